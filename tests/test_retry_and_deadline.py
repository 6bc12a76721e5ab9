"""`farm retry JOB --failed` and the job deadline (timeouts.job), embedded (issue 32, items 3 and 4).

A retry runs only a finished job's failed (or lost) tasks again, as new attempts of the same tasks: every
earlier attempt stays a run, the job's status is true afterwards. timeouts.job is a deadline stored at submit
and enforced by the controller's sweep (Controller.expire_leases), however often the job is resumed.
Time is the controller's injected clock here: no test sleeps out a deadline.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest

from farm.controller.scheduling.controller import Controller, RetryRefused
from farm.controller.scheduling.jobfile import load_job
from farm.controller.store import open_store
from farm.proto.results import FailureClass, RunResult


def _job_file(tmp_path: Path, model: Path, *, threads: str = "[1, 2]", extra: str = "") -> Path:
    job = tmp_path / "job.yaml"
    job.write_text(f"name: retry-probe\nmodels: [{model}]\nmatrix: {{threads: {threads}}}\n"
                   "workload: {iterations: 3, warmup: 1}\nsim: {backend: process, on_contention: flag}\n" + extra)
    return job


def _submit(db: Path, job: Path, clock=time.time) -> int:
    store = open_store(db, create_folder=True)
    try:
        return Controller(store, clock=clock).submit(load_job(job))
    finally:
        store.close()


def _fail_tasks(db: Path, job_id: int, n: int, failure: FailureClass = FailureClass.BUG) -> list[int]:
    """Lease n tasks as another agent and deliver a failure for each: the controller's own path for a result."""
    store = open_store(db)
    try:
        controller = Controller(store)
        failed = []
        for _ in range(n):
            task = controller.lease("other-agent", {"sim"}, job_id=job_id)
            assert task is not None
            controller.complete(task.task_id, task.attempt, "other-agent", time.time(),
                                RunResult.failed(failure, "the harness died (test)"))
            failed.append(task.task_id)
        return failed
    finally:
        store.close()


def test_retry_failed_reruns_only_the_failed_tasks_as_new_attempts(farm_inprocess, farm_db, tmp_path, tiny_models):
    job_id = _submit(farm_db, _job_file(tmp_path, tiny_models["onnx"], threads="[1, 2, 3]"))
    failed = _fail_tasks(farm_db, job_id, 2)

    # unfinished: the job still has a task waiting, so there is nothing to retry yet
    still = farm_inprocess("retry", str(job_id), "--failed")
    assert still.returncode != 0 and f"job {job_id} is running" in still.stderr and "farm watch" in still.stderr

    watched = farm_inprocess("watch", str(job_id), "--quiet")  # this process owns the job: it runs the rest here
    assert watched.returncode == 1, watched.stderr  # runs failed
    status = farm_inprocess("status", str(job_id), "--json").json()
    assert (status["status"], status["completed"], status["failed"]) == ("failed", 1, 2)

    no_flag = farm_inprocess("retry", str(job_id))
    assert no_flag.returncode == 2 and "--failed" in no_flag.stderr
    nothing_canceled = farm_inprocess("retry", str(job_id), "--canceled")
    assert nothing_canceled.returncode != 0 and "no canceled task" in nothing_canceled.stderr

    retried = farm_inprocess("retry", str(job_id), "--failed")
    assert retried.returncode == 0, retried.stderr
    assert f"job {job_id}: 2 of 3 task(s) run again" in retried.stderr
    status = farm_inprocess("status", str(job_id), "--json").json()
    assert (status["status"], status["completed"], status["failed"], status["total"]) == ("completed", 3, 0, 3)
    assert status["message"] == "2 failed task(s) of 3 run again by `farm retry`; their earlier attempts stay stored"

    store = open_store(farm_db)
    try:
        records = {t.id: t for t in store.jobs.tasks(job_id)}
        for task_id in failed:  # attempt 1 (failed, kept) and attempt 2 (the retry) are both stored
            assert records[task_id].attempts == 2 and records[task_id].status == "completed"
    finally:
        store.close()
    with sqlite3.connect(farm_db) as db:  # every attempt is a run: the failed ones kept beside their retries
        runs = db.execute("SELECT task_id, attempt, status FROM runs WHERE job_id = ? ORDER BY task_id, attempt",
                          [job_id]).fetchall()
    assert len(runs) == 5
    for task_id in failed:
        assert [(a, s) for t, a, s in runs if t == task_id] == [(1, "failed"), (2, "completed")]

    again = farm_inprocess("retry", str(job_id), "--failed")
    assert again.returncode != 0 and "no failed task to retry" in again.stderr and "3 completed" in again.stderr
    gone = farm_inprocess("retry", "999", "--failed")
    assert gone.returncode != 0 and "no job 999" in gone.stderr


def test_a_retry_whose_tasks_fail_again_leaves_the_job_failed(farm_db, tmp_path, tiny_models):
    job_id = _submit(farm_db, _job_file(tmp_path, tiny_models["onnx"], threads="[1]"))
    _fail_tasks(farm_db, job_id, 1)
    store = open_store(farm_db)
    try:
        controller = Controller(store)
        assert controller.job_status(job_id) == "failed"
        assert controller.retry(job_id) == 1
        assert controller.job_status(job_id) == "queued"
        with pytest.raises(RetryRefused, match="is queued"):
            controller.retry(job_id)
    finally:
        store.close()
    _fail_tasks(farm_db, job_id, 1, FailureClass.BUG)  # attempt 2 fails too
    store = open_store(farm_db)
    try:
        assert Controller(store).job_status(job_id) == "failed"
        assert store.jobs.task_counts(job_id) == {"failed": 1}
    finally:
        store.close()


