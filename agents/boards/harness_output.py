"""The board harness's result line (`@@farm-harness <json>`), read on the agent's side.

What a board prints is hostile until checked: the line is found among whatever else reached
stdout and must be the only one (a second is forged), its JSON bounded in size and nesting with
no key twice, every field checked for type, finite numbers in range and sizes, and its text
escaped, so a broken or lying board becomes a clear error and never a model result.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from farm.agents.harness.task import HarnessOutput
from farm.agents.board_harness.board_harness import PROTOCOL, RESULT_MARK
from farm.proto.escape import printable

MAX_RESULT_CHARS = 32 << 20
MAX_MESSAGE_CHARS = 8000
MAX_ITERATIONS = 200_000
MAX_DEPTH = 32  # the result is two levels deep; json's recursive parser must never see 100,000
MAX_MS = 7 * 24 * 3600 * 1000.0  # a week: no one iteration, warmup or load takes longer
MAX_SECONDS = 7 * 24 * 3600.0
MAX_BYTES = 1 << 50  # a pebibyte: far above any board's memory
MAX_COUNT = 1 << 40
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')  # JSON strings, so brackets inside them are not counted
_BRACKETS = re.compile(r"[\[\]{}]")
FAILURE_CLASSES = ("infrastructure", "job", "resource", "timeout", "canceled", "bug")


class HarnessOutputError(ValueError):
    """No usable result line: the harness died, or the board printed something else."""


@dataclass
class BoardHarnessOutput(HarnessOutput):
    """The sim harness's output fields, plus what a board run reports of a script."""

    process_memory_avg_bytes: float | None = None  # the script's process group, summed, sampled
    process_memory_peak_bytes: int | None = None
    process_memory_samples: int = 0
    output_bytes: int = 0
    output_tail: str = ""
    timings_dropped: int = 0
    leftovers: list[str] = field(default_factory=list)
    accelerator: dict[str, Any] | None = None  # the unit, precision and ONNX Runtime's providers of the session


@dataclass
class BoardEnvOutput:
    ok: bool
    failure_class: str | None = None
    message: str = ""
    python: str | None = None
    reused: bool = False


def _in_range(value: Any, maximum: float) -> bool:
    """A JSON number (not a bool) that is finite and within [0, maximum]; a huge int is compared, not converted."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return 0 <= value <= maximum


def _number(data: dict[str, Any], key: str, maximum: float, *, integer: bool = False) -> float | int | None:
    value = data.get(key)
    if value is None:
        return None
    if not _in_range(value, maximum):
        raise HarnessOutputError(f"the board's result has {key} = {printable(repr(value), 60)}; expected a finite "
                                 f"number from 0 to {maximum:g}")
    return int(value) if integer else float(value)


def _count(data: dict[str, Any], key: str, maximum: float = MAX_COUNT) -> int | None:
    """A whole number >= 0, or None when absent."""
    value = _number(data, key, maximum, integer=True)
    return None if value is None else int(value)


def _numbers(data: dict[str, Any], key: str, limit: int) -> list[float]:
    values = data.get(key) or []
    if not isinstance(values, list) or len(values) > limit:
        raise HarnessOutputError(f"the board's result has a {key} that is not a list of at most {limit} numbers")
    for v in values:
        if not _in_range(v, MAX_MS):
            raise HarnessOutputError(f"the board's result has {printable(repr(v), 60)} in {key}; expected finite "
                                     f"numbers from 0 to {MAX_MS:g} ms")
    return [float(v) for v in values]


def _text(data: dict[str, Any], key: str, limit: int = MAX_MESSAGE_CHARS, *, multiline: bool = True) -> str:
    """The field's last `limit` characters with every control character escaped (proto/escape.py)."""
    value = data.get(key) or ""
    if not isinstance(value, str):
        raise HarnessOutputError(f"the board's result has a {key} that is not text")
    return printable(value[-limit:], None, multiline=multiline)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise HarnessOutputError(f"the board's result names {printable(key, 60)} twice; a result has each key once")
        data[key] = value
    return data


