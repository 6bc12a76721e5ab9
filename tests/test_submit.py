"""The user's path: `farm submit job.yaml` on the embedded controller, then results, jobs,
status, cancel and resume — real runs through the CLI, nothing of farm mocked."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from farm.controller.store.samples import unpack_iterations

from conftest import FARM, write_job

CONTRACT_KEYS = {"job", "task", "model", "target", "threads", "batch_size", "repeat", "status", "failure_class",
                 "message", "latency_ms", "peak_memory_mb", "avg_memory_mb", "cpu_percent", "wall_s", "backend", "limits"}


@pytest.fixture
def small_job(tmp_path: Path, tiny_models) -> Path:
    os.symlink(tiny_models["tflite"], tmp_path / "tiny.tflite")
    os.symlink(tiny_models["onnx"], tmp_path / "tiny.onnx")
    return write_job(tmp_path, """
name: small
models:
  - path: tiny.tflite
    family: tiny
  - tiny.onnx
workload: {type: benchmark, iterations: 25, warmup: 2}
matrix: {threads: [1, 2]}
sim: {memory: 512m}
""")


def test_submit_runs_stores_and_prints(small_job: Path, farm, farm_db: Path) -> None:
    run = farm("submit", str(small_job))
    assert run.returncode == 0, run.stderr
    assert "tiny.tflite" in run.stdout and "tiny.onnx" in run.stdout
    assert run.stdout.count(" ok ") == 4
    assert "[4/4]" in run.stderr  # progress as runs finish

    records = farm("results", "1", "--format", "json").json()
    assert len(records) == 4
    for r in records:
        assert CONTRACT_KEYS <= r.keys()
        assert r["status"] == "completed" and r["failure_class"] is None
        assert set(r["model"]) >= {"name", "sha256", "family"}
        assert len(r["model"]["sha256"]) == 64
        lat = r["latency_ms"]
        assert set(lat) >= {"init", "first", "avg", "p50", "p90", "p99", "std", "min", "max"}
        assert 0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
        assert r["limits"]["memory_mb"] == 512 and r["limits"]["cpus"] == r["threads"]
        assert r["peak_memory_mb"] > 0 and r["cpu_percent"]["avg"] is not None
        assert r["wall_s"] > 0 and r["backend"] in ("cgroup", "docker", "process")
    assert {r["model"]["family"] for r in records} == {"tiny", None}

    # every per-iteration sample is kept, not only the summary
    db = sqlite3.connect(farm_db)
    counts = [len(unpack_iterations(packed)) for (packed,) in db.execute("SELECT iterations FROM run_samples")]
    # one run per task, or more where a contended run was measured again (sim.on_contention: retry)
    assert len(counts) >= 4 and set(counts) == {25}
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"

    csv_out = farm("results", "1", "--format", "csv").stdout.splitlines()
    assert "latency_ms.avg" in csv_out[0].split(",") and len(csv_out) == 5
    table = farm("results", "1").stdout
    assert "tiny.onnx" in table

    jobs = farm("jobs", "--json").json()
    assert jobs[0]["id"] == 1 and jobs[0]["status"] == "completed" and jobs[0]["completed"] == 4
    status = farm("status", "1", "--json").json()
    assert status["status"] == "completed" and status["completed"] == 4


def test_unknown_job_is_a_clear_error(farm) -> None:
    run = farm("results", "42")
    assert run.returncode == 2 and "no job 42" in run.stderr


def _script_job(tmp_path: Path, tiny_models, script: str, extra: str = "") -> Path:
    os.symlink(tiny_models["tflite"], tmp_path / "tiny.tflite")
    (tmp_path / "work.py").write_text(script)
    return write_job(tmp_path, f"""
models: [tiny.tflite]
workload:
  type: script
  command: python
  script: work.py
  args: ["--model", "{{model}}", "--threads", "{{threads}}"]
{extra}
""")


def test_script_mode_times_the_process_and_reads_json_lines(tmp_path: Path, tiny_models, farm) -> None:
    job = _script_job(tmp_path, tiny_models, """
