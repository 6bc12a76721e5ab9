"""One CLI, two farms: every command run embedded (a local store) and against a real controller
serving a copy of that very store says the same thing in --json; a named controller that
is down is an error for every command, never a quiet read of a local store; FARM_CONTROLLER makes
`farm device quarantine` change the controller's device.

The controllers and agents here run on threads of pytest's process (farm.client.compose, issue 34) and the
CLI is `farm.cli.main.main(argv)` in-process (a real process each with `pytest --farm-subprocess`): what these
tests prove is what the commands say, not that a process starts (test_cli_remote.py and the cluster tests start
real `farm controller serve` and `farm agent` processes)."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from pathlib import Path

import grpc
import pytest

from conftest import write_job
from grpc_processes import Cluster, in_process_cluster
from test_json_output import assert_iso_times

pytestmark = pytest.mark.timeout(900)

WIDTHS = ("0.35", "0.5", "0.75", "1.0")
# Fields that name when or by which process something happened: they differ between two farms by
# construction (the embedded run's own pid, the controller owning its jobs, the clock at each call).
VOLATILE = {"created_at", "started_at", "finished_at", "changed_at", "owner_pid", "owner_host", "last_seen",
            "connected_at", "calibration_age_s"}


def _normalized(value):
    if isinstance(value, dict):
        return {k: ("<varies>" if k in VOLATILE else _normalized(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalized(v) for v in value]
    return value


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> Path:
    from farm.model_generators.generate import generate_examples
    d = tmp_path_factory.mktemp("family")
    generate_examples(d, widths=[float(w) for w in WIDTHS] + [1.4], input_sizes=[96], formats=("tflite",), zoo=False)
    return d


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    c = in_process_cluster(tmp_path, monkeypatch)
    yield c
    c.stop_all()


def _job(d: Path, name: str, cpus: float, widths: tuple[str, ...]) -> Path:
    models = ", ".join(f"mobilenetv2_w{w}_r96.tflite" for w in widths)
    return write_job(d, f"""
