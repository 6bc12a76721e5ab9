"""The store contract: what every implementation of farm.controller.store.Store must do, method by method.

Each test takes the `store` fixture, parametrized by implementation (STORES): SQLite, and PostgreSQL on a
private server shared by the session (a fresh database per test; skipped with the reason when Debian's
postgresql cannot run). tests/test_store_contract.py collects the suite.
The tests use the interface only (repositories and typed rows), never SQL, so they run against any store.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from farm.controller.store import METRIC_UNITS, SQLiteStore, Store, UnknownMetric
from farm.controller.store.interface import RunWrite
from farm.controller.store.rows import (
    AgentRow, CalibrationRow, DeviceRow, DriftRow, HealthRow, JobListing, JobRow, ResultRow, Row, RunningAttempt,
    TaskRow)
from farm.proto.op_profile import OpProfileRow as WireOpProfileRow
from farm.proto.results import (
    FIGURES, Contention, FailureClass, LatencyStats, ResultRefused, RunResult, RunStatus, Telemetry, TelemetrySample)



def _postgres(request: pytest.FixtureRequest, folder: Path) -> Store:
    """A fresh database on the session's PostgreSQL peer (skipped, with the reason, when it cannot run)."""
    from conftest import fresh_postgres_url
    from farm.controller.store.postgres import PostgresStore

    peer = request.getfixturevalue("postgres_peer")
    return PostgresStore(fresh_postgres_url(peer, request.node.name), files_dir=folder)


# implementation name -> opener of an empty store in a folder of its own
STORES: dict[str, Callable[[pytest.FixtureRequest, Path], Store]] = {
    "sqlite": lambda request, folder: SQLiteStore(folder / "farm.db"),
    "postgresql": _postgres,
}


@pytest.fixture(params=sorted(STORES))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    opened = STORES[request.param](request, tmp_path)
    try:
        yield opened
    finally:
        opened.close()


def _job(store: Store, tasks: list[dict[str, Any]], *, status: str = "queued", priority: str = "normal",
         kind: str = "user", owner: str | None = None, team: str | None = None, name: str = "job") -> int:
    return store.jobs.insert({"name": name, "kind": kind, "status": status, "priority": priority,
                              "created_at": time.time(), "spec_json": "{}", "spec_yaml": "", "base_dir": "/tmp",
                              "submitted_by": owner, "team": team}, tasks)


def _task(seq: int, *, target: str = "sim", priority: int = 1, model: str = "m", sha: str = "a" * 64, threads: int = 1,
          repeat: int = 0, pair_key: str | None = None, spec_json: str = "{}", batch_size: int = 1) -> dict[str, Any]:
    return {"seq": seq, "target": target, "model_name": model, "model_path": f"{model}.tflite", "model_sha256": sha,
            "model_family": None, "model_facts_json": '{"macs": 1000}', "threads": threads, "batch_size": batch_size,
            "input_size": None, "repeat": repeat, "status": "pending", "attempts": 0, "max_attempts": 3,
            "pair_key": pair_key, "spec_json": spec_json, "priority": priority, "created_at": time.time(),
            "model_size_bytes": 1000, "model_param_count": 10}


def _lease(store: Store, targets: set[str], agent: str = "agent-1", limit: int = 1) -> list[TaskRow]:
    """What the controller does: the next tasks in lease order, leased in one transaction."""
    with store.transaction():
        tasks = store.leases.next_pending(targets, limit)
        for t in tasks:
            store.leases.lease(t.id, t.attempts + 1, agent, time.time() + 60)
            store.leases.start_job(t.job_id, time.time())
    return tasks


def _result(avg_ms: float = 2.0, *, status: RunStatus = RunStatus.COMPLETED, contended: bool | None = None,
            environment: dict[str, Any] | None = None) -> RunResult:
    return RunResult(
        status=status, message="" if status == RunStatus.COMPLETED else "it broke",
        failure_class=None if status == RunStatus.COMPLETED else FailureClass.JOB, backend="test",
        latency=LatencyStats(init=5.0, first=3.0, warmup_avg=2.5, avg=avg_ms, p50=avg_ms, p90=avg_ms, p99=avg_ms,
                             std=0.1, min=avg_ms, max=avg_ms, count=3),
        iterations_ms=[avg_ms, avg_ms + 0.125, avg_ms - 0.0625], wall_s=1.5,
        telemetry=Telemetry(interval_ms=10.0, memory_peak_bytes=8 << 20, memory_avg_bytes=float(6 << 20),
                            cpu_avg_percent=50.0, samples=[TelemetrySample(0.0, 10.0, 1 << 20),
                                                           TelemetrySample(0.01, 90.0, 2 << 20)]),
        environment=environment if environment is not None else {"runtime": "litert"},
        contention=None if contended is None else Contention(contended=contended),
        op_profile=[WireOpProfileRow(kind="op_type", node_type="Conv", avg_ms=1.5, percent=75.0, count=2)])


def _run(store: Store, task: TaskRow, result: RunResult | None = None, agent: str = "agent-1") -> int:
    run_id = store.runs.record(task, task.attempts + 1 if task.status == "pending" else task.attempts, agent,
                               time.time(), result or _result(), {"status": "completed", "finished_at": time.time(),
                                                                   "leased_by": None})
    assert run_id is not None
    return run_id


# --- schema -------------------------------------------------------------------------------------------

def test_a_new_store_is_at_the_current_schema(store: Store) -> None:
    from farm.controller.store.schema import SCHEMA_VERSION
    assert store.schema_version() == SCHEMA_VERSION
    assert store.has_table("calibration_drift") and not store.has_table("no_such_table")


# --- jobs ----------------------------------------------------------------------------------------------

