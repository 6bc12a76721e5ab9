"""Lab-wide duties on exactly one controller when several share one store (issue 32): the nightly refresh
(its submit, its artifact collection and the checks of each finished suite job).

Two primitives, one table each, the same SQL on SQLite and PostgreSQL:
- a lease row per duty (`hold`): one holder at a time; it renews well within its TTL, and when it dies the
  first controller to ask after the TTL takes over;
- a claim per occurrence (`claim`): a cron tick or a job checked is done by whoever claims it first, once,
  lab-wide, so a hand-over between the lease's holders never submits or checks anything twice.
"""

from __future__ import annotations

import time
from typing import Any

DDL = ("CREATE TABLE IF NOT EXISTS lab_leader (duty TEXT PRIMARY KEY, holder TEXT NOT NULL, "
       "expires_at DOUBLE PRECISION NOT NULL)",
       "CREATE TABLE IF NOT EXISTS lab_claims (duty TEXT NOT NULL, occurrence TEXT NOT NULL, holder TEXT NOT NULL, "
       "claimed_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (duty, occurrence))")


class LabDuties:
    def __init__(self, store: Any) -> None:
        self.store = store
        postgres = type(store).__name__ == "PostgresStore"
        self._p = "%s" if postgres else "?"
        with store.transaction():
            if postgres:
                store.execute("SELECT pg_advisory_xact_lock(%s)", [0x6661726D4C])  # b"farmL": one creator at a time
            for statement in DDL:
                store.execute(statement)

    def hold(self, duty: str, holder: str, ttl_s: float, *, now: float | None = None) -> bool:
        """Take or renew the duty's lease for ttl_s; True when `holder` has it (another's live lease: False)."""
        now = time.time() if now is None else now
        p = self._p
        with self.store.transaction():
            self.store.execute(
                f"INSERT INTO lab_leader (duty, holder, expires_at) VALUES ({p}, {p}, {p}) ON CONFLICT (duty) DO UPDATE "
                "SET holder = excluded.holder, expires_at = excluded.expires_at "
                f"WHERE lab_leader.holder = excluded.holder OR lab_leader.expires_at < {p}",
                [duty, holder, now + ttl_s, now])
            rows = self.store.query(f"SELECT holder FROM lab_leader WHERE duty = {p}", [duty])
        return bool(rows) and rows[0]["holder"] == holder

    def holder(self, duty: str, *, now: float | None = None) -> str | None:
        """Who holds the duty's live lease (None: nobody, or a lease that ran out)."""
        now = time.time() if now is None else now
        rows = self.store.query(f"SELECT holder FROM lab_leader WHERE duty = {self._p} AND expires_at >= {self._p}",
                                [duty, now])
        return str(rows[0]["holder"]) if rows else None

    def claim(self, duty: str, occurrence: str, holder: str) -> bool:
        """Whether `holder` is the one to do this occurrence (the first to claim it, lab-wide)."""
        p = self._p
        with self.store.transaction():
            self.store.execute(f"INSERT INTO lab_claims (duty, occurrence, holder, claimed_at) VALUES ({p}, {p}, {p}, {p}) "
                               "ON CONFLICT (duty, occurrence) DO NOTHING", [duty, occurrence, holder, time.time()])
            rows = self.store.query(f"SELECT holder FROM lab_claims WHERE duty = {p} AND occurrence = {p}",
                                    [duty, occurrence])
        return bool(rows[0]["holder"] == holder)
