"""Copying a pydantic model with some fields changed, refusing names the model does not have.

pydantic's `model_copy(update=...)` keeps a misspelled or removed field silently: a board type's longer run
timeout once went to a `run_timeout_s` that `TaskSpec` no longer had, and the run got the sim's timeout.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


def replaced(model: M, **changes: Any) -> M:
    """A copy of `model` with `changes`; a TypeError names any field the model does not have."""
    unknown = sorted(set(changes) - set(type(model).model_fields))
    if unknown:
        raise TypeError(f"{type(model).__name__} has no field {', '.join(unknown)}")
    return model.model_copy(update=changes)