def test_the_deadline_is_stored_at_submit_and_the_sweep_ends_the_job(farm_db, tmp_path, tiny_models):
    now = [1_000_000.0]
    job_id = _submit(farm_db, _job_file(tmp_path, tiny_models["onnx"], extra="timeouts: {job: 30s}\n"),
                     clock=lambda: now[0])
    store = open_store(farm_db)
    try:
        row = store.jobs.get(job_id)
        assert row is not None and row.deadline_at == pytest.approx(1_000_030.0)
        controller = Controller(store, clock=lambda: now[0])
        running = controller.lease("an-agent", {"sim"}, job_id=job_id)  # one task runs, one waits
        assert running is not None
        now[0] += 29
        assert controller.enforce_deadlines() == []
        now[0] += 2  # past it: the sweep that expires leases ends the job too
        controller.expire_leases()
        job = store.jobs.get(job_id)
        assert job is not None and job.status == "canceled"
        assert "timeouts.job = 30 s" in (job.message or "")
        assert store.jobs.task_counts(job_id) == {"canceled": 1, "running": 1}
        assert not controller.heartbeat(running.task_id, running.attempt, "an-agent")  # the running one stops
    finally:
        store.close()


def test_a_resume_keeps_the_deadline_and_a_retry_sets_a_new_one(farm_inprocess, farm_db, tmp_path, tiny_models):
    job_id = _submit(farm_db, _job_file(tmp_path, tiny_models["onnx"], extra="timeouts: {job: 1h}\n"),
                     clock=lambda: time.time() - 7200)  # submitted two hours ago: an hour past its deadline
    store = open_store(farm_db)
    try:
        store.jobs.update(job_id, status="interrupted", owner_pid=None)  # as Ctrl+C leaves it
    finally:
        store.close()
    resumed = farm_inprocess("resume", str(job_id), "--quiet")  # the clock did not restart: the runner ends it
    status = farm_inprocess("status", str(job_id), "--json").json()
    assert status["status"] == "canceled", (resumed.stderr, status)
    assert "timeouts.job = 3600 s" in status["message"] and status["completed"] == 0

    retried = farm_inprocess("retry", str(job_id), "--canceled")  # asked again: a new deadline, an hour from now
    assert retried.returncode == 0, retried.stderr
    status = farm_inprocess("status", str(job_id), "--json").json()
    assert (status["status"], status["completed"]) == ("completed", 2)
    store = open_store(farm_db)
    try:
        row = store.jobs.get(job_id)
        assert row is not None and row.deadline_at is not None and row.deadline_at > time.time() + 3000
    finally:
        store.close()


def test_the_stored_spec_keeps_timeouts_job(farm_db, tmp_path, tiny_models):
    job_id = _submit(farm_db, _job_file(tmp_path, tiny_models["onnx"], extra="timeouts: {job: 2m}\n"))
    store = open_store(farm_db)
    try:
        row = store.jobs.get(job_id)
        assert row is not None and json.loads(row.spec_json or "{}")["timeouts"]["job"] == 120
    finally:
        store.close()


def test_a_postgresql_store_at_schema_16_gains_the_deadline_column(request, tmp_path):
    """A lab's database from before deadlines is brought up on open, not refused as 'written by an older farm'."""
    from conftest import fresh_postgres_url
    from farm.controller.store.postgres import PostgresStore
    from farm.controller.store.schema import SCHEMA_VERSION

    url = fresh_postgres_url(request.getfixturevalue("postgres_peer"), request.node.name)
    store = PostgresStore(url, files_dir=tmp_path)
    try:
        store.execute("DROP INDEX idx_jobs_deadline_at")
        store.execute("ALTER TABLE jobs DROP COLUMN deadline_at")
        store.execute("UPDATE schema_version SET version = 16")
    finally:
        store.close()
    store = PostgresStore(url, files_dir=tmp_path)
    try:
        assert store.schema_version() == SCHEMA_VERSION  # 16 -> 17 -> on (each step in turn)
        job_id = store.jobs.insert({"name": "j", "status": "queued", "priority": "normal", "created_at": 1.0,
                                    "deadline_at": 5.0}, [])
        assert store.jobs.past_deadline(6.0) == [job_id]
    finally:
        store.close()


def test_the_python_api_retries_a_job(farm_db, tmp_path, tiny_models, monkeypatch):
    import farm

    job_id = _submit(farm_db, _job_file(tmp_path, tiny_models["onnx"], threads="[1]"))
    _fail_tasks(farm_db, job_id, 1)
    monkeypatch.delenv("FARM_CONTROLLER", raising=False)
    with farm.connect(db=str(farm_db)) as lab:
        job = lab.retry(job_id)
        info = job.wait()
        assert (info.status, info.completed, info.failed) == ("completed", 1, 0)
        with pytest.raises(farm.FarmError, match="no failed task"):
            lab.retry(job_id)
