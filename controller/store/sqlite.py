"""The SQLite store: jobs, tasks, runs, summaries, per-iteration and telemetry samples, in one file.

WAL mode, a schema version with ordered migrations (controller/store/schema.py), and one transaction
per finished run, so a crash mid-job loses nothing already measured. Several processes may open the
same file (`farm cancel` while `farm submit` runs); busy_timeout makes them take turns. One connection
writes; queries outside a transaction use reader connections of their own, so a long write (a run
with a million samples) never makes a listing wait (WAL readers see the last commit). The file is
created readable by its owner only.

Every statement farm runs against SQLite is in this module, in the repository it belongs to; the
repositories share the store's connection and transaction (controller/store/interface.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

from farm.controller.store.samples import pack_iterations, pack_telemetry, unpack_iterations, unpack_telemetry
from farm.controller.store.schema import (
    PACKED_SAMPLES, SCHEMA_VERSION, migrate, schema_version, sqlite_utils, up_to_date)
from farm.controller.store.interface import DeviceRecord, StoreError, VisibleTo
from farm.controller.store.metrics import MiB, UnknownMetric
from farm.controller.store.rows import (
    AgentRow, CalibrationFit, CalibrationRow, CalibrationTime, DashboardJob, DeviceLatency, DeviceRow, DriftRow,
    HealthRow, JobListing, JobRow, JobSpec, LabDevice, LatestCalibration, LatestDrift, LeaseState, MeasuredRow,
    OpProfileRow, PairedRow, QuarantinedTarget, QueuedWork, ResultRow, RunningAttempt, RunningTask, TaskOutcome,
    TaskRow, TelemetrySample)
from farm.proto import op_profile
from farm.proto.results import FailureClass, ResultRefused, RunResult, RunStatus, TaskStatus

__all__ = ["SCHEMA_VERSION", "SQLiteStore", "store_error_message"]
BUSY_TIMEOUT_S = 30
# A quarantined device (or one in maintenance) is offered no task until it is released.
HEALTHY_TARGET = "AND t.target NOT IN (SELECT name FROM device_health WHERE health IN ('bad', 'maintenance'))"
# SQLite's bound on ? parameters in one statement, with room to spare
CHUNK = 500
# runs converted per transaction when an older store's samples are packed (migration 15)
PACK_BATCH_RUNS = 200

# metric name -> its SQL expression over a summaries row {s} and its runs row {r} (units: metrics.METRIC_UNITS)
METRIC_SQL: dict[str, str] = {
    "latency": "{s}.latency_avg_ms",
    "whole_run": "COALESCE({r}.whole_run_s, {r}.wall_s)",
    "peak_memory": f"{{s}}.peak_memory_bytes / {float(MiB)}",
    "avg_memory": f"{{s}}.avg_memory_bytes / {float(MiB)}",
    "energy": "json_extract({r}.environment_json, '$.energy_per_inference_mj')",
}


def metric_sql(metric: str, summaries: str, runs: str) -> str:
    """The metric's expression over the given aliases of summaries and runs."""
    if metric not in METRIC_SQL:
        raise UnknownMetric(metric)
    return METRIC_SQL[metric].format(s=summaries, r=runs)


def store_error_message(path: Path, error: sqlite3.Error) -> str:
    """What a person can do about an SQLite error on the store, in one paragraph."""
    text = str(error)
    if "not a database" in text or "malformed" in text:
        return (f"{path} is not a farm store that can be read (not SQLite, or damaged: {text}). farm did not "
                "change it; point --db (or FARM_DB) at another file, or restore it from a backup.")
    if "locked" in text or "busy" in text:
        return (f"{path} is locked by another process (waited {BUSY_TIMEOUT_S} s: {text}); nothing was written. "
                "Wait for that process (e.g. another `farm submit`) to finish, or stop it, and try again.")
    if "readonly" in text or "unable to open" in text or "disk I/O" in text:
        return (f"{path} cannot be opened for writing ({text}): check that the file and its folder are writable "
                "by you (farm also writes the -wal and -shm files beside it), or point --db at another file.")
    return f"the store {path} failed: {text}"


def _rows(cursor: sqlite3.Cursor) -> list[dict[str, Any]]:
    columns = [c[0] for c in cursor.description]
    return [dict(zip(columns, row)) for row in cursor]


def _visible_jobs(visible_to: VisibleTo, alias: str) -> tuple[str, list[Any]]:
    """The WHERE clause of service.Viewer.may_read in a `team` lab: the lab's own jobs, the token's, its team's."""
    if visible_to is None:
        return "", []
    a = alias
    return (f"WHERE {a}submitted_by IS NULL OR {a}submitted_by = ? OR ({a}team IS NOT NULL AND {a}team = ?) ",
            [visible_to[0], visible_to[1]])


def _marks(values: Sequence[Any]) -> str:
    return ",".join("?" for _ in values)