def test_a_job_and_its_tasks_round_trip_as_typed_rows(store: Store) -> None:
    job_id = _job(store, [_task(0), _task(1, target="phone-1", threads=2)], owner="tok", team="red", name="j")
    job = store.jobs.get(job_id)
    assert isinstance(job, JobRow) and dataclasses.is_dataclass(job)
    assert (job.id, job.name, job.status, job.kind, job.submitted_by, job.team) == (job_id, "j", "queued", "user", "tok", "red")
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.status = "running"  # type: ignore[misc]
    tasks = store.jobs.tasks(job_id)
    assert [type(t) for t in tasks] == [TaskRow, TaskRow] and [t.seq for t in tasks] == [0, 1]
    assert tasks[1].target == "phone-1" and tasks[1].threads == 2 and tasks[1].model_size_bytes == 1000
    assert store.jobs.task(tasks[0].id) == tasks[0]
    assert store.jobs.get(job_id + 100) is None and store.jobs.task(10_000) is None
    with pytest.raises(TypeError):
        job["status"]  # type: ignore[index]  # rows are read by attribute: the old dict-style shim is gone
    assert job.as_dict()["name"] == "j"


def test_updates_change_only_the_fields_named(store: Store) -> None:
    job_id = _job(store, [_task(0)])
    store.jobs.update(job_id, status="running", message="go")
    job = store.jobs.get(job_id)
    assert job is not None and (job.status, job.message, job.name) == ("running", "go", "job")
    task = store.jobs.tasks(job_id)[0]
    store.jobs.update_task(task.id, message="hello")
    updated = store.jobs.task(task.id)
    assert updated is not None and updated.message == "hello" and updated.status == "pending"


def test_listing_counts_tasks_by_status_and_keeps_to_what_a_viewer_may_read(store: Store) -> None:
    lab = _job(store, [_task(0), _task(1)])
    mine = _job(store, [_task(0)], owner="me", team="red")
    theirs = _job(store, [_task(0)], owner="other", team="blue")
    teammate = _job(store, [_task(0)], owner="mate", team="red")
    store.jobs.update_task(store.jobs.tasks(lab)[0].id, status="completed")
    rows = store.jobs.listing(10)
    assert [r.id for r in rows] == [teammate, theirs, mine, lab] and all(isinstance(r, JobListing) for r in rows)
    assert (rows[-1].counts, rows[-1].tasks, rows[-1].completed, rows[-1].failed) == (
        {"completed": 1, "pending": 1}, 2, 1, 0)
    assert [r.id for r in store.jobs.listing(10, ("me", "red"))] == [teammate, mine, lab]
    assert [r.id for r in store.jobs.listing(1)] == [teammate]
    assert [j.id for j in store.reads.jobs(10, ("me", "red"))] == [teammate, mine, lab]
    assert store.reads.jobs(10)[-1].counts == {"completed": 1, "pending": 1}
    assert store.reads.job_count() == 4 and store.reads.job_count(("me", None)) == 2  # the lab's and its own


def test_task_counts_follow_every_change(store: Store) -> None:
    job_id = _job(store, [_task(i) for i in range(4)])
    assert store.jobs.task_counts(job_id) == {"pending": 4}
    assert store.jobs.has_open_tasks(job_id) and store.jobs.finished_task_count(job_id) == 0
    assert store.jobs.cancel_pending_tasks(job_id, "stop", time.time()) == 4
    assert store.jobs.task_counts(job_id) == {"canceled": 4} and not store.jobs.has_open_tasks(job_id)
    assert store.jobs.finished_task_count(job_id) == 4
    assert store.jobs.task_counts_of([job_id, job_id + 1]) == {job_id: {"canceled": 4}}
    since = time.time() - 60
    assert store.jobs.requeue_interrupted_tasks(job_id, since, "again") == 4
    assert store.jobs.task_counts(job_id) == {"pending": 4}
    assert store.reads.tasks_by_status() == {"pending": 4} and store.reads.pending_by_priority() == {1: 4}


def test_retried_tasks_wait_again_as_new_attempts_of_the_same_tasks(store: Store) -> None:
    job_id = _job(store, [_task(i) for i in range(4)])
    leased = _lease(store, {"sim"}, limit=3)
    for task in leased[:2]:
        store.jobs.update_task(task.id, status="failed", failure_class="bug", finished_at=time.time(), leased_by=None)
    store.jobs.update_task(leased[2].id, status="completed", finished_at=time.time(), leased_by=None)
    store.jobs.cancel_pending_tasks(job_id, "stop", time.time())
    assert store.jobs.task_counts(job_id) == {"failed": 2, "completed": 1, "canceled": 1}
    assert store.jobs.requeue_tasks(job_id, [], "again", 3) == 0
    assert store.jobs.requeue_tasks(job_id, ["failed"], "again", 3) == 2
    assert store.jobs.task_counts(job_id) == {"pending": 2, "completed": 1, "canceled": 1}
    again = [store.jobs.task(t.id) for t in leased[:2]]
    assert all(t is not None and (t.status, t.attempts, t.max_attempts, t.failure_class, t.finished_at, t.leased_by,
                                  t.message) == ("pending", 1, 4, None, None, None, "again") for t in again)
    assert [t.attempts + 1 for t in _lease(store, {"sim"}, limit=4)] == [2, 2]  # the next lease is attempt 2
    assert store.jobs.requeue_tasks(job_id, ["canceled", "failed"], "more", 1) == 1
    assert store.jobs.task_counts(job_id) == {"pending": 1, "running": 2, "completed": 1}


def test_jobs_past_their_deadline(store: Store) -> None:
    soon, later, none = (_job(store, [_task(0)]) for _ in range(3))
    done = _job(store, [_task(0)], status="completed")
    store.jobs.update(soon, deadline_at=100.0)
    store.jobs.update(later, deadline_at=200.0)
    store.jobs.update(done, deadline_at=50.0)
    row = store.jobs.get(soon)
    assert row is not None and row.deadline_at == 100.0 and (store.jobs.get(none) or row).deadline_at is None
    assert store.jobs.past_deadline(99.0) == []
    assert store.jobs.past_deadline(150.0) == [soon]  # a finished job is left be
    store.jobs.update(later, status="interrupted")
    assert store.jobs.past_deadline(250.0) == [soon, later]


