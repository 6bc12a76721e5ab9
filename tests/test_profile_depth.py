"""What a profile holds beyond latency: throughput, samples/s and start-up as figures of their own,
and per-operator profiles — from ONNX Runtime's trace in the sim and from benchmark_model's tables
on a phone — stored, bounded and shown by `farm results --ops`."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from adb_emulator import AdbDeviceEmulator
from conftest import write_job
from farm.agents.android.adb import load_or_create_lab_key
from farm.agents.harness.onnxruntime_profile import OrtProfileError, ort_op_profile, parse_ort_profile
from farm.controller.store import SQLiteStore as Store
from farm.proto.op_profile import MAX_NODES, MAX_OP_TYPES, NODE, OP_TYPE, OpProfileRow, bounded, from_dicts


def _trace(runs: list[dict[str, tuple[str, int]]]) -> str:
    """An ONNX Runtime trace: per run, node -> (op type, µs), as the profiler writes it."""
    events: list[dict] = [{"cat": "Session", "name": "session_initialization", "dur": 900, "args": {}}]
    for nodes in runs:
        events.append({"cat": "Session", "name": "model_run", "dur": 1000, "args": {}})
        for node, (op, us) in nodes.items():
            events.append({"cat": "Node", "name": f"{node}_fence_before", "dur": 0, "args": {"op_name": op}})
            events.append({"cat": "Node", "name": f"{node}_kernel_time", "dur": us, "args": {"op_name": op}})
    return json.dumps(events)


def test_the_ort_trace_gives_per_node_and_per_type_times_with_the_cold_run_apart() -> None:
    cold = {"conv1": ("Conv", 900), "conv2": ("Conv", 300), "fc": ("Gemm", 200)}
    warm = {"conv1": ("Conv", 100), "conv2": ("Conv", 300), "fc": ("Gemm", 100)}
    nodes = {r.name: r for r in parse_ort_profile(_trace([cold, warm, warm]))}
    assert set(nodes) == {"conv1", "conv2", "fc"}  # fences are bookkeeping, not nodes
    assert nodes["conv1"].avg_ms == pytest.approx(0.1) and nodes["conv1"].first_ms == pytest.approx(0.9)
    assert nodes["conv1"].times_called == 1 and nodes["conv1"].node_type == "Conv"
    assert sum(r.percent for r in nodes.values()) == pytest.approx(100)
    types = {r.node_type: r for r in ort_op_profile(_trace([cold, warm, warm])) if r.kind == OP_TYPE}
    assert types["Conv"].avg_ms == pytest.approx(0.4) and types["Conv"].count == 2
    assert types["Gemm"].percent == pytest.approx(20)
    with pytest.raises(OrtProfileError):
        parse_ort_profile("not json")
    with pytest.raises(OrtProfileError):
        parse_ort_profile('{"events": 3}')


def test_a_hostile_profile_is_cut_to_the_slowest_rows_with_printable_names() -> None:
    rows = [OpProfileRow(kind=NODE, node_type="Conv", name=f"n{i}", avg_ms=float(i)) for i in range(5000)]
    rows += [OpProfileRow(kind=OP_TYPE, node_type=f"T{i}", avg_ms=float(i)) for i in range(500)]
    rows += [OpProfileRow(kind=NODE, node_type="\x1b[2Jevil\nline", name="x" * 10_000, avg_ms=1e9),
             OpProfileRow(kind=NODE, node_type="Conv", name="nan", avg_ms=math.nan),
             OpProfileRow(kind=NODE, node_type="Conv", name="neg", avg_ms=-1.0),
             OpProfileRow(kind="bogus", node_type="Conv", name="kind", avg_ms=1.0),
             OpProfileRow(kind=NODE, node_type="Conv", name="inf", avg_ms=1.0, percent=math.inf, count=True)]
    kept = bounded(rows)
    nodes, types = [r for r in kept if r.kind == NODE], [r for r in kept if r.kind == OP_TYPE]
    assert len(nodes) == MAX_NODES and len(types) == MAX_OP_TYPES
    assert nodes[0].avg_ms == 1e9 and "\x1b" not in nodes[0].node_type and "\n" not in nodes[0].node_type
    assert len(nodes[0].name) < 300
    assert [r.avg_ms for r in nodes[1:4]] == [4999.0, 4998.0, 4997.0]  # slowest first
    assert not {"nan", "neg", "kind"} & {r.name for r in kept}


def test_rows_a_sandboxed_run_wrote_are_checked_before_they_are_believed() -> None:
    good = {"kind": "node", "node_type": "Conv", "name": "c1", "avg_ms": 1.5}
    garbage = [None, 3, "x", {"kind": "node"}, {**good, "evil": 1}, {**good, "avg_ms": "fast"},
               {**good, "node_type": ["Conv"]}, {**good, "name": {"a": 1}}]
    assert [r.name for r in from_dicts([*garbage, good])] == ["c1"]
    assert from_dicts({"not": "a list"}) == [] and from_dicts(None) == []


def _op_table_over_latency(record: dict) -> float:
    """The op table's per-inference sum over the timed loop's average, for one run."""
    return sum(o["avg_ms"] for o in record["op_profile"] if o["kind"] == "op_type") / record["latency_ms"]["avg"]


def test_an_onnx_run_in_the_sim_has_throughput_startup_and_an_op_profile(tmp_path: Path, mobilenet_models,
                                                                           farm) -> None:
    os.symlink(mobilenet_models["mobilenetv2_w0.35_r96.onnx"], tmp_path / "m.onnx")
    job = write_job(tmp_path, """
