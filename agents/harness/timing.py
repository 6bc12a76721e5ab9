"""The timing loop shared by every runtime: warmup, first inference, timed iterations.

The loop itself is the board harness's (Python 3.6, no farm on the board): one loop times the
sim and the boards, so their figures differ by the hardware and nothing else."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from farm.agents.board_harness.board_harness import time_inferences as board_time_inferences
from farm.agents.harness.task import HarnessOutput


def time_inferences(invoke: Callable[[], object], out: HarnessOutput, *, warmup: int, iterations: int) -> None:
    """Fills first_ms, warmup_ms, iterations_ms, measure_wall_s, loop_cpu_s and loop_wait_s of `out`."""
    figures: dict[str, Any] = {"warmup_ms": out.warmup_ms}
    board_time_inferences(invoke, figures, warmup, iterations, loop_probe=loop_probe)
    out.first_ms = figures["first_ms"]
    out.iterations_ms = figures["iterations_ms"]
    out.measure_wall_s = figures["measure_wall_s"]
    (cpu0, wait0), (cpu1, wait1) = figures["loop_probe"]
    out.loop_cpu_s = cpu1 - cpu0
    out.loop_wait_s = None if wait0 is None or wait1 is None else max(0, wait1 - wait0) / 1e9


def loop_probe() -> tuple[float, int | None]:
    """(this process's CPU time in s, its threads' run-queue wait in ns): what the timed loop got, and how
    long its threads were runnable with no CPU (/proc/<pid>/task/<tid>/schedstat; None where not exposed)."""
    cpu = time.process_time()
    wait = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                fields = f.read().split()
            wait += int(fields[1])
    except (OSError, IndexError, ValueError):
        return cpu, None
    return cpu, wait
