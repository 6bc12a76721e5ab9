"""From stored runs to stored calibrations: pairing, fitting per group, versioning.

Pairs come from completed runs only. Until device drivers exist, a "device" can be any
job measured elsewhere or under another budget: `--sim-job A --device-job B` pairs the two
jobs' runs of the same model (by sha256), matrix cell and repeat.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, JsonValue, ValidationError

from farm.controller.analysis.calibration import (
    Calibration, FitResult, Pair, PopulationPrior, Prior, calibrate, shipped_class_priors,
)
from farm.controller.store import METRIC_UNITS, Store
from farm.controller.store.rows import CalibrationRow, LatestCalibration
from farm.proto.questions import CalibrationVersion, RunModel, RunRecord
from farm.proto.results import ModelFacts
from farm.proto.spec import SimBudget, Workload

MiB = 1 << 20

# metric name -> (the store's name for it, unit); the store maps a name to its columns (controller/store)
METRICS: dict[str, tuple[str, str]] = {name: (name, unit) for name, unit in METRIC_UNITS.items()}
SIM_SIDE = {"energy": "latency"}  # metrics whose sim value is another metric
ALL_FAMILIES = ""  # the family key of a fit over every family
# Model facts offered as extra regressors; each is kept only where leave-one-out says it helps.
# (other_macs_share is 1 − the three shares: offering it too would add nothing.)
# op_count is the layer count (operators in the graph). conv1x1_macs_share is the 1×1-conv part of
# conv_macs_share, the other share issue 31's fit uses beside the depthwise one.
FEATURES = ("param_count", "macs", "size_bytes", "conv_macs_share", "depthwise_macs_share", "fc_macs_share",
            "conv1x1_macs_share", "activation_bytes", "op_count")


class CalibrationError(ValueError):
    """Nothing to fit, or an unknown metric/job: a message for a person."""


def _object_or_none(value: object) -> object:
    return value if isinstance(value, dict) else None


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class StoredTensor(_Lenient):
    dtype: str = ""


class StoredFacts(_Lenient):
    """The parts of a task's stored model facts (tasks.model_facts_json: the scheduler's `asdict(ModelFacts)`, "{}"
    for a model that could not be read) a calibration reads: the FEATURES, the inputs' types, the op types. A fact
    the stored JSON names (even as null) stands; one it does not name is not set (model_fields_set)."""

    size_bytes: float | None = None
    param_count: float | None = None
    macs: float | None = None
    conv_macs_share: float | None = None
    depthwise_macs_share: float | None = None
    fc_macs_share: float | None = None
    conv1x1_macs_share: float | None = None
    activation_bytes: float | None = None
    op_count: float | None = None
    inputs: list[StoredTensor] = []
    op_types: dict[str, float] = {}


def stored_facts(text: str | None) -> StoredFacts:
    """A task's stored model facts; none (every fact unset) where the JSON is not the facts' shape."""
    try:
        return StoredFacts.model_validate_json(text or "{}")
    except ValidationError:
        return StoredFacts()


class BoardIdentity(_Lenient):
    """What a run's board says of itself that makes it another device to calibrate (agents/boards)."""

    power_identity: str | None = None
    arch: str | None = None


class UnitUse(_Lenient):
    """The compute unit a run used (a sim → gpu pair is a fit of its own)."""

    unit: str | None = None
    precision: str | None = None


class RunEnvironment(_Lenient):
    """The parts of a run's stored environment (runs.environment_json) a calibration key reads; the rest is
    the run's own record and ignored here."""

    runtime: str | None = None
    device: Annotated[BoardIdentity | None, BeforeValidator(_object_or_none)] = None
    accelerator: Annotated[UnitUse | None, BeforeValidator(_object_or_none)] = None

    @classmethod
    def of(cls, text: str | None, run_id: int) -> RunEnvironment:
        try:
            return cls.model_validate_json(text or "{}")
        except ValidationError as e:
            raise CalibrationError(f"run {run_id}'s stored environment is not an environment "
                                   f"({e.errors()[0]['loc']}: {e.errors()[0]['msg']})") from None

    def qualifiers(self) -> list[str]:
        """What makes a device run's board another device to calibrate: power mode, architecture, compute unit."""
        unit = self.accelerator
        on = (f"unit={unit.unit}" + (f":{unit.precision}" if unit.precision not in (None, "fp32") else "")
              if unit is not None and unit.unit not in (None, "cpu") else None)
        board = self.device or BoardIdentity()
        return [q for q in (board.power_identity, board.arch and f"arch={board.arch}", on) if q]


