"""The timing loop shared by every runtime: warmup, first inference, timed iterations."""

from __future__ import annotations

import time
from typing import Callable

from farm.agents.harness.task import HarnessOutput


def time_inferences(invoke: Callable[[], object], out: HarnessOutput, *, warmup: int, iterations: int) -> None:
    """Fills first_ms, warmup_ms, iterations_ms and measure_wall_s of `out`."""
    clock = time.perf_counter_ns
    t0 = clock()
    invoke()
    out.first_ms = (clock() - t0) / 1e6
    # The first inference counts as the first warmup run, as benchmark_model does.
    for _ in range(max(0, warmup - 1)):
        t0 = clock()
        invoke()
        out.warmup_ms.append((clock() - t0) / 1e6)
    samples = []
    start = clock()
    for _ in range(iterations):
        t0 = clock()
        invoke()
        samples.append(clock() - t0)
    out.measure_wall_s = (clock() - start) / 1e9
    out.iterations_ms = [s / 1e6 for s in samples]