def _depth(line: str) -> int:
    """How deep the JSON's arrays and objects nest, counted without parsing (and so without recursion)."""
    depth = deepest = 0
    for bracket in _BRACKETS.finditer(_STRINGS.sub("", line)):
        depth += 1 if bracket.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _result_json(text: str) -> dict[str, Any]:
    """The one result line's JSON object."""
    starts = [0] if text.startswith(RESULT_MARK) else []
    starts += [m.start() + 1 for m in re.finditer("\n" + re.escape(RESULT_MARK), text)]
    if not starts:
        raise HarnessOutputError("the board harness printed no result line")
    if len(starts) > 1:
        raise HarnessOutputError(f"the board printed {len(starts)} result lines ({RESULT_MARK.strip()}); the harness "
                                 "prints exactly one, so the others are forged (by the script or a process it left)")
    line = text[starts[0]:].split("\n", 1)[0][len(RESULT_MARK):]
    if len(line) > MAX_RESULT_CHARS:
        raise HarnessOutputError(f"the board's result line is over {MAX_RESULT_CHARS >> 20} MiB")
    if _depth(line) > MAX_DEPTH:
        raise HarnessOutputError(f"the board's result line nests deeper than {MAX_DEPTH} levels")
    try:
        data = json.loads(line, parse_constant=lambda c: float("nan"), object_pairs_hook=_no_duplicate_keys)
    except (ValueError, RecursionError) as e:  # RecursionError: unreachable after the depth check, kept as a guard
        raise HarnessOutputError(f"the board's result line is not JSON: {printable(e, 200)}") from None
    if not isinstance(data, dict):
        raise HarnessOutputError("the board's result line is not a JSON object")
    if data.get("protocol") != PROTOCOL:
        raise HarnessOutputError(f"the board harness speaks protocol {printable(repr(data.get('protocol')), 40)}, "
                                 f"this agent {PROTOCOL}")
    return data


def _status(data: dict[str, Any]) -> tuple[bool, str | None]:
    ok = data.get("ok")
    if not isinstance(ok, bool):
        raise HarnessOutputError("the board's result has no ok: true/false")
    failure = data.get("failure_class")
    if not ok and failure not in FAILURE_CLASSES:
        raise HarnessOutputError(f"the board's result failed with an unknown failure class {printable(repr(failure), 60)}")
    return ok, None if ok else failure


def parse_harness_output(text: str) -> BoardHarnessOutput:
    """`board_harness.py run`'s stdout → its checked result."""
    data = _result_json(text)
    ok, failure = _status(data)
    shapes = data.get("input_shapes") or {}
    if not isinstance(shapes, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and len(v) <= MAX_DEPTH
            and all(isinstance(d, int) and not isinstance(d, bool) and abs(d) <= MAX_COUNT for d in v)
            for k, v in shapes.items()):
        raise HarnessOutputError("the board's result has input_shapes that are not lists of integers by name")
    versions = data.get("tool_versions") or {}
    if not isinstance(versions, dict):
        raise HarnessOutputError("the board's result has tool_versions that are not a mapping")
    leftovers = data.get("leftovers") or []
    return BoardHarnessOutput(
        ok=ok, failure_class=failure, message=_text(data, "message"), runtime=_text(data, "runtime", 40, multiline=False),
        init_ms=_number(data, "init_ms", MAX_MS), first_ms=_number(data, "first_ms", MAX_MS),
        warmup_ms=_numbers(data, "warmup_ms", MAX_ITERATIONS), iterations_ms=_numbers(data, "iterations_ms", MAX_ITERATIONS),
        whole_run_s=_number(data, "whole_run_s", MAX_SECONDS), measure_wall_s=_number(data, "measure_wall_s", MAX_SECONDS),
        baseline_rss_bytes=_count(data, "baseline_rss_bytes", MAX_BYTES),
        peak_rss_bytes=_count(data, "peak_rss_bytes", MAX_BYTES),
        input_shapes={printable(k, 200): v for k, v in list(shapes.items())[:64]},
        tool_versions={printable(k, 60): printable(v, 120) for k, v in list(versions.items())[:20]},
        process_memory_avg_bytes=_number(data, "process_memory_avg_bytes", MAX_BYTES),
        process_memory_peak_bytes=_count(data, "process_memory_peak_bytes", MAX_BYTES),
        process_memory_samples=_count(data, "process_memory_samples") or 0,
        output_bytes=_count(data, "output_bytes", MAX_BYTES) or 0,
        output_tail=_text(data, "output_tail"),
        timings_dropped=_count(data, "timings_dropped") or 0,
        leftovers=[printable(x, 200) for x in leftovers[:20]] if isinstance(leftovers, list) else [],
        accelerator=_accelerator(data.get("accelerator")),
        accuracy=data["accuracy"] if isinstance(data.get("accuracy"), dict) else None,  # bounded by the driver
    )


def _accelerator(value: Any) -> dict[str, Any] | None:
    """The unit the board's session ran on, as the harness saw it: short strings only."""
    if not isinstance(value, dict):
        return None
    providers = value.get("providers")
    return {"unit": printable(str(value.get("unit", "")), 20), "precision": printable(str(value.get("precision", "")), 8),
            "providers": [printable(str(p), 60) for p in providers[:8]] if isinstance(providers, list) else []}


def parse_env_output(text: str) -> BoardEnvOutput:
    """`board_harness.py env`'s stdout → where the requirements' venv python is, or why there is none."""
    data = _result_json(text)
    ok, failure = _status(data)
    python = data.get("python")
    if ok and (not isinstance(python, str) or not python.startswith("/") or printable(python, None) != python):
        raise HarnessOutputError("the board's venv result names no interpreter path")
    return BoardEnvOutput(ok=ok, failure_class=failure, message=_text(data, "message"),
                          python=python if ok else None, reused=bool(data.get("reused")))
