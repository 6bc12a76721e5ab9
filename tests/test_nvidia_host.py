"""A Linux host with an NVIDIA GPU as a device (issue 29): the `nvidia` driver on this host (`host: local`) and over
ssh (the sshd board peer), sampled by a fake `nvidia-smi` that replays real captured rows (tests/fake_jetson_bin);
`matrix.accelerators` cells a device lacks refused at submit or skipped; the unit in results, pairs and devices."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import pytest

from conftest import write_job
from sshd_peer import FAKE_JETSON_BIN, SshdPeer

FAKE_PATH = {"PATH": f"{FAKE_JETSON_BIN}:{os.environ.get('PATH', '')}"}


def local_lab(tmp_path: Path) -> Path:
    lab = tmp_path / "lab.yaml"
    lab.write_text(f"""
devices:
  - name: gpu-1
    driver: nvidia
    type: nvidia-gpu-host
    host: local
    python: {sys.executable}
    telemetry: nvidia-smi
""")
    return lab


def test_a_gpu_host_runs_its_cells_and_a_missing_provider_is_the_jobs(tmp_path: Path, tiny_models, farm) -> None:
    os.symlink(tiny_models["onnx"], tmp_path / "tiny.onnx")
    job = write_job(tmp_path, """
models: [tiny.onnx]
workload: {type: benchmark, iterations: 20, warmup: 1}
matrix: {accelerators: [cpu, cuda]}
targets: [gpu-1]
sim: {on_contention: flag}
""")
    run = farm("submit", str(job), "--devices", str(local_lab(tmp_path)), "--json", env=FAKE_PATH)
    assert run.returncode == 1, run.stderr[-2000:]  # the cuda cell failed, the rest of the job stands
    records = {(r["target"], r["accelerator"]): r for r in farm("results", "1", "--json").json()}
    assert set(records) == {("gpu-1", "cpu"), ("gpu-1", "cuda"), ("sim", "cpu")}
    cpu, cuda = records[("gpu-1", "cpu")], records[("gpu-1", "cuda")]
    assert cpu["status"] == "completed" and cpu["latency_ms"]["avg"] > 0
    # onnxruntime here has no CUDA provider: a job failure that says so, never a CPU figure under `cuda`
    assert cuda["status"] == "failed" and cuda["failure_class"] == "job"
    assert "CUDAExecutionProvider" in cuda["message"] and "onnxruntime-gpu" in cuda["message"]
    assert cuda["latency_ms"] is None
    # the GPU's figures, from the replayed H100 rows: the loaded row's power and memory, energy integrated
    gpu = cpu["gpu"]
    assert gpu["name"] == "NVIDIA H100 80GB HBM3" and gpu["power_peak_w"] == 631.95 and gpu["memory_peak_mib"] == 19818
    assert gpu["energy_source"] == "integrated_power" and gpu["energy_mj"] > 0 and gpu["samples"] >= 1
    assert cpu["energy_per_inference_mj"] > 0
    assert cpu["gpu_memory_peak_mb"] == 19818.0  # a declared figure (proto/results.py): stored in its own column
    assert "gpu" not in records[("sim", "cpu")] and "gpu_memory_peak_mb" not in records[("sim", "cpu")]
    pairs = farm("results", "1", "--pairs", "--json").json()
    assert [(p["device"], p["device_run"]["accelerator"], p["sim"]["accelerator"]) for p in pairs] == [
        ("gpu-1", "cpu", "cpu")]  # the failed cuda run has no pair; each device cell has a twin of its own
    table = farm("results", "1", env={"COLUMNS": "200"})
    assert "cuda" in table.stdout and "GPU W" in table.stdout

    # the dashboard's job page and the report name the unit of every row
    from farm.controller.store import open_store
    from farm.web.pages import job_page
    from farm.web.views import job_view
    store = open_store(str(tmp_path / "farm.db"))
    try:
        view = job_view(store, 1)
        assert view is not None
        page = job_page(view, csrf="x", may_cancel=False)
    finally:
        store.close()
    assert '<th' in page and ">unit<" in page and ">cuda<" in page
    report = farm("report", "1", "-o", str(tmp_path / "report.html"))
    assert report.returncode == 0, report.stderr
    html = (tmp_path / "report.html").read_text()
    assert "<th>unit</th>" in html and "<td>cuda</td>" in html and "GPU power avg/peak (W)" in html

    devices = farm("devices", "--devices", str(local_lab(tmp_path)), "--json").json()
    assert devices[0]["units"] == ["cpu", "cuda", "tensorrt"] and devices[0]["driver"] == "nvidia"


def test_cells_a_target_lacks_are_refused_at_submit_or_skipped(tmp_path: Path, tiny_models, farm) -> None:
    os.symlink(tiny_models["onnx"], tmp_path / "tiny.onnx")
    lab = str(local_lab(tmp_path))
    sim_gpu = write_job(tmp_path, "models: [tiny.onnx]\nmatrix: {accelerators: [cuda]}\n", "sim.yaml")
    refused = farm("submit", str(sim_gpu), "--devices", lab)
    assert refused.returncode == 2
    assert "matrix.accelerators[0]" in refused.stderr and "the sim is a CPU" in refused.stderr
    unknown = write_job(tmp_path, "models: [tiny.onnx]\nmatrix: {accelerators: [cpu, tpu]}\n", "unknown.yaml")
    bad = farm("submit", str(unknown), "--devices", lab)
    assert bad.returncode == 2 and "unknown compute unit 'tpu'" in bad.stderr and "matrix.accelerators" in bad.stderr
    precision = write_job(tmp_path, "models: [tiny.onnx]\nmatrix: {accelerators: ['hexagon:fp32']}\n", "p.yaml")
    bad = farm("submit", str(precision), "--devices", lab)
    assert bad.returncode == 2 and "hexagon cannot be asked for fp32" in bad.stderr

    dla = write_job(tmp_path, """
