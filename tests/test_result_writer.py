"""Results from agents' streams are applied many per transaction, and acknowledged only after their commit:
a refused result in a batch stores nothing and spoils nothing else, and a result still queued is not
acknowledged, so the agent keeps it (and resends it after a reconnect)."""

from __future__ import annotations

import queue
import sqlite3
import time
from pathlib import Path

import pytest

from farm.controller.grpc_server import AgentSession, FarmServer
from farm.controller.scheduling.jobfile import load_job_text
from farm.controller.store import SQLiteStore as Store
from farm.proto.generated import agent_pb2
from farm.proto.results import FailureClass, LatencyStats, RunResult, RunStatus
from farm.proto.wire import result_to_message


@pytest.fixture
def server(tmp_path: Path, tiny_models) -> FarmServer:
    s = FarmServer(Store(tmp_path / "farm.db"), lease_ttl_s=30)
    s.controller.submit(load_job_text(f"models: [{tiny_models['onnx']}]\nrepeats: 6\n", "job.yaml", tmp_path))
    yield s
    s.stop()


def _connect(server: FarmServer, name: str) -> AgentSession:
    session, _ = server.open_session(agent_pb2.Hello(agent_name=name), "test")
    return session


def _result(task_id: int, attempt: int) -> agent_pb2.AgentMessage:
    message = agent_pb2.AgentMessage()
    message.result.task.task_id, message.result.task.attempt = task_id, attempt
    message.result.started_at = time.time()
    result_to_message(RunResult(status=RunStatus.COMPLETED, iterations_ms=[1.0, 2.0],
                                latency=LatencyStats(None, None, None, 1.5, 1.5, 2.0, 2.0, 0.5, 1.0, 2.0, 2)),
                      message.result.result)
    return message


def _acks(session: AgentSession, count: int, timeout_s: float = 30) -> list[agent_pb2.ResultAck]:
    acks, deadline = [], time.monotonic() + timeout_s
    while len(acks) < count:
        message = session.outbox.get(timeout=max(0.01, deadline - time.monotonic()))
        if message is not None and message.WhichOneof("kind") == "ack":
            acks.append(message.ack)
    return acks


def test_queued_results_are_applied_in_one_transaction_and_acked_after_it(server: FarmServer, tmp_path: Path) -> None:
    a, b = _connect(server, "a"), _connect(server, "b")
    mine = [server.controller.lease("a", {"sim"}) for _ in range(4)]
    theirs = server.controller.lease("b", {"sim"})
    for task in mine:
        server.on_agent_message(a, _result(task.task_id, task.attempt))
    server.on_agent_message(a, _result(theirs.task_id, theirs.attempt))  # not a's lease: refused
    # nothing is acknowledged, and nothing stored, while the results wait for the writer
    with pytest.raises(queue.Empty):
        a.outbox.get(timeout=0.3)
    assert server.store.query("SELECT COUNT(*) AS n FROM runs")[0]["n"] == 0
    server.results.start()
    acks = {ack.task.task_id: ack for ack in _acks(a, 5)}
    # each ack left after its commit: another connection sees every acknowledged run
    with sqlite3.connect(tmp_path / "farm.db") as other:
        stored = dict(other.execute("SELECT task_id, id FROM runs").fetchall())
    assert {t.task_id for t in mine} == set(stored)
    for task in mine:
        assert acks[task.task_id].applied and acks[task.task_id].run_id == stored[task.task_id]
    refused = acks[theirs.task_id]
    assert not refused.applied and "not leased to agent a" in refused.note and "Do not resend" in refused.note
    assert server.results.transactions == 1 and server.timings["complete"][1] == 5
    # the refused result changed nothing: b still holds its lease and can deliver
    server.on_agent_message(b, _result(theirs.task_id, theirs.attempt))
    assert _acks(b, 1)[0].applied


def test_a_result_delivered_again_after_a_lost_ack_is_applied_once(server: FarmServer) -> None:
    a = _connect(server, "a")
    task = server.controller.lease("a", {"sim"})
    server.results.start()
    server.on_agent_message(a, _result(task.task_id, task.attempt))
    server.on_agent_message(a, _result(task.task_id, task.attempt))  # the agent resent it (its ack was lost)
    first, again = _acks(a, 2)
    assert first.applied and not again.applied and again.note == "already applied"
    assert server.store.query("SELECT COUNT(*) AS n FROM runs WHERE task_id = ?", [task.task_id])[0]["n"] == 1


def _failed(task_id: int, attempt: int, failure: FailureClass, message: str) -> agent_pb2.AgentMessage:
    wire = agent_pb2.AgentMessage()
    wire.result.task.task_id, wire.result.task.attempt = task_id, attempt
    wire.result.started_at = time.time()
    result_to_message(RunResult.failed(failure, message), wire.result.result)
    return wire


def test_one_batch_with_a_resend_a_conflict_a_stranger_and_a_retry_applies_each_as_it_would_alone(
        server: FarmServer) -> None:
    """The writer reads and writes a batch a statement per table; what each result does is still its own: a task
    delivered twice in the batch is applied once, a different result for the same attempt is refused, a task that
    does not exist is refused, an infrastructure failure puts its task back in the queue."""
    a = _connect(server, "a")
    first, second, third = (server.controller.lease("a", {"sim"}) for _ in range(3))
    for message in (_result(first.task_id, first.attempt), _result(first.task_id, first.attempt),
                    _failed(first.task_id, first.attempt, FailureClass.JOB, "another result"),
                    _result(10**6, 1), _failed(second.task_id, second.attempt, FailureClass.INFRASTRUCTURE, "lost"),
                    _result(third.task_id, third.attempt)):
        server.on_agent_message(a, message)
    server.results.start()
    applied, again, conflict, stranger, retried, done = _acks(a, 6)
    assert server.results.transactions == 1
    assert applied.applied and not again.applied and again.note == "already applied"
    assert not conflict.applied and "already stored" in conflict.note
    assert not stranger.applied and "there is no task 1000000" in stranger.note
    assert retried.applied and done.applied and len({applied.run_id, retried.run_id, done.run_id}) == 3
    runs = server.store.query("SELECT id, task_id, attempt, status FROM runs ORDER BY id")
    assert [(r["id"], r["task_id"], r["status"]) for r in runs] == [
        (applied.run_id, first.task_id, "completed"), (retried.run_id, second.task_id, "failed"),
        (done.run_id, third.task_id, "completed")]
    tasks = {t.id: t for t in server.store.jobs.tasks(1)}
    assert [(tasks[t.task_id].status, tasks[t.task_id].last_run_id) for t in (first, second, third)] == [
        ("completed", applied.run_id), ("pending", retried.run_id), ("completed", done.run_id)]
    assert tasks[second.task_id].leased_by is None and "lost; retrying" in (tasks[second.task_id].message or "")
    assert server.store.jobs.task_counts(1) == {"completed": 2, "pending": 4}  # the triggers' counts follow
    assert server.store.runs.iterations(done.run_id) == [1.0, 2.0]
