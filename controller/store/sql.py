"""The store's repositories, written once for SQLite and PostgreSQL: one query per question.

Every query here is written with `?` placeholders; a store's `sql()` turns them into its driver's style
(psycopg's `%s`). What the two databases do differently is asked of the store, in a few marked places
(each `# dialect:` comment), never spelled twice:

- `sql(text)`: the placeholder style;
- `any_of(column, values)`: membership in a list (SQLite: `IN (?, ...)` in chunks of `chunk` values,
  its bound on parameters; PostgreSQL: one `= ANY(?)` with an array);
- `same`: NULL-safe equality (`IS` / `IS NOT DISTINCT FROM`);
- `lock_rows`: what a SELECT appends to lock the rows it reads until the transaction ends (PostgreSQL's
  `FOR UPDATE`; SQLite's writer holds the whole database from BEGIN IMMEDIATE on);
- `lock_table(name)`: a statement that serializes writers of a table, or None;
- `json_text(column, key)`: a JSON text column's key as text (a dotted key: nested objects' keys);
- `metric_sql`: each metric's expression (metrics.METRIC_UNITS);
- `insert_row` / `update_row` / `executemany`: column quoting and value conversion;
- `next_ids(table, n)`: n new ids of a table inside the writing transaction, so a batch of rows (a result
  batch's runs) is inserted by one executemany with its ids known (SQLite: after MAX(id), as its own rowid
  choice; PostgreSQL: the identity's sequence).

Leasing (`next_pending`) differs in its algorithm, not only its spelling: each store's module keeps its own,
a subclass of `Leases`. Results are mapped to columns once (RUN_COLUMNS, SUMMARY_COLUMNS): `Runs.record`
writes through the map and `Runs.results` reads through it.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import time
from contextlib import AbstractContextManager
from typing import Any, Callable, Collection, Iterator, Mapping, Protocol, Sequence

from farm.controller.store.interface import DeviceRecord, RunWrite, VisibleTo
from farm.controller.store.job_listing import LISTING_SELECT, TASK_COUNTS_SELECT
from farm.controller.store.metrics import UnknownMetric
from farm.controller.store.rows import (
    AgentRow, CalibrationFitRow, CalibrationRow, CalibrationTime, DashboardJob, DeviceLatency, DeviceRow, DriftRow, EarlierAttempt,
    HealthRow, JobListing, JobRow, JobSpecRow, LabDeviceRow, LatestCalibration, LatestDrift, LeaseState, MeasuredRow,
    StoredOpProfileRow, PairedRow, QuarantinedTarget, QueuedWork, ResultRow, RunningAttempt, RunningTask, TaskOutcome,
    TaskRow, TelemetrySampleRow)
from farm.controller.store.samples import pack_iterations, pack_telemetry, unpack_iterations, unpack_telemetry
from farm.proto import op_profile
from farm.proto.results import FIGURES, FailureClass, ResultRefused, RunResult, RunStatus, TaskStatus, check_figures


def close_idle(readers: queue.SimpleQueue[Any]) -> None:
    """Close every idle reader connection of a store's pool (both databases' `close`)."""
    while True:
        try:
            readers.get_nowait().close()
        except queue.Empty:
            return


# A quarantined device (or one in maintenance) is offered no task until it is released.
HEALTHY_TARGET = "AND t.target NOT IN (SELECT name FROM device_health WHERE health IN ('bad', 'maintenance'))"
AGENT_COLUMNS = ("name", "session_id", "state", "farm_version", "capabilities_json", "hostname", "peer",
                 "connected_at", "last_seen")
# metric name -> its SQL expression over a summaries row {s} and its runs row {r} (units: metrics.METRIC_UNITS):
# these two are the same in both databases; each store adds peak_memory, avg_memory and energy in its own SQL.
COMMON_METRIC_SQL: dict[str, str] = {"latency": "{s}.latency_avg_ms", "whole_run": "COALESCE({r}.whole_run_s, {r}.wall_s)"}
# Calibrations in key order; NULLs first, as SQLite sorts them.
CALIBRATION_ORDER = ("device, metric, threads NULLS FIRST, runtime, batch_size NULLS FIRST, input_size NULLS FIRST, "
                     '"precision" NULLS FIRST, family')


class Dialect(Protocol):
    """What the shared repositories ask of a store (see the module's docstring)."""
    chunk: int
    same: str
    lock_rows: str
    metric_sql: Mapping[str, str]

    def transaction(self) -> AbstractContextManager[None]: ...
    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]: ...
    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any: ...
    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None: ...
    def insert_row(self, table: str, row: Mapping[str, Any], *, returning: str | None = "id") -> int: ...
    def update_row(self, table: str, pk: int, fields: Mapping[str, Any]) -> None: ...
    def sql(self, text: str) -> str: ...
    def any_of(self, column: str, values: Sequence[Any]) -> tuple[str, list[Any]]: ...
    def lock_table(self, table: str) -> str | None: ...
    def json_text(self, column: str, key: str) -> str: ...
    def next_ids(self, table: str, count: int) -> list[int]: ...


def metric_expression(metrics: Mapping[str, str], metric: str, summaries: str, runs: str) -> str:
    """The metric's expression over the given aliases of summaries and runs."""
    if metric not in metrics:
        raise UnknownMetric(metric)
    return metrics[metric].format(s=summaries, r=runs)


def visible_jobs(visible_to: VisibleTo, alias: str) -> tuple[str, list[Any]]:
    """The WHERE clause of service.Viewer.may_read in a `team` lab: the lab's own jobs, the token's, its team's."""
    if visible_to is None:
        return "", []
    a = alias
    return (f"WHERE {a}submitted_by IS NULL OR {a}submitted_by = ? OR ({a}team IS NOT NULL AND {a}team = ?) ",
            [visible_to[0], visible_to[1]])


