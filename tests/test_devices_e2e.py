"""One job on an emulated phone and a Jetson-like ssh host: every device run comes back beside
its sim twin (the same model, cell and repeat, in the sim with that device type's budget)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from adb_emulator import AdbDeviceEmulator
from conftest import write_job
from farm.agents.android.adb import load_or_create_lab_key
from sshd_peer import SshdPeer


@pytest.fixture
def lab(tmp_path: Path, board: SshdPeer) -> Iterator[Path]:
    key = tmp_path / "lab" / "adbkey"
    load_or_create_lab_key(key)
    with AdbDeviceEmulator(tmp_path / "phone", authorized_keys=[Path(f"{key}.pub").read_text()]) as phone:
        devices = tmp_path / "lab.yaml"
        devices.write_text(f"""
devices:
  - name: g6-1
    driver: android
    type: lg-g6
    tags: [phones]
    host: 127.0.0.1
    port: {phone.port}
    adb_key: {key}
{board.jetson_lab_entry()}""")
        yield devices


def test_a_pair_for_every_model_threads_and_repeat(lab: Path, mobilenet_models, tmp_path: Path, farm) -> None:
    for name in ("mobilenetv2_w0.35_r96.tflite", "mobilenetv2_w1.0_r96.tflite"):
        os.symlink(mobilenet_models[name], tmp_path / name)
    job = write_job(tmp_path, """
models: ['mobilenetv2_w*_r96.tflite']
workload: {type: benchmark, iterations: 20, warmup: 2}
matrix: {threads: [1, 2]}
repeats: 2
targets: [tag:phones, nano-1]
""")
    run = farm("submit", str(job), "--devices", str(lab), "--json")
    assert run.returncode == 0, run.stderr + run.stdout[-2000:]
    records = run.json()["results"]
    assert len(records) == 2 * 2 * 2 * 2 * 2  # models × threads × repeats × devices × (device + sim twin)

    pairs = farm("results", "1", "--pairs", "--json").json()
    assert len(pairs) == 16
    assert {(p["model"]["name"], p["threads"], p["repeat"], p["device"]) for p in pairs} == {
        (m, t, r, d) for m in ("mobilenetv2_w0.35_r96", "mobilenetv2_w1.0_r96") for t in (1, 2) for r in (0, 1)
        for d in ("g6-1", "nano-1")}
    for p in pairs:
        assert p["sim"]["backend"] in ("cgroup", "docker", "process")
        # the twin ran with the device type's budget: 1/2 CPUs for 1/2 threads, 2 GB (G6) or the Nano's 4 GB
        assert p["sim"]["limits"]["cpus"] == p["threads"]
        assert p["sim"]["limits"]["memory_mb"] == (2048 if p["device"] == "g6-1" else 4096)
        assert p["device_run"]["backend"] == ("android" if p["device"] == "g6-1" else "jetson")
        assert p["device_run"]["latency_ms"]["avg"] > 0

    # the device's own facts are stored with every run on it
    import json
    import sqlite3
    envs = [json.loads(e) for (e,) in sqlite3.connect(tmp_path / "farm.db").execute(
        "SELECT r.environment_json FROM runs r JOIN tasks t ON t.id = r.task_id WHERE t.target = 'g6-1'")]
    assert envs and all(e["device"]["model"] == "LG-H870" and e["device"]["abi"] == "arm64-v8a" for e in envs)
    jetson = [json.loads(e) for (e,) in sqlite3.connect(tmp_path / "farm.db").execute(
        "SELECT r.environment_json FROM runs r JOIN tasks t ON t.id = r.task_id WHERE t.target = 'nano-1'")]
    assert all(e["device"]["nvpmodel_mode"] == "MAXN" for e in jetson)

    # the pairs go straight to calibration: two models are too few, and it says how many it has
    cal = farm("calibrate", "--job", "1", "--device", "g6-1", "--include-contended", "--json")  # a busy host flags twins
    assert cal.returncode == 1
    refused = cal.json()["refused"]
    assert len(refused) == 2 and all("at least 4" in r and "have 2" in r for r in refused)

    # the Jetson's power mode is part of its calibration key: with enough models it is fitted per mode,
    from farm.controller.analysis.calibrations import pair_within_job
    from farm.controller.store import SQLiteStore as Store
    nano_pairs = pair_within_job(Store(tmp_path / "farm.db"), 1, "nano-1", "latency")
    # and so is its architecture (this fake Nano is the test machine: its `uname -m`)
    import platform
    assert nano_pairs and {p.runtime for p in nano_pairs} == {f"litert@nvpmodel=MAXN;clocks-dynamic;arch={platform.machine()}"}

    table = farm("results", "1", "--pairs").stdout
    assert "g6-1" in table and "nano-1" in table and "/ sim" in table  # the ratio column, header on two lines


def test_an_unknown_device_target_is_refused_with_the_known_ones(lab: Path, tiny_models, tmp_path: Path, farm) -> None:
    os.symlink(tiny_models["tflite"], tmp_path / "tiny.tflite")
    job = write_job(tmp_path, "models: [tiny.tflite]\ntargets: [sim, pixel-9]\n")
    run = farm("submit", str(job), "--devices", str(lab))
    assert run.returncode == 2
    assert "targets[1]" in run.stderr and "pixel-9" in run.stderr and "g6-1" in run.stderr


def test_a_phone_that_stays_unplugged_is_retried_then_quarantined(lab: Path, tmp_path: Path, mobilenet_models,
                                                                 farm) -> None:
    import yaml
    entries = yaml.safe_load(lab.read_text())
    phone_port = entries["devices"][0]["port"]
    entries["devices"][0]["port"] = 1  # nothing answers there: the phone is unplugged
    lab.write_text(yaml.safe_dump(entries))
    os.symlink(mobilenet_models["mobilenetv2_w0.35_r96.tflite"], tmp_path / "m.tflite")
    job = write_job(tmp_path, "models: [m.tflite]\nworkload: {type: benchmark, iterations: 5}\nrepeats: 2\n"
                              "targets: [g6-1]\n")
    run = farm("submit", str(job), "--devices", str(lab), "--json")
    assert run.returncode == 1
    records = {(r["target"], r["repeat"]): r for r in run.json()["results"]}
    first, second = records[("g6-1", 0)], records[("g6-1", 1)]
    assert first["failure_class"] == "infrastructure" and first["attempts"] == 3
    assert "quarantined" in second["message"] and second["attempts"] == 0  # never offered to the dead phone
    assert records[("sim", 0)]["status"] == "completed"  # the twins still ran
    health = {r["name"]: r for r in farm("device", "health", "--json").json()}
    assert health["g6-1"]["health"] == "bad"
    assert farm("device", "release", "g6-1").returncode == 0
    assert {r["name"]: r for r in farm("device", "health", "--json").json()}["g6-1"]["health"] == "good"
    assert farm("device", "maintenance", "g6-1", "--reason", "battery swap").returncode == 0
    held = {r["name"]: r for r in farm("device", "health", "--json").json()}["g6-1"]
    assert held["health"] == "maintenance" and held["reason"] == "battery swap"
    assert phone_port  # the emulator itself was never touched


def test_an_untyped_phone_gets_its_type_from_its_own_facts(tmp_path: Path, farm) -> None:
    from farm.agents.lab import discover_types, load_lab
    key = tmp_path / "adbkey"
    load_or_create_lab_key(key)
    with AdbDeviceEmulator(tmp_path / "phone", authorized_keys=[Path(f"{key}.pub").read_text()]) as phone:
        lab = tmp_path / "lab.yaml"
        lab.write_text(f"devices:\n  - {{name: mystery, driver: android, host: 127.0.0.1, port: {phone.port}, "
                       f"adb_key: {key}}}\n  - {{name: gone, driver: android, host: 127.0.0.1, port: 1, adb_key: {key}}}\n")
        devices = load_lab(lab)
        problems = discover_types(devices)
    assert devices[0].device_type.name == "lg-g6"  # the emulator says ro.product.model=LG-H870
    assert devices[1].device_type is None and problems and problems[0].startswith("gone:")


def test_a_phone_job_with_an_accelerator_axis(tmp_path: Path, tiny_models, farm) -> None:
    """Issue 29 through `farm submit` on the ADB emulator: each unit's delegate flags reach benchmark_model, the GPU
    cell is a GPU figure, the NNAPI delegate that took no node is a job failure saying so, the rest of the job kept."""
    import json
    import sqlite3

    key = tmp_path / "lab" / "adbkey"
    load_or_create_lab_key(key)
    os.symlink(tiny_models["tflite"], tmp_path / "tiny.tflite")
    with AdbDeviceEmulator(tmp_path / "phone", authorized_keys=[Path(f"{key}.pub").read_text()]) as phone:
        lab = tmp_path / "lab.yaml"
        lab.write_text(f"devices:\n  - name: g6-1\n    driver: android\n    type: lg-g6\n    host: 127.0.0.1\n"
                       f"    port: {phone.port}\n    adb_key: {key}\n")
        job = write_job(tmp_path, """
