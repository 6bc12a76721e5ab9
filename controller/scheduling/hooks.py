"""What scheduling calls out to without importing the roles above it: a role registers a hook here
(the controller package does it at import, controller/__init__.py), scheduling calls every one.

- on_quarantine(device, reason): a device was just quarantined (operations sends its alert);
- missing_model_hint(path): for a model file that does not exist, how to write it, or None (the
  example-model generators know their own file names)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

QuarantineHook = Callable[[str, str], None]
MissingModelHint = Callable[[Path], "str | None"]

QUARANTINE_HOOKS: list[QuarantineHook] = []
MISSING_MODEL_HINTS: list[MissingModelHint] = []


def on_quarantine(hook: QuarantineHook) -> None:
    if hook not in QUARANTINE_HOOKS:
        QUARANTINE_HOOKS.append(hook)


def on_missing_model(hint: MissingModelHint) -> None:
    if hint not in MISSING_MODEL_HINTS:
        MISSING_MODEL_HINTS.append(hint)


def quarantined(device: str, reason: str) -> None:
    for hook in QUARANTINE_HOOKS:
        hook(device, reason)


def missing_model_hint(path: Path) -> str | None:
    """The first hint a registered hook has for this missing model file."""
    for hint in MISSING_MODEL_HINTS:
        found = hint(path)
        if found:
            return found
    return None
