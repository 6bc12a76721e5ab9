"""farm from Python: `farm.connect()` -> submit jobs, wait for them, read typed results, calibrate, predict.

    import farm
    with farm.connect() as lab:                 # embedded, or the controller in $FARM_CONTROLLER / config
        job = lab.submit("job.yaml")            # or a dict shaped like a job file
        job.wait(progress=True)                 # a tqdm bar in a notebook; wait(timeout=60) for a detached job
        df = job.results().to_pandas()          # one row per run, every result field
        job.pairs(); job.rank(); job.report("out/")
        lab.calibrations(); lab.inspect("m.onnx"); lab.suggest("phone-1", 5)

The same `Farm` the CLI uses (farm.client) answers: embedded, `wait()` runs the job in this
process; with a controller, the controller's agents run it and `wait()` watches.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, get_args

from pydantic import ValidationError

from farm.client.api import (
    CalibrateAnswer, CalibrateAsk, CalibrationVersion, DeviceInfo, DriftRecord, Farm, FarmError, JobInfo, PredictAsk,
    Prediction, Progress, RankAnswer, RankAsk, Submitted,
)
from farm.client.api import RunRecord as TypedRunRecord
from farm.proto.questions import CalibrationFit, explain
from farm.proto.spec import Priority

if TYPE_CHECKING:  # inspection loads onnx/LiteRT readers: only when asked
    from farm.proto.results import ModelFacts

# The Python API's records are the client's own answer models (farm.proto.questions): a calibration as
# `farm calibrate --json` lists it, a prediction as `farm predict --json` prints it.
Calibration = CalibrationFit

PRIORITIES: tuple[str, ...] = get_args(Priority)


@dataclass(frozen=True)
class RunRecord:
    """One run, flat for a table (pandas): the figures most asked for; `typed` is the whole typed record
    (farm.client.api.RunRecord) and `record` its JSON form, as `farm results --format json` has it."""

    job: int
    model: str
    sha256: str
    target: str
    threads: int
    batch_size: int
    repeat: int
    status: str
    failure_class: str | None
    latency_ms: float | None  # the timed loop's mean
    latency_p90_ms: float | None
    peak_memory_mb: float | None
    avg_memory_mb: float | None
    wall_s: float | None
    backend: str | None
    typed: TypedRunRecord = field(repr=False, compare=False)

    @property
    def record(self) -> dict[str, Any]:
        return self.typed.model_dump()

    @classmethod
    def of(cls, r: TypedRunRecord) -> "RunRecord":
        latency = r.latency_ms
        return cls(job=r.job, model=r.model.name, sha256=r.model.sha256, target=r.target, threads=r.threads,
                   batch_size=r.batch_size, repeat=r.repeat, status=r.status, failure_class=r.failure_class,
                   latency_ms=latency.avg if latency else None, latency_p90_ms=latency.p90 if latency else None,
                   peak_memory_mb=r.peak_memory_mb, avg_memory_mb=r.avg_memory_mb, wall_s=r.wall_s, backend=r.backend,
                   typed=r)


class Results(list):
    """A job's RunRecords, in the store's order."""

    def to_pandas(self) -> Any:
        """One row per run: the flat figures, then every field of the record (nested ones as "a.b"). Needs pandas."""
        try:
            import pandas
        except ImportError:
            raise FarmError("Results.to_pandas() needs the 'pandas' extra, which is not installed: "
                            "`pip install 'farm[pandas]'` (or `pip install pandas`; or read the records as they are: "
                            "each is a RunRecord)") from None
        columns = [f for f in RunRecord.__dataclass_fields__ if f != "typed"]
        rows = []
        for r in self:  # the flat figures first, then every other field of the record ("limits.cpus", "contention.contended"...)
            row = {c: getattr(r, c) for c in columns}
            _flatten("", r.typed.model_dump(exclude={"op_profile"}), row)
            rows.append(row)
        return pandas.DataFrame(rows)


def _flatten(prefix: str, value: Any, into: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, into)
    elif prefix not in into:  # the flat columns above keep their plain name and value
        into[prefix] = value


def _print_warning(kind: str, message: str) -> None:
    print(f"{kind}: {message}", file=sys.stderr, flush=True)  # as `farm submit` says it


def _print_progress(p: Progress) -> None:
    line = p.last or f"{p.completed} ok, {p.failed} failed, {p.running} running"
    print(f"job {p.job}: [{p.done}/{p.total}] {line}", file=sys.stderr, flush=True)


def _progress_printer(job: int, progress: bool | str) -> tuple[Callable[[Progress], None] | None, Callable[[], None]]:
    """What wait() calls with each step, and how the display ends: a tqdm.auto bar, stderr lines, or nothing."""
    if not progress:
        return None, lambda: None
    if progress is True:
        try:
            from tqdm.auto import tqdm
        except ImportError:  # the 'notebook' extra brings it; lines do without
            return _print_progress, lambda: None
        bar = tqdm(total=0, desc=f"job {job}", unit="run")

        def draw(p: Progress) -> None:
            bar.total = p.total
            bar.n = p.done
            bar.set_postfix_str(f"{p.completed} ok, {p.failed} failed, {p.running} running", refresh=False)
            bar.refresh()

        return draw, bar.close
    return _print_progress, lambda: None


class Job:
    """A submitted job: wait for it, read its results, cancel it."""

    def __init__(self, lab: "Lab", id: int, submitted: Submitted | None = None) -> None:
        self._lab = lab
        self.id = id
        self.submitted = submitted

    def __repr__(self) -> str:
        return f"<farm job {self.id} on the {self._lab.where}>"

    def info(self) -> JobInfo:
        return self._lab.farm.job(self.id)

    @property
    def status(self) -> str:
        return self.info().status

    def wait(self, timeout: float | None = None, progress: bool | str = False) -> JobInfo:
        """Until the job ends (embedded: runs it here, unless submitted with detach=True).

        progress: True draws a progress bar (tqdm.auto: a widget in a notebook, a line in a terminal)
        when tqdm is installed, else prints each step on stderr; "lines" always prints the steps.
        timeout: seconds to wait before TimeoutError; the job goes on (wait again, or cancel it). A job
        this process runs itself (embedded, not detached) cannot be left running, so it refuses a timeout.
        """
        if progress not in (True, False, "lines"):
            raise FarmError(f"wait(progress={progress!r}): give True (a bar), \"lines\" or False.")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not math.isfinite(timeout) or timeout <= 0):
            raise FarmError(f"wait(timeout={timeout!r}): give a positive number of seconds (or leave it out).")
        show, close = _progress_printer(self.id, progress)
        try:
            if timeout is None:
                finished = self._lab.farm.wait(self.id, show)
            else:
                finished = self._wait_at_most(timeout, show)
        finally:
            close()
        if not finished:
            raise KeyboardInterrupt(f"job {self.id} was interrupted; lab.resume({self.id}) carries on")
        return self.info()

    def _wait_at_most(self, timeout: float, show: Callable[[Progress], None] | None) -> bool:
        info = self.info()
        if (self._lab.farm.embedded and info.owner_pid == os.getpid() and info.owner_host == socket.gethostname()
                and not info.finished):
            raise FarmError(f"wait(timeout=...): job {self.id} runs in this process, so waiting less would leave it "
                            "half run; submit it with detach=True (a background process runs it) to wait with a timeout")
        outcome: list[bool | BaseException] = []

        def follow() -> None:  # following a job (a controller's stream, a store another process writes) is safe to leave
            try:
                outcome.append(self._lab.farm.wait(self.id, show))
            except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread below
                outcome.append(e)

        follower = threading.Thread(target=follow, name=f"farm-wait-{self.id}", daemon=True)
        follower.start()
        follower.join(timeout)
        if not outcome:
            raise TimeoutError(f"job {self.id} is still {self.info().status} after {timeout:g} s; it goes on: "
                               "wait() again, or cancel() it")
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    def pairs(self) -> list[dict[str, Any]]:
        """Device runs beside their sim twins (completed pairs only), as `farm results JOB --pairs --json`."""
        from farm.controller.analysis.results import paired_records

        return [p.model_dump() for p in paired_records(self._lab.farm.results(self.id))]

    def report(self, folder: str | Path, *, png: bool = False) -> list[Path]:
        """Writes `farm report`'s page (and with png=True each figure) into folder; the paths written, the page first."""
        answer = self._lab.farm.report(self.id, html=True, png=png)
        target = Path(folder)
        target.mkdir(parents=True, exist_ok=True)
        written = []
        for f in answer.files:  # each name is a plain file name (checked when the answer was read)
            (target / f.name).write_bytes(f.data)
            written.append(target / f.name)
        for w in answer.warnings:
            _print_warning("warning", w)
        return written

    def rank(self, *, metric: str = "latency", device_jobs: Iterable[int] = (), devices: Iterable[str] = (),
             include_contended: bool = False) -> RankAnswer:
        """Rank agreement of the sim with the devices on this job's models (`farm rank`)."""
        try:
            ask = RankAsk(job=self.id, metric=metric, device_jobs=list(device_jobs), devices=list(devices),
                          include_contended=include_contended)
        except ValidationError as e:
            raise FarmError(f"rank(): {explain(e)}") from None
        return self._lab.farm.rank(ask)

    def results(self) -> Results:
        return Results(RunRecord.of(r) for r in self._lab.farm.results(self.id))

    def cancel(self) -> int:
        return self._lab.farm.cancel(self.id)


