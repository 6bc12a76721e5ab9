"""After a reference-suite run: refit every device, measure drift against the previous
calibration, and check each device's golden results against its own history.

Calibrations go stale silently unless something checks (a phone gets an OS update, a board
loses its fan); this is the check. A device whose golden results leave their history by
more than k·σ is quarantined until a person releases it.
"""

from __future__ import annotations

import logging
import statistics

import numpy as np
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from farm.controller.operations.alerts import DriftEvent, drift_event
from farm.controller.analysis.calibrations import (
    ALL_FAMILIES, StoredCalibration, contended_left_out, calibration_source, fit_and_store,
    job_devices, pair_within_job,
)
from farm.controller.scheduling.controller import Controller
from farm.controller.operations.reference_suite import HEALTH_CHECK
from farm.controller.store import Store
from farm.proto.questions import DriftCheck

log = logging.getLogger("farm.refresh")


@dataclass
class DriftThresholds:
    # Defaults sit above what two quiet refreshes differ by on a shared 2-core machine (slope up
    # to ~16 %, as the sim side itself moves that much); set them from your lab's own quiet nights.
    slope_change: float = 0.30  # relative change of a
    intercept_change: float = 0.30  # change of b, relative to the mean device value
    r2_drop: float = 0.05
    prediction_shift: float = 0.25  # mean relative move of the reference models' predictions


def _plain_line(pairs: list[Any]) -> tuple[float, float, float]:
    xs = np.array([p.x for p in pairs])
    ys = np.array([p.y for p in pairs])
    a, b = np.polyfit(xs, ys, 1)
    residual = ys - (a * xs + b)
    total = float(((ys - ys.mean()) ** 2).sum())
    return float(a), float(b), 1.0 - float((residual ** 2).sum()) / total if total else 1.0


def _source_job(c: StoredCalibration) -> int | None:
    return c.source.first_job()


def unlike(store: Store, old: StoredCalibration, new: StoredCalibration) -> str | None:
    """Why `old` is no baseline for `new` (None: like with like). Drift compares a refresh's fit with an earlier
    refresh's: the reference suite's runs (not a calibration someone fitted by hand, whose fit moves for reasons
    that are not the device), the same kind of fit on the same features."""
    job_id = _source_job(old)
    job = store.jobs.get(job_id) if job_id is not None else None
    if job is None or job.kind != HEALTH_CHECK:
        return (f"version {old.version} (#{old.id}) was fitted from job {job_id if job_id is not None else '?'}, "
                "not by a refresh")
    # the same kind of fit on the same features (drift_between compares the models both measured, with the old
    # version's own fit of the kind the new one chose): a fit of that kind on other features is passed over
    kind, new_fit = new.calibration.chosen, new.calibration.chosen_fit
    old_fit = old.calibration.fits.get(kind)
    if old_fit is not None and sorted(old_fit.features_used) != sorted(new_fit.features_used):
        return (f"version {old.version} (#{old.id}) fitted {kind} on "
                f"{', '.join(sorted(old_fit.features_used)) or 'sim alone'}, this one on "
                f"{', '.join(sorted(new_fit.features_used)) or 'sim alone'}")
    return None


def drift_baseline(store: Store, new: StoredCalibration) -> tuple[StoredCalibration | None, list[str]]:
    """The newest earlier version of `new`'s key that is like with like (unlike() says None), and why each newer
    one was passed over. None: nothing to compare with yet, and nothing to raise an alert about."""
    from farm.controller.analysis.calibrations import stored_calibration

    passed: list[str] = []
    for row in reversed(store.calibrations.versions(new.id)):
        if row.version >= new.version:
            continue
        old = stored_calibration(row)
        why = unlike(store, old, new)
        if why is None:
            return old, passed
        passed.append(why)
    return None, passed