models: [tiny.onnx]
workload: {iterations: 5, warmup: 0}
matrix: {accelerators: [cpu, dla]}
targets: [gpu-1]
sim: {on_contention: flag}
""", "dla.yaml")
    refused = farm("submit", str(dla), "--devices", lab, env=FAKE_PATH)
    assert refused.returncode == 2 and "gpu-1 has no dla" in refused.stderr and "--skip-invalid" in refused.stderr
    assert farm("jobs", "--json").json() == []  # nothing stored
    skipped = farm("submit", str(dla), "--devices", lab, "--skip-invalid", "--json", env=FAKE_PATH)
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert "gpu-1 has no dla" in skipped.stderr  # said, then the cells it can run are run
    assert "dla:fp32" not in skipped.stderr  # a DLA computes in fp16 unless told int8
    assert sorted((r["target"], r["accelerator"]) for r in skipped.json()["results"]) == [("gpu-1", "cpu"), ("sim", "cpu")]


def test_a_gpu_host_over_ssh_tells_a_script_its_unit(board: SshdPeer, tmp_path: Path, tiny_models, farm) -> None:
    """The same driver over ssh (the board peer, whose PATH has the fake nvidia-smi): a script is told the unit of
    its cell, and its sim twin is told cpu."""
    os.symlink(tiny_models["onnx"], tmp_path / "tiny.onnx")
    (tmp_path / "script").mkdir()
    (tmp_path / "script" / "infer.py").write_text(
        "import json, sys\nunit, precision = sys.argv[1], sys.argv[2]\n"
        "for _ in range(5):\n"
        "    print(json.dumps({'latency_ms': {'cuda': 1.0, 'cpu': 3.0}[unit] * (0.5 if precision == 'fp16' else 1)}))\n")
    lab = tmp_path / "lab.yaml"
    lab.write_text(f"""
devices:
  - name: box-1
    driver: nvidia
    type: nvidia-gpu-host
    host: {board.host}
    port: {board.port}
    username: {board.username}
    ssh_key: {board.client_key}
    known_hosts: {board.known_hosts}
    python: {sys.executable}
    telemetry: nvidia-smi
""")
    job = write_job(tmp_path, """
