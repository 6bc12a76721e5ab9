"""`farm rank`: models ordered by the sim and by each device, side by side, with Kendall τ.

"Which of my models is best there?" is often the real question: a device column can be a
job measured on the device (or under another budget) or a calibrated device's predictions.
"""

from __future__ import annotations

from collections import defaultdict
from statistics import mean
from typing import Any

from scipy.stats import kendalltau

from farm.controller.analysis.calibrations import CalibrationError, contended_left_out, current_calibration, job_values
from farm.controller.scheduling.store import Store


class RankError(ValueError):
    pass


Cell = tuple[int, int, int]  # (threads, batch size, input size or 0): another one is another ranking


def _means(store: Store, job: int, metric: str,
           include_contended: bool = False) -> dict[Cell, dict[str, tuple[float, str | None, dict[str, float]]]]:
    """(threads, batch size, input size) -> model -> (mean over repeats, family, model features)."""
    acc: dict[Cell, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    about: dict[str, tuple[str | None, dict[str, float]]] = {}
    for v in job_values(store, job, metric, include_contended=include_contended):
        acc[(v.threads, v.batch_size, v.input_size or 0)][v.model].append(v.value)
        about[v.model] = (v.family, v.features)
    return {cell: {m: (mean(vals), *about[m]) for m, vals in models.items()} for cell, models in acc.items()}


def _tau(reference: dict[str, float], other: dict[str, float]) -> float | None:
    common = sorted(set(reference) & set(other))
    if len(common) < 3:
        return None
    tau = kendalltau([reference[m] for m in common], [other[m] for m in common]).statistic
    return None if tau != tau else float(tau)  # NaN when one side is constant


def rank_job(store: Store, job: int, metric: str, *, device_jobs: list[int], devices: list[str],
             include_contended: bool = False) -> dict[str, Any]:
    try:
        sim = _means(store, job, metric, include_contended)
        measured = {d: _means(store, d, metric, include_contended) for d in device_jobs}
    except CalibrationError as e:
        raise RankError(str(e)) from None
    left_out = 0 if include_contended else contended_left_out(store, [job, *device_jobs])
    if not sim:
        why = f" ({left_out} contended run(s) left out; --include-contended uses them)" if left_out else ""
        raise RankError(f"job {job} has no completed run with a {metric} figure to rank{why}")
    groups = []
    for cell in sorted(sim):
        threads, batch_size, input_size = cell
        sim_values = {m: v for m, (v, _, _) in sim[cell].items()}
        columns: list[dict[str, Any]] = [{"name": f"sim (job {job})", "kendall_tau": None,
                    "order": sorted(sim_values.items(), key=lambda kv: kv[1])}]
        for d, by_cell in measured.items():
            values = {m: v for m, (v, _, _) in by_cell.get(cell, {}).items()}
            columns.append({"name": f"job {d}", "kendall_tau": _tau(sim_values, values),
                            "order": sorted(values.items(), key=lambda kv: kv[1])})
        for device in devices:
            predicted = {}
            for model, (x, fam, features) in sim[cell].items():
                stored = current_calibration(store, device, metric, threads, family=fam, batch_size=batch_size,
                                             input_size=input_size or None)
                if stored is None:
                    raise RankError(f"no {metric} calibration for device {device!r} at {threads} thread(s), batch "
                                    f"{batch_size}; run `farm calibrate` first (`farm calibrations` lists what exists)")
                predicted[model] = stored.calibration.fits[stored.calibration.chosen].predict(x, features=features).estimate
            columns.append({"name": f"{device} (predicted)", "kendall_tau": _tau(sim_values, predicted),
                            "order": sorted(predicted.items(), key=lambda kv: kv[1])})
        groups.append({"threads": threads, "batch_size": batch_size, "input_size": input_size or None,
                       "columns": columns})
    return {"job": job, "metric": metric, "groups": groups, "contended_left_out": left_out}
