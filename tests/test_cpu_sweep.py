"""Sweeping the sim's CPU budget in one job (matrix.cpus): each run gets its budget, and a job
that would set it twice, or ask it of a device's twin, is refused naming the field and line."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import write_job


def test_each_run_gets_its_swept_cpu_budget(tmp_path: Path, tiny_models, farm) -> None:
    os.symlink(tiny_models["onnx"], tmp_path / "tiny.onnx")
    job = write_job(tmp_path, """
models: [tiny.onnx]
workload: {type: benchmark, iterations: 5, warmup: 1}
matrix: {threads: [1], cpus: [0.5, 1, null]}
sim: {memory: 512m}
""")
    run = farm("submit", str(job), "--json")
    assert run.returncode == 0, run.stderr + run.stdout[-2000:]
    records = run.json()["results"]
    assert sorted(r["cpus"] for r in records) == [0.5, 1, 1]  # null: one core per thread
    assert sorted(r["limits"]["cpus"] for r in records) == [0.5, 1, 1]
    assert len({r["pair_key"] for r in records}) == 3  # three cells, not three repeats of one
    assert all(r["status"] == "completed" for r in records)


def test_a_cpu_sweep_beside_sim_cpus_or_a_device_is_refused(tmp_path: Path, tiny_models, farm) -> None:
    os.symlink(tiny_models["onnx"], tmp_path / "tiny.onnx")
    twice = write_job(tmp_path, "models: [tiny.onnx]\nmatrix:\n  cpus: [1, 2]\nsim: {cpus: 1}\n", "twice.yaml")
    run = farm("submit", str(twice), "--json")
    assert run.returncode == 2
    problem = run.json()["problems"][0]
    assert problem["field"] == "matrix.cpus" and problem["line"] == 3 and "sim.cpus" in problem["message"]

    devices = tmp_path / "lab.yaml"
    devices.write_text("devices:\n  - {name: g6-1, driver: android, type: lg-g6, host: 127.0.0.1, port: 1, "
                       f"adb_key: {tmp_path / 'key'}}}\n")
    twin = write_job(tmp_path, "models: [tiny.onnx]\nmatrix: {cpus: [1, 2]}\ntargets: [g6-1]\n", "twin.yaml")
    run = farm("submit", str(twin), "--devices", str(devices), "--json")
    assert run.returncode == 2 and "g6-1" in run.json()["error"] and "targets: [sim]" in run.json()["error"]

    for bad, why in (("[]", "at least one"), ("[0]", "above 0"), ("[.nan]", "above 0"), ("[1, 1]", "twice")):
        path = write_job(tmp_path, f"models: [tiny.onnx]\nmatrix: {{cpus: {bad}}}\n", "bad.yaml")
        run = farm("submit", str(path), "--json")
        assert run.returncode == 2 and why in run.stdout, (bad, run.stdout)


def test_sweep_cells_an_onnx_model_cannot_run_are_named_before_they_run(tmp_path: Path, tiny_models,
                                                                        mobilenet_models, farm) -> None:
    os.symlink(tiny_models["onnx"], tmp_path / "tiny.onnx")  # fixed (1, 3, 8, 8)
    os.symlink(mobilenet_models["mobilenetv2_w0.35_r96.onnx"], tmp_path / "m.onnx")  # any batch, 96x96
    job = write_job(tmp_path, """
models: [tiny.onnx, m.onnx]
workload: {type: benchmark, iterations: 2, warmup: 1}
matrix:
  batch_sizes: [1, 2]
  input_sizes: [null]
""")
    run = farm("submit", str(job), "--json")
    warnings = run.json()["warnings"]
    assert [(w["field"], w["line"]) for w in warnings] == [("matrix.batch_sizes", 5)]
    assert "tiny.onnx has a fixed batch of 1" in warnings[0]["message"] and "batch 2" in warnings[0]["message"]
    by_cell = {(r["model"]["name"], r["batch_size"]): r["status"] for r in run.json()["results"]}
    # the generated MobileNetV2 takes any batch; the warned cell fails as the warning said
    assert by_cell == {("tiny", 1): "completed", ("tiny", 2): "failed", ("mobilenetv2_w0.35_r96", 1): "completed",
                       ("mobilenetv2_w0.35_r96", 2): "completed"}
    assert run.returncode == 1
