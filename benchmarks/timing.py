"""Timing a call many times in-process, and the median and p99 of what it took: shared by the store benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def timed(call: Callable[[], Any], times: int) -> list[float]:
    """Seconds each of `times` calls took."""
    spent = []
    for _ in range(times):
        started = time.perf_counter()
        call()
        spent.append(time.perf_counter() - started)
    return spent


def ms_summary(values: list[float]) -> dict[str, float]:
    """Median and p99 of seconds, in milliseconds."""
    ordered = sorted(values)
    return {"median": round(statistics.median(ordered) * 1000, 3),
            "p99": round(ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))] * 1000, 3)}