def drift_between(old: StoredCalibration, new: StoredCalibration, thresholds: DriftThresholds) -> DriftCheck:
    """How far the device moved between two calibrations, like with like (issue 32):

    - the coefficients and R² are those of the plain line y = a·x + b through the models *both*
      calibrations measured (a line through other models says how the models differ, not the device);
      with fewer than three in common they are not compared;
    - the prediction shift compares the *same fit kind* (the new calibration's chosen kind, when the old
      one has it; else each one's chosen) on the new calibration's models that lie inside the range the
      old fit saw (an extrapolated prediction moving is not drift).
    Each reason says what it was computed on."""
    old_pairs = {p.model: p for p in old.calibration.pairs}
    shared = [p for p in new.calibration.pairs if p.model in old_pairs]
    slope = intercept = r2_drop = 0.0
    moved: dict[str, str] = {}  # what each figure moved from and to: an alert a person can check
    basis = f"{len(shared)} model(s) in common"
    if len(shared) >= 3 and len({p.x for p in shared}) >= 2 and len({old_pairs[p.model].x for p in shared}) >= 2:
        a_old, b_old, r2_old = _plain_line([old_pairs[p.model] for p in shared])
        a_new, b_new, r2_new = _plain_line(shared)
        mean_y = statistics.fmean(p.y for p in shared) or 1.0
        slope = abs(a_new - a_old) / abs(a_old) if a_old else float("inf")
        intercept = abs(b_new - b_old) / abs(mean_y)
        r2_drop = max(0.0, r2_old - r2_new)
        basis = f"plain line over the {len(shared)} model(s) both measured"
        moved = {"slope_change": f"slope {a_old:.4g} → {a_new:.4g}",
                 "intercept_change": f"intercept {b_old:.4g} → {b_new:.4g}", "r2_drop": f"R² {r2_old:.3f} → {r2_new:.3f}"}
    kind = new.calibration.chosen if new.calibration.chosen in old.calibration.fits else None
    old_fit, new_fit = old.calibration.fit(kind), new.calibration.fit(kind)
    shifts = []
    for p in new.calibration.pairs:
        if old_fit.extrapolation([p.x], {k: [v] for k, v in p.features.items()})[0]:
            continue  # outside what the old fit saw
        before = old_fit.predict(p.x, features=p.features).estimate
        if before:
            shifts.append(abs(new_fit.predict(p.x, features=p.features).estimate - before) / abs(before))
    shift = statistics.fmean(shifts) if shifts else 0.0
    shift_basis = (f"{kind or f'{old_fit.kind} vs {new_fit.kind}'} on {len(shifts)} model(s) inside the old fit's range")
    moved["prediction_shift"] = f"predictions moved {100 * shift:.1f} % on average"
    against = f"v{old.version} → v{new.version}"
    reasons = [f"{name} {value:.3g} > {getattr(thresholds, name):g} "
               f"({moved.get(name, name)}; {shift_basis if name == 'prediction_shift' else basis}; {against})"
               for name, value in (("slope_change", slope), ("intercept_change", intercept), ("r2_drop", r2_drop),
                                   ("prediction_shift", shift)) if value > getattr(thresholds, name)]
    return DriftCheck(device=new.device, metric=new.metric, threads=new.threads, calibration_id=new.id,
                      previous_id=old.id, slope_change=slope, intercept_change=intercept, r2_drop=r2_drop,
                      prediction_shift=shift, reasons=reasons, exceeded=bool(reasons))


def record_drift(store: Store, drift: DriftCheck) -> None:
    row = drift.model_dump(exclude={"reasons", "exceeded"})
    store.calibrations.add_drift({**row, "exceeded": int(drift.exceeded), "reasons": "; ".join(drift.reasons),
                     "created_at": time.time()})


def drift_history(store: Store, device: str | None = None) -> list[dict[str, Any]]:
    return [row.as_dict() for row in store.calibrations.drift_history(device)]


@dataclass
class GoldenOutlier:
    device: str
    model: str
    threads: int
    value: float
    history_mean: float
    history_sigma: float
    k: float

    def describe(self) -> str:
        return (f"{self.model} at {self.threads} thread(s) took {self.value:.4g} ms, its history is "
                f"{self.history_mean:.4g} ± {self.history_sigma:.3g} ms (more than {self.k:g}σ away)")


def _device_latencies(store: Store, job_id: int, device: str) -> dict[tuple[str, int], float]:
    rows = store.runs.device_latencies(job_id, device)
    values: dict[tuple[str, int], list[float]] = {}
    for row in rows:
        if row.latency_avg_ms is not None:
            # every task is scheduled with its model's digest; a row without one groups under ""
            values.setdefault((row.model_sha256 or "", row.threads), []).append(row.latency_avg_ms)
    return {key: statistics.fmean(v) for key, v in values.items()}


def golden_outliers(store: Store, job_id: int, device: str, *, k: float = 3.0, min_history: int = 2,
                    sigma_floor: float = 0.05) -> list[GoldenOutlier]:
    """Reference models whose latency on `device` left their own history (earlier health checks)."""
    earlier = store.jobs.earlier_of_kind(HEALTH_CHECK, job_id)
    history: dict[tuple[str, int], list[float]] = {}
    for jid in earlier:
        for key, value in _device_latencies(store, jid, device).items():
            history.setdefault(key, []).append(value)
    names = store.jobs.model_names(job_id)
    outliers = []
    for key, value in _device_latencies(store, job_id, device).items():
        past = history.get(key, [])
        if len(past) < min_history:
            continue  # too little history to call anything an outlier
        mean = statistics.fmean(past)
        # run-to-run noise of a few % is normal: σ never counts as smaller than that
        sigma = max(statistics.pstdev(past), sigma_floor * mean)
        if abs(value - mean) > k * sigma:
            outliers.append(GoldenOutlier(device, names.get(key[0], key[0][:12]), key[1], value, mean, sigma, k))
    return outliers