class SQLiteStore:
    """The store in one SQLite file (or ":memory:"), its repositories over one connection."""

    def __init__(self, path: Path | str, *, create_folder: bool = False) -> None:
        """create_folder: make a missing folder of the store; otherwise it is an error (a mistyped --db
        would otherwise look like a store whose results were lost)."""
        # Absolute from here on: run directories live beside the store and must not depend on the cwd.
        self.path = Path(path) if str(path) == ":memory:" else Path(path).expanduser().absolute()
        self._on_disk = str(path) != ":memory:"
        self.location = str(self.path)
        if self._on_disk:
            if self.path.is_dir():
                raise StoreError(f"{self.path} is a folder, not a farm store; give a file path such as {self.path / 'farm.db'}.")
            if not create_folder and not self.path.parent.is_dir():
                missing = next(p for p in reversed([self.path.parent, *self.path.parent.parents]) if not p.is_dir())
                raise StoreError(f"the store {self.path} is in a folder that does not exist ({missing} is missing); "
                                 "farm creates no folders unless asked: check the path for a typo, or add --create "
                                 "(farm.connect(db=..., create=True)) to make them and start an empty store there.")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StoreError(f"cannot create the folder of the store {self.path}: {e.strerror or e}.") from None
            try:
                # Results, job files and agent facts are the lab's business; SQLite gives -wal/-shm the same mode.
                os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            except FileExistsError:
                pass  # an existing store keeps its mode; SQLite says below whether it can be written
            except OSError as e:
                raise StoreError(f"{self.path} cannot be opened for writing ({e.strerror or e}): check that the file "
                                 "and its folder are writable by you, or point --db at another file.") from None
        self._lock = threading.RLock()  # one connection shared by the agent threads
        self._local = threading.local()  # whether this thread is inside a transaction
        self._readers: queue.SimpleQueue[sqlite3.Connection] = queue.SimpleQueue()  # idle reader connections
        try:
            conn = sqlite3.connect(str(self.path), check_same_thread=False, timeout=BUSY_TIMEOUT_S,
                                   isolation_level=None)
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_S * 1000}")
            self.db = sqlite_utils.Database(conn)
            if self._on_disk:
                self.db.enable_wal()
            conn.execute("PRAGMA foreign_keys = ON")
            self._migrate()
        except sqlite3.Error as e:
            raise StoreError(store_error_message(self.path, e)) from None
        self.jobs = SQLiteJobs(self)
        self.leases = SQLiteLeases(self)
        self.runs = SQLiteRuns(self)
        self.devices = SQLiteDevices(self)
        self.calibrations = SQLiteCalibrations(self)
        self.artifacts = SQLiteArtifacts(self)
        self.reads = SQLiteLabReads(self)

    # --- schema ------------------------------------------------------------
    def _migrate(self) -> None:
        # An up-to-date store is only read here, so opening one works while another process writes.
        if up_to_date(self.db):
            return
        with self.transaction():
            migrate(self.db, self.path, upto=PACKED_SAMPLES)
        while True:  # runs stored before migration 15, a batch per transaction: a killed conversion resumes
            with self.transaction():
                if not pack_stored_samples(self.db, PACK_BATCH_RUNS):
                    break
        with self.transaction():
            migrate(self.db, self.path)

    def schema_version(self) -> int:
        return schema_version(self.db)

    def has_table(self, table: str) -> bool:
        return bool(self.query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", [table]))

    def on_queue_change(self, wake: Callable[[], None]) -> None:
        """Nothing to listen to: one controller serves an SQLite store, and wakes its own dispatcher."""

    def sync_normal(self) -> None:
        """WAL + NORMAL survives a killed process intact; only a power cut can drop the last commits, and
        then their tasks re-run when the leases run out. It saves an fsync per lease and per result."""
        with self._lock:
            self.db.conn.execute("PRAGMA synchronous = NORMAL")

    # --- connection and transactions ----------------------------------------
    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One write transaction; inside another one it is a savepoint, so a step of a batch (one result
        of many) that fails undoes only its own writes and the batch still commits once."""
        with self._lock:
            conn = self.db.conn
            if getattr(self._local, "writing", False):
                conn.execute("SAVEPOINT step")  # SQLite nests savepoints of the same name
                try:
                    yield
                except BaseException:
                    conn.execute("ROLLBACK TO step")
                    conn.execute("RELEASE step")
                    raise
                conn.execute("RELEASE step")
                return
            conn.execute("BEGIN IMMEDIATE")
            self._local.writing = True
            try:
                yield
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            finally:
                self._local.writing = False
            conn.execute("COMMIT")

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """Rows of one statement as dicts: the repositories' (and tests') way to read."""
        if not self._on_disk or getattr(self._local, "writing", False):  # a transaction reads its own writes
            with self._lock:
                return _rows(self.db.conn.execute(sql, params))
        try:
            conn = self._readers.get_nowait()
        except queue.Empty:
            conn = self._open_reader()
        try:
            return _rows(conn.execute(sql, params))
        finally:
            self._readers.put(conn)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Cursor:
        """A statement on the writing connection (inside a transaction for a write)."""
        cursor: sqlite3.Cursor = self.db.conn.execute(sql, params)
        return cursor

    def _open_reader(self) -> sqlite3.Connection:
        conn = sqlite3.connect(str(self.path), check_same_thread=False, timeout=30, isolation_level=None)
        conn.execute("PRAGMA busy_timeout = 30000")
        conn.execute("PRAGMA query_only = ON")
        return conn

    def export_rows(self, tables: Sequence[str], batch: int = 1000) -> Iterator[tuple[str, list[dict[str, Any]]]]:
        """Every row of each of `tables`, a batch at a time in insertion order, all from one read snapshot
        (a writer at the same time changes nothing of what is read): `farm store migrate`'s source."""
        known = set(self.db.table_names())
        for table in tables:
            if table not in known:
                raise StoreError(f"{self.path} has no table {table!r}: not a farm store at schema {SCHEMA_VERSION}")
        conn = self._open_reader() if self._on_disk else self.db.conn
        with self._lock if not self._on_disk else _no_lock():
            conn.execute("BEGIN")  # one snapshot for every table (WAL)
            try:
                for table in tables:
                    cursor = conn.execute(f"SELECT * FROM {table} ORDER BY rowid")
                    columns = [c[0] for c in cursor.description]
                    while rows := cursor.fetchmany(batch):
                        yield table, [dict(zip(columns, row)) for row in rows]
            finally:
                conn.execute("ROLLBACK")
                if self._on_disk:
                    conn.close()

    def close(self) -> None:
        with self._lock:
            self.db.conn.close()
        while True:
            try:
                self._readers.get_nowait().close()
            except queue.Empty:
                break

    # Plain statements on the hot path (a result, a lease): sqlite_utils' insert and update read the
    # table's schema on every call, which was most of a result's cost in the scheduling benchmark.
    def insert_row(self, table: str, row: Mapping[str, Any]) -> int:
        sql = f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})"
        row_id = self.db.conn.execute(sql, list(row.values())).lastrowid
        assert row_id is not None  # an INSERT always sets it
        return int(row_id)

    def update_row(self, table: str, pk: int, fields: Mapping[str, Any]) -> None:
        if fields:
            sql = f"UPDATE {table} SET {', '.join(f'{k} = ?' for k in fields)} WHERE id = ?"
            self.db.conn.execute(sql, [*fields.values(), pk])


@contextmanager
def _no_lock() -> Iterator[None]:
    yield


def pack_stored_samples(db: sqlite_utils.Database, runs: int) -> int:
    """Inside a transaction: move up to `runs` runs' samples from the row-per-sample tables (schema < 15) into
    run_samples, packed; returns how many runs moved (0: none left, or the tables are gone)."""
    tables = set(db.table_names())
    if not {"iterations", "telemetry"} <= tables:
        return 0
    run_ids = [int(r[0]) for r in db.execute(
        "SELECT run_id FROM iterations UNION SELECT run_id FROM telemetry ORDER BY run_id LIMIT ?", [runs])]
    if not run_ids:
        return 0
    marks = _marks(run_ids)
    timings: dict[int, list[float | None]] = {run_id: [] for run_id in run_ids}
    for run_id, ms in db.execute(f"SELECT run_id, ms FROM iterations WHERE run_id IN ({marks}) ORDER BY run_id, idx",
                                 run_ids):
        timings[run_id].append(ms)
    samples: dict[int, list[tuple[float | None, float | None, int | None]]] = {run_id: [] for run_id in run_ids}
    for run_id, t_s, cpu, memory in db.execute(
            f"SELECT run_id, t_s, cpu_percent, memory_bytes FROM telemetry WHERE run_id IN ({marks}) "
            "ORDER BY run_id, idx", run_ids):
        samples[run_id].append((t_s, cpu, memory))
    db.conn.executemany(
        "INSERT OR REPLACE INTO run_samples (run_id, iterations, telemetry) VALUES (?, ?, ?)",
        [(run_id, pack_iterations(timings[run_id]) if timings[run_id] else None,
          pack_telemetry(samples[run_id]) if samples[run_id] else None) for run_id in run_ids])
    db.execute(f"DELETE FROM iterations WHERE run_id IN ({marks})", run_ids)
    db.execute(f"DELETE FROM telemetry WHERE run_id IN ({marks})", run_ids)
    return len(run_ids)


