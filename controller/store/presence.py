"""Which controller each agent is connected to, when it last spoke and how many of its slots run a task:
shared through the store, so every controller on one database (and its dashboard, `farm agents`, `farm
devices`) shows the whole lab the same way, not only the agents on its own streams.

Each controller writes the rows of its own agents (when one connects or leaves, and every quarter lease TTL
with its keep-alive); a row not refreshed for a lease TTL is a dead controller's and counts for nothing.
The same SQL runs on SQLite and PostgreSQL through the shared repositories' dialect hooks (controller/store/sql.py:
placeholders, list membership); the table is schema migration 19 (schema.LAB_WIDE_DDL).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from farm.controller.store.sql import Repository


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


class Presence(Repository):
    def publish(self, controller: str, seen: Sequence[Seen], *, complete: bool) -> None:
        """Store `seen` as `controller`'s; complete: these are all its agents (the others it listed went away)."""
        with self.store.transaction():
            for s in seen:
                self._execute(
                    "INSERT INTO agent_presence (agent, controller, state, last_seen, connected_at, busy, slots) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (agent) DO UPDATE SET "
                    "controller = excluded.controller, state = excluded.state, last_seen = excluded.last_seen, "
                    "connected_at = excluded.connected_at, busy = excluded.busy, slots = excluded.slots",
                    [s.agent, controller, s.state, s.last_seen, s.connected_at, s.busy, s.slots])
            if complete:
                names = [s.agent for s in seen]
                if not names:
                    self._execute("DELETE FROM agent_presence WHERE controller = ?", [controller])
                else:
                    listed, params = self.store.any_of("agent", names)
                    self._execute(f"DELETE FROM agent_presence WHERE controller = ? AND NOT ({listed})",
                                  [controller, *params])

    def withdraw(self, controller: str, agent: str) -> None:
        """The agent left `controller` (a row another controller wrote since, after a move, stays)."""
        with self.store.transaction():
            self._execute("DELETE FROM agent_presence WHERE agent = ? AND controller = ?", [agent, controller])

    def fresh(self, since: float) -> list[Seen]:
        """Every agent some controller published at or after `since`, by name."""
        return [Seen(r["agent"], r["controller"], r["state"], float(r["last_seen"]), float(r["connected_at"]),
                     int(r["busy"]), int(r["slots"]))
                for r in self._query("SELECT * FROM agent_presence WHERE last_seen >= ? ORDER BY agent", [since])]