class Lab:
    """A connection to a farm (what `farm.connect()` returns). Close it, or use it in a `with` block."""

    def __init__(self, farm: Farm) -> None:
        self.farm = farm

    @property
    def where(self) -> str:
        return self.farm.where

    def __repr__(self) -> str:
        return f"<farm {self.where}>"

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.farm.close()

    def submit(self, job: str | Path | dict[str, Any], *, priority: str | None = None, detach: bool = False,
               base_dir: str | Path | None = None, overrides: Mapping[str, Any] | Iterable[str] = ()) -> Job:
        """A job file's path, or a dict shaped like one (model paths relative to base_dir, default the
        current folder). detach=True (embedded): a background process runs it instead of `wait()`.
        overrides: `farm submit --set`, as {"workload.iterations": 20} or ["workload.iterations=20"]."""
        import yaml

        if not isinstance(job, (str, Path, dict)) or isinstance(job, str) and not job.strip():
            raise FarmError(f"submit(job): give a job file's path (str or Path) or a dict shaped like a job file, "
                            f"not {job!r}.")
        if priority not in (None, *PRIORITIES):
            raise FarmError(f"submit(priority={priority!r}): give one of {', '.join(PRIORITIES)} (or leave it out).")
        if isinstance(overrides, str):
            raise FarmError(f"submit(overrides={overrides!r}): give a dict or a list of 'FIELD=VALUE' strings.")
        sets = [f"{k}={yaml.safe_dump(v, default_flow_style=True, width=1 << 20).strip().removesuffix('...').strip()}"
                for k, v in overrides.items()] if isinstance(overrides, Mapping) else [str(o) for o in overrides]
        if isinstance(job, dict):
            source = Path(base_dir or Path.cwd()).absolute() / f"{job.get('name') or 'job'}.yaml"
            submitted = self.farm.submit(source, yaml.safe_dump(job, sort_keys=False), priority=priority,  # type: ignore[arg-type]
                                         detach=detach, overrides=sets, on_warning=_print_warning)
        else:
            submitted = self.farm.submit(Path(job), priority=priority, detach=detach, overrides=sets,  # type: ignore[arg-type]
                                         on_warning=_print_warning)
        return Job(self, submitted.job, submitted)

    def job(self, id: int) -> Job:
        self.farm.job(id)  # raises FarmError for a job this farm does not have
        return Job(self, id)

    def jobs(self, limit: int = 50) -> list[JobInfo]:
        return self.farm.jobs(limit)

    def resume(self, id: int) -> Job:
        self.farm.resume(id)
        return Job(self, id)

    def retry(self, id: int, *, failed: bool = True, canceled: bool = False) -> Job:
        """`farm retry ID --failed [--canceled]`: a finished job's failed (or lost) tasks, and with canceled=True
        its canceled ones, run again as new attempts; `wait()` runs them (embedded) or follows them."""
        self.farm.retry(id, failed=failed, canceled=canceled)
        return Job(self, id)

    def devices(self) -> list[DeviceInfo]:
        """Embedded: the lab's device list ($FARM_DEVICES) with health; a controller: its agents' devices."""
        return self.farm.devices()

    def calibrate(self, *, job: int | None = None, sim_job: int | None = None, device_job: int | None = None,
                  device: str | None = None, metrics: Iterable[str] = ("latency",), min_pairs: int = 4,
                  include_contended: bool = False) -> list[Calibration]:
        """Fit and store calibrations (a new version each); see `farm calibrate`. Groups too small to fit
        are left out; `calibrate_document` has them, with why. Nothing fitted at all raises FarmError saying why
        (as `farm calibrate` exits 1), never an empty list without a reason."""
        answer = self.calibrate_document(job=job, sim_job=sim_job, device_job=device_job, device=device,
                                         metrics=metrics, min_pairs=min_pairs, include_contended=include_contended)
        if not answer.calibrations:
            raise FarmError(f"calibrate(): nothing was fitted: {nothing_fitted(answer)}")
        return answer.calibrations

    def calibrate_document(self, **ask: Any) -> CalibrateAnswer:
        ask["metrics"] = list(ask.get("metrics") or ("latency",))
        try:
            request = CalibrateAsk.model_validate(ask)
        except ValidationError as e:
            raise FarmError(f"calibrate(): {explain(e)}") from None
        return self.farm.calibrate(request)

    def predict(self, model: str | Path, device: str, *, metrics: Iterable[str] = ("latency",),
                threads: int | None = None, confidence: float = 0.9, include_contended: bool = False,
                progress: bool = False) -> list[Prediction]:
        """On-device estimates from the sim alone (the model is measured in the sim first unless a run fits)."""
        ask = PredictAsk(model=Path(model), device=device, metrics=tuple(metrics), threads=threads,
                         confidence=confidence, include_contended=include_contended)
        return self.farm.predict(ask, _print_progress if progress else None)

    def calibrations(self, device: str | None = None, metric: str | None = None) -> list[CalibrationVersion]:
        """Every stored calibration version (`farm calibrations`), newest first per key."""
        return self.farm.calibrations(device, metric)

    def drift(self, device: str | None = None) -> list[DriftRecord]:
        """How each nightly refresh moved the calibrations (`farm drift`)."""
        return self.farm.drift(device)

    def inspect(self, model: str | Path) -> ModelFacts:
        """What farm knows about a model file without running it (`farm inspect`): shapes, ops, parameters, MACs."""
        from farm.models.facts import ModelError, inspect_model

        path = Path(model)
        if not path.is_file():
            raise FarmError(f"inspect({str(model)!r}): no such model file")
        try:
            return inspect_model(path)
        except ModelError as e:
            raise FarmError(str(e)) from None

    def suggest(self, device: str, count: int, *, metric: str = "latency", threads: int | None = None,
                include_contended: bool = False) -> dict[str, Any]:
        """`farm calibrate --suggest K --device D`: the models of this store to measure on the device next
        (candidates: models measured in the sim, not yet in the device's calibration), of a local store or a
        controller's (the jobs this caller may read)."""
        from farm.proto.questions import SUGGEST

        answer = self.farm._ask(SUGGEST, device=device, count=count, metric=metric, threads=threads,
                                include_contended=include_contended)
        return answer.model_dump(mode="json", exclude={"workload"})