def _features(facts: StoredFacts, size_bytes: int | None, param_count: int | None) -> dict[str, float]:
    """The regressors of a stored task's model: the size and parameter count its task row holds, and each fact its
    stored facts name (those stand over the row's)."""
    values: dict[str, float | None] = {"size_bytes": size_bytes, "param_count": param_count}
    values.update({name: getattr(facts, name) for name in FEATURES if name in facts.model_fields_set})
    return {name: float(value) for name in FEATURES if (value := values.get(name)) is not None}


@dataclass
class MeasuredValue:
    model: str
    sha256: str
    family: str | None
    threads: int
    batch_size: int
    input_size: int | None
    repeat: int
    runtime: str
    value: float
    run_id: int
    features: dict[str, float]
    precision: str = "fp32"


def _metric_name(metric: str) -> str:
    if metric not in METRICS:
        raise CalibrationError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
    return METRICS[metric][0]


def contended_left_out(store: Store, job_ids: list[int]) -> int:
    """Completed runs of these jobs that pair selection leaves out as contended (to say how many).

    A contended sim run measured other work as much as the model: pairs leave it out unless asked."""
    return store.calibrations.contended_completed_runs(job_ids)


def job_values(store: Store, job_id: int, metric: str, *, include_contended: bool = False,
               target: str | None = None) -> list[MeasuredValue]:
    """The metric of every completed run of a job (the attempt that counted); contended runs only if asked;
    one target's runs only (the sim or a device) when given."""
    if store.jobs.get(job_id) is None:
        raise CalibrationError(f"no job {job_id} in {store.location}")
    rows = store.calibrations.completed_values(job_id, _metric_name(metric), include_contended=include_contended, target=target)
    out = []
    for row in rows:
        if row.value is None:
            continue
        env = RunEnvironment.of(row.environment_json, row.run_id)
        facts = stored_facts(row.model_facts_json)
        features = _features(facts, row.model_size_bytes, row.model_param_count)
        # every task is scheduled with its model's digest and a batch size; a row without them reads as "" and 1
        out.append(MeasuredValue(row.model_name, row.model_sha256 or "", row.model_family, row.threads,
                                 row.batch_size or 1, row.input_size, row.repeat, env.runtime or "",
                                 float(row.value), row.run_id, features, model_precision(facts)))
    return out


def model_precision(facts: StoredFacts) -> str:
    """int8 / fp16 / fp32 from a model's facts: its inputs' type, or quantize ops inside a float model."""
    dtypes = {t.dtype.lower() for t in facts.inputs}
    if dtypes & {"int8", "uint8"} or "QUANTIZE" in facts.op_types:
        return "int8"
    if dtypes & {"float16"}:
        return "fp16"
    return "fp32"


@dataclass
class PairedRun:
    pair: Pair
    threads: int
    runtime: str
    sim_run_id: int
    device_run_id: int
    batch_size: int = 1
    input_size: int | None = None
    precision: str = "fp32"


def pair_jobs(store: Store, sim_job: int, device_job: int, metric: str, *,
              include_contended: bool = False) -> list[PairedRun]:
    """Runs of the same model (sha256), cell and repeat in both jobs, averaged over repeats later."""
    device = {(v.sha256, v.threads, v.batch_size, v.input_size, v.repeat): v
              for v in job_values(store, device_job, metric, include_contended=include_contended)}
    pairs = []
    for s in job_values(store, sim_job, SIM_SIDE.get(metric, metric), include_contended=include_contended):
        d = device.get((s.sha256, s.threads, s.batch_size, s.input_size, s.repeat))
        if d is None:
            continue
        pairs.append(PairedRun(Pair(s.model, s.value, d.value, s.family, s.features), s.threads, s.runtime,
                               s.run_id, d.run_id, s.batch_size, s.input_size, s.precision))
    return pairs