@dataclass
class RefreshReport:
    job: int
    calibrations: list[dict[str, Any]] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    drift: list[DriftCheck] = field(default_factory=list)
    quarantined: dict[str, list[str]] = field(default_factory=dict)
    contended_left_out: int = 0  # sim twins whose cores were not their own: not fitted


def after_reference_run(store: Store, job_id: int, *, thresholds: DriftThresholds | None = None, k: float = 3.0,
                        alert: Callable[[DriftEvent], None] | None = None,
                        include_contended: bool = False) -> RefreshReport:
    """Refit every device of the suite job, record drift, quarantine devices whose golden results moved."""
    thresholds = thresholds or DriftThresholds()
    report = RefreshReport(job_id)
    controller = Controller(store)
    report.contended_left_out = 0 if include_contended else contended_left_out(store, [job_id])
    for device in job_devices(store, job_id):
        paired = pair_within_job(store, job_id, device, "latency", include_contended=include_contended)
        stored, refused = fit_and_store(store, device, "latency", paired, source=calibration_source(store, job_id))
        report.refused += refused
        if not paired:  # say why nothing was fitted, rather than an empty list that looks like success
            report.refused.append(f"{device}: no completed sim/device pair in job {job_id} "
                                  f"(`farm results {job_id}` shows the failed runs and why)")
        for new in stored:
            report.calibrations.append({"id": new.id, "device": device, "threads": new.threads,
                                        "family": new.family or None, "version": new.version})
            if new.family != ALL_FAMILIES:
                continue
            old, passed = drift_baseline(store, new)  # like with like: an earlier refresh's fit of the same kind
            if old is None:
                if passed:  # a hand-made calibration (or another kind of fit) is no baseline: no alert, said why
                    log.info("%s threads=%d: no drift check yet: %s", device, new.threads, "; ".join(passed))
                continue
            drift = drift_between(old, new, thresholds)
            record_drift(store, drift)
            report.drift.append(drift)
            if drift.exceeded and alert:
                alert(drift_event(device=drift.device, metric=drift.metric, threads=drift.threads,
                                  slope_change=drift.slope_change, intercept_change=drift.intercept_change,
                                  r2_drop=drift.r2_drop, prediction_shift=drift.prediction_shift,
                                  calibration_id=drift.calibration_id, previous_id=drift.previous_id,
                                  reasons=drift.reasons))
        outliers = golden_outliers(store, job_id, device, k=k)
        if outliers:
            reason = "golden results left their history: " + "; ".join(o.describe() for o in outliers)
            controller.quarantine(device, reason)  # the controller also tells the webhook
            report.quarantined[device] = [o.describe() for o in outliers]
        elif _passed(store, job_id, device):
            controller.passed_health_check(device, f"passed the reference suite of job {job_id}: every run completed, "
                                                   f"golden results within {k:g}·σ of their history (where it has one)")
    return report


def _passed(store: Store, job_id: int, device: str) -> bool:
    """Whether `device` ran every reference task of the job it was given, and completed each."""
    tasks = [t for t in store.jobs.tasks(job_id) if t.target == device]
    return bool(tasks) and all(t.status == "completed" for t in tasks)


def report_json(report: RefreshReport) -> dict[str, Any]:
    return {"job": report.job, "calibrations": report.calibrations, "refused": report.refused,
            "drift": [d.model_dump() for d in report.drift],
            "quarantined": report.quarantined, "contended_left_out": report.contended_left_out}




def last_reference_checks(store: Store) -> dict[str, float]:
    """device -> when its last health check (a reference suite farm submitted) completed, in Unix time."""
    return store.devices.last_reference_checks(HEALTH_CHECK)


def stale_devices(store: Store, devices: list[str], max_age_s: float) -> list[str]:
    """Devices whose last reference-suite check is older than max_age_s (never-checked ones excluded:
    their health is unknown, and the nightly refresh gives them a history first)."""
    now = time.time()
    checked = last_reference_checks(store)
    return [d for d in devices if d in checked and now - checked[d] > max_age_s]
