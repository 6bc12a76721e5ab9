"""Summary statistics of per-iteration latencies (pure, numpy only)."""

from __future__ import annotations

import numpy as np

from farm.proto.results import LatencyStats


def latency_stats(iterations_ms: list[float], *, init_ms: float | None = None,
                  first_ms: float | None = None, warmup_ms: list[float] | None = None) -> LatencyStats:
    a = np.asarray(iterations_ms, dtype=float)
    if a.size == 0:
        raise ValueError("no iterations to summarise")
    # Linear interpolation between order statistics, numpy's default and benchmark_model's habit.
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return LatencyStats(
        init=init_ms,
        first=first_ms,
        warmup_avg=float(np.mean(warmup_ms)) if warmup_ms else None,
        avg=float(a.mean()),
        p50=float(p50),
        p90=float(p90),
        p99=float(p99),
        std=float(a.std(ddof=1)) if a.size > 1 else 0.0,
        min=float(a.min()),
        max=float(a.max()),
        count=int(a.size),
    )