def pair_within_job(store: Store, job_id: int, device: str, metric: str, *,
                    include_contended: bool = False) -> list[PairedRun]:
    """A job's device runs beside their sim twins (same pair key), completed on both sides; a twin
    whose run was contended only if asked."""
    expr = _metric_name(metric)
    sim_expr = _metric_name(SIM_SIDE.get(metric, metric))
    if store.jobs.get(job_id) is None:
        raise CalibrationError(f"no job {job_id} in {store.location}")
    rows = store.calibrations.paired_values(job_id, device, sim_expr, expr, include_contended=include_contended)
    out = []
    for row in rows:
        if row.x is None or row.y is None:
            continue
        facts = stored_facts(row.model_facts_json)
        features = _features(facts, row.model_size_bytes, row.model_param_count)
        # a Jetson in another power mode is another device to calibrate; a board of another architecture
        # costs each operator differently, so its fit is never one with an x86 board's; and a run on a GPU, NPU or
        # DSP is a fit of its own (a sim → gpu pair: the key says what it is)
        runtime = RunEnvironment.of(row.environment_json, row.sim_run).runtime or ""
        qualifiers = RunEnvironment.of(row.device_environment, row.device_run).qualifiers()
        if qualifiers:
            runtime = f"{runtime}@{';'.join(qualifiers)}"
        out.append(PairedRun(Pair(row.model_name, float(row.x), float(row.y), row.model_family, features),
                             row.threads, runtime, row.sim_run, row.device_run, row.batch_size or 1,
                             row.input_size, model_precision(facts)))
    return out


def job_devices(store: Store, job_id: int) -> list[str]:
    return store.jobs.targets(job_id)


class CalibrationSource(BaseModel):
    """What a calibration came from (calibrations.source): its job (device runs and their sim twins in one job) or
    its two jobs, and the sim budget and workload its sim side ran, so a prediction measures a new model alike."""

    model_config = ConfigDict(frozen=True)
    job: int | None = None
    sim_job: int | None = None
    device_job: int | None = None
    sim: SimBudget | None = None  # None: fitted before sources recorded the sim side (or from pairs outside any job)
    workload: Workload | None = None

    def stored(self) -> str:
        """As calibrations.source keeps it: the jobs given, then the sim budget and workload as their job stored them."""
        return json.dumps(self.model_dump(mode="json", exclude_unset=True))

    @classmethod
    def of(cls, text: str | None) -> CalibrationSource:
        """A stored source; one that is not a source's shape (or none) records nothing. A sim side this farm no
        longer accepts is dropped alone: the jobs it came from stay (the report names them; predict says refit)."""
        try:
            return cls.model_validate_json(text or "{}")
        except ValidationError:
            pass
        try:
            stored = json.loads(text or "{}")
            jobs = {k: stored[k] for k in ("job", "sim_job", "device_job") if k in stored} if isinstance(stored, dict) else {}
            return cls.model_validate(jobs)
        except (ValueError, ValidationError):
            return cls()

    def first_job(self) -> int | None:
        """The job the calibration came from, or its device side's (else its sim side's)."""
        return self.job or self.device_job or self.sim_job


@dataclass
class StoredCalibration:
    id: int
    device: str
    metric: str
    threads: int
    runtime: str
    family: str
    version: int
    calibration: Calibration
    source: CalibrationSource  # the jobs it came from and the sim budget/workload to reproduce the x side
    batch_size: int = 1
    input_size: int | None = None
    precision: str = "fp32"


class SimSide(BaseModel):
    """The parts of a stored job spec (jobs.spec_json) a calibration's source keeps."""

    model_config = ConfigDict(extra="ignore")
    sim: SimBudget
    workload: Workload


def sim_side(spec_json: str | None) -> SimSide | None:
    """A stored job's sim budget and workload; None for a spec without them."""
    try:
        return SimSide.model_validate_json(spec_json or "{}")
    except ValidationError:
        return None


