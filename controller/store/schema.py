"""The SQLite schema: ordered migrations, each run once in the transaction that upgrades a store.

A migration keeps its number forever (stores in the field are at every version); a new one is appended.
Each is written with sqlite_utils' table API where it fits (create, add_column, create_index) and plain
SQL where SQLite needs its own words (triggers, WITHOUT ROWID). A PostgreSQL store has its own schema
module: nothing here crosses the store interface (controller/store/interface.py).
"""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING, Any, Callable, Collection

from farm.controller.store.figure_columns import FIGURE_COLUMNS

__all__ = ["FIGURE_COLUMN_TYPES", "LAB_WIDE_DDL", "LAB_WIDE_TABLES", "MIGRATIONS", "MOVE_MODEL_FACTS", "PACKED_SAMPLES", "SCHEMA_VERSION", "database", "figure_columns_to_add", "migrate", "schema_version", "sqlite_utils",
           "up_to_date"]


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


def __getattr__(name: str) -> Any:  # PEP 562: sqlite_utils (with click and dateutil, ~0.15 s) loads on first use
    if name == "sqlite_utils":
        module = _sqlite_utils_without_numpy()
        globals()["sqlite_utils"] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def database(conn: sqlite3.Connection) -> sqlite_utils.Database:
    """sqlite_utils' table API over `conn`: only a migration (or a test) needs it, so a read-only command that
    opens an up-to-date store never imports it (issue 34)."""
    db: sqlite_utils.Database = _sqlite_utils_without_numpy().Database(conn)
    return db


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


def _migration_15(db: sqlite_utils.Database) -> None:
    # Per-iteration timings and telemetry packed per run (issue 22, controller/store/samples.py): a row per
    # sample cost 38 bytes for each 8-byte timing. Runs stored before move over after this migration, a batch
    # of runs per transaction (sqlite.pack_stored_samples), so a killed conversion resumes where it stopped;
    # migration 16 drops the old tables once they are empty.
    db.table("run_samples").create({"run_id": int, "iterations": bytes, "telemetry": bytes}, pk="run_id",
                                   if_not_exists=True)


def _migration_16(db: sqlite_utils.Database) -> None:
    # Every run's samples are packed (migration 15's conversion is done): the row-per-sample tables go.
    db.execute("DROP TABLE IF EXISTS iterations")
    db.execute("DROP TABLE IF EXISTS telemetry")


def _migration_17(db: sqlite_utils.Database) -> None:
    # A job's deadline (issue 32): submit time + timeouts.job, stored so every controller's sweep ends a job
    # that outlives it, embedded or served, however often it is resumed; `farm retry` sets a new one.
    if "deadline_at" not in db.table("jobs").columns_dict:  # a store replayed from an older version number has it
        db.table("jobs").add_column("deadline_at", float)
    db.table("jobs").create_index(["deadline_at"], if_not_exists=True)


def _migration_18(db: sqlite_utils.Database) -> None:
    # A job's task plans stored once (issue 35, item 4): every task carried its plan (workload, sim budget,
    # timeouts; ~1.4 KB) though a job has a few distinct ones (a device's sim twin's budget, a model entry's
    # inputs). Tasks name their plan; the plans already stored move over, each distinct one once per job.
    # (each step holds when replayed on a store that has it: a store replayed from an older version number)
    db.execute("CREATE TABLE IF NOT EXISTS task_plans (id INTEGER PRIMARY KEY, job_id INTEGER REFERENCES jobs(id), "
               "plan_json TEXT)")
    db.execute("CREATE INDEX IF NOT EXISTS idx_task_plans_job_id ON task_plans (job_id)")
    if "plan_id" not in db.table("tasks").columns_dict:
        db.table("tasks").add_column("plan_id", int)
    db.execute("INSERT INTO task_plans (job_id, plan_json) SELECT job_id, spec_json FROM tasks "
               "WHERE spec_json IS NOT NULL AND job_id IS NOT NULL GROUP BY job_id, spec_json ORDER BY MIN(id)")
    db.execute("UPDATE tasks SET plan_id = (SELECT p.id FROM task_plans p WHERE p.job_id = tasks.job_id "
               "AND p.plan_json = tasks.spec_json), spec_json = NULL WHERE spec_json IS NOT NULL AND job_id IS NOT NULL")


def _migration_19_lab_wide_tables(db: sqlite_utils.Database) -> None:
    # The lab-wide tables of issue 32, which main created with CREATE TABLE IF NOT EXISTS when a controller first
    # opened them (a store may hold them already, hence IF NOT EXISTS here too): which controller each agent is
    # on (controller/store/presence.py), and the leader's lease per duty and the claim per occurrence
    # (controller/store/leader.py), and clients' submit keys. A step of its own, so other schema changes number around it.
    for statement in LAB_WIDE_DDL:
        db.execute(statement)


def _migration_20_model_facts(db: sqlite_utils.Database) -> None:
    # A job's model facts stored once (issue 35): each task carried its model's facts JSON (inspect's inputs,
    # outputs and operators, ~500 B for a real model) though a job has a few models. Tasks name their facts row,
    # as they name their plan (migration 18); the facts already stored move over, each distinct one once per job.
    # (each step holds when replayed on a store that has it)
    db.execute("CREATE TABLE IF NOT EXISTS model_facts (id INTEGER PRIMARY KEY, job_id INTEGER REFERENCES jobs(id), "
               "facts_json TEXT)")
    db.execute("CREATE INDEX IF NOT EXISTS idx_model_facts_job_id ON model_facts (job_id)")
    if "facts_id" not in db.table("tasks").columns_dict:
        db.table("tasks").add_column("facts_id", int)
    db.execute(MOVE_MODEL_FACTS[0])
    db.execute(MOVE_MODEL_FACTS[1])


