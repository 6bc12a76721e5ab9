"""The controller's own nightly refresh: a cron expression decides when the reference suite is
submitted (at low priority, so interactive work goes first) to every registered device, and
when such a job finishes its refit / drift / golden checks run (controller/operations/refresh.py).

For labs that prefer systemd, deploy/farm-refresh.timer does the same from outside.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from croniter import CroniterError, croniter

from farm.controller.scheduling.artifacts import GC_GRACE_S, ArtifactStore
from farm.controller.scheduling.jobfile import DeviceTarget, JobFileError
from farm.controller.operations.alerts import DriftEvent
from farm.controller.operations.reference_suite import HEALTH_CHECK, SuiteError, submit_reference_suite
from farm.controller.operations.refresh import after_reference_run
from farm.controller.store import Store
from farm.controller.store.leader import LabDuties

log = logging.getLogger("farm.nightly")
LEADER_TTL_S = 150.0  # the nightly's lease among controllers on one store: renewed every tick (30 s)
# A numeric range written backwards: croniter reads it as wrapping around, cron(8) refuses it.
_BACKWARD_RANGE = re.compile(r"(?<![\w/])(\d+)-(\d+)")


class CronError(ValueError):
    pass


@dataclass(frozen=True)
class Cron:
    """A cron expression as cron(8) reads it, by croniter: five fields (minute hour day-of-month
    month day-of-week), day-of-month OR day-of-week when both are restricted, 0 or 7 = Sunday,
    names (JAN, MON) and @yearly/@monthly/@weekly/@daily/@midnight/@hourly."""

    text: str

    @classmethod
    def parse(cls, text: str) -> "Cron":
        text = " ".join(text.split())
        example = "e.g. '30 2 * * *' or '@daily'"
        if text.startswith("@"):
            if text.lower() not in _MACROS:
                raise CronError(f"{text!r}: unknown shorthand; one of {', '.join(sorted(_MACROS))}")
        elif len(text.split()) != 5:
            raise CronError(f"{text!r}: a cron expression has 5 fields (minute hour day month weekday), {example}")
        for field_text, name in zip(text.split(), ("minute", "hour", "day", "month", "weekday")):
            for a, b in _BACKWARD_RANGE.findall(field_text):
                if int(a) > int(b):
                    raise CronError(f"{text!r}: {name} range {a}-{b} runs backwards")
        cron = cls(text)
        try:
            croniter(cron._expression, dt.datetime(2000, 1, 1))
        except (CroniterError, ValueError, KeyError) as e:
            raise CronError(f"{text!r}: {e}; {example}") from None
        cron.next_after(dt.datetime(2000, 1, 1))  # refuses one that never matches ('0 0 30 2 *') now, not at night
        return cron

    def matches(self, t: dt.datetime) -> bool:
        return bool(croniter.match(self._expression, t.replace(second=0, microsecond=0)))

    def next_after(self, t: dt.datetime) -> dt.datetime:
        """The first whole minute strictly after t that matches."""
        try:
            return croniter(self._expression, t).get_next(dt.datetime)
        except CroniterError as e:  # e.g. '0 0 30 2 *': February never has a 30th
            raise CronError(f"{self.text!r} never matches ({e})") from None

    @property
    def _expression(self) -> str:
        return self.text.lower() if self.text.startswith("@") else self.text


_MACROS = frozenset({"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"})


class NightlyRefresh:
    """Submits the reference suite when the cron says so; checks each such job once it is done."""

    def __init__(self, store: Store, suite: Path | None, cron: Cron, devices: Callable[[], list[DeviceTarget]], *,
                 alert: Callable[[DriftEvent], None] | None = None, clock: Callable[[], dt.datetime] = dt.datetime.now,
                 artifacts: ArtifactStore | None = None, duties: LabDuties | None = None,
                 holder: str = "", include_contended: bool = False) -> None:
        self.store = store
        self.include_contended = include_contended  # fit the suite's contended sim runs too (as `farm refresh --include-contended`)
        # several controllers on one store: each tick is submitted, and each suite job checked, by one of them
        self.duties = duties
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}"
        self.artifacts = artifacts  # agents fetch models from the controller's store only: the suite's go in
        self.suite = suite  # None: the suite that ships with farm
        self.cron = cron
        self.devices = devices
        self.alert = alert
        self.clock = clock
        self.next_run = cron.next_after(clock())
        # a restarted controller does not re-check old refreshes
        self.checked: set[int] = set(store.jobs.of_kind(HEALTH_CHECK, ("completed", "failed", "canceled")))
        self._stop = threading.Event()

    def tick(self) -> int | None:
        """Submit when due (returns the job id) and check finished suite jobs; call about once a minute."""
        job_id = None
        now = self.clock()
        if now >= self.next_run:
            due, self.next_run = self.next_run, self.cron.next_after(now)
            if self.duties is None or self.duties.claim("nightly", due.isoformat(timespec="minutes"), self.holder):
                job_id = self.submit()
            else:
                log.info("nightly refresh of %s: submitted by another controller on this store", due)
        if self.duties is None or self.duties.hold("nightly", self.holder, LEADER_TTL_S):
            self.check_finished()
        return job_id

    def submit(self) -> int | None:
        devices = self.devices()
        if not devices:
            log.warning("nightly refresh skipped: no device is registered")
            return None
        try:
            job_id = submit_reference_suite(self.store, devices, self.suite, priority="low", artifacts=self.artifacts)
        except (JobFileError, SuiteError) as e:
            log.error("nightly refresh skipped: %s", e)
            return None
        log.info("nightly refresh: reference suite submitted as job %d for %d device(s)", job_id, len(devices))
        if self.artifacts is not None:  # the nightly also collects what no job names any more (`farm artifacts gc`)
            removed = self.artifacts.collect(self.store.artifacts.referenced(), GC_GRACE_S)
            self.store.artifacts.forget_uploads([name[:64] for name, _ in removed if not name.startswith(".")])
            log.info("nightly: %d artifact(s) no job names removed (%d bytes)", len(removed), sum(n for _, n in removed))
        return job_id

    def check_finished(self) -> None:
        for job_id in self.store.jobs.of_kind(HEALTH_CHECK, ("completed", "failed")):
            if job_id in self.checked:
                continue
            self.checked.add(job_id)
            if self.duties is not None and not self.duties.claim("check", str(job_id), self.holder):
                continue  # checked by the controller that led before this one
            report = after_reference_run(self.store, job_id, alert=self.alert, include_contended=self.include_contended)
            log.info("nightly refresh job %d: %d calibration(s), %d drift check(s), quarantined %s", job_id,
                     len(report.calibrations), len(report.drift), sorted(report.quarantined) or "none")
            if report.contended_left_out:
                log.warning("nightly refresh job %d: %d contended sim run(s) left out of the fits "
                            "(`farm controller serve --refresh-include-contended` uses them)", job_id,
                            report.contended_left_out)

    def run_forever(self, interval_s: float = 30.0) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.tick()
            except Exception:  # a failed refresh must never take the controller down
                log.exception("nightly refresh failed")

    def start(self) -> "NightlyRefresh":
        threading.Thread(target=self.run_forever, name="nightly-refresh", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
