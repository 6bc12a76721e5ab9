"""What goes wrong around a job, not in it: the store, the paths and options given, Ctrl-C, and the
JSON farm prints. Each case is an error a person can act on (one paragraph, exit 2, no traceback),
and afterwards the store still opens with every earlier job as it was and no orphan job.

A refusal that runs nothing is checked through `farm.cli.main.main(argv)` in this process
(`farm_inprocess`, issue 34); where a process is the point (Ctrl-C, another user, a server that
must not start, a run) the test starts one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import FARM, write_job
from grpc_processes import Cluster, wait_for

# the jobs that run keep a contended run, marked, instead of measuring it again: the policy is test_contention.py's
JOB = """
name: small
models: [tiny.tflite]
workload: {type: benchmark, iterations: 5, warmup: 1}
sim: {memory: 256m, on_contention: flag}
"""


@pytest.fixture
def job(tmp_path: Path, tiny_models) -> Path:
    os.symlink(tiny_models["tflite"], tmp_path / "tiny.tflite")
    return write_job(tmp_path, JOB)


def one_paragraph_error(run, fragments: list[str]) -> None:
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert "Traceback" not in run.stderr and run.stderr.startswith("error: "), run.stderr
    assert "\n\n" not in run.stderr.strip()
    for fragment in fragments:
        assert fragment in run.stderr, f"{fragment!r} not in {run.stderr!r}"


def jobs_in(db: Path) -> list[tuple]:
    """What the store holds, read with plain sqlite3 (it must still open)."""
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        return conn.execute("SELECT id, status FROM jobs ORDER BY id").fetchall()


# --- the store --------------------------------------------------------------------------------------
def test_a_corrupt_store_is_named_and_left_alone(job: Path, farm_inprocess, farm_db: Path) -> None:
    garbage = b"this was never an SQLite file " * 200
    farm_db.write_bytes(garbage)
    for args in (("jobs",), ("submit", str(job))):
        one_paragraph_error(farm_inprocess(*args), [str(farm_db), "not a farm store", "farm did not change it"])
    assert farm_db.read_bytes() == garbage


def test_a_store_that_is_a_folder(job: Path, farm_inprocess, tmp_path: Path) -> None:
    folder = tmp_path / "stores"
    folder.mkdir()
    one_paragraph_error(farm_inprocess("submit", str(job), "--db", str(folder)), [str(folder), "is a folder", "farm.db"])
    assert list(folder.iterdir()) == []


def test_a_locked_store_waits_then_says_so_and_stores_nothing(job: Path, farm, farm_db: Path) -> None:
    assert farm("submit", str(job)).returncode == 0
    locker = subprocess.Popen([sys.executable, "-c", (
        "import sqlite3, sys, time\n"
        f"c = sqlite3.connect({str(farm_db)!r}, isolation_level=None)\n"
        "c.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); time.sleep(300)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout.readline().strip() == "locked"
        assert farm("jobs", "--json").json()[0]["status"] == "completed"  # readers are not held up
        # the wait is FARM_STORE_WAIT_S's (default 30 s): the refusal after it is the same, sooner
        one_paragraph_error(farm("submit", str(job), env={"FARM_STORE_WAIT_S": "1"}),
                            [str(farm_db), "locked by another process (waited 1 s", "nothing was written"])
    finally:
        locker.kill()
        locker.wait()
    assert jobs_in(farm_db) == [(1, "completed")]  # no orphan job, the earlier one intact


def test_a_store_wait_that_is_not_seconds_is_refused_naming_the_variable(job: Path, farm_inprocess,
                                                                           farm_db: Path) -> None:
    for bad in ("soon", "0", "-5", "nan", "86400"):
        one_paragraph_error(farm_inprocess("submit", str(job), env={"FARM_STORE_WAIT_S": bad}),
                            [f"FARM_STORE_WAIT_S={bad!r}", "number of seconds", "default 30 s"])
    assert not farm_db.exists()  # refused before the store was made


def test_a_read_only_store(job: Path, farm, tiny_models) -> None:
    # root may write anywhere, so the user who cannot is nobody; their files live outside pytest's 0700 tmp
    shared = Path(tempfile.mkdtemp(prefix="farm-ro-", dir="/tmp"))
    try:
        os.chmod(shared, 0o755)
        shutil.copy(tiny_models["tflite"], shared / "tiny.tflite")
        os.chmod(shared / "tiny.tflite", 0o644)
        write_job(shared, JOB)
        db = shared / "farm.db"
        assert farm("submit", str(shared / "job.yaml"), "--db", str(db)).returncode == 0
        as_nobody = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *FARM, "submit",
                                    str(shared / "job.yaml"), "--db", str(db)],
                                   capture_output=True, text=True, cwd=shared, timeout=120,
                                   env={**os.environ, "HOME": str(shared)})
        one_paragraph_error(as_nobody, [str(db), "cannot be opened for writing", "writable"])
        assert jobs_in(db) == [(1, "completed")]
    finally:
        shutil.rmtree(shared)


def test_a_relative_db_is_made_absolute(job: Path, farm, tmp_path: Path) -> None:
    # the run directories live beside the store: a relative path used to fail every run as `bug`
    run = farm("submit", "job.yaml", "--db", "rel/store.db", "--json", "--create", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert [r["status"] for r in run.json()["results"]] == ["completed"]
    assert jobs_in(tmp_path / "rel" / "store.db") == [(1, "completed")]
    via_env = farm("submit", "job.yaml", "--json", cwd=tmp_path, env={"FARM_DB": "rel/store.db"})
    assert via_env.returncode == 0 and via_env.json()["job"] == 2


# --- paths and options ------------------------------------------------------------------------------
def test_report_into_a_missing_folder(job: Path, farm, farm_inprocess, farm_db: Path, tmp_path: Path) -> None:
    assert farm("submit", str(job)).returncode == 0
    one_paragraph_error(farm_inprocess("report", "1", "-o", str(tmp_path / "no" / "such" / "report.html")),
                        [str(tmp_path / "no" / "such"), "does not exist", "mkdir -p", "Nothing was written"])
    assert not (tmp_path / "no").exists()
    assert jobs_in(farm_db) == [(1, "completed")]


def test_more_slots_than_cores_is_refused_before_a_job_is_stored(job: Path, farm_inprocess, farm_db: Path) -> None:
    cores = len(os.sched_getaffinity(0))
    one_paragraph_error(farm_inprocess("submit", str(job), "--slots", str(cores + 1)),
                        [f"--slots {cores + 1}", f"need {cores + 1} cores", f"--slots 1 to {cores}"])
    assert not farm_db.exists() or jobs_in(farm_db) == []  # no orphan "interrupted" job
    bad_value = farm_inprocess("submit", str(job), "--slots", "0")
    assert bad_value.returncode == 2 and "at least 1" in bad_value.stderr


def test_models_generate_onto_an_existing_file(farm_inprocess, tmp_path: Path) -> None:
    target = tmp_path / "notes.txt"
    target.write_text("keep me\n")
    one_paragraph_error(farm_inprocess("models", "generate", str(target), "--no-zoo", "--widths", "0.35", "--sizes", "96"),
                        [str(target), "is a file", "left as it is"])
    assert target.read_text() == "keep me\n"


def test_controller_and_agent_with_relative_paths_and_a_task_limit(tmp_path: Path, tiny_models) -> None:
    os.symlink(tiny_models["tflite"], tmp_path / "tiny.tflite")
    cluster = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(tmp_path / "x.toml")})
    try:
        proc = cluster.spawn("controller", "controller", "serve", "--listen", "127.0.0.1:0", "--db", "ctl.db",
                             "--no-auth", "--max-tasks", "2")
        cluster.address = str(wait_for(lambda: "listening on" in proc.output() and
                                       proc.output().split("listening on ")[1].split(" ")[0], 30, "the controller"))
        assert f"store {tmp_path / 'ctl.db'}" in proc.output()
        agent = cluster.spawn("agent", "agent", "--controller", cluster.address, "--name", "rack", "--work-dir", "work")
        wait_for(lambda: "connected to controller" in agent.output(), 30, "the agent to connect")
        assert f"work dir {tmp_path / 'work'}" in agent.output()
        write_job(tmp_path, JOB + "repeats: 2\n")
        ok = cluster.farm("submit", "job.yaml", "--controller", cluster.address, "--json")
        assert ok.returncode == 0, ok.stderr
        assert [r["status"] for r in json.loads(ok.stdout)["results"]] == ["completed", "completed"]
        write_job(tmp_path, JOB + "repeats: 3\n")
        refused = cluster.farm("submit", "job.yaml", "--controller", cluster.address, "--json")
        assert refused.returncode == 2 and "expands to 3 runs" in refused.stderr
        assert "over the limit of 2 per job" in refused.stderr
        assert "over the limit of 2 per job" in _strict(refused.stdout)["error"]  # --json: on stdout too
        assert jobs_in(tmp_path / "ctl.db") == [(1, "completed")]
        with sqlite3.connect(tmp_path / "ctl.db") as conn:  # a hostile agent's Infinity, stored
            conn.execute("UPDATE summaries SET latency_avg_ms = 9e999")
        results = cluster.farm("results", "1", "--controller", cluster.address, "--format", "json")
        records = _strict(results.stdout)
        assert [r["nonfinite"] for r in records] == [["latency_ms.avg"], ["latency_ms.avg"]]
        assert [r["latency_ms"]["avg"] for r in records] == [None, None]
    finally:
        cluster.stop_all()


# --- Ctrl-C ------------------------------------------------------------------------------------------
def test_ctrl_c_leaves_the_job_interrupted_and_resume_finishes_it(tmp_path: Path, tiny_models, farm, farm_db: Path) -> None:
    os.symlink(tiny_models["tflite"], tmp_path / "tiny.tflite")
    (tmp_path / "slow.py").write_text("import json, time\ntime.sleep(1.5)\nprint(json.dumps({'latency_ms': 1.0}))\n")
    write_job(tmp_path, """