class _Repository:
    def __init__(self, store: SQLiteStore) -> None:
        self.store = store

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        return self.store.query(sql, params)

    def _count(self, sql: str, params: Sequence[Any] = ()) -> int:
        """The one number a statement answers (as `n`)."""
        return int(self.store.query(sql, params)[0]["n"] or 0)


class SQLiteJobs(_Repository):
    def insert(self, job: Mapping[str, Any], tasks: Sequence[Mapping[str, Any]]) -> int:
        with self.store.transaction():
            job_id = self.store.insert_row("jobs", job)
            columns = list(dict.fromkeys(["job_id", *(k for t in tasks for k in t)]))  # refused models add a few
            # one statement for every task: a 100,000-task job is inserted in a second or two
            self.store.db.conn.executemany(
                f"INSERT INTO tasks ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                ([job_id if c == "job_id" else t.get(c) for c in columns] for t in tasks))
        return job_id

    def get(self, job_id: int) -> JobRow | None:
        rows = self._query("SELECT * FROM jobs WHERE id = ?", [job_id])
        return JobRow.of(rows[0]) if rows else None

    def update(self, job_id: int, **fields: Any) -> None:
        with self.store.transaction():
            self.store.db.table("jobs").update(job_id, fields)

    def tasks(self, job_id: int) -> list[TaskRow]:
        return [TaskRow.of(r) for r in self._query("SELECT * FROM tasks WHERE job_id = ? ORDER BY seq", [job_id])]

    def task(self, task_id: int) -> TaskRow | None:
        rows = self._query("SELECT * FROM tasks WHERE id = ?", [task_id])
        return TaskRow.of(rows[0]) if rows else None

    def update_task(self, task_id: int, **fields: Any) -> None:
        with self.store.transaction():
            self.store.db.table("tasks").update(task_id, fields)

    def listing(self, limit: int, visible_to: VisibleTo = None) -> list[JobListing]:
        """The newest jobs; with visible_to (owner, team): only the lab's own, that token's and its team's.
        Each row has `counts` (its tasks by status) and their sums tasks/completed/failed: one grouped count."""
        where, params = _visible_jobs(visible_to, "")
        jobs = self._query(
            "SELECT id, name, status, priority, created_at, started_at, finished_at, message, owner_pid, owner_host, "
            f"submitted_by, team FROM jobs {where}ORDER BY id DESC LIMIT ?", [*params, limit])
        counts = self.task_counts_of([j["id"] for j in jobs])
        out = []
        for j in jobs:
            c = counts.get(j["id"], {})
            out.append(JobListing(**j, counts=c, tasks=sum(c.values()), completed=c.get("completed", 0),
                                  failed=c.get("failed", 0)))
        return out

    def of_kind(self, kind: str, statuses: tuple[str, ...]) -> list[int]:
        return [int(r["id"]) for r in self._query(
            f"SELECT id FROM jobs WHERE kind = ? AND status IN ({_marks(statuses)}) ORDER BY id", [kind, *statuses])]

    def earlier_of_kind(self, kind: str, before_job: int) -> list[int]:
        return [int(r["id"]) for r in self._query("SELECT id FROM jobs WHERE kind = ? AND id < ? ORDER BY id",
                                                  [kind, before_job])]

    def task_counts(self, job_id: int) -> dict[str, int]:
        """A job's tasks by status."""
        return self.task_counts_of([job_id]).get(job_id, {})

    def task_counts_of(self, job_ids: list[int]) -> dict[int, dict[str, int]]:
        """Each of these jobs' tasks by status, read from the counts the triggers keep (migration 14)."""
        by_job: dict[int, dict[str, int]] = {}
        for start in range(0, len(job_ids), CHUNK):
            chunk = job_ids[start:start + CHUNK]
            for r in self._query(f"SELECT job_id, status, n FROM job_task_counts WHERE job_id IN ({_marks(chunk)}) "
                                 "AND n > 0", chunk):
                by_job.setdefault(r["job_id"], {})[r["status"]] = r["n"]
        return by_job

    def finished_task_count(self, job_id: int) -> int:
        return self._count("SELECT COUNT(*) AS n FROM tasks WHERE job_id = ? AND status IN "
                           "('completed','failed','canceled')", [job_id])

    def has_open_tasks(self, job_id: int) -> bool:
        # answered from the (job_id, status) index without counting
        return bool(self._count("SELECT EXISTS(SELECT 1 FROM tasks WHERE job_id = ? AND status IN ('pending', "
                                "'running')) AS n", [job_id]))

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

    def completed_with_model(self, sha256: str, threads: int) -> list[JobSpec]:
        """Jobs (id, spec_json), newest first, with a completed run of this model at these threads."""
        return [JobSpec.of(r) for r in self._query(
            "SELECT DISTINCT j.id, j.spec_json FROM jobs j JOIN tasks t ON t.job_id = j.id "
            "WHERE t.model_sha256 = ? AND t.threads = ? AND t.status = 'completed' ORDER BY j.id DESC",
            [sha256, threads])]

    def cancel_pending_tasks(self, job_id: int, message: str, now: float) -> int:
        with self.store.transaction():
            return self.store.execute(
                "UPDATE tasks SET status = ?, failure_class = ?, message = ?, finished_at = ? WHERE job_id = ? AND status = ?",
                [TaskStatus.CANCELED.value, FailureClass.CANCELED.value, message, now, job_id,
                 TaskStatus.PENDING.value]).rowcount

    def requeue_interrupted_tasks(self, job_id: int, since: float, message: str) -> int:
        """A job's unstarted tasks and those canceled since `since` (stopped by Ctrl+C) wait again."""
        with self.store.transaction():
            return self.store.execute(
                "UPDATE tasks SET status = ?, leased_by = NULL, failure_class = NULL, finished_at = NULL, message = ? "
                "WHERE job_id = ? AND (status IN (?, ?) OR (status = ? AND finished_at >= ?))",
                [TaskStatus.PENDING.value, message, job_id, TaskStatus.PENDING.value, TaskStatus.RUNNING.value,
                 TaskStatus.CANCELED.value, since]).rowcount

    def requeue_tasks(self, job_id: int, statuses: Collection[str], message: str, more_attempts: int) -> int:
        """`farm retry`: a job's tasks in `statuses` wait again, as new attempts of the same tasks (each earlier
        attempt stays a run); each gets `more_attempts` attempts beyond those it has used."""
        statuses = sorted(statuses)
        if not statuses:
            return 0
        with self.store.transaction():
            return self.store.execute(
                "UPDATE tasks SET status = ?, leased_by = NULL, lease_expires_at = NULL, failure_class = NULL, "
                f"finished_at = NULL, message = ?, max_attempts = attempts + ? WHERE job_id = ? AND status IN "
                f"({_marks(statuses)})", [TaskStatus.PENDING.value, message, more_attempts, job_id, *statuses]).rowcount

    def past_deadline(self, now: float) -> list[int]:
        """Unfinished jobs whose deadline (timeouts.job) is before `now`."""
        return [int(r["id"]) for r in self._query(
            "SELECT id FROM jobs WHERE deadline_at < ? AND status IN ('queued', 'running', 'interrupted') ORDER BY id",
            [now])]

    def fail_waiting_tasks(self, device: str, message: str, now: float, *, job_id: int | None = None) -> list[int]:
        """Fail the device's pending tasks (infrastructure); returns the job of each."""
        where = "target = ? AND status = 'pending'"
        params: list[Any] = [device]
        if job_id is not None:
            where += " AND job_id = ?"
            params.append(job_id)
        with self.store.transaction():
            jobs = [int(r[0]) for r in self.store.execute(f"SELECT job_id FROM tasks WHERE {where}", params)]
            self.store.execute(f"UPDATE tasks SET status = 'failed', failure_class = 'infrastructure', finished_at = ?, "
                               f"message = ? WHERE {where}", [now, message, *params])
        return jobs


class SQLiteLeases(_Repository):
    def next_pending(self, targets: Collection[str], limit: int, *, job_id: int | None = None) -> list[TaskRow]:
        """The first `limit` leasable tasks for any of `targets`, in lease order (priority, job, seq).

        One walk of the (status, target, priority, job_id, seq) index per target, merged here: the
        cost stays flat with queue depth, even when other devices' backlogs come first."""
        where = f"t.status = 'pending' AND t.target = ? AND j.status IN ('queued', 'running') {HEALTHY_TARGET}"
        if job_id is not None:
            where += " AND t.job_id = ?"
        rows: list[TaskRow] = []
        for target in sorted(targets):
            cursor = self.store.execute(
                f"SELECT t.* FROM tasks t JOIN jobs j ON j.id = t.job_id WHERE {where} "
                "ORDER BY t.priority, t.job_id, t.seq LIMIT ?", [target, *([job_id] if job_id is not None else []), limit])
            rows += [TaskRow.of(r) for r in _rows(cursor)]
        rows.sort(key=lambda t: (t.priority, t.job_id, t.seq))
        return rows[:limit]

    def lease(self, task_id: int, attempt: int, agent: str, expires_at: float) -> None:
        self.store.execute("UPDATE tasks SET status = ?, attempts = ?, leased_by = ?, lease_expires_at = ? WHERE id = ?",
                           [TaskStatus.RUNNING.value, attempt, agent, expires_at, task_id])

    def start_job(self, job_id: int, now: float) -> None:
        """A queued job is running from its first lease on."""
        self.store.execute("UPDATE jobs SET status = 'running', started_at = ? WHERE id = ? AND status = 'queued'",
                           [now, job_id])

    def state(self, task_id: int) -> LeaseState | None:
        """(task status, attempts, lease_expires_at, job status, leased_by) of a task."""
        row = self.store.execute(
            "SELECT t.status, t.attempts, t.lease_expires_at, j.status, t.leased_by FROM tasks t "
            "JOIN jobs j ON j.id = t.job_id WHERE t.id = ?", [task_id]).fetchone()
        return None if row is None else LeaseState(*row)

    def renew(self, task_id: int, expires_at: float) -> None:
        with self.store.transaction():
            self.store.execute("UPDATE tasks SET lease_expires_at = ? WHERE id = ?", [expires_at, task_id])

    def running_attempts(self, *, job_id: int | None = None, agent: str | None = None,
                         expired_before: float | None = None,
                         task_ids: list[int] | None = None) -> list[RunningAttempt]:
        """Running tasks (id, job_id, attempts, max_attempts, leased_by) matching every filter given."""
        where, params = ["status = 'running'"], []
        for clause, value in (("job_id = ?", job_id), ("leased_by = ?", agent), ("lease_expires_at < ?", expired_before)):
            if value is not None:
                where.append(clause)
                params.append(value)
        if task_ids is not None:
            where.append(f"id IN ({_marks(task_ids)})")
            params += task_ids
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
                # only while the attempt is still the one running: a stale list must not reopen a settled task
                current = self.store.execute("SELECT status, attempts FROM tasks WHERE id = ?", [t.id]).fetchone()
                if current is None or tuple(current) != (TaskStatus.RUNNING.value, t.attempts):
                    continue
                message = reason.format(agent=t.leased_by or "(none)")
                inserted = self.store.execute(
                    "INSERT OR IGNORE INTO runs (task_id, job_id, attempt, status, failure_class, message, agent, "
                    "finished_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [t.id, t.job_id, t.attempts, RunStatus.FAILED.value, FailureClass.INFRASTRUCTURE.value, message,
                     t.leased_by, now])
                # an ignored insert leaves lastrowid at the connection's previous insert: look the attempt's run up
                run_id = inserted.lastrowid if inserted.rowcount == 1 else None
                if run_id is None:
                    found = self.store.execute("SELECT id FROM runs WHERE task_id = ? AND attempt = ?",
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
            self.store.execute("UPDATE jobs SET owner_pid = ?, owner_host = ? WHERE status IN ('queued', 'running')",
                               [pid, host])
            self.store.execute("UPDATE tasks SET lease_expires_at = ? WHERE status = 'running'", [lease_expires_at])
            self.store.execute("UPDATE agents SET state = 'offline'" + stale, since)
            self.store.execute("UPDATE devices SET state = 'offline'" + stale, since)


class SQLiteRuns(_Repository):
    def record(self, task: TaskRow, attempt: int, agent: str, started_at: float, result: RunResult,
               task_fields: Mapping[str, Any]) -> int | None:
        """Store a run with its samples and update its task, atomically.

        Returns the run id, or None when this agent already delivered this same result. Raises
        ResultRefused, storing nothing, unless the attempt is running and leased to `agent`.
        """
        store = self.store
        with store.transaction():
            existing = store.execute(
                "SELECT agent, status, message FROM runs WHERE task_id = ? AND attempt = ?", [task.id, attempt]).fetchone()
            if existing:
                if existing == (agent, result.status.value, result.message):
                    return None  # delivered twice (the first ack was lost): applied once
                raise ResultRefused(f"attempt {attempt} of task {task.id} is already stored: {existing[2]}")
            self._check_lease(task.id, attempt, agent)
            limits = result.limits
            run_id = store.insert_row("runs", {
                "task_id": task.id, "job_id": task.job_id, "attempt": attempt,
                "status": result.status.value,
                "failure_class": result.failure_class.value if result.failure_class else None,
                "message": result.message, "agent": agent, "started_at": started_at,
                "finished_at": time.time(), "backend": result.backend,
                "approximate": int(result.approximate), "limits_cpus": limits.cpus,
                "limits_cpuset": limits.cpuset, "limits_memory_mb": limits.memory_mb,
                "wall_s": result.wall_s, "whole_run_s": result.whole_run_s,
                "environment_json": json.dumps(result.stored_environment()),
                "tool_versions_json": json.dumps(result.tool_versions), "log_tail": result.log_tail,
                "contended": None if result.contention is None else int(result.contention.contended),
                "contention_json": None if result.contention is None else json.dumps(dataclasses.asdict(result.contention)),
            })
            self._insert_summary(run_id, result)
            self._insert_op_profile(run_id, result)
            samples = result.telemetry.samples if result.telemetry else []
            if result.iterations_ms or samples:  # packed: one row per run, 8 bytes a timing (samples.py)
                store.insert_row("run_samples", {
                    "run_id": run_id,
                    "iterations": pack_iterations(result.iterations_ms) if result.iterations_ms else None,
                    "telemetry": pack_telemetry((s.t_s, s.cpu_percent, s.memory_bytes) for s in samples) if samples
                    else None})
            store.update_row("tasks", task.id, {**task_fields, "last_run_id": run_id})
        return run_id

    def _check_lease(self, task_id: int, attempt: int, agent: str) -> None:
        row = self.store.execute("SELECT status, attempts, leased_by FROM tasks WHERE id = ?", [task_id]).fetchone()
        if row is None:
            raise ResultRefused(f"there is no task {task_id}")
        status, attempts, leased_by = row
        if status != TaskStatus.RUNNING.value:
            raise ResultRefused(f"task {task_id} is {status}: attempt {attempt} holds no lease")
        if attempts != attempt:
            raise ResultRefused(f"attempt {attempt} of task {task_id} is not the current one (attempt {attempts})")
        if leased_by != agent:
            raise ResultRefused(f"task {task_id} attempt {attempt} is not leased to agent {agent}")

    def _insert_summary(self, run_id: int, r: RunResult) -> None:
        row: dict[str, Any] = {"run_id": run_id, "baseline_memory_bytes": r.baseline_memory_bytes,
                               "peak_rss_bytes": r.peak_rss_bytes, "throughput_per_s": r.throughput_per_s,
                               "startup_ms": r.startup_ms}
        if r.latency:
            lat = r.latency
            row.update({
                "latency_init_ms": lat.init, "latency_first_ms": lat.first,
                "latency_warmup_avg_ms": lat.warmup_avg, "latency_avg_ms": lat.avg,
                "latency_p50_ms": lat.p50, "latency_p90_ms": lat.p90, "latency_p99_ms": lat.p99,
                "latency_std_ms": lat.std, "latency_min_ms": lat.min, "latency_max_ms": lat.max,
                "latency_count": lat.count,
            })
        if r.telemetry:
            t = r.telemetry
            row.update({
                "peak_memory_bytes": t.memory_peak_bytes, "peak_memory_source": t.memory_peak_source,
                "avg_memory_bytes": t.memory_avg_bytes, "cpu_avg_percent": t.cpu_avg_percent,
                "cpu_peak_percent": t.cpu_peak_percent, "block_read_bytes": t.block_read_bytes,
                "block_write_bytes": t.block_write_bytes, "net_rx_bytes": t.net_rx_bytes,
                "net_tx_bytes": t.net_tx_bytes, "sampler_cpu_percent": t.sampler_cpu_percent,
                "sample_interval_ms": t.interval_ms, "sample_count": len(t.samples),
            })
        self.store.insert_row("summaries", row)

    def _insert_op_profile(self, run_id: int, r: RunResult) -> None:
        """Inside record's transaction: the run's op profile, bounded and cleaned again (it came over the wire)."""
        rows = op_profile.bounded(r.op_profile)
        if rows:
            self.store.db.conn.executemany(
                "INSERT INTO op_profiles (run_id, idx, kind, node_type, name, avg_ms, percent, first_ms, count, "
                "times_called, mem_kb) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                ((run_id, i, o.kind, o.node_type, o.name, o.avg_ms, o.percent, o.first_ms, o.count, o.times_called,
                  o.mem_kb) for i, o in enumerate(rows)))

    def iterations(self, run_id: int) -> list[float]:
        rows = self._query("SELECT iterations FROM run_samples WHERE run_id = ?", [run_id])
        return unpack_iterations(rows[0]["iterations"]) if rows and rows[0]["iterations"] else []

    def telemetry(self, run_id: int) -> list[TelemetrySample]:
        rows = self._query("SELECT telemetry FROM run_samples WHERE run_id = ?", [run_id])
        return unpack_telemetry(rows[0]["telemetry"]) if rows and rows[0]["telemetry"] else []

    def results(self, job_id: int) -> list[ResultRow]:
        """Every task of a job with its counted run and summary (None columns for a task not run)."""
        return [ResultRow.of(r) for r in self._query(
            "SELECT t.id AS task, t.job_id AS job, t.model_name, t.model_sha256, t.model_family, t.model_path, "
            "t.target, t.threads, t.batch_size, t.input_size, t.repeat, t.status AS task_status, "
            "t.attempts, t.pair_key, t.failure_class AS task_failure_class, t.message AS task_message, "
            "t.model_size_bytes, t.model_param_count, t.model_facts_json, t.spec_json AS task_spec_json, "
            "r.id AS run_id, r.attempt, r.status AS run_status, r.failure_class, r.message, r.backend, "
            "r.approximate, r.limits_cpus, r.limits_cpuset, r.limits_memory_mb, r.wall_s, r.whole_run_s, "
            "r.started_at, r.finished_at, r.tool_versions_json, r.environment_json, r.contention_json, "
            "s.latency_init_ms, s.latency_first_ms, s.latency_warmup_avg_ms, s.latency_avg_ms, s.latency_p50_ms, "
            "s.latency_p90_ms, s.latency_p99_ms, s.latency_std_ms, s.latency_min_ms, s.latency_max_ms, "
            "s.latency_count, s.peak_memory_bytes, s.peak_memory_source, s.avg_memory_bytes, s.baseline_memory_bytes, "
            "s.peak_rss_bytes, s.cpu_avg_percent, s.cpu_peak_percent, s.block_read_bytes, s.block_write_bytes, "
            "s.net_rx_bytes, s.net_tx_bytes, s.sampler_cpu_percent, s.sample_interval_ms, s.sample_count, "
            "s.throughput_per_s, s.startup_ms "
            "FROM tasks t LEFT JOIN runs r ON r.id = t.last_run_id LEFT JOIN summaries s ON s.run_id = r.id "
            "WHERE t.job_id = ? ORDER BY t.model_name, t.threads, t.batch_size, t.input_size, t.repeat, t.target, t.seq",
            [job_id])]

    def op_profiles(self, run_ids: list[int]) -> dict[int, list[OpProfileRow]]:
        """Each run's op profile rows (op types, then nodes; slowest first), by run id."""
        found: dict[int, list[OpProfileRow]] = {run_id: [] for run_id in run_ids}
        for start in range(0, len(run_ids), CHUNK):
            chunk = run_ids[start:start + CHUNK]
            for row in self._query(
                    "SELECT run_id, kind, node_type, name, avg_ms, percent, first_ms, count, times_called, mem_kb "
                    f"FROM op_profiles WHERE run_id IN ({_marks(chunk)}) ORDER BY run_id, idx", chunk):
                run_id = row.pop("run_id")
                found[run_id].append(OpProfileRow.of(row))
        return found

    def contended_runs(self, task_id: int) -> int:
        return self._count("SELECT COUNT(*) AS n FROM runs WHERE task_id = ? AND contended = 1", [task_id])

    def device_latencies(self, job_id: int, device: str) -> list[DeviceLatency]:
        """(model_sha256, model_name, threads, latency_avg_ms) of a job's completed runs on `device`."""
        return [DeviceLatency.of(r) for r in self._query(
            "SELECT t.model_sha256, t.model_name, t.threads, s.latency_avg_ms FROM tasks t "
            "JOIN runs r ON r.id = t.last_run_id JOIN summaries s ON s.run_id = r.id "
            "WHERE t.job_id = ? AND t.target = ? AND t.status = 'completed'", [job_id, device])]


