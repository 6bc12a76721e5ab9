"""From stored runs to stored calibrations: pairing, fitting per group, versioning.

Pairs come from completed runs only. Until device drivers exist, a "device" can be any
job measured elsewhere or under another budget: `--sim-job A --device-job B` pairs the two
jobs' runs of the same model (by sha256), matrix cell and repeat.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from pydantic import JsonValue

from farm.controller.analysis.calibration import (
    Calibration, FitResult, Pair, PopulationPrior, Prior, calibrate, shipped_class_priors,
)
from farm.controller.store import METRIC_UNITS, Store
from farm.controller.store.rows import CalibrationRow, LatestCalibration
from farm.proto.questions import RunRecord

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
        env = json.loads(row.environment_json or "{}")
        facts = json.loads(row.model_facts_json or "{}")
        features = model_features({"size_bytes": row.model_size_bytes,
                                   "param_count": row.model_param_count, **facts})
        # every task is scheduled with its model's digest and a batch size; a row without them reads as "" and 1
        out.append(MeasuredValue(row.model_name, row.model_sha256 or "", row.model_family, row.threads,
                                 row.batch_size or 1, row.input_size, row.repeat, env.get("runtime", ""),
                                 float(row.value), row.run_id, features, model_precision(facts)))
    return out


def model_precision(facts: dict[str, Any]) -> str:
    """int8 / fp16 / fp32 from a model's facts: its inputs' type, or quantize ops inside a float model."""
    dtypes = {str(t.get("dtype", "")).lower() for t in facts.get("inputs") or []}
    if dtypes & {"int8", "uint8"} or "QUANTIZE" in (facts.get("op_types") or {}):
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
        facts = json.loads(row.model_facts_json or "{}")
        features = model_features({"size_bytes": row.model_size_bytes,
                                   "param_count": row.model_param_count, **facts})
        runtime = json.loads(row.environment_json or "{}").get("runtime", "")
        device_environment = json.loads(row.device_environment or "{}")
        board: dict[str, Any] = device_environment.get("device") or {}
        # a Jetson in another power mode is another device to calibrate; a board of another architecture
        # costs each operator differently, so its fit is never one with an x86 board's; and a run on a GPU, NPU or
        # DSP is a fit of its own (a sim → gpu pair: the key says what it is)
        unit = device_environment.get("accelerator") or {}
        on = (f"unit={unit.get('unit')}" + (f":{unit['precision']}" if unit.get("precision") not in (None, "fp32") else "")
              if isinstance(unit, dict) and unit.get("unit") not in (None, "cpu") else None)
        qualifiers = [q for q in (board.get("power_identity"), board.get("arch") and f"arch={board['arch']}", on) if q]
        if qualifiers:
            runtime = f"{runtime}@{';'.join(qualifiers)}"
        out.append(PairedRun(Pair(row.model_name, float(row.x), float(row.y), row.model_family, features),
                             row.threads, runtime, row.sim_run, row.device_run, row.batch_size or 1,
                             row.input_size, model_precision(facts)))
    return out


def job_devices(store: Store, job_id: int) -> list[str]:
    return store.jobs.targets(job_id)


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
    source: dict[str, Any]  # the jobs it came from and the sim budget/workload to reproduce the x side
    batch_size: int = 1
    input_size: int | None = None
    precision: str = "fp32"


def calibration_source(store: Store, sim_job: int, device_job: int | None = None) -> dict[str, Any]:
    """The jobs a calibration came from, and what a prediction needs to measure a new model exactly
    as its sim side was (budget and workload). device_job None: device runs and twins in one job."""
    job = store.jobs.get(sim_job)
    if job is None:
        raise ValueError(f"no job {sim_job} in {store.location}")
    spec = json.loads(job.spec_json or "{}")
    jobs = {"job": sim_job} if device_job is None else {"sim_job": sim_job, "device_job": device_job}
    return {**jobs, "sim": spec["sim"], "workload": spec["workload"]}


def fit_and_store(store: Store, device: str, metric: str, paired: list[PairedRun], *, source: dict[str, Any],
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
    newest: dict[str, tuple[int, dict[str, Any]]] = {}
    for row in rows:
        fit = json.loads(row.fit_json or "{}")["fits"].get("log_ridge")
        if fit is not None and row.device not in newest:
            newest[row.device] = (row.version, fit)
    if device in newest:
        version, fit = newest[device]
        return Prior.from_fits([FitResult.from_json(fit)], features, f"{device} version {version}")
    device_type = _device_type(store, device)
    peers = [FitResult.from_json(fit) for name, (_, fit) in newest.items()
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
            document = json.loads(row.fit_json or "{}")
            newest[row.device] = FitResult.from_json(document["fits"][document["chosen"]])
    return PopulationPrior.shipped().with_fits(list(newest.values()), "device(s) in this store")


def _device_type(store: Store, device: str) -> str | None:
    return store.devices.device_type(device)


def _store_one(store: Store, device: str, metric: str, key: CalibrationKey, family: str,
               cal: Calibration, runs: list[PairedRun], source: dict[str, Any]) -> StoredCalibration:
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
        "fit_json": json.dumps(cal.to_json()), "source": json.dumps(source),
    }, [{"model": r.pair.model, "sim_run_id": r.sim_run_id, "device_run_id": r.device_run_id} for r in runs])
    return StoredCalibration(cal_id, device, metric, threads, runtime, family, version, cal, source,
                             key.batch_size, key.input_size, key.precision)


def stored_calibration(row: CalibrationRow | LatestCalibration) -> StoredCalibration:
    return StoredCalibration(row.id, row.device, row.metric, row.threads, row.runtime, row.family,
                             row.version, Calibration.from_json(json.loads(row.fit_json or "{}")),
                             json.loads(row.source or "{}"), row.batch_size or 1, row.input_size,
                             row.precision or "fp32")


def calibration_history(store: Store, device: str | None = None, metric: str | None = None) -> list[dict[str, Any]]:
    rows = [{k: v for k, v in r.as_dict().items() if k not in ("a", "b")} for r in store.calibrations.rows(device, metric)]
    for r in rows:
        r["warnings"] = json.loads(r.pop("warnings_json") or "[]")
        calibration = Calibration.from_json(json.loads(r.pop("fit_json")))
        fit = calibration.chosen_fit
        # the whole chosen fit, under honest names: a line's a/b, a power law's exponent/factor
        r.update(formula=fit.formula, features_used=list(fit.features_used), unsafe=calibration.unsafe,
                 prior_weight=fit.prior_weight, prior_source=fit.prior_source,
                 **({"exponent": fit.a, "factor": fit.b} if fit.log_space else {"a": fit.a, "b": fit.b}))
    return rows


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
            fit = json.loads(row.fit_json or "{}")["fits"].get("log_bayes")
            if fit is not None:
                newest[row.device] = FitResult.from_json(fit)
    return {name: prior.with_fits([f for f in newest.values() if f.device_class == name], "device(s) in this store")
            for name, prior in shipped_class_priors().items()}


def add_predictions(store: Store, records: list[RunRecord], devices: list[str], sim_budget: dict[str, Any]) -> None:
    """`predict_for`: put each device's calibrated estimate beside every completed record."""
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
                                 "same_sim_budget": stored.source.get("sim") == sim_budget}
            predictions[device] = entry or None
        record.predictions = predictions  # set: the record's JSON carries it


def model_features(model: dict[str, Any]) -> dict[str, float]:
    """The regressor values a model has (FEATURES), from a results record's model or any such mapping."""
    return {f: float(model[f]) for f in FEATURES if model.get(f) is not None}


