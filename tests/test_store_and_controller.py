"""The store keeps everything and migrates old files; the controller's rules for leases,
retries and duplicate results hold. Real SQLite files, real Controller."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import numpy as np
import pytest

from farm.agents.harness.script_runner import parse_timing_line
from farm.agents.harness.stats import latency_stats
from farm.controller.scheduling.controller import Controller, should_retry
from farm.controller.scheduling.jobfile import load_job_text
from farm.controller.store import SQLiteStore as Store
from farm.controller.store.schema import MIGRATIONS, SCHEMA_VERSION
from farm.proto.results import FailureClass, LatencyStats, RunResult, RunStatus


def test_latency_stats_agree_with_numpy() -> None:
    rng = np.random.default_rng(3)
    xs = list(rng.gamma(4.0, 2.5, size=500))
    s = latency_stats(xs, init_ms=12.0, first_ms=30.0, warmup_ms=[20.0, 22.0])
    a = np.array(xs)
    assert s.avg == pytest.approx(a.mean()) and s.std == pytest.approx(a.std(ddof=1))
    assert s.p50 == pytest.approx(np.median(a)) and s.p99 == pytest.approx(np.percentile(a, 99))
    assert s.min == a.min() and s.max == a.max() and s.count == 500
    assert s.warmup_avg == 21.0 and s.first == 30.0 and s.init == 12.0


@pytest.mark.parametrize("line, value", [
    ('{"latency_ms": 12.5}', 12.5), ('{"inference_ms": 3}', 3.0), ('  {"latency_ms": 1e-3}\n', 0.001),
    ('{"latency_ms": "fast"}', None), ('[1, 2]', None),  # negative: refused, tests/test_script_timings.py
    ('latency_ms: 4', None), ('{"other": 1}', None), ('{broken', None), ('{"latency_ms": true}', None),
])
def test_script_timing_lines(line: str, value: float | None) -> None:
    assert parse_timing_line(line) == value


def test_old_schema_is_migrated_in_place(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE schema_version (version INTEGER)")
    conn.execute("INSERT INTO schema_version VALUES (1)")
    conn.commit()
    import sqlite_utils
    MIGRATIONS[0](sqlite_utils.Database(conn))  # a store written by schema 1
    conn.execute("INSERT INTO jobs (id, name, status) VALUES (7, 'old', 'completed')")
    conn.commit()
    conn.close()
    store = Store(path)
    assert store.schema_version() == SCHEMA_VERSION
    assert "model_param_count" in store.db["tasks"].columns_dict
    assert store.jobs.get(7).name == "old"  # data survives the migration


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    Store(path).db.execute("UPDATE schema_version SET version = 999")
    from farm.controller.store import StoreError
    with pytest.raises(StoreError, match="newer farm"):
        Store(path)


@pytest.mark.parametrize("failure, attempt, expected", [
    (FailureClass.INFRASTRUCTURE, 1, True), (FailureClass.INFRASTRUCTURE, 3, False),
    (FailureClass.TIMEOUT, 1, True), (FailureClass.TIMEOUT, 2, False),
    (FailureClass.JOB, 1, False), (FailureClass.RESOURCE, 1, False), (FailureClass.BUG, 1, False),
])
def test_retry_rules(failure: FailureClass, attempt: int, expected: bool) -> None:
    assert should_retry(failure, attempt, 3) is expected


@pytest.fixture
def controller(tmp_path: Path, tiny_models) -> Controller:
    job = load_job_text(f"models: [{tiny_models['tflite']}]\nmatrix: {{threads: [1, 2]}}\n", "job.yaml", tmp_path)
    c = Controller(Store(tmp_path / "farm.db"), lease_ttl_s=0.2)
    c.submit(job)
    return c


def _ok() -> RunResult:
    lat = LatencyStats(None, None, None, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1)
    return RunResult(status=RunStatus.COMPLETED, latency=lat, iterations_ms=[1.0])


def test_a_result_delivered_twice_is_applied_once(controller: Controller) -> None:
    task = controller.lease("a", {"sim"})
    assert controller.complete(task.task_id, task.attempt, "a", time.time(), _ok()) is not None
    assert controller.complete(task.task_id, task.attempt, "a", time.time(), _ok()) is None
    assert controller.store.query("SELECT COUNT(*) AS n FROM runs")[0]["n"] == 1


def test_an_expired_lease_goes_back_with_attempt_plus_one(controller: Controller) -> None:
    first = controller.lease("lost-agent", {"sim"})
    time.sleep(0.3)  # the agent stopped heartbeating
    assert controller.heartbeat(first.task_id, first.attempt) is False  # a late beat does not revive it
    again = controller.lease("other-agent", {"sim"})
    # the expired task is first in line again, as attempt 2, and the lost agent's late beat is refused
    assert (again.task_id, again.attempt) == (first.task_id, 2)
    assert controller.heartbeat(first.task_id, first.attempt) is False


def test_infrastructure_failure_is_retried_then_reported(controller: Controller) -> None:
    for attempt in (1, 2, 3):
        t = controller.lease("a", {"sim"}, job_id=1)
        assert t.attempt == attempt
        controller.complete(t.task_id, t.attempt, "a", time.time(),
                            RunResult.failed(FailureClass.INFRASTRUCTURE, "device vanished"))
    task = controller.store.jobs.task(t.task_id)
    assert task.status == "failed" and task.failure_class == "infrastructure"
    runs = controller.store.query("SELECT attempt FROM runs WHERE task_id = ? ORDER BY attempt", [t.task_id])
    assert [r["attempt"] for r in runs] == [1, 2, 3]  # every attempt is kept


def test_cancel_stops_leasing_and_heartbeats(controller: Controller) -> None:
    t = controller.lease("a", {"sim"})
    assert controller.cancel_job(1) == 2  # one pending, one running
    assert controller.heartbeat(t.task_id, t.attempt) is False
    assert controller.lease("a", {"sim"}) is None
    controller.complete(t.task_id, t.attempt, "a", time.time(), RunResult.failed(FailureClass.CANCELED, "stopped"))
    assert controller.job_status(1) == "canceled"


def _recounted(store: Store) -> dict[int, dict[str, int]]:
    """Every job's tasks by status, counted row by row (what the kept counts must always equal)."""
    counts: dict[int, dict[str, int]] = {}
    for r in store.query("SELECT job_id, status, COUNT(*) AS n FROM tasks GROUP BY job_id, status"):
        counts.setdefault(r["job_id"], {})[r["status"]] = r["n"]
    return counts


