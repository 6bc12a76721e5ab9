"""`farm store migrate`: a lab's SQLite file copied whole into an empty PostgreSQL database.

Every table of the lab (jobs, tasks, runs with their summaries, packed samples and op profiles,
calibrations with their runs and drift, agents, devices and their health, artifact uploads) is read
from one snapshot of the file and written in one PostgreSQL transaction, ids kept: the copy arrives
whole or not at all, and `farm results`/`farm calibrations` answer the same from either store. The
per-job task counts are rebuilt by the database's trigger as tasks arrive. The SQL is in the two
stores (sqlite.export_rows, postgres.import_rows); this module only moves rows between them.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable

from farm.controller.store.artifacts_db import ArtifactChunks
from farm.controller.store.interface import StoreError
from farm.controller.store.postgres import TABLES, PostgresStore
from farm.controller.store.sqlite import SQLiteStore
from farm.proto.names import SAFE_SUFFIX, SHA256_HEX

__all__ = ["copy_artifacts", "copy_lab"]


def copy_lab(source: SQLiteStore, target: PostgresStore, *,
             on_batch: Callable[[str, int], None] | None = None) -> dict[str, int]:
    """Copy every row of the lab at `source` into the empty `target`; rows copied per table."""
    live = source.live_job_ids(time.time())
    if live:  # its runner or controller still writes: the copy would stop half-way through its results
        jobs = ", ".join(str(j) for j in live[:10])
        raise StoreError(f"{source.path}: job(s) {jobs} still run (their tasks' leases are live), so the lab is still "
                         "being written. Stop the controller (or let `farm run` finish, or `farm cancel` the job) "
                         "and migrate again once no task runs; nothing was copied.")
    holding = target.tables_with_rows(TABLES)
    if holding:
        raise StoreError(f"{target.location} already holds a lab (rows in {', '.join(holding)}): farm migrates into "
                         "an empty database only, so nothing of either lab is overwritten. Create a new database "
                         "(createdb) and give its URL to --to.")
    copied = dict.fromkeys(TABLES, 0)
    with target.transaction():
        for table, rows in source.export_rows(TABLES):
            try:
                target.import_rows(table, rows)
            except Exception as e:  # a value PostgreSQL refuses (SQLite stores any type in any column)
                if isinstance(e, StoreError) or not type(e).__module__.startswith("psycopg"):
                    raise
                first, last = rows[0].get("id", rows[0].get("run_id")), rows[-1].get("id", rows[-1].get("run_id"))
                raise StoreError(f"{source.path}: table {table}, rows {first}..{last}, cannot be stored in "
                                 f"{target.location}: {target.error_message(e)}. Nothing was copied.") from None
            copied[table] += len(rows)
            if on_batch:
                on_batch(table, copied[table])
        target.continue_ids()
    return copied


def artifacts_folder(path: Path) -> Path:
    """A store's artifact folder (controller/grpc_server.controller_files): `farm.db` -> `farm-artifacts/`."""
    return path.with_name(path.stem + "-artifacts")


def copy_artifacts(source: SQLiteStore, target: PostgresStore) -> int:
    """The uploaded models and script folders beside the SQLite file, copied to the folder a controller on
    `target` serves from on this host; how many files (0 when the lab has none)."""
    origin, destination = artifacts_folder(source.path), artifacts_folder(target.path)
    if not origin.is_dir():
        return 0
    shutil.copytree(origin, destination, dirs_exist_ok=True)
    destination.chmod(0o700)
    chunks = ArtifactChunks(target)  # and into the database, so every controller of the lab serves them
    for path in sorted(destination.iterdir()):
        if path.is_file() and SHA256_HEX.match(path.name[:64]) and SAFE_SUFFIX.match(path.name[64:]):
            chunks.put(path.name[:64], path.stat().st_size, path.name[64:], path)  # checked by hash when served
    return sum(1 for p in destination.rglob("*") if p.is_file())
