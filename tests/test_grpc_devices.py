"""A phone on a rack host: `farm agent --devices lab.yaml` registers it with the controller, and a
job submitted to the controller runs on the phone and on its sim twin, paired in the results.

The controller and the agent run on threads of pytest's process (farm.client.compose) and the CLI in-process
(issue 34; a real process per call with `pytest --farm-subprocess`): the point is the registration and the
pairing, not a process start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adb_emulator import AdbDeviceEmulator
from farm.agents.android.adb import load_or_create_lab_key
from grpc_processes import Cluster


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FARM_DEVICES", "")  # the agent on a thread here reads its lab from --devices only
    c = Cluster(tmp_path, {"FARM_DB": str(tmp_path / "client.db")}, cli_in_process=True)
    yield c
    c.stop_all()


def test_a_job_through_the_controller_runs_on_the_agents_phone(cluster: Cluster, mobilenet_models) -> None:
    key = cluster.root / "adbkey"
    load_or_create_lab_key(key)
    with AdbDeviceEmulator(cluster.root / "phone", authorized_keys=[Path(f"{key}.pub").read_text()]) as phone:
        lab = cluster.root / "lab.yaml"
        lab.write_text(f"devices:\n  - {{name: g6-1, driver: android, type: lg-g6, tags: [phones], host: 127.0.0.1, "
                       f"port: {phone.port}, adb_key: {key}}}\n")
        cluster.serve_in_process(no_auth=True)
        cluster.agent_in_process("rack1", devices=lab)  # returns once connected

        devices = json.loads(cluster.farm("devices", "--json", "--controller", cluster.address).stdout)
        assert {d["name"] for d in devices} == {"rack1/sim", "g6-1"}

        model = mobilenet_models["mobilenetv2_w0.35_r96.tflite"]
        job = cluster.root / "job.yaml"
        job.write_text(f"models: ['{model}']\nworkload: {{type: benchmark, iterations: 10}}\nmatrix: {{threads: [1, 2]}}\n"
                       "targets: [tag:phones]\n")
        run = cluster.farm("submit", str(job), "--controller", cluster.address, "--json", timeout=300)
        assert run.returncode == 0, run.stderr + cluster.server_output()[-3000:]
    records = json.loads(run.stdout)["results"]
    assert {(r["target"], r["threads"]) for r in records} == {("g6-1", 1), ("g6-1", 2), ("sim", 1), ("sim", 2)}
    assert all(r["status"] == "completed" for r in records)
    phone_runs = [r for r in records if r["target"] == "g6-1"]
    assert all(r["backend"] == "android" and r["latency_ms"]["avg"] > 0 for r in phone_runs)
    twins = {r["pair_key"] for r in records if r["target"] == "sim"}
    assert {r["pair_key"] for r in phone_runs} == twins  # every phone run has its sim twin
