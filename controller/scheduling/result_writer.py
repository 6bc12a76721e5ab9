"""Agents' results, applied many per transaction by one writer thread; each acknowledged after its commit.

An agent's stream reader only queues a result, so a hundred agents do not take turns on the store's
lock one result (one commit) at a time: the writer drains whatever has queued meanwhile (up to
`max_batch`) and applies it in one transaction. The acknowledgement leaves only once that
transaction is committed, so an agent keeps (and after a reconnect resends) every result the
store does not have yet: a controller killed with results in the queue loses none, and a resent
one is applied once (the store's (task, attempt) key).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from farm.controller.scheduling.batches import BatchThread
from farm.controller.scheduling.controller import Applied, Controller, Delivery
from farm.proto.escape import printable
from farm.proto.generated import agent_pb2
from farm.proto.results import FailureClass, ResultRefused, RunResult, TaskStatus
from farm.proto.wire import MAX_RESULT_BYTES, result_from_message

log = logging.getLogger("farm.controller")

RESULT_BATCH = 64  # results per transaction at most: a batch of full-size results stays a few seconds' write


@dataclass
class QueuedResult:
    """A result waiting for the writer, and where its acknowledgement goes."""

    agent: str
    message: agent_pb2.TaskResult
    # Called after the commit with the ack and whether the task went back to the queue (a retry).
    acknowledge: Callable[[agent_pb2.ResultAck, bool], None]
    # Called when applying it failed unexpectedly: the agent keeps the result and resends it later.
    failed: Callable[[], None] = lambda: None


def decode(agent: str, message: agent_pb2.TaskResult) -> tuple[RunResult, str]:
    """The wire result as a RunResult, and the problem that made it a failure instead (or "").

    A result too large, or one farm cannot read, fails its task rather than being retried."""
    size = message.result.ByteSize()
    if size > MAX_RESULT_BYTES:
        problem = (f"its result is {size} bytes, over the {MAX_RESULT_BYTES} byte limit per result; "
                   "farm agents cap their samples to fit, so this agent is out of date or not farm's")
        return RunResult.failed(FailureClass.JOB, f"agent {agent} sent a result that cannot be stored: {problem}"), problem
    try:
        return result_from_message(message.result), ""
    except (ValueError, TypeError, KeyError) as e:  # an unknown status or failure class, JSON that is not
        return (RunResult.failed(FailureClass.BUG, f"agent {agent} sent a result farm cannot read: {printable(e)}"),
                f"its result cannot be read ({printable(e)})")


def acknowledgement(agent: str, message: agent_pb2.TaskResult, outcome: Applied | ResultRefused,
                    problem: str) -> agent_pb2.ResultAck:
    """The ack for one applied (or refused) result; its note says why when it was not simply stored."""
    task_id, attempt = message.task.task_id, message.task.attempt
    ack = agent_pb2.ResultAck(task=message.task)
    if isinstance(outcome, ResultRefused):
        log.warning("agent %s: result for task %d attempt %d refused: %s", agent, task_id, attempt, printable(outcome))
        ack.note = f"refused: {outcome}; nothing was stored. Do not resend."
        return ack
    ack.applied = outcome.run_id is not None
    ack.run_id = outcome.run_id or 0
    if problem:
        log.warning("agent %s: task %d attempt %d failed: %s", agent, task_id, attempt, problem)
        ack.note = f"stored as a failure: {problem}. Do not resend."
    elif not ack.applied:
        ack.note = "already applied"
    return ack


class ResultWriter(BatchThread[QueuedResult]):
    """The one thread that applies queued results, a batch per transaction."""

    def __init__(self, controller: Controller, *, max_batch: int = RESULT_BATCH,
                 timed: Callable[[str, float, int], None] = lambda step, started, count: None) -> None:
        super().__init__("result-writer", max_batch)
        self.controller = controller
        self._timed = timed
        self.transactions = 0  # batches committed (a benchmark or test compares it with the results applied)

    def write(self, batch: list[QueuedResult]) -> None:
        """Apply `batch` in one transaction, then acknowledge each result (never before the commit)."""
        try:
            acks = self._apply(batch)
        except Exception as e:  # a store error, or a bug: apply one by one, so only the result that fails is held back
            outage = self.controller.outage
            if len(batch) == 1 or outage.failed(e, "storing results"):  # out of reach: each would fail alike
                for item in batch:
                    if not outage.failed(e, "storing a result"):
                        log.exception("agent %s: applying the result for task %d attempt %d failed; the agent keeps it",
                                      item.agent, item.message.task.task_id, item.message.task.attempt)
                    item.failed()
                return
            for item in batch:
                self.write([item])
            return
        self.controller.outage.answered()
        for item, (ack, requeued) in zip(batch, acks):
            item.acknowledge(ack, requeued)

    def _apply(self, batch: list[QueuedResult]) -> list[tuple[agent_pb2.ResultAck, bool]]:
        decoded = [decode(item.agent, item.message) for item in batch]
        deliveries = [Delivery(item.message.task.task_id, item.message.task.attempt, item.agent,
                               item.message.started_at, result) for item, (result, _) in zip(batch, decoded)]
        started = time.perf_counter()
        outcomes = self.controller.complete_batch(deliveries)
        self.transactions += 1
        self._timed("complete", started, len(batch))
        return [(acknowledgement(item.agent, item.message, outcome, problem),
                 isinstance(outcome, Applied) and outcome.task_status == TaskStatus.PENDING.value)
                for item, (_, problem), outcome in zip(batch, decoded, outcomes)]


__all__ = ["QueuedResult", "RESULT_BATCH", "ResultWriter", "acknowledgement", "decode"]