class SQLiteDevices(_Repository):
    def record_agent(self, agent: Mapping[str, Any], devices: Sequence[DeviceRecord]) -> None:
        """Upsert an agent and its devices, one statement for every device: registration stays linear in their
        number."""
        with self.store.transaction():
            self.store.db.table("agents").upsert(dict(agent), pk="name")
            self.store.db.conn.executemany(
                "INSERT INTO devices (name, agent, driver, device_type, tags_json, facts_json, slots, state, last_seen) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET agent = excluded.agent, "
                "driver = excluded.driver, device_type = excluded.device_type, tags_json = excluded.tags_json, "
                "facts_json = excluded.facts_json, slots = excluded.slots, state = excluded.state, "
                "last_seen = excluded.last_seen", devices)

    def agents(self) -> list[AgentRow]:
        return [AgentRow.of(r) for r in self._query("SELECT * FROM agents ORDER BY name")]

    def all(self, *, sim: bool = True) -> list[DeviceRow]:
        """Registered devices, sim slots left out unless asked."""
        return [DeviceRow.of(r) for r in self._query(
            "SELECT * FROM devices" + ("" if sim else " WHERE driver != 'sim'") + " ORDER BY name")]

    def owners(self, names: Sequence[str] | None = None) -> dict[str, str]:
        if names is None:
            return {r["name"]: r["agent"] for r in self._query("SELECT name, agent FROM devices")}
        found: dict[str, str] = {}
        for start in range(0, len(names), CHUNK):
            chunk = list(names[start:start + CHUNK])
            found.update((r["name"], r["agent"]) for r in self._query(
                f"SELECT name, agent FROM devices WHERE name IN ({_marks(chunk)})", chunk))
        return found

    def keep_alive(self, agents: Sequence[str], now: float, stale_before: float) -> None:
        """The agents connected here (and their devices) were seen `now`; any other agent or device still shown
        connected but not seen since `stale_before` is offline (its controller died)."""
        with self.store.transaction():
            for start in range(0, len(agents), CHUNK):
                chunk = list(agents[start:start + CHUNK])
                self.store.execute(f"UPDATE agents SET last_seen = ? WHERE name IN ({_marks(chunk)})", [now, *chunk])
                self.store.execute(f"UPDATE devices SET last_seen = ? WHERE agent IN ({_marks(chunk)})", [now, *chunk])
            for table in ("agents", "devices"):
                self.store.execute(f"UPDATE {table} SET state = 'offline' WHERE state != 'offline' "
                                   "AND (last_seen IS NULL OR last_seen < ?)", [stale_before])

    def device_type(self, device: str) -> str | None:
        rows = self._query("SELECT device_type FROM devices WHERE name = ?", [device])
        return rows[0]["device_type"] if rows else None

    def forget(self, name: str) -> None:
        with self.store.transaction():
            self.store.execute("DELETE FROM devices WHERE name = ?", [name])

    def set_health(self, device: str, health: str, reason: str, now: float) -> None:
        with self.store.transaction():
            self.store.execute(
                "INSERT INTO device_health (name, health, reason, changed_at) VALUES (?, ?, ?, ?) ON CONFLICT(name) "
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
            "AND name IN (SELECT target FROM tasks WHERE job_id = ?)", [job_id])]

    def last_reference_checks(self, health_check_kind: str) -> dict[str, float]:
        """device -> when its last health check (a job of that kind) completed on it, in Unix time."""
        return {r["target"]: r["at"] for r in self._query(
            "SELECT t.target, MAX(t.finished_at) AS at FROM tasks t JOIN jobs j ON j.id = t.job_id "
            "WHERE j.kind = ? AND t.target != 'sim' AND t.status = 'completed' GROUP BY t.target", [health_check_kind])}