def calibration_source(store: Store, sim_job: int, device_job: int | None = None) -> CalibrationSource:
    """The jobs a calibration came from, and what a prediction needs to measure a new model exactly
    as its sim side was (budget and workload). device_job None: device runs and twins in one job."""
    job = store.jobs.get(sim_job)
    if job is None:
        raise ValueError(f"no job {sim_job} in {store.location}")
    side = sim_side(job.spec_json)  # None: a spec without a sim side this farm reads; a prediction then says so
    given = {} if side is None else {"sim": side.sim, "workload": side.workload}
    if device_job is None:
        return CalibrationSource(job=sim_job, **given)
    return CalibrationSource(sim_job=sim_job, device_job=device_job, **given)


def fit_and_store(store: Store, device: str, metric: str, paired: list[PairedRun], *, source: CalibrationSource | None,
                  min_pairs: int = 4, confidence: float = 0.9) -> tuple[list[StoredCalibration], list[str]]:
    """One calibration per key (threads, runtime, batch size, input size, precision) and, where a
    family has enough models, per family. Different batch or input sizes are never pooled.

    Returns the stored calibrations and the groups that were refused, with why.
    """
    groups: dict[tuple[CalibrationKey, str], list[PairedRun]] = defaultdict(list)
    for p in paired:
        key = CalibrationKey(p.threads, p.runtime, p.batch_size, p.input_size, p.precision)
        groups[(key, ALL_FAMILIES)].append(p)
        if p.pair.family:
            groups[(key, p.pair.family)].append(p)
    stored, refused = [], []
    for (key, family), runs in sorted(groups.items(), key=lambda item: (item[0][0].sort_key(), item[0][1])):
        label = f"{device} {metric} {key}" + (f" family={family}" if family else "")
        if family and len({r.pair.family for r in runs}) == 1 and len(runs) == len(groups[(key, ALL_FAMILIES)]):
            continue  # one family only: the per-family fit would repeat the pooled one
        try:
            offered = [f for f in FEATURES if all(f in r.pair.features for r in runs)]
            prior = lab_prior(store, device, metric, key, family, offered)
            cal = calibrate([r.pair for r in runs], confidence=confidence, min_pairs=min_pairs, features=offered,
                            prior=prior, population=lab_population(store, device, metric, key, family),
                            class_priors=lab_class_priors(store, device, metric, key, family))
        except ValueError as e:  # NotEnoughPairs, or values too bunched up to fit
            refused.append(f"{label}: {e}")
            continue
        stored.append(_store_one(store, device, metric, key, family, cal, runs, source))
    return stored, refused


@dataclass(frozen=True)
class CalibrationKey:
    """What a calibration is for, apart from device, metric and family: never averaged together."""

    threads: int
    runtime: str
    batch_size: int = 1
    input_size: int | None = None
    precision: str = "fp32"

    def sort_key(self) -> tuple[int, str, int, int, str]:
        return (self.threads, self.runtime, self.batch_size, self.input_size or 0, self.precision)

    def __str__(self) -> str:
        return (f"threads={self.threads} runtime={self.runtime or '?'} batch={self.batch_size}"
                + (f" input={self.input_size}" if self.input_size else "") + f" precision={self.precision}")


def lab_prior(store: Store, device: str, metric: str, key: CalibrationKey, family: str,
              features: list[str]) -> Prior:
    """What the lab already knows: this device's newest log_ridge fit for the key, else the mean of
    the newest ones of other devices of the same device type, else "device = constant factor × sim"."""
    rows = store.calibrations.fits(metric, key.threads, key.runtime, key.batch_size, key.input_size, key.precision, family)
    newest: dict[str, tuple[int, FitResult]] = {}
    for row in rows:
        if row.device not in newest:
            fit = _stored_fits(row.fit_json).get("log_ridge")
            if fit is not None:
                newest[row.device] = (row.version, fit)
    if device in newest:
        version, fit = newest[device]
        return Prior.from_fits([fit], features, f"{device} version {version}")
    device_type = _device_type(store, device)
    peers = [fit for name, (_, fit) in newest.items()
             if device_type and _device_type(store, name) == device_type]
    if peers:
        return Prior.from_fits(peers, features, f"{len(peers)} other device(s) of type {device_type}")
    return Prior()


