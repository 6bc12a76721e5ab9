"""Which controller each agent is connected to, when it last spoke and how many of its slots run a task:
shared through the store, so every controller on one database (and its dashboard, `farm agents`, `farm
devices`) shows the whole lab the same way, not only the agents on its own streams.

Each controller writes the rows of its own agents (when one connects or leaves, and every quarter lease TTL
with its keep-alive); a row not refreshed for a lease TTL is a dead controller's and counts for nothing.
The same SQL runs on SQLite and PostgreSQL (only the placeholder differs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DDL = ("CREATE TABLE IF NOT EXISTS agent_presence (agent TEXT PRIMARY KEY, controller TEXT NOT NULL, "
       "state TEXT NOT NULL, last_seen DOUBLE PRECISION NOT NULL, connected_at DOUBLE PRECISION NOT NULL, "
       "busy BIGINT NOT NULL, slots BIGINT NOT NULL)")  # not REAL: PostgreSQL's is 4 bytes, seconds since 1970 lose minutes


@dataclass(frozen=True)
class Seen:
    """One agent as the controller it is connected to last published it."""

    agent: str
    controller: str  # that controller's address (HOST:PORT)
    state: str  # online / draining
    last_seen: float
    connected_at: float
    busy: int  # slots running a task
    slots: int


class Presence:
    def __init__(self, store: Any) -> None:
        self.store = store
        self._p = "%s" if type(store).__name__ == "PostgresStore" else "?"
        with store.transaction():
            if type(store).__name__ == "PostgresStore":
                store.execute("SELECT pg_advisory_xact_lock(%s)", [0x6661726D50])  # b"farmP": one creator at a time
            store.execute(DDL)

    def publish(self, controller: str, seen: Sequence[Seen], *, complete: bool) -> None:
        """Store `seen` as `controller`'s; complete: these are all its agents (the others it listed went away)."""
        p = self._p
        with self.store.transaction():
            for s in seen:
                self.store.execute(
                    f"INSERT INTO agent_presence (agent, controller, state, last_seen, connected_at, busy, slots) "
                    f"VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {p}) ON CONFLICT (agent) DO UPDATE SET "
                    "controller = excluded.controller, state = excluded.state, last_seen = excluded.last_seen, "
                    "connected_at = excluded.connected_at, busy = excluded.busy, slots = excluded.slots",
                    [s.agent, controller, s.state, s.last_seen, s.connected_at, s.busy, s.slots])
            if complete:
                names = [s.agent for s in seen]
                listed = ", ".join([p] * len(names))
                self.store.execute(f"DELETE FROM agent_presence WHERE controller = {p}"
                                   + (f" AND agent NOT IN ({listed})" if names else ""), [controller, *names])

    def withdraw(self, controller: str, agent: str) -> None:
        """The agent left `controller` (a row another controller wrote since, after a move, stays)."""
        with self.store.transaction():
            self.store.execute(f"DELETE FROM agent_presence WHERE agent = {self._p} AND controller = {self._p}",
                               [agent, controller])

    def fresh(self, since: float) -> list[Seen]:
        """Every agent some controller published at or after `since`, by name."""
        return [Seen(r["agent"], r["controller"], r["state"], float(r["last_seen"]), float(r["connected_at"]),
                     int(r["busy"]), int(r["slots"]))
                for r in self.store.query(f"SELECT * FROM agent_presence WHERE last_seen >= {self._p} ORDER BY agent",
                                          [since])]