class SQLiteCalibrations(_Repository):
    def completed_values(self, job_id: int, metric: str, *, include_contended: bool,
                         target: str | None = None) -> list[MeasuredRow]:
        """A metric of every completed run of a job (the attempt that counted), with its model's facts;
        only one target's runs (the sim or one device) when given."""
        value = metric_sql(metric, "s", "r")
        quiet = "" if include_contended else " AND COALESCE(r.contended, 0) = 0"
        quiet += "" if target is None else " AND t.target = ?"
        return [MeasuredRow.of(r) for r in self._query(
            f"SELECT t.model_name, t.model_sha256, t.model_family, t.threads, t.batch_size, t.input_size, t.repeat, "
            f"t.model_size_bytes, t.model_param_count, t.model_facts_json, r.id AS run_id, r.environment_json, "
            f"{value} AS value FROM tasks t JOIN runs r ON r.id = t.last_run_id JOIN summaries s ON s.run_id = r.id "
            f"WHERE t.job_id = ? AND t.status = 'completed'{quiet}", [job_id] + ([] if target is None else [target]))]

    def paired_values(self, job_id: int, device: str, sim_metric: str, device_metric: str, *,
                      include_contended: bool) -> list[PairedRow]:
        """A job's completed device runs beside their completed sim twins (same pair key): x is `sim_metric` of the
        sim run, y is `device_metric` of the device run."""
        x, y = metric_sql(sim_metric, "ss", "rs"), metric_sql(device_metric, "sd", "rd")
        quiet = "" if include_contended else " AND COALESCE(rs.contended, 0) = 0"
        return [PairedRow.of(r) for r in self._query(
            f"SELECT d.model_name, d.model_family, d.threads, d.batch_size, d.input_size, d.model_size_bytes, "
            f"d.model_param_count, d.model_facts_json, rs.id AS sim_run, rd.id AS device_run, rs.environment_json, "
            f"rd.environment_json AS device_environment, ({x}) AS x, ({y}) AS y "
            f"FROM tasks d JOIN tasks t ON t.job_id = d.job_id AND t.pair_key = d.pair_key AND t.target = 'sim' "
            f"JOIN runs rd ON rd.id = d.last_run_id JOIN summaries sd ON sd.run_id = rd.id "
            f"JOIN runs rs ON rs.id = t.last_run_id JOIN summaries ss ON ss.run_id = rs.id "
            f"WHERE d.job_id = ? AND d.target = ? AND d.status = 'completed' AND t.status = 'completed'{quiet}",
            [job_id, device])]

    def contended_completed_runs(self, job_ids: list[int]) -> int:
        """Completed runs of these jobs whose sim run was contended."""
        if not job_ids:
            return 0
        return self._count(
            f"SELECT COUNT(*) AS n FROM tasks t JOIN runs r ON r.id = t.last_run_id WHERE t.job_id IN ({_marks(job_ids)}) "
            "AND t.status = 'completed' AND r.contended = 1", list(job_ids))

    def add(self, row: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
        """Store a calibration as the next version of its key, with the runs it was fitted on; (id, version)."""
        with self.store.transaction():
            version = int(self.store.execute(
                "SELECT COALESCE(MAX(version), 0) + 1 FROM calibrations WHERE device = ? AND metric = ? AND threads = ? "
                "AND runtime = ? AND batch_size IS ? AND input_size IS ? AND precision = ? AND family = ?",
                [row["device"], row["metric"], row["threads"], row["runtime"], row["batch_size"], row["input_size"],
                 row["precision"], row["family"]]).fetchone()[0])
            cal_id = self.store.insert_row("calibrations", {**row, "version": version})
            # a few dozen rows off the hot path: sqlite_utils' bulk insert (the tasks of a job use executemany,
            # about twice as fast for 50,000 rows as insert_all, measured side by side)
            self.store.db.table("calibration_runs").insert_all({"calibration_id": cal_id, **run} for run in runs)
        return cal_id, version

    def fits(self, metric: str, threads: int, runtime: str, batch_size: int | None, input_size: int | None,
             precision: str, family: str) -> list[CalibrationFit]:
        """(device, version, fit_json) of every calibration of this key, newest first."""
        return [CalibrationFit.of(r) for r in self._query(
            "SELECT device, version, fit_json FROM calibrations WHERE metric = ? AND threads = ? AND runtime = ? "
            "AND batch_size IS ? AND input_size IS ? AND precision = ? AND family = ? ORDER BY id DESC",
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
        return [CalibrationRow.of(r) for r in self._query(
            sql + " ORDER BY device, metric, threads, runtime, batch_size, input_size, precision, family, version",
            params)]

    def get(self, calibration_id: int) -> CalibrationRow | None:
        rows = self._query("SELECT * FROM calibrations WHERE id = ?", [calibration_id])
        return CalibrationRow.of(rows[0]) if rows else None

    def versions(self, calibration_id: int) -> list[CalibrationRow]:
        """Every version of the calibration key that `calibration_id` belongs to, oldest first."""
        return [CalibrationRow.of(r) for r in self._query(
            "SELECT c.* FROM calibrations c JOIN calibrations k ON k.id = ? AND c.device = k.device "
            "AND c.metric = k.metric AND c.threads = k.threads AND c.runtime = k.runtime AND c.batch_size IS k.batch_size "
            "AND c.input_size IS k.input_size AND c.precision IS k.precision AND c.family = k.family ORDER BY c.version",
            [calibration_id])]

    def latest(self) -> list[LatestCalibration]:
        """The newest version of every calibration key, with how many versions it has."""
        return [LatestCalibration.of(r) for r in self._query(
            "SELECT c.id, c.device, c.metric, c.threads, c.runtime, c.batch_size, c.input_size, c.precision, c.family, "
            "c.version, c.created_at, c.kind, c.n, c.r2, c.loo_mape, c.kendall_tau, c.spearman_rho, c.fit_json, c.source, "
            "g.versions FROM calibrations c JOIN (SELECT MAX(id) AS id, COUNT(*) AS versions FROM calibrations "
            "GROUP BY device, metric, threads, runtime, batch_size, input_size, precision, family) g ON g.id = c.id "
            "ORDER BY c.device, c.metric, c.threads, c.runtime, c.batch_size, c.input_size, c.precision, c.family")]

    def newest(self, device: str, metric: str, threads: int, family: str, *, runtime: str | None,
               batch_size: int | None, input_size: int | None, precision: str | None) -> CalibrationRow | None:
        """The newest calibration of the key; None filters match any. A board's calibrations are also keyed by
        its power mode ("litert@nvpmodel=MAXN;..."): a plain runtime matches each of them."""
        sql = "SELECT * FROM calibrations WHERE device = ? AND metric = ? AND threads = ? AND family = ?"
        params: list[Any] = [device, metric, threads, family]
        for column, value in (("batch_size", batch_size), ("input_size", input_size), ("precision", precision)):
            if value is not None:
                sql += f" AND {column} = ?"
                params.append(value)
        if runtime is not None:
            sql += " AND (runtime = ? OR runtime LIKE ?)"
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
            "SELECT device, MAX(created_at) AS at FROM calibrations GROUP BY device")}

    def newest_at(self, device: str) -> float | None:
        at = self._query("SELECT MAX(created_at) AS at FROM calibrations WHERE device = ?", [device])[0]["at"]
        return None if at is None else float(at)

    def using_job(self, job_id: int) -> list[CalibrationRow]:
        """Every stored calibration version fitted on this job's runs (either side), oldest version first."""
        return [CalibrationRow.of(r) for r in self._query(
            "SELECT c.* FROM calibrations c WHERE c.id IN ("
            " SELECT cr.calibration_id FROM calibration_runs cr JOIN runs r"
            " ON r.id = cr.sim_run_id OR r.id = cr.device_run_id WHERE r.job_id = ?)"
            " ORDER BY c.device, c.metric, c.threads, c.family, c.version", [job_id])]

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
            "WHERE d.rowid = (SELECT e.rowid FROM calibration_drift e WHERE e.device = d.device AND e.metric = d.metric "
            "AND e.threads IS d.threads ORDER BY e.created_at DESC, e.rowid DESC LIMIT 1) "
            "ORDER BY d.device, d.metric, d.threads")]


