"""Agents' heartbeats: the leases they name renewed many per transaction by one thread.

Agents that connected together beat together: renewing each lease in a transaction of its own, on the
threads that apply agents' messages, put a thousand commits ahead of the results and work requests
behind them every heartbeat period. A heartbeat is only queued; the renewer takes what has queued
meanwhile, renews it in one transaction and tells each agent which of its attempts to stop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from farm.controller.scheduling.batches import BatchThread
from farm.controller.scheduling.controller import Controller

log = logging.getLogger("farm.controller")

RENEWAL_BATCH = 1024  # heartbeats per transaction at most; each is a row or two to update


@dataclass
class QueuedHeartbeat:
    """The attempts one heartbeat names that its session holds, and where the ones to stop go."""

    agent: str
    attempts: list[tuple[int, int]]
    stop: Callable[[list[tuple[int, int]]], None]  # the attempts whose lease is gone (canceled, or ran out)


class LeaseRenewer(BatchThread[QueuedHeartbeat]):
    def __init__(self, controller: Controller, *, max_batch: int = RENEWAL_BATCH,
                 timed: Callable[[str, float, int], None] = lambda step, started, count: None) -> None:
        super().__init__("lease-renewer", max_batch)
        self.controller = controller
        self._timed = timed

    def write(self, batch: list[QueuedHeartbeat]) -> None:
        renewals = [(task_id, attempt, beat.agent) for beat in batch for task_id, attempt in beat.attempts]
        started = time.perf_counter()
        try:
            alive = self.controller.heartbeat_batch(renewals)
        except Exception as e:  # a store error: the leases are not lost yet, and the agents beat again within a period
            if not self.controller.outage.failed(e, f"renewing {len(renewals)} lease(s)"):
                log.exception("renewing %d lease(s) failed; the agents' next heartbeats try again", len(renewals))
            return
        self.controller.outage.answered()
        self._timed("heartbeat", started, len(renewals))
        answers = iter(alive)
        for beat in batch:
            gone = [ref for ref in beat.attempts if not next(answers)]
            if gone:
                beat.stop(gone)


__all__ = ["LeaseRenewer", "QueuedHeartbeat", "RENEWAL_BATCH"]
