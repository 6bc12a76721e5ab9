"""`farm jobs` on an SQLite store that is up to date, read with sqlite3 alone: no store classes, no rows'
dataclasses, no results' models (issue 34 item 5: a listing starts in a fraction of the time).

The statements are the store's own (sql.py's Jobs.listing runs the same two); what is read is the same
listing, each job with its tasks by status (`counts`). Anything this reader cannot vouch for (no such file,
an older schema that a migration would bring up to date, a file that is not a store, a store another process
holds locked) answers None: the caller then opens the store as usual, which migrates it or says what is wrong.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from farm.controller.store.schema import up_to_date

# what Jobs.listing selects, newest first; `{where}` is the visibility clause of a `team` lab ("" embedded)
LISTING_SELECT = ("SELECT id, name, status, priority, created_at, started_at, finished_at, message, owner_pid, "
                  "owner_host, submitted_by, team FROM jobs {where}ORDER BY id DESC LIMIT ?")
# each listed job's tasks by status, from the counts the triggers keep; `{clause}`: the job ids
TASK_COUNTS_SELECT = "SELECT job_id, status, n FROM job_task_counts WHERE {clause} AND n > 0 ORDER BY job_id, status"
IDS_PER_STATEMENT = 500  # as the SQLite store's chunk: within every SQLite's bound on parameters
READ_TIMEOUT_MS = 30_000  # as the store's readers wait for another process's write


def read_listing(path: Path, limit: int) -> list[dict[str, Any]] | None:
    """The newest `limit` jobs of the SQLite store at `path` (an absolute file), each with its `counts`; None
    when it is not an up-to-date store in WAL mode this process can read now."""
    if not path.is_file():
        return None
    try:
        conn = sqlite3.connect(str(path), timeout=READ_TIMEOUT_MS / 1000, isolation_level=None)
    except sqlite3.Error:
        return None
    try:
        conn.execute(f"PRAGMA busy_timeout = {READ_TIMEOUT_MS}")
        conn.execute("PRAGMA query_only = ON")  # never a write, whatever follows
        if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal" or not up_to_date(conn):
            return None  # opening it as a store changes it first (WAL, migrations)
        return _listing(conn, limit)
    except sqlite3.Error:
        return None
    finally:
        conn.close()


def _listing(conn: sqlite3.Connection, limit: int) -> list[dict[str, Any]]:
    conn.execute("BEGIN")  # one snapshot: the counts belong to the jobs listed
    cursor = conn.execute(LISTING_SELECT.format(where=""), [limit])
    columns = [c[0] for c in cursor.description]
    jobs = [dict(zip(columns, row)) for row in cursor]
    counts: dict[int, dict[str, int]] = {}
    ids = [j["id"] for j in jobs]
    for start in range(0, len(ids), IDS_PER_STATEMENT):
        chunk = ids[start:start + IDS_PER_STATEMENT]
        clause = f"job_id IN ({','.join('?' for _ in chunk)})"
        for job_id, status, n in conn.execute(TASK_COUNTS_SELECT.format(clause=clause), chunk):
            counts.setdefault(job_id, {})[status] = n
    conn.execute("ROLLBACK")
    return [{**j, "counts": counts.get(j["id"], {})} for j in jobs]