class SQLiteArtifacts(_Repository):
    def record_upload(self, sha256: str, owner: str, size: int, at: float) -> None:
        with self.store.transaction():
            self.store.execute("INSERT OR IGNORE INTO artifact_uploads (sha256, owner, size, at) VALUES (?, ?, ?, ?)",
                               [sha256, owner, size, at])

    def upload_usage(self, owner: str) -> int:
        """Bytes of the artifacts this token uploaded that are still stored."""
        return self._count("SELECT COALESCE(SUM(size), 0) AS n FROM artifact_uploads WHERE owner = ?", [owner])

    def forget_uploads(self, hashes: list[str]) -> None:
        with self.store.transaction():
            self.store.db.conn.executemany("DELETE FROM artifact_uploads WHERE sha256 = ?", [[h] for h in hashes])

    def referenced(self) -> set[str]:
        """The sha256 of every model and packed script folder some job's task names (what gc must keep)."""
        rows = self._query("SELECT DISTINCT model_sha256 AS sha FROM tasks WHERE model_sha256 IS NOT NULL "
                           "UNION SELECT DISTINCT json_extract(spec_json, '$.script_archive') FROM tasks "
                           "WHERE json_extract(spec_json, '$.script_archive') IS NOT NULL")
        return {str(r["sha"]) for r in rows}