name: {name}
models: [{models}]
workload: {{type: benchmark, iterations: 10, warmup: 1}}
sim: {{cpus: {cpus}, memory: 1g, on_contention: flag}}
""", f"{name}.yaml")  # on this shared host runs are often contended: flag them, and analyse with --include-contended


def test_every_command_says_the_same_embedded_and_through_a_controller(cluster: Cluster, family: Path) -> None:
    embedded_db = cluster.root / "embedded.db"
    for name, cpus in (("sim", 1.0), ("half", 0.5)):
        run = cluster.farm("submit", str(_job(family, name, cpus, WIDTHS)), "--db", str(embedded_db), "--quiet",
                           "--backend", "process", timeout=600)
        assert run.returncode == 0, run.stderr
    with sqlite3.connect(embedded_db) as source, sqlite3.connect(cluster.root / "controller.db") as copy:
        source.backup(copy)  # the same data on both sides: a copy of the store, as it is now
    cluster.serve_in_process(no_auth=True)
    cluster.agent_in_process("rack1", backend="process")  # returns once connected

    def both(*args: str, compare: bool = True) -> tuple[dict | list, dict | list]:
        local = cluster.farm(*args, "--json", "--db", str(embedded_db), timeout=600)
        remote = cluster.farm(*args, "--json", "--controller", cluster.address, timeout=600)
        assert local.returncode == remote.returncode, (args, local.stderr, remote.stderr)
        local_doc, remote_doc = json.loads(local.stdout), json.loads(remote.stdout)
        assert_iso_times(local_doc, f"{args} embedded"), assert_iso_times(remote_doc, f"{args} remote")
        if compare:
            assert _normalized(local_doc) == _normalized(remote_doc), args
        return local_doc, remote_doc

    jobs, _ = both("jobs")
    assert [j["name"] for j in jobs] == ["half", "sim"]
    status, _ = both("status", "1")
    assert status["status"] == "completed" and status["completed"] == 4
    both("results", "1")
    both("results", "2", "--pairs")
    watched, _ = both("watch", "2")  # an ended job: its results at once, exit code as submit's
    assert watched["status"] == "completed" and len(watched["results"]) == 4
    assert both("cancel", "1")[0] == {"job": 1, "canceled_tasks": 0}

    calibrated, _ = both("calibrate", "--sim-job", "1", "--device-job", "2", "--device", "half-cpu",
                         "--include-contended", "--metric", "latency", "--metric", "peak_memory")
    assert {c["metric"] for c in calibrated["calibrations"]} == {"latency", "peak_memory"}
    history, _ = both("calibrations", "--device", "half-cpu")
    assert [r["version"] for r in history] == [1, 1]
    ranking, _ = both("rank", "1", "--device-job", "2", "--device", "half-cpu", "--include-contended")
    assert [c["name"] for c in ranking["groups"][0]["columns"]] == ["sim (job 1)", "job 2", "half-cpu (predicted)"]
    assert both("drift")[0] == []

    # report: rendered where the store is, written here; the same files, the same page
    written = []
    for where, target in (("--db", str(embedded_db)), ("--controller", cluster.address)):
        out = cluster.root / f"report-{where.strip('-')}"
        out.mkdir()
        run = cluster.farm("report", "1", "-o", str(out / "report.html"), "--png", str(out / "png"), "--json", where, target)
        assert run.returncode == 0, run.stderr
        written.append(out)
    local_files, remote_files = (sorted(p.relative_to(o) for p in o.rglob("*") if p.is_file()) for o in written)
    assert local_files == remote_files and len(local_files) > 1
    assert (written[0] / "report.html").read_text() == (written[1] / "report.html").read_text()

    # predict measures the new model in the sim (here, or on the controller's agent), then reuses that run
    model = str(family / "mobilenetv2_w1.4_r96.tflite")  # never measured yet
    first = both("predict", model, "--device", "half-cpu", "--include-contended", compare=False)
    # each farm measured the model once, itself: the estimate, interval, verdict and warnings follow that sim value

    def unmeasured(p: dict) -> dict:  # what does not follow the sim value each farm measured (the verdict and the
        # calibration's warnings name that value when it extrapolates)
        kept = {k: p.get(k) for k in ("model", "sha256", "device", "metric", "threads", "unit", "confidence")}
        calibration = p.get("calibration") or {}
        return {**kept, "calibration": (calibration.get("id"), calibration.get("version"), calibration.get("formula"))}
    assert [unmeasured(p) for p in first[0]] == [unmeasured(p) for p in first[1]]
    assert all(p["sim_reused"] is False and p["model"] == "mobilenetv2_w1.4_r96.tflite" for p in first[0] + first[1])
    again = both("predict", model, "--device", "half-cpu", "--include-contended", compare=False)
    assert all(p["sim_reused"] is True for p in again[0] + again[1])

    # device health: the controller's devices change, as the local store's do
    assert both("device", "quarantine", "half-cpu", "--reason", "fan noise")[0]["failed_tasks"] == 0
    health, _ = both("device", "health")
    assert [(h["name"], h["health"], h["reason"]) for h in health] == [("half-cpu", "bad", "fan noise")]
    both("device", "maintenance", "half-cpu")
    both("device", "release", "half-cpu")
    assert both("device", "health")[0][0]["health"] == "good"

    # What is not the same farm by nature: embedded lists the lab's devices ($FARM_DEVICES, none here)
    # and has no agents to list; a controller lists what its agents registered.
    local_devices, remote_devices = both("devices", compare=False)
    assert local_devices == [] and [d["name"] for d in remote_devices] == ["rack1/sim"]
    agents = cluster.farm("agents", "--json", "--controller", cluster.address)
    assert [a["name"] for a in json.loads(agents.stdout)] == ["rack1"]
    assert assert_iso_times(json.loads(agents.stdout), "agents") == 2  # connected_at, last_seen
    local_agents = cluster.farm("agents", "--json", "--db", str(embedded_db))
    assert local_agents.returncode == 2 and "--controller" in local_agents.stderr
    # refused in both, each saying why: no device to refresh, a finished job to resume, a name to forget
    for args in (("refresh",), ("resume", "1"), ("device", "forget", "nobody")):
        local = cluster.farm(*args, "--json", "--db", str(embedded_db))
        remote = cluster.farm(*args, "--json", "--controller", cluster.address)
        assert local.returncode == remote.returncode == 2, (args, local.stderr, remote.stderr)
        assert json.loads(local.stdout)["error"] and json.loads(remote.stdout)["error"]

    # submit itself: the same job both ways (remote: --detach, then `farm watch`), the same records where a
    # run's place cannot matter
    job = _job(family, "again", 1.0, WIDTHS[:2])
    local = cluster.farm("submit", str(job), "--json", "--db", str(embedded_db), "--backend", "process", timeout=600)
    queued = cluster.farm("submit", str(job), "--detach", "--json", "--controller", cluster.address)
    assert queued.returncode == 0, queued.stderr
    remote = cluster.farm("watch", str(json.loads(queued.stdout)["job"]), "--json", "--controller", cluster.address,
                          timeout=600)
    assert local.returncode == remote.returncode == 0, (local.stderr, remote.stderr)
    key = lambda r: (r["model"]["name"], r["model"]["sha256"], r["threads"], r["repeat"], r["status"],  # noqa: E731
                     r["limits"]["cpus"], r["limits"]["memory_mb"], r["latency_ms"]["count"])
    assert sorted(map(key, json.loads(local.stdout)["results"])) == sorted(map(key, json.loads(remote.stdout)["results"]))
    assert not (cluster.root / "unused.db").exists()  # FARM_DB was never opened by a command given a controller


COMMANDS = [
    ("submit", "job.yaml"), ("submit", "job.yaml", "--detach"), ("watch", "1"), ("resume", "1"), ("results", "1"),
    ("jobs",), ("status", "1"), ("cancel", "1"), ("calibrate", "--job", "1"), ("calibrations",),
    ("predict", "model.tflite", "--device", "d"), ("rank", "1"), ("report", "1", "-o", "r.html"), ("refresh",),
    ("drift",), ("devices",), ("agents",), ("device", "health"), ("device", "quarantine", "d"),
    ("device", "release", "d"), ("device", "maintenance", "d"), ("device", "forget", "d"),
]


def test_a_named_controller_that_is_down_is_an_error_for_every_command(tmp_path: Path, tiny_models, farm) -> None:
    shutil.copy(tiny_models["tflite"], tmp_path / "model.tflite")
    write_job(tmp_path, "name: j\nmodels: [model.tflite]\nworkload: {type: benchmark, iterations: 2}\n")
    local_db = tmp_path / "local.db"
    env = {"FARM_DB": str(local_db), "FARM_CONFIG": str(tmp_path / "none.toml"), "FARM_TOKEN": ""}
    for how in ("flag", "environment"):
        for command in COMMANDS:  # the `farm` fixture: in this process, or a real one with --farm-subprocess
            args = [*command, "--json"] + (["--controller", "127.0.0.1:1"] if how == "flag" else [])
            run = farm(*args, cwd=tmp_path, timeout=120,
                       env={**env, "FARM_CONTROLLER": "127.0.0.1:1" if how == "environment" else ""})
            # resume asks the controller too now (issue 32: a finished controller job's failed tasks run again)
            assert run.returncode == 3, (how, command, run.stdout, run.stderr)
            assert "cannot reach the controller at 127.0.0.1:1" in json.loads(run.stdout)["error"], (how, command)
            assert not local_db.exists(), (how, command)  # no local store was opened, let alone read
    assert not (tmp_path / "r.html").exists()


def test_farm_controller_in_the_environment_quarantines_the_controllers_device(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    admin, client = "a" * 24, "c" * 24
    tokens.write_text(f"admin {admin}\nclient {client}\n")
    tokens.chmod(0o600)
    cluster = Cluster(tmp_path, env={"FARM_CONFIG": str(tmp_path / "none.toml"), "FARM_DB": str(tmp_path / "local.db")},
                      cli_in_process=True)
    try:
        cluster.serve_in_process(tokens=tokens)
        env = {"FARM_CONTROLLER": cluster.address}
        refused = cluster.farm("device", "quarantine", "g6-1", env={**env, "FARM_TOKEN": client})
        assert refused.returncode == 2 and "admin" in refused.stderr  # changing a device is an operator's call
        done = cluster.farm("device", "quarantine", "g6-1", "--reason", "screen cracked", "--json",
                            env={**env, "FARM_TOKEN": admin})
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"device": "g6-1", "action": "quarantine", "failed_tasks": 0}
        with cluster.db() as db:
            assert db.execute("SELECT health, reason FROM device_health WHERE name = 'g6-1'").fetchall() == \
                   [("bad", "screen cracked")]
        health = cluster.farm("device", "health", "--json", env={**env, "FARM_TOKEN": client})  # reading is a client's
        assert [h["name"] for h in json.loads(health.stdout)] == ["g6-1"]
        assert not (tmp_path / "local.db").exists()
    finally:
        cluster.stop_all()


def test_the_new_calls_refuse_hostile_requests(tmp_path: Path) -> None:
    from farm.proto.generated import farm_pb2, farm_pb2_grpc

    cluster = Cluster(tmp_path, env={"FARM_CONFIG": str(tmp_path / "none.toml")})
    try:
        cluster.serve_in_process(no_auth=True)
        stub = farm_pb2_grpc.FarmServiceStub(grpc.insecure_channel(cluster.address))
        hostile = [
            ("Calibrate", farm_pb2.CalibrateRequest(job=1, metrics=["latency"] * 10_000)),
            ("Calibrate", farm_pb2.CalibrateRequest(sim_job=1, device_job=2, device="\x1b[31mred", metrics=["latency"])),
            ("Predict", farm_pb2.PredictRequest(model_sha256="../../etc/passwd", model_name="m", device="d")),
            ("Predict", farm_pb2.PredictRequest(model_sha256="0" * 64, model_name="m", device="d",
                                                measured_jobs=list(range(100)))),
            ("Rank", farm_pb2.RankRequest(job=1, device_jobs=list(range(10_000)))),
            ("SetDeviceHealth", farm_pb2.SetDeviceHealthRequest(device="x" * 5000, action="quarantine")),
            ("SetDeviceHealth", farm_pb2.SetDeviceHealthRequest(device="d", action="explode")),
            ("FinishRefresh", farm_pb2.FinishRefreshRequest(job=1, k=float("nan"))),
            ("Report", farm_pb2.ReportRequest(job=999, html=True)),
        ]
        for method, request in hostile:
            with pytest.raises(grpc.RpcError) as e:
                getattr(stub, method)(request, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value.details())
        with pytest.raises(grpc.RpcError) as e:  # no device registered: nothing to refresh, said so
            stub.StartRefresh(farm_pb2.StartRefreshRequest(), timeout=30)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # still serving after all of them (on threads here: a crash would be an unanswered call, not an exit)
        assert stub.ListJobs(farm_pb2.ListJobsRequest(), timeout=30).jobs == []
        assert cluster.servers[0].running is not None
    finally:
        cluster.stop_all()


def test_submit_detach_without_a_controller_runs_in_the_background_and_watch_follows_it(tmp_path: Path, farm,
                                                                                         tiny_models) -> None:
    shutil.copy(tiny_models["tflite"], tmp_path / "tiny.tflite")
    job = write_job(tmp_path, """
