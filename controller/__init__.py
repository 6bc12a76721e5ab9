"""farm.controller: scheduling at the bottom, analysis on it, operations on both, the front door on top.

Scheduling never imports a role above it; what it must tell them goes through the hooks registered
here (controller/scheduling/hooks.py). Each hook imports its module on first call, so importing any
controller module stays cheap."""

from __future__ import annotations

from pathlib import Path

from farm.controller.scheduling import hooks


def _alert_quarantine(device: str, reason: str) -> None:
    from farm.controller.operations.alerts import alert_quarantine
    alert_quarantine(device, reason)


def _example_model_hint(path: Path) -> str | None:
    from farm.model_generators.generate import generate_hint  # the generators know their own file names
    return generate_hint(path)


def standard_hooks() -> hooks.Hooks:
    """A fresh Hooks with the alert and the example-model hint, for one composed controller (client/compose.py)."""
    own = hooks.Hooks()
    own.on_quarantine(_alert_quarantine)
    own.on_missing_model(_example_model_hint)
    return own


# the process default, for a Controller built without hooks of its own
hooks.on_quarantine(_alert_quarantine)
hooks.on_missing_model(_example_model_hint)
