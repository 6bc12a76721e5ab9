"""Issue 32 items 5 and 6 as a lab manager meets them: a failed run says why wherever its results are shown,
the report's job spec reads as the job file it came from, and failure texts are one clean paragraph.
The audit of every bullet is docs/how-to/lab-trust.md."""

from __future__ import annotations

import html
import re
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import write_job


@pytest.fixture
def failed_job(tmp_path: Path, tiny_models, farm) -> Path:
    """Job 1: one model that runs and one its runtime refuses (stored as a `job` failure by --skip-invalid)."""
    shutil.copy(tiny_models["onnx"], tmp_path / "tiny.onnx")
    shutil.copy(tiny_models["unsupported_onnx"], tmp_path / "custom_op.onnx")
    job = write_job(tmp_path, "name: trust\nmodels: [tiny.onnx, custom_op.onnx]\n"
                              "workload: {type: benchmark, iterations: 5, warmup: 1}\ntargets: [sim]\n"
                              "sim: {memory: 512m}\n")
    submitted = farm("submit", str(job), "--skip-invalid", "--quiet")
    assert submitted.returncode == 1, submitted.stderr  # the job ran, a run failed
    return job


@pytest.mark.parametrize("form", [(), ("--wide",), ("--runs",)])
def test_results_tables_say_why_a_run_failed(failed_job: Path, farm, form: tuple[str, ...]) -> None:
    shown = farm("results", "1", *form)
    assert shown.returncode == 0, shown.stderr
    lines = [line for line in shown.stderr.splitlines() if line.startswith("failed ")]
    assert len(lines) == 1, shown.stderr  # one paragraph for the one failed run, none for the one that ran
    assert lines[0].startswith("failed custom_op (threads 1, repeat 0): job: ") and "FarmUnknownOp" in lines[0]


def test_report_shows_the_job_spec_as_yaml(failed_job: Path, farm, tmp_path: Path) -> None:
    page_path = tmp_path / "report.html"
    made = farm("report", "1", "-o", str(page_path))
    assert made.returncode == 0, made.stderr
    page = page_path.read_text()
    block = re.search(r"<h2 id=spec>.*?<summary>(.*?)</summary><pre>(.*?)</pre>", page, re.S)
    assert block is not None and "YAML" in block.group(1)
    text = html.unescape(block.group(2))
    assert "\\n" not in text and text.count("\n") > 20  # one field a line, not one line of literal \n
    spec = yaml.safe_load(text)  # the stored spec back, field for field
    assert spec["name"] == "trust" and spec["models"] == ["tiny.onnx", "custom_op.onnx"]
    assert spec["matrix"]["threads"] == [1] and spec["targets"] == ["sim"]
    assert spec["workload"]["iterations"] == 5 and spec["sim"]["on_contention"] == "flag"


def test_a_fetch_failure_is_one_clean_paragraph(tmp_path: Path) -> None:
    """A model the controller does not hold: the run's message is the controller's status and words on one line,
    not grpc's object repr (`<_MultiThreadedRendezvous ...>` with its debug_error_string)."""
    import grpc

    from farm.agents.link.remote_controller import RemoteController
    from farm.proto.tasks import TaskPlan, TaskSpec
    from grpc_processes import Cluster

    cluster = Cluster(tmp_path, env={})
    try:
        cluster.serve_in_process()
        agent = RemoteController(str(cluster.address), name="rack", token=None, devices=[],
                                 artifact_dir=tmp_path / "cache")
        task = TaskSpec(task_id=1, job_id=1, attempt=1, target="sim", model_name="m", model_path="/elsewhere/m.onnx",
                        model_sha256="ab" * 32, model_family=None, threads=1, batch_size=1, input_size=None, repeat=0,
                        plan=TaskPlan(workload={"type": "benchmark"}, sim={}, run_timeout_s=60, base_dir="/elsewhere"))
        with pytest.raises(grpc.RpcError) as raised:
            agent.local_model_path(task)
        message = agent.fetch_failure(task, raised.value)
    finally:
        cluster.stop_all()
    assert "\n" not in message and "<_" not in message and "debug_error_string" not in message
    assert message.startswith(f"agent rack could not fetch model {'ab' * 6} (or the script folder or dataset): the controller at ")
    assert "answered NOT_FOUND: no artifact with sha256" in message
    assert not list((tmp_path / "cache").glob("*.part"))  # nothing half-written left in the cache


