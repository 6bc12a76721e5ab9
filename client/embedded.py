"""`Farm` over a local store: a controller and an agent in this process run the jobs.

Every answer comes from farm.controller.service, the same functions the gRPC servicer calls;
this module adds only what embedded mode has of its own: runs here (or in a background
process for --detach), the lab's device list, and the health check before user work.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from farm.client.api import (
    EXIT_ENVIRONMENT, TERMINAL, DeviceInfo, Farm, FarmError, JobInfo, OnProgress, PredictAsk, Prediction, Problem,
    Progress, RefreshAsk, Submitted,
)
from farm.proto.questions import FINISH_REFRESH, AnswerT, AskT, Question, RefreshAnswer
from farm.controller import service
from farm.controller.scheduling.controller import Controller
from farm.controller.store import DB_ENV, StoreError, db_location, open_store
from farm.controller.store.rows import plain

if TYPE_CHECKING:  # the job model (pydantic) loads only when a job is read: `farm jobs` never needs it
    from farm.proto.spec import Priority

POLL_S = 0.3  # how often `wait` looks at a job another process runs


def _job_info(controller: Controller, job_id: int) -> JobInfo:
    info = service.job_info(controller, job_id)
    if info is None:
        raise FarmError(f"no job {job_id} in {controller.store.location}; `farm jobs` lists the jobs there.")
    return info


def check_runner_options(slots: Any, backend: Any) -> None:
    """slots and backend as the CLI's --slots and --backend allow them (the Python API passes anything)."""
    if backend is not None and backend != "auto":  # the sandbox package loads only when a backend is named
        from farm.agents.sandbox import BACKEND_NAMES

        if backend not in BACKEND_NAMES:
            raise FarmError(f"backend={backend!r}: no such sandbox backend; give one of auto, "
                            f"{', '.join(BACKEND_NAMES)} (`farm backends` says which run here).")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise FarmError(f"slots={slots!r}: give a whole number of sim slots, at least 1 (each gets cores of its own).")


