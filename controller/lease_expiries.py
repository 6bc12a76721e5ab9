"""How many leases ran out since the controller started: counted where it happens (Controller.expire_leases),
read by the metrics endpoint. Kept apart so scheduling never imports the operations code that reads it."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_total = 0


def record_lease_expiries(count: int) -> None:
    """Called by Controller.expire_leases with how many leases it just returned to the queue."""
    global _total
    if count <= 0:
        return
    with _lock:
        _total += count


def lease_expiries_total() -> int:
    with _lock:
        return _total
