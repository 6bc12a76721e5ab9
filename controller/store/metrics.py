"""The metrics a store can read from a stored run, by name; each database maps a name to its own columns.

Callers name a metric ("latency", "peak_memory", ...); which columns hold it, and how a value is
computed from them, is the store implementation's business (controller/store/sqlite.py for SQLite).
"""

from __future__ import annotations

MiB = 1 << 20

# metric name -> unit of the value the store returns
METRIC_UNITS: dict[str, str] = {
    "latency": "ms",  # the run's average iteration
    "whole_run": "s",  # the whole run (wall time when the agent did not measure it apart)
    "peak_memory": "MB",
    "avg_memory": "MB",
    # Only boards with power rails (Jetsons) measure it; the sim has no rails.
    "energy": "mJ",
}


class UnknownMetric(ValueError):
    def __init__(self, metric: str) -> None:
        super().__init__(f"unknown metric {metric[:40]!r}; choose one of {', '.join(METRIC_UNITS)}")
        self.metric = metric
