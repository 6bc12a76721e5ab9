"""The controller's own nightly refresh: a cron expression decides when the reference suite is
submitted (at low priority, so interactive work goes first) to every registered device, and
when such a job finishes its refit / drift / golden checks run (controller/refresh.py).

For labs that prefer systemd, deploy/farm-refresh.timer does the same from outside.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from farm.controller.controller import Controller
from farm.controller.artifacts import ArtifactStore
from farm.controller.jobfile import DeviceTarget, JobFileError, load_job
from farm.controller.refresh import REFERENCE_SUITE_NAME, after_reference_run
from farm.controller.store import Store

log = logging.getLogger("farm.nightly")
_FIELDS = (("minute", 0, 59), ("hour", 0, 23), ("day", 1, 31), ("month", 1, 12), ("weekday", 0, 6))


class CronError(ValueError):
    pass


@dataclass(frozen=True)
class Cron:
    """A five-field cron expression: minute hour day-of-month month day-of-week (0 = Sunday)."""

    minute: frozenset[int]
    hour: frozenset[int]
    day: frozenset[int]
    month: frozenset[int]
    weekday: frozenset[int]
    text: str

    @classmethod
    def parse(cls, text: str) -> "Cron":
        parts = text.split()
        if len(parts) != 5:
            raise CronError(f"{text!r}: a cron expression has 5 fields (minute hour day month weekday), e.g. '30 2 * * *'")
        values = {}
        for part, (name, lo, hi) in zip(parts, _FIELDS):
            values[name] = frozenset(_field(part, name, lo, hi))
        return cls(**values, text=text)

    def matches(self, t: dt.datetime) -> bool:
        return (t.minute in self.minute and t.hour in self.hour and t.day in self.day and t.month in self.month
                and (t.isoweekday() % 7) in self.weekday)

    def next_after(self, t: dt.datetime) -> dt.datetime:
        """The first whole minute strictly after t that matches (searches up to a year ahead)."""
        candidate = t.replace(second=0, microsecond=0) + dt.timedelta(minutes=1)
        for _ in range(366 * 24 * 60):
            if self.matches(candidate):
                return candidate
            candidate += dt.timedelta(minutes=1)
        raise CronError(f"{self.text!r} never matches")


def _field(part: str, name: str, lo: int, hi: int) -> set[int]:
    out: set[int] = set()
    for item in part.split(","):
        step = 1
        if "/" in item:
            item, step_text = item.split("/", 1)
            if not step_text.isdigit() or int(step_text) == 0:
                raise CronError(f"{name}: bad step in {part!r}")
            step = int(step_text)
        if item == "*":
            start, end = lo, hi
        elif "-" in item:
            a, b = item.split("-", 1)
            if not (a.isdigit() and b.isdigit()):
                raise CronError(f"{name}: bad range in {part!r}")
            start, end = int(a), int(b)
        elif item.isdigit():
            start = end = int(item)
        else:
            raise CronError(f"{name}: {part!r} is not a number, range, list or *")
        if not (lo <= start <= end <= hi):
            raise CronError(f"{name}: {part!r} is outside {lo}-{hi}")
        out.update(range(start, end + 1, step))
    return out


class NightlyRefresh:
    """Submits the reference suite when the cron says so; checks each such job once it is done."""

    def __init__(self, store: Store, suite: Path, cron: Cron, devices: Callable[[], list[DeviceTarget]], *,
                 alert: Callable[[dict], object] | None = None, clock: Callable[[], dt.datetime] = dt.datetime.now,
                 artifacts: ArtifactStore | None = None) -> None:
        self.store = store
        self.artifacts = artifacts  # agents fetch models from the controller's store only: the suite's go in
        self.suite = suite
        self.cron = cron
        self.devices = devices
        self.alert = alert
        self.clock = clock
        self.next_run = cron.next_after(clock())
        self.checked: set[int] = {r["id"] for r in store.query(
            "SELECT id FROM jobs WHERE name = ? AND status IN ('completed', 'failed', 'canceled')",
            [REFERENCE_SUITE_NAME])}  # a restarted controller does not re-check old refreshes
        self._stop = threading.Event()

    def tick(self) -> int | None:
        """Submit when due (returns the job id) and check finished suite jobs; call about once a minute."""
        job_id = None
        now = self.clock()
        if now >= self.next_run:
            self.next_run = self.cron.next_after(now)
            job_id = self.submit()
        self.check_finished()
        return job_id

    def submit(self) -> int | None:
        devices = self.devices()
        if not devices:
            log.warning("nightly refresh skipped: no device is registered")
            return None
        try:
            job = load_job(self.suite, devices=devices)
        except JobFileError as e:
            log.error("nightly refresh skipped: %s", e)
            return None
        if self.artifacts is not None:
            try:
                for model in job.models:
                    self.artifacts.add_file(model.path)
            except (OSError, ValueError) as e:
                log.error("nightly refresh skipped: a reference model cannot be stored for the agents: %s", e)
                return None
        job.targets = list(devices)  # every device, each with its sim twin
        job.spec.targets = [d.name for d in devices]
        job.spec.priority = "low"
        job_id = Controller(self.store).submit(job, name=REFERENCE_SUITE_NAME)
        log.info("nightly refresh: reference suite submitted as job %d for %d device(s)", job_id, len(devices))
        return job_id

    def check_finished(self) -> None:
        for row in self.store.query("SELECT id FROM jobs WHERE name = ? AND status IN ('completed', 'failed')",
                                    [REFERENCE_SUITE_NAME]):
            if row["id"] in self.checked:
                continue
            self.checked.add(row["id"])
            report = after_reference_run(self.store, row["id"], alert=self.alert)
            log.info("nightly refresh job %d: %d calibration(s), %d drift check(s), quarantined %s", row["id"],
                     len(report.calibrations), len(report.drift), sorted(report.quarantined) or "none")

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