def test_a_retry_that_fails_keeps_the_contended_measurement(tmp_path: Path, tiny_models) -> None:
    """sim.on_contention: retry measured attempt 1 again because it was contended; every later attempt failed
    fetching the model. The task ends with attempt 1's figures, flagged, not as a failure without any."""
    import time

    from farm.controller.scheduling.controller import Controller
    from farm.controller.scheduling.jobfile import load_job_text
    from farm.controller.store import SQLiteStore
    from farm.proto.results import Contention, FailureClass, LatencyStats, RunResult, RunStatus

    job = load_job_text(f"models: [{tiny_models['tflite']}]\nsim: {{on_contention: retry}}\n", "job.yaml", tmp_path)
    controller = Controller(SQLiteStore(tmp_path / "farm.db"))
    job_id = controller.submit(job)
    latency = LatencyStats(None, None, None, 2.5, 2.5, 2.6, 2.7, 0.1, 2.4, 2.8, 20)
    contended = RunResult(status=RunStatus.COMPLETED, latency=latency, iterations_ms=[2.5] * 20,
                          contention=Contention(contended=True, reasons=["others used 40 % of the run's core"]))
    t = controller.lease("a", {"sim"}, job_id=job_id)
    controller.complete(t.task_id, t.attempt, "a", time.time(), contended)
    assert controller.store.jobs.task(t.task_id).status == "pending"  # measured again, as the policy says
    while (t := controller.lease("a", {"sim"}, job_id=job_id)) is not None:
        controller.complete(t.task_id, t.attempt, "a", time.time(), RunResult.failed(
            FailureClass.INFRASTRUCTURE, "agent a could not fetch model 0123456789ab: the controller answered NOT_FOUND"))
    task = controller.store.jobs.task(t.task_id if t else 1)
    assert task.status == "completed" and task.failure_class is None
    assert "attempt 1's measurement kept, contended and flagged" in task.message
    assert "NOT_FOUND" in task.message
    [result] = controller.store.runs.results(job_id)
    assert result.latency_avg_ms == 2.5  # attempt 1's figures
    shown = controller.store.query("SELECT r.attempt, r.contended FROM tasks t JOIN runs r ON r.id = t.last_run_id")
    assert shown == [{"attempt": 1, "contended": 1}]  # flagged: calibrations leave it out unless asked
    runs = controller.store.query("SELECT attempt, status FROM runs ORDER BY attempt")
    assert runs[0] == {"attempt": 1, "status": "completed"} and all(r["status"] == "failed" for r in runs[1:])
    assert controller.progress(job_id).completed == 1 and controller.store.jobs.get(job_id).status == "completed"


def test_a_failure_with_no_measurement_before_it_still_fails(tmp_path: Path, tiny_models) -> None:
    import time

    from farm.controller.scheduling.controller import Controller
    from farm.controller.scheduling.jobfile import load_job_text
    from farm.controller.store import SQLiteStore
    from farm.proto.results import FailureClass, RunResult

    job = load_job_text(f"models: [{tiny_models['tflite']}]\n", "job.yaml", tmp_path)
    controller = Controller(SQLiteStore(tmp_path / "farm.db"))
    job_id = controller.submit(job)
    t = controller.lease("a", {"sim"}, job_id=job_id)
    controller.complete(t.task_id, t.attempt, "a", time.time(), RunResult.failed(FailureClass.JOB, "bad model"))
    task = controller.store.jobs.task(t.task_id)
    assert (task.status, task.failure_class, task.message) == ("failed", "job", "bad model")


def _store_contended_jobs(tmp_path: Path) -> Path:
    """Two sim jobs (1 and 0.5 CPU) of four models, every run contended, stored through the real controller."""
    import time

    from farm.controller.scheduling.controller import Controller
    from farm.controller.scheduling.jobfile import load_job_text
    from farm.controller.store import SQLiteStore
    from farm.model_generators.generate import generate_examples
    from farm.proto.results import Contention, LatencyStats, RunResult, RunStatus

    models = [str(m.path) for m in generate_examples(tmp_path / "models", widths=[0.35, 0.5, 0.75, 1.0],
                                                     input_sizes=[96], formats=("tflite",), zoo=False)]
    controller = Controller(SQLiteStore(tmp_path / "farm.db"))
    for cpus, scale in ((1.0, 1.0), (0.5, 2.1)):
        job = load_job_text(f"models: {models}\nsim: {{cpus: {cpus}, on_contention: flag}}\n", "job.yaml", tmp_path)
        job_id = controller.submit(job)
        while (t := controller.lease("a", {"sim"}, job_id=job_id)) is not None:
            ms = scale * (1.0 + t.task_id % 4)
            controller.complete(t.task_id, t.attempt, "a", time.time(), RunResult(
                status=RunStatus.COMPLETED, latency=LatencyStats(None, None, None, ms, ms, ms, ms, 0.01, ms, ms, 10),
                iterations_ms=[ms] * 10, contention=Contention(contended=True, reasons=["a hog on the run's core"])))
    controller.store.close()
    return tmp_path / "farm.db"