import json, sys, time
assert sys.argv[1] == "--model" and sys.argv[2].endswith("tiny.tflite") and sys.argv[4] == "1"
for ms in (5.0, 7.0, 6.0, 9.0):
    print(json.dumps({"latency_ms": ms}), flush=True)
print("not json, kept in the log")
time.sleep(0.3)
""")
    run = farm("submit", str(job), "--json")
    assert run.returncode == 0, run.stderr
    r = run.json()["results"][0]
    assert r["latency_ms"]["avg"] == pytest.approx(6.75)
    assert r["latency_ms"]["max"] == 9.0 and r["latency_ms"]["count"] == 4
    assert r["whole_run_s"] >= 0.3


def test_script_that_fails_is_a_job_failure_with_its_output(tmp_path: Path, tiny_models, farm) -> None:
    job = _script_job(tmp_path, tiny_models, "import sys\nprint('model has no head')\nsys.exit(4)\n")
    run = farm("submit", str(job), "--json")
    assert run.returncode == 1
    r = run.json()["results"][0]
    assert r["failure_class"] == "job" and "status 4" in r["message"] and "model has no head" in r["message"]


def test_run_over_its_timeout_fails_as_timeout(tmp_path: Path, tiny_models, farm) -> None:
    # an hour's sleep: were the run not stopped at its 1 s limit, `farm submit` would outlast the per-test and the
    # fixture's timeouts and fail the test, however loaded the machine (no wall-clock bound on a process, issue 34)
    job = _script_job(tmp_path, tiny_models, "import time\ntime.sleep(3600)\n", "timeouts: {run: 1s}")
    run = farm("submit", str(job), "--json")
    r = run.json()["results"][0]
    assert r["failure_class"] == "timeout" and "1 s" in r["message"]
    assert r["attempts"] == 2  # a timeout is retried once, then reported


def _wait_for(predicate, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached in time")


def _completed_runs(db: Path) -> int:
    if not db.exists():
        return 0
    try:
        # tasks, not runs: a contended run is measured again (sim.on_contention: retry) as another run
        return sqlite3.connect(db).execute("SELECT COUNT(*) FROM tasks WHERE status = 'completed'").fetchone()[0]
    except sqlite3.OperationalError:
        return 0




def _slow_job(tmp_path: Path, tiny_models) -> Path:
    return _script_job(tmp_path, tiny_models, "import json, time\ntime.sleep(0.6)\nprint(json.dumps({'latency_ms': 1.0}))\n",
                       "repeats: 8")


def _submit_in_background(job: Path, farm_db: Path) -> subprocess.Popen:
    # Output to files, not pipes nobody reads: a full pipe would stall the submit, not the thing under test.
    return subprocess.Popen([*FARM, "submit", str(job), "--quiet"], env={**os.environ, "FARM_DB": str(farm_db)},
                            stdout=(job.parent / "submit.out").open("w"), stderr=(job.parent / "submit.err").open("w"),
                            text=True)


def test_cancel_from_another_process_keeps_finished_runs(tmp_path: Path, tiny_models, farm, farm_db: Path) -> None:
    job = _slow_job(tmp_path, tiny_models)
    proc = _submit_in_background(job, farm_db)
    _wait_for(lambda: _completed_runs(farm_db) >= 2)
    cancel = farm("cancel", "1", "--json")
    assert cancel.returncode == 0 and cancel.json()["canceled_tasks"] >= 1
    proc.wait(timeout=60)
    status = farm("status", "1", "--json").json()
    assert status["status"] == "canceled"
    assert status["completed"] >= 2 and status["canceled"] >= 1
    assert status["completed"] + status["canceled"] == 8


def test_kill_9_mid_job_loses_nothing_and_resume_finishes(tmp_path: Path, tiny_models, farm, farm_db: Path) -> None:
    job = _slow_job(tmp_path, tiny_models)
    proc = _submit_in_background(job, farm_db)
    _wait_for(lambda: _completed_runs(farm_db) >= 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = _completed_runs(farm_db)
    assert kept >= 3
    assert farm("status", "1", "--json").json()["status"] == "interrupted"
    assert "farm resume 1" in farm("status", "1").stdout

    resumed = farm("resume", "1", "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.json()["status"] == "completed"
    assert _completed_runs(farm_db) == 8
    records = resumed.json()["results"]
    assert len(records) == 8 and all(r["status"] == "completed" for r in records)


def _script_pid(parent: int) -> int | None:
    """The script's process, found from outside: in its own namespaces it can neither see nor write our paths."""
    import psutil

    for p in psutil.Process(parent).children(recursive=True):
        try:
            if any(a.endswith("work.py") for a in p.cmdline()):
                return p.pid
        except psutil.Error:
            pass
    return None