def lab_population(store: Store, device: str, metric: str, key: CalibrationKey, family: str) -> PopulationPrior:
    """The shipped population prior, with the newest chosen fit of every *other* device the store holds
    for this key added as more devices of the population (those that used MACs and size in log space)."""
    rows = store.calibrations.fits(metric, key.threads, key.runtime, key.batch_size, key.input_size, key.precision, family)
    newest: dict[str, FitResult] = {}
    for row in rows:
        if row.device != device and row.device not in newest:
            newest[row.device] = Calibration.from_json(json.loads(row.fit_json or "{}")).chosen_fit
    return PopulationPrior.shipped().with_fits(list(newest.values()), "device(s) in this store")


def _stored_fits(fit_json: str | None) -> dict[str, FitResult]:
    """A stored calibration's fits by kind (calibrations.fit_json, as Calibration.to_json wrote it)."""
    return Calibration.from_json(json.loads(fit_json or "{}")).fits


def _device_type(store: Store, device: str) -> str | None:
    return store.devices.device_type(device)


def _store_one(store: Store, device: str, metric: str, key: CalibrationKey, family: str,
               cal: Calibration, runs: list[PairedRun], source: CalibrationSource | None) -> StoredCalibration:
    chosen = cal.fits[cal.chosen]
    threads, runtime = key.threads, key.runtime
    cal_id, version = store.calibrations.add({
        "device": device, "metric": metric, "threads": threads, "runtime": runtime, "precision": key.precision,
        "batch_size": key.batch_size, "input_size": key.input_size,
        "family": family, "created_at": time.time(), "kind": cal.chosen, "n": chosen.n,
        # a and b are a line's slope and intercept; a log fit's exponent/factor live in fit_json under those names
        "a": None if chosen.log_space else chosen.a, "b": None if chosen.log_space else chosen.b,
        "r2": chosen.r2, "loo_mape": chosen.loo_mape,
        "within_10": chosen.loo_within_10, "kendall_tau": chosen.kendall_tau,
        "spearman_rho": chosen.spearman_rho, "warnings_json": json.dumps(cal.warnings),
        "fit_json": json.dumps(cal.to_json()), "source": source.stored() if source else "{}",
    }, [{"model": r.pair.model, "sim_run_id": r.sim_run_id, "device_run_id": r.device_run_id} for r in runs])
    return StoredCalibration(cal_id, device, metric, threads, runtime, family, version, cal,
                             source or CalibrationSource(), key.batch_size, key.input_size, key.precision)


def stored_calibration(row: CalibrationRow | LatestCalibration) -> StoredCalibration:
    return StoredCalibration(row.id, row.device, row.metric, row.threads, row.runtime, row.family,
                             row.version, Calibration.from_json(json.loads(row.fit_json or "{}")),
                             CalibrationSource.of(row.source), row.batch_size or 1, row.input_size,
                             row.precision or "fp32")


def calibration_history(store: Store, device: str | None = None, metric: str | None = None) -> list[CalibrationVersion]:
    """Every stored calibration version (of a device, a metric), as `farm calibrations` lists them."""
    return [calibration_version(r) for r in store.calibrations.rows(device, metric)]


def calibration_version(row: CalibrationRow) -> CalibrationVersion:
    """One stored version with its whole chosen fit, under honest names: a line's a/b, a power law's exponent/factor."""
    calibration = Calibration.from_json(json.loads(row.fit_json or "{}"))
    fit = calibration.chosen_fit
    version = CalibrationVersion(
        id=row.id, device=row.device, metric=row.metric, threads=row.threads, runtime=row.runtime,
        batch_size=row.batch_size, input_size=row.input_size, precision=row.precision, family=row.family,
        version=row.version, created_at=row.created_at, kind=row.kind, n=row.n, r2=row.r2, loo_mape=row.loo_mape,
        within_10=row.within_10, kendall_tau=row.kendall_tau, spearman_rho=row.spearman_rho, source=row.source,
        warnings=json.loads(row.warnings_json or "[]"), formula=fit.formula, features_used=list(fit.features_used),
        unsafe=calibration.unsafe, prior_weight=fit.prior_weight, prior_source=fit.prior_source)
    if fit.log_space:
        version.exponent, version.factor = fit.a, fit.b
    else:
        version.a, version.b = fit.a, fit.b
    return version