def test_calibrate_over_contended_runs_only_says_why_nothing_was_fitted(tmp_path: Path) -> None:
    import farm
    from farm.client.errors import FarmError

    db = _store_contended_jobs(tmp_path)
    with farm.connect(db=db) as lab:
        with pytest.raises(FarmError, match=r"calibrate\(\): nothing was fitted: .*8 contended run\(s\) left out.*"
                                            r"include_contended=True"):
            lab.calibrate(sim_job=1, device_job=2, device="half-cpu")
        assert lab.calibrate(sim_job=1, device_job=2, device="half-cpu", include_contended=True)


def test_report_says_why_rankings_are_empty(tmp_path: Path) -> None:
    """Every run contended: the report's rankings say nothing was ranked and why, not an empty section."""
    from farm.controller.analysis.report import build_report
    from farm.controller.store import SQLiteStore

    store = SQLiteStore(_store_contended_jobs(tmp_path))
    page, _, _ = build_report(store, 1)
    rankings = page[page.index("<h2 id=rankings>"):page.index("<h2 id=spec>")]
    assert "latency: not ranked: job 1 has no completed sim run with a latency figure to rank" in rankings
    assert "4 contended run(s) left out" in rankings


def test_report_names_models_a_sweep_chart_or_a_ranking_column_leaves_out(tmp_path: Path) -> None:
    """Four models of one family swept over 1 and 2 threads; two failed at 2 threads. The family's sweep chart
    draws two lines and names the other two (it dropped them without a word)."""
    import time

    from farm.controller.analysis.report import build_report
    from farm.controller.scheduling.controller import Controller
    from farm.controller.scheduling.jobfile import load_job_text
    from farm.controller.store import SQLiteStore
    from farm.model_generators.generate import generate_examples
    from farm.proto.results import FailureClass, LatencyStats, RunResult, RunStatus

    models = sorted(str(m.path) for m in generate_examples(tmp_path / "models", widths=[0.35, 0.5, 0.75, 1.0],
                                                           input_sizes=[96], formats=("tflite",), zoo=False))
    controller = Controller(SQLiteStore(tmp_path / "farm.db"))
    listed = ", ".join(f"{{path: {m}, family: mnv2}}" for m in models)
    job_id = controller.submit(load_job_text(f"models: [{listed}]\nmatrix: {{threads: [1, 2]}}\n"
                                             "sim: {on_contention: flag}\n", "job.yaml", tmp_path))
    while (t := controller.lease("a", {"sim"}, job_id=job_id)) is not None:
        wide = t.model_name.endswith(("w0.75_r96", "w1.0_r96"))
        ms = (1.0 + t.task_id) / t.threads
        result = RunResult.failed(FailureClass.JOB, "out of luck") if wide and t.threads == 2 else RunResult(
            status=RunStatus.COMPLETED, latency=LatencyStats(None, None, None, ms, ms, ms, ms, 0.01, ms, ms, 10),
            iterations_ms=[ms] * 10)
        controller.complete(t.task_id, t.attempt, "a", time.time(), result)
    page, _, _ = build_report(controller.store, job_id)
    plots = page[page.index("<h2 id=sweeps>"):page.index("<h2 id=telemetry>")]
    assert "<h3>mnv2 against threads</h3>" in plots
    assert "mnv2 against threads: 2 line(s) not drawn, each with one threads value" in plots
    assert "mobilenetv2_w0.75_r96" in plots and "mobilenetv2_w1.0_r96" in plots.split("not drawn")[1]
    assert "mobilenetv2_w0.35_r96" not in plots.split("not drawn")[1]