models: [tiny.onnx]
workload: {type: script, script: infer.py, dir: script, args: ["{accelerator}", "{precision}"]}
matrix: {accelerators: [cuda, "cuda:fp16"]}
targets: [box-1]
sim: {on_contention: flag}
""")
    run = farm("submit", str(job), "--devices", str(lab), "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    pairs = farm("results", "1", "--pairs", "--json").json()
    seen = sorted((p["device_run"]["accelerator"], p["device_run"]["latency_ms"]["avg"], p["sim"]["latency_ms"]["avg"])
                  for p in pairs)
    assert seen == [("cuda", 1.0, 3.0), ("cuda:fp16", 0.5, 3.0)]
    assert all(p["device_run"]["gpu"]["power_peak_w"] == 631.95 for p in pairs)
    stored = farm("results", "1", "--json").json()
    assert {r["accelerator"] for r in stored if r["target"] == "sim"} == {"cpu"}


@pytest.mark.parametrize("entry, message", [
    ("    host: 10.0.0.9\n", "username and ssh_key are needed"),
    ("    host: local\n    telemetry: jtop\n", "telemetry 'jtop' is not one of the nvidia driver's"),
    ("    host: local\n    gpu: -1\n", "gpu"),
])
def test_bad_nvidia_entries_name_the_field(tmp_path: Path, tiny_models, farm, entry: str, message: str) -> None:
    os.symlink(tiny_models["onnx"], tmp_path / "tiny.onnx")
    lab = tmp_path / "lab.yaml"
    lab.write_text("devices:\n  - name: gpu-1\n    driver: nvidia\n" + entry)
    job = write_job(tmp_path, "models: [tiny.onnx]\ntargets: [gpu-1]\n")
    run = farm("submit", str(job), "--devices", str(lab))
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_the_wire_carries_the_unit_and_older_tasks_read_as_cpu() -> None:
    from farm.proto.generated import common_pb2
    from farm.proto.spec import BenchmarkWorkload, SimBudget
    from farm.proto.tasks import TaskPlan, TaskSpec
    from farm.proto.wire import task_from_message, task_to_message

    plan = TaskPlan(workload=BenchmarkWorkload(), sim=SimBudget(), run_timeout_s=60, base_dir="/",
                    accelerator="tensorrt", precision="int8")
    task = TaskSpec(task_id=1, job_id=1, attempt=1, target="gpu-1", model_name="m", model_path="/m.onnx",
                    model_sha256="0" * 64, model_family=None, threads=1, batch_size=1, input_size=None, repeat=0,
                    plan=plan)
    message = task_to_message(task, common_pb2.TaskSpec())
    back = task_from_message(message)
    assert (back.plan.accelerator, back.plan.precision) == ("tensorrt", "int8")
    cpu = task_to_message(task.model_copy(update={"plan": plan.model_copy(update={"accelerator": "cpu",
                                                                                  "precision": "fp32"})}),
                          common_pb2.TaskSpec())
    assert json.loads(cpu.extra_json or "{}") == {}  # what an agent of an earlier version reads: nothing new
    assert task_from_message(cpu).plan.accelerator == "cpu"


def test_a_units_calibration_is_keyed_apart_from_the_cpus(tmp_path: Path, tiny_models, farm) -> None:
    """A cpu cell and a cuda cell of the same models on one device are two calibrations, the cuda one keyed by its
    unit (runtime@unit=cuda): a sim → gpu pair is a fit of its own, never pooled with the CPU's."""
    import onnx

    for i in range(5):
        model = onnx.load(str(tiny_models["onnx"]))
        model.doc_string = "x" * (1000 * (i + 1))  # five sizes: five latencies for the script below
        onnx.save(model, str(tmp_path / f"m{i}.onnx"))
    (tmp_path / "script").mkdir()
    (tmp_path / "script" / "infer.py").write_text(
        "import json, os, sys\nsize = os.path.getsize(sys.argv[1])\n"
        "scale = {'cpu': 1.0, 'cuda': 0.1}[sys.argv[2]]\n"
        "for _ in range(5):\n    print(json.dumps({'latency_ms': size / 1000 * scale}))\n")
    job = write_job(tmp_path, """
models: [m0.onnx, m1.onnx, m2.onnx, m3.onnx, m4.onnx]
workload: {type: script, script: infer.py, dir: script, args: ["{model}", "{accelerator}"]}
matrix: {accelerators: [cpu, cuda]}
targets: [gpu-1]
sim: {on_contention: flag}
""")
    run = farm("submit", str(job), "--devices", str(local_lab(tmp_path)), "--json", env=FAKE_PATH)
    assert run.returncode == 0, run.stderr[-2000:]
    cal = farm("calibrate", "--job", "1", "--device", "gpu-1", "--metric", "latency", "--include-contended", "--json")
    assert cal.returncode == 0, cal.stderr[-2000:]
    assert len(cal.json()["calibrations"]) == 2
    slopes = {c["runtime"]: c["a"] for c in farm("calibrations", "--json").json()}
    arch = platform.machine()
    assert slopes == {f"script@arch={arch}": pytest.approx(1.0), f"script@arch={arch};unit=cuda": pytest.approx(0.1)}
    table = farm("calibrations", env={"COLUMNS": "200"}).stdout
    assert "unit" in table and "cuda" in table
