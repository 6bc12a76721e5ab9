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
from typing import Any, Callable, Iterator

import sqlite_utils

from farm.proto.results import FailureClass, ResultRefused, RunResult, RunStatus, TaskStatus

DB_ENV = "FARM_DB"


def default_db_path() -> Path:
    if os.environ.get(DB_ENV):
        return Path(os.environ[DB_ENV])
    from platformdirs import user_data_dir
    return Path(user_data_dir("farm", appauthor=False)) / "farm.db"


def _migration_1(db: sqlite_utils.Database) -> None:
    db["jobs"].create({
        "id": int, "name": str, "status": str, "priority": str, "created_at": float,
        "started_at": float, "finished_at": float, "spec_json": str, "spec_yaml": str,
        "source_path": str, "base_dir": str, "owner_pid": int, "owner_host": str, "message": str,
    }, pk="id")
    db["tasks"].create({
        "id": int, "job_id": int, "seq": int, "target": str, "model_name": str, "model_path": str,
        "model_sha256": str, "model_family": str, "model_facts_json": str, "threads": int,
        "batch_size": int, "input_size": int, "repeat": int, "status": str, "attempts": int,
        "max_attempts": int, "pair_key": str, "spec_json": str, "leased_by": str,
        "lease_expires_at": float, "priority": int, "created_at": float, "finished_at": float,
        "last_run_id": int, "failure_class": str, "message": str,
    }, pk="id", foreign_keys=[("job_id", "jobs", "id")])
    db["tasks"].create_index(["job_id", "seq"], unique=True)
    db["tasks"].create_index(["status", "priority", "id"])
    db["runs"].create({
        "id": int, "task_id": int, "job_id": int, "attempt": int, "status": str,
        "failure_class": str, "message": str, "agent": str, "started_at": float,
        "finished_at": float, "backend": str, "approximate": int, "limits_cpus": float,
        "limits_cpuset": str, "limits_memory_mb": float, "wall_s": float, "whole_run_s": float,
        "environment_json": str, "tool_versions_json": str, "log_tail": str,
    }, pk="id", foreign_keys=[("task_id", "tasks", "id"), ("job_id", "jobs", "id")])
    # A result delivered twice is applied once.
    db["runs"].create_index(["task_id", "attempt"], unique=True)
    db["runs"].create_index(["job_id"])
    db["summaries"].create({
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
    db["iterations"].create({"run_id": int, "idx": int, "ms": float}, pk=("run_id", "idx"))
    db["telemetry"].create({"run_id": int, "idx": int, "t_s": float, "cpu_percent": float,
                            "memory_bytes": int}, pk=("run_id", "idx"))


def _migration_2(db: sqlite_utils.Database) -> None:
    # Model facts become first-class columns so results can be filtered without JSON parsing.
    db["tasks"].add_column("model_size_bytes", int)
    db["tasks"].add_column("model_param_count", int)


def _migration_3(db: sqlite_utils.Database) -> None:
    # Calibrations are versioned per (device, metric, threads, runtime, family) key and keep
    # the runs they were fitted on.
    db["calibrations"].create({
        "id": int, "device": str, "metric": str, "threads": int, "runtime": str, "precision": str,
        "family": str, "version": int, "created_at": float, "kind": str, "n": int, "a": float,
        "b": float, "r2": float, "loo_mape": float, "within_10": float, "kendall_tau": float,
        "spearman_rho": float, "warnings_json": str, "fit_json": str, "source": str,
    }, pk="id")
    db["calibrations"].create_index(["device", "metric", "threads", "runtime", "family", "version"], unique=True)
    db["calibration_runs"].create({"calibration_id": int, "model": str, "sim_run_id": int, "device_run_id": int},
                                  foreign_keys=[("calibration_id", "calibrations", "id")])


def _migration_4(db: sqlite_utils.Database) -> None:
    # The gRPC controller remembers its agents and their devices, so `farm devices` still lists
    # a device whose agent is offline, and a restarted controller knows who to expect.
    db["agents"].create({
        "name": str, "session_id": str, "state": str, "farm_version": str, "capabilities_json": str,
        "hostname": str, "peer": str, "connected_at": float, "last_seen": float,
    }, pk="name")
    db["devices"].create({
        "name": str, "agent": str, "driver": str, "device_type": str, "tags_json": str,
        "facts_json": str, "slots": int, "state": str, "last_seen": float,
    }, pk="name")
    # Every applied result asks "is anything of this job left?"; without this it scans the job's tasks.
    db["tasks"].create_index(["job_id", "status"])


def _migration_5(db: sqlite_utils.Database) -> None:
    # A device's health is the lab's judgement (good / bad / maintenance), apart from whether
    # its agent is connected: a quarantined device gets no tasks until someone releases it.
    db["device_health"].create({"name": str, "health": str, "reason": str, "changed_at": float}, pk="name")


def _migration_6(db: sqlite_utils.Database) -> None:
    # Each refresh compares a device's new calibration with the one before it.
    db["calibration_drift"].create({
        "id": int, "device": str, "metric": str, "threads": int, "calibration_id": int, "previous_id": int,
        "slope_change": float, "intercept_change": float, "r2_drop": float, "prediction_shift": float,
        "exceeded": int, "reasons": str, "created_at": float,
    }, pk="id")


def _migration_7(db: sqlite_utils.Database) -> None:
    # The lease query's own order for one target (status = 'pending', target, then priority, job,
    # seq): SQLite walks the index and stops at the first task that fits, instead of sorting every
    # pending row, and never walks past other devices' backlogs.
    db["tasks"].create_index(["status", "target", "priority", "job_id", "seq"], index_name="idx_tasks_lease_order")
    db.execute("DROP INDEX IF EXISTS idx_tasks_status_priority_id")  # the old order (by id): a wasted write per task


def _migration_8(db: sqlite_utils.Database) -> None:
    # What a job is for: 'health_check' only for the reference suite farm itself submitted
    # (controller/reference_suite.py), 'user' for everything else, whatever its name.
    # Older jobs are not guessed from their name: golden-result history starts again.
    db["jobs"].add_column("kind", str, not_null_default="user")


def _migration_9(db: sqlite_utils.Database) -> None:
    # A sim run carries the evidence of whether its cores were its own; calibrations leave out
    # contended runs by default, so the flag is a column (indexed by the pair queries' joins on id).
    db["runs"].add_column("contended", int)
    db["runs"].add_column("contention_json", str)


def _migration_10(db: sqlite_utils.Database) -> None:
    # Batch size, input size and precision are part of a calibration's key: a model at batch 8 is
    # not a repeat of the same model at batch 1.
    db["calibrations"].add_column("batch_size", int)
    db["calibrations"].add_column("input_size", int)
    db.execute("UPDATE calibrations SET batch_size = 1 WHERE batch_size IS NULL")
    db.execute("DROP INDEX IF EXISTS idx_calibrations_device_metric_threads_runtime_family_version")
    db["calibrations"].create_index(["device", "metric", "threads", "runtime", "batch_size", "input_size",
                                     "precision", "family", "version"], unique=True)


MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [
    _migration_1, _migration_2, _migration_3, _migration_4, _migration_5, _migration_6, _migration_7, _migration_8,
    _migration_9, _migration_10]
SCHEMA_VERSION = len(MIGRATIONS)


class StoreError(Exception):
    pass


BUSY_TIMEOUT_S = 30


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


class Store:
    def __init__(self, path: Path | str) -> None:
        # Absolute from here on: run directories live beside the store and must not depend on the cwd.
        self.path = Path(path) if str(path) == ":memory:" else Path(path).expanduser().absolute()
        self._on_disk = str(path) != ":memory:"
        if self._on_disk:
            if self.path.is_dir():
                raise StoreError(f"{self.path} is a folder, not a farm store; give a file path such as {self.path / 'farm.db'}.")
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
                self.db["schema_version"].create({"version": int})
                self.db["schema_version"].insert({"version": 0})
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
        with self._lock:
            conn = self.db.conn
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
                return list(self.db.query(sql, params))
        try:
            conn = self._readers.get_nowait()
        except queue.Empty:
            conn = self._open_reader()
        try:
            cursor = conn.execute(sql, params)
            columns = [c[0] for c in cursor.description]
            return [dict(zip(columns, row)) for row in cursor]
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
            job_id = self.db["jobs"].insert(job).last_pk
            for t in tasks:
                t["job_id"] = job_id
            self.db["tasks"].insert_all(tasks)
        return job_id

    def job(self, job_id: int) -> dict[str, Any] | None:
        rows = self.query("SELECT * FROM jobs WHERE id = ?", [job_id])
        return rows[0] if rows else None

    def update_job(self, job_id: int, **fields: Any) -> None:
        with self.transaction():
            self.db["jobs"].update(job_id, fields)

    def tasks(self, job_id: int) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM tasks WHERE job_id = ? ORDER BY seq", [job_id])

    def task(self, task_id: int) -> dict[str, Any] | None:
        rows = self.query("SELECT * FROM tasks WHERE id = ?", [task_id])
        return rows[0] if rows else None

    def update_task(self, task_id: int, **fields: Any) -> None:
        with self.transaction():
            self.db["tasks"].update(task_id, fields)

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
            run_id = self.db["runs"].insert({
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
            }).last_pk
            self._insert_summary(run_id, result)
            if result.iterations_ms:  # executemany: a million samples in a second or two, not a minute
                self.db.conn.executemany("INSERT INTO iterations (run_id, idx, ms) VALUES (?, ?, ?)",
                                         ((run_id, i, ms) for i, ms in enumerate(result.iterations_ms)))
            if result.telemetry and result.telemetry.samples:
                self.db.conn.executemany(
                    "INSERT INTO telemetry (run_id, idx, t_s, cpu_percent, memory_bytes) VALUES (?, ?, ?, ?, ?)",
                    ((run_id, i, s.t_s, s.cpu_percent, s.memory_bytes) for i, s in enumerate(result.telemetry.samples)))
            self.db["tasks"].update(task["id"], {**task_fields, "last_run_id": run_id})
        return run_id

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
            if retry(t["attempts"], t["max_attempts"]):
                fields = {"status": TaskStatus.PENDING.value, "message": message}
            else:
                fields = {"status": TaskStatus.FAILED.value, "failure_class": FailureClass.INFRASTRUCTURE.value,
                          "finished_at": now, "message": f"{message} (attempt {t['attempts']} of {t['max_attempts']})"}
                failed_jobs.append(t["job_id"])
            self.db["tasks"].update(t["id"], {**fields, "leased_by": None, "last_run_id": run_id})
        return failed_jobs

    def _insert_summary(self, run_id: int, r: RunResult) -> None:
        row: dict[str, Any] = {"run_id": run_id, "baseline_memory_bytes": r.baseline_memory_bytes,
                               "peak_rss_bytes": r.peak_rss_bytes}
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
        self.db["summaries"].insert(row)

    def iterations(self, run_id: int) -> list[float]:
        return [r["ms"] for r in self.query("SELECT ms FROM iterations WHERE run_id = ? ORDER BY idx", [run_id])]

    def telemetry(self, run_id: int) -> list[dict[str, Any]]:
        return self.query("SELECT t_s, cpu_percent, memory_bytes FROM telemetry WHERE run_id = ? ORDER BY idx", [run_id])

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
