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
from farm.proto.results import LatencyStats, RunResult, RunStatus
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