def test_a_ranking_column_names_the_models_it_has_no_figure_for() -> None:
    from farm.controller.analysis.report import _ranking_group
    from farm.proto.questions import RankColumn, RankGroup

    group = RankGroup(threads=1, batch_size=1, input_size=None, columns=[
        RankColumn(name="sim (job 1)", kendall_tau=None, order=[("a", 1.0), ("b", 2.0), ("c", 3.0)], notes=[]),
        RankColumn(name="pixel (job 2)", kendall_tau=None, order=[("a", 9.0)], notes=[]),
        RankColumn(name="jetson (predicted)", kendall_tau=None, order=[], notes=["c: not predicted (no macs)"])])
    section = _ranking_group("latency", group)
    assert "<p class=note>pixel (job 2): no completed figure for b, c</p>" in section
    assert "<p class=note>jetson (predicted): no completed figure for a, b, c</p>" in section
    assert "c: not predicted (no macs)" in section


def test_tasks_failed_by_a_quarantine_are_recent_failures(tmp_path: Path, tiny_models) -> None:
    """A quarantined device's waiting tasks fail without a run: the lab page's "Recent failures" lists them."""
    import time

    from farm.controller.scheduling.controller import Controller
    from farm.controller.scheduling.jobfile import DeviceTarget, load_job_text
    from farm.controller.store import SQLiteStore
    from farm.proto.results import FailureClass, RunResult
    from farm.web.pages import failures_panel
    from farm.web.views import RecentFailure

    controller = Controller(SQLiteStore(tmp_path / "farm.db"))
    job_id = controller.submit(load_job_text(f"models: [{tiny_models['tflite']}]\nsim: {{on_contention: flag}}\n",
                                             "sim.yaml", tmp_path))
    t = controller.lease("a", {"sim"}, job_id=job_id)
    controller.complete(t.task_id, t.attempt, "a", time.time(), RunResult.failed(FailureClass.JOB, "bad model"))
    device_job = controller.submit(load_job_text(
        f"models: [{tiny_models['tflite']}]\nmatrix: {{threads: [1, 2]}}\ntargets: [pixel-1]\n", "device.yaml", tmp_path,
        devices=[DeviceTarget("pixel-1")]))
    assert controller.quarantine("pixel-1", "adb says offline") == 2
    failures = controller.store.reads.recent_failures(10)
    quarantined = [f for f in failures if f["job_id"] == device_job]
    assert len(quarantined) == 2 and all(f["run_id"] is None and f["target"] == "pixel-1" for f in quarantined)
    assert all(f["failure_class"] == "infrastructure" and "device pixel-1 is quarantined (adb says offline)" in f["message"]
               for f in quarantined)
    assert [f["job_id"] for f in failures] == [device_job, device_job, job_id]  # newest first, the run's too
    panel = failures_panel([RecentFailure(**f) for f in failures])
    assert panel.count("tiny @ pixel-1") == 2 and "device pixel-1 is quarantined" in panel and "bad model" in panel


def test_a_passed_health_check_never_releases_a_quarantined_device(tmp_path: Path) -> None:
    from farm.controller.scheduling.controller import Controller
    from farm.controller.store import SQLiteStore

    controller = Controller(SQLiteStore(tmp_path / "farm.db"))
    assert controller.passed_health_check("pixel-1", "passed job 1")
    controller.quarantine("jetson-1", "golden results left their history")
    assert not controller.passed_health_check("jetson-1", "passed job 2")
    health = controller.store.devices.health_by_name()
    assert (health["pixel-1"].health, health["pixel-1"].reason) == ("good", "passed job 1")
    assert health["jetson-1"].health == "bad"  # only a person releases it


def test_the_store_panel_of_a_postgresql_lab_names_its_database(postgres_peer, tmp_path: Path) -> None:
    """The dashboard's Store panel (and the controller's watch) show the database's address, without a password,
    not the made-up file path of the local folder a PostgreSQL store keeps."""
    from conftest import fresh_postgres_url
    from farm.controller.scheduling.store_file import StoreFileWatch
    from farm.controller.store.postgres import PostgresStore
    from farm.web.pages import store_facts

    url = fresh_postgres_url(postgres_peer, "store_panel")
    store = PostgresStore(url.replace("://farm@", "://farm:s3cret@") if "://farm@" in url else url,
                          files_dir=tmp_path / "files")
    try:
        state = StoreFileWatch.for_store(store).check()
    finally:
        store.close()
    assert state.database and state.ok and state.path == store.location
    assert state.path.startswith("postgresql://") and state.path.endswith("/t_store_panel") and "s3cret" not in state.path
    panel = store_facts(state)
    assert "<dt>database</dt>" in panel and state.path in panel
    assert "farm-postgresql" not in panel and ">linked<" not in panel and "s3cret" not in panel