models: [m.onnx]
workload: {type: benchmark, iterations: 20, warmup: 2, op_profiling: true}
matrix: {batch_sizes: [1, 3]}
""")
    run = farm("submit", str(job), "--json")
    assert run.returncode == 0, run.stderr + run.stdout[-2000:]
    records = farm("results", "1", "--ops", "--json").json()
    assert [r["batch_size"] for r in records] == [1, 3] and all(r["status"] == "completed" for r in records)
    for r in records:
        lat = r["latency_ms"]
        assert r["startup_ms"] == pytest.approx(lat["init"] + lat["first"], abs=2e-4)
        # measured over the loop's wall time, so never above what the per-inference average allows
        assert 0 < r["throughput_per_s"] <= 1000 / lat["avg"] * 1.001
        assert r["throughput_per_s"] > 1000 / lat["avg"] * 0.5
        assert r["samples_per_s"] == pytest.approx(r["throughput_per_s"] * r["batch_size"], rel=1e-3)
        types = {o["node_type"]: o for o in r["op_profile"] if o["kind"] == "op_type"}
        nodes = [o for o in r["op_profile"] if o["kind"] == "node"]
        assert "Conv" in types and "Gemm" in types and types["Conv"]["count"] >= 10
        assert sum(o["percent"] for o in types.values()) == pytest.approx(100, abs=0.01)
        assert 0 < len(nodes) <= MAX_NODES and all(o["name"] for o in nodes)
        assert nodes == sorted(nodes, key=lambda o: -o["avg_ms"])
    # the op table is the same per-inference time as the whole, within the profiler's own overhead. The profiled
    # pass comes after the timed loop and the contention watch does not cover it, so load on a shared machine can
    # make the two passes two machines: judged on the best of up to three jobs (a broken op table fails all three)
    ratios = [_op_table_over_latency(records[0])]
    while min(ratios) >= 1.5 and len(ratios) < 3:
        again = farm("submit", str(job), "--json")
        assert again.returncode == 0, again.stderr + again.stdout[-2000:]
        ratios.append(_op_table_over_latency(farm("results", str(again.json()["job"]), "--ops", "--json").json()[0]))
    assert min(ratios) < 1.5, f"op table ÷ timed average per job: {ratios}"
    plain = farm("results", "1").stdout
    table = farm("results", "1", "--ops").stdout
    assert "Conv" in table and "ms per inference" in table and "Conv" not in plain
    assert "op_profile" not in farm("results", "1", "--json").stdout  # only when asked: records stay small


def test_a_phones_op_tables_are_stored_and_shown(tmp_path: Path, tiny_models, farm) -> None:
    key = tmp_path / "lab" / "adbkey"
    load_or_create_lab_key(key)
    os.symlink(tiny_models["tflite"], tmp_path / "tiny.tflite")
    job = write_job(tmp_path, """
