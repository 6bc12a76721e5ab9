"""The board harness's result line (`@@farm-harness <json>`), read on the agent's side.

What a board prints is hostile until checked: the line is found among whatever else reached
stdout, its JSON bounded in size, every field checked for type, finite numbers and sizes, so a
broken or lying board becomes a clear error and never a model result.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from farm.agents.harness.task import HarnessOutput
from farm.agents.board_harness.board_harness import PROTOCOL, RESULT_MARK

MAX_RESULT_CHARS = 32 << 20
MAX_MESSAGE_CHARS = 8000
MAX_ITERATIONS = 200_000
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


@dataclass
class BoardEnvOutput:
    ok: bool
    failure_class: str | None = None
    message: str = ""
    python: str | None = None
    reused: bool = False


def _number(data: dict[str, Any], key: str, *, integer: bool = False) -> float | int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise HarnessOutputError(f"the board's result has {key} = {value!r}; expected a finite number >= 0")
    return int(value) if integer else float(value)


def _count(data: dict[str, Any], key: str) -> int | None:
    """A whole number >= 0, or None when absent."""
    value = _number(data, key, integer=True)
    return None if value is None else int(value)


def _numbers(data: dict[str, Any], key: str, limit: int) -> list[float]:
    values = data.get(key) or []
    if not isinstance(values, list) or len(values) > limit:
        raise HarnessOutputError(f"the board's result has a {key} that is not a list of at most {limit} numbers")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise HarnessOutputError(f"the board's result has {v!r} in {key}; expected finite numbers >= 0")
    return [float(v) for v in values]


def _text(data: dict[str, Any], key: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    value = data.get(key) or ""
    if not isinstance(value, str):
        raise HarnessOutputError(f"the board's result has a {key} that is not text")
    return value[-limit:]


def _result_json(text: str) -> dict[str, Any]:
    """The last result line's JSON object."""
    at = text.rfind("\n" + RESULT_MARK)
    if at < 0 and not text.startswith(RESULT_MARK):
        raise HarnessOutputError("the board harness printed no result line")
    line = text[at + 1 if at >= 0 else 0:].split("\n", 1)[0][len(RESULT_MARK):]
    if len(line) > MAX_RESULT_CHARS:
        raise HarnessOutputError(f"the board's result line is over {MAX_RESULT_CHARS >> 20} MiB")
    try:
        data = json.loads(line, parse_constant=lambda c: float("nan"))
    except ValueError as e:
        raise HarnessOutputError(f"the board's result line is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise HarnessOutputError("the board's result line is not a JSON object")
    if data.get("protocol") != PROTOCOL:
        raise HarnessOutputError(f"the board harness speaks protocol {data.get('protocol')!r}, this agent {PROTOCOL}")
    return data


def _status(data: dict[str, Any]) -> tuple[bool, str | None]:
    ok = data.get("ok")
    if not isinstance(ok, bool):
        raise HarnessOutputError("the board's result has no ok: true/false")
    failure = data.get("failure_class")
    if not ok and failure not in FAILURE_CLASSES:
        raise HarnessOutputError(f"the board's result failed with an unknown failure class {failure!r}")
    return ok, None if ok else failure


def parse_harness_output(text: str) -> BoardHarnessOutput:
    """`board_harness.py run`'s stdout → its checked result."""
    data = _result_json(text)
    ok, failure = _status(data)
    shapes = data.get("input_shapes") or {}
    if not isinstance(shapes, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in v)
            for k, v in shapes.items()):
        raise HarnessOutputError("the board's result has input_shapes that are not lists of integers by name")
    versions = data.get("tool_versions") or {}
    if not isinstance(versions, dict):
        raise HarnessOutputError("the board's result has tool_versions that are not a mapping")
    leftovers = data.get("leftovers") or []
    return BoardHarnessOutput(
        ok=ok, failure_class=failure, message=_text(data, "message"), runtime=_text(data, "runtime", 40),
        init_ms=_number(data, "init_ms"), first_ms=_number(data, "first_ms"),
        warmup_ms=_numbers(data, "warmup_ms", MAX_ITERATIONS), iterations_ms=_numbers(data, "iterations_ms", MAX_ITERATIONS),
        whole_run_s=_number(data, "whole_run_s"), measure_wall_s=_number(data, "measure_wall_s"),
        baseline_rss_bytes=_count(data, "baseline_rss_bytes"),
        peak_rss_bytes=_count(data, "peak_rss_bytes"),
        input_shapes={k[:200]: v for k, v in list(shapes.items())[:64]},
        tool_versions={str(k)[:60]: str(v)[:120] for k, v in list(versions.items())[:20]},
        process_memory_avg_bytes=_number(data, "process_memory_avg_bytes"),
        process_memory_peak_bytes=_count(data, "process_memory_peak_bytes"),
        process_memory_samples=_count(data, "process_memory_samples") or 0,
        output_bytes=_count(data, "output_bytes") or 0,
        output_tail=_text(data, "output_tail"),
        timings_dropped=_count(data, "timings_dropped") or 0,
        leftovers=[str(x)[:200] for x in leftovers[:20]] if isinstance(leftovers, list) else [],
    )


def parse_env_output(text: str) -> BoardEnvOutput:
    """`board_harness.py env`'s stdout → where the requirements' venv python is, or why there is none."""
    data = _result_json(text)
    ok, failure = _status(data)
    python = data.get("python")
    if ok and (not isinstance(python, str) or not python.startswith("/")):
        raise HarnessOutputError("the board's venv result names no interpreter path")
    return BoardEnvOutput(ok=ok, failure_class=failure, message=_text(data, "message"),
                          python=python if ok else None, reused=bool(data.get("reused")))
