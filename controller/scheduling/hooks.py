"""What scheduling calls out to without importing the roles above it: a role registers a hook here,
scheduling calls every one.

- on_quarantine(device, reason): a device was just quarantined (operations sends its alert);
- missing_model_hint(path): for a model file that does not exist, how to write it, or None (the
  example-model generators know their own file names).

Each Controller holds a Hooks of its own (Controller(hooks=...)): a composed controller (client/compose.py)
gets a fresh one from farm.controller.standard_hooks(), so two controllers in one process never call each
other's hooks. A Controller built without one shares the process default, which controller/__init__.py fills
at import. The missing-model hint is read by the job-file parser, which holds no Controller: it asks the
default (a pure function of the path, so sharing it is harmless)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

QuarantineHook = Callable[[str, str], None]
MissingModelHint = Callable[[Path], "str | None"]


@dataclass
class Hooks:
    quarantine: list[QuarantineHook] = field(default_factory=list)
    missing_model: list[MissingModelHint] = field(default_factory=list)

    def on_quarantine(self, hook: QuarantineHook) -> None:
        if hook not in self.quarantine:
            self.quarantine.append(hook)

    def on_missing_model(self, hint: MissingModelHint) -> None:
        if hint not in self.missing_model:
            self.missing_model.append(hint)

    def quarantined(self, device: str, reason: str) -> None:
        for hook in self.quarantine:
            hook(device, reason)

    def missing_model_hint(self, path: Path) -> str | None:
        """The first hint a registered hook has for this missing model file."""
        for hint in self.missing_model:
            found = hint(path)
            if found:
                return found
        return None


_DEFAULT = Hooks()


def default_hooks() -> Hooks:
    """The process default: what controller/__init__.py registered at import."""
    return _DEFAULT


def on_quarantine(hook: QuarantineHook) -> None:
    _DEFAULT.on_quarantine(hook)


def on_missing_model(hint: MissingModelHint) -> None:
    _DEFAULT.on_missing_model(hint)


def quarantined(device: str, reason: str) -> None:
    _DEFAULT.quarantined(device, reason)


def missing_model_hint(path: Path) -> str | None:
    return _DEFAULT.missing_model_hint(path)
