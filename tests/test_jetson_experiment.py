"""examples/jetson-experiment.yaml, the published Jetson Nano experiment, run end to end against
the Jetson-like ssh peer: every script run on the board comes back beside its sim twin with
whole-script runtime and average and peak memory on both sides, ready to calibrate."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import yaml

from farm.models.mobilenetv2 import model_name
from farm.models.zoo import zoo_models
from farm.proto.spec import JobSpec
from grpc_processes import Cluster, wait_for
from sshd_peer import SshdPeer

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _lab(tmp_path: Path, board: SshdPeer) -> Path:
    lab = tmp_path / "lab.yaml"
    lab.write_text(f"""
devices:
  - name: nano-1
    driver: jetson
    type: jetson-nano
    host: {board.host}
    port: {board.port}
    username: {board.username}
    ssh_key: {board.client_key}
    known_hosts: {board.known_hosts}
    python: {sys.executable}
    nv_tegra_release: {board.fake_bin / 'nv_tegra_release'}
    device_tree_model: {board.fake_bin / 'device_tree_model'}
""")
    return lab


def _example_with(tmp_path: Path, models: dict[str, Path]) -> Path:
    """The example as published, its five zoo models swapped for small ones (the same script, matrix,
    repeats, targets and budget; the zoo's ResNet-50 on one contended CPU would take minutes here)."""
    spec = yaml.safe_load((EXAMPLES / "jetson-experiment.yaml").read_text())
    shutil.copytree(EXAMPLES / "jetson-experiment", tmp_path / "jetson-experiment")
    (tmp_path / "models").mkdir()
    for name, path in models.items():
        os.symlink(path, tmp_path / "models" / name)
    spec["models"] = [{"path": f"models/{name}", "family": "image"} for name in models]
    job = tmp_path / "jetson-experiment.yaml"
    job.write_text(yaml.safe_dump(spec))
    return job


def test_the_example_is_the_published_setup() -> None:
    spec = JobSpec.model_validate(yaml.safe_load((EXAMPLES / "jetson-experiment.yaml").read_text()))
    assert spec.workload.type == "script" and spec.workload.script == "infer.py"
    assert spec.matrix.threads == [1] and spec.sim.cpus == 1 and spec.sim.memory == 4 << 30
    assert spec.targets == ["type:jetson-nano"]
    assert (EXAMPLES / spec.workload.dir / spec.workload.script).is_file()
    # every model is one `make models` writes (the Makefile's widths and sizes, plus the zoo)
    import re
    found = re.search(r"models generate examples/models --widths (\S+) --sizes (\S+)", (EXAMPLES.parent / "Makefile").read_text())
    assert found, "the Makefile's models target no longer generates examples/models"
    widths, sizes = [float(w) for w in found[1].split(",")], [int(x) for x in found[2].split(",")]
    make_models = {f"{model_name(w, size)}.{fmt}" for w in widths for size in sizes
                   for fmt in ("tflite", "onnx")} | {f"{name}.onnx" for name in zoo_models()}
    for entry in spec.models:
        assert Path(entry.path).parent == Path("models") and Path(entry.path).name in make_models, entry.path


def test_the_jetson_experiment_runs_end_to_end_paired(board: SshdPeer, mobilenet_models, tmp_path: Path,
                                                      farm) -> None:
    job = _example_with(tmp_path, {name: mobilenet_models[name] for name in
                                   ("mobilenetv2_w0.35_r96.onnx", "mobilenetv2_w1.0_r96.onnx")})
    run = farm("submit", str(job), "--devices", str(_lab(tmp_path, board)), "--json")
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    records = run.json()["results"]
    assert len(records) == 2 * 3 * 2  # models × repeats × (board + sim twin)
    assert all(r["status"] == "completed" for r in records), [r["message"] for r in records]

    pairs = farm("results", "1", "--pairs", "--json").json()
    assert len(pairs) == 6
    for p in pairs:
        board_run, sim = p["device_run"], p["sim"]
        assert board_run["backend"] == "jetson" and sim["backend"] in ("cgroup", "docker", "process")
        assert sim["limits"]["cpus"] == 1 and sim["limits"]["memory_mb"] == 4096  # the Nano's budget
        for side in (board_run, sim):
            assert side["whole_run_s"] > 0 and side["latency_ms"]["count"] == 50  # 50 images, one per line
            assert side["avg_memory_mb"] > 0 and side["peak_memory_mb"] >= side["avg_memory_mb"]
        assert board_run["energy_per_inference_mj"] > 0  # the fake Nano's power rails
    table = farm("results", "1", "--pairs").stdout
    assert "nano-1" in table
    # the pairs go to calibration on the experiment's metrics: two models are too few, and it says so
    # (contended twins counted too: on a busy test machine the sim's honest contention flag is not the point here)
    cal = farm("calibrate", "--job", "1", "--device", "nano-1", "--metric", "whole_run", "--metric", "avg_memory",
               "--metric", "peak_memory", "--include-contended", "--json")
    refused = cal.json()["refused"]
    assert cal.returncode == 1 and len(refused) == 3, cal.stdout + cal.stderr
    assert all("at least 4" in r and "have 2" in r for r in refused), refused
    assert {r.split()[1] for r in refused} == {"whole_run", "avg_memory", "peak_memory"}


def test_the_jetson_experiment_through_a_controller_and_a_remote_agent(board: SshdPeer, mobilenet_models,
                                                                      tmp_path: Path) -> None:
    """`farm agent --devices lab.yaml` on a rack host: the script folder goes client → controller → agent
    → board, each hop by content hash."""
    job = _example_with(tmp_path, {"mobilenetv2_w0.35_r96.onnx": mobilenet_models["mobilenetv2_w0.35_r96.onnx"]})
    cluster = Cluster(tmp_path, {"FARM_DB": str(tmp_path / "client.db")})
    try:
        cluster.start_controller("--no-auth")
        agent = cluster.start_agent("rack1", "--devices", str(_lab(tmp_path, board)))
        wait_for(lambda: "connected to controller" in agent.output(), 30, "the agent to connect")
        run = cluster.farm("submit", str(job), "--controller", cluster.address, "--json", timeout=400)
        assert run.returncode == 0, run.stderr[-3000:] + agent.output()[-3000:]
    finally:
        cluster.stop_all()
    records = json.loads(run.stdout)["results"]
    assert len(records) == 3 * 2 and all(r["status"] == "completed" for r in records), records
    board_runs = [r for r in records if r["target"] == "nano-1"]
    assert all(r["backend"] == "jetson" and r["whole_run_s"] > 0 for r in board_runs)
    assert {r["pair_key"] for r in board_runs} == {r["pair_key"] for r in records if r["target"] == "sim"}
