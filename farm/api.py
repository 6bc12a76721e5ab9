"""farm from Python: `farm.connect()` -> submit jobs, wait for them, read typed results, calibrate, predict.

    import farm
    with farm.connect() as lab:                 # embedded, or the controller in $FARM_CONTROLLER / config
        job = lab.submit("job.yaml")            # or a dict shaped like a job file
        job.wait(progress=True)
        df = job.results().to_pandas()

The same `Farm` the CLI uses (farm.client) answers: embedded, `wait()` runs the job in this
process; with a controller, the controller's agents run it and `wait()` watches.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, get_args

from pydantic import ValidationError

from farm.client.api import (
    CalibrateAnswer, CalibrateAsk, DeviceInfo, Farm, FarmError, JobInfo, PredictAsk, Prediction, Progress, Submitted,
)
from farm.client.api import RunRecord as TypedRunRecord
from farm.proto.questions import CalibrationFit, explain
from farm.proto.spec import Priority

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
        """One row per run (the typed fields; `record` holds the rest). Needs pandas."""
        try:
            import pandas
        except ImportError:
            raise FarmError("Results.to_pandas() needs the 'pandas' extra, which is not installed: "
                            "`pip install 'farm[pandas]'` (or `pip install pandas`; or read the records as they are: "
                            "each is a RunRecord)") from None
        columns = [f for f in RunRecord.__dataclass_fields__ if f != "typed"]
        return pandas.DataFrame([{c: getattr(r, c) for c in columns} for r in self], columns=columns)


def _print_warning(kind: str, message: str) -> None:
    print(f"{kind}: {message}", file=sys.stderr, flush=True)  # as `farm submit` says it


def _print_progress(p: Progress) -> None:
    line = p.last or f"{p.completed} ok, {p.failed} failed, {p.running} running"
    print(f"job {p.job}: [{p.done}/{p.total}] {line}", file=sys.stderr, flush=True)


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

    def wait(self, progress: bool = False) -> JobInfo:
        """Until the job ends (embedded: runs it here). progress=True prints each step on stderr."""
        if not self._lab.farm.wait(self.id, _print_progress if progress else None):
            raise KeyboardInterrupt(f"job {self.id} was interrupted; lab.resume({self.id}) carries on")
        return self.info()

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

    def devices(self) -> list[DeviceInfo]:
        """Embedded: the lab's device list ($FARM_DEVICES) with health; a controller: its agents' devices."""
        return self.farm.devices()

    def calibrate(self, *, job: int | None = None, sim_job: int | None = None, device_job: int | None = None,
                  device: str | None = None, metrics: Iterable[str] = ("latency",), min_pairs: int = 4,
                  include_contended: bool = False) -> list[Calibration]:
        """Fit and store calibrations (a new version each); see `farm calibrate`. Groups too small to fit
        are left out; `calibrate_document` has them, with why."""
        return self.calibrate_document(job=job, sim_job=sim_job, device_job=device_job, device=device,
                                       metrics=metrics, min_pairs=min_pairs,
                                       include_contended=include_contended).calibrations

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

    def suggest(self, device: str, count: int, *, metric: str = "latency", threads: int | None = None,
                include_contended: bool = False) -> dict[str, Any]:
        """`farm calibrate --suggest K --device D`: the models of this store to measure on the device next
        (candidates: models measured in the sim, not yet in the device's calibration); local stores only."""
        from farm.controller.analysis.calibrations import CalibrationError, suggest_for_device

        if not self.farm.embedded:
            raise FarmError("Lab.suggest reads a local store's models: farm.connect(db=...) on the controller's host")
        try:
            return suggest_for_device(self.farm.store, device, count, metric=metric,  # type: ignore[attr-defined]
                                      threads=threads, include_contended=include_contended)
        except (CalibrationError, ValueError) as e:
            raise FarmError(str(e)) from None


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
    address_given = controller
    credentials = Credentials.resolve(token) if token else None
    return Lab(open_farm(address_given, db=db, credentials=credentials, slots=slots, backend=backend, create=create))


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
