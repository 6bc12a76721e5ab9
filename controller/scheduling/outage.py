"""The lab's store out of reach (a PostgreSQL server restarting, its connections killed): said once, not once per
thread and round.

Every thread that writes (the dispatcher, the result writer, the lease renewer) meets the same outage; each asks
`StoreOutage.failed(error)` whether the error is one (store.lost_connection), and the first to meet it logs one
warning. The first call that works again logs when the store came back and how long it was away. Meanwhile nothing
is lost: an agent keeps every result until it is acknowledged after its commit, and sends it again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from farm.controller.store import lost_connection

log = logging.getLogger("farm.controller")


class StoreOutage:
    def __init__(self, location: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.location = location
        self.clock = clock
        self.since: float | None = None  # when the current outage began (None: the store answers)
        self.outages = 0  # outages met since this controller started
        self._lock = threading.Lock()

    def failed(self, error: BaseException, doing: str) -> bool:
        """True when `error` is the store out of reach (logged once per outage, with what was being done);
        False for anything else, which the caller reports as before."""
        if not lost_connection(error):
            return False
        with self._lock:
            if self.since is not None:
                return True
            self.since = self.clock()
            self.outages += 1
        log.warning("the lab's store %s cannot be reached (%s, %s); the controller carries on and tries again: "
                    "agents keep their results until the store has them, and send them again",
                    self.location, self.reason(error), doing)
        return True

    def answered(self) -> None:
        """A call to the store worked: an outage, if there was one, is over."""
        if self.since is None:
            return
        with self._lock:
            if self.since is None:
                return
            away, self.since = self.clock() - self.since, None
        log.warning("the lab's store %s answers again after %.1f s; carrying on", self.location, away)

    def message(self, error: BaseException) -> str:
        """What a client or agent is told when its call met the outage."""
        return (f"the lab's store {self.location} cannot be reached ({self.reason(error)}); this controller keeps "
                "running and reconnects by itself, and nothing stored is lost: try again shortly")

    def reason(self, error: BaseException) -> str:
        """The error in one line, without the store's address (the message names it once)."""
        text = " ".join(str(error).split()) or type(error).__name__
        _, found, rest = text.partition(f"{self.location}: ")
        return (rest if found else text)[:400]


__all__ = ["StoreOutage"]
