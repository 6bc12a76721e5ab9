"""Strict JSON for everything farm prints or sends: no NaN, no Infinity.

Python's json writes `Infinity` and `NaN`, which no other JSON parser accepts. The rule,
in this one place: a non-finite number becomes null, and the record that held it (the
nearest object that is an element of a list, or the document itself) gets a `nonfinite`
list naming the fields, e.g. {"latency_ms": {"avg": null}, "nonfinite": ["latency_ms.avg"]}.
"""

from __future__ import annotations

import json
import math
from typing import Any

FLAG = "nonfinite"


def _clean(value: Any, path: str, found: list[str]) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        found.append(path)
        return None
    if isinstance(value, dict):
        return {k: _clean(v, f"{path}.{k}", found) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_record(v) if isinstance(v, dict) else _clean(v, f"{path}[{i}]", found) for i, v in enumerate(value)]
    return value


def _record(data: dict[str, Any]) -> dict[str, Any]:
    """One record: its non-finite fields become null and are named in its flag (merged with an earlier one)."""
    found: list[str] = []
    out = {k: _clean(v, str(k), found) for k, v in data.items()}
    if found:
        out[FLAG] = [*(out.get(FLAG) or []), *found]
    return out


def clean(data: Any) -> Any:
    """`data` with every non-finite float replaced by null and flagged in its record."""
    if isinstance(data, dict):
        return _record(data)
    return _clean(data, "", [])  # a bare list or number has no record to flag


_SCALARS = (str, int, float, bool, type(None))


def _plain(value: Any) -> bool:
    """Only JSON's own types (exactly: no enum, no model, no datetime), which pydantic_core would hand back as
    they are: then it need not load (`farm jobs --json` prints plain dicts)."""
    kind = type(value)
    if kind in _SCALARS:
        return True
    if kind is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    return kind is list and all(_plain(v) for v in value)


def dumps(data: Any, **kwargs: Any) -> str:
    """json.dumps of clean(data); allow_nan=False makes any value that slipped through raise, not print.
    Answer models (farm.proto.questions) print as their JSON form, non-finite numbers flagged the same way."""
    kwargs.setdefault("default", str)
    if not _plain(data):
        from pydantic_core import to_jsonable_python  # here, not at import: `farm --version` loads no pydantic

        data = to_jsonable_python(data, fallback=kwargs["default"])
    return json.dumps(clean(data), allow_nan=False, **kwargs)