def test_kept_task_counts_follow_every_change(controller: Controller, tmp_path: Path, tiny_models) -> None:
    store = controller.store
    job = load_job_text(f"models: [{tiny_models['tflite']}]\nrepeats: 3\n", "job.yaml", tmp_path)
    controller.submit(job)
    assert store.jobs.task_counts_of([1, 2]) == _recounted(store) == {1: {"pending": 2}, 2: {"pending": 3}}
    t = controller.lease("a", {"sim"}, job_id=2)
    controller.complete(t.task_id, t.attempt, "a", time.time(), _ok())
    t = controller.lease("a", {"sim"}, job_id=2)
    controller.complete(t.task_id, t.attempt, "a", time.time(), RunResult.failed(FailureClass.JOB, "bad model"))
    controller.lease("a", {"sim"}, job_id=2)
    controller.lease("b", {"sim"}, job_id=1)
    controller.cancel_job(1)
    assert store.jobs.task_counts_of([1, 2]) == _recounted(store)
    assert store.jobs.task_counts(2) == {"completed": 1, "failed": 1, "running": 1}
    store.db.execute("UPDATE tasks SET job_id = 2, seq = seq + 100 WHERE job_id = 1")  # a raw change is followed too
    store.db.execute("DELETE FROM tasks WHERE status = 'canceled' AND id NOT IN (SELECT task_id FROM runs)")
    assert store.jobs.task_counts_of([1, 2]) == _recounted(store)
    assert store.jobs.task_counts(1) == {} and store.jobs.task_counts_of([]) == {}
    listed = {j.id: j for j in store.jobs.listing(10)}
    assert (listed[2].tasks, listed[2].completed, listed[2].failed) == (sum(_recounted(store)[2].values()), 1, 1)


def test_a_store_from_before_kept_counts_gets_them_counted(tmp_path: Path, tiny_models) -> None:
    path = tmp_path / "farm.db"
    store = Store(path)
    Controller(store).submit(load_job_text(f"models: [{tiny_models['tflite']}]\nrepeats: 4\n", "job.yaml", tmp_path))
    # as schema 13 left it: no kept counts
    for trigger in ("tasks_counted_insert", "tasks_counted_delete", "tasks_counted_update"):
        store.db.execute(f"DROP TRIGGER {trigger}")
    store.db.execute("DROP TABLE job_task_counts")
    store.db.execute("UPDATE tasks SET status = 'completed' WHERE seq = 0")
    store.db.execute("UPDATE schema_version SET version = 13")
    store.close()
    store = Store(path)
    assert store.schema_version() == SCHEMA_VERSION
    assert store.jobs.task_counts(1) == {"completed": 1, "pending": 3} == _recounted(store)[1]
