"""The dataset pass (issue 30): after the timed loop, the model runs on every sample of workload.dataset, and the
run records each output's digest and summary (kept whole up to a size), agreement with the reference outputs
packed with the task, and, with labels, top-1/top-5 accuracy. The timings are never touched by it: it runs after
them, and its own wall time is recorded apart (`wall_s`)."""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from farm.proto.accuracy import MAX_KEPT_VALUES, MAX_OUTPUTS, unpack

PEAK_DB = 200.0  # PSNR/SNR of outputs identical to the reference: reported as this ceiling, not infinity


def _db(signal: float, noise: float) -> float:
    if noise <= 0:
        return PEAK_DB
    if signal <= 0:
        return -PEAK_DB
    return max(-PEAK_DB, min(PEAK_DB, 10 * math.log10(signal / noise)))


def _topk(rows: np.ndarray, k: int) -> np.ndarray:
    k = min(k, rows.shape[1])
    return np.argpartition(-rows, k - 1, axis=1)[:, :k]


def agreement(outputs: np.ndarray, reference: np.ndarray) -> dict[str, float | None]:
    """One output's figures against its reference, both [samples, ...] (float64)."""
    y = outputs.reshape(len(outputs), -1).astype(np.float64)
    r = reference.reshape(len(reference), -1).astype(np.float64)
    err = y - r
    norms = float(np.linalg.norm(y)) * float(np.linalg.norm(r))
    mse = float(np.mean(err ** 2))
    peak = float(np.max(np.abs(r))) if r.size else 0.0
    found: dict[str, float | None] = {
        "max_abs_error": float(np.max(np.abs(err))) if err.size else 0.0,
        "mean_abs_error": float(np.mean(np.abs(err))) if err.size else 0.0,
        "cosine": max(-1.0, min(1.0, float(np.sum(y * r) / norms))) if norms > 0 else (1.0 if not np.any(y) and not np.any(r) else 0.0),
        "psnr_db": _db(peak ** 2, mse),
        "snr_db": _db(float(np.sum(r ** 2)), float(np.sum(err ** 2))),
        "top1": None, "top5": None,
    }
    if y.shape[1] >= 2:  # a score per class: does the model pick what the reference picks?
        ref_best = np.argmax(r, axis=1)
        found["top1"] = float(np.mean(np.argmax(y, axis=1) == ref_best))
        if y.shape[1] >= 5:
            found["top5"] = float(np.mean(np.any(_topk(y, 5) == ref_best[:, None], axis=1)))
    return found


def accuracy(outputs: np.ndarray, labels: np.ndarray) -> dict[str, float | None]:
    scores = outputs.reshape(len(outputs), -1).astype(np.float64)
    labels = labels.reshape(-1).astype(np.int64)
    top1 = float(np.mean(np.argmax(scores, axis=1) == labels)) if scores.shape[1] >= 2 else None
    top5 = float(np.mean(np.any(_topk(scores, 5) == labels[:, None], axis=1))) if scores.shape[1] >= 5 else None
    return {"top1": top1, "top5": top5}


def summary(name: str, values: np.ndarray) -> dict[str, Any]:
    data = np.ascontiguousarray(values)
    as_float = data.astype(np.float64)
    entry: dict[str, Any] = {
        "sha256": hashlib.sha256(str(data.dtype).encode() + str(list(data.shape)).encode() + data.tobytes()).hexdigest(),
        "shape": [int(d) for d in data.shape],
        "min": float(as_float.min()), "max": float(as_float.max()),
        "mean": float(as_float.mean()), "std": float(as_float.std()),
    }
    if data.size <= MAX_KEPT_VALUES:
        entry["values"] = [float(v) for v in as_float.reshape(-1)]
    return entry


def run_dataset(dataset: dict[str, Any], infer: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
                fixed: dict[str, np.ndarray], output_names: list[str]) -> dict[str, Any]:
    """Every sample through `infer` (the other inputs keep the timed loop's values), and the block a run records.

    fixed: the timed loop's feeds (inputs the dataset does not give keep them); output_names in the model's order."""
    inputs, labels, reference = unpack(dataset["packed"])
    count = len(next(iter(inputs.values())))
    started = time.perf_counter()
    collected: dict[str, list[np.ndarray]] = {name: [] for name in output_names[:MAX_OUTPUTS]}
    for i in range(count):
        feeds = {**fixed, **{name: samples[i:i + 1].astype(fixed[name].dtype if name in fixed else samples.dtype)
                             for name, samples in inputs.items()}}
        produced = infer(feeds)
        for name in collected:
            collected[name].append(np.asarray(produced[name]))
    wall = time.perf_counter() - started
    primary = dataset.get("output") or output_names[0]
    block: dict[str, Any] = {"samples": count, "output": primary, "wall_s": wall,
                             "reference": dataset.get("reference"), "outputs": {}}
    stacked = {name: np.concatenate(parts) for name, parts in collected.items()}
    for name, values in stacked.items():
        entry = summary(name, values)
        if name in reference:
            entry["agreement"] = agreement(values, reference[name])
        block["outputs"][name] = entry
    if primary in stacked and primary in reference:
        block["agreement"] = block["outputs"][primary]["agreement"]
    if labels is not None and primary in stacked:
        block["accuracy"] = accuracy(stacked[primary], labels)
    return block
