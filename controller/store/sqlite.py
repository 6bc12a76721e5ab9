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

import math
import os
import queue
import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterator, Mapping, Sequence

from farm.controller.store.interface import StoreError
from farm.controller.store.metrics import MiB
from farm.controller.store.rows import TaskRow
from farm.controller.store.samples import pack_iterations, pack_telemetry
from farm.controller.store.schema import PACKED_SAMPLES, SCHEMA_VERSION, database, migrate, schema_version, up_to_date
from farm.controller.store.sql import (
    close_idle,
    COMMON_METRIC_SQL, HEALTHY_TARGET, TASK_FROM, TASK_SELECT, Leases, RepositoryStore)

if TYPE_CHECKING:
    import sqlite_utils

__all__ = ["HEALTHY_TARGET", "SCHEMA_VERSION", "SQLiteStore", "store_error_message"]
BUSY_TIMEOUT_S = 30  # how long a writer waits for a store another process holds locked (default)
BUSY_ENV = "FARM_STORE_WAIT_S"  # seconds, overriding BUSY_TIMEOUT_S
# SQLite's bound on ? parameters in one statement, with room to spare
CHUNK = 500
# runs converted per transaction when an older store's samples are packed (migration 15)
PACK_BATCH_RUNS = 200

# each metric's SQL (sql.COMMON_METRIC_SQL, and these in this database's own)
METRIC_SQL: dict[str, str] = {
    **COMMON_METRIC_SQL,
    "peak_memory": f"{{s}}.peak_memory_bytes / {float(MiB)}",
    "avg_memory": f"{{s}}.avg_memory_bytes / {float(MiB)}",
    "energy": "json_extract({r}.environment_json, '$.energy_per_inference_mj')",
}


def busy_timeout_s() -> float:
    """Seconds a connection waits on a store another process holds locked: $FARM_STORE_WAIT_S, else 30."""
    raw = os.environ.get(BUSY_ENV, "").strip()
    if not raw:
        return BUSY_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= 3600:  # NaN fails too
        raise StoreError(f"{BUSY_ENV}={raw[:40]!r} is not a number of seconds from 0 (exclusive) to 3600; "
                         f"unset it for the default {BUSY_TIMEOUT_S} s.")
    return value


def store_error_message(path: Path, error: sqlite3.Error) -> str:
    """What a person can do about an SQLite error on the store, in one paragraph."""
    text = str(error)
    if "not a database" in text or "malformed" in text:
        return (f"{path} is not a farm store that can be read (not SQLite, or damaged: {text}). farm did not "
                "change it; point --db (or FARM_DB) at another file, or restore it from a backup.")
    if "locked" in text or "busy" in text:
        return (f"{path} is locked by another process (waited {_wait_shown()} s: {text}); nothing was written. "
                "Wait for that process (e.g. another `farm submit`) to finish, or stop it, and try again.")
    if "disk is full" in text or "database or disk is full" in text:
        return (f"the disk holding the store {path} is full ({text}): nothing more could be stored; what was stored "
                "is kept. Free space there, then `farm resume JOB` carries on an interrupted job (`farm jobs` lists it).")
    if "readonly" in text or "unable to open" in text or "disk I/O" in text:
        return (f"{path} cannot be opened for writing ({text}): check that the file and its folder are writable "
                "by you (farm also writes the -wal and -shm files beside it), or point --db at another file.")
    return f"the store {path} failed: {text}"


def _wait_shown() -> str:
    try:
        return f"{busy_timeout_s():g}"
    except StoreError:  # refused when the store was opened; the message here is about the lock
        return str(BUSY_TIMEOUT_S)


def _rows(cursor: sqlite3.Cursor) -> list[dict[str, Any]]:
    columns = [c[0] for c in cursor.description]
    return [dict(zip(columns, row)) for row in cursor]


def _marks(values: Sequence[Any]) -> str:
    return ",".join("?" for _ in values)