def test_ctrl_c_stops_the_sandboxed_run_too(tmp_path: Path, tiny_models, farm, farm_db: Path) -> None:
    job = _script_job(tmp_path, tiny_models, "import time\ntime.sleep(60)\n")
    proc = _submit_in_background(job, farm_db)
    _wait_for(lambda: _script_pid(proc.pid))
    child = _script_pid(proc.pid)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    _wait_for(lambda: not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2], 10)
    # the stopped attempt is stored as canceled; the task waits for `farm resume` in an interrupted job
    assert sqlite3.connect(farm_db).execute("SELECT status, failure_class FROM runs").fetchall() == [("failed", "canceled")]
    r = farm("results", "1", "--format", "json").json()[0]
    assert r["status"] == "pending" and r["failure_class"] is None
    assert farm("status", "1", "--json").json()["status"] == "interrupted"


def test_job_timeout_cancels_the_rest(tmp_path: Path, tiny_models, farm, farm_db: Path) -> None:
    job = _script_job(tmp_path, tiny_models, "import time\ntime.sleep(0.8)\n", "repeats: 10\ntimeouts: {job: 2s}")
    run = farm("submit", str(job), "--json")
    # the rest were canceled, not run: fewer runs stored than the ten asked for (no wall-clock bound, issue 34)
    assert sqlite3.connect(farm_db).execute("SELECT COUNT(*) FROM runs").fetchone()[0] < 10
    assert run.json()["status"] == "canceled"
    status = farm("status", "1", "--json").json()
    assert "timeouts.job = 2 s" in status["message"]
    assert status["completed"] >= 1 and status["canceled"] >= 1 and status["completed"] + status["canceled"] == 10


def test_two_sim_slots_run_on_disjoint_cores(tmp_path: Path, tiny_models, farm) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    job = _script_job(tmp_path, tiny_models, "import time\ntime.sleep(0.3)\n", "repeats: 4")
    run = farm("submit", str(job), "--slots", "2", "--json")
    assert run.returncode == 0, run.stderr
    cpusets = {r["limits"]["cpuset"] for r in run.json()["results"]}
    assert len(cpusets) == 2 and None not in cpusets  # each slot pinned to its own core(s)
    a, b = (set(c.split(",")) for c in cpusets)
    assert not a & b


def test_a_script_folder_holding_the_live_store_loses_no_write(tmp_path: Path, tiny_models, farm, farm_db: Path) -> None:
    # The job folder is the store's folder: packing it must not read (and close) the store's files in the
    # process that has them open. That drops SQLite's locks; another process reading meanwhile (here: the
    # test, as `farm status` would) then checkpoints and removes the WAL under it, and the runs are lost.
    assert farm_db.parent == tmp_path
    job = _script_job(tmp_path, tiny_models, "import json, time\ntime.sleep(0.3)\nprint(json.dumps({'latency_ms': 1.0}))\n",
                      "repeats: 6")
    proc = _submit_in_background(job, farm_db)
    while proc.poll() is None:  # a reader beside the running job
        _completed_runs(farm_db)
        time.sleep(0.05)
    assert proc.returncode == 0, (job.parent / "submit.err").read_text()
    with sqlite3.connect(farm_db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert conn.execute("SELECT COUNT(*) FROM tasks WHERE status = 'completed'").fetchone()[0] == 6
    assert farm("status", "1", "--json").json()["completed"] == 6
