"""Counters the scheduler keeps in memory for the metrics endpoint (everything else is read from the store).

They live here, below both, so the scheduler (controller.py) reports to the metrics without
importing them: operations read scheduling, never the other way round.
"""

from __future__ import annotations

import threading

_lease_expiries_lock = threading.Lock()
_lease_expiries_total = 0


def record_lease_expiries(count: int) -> None:
    """Called by Controller.expire_leases with how many leases it just returned to the queue."""
    global _lease_expiries_total
    if count <= 0:
        return
    with _lease_expiries_lock:
        _lease_expiries_total += count


def lease_expiries_total() -> int:
    with _lease_expiries_lock:
        return _lease_expiries_total


__all__ = ["lease_expiries_total", "record_lease_expiries"]