def current_calibration(store: Store, device: str, metric: str, threads: int, runtime: str | None = None,
                        family: str | None = None, batch_size: int | None = None, input_size: int | None = None,
                        precision: str | None = None) -> StoredCalibration | None:
    """The newest version for the key; a family's own fit when it has one, else the pooled fit.

    batch size / input size / precision None: any (the newest wins).
    """
    for fam in ([family] if family else []) + [ALL_FAMILIES]:
        # a sim run's plain runtime matches each power mode of a board's calibrations: the newest wins
        row = store.calibrations.newest(device, metric, threads, fam, runtime=runtime, batch_size=batch_size,
                                       input_size=input_size, precision=precision)
        if row:
            return stored_calibration(row)
    return None


def devices_with_calibrations(store: Store) -> list[str]:
    return store.calibrations.devices()


def lab_class_priors(store: Store, device: str, metric: str, key: CalibrationKey, family: str
                     ) -> dict[str, PopulationPrior]:
    """The shipped per-class priors of the log_bayes kind, each with the newest log_bayes fit of every *other*
    device the store holds for this key and of that class added as more devices of the class (issue 31:
    the prior's widths learned from the lab's own calibrations where present)."""
    rows = store.calibrations.fits(metric, key.threads, key.runtime, key.batch_size, key.input_size, key.precision, family)
    newest: dict[str, FitResult] = {}
    for row in rows:
        if row.device != device and row.device not in newest:
            fit = _stored_fits(row.fit_json).get("log_bayes")
            if fit is not None:
                newest[row.device] = fit
    return {name: prior.with_fits([f for f in newest.values() if f.device_class == name], "device(s) in this store")
            for name, prior in shipped_class_priors().items()}


def add_predictions(store: Store, records: list[RunRecord], devices: list[str], sim_budget: SimBudget | None) -> None:
    """`predict_for`: put each device's calibrated estimate beside every completed record; `sim_budget` is the
    job's (None: one this farm cannot read, which no calibration's counts as)."""
    for record in records:
        if record.status != "completed":
            continue
        predictions: dict[str, JsonValue] = {}
        features = model_features(record.model.model_dump())
        for device in devices:
            entry: dict[str, JsonValue] = {}
            measured = (("latency", record.latency_ms.avg if record.latency_ms else None),
                        ("peak_memory", record.peak_memory_mb), ("avg_memory", record.avg_memory_mb))
            for metric, x in measured:
                if x is None:
                    continue
                stored = current_calibration(store, device, metric, record.threads, runtime=record.runtime,
                                             family=record.model.family, batch_size=record.batch_size,
                                             input_size=record.input_size)
                if stored is None:
                    continue
                p = stored.calibration.fits[stored.calibration.chosen].predict(x, features=features)
                entry[metric] = {"estimate": p.estimate, "low": p.low, "high": p.high, "calibration": stored.id,
                                 "version": stored.version,
                                 # a calibration from another sim budget does not apply to these numbers
                                 "same_sim_budget": stored.source.sim is not None and stored.source.sim == sim_budget}
            predictions[device] = entry or None
        record.predictions = predictions  # set: the record's JSON carries it


def model_features(model: ModelFacts | StoredFacts | RunModel | Mapping[str, Any]) -> dict[str, float]:
    """The regressor values a model has (FEATURES), from its facts, a results record's model (or, until the
    record readers move to the model, its plain form)."""
    if isinstance(model, Mapping):
        values = [(f, model.get(f)) for f in FEATURES]
    else:
        values = [(f, getattr(model, f, None)) for f in FEATURES]
    return {f: float(value) for f, value in values if value is not None}


