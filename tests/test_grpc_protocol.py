"""The wire itself: committed stubs match the .proto files, TaskSpec and RunResult cross it
unchanged, the standard health and reflection services answer, and an agent of another
protocol version is refused with a message that says what to do."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from farm.agents.link.remote_controller import AgentDevice, RemoteController
from farm.proto.generated import common_pb2
from farm.proto.results import (
    FIGURES, FailureClass, LatencyStats, Limits, ModelFacts, RunResult, RunStatus, Telemetry, TelemetrySample, TensorInfo,
)
from farm.proto.tasks import TaskPlan, TaskSpec
from farm.proto.wire import result_from_message, result_to_message, task_from_message, task_to_message
from grpc_processes import Cluster, wait_for

ROOT = Path(__file__).resolve().parents[1]


def test_committed_stubs_match_the_proto_files(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) regenerates the stubs")
    from farm.proto.codegen import GENERATED, generate

    fresh = {p.name: p.read_text() for p in generate(tmp_path)}
    committed = {p.name: p.read_text() for p in GENERATED.iterdir() if p.is_file() and p.suffix in (".py", ".pyi")}
    stale = sorted(name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name))
    assert not stale, f"proto/generated is stale ({', '.join(stale)}): run `make proto` and commit the result"


def test_a_task_and_a_full_result_cross_the_wire_unchanged() -> None:
    task = TaskSpec(task_id=7, job_id=2, attempt=3, target="sim", model_name="m", model_path="/m.onnx",
                    model_sha256="ab" * 32, model_family=None, threads=2, batch_size=1, input_size=None, repeat=1,
                    plan=TaskPlan(workload={"type": "benchmark", "iterations": 100, "input_shapes": {"x": [1, 3]}},
                    sim={"cpus": None, "memory": 1 << 29}, run_timeout_s=600.0, base_dir="/jobs"))
    wire = common_pb2.TaskSpec.FromString(task_to_message(task, common_pb2.TaskSpec()).SerializeToString())
    assert task_from_message(wire) == task
    # the plan's part is encoded once per plan object (issue 35); each task still carries its own fields and plan
    again = task.model_copy(update={"task_id": 8, "repeat": 2})  # the same plan object, as the controller leases
    assert again.plan is task.plan
    assert task_from_message(task_to_message(again, common_pb2.TaskSpec())) == again
    other = task.model_copy(update={"plan": task.plan.model_copy(update={"base_dir": "/other", "accelerator": "gpu"})})
    assert task_from_message(task_to_message(other, common_pb2.TaskSpec())) == other
    assert task_to_message(task, common_pb2.TaskSpec()).SerializeToString() == wire.SerializeToString()

    result = RunResult(
        status=RunStatus.COMPLETED, backend="cgroup", limits=Limits(cpus=1.0, memory_mb=512.0), wall_s=0.5,
        latency=LatencyStats(init=3.0, first=2.0, warmup_avg=None, avg=1.0, p50=1.0, p90=1.2, p99=1.3, std=0.1,
                             min=0.9, max=1.4, count=3),
        iterations_ms=[0.9, 1.0, 1.4], telemetry=Telemetry(interval_ms=50.0, cpu_avg_percent=99.0, memory_peak_bytes=1 << 25,
                                                           memory_peak_source="kernel", samples=[TelemetrySample(0.05, 98.0, 1 << 24)]),
        peak_rss_bytes=1 << 26, model=ModelFacts(path="/m.onnx", format="onnx", size_bytes=10, sha256="ab" * 32,
                                                 inputs=[TensorInfo("x", [1, "N", 3], "float32")], op_types={"Conv": 2}),
        environment={"governor": "performance", "temps": [40.5, 41]}, tool_versions={"onnxruntime": "1.20"},
        # every declared run figure (proto/results.py): the wire carries it under its field's name
        **{f.name: (7 << 20) + i if f.column is int else 0.5 + i for i, f in enumerate(FIGURES)})
    wire_result = common_pb2.RunResult.FromString(result_to_message(result, common_pb2.RunResult()).SerializeToString())
    back = result_from_message(wire_result)
    assert back == result
    # the samples come straight from the message's typed fields (issue 35): the same types as a validated result
    assert back.telemetry is not None and dataclasses.asdict(back.telemetry.samples[0]) == {
        "t_s": 0.05, "cpu_percent": 98.0, "memory_bytes": 1 << 24}
    assert [type(v) for v in dataclasses.astuple(back.telemetry.samples[0])] == [float, float, int]
    assert all(type(v) is float for v in back.iterations_ms) and back.iterations_ms == [0.9, 1.0, 1.4]
    failed = RunResult.failed(FailureClass.RESOURCE, "out of memory at the 512 MiB limit")
    assert result_from_message(result_to_message(failed, common_pb2.RunResult())) == failed


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory):
    """One controller on threads of this process for the module: each test uses agent and device names of its own."""
    c = Cluster(tmp_path_factory.mktemp("protocol"), env={"FARM_CONTROLLER": "", "FARM_TOKEN": ""})
    c.serve_in_process()
    yield c
    c.stop_all()


def _reflected_services(channel: grpc.Channel) -> set[str]:
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    return {s.name for reply in replies for s in reply.list_services_response.service}


def test_reflection_is_off_unless_asked_for(controller: Cluster) -> None:
    with grpc.insecure_channel(controller.address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            _reflected_services(channel)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_health_answers_serving_and_reflection_lists_the_services(tmp_path: Path) -> None:
    controller = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": ""})
    controller.serve_in_process(reflection=True)
    try:
        _check_health_and_reflection(controller)
    finally:
        controller.stop_all()


def _check_health_and_reflection(controller: Cluster) -> None:
    with grpc.insecure_channel(controller.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "farm.v1.FarmService", "farm.v1.AgentService"):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        services = _reflected_services(channel)
    assert {"farm.v1.FarmService", "farm.v1.AgentService", "grpc.health.v1.Health"} <= services


def test_an_agent_of_another_protocol_version_is_refused_clearly(controller: Cluster) -> None:
    agent = RemoteController(controller.address, name="old-agent", token=None, protocol_version=99,
                             devices=[AgentDevice("old-agent/sim", "sim", "sim")]).start()
    try:
        wait_for(lambda: agent.fatal is not None, 20, "the refusal")
        assert agent.lease("old-agent", {"sim"}) is None  # the agent stops asking for work
    finally:
        agent.close()
    message = str(agent.fatal)
    assert "version mismatch" in message and "protocol 99" in message and "protocol 1" in message
    assert "Install the same farm version" in message


def test_a_reconnecting_agent_takes_over_its_own_session(controller: Cluster, caplog) -> None:
    first = RemoteController(controller.address, name="rack", token=None, devices=[AgentDevice("rack/sim", "sim", "sim")]).start()
    second = None
    try:
        wait_for(first.connected.is_set, 20, "the first session")
        second = RemoteController(controller.address, name="rack", token=None,
                                  devices=[AgentDevice("rack/sim", "sim", "sim")]).start()
        wait_for(second.connected.is_set, 20, "the second session")
        # the old stream learns why it ended (a real reconnect's old stream is already dead and never hears it),
        # says so, and tries again later instead of exiting: a taken session may be its own after a network blip.
        # Judged before the CLI call below: under load that call can outlast the 5 s after which the first comes back.
        wait_for(lambda: "took over this session" in caplog.text, 20, "the old session to be told")
        assert "connecting again in 5 s" in caplog.text and first.fatal is None
        assert second.connected.is_set() and second.fatal is None
        agents = controller.farm("agents", "--json", "--controller", controller.address)
        assert agents.returncode == 0, agents.stderr
        assert '"state": "online"' in agents.stdout and agents.stdout.count('"name": "rack"') == 1
        wait_for(lambda: first.reconnects >= 1 and first.connected.is_set(), 30, "the first agent to try again")
        assert first.fatal is None
    finally:
        first.close()
        if second:
            second.close()


def test_an_agent_fetches_a_model_it_lacks_by_sha256(controller: Cluster, tiny_models, tmp_path: Path) -> None:
    import hashlib
    import os

    os.symlink(tiny_models["onnx"], controller.root / "tiny.onnx")
    (controller.root / "job.yaml").write_text("models: [tiny.onnx]\n")
    assert controller.farm("submit", str(controller.root / "job.yaml"), "--controller", controller.address,
                           "--detach").returncode == 0
    sha = hashlib.sha256(tiny_models["onnx"].read_bytes()).hexdigest()
    client = RemoteController(controller.address, name="far-away", token=None, devices=[], artifact_dir=tmp_path / "cache")
    task = TaskSpec(task_id=1, job_id=1, attempt=1, target="sim", model_name="tiny", model_path="/elsewhere/tiny.onnx",
                    model_sha256=sha, model_family=None, threads=1, batch_size=1, input_size=None, repeat=0,
                    plan=TaskPlan(workload={"type": "benchmark"}, sim={}, run_timeout_s=60, base_dir="/elsewhere"))
    local = Path(client.local_model_path(task))
    assert local == tmp_path / "cache" / f"{sha}.onnx"
    assert local.read_bytes() == tiny_models["onnx"].read_bytes()
    # names from the wire never become paths: only a sha256 of a model some task names is served
    for bad in ("../../etc/passwd", "0" * 64):
        with pytest.raises(grpc.RpcError) as refused:
            client.fetch_artifact(bad, tmp_path / "cache" / "x")
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert not (tmp_path / "cache" / "x").exists()


def test_oversized_job_files_and_path_like_agent_names_are_refused(controller: Cluster) -> None:
    big = controller.root / "big.yaml"
    big.write_text("models: [tiny.onnx]\n" + "# padding\n" * 120_000)
    run = controller.farm("submit", str(big), "--controller", controller.address)
    assert run.returncode == 2 and "over the limit of 1,048,576 bytes" in run.stderr, run.stderr
    # the CLI refuses it before sending; a client that sends it anyway meets the controller's own limit
    from farm.proto.generated import farm_pb2, farm_pb2_grpc
    with grpc.insecure_channel(controller.address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            farm_pb2_grpc.FarmServiceStub(channel).SubmitJob(farm_pb2.SubmitJobRequest(job_yaml=big.read_text()),
                                                            timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "over 1048576 bytes" in refused.value.details()

    sneaky = RemoteController(controller.address, name="../../etc", token=None, devices=[]).start()
    try:
        wait_for(lambda: sneaky.fatal is not None, 20, "the refusal")
    finally:
        sneaky.close()
    assert "is not allowed" in str(sneaky.fatal)


def test_one_device_cannot_be_registered_by_two_agents(controller: Cluster) -> None:
    phone = AgentDevice("g6-1", "android", "lg-g6", tags=["phones"])
    first = RemoteController(controller.address, name="rack-a", token=None, devices=[phone]).start()
    second = RemoteController(controller.address, name="rack-b", token=None, devices=[phone])
    try:
        wait_for(first.connected.is_set, 20, "rack-a")
        second.start()
        wait_for(lambda: second.fatal is not None, 20, "the refusal")
    finally:
        first.close()
        second.close()
    assert "belongs to agent 'rack-a' (online)" in str(second.fatal)
    devices = controller.farm("devices", "--json", "--controller", controller.address)
    assert '"name": "g6-1"' in devices.stdout and '"agent": "rack-a"' in devices.stdout