class SQLiteStore(RepositoryStore):
    """The store in one SQLite file (or ":memory:"), its repositories over one connection."""

    def __init__(self, path: Path | str, *, create_folder: bool = False) -> None:
        """create_folder: make a missing folder of the store; otherwise it is an error (a mistyped --db
        would otherwise look like a store whose results were lost)."""
        # Absolute from here on: run directories live beside the store and must not depend on the cwd.
        self.path = Path(path) if str(path) == ":memory:" else Path(path).expanduser().absolute()
        self._on_disk = str(path) != ":memory:"
        self.location = str(self.path)
        wait_s = busy_timeout_s()  # a bad $FARM_STORE_WAIT_S is refused before the file is made or opened
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
            conn = sqlite3.connect(str(self.path), check_same_thread=False, timeout=wait_s, isolation_level=None)
            conn.execute(f"PRAGMA busy_timeout = {round(wait_s * 1000)}")
            conn.execute("PRAGMA recursive_triggers = ON")  # as sqlite_utils.Database(conn) sets it
            self.conn = conn
            self._db: sqlite_utils.Database | None = None
            if self._on_disk and conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                conn.execute("PRAGMA journal_mode = wal")  # no transaction is open yet (sqlite_utils' enable_wal)
            conn.execute("PRAGMA foreign_keys = ON")
            self._migrate()
        except sqlite3.Error as e:
            raise StoreError(store_error_message(self.path, e)) from None
        self.attach_repositories(SQLiteLeases)

    @property
    def db(self) -> sqlite_utils.Database:
        """sqlite_utils' table API over the writing connection, made on first use: migrations (and tests) use it;
        opening an up-to-date store and every statement farm runs go to `conn` and never import sqlite_utils."""
        if self._db is None:
            self._db = database(self.conn)
        return self._db

    # --- schema ------------------------------------------------------------
    def _migrate(self) -> None:
        # An up-to-date store is only read here, so opening one works while another process writes.
        if up_to_date(self.conn):
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
        return schema_version(self.conn)

    def has_table(self, table: str) -> bool:
        return bool(self.query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", [table]))

    def on_queue_change(self, wake: Callable[[], None]) -> None:
        """Nothing to listen to: one controller serves an SQLite store, and wakes its own dispatcher."""

    def sync_normal(self) -> None:
        """WAL + NORMAL survives a killed process intact; only a power cut can drop the last commits, and
        then their tasks re-run when the leases run out. It saves an fsync per lease and per result."""
        with self._lock:
            self.conn.execute("PRAGMA synchronous = NORMAL")

    # --- connection and transactions ----------------------------------------
    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One write transaction; inside another one it is a savepoint, so a step of a batch (one result
        of many) that fails undoes only its own writes and the batch still commits once."""
        with self._lock:
            conn = self.conn
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
                return _rows(self.conn.execute(sql, params))
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
        cursor: sqlite3.Cursor = self.conn.execute(sql, params)
        return cursor

    def _open_reader(self) -> sqlite3.Connection:
        conn = sqlite3.connect(str(self.path), check_same_thread=False, timeout=30, isolation_level=None)
        conn.execute("PRAGMA busy_timeout = 30000")
        conn.execute("PRAGMA query_only = ON")
        return conn

    def live_job_ids(self, now: float) -> list[int]:
        """Jobs with a task whose lease still holds at `now`: a runner or controller still writes them."""
        return [r["job_id"] for r in self.query(
            "SELECT DISTINCT job_id FROM tasks WHERE status = 'running' AND "
            "(lease_expires_at IS NULL OR lease_expires_at > ?) ORDER BY job_id", [now])]

    def export_rows(self, tables: Sequence[str], batch: int = 1000) -> Iterator[tuple[str, list[dict[str, Any]]]]:
        """Every row of each of `tables`, a batch at a time in insertion order, all from one read snapshot
        (a writer at the same time changes nothing of what is read): `farm store migrate`'s source."""
        known = {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        for table in tables:
            if table not in known:
                raise StoreError(f"{self.path} has no table {table!r}: not a farm store at schema {SCHEMA_VERSION}")
        conn = self._open_reader() if self._on_disk else self.conn
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
            self.conn.close()
        close_idle(self._readers)

    # --- SQLite's answers to the shared repositories' questions (sql.py's Dialect) -----------------------
    chunk = CHUNK
    same = "IS"
    lock_rows = ""  # the writer holds the whole database from BEGIN IMMEDIATE on
    metric_sql = METRIC_SQL

    def sql(self, text: str) -> str:
        return text

    def any_of(self, column: str, values: Sequence[Any]) -> tuple[str, list[Any]]:
        return f"{column} IN ({_marks(values)})", list(values)

    def lock_table(self, table: str) -> str | None:
        return None

    def json_text(self, column: str, key: str) -> str:
        return f"json_extract({column}, '$.{key}')"

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self.conn.executemany(sql, rows)

    def next_ids(self, table: str, count: int) -> list[int]:
        """Inside the write transaction (BEGIN IMMEDIATE holds the database): the ids SQLite itself would give
        the next `count` rows of a table whose id is its rowid (one more than the largest, no AUTOINCREMENT)."""
        assert getattr(self._local, "writing", False), "next_ids outside a write transaction"
        top = self.conn.execute(f"SELECT COALESCE(MAX(id), 0) FROM {_table_name(table)}").fetchone()[0]
        return list(range(int(top) + 1, int(top) + 1 + count))

    # Plain statements on the hot path (a result, a lease): sqlite_utils' insert and update read the
    # table's schema on every call, which was most of a result's cost in the scheduling benchmark.
    def insert_row(self, table: str, row: Mapping[str, Any], *, returning: str | None = "id") -> int:
        """returning: kept for the Dialect's signature; SQLite answers the new rowid either way."""
        sql = f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})"
        row_id = self.conn.execute(sql, list(row.values())).lastrowid
        assert row_id is not None  # an INSERT always sets it
        return int(row_id)

    def update_row(self, table: str, pk: int, fields: Mapping[str, Any]) -> None:
        if fields:
            sql = f"UPDATE {table} SET {', '.join(f'{k} = ?' for k in fields)} WHERE id = ?"
            self.conn.execute(sql, [*fields.values(), pk])


def _table_name(name: str) -> str:
    if not name.replace("_", "").isalnum():
        raise ValueError(f"not a table name: {name[:40]!r}")
    return name


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
        [(run_id, pack_iterations(timings[run_id], exact=True) if timings[run_id] else None,
          pack_telemetry(samples[run_id]) if samples[run_id] else None) for run_id in run_ids])
    db.execute(f"DELETE FROM iterations WHERE run_id IN ({marks})", run_ids)
    db.execute(f"DELETE FROM telemetry WHERE run_id IN ({marks})", run_ids)
    return len(run_ids)


class SQLiteLeases(Leases):
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
                f"SELECT {TASK_SELECT} FROM {TASK_FROM} JOIN jobs j ON j.id = t.job_id WHERE {where} "
                "ORDER BY t.priority, t.job_id, t.seq LIMIT ?", [target, *([job_id] if job_id is not None else []), limit])
            rows += [TaskRow.of(r) for r in _rows(cursor)]
        rows.sort(key=lambda t: (t.priority, t.job_id, t.seq))
        return rows[:limit]