class SQLiteLabReads(_Repository):
    def devices(self) -> list[LabDevice]:
        """Every device the lab knows (registered by an agent, or only judged healthy/bad), with its health."""
        return [LabDevice.of(r) for r in self._query(
            "SELECT d.name, d.agent, d.driver, d.device_type, d.tags_json, d.slots, d.state, d.last_seen, "
            "h.health, h.reason, h.changed_at FROM devices d LEFT JOIN device_health h ON h.name = d.name "
            "UNION ALL SELECT h.name, NULL, NULL, NULL, NULL, NULL, NULL, NULL, h.health, h.reason, h.changed_at "
            "FROM device_health h WHERE h.name NOT IN (SELECT name FROM devices) ORDER BY 1")]

    def agents(self) -> list[AgentRow]:
        return self.store.devices.agents()

    def running_tasks(self) -> list[RunningTask]:
        return [RunningTask.of(r) for r in self._query(
            "SELECT id, job_id, target, model_name, threads, repeat, attempts, leased_by FROM tasks "
            "WHERE status = 'running' ORDER BY id")]

    def queue(self) -> list[QueuedWork]:
        """Pending tasks per target and job, in lease order (priority, then job)."""
        return [QueuedWork.of(r) for r in self._query(
            "SELECT target, job_id, MIN(priority) AS priority, COUNT(*) AS pending FROM tasks "
            "WHERE status = 'pending' GROUP BY target, job_id ORDER BY MIN(priority), job_id, target")]

    def jobs(self, limit: int, visible_to: VisibleTo = None) -> list[DashboardJob]:
        """The newest jobs, each with its task counts per status (one grouped query, not one per job)."""
        where, params = _visible_jobs(visible_to, "")
        jobs = self._query("SELECT id, name, kind, status, priority, created_at, started_at, finished_at, message "
                           f"FROM jobs {where}ORDER BY id DESC LIMIT ?", [*params, limit])
        counts = self.store.jobs.task_counts_of([j["id"] for j in jobs])
        return [DashboardJob(**j, counts=counts.get(j["id"], {})) for j in jobs]

    def job_count(self, visible_to: VisibleTo = None) -> int:
        where, params = _visible_jobs(visible_to, "")
        return self._count(f"SELECT COUNT(*) AS n FROM jobs {where}", params)

    def pending_by_priority(self) -> dict[int, int]:
        return {r["priority"]: r["n"] for r in self._query(
            "SELECT priority, COUNT(*) AS n FROM tasks WHERE status = 'pending' GROUP BY priority")}

    def tasks_by_status(self) -> dict[str, int]:
        return {str(r["status"]): r["n"] for r in self._query("SELECT status, COUNT(*) AS n FROM tasks GROUP BY status")}

    # --- the job page's evidence behind a failure, and the lab page's panels ---------------------
    def log_tails(self, run_ids: Sequence[int]) -> dict[int, str]:
        """Each failed run's kept output (the sandbox's last lines), by run id; runs without one left out."""
        found: dict[int, str] = {}
        for start in range(0, len(run_ids), 500):  # SQLite's bound on ? parameters
            chunk = list(run_ids[start:start + 500])
            marks = ",".join("?" * len(chunk))
            for row in self._query(f"SELECT id, log_tail FROM runs WHERE id IN ({marks}) AND log_tail IS NOT NULL "
                                   "AND log_tail != ''", chunk):
                found[int(row["id"])] = str(row["log_tail"])
        return found

    def recent_failures(self, limit: int) -> list[dict[str, Any]]:
        """The newest failed runs (not cancellations), each with its task's target and model."""
        return self._query(
            "SELECT r.id AS run_id, r.job_id, r.task_id, r.attempt, r.failure_class, r.message, r.finished_at, "
            "r.limits_memory_mb, t.target, t.model_name FROM runs r JOIN tasks t ON t.id = r.task_id "
            "WHERE r.status = 'failed' AND r.failure_class IS NOT NULL AND r.failure_class != 'canceled' "
            "ORDER BY r.id DESC LIMIT ?", [limit])

    def drift_alerts(self, limit: int) -> list[dict[str, Any]]:
        """The newest refreshes whose drift exceeded a threshold."""
        return self._query("SELECT * FROM calibration_drift WHERE exceeded = 1 ORDER BY id DESC LIMIT ?", [limit])

    def earlier_attempts(self, job_id: int) -> dict[int, list[dict[str, Any]]]:
        """Each task's runs before its counted one (why it was run again: contention or a lost attempt), by task."""
        found: dict[int, list[dict[str, Any]]] = {}
        for row in self._query("SELECT r.task_id, r.attempt, r.status, r.failure_class, r.contended FROM runs r "
                               "JOIN tasks t ON t.id = r.task_id WHERE r.job_id = ? AND r.id != t.last_run_id "
                               "ORDER BY r.task_id, r.attempt", [job_id]):
            found.setdefault(int(row.pop("task_id")), []).append(row)
        return found
