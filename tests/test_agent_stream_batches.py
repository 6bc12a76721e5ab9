"""Two messages per task on the agent stream: a result carries its slot's next work request (AgentBatch), and the
acknowledgement carries the offer that request brings (ControllerBatch); only between sides that say they read
batches, so an older agent or controller sees the single messages it knows. A real controller on loopback, the
bare stubs for exact messages, and farm's own agent for the other half."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import grpc
import pytest

from farm.agents.agent import Agent
from farm.agents.link.remote_controller import AgentDevice, RemoteController
from farm.controller import grpc_server
from farm.controller.rpc import agent_service
from farm.controller.grpc_server import serve
from farm.controller.store import SQLiteStore as Store
from farm.proto.batching import MAX_BATCH_MESSAGES
from farm.proto.generated import agent_pb2, common_pb2, farm_pb2, farm_pb2_grpc
from farm.proto.results import LatencyStats, RunResult, RunStatus
from farm.proto.wire import result_to_message
from raw_agent import RawAgent

pytestmark = pytest.mark.timeout(240)


def _ok() -> RunResult:
    return RunResult(status=RunStatus.COMPLETED, iterations_ms=[1.0, 1.0],
                     latency=LatencyStats(None, None, None, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 2))


def _result(task: common_pb2.TaskSpec) -> agent_pb2.AgentMessage:
    message = agent_pb2.TaskResult(task=common_pb2.TaskRef(task_id=task.task_id, attempt=task.attempt),
                                   started_at=time.time())
    result_to_message(_ok(), message.result)
    return agent_pb2.AgentMessage(result=message)


def _request(request_id: int) -> agent_pb2.AgentMessage:
    return agent_pb2.AgentMessage(work_request=agent_pb2.WorkRequest(request_id=request_id, targets=["sim"]))


def _write(agent: RawAgent, timeout: float = 30) -> list[agent_pb2.ControllerMessage]:
    """The next write from the controller: its messages, a batch opened (and 'batch' first, to tell)."""
    message = agent.inbox.get(timeout=timeout)
    if message.WhichOneof("kind") == "batch":
        return [agent_pb2.ControllerMessage(batch=agent_pb2.ControllerBatch()), *message.batch.messages]
    return [message]


def _kinds(write: list[agent_pb2.ControllerMessage]) -> list[str]:
    return [str(m.WhichOneof("kind")) for m in write]


@pytest.fixture
def controller(tmp_path: Path, tiny_models):
    store = Store(tmp_path / "farm.db")
    running = serve(store, "127.0.0.1:0", tokens=None, lease_ttl_s=30, models_roots=[Path(tiny_models["onnx"]).parent])
    running.tiny = tiny_models["onnx"]  # type: ignore[attr-defined]
    yield running
    running.stop()


def _submit(controller, repeats: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{controller.port}") as channel:
        return farm_pb2_grpc.FarmServiceStub(channel).SubmitJob(farm_pb2.SubmitJobRequest(
            job_yaml=f"models: [{controller.tiny}]\nrepeats: {repeats}\n", base_dir="/"), timeout=60).job_id


def test_the_result_brings_the_next_request_and_the_ack_brings_its_offer(controller,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_service, "ACK_HOLD_S", 3.0)  # a busy machine's slow dispatch still meets the ack
    job_id = _submit(controller, repeats=3)
    agent = RawAgent(f"127.0.0.1:{controller.port}", "rack", "", capabilities=("batch",))
    try:
        (welcome,) = _write(agent)
        assert "batch" in welcome.welcome.capabilities
        agent.send(**{"work_request": _request(1).work_request})
        (offer,) = _write(agent)
        task = offer.offer.task
        for request_id in (2, 3):
            agent.outbox.put(agent_pb2.AgentMessage(batch=agent_pb2.AgentBatch(
                messages=[_result(task), _request(request_id)])))
            write = _write(agent)
            # one write: the acknowledgement of the stored result, then the offer for the request that rode with it
            assert _kinds(write) == ["batch", "ack", "offer"], write
            assert write[1].ack.applied and write[1].ack.task.task_id == task.task_id
            assert write[2].offer.request_id == request_id and write[2].offer.task.task_id != task.task_id
            task = write[2].offer.task
        agent.send(**{"result": _result(task).result})
        assert _kinds(_write(agent)) == ["ack"]
    finally:
        agent.close()
    counts = controller.farm.store.jobs.task_counts(job_id)
    assert counts.get("completed") == 3 and len(controller.farm.store.query("SELECT id FROM runs")) == 3


def test_an_agent_that_does_not_read_batches_gets_single_messages(controller) -> None:
    _submit(controller, repeats=2)
    agent = RawAgent(f"127.0.0.1:{controller.port}", "old", "")  # no "batch" in its hello: an older farm
    try:
        assert _kinds(_write(agent)) == ["welcome"]
        agent.send(**{"work_request": _request(1).work_request})
        (offer,) = _write(agent)
        agent.send(**{"result": _result(offer.offer.task).result})
        agent.send(**{"work_request": _request(2).work_request})  # sent at once: the ack and offer could share
        assert _kinds(_write(agent)) in (["ack"], ["offer"])
        assert _kinds(_write(agent)) in (["ack"], ["offer"])
        assert agent.inbox.empty()
    finally:
        agent.close()


def test_a_nested_batch_or_a_hello_inside_one_is_ignored_and_the_stream_goes_on(controller) -> None:
    _submit(controller, repeats=2)  # a task left for the nested request, were it taken
    agent = RawAgent(f"127.0.0.1:{controller.port}", "odd", "", capabilities=("batch",))
    try:
        _write(agent)
        nested = agent_pb2.AgentMessage(batch=agent_pb2.AgentBatch(messages=[_request(7)]))
        agent.outbox.put(agent_pb2.AgentMessage(batch=agent_pb2.AgentBatch(messages=[
            nested, agent_pb2.AgentMessage(hello=agent_pb2.Hello(agent_name="someone-else")), agent_pb2.AgentMessage(),
            _request(8)])))
        (offer,) = _write(agent)
        assert offer.offer.request_id == 8  # the nested request (7) was not taken
        with pytest.raises(queue.Empty):
            agent.inbox.get(timeout=1.0)
    finally:
        agent.close()


def test_a_batch_over_the_cap_ends_that_stream_only(controller) -> None:
    agent = RawAgent(f"127.0.0.1:{controller.port}", "flood", "", capabilities=("batch",))
    other = RawAgent(f"127.0.0.1:{controller.port}", "calm", "", capabilities=("batch",))
    try:
        _write(agent), _write(other)
        agent.outbox.put(agent_pb2.AgentMessage(batch=agent_pb2.AgentBatch(
            messages=[agent_pb2.AgentMessage(heartbeat=agent_pb2.Heartbeat())] * (MAX_BATCH_MESSAGES + 1))))
        assert agent.ended.wait(30)
        _submit(controller, repeats=1)
        other.send(**{"work_request": _request(1).work_request})
        assert _kinds(_write(other)) == ["offer"]  # the controller goes on serving the others
    finally:
        agent.close(), other.close()


class _Instant:
    """A driver that returns at once: only the stream is under test."""

    name = "sim"

    def in_slot(self, slot) -> "_Instant":
        return self

    def run(self, task, cancel_check) -> RunResult:
        return _ok()


def _run_agent(controller, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, repeats: int) -> list[str]:
    """farm's own agent (two slots) through a job; the kinds of what the controller received from it."""
    seen: list[str] = []  # what arrived, one entry a write (a batch's own messages are handled inside its call)
    original = grpc_server.FarmServer.on_agent_message
    inside = threading.local()

    def observed(self, session, message) -> None:
        depth = getattr(inside, "depth", 0)
        if depth == 0:
            seen.append(str(message.WhichOneof("kind")))
        inside.depth = depth + 1
        try:
            original(self, session, message)
        finally:
            inside.depth = depth

    monkeypatch.setattr(grpc_server.FarmServer, "on_agent_message", observed)
    job_id = _submit(controller, repeats=repeats)
    client = RemoteController(f"127.0.0.1:{controller.port}", name="rack", token=None,
                              devices=[AgentDevice("rack/sim", "sim", "sim")], artifact_dir=tmp_path / "cache").start()
    agent = Agent(client, _Instant(), name="rack", slots=2)  # type: ignore[arg-type]
    slots = threading.Thread(target=agent.run_job, args=(None,), daemon=True)
    slots.start()
    try:
        deadline = time.monotonic() + 120
        while controller.farm.store.jobs.has_open_tasks(job_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert controller.farm.store.jobs.task_counts(job_id).get("completed") == repeats
    finally:
        client.drain()
        slots.join(30)
        assert client.wait_for_acks(10)
        client.close()
    assert len(controller.farm.store.query("SELECT id FROM runs")) == repeats  # each task once
    return seen


def test_farms_agent_sends_each_result_with_its_next_request(controller, monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    seen = _run_agent(controller, monkeypatch, tmp_path, repeats=12)
    # every result rode in a batch with its slot's next request (two slots' may share one): a write per task at
    # most, besides the two slots' first requests, the drain and heartbeats
    assert "result" not in seen and "batch" in seen
    assert len([kind for kind in seen if kind != "heartbeat"]) <= 12 + 3, " ".join(seen)


def test_farms_agent_sends_single_messages_to_a_controller_that_does_not_read_batches(
        controller, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(agent_service, "BATCH_CAPABILITY", "not-batch")  # its Welcome no longer lists "batch"
    seen = _run_agent(controller, monkeypatch, tmp_path, repeats=6)
    assert "batch" not in seen and seen.count("result") == 6
