"""The timing loop shared by every runtime: warmup, first inference, timed iterations.

The loop itself is the board harness's (Python 3.6, no farm on the board): one loop times the
sim and the boards, so their figures differ by the hardware and nothing else."""

from __future__ import annotations

from typing import Any, Callable

from farm.agents.board_harness.board_harness import time_inferences as board_time_inferences
from farm.agents.harness.task import HarnessOutput


def time_inferences(invoke: Callable[[], object], out: HarnessOutput, *, warmup: int, iterations: int) -> None:
    """Fills first_ms, warmup_ms, iterations_ms and measure_wall_s of `out`."""
    figures: dict[str, Any] = {"warmup_ms": out.warmup_ms}
    board_time_inferences(invoke, figures, warmup, iterations)
    out.first_ms = figures["first_ms"]
    out.iterations_ms = figures["iterations_ms"]
    out.measure_wall_s = figures["measure_wall_s"]
