"""The dispatcher's matching, without a network: idle slots get tasks whose target they serve, in
priority order, one transaction per batch, and a slot is not starved by work it cannot run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from farm.controller.grpc_server import AgentSession, FarmServer
from farm.controller.scheduling.jobfile import load_job_text
from farm.controller.store import SQLiteStore as Store
from farm.proto.generated import agent_pb2


@pytest.fixture
def server(tmp_path: Path, tiny_models) -> FarmServer:
    s = FarmServer(Store(tmp_path / "farm.db"), lease_ttl_s=30)
    job = load_job_text(f"models: [{tiny_models['onnx']}]\nrepeats: 6\n", "job.yaml", tmp_path)
    s.controller.submit(job)
    return s


def _session(server: FarmServer, name: str, *targets: str, slots: int = 1) -> AgentSession:
    session = AgentSession(name=name, session_id=name, peer="test", hello=agent_pb2.Hello(agent_name=name))
    session.requests = {i + 1: frozenset(targets) for i in range(slots)}
    server.sessions[name] = session
    return session


def _offers(session: AgentSession) -> list[tuple[int, str]]:
    out = []
    while not session.outbox.empty():
        message = session.outbox.get_nowait()
        out.append((message.offer.task.task_id, message.offer.task.target))
    return out


def test_each_slot_gets_a_task_it_serves_in_queue_order(server: FarmServer) -> None:
    # the first three tasks of the queue are for one device only
    server.store.db.execute("UPDATE tasks SET target = 'lab1/pixel' WHERE seq < 3")
    sim_only = _session(server, "simhost", "sim", "simhost/sim", slots=2)
    pixel = _session(server, "lab1", "lab1/pixel", "pixel")
    assert server.dispatch_once() == 3
    assert _offers(pixel) == [(1, "lab1/pixel")]
    # the sim slots are not starved by the pixel tasks ahead of theirs
    assert _offers(sim_only) == [(4, "sim"), (5, "sim")]
    leased = server.store.query("SELECT id, leased_by, attempts FROM tasks WHERE status = 'running' ORDER BY id")
    assert [(r["id"], r["leased_by"], r["attempts"]) for r in leased] == [(1, "lab1", 1), (4, "simhost", 1), (5, "simhost", 1)]
    assert server.store.jobs.get(1).status == "running"


def test_a_slot_with_nothing_to_run_is_not_asked_again_until_the_queue_changes(server: FarmServer) -> None:
    idle = _session(server, "elsewhere", "jetson")
    assert server.dispatch_once() == 0
    calls = server.timings["lease"][1]
    assert server.dispatch_once() == 0 and server.timings["lease"][1] == calls  # remembered: no query
    server.store.db.execute("UPDATE tasks SET target = 'jetson' WHERE seq = 5")
    server.wake(queue_changed=True)
    assert server.dispatch_once() == 1
    assert _offers(idle) == [(6, "jetson")]


def test_a_superseded_attempt_is_acknowledged_but_not_stored(server: FarmServer) -> None:
    from farm.proto.results import LatencyStats, RunResult, RunStatus
    from farm.proto.wire import result_to_message

    task = server.controller.lease("slow", {"sim"})
    server.store.db.execute("UPDATE tasks SET lease_expires_at = 0 WHERE id = ?", [task.task_id])
    server.controller.expire_leases()
    again = server.controller.lease("fast", {"sim"})
    assert (again.task_id, again.attempt) == (task.task_id, 2)
    ok = RunResult(status=RunStatus.COMPLETED, iterations_ms=[1.0],
                   latency=LatencyStats(None, None, None, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1))

    def deliver(attempt: int, agent: str) -> agent_pb2.ResultAck:
        message = agent_pb2.TaskResult(started_at=time.time())
        message.task.task_id, message.task.attempt = task.task_id, attempt
        result_to_message(ok, message.result)
        return server.apply_result(agent, message)

    late = deliver(1, "slow")
    assert not late.applied and "lease expired on agent slow" in late.note and "Do not resend" in late.note
    assert not deliver(2, "slow").applied  # attempt 2 is leased to another agent
    assert deliver(2, "fast").applied
    twice = deliver(2, "fast")
    assert not twice.applied and twice.note == "already applied"
    runs = server.store.query("SELECT attempt, agent, failure_class FROM runs WHERE task_id = ? ORDER BY attempt",
                              [task.task_id])
    # the lost attempt is a run of its own, the late result changed nothing
    assert runs == [{"attempt": 1, "agent": "slow", "failure_class": "infrastructure"},
                    {"attempt": 2, "agent": "fast", "failure_class": None}]


class _Refused(Exception):
    pass


class _Context:
    """Enough of grpc.ServicerContext for calling a servicer method directly."""

    def abort(self, code, details: str):
        raise _Refused(code, details)


def test_a_job_targets_the_devices_agents_registered_by_name_type_or_tag(server: FarmServer, tiny_models, tmp_path: Path) -> None:
    from farm.controller.grpc_server import FarmServicer, controller_files
    from farm.proto.generated import common_pb2, farm_pb2

    server.files = controller_files(server.store, models_roots=[tiny_models["onnx"].parent])  # a --models-root

    hello = agent_pb2.Hello(agent_name="rack1", devices=[
        common_pb2.Device(name="rack1/sim", driver="sim", device_type="sim", slots=1),
        common_pb2.Device(name="g6-1", driver="android", device_type="lg-g6", tags=["phones"])])
    server.open_session(hello, "test")
    servicer = FarmServicer(server)
    text = f"models: [{tiny_models['onnx']}]\ntargets: [tag:phones]\n"
    response = servicer.SubmitJob(farm_pb2.SubmitJobRequest(job_yaml=text, base_dir=str(tmp_path)), _Context())
    targets = sorted(r["target"] for r in server.store.query("SELECT target FROM tasks WHERE job_id = ?", [response.job_id]))
    assert targets == ["g6-1", "sim"]  # the phone, and its sim twin with the phone's budget
    with pytest.raises(_Refused) as refused:
        servicer.SubmitJob(farm_pb2.SubmitJobRequest(job_yaml=text.replace("tag:phones", "nano-9"),
                                                     base_dir=str(tmp_path)), _Context())
    assert "no device matches 'nano-9'" in refused.value.args[1] and "g6-1" in refused.value.args[1]
