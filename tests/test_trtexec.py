"""TensorRT's trtexec (issue 29): the parser on real captured output of TensorRT 7.x–10.x (tests/fixtures/trtexec/),
and the tensorrt/dla units end to end on the sshd Jetson peer with a fake trtexec replaying that output: the engine
built once and then loaded from the board's cache, a crash mid-build and a cut summary as job failures with the
rest of the job kept."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest

from conftest import write_job
from farm.agents.parsers.trtexec import parse_export_times, parse_trtexec, summary_problem, version_from_code
from sshd_peer import SshdPeer

FIXTURES = Path(__file__).parent / "fixtures" / "trtexec"


def captured(name: str) -> str:
    return "\n".join(line for line in (FIXTURES / name).read_text().splitlines() if not line.startswith("# "))


def test_orin_nano_852_summary() -> None:
    out = parse_trtexec(captured("t1_orin_nano_8502.txt"))
    assert (out.status, out.version, out.throughput_qps, out.host_walltime_s) == ("PASSED", "8.5.2", 97.8649, 3.0348)
    lat, gpu = out.stats["Latency"], out.stats["GPU Compute Time"]
    assert (lat.min, lat.max, lat.mean, lat.median) == (10.642, 10.9861, 10.7971, 10.7972)
    assert lat.percentiles == {"90": 10.9329, "95": 10.949, "99": 10.9744}
    assert gpu.mean == 10.1824 and out.stats["H2D Latency"].mean == 0.316446 and out.stats["D2H Latency"].mean == 0.29821
    assert out.gpu_compute_total_s == 3.02418 and summary_problem(out) is None


def test_every_release_format() -> None:
    t2 = parse_trtexec(captured("t2_xavier_nx_80.txt"))  # 8.0–8.2: End-to-End line, one percentile
    assert t2.stats["End-to-End Host Latency"].mean == 0.586663 and t2.stats["Latency"].percentiles == {"99": 0.587769}
    t3 = parse_trtexec(captured("t3_agx_xavier_8400_batch16.txt"))
    assert (t3.version, t3.throughput_qps) == ("8.4.0", 41087.7)
    t7 = parse_trtexec(captured("t7_zero_transfers_84.txt"))
    assert t7.stats["H2D Latency"].mean == 0 and t7.stats["D2H Latency"].max == 0  # 0 ms is a reading
    assert t7.warnings == ["GPU compute time is unstable, with coefficient of variance = 2.10486%."]
    t5 = parse_trtexec(captured("t5_rtx3070_100900.txt"))  # 10.9: a build, then the benchmark
    assert (t5.version, t5.device, t5.engine_build_s, t5.engine_size_mib) == ("10.9.0", "NVIDIA GeForce RTX 3070", 104.774, 231.019)
    assert t5.engine_load_s == 0.21022 and t5.queries == 29 and t5.status == "PASSED"
    legacy = parse_trtexec(captured("t8_legacy_7x.txt"))
    assert "TensorRT 7.x" in (summary_problem(legacy) or "")


def test_profile_tables_both_layouts() -> None:
    p1 = parse_trtexec(captured("p1_profile_xavier_nx_8502.txt"))  # name first, no summary (profile in the same run)
    assert p1.summary_skipped_for_profile and p1.profile_iterations == 309 and summary_problem(p1) is None
    assert p1.profile[2].layer == "Reformatting CopyNode for Input Tensor 0 to conv1 + PWN(re_lu_clip)"
    assert (p1.profile[4].avg_ms, p1.profile[4].median_ms, p1.profile[4].percent) == (6.8952, 6.2962, 69.4)
    assert p1.profile_total_ms == 9.9309 and all(r.layer != "Total" for r in p1.profile)
    p2 = parse_trtexec(captured("p2_profile_rtx3080_8601.txt"))  # 8.6: numbers first, name last
    assert p2.profile[0].layer == "{ForeignNode[771 + (Unnamed Layer* 1) [Shuffle]...dummy_gather_]}"
    assert p2.profile[0].total_ms == 486.12 and p2.profile[3].layer == "Conv_311 || Conv_308 || Conv_307"


def test_dla_placement_build_and_load_lines() -> None:
    dla = parse_trtexec(captured("dla_orin_86.txt") + "\n" + captured("dla_layers_orin.txt"))
    assert dla.dla_fallbacks == ["/model.24/Constant_1_output_0", "(Unnamed Layer* 277) [Shuffle]"]
    assert (dla.layers_on_dla, dla.layers_on_gpu) == (2, 2)
    old = parse_trtexec(" [W] [TRT] Default DLA is enabled but layer Embedding matrix is not supported on DLA, "
                        "falling back to GPU.")
    assert old.dla_fallbacks == ["Embedding matrix"]
    build = parse_trtexec(captured("build_dla_8502.txt"))
    assert build.engine_build_s == 14.6812 and "engine build" in (summary_problem(build) or "")
    load = parse_trtexec(captured("load_xavier_nx_8502.txt"))
    assert load.engine_load_s == 0.0366376 and load.engine_size_mib == 28
    fp16 = parse_trtexec("[02/26/2022-09:33:14] [TRT] [W] FP16 support requested on hardware without native FP16 "
                         "support, performance will be negatively affected.")
    assert fp16.precision_not_native == ["FP16"]


@pytest.mark.parametrize("text, problem", [
    ("[05/10/2024-12:24:57] [E] Engine set up failed\n&&&& FAILED TensorRT.trtexec [TensorRT v8502] # trtexec",
     "trtexec failed: Engine set up failed"),
    ("&&&& RUNNING TensorRT.trtexec [TensorRT v8502] # trtexec\n[05/10/2024-12:24:57] [I] Engine built in 14.6812 sec.",
     "no performance summary (it stopped after an engine build; cut short or killed)"),
    ("", "no performance summary"),
    ("[I] Latency: min = nan ms, max = inf ms, mean = -1 ms, median = 1e999 ms", "without its PASSED line"),
])
def test_failures_say_what_was_seen(text: str, problem: str) -> None:
    assert problem in (summary_problem(parse_trtexec(text)) or "")


def test_versions_and_export_times() -> None:
    assert [version_from_code(c) for c in ("8502", "8400", "100900", "101401")] == ["8.5.2", "8.4.0", "10.9.0", "10.14.1"]
    times = parse_export_times((FIXTURES / "export_times_orin_nano_103.json").read_text())
    assert times == [3.06689, 3.0545]
    assert parse_export_times("not json") == [] and parse_export_times('{"a": 1}') == []
    assert parse_export_times('[{"latencyMs": "x"}, {"latencyMs": -1}, {"latencyMs": 1e999}, 7, {"latencyMs": 2}]') == [2.0]


def jetson_lab(board: SshdPeer, tmp_path: Path) -> Path:
    """The peer as a Jetson whose farm folder (runs, models, the engine cache) is this test's own."""
    lab = tmp_path / "lab.yaml"
    lab.write_text("devices:\n" + board.jetson_lab_entry() + f"    remote_dir: {tmp_path / 'board'}\n")
    return lab


