"""`farm rank`: models ordered by the sim and by each device, side by side, with Kendall τ.

"Which of my models is best there?" is often the real question: a device column can be a
job measured on the device (or under another budget) or a calibrated device's predictions.
"""

from __future__ import annotations

import math
from collections import defaultdict
from statistics import mean

from scipy.stats import kendalltau

from farm.controller.analysis.calibrations import CalibrationError, contended_left_out, current_calibration, job_values
from farm.controller.store import Store
from farm.proto.questions import RankAnswer, RankColumn, RankGroup


class RankError(ValueError):
    pass


Cell = tuple[int, int, int]  # (threads, batch size, input size or 0): another one is another ranking


def _means(store: Store, job: int, metric: str, include_contended: bool = False,
           target: str | None = None) -> dict[Cell, dict[str, tuple[float, str | None, dict[str, float]]]]:
    """(threads, batch size, input size) -> model -> (mean over repeats, family, model features), from
    one target's runs (the sim, or one device) when given: a sim figure never averages a phone's in."""
    acc: dict[Cell, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    about: dict[str, tuple[str | None, dict[str, float]]] = {}
    for v in job_values(store, job, metric, include_contended=include_contended, target=target):
        acc[(v.threads, v.batch_size, v.input_size or 0)][v.model].append(v.value)
        about[v.model] = (v.family, v.features)
    return {cell: {m: (mean(vals), *about[m]) for m, vals in models.items()} for cell, models in acc.items()}


def _measured_columns(store: Store, job: int, metric: str, include_contended: bool,
                      label: str) -> list[tuple[str, dict[Cell, dict[str, tuple[float, str | None, dict[str, float]]]]]]:
    """A job's measured columns: one per device target from that device's own runs, or the job's sim
    runs when it has no device target (a job run under another budget)."""
    targets = store.jobs.targets(job)
    if not targets:
        return [(label, _means(store, job, metric, include_contended, target="sim"))]
    return [(f"{t} ({label})", _means(store, job, metric, include_contended, target=t)) for t in targets]


def _applies(calibration_families: set[str | None], family: str | None) -> bool:
    """A calibration applies to a model only when the model's family was among the pairs it was fitted on."""
    return family in calibration_families


def _tau(reference: dict[str, float], other: dict[str, float]) -> float | None:
    common = sorted(set(reference) & set(other))
    if len(common) < 3:
        return None
    tau = kendalltau([reference[m] for m in common], [other[m] for m in common]).statistic
    return None if tau != tau else float(tau)  # NaN when one side is constant


def rank_job(store: Store, job: int, metric: str, *, device_jobs: list[int], devices: list[str],
             include_contended: bool = False) -> RankAnswer:
    """Per cell: the sim column (sim runs only), a column per device the job (or a device job) measured,
    and a predicted column per calibrated device; τ against the sim over the models both sides have."""
    try:
        sim = _means(store, job, metric, include_contended, target="sim")
        measured = _measured_columns(store, job, metric, include_contended, f"job {job}") if store.jobs.targets(job) else []
        for d in device_jobs:
            measured += _measured_columns(store, d, metric, include_contended, f"job {d}")
    except CalibrationError as e:
        raise RankError(str(e)) from None
    left_out = 0 if include_contended else contended_left_out(store, [job, *device_jobs])
    if not sim:
        why = f" ({left_out} contended run(s) left out; --include-contended uses them)" if left_out else ""
        raise RankError(f"job {job} has no completed sim run with a {metric} figure to rank{why}")
    groups = []
    for cell in sorted(sim):
        threads, batch_size, input_size = cell
        sim_values = {m: v for m, (v, _, _) in sim[cell].items()}
        columns = [RankColumn(name=f"sim (job {job})", kendall_tau=None,
                              order=sorted(sim_values.items(), key=lambda kv: kv[1]), notes=[])]
        for name, by_cell in measured:
            values = {m: v for m, (v, _, _) in by_cell.get(cell, {}).items()}
            columns.append(RankColumn(name=name, kendall_tau=_tau(sim_values, values),
                                      order=sorted(values.items(), key=lambda kv: kv[1]), notes=[]))
        for device in devices:
            columns.append(_predicted_column(store, device, metric, cell, sim[cell]))
        groups.append(RankGroup(threads=threads, batch_size=batch_size, input_size=input_size or None,
                                columns=columns))
    return RankAnswer(job=job, metric=metric, groups=groups, contended_left_out=left_out)


def _predicted_column(store: Store, device: str, metric: str, cell: Cell,
                      sim_cell: dict[str, tuple[float, str | None, dict[str, float]]]) -> RankColumn:
    """A device's predictions from the calibration that applies to each model's family; a model with
    none gets a note and stays out of the order and of τ (never a made-up 0 ms)."""
    threads, batch_size, input_size = cell
    predicted: dict[str, float] = {}
    notes: list[str] = []
    for model, (x, fam, features) in sorted(sim_cell.items()):
        stored = current_calibration(store, device, metric, threads, family=fam, batch_size=batch_size,
                                     input_size=input_size or None)
        if stored is None or not _applies({p.family for p in stored.calibration.pairs}, fam):
            notes.append(f"{model}: no calibration for this family ({fam or 'no family'}) on {device} at "
                         f"{threads} thread(s), batch {batch_size}; `farm calibrate` a job with {fam or 'such'} "
                         f"models to predict it")
            continue
        try:
            estimate = stored.calibration.predict(x, features=features).estimate
        except ValueError as e:  # a feature the fit needs is missing, or a value outside its domain
            notes.append(f"{model}: not predicted ({e})")
            continue
        if not math.isfinite(estimate) or estimate <= 0:
            notes.append(f"{model}: the calibration gave {estimate!r}, not a duration; left out")
            continue
        predicted[model] = estimate
    sim_values = {m: v for m, (v, _, _) in sim_cell.items()}
    return RankColumn(name=f"{device} (predicted)", kendall_tau=_tau(sim_values, predicted),
                      order=sorted(predicted.items(), key=lambda kv: kv[1]), notes=notes)