def chunks(values: Sequence[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(values), size):
        yield list(values[start:start + size])


# --- the one map from a result to its columns ----------------------------------------------------------------
def _latency(field: str) -> Callable[[RunResult], Any]:
    return lambda r: getattr(r.latency, field) if r.latency else None


def _telemetry(get: Callable[[Any], Any]) -> Callable[[RunResult], Any]:
    return lambda r: get(r.telemetry) if r.telemetry else None


def _figure(name: str) -> Callable[[RunResult], Any]:
    return lambda r: getattr(r, name)


def _contention_json(r: RunResult) -> str | None:
    return None if r.contention is None else json.dumps(dataclasses.asdict(r.contention))


# runs column -> (its value from a result, its name in a ResultRow or None when results() does not read it)
RUN_COLUMNS: dict[str, tuple[Callable[[RunResult], Any], str | None]] = {
    "status": (lambda r: r.status.value, "run_status"),
    "failure_class": (lambda r: r.failure_class.value if r.failure_class else None, "failure_class"),
    "message": (lambda r: r.message, "message"),
    "backend": (lambda r: r.backend, "backend"),
    "approximate": (lambda r: int(r.approximate), "approximate"),
    "limits_cpus": (lambda r: r.limits.cpus, "limits_cpus"),
    "limits_cpuset": (lambda r: r.limits.cpuset, "limits_cpuset"),
    "limits_memory_mb": (lambda r: r.limits.memory_mb, "limits_memory_mb"),
    "wall_s": (lambda r: r.wall_s, "wall_s"),
    "whole_run_s": (lambda r: r.whole_run_s, "whole_run_s"),
    "environment_json": (lambda r: json.dumps(r.stored_environment()), "environment_json"),
    "tool_versions_json": (lambda r: json.dumps(r.tool_versions), "tool_versions_json"),
    "log_tail": (lambda r: r.log_tail, None),
    "contended": (lambda r: None if r.contention is None else int(r.contention.contended), None),
    "contention_json": (_contention_json, "contention_json"),
}
# summaries column (read under the same name) -> its value from a result
SUMMARY_COLUMNS: dict[str, Callable[[RunResult], Any]] = {
    "latency_init_ms": _latency("init"), "latency_first_ms": _latency("first"),
    "latency_warmup_avg_ms": _latency("warmup_avg"), "latency_avg_ms": _latency("avg"),
    "latency_p50_ms": _latency("p50"), "latency_p90_ms": _latency("p90"), "latency_p99_ms": _latency("p99"),
    "latency_std_ms": _latency("std"), "latency_min_ms": _latency("min"), "latency_max_ms": _latency("max"),
    "latency_count": _latency("count"),
    "peak_memory_bytes": _telemetry(lambda t: t.memory_peak_bytes),
    "peak_memory_source": _telemetry(lambda t: t.memory_peak_source),
    "avg_memory_bytes": _telemetry(lambda t: t.memory_avg_bytes),
    "baseline_memory_bytes": lambda r: r.baseline_memory_bytes,
    "peak_rss_bytes": lambda r: r.peak_rss_bytes,
    "cpu_avg_percent": _telemetry(lambda t: t.cpu_avg_percent),
    "cpu_peak_percent": _telemetry(lambda t: t.cpu_peak_percent),
    "block_read_bytes": _telemetry(lambda t: t.block_read_bytes),
    "block_write_bytes": _telemetry(lambda t: t.block_write_bytes),
    "net_rx_bytes": _telemetry(lambda t: t.net_rx_bytes),
    "net_tx_bytes": _telemetry(lambda t: t.net_tx_bytes),
    "sampler_cpu_percent": _telemetry(lambda t: t.sampler_cpu_percent),
    "sample_interval_ms": _telemetry(lambda t: t.interval_ms),
    "sample_count": _telemetry(lambda t: len(t.samples)),
    "throughput_per_s": lambda r: r.throughput_per_s,
    "startup_ms": lambda r: r.startup_ms,
}
# the declared run figures (proto/results.py, RunFigure): each in a column of its name (schema.figure_columns_to_add)
SUMMARY_COLUMNS.update({f.name: _figure(f.name) for f in check_figures(
    FIGURES, columns={*SUMMARY_COLUMNS, *ResultRow.__dataclass_fields__})})
# A task's model facts: tasks name their job's stored facts (model_facts, schema 20) as they name their plan; a
# row written otherwise keeps its own. `alias` is the tasks row's, `facts` the joined model_facts row's.
def model_facts(alias: str = "t", facts: str = "f") -> str:
    return f"COALESCE({alias}.model_facts_json, {facts}.facts_json) AS model_facts_json"


def facts_join(alias: str = "t", facts: str = "f") -> str:
    return f"LEFT JOIN model_facts {facts} ON {facts}.id = {alias}.facts_id"


TASK_RESULT_COLUMNS = (
    "t.id AS task, t.job_id AS job, t.model_name, t.model_sha256, t.model_family, t.model_path, t.target, t.threads, "
    "t.batch_size, t.input_size, t.repeat, t.status AS task_status, t.attempts, t.pair_key, "
    "t.failure_class AS task_failure_class, t.message AS task_message, t.model_size_bytes, t.model_param_count, "
    f"{model_facts()}, COALESCE(t.spec_json, p.plan_json) AS task_spec_json")
# A task row with its plan and its model's facts: tasks name their job's plan (task_plans, schema 18) and facts
# (model_facts, schema 20); a row written otherwise keeps its own spec_json and model_facts_json. Every query that
# makes TaskRows selects these FROM TASK_FROM.
_STORED_ONCE = {"spec_json": "COALESCE(t.spec_json, p.plan_json) AS spec_json", "model_facts_json": model_facts()}
TASK_SELECT = ", ".join(_STORED_ONCE.get(_c, f"t.{_c}") for _c in TaskRow.__dataclass_fields__)
TASK_FROM = f"tasks t LEFT JOIN task_plans p ON p.id = t.plan_id {facts_join()}"
RESULT_COLUMNS = ", ".join([
    TASK_RESULT_COLUMNS, "r.id AS run_id, r.attempt, r.started_at, r.finished_at",
    *(f"r.{c}" if alias == c else f"r.{c} AS {alias}" for c, (_, alias) in RUN_COLUMNS.items() if alias),
    *(f"s.{c}" for c in SUMMARY_COLUMNS)])


def run_row(result: RunResult) -> dict[str, Any]:
    return {column: get(result) for column, (get, _) in RUN_COLUMNS.items()}


def summary_row(result: RunResult) -> dict[str, Any]:
    return {column: get(result) for column, get in SUMMARY_COLUMNS.items()}


def _insert(table: str, columns: Sequence[str]) -> str:
    return f"INSERT INTO {table} ({', '.join(_q(c) for c in columns)}) VALUES ({', '.join('?' * len(columns))})"


RUN_INSERT_COLUMNS = ("id", "task_id", "job_id", "attempt", "agent", "started_at", "finished_at", *RUN_COLUMNS)
SUMMARY_INSERT_COLUMNS = ("run_id", *SUMMARY_COLUMNS)
OP_PROFILE_COLUMNS = ("run_id", "idx", "kind", "node_type", "name", "avg_ms", "percent", "first_ms", "count",
                      "times_called", "mem_kb")


class RepositoryStore:
    """What both stores share: their repositories, the shared ones and each store's own way to lease."""
    jobs: Jobs
    leases: Leases
    runs: Runs
    devices: Devices
    calibrations: Calibrations
    artifacts: Artifacts
    reads: LabReads

    def attach_repositories(self, leases: type[Leases]) -> None:
        self.jobs, self.leases, self.runs = Jobs(self), leases(self), Runs(self)
        self.devices, self.calibrations, self.artifacts = Devices(self), Calibrations(self), Artifacts(self)
        self.reads = LabReads(self)


class Repository:
    def __init__(self, store: Any) -> None:
        self.store = store

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        return self.store.query(self.store.sql(sql), params)  # type: ignore[no-any-return]

    def _execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self.store.execute(self.store.sql(sql), params)

    def _count(self, sql: str, params: Sequence[Any] = ()) -> int:
        """The one number a statement answers (as `n`)."""
        return int(self._query(sql, params)[0]["n"] or 0)

    def _in(self, column: str, values: Sequence[Any]) -> Iterator[tuple[str, list[Any]]]:
        """`column` in `values`, as (clause, params) per chunk the database takes in one statement."""
        for chunk in chunks(values, self.store.chunk):
            yield self.store.any_of(column, chunk)


# A task's field stored once per job in a table of its own: field -> (its table, that table's column, the task's
# column naming the row). A job has a few plans and a few models however many tasks it has.
STORED_ONCE_PER_JOB = {"spec_json": ("task_plans", "plan_json", "plan_id"),
                       "model_facts_json": ("model_facts", "facts_json", "facts_id")}


class Jobs(Repository):
    def insert(self, job: Mapping[str, Any], tasks: Sequence[Mapping[str, Any]]) -> int:
        """The job and its tasks; each task's plan (its `spec_json`) and its model's facts (`model_facts_json`) are
        stored once per job, in task_plans and model_facts; the task names them (plan_id, facts_id)."""
        with self.store.transaction():
            job_id = self.store.insert_row("jobs", job)
            ids: dict[str, dict[str, int]] = {field: {} for field in STORED_ONCE_PER_JOB}
            for field, (table, column, _) in STORED_ONCE_PER_JOB.items():
                for t in tasks:
                    if t.get(field) is not None and t[field] not in ids[field]:
                        ids[field][t[field]] = self.store.insert_row(table, {"job_id": job_id, column: t[field]})
            named = {key: field for field, (_, _, key) in STORED_ONCE_PER_JOB.items()}
            columns = list(dict.fromkeys(["job_id", *named, *(k for t in tasks for k in t
                                                                if k not in STORED_ONCE_PER_JOB)]))

            def value(t: Mapping[str, Any], c: str) -> Any:
                if c == "job_id":
                    return job_id
                if c in named:  # the id of the row Jobs.insert stored for the task's field (None: it has none)
                    stored = t.get(named[c])
                    return None if stored is None else ids[named[c]][stored]
                return t.get(c)
            if tasks:  # one statement for every task: a 100,000-task job is inserted in a second or two
                self.store.executemany(
                    self.store.sql(f"INSERT INTO tasks ({', '.join(_q(c) for c in columns)}) "
                                   f"VALUES ({', '.join('?' * len(columns))})"),
                    [[value(t, c) for c in columns] for t in tasks])
        return int(job_id)

    def claim_submit_key(self, owner: str, key: str, now: float) -> int | None:
        """Inside the caller's transaction: take `key` for a job about to be made (None), or the job an earlier
        submit with the same key made. A concurrent claim of the same key waits for the first to commit."""
        self._execute("INSERT INTO submit_keys (owner, submit_key, job_id, at) VALUES (?, ?, NULL, ?) "
                      "ON CONFLICT (owner, submit_key) DO NOTHING", [owner, key, now])
        rows = self._query("SELECT job_id FROM submit_keys WHERE owner = ? AND submit_key = ?", [owner, key])
        return None if rows[0]["job_id"] is None else int(rows[0]["job_id"])

    def bind_submit_key(self, owner: str, key: str, job_id: int) -> None:
        self._execute("UPDATE submit_keys SET job_id = ? WHERE owner = ? AND submit_key = ?", [job_id, owner, key])

    def job_of_submit_key(self, owner: str, key: str) -> int | None:
        rows = self._query("SELECT job_id FROM submit_keys WHERE owner = ? AND submit_key = ? AND job_id IS NOT NULL",
                           [owner, key])
        return int(rows[0]["job_id"]) if rows else None

    def get(self, job_id: int) -> JobRow | None:
        rows = self._query("SELECT * FROM jobs WHERE id = ?", [job_id])
        return JobRow.of(rows[0]) if rows else None

    def status(self, job_id: int) -> str | None:
        """The job's status alone (a result reads this, not the job's spec and source)."""
        row = self._execute("SELECT status FROM jobs WHERE id = ?", [job_id]).fetchone()
        return None if row is None else str(row[0])

    def statuses(self, job_ids: Collection[int]) -> dict[int, str]:
        """Each of these jobs' status alone, by id (a result batch reads these, not the jobs' spec and source)."""
        found: dict[int, str] = {}
        for clause, params in self._in("id", sorted(set(job_ids))):
            found.update((int(r[0]), str(r[1])) for r in self._execute(
                f"SELECT id, status FROM jobs WHERE {clause}", params).fetchall())
        return found

    def update(self, job_id: int, **fields: Any) -> None:
        with self.store.transaction():
            self.store.update_row("jobs", job_id, fields)

    def tasks(self, job_id: int) -> list[TaskRow]:
        return [TaskRow.of(r) for r in self._query(
            f"SELECT {TASK_SELECT} FROM {TASK_FROM} WHERE t.job_id = ? ORDER BY t.seq", [job_id])]

    def task(self, task_id: int) -> TaskRow | None:
        rows = self._query(f"SELECT {TASK_SELECT} FROM {TASK_FROM} WHERE t.id = ?", [task_id])
        return TaskRow.of(rows[0]) if rows else None

    def update_task(self, task_id: int, **fields: Any) -> None:
        with self.store.transaction():
            self.store.update_row("tasks", task_id, fields)

    def listing(self, limit: int, visible_to: VisibleTo = None) -> list[JobListing]:
        """The newest jobs; with visible_to (owner, team): only the lab's own, that token's and its team's.
        Each row has `counts` (its tasks by status) and their sums tasks/completed/failed: one grouped count."""
        where, params = visible_jobs(visible_to, "")
        jobs = self._query(LISTING_SELECT.format(where=where), [*params, limit])
        counts = self.task_counts_of([j["id"] for j in jobs])
        out = []
        for j in jobs:
            c = counts.get(j["id"], {})
            out.append(JobListing(**j, counts=c, tasks=sum(c.values()), completed=c.get("completed", 0),
                                  failed=c.get("failed", 0)))
        return out

    def of_kind(self, kind: str, statuses: tuple[str, ...]) -> list[int]:
        clause, params = self.store.any_of("status", list(statuses))  # a handful of statuses
        return [int(r["id"]) for r in self._query(f"SELECT id FROM jobs WHERE kind = ? AND {clause} ORDER BY id",
                                                  [kind, *params])]

    def earlier_of_kind(self, kind: str, before_job: int) -> list[int]:
        return [int(r["id"]) for r in self._query("SELECT id FROM jobs WHERE kind = ? AND id < ? ORDER BY id",
                                                  [kind, before_job])]

    def task_counts(self, job_id: int) -> dict[str, int]:
        """A job's tasks by status."""
        return self.task_counts_of([job_id]).get(job_id, {})

    def task_counts_of(self, job_ids: list[int]) -> dict[int, dict[str, int]]:
        """Each of these jobs' tasks by status, read from the counts the triggers keep."""
        by_job: dict[int, dict[str, int]] = {}
        for clause, params in self._in("job_id", job_ids):
            for r in self._query(TASK_COUNTS_SELECT.format(clause=clause), params):
                by_job.setdefault(r["job_id"], {})[r["status"]] = r["n"]
        return by_job

    def finished_task_count(self, job_id: int) -> int:
        return self._count("SELECT COUNT(*) AS n FROM tasks WHERE job_id = ? AND status IN "
                           "('completed','failed','canceled')", [job_id])

    def has_open_tasks(self, job_id: int) -> bool:
        # answered from the (job_id, status) index without counting
        return bool(self._count("SELECT CAST(EXISTS(SELECT 1 FROM tasks WHERE job_id = ? AND status IN ('pending', "
                                "'running')) AS integer) AS n", [job_id]))

    def targets(self, job_id: int) -> list[str]:
        """The devices a job has tasks for (sim left out)."""
        return [str(r["target"]) for r in self._query(
            "SELECT DISTINCT target FROM tasks WHERE job_id = ? AND target != 'sim' ORDER BY target", [job_id])]

    def model_names(self, job_id: int) -> dict[str, str]:
        """sha256 -> model name, for a job's models."""
        return {r["model_sha256"]: r["model_name"] for r in self._query(
            "SELECT DISTINCT model_sha256, model_name FROM tasks WHERE job_id = ?", [job_id])}

    def model_tasks(self, job_id: int, sha256: str, threads: int) -> list[TaskOutcome]:
        """A job's tasks for one model at one thread count: their status and, when failed, why."""
        return [TaskOutcome.of(r) for r in self._query(
            "SELECT status, failure_class, message FROM tasks WHERE job_id = ? AND model_sha256 = ? AND threads = ? "
            "ORDER BY id", [job_id, sha256, threads])]

    def completed_with_model(self, sha256: str, threads: int) -> list[JobSpecRow]:
        """Jobs (id, spec_json), newest first, with a completed run of this model at these threads."""
        return [JobSpecRow.of(r) for r in self._query(
            "SELECT DISTINCT j.id, j.spec_json FROM jobs j JOIN tasks t ON t.job_id = j.id "
            "WHERE t.model_sha256 = ? AND t.threads = ? AND t.status = 'completed' ORDER BY j.id DESC",
            [sha256, threads])]

    def cancel_pending_tasks(self, job_id: int, message: str, now: float) -> int:
        with self.store.transaction():
            return int(self._execute(
                "UPDATE tasks SET status = ?, failure_class = ?, message = ?, finished_at = ? WHERE job_id = ? "
                "AND status = ?", [TaskStatus.CANCELED.value, FailureClass.CANCELED.value, message, now, job_id,
                                   TaskStatus.PENDING.value]).rowcount)

    def requeue_interrupted_tasks(self, job_id: int, since: float, message: str) -> int:
        """A job's unstarted tasks and those canceled since `since` (stopped by Ctrl+C) wait again."""
        with self.store.transaction():
            return int(self._execute(
                "UPDATE tasks SET status = ?, leased_by = NULL, failure_class = NULL, finished_at = NULL, message = ? "
                "WHERE job_id = ? AND (status IN (?, ?) OR (status = ? AND finished_at >= ?))",
                [TaskStatus.PENDING.value, message, job_id, TaskStatus.PENDING.value, TaskStatus.RUNNING.value,
                 TaskStatus.CANCELED.value, since]).rowcount)

    def requeue_tasks(self, job_id: int, statuses: Collection[str], message: str, more_attempts: int) -> int:
        """`farm retry`: a job's tasks in `statuses` wait again, as new attempts of the same tasks (each earlier
        attempt stays a run); each gets `more_attempts` attempts beyond those it has used."""
        ordered = sorted(statuses)
        if not ordered:
            return 0
        clause, params = self.store.any_of("status", ordered)
        with self.store.transaction():
            return int(self._execute(
                "UPDATE tasks SET status = ?, leased_by = NULL, lease_expires_at = NULL, failure_class = NULL, "
                f"finished_at = NULL, message = ?, max_attempts = attempts + ? WHERE job_id = ? AND {clause}",
                [TaskStatus.PENDING.value, message, more_attempts, job_id, *params]).rowcount)

    def past_deadline(self, now: float) -> list[int]:
        """Unfinished jobs whose deadline (timeouts.job) is before `now`."""
        return [int(r["id"]) for r in self._query(
            "SELECT id FROM jobs WHERE deadline_at < ? AND status IN ('queued', 'running', 'interrupted') ORDER BY id",
            [now])]

    def fail_waiting_tasks(self, device: str, message: str, now: float, *, job_id: int | None = None) -> list[int]:
        """Fail the device's pending tasks (infrastructure); returns the job of each, in task order."""
        where = "target = ? AND status = 'pending'"
        params: list[Any] = [device]
        if job_id is not None:
            where += " AND job_id = ?"
            params.append(job_id)
        with self.store.transaction():
            # dialect: the rows read are locked, so the update changes exactly them while another controller leases
            rows = self._query(f"SELECT id, job_id FROM tasks WHERE {where} ORDER BY id{self.store.lock_rows}", params)
            for clause, ids in self._in("id", [r["id"] for r in rows]):
                self._execute(f"UPDATE tasks SET status = 'failed', failure_class = 'infrastructure', finished_at = ?, "
                              f"message = ? WHERE {clause}", [now, message, *ids])
        return [int(r["job_id"]) for r in rows]


class Leases(Repository):
    def next_pending(self, targets: Collection[str], limit: int, *, job_id: int | None = None) -> list[TaskRow]:
        raise NotImplementedError  # dialect: each store leases in its own way (sqlite.py, postgres.py)

    def lease(self, task_id: int, attempt: int, agent: str, expires_at: float) -> None:
        self.lease_many([(task_id, attempt, agent, expires_at)])

    def lease_many(self, leases: Sequence[tuple[int, int, str, float]]) -> None:
        """(task, attempt, agent, expires_at) each, one statement for all: a dispatcher round's leases."""
        if leases:
            self.store.executemany(self.store.sql(
                "UPDATE tasks SET status = ?, attempts = ?, leased_by = ?, lease_expires_at = ? WHERE id = ?"),
                [(TaskStatus.RUNNING.value, attempt, agent, expires_at, task_id)
                 for task_id, attempt, agent, expires_at in leases])

    def start_job(self, job_id: int, now: float) -> None:
        """A queued job is running from its first lease on."""
        self._execute("UPDATE jobs SET status = 'running', started_at = ? WHERE id = ? AND status = 'queued'",
                      [now, job_id])

    def state(self, task_id: int) -> LeaseState | None:
        """(task status, attempts, lease_expires_at, job status, leased_by) of a task."""
        row = self._execute(
            "SELECT t.status, t.attempts, t.lease_expires_at, j.status, t.leased_by FROM tasks t "
            "JOIN jobs j ON j.id = t.job_id WHERE t.id = ?", [task_id]).fetchone()
        return None if row is None else LeaseState(*row)

    def renew(self, task_id: int, expires_at: float) -> None:
        with self.store.transaction():
            self._execute("UPDATE tasks SET lease_expires_at = ? WHERE id = ?", [expires_at, task_id])

    def running_attempts(self, *, job_id: int | None = None, agent: str | None = None,
                         expired_before: float | None = None,
                         task_ids: list[int] | None = None) -> list[RunningAttempt]:
        """Running tasks (id, job_id, attempts, max_attempts, leased_by) matching every filter given."""
        where: list[str] = ["status = 'running'"]
        params: list[Any] = []
        for clause, value in (("job_id = ?", job_id), ("leased_by = ?", agent), ("lease_expires_at < ?", expired_before)):
            if value is not None:
                where.append(clause)
                params.append(value)
        if task_ids is not None:
            clause, ids = self.store.any_of("id", list(task_ids))
            where.append(clause)
            params += ids
        return [RunningAttempt.of(r) for r in self._query(
            f"SELECT id, job_id, attempts, max_attempts, leased_by FROM tasks WHERE {' AND '.join(where)} ORDER BY id",
            params)]

    def record_lost_attempts(self, tasks: list[RunningAttempt], reason: str, *, retry: Callable[[int, int], bool],
                             now: float) -> list[int]:
        """Inside a transaction: each running attempt in `tasks` becomes a failed run (infrastructure); its task
        goes back to the queue, or fails when `retry` says no.

        `reason` may name the agent as {agent}. Returns the jobs whose tasks failed for good."""
        failed_jobs = []
        with self.store.transaction():
            for t in tasks:
                # only while the attempt is still the one running: a stale list (or another controller) must not
                # reopen a settled task
                current = self._execute(f"SELECT status, attempts FROM tasks WHERE id = ?{self.store.lock_rows}",
                                        [t.id]).fetchone()
                if current is None or tuple(current) != (TaskStatus.RUNNING.value, t.attempts):
                    continue
                message = reason.format(agent=t.leased_by or "(none)")
                self._execute(
                    "INSERT INTO runs (task_id, job_id, attempt, status, failure_class, message, agent, finished_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (task_id, attempt) DO NOTHING",
                    [t.id, t.job_id, t.attempts, RunStatus.FAILED.value, FailureClass.INFRASTRUCTURE.value, message,
                     t.leased_by, now])
                found = self._execute("SELECT id FROM runs WHERE task_id = ? AND attempt = ?",
                                      [t.id, t.attempts]).fetchone()
                run_id = None if found is None else int(found[0])
                fields: dict[str, Any]
                if retry(t.attempts, t.max_attempts):
                    fields = {"status": TaskStatus.PENDING.value, "message": message}
                else:
                    fields = {"status": TaskStatus.FAILED.value, "failure_class": FailureClass.INFRASTRUCTURE.value,
                              "finished_at": now, "message": f"{message} (attempt {t.attempts} of {t.max_attempts})"}
                    failed_jobs.append(t.job_id)
                self.store.update_row("tasks", t.id, {**fields, "leased_by": None, "last_run_id": run_id})
        return failed_jobs

    def adopt_unfinished(self, pid: int, host: str, lease_expires_at: float, *,
                         seen_before: float | None = None) -> None:
        """After a restart: this process owns the open jobs, running leases get a fresh expiry, and every
        agent and device is offline until it says hello; with `seen_before`, only those last seen before it
        (another controller on the same database keeps its own agents' last_seen fresh)."""
        stale, since = ("", []) if seen_before is None else (" WHERE last_seen IS NULL OR last_seen < ?", [seen_before])
        with self.store.transaction():
            self._execute("UPDATE jobs SET owner_pid = ?, owner_host = ? WHERE status IN ('queued', 'running')",
                          [pid, host])
            self._execute("UPDATE tasks SET lease_expires_at = ? WHERE status = 'running'", [lease_expires_at])
            self._execute("UPDATE agents SET state = 'offline'" + stale, since)
            self._execute("UPDATE devices SET state = 'offline'" + stale, since)


def check_lease(row: Sequence[Any] | None, task_id: int, attempt: int, agent: str) -> None:
    if row is None:
        raise ResultRefused(f"there is no task {task_id}")
    status, attempts, leased_by = row
    if status != TaskStatus.RUNNING.value:
        raise ResultRefused(f"task {task_id} is {status}: attempt {attempt} holds no lease")
    if attempts != attempt:
        raise ResultRefused(f"attempt {attempt} of task {task_id} is not the current one (attempt {attempts})")
    if leased_by != agent:
        raise ResultRefused(f"task {task_id} attempt {attempt} is not leased to agent {agent}")


class Runs(Repository):
    def record(self, task: TaskRow, attempt: int, agent: str, started_at: float, result: RunResult,
               task_fields: Mapping[str, Any]) -> int | None:
        """Store a run with its samples and update its task, atomically.

        Returns the run id, or None when this agent already delivered this same result. Raises
        ResultRefused, storing nothing, unless the attempt is running and leased to `agent`.
        (The result writer checks a whole batch with `leased` and `delivered` and stores it with `write`.)
        """
        store = self.store
        with store.transaction():
            # dialect: the task row's lock orders two controllers delivering results for the same task
            lease = self._execute(f"SELECT status, attempts, leased_by FROM tasks WHERE id = ?{store.lock_rows}",
                                  [task.id]).fetchone()
            existing = self.delivered([(task.id, attempt)]).get((task.id, attempt))
            if existing:
                if existing == (agent, result.status.value, result.message):
                    return None  # delivered twice (the first ack was lost): applied once
                raise ResultRefused(f"attempt {attempt} of task {task.id} is already stored: {existing[2]}")
            check_lease(lease, task.id, attempt, agent)
            return self.write([RunWrite(task, attempt, agent, started_at, result, task_fields)])[0]

    def leased(self, task_ids: Collection[int]) -> dict[int, TaskRow]:
        """Inside the caller's transaction: these tasks by id (those that exist), each row locked until it ends."""
        found: dict[int, TaskRow] = {}
        for clause, params in self._in("t.id", sorted(set(task_ids))):
            if self.store.lock_rows:  # dialect: lock in id order (two controllers' batches never wait in a circle)
                self._query(f"SELECT t.id FROM tasks t WHERE {clause} ORDER BY t.id{self.store.lock_rows}", params)
            for row in self._query(f"SELECT {TASK_SELECT} FROM {TASK_FROM} WHERE {clause}", params):
                found[int(row["id"])] = TaskRow.of(row)
        return found

    def delivered(self, attempts: Collection[tuple[int, int]]) -> dict[tuple[int, int], tuple[str, str, str]]:
        """(task, attempt) -> (agent, status, message) of each of these attempts already stored as a run."""
        wanted = set(attempts)
        found: dict[tuple[int, int], tuple[str, str, str]] = {}
        for clause, params in self._in("task_id", sorted({task for task, _ in wanted})):
            for row in self._execute(f"SELECT task_id, attempt, agent, status, message FROM runs WHERE {clause}",
                                     params).fetchall():
                if (row[0], row[1]) in wanted:
                    found[(int(row[0]), int(row[1]))] = (row[2], row[3], row[4])
        return found

    def write(self, batch: Sequence[RunWrite]) -> list[int]:
        """Inside the caller's checks: store each result as a run (summary, samples, op profile) and update its
        task, one statement per table for the whole batch, in one transaction. Returns the run ids in order.
        Each task at most once in a batch."""
        store = self.store
        if not batch:
            return []
        with store.transaction():
            run_ids: list[int] = store.next_ids("runs", len(batch))  # dialect
            now = time.time()
            runs = [w.result for w in batch]
            store.executemany(store.sql(_insert("runs", RUN_INSERT_COLUMNS)), [
                [run_id, w.task.id, w.task.job_id, w.attempt, w.agent, w.started_at, now,
                 *(get(w.result) for get, _ in RUN_COLUMNS.values())] for run_id, w in zip(run_ids, batch)])
            store.executemany(store.sql(_insert("summaries", SUMMARY_INSERT_COLUMNS)), [
                [run_id, *(get(r) for get in SUMMARY_COLUMNS.values())] for run_id, r in zip(run_ids, runs)])
            profiles = [(run_id, i, o.kind, o.node_type, o.name, o.avg_ms, o.percent, o.first_ms, o.count,
                         o.times_called, o.mem_kb) for run_id, r in zip(run_ids, runs)
                        # bounded and cleaned again: it came over the wire
                        for i, o in enumerate(op_profile.bounded(r.op_profile) if r.op_profile else [])]
            if profiles:
                store.executemany(store.sql(_insert("op_profiles", OP_PROFILE_COLUMNS)), profiles)
            samples = [_packed(run_id, r) for run_id, r in zip(run_ids, runs)
                       if r.iterations_ms or (r.telemetry and r.telemetry.samples)]
            if samples:  # packed: one row per run, 8 bytes a timing (samples.py)
                store.executemany(store.sql(_insert("run_samples", ("run_id", "iterations", "telemetry"))), samples)
            updates: dict[tuple[str, ...], list[list[Any]]] = {}
            for run_id, w in zip(run_ids, batch):
                fields = {"last_run_id": run_id, **w.task_fields}  # task_fields may name an earlier run
                updates.setdefault(tuple(fields), []).append([*fields.values(), w.task.id])
            for columns, rows in updates.items():  # one statement per shape of change (usually one)
                store.executemany(store.sql(
                    f"UPDATE tasks SET {', '.join(f'{_q(c)} = ?' for c in columns)} WHERE id = ?"), rows)
        return run_ids

    def iterations(self, run_id: int) -> list[float]:
        rows = self._query("SELECT iterations FROM run_samples WHERE run_id = ?", [run_id])
        return unpack_iterations(bytes(rows[0]["iterations"])) if rows and rows[0]["iterations"] else []

    def telemetry(self, run_id: int) -> list[TelemetrySampleRow]:
        rows = self._query("SELECT telemetry FROM run_samples WHERE run_id = ?", [run_id])
        return unpack_telemetry(bytes(rows[0]["telemetry"])) if rows and rows[0]["telemetry"] else []

    def results(self, job_id: int) -> list[ResultRow]:
        """Every task of a job with its counted run and summary (None columns for a task not run)."""
        return [ResultRow.of(r) for r in self._query(
            f"SELECT {RESULT_COLUMNS} FROM {TASK_FROM} LEFT JOIN runs r ON r.id = t.last_run_id "
            "LEFT JOIN summaries s ON s.run_id = r.id WHERE t.job_id = ? ORDER BY t.model_name NULLS FIRST, "
            "t.threads NULLS FIRST, t.batch_size NULLS FIRST, t.input_size NULLS FIRST, t.repeat NULLS FIRST, "
            "t.target NULLS FIRST, t.seq NULLS FIRST", [job_id])]

    def op_profiles(self, run_ids: list[int]) -> dict[int, list[StoredOpProfileRow]]:
        """Each run's op profile rows (op types, then nodes; slowest first), by run id."""
        found: dict[int, list[StoredOpProfileRow]] = {run_id: [] for run_id in run_ids}
        for clause, params in self._in("run_id", run_ids):
            for row in self._query(
                    "SELECT run_id, kind, node_type, name, avg_ms, percent, first_ms, count, times_called, mem_kb "
                    f"FROM op_profiles WHERE {clause} ORDER BY run_id, idx", params):
                run_id = row.pop("run_id")
                found[run_id].append(StoredOpProfileRow.of(row))
        return found

    def contended_runs(self, task_id: int) -> int:
        return self._count("SELECT COUNT(*) AS n FROM runs WHERE task_id = ? AND contended = 1", [task_id])

    def last_contended_measurement(self, task_id: int) -> tuple[int, int] | None:
        """(run id, attempt) of the task's latest completed but contended run: a measurement a retry set aside."""
        rows = self._query("SELECT id, attempt FROM runs WHERE task_id = ? AND contended = 1 AND status = 'completed' "
                           "ORDER BY attempt DESC LIMIT 1", [task_id])
        return (int(rows[0]["id"]), int(rows[0]["attempt"])) if rows else None

    def device_latencies(self, job_id: int, device: str) -> list[DeviceLatency]:
        """(model_sha256, model_name, threads, latency_avg_ms) of a job's completed runs on `device`."""
        return [DeviceLatency.of(r) for r in self._query(
            "SELECT t.model_sha256, t.model_name, t.threads, s.latency_avg_ms FROM tasks t "
            "JOIN runs r ON r.id = t.last_run_id JOIN summaries s ON s.run_id = r.id "
            "WHERE t.job_id = ? AND t.target = ? AND t.status = 'completed' ORDER BY t.id", [job_id, device])]


class Devices(Repository):
    def record_agent(self, agent: Mapping[str, Any], devices: Sequence[DeviceRecord]) -> None:
        """Upsert an agent (only the fields given change) and its devices, one statement for every device:
        registration stays linear in their number."""
        unknown = set(agent) - set(AGENT_COLUMNS)
        if unknown:
            raise ValueError(f"agents have no column {sorted(unknown)[0]!r}")
        fields = {k: v for k, v in agent.items() if k in AGENT_COLUMNS}
        changes = ", ".join(f"{_q(k)} = excluded.{_q(k)}" for k in fields if k != "name")
        with self.store.transaction():
            self._execute(
                f"INSERT INTO agents ({', '.join(_q(k) for k in fields)}) VALUES ({', '.join('?' * len(fields))}) "
                "ON CONFLICT (name) " + (f"DO UPDATE SET {changes}" if changes else "DO NOTHING"), list(fields.values()))
            if devices:
                self.store.executemany(self.store.sql(
                    "INSERT INTO devices (name, agent, driver, device_type, tags_json, facts_json, slots, state, "
                    "last_seen) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET "
                    "agent = excluded.agent, driver = excluded.driver, device_type = excluded.device_type, "
                    "tags_json = excluded.tags_json, facts_json = excluded.facts_json, slots = excluded.slots, "
                    "state = excluded.state, last_seen = excluded.last_seen"), list(devices))

    def agents(self) -> list[AgentRow]:
        return [AgentRow.of(r) for r in self._query("SELECT * FROM agents ORDER BY name")]

    def all(self, *, sim: bool = True) -> list[DeviceRow]:
        """Registered devices, sim slots left out unless asked."""
        return [DeviceRow.of(r) for r in self._query(
            "SELECT * FROM devices" + ("" if sim else " WHERE driver != 'sim'") + " ORDER BY name")]

    def owners(self, names: Sequence[str] | None = None) -> dict[str, str]:
        if names is None:
            return {r["name"]: r["agent"] for r in self._query("SELECT name, agent FROM devices ORDER BY name")}
        found: dict[str, str] = {}
        for clause, params in self._in("name", names):
            found.update((r["name"], r["agent"]) for r in self._query(
                f"SELECT name, agent FROM devices WHERE {clause} ORDER BY name", params))
        return found

    def keep_alive(self, agents: Sequence[str], now: float, stale_before: float) -> None:
        """The agents connected here (and their devices) were seen `now`; any other agent or device still shown
        connected but not seen since `stale_before` is offline (its controller died)."""
        with self.store.transaction():
            for clause, params in self._in("name", agents):
                self._execute(f"UPDATE agents SET last_seen = ? WHERE {clause}", [now, *params])
            for clause, params in self._in("agent", agents):
                self._execute(f"UPDATE devices SET last_seen = ? WHERE {clause}", [now, *params])
            for table in ("agents", "devices"):
                self._execute(f"UPDATE {table} SET state = 'offline' WHERE state != 'offline' "
                              "AND (last_seen IS NULL OR last_seen < ?)", [stale_before])

    def device_type(self, device: str) -> str | None:
        rows = self._query("SELECT device_type FROM devices WHERE name = ?", [device])
        return rows[0]["device_type"] if rows else None

    def forget(self, name: str) -> None:
        with self.store.transaction():
            self._execute("DELETE FROM devices WHERE name = ?", [name])

    def set_health(self, device: str, health: str, reason: str, now: float) -> None:
        with self.store.transaction():
            self._execute(
                "INSERT INTO device_health (name, health, reason, changed_at) VALUES (?, ?, ?, ?) ON CONFLICT (name) "
                "DO UPDATE SET health = excluded.health, reason = excluded.reason, changed_at = excluded.changed_at",
                [device, health, reason, now])

    def health(self) -> list[HealthRow]:
        return [HealthRow.of(r) for r in self._query("SELECT * FROM device_health ORDER BY name")]

    def health_by_name(self) -> dict[str, HealthRow]:
        return {row.name: row for row in self.health()}

    def quarantined_targets(self, job_id: int) -> list[QuarantinedTarget]:
        """The job's targets that are quarantined or in maintenance (name, reason)."""
        return [QuarantinedTarget.of(r) for r in self._query(
            "SELECT name, reason FROM device_health WHERE health IN ('bad', 'maintenance') "
            "AND name IN (SELECT target FROM tasks WHERE job_id = ?) ORDER BY name", [job_id])]

    def last_reference_checks(self, health_check_kind: str) -> dict[str, float]:
        """device -> when its last health check (a job of that kind) completed on it, in Unix time."""
        return {r["target"]: r["at"] for r in self._query(
            "SELECT t.target, MAX(t.finished_at) AS at FROM tasks t JOIN jobs j ON j.id = t.job_id "
            "WHERE j.kind = ? AND t.target != 'sim' AND t.status = 'completed' GROUP BY t.target ORDER BY t.target",
            [health_check_kind])}


class Calibrations(Repository):
    def _metric(self, metric: str, summaries: str, runs: str) -> str:
        return metric_expression(self.store.metric_sql, metric, summaries, runs)

    def completed_values(self, job_id: int, metric: str, *, include_contended: bool,
                         target: str | None = None) -> list[MeasuredRow]:
        """A metric of every completed run of a job (the attempt that counted), with its model's facts;
        only one target's runs (the sim or one device) when given."""
        value = self._metric(metric, "s", "r")
        quiet = "" if include_contended else " AND COALESCE(r.contended, 0) = 0"
        quiet += "" if target is None else " AND t.target = ?"
        return [MeasuredRow.of(r) for r in self._query(
            f"SELECT t.model_name, t.model_sha256, t.model_family, t.threads, t.batch_size, t.input_size, t.repeat, "
            f"t.model_size_bytes, t.model_param_count, {model_facts()}, r.id AS run_id, r.environment_json, "
            f"{value} AS value FROM tasks t {facts_join()} JOIN runs r ON r.id = t.last_run_id "
            "JOIN summaries s ON s.run_id = r.id "
            f"WHERE t.job_id = ? AND t.status = 'completed'{quiet} ORDER BY t.id",
            [job_id] + ([] if target is None else [target]))]

    def paired_values(self, job_id: int, device: str, sim_metric: str, device_metric: str, *,
                      include_contended: bool) -> list[PairedRow]:
        """A job's completed device runs beside their completed sim twins (same pair key): x is `sim_metric` of the
        sim run, y is `device_metric` of the device run."""
        x, y = self._metric(sim_metric, "ss", "rs"), self._metric(device_metric, "sd", "rd")
        quiet = "" if include_contended else " AND COALESCE(rs.contended, 0) = 0"
        return [PairedRow.of(r) for r in self._query(
            f"SELECT d.model_name, d.model_family, d.threads, d.batch_size, d.input_size, d.model_size_bytes, "
            f"d.model_param_count, {model_facts('d')}, rs.id AS sim_run, rd.id AS device_run, rs.environment_json, "
            f"rd.environment_json AS device_environment, ({x}) AS x, ({y}) AS y "
            f"FROM tasks d {facts_join('d')} JOIN tasks t ON t.job_id = d.job_id AND t.pair_key = d.pair_key AND t.target = 'sim' "
            f"JOIN runs rd ON rd.id = d.last_run_id JOIN summaries sd ON sd.run_id = rd.id "
            f"JOIN runs rs ON rs.id = t.last_run_id JOIN summaries ss ON ss.run_id = rs.id "
            f"WHERE d.job_id = ? AND d.target = ? AND d.status = 'completed' AND t.status = 'completed'{quiet} "
            f"ORDER BY d.id, t.id", [job_id, device])]

    def contended_completed_runs(self, job_ids: list[int]) -> int:
        """Completed runs of these jobs whose sim run was contended."""
        return sum(self._count(
            f"SELECT COUNT(*) AS n FROM tasks t JOIN runs r ON r.id = t.last_run_id WHERE {clause} "
            "AND t.status = 'completed' AND r.contended = 1", params) for clause, params in self._in("t.job_id", job_ids))

    def add(self, row: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
        """Store a calibration as the next version of its key, with the runs it was fitted on; (id, version)."""
        same = self.store.same
        with self.store.transaction():
            lock = self.store.lock_table("calibrations")  # dialect: two controllers refreshing at once
            if lock:
                self.store.execute(lock)
            found = self._execute(
                "SELECT COALESCE(MAX(version), 0) + 1 FROM calibrations WHERE device = ? AND metric = ? AND threads = ? "
                f"AND runtime = ? AND batch_size {same} ? AND input_size {same} ? AND \"precision\" = ? AND family = ?",
                [row["device"], row["metric"], row["threads"], row["runtime"], row["batch_size"], row["input_size"],
                 row["precision"], row["family"]]).fetchone()
            version = int(found[0]) if found else 1
            cal_id = self.store.insert_row("calibrations", {**row, "version": version})
            for run in runs:  # a few dozen rows off the hot path
                self.store.insert_row("calibration_runs", {"calibration_id": cal_id, **run}, returning=None)
        return int(cal_id), version

    def fits(self, metric: str, threads: int, runtime: str, batch_size: int | None, input_size: int | None,
             precision: str, family: str) -> list[CalibrationFitRow]:
        """(device, version, fit_json) of every calibration of this key, newest first."""
        same = self.store.same
        return [CalibrationFitRow.of(r) for r in self._query(
            "SELECT device, version, fit_json FROM calibrations WHERE metric = ? AND threads = ? AND runtime = ? "
            f"AND batch_size {same} ? AND input_size {same} ? AND \"precision\" = ? AND family = ? ORDER BY id DESC",
            [metric, threads, runtime, batch_size, input_size, precision, family])]

    def rows(self, device: str | None = None, metric: str | None = None) -> list[CalibrationRow]:
        where, params = [], []
        if device:
            where.append("device = ?")
            params.append(device)
        if metric:
            where.append("metric = ?")
            params.append(metric)
        sql = "SELECT * FROM calibrations"
        if where:
            sql += " WHERE " + " AND ".join(where)
        return [CalibrationRow.of(r) for r in self._query(f"{sql} ORDER BY {CALIBRATION_ORDER}, version", params)]

    def get(self, calibration_id: int) -> CalibrationRow | None:
        rows = self._query("SELECT * FROM calibrations WHERE id = ?", [calibration_id])
        return CalibrationRow.of(rows[0]) if rows else None

    def versions(self, calibration_id: int) -> list[CalibrationRow]:
        """Every version of the calibration key that `calibration_id` belongs to, oldest first."""
        same = self.store.same
        return [CalibrationRow.of(r) for r in self._query(
            "SELECT c.* FROM calibrations c JOIN calibrations k ON k.id = ? AND c.device = k.device "
            "AND c.metric = k.metric AND c.threads = k.threads AND c.runtime = k.runtime "
            f"AND c.batch_size {same} k.batch_size AND c.input_size {same} k.input_size "
            f"AND c.\"precision\" {same} k.\"precision\" AND c.family = k.family ORDER BY c.version", [calibration_id])]

    def latest(self) -> list[LatestCalibration]:
        """The newest version of every calibration key, with how many versions it has."""
        order = ", ".join(f"c.{part}" for part in CALIBRATION_ORDER.split(", "))
        return [LatestCalibration.of(r) for r in self._query(
            "SELECT c.id, c.device, c.metric, c.threads, c.runtime, c.batch_size, c.input_size, c.\"precision\", "
            "c.family, c.version, c.created_at, c.kind, c.n, c.r2, c.loo_mape, c.kendall_tau, c.spearman_rho, "
            "c.fit_json, c.source, g.versions FROM calibrations c JOIN (SELECT MAX(id) AS id, COUNT(*) AS versions "
            "FROM calibrations GROUP BY device, metric, threads, runtime, batch_size, input_size, \"precision\", "
            f"family) g ON g.id = c.id ORDER BY {order}")]

    def newest(self, device: str, metric: str, threads: int, family: str, *, runtime: str | None,
               batch_size: int | None, input_size: int | None, precision: str | None) -> CalibrationRow | None:
        """The newest calibration of the key; None filters match any. A board's calibrations are also keyed by
        its power mode ("litert@nvpmodel=MAXN;..."): a plain runtime matches each of them."""
        sql = "SELECT * FROM calibrations WHERE device = ? AND metric = ? AND threads = ? AND family = ?"
        params: list[Any] = [device, metric, threads, family]
        for column, value in (("batch_size", batch_size), ("input_size", input_size), ('"precision"', precision)):
            if value is not None:
                sql += f" AND {column} = ?"
                params.append(value)
        if runtime is not None:  # a LIKE that ignores ASCII case, as SQLite's does
            sql += " AND (runtime = ? OR LOWER(runtime) LIKE LOWER(?))"
            params += [runtime, f"{runtime}@%"]
        rows = self._query(sql + " ORDER BY id DESC LIMIT 1", params)
        return CalibrationRow.of(rows[0]) if rows else None

    def devices(self) -> list[str]:
        return [str(r["device"]) for r in self._query("SELECT DISTINCT device FROM calibrations ORDER BY device")]

    def newest_times(self) -> list[CalibrationTime]:
        """(device, metric, newest): when each device's metric was last calibrated."""
        return [CalibrationTime.of(r) for r in self._query(
            "SELECT device, metric, MAX(created_at) AS newest FROM calibrations "
            "WHERE created_at IS NOT NULL GROUP BY device, metric ORDER BY device, metric")]

    def newest_by_device(self) -> dict[str, float]:
        """device -> when its newest calibration was stored."""
        return {r["device"]: r["at"] for r in self._query(
            "SELECT device, MAX(created_at) AS at FROM calibrations GROUP BY device ORDER BY device")}

    def newest_at(self, device: str) -> float | None:
        at = self._query("SELECT MAX(created_at) AS at FROM calibrations WHERE device = ?", [device])[0]["at"]
        return None if at is None else float(at)

    def using_job(self, job_id: int) -> list[CalibrationRow]:
        """Every stored calibration version fitted on this job's runs (either side), oldest version first."""
        return [CalibrationRow.of(r) for r in self._query(
            "SELECT c.* FROM calibrations c WHERE c.id IN ("
            " SELECT cr.calibration_id FROM calibration_runs cr JOIN runs r"
            " ON r.id = cr.sim_run_id OR r.id = cr.device_run_id WHERE r.job_id = ?)"
            " ORDER BY c.device, c.metric, c.threads NULLS FIRST, c.family, c.version", [job_id])]

    def add_drift(self, row: Mapping[str, Any]) -> None:
        with self.store.transaction():
            self.store.insert_row("calibration_drift", row)

    def drift_history(self, device: str | None = None, *, metric: str | None = None,
                      threads: int | None = None) -> list[DriftRow]:
        where, params = [], []
        for clause, value in (("device = ?", device), ("metric = ?", metric), ("threads = ?", threads)):
            if value is not None and value != "":
                where.append(clause)
                params.append(value)
        sql = "SELECT * FROM calibration_drift" + (" WHERE " + " AND ".join(where) if where else "")
        return [DriftRow.of(r) for r in self._query(sql + " ORDER BY id", params)]

    def latest_drift(self) -> list[LatestDrift]:
        """The newest drift row per (device, metric, threads): drift is computed per calibration key."""
        return [LatestDrift.of(r) for r in self._query(
            "SELECT d.device, d.metric, d.threads, d.prediction_shift, d.exceeded FROM calibration_drift d "
            "WHERE d.id = (SELECT e.id FROM calibration_drift e WHERE e.device = d.device AND e.metric = d.metric "
            f"AND e.threads {self.store.same} d.threads ORDER BY e.created_at DESC NULLS LAST, e.id DESC LIMIT 1) "
            "ORDER BY d.device, d.metric, d.threads NULLS FIRST")]


class Artifacts(Repository):
    def record_upload(self, sha256: str, owner: str, size: int, at: float) -> None:
        with self.store.transaction():
            self._execute("INSERT INTO artifact_uploads (sha256, owner, size, at) VALUES (?, ?, ?, ?) "
                          "ON CONFLICT DO NOTHING", [sha256, owner, size, at])

    def upload_usage(self, owner: str) -> int:
        """Bytes of the artifacts this token uploaded that are still stored."""
        return self._count("SELECT COALESCE(SUM(size), 0) AS n FROM artifact_uploads WHERE owner = ?", [owner])

    def forget_uploads(self, hashes: list[str]) -> None:
        with self.store.transaction():
            for clause, params in self._in("sha256", hashes):
                self._execute(f"DELETE FROM artifact_uploads WHERE {clause}", params)

    def referenced(self) -> set[str]:
        """The sha256 of every model, packed script folder and uploaded dataset some job's task names (what gc must
        keep)."""
        archive = self.store.json_text("spec_json", "script_archive")
        planned = self.store.json_text("plan_json", "script_archive")
        dataset = self.store.json_text("plan_json", "workload.dataset.artifact")
        rows = self._query("SELECT DISTINCT model_sha256 AS sha FROM tasks WHERE model_sha256 IS NOT NULL "
                           f"UNION SELECT DISTINCT {archive} FROM tasks WHERE {archive} IS NOT NULL "
                           f"UNION SELECT DISTINCT {planned} FROM task_plans WHERE {planned} IS NOT NULL "
                           f"UNION SELECT DISTINCT {dataset} FROM task_plans WHERE {dataset} IS NOT NULL")
        return {str(r["sha"]) for r in rows}


class LabReads(Repository):
    def devices(self) -> list[LabDeviceRow]:
        """Every device the lab knows (registered by an agent, or only judged healthy/bad), with its health."""
        return [LabDeviceRow.of(r) for r in self._query(
            "SELECT d.name, d.agent, d.driver, d.device_type, d.tags_json, d.slots, d.state, d.last_seen, "
            "h.health, h.reason, h.changed_at FROM devices d LEFT JOIN device_health h ON h.name = d.name "
            "UNION ALL SELECT h.name, NULL, NULL, NULL, NULL, NULL, NULL, NULL, h.health, h.reason, h.changed_at "
            "FROM device_health h WHERE h.name NOT IN (SELECT name FROM devices) ORDER BY 1")]

    def agents(self) -> list[AgentRow]:
        return self.store.devices.agents()  # type: ignore[no-any-return]

    def running_tasks(self) -> list[RunningTask]:
        return [RunningTask.of(r) for r in self._query(
            "SELECT id, job_id, target, model_name, threads, repeat, attempts, leased_by FROM tasks "
            "WHERE status = 'running' ORDER BY id")]

    def queue(self) -> list[QueuedWork]:
        """Pending tasks per target and job, in lease order (priority, then job)."""
        return [QueuedWork.of(r) for r in self._query(
            "SELECT target, job_id, MIN(priority) AS priority, COUNT(*) AS pending FROM tasks "
            "WHERE status = 'pending' GROUP BY target, job_id ORDER BY MIN(priority) NULLS FIRST, job_id, target")]

    def jobs(self, limit: int, visible_to: VisibleTo = None) -> list[DashboardJob]:
        """The newest jobs, each with its task counts per status (one grouped query, not one per job)."""
        where, params = visible_jobs(visible_to, "")
        jobs = self._query("SELECT id, name, kind, status, priority, created_at, started_at, finished_at, message "
                           f"FROM jobs {where}ORDER BY id DESC LIMIT ?", [*params, limit])
        counts = self.store.jobs.task_counts_of([j["id"] for j in jobs])
        return [DashboardJob(**j, counts=counts.get(j["id"], {})) for j in jobs]

    def job_count(self, visible_to: VisibleTo = None) -> int:
        where, params = visible_jobs(visible_to, "")
        return self._count(f"SELECT COUNT(*) AS n FROM jobs {where}", params)

    def pending_by_priority(self) -> dict[int, int]:
        return {r["priority"]: r["n"] for r in self._query(
            "SELECT priority, COUNT(*) AS n FROM tasks WHERE status = 'pending' GROUP BY priority ORDER BY priority")}

    def tasks_by_status(self) -> dict[str, int]:
        return {str(r["status"]): r["n"] for r in self._query(
            "SELECT status, COUNT(*) AS n FROM tasks GROUP BY status ORDER BY status")}

    # --- the job page's evidence behind a failure, and the lab page's panels ---------------------
    def log_tails(self, run_ids: Sequence[int]) -> dict[int, str]:
        """Each failed run's kept output (the sandbox's last lines), by run id; runs without one left out."""
        found: dict[int, str] = {}
        for clause, params in self._in("id", run_ids):
            for row in self._query(f"SELECT id, log_tail FROM runs WHERE {clause} AND log_tail IS NOT NULL "
                                   "AND log_tail != '' ORDER BY id", params):
                found[int(row["id"])] = str(row["log_tail"])
        return found

    def recent_failures(self, limit: int) -> list[dict[str, Any]]:
        """The newest failed runs (not cancellations), one per task (its latest, with `failed_attempts`: how many of
        its attempts failed), each with its task's target and model, and the tasks failed without a run (a
        quarantined device's waiting tasks: run_id None), newest first."""
        failed = "status = 'failed' AND failure_class IS NOT NULL AND failure_class != 'canceled'"
        runs = self._query(
            "SELECT r.id AS run_id, r.job_id, r.task_id, r.attempt, r.failure_class, r.message, r.finished_at, "
            "r.limits_memory_mb, t.target, t.model_name, f.failed_attempts FROM runs r JOIN tasks t ON t.id = r.task_id "
            f"JOIN (SELECT task_id, MAX(id) AS last_id, COUNT(*) AS failed_attempts FROM runs WHERE {failed} "
            "GROUP BY task_id) f ON f.last_id = r.id ORDER BY r.id DESC LIMIT ?", [limit])
        never_ran = self._query(
            "SELECT NULL AS run_id, t.job_id, t.id AS task_id, t.attempts AS attempt, t.failure_class, t.message, "
            "t.finished_at, NULL AS limits_memory_mb, t.target, t.model_name, 0 AS failed_attempts FROM tasks t "
            "WHERE t.status = 'failed' AND t.last_run_id IS NULL ORDER BY t.finished_at DESC, t.id DESC LIMIT ?",
            [limit])
        return sorted(runs + never_ran, key=lambda r: -(r["finished_at"] or 0.0))[:limit]

    def drift_alerts(self, limit: int) -> list[dict[str, Any]]:
        """The newest refreshes whose drift exceeded a threshold."""
        return self._query("SELECT * FROM calibration_drift WHERE exceeded = 1 ORDER BY id DESC LIMIT ?", [limit])

    def earlier_attempts(self, job_id: int) -> dict[int, list[EarlierAttempt]]:
        """Each task's runs before its counted one (why it was run again: contention or a lost attempt), by task."""
        found: dict[int, list[EarlierAttempt]] = {}
        for row in self._query("SELECT r.task_id, r.attempt, r.status, r.failure_class, r.contended FROM runs r "
                               "JOIN tasks t ON t.id = r.task_id WHERE r.job_id = ? AND r.id != t.last_run_id "
                               "ORDER BY r.task_id, r.attempt", [job_id]):
            found.setdefault(int(row.pop("task_id")), []).append(EarlierAttempt.of(row))
        return found


def _packed(run_id: int, result: RunResult) -> tuple[int, bytes | None, bytes | None]:
    samples = result.telemetry.samples if result.telemetry else []
    return (run_id, pack_iterations(result.iterations_ms) if result.iterations_ms else None,
            pack_telemetry((s.t_s, s.cpu_percent, s.memory_bytes) for s in samples) if samples else None)


def _q(column: str) -> str:
    """A column name from a caller's mapping: quoted, so it is only ever a name (and "precision" is one)."""
    if not column.replace("_", "").isalnum():
        raise ValueError(f"not a column name: {column[:40]!r}")
    return f'"{column}"'
