"""Summary statistics of per-iteration latencies (pure, numpy only)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from farm.proto.results import LatencyStats


def latency_stats(iterations_ms: Any, *, init_ms: float | None = None,
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


def throughput_per_s(latency: LatencyStats | None, measure_wall_s: float | None = None) -> float | None:
    """Inferences (batches) per second: timed iterations over the loop's own wall time where it was measured
    (the loop's overhead counts, as it would for a caller), else 1000 / the average latency (a tool's summary)."""
    if latency is None:
        return None
    if measure_wall_s and measure_wall_s > 0 and latency.count:
        return latency.count / measure_wall_s
    return 1000.0 / latency.avg if latency.avg and latency.avg > 0 else None


def startup_ms(latency: LatencyStats | None) -> float | None:
    """What a cold start costs before the first result: loading the model (init) plus the first inference."""
    if latency is None or latency.init is None or latency.first is None:
        return None
    return latency.init + latency.first


_MAY_BE_NULL = ("init", "first", "warmup_avg")


def summary_of_more(fields: object, kept: int) -> LatencyStats:
    """The summary a harness computed over more timings than it kept (a script's flood past MAX_SAMPLES), read as
    hostile: LatencyStats's fields and no other, each a finite number >= 0 (init, first and warmup_avg may be null),
    count an integer above the `kept` timings. Raises ValueError naming the field."""
    names = [f.name for f in dataclasses.fields(LatencyStats)]
    if not isinstance(fields, dict) or sorted(fields) != sorted(names):
        raise ValueError(f"the harness's latency summary is not an object of exactly {', '.join(names)}")
    for name in names:
        value = fields[name]
        if value is None and name in _MAY_BE_NULL:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"the harness's latency summary: {name} is {value!r}, not a finite number >= 0")
    if not isinstance(fields["count"], int) or fields["count"] <= kept:
        raise ValueError(f"the harness's latency summary: count is {fields['count']!r}, not more than the {kept} "
                         "timings it kept")
    return LatencyStats(**fields)