def test_the_store_panel_of_a_sqlite_lab_still_watches_its_file(tmp_path: Path) -> None:
    from farm.controller.scheduling.store_file import StoreFileWatch
    from farm.controller.store import SQLiteStore
    from farm.web.pages import store_facts

    store = SQLiteStore(tmp_path / "farm.db")
    watch = StoreFileWatch.for_store(store)
    state = watch.check()
    assert not state.database and state.path == str(tmp_path / "farm.db") and state.size_bytes
    assert "<dt>path</dt>" in store_facts(state) and ">linked<" in store_facts(state)
    (tmp_path / "farm.db").unlink()
    assert not watch.check().ok
    watch.close()
    store.close()


@pytest.mark.process
def test_a_full_disk_mid_job_is_a_clear_error_and_the_job_resumes(tmp_path: Path, tiny_models, farm_process) -> None:
    """The store's disk fills while a job runs (a real tmpfs, filled by the test after the first run): the runner
    stops with one paragraph and exit 3, not a thread's traceback; the job reads `interrupted`, and once space is
    freed `farm resume` finishes it with the runs stored before kept."""
    import os
    import sqlite3
    import subprocess
    import time

    from conftest import FARM

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], check=True)
    try:
        db = disk / "farm.db"
        shutil.copy(tiny_models["onnx"], tmp_path / "tiny.onnx")
        job = write_job(tmp_path, "name: fill\nmodels: [tiny.onnx]\nworkload: {type: benchmark, iterations: 500, "
                                  "warmup: 1}\nrepeats: 8\ntargets: [sim]\nsim: {memory: 512m}\n")
        runner = subprocess.Popen([*FARM, "submit", str(job), "--db", str(db), "--quiet"], cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "FARM_DB": str(db)})

        def completed_runs() -> int:
            try:
                with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
                    return conn.execute("SELECT COUNT(*) FROM runs WHERE status = 'completed'").fetchone()[0]
            except sqlite3.OperationalError:
                return 0

        while completed_runs() < 1 and runner.poll() is None:
            time.sleep(0.2)
        assert runner.poll() is None, runner.communicate()
        filler = disk / "filler"
        with filler.open("wb") as f:  # every free byte: the next write of the store fails
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        out, err = runner.communicate(timeout=300)
        assert runner.returncode == 3, err
        assert "Traceback" not in err and "Exception in thread" not in err
        assert f"error: the disk holding the store {db} is full" in err and "`farm resume JOB`" in err
        stored = completed_runs()
        assert 1 <= stored < 8

        filler.unlink()
        status = farm_process("status", "1", "--db", str(db))
        assert "interrupted" in status.stdout and "farm resume 1" in status.stdout, status.stdout + status.stderr
        resumed = farm_process("resume", "1", "--db", str(db), "--quiet")
        assert resumed.returncode == 0, resumed.stderr
        assert completed_runs() == 8  # the runs stored before the disk filled, and the rest
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_connect_with_a_store_uses_it_even_when_a_controller_is_configured(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """farm.connect(db=...) names the lab: $FARM_CONTROLLER is for a connect() that names none (it was talked to
    instead, and its error then told the user to use connect(db=...))."""
    import farm
    from farm.client.errors import FarmError

    monkeypatch.setenv("FARM_CONTROLLER", "127.0.0.1:1")  # nothing listens there
    with farm.connect(db=tmp_path / "farm.db") as lab:
        assert lab.farm.embedded and lab.jobs() == []
    assert (tmp_path / "farm.db").exists()
    with pytest.raises(FarmError, match="a lab is a controller or a store; give one of them"):
        farm.connect("127.0.0.1:1", db=tmp_path / "farm.db")


@pytest.mark.parametrize("include", [False, True])
def test_the_nightly_refresh_can_fit_contended_runs(tmp_path: Path, include: bool, caplog) -> None:
    """Every sim run of the suite contended (a busy lab host): the controller's nightly leaves them out, as
    `farm refresh` does, unless it was started with --refresh-include-contended; either way it says so."""
    import time

    from farm.controller.operations.nightly import Cron, NightlyRefresh
    from farm.controller.operations.reference_suite import bundled_suite_text, submit_reference_suite
    from farm.controller.scheduling.controller import Controller
    from farm.controller.scheduling.jobfile import DeviceTarget
    from farm.controller.store import SQLiteStore
    from farm.proto.results import Contention, LatencyStats, RunResult, RunStatus

    suite = tmp_path / "suite" / "reference-suite.yaml"
    suite.parent.mkdir()
    suite.write_text(bundled_suite_text().replace("threads: [1, 2]", "threads: [1]"))
    store = SQLiteStore(tmp_path / "farm.db")
    phone = DeviceTarget("g6-1")
    job_id = submit_reference_suite(store, [phone], suite)
    nightly = NightlyRefresh(store, suite, Cron.parse("@daily"), lambda: [phone], include_contended=include)
    controller = Controller(store)
    for target, scale in (("sim", 1.0), ("g6-1", 3.0)):
        while (t := controller.lease("a", {target}, job_id=job_id)) is not None:
            ms = scale * (1.0 + t.task_id % 5)
            controller.complete(t.task_id, t.attempt, "a", time.time(), RunResult(
                status=RunStatus.COMPLETED, latency=LatencyStats(None, None, None, ms, ms, ms, ms, 0.01, ms, ms, 10),
                iterations_ms=[ms] * 10,
                contention=Contention(contended=target == "sim", reasons=["a hog on the run's core"])))
    assert store.jobs.get(job_id).status == "completed"
    with caplog.at_level("WARNING", logger="farm"):
        nightly.check_finished()
    fitted = store.query("SELECT device FROM calibrations")
    assert bool(fitted) == include and all(r["device"] == "g6-1" for r in fitted)
    said = "contended sim run(s) left out of the fits (`farm controller serve --refresh-include-contended` uses them)"
    assert (said in caplog.text) != include


def test_a_fetch_failure_retried_is_told_once_per_task(tmp_path: Path, tiny_models) -> None:
    """A model the controller lost before its agent fetched it: every attempt fails fetching it (infrastructure, so
    retried). `farm results`, the report and the dashboard's Recent failures say so once for the task, with how
    many attempts failed, not once per attempt."""
    from farm.controller.analysis.results import run_records
    from farm.web.pages import failures_panel
    from farm.web.views import RecentFailure
    from grpc_processes import Cluster, sleep_job, wait_for

    cluster = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(tmp_path / "none"),
                                     "XDG_DATA_HOME": str(tmp_path / "data")}, cli_in_process=True)
    try:
        server = cluster.serve_in_process()
        job = sleep_job(tmp_path, tiny_models["onnx"], tasks=1, seconds=0.1)
        assert cluster.farm("submit", str(job), "--controller", str(cluster.address), "--detach").returncode == 0
        artifacts = [p for p in (tmp_path / "controller-artifacts").iterdir() if p.suffix == ".onnx"]
        assert artifacts, "the upload was not kept where this test looks"
        for path in artifacts:
            path.unlink()  # the controller lost the model (a disk replaced, a collection gone wrong)
        cluster.agent_in_process("rack")
        store = server.store
        wait_for(lambda: store.jobs.get(1).status == "failed", 120, "the job to fail")
        attempts = store.query("SELECT attempt, failure_class FROM runs ORDER BY attempt")
        assert [r["failure_class"] for r in attempts] == ["infrastructure"] * 3, attempts  # retried, as it should be
        shown = cluster.farm("results", "1", "--controller", str(cluster.address))
        said = [line for line in shown.stderr.splitlines() if "could not fetch" in line]
        assert len(said) == 1, shown.stderr
        assert said[0].endswith("(the last of 3 attempts)") and "NOT_FOUND" in said[0]
        [record] = run_records(store, 1)
        assert record.attempts == 3
        recent = store.reads.recent_failures(10)
        assert [(r["task_id"], r["failed_attempts"]) for r in recent] == [(1, 3)], recent
        panel = failures_panel([RecentFailure(**r) for r in recent])
        assert panel.count("could not fetch") == 1 and "3 failed attempts" in panel
        report = tmp_path / "report.html"
        assert cluster.farm("report", "1", "--controller", str(cluster.address), "-o", str(report)).returncode == 0
        text = html.unescape(report.read_text())
        assert text.count("could not fetch model") == 1 and "the last of 3 attempts" in text
    finally:
        cluster.stop_all()