class EmbeddedFarm(Farm):
    """slots/backend/lab: how this process runs jobs (`farm submit --slots --backend --devices`)."""

    embedded = True

    def __init__(self, db: Path | str | None = None, *, slots: int = 1, backend: str | None = None,
                 lab: Callable[[], list[Any]] | None = None, devices_file: Path | str | None = None,
                 health_check_max_age_h: float | None = None, create: bool = False, read_only: bool = False) -> None:
        check_runner_options(slots, backend)  # before the store: a bad argument changes nothing
        path = db_location(str(db) if db else None)  # a file, or a postgresql:// URL
        # the user data folder (no --db, no FARM_DB) is farm's own to make; a path someone typed is not
        given = bool(db or os.environ.get(DB_ENV))
        create = create or not given
        # a read-only command given a store file that is not there makes none (a typo must not leave an empty
        # store behind, issue 32): it reads an empty one in memory, and the CLI says where it looked
        self.store_missing: Path | None = None
        if read_only and given and isinstance(path, Path) and str(path) != ":memory:" and not path.exists() \
                and path.parent.is_dir():  # a missing folder stays the error it always was (--create makes it)
            self.store_missing, path = path, Path(":memory:")
        try:
            self.store = open_store(path, create_folder=create)
        except StoreError as e:
            raise FarmError(str(e)) from None
        from farm.controller import standard_hooks
        self.controller = Controller(self.store, hooks=standard_hooks())  # this farm's own (client/compose.py)
        self.scope = service.Scope(self.controller)  # everyone's jobs, no agents to list: this process runs them
        self.slots, self.backend = slots, backend
        self.devices_file = Path(devices_file).absolute() if devices_file else None  # handed to a --detach run
        self._lab_source = lab or _lab_from_environment
        self._lab: list[Any] | None = None
        if health_check_max_age_h is None:
            health_check_max_age_h = float(os.environ.get("FARM_HEALTH_MAX_AGE_H", "24"))
        self.health_check_max_age_h = health_check_max_age_h

    @property
    def where(self) -> str:
        return f"store {self.store.location}"

    def close(self) -> None:
        self.store.close()

    def lab(self) -> list[Any]:
        """The lab's devices this process drives (read once)."""
        if self._lab is None:
            self._lab = self._lab_source()
        return self._lab

    # --- jobs ---------------------------------------------------------------------------
    def submit(self, source: Path, text: str | None = None, *, priority: Priority | None = None,
               max_tasks: int | None = None, skip_invalid: bool = False, detach: bool = False,
               on_warning: Callable[[str, str], None] | None = None, on_progress: OnProgress | None = None,
               overrides: Sequence[str] = ()) -> Submitted:
        text = self.job_text(source, text, overrides)
        from farm.controller.scheduling.jobfile import DEFAULT_MAX_TASKS, HostCapacity, JobFileError, load_job, load_job_text

        lab = self.lab()
        options: dict[str, Any] = {"devices": [lab_target(d) for d in lab], "max_tasks": max_tasks or DEFAULT_MAX_TASKS,
                                   "skip_invalid": skip_invalid, "host": HostCapacity.here()}
        try:
            job = load_job(source, **options) if text is None else \
                load_job_text(text, str(source), source.resolve().parent, source.resolve(), **options)
        except JobFileError as e:
            raise FarmError(str(e), problems=[Problem.model_validate(p.to_json()) for p in e.problems]) from None
        for problem in [*job.warnings, *(m.problem for m in job.invalid)]:
            if on_warning:
                on_warning("warning" if problem in job.warnings else "skipped", str(problem))
        unenforced = self._unenforced_budget(job.spec)
        if unenforced and on_warning:
            on_warning("warning", f"{source}: {unenforced}")
        if priority:
            job.spec.priority = priority
        targets = [t.name for t in job.targets if t is not None]
        if targets and not detach:
            self._health_check_before(lab, targets, on_progress, on_warning)
        elif targets and on_warning and self.health_check_max_age_h > 0:
            on_warning("note", "--detach runs no health check first; `farm refresh` checks the devices")
        job_id = self.controller.submit(job)
        log = self._start_background(job_id) if detach else None
        return Submitted(job=job_id, tasks=self.controller.progress(job_id).total, models=len(job.models),
                         where=self.where, warnings=[Problem.model_validate(p.to_json()) for p in job.warnings], log=log)

    def _unenforced_budget(self, spec: Any) -> str | None:
        """A fractional CPU budget the backend these runs get cannot enforce (said before the job runs)."""
        from farm.agents.sandbox import AUTO_ORDER, backend_class

        names = AUTO_ORDER if self.backend in (None, "auto") else (self.backend,)
        chosen = next((backend_class(n) for n in names if backend_class(n).unavailable_reason() is None), None)
        budgets = [("sim.cpus", spec.sim.cpus)] + [("matrix.cpus", c) for c in spec.matrix.cpus]
        for field_name, cpus in budgets:
            reason = chosen.unenforced_cpus(cpus) if chosen is not None else None
            if reason:
                return f"{field_name}: {reason} Its runs and calibrations are flagged."
        return None

    def _start_background(self, job_id: int) -> Path:
        """A detached `farm resume JOB` runs the queued job; its output goes to a log beside the store."""
        log = self.store.path.parent / f"job-{job_id}.log"
        # a database URL goes by the environment, not the command line: `ps` would show its password
        url = getattr(self.store, "url", None)
        where = [] if url else ["--db", str(self.store.path)]
        command = [sys.executable, "-m", "farm.cli.main", "resume", str(job_id), *where,
                   "--quiet", "--slots", str(self.slots), *(["--backend", self.backend] if self.backend else []),
                   *(["--devices", str(self.devices_file)] if self.devices_file else [])]
        with log.open("ab") as out:
            try:
                process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                           env={**os.environ, DB_ENV: url} if url else None,
                                           start_new_session=True)  # Ctrl+C here does not stop it
            except OSError as e:
                raise FarmError(f"cannot start the background run of job {job_id}: {e}; `farm resume {job_id}` "
                                "runs it in this terminal", EXIT_ENVIRONMENT) from None
        # the background process owns it now: `farm status` and `farm watch` follow that process
        self.store.jobs.update(job_id, owner_pid=process.pid)
        return log

    def _health_check_before(self, lab: list[Any], targets: list[str], on_progress: OnProgress | None,
                             on_warning: Callable[[str, str], None] | None) -> None:
        """Before user work on a device whose last check is older than FARM_HEALTH_MAX_AGE_H hours
        (default 24; 0 turns it off), run the reference suite on it first (LAVA's health checks)."""
        from farm.controller.operations.refresh import stale_devices

        if self.health_check_max_age_h <= 0:
            return
        stale = set(stale_devices(self.store, targets, self.health_check_max_age_h * 3600))
        if not stale:
            return
        if on_warning:
            on_warning("health check first", f"{', '.join(sorted(stale))} last checked over "
                                              f"{self.health_check_max_age_h:g} h ago")
        self._reference_run([d for d in lab if d.name in stale], priority="interactive", on_progress=on_progress)

    def wait(self, job: int, on_progress: OnProgress | None = None) -> bool:
        info = _job_info(self.controller, job)
        if info.status == "interrupted":
            raise FarmError(f"job {job} is interrupted: no process runs it. `farm resume {job}` carries on, keeping "
                            "every run already stored.", 1)
        if info.owner_pid == os.getpid() and info.owner_host == socket.gethostname() and not info.finished:
            return self._run_here(job, on_progress)
        last = None
        while True:  # another process runs it (a --detach background run, another terminal): follow the store
            info = _job_info(self.controller, job)
            step = Progress(job, info.status, info.total, info.completed, info.failed, info.running, info.canceled)
            if step != last and on_progress:
                on_progress(step)
            last = step
            if info.finished:
                return True
            if info.status == "interrupted":
                raise FarmError(f"job {job} was interrupted (the process running it stopped); `farm resume {job}` "
                                "carries on", 1)
            time.sleep(POLL_S)

    def _run_here(self, job: int, on_progress: OnProgress | None) -> bool:
        from farm.client.runner import run_job_embedded

        # the stored spec is the validated one, sizes in bytes: read, not validated again
        row = self.store.jobs.get(job)
        if row is None:
            raise FarmError(f"no job {job} in {self.store.location}; `farm jobs` lists the jobs there.")
        timeout = (json.loads(row.spec_json or "{}").get("timeouts") or {}).get("job")
        total = self.controller.progress(job).total

        def on_result(task: Any, result: Any) -> None:
            if result.ok and result.latency:
                last = f"{task.model_name} t{task.threads}: {result.latency.avg:.2f} ms"
            elif result.ok:
                last = f"{task.model_name} t{task.threads}: ok"
            else:
                last = f"{task.model_name} t{task.threads}: {result.failure_class.value}"
            p = self.controller.progress(job)
            if on_progress:
                on_progress(Progress(job, "running", total, p.completed, p.failed, p.running, p.canceled, last))

        return run_job_embedded(self.store, job, slots=self.slots, backend=self.backend, job_timeout_s=timeout,
                                on_result=on_result, devices=self.lab(), controller=self.controller)

    def resume(self, job: int) -> None:
        status = _job_info(self.controller, job).status
        if status in TERMINAL:
            raise FarmError(f"job {job} is {status}; only an interrupted or queued job can be resumed. "
                            f"`farm retry {job} --failed` runs its failed tasks again.")
        if status == "running":
            raise FarmError(f"job {job} is still running in process {(plain(self.store.jobs.get(job)) or {}).get('owner_pid')}; cancel it "
                            "first or wait.")
        self.controller.resume(job)

    def ask(self, question: Question[AskT, AnswerT], request: AskT) -> AnswerT:
        """The service function of the question's table line answers, over this process's store (after the
        line's role and job-access rule: service.answer)."""
        answer: AnswerT = _answer(service.answer, question, self.scope, request)
        return answer

    # --- devices ------------------------------------------------------------------------
    def devices(self) -> list[DeviceInfo]:
        """The lab's device list, each with health, its last reference-suite check and calibration age."""
        from farm.controller.operations.refresh import last_reference_checks

        health = self.store.devices.health_by_name()
        checks = last_reference_checks(self.store)
        rows = []
        for d in self.lab():
            newest = self.store.calibrations.newest_at(d.name)
            h = health.get(d.name)
            rows.append(DeviceInfo(name=d.name, driver=d.entry.driver,
                                   device_type=d.device_type.name if d.device_type else None, tags=d.tags,
                                   units=list(d.device_type.accelerators) if d.device_type else ["cpu"],
                                   health=h.health if h else "unknown", reason=h.reason if h else None,
                                   last_check=checks.get(d.name),
                                   calibration_age_s=time.time() - newest if newest else None))
        return rows

    def predict(self, ask: PredictAsk, on_progress: OnProgress | None = None) -> list[Prediction]:
        measured: list[int] = []
        while True:  # the service says which sim job to run first; run it here, then ask again
            answer = _answer(service.predict, self.store, ask.model.resolve(), ask.model.name, ask.device,
                             list(ask.metrics), threads=ask.threads, confidence=ask.confidence,
                             include_contended=ask.include_contended, measured_jobs=tuple(measured))
            if not isinstance(answer, service.MeasureFirst):
                return list(answer)
            job_id = self.controller.submit(answer.job)
            measured.append(job_id)
            if not self._run_here(job_id, on_progress):
                raise KeyboardInterrupt

    def _reference_run(self, lab: list[Any], *, priority: Priority, on_progress: OnProgress | None,
                       suite: Path | None = None) -> int | None:
        from farm.controller.scheduling.jobfile import JobFileError
        from farm.controller.operations.reference_suite import SuiteError, submit_reference_suite

        suite = suite or (Path(os.environ["FARM_REFERENCE_SUITE"]) if os.environ.get("FARM_REFERENCE_SUITE") else None)
        try:
            job_id = submit_reference_suite(self.store, [lab_target(d) for d in lab], suite, priority=priority)
        except (JobFileError, SuiteError) as e:
            raise FarmError(str(e)) from None
        return job_id if self._run_here(job_id, on_progress) else None

    def refresh(self, ask: RefreshAsk, on_progress: OnProgress | None = None) -> RefreshAnswer | None:
        from farm.controller.operations.alerts import alerts_from_environment

        lab = self.lab()
        if not lab:
            raise FarmError("farm refresh needs devices to refresh: --devices lab.yaml or $FARM_DEVICES")
        job_id = self._reference_run(lab, priority="low", on_progress=on_progress, suite=ask.suite)
        if job_id is None:
            return None
        webhook = alerts_from_environment()
        scope = service.Scope(self.controller, alert=webhook.send_async if webhook else None)
        request = FINISH_REFRESH.ask(job=job_id, k=ask.k, max_slope_change=ask.max_slope_change,
                                     max_prediction_shift=ask.max_prediction_shift,
                                     max_intercept_change=ask.max_intercept_change, max_r2_drop=ask.max_r2_drop,
                                     include_contended=ask.include_contended)
        answer: RefreshAnswer = _answer(service.finish_refresh, scope, request)
        return answer


def _answer(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return function(*args, **kwargs)
    except service.ServiceError as e:
        raise FarmError(str(e)) from None


def lab_target(device: Any) -> Any:
    from farm.controller.scheduling.jobfile import DeviceTarget
    return DeviceTarget(device.name, device.device_type, device.tags)


def _lab_from_environment() -> list[Any]:
    from farm.agents.lab import LabConfigError, discover_types, lab_from_environment
    try:
        lab = lab_from_environment()
    except LabConfigError as e:
        raise FarmError(str(e)) from None
    discover_types(lab)
    return lab