def test_jobs_by_kind_targets_and_models(store: Store) -> None:
    a = _job(store, [_task(0, target="phone-1", model="x", sha="1" * 64), _task(1, model="y", sha="2" * 64)],
             kind="health_check")
    b = _job(store, [_task(0)], kind="health_check", status="completed")
    _job(store, [_task(0)])
    assert store.jobs.of_kind("health_check", ("queued",)) == [a]
    assert store.jobs.of_kind("health_check", ("queued", "completed")) == [a, b]
    assert store.jobs.earlier_of_kind("health_check", b) == [a]
    assert store.jobs.targets(a) == ["phone-1"]  # the sim left out
    assert store.jobs.model_names(a) == {"1" * 64: "x", "2" * 64: "y"}
    assert [o.status for o in store.jobs.model_tasks(a, "2" * 64, 1)] == ["pending"]
    assert store.jobs.model_tasks(a, "2" * 64, 4) == []


def test_completed_jobs_with_a_model_newest_first(store: Store) -> None:
    first = _job(store, [_task(0, sha="c" * 64)])
    second = _job(store, [_task(0, sha="c" * 64)])
    for job_id in (first, second):
        _run(store, _lease(store, {"sim"})[0])
    assert [j.id for j in store.jobs.completed_with_model("c" * 64, 1)] == [second, first]
    assert store.jobs.completed_with_model("c" * 64, 2) == []


# --- leasing -----------------------------------------------------------------------------------------------

def test_leasing_follows_priority_then_job_then_seq_and_only_the_targets_asked(store: Store) -> None:
    low = _job(store, [_task(0, priority=3), _task(1, priority=3)])
    high = _job(store, [_task(0, priority=0, target="phone-1"), _task(1, priority=0)])
    order = store.leases.next_pending({"sim", "phone-1"}, 10)
    assert [(t.job_id, t.seq) for t in order] == [(high, 0), (high, 1), (low, 0), (low, 1)]
    assert [(t.job_id, t.seq) for t in store.leases.next_pending({"sim"}, 2)] == [(high, 1), (low, 0)]
    assert [t.job_id for t in store.leases.next_pending({"sim"}, 10, job_id=low)] == [low, low]
    assert store.leases.next_pending({"phone-2"}, 10) == []


def test_a_leased_task_is_offered_to_nobody_else(store: Store) -> None:
    job_id = _job(store, [_task(0), _task(1)])
    first = _lease(store, {"sim"}, "agent-1")
    second = _lease(store, {"sim"}, "agent-2")
    assert [t.seq for t in first] == [0] and [t.seq for t in second] == [1]
    assert _lease(store, {"sim"}, "agent-3") == []
    state = store.leases.state(first[0].id)
    assert state is not None and (state.task_status, state.attempts, state.job_status, state.leased_by) == (
        "running", 1, "running", "agent-1")
    job = store.jobs.get(job_id)
    assert job is not None and job.status == "running" and job.started_at is not None
    assert store.leases.state(10_000) is None