def test_tensorrt_on_the_jetson_peer_builds_once_then_loads(board: SshdPeer, tmp_path: Path, tiny_models, farm) -> None:
    import onnx
    for name in ("tiny", "crash", "truncated"):  # three files (three hashes, three engines) of the same tiny net
        model = onnx.load(str(tiny_models["onnx"]))
        model.doc_string = f"farm-test:{name}"  # what the fake trtexec reads to misbehave
        onnx.save(model, str(tmp_path / f"{name}.onnx"))
    job = write_job(tmp_path, """
models: [tiny.onnx, crash.onnx, truncated.onnx]
workload: {type: benchmark, iterations: 40, warmup: 1}
matrix: {accelerators: ["tensorrt:fp16"]}
repeats: 2
targets: [nano-1]
sim: {on_contention: flag}
""")
    run = farm("submit", str(job), "--devices", str(jetson_lab(board, tmp_path)), "--json")
    assert run.returncode == 1, run.stderr[-2000:]  # two models fail, the rest of the job stands
    records = [r for r in farm("results", "1", "--runs", "--json").json() if r["target"] == "nano-1"]
    by_model: dict[str, list] = {}
    for r in records:
        by_model.setdefault(r["model"]["name"], []).append(r)
    good = sorted(by_model["tiny"], key=lambda r: r["repeat"])
    assert [r["status"] for r in good] == ["completed", "completed"]
    assert all(r["accelerator"] == "tensorrt:fp16" and r["runtime"] == "tensorrt" for r in good)
    # each timed inference from --exportTimes (the captured Orin Nano records, cycled to 40)
    assert good[0]["latency_ms"]["count"] == 40 and good[0]["latency_ms"]["avg"] == pytest.approx((3.06689 + 3.0545) / 2, abs=1e-4)  # records round to 4 places
    assert good[0]["throughput_per_s"] == pytest.approx(97.8649, abs=1e-3)  # trtexec's own qps, as records round it
    assert good[0]["energy_per_inference_mj"] > 0  # tegrastats' rails over the run
    envs = [json.loads(e) for (e,) in sqlite3.connect(tmp_path / "farm.db").execute(
        "SELECT r.environment_json FROM runs r JOIN tasks t ON t.id = r.task_id WHERE t.target = 'nano-1' "
        "AND t.model_name = 'tiny' ORDER BY t.repeat")]
    first, second = (e["trtexec"] for e in envs)
    assert (first["engine_cached"], first["engine_build_s"]) == (False, 14.6812)
    assert (second["engine_cached"], second["engine_load_s"]) == (True, 0.0366376)
    assert "--fp16" in envs[0]["command"] and "--loadEngine=" in envs[1]["command"]
    assert first["gpu_compute_ms"] == 10.1824 and first["h2d_ms"] == 0.316446 and first["version"] == "8.5.2"

    crash = by_model["crash"][0]
    assert crash["status"] == "failed" and crash["failure_class"] == "job"
    assert "building the engine" in crash["message"] and "no performance summary" in crash["message"]
    cut = by_model["truncated"][0]
    assert cut["failure_class"] == "job" and "without its PASSED line" in cut["message"]
    # no half engine was left by the crash: the board's cache holds the good model's engine only
    cached = sorted(p.name.split("-")[1:] for p in (tmp_path / "board" / "engines").iterdir())
    assert cached == [["tensorrt", "fp16", p.name.split("-")[-1]] for p in (tmp_path / "board" / "engines").iterdir()]
    assert len(cached) == 1  # the good model's engine: none for the crash, no .part left anywhere


def test_a_tensorrt_cell_on_a_board_without_trtexec_is_the_jobs(board: SshdPeer, tmp_path: Path, tiny_models, farm) -> None:
    os.symlink(tiny_models["onnx"], tmp_path / "tiny.onnx")
    lab = tmp_path / "lab.yaml"
    lab.write_text("devices:\n" + board.jetson_lab_entry())
    job = write_job(tmp_path, """
models: [tiny.onnx]
workload: {type: benchmark, iterations: 5, warmup: 0}
matrix: {accelerators: [dla]}
targets: [nano-1]
""")
    refused = farm("submit", str(job), "--devices", str(lab))
    assert refused.returncode == 2 and "nano-1 has no dla" in refused.stderr
