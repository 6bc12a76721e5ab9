"""What to measure next on a device (`farm calibrate --suggest K --device D`): candidates from the store.

Apart from calibrations.py because it reads run records (results.py), and results.py reads calibrations
for a job's predictions: one module each way would be an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from farm.controller.analysis.calibration import Pair, suggest_models
from farm.controller.analysis.calibrations import (
    SIM_SIDE, CalibrationError, _metric_name, model_features, stored_calibration,
)
from farm.controller.analysis.results import run_records
from farm.controller.store import Store
from farm.proto.questions import RunRecord, SuggestAnswer, SuggestedModel


@dataclass
class _Candidate:
    """A model measured in the sim and not yet on the device: its first sim job, its sim values, its features."""

    model: str
    sha256: str
    family: str | None
    path: str | None
    job: int
    features: dict[str, float]
    values: list[float] = field(default_factory=list)


def _sim_value(record: RunRecord, metric: str) -> float | None:
    """A sim run record's figure for the sim side of ``metric`` (energy: latency)."""
    side = SIM_SIDE.get(metric, metric)
    value = {"latency": record.latency_ms.avg if record.latency_ms else None,
             "whole_run": record.whole_run_s if record.whole_run_s is not None else record.wall_s,
             "peak_memory": record.peak_memory_mb, "avg_memory": record.avg_memory_mb}.get(side)
    return float(value) if value is not None and value > 0 else None


def _contended(record: RunRecord) -> bool:
    return isinstance(record.contention, dict) and bool(record.contention.get("contended"))


def suggest_for_device(store: Store, device: str, count: int, *, metric: str = "latency",
                       threads: int | None = None, include_contended: bool = False,
                       jobs_limit: int = 10_000, visible_to: tuple[str, str | None] | None = None) -> SuggestAnswer:
    """The ``count`` models of the store to measure on ``device`` next (the most predictive variance removed, over the sim value and
    the model facts, ``suggest_models``). Candidates: every model with a completed (uncontended unless asked) sim run
    at that thread count in any job, not yet in the device's newest calibration; those already in it
    count as measured. ``threads``: default the newest calibration's, else 1. Each suggestion names
    the model file and the job whose sim run it came from, so a job can run exactly those."""

    _metric_name(metric)  # an unknown metric is refused by name
    rows = [r for r in store.calibrations.rows(device, metric)]
    newest = max(rows, key=lambda r: (r.created_at, r.id)) if rows else None
    if threads is None:
        threads = newest.threads if newest else 1
    measured: list[Pair] = []
    if newest is not None and newest.threads == threads:
        measured = list(stored_calibration(newest).calibration.pairs)
    done = {p.model for p in measured}
    candidates: dict[str, _Candidate] = {}
    for job in store.jobs.listing(jobs_limit, visible_to):  # visible_to: only the jobs this caller may read
        for r in run_records(store, job.id):
            value = _sim_value(r, metric)
            if (r.target != "sim" or r.status != "completed" or r.threads != threads or value is None
                    or (not include_contended and _contended(r)) or r.model.name in done):
                continue
            if r.model.name not in candidates:
                candidates[r.model.name] = _Candidate(r.model.name, r.model.sha256, r.model.family, r.model.path,
                                                      job.id, model_features(r.model))
            candidates[r.model.name].values.append(value)
    if not candidates:
        raise CalibrationError(
            f"no candidate for {device}: no model has a completed sim run at {threads} thread(s) that "
            f"{device}'s {metric} calibration does not already hold; measure models in the sim first "
            "(`farm submit` a job with them), then ask again")
    # a feature every candidate and measured model has, and that varies, can spread the choice
    names = sorted(set.intersection(*(set(c.features) for c in candidates.values()),
                                    *(set(p.features) for p in measured)))
    pairs = [Pair(c.model, sum(c.values) / len(c.values), float("nan"), c.family,
                  {n: c.features[n] for n in names}) for c in candidates.values()]
    usable = names  # counts and sizes enter in log, shares as they are: as log_ridge takes them
    chosen = suggest_models(pairs, count, features=usable,
                            measured=[Pair(p.model, p.x, p.y, p.family, {n: p.features[n] for n in usable})
                                      for p in measured])
    sim = {p.model: p.x for p in pairs}
    return SuggestAnswer(device=device, metric=metric, threads=threads, measured=len(measured),
                         candidates=len(candidates), features=usable,
                         suggested=[SuggestedModel(model=name, sim=sim[name], sha256=candidates[name].sha256,
                                                   family=candidates[name].family, path=candidates[name].path,
                                                   job=candidates[name].job) for name in chosen])