# Migration 20's move, the same SQL in both databases (postgres.py's upgrade from 19 takes it too).
MOVE_MODEL_FACTS = (
    "INSERT INTO model_facts (job_id, facts_json) SELECT job_id, model_facts_json FROM tasks "
    "WHERE model_facts_json IS NOT NULL AND job_id IS NOT NULL GROUP BY job_id, model_facts_json ORDER BY MIN(id)",
    "UPDATE tasks SET facts_id = (SELECT f.id FROM model_facts f WHERE f.job_id = tasks.job_id "
    "AND f.facts_json = tasks.model_facts_json), model_facts_json = NULL "
    "WHERE model_facts_json IS NOT NULL AND job_id IS NOT NULL",
)


# The same DDL in both databases (postgres.py's SCHEMA and its upgrade from 17 take it too): float8 and bigint,
# not REAL (PostgreSQL's is 4 bytes: seconds since 1970 would lose minutes).
LAB_WIDE_DDL = (
    "CREATE TABLE IF NOT EXISTS agent_presence (agent TEXT PRIMARY KEY, controller TEXT NOT NULL, "
    "state TEXT NOT NULL, last_seen DOUBLE PRECISION NOT NULL, connected_at DOUBLE PRECISION NOT NULL, "
    "busy BIGINT NOT NULL, slots BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS lab_leader (duty TEXT PRIMARY KEY, holder TEXT NOT NULL, "
    "expires_at DOUBLE PRECISION NOT NULL)",
    "CREATE TABLE IF NOT EXISTS lab_claims (duty TEXT NOT NULL, occurrence TEXT NOT NULL, holder TEXT NOT NULL, "
    "claimed_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (duty, occurrence))",
    # a client's submit key per owner ('' for the lab's own): a submit repeated through another controller after
    # a lost answer finds the job the first one made (Controller.submit_once)
    "CREATE TABLE IF NOT EXISTS submit_keys (owner TEXT NOT NULL, submit_key TEXT NOT NULL, job_id BIGINT, "
    "at DOUBLE PRECISION NOT NULL, PRIMARY KEY (owner, submit_key))",
)
LAB_WIDE_TABLES = ("agent_presence", "lab_leader", "lab_claims", "submit_keys")


# The declared run figures (farm.proto.results.FIGURES, read here from their generated plain copy,
# figure_columns.py, so opening a store loads no pydantic) are columns of summaries, added from the declaration
# wherever a store lacks one, on opening it (SQLite: `migrate`, and `up_to_date` says no; PostgreSQL:
# postgres.py's _add_figure_columns): a new figure needs no numbered migration and no schema version, and a farm
# of an earlier version still opens the store (it names the columns it reads and writes; the new one stays NULL).
# The same DDL in both databases (SQLite's affinity of BIGINT is INTEGER, of DOUBLE PRECISION REAL).
FIGURE_COLUMN_TYPES: dict[str, str] = {"int": "BIGINT", "float": "DOUBLE PRECISION"}


def figure_columns_to_add(present: Collection[str]) -> list[str]:
    """The statements adding each declared figure's column that summaries' columns `present` lack."""
    return [f"ALTER TABLE summaries ADD COLUMN {name} {FIGURE_COLUMN_TYPES[column]}" for name, column in FIGURE_COLUMNS
            if name not in present]


def _summary_columns(db: sqlite_utils.Database | sqlite3.Connection) -> list[str]:
    return [row[1] for row in db.execute("PRAGMA table_info(summaries)").fetchall()]


MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [
    _migration_1, _migration_2, _migration_3, _migration_4, _migration_5, _migration_6, _migration_7, _migration_8,
    _migration_9, _migration_10, _migration_11, _migration_12, _migration_13, _migration_14, _migration_15,
    _migration_16, _migration_17, _migration_18, _migration_19_lab_wide_tables, _migration_20_model_facts]
SCHEMA_VERSION = len(MIGRATIONS)
# The schema at which stored samples are converted, in transactions of their own, before going further.
PACKED_SAMPLES = 15


def migrate(db: sqlite_utils.Database, path: object, upto: int = SCHEMA_VERSION) -> None:
    """Bring the store at `db` to schema `upto` (never back), inside the caller's write transaction."""
    if "schema_version" not in db.table_names():
        db.table("schema_version").create({"version": int})
        db.table("schema_version").insert({"version": 0})
    current = schema_version(db)
    if current > SCHEMA_VERSION:
        from farm.controller.store.interface import StoreError

        raise StoreError(
            f"{path} was written by a newer farm (schema {current}, this farm knows {SCHEMA_VERSION}); upgrade farm")
    for version in range(current, upto):
        MIGRATIONS[version](db)
    if current < upto:
        db.execute("UPDATE schema_version SET version = ?", [upto])
    if upto == SCHEMA_VERSION:
        for statement in figure_columns_to_add(_summary_columns(db)):
            db.execute(statement)


def schema_version(db: sqlite_utils.Database | sqlite3.Connection) -> int:
    row = db.execute("SELECT version FROM schema_version").fetchone()
    return int(row[0])


def up_to_date(db: sqlite_utils.Database | sqlite3.Connection) -> bool:
    """Plain SQL, so opening an up-to-date store needs no sqlite_utils."""
    has_table = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'").fetchone()
    return (has_table is not None and schema_version(db) == SCHEMA_VERSION
            and not figure_columns_to_add(_summary_columns(db)))
