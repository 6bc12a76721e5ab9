"""The dispatcher: one thread matching agents' idle slots to pending tasks, many slots per transaction.

An idle agent slot sends a WorkRequest (kept in its session's `requests`); the dispatcher wakes,
leases for up to DISPATCH_BATCH slots in one transaction (Controller.lease_batch) and sends each
offer down its agent's stream. Targets found empty are remembered until the queue may have
changed, so idle slots cost no query per round.
"""

from __future__ import annotations

import logging
import threading
import time

from farm.controller.scheduling.controller import Controller
from farm.controller.scheduling.sessions import AgentSession, Sessions
from farm.proto.generated import agent_pb2
from farm.proto.wire import task_to_message

log = logging.getLogger("farm.controller")

DISPATCH_BATCH = 16  # slots leased per transaction: fewer commits, yet offers still leave in small bursts
DISPATCH_IDLE_S = 0.5  # how often the dispatcher looks again when nothing woke it (expired leases)


class StepTimings(dict[str, list[float]]):
    """Seconds spent and calls made per step (lease, complete, heartbeat, expire), so a benchmark can say
    where the time goes. "complete" counts results; its seconds are the writer's transactions."""

    def __init__(self) -> None:
        super().__init__({"lease": [0.0, 0], "complete": [0.0, 0], "heartbeat": [0.0, 0], "expire": [0.0, 0]})

    def add(self, step: str, started: float, count: int = 1) -> None:
        entry = self[step]
        entry[0] += time.perf_counter() - started
        entry[1] += count


class Dispatcher:
    def __init__(self, controller: Controller, sessions: Sessions, timings: StepTimings) -> None:
        self.controller = controller
        self.sessions = sessions
        self.timings = timings
        self._wake = threading.Event()
        # Targets known to have no pending task, so idle slots are not asked about again and again;
        # forgotten whenever tasks may have become pending (submit, retry, expiry, release, idle round).
        self._empty_targets: set[str] = set()
        self._queue_changed = True
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dispatcher", daemon=True)
        self.count = 0  # offers made

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    def wake(self, queue_changed: bool = False) -> None:
        if queue_changed:
            self._queue_changed = True
        self._wake.set()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            if not self._wake.wait(DISPATCH_IDLE_S):
                self._queue_changed = True  # an idle round looks at everything again
            self._wake.clear()
            try:
                self.dispatch_once()
                self.sessions.keep_alive(self.controller.lease_ttl_s)  # its own writes, a quarter TTL apart
            except Exception as e:  # a bad round must not stop dispatching for good
                if not self.controller.outage.failed(e, "dispatching work"):
                    log.exception("dispatch round failed")
            else:
                self.controller.outage.answered()

    def dispatch_once(self) -> int:
        """Offer pending tasks to the waiting slots; returns how many were offered."""
        started = time.perf_counter()
        if self.controller.expire_leases():
            self._queue_changed = True
        self.timings.add("expire", started)
        if self._queue_changed:
            self._queue_changed = False
            self._empty_targets.clear()
        with self.sessions.lock:
            waiting = [(s, rid, targets) for s in self.sessions.by_name.values() if s.state == "online"
                       for rid, targets in list(s.requests.items())]
        waiting = [w for w in waiting if not w[2] <= self._empty_targets and not w[0].closed.is_set()]
        if not waiting:
            return 0
        offered = 0
        for first in range(0, len(waiting), DISPATCH_BATCH):
            offered += self._dispatch_batch(waiting[first:first + DISPATCH_BATCH])
        return offered

    def _dispatch_batch(self, waiting: list[tuple[AgentSession, int, frozenset[str]]]) -> int:
        waiting = [w for w in waiting if not w[2] <= self._empty_targets]  # an earlier batch may have found none
        if not waiting:
            return 0
        started = time.perf_counter()
        # One transaction for several slots; a slot it could not serve asks on its own.
        leased, exhausted = self.controller.lease_batch([(session.name, targets) for session, _, targets in waiting])
        self.timings.add("lease", started)
        offered = 0
        for (session, request_id, targets), task in zip(waiting, leased):
            if task is None and not exhausted:
                started = time.perf_counter()
                task = self.controller.lease(session.name, set(targets))
                self.timings.add("lease", started)
            if task is None:
                self._empty_targets |= targets
                continue
            if session.closed.is_set():  # the stream broke meanwhile: the task goes straight back
                self.release(task.task_id, "released: agent {agent} went away as it was offered")
                continue
            now = time.time()
            with self.sessions.lock:
                session.requests.pop(request_id, None)
                session.running.add((task.task_id, task.attempt))
            offer = agent_pb2.TaskOffer(request_id=request_id, lease_expires_at=now + self.controller.lease_ttl_s,
                                        offered_at=now)
            task_to_message(task, offer.task)
            session.send(agent_pb2.ControllerMessage(offer=offer))
            offered += 1
            self.count += 1
        return offered

    def release(self, task_id: int, reason: str) -> None:
        """A running task goes back to the queue (its attempt stored as lost, `reason` naming {agent})."""
        self.controller.lose_attempts(self.controller.store.leases.running_attempts(task_ids=[task_id]), reason)
        self._queue_changed = True


__all__ = ["DISPATCH_BATCH", "DISPATCH_IDLE_S", "Dispatcher", "StepTimings"]
