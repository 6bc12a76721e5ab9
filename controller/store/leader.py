"""Lab-wide duties on exactly one controller when several share one store (issue 32): the nightly refresh
(its submit, its artifact collection and the checks of each finished suite job).

Two primitives, one table each (schema migration 19, schema.LAB_WIDE_DDL), the same SQL on SQLite and PostgreSQL
(the shared repositories' `?` placeholders, controller/store/sql.py):
- a lease row per duty (`hold`): one holder at a time; it renews well within its TTL, and when it dies the
  first controller to ask after the TTL takes over;
- a claim per occurrence (`claim`): a cron tick or a job checked is done by whoever claims it first, once,
  lab-wide, so a hand-over between the lease's holders never submits or checks anything twice.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from farm.controller.store.interface import StoreError
from farm.controller.store.sql import Repository

log = logging.getLogger("farm.controller")


class LabDuties(Repository):
    def hold(self, duty: str, holder: str, ttl_s: float, *, now: float | None = None) -> bool:
        """Take or renew the duty's lease for ttl_s; True when `holder` has it (another's live lease: False)."""
        now = time.time() if now is None else now
        with self.store.transaction():
            self._execute(
                "INSERT INTO lab_leader (duty, holder, expires_at) VALUES (?, ?, ?) ON CONFLICT (duty) DO UPDATE "
                "SET holder = excluded.holder, expires_at = excluded.expires_at "
                "WHERE lab_leader.holder = excluded.holder OR lab_leader.expires_at < ?",
                [duty, holder, now + ttl_s, now])
            rows = self._query("SELECT holder FROM lab_leader WHERE duty = ?", [duty])
        return bool(rows) and rows[0]["holder"] == holder

    def holder(self, duty: str, *, now: float | None = None) -> str | None:
        """Who holds the duty's live lease (None: nobody, or a lease that ran out)."""
        now = time.time() if now is None else now
        rows = self._query("SELECT holder FROM lab_leader WHERE duty = ? AND expires_at >= ?", [duty, now])
        return str(rows[0]["holder"]) if rows else None

    def release(self, duty: str, holder: str) -> None:
        """`holder` gives the duty up (a controller stopping): the next to ask takes it at once, not after the TTL."""
        with self.store.transaction():
            self._execute("DELETE FROM lab_leader WHERE duty = ? AND holder = ?", [duty, holder])

    def claim(self, duty: str, occurrence: str, holder: str) -> bool:
        """Whether `holder` is the one to do this occurrence (the first to claim it, lab-wide)."""
        with self.store.transaction():
            self._execute("INSERT INTO lab_claims (duty, occurrence, holder, claimed_at) VALUES (?, ?, ?, ?) "
                          "ON CONFLICT (duty, occurrence) DO NOTHING", [duty, occurrence, holder, time.time()])
            rows = self._query("SELECT holder FROM lab_claims WHERE duty = ? AND occurrence = ?", [duty, occurrence])
        return bool(rows[0]["holder"] == holder)


class SweepLeader:
    """Whether this controller runs the lab-wide sweeps now (lease expiry, job deadlines: Controller.expire_leases):
    the one holding the "sweeps" lease. Asked every dispatch round, it writes at most every quarter TTL; when the
    holder dies its lease runs out and the next controller to ask takes it (within ttl_s and a quarter)."""

    DUTY = "sweeps"

    def __init__(self, duties: LabDuties, holder: str, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self.duties, self.holder, self.ttl_s, self.clock = duties, holder, ttl_s, clock
        self.leading = False
        self._next_ask = float("-inf")

    def __call__(self) -> bool:
        now = self.clock()
        if now < self._next_ask:
            return self.leading
        try:
            leading = self.duties.hold(self.DUTY, self.holder, self.ttl_s, now=now)
        except StoreError as e:  # the store is away: no sweep here (the others' leases are judged when it is back)
            log.warning("lab-wide sweeps paused on %s: %s", self.holder, e)
            leading = False
        if leading != self.leading:
            log.info("%s %s the lab-wide sweeps (lease expiry, job deadlines)", self.holder,
                     "takes over" if leading else "leaves")
        self.leading, self._next_ask = leading, now + self.ttl_s / 4
        return leading

    def release(self) -> None:
        """A controller stopping on purpose hands the sweeps on at once (a killed one: after its TTL)."""
        if self.leading:
            try:
                self.duties.release(self.DUTY, self.holder)
            except StoreError as e:
                log.warning("could not hand the lab-wide sweeps on from %s: %s", self.holder, e)
            self.leading = False