models: [tiny.tflite]
workload: {type: script, script: slow.py}
matrix: {threads: [1, 2]}
repeats: 3
sim: {memory: 256m, on_contention: flag}
""")
    submit = subprocess.Popen([*FARM, "submit", "job.yaml"], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "FARM_DB": str(farm_db)})

    def first_run_stored() -> bool:
        if not farm_db.exists():
            return False
        with sqlite3.connect(farm_db, timeout=30) as conn:
            return "runs" in {r[0] for r in conn.execute("SELECT name FROM sqlite_master")} and \
                conn.execute("SELECT COUNT(*) FROM runs WHERE status = 'completed'").fetchone()[0] >= 1

    wait_for(first_run_stored, 120, "the first run to be stored")
    submit.send_signal(signal.SIGINT)
    _, stderr = submit.communicate(timeout=60)
    assert submit.returncode == 130, stderr
    assert "Traceback" not in stderr

    status = farm("status", "1", "--json").json()
    assert status["status"] == "interrupted" and status["canceled"] == 0
    assert 1 <= status["completed"] < 6 and status["pending"] == 6 - status["completed"]
    assert "farm resume 1" in status["message"]
    records = farm("results", "1", "--format", "json").json()
    for r in records:
        if r["status"] == "pending":  # not run yet: the budget it will get, not "no cpu cap"
            assert r["limits"]["cpus"] == r["threads"] and r["limits"]["memory_mb"] == 256
    assert "no cpu cap" not in farm("results", "1").stdout
    resumed = farm("resume", "1", "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.json()["status"] == "completed"
    assert [r["status"] for r in resumed.json()["results"]] == ["completed"] * 6


# --- strict JSON -------------------------------------------------------------------------------------
def _strict(text: str):
    def refuse(constant: str):
        raise AssertionError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_a_stored_infinity_is_printed_as_null_with_a_flag(job: Path, farm, farm_db: Path) -> None:
    assert farm("submit", str(job)).returncode == 0
    with sqlite3.connect(farm_db) as conn:  # what a hostile agent's result left in the store
        conn.execute("UPDATE summaries SET latency_avg_ms = 9e999, latency_p90_ms = -9e999")
    for args in (("results", "1", "--format", "json"), ("results", "1", "--json")):
        run = farm(*args)
        assert run.returncode == 0, run.stderr
        record = _strict(run.stdout)[0]
        assert record["latency_ms"]["avg"] is None and record["latency_ms"]["p90"] is None
        assert record["nonfinite"] == ["latency_ms.avg", "latency_ms.p90"]
        assert record["latency_ms"]["p50"] > 0  # the finite figures are untouched
    table = farm("results", "1")
    assert table.returncode == 0 and "Traceback" not in table.stderr


def test_strict_json_flags_each_record() -> None:
    from farm.proto import strict_json
    document = {"job": 1, "results": [{"a": {"b": [1.0, float("nan")]}, "c": 2.5}, {"a": float("-inf")}]}
    assert _strict(strict_json.dumps(document)) == {"job": 1, "results": [
        {"a": {"b": [1.0, None]}, "c": 2.5, "nonfinite": ["a.b[1]"]}, {"a": None, "nonfinite": ["a"]}]}
    # a record already flagged (by the controller) keeps its flag when printed again
    assert _strict(strict_json.dumps([{"x": None, "nonfinite": ["x"]}])) == [{"x": None, "nonfinite": ["x"]}]


# --- special files: refused by type before any read, so nothing blocks and nothing grows ---------------
@pytest.mark.parametrize("command", [("submit", "{fifo}"), ("submit", "{job_naming_fifo}"), ("inspect", "{fifo}"),
                                     ("predict", "{fifo}", "--device", "phone"), ("inspect", "/dev/zero"),
                                     ("submit", "/dev/zero")])
def test_a_fifo_or_a_device_is_refused_unread(command: tuple[str, ...], farm_inprocess, farm_db: Path,
                                              tmp_path: Path) -> None:
    # in this process: a read that blocked would hang the test until pytest's timeout fails it
    fifo = tmp_path / "model.tflite"
    os.mkfifo(fifo)  # nobody ever writes to it: a read would block forever
    job_naming_fifo = write_job(tmp_path, "models: [model.tflite]\n")
    args = [a.format(fifo=fifo, job_naming_fifo=job_naming_fifo) for a in command]
    kind = "a character device" if "/dev/zero" in args else "a FIFO (named pipe)"
    one_paragraph_error(farm_inprocess(*args), [kind, "not a regular file", "model file" if command[0] != "submit"
                                                  or "job_naming" in command[1] else "job file"])
    assert not os.path.exists(farm_db) or jobs_in(farm_db) == []


def test_files_over_the_size_limit_are_refused_by_their_size(tmp_path: Path) -> None:
    from farm.proto.regular_files import FileRefused, read_regular_file
    big = tmp_path / "big.yaml"
    with big.open("wb") as f:
        f.truncate(10 << 20)  # sparse: 10 MB that were never written, and are never read
    with pytest.raises(FileRefused, match=r"10,485,760 bytes, over the limit of 1,048,576 bytes for a job file"):
        read_regular_file(big, "job file", 1 << 20)


def test_a_small_file_under_a_huge_limit_is_read_without_allocating_the_limit(tmp_path: Path) -> None:
    """A model's limit is GiBs: reading a small model must not ask for all of it at once (a MemoryError on a
    small VM, found in the cgroup-v2 VM); 1 TiB is past what this machine could allocate, and more than one
    read's worth (1 MiB) still comes back whole."""
    from farm.proto.regular_files import read_regular_file
    small, medium = tmp_path / "small.onnx", tmp_path / "medium.onnx"
    small.write_bytes(b"abc")
    medium.write_bytes(bytes(range(256)) * 5000)
    assert read_regular_file(small, "model file", 1 << 40) == b"abc"
    assert read_regular_file(medium, "model file", 1 << 40) == bytes(range(256)) * 5000