def nothing_fitted(answer: Any) -> str:
    """Why a calibration answer (CalibrateAnswer) holds no fit, in one paragraph."""
    why = list(answer.refused)
    if answer.contended_left_out:
        why.append(f"{answer.contended_left_out} contended run(s) left out: other work used their cores "
                   "(include_contended=True uses them)")
    return "; ".join(why) or "no pair of a sim run and a device run of the same model and settings was found"


def connect(controller: str | None = None, *, db: str | Path | None = None, token: str | None = None,
            slots: int = 1, backend: str | None = None, create: bool = False) -> Lab:
    """The controller given, else $FARM_CONTROLLER or the config file's; else the embedded store
    (db, else $FARM_DB, else the user data folder). slots/backend: how embedded runs go.
    create=True makes a missing folder of `db` (as `--create`); otherwise a missing folder is an error."""
    from farm.client import open_farm
    from farm.client.config import Credentials

    for name, value in (("controller", controller), ("token", token)):
        if value is not None and not isinstance(value, str):
            raise FarmError(f"connect({name}={value!r}): give a string.")
    if db is not None and not isinstance(db, (str, Path)):
        raise FarmError(f"connect(db={db!r}): give the store's file path (str or Path).")
    if not isinstance(slots, bool) and isinstance(slots, int) and slots >= 1:
        from farm.agents.agent import split_cores
        try:
            split_cores(slots)  # the rule `farm submit --slots` follows
        except ValueError as e:
            raise FarmError(f"connect(slots={slots}): {e}; each sim slot gets cores of its own.") from None
    if db is not None and controller is not None:
        raise FarmError(f"connect(controller={controller!r}, db=...): a lab is a controller or a store; give one of them.")
    credentials = Credentials.resolve(token) if token else None
    if db is not None:
        # a store named here is the answer: $FARM_CONTROLLER or the config file's controller is for calls naming none
        from farm.client.compose import EmbeddedSettings, build_embedded
        return Lab(build_embedded(EmbeddedSettings(db=db, slots=slots, backend=backend, create=create)))
    return Lab(open_farm(controller, db=db, credentials=credentials, slots=slots, backend=backend, create=create))


def suggest(candidates: Iterable[dict[str, Any]], count: int, *, features: Iterable[str] = (),
            measured: Iterable[dict[str, Any]] = ()) -> list[str]:
    """The ``count`` candidate models to measure on a device next, as `farm calibrate --suggest`.

    Each candidate is a dict with ``model``, ``x`` (its sim value) and the named ``features``
    (FLOPs, size…); ``measured`` models (same keys) are already calibrated on the device and
    count in the design. Greedy D-optimal: spread over log sim and the features.
    """
    from farm.controller.analysis.calibration import Pair, suggest_models

    names = list(features)

    def pair(row: dict[str, Any]) -> Pair:
        return Pair(model=str(row["model"]), x=float(row["x"]), y=float("nan"),
                    features={name: float(row[name]) for name in names if name in row})

    return suggest_models([pair(r) for r in candidates], count, features=names, measured=[pair(r) for r in measured])


__all__ = ["Calibration", "FarmError", "Job", "JobInfo", "Lab", "Prediction", "Results", "RunRecord", "connect",
           "suggest"]
