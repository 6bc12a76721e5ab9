"""The SQLite store: jobs, tasks, runs, summaries, per-iteration and telemetry samples.

WAL mode, a schema version with ordered migrations, and one transaction per finished run,
so a crash mid-job loses nothing already measured. Several processes may open the same
file (`farm cancel` while `farm submit` runs); busy_timeout makes them take turns.
One connection writes; queries outside a transaction use reader connections of their own,
so a long write (a run with a million samples) never makes a listing wait (WAL readers see
the last commit). The file is created readable by its owner only.
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
from typing import TYPE_CHECKING, Any, Callable, Iterator


def _sqlite_utils_without_numpy() -> Any:
    """sqlite_utils imports numpy and pandas when installed, only to name their scalar types' columns when it
    guesses a schema; the store never hands it either, and `farm jobs` should not load them (~0.1 s)."""
    import importlib
    import sys

    hidden = [name for name in ("numpy", "pandas") if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # import fails: sqlite_utils skips them
    try:
        return importlib.import_module("sqlite_utils")
    finally:
        for name in hidden:
            if sys.modules.get(name, "") is None:
                del sys.modules[name]


if TYPE_CHECKING:
    import sqlite_utils
else:
    sqlite_utils = _sqlite_utils_without_numpy()

from farm.proto import op_profile
from farm.proto.results import FailureClass, ResultRefused, RunResult, RunStatus, TaskStatus

DB_ENV = "FARM_DB"


def default_db_path() -> Path:
    if os.environ.get(DB_ENV):
        return Path(os.environ[DB_ENV])
    from platformdirs import user_data_dir
    return Path(user_data_dir("farm", appauthor=False)) / "farm.db"


def _migration_1(db: sqlite_utils.Database) -> None:
    db.table("jobs").create({
        "id": int, "name": str, "status": str, "priority": str, "created_at": float,
        "started_at": float, "finished_at": float, "spec_json": str, "spec_yaml": str,
        "source_path": str, "base_dir": str, "owner_pid": int, "owner_host": str, "message": str,
    }, pk="id")
    db.table("tasks").create({
        "id": int, "job_id": int, "seq": int, "target": str, "model_name": str, "model_path": str,
        "model_sha256": str, "model_family": str, "model_facts_json": str, "threads": int,
        "batch_size": int, "input_size": int, "repeat": int, "status": str, "attempts": int,
        "max_attempts": int, "pair_key": str, "spec_json": str, "leased_by": str,
        "lease_expires_at": float, "priority": int, "created_at": float, "finished_at": float,
        "last_run_id": int, "failure_class": str, "message": str,
    }, pk="id", foreign_keys=[("job_id", "jobs", "id")])
    db.table("tasks").create_index(["job_id", "seq"], unique=True)
    db.table("tasks").create_index(["status", "priority", "id"])
    db.table("runs").create({
        "id": int, "task_id": int, "job_id": int, "attempt": int, "status": str,
        "failure_class": str, "message": str, "agent": str, "started_at": float,
        "finished_at": float, "backend": str, "approximate": int, "limits_cpus": float,
        "limits_cpuset": str, "limits_memory_mb": float, "wall_s": float, "whole_run_s": float,
        "environment_json": str, "tool_versions_json": str, "log_tail": str,
    }, pk="id", foreign_keys=[("task_id", "tasks", "id"), ("job_id", "jobs", "id")])
    # A result delivered twice is applied once.
    db.table("runs").create_index(["task_id", "attempt"], unique=True)
    db.table("runs").create_index(["job_id"])
    db.table("summaries").create({
        "run_id": int, "latency_init_ms": float, "latency_first_ms": float,
        "latency_warmup_avg_ms": float, "latency_avg_ms": float, "latency_p50_ms": float,
        "latency_p90_ms": float, "latency_p99_ms": float, "latency_std_ms": float,
        "latency_min_ms": float, "latency_max_ms": float, "latency_count": int,
        "peak_memory_bytes": int, "peak_memory_source": str, "avg_memory_bytes": float,
        "baseline_memory_bytes": int, "peak_rss_bytes": int, "cpu_avg_percent": float,
        "cpu_peak_percent": float, "block_read_bytes": int, "block_write_bytes": int,
        "net_rx_bytes": int, "net_tx_bytes": int, "sampler_cpu_percent": float,
        "sample_interval_ms": float, "sample_count": int,
    }, pk="run_id", foreign_keys=[("run_id", "runs", "id")])
    db.table("iterations").create({"run_id": int, "idx": int, "ms": float}, pk=("run_id", "idx"))
    db.table("telemetry").create({"run_id": int, "idx": int, "t_s": float, "cpu_percent": float,
                            "memory_bytes": int}, pk=("run_id", "idx"))


def _migration_2(db: sqlite_utils.Database) -> None:
    # Model facts become first-class columns so results can be filtered without JSON parsing.
    db.table("tasks").add_column("model_size_bytes", int)
    db.table("tasks").add_column("model_param_count", int)


def _migration_3(db: sqlite_utils.Database) -> None:
    # Calibrations are versioned per (device, metric, threads, runtime, family) key and keep
    # the runs they were fitted on.
    db.table("calibrations").create({
        "id": int, "device": str, "metric": str, "threads": int, "runtime": str, "precision": str,
        "family": str, "version": int, "created_at": float, "kind": str, "n": int, "a": float,
        "b": float, "r2": float, "loo_mape": float, "within_10": float, "kendall_tau": float,
        "spearman_rho": float, "warnings_json": str, "fit_json": str, "source": str,
    }, pk="id")
    db.table("calibrations").create_index(["device", "metric", "threads", "runtime", "family", "version"], unique=True)
    db.table("calibration_runs").create({"calibration_id": int, "model": str, "sim_run_id": int, "device_run_id": int},
                                  foreign_keys=[("calibration_id", "calibrations", "id")])


def _migration_4(db: sqlite_utils.Database) -> None:
    # The gRPC controller remembers its agents and their devices, so `farm devices` still lists
    # a device whose agent is offline, and a restarted controller knows who to expect.
    db.table("agents").create({
        "name": str, "session_id": str, "state": str, "farm_version": str, "capabilities_json": str,
        "hostname": str, "peer": str, "connected_at": float, "last_seen": float,
    }, pk="name")
    db.table("devices").create({
        "name": str, "agent": str, "driver": str, "device_type": str, "tags_json": str,
        "facts_json": str, "slots": int, "state": str, "last_seen": float,
    }, pk="name")
    # Every applied result asks "is anything of this job left?"; without this it scans the job's tasks.
    db.table("tasks").create_index(["job_id", "status"])


def _migration_5(db: sqlite_utils.Database) -> None:
    # A device's health is the lab's judgement (good / bad / maintenance), apart from whether
    # its agent is connected: a quarantined device gets no tasks until someone releases it.
    db.table("device_health").create({"name": str, "health": str, "reason": str, "changed_at": float}, pk="name")


def _migration_6(db: sqlite_utils.Database) -> None:
    # Each refresh compares a device's new calibration with the one before it.
    db.table("calibration_drift").create({
        "id": int, "device": str, "metric": str, "threads": int, "calibration_id": int, "previous_id": int,
        "slope_change": float, "intercept_change": float, "r2_drop": float, "prediction_shift": float,
        "exceeded": int, "reasons": str, "created_at": float,
    }, pk="id")


def _migration_7(db: sqlite_utils.Database) -> None:
    # The lease query's own order for one target (status = 'pending', target, then priority, job,
    # seq): SQLite walks the index and stops at the first task that fits, instead of sorting every
    # pending row, and never walks past other devices' backlogs.
    db.table("tasks").create_index(["status", "target", "priority", "job_id", "seq"], index_name="idx_tasks_lease_order")
    db.execute("DROP INDEX IF EXISTS idx_tasks_status_priority_id")  # the old order (by id): a wasted write per task


def _migration_8(db: sqlite_utils.Database) -> None:
    # What a job is for: 'health_check' only for the reference suite farm itself submitted
    # (controller/operations/reference_suite.py), 'user' for everything else, whatever its name.
    # Older jobs are not guessed from their name: golden-result history starts again.
    db.table("jobs").add_column("kind", str, not_null_default="user")


def _migration_9(db: sqlite_utils.Database) -> None:
    # A sim run carries the evidence of whether its cores were its own; calibrations leave out
    # contended runs by default, so the flag is a column (indexed by the pair queries' joins on id).
    db.table("runs").add_column("contended", int)
    db.table("runs").add_column("contention_json", str)


def _migration_10(db: sqlite_utils.Database) -> None:
    # Batch size, input size and precision are part of a calibration's key: a model at batch 8 is
    # not a repeat of the same model at batch 1.
    db.table("calibrations").add_column("batch_size", int)
    db.table("calibrations").add_column("input_size", int)
    db.execute("UPDATE calibrations SET batch_size = 1 WHERE batch_size IS NULL")
    db.execute("DROP INDEX IF EXISTS idx_calibrations_device_metric_threads_runtime_family_version")
    db.table("calibrations").create_index(["device", "metric", "threads", "runtime", "batch_size", "input_size",
                                     "precision", "family", "version"], unique=True)


def _migration_11(db: sqlite_utils.Database) -> None:
    # Profile depth (issue 13): throughput and cold-start cost as figures of their own, and the slowest
    # operators of a run (bounded per run by farm.proto.op_profile).
    db.table("summaries").add_column("throughput_per_s", float)
    db.table("summaries").add_column("startup_ms", float)
    db.table("op_profiles").create({
        "run_id": int, "idx": int, "kind": str, "node_type": str, "name": str, "avg_ms": float, "percent": float,
        "first_ms": float, "count": int, "times_called": int, "mem_kb": float,
    }, pk=("run_id", "idx"), foreign_keys=[("run_id", "runs", "id")])


def _migration_12(db: sqlite_utils.Database) -> None:
    # Jobs have owners (issue 18, N11): the submitting token's id (a hash prefix, never the token) and its
    # team. NULL for jobs from before, from embedded mode and from the controller itself: the lab's own.
    db.table("jobs").add_column("submitted_by", str)
    db.table("jobs").add_column("team", str)


def _migration_13(db: sqlite_utils.Database) -> None:
    # Who uploaded which artifact (issue 18, N13): a client token's uploads count against its quota until
    # `farm artifacts gc` removes them.
    db.table("artifact_uploads").create({"sha256": str, "owner": str, "size": int, "at": float}, pk=("sha256", "owner"))
    db.table("artifact_uploads").create_index(["owner"])


def _migration_14(db: sqlite_utils.Database) -> None:
    # Each job's tasks by status, kept by triggers as tasks change (issue 22): listing and watching jobs read
    # a few rows instead of counting every task (100k pending: ~25 ms a listing). In the same transaction as
    # the change, so a kill -9 leaves counts and tasks agreeing. Rows at n = 0 stay; readers skip them.
    db.execute("CREATE TABLE job_task_counts (job_id INTEGER NOT NULL, status TEXT NOT NULL, n INTEGER NOT NULL, "
               "PRIMARY KEY (job_id, status)) WITHOUT ROWID")
    db.execute("INSERT INTO job_task_counts (job_id, status, n) SELECT job_id, status, COUNT(*) FROM tasks "
               "WHERE job_id IS NOT NULL AND status IS NOT NULL GROUP BY job_id, status")
    add = ("INSERT INTO job_task_counts (job_id, status, n) SELECT NEW.job_id, NEW.status, 1 "
           "WHERE NEW.job_id IS NOT NULL AND NEW.status IS NOT NULL ON CONFLICT (job_id, status) DO UPDATE SET n = n + 1;")
    remove = "UPDATE job_task_counts SET n = n - 1 WHERE job_id = OLD.job_id AND status = OLD.status;"
    db.execute(f"CREATE TRIGGER tasks_counted_insert AFTER INSERT ON tasks BEGIN {add} END")
    db.execute(f"CREATE TRIGGER tasks_counted_delete AFTER DELETE ON tasks BEGIN {remove} END")
    db.execute("CREATE TRIGGER tasks_counted_update AFTER UPDATE OF job_id, status ON tasks "
               f"WHEN OLD.job_id IS NOT NEW.job_id OR OLD.status IS NOT NEW.status BEGIN {remove} {add} END")


def _visible_jobs(visible_to: tuple[str, str | None] | None, alias: str) -> tuple[str, list[Any]]:
    """The WHERE clause of service.Viewer.may_read in a `team` lab: the lab's own jobs, the token's, its team's."""
    if visible_to is None:
        return "", []
    a = alias
    return (f"WHERE {a}submitted_by IS NULL OR {a}submitted_by = ? OR ({a}team IS NOT NULL AND {a}team = ?) ",
            [visible_to[0], visible_to[1]])


MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [
    _migration_1, _migration_2, _migration_3, _migration_4, _migration_5, _migration_6, _migration_7, _migration_8,
    _migration_9, _migration_10, _migration_11, _migration_12, _migration_13, _migration_14]
SCHEMA_VERSION = len(MIGRATIONS)


class StoreError(Exception):
    pass


BUSY_TIMEOUT_S = 30
# A quarantined device (or one in maintenance) is offered no task until it is released.
HEALTHY_TARGET = "AND t.target NOT IN (SELECT name FROM device_health WHERE health IN ('bad', 'maintenance'))"


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


class Store:
    def __init__(self, path: Path | str, *, create_folder: bool = False) -> None:
        """create_folder: make a missing folder of the store; otherwise it is an error (a mistyped --db
        would otherwise look like a store whose results were lost)."""
        # Absolute from here on: run directories live beside the store and must not depend on the cwd.
        self.path = Path(path) if str(path) == ":memory:" else Path(path).expanduser().absolute()
        self._on_disk = str(path) != ":memory:"
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
        try:
            conn = sqlite3.connect(str(self.path), check_same_thread=False, timeout=BUSY_TIMEOUT_S,
                                   isolation_level=None)
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_S * 1000}")
            self.db = sqlite_utils.Database(conn)
            if self._on_disk:
                self.db.enable_wal()
            conn.execute("PRAGMA foreign_keys = ON")
            self._lock = threading.RLock()  # one connection shared by the agent threads
            self._local = threading.local()  # whether this thread is inside a transaction
            self._readers: "queue.SimpleQueue[sqlite3.Connection]" = queue.SimpleQueue()  # idle reader connections
            self._migrate()
        except sqlite3.Error as e:
            raise StoreError(store_error_message(self.path, e)) from None

    # --- schema ------------------------------------------------------------
    def _migrate(self) -> None:
        # An up-to-date store is only read here, so opening one works while another process writes.
        if "schema_version" in self.db.table_names() and self.schema_version() == SCHEMA_VERSION:
            return
        with self.transaction():
            if "schema_version" not in self.db.table_names():
                self.db.table("schema_version").create({"version": int})
                self.db.table("schema_version").insert({"version": 0})
            current = self.db.execute("SELECT version FROM schema_version").fetchone()[0]
            if current > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path} was written by a newer farm (schema {current}, this farm knows {SCHEMA_VERSION}); upgrade farm"
                )
            for version in range(current, SCHEMA_VERSION):
                MIGRATIONS[version](self.db)
            self.db.execute("UPDATE schema_version SET version = ?", [SCHEMA_VERSION])

    def schema_version(self) -> int:
        return self.db.execute("SELECT version FROM schema_version").fetchone()[0]

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

    def query(self, sql: str, params: Any = ()) -> list[dict[str, Any]]:
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

    def _open_reader(self) -> sqlite3.Connection:
        conn = sqlite3.connect(str(self.path), check_same_thread=False, timeout=30, isolation_level=None)
        conn.execute("PRAGMA busy_timeout = 30000")
        conn.execute("PRAGMA query_only = ON")
        return conn

    def close(self) -> None:
        with self._lock:
            self.db.conn.close()
        while True:
            try:
                self._readers.get_nowait().close()
            except queue.Empty:
                break

    # --- jobs and tasks -------------------------------------------------------
    def insert_job(self, job: dict[str, Any], tasks: list[dict[str, Any]]) -> int:
        with self.transaction():
            job_id = self._insert_row("jobs", job)
            columns = list(dict.fromkeys(["job_id", *(k for t in tasks for k in t)]))  # refused models add a few
            # one statement for every task: a 100,000-task job is inserted in a second or two
            self.db.conn.executemany(
                f"INSERT INTO tasks ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                ([job_id if c == "job_id" else t.get(c) for c in columns] for t in tasks))
        return job_id

    def job(self, job_id: int) -> dict[str, Any] | None:
        rows = self.query("SELECT * FROM jobs WHERE id = ?", [job_id])
        return rows[0] if rows else None

    def update_job(self, job_id: int, **fields: Any) -> None:
        with self.transaction():
            self.db.table("jobs").update(job_id, fields)

    def tasks(self, job_id: int) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM tasks WHERE job_id = ? ORDER BY seq", [job_id])

    def task(self, task_id: int) -> dict[str, Any] | None:
        rows = self.query("SELECT * FROM tasks WHERE id = ?", [task_id])
        return rows[0] if rows else None

    def update_task(self, task_id: int, **fields: Any) -> None:
        with self.transaction():
            self.db.table("tasks").update(task_id, fields)

    # --- runs -------------------------------------------------------------------
    def record_run(self, task: dict[str, Any], attempt: int, agent: str, started_at: float,
                   result: RunResult, task_fields: dict[str, Any]) -> int | None:
        """Store a run with its samples and update its task, atomically.

        Returns the run id, or None when this agent already delivered this same result. Raises
        ResultRefused, storing nothing, unless the attempt is running and leased to `agent`.
        """
        with self.transaction():
            existing = self.db.execute(
                "SELECT agent, status, message FROM runs WHERE task_id = ? AND attempt = ?", [task["id"], attempt]).fetchone()
            if existing:
                if existing == (agent, result.status.value, result.message):
                    return None  # delivered twice (the first ack was lost): applied once
                raise ResultRefused(f"attempt {attempt} of task {task['id']} is already stored: {existing[2]}")
            self._check_lease(task["id"], attempt, agent)
            limits = result.limits
            run_id = self._insert_row("runs", {
                "task_id": task["id"], "job_id": task["job_id"], "attempt": attempt,
                "status": result.status.value,
                "failure_class": result.failure_class.value if result.failure_class else None,
                "message": result.message, "agent": agent, "started_at": started_at,
                "finished_at": time.time(), "backend": result.backend,
                "approximate": int(result.approximate), "limits_cpus": limits.cpus,
                "limits_cpuset": limits.cpuset, "limits_memory_mb": limits.memory_mb,
                "wall_s": result.wall_s, "whole_run_s": result.whole_run_s,
                "environment_json": json.dumps(result.environment),
                "tool_versions_json": json.dumps(result.tool_versions), "log_tail": result.log_tail,
                "contended": None if result.contention is None else int(result.contention.contended),
                "contention_json": None if result.contention is None else json.dumps(dataclasses.asdict(result.contention)),
            })
            self._insert_summary(run_id, result)
            self._insert_op_profile(run_id, result)
            if result.iterations_ms:  # executemany: a million samples in a second or two, not a minute
                self.db.conn.executemany("INSERT INTO iterations (run_id, idx, ms) VALUES (?, ?, ?)",
                                         ((run_id, i, ms) for i, ms in enumerate(result.iterations_ms)))
            if result.telemetry and result.telemetry.samples:
                self.db.conn.executemany(
                    "INSERT INTO telemetry (run_id, idx, t_s, cpu_percent, memory_bytes) VALUES (?, ?, ?, ?, ?)",
                    ((run_id, i, s.t_s, s.cpu_percent, s.memory_bytes) for i, s in enumerate(result.telemetry.samples)))
            self._update_row("tasks", task["id"], {**task_fields, "last_run_id": run_id})
        return run_id

    # Plain statements on the hot path (a result, a lease): sqlite_utils' insert and update read the
    # table's schema on every call, which was most of a result's cost in the scheduling benchmark.
    def _insert_row(self, table: str, row: dict[str, Any]) -> int:
        sql = f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})"
        row_id = self.db.conn.execute(sql, list(row.values())).lastrowid
        assert row_id is not None  # an INSERT always sets it
        return row_id

    def _update_row(self, table: str, pk: int, fields: dict[str, Any]) -> None:
        sql = f"UPDATE {table} SET {', '.join(f'{k} = ?' for k in fields)} WHERE id = ?"
        self.db.conn.execute(sql, [*fields.values(), pk])

    def _check_lease(self, task_id: int, attempt: int, agent: str) -> None:
        row = self.db.execute("SELECT status, attempts, leased_by FROM tasks WHERE id = ?", [task_id]).fetchone()
        if row is None:
            raise ResultRefused(f"there is no task {task_id}")
        status, attempts, leased_by = row
        if status != TaskStatus.RUNNING.value:
            raise ResultRefused(f"task {task_id} is {status}: attempt {attempt} holds no lease")
        if attempts != attempt:
            raise ResultRefused(f"attempt {attempt} of task {task_id} is not the current one (attempt {attempts})")
        if leased_by != agent:
            raise ResultRefused(f"task {task_id} attempt {attempt} is not leased to agent {agent}")

    def record_lost_attempts(self, tasks: list[dict[str, Any]], reason: str, *, retry: Callable[[int, int], bool],
                             now: float) -> list[int]:
        """Inside a transaction: each running attempt in `tasks` (id, job_id, attempts, max_attempts, leased_by)
        becomes a failed run (infrastructure); its task goes back to the queue, or fails when `retry` says no.

        `reason` may name the agent as {agent}. Returns the jobs whose tasks failed for good."""
        failed_jobs = []
        for t in tasks:
            message = reason.format(agent=t["leased_by"] or "(none)")
            run_id = self.db.execute(
                "INSERT OR IGNORE INTO runs (task_id, job_id, attempt, status, failure_class, message, agent, finished_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [t["id"], t["job_id"], t["attempts"], RunStatus.FAILED.value, FailureClass.INFRASTRUCTURE.value, message,
                 t["leased_by"], now]).lastrowid
            fields: dict[str, Any]
            if retry(t["attempts"], t["max_attempts"]):
                fields = {"status": TaskStatus.PENDING.value, "message": message}
            else:
                fields = {"status": TaskStatus.FAILED.value, "failure_class": FailureClass.INFRASTRUCTURE.value,
                          "finished_at": now, "message": f"{message} (attempt {t['attempts']} of {t['max_attempts']})"}
                failed_jobs.append(t["job_id"])
            self.db.table("tasks").update(t["id"], {**fields, "leased_by": None, "last_run_id": run_id})
        return failed_jobs

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
        self._insert_row("summaries", row)

    def iterations(self, run_id: int) -> list[float]:
        return [r["ms"] for r in self.query("SELECT ms FROM iterations WHERE run_id = ? ORDER BY idx", [run_id])]

    def telemetry(self, run_id: int) -> list[dict[str, Any]]:
        return self.query("SELECT t_s, cpu_percent, memory_bytes FROM telemetry WHERE run_id = ? ORDER BY idx", [run_id])

    # --- queries for the dashboard (r14-web) -------------------------------------------
    def dashboard_devices(self) -> list[dict[str, Any]]:
        """Every device the lab knows (registered by an agent, or only judged healthy/bad), with its health."""
        return self.query(
            "SELECT d.name, d.agent, d.driver, d.device_type, d.tags_json, d.slots, d.state, d.last_seen, "
            "h.health, h.reason, h.changed_at FROM devices d LEFT JOIN device_health h ON h.name = d.name "
            "UNION ALL SELECT h.name, NULL, NULL, NULL, NULL, NULL, NULL, NULL, h.health, h.reason, h.changed_at "
            "FROM device_health h WHERE h.name NOT IN (SELECT name FROM devices) ORDER BY 1")

    def dashboard_calibration_times(self) -> dict[str, float]:
        """device -> when its newest calibration was stored."""
        return {r["device"]: r["at"] for r in self.query(
            "SELECT device, MAX(created_at) AS at FROM calibrations GROUP BY device")}

    def dashboard_running_tasks(self) -> list[dict[str, Any]]:
        return self.query("SELECT id, job_id, target, model_name, threads, repeat, attempts, leased_by "
                          "FROM tasks WHERE status = 'running' ORDER BY id")

    def dashboard_queue(self) -> list[dict[str, Any]]:
        """Pending tasks per target and job, in lease order (priority, then job)."""
        return self.query("SELECT target, job_id, MIN(priority) AS priority, COUNT(*) AS pending FROM tasks "
                          "WHERE status = 'pending' GROUP BY target, job_id ORDER BY MIN(priority), job_id, target")

    def dashboard_agents(self) -> list[dict[str, Any]]:
        return self.query("SELECT name, state, farm_version, hostname, peer, connected_at, last_seen FROM agents "
                          "ORDER BY name")

    def dashboard_jobs(self, limit: int, visible_to: tuple[str, str | None] | None = None) -> list[dict[str, Any]]:
        """The newest jobs, each with its task counts per status (one grouped query, not one per job)."""
        where, params = _visible_jobs(visible_to, "")
        jobs = self.query("SELECT id, name, kind, status, priority, created_at, started_at, finished_at, message "
                          f"FROM jobs {where}ORDER BY id DESC LIMIT ?", [*params, limit])
        counts = self.task_counts_of([j["id"] for j in jobs])
        for j in jobs:
            j["counts"] = counts.get(j["id"], {})
        return jobs

    def task_counts_of(self, job_ids: list[int]) -> dict[int, dict[str, int]]:
        """Each of these jobs' tasks by status, read from the counts the triggers keep (migration 14)."""
        by_job: dict[int, dict[str, int]] = {}
        for start in range(0, len(job_ids), 500):  # under SQLite's limit on bound parameters
            chunk = job_ids[start:start + 500]
            marks = ",".join("?" for _ in chunk)
            for r in self.query(f"SELECT job_id, status, n FROM job_task_counts WHERE job_id IN ({marks}) AND n > 0",
                                chunk):
                by_job.setdefault(r["job_id"], {})[r["status"]] = r["n"]
        return by_job

    def record_upload(self, sha256: str, owner: str, size: int, at: float) -> None:
        with self.transaction():
            self.db.execute("INSERT OR IGNORE INTO artifact_uploads (sha256, owner, size, at) VALUES (?, ?, ?, ?)",
                            [sha256, owner, size, at])

    def upload_usage(self, owner: str) -> int:
        """Bytes of the artifacts this token uploaded that are still stored."""
        return self.query("SELECT COALESCE(SUM(size), 0) AS n FROM artifact_uploads WHERE owner = ?", [owner])[0]["n"]

    def forget_uploads(self, hashes: list[str]) -> None:
        with self.transaction():
            self.db.conn.executemany("DELETE FROM artifact_uploads WHERE sha256 = ?", [[h] for h in hashes])

    def referenced_artifacts(self) -> set[str]:
        """The sha256 of every model and packed script folder some job's task names (what gc must keep)."""
        rows = self.query("SELECT DISTINCT model_sha256 AS sha FROM tasks WHERE model_sha256 IS NOT NULL "
                          "UNION SELECT DISTINCT json_extract(spec_json, '$.script_archive') FROM tasks "
                          "WHERE json_extract(spec_json, '$.script_archive') IS NOT NULL")
        return {r["sha"] for r in rows}

    def dashboard_job_count(self, visible_to: tuple[str, str | None] | None = None) -> int:
        where, params = _visible_jobs(visible_to, "")
        return self.query(f"SELECT COUNT(*) AS n FROM jobs {where}", params)[0]["n"]

    def dashboard_calibration(self, calibration_id: int) -> dict[str, Any] | None:
        rows = self.query("SELECT * FROM calibrations WHERE id = ?", [calibration_id])
        return rows[0] if rows else None

    def dashboard_calibration_versions(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """Every version of the calibration key `row` belongs to, oldest first."""
        return self.query(
            "SELECT * FROM calibrations WHERE device = ? AND metric = ? AND threads = ? AND runtime = ? "
            "AND batch_size IS ? AND input_size IS ? AND precision IS ? AND family = ? ORDER BY version",
            [row["device"], row["metric"], row["threads"], row["runtime"], row["batch_size"], row["input_size"],
             row["precision"], row["family"]])

    def dashboard_latest_calibrations(self) -> list[dict[str, Any]]:
        """The newest version of every calibration key, with how many versions it has."""
        return self.query(
            "SELECT c.id, c.device, c.metric, c.threads, c.runtime, c.batch_size, c.input_size, c.precision, c.family, "
            "c.version, c.created_at, c.kind, c.n, c.r2, c.loo_mape, c.kendall_tau, c.spearman_rho, c.fit_json, c.source, "
            "g.versions FROM calibrations c JOIN (SELECT MAX(id) AS id, COUNT(*) AS versions FROM calibrations "
            "GROUP BY device, metric, threads, runtime, batch_size, input_size, precision, family) g ON g.id = c.id "
            "ORDER BY c.device, c.metric, c.threads, c.runtime, c.batch_size, c.input_size, c.precision, c.family")

    def dashboard_drift(self, device: str, metric: str, threads: int) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM calibration_drift WHERE device = ? AND metric = ? AND threads = ? ORDER BY id",
                          [device, metric, threads])

    def dashboard_job_status_counts(self, job_id: int) -> dict[str, int]:
        return {r["status"]: r["n"] for r in self.query(
            "SELECT status, COUNT(*) AS n FROM tasks WHERE job_id = ? GROUP BY status", [job_id])}
    # --- r13-profile: per-operator profiles ----------------------------------------------------
    def _insert_op_profile(self, run_id: int, r: RunResult) -> None:
        """Inside record_run's transaction: the run's op profile, bounded and cleaned again (it came over the wire)."""
        rows = op_profile.bounded(r.op_profile)
        if rows:
            self.db.conn.executemany(
                "INSERT INTO op_profiles (run_id, idx, kind, node_type, name, avg_ms, percent, first_ms, count, "
                "times_called, mem_kb) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                ((run_id, i, o.kind, o.node_type, o.name, o.avg_ms, o.percent, o.first_ms, o.count, o.times_called,
                  o.mem_kb) for i, o in enumerate(rows)))

    def op_profiles(self, run_ids: list[int]) -> dict[int, list[dict[str, Any]]]:
        """Each run's op profile rows (op types, then nodes; slowest first), by run id."""
        found: dict[int, list[dict[str, Any]]] = {run_id: [] for run_id in run_ids}
        for start in range(0, len(run_ids), 500):  # SQLite's bound on ? parameters
            chunk = run_ids[start:start + 500]
            marks = ",".join("?" * len(chunk))
            for row in self.query(f"SELECT * FROM op_profiles WHERE run_id IN ({marks}) ORDER BY run_id, idx", chunk):
                run_id = row.pop("run_id")
                row.pop("idx")
                found[run_id].append(row)
        return found
    # --- r13-report --------------------------------------------------------------
    def calibrations_using_job(self, job_id: int) -> list[dict[str, Any]]:
        """Every stored calibration version fitted on this job's runs (either side), oldest version first."""
        return self.query(
            "SELECT c.* FROM calibrations c WHERE c.id IN ("
            " SELECT cr.calibration_id FROM calibration_runs cr JOIN runs r"
            " ON r.id = cr.sim_run_id OR r.id = cr.device_run_id WHERE r.job_id = ?)"
            " ORDER BY c.device, c.metric, c.threads, c.family, c.version", [job_id])

    # --- queries (r12-sched) ------------------------------------------------------------------
    # Every statement the controller runs lives below, named for what it asks; controller/ modules
    # call these and hold no SQL of their own (tests/test_sql_in_store_only.py fails otherwise).

    # jobs and tasks
    def job_list(self, limit: int, visible_to: tuple[str, str | None] | None = None) -> list[dict[str, Any]]:
        """The newest jobs; with visible_to (owner, team): only the lab's own, that token's and its team's.
        Each row has `counts` (its tasks by status) and their sums tasks/completed/failed: one grouped count."""
        where, params = _visible_jobs(visible_to, "")
        jobs = self.query(
            "SELECT id, name, status, priority, created_at, started_at, finished_at, message, owner_pid, owner_host, "
            f"submitted_by, team FROM jobs {where}ORDER BY id DESC LIMIT ?", [*params, limit])
        counts = self.task_counts_of([j["id"] for j in jobs])
        for j in jobs:
            c = j["counts"] = counts.get(j["id"], {})
            j.update(tasks=sum(c.values()), completed=c.get("completed", 0), failed=c.get("failed", 0))
        return jobs

    def jobs_of_kind(self, kind: str, statuses: tuple[str, ...]) -> list[int]:
        marks = ",".join("?" for _ in statuses)
        return [r["id"] for r in self.query(f"SELECT id FROM jobs WHERE kind = ? AND status IN ({marks}) ORDER BY id",
                                            [kind, *statuses])]

    def earlier_jobs_of_kind(self, kind: str, before_job: int) -> list[int]:
        return [r["id"] for r in self.query("SELECT id FROM jobs WHERE kind = ? AND id < ? ORDER BY id", [kind, before_job])]

    def task_counts(self, job_id: int) -> dict[str, int]:
        """A job's tasks by status."""
        return self.task_counts_of([job_id]).get(job_id, {})

    def job_has_open_tasks(self, job_id: int) -> bool:
        # answered from the (job_id, status) index without counting
        return bool(self.query("SELECT EXISTS(SELECT 1 FROM tasks WHERE job_id = ? AND status IN ('pending', 'running')) "
                               "AS n", [job_id])[0]["n"])

    def job_targets(self, job_id: int) -> list[str]:
        """The devices a job has tasks for (sim left out)."""
        return [r["target"] for r in self.query(
            "SELECT DISTINCT target FROM tasks WHERE job_id = ? AND target != 'sim' ORDER BY target", [job_id])]

    def job_model_names(self, job_id: int) -> dict[str, str]:
        """sha256 -> model name, for a job's models."""
        return {r["model_sha256"]: r["model_name"] for r in self.query(
            "SELECT DISTINCT model_sha256, model_name FROM tasks WHERE job_id = ?", [job_id])}

    def cancel_pending_tasks(self, job_id: int, message: str, now: float) -> int:
        with self.transaction():
            return self.db.conn.execute(
                "UPDATE tasks SET status = ?, failure_class = ?, message = ?, finished_at = ? WHERE job_id = ? AND status = ?",
                [TaskStatus.CANCELED.value, FailureClass.CANCELED.value, message, now, job_id,
                 TaskStatus.PENDING.value]).rowcount

    def requeue_interrupted_tasks(self, job_id: int, since: float, message: str) -> int:
        """A job's unstarted tasks and those canceled since `since` (stopped by Ctrl+C) wait again."""
        with self.transaction():
            return self.db.conn.execute(
                "UPDATE tasks SET status = ?, leased_by = NULL, failure_class = NULL, finished_at = NULL, message = ? "
                "WHERE job_id = ? AND (status IN (?, ?) OR (status = ? AND finished_at >= ?))",
                [TaskStatus.PENDING.value, message, job_id, TaskStatus.PENDING.value, TaskStatus.RUNNING.value,
                 TaskStatus.CANCELED.value, since]).rowcount

    def fail_waiting_tasks(self, device: str, message: str, now: float, *, job_id: int | None = None) -> list[int]:
        """Fail the device's pending tasks (infrastructure); returns the job of each."""
        where = "target = ? AND status = 'pending'"
        params: list[Any] = [device]
        if job_id is not None:
            where += " AND job_id = ?"
            params.append(job_id)
        with self.transaction():
            jobs = [r[0] for r in self.db.conn.execute(f"SELECT job_id FROM tasks WHERE {where}", params)]
            self.db.conn.execute(f"UPDATE tasks SET status = 'failed', failure_class = 'infrastructure', finished_at = ?, "
                                 f"message = ? WHERE {where}", [now, message, *params])
        return jobs

    # leases
    def next_pending(self, targets: set[str] | frozenset[str], limit: int, *,
                     job_id: int | None = None) -> list[dict[str, Any]]:
        """The first `limit` leasable tasks for any of `targets`, in lease order (priority, job, seq).

        One walk of the (status, target, priority, job_id, seq) index per target, merged here: the
        cost stays flat with queue depth, even when other devices' backlogs come first."""
        where = f"t.status = 'pending' AND t.target = ? AND j.status IN ('queued', 'running') {HEALTHY_TARGET}"
        if job_id is not None:
            where += " AND t.job_id = ?"
        rows: list[dict[str, Any]] = []
        for target in sorted(targets):
            cursor = self.db.conn.execute(
                f"SELECT t.* FROM tasks t JOIN jobs j ON j.id = t.job_id WHERE {where} "
                "ORDER BY t.priority, t.job_id, t.seq LIMIT ?", [target, *([job_id] if job_id is not None else []), limit])
            columns = [c[0] for c in cursor.description]
            rows += [dict(zip(columns, values)) for values in cursor.fetchall()]
        rows.sort(key=lambda t: (t["priority"], t["job_id"], t["seq"]))
        return rows[:limit]

    def lease_task(self, task_id: int, attempt: int, agent: str, expires_at: float) -> None:
        self.db.conn.execute("UPDATE tasks SET status = ?, attempts = ?, leased_by = ?, lease_expires_at = ? WHERE id = ?",
                             [TaskStatus.RUNNING.value, attempt, agent, expires_at, task_id])

    def start_job(self, job_id: int, now: float) -> None:
        """A queued job is running from its first lease on."""
        self.db.conn.execute("UPDATE jobs SET status = 'running', started_at = ? WHERE id = ? AND status = 'queued'",
                             [now, job_id])

    def lease_state(self, task_id: int) -> tuple[str, int, float | None, str, str | None] | None:
        """(task status, attempts, lease_expires_at, job status, leased_by) of a task."""
        return self.db.conn.execute(
            "SELECT t.status, t.attempts, t.lease_expires_at, j.status, t.leased_by FROM tasks t "
            "JOIN jobs j ON j.id = t.job_id WHERE t.id = ?", [task_id]).fetchone()

    def renew_lease(self, task_id: int, expires_at: float) -> None:
        with self.transaction():
            self.db.conn.execute("UPDATE tasks SET lease_expires_at = ? WHERE id = ?", [expires_at, task_id])

    def running_attempts(self, *, job_id: int | None = None, agent: str | None = None, expired_before: float | None = None,
                         task_ids: list[int] | None = None) -> list[dict[str, Any]]:
        """Running tasks (id, job_id, attempts, max_attempts, leased_by) matching every filter given."""
        where, params = ["status = 'running'"], []
        for clause, value in (("job_id = ?", job_id), ("leased_by = ?", agent), ("lease_expires_at < ?", expired_before)):
            if value is not None:
                where.append(clause)
                params.append(value)
        if task_ids is not None:
            where.append(f"id IN ({','.join('?' for _ in task_ids)})")
            params += task_ids
        return self.query(f"SELECT id, job_id, attempts, max_attempts, leased_by FROM tasks WHERE {' AND '.join(where)} "
                          "ORDER BY id", params)

    def contended_runs(self, task_id: int) -> int:
        return self.query("SELECT COUNT(*) AS n FROM runs WHERE task_id = ? AND contended = 1", [task_id])[0]["n"]

    def adopt_unfinished(self, pid: int, host: str, lease_expires_at: float) -> None:
        """After a restart: this process owns the open jobs, running leases get a fresh expiry, and every
        agent and device is offline until it says hello."""
        with self.transaction():
            self.db.conn.execute("UPDATE jobs SET owner_pid = ?, owner_host = ? WHERE status IN ('queued', 'running')",
                                 [pid, host])
            self.db.conn.execute("UPDATE tasks SET lease_expires_at = ? WHERE status = 'running'", [lease_expires_at])
            self.db.conn.execute("UPDATE agents SET state = 'offline'")
            self.db.conn.execute("UPDATE devices SET state = 'offline'")

    # agents and devices
    def record_agent(self, agent: dict[str, Any], devices: list[tuple[Any, ...]]) -> None:
        """Upsert an agent and its devices (name, agent, driver, device_type, tags_json, facts_json, slots,
        state, last_seen), one statement for every device: registration stays linear in their number."""
        with self.transaction():
            self.db.table("agents").upsert(agent, pk="name")
            self.db.conn.executemany(
                "INSERT INTO devices (name, agent, driver, device_type, tags_json, facts_json, slots, state, last_seen) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET agent = excluded.agent, "
                "driver = excluded.driver, device_type = excluded.device_type, tags_json = excluded.tags_json, "
                "facts_json = excluded.facts_json, slots = excluded.slots, state = excluded.state, "
                "last_seen = excluded.last_seen", devices)

    def agents(self) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM agents ORDER BY name")

    def devices(self) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM devices ORDER BY name")

    def device_owners(self) -> dict[str, str]:
        return {r["name"]: r["agent"] for r in self.query("SELECT name, agent FROM devices")}

    def device_rows(self, *, sim: bool = True) -> list[dict[str, Any]]:
        """Registered devices (name, device_type, tags_json), sim slots left out unless asked."""
        return self.query("SELECT name, device_type, tags_json FROM devices" + ("" if sim else " WHERE driver != 'sim'"))

    def device_type(self, device: str) -> str | None:
        rows = self.query("SELECT device_type FROM devices WHERE name = ?", [device])
        return rows[0]["device_type"] if rows else None

    def forget_device(self, name: str) -> None:
        with self.transaction():
            self.db.conn.execute("DELETE FROM devices WHERE name = ?", [name])

    # device health
    def set_device_health(self, device: str, health: str, reason: str, now: float) -> None:
        with self.transaction():
            self.db.conn.execute(
                "INSERT INTO device_health (name, health, reason, changed_at) VALUES (?, ?, ?, ?) ON CONFLICT(name) "
                "DO UPDATE SET health = excluded.health, reason = excluded.reason, changed_at = excluded.changed_at",
                [device, health, reason, now])

    def device_health(self) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM device_health ORDER BY name")

    def quarantined_targets(self, job_id: int) -> list[dict[str, Any]]:
        """The job's targets that are quarantined or in maintenance (name, reason)."""
        return self.query("SELECT name, reason FROM device_health WHERE health IN ('bad', 'maintenance') "
                          "AND name IN (SELECT target FROM tasks WHERE job_id = ?)", [job_id])

    def last_reference_checks(self, health_check_kind: str) -> dict[str, float]:
        """device -> when its last health check (a job of that kind) completed on it, in Unix time."""
        return {r["target"]: r["at"] for r in self.query(
            "SELECT t.target, MAX(t.finished_at) AS at FROM tasks t JOIN jobs j ON j.id = t.job_id "
            "WHERE j.kind = ? AND t.target != 'sim' AND t.status = 'completed' GROUP BY t.target", [health_check_kind])}

    # metrics
    def pending_by_priority(self) -> dict[int, int]:
        return {r["priority"]: r["n"] for r in self.query(
            "SELECT priority, COUNT(*) AS n FROM tasks WHERE status = 'pending' GROUP BY priority")}

    def tasks_by_status(self) -> dict[str, int]:
        return {str(r["status"]): r["n"] for r in self.query("SELECT status, COUNT(*) AS n FROM tasks GROUP BY status")}

    def newest_calibration_times(self) -> list[dict[str, Any]]:
        """(device, metric, newest): when each device's metric was last calibrated."""
        return self.query("SELECT device, metric, MAX(created_at) AS newest FROM calibrations "
                          "WHERE created_at IS NOT NULL GROUP BY device, metric ORDER BY device, metric")

    def latest_drift(self) -> list[dict[str, Any]]:
        """The newest drift row per (device, metric, threads): drift is computed per calibration key."""
        return self.query(
            "SELECT d.device, d.metric, d.threads, d.prediction_shift, d.exceeded FROM calibration_drift d "
            "WHERE d.rowid = (SELECT e.rowid FROM calibration_drift e WHERE e.device = d.device AND e.metric = d.metric "
            "AND e.threads IS d.threads ORDER BY e.created_at DESC, e.rowid DESC LIMIT 1) "
            "ORDER BY d.device, d.metric, d.threads")

    def has_table(self, table: str) -> bool:
        return bool(self.query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", [table]))

    # drift and golden results
    def add_drift(self, row: dict[str, Any]) -> None:
        with self.transaction():
            self._insert_row("calibration_drift", row)

    def drift_history(self, device: str | None = None) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM calibration_drift" + (" WHERE device = ?" if device else "") + " ORDER BY id",
                          [device] if device else [])

    def device_latencies(self, job_id: int, device: str) -> list[dict[str, Any]]:
        """(model_sha256, model_name, threads, latency_avg_ms) of a job's completed runs on `device`."""
        return self.query(
            "SELECT t.model_sha256, t.model_name, t.threads, s.latency_avg_ms FROM tasks t "
            "JOIN runs r ON r.id = t.last_run_id JOIN summaries s ON s.run_id = r.id "
            "WHERE t.job_id = ? AND t.target = ? AND t.status = 'completed'", [job_id, device])

    # results
    def run_rows(self, job_id: int) -> list[dict[str, Any]]:
        """Every task of a job with its counted run and summary (None columns for a task not run)."""
        return self.query(
            "SELECT t.id AS task, t.job_id AS job, t.model_name, t.model_sha256, t.model_family, t.model_path, "
            "t.target, t.threads, t.batch_size, t.input_size, t.repeat, t.status AS task_status, "
            "t.attempts, t.pair_key, t.failure_class AS task_failure_class, t.message AS task_message, "
            "t.model_size_bytes, t.model_param_count, t.model_facts_json, t.spec_json AS task_spec_json, "
            "r.id AS run_id, r.attempt, r.status AS run_status, r.failure_class, r.message, r.backend, "
            "r.approximate, r.limits_cpus, r.limits_cpuset, r.limits_memory_mb, r.wall_s, r.whole_run_s, "
            "r.started_at, r.finished_at, r.tool_versions_json, r.environment_json, r.contention_json, s.* "
            "FROM tasks t LEFT JOIN runs r ON r.id = t.last_run_id LEFT JOIN summaries s ON s.run_id = r.id "
            "WHERE t.job_id = ? ORDER BY t.model_name, t.threads, t.batch_size, t.input_size, t.repeat, t.target, t.seq",
            [job_id])

    # calibrations (`value_sql` is a metric's expression over summaries s / runs r, from calibrations.METRICS)
    def contended_completed_runs(self, job_ids: list[int]) -> int:
        """Completed runs of these jobs whose sim run was contended."""
        if not job_ids:
            return 0
        marks = ",".join("?" for _ in job_ids)
        return self.query(
            f"SELECT COUNT(*) AS n FROM tasks t JOIN runs r ON r.id = t.last_run_id WHERE t.job_id IN ({marks}) "
            "AND t.status = 'completed' AND r.contended = 1", list(job_ids))[0]["n"]

    def completed_values(self, job_id: int, value_sql: str, *, include_contended: bool,
                         target: str | None = None) -> list[dict[str, Any]]:
        """A metric of every completed run of a job (the attempt that counted), with its model's facts;
        only one target's runs (the sim or one device) when given."""
        quiet = "" if include_contended else " AND COALESCE(r.contended, 0) = 0"
        quiet += "" if target is None else " AND t.target = ?"
        return self.query(
            f"SELECT t.model_name, t.model_sha256, t.model_family, t.threads, t.batch_size, t.input_size, t.repeat, "
            f"t.model_size_bytes, t.model_param_count, t.model_facts_json, r.id AS run_id, r.environment_json, "
            f"{value_sql} AS value FROM tasks t JOIN runs r ON r.id = t.last_run_id JOIN summaries s ON s.run_id = r.id "
            f"WHERE t.job_id = ? AND t.status = 'completed'{quiet}", [job_id] + ([] if target is None else [target]))

    def paired_values(self, job_id: int, device: str, sim_sql: str, device_sql: str, *,
                      include_contended: bool) -> list[dict[str, Any]]:
        """A job's completed device runs beside their completed sim twins (same pair key): x from the sim, y from
        the device."""
        quiet = "" if include_contended else " AND COALESCE(rs.contended, 0) = 0"
        return self.query(
            f"SELECT d.model_name, d.model_family, d.threads, d.batch_size, d.input_size, d.model_size_bytes, "
            f"d.model_param_count, d.model_facts_json, rs.id AS sim_run, rd.id AS device_run, rs.environment_json, "
            f"rd.environment_json AS device_environment, "
            f"({sim_sql.replace('s.', 'ss.').replace('r.', 'rs.')}) AS x, "
            f"({device_sql.replace('s.', 'sd.').replace('r.', 'rd.')}) AS y "
            f"FROM tasks d JOIN tasks t ON t.job_id = d.job_id AND t.pair_key = d.pair_key AND t.target = 'sim' "
            f"JOIN runs rd ON rd.id = d.last_run_id JOIN summaries sd ON sd.run_id = rd.id "
            f"JOIN runs rs ON rs.id = t.last_run_id JOIN summaries ss ON ss.run_id = rs.id "
            f"WHERE d.job_id = ? AND d.target = ? AND d.status = 'completed' AND t.status = 'completed'{quiet}",
            [job_id, device])

    def calibration_fits(self, metric: str, threads: int, runtime: str, batch_size: int | None, input_size: int | None,
                         precision: str, family: str) -> list[dict[str, Any]]:
        """(device, version, fit_json) of every calibration of this key, newest first."""
        return self.query(
            "SELECT device, version, fit_json FROM calibrations WHERE metric = ? AND threads = ? AND runtime = ? "
            "AND batch_size IS ? AND input_size IS ? AND precision = ? AND family = ? ORDER BY id DESC",
            [metric, threads, runtime, batch_size, input_size, precision, family])

    def add_calibration(self, row: dict[str, Any], runs: list[dict[str, Any]]) -> tuple[int, int]:
        """Store a calibration as the next version of its key, with the runs it was fitted on; (id, version)."""
        with self.transaction():
            version = self.db.conn.execute(
                "SELECT COALESCE(MAX(version), 0) + 1 FROM calibrations WHERE device = ? AND metric = ? AND threads = ? "
                "AND runtime = ? AND batch_size IS ? AND input_size IS ? AND precision = ? AND family = ?",
                [row["device"], row["metric"], row["threads"], row["runtime"], row["batch_size"], row["input_size"],
                 row["precision"], row["family"]]).fetchone()[0]
            cal_id = self._insert_row("calibrations", {**row, "version": version})
            for run in runs:
                self._insert_row("calibration_runs", {"calibration_id": cal_id, **run})
        return cal_id, version

    def calibration_rows(self, device: str | None = None, metric: str | None = None) -> list[dict[str, Any]]:
        where, params = [], []
        if device:
            where.append("device = ?")
            params.append(device)
        if metric:
            where.append("metric = ?")
            params.append(metric)
        sql = ("SELECT id, device, metric, threads, runtime, batch_size, input_size, precision, family, version, "
               "created_at, kind, n, r2, loo_mape, within_10, kendall_tau, spearman_rho, warnings_json, source, fit_json "
               "FROM calibrations")
        if where:
            sql += " WHERE " + " AND ".join(where)
        return self.query(sql + " ORDER BY device, metric, threads, runtime, batch_size, input_size, precision, family, "
                                "version", params)

    def newest_calibration(self, device: str, metric: str, threads: int, family: str, *, runtime: str | None,
                           batch_size: int | None, input_size: int | None, precision: str | None) -> dict[str, Any] | None:
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
        rows = self.query(sql + " ORDER BY id DESC LIMIT 1", params)
        return rows[0] if rows else None

    def calibrated_devices(self) -> list[str]:
        return [r["device"] for r in self.query("SELECT DISTINCT device FROM calibrations ORDER BY device")]

    def sync_normal(self) -> None:
        """WAL + NORMAL survives a killed process intact; only a power cut can drop the last commits, and
        then their tasks re-run when the leases run out. It saves an fsync per lease and per result."""
        with self._lock:
            self.db.conn.execute("PRAGMA synchronous = NORMAL")
    # --- queries for the client (r12-client) ---------------------------------------------
    def finished_task_count(self, job_id: int) -> int:
        return self.query("SELECT COUNT(*) AS n FROM tasks WHERE job_id = ? AND status IN "
                          "('completed','failed','canceled')", [job_id])[0]["n"]

    def completed_jobs_with_model(self, sha256: str, threads: int) -> list[dict[str, Any]]:
        """Jobs (id, spec_json), newest first, with a completed run of this model at these threads."""
        return self.query("SELECT DISTINCT j.id, j.spec_json FROM jobs j JOIN tasks t ON t.job_id = j.id "
                          "WHERE t.model_sha256 = ? AND t.threads = ? AND t.status = 'completed' ORDER BY j.id DESC",
                          [sha256, threads])

    def model_tasks(self, job_id: int, sha256: str, threads: int) -> list[dict[str, Any]]:
        """A job's tasks for one model at one thread count: their status and, when failed, why."""
        return self.query("SELECT status, failure_class, message FROM tasks WHERE job_id = ? AND model_sha256 = ? "
                          "AND threads = ? ORDER BY id", [job_id, sha256, threads])

    def device_health_by_name(self) -> dict[str, dict[str, Any]]:
        return {r["name"]: r for r in self.query("SELECT * FROM device_health")}

    def newest_calibration_at(self, device: str) -> float | None:
        return self.query("SELECT MAX(created_at) AS at FROM calibrations WHERE device = ?", [device])[0]["at"]

    # --- web: the evidence behind a failure, and the lab page's panels ---------------------------
    def dashboard_log_tails(self, run_ids: list[int]) -> dict[int, str]:
        """Each failed run's kept output (the sandbox's last lines), by run id; runs without one left out."""
        found: dict[int, str] = {}
        for start in range(0, len(run_ids), 500):  # SQLite's bound on ? parameters
            chunk = run_ids[start:start + 500]
            marks = ",".join("?" * len(chunk))
            for row in self.query(f"SELECT id, log_tail FROM runs WHERE id IN ({marks}) AND log_tail IS NOT NULL "
                                  "AND log_tail != ''", chunk):
                found[row["id"]] = row["log_tail"]
        return found

    def dashboard_recent_failures(self, limit: int) -> list[dict[str, Any]]:
        """The newest failed runs (not cancellations), each with its task's target and model."""
        return self.query(
            "SELECT r.id AS run_id, r.job_id, r.task_id, r.attempt, r.failure_class, r.message, r.finished_at, "
            "r.limits_memory_mb, t.target, t.model_name FROM runs r JOIN tasks t ON t.id = r.task_id "
            "WHERE r.status = 'failed' AND r.failure_class IS NOT NULL AND r.failure_class != 'canceled' "
            "ORDER BY r.id DESC LIMIT ?", [limit])

    def dashboard_drift_alerts(self, limit: int) -> list[dict[str, Any]]:
        """The newest refreshes whose drift exceeded a threshold."""
        return self.query("SELECT * FROM calibration_drift WHERE exceeded = 1 ORDER BY id DESC LIMIT ?", [limit])

    def dashboard_earlier_attempts(self, job_id: int) -> dict[int, list[dict[str, Any]]]:
        """Each task's runs before its counted one (why it was run again: contention or a lost attempt), by task."""
        found: dict[int, list[dict[str, Any]]] = {}
        for row in self.query("SELECT r.task_id, r.attempt, r.status, r.failure_class, r.contended FROM runs r "
                              "JOIN tasks t ON t.id = r.task_id WHERE r.job_id = ? AND r.id != t.last_run_id "
                              "ORDER BY r.task_id, r.attempt", [job_id]):
            found.setdefault(row.pop("task_id"), []).append(row)
        return found