models: [tiny.tflite]
workload: {type: benchmark, iterations: 10, warmup: 1}
matrix: {accelerators: [cpu, "gpu:fp16", nnapi]}
targets: [g6-1]
sim: {on_contention: flag}
""")
        run = farm("submit", str(job), "--devices", str(lab), "--json")
    assert run.returncode == 1, run.stderr[-2000:]
    phone_runs = {r["accelerator"]: r for r in run.json()["results"] if r["target"] == "g6-1"}
    assert set(phone_runs) == {"cpu", "gpu:fp16", "nnapi"}
    assert phone_runs["cpu"]["status"] == phone_runs["gpu:fp16"]["status"] == "completed"
    assert phone_runs["nnapi"]["failure_class"] == "job" and "NNAPI delegate took none" in phone_runs["nnapi"]["message"]
    commands = {json.loads(plan)["accelerator"]: json.loads(env)["command"] for plan, env in sqlite3.connect(
        tmp_path / "farm.db").execute("SELECT p.plan_json, r.environment_json FROM runs r JOIN tasks t "
                                      "ON t.id = r.task_id JOIN task_plans p ON p.id = t.plan_id WHERE t.target = 'g6-1'")}
    assert "--use_gpu=true --gpu_precision_loss_allowed=true" in commands["gpu"]
    assert "--use_nnapi=true" in commands["nnapi"] and "--use_gpu" not in commands["cpu"]