name: background
models: [tiny.tflite]
workload: {type: benchmark, iterations: 3}
repeats: 3
sim: {memory: 256m, backend: process, on_contention: flag}
""")
    queued = farm("submit", str(job), "--detach", "--json")
    assert queued.returncode == 0, queued.stderr
    answer = queued.json()
    assert answer["job"] == 1 and answer["status"] == "queued" and answer["tasks"] == 3
    log = Path(answer["log"])
    assert log.parent == tmp_path  # beside the store
    watched = farm("watch", "1", "--json")
    assert watched.returncode == 0, watched.stderr + log.read_text()
    assert watched.json()["status"] == "completed" and len(watched.json()["results"]) == 3
    status = farm("status", "1", "--json").json()
    assert status["owner_pid"] != os.getpid() and status["completed"] == 3  # the background process ran it
    said = farm("submit", str(job), "--detach")
    assert "farm watch 2" in said.stderr and "background" in said.stderr
    assert farm("watch", "2", "--quiet").returncode == 0


def test_farm_refresh_against_a_controller_runs_the_suite_on_its_agents_devices(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from adb_emulator import AdbDeviceEmulator, EmulatedPhone
    from farm.agents.android.adb import load_or_create_lab_key
    from farm.controller.operations.reference_suite import bundled_suite_text
    from farm.models.facts import inspect_model
    from farm.model_generators.generate import generate_examples

    suite_dir = tmp_path / "suite"
    suite_dir.mkdir()
    suite = suite_dir / "reference-suite.yaml"
    # a contended sim twin kept (flagged; --include-contended below), not measured up to 3 times
    suite.write_text(bundled_suite_text().replace("threads: [1, 2]", "threads: [1]").replace("iterations: 50", "iterations: 10")
                     + "sim: {on_contention: flag}\n")
    models = generate_examples(suite_dir / "models", widths=[0.35, 0.5, 0.75, 1.0, 1.4], input_sizes=[160],
                               formats=("tflite",), zoo=False)
    table = {}
    for m in models:  # the phone's speed: proportional to each model's MACs, like a real device's
        facts = inspect_model(m.path)  # one parse of each file
        us = facts.macs / 60
        table[facts.sha256] = {"init": 20000, "first": us * 1.3, "warmup_avg": us, "avg": us,
                               "std": us * 0.01, "min": us * 0.97, "max": us * 1.05, "median": us,
                               "p5": us * 0.98, "p95": us * 1.03, "memory_init_mb": 5.0,
                               "memory_overall_mb": 20.0}
    key = tmp_path / "adbkey"
    load_or_create_lab_key(key)
    env = {"FARM_CONFIG": str(tmp_path / "none.toml"), "FARM_DB": str(tmp_path / "local.db"), "FARM_CONTROLLER": "",
           "FARM_DEVICES": "", "FARM_REFERENCE_SUITE": ""}
    for name, value in env.items():  # what the controller and agent on threads here read from the environment
        monkeypatch.setenv(name, value)
    cluster = Cluster(tmp_path, env=env, cli_in_process=True)
    with AdbDeviceEmulator(tmp_path / "phone", phone=EmulatedPhone(benchmark_us=table),
                           authorized_keys=[Path(f"{key}.pub").read_text()]) as phone:
        lab = tmp_path / "lab.yaml"
        lab.write_text(f"devices:\n  - {{name: g6-1, driver: android, type: lg-g6, host: 127.0.0.1, "
                       f"port: {phone.port}, adb_key: {key}}}\n")
        try:
            cluster.serve_in_process(no_auth=True, refresh_suite=suite)
            cluster.agent_in_process("rack1", devices=lab, backend="process")  # returns once connected
            refused = cluster.farm("refresh", "--suite", str(suite), "--controller", cluster.address)
            assert refused.returncode == 2 and "its own suite" in refused.stderr
            # a busy shared host contends the sim twins: keep them (the refit, not its quality, is the point here)
            loose = ["--max-slope-change", "0.5", "--max-prediction-shift", "0.5", "--max-intercept-change", "0.5",
                     "--max-r2-drop", "0.2", "--include-contended"]
            reports = []
            for _ in range(2):
                run = cluster.farm("refresh", "--json", "--controller", cluster.address, *loose, timeout=900)
                assert run.returncode == 0, run.stderr + cluster.server_output()[-3000:]
                reports.append(json.loads(run.stdout))
            assert [c["version"] for c in reports[1]["calibrations"] if c["device"] == "g6-1" and c["family"] is None] \
                == [2], reports
            assert [d["device"] for d in reports[1]["drift"]] == ["g6-1"]
            drift = cluster.farm("drift", "--device", "g6-1", "--json", "--controller", cluster.address)
            assert len(json.loads(drift.stdout)) == 1
            assert not (tmp_path / "local.db").exists()
        finally:
            cluster.stop_all()
