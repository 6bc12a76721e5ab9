"""A PostgreSQL lab's artifacts (models, script archives, datasets) content-addressed in its database.

Every controller on one database serves every artifact: an upload received by one is written here in
1 MiB chunks keyed by (sha256, index), and another controller streams it out chunk by chunk into its own
local folder (a cache) before serving it. Memory stays bounded both ways: one chunk at a time.

An artifact is visible only once complete: its chunks and its `artifact_blobs` row commit in one
transaction, under an advisory lock on its hash (two controllers storing the same bytes at once store
them once). Streaming uses connections of its own, never the store's writing connection, so a 100 MB
upload does not hold up results and leases. Garbage collection here is lab-wide: what no job in the
database names, untouched for the grace period, goes for every controller at once.

SQLite labs keep the local folder only (controller/scheduling/artifacts.py, ArtifactStore).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from farm.controller.store.interface import StoreError

if TYPE_CHECKING:
    from farm.controller.store.postgres import PostgresStore

CHUNK_BYTES = 1 << 20


class ArtifactChunks:
    """The artifact tables of one PostgreSQL store (its schema has them: postgres.ARTIFACT_DDL, upgrade 17)."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store

    def _connection(self) -> Any:
        """A connection of its own (closed by `with`): a long stream never holds the store's writer."""
        return self.store.own_connection()

    def _fail(self, doing: str, error: BaseException) -> StoreError:
        return StoreError(f"{doing} in {self.store.location}: {self.store.error_message(error)}")

    def stored(self, sha256: str) -> tuple[int, str] | None:
        """(size, file suffix) of a complete artifact in the database, else None."""
        try:
            with self._connection() as conn:
                row = conn.execute("SELECT size, suffix FROM artifact_blobs WHERE sha256 = %s", [sha256]).fetchone()
        except self.store._psycopg.Error as e:
            raise self._fail(f"looking up artifact {sha256[:12]}", e) from None
        return None if row is None else (int(row[0]), str(row[1]))

    def present(self, hashes: Iterable[str], *, now: float | None = None) -> set[str]:
        """Which of `hashes` the database holds; those are touched, so gc leaves what a client was just told
        is here (its submit follows)."""
        wanted = list(dict.fromkeys(hashes))
        if not wanted:
            return set()
        try:
            with self._connection() as conn:
                rows = conn.execute("UPDATE artifact_blobs SET touched_at = %s WHERE sha256 = ANY(%s) RETURNING sha256",
                                    [time.time() if now is None else now, wanted]).fetchall()
        except self.store._psycopg.Error as e:
            raise self._fail("looking up artifacts", e) from None
        return {str(r[0]) for r in rows}

    def put(self, sha256: str, size: int, suffix: str, path: Path) -> bool:
        """Store the verified file at `path` (its bytes hash to sha256) chunk by chunk; False when the
        database held it already (another controller stored it first)."""
        now = time.time()
        try:
            with self._connection() as conn, conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [sha256])
                if conn.execute("SELECT 1 FROM artifact_blobs WHERE sha256 = %s", [sha256]).fetchone():
                    return False
                conn.execute("DELETE FROM artifact_chunks WHERE sha256 = %s", [sha256])  # a blob-less leftover
                count, written = 0, 0
                with path.open("rb") as f:
                    while data := f.read(CHUNK_BYTES):
                        conn.execute("INSERT INTO artifact_chunks (sha256, idx, data) VALUES (%s, %s, %b)",  # %b: sent binary
                                     [sha256, count, data])
                        count += 1
                        written += len(data)
                if written != size:
                    raise StoreError(f"artifact {sha256[:12]}: the local copy {path} is {written} bytes, not {size}; "
                                     "nothing was stored")
                conn.execute("INSERT INTO artifact_blobs (sha256, size, suffix, chunks, stored_at, touched_at) "
                             "VALUES (%s, %s, %s, %s, %s, %s)", [sha256, size, suffix, count, now, now])
        except self.store._psycopg.Error as e:
            raise self._fail(f"storing artifact {sha256[:12]}", e) from None
        return True

    def read(self, sha256: str) -> Iterator[bytes]:
        """The artifact's bytes, one chunk per database round trip (the caller checks size and hash)."""
        try:
            with self._connection() as conn:
                row = conn.execute("SELECT chunks FROM artifact_blobs WHERE sha256 = %s", [sha256]).fetchone()
                if row is None:
                    raise StoreError(f"artifact {sha256[:12]} is no longer in {self.store.location} "
                                     "(collected meanwhile); upload it again")
                for idx in range(int(row[0])):
                    chunk = conn.execute("SELECT data FROM artifact_chunks WHERE sha256 = %s AND idx = %s",
                                         [sha256, idx], binary=True).fetchone()  # raw bytes, not hex text
                    if chunk is None:
                        raise StoreError(f"artifact {sha256[:12]}: chunk {idx} is missing from "
                                         f"{self.store.location} (collected meanwhile); upload it again")
                    yield bytes(chunk[0])
        except self.store._psycopg.Error as e:
            raise self._fail(f"reading artifact {sha256[:12]}", e) from None

    def collect(self, keep: set[str], grace_s: float, *, dry_run: bool = False,
                now: float | None = None) -> list[tuple[str, int]]:
        """Remove, lab-wide, the artifacts no job names (`keep`) and untouched for grace_s; (name, bytes) of each."""
        cutoff = (time.time() if now is None else now) - grace_s
        try:
            with self._connection() as conn, conn.transaction():
                rows = conn.execute("SELECT sha256, suffix, size FROM artifact_blobs WHERE touched_at <= %s "
                                    "AND NOT (sha256 = ANY(%s)) ORDER BY sha256 FOR UPDATE SKIP LOCKED",
                                    [cutoff, sorted(keep)]).fetchall()
                gone = [str(r[0]) for r in rows]
                if gone and not dry_run:
                    conn.execute("DELETE FROM artifact_chunks WHERE sha256 = ANY(%s)", [gone])
                    conn.execute("DELETE FROM artifact_blobs WHERE sha256 = ANY(%s)", [gone])
        except self.store._psycopg.Error as e:
            raise self._fail("collecting artifacts", e) from None
        return [(f"{r[0]}{r[1]}", int(r[2])) for r in rows]