models: [tiny.tflite]
workload: {type: benchmark, iterations: 10, warmup: 1, op_profiling: true}
targets: [g6-1]
""")
    with AdbDeviceEmulator(tmp_path / "phone", authorized_keys=[Path(f"{key}.pub").read_text()]) as phone:
        devices = tmp_path / "lab.yaml"
        devices.write_text(f"devices:\n  - {{name: g6-1, driver: android, type: lg-g6, host: 127.0.0.1, "
                           f"port: {phone.port}, adb_key: {key}}}\n")
        run = farm("submit", str(job), "--devices", str(devices), "--json")
    assert run.returncode == 0, run.stderr + run.stdout[-2000:]
    records = {r["target"]: r for r in farm("results", "1", "--ops", "--json").json()}
    phone_run = records["g6-1"]
    assert "--enable_op_profiling=true" in _environment(tmp_path, phone_run["run"])["command"]
    # the emulator prints tables captured from a real run (tests/fixtures/benchmark_model/g_*)
    nodes = [o for o in phone_run["op_profile"] if o["kind"] == "node"]
    types = {o["node_type"]: o for o in phone_run["op_profile"] if o["kind"] == "op_type"}
    assert nodes[0] == {"kind": "node", "node_type": "Convolution (NHWC, QU8) GEMM", "name":
                        "Delegate/Convolution (NHWC, QU8) GEMM:3", "avg_ms": 0.338, "percent": 4.598,
                        "first_ms": 0.324, "count": None, "times_called": 1, "mem_kb": 0.0}
    assert "ModifyGraphWithDelegate" not in types  # the initialization tables are not the inference's
    assert phone_run["throughput_per_s"] == pytest.approx(1000 / 55.0432, rel=1e-4)
    assert phone_run["startup_ms"] == pytest.approx(18.777 + 64.791, rel=1e-4)
    # the sim twin runs the .tflite with LiteRT, which has no op profiler: it says so
    assert records["sim"]["op_profile"] == [] and "LiteRT" in records["sim"]["op_profile_note"]
    table = farm("results", "1", "--ops").stdout
    assert "Convolution (NHWC, QU8) GEMM" in table and "exposes no op profiler" in table
    store = Store(tmp_path / "farm.db")
    try:
        assert len(store.runs.op_profiles([phone_run["run"]])[phone_run["run"]]) == len(phone_run["op_profile"])
    finally:
        store.close()


def _environment(tmp_path: Path, run_id: int) -> dict:
    store = Store(tmp_path / "farm.db")
    try:
        return json.loads(store.query("SELECT environment_json FROM runs WHERE id = ?", [run_id])[0]["environment_json"])
    finally:
        store.close()


def test_op_profiles_cross_the_wire_to_a_controller_and_back(tmp_path: Path, mobilenet_models) -> None:
    from grpc_processes import Cluster, wait_for

    cluster = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(tmp_path / "none.toml")})
    try:
        os.symlink(mobilenet_models["mobilenetv2_w0.35_r96.onnx"], tmp_path / "m.onnx")
        job = write_job(tmp_path, "models: [m.onnx]\nworkload: {type: benchmark, iterations: 5, warmup: 1, "
                                  "op_profiling: true}\nmatrix: {batch_sizes: [2]}\nsim: {on_contention: flag}\n")
        cluster.start_controller("--no-auth")
        agent = cluster.start_agent("rack1")
        wait_for(lambda: "connected to controller" in agent.output(), 30, "the agent to connect")
        submitted = cluster.farm("submit", str(job), "--controller", cluster.address, "--json")
        assert submitted.returncode == 0, submitted.stderr
        (record,) = json.loads(cluster.farm("results", "1", "--ops", "--json", "--controller", cluster.address).stdout)
        assert record["status"] == "completed", record["message"]
        assert record["samples_per_s"] == pytest.approx(2 * record["throughput_per_s"], rel=1e-3)
        kinds = {o["kind"] for o in record["op_profile"]}
        assert kinds == {"node", "op_type"} and any(o["node_type"] == "Conv" for o in record["op_profile"])
        plain = json.loads(cluster.farm("results", "1", "--json", "--controller", cluster.address).stdout)
        assert "op_profile" not in plain[0]
        table = cluster.farm("results", "1", "--ops", "--controller", cluster.address).stdout
        assert "ms per inference" in table and "Conv" in table
    finally:
        cluster.stop_all()


def test_an_op_profile_is_bounded_on_the_wire_too() -> None:
    from farm.proto.generated import common_pb2
    from farm.proto.results import LatencyStats, RunResult, RunStatus
    from farm.proto.wire import result_for_the_wire, result_from_message

    rows = [OpProfileRow(kind=NODE, node_type="Conv", name=f"n{i}", avg_ms=float(i), first_ms=float(i), times_called=1)
            for i in range(10_000)]
    result = RunResult(status=RunStatus.COMPLETED, latency=LatencyStats(1, 2, 1, 1, 1, 1, 1, 0, 1, 1, 5),
                       throughput_per_s=1000.0, startup_ms=3.0, op_profile=rows)
    back = result_from_message(result_for_the_wire(result, common_pb2.RunResult()))
    assert len(back.op_profile) == MAX_NODES and back.op_profile[0] == rows[-1]
    assert back.throughput_per_s == 1000.0 and back.startup_ms == 3.0
    assert back.op_profile[0].count is None and back.op_profile[0].percent is None  # unset stays unset
