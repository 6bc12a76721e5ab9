"""`farm predict MODEL --device D`: measure the model in the sim exactly as D's calibration's
sim side was measured (same budget, same workload), or reuse such a run, then apply D's
current calibration. No device time is spent."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from farm.controller.calibrations import (
    METRICS, SIM_SIDE, calibration_history, contended_left_out, current_calibration, job_values, model_features,
)
from farm.controller.controller import Controller
from farm.controller.jobfile import JobFileError, load_job_text
from farm.controller.store import Store


class PredictError(ValueError):
    pass


def _reusable_job(store: Store, sha256: str, threads: int, source: dict[str, Any]) -> int | None:
    """A job measured with the same sim budget and workload that has this model at these threads."""
    rows = store.query(
        "SELECT DISTINCT j.id, j.spec_json FROM jobs j JOIN tasks t ON t.job_id = j.id "
        "WHERE t.model_sha256 = ? AND t.threads = ? AND t.status = 'completed' ORDER BY j.id DESC",
        [sha256, threads])
    for row in rows:
        spec = json.loads(row["spec_json"])
        if spec["sim"] == source["sim"] and spec["workload"] == source["workload"]:
            return row["id"]
    return None


def _measure(store: Store, model: Path, threads: list[int], source: dict[str, Any], backend: str | None) -> int:
    from farm.cli.embedded import run_job_embedded

    sim = dict(source["sim"])
    if sim.get("memory") is not None:
        sim["memory"] = f"{sim['memory']}b"  # stored as bytes; a job file's sizes carry their unit
    spec = {"name": f"predict {model.name}", "models": [str(model.resolve())], "workload": source["workload"],
            "sim": sim, "matrix": {"threads": threads}, "priority": "interactive"}
    try:
        job = load_job_text(yaml.safe_dump(spec), f"prediction job for {model}", model.resolve().parent)
    except JobFileError as e:
        raise PredictError(str(e)) from None
    job_id = Controller(store).submit(job)
    run_job_embedded(store, job_id, backend=backend)
    return job_id


def predict_model(store: Store, model: Path, device: str, metrics: list[str], *, threads: int | None,
                  backend: str | None, confidence: float, include_contended: bool = False) -> list[dict[str, Any]]:
    from farm.models.facts import ModelError, inspect_model

    if not model.exists():
        raise PredictError(f"{model}: no such model file")
    try:
        facts = inspect_model(model)
    except ModelError as e:
        raise PredictError(str(e)) from None
    history = calibration_history(store, device)
    if not history:
        raise PredictError(f"no calibration for device {device!r} in {store.path}; run `farm calibrate` first")
    thread_counts = sorted({r["threads"] for r in history if threads in (None, r["threads"])})
    if not thread_counts:
        raise PredictError(f"device {device!r} has no calibration at {threads} thread(s); it has "
                           f"{sorted({r['threads'] for r in history})}")
    predictions = []
    for t in thread_counts:
        newest = current_calibration(store, device, metrics[0] if metrics[0] in METRICS else "latency", t)
        source = newest.source if newest else {}
        if "sim" not in source:
            raise PredictError(f"calibration #{newest.id if newest else '?'} does not record its sim budget; refit it")
        job_id = _reusable_job(store, facts.sha256, t, source)
        reused = job_id is not None
        if job_id is None:
            job_id = _measure(store, model, [t], source, backend)
        values = [v for v in job_values(store, job_id, "latency", include_contended=include_contended)
                  if v.sha256 == facts.sha256 and v.threads == t]
        if not values and not include_contended and contended_left_out(store, [job_id]):
            raise PredictError(f"the sim run of {model.name} at {t} thread(s) was contended (other work used its "
                               f"cores; job {job_id}, `farm results {job_id} --json` shows why): measure again on "
                               "quieter cores, or pass --include-contended")
        if not values:
            task = store.query("SELECT failure_class, message FROM tasks WHERE job_id = ? AND model_sha256 = ?",
                               [job_id, facts.sha256])
            why = f"{task[0]['failure_class']}: {task[0]['message']}" if task else "no run"
            raise PredictError(f"the sim run of {model.name} at {t} thread(s) did not complete ({why}); job {job_id}")
        runtime = values[0].runtime
        for metric in metrics:
            measured = [v.value for v in job_values(store, job_id, SIM_SIDE.get(metric, metric),
                                                    include_contended=include_contended)
                        if v.sha256 == facts.sha256 and v.threads == t]
            stored = current_calibration(store, device, metric, t, runtime=runtime, batch_size=values[0].batch_size)
            if stored is None or not measured:
                raise PredictError(f"device {device!r} has no {metric} calibration for {runtime} at {t} thread(s)")
            x = sum(measured) / len(measured)
            fit = stored.calibration.fits[stored.calibration.chosen]
            features = model_features(asdict(facts))
            p = fit.predict(x, features=features, confidence=confidence)
            predictions.append({
                "model": model.name, "sha256": facts.sha256, "device": device, "metric": metric, "threads": t,
                "unit": METRICS[metric][1], "sim": x, "estimate": p.estimate, "low": p.low, "high": p.high,
                "confidence": confidence, "sim_job": job_id, "sim_reused": reused,
                "calibration": {"id": stored.id, "version": stored.version, "kind": stored.calibration.chosen,
                                "family": stored.family or None, "n": fit.n, "r2": fit.r2},
                "unsafe": stored.calibration.unsafe, "formula": fit.formula,
                "warnings": list(stored.calibration.warnings),
            })
    return predictions