# --- a store path whose folder is missing: an error (a typo must not look like an empty store) ------
@pytest.mark.parametrize("how", ["--db", "FARM_DB", "web --db", "controller --db"])
def test_a_store_in_a_missing_folder_is_an_error_unless_create(how: str, job: Path, farm_process, farm_inprocess,
                                                                tmp_path: Path) -> None:
    # the servers run as processes: were the refusal broken, one would serve until the timeout, not hang the test
    run = farm_process if how in ("web --db", "controller --db") else \
        lambda *args, timeout=None, **kwargs: farm_inprocess(*args, **kwargs)
    db = tmp_path / "typo" / "deeper" / "farm.db"
    command = {"--db": ("jobs", "--db", str(db)), "FARM_DB": ("jobs",),
               "web --db": ("web", "--db", str(db), "--listen", "127.0.0.1:0"),
               "controller --db": ("controller", "serve", "--no-auth", "--listen", "127.0.0.1:0", "--db", str(db))}[how]
    env = {"FARM_DB": str(db)} if how == "FARM_DB" else None
    refused = run(*command, env=env, timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert "Traceback" not in refused.stderr and "\n\n" not in refused.stderr.strip()
    for fragment in (str(db), f"{tmp_path / 'typo'} is missing", "--create"):
        assert fragment in refused.stderr, refused.stderr
    assert not (tmp_path / "typo").exists()  # nothing was made
    if how in ("--db", "FARM_DB"):
        made = run(*command, "--create", env=env)
        assert made.returncode == 0 and db.is_file(), made.stderr


def test_the_python_api_checks_its_arguments_as_the_cli_does(tmp_path: Path) -> None:
    import farm
    for kwargs, fragments in (({"backend": "quantum"}, ["'quantum'", "auto, cgroup, docker, process"]),
                              ({"slots": 0}, ["slots=0", "at least 1"]),
                              ({"slots": 10_000}, ["connect(slots=10000)", "10000 sim slots need 10000 cores"]),
                              ({"db": 5}, ["connect(db=5)", "file path"]),
                              ({"db": tmp_path / "missing" / "farm.db"}, ["missing is missing", "create=True"])):
        with pytest.raises(farm.FarmError) as refused:
            farm.connect(**{"db": tmp_path / "farm.db", **kwargs}).close()
        assert all(f in str(refused.value) for f in fragments), str(refused.value)
    assert not (tmp_path / "missing").exists()
    with farm.connect(db=tmp_path / "made" / "farm.db", create=True) as lab:
        assert (tmp_path / "made" / "farm.db").is_file()
        for job in (None, 3, "", b"job.yaml"):
            with pytest.raises(farm.FarmError, match="give a job file's path"):
                lab.submit(job)  # type: ignore[arg-type]
        with pytest.raises(farm.FarmError, match="interactive, normal, low"):
            lab.submit(tmp_path / "job.yaml", priority="urgent")
        with pytest.raises(farm.FarmError, match="--set repeats=lots"):
            lab.submit({"models": ["x.tflite"]}, overrides={"repeats": "lots"})


def test_calibrating_a_job_against_itself_is_refused(farm_inprocess) -> None:
    one_paragraph_error(farm_inprocess("calibrate", "--sim-job", "1", "--device-job", "1", "--device", "half-cpu"),
                        ["--sim-job 1 --device-job 1", "against itself", "--job J"])


def test_control_characters_in_job_and_model_names_never_reach_the_terminal(farm, tmp_path: Path, tiny_models) -> None:
    # the names come from a job file (hostile): an escape would recolour or retitle the terminal, a newline
    # would forge a line, and rich markup would be obeyed; whatever the run's outcome, every line shows them escaped
    os.symlink(tiny_models["tflite"], tmp_path / "tiny.tflite")
    write_job(tmp_path, 'name: "J\\e[31mred\\nforged [bold]x[/bold]"\n'
                        'models:\n  - {path: tiny.tflite, name: "m\\e]0;title\\a\\rback [bold]y[/bold]"}\n'
                        "workload: {type: benchmark, iterations: 2, warmup: 0}\nsim: {memory: 256m, on_contention: flag}\n")
    said = [farm("submit", "job.yaml", *extra, cwd=tmp_path) for extra in ((), ("--progress",))]  # lines, then a bar
    said += [farm(*command, cwd=tmp_path) for command in (("jobs",), ("status", "1"), ("results", "1", "--runs"))]
    for run in said:
        text = run.stdout + run.stderr
        assert "Traceback" not in text, text
        assert not any(c in text for c in "\x1b\x07\r"), repr(text)
        assert not any(line.startswith(("forged", "back")) for line in text.splitlines()), text
    progress_lines = [ln for ln in said[0].stderr.splitlines() if ln.startswith("[1/1] ")]
    assert progress_lines and "m\\x1b]0;title\\x07\\rback [bold]y[/bold]" in progress_lines[0]  # escaped, markup shown
    assert "J\\x1b[31mred\\nforged [bold]x[/bold]" in said[3].stdout


def test_a_store_locked_mid_run_is_a_warning_line_not_a_heartbeat_traceback(monkeypatch, caplog, tmp_path: Path) -> None:
    # the lease renewals of a running task meet a store another process holds locked (sqlite3's own error,
    # as the store raises it after its busy timeout); the run goes on, each miss is one log line
    import threading
    import time as clock

    from farm.agents import agent as agent_module
    from farm.proto.results import RunResult
    from farm.proto.tasks import TaskPlan, TaskSpec

    class LockedStore:  # the controller side of a store someone else holds, then lets go
        def __init__(self) -> None:
            self.beats = 0
            self.completed: list[RunResult] = []

        def heartbeat(self, task_id: int, attempt: int) -> bool:
            self.beats += 1
            if self.beats <= 2:
                raise sqlite3.OperationalError("database is locked")
            return True

        def complete(self, task_id, attempt, agent, started_at, result) -> int:
            self.completed.append(result)
            return 1

    class SlowMachine:  # the sim's hardware: a run that takes a few heartbeats
        def in_slot(self, slot):
            return self

        def run(self, task, cancel_check) -> RunResult:
            deadline = clock.monotonic() + 1.0
            while clock.monotonic() < deadline and not cancel_check():
                clock.sleep(0.01)
            return RunResult.failed(agent_module.FailureClass.JOB, "stopped" if cancel_check() else "ran to its end")

    crashes: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda hook: crashes.append(hook.exc_value))
    monkeypatch.setattr(agent_module, "HEARTBEAT_INTERVAL_S", 0.1)
    store = LockedStore()
    runner = agent_module.Agent(store, SlowMachine(), name="a1")  # type: ignore[arg-type]
    task = TaskSpec(task_id=7, job_id=1, attempt=1, target="sim", model_name="m", model_path=str(tmp_path / "m.tflite"),
                    model_sha256="0" * 64, model_family=None, threads=1, batch_size=1, input_size=None, repeat=0,
                    plan=TaskPlan(workload={"type": "benchmark"}, sim={}, run_timeout_s=60, base_dir=str(tmp_path)))
    with caplog.at_level("WARNING", logger="farm.agent"):
        result = runner.run_task(task, runner.sim)  # the driver the sim slots run with
    assert not crashes and result.message == "ran to its end" and store.completed == [result]
    assert store.beats >= 3  # it kept renewing after the lock
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("could not renew its lease (OperationalError: database is locked)" in ln
                                   and "the run goes on" in ln for ln in lines)