def test_concurrent_leases_never_hand_out_a_task_twice(store: Store) -> None:
    _job(store, [_task(i) for i in range(40)])
    leased: list[int] = []
    lock = threading.Lock()

    def agent(name: str) -> None:
        while tasks := _lease(store, {"sim"}, name):
            with lock:
                leased.extend(t.id for t in tasks)

    threads = [threading.Thread(target=agent, args=(f"agent-{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(leased) == 40 and len(set(leased)) == 40


def test_a_quarantined_device_is_offered_nothing_until_released(store: Store) -> None:
    job_id = _job(store, [_task(0, target="phone-1")])
    store.devices.set_health("phone-1", "bad", "too hot", time.time())
    assert store.leases.next_pending({"phone-1"}, 1) == []
    assert [(q.name, q.reason) for q in store.devices.quarantined_targets(job_id)] == [("phone-1", "too hot")]
    store.devices.set_health("phone-1", "good", "fixed", time.time())
    assert len(store.leases.next_pending({"phone-1"}, 1)) == 1 and store.devices.quarantined_targets(job_id) == []


def test_a_canceled_job_offers_no_task(store: Store) -> None:
    job_id = _job(store, [_task(0)])
    store.jobs.update(job_id, status="canceled")
    assert store.leases.next_pending({"sim"}, 1) == []


def test_leases_renew_expire_and_lost_attempts_go_back_or_fail(store: Store) -> None:
    job_id = _job(store, [_task(0), _task(1)])
    a, b = _lease(store, {"sim"}, "agent-1", limit=2)
    store.leases.renew(a.id, time.time() - 1)  # already expired
    running = store.leases.running_attempts(job_id=job_id)
    assert [type(r) for r in running] == [RunningAttempt, RunningAttempt] and [r.id for r in running] == [a.id, b.id]
    assert [r.id for r in store.leases.running_attempts(expired_before=time.time())] == [a.id]
    assert [r.id for r in store.leases.running_attempts(agent="agent-2")] == []
    assert [r.id for r in store.leases.running_attempts(task_ids=[b.id])] == [b.id]
    with store.transaction():
        failed = store.leases.record_lost_attempts(running, "agent {agent} went away",
                                                   retry=lambda attempts, most: attempts < 1, now=time.time())
    assert failed == [job_id, job_id]
    again = store.jobs.task(a.id)
    assert again is not None and again.status == "failed" and again.failure_class == "infrastructure"
    assert again.message is not None and "agent agent-1 went away" in again.message and again.leased_by is None
    for failed_task in (a, b):
        store.jobs.update_task(failed_task.id, status="pending")
    retried = _lease(store, {"sim"}, "agent-2", limit=2)
    with store.transaction():
        assert store.leases.record_lost_attempts(store.leases.running_attempts(agent="agent-2"), "gone",
                                                 retry=lambda attempts, most: True, now=time.time()) == []
    assert {t.status for t in store.jobs.tasks(job_id)} == {"pending"} and len(retried) == 2


def test_a_lost_attempt_already_settled_is_left_as_it_is(store: Store) -> None:
    """A stale list (read before another writer settled the attempt) changes nothing: no second run, and the
    task keeps the run it has (SQLite once took the id of whatever it had inserted last)."""
    job_id = _job(store, [_task(0), _task(1)])
    a, b = _lease(store, {"sim"}, "agent-1", limit=2)
    stale = store.leases.running_attempts(task_ids=[a.id])
    with store.transaction():
        assert store.leases.record_lost_attempts(stale, "gone", retry=lambda attempts, most: False,
                                                 now=time.time()) == [job_id]
    settled = store.jobs.task(a.id)
    assert settled is not None and settled.status == "failed" and settled.last_run_id is not None
    with store.transaction():  # b's lost run is the last insert on this connection
        store.leases.record_lost_attempts(store.leases.running_attempts(task_ids=[b.id]), "gone",
                                          retry=lambda attempts, most: True, now=time.time())
    with store.transaction():
        assert store.leases.record_lost_attempts(stale, "gone again", retry=lambda attempts, most: True,
                                                 now=time.time()) == []
    again = store.jobs.task(a.id)
    assert again is not None and (again.status, again.last_run_id, again.message) == (
        "failed", settled.last_run_id, settled.message)


def test_a_restarted_controller_adopts_open_jobs_and_every_agent_is_offline(store: Store) -> None:
    job_id = _job(store, [_task(0)])
    _lease(store, {"sim"})
    store.devices.record_agent({"name": "agent-1", "state": "online", "last_seen": 1.0},
                               [("phone-1", "agent-1", "android", "pixel", "[]", "{}", 1, "online", 1.0)])
    store.leases.adopt_unfinished(4242, "host-b", time.time() + 99)
    job = store.jobs.get(job_id)
    assert job is not None and (job.owner_pid, job.owner_host) == (4242, "host-b")
    assert [a.state for a in store.devices.agents()] == ["offline"] and [d.state for d in store.devices.all()] == ["offline"]
    assert store.leases.running_attempts(expired_before=time.time() + 50) == []


def test_a_controller_starting_beside_another_leaves_the_agents_it_keeps_fresh_online(store: Store) -> None:
    for name, seen in (("theirs", 100.0), ("gone", 10.0)):  # theirs: kept fresh by the other controller
        store.devices.record_agent({"name": name, "state": "online", "last_seen": seen},
                                   [(f"{name}/sim", name, "sim", "sim", "[]", "{}", 1, "online", seen)])
    store.leases.adopt_unfinished(4242, "host-b", time.time() + 99, seen_before=50.0)
    assert {a.name: a.state for a in store.devices.agents()} == {"gone": "offline", "theirs": "online"}
    assert {d.name: d.state for d in store.devices.all()} == {"gone/sim": "offline", "theirs/sim": "online"}
    # the other controller keeps its agent fresh; one whose controller died goes offline after a TTL
    store.devices.record_agent({"name": "orphan", "state": "online", "last_seen": 120.0},
                               [("orphan/sim", "orphan", "sim", "sim", "[]", "{}", 1, "online", 120.0)])
    store.devices.keep_alive(["theirs"], 200.0, 150.0)
    assert {a.name: (a.state, a.last_seen) for a in store.devices.agents()} == {
        "gone": ("offline", 10.0), "orphan": ("offline", 120.0), "theirs": ("online", 200.0)}
    assert {d.name: d.state for d in store.devices.all()} == {
        "gone/sim": "offline", "orphan/sim": "offline", "theirs/sim": "online"}
    store.devices.keep_alive([], 300.0, 250.0)  # no agent here: only the sweep
    assert {a.state for a in store.devices.agents()} == {"offline"}
    assert store.devices.owners(["theirs/sim", "nope", "gone/sim"]) == {"theirs/sim": "theirs", "gone/sim": "gone"}
    assert store.devices.owners([]) == {}


def test_waiting_tasks_of_a_device_fail_with_their_jobs_named(store: Store) -> None:
    a = _job(store, [_task(0, target="phone-1"), _task(1)])
    b = _job(store, [_task(0, target="phone-1")])
    assert store.jobs.fail_waiting_tasks("phone-1", "gone", time.time(), job_id=b) == [b]
    assert store.jobs.fail_waiting_tasks("phone-1", "gone", time.time()) == [a]
    assert store.jobs.task_counts(a) == {"failed": 1, "pending": 1}


# --- runs and samples -----------------------------------------------------------------------------------------

def test_a_result_is_stored_whole_and_read_back_exactly(store: Store) -> None:
    job_id = _job(store, [_task(0)])
    task = _lease(store, {"sim"})[0]
    run_id = _run(store, task, _result(2.0, contended=True))
    assert store.runs.iterations(run_id) == [2.0, 2.125, 1.9375]
    assert [(s.t_s, s.cpu_percent, s.memory_bytes) for s in store.runs.telemetry(run_id)] == [
        (0.0, 10.0, 1 << 20), (0.01, 90.0, 2 << 20)]
    profile = store.runs.op_profiles([run_id, run_id + 1])
    assert [(o.kind, o.node_type, o.avg_ms, o.count) for o in profile[run_id]] == [("op_type", "Conv", 1.5, 2)]
    assert profile[run_id + 1] == []
    (row,) = store.runs.results(job_id)
    assert isinstance(row, ResultRow)
    assert (row.task, row.job, row.run_id, row.task_status, row.latency_avg_ms, row.latency_count) == (
        task.id, job_id, run_id, "completed", 2.0, 3)
    assert (row.peak_memory_bytes, row.sample_count, row.wall_s, row.backend) == (8 << 20, 2, 1.5, "test")
    assert store.runs.contended_runs(task.id) == 1
    assert store.calibrations.contended_completed_runs([job_id]) == 1 and store.calibrations.contended_completed_runs([]) == 0


def test_every_declared_run_figure_is_written_and_read_back_under_its_name(store: Store) -> None:
    """The figures declared on RunResult (proto/results.py, `figure(...)`) go to their columns and come back in the
    result row and the run's record; a run without one reads None and its record has no key for it."""
    from farm.controller.analysis.results import run_record
    values = {f.name: (123 << 20) + i if f.column is int else 1.5 + i for i, f in enumerate(FIGURES)}
    job_id = _job(store, [_task(0), _task(1)])
    measured, unmeasured = _lease(store, {"sim"}, limit=2)
    _run(store, measured, dataclasses.replace(_result(), **values))
    _run(store, unmeasured)
    rows = {row.task: row for row in store.runs.results(job_id)}
    assert dict(rows[measured.id].figures) == values
    assert dict(rows[unmeasured.id].figures) == {f.name: None for f in FIGURES}
    record = run_record(rows[measured.id]).model_dump()
    assert {f.record: record[f.record] for f in FIGURES} == {f.record: f.shown(values[f.name]) for f in FIGURES}
    assert not {f.record for f in FIGURES} & set(run_record(rows[unmeasured.id]).model_dump())


def test_a_jobs_task_plans_are_stored_once_and_every_task_reads_its_own(store: Store) -> None:
    own, twin = '{"sim": {"cpus": 1.0}, "workload": {}}', '{"sim": {"cpus": 0.5}, "workload": {}}'
    first = _job(store, [_task(0, spec_json=own), _task(1, spec_json=twin), _task(2, spec_json=own)])
    second = _job(store, [_task(0, spec_json=own)])
    tasks = store.jobs.tasks(first)
    assert [t.spec_json for t in tasks] == [own, twin, own]
    assert tasks[0].plan_id == tasks[2].plan_id != tasks[1].plan_id and None not in {t.plan_id for t in tasks}
    (other,) = store.jobs.tasks(second)
    assert other.spec_json == own and other.plan_id not in {t.plan_id for t in tasks}  # a plan is its job's
    task = store.jobs.task(tasks[1].id)
    assert task is not None and (task.spec_json, task.plan_id) == (twin, tasks[1].plan_id)
    leased = _lease(store, {"sim"}, limit=4)
    assert [(t.id, t.spec_json) for t in leased] == [(t.id, t.spec_json) for t in [*tasks, other]]
    assert [r.task_spec_json for r in store.runs.results(first)] == [own, twin, own]


def test_a_jobs_model_facts_are_stored_once_and_every_task_and_result_reads_its_own(store: Store) -> None:
    big, small = '{"macs": 300774272, "op_types": {"Conv": 52}}', '{"macs": 1000}'
    first = _job(store, [{**_task(0), "model_facts_json": big}, {**_task(1), "model_facts_json": small},
                         {**_task(2), "model_facts_json": big}, {**_task(3), "model_facts_json": None}])
    second = _job(store, [{**_task(0), "model_facts_json": big}])
    tasks = store.jobs.tasks(first)
    assert [t.model_facts_json for t in tasks] == [big, small, big, None]
    assert tasks[0].facts_id == tasks[2].facts_id != tasks[1].facts_id and tasks[3].facts_id is None
    (other,) = store.jobs.tasks(second)
    assert other.model_facts_json == big and other.facts_id not in {t.facts_id for t in tasks}  # facts are a job's
    leased = _lease(store, {"sim"}, limit=5)
    assert [t.model_facts_json for t in leased] == [big, small, big, None, big]
    for task in leased:
        _run(store, task)
    assert [r.model_facts_json for r in store.runs.results(first)] == [big, small, big, None]
    assert [r.model_facts_json for r in store.calibrations.completed_values(first, "latency", include_contended=True)
            ] == [big, small, big, None]


def test_a_batch_of_results_written_at_once_reads_back_as_each_written_alone(store: Store) -> None:
    """Runs.write (the result writer's batch: a statement per table) stores what Runs.record stores one by one."""
    alone, batched = _job(store, [_task(k) for k in range(3)]), _job(store, [_task(k) for k in range(3)])
    results = [_result(2.0), _result(3.0, contended=True), _result(4.0, status=RunStatus.FAILED)]
    fields = [{"status": "completed", "leased_by": None}, {"status": "completed", "leased_by": None},
              {"status": "pending", "failure_class": "job", "message": "again", "leased_by": None}]
    leased = _lease(store, {"sim"}, limit=6)
    for task, result, change in zip(leased[:3], results, fields):
        store.runs.record(task, 1, "agent-1", 1.0, result, change)
    with store.transaction():
        found = store.runs.leased([t.id for t in leased[3:]] + [10**9])
        assert sorted(found) == [t.id for t in leased[3:]] and all(found[t.id].leased_by == "agent-1" for t in leased[3:])
        assert store.jobs.statuses([batched, 10**9]) == {batched: "running"}
        ids = store.runs.write([RunWrite(found[t.id], 1, "agent-1", 1.0, r, f)
                                for t, r, f in zip(leased[3:], results, fields)])
    assert len(set(ids)) == 3 and min(ids) > max(r.run_id or 0 for r in store.runs.results(alone))
    assert store.runs.delivered([(leased[3].id, 1), (leased[4].id, 2), (leased[5].id, 1)]) == {
        (leased[3].id, 1): ("agent-1", "completed", ""), (leased[5].id, 1): ("agent-1", "failed", "it broke")}

    def shown(job_id: int) -> list[tuple[Any, ...]]:
        rows = store.runs.results(job_id)
        samples = [(store.runs.iterations(r.run_id), store.runs.telemetry(r.run_id),
                    store.runs.op_profiles([r.run_id])[r.run_id]) for r in rows if r.run_id]
        kept = [{k: v for k, v in dataclasses.asdict(r).items() if k not in {"task", "job", "run_id", "finished_at"}}
                for r in rows]
        return [kept, samples]
    assert shown(batched) == shown(alone)
    assert [r.run_id for r in store.runs.results(batched)] == ids
    assert store.jobs.task_counts(batched) == store.jobs.task_counts(alone) == {"completed": 2, "pending": 1}


def test_a_task_never_run_has_a_result_row_with_no_run(store: Store) -> None:
    job_id = _job(store, [_task(0)])
    (row,) = store.runs.results(job_id)
    assert row.run_id is None and row.latency_avg_ms is None and row.task_status == "pending"


def test_a_resent_result_is_applied_once(store: Store) -> None:
    job_id = _job(store, [_task(0)])
    task = _lease(store, {"sim"})[0]
    first = _run(store, task)
    assert store.runs.record(task, 1, "agent-1", time.time(), _result(), {"status": "completed"}) is None
    assert [r.run_id for r in store.runs.results(job_id)] == [first]
    assert store.runs.iterations(first) == [2.0, 2.125, 1.9375]  # not doubled
    with pytest.raises(ResultRefused, match="already stored"):  # another result for the same attempt
        store.runs.record(task, 1, "agent-1", time.time(), _result(status=RunStatus.FAILED), {"status": "failed"})


def test_a_result_without_its_lease_is_refused_and_stores_nothing(store: Store) -> None:
    job_id = _job(store, [_task(0), _task(1)])
    pending = store.jobs.tasks(job_id)[1]
    task = _lease(store, {"sim"}, "agent-1")[0]
    for target, attempt, agent, why in ((task, 1, "agent-2", "not leased"), (task, 2, "agent-1", "not the current"),
                                        (pending, 1, "agent-1", "holds no lease")):
        with pytest.raises(ResultRefused, match=why):
            store.runs.record(target, attempt, agent, time.time(), _result(), {"status": "completed"})
    assert all(r.run_id is None for r in store.runs.results(job_id))


def test_a_failing_step_of_a_batch_undoes_only_its_own_writes(store: Store) -> None:
    job_id = _job(store, [_task(0), _task(1)])
    a, b = _lease(store, {"sim"}, limit=2)
    with store.transaction():
        _run(store, a)
        with pytest.raises(ResultRefused):
            with store.transaction():
                store.jobs.update(job_id, message="half done")
                store.runs.record(b, 1, "agent-9", time.time(), _result(), {"status": "completed"})
    job = store.jobs.get(job_id)
    assert job is not None and job.message is None
    assert [r.run_id is not None for r in store.runs.results(job_id)] == [True, False]


def test_hostile_values_are_kept_as_sqlite_keeps_them(store: Store) -> None:
    """From the wire: a NaN figure is stored as missing, infinity as infinity, a NUL character in a log tail or a
    message is kept (PostgreSQL text cannot hold NUL: U+FFFD stands in), a bool is 0/1."""
    job_id = _job(store, [_task(0)], name="bad\x00name")
    task = _lease(store, {"sim"})[0]
    result = dataclasses.replace(_result(float("nan")), wall_s=float("inf"), message="half\x00way",
                                 log_tail="line\x00\x1b[31m", status=RunStatus.FAILED, failure_class=FailureClass.JOB)
    _run(store, task, result)
    (row,) = store.runs.results(job_id)
    assert row.latency_avg_ms is None and row.wall_s == float("inf") and row.latency_count == 3
    assert row.message in ("half\x00way", "half\ufffdway")
    job = store.jobs.get(job_id)
    assert job is not None and job.name in ("bad\x00name", "bad\ufffdname")
    assert store.reads.log_tails([row.run_id])[row.run_id] in ("line\x00\x1b[31m", "line\ufffd\x1b[31m")
    store.calibrations.add_drift({"device": "phone-1", "metric": "latency", "threads": 1, "exceeded": True,
                                  "prediction_shift": float("nan"), "created_at": 1.0})
    (drift,) = store.calibrations.drift_history()
    assert drift.exceeded == 1 and drift.prediction_shift is None
    assert [a.exceeded for a in store.calibrations.latest_drift()] == [1]


def test_device_latencies_of_completed_runs(store: Store) -> None:
    job_id = _job(store, [_task(0, target="phone-1", model="x")])
    _run(store, _lease(store, {"phone-1"})[0], _result(7.0))
    assert [(d.model_name, d.threads, d.latency_avg_ms) for d in store.runs.device_latencies(job_id, "phone-1")] == [
        ("x", 1, 7.0)]
    assert store.runs.device_latencies(job_id, "phone-2") == []


# --- devices and health --------------------------------------------------------------------------------------------

def test_agents_and_devices_round_trip(store: Store) -> None:
    store.devices.record_agent({"name": "agent-1", "session_id": "s1", "state": "online", "farm_version": "1",
                                "capabilities_json": "[]", "hostname": "h", "peer": "p", "connected_at": 1.0,
                                "last_seen": 2.0},
                               [("phone-1", "agent-1", "android", "pixel", '["a"]', "{}", 1, "online", 2.0),
                                ("agent-1/sim", "agent-1", "sim", "sim", "[]", "{}", 2, "online", 2.0)])
    (agent,) = store.devices.agents()
    assert isinstance(agent, AgentRow) and (agent.name, agent.session_id, agent.hostname) == ("agent-1", "s1", "h")
    assert store.reads.agents() == [agent]
    devices = store.devices.all()
    assert all(isinstance(d, DeviceRow) for d in devices) and [d.name for d in devices] == ["agent-1/sim", "phone-1"]
    assert [d.name for d in store.devices.all(sim=False)] == ["phone-1"]
    assert store.devices.owners() == {"phone-1": "agent-1", "agent-1/sim": "agent-1"}
    assert store.devices.device_type("phone-1") == "pixel" and store.devices.device_type("nope") is None
    store.devices.record_agent({"name": "agent-1", "state": "online"},
                               [("phone-1", "agent-1", "android", "pixel-2", "[]", "{}", 1, "online", 3.0)])
    assert store.devices.device_type("phone-1") == "pixel-2"  # a hello again updates, never duplicates
    store.devices.forget("phone-1")
    assert [d.name for d in store.devices.all()] == ["agent-1/sim"]


def test_health_is_judged_per_device_and_listed_with_the_lab(store: Store) -> None:
    store.devices.record_agent({"name": "agent-1"}, [("phone-1", "agent-1", "android", "pixel", "[]", "{}", 1, "online", 2.0)])
    store.devices.set_health("phone-1", "maintenance", "new battery", 10.0)
    store.devices.set_health("board-9", "bad", "smoke", 11.0)  # judged, never registered
    health = store.devices.health()
    assert all(isinstance(h, HealthRow) for h in health)
    assert [(h.name, h.health, h.reason, h.changed_at) for h in health] == [
        ("board-9", "bad", "smoke", 11.0), ("phone-1", "maintenance", "new battery", 10.0)]
    assert store.devices.health_by_name()["phone-1"].health == "maintenance"
    lab = store.reads.devices()
    assert [(d.name, d.agent, d.health) for d in lab] == [("board-9", None, "bad"), ("phone-1", "agent-1", "maintenance")]


def test_the_last_reference_check_of_each_device(store: Store) -> None:
    job_id = _job(store, [_task(0, target="phone-1")], kind="health_check")
    _run(store, _lease(store, {"phone-1"})[0])
    checks = store.devices.last_reference_checks("health_check")
    assert list(checks) == ["phone-1"] and checks["phone-1"] > 0
    assert store.devices.last_reference_checks("user") == {}
    assert store.jobs.get(job_id) is not None


def test_running_tasks_and_the_queue_as_the_dashboard_reads_them(store: Store) -> None:
    job_id = _job(store, [_task(0), _task(1), _task(2, target="phone-1", priority=0)])
    task = _lease(store, {"sim"})[0]
    running = store.reads.running_tasks()
    assert [(r.id, r.job_id, r.target, r.leased_by) for r in running] == [(task.id, job_id, "sim", "agent-1")]
    assert [(q.target, q.job_id, q.priority, q.pending) for q in store.reads.queue()] == [
        ("phone-1", job_id, 0, 1), ("sim", job_id, 1, 1)]


# --- calibrations and drift -----------------------------------------------------------------------------------------

def _paired_job(store: Store) -> int:
    """Two models measured on the sim and on phone-1 (pair keys tie them), the sim run of m1 contended."""
    job_id = _job(store, [_task(0, model="m0", sha="0" * 64, pair_key="k0"),
                          _task(1, model="m0", sha="0" * 64, target="phone-1", pair_key="k0"),
                          _task(2, model="m1", sha="1" * 64, pair_key="k1"),
                          _task(3, model="m1", sha="1" * 64, target="phone-1", pair_key="k1")])
    results = {(0,): _result(1.0), (1,): _result(10.0, environment={"runtime": "litert", "energy_per_inference_mj": 3.5}),
               (2,): _result(2.0, contended=True), (3,): _result(20.0)}
    for task in _lease(store, {"sim", "phone-1"}, limit=4):
        _run(store, task, results[(task.seq,)])
    return job_id


def test_a_metric_is_named_never_a_column(store: Store) -> None:
    job_id = _paired_job(store)
    values = store.calibrations.completed_values(job_id, "latency", include_contended=True, target="sim")
    assert sorted((v.model_name, v.value) for v in values) == [("m0", 1.0), ("m1", 2.0)]
    assert [v.model_name for v in store.calibrations.completed_values(job_id, "latency", include_contended=False,
                                                                      target="sim")] == ["m0"]
    memory = store.calibrations.completed_values(job_id, "peak_memory", include_contended=True)
    assert {v.value for v in memory} == {8.0}  # MB
    whole = store.calibrations.completed_values(job_id, "whole_run", include_contended=True, target="phone-1")
    assert {v.value for v in whole} == {1.5}  # no whole-run figure: the sandbox's wall time
    energy = store.calibrations.completed_values(job_id, "energy", include_contended=True, target="phone-1")
    assert sorted((v.model_name, v.value) for v in energy) == [("m0", 3.5), ("m1", None)]
    assert set(METRIC_UNITS) == {"latency", "whole_run", "peak_memory", "avg_memory", "energy"}
    with pytest.raises(UnknownMetric, match="s.latency_avg_ms"):
        store.calibrations.completed_values(job_id, "s.latency_avg_ms", include_contended=True)


def test_paired_values_put_the_sim_beside_the_device(store: Store) -> None:
    job_id = _paired_job(store)
    pairs = store.calibrations.paired_values(job_id, "phone-1", "latency", "latency", include_contended=True)
    assert sorted((p.model_name, p.x, p.y) for p in pairs) == [("m0", 1.0, 10.0), ("m1", 2.0, 20.0)]
    quiet = store.calibrations.paired_values(job_id, "phone-1", "latency", "latency", include_contended=False)
    assert [(p.model_name, p.x, p.y) for p in quiet] == [("m0", 1.0, 10.0)]
    energy = store.calibrations.paired_values(job_id, "phone-1", "latency", "energy", include_contended=True)
    assert sorted((p.model_name, p.x, p.y) for p in energy) == [("m0", 1.0, 3.5), ("m1", 2.0, None)]
    assert all(p.device_environment and "litert" in p.device_environment for p in pairs)


def _calibration(device: str = "phone-1", metric: str = "latency", **key: Any) -> dict[str, Any]:
    return {"device": device, "metric": metric, "threads": 1, "runtime": "litert", "precision": "fp32",
            "batch_size": 1, "input_size": None, "family": "", "created_at": time.time(), "kind": "linear", "n": 2,
            "a": 10.0, "b": 0.0, "r2": 0.99, "loo_mape": 0.05, "within_10": 1.0, "kendall_tau": 1.0,
            "spearman_rho": 1.0, "warnings_json": "[]", "fit_json": '{"fit": 1}', "source": "{}", **key}


def test_calibrations_are_versioned_per_key_and_read_back(store: Store) -> None:
    job_id = _paired_job(store)
    runs = [{"model": p.model_name, "sim_run_id": p.sim_run, "device_run_id": p.device_run}
            for p in store.calibrations.paired_values(job_id, "phone-1", "latency", "latency", include_contended=True)]
    first = store.calibrations.add(_calibration(), runs)
    second = store.calibrations.add(_calibration(r2=0.5), runs)
    other = store.calibrations.add(_calibration(batch_size=8), [])
    assert (first[1], second[1], other[1]) == (1, 2, 1)  # a batch size of its own is another key
    newest = store.calibrations.newest("phone-1", "latency", 1, "", runtime="litert", batch_size=1, input_size=None,
                                       precision=None)
    assert isinstance(newest, CalibrationRow) and (newest.id, newest.version, newest.r2) == (second[0], 2, 0.5)
    assert store.calibrations.newest("phone-1", "latency", 2, "", runtime=None, batch_size=None, input_size=None,
                                     precision=None) is None
    assert [(f.device, f.version) for f in store.calibrations.fits("latency", 1, "litert", 1, None, "fp32", "")] == [
        ("phone-1", 2), ("phone-1", 1)]
    assert [r.version for r in store.calibrations.rows("phone-1", "latency")] == [1, 2, 1]
    assert store.calibrations.rows("phone-2") == []
    got = store.calibrations.get(first[0])
    assert got is not None and got.fit_json == '{"fit": 1}' and store.calibrations.get(10_000) is None
    assert [v.version for v in store.calibrations.versions(second[0])] == [1, 2]
    latest = store.calibrations.latest()
    assert sorted((c.batch_size, c.version, c.versions) for c in latest) == [(1, 2, 2), (8, 1, 1)]
    assert store.calibrations.devices() == ["phone-1"]
    assert [(t.device, t.metric) for t in store.calibrations.newest_times()] == [("phone-1", "latency")]
    assert set(store.calibrations.newest_by_device()) == {"phone-1"}
    assert store.calibrations.newest_at("phone-1") is not None and store.calibrations.newest_at("phone-2") is None
    assert {c.id for c in store.calibrations.using_job(job_id)} == {first[0], second[0]}


def test_a_power_mode_runtime_matches_its_plain_runtime(store: Store) -> None:
    store.calibrations.add(_calibration("nano-1", runtime="litert@nvpmodel=MAXN"), [])
    found = store.calibrations.newest("nano-1", "latency", 1, "", runtime="litert", batch_size=None, input_size=None,
                                      precision=None)
    assert found is not None and found.runtime == "litert@nvpmodel=MAXN"


def test_drift_round_trips_and_the_latest_per_key_is_read(store: Store) -> None:
    row = {"device": "phone-1", "metric": "latency", "threads": 1, "calibration_id": 2, "previous_id": 1,
           "slope_change": 0.1, "intercept_change": 0.0, "r2_drop": 0.01, "prediction_shift": 0.05, "exceeded": 0,
           "reasons": "", "created_at": 100.0}
    store.calibrations.add_drift(row)
    store.calibrations.add_drift({**row, "prediction_shift": 0.5, "exceeded": 1, "reasons": "moved", "created_at": 200.0})
    store.calibrations.add_drift({**row, "device": "phone-2", "threads": 2, "created_at": 50.0})
    history = store.calibrations.drift_history()
    assert all(isinstance(d, DriftRow) for d in history) and len(history) == 3
    assert [d.prediction_shift for d in store.calibrations.drift_history("phone-1")] == [0.05, 0.5]
    assert [d.device for d in store.calibrations.drift_history("phone-2", metric="latency", threads=2)] == ["phone-2"]
    assert store.calibrations.drift_history("phone-2", threads=1) == []
    latest = store.calibrations.latest_drift()
    assert [(d.device, d.threads, d.prediction_shift, d.exceeded) for d in latest] == [
        ("phone-1", 1, 0.5, 1), ("phone-2", 2, 0.05, 0)]


# --- artifacts ------------------------------------------------------------------------------------------------------

def test_uploads_count_against_their_owner_until_forgotten(store: Store) -> None:
    store.artifacts.record_upload("a" * 64, "tok", 100, 1.0)
    store.artifacts.record_upload("a" * 64, "tok", 100, 2.0)  # the same upload again counts once
    store.artifacts.record_upload("b" * 64, "tok", 50, 1.0)
    store.artifacts.record_upload("b" * 64, "other", 50, 1.0)
    assert store.artifacts.upload_usage("tok") == 150 and store.artifacts.upload_usage("nobody") == 0
    store.artifacts.forget_uploads(["a" * 64])
    assert store.artifacts.upload_usage("tok") == 50


def test_referenced_artifacts_are_models_and_script_archives(store: Store) -> None:
    _job(store, [_task(0, sha="d" * 64, spec_json='{"script_archive": "' + "e" * 64 + '"}'), _task(1, sha="f" * 64)])
    assert store.artifacts.referenced() == {"d" * 64, "e" * 64, "f" * 64}


def test_an_uploaded_dataset_a_job_names_is_referenced(store: Store) -> None:
    """A controller job's dataset is an artifact its plan names (workload.dataset.artifact): gc keeps it."""
    plan = '{"workload": {"type": "benchmark", "dataset": {"path": "x.npz", "artifact": "' + "c" * 64 + '"}}}'
    _job(store, [_task(0, sha="d" * 64, spec_json=plan), _task(1, sha="d" * 64, spec_json='{"workload": {}}')])
    assert store.artifacts.referenced() == {"c" * 64, "d" * 64}


def test_every_row_type_is_frozen() -> None:
    import farm.controller.store.rows as rows
    kinds = [v for v in vars(rows).values() if isinstance(v, type) and issubclass(v, Row) and v is not Row]
    assert len(kinds) > 20
    assert all(k.__dataclass_params__.frozen for k in kinds)  # type: ignore[attr-defined]
