"""The data ceiling of calibration (issue 31): how close to the device can *any* fit on these columns get?

Run by hand: ``cd benchmarks && ../.venv/bin/python ceiling.py``.

For every CPU pair of every shared latency file that has CPU pairs — the qed phones' big cores (FLOPS and
size), HELP's NAS-Bench-201 CPUs and OneProxy's nn-Meter Cortex-A76 channel (with the per-layer features
farm's own ``inspect_model`` read from the generated networks, benchmarks/data/nb201_features.csv) — the
share of models within ±10 % of:

- ``in-sample``: least squares in log space on *all* models, judged on the same models (no k = 10 fit on the
  same columns can beat it on average: it is the best line, told every answer);
- ``10-fold CV, quadratic``: every column, their squares and pairwise products, ridge-shrunk, each model
  predicted by a fit that did not see it — does a feature, or a curve in it, lift the ceiling?

Columns: ``sim`` (log sim time); ``work, size`` (log FLOPs, log size); ``all`` (those plus log parameters,
log activation bytes, log layer count and the 1×1, 3×3 and fully-connected shares; depthwise is 0 in NB201).
"""

from __future__ import annotations

import csv

import numpy as np
from calibration import (
    DATA_DIR,
    NB201_FEATURES_FILE,
    QED,
    SMALLEST_VALID_MS,
    DevicePair,
    load_columns,
    load_nb201,
)

WITHIN = 0.10
FOLDS = 10
RIDGE = 1e-3  # of the quadratic fit, relative to the mean diagonal of its Gram matrix (standardized columns)
LOG_FEATURES = ("flops", "size_bytes", "param_count", "activation_bytes", "op_count")
SHARE_FEATURES = ("conv1x1_macs_share", "conv3x3_macs_share", "fc_macs_share")
QED_TARGETS = (("Galaxy S10 big core", "s10|1large"), ("Mi 8 SE big core", "mi8se|1large"),
               ("Galaxy A03s big core", "a03s|1large"), ("iPhone XS big core", "iphonexs|1large"),
               ("iPhone 7 big core", "iphone7|1large"))
NB201_CPU_PAIRS = (("Xeon Silver 4114 → Silver 4210R", "silver_4114_ms", "silver_4210r_ms"),
                   ("Xeon Gold 6226 → Gold 6240", "gold_6226_ms", "gold_6240_ms"),
                   ("Xeon Silver 4114 → Gold 6240", "silver_4114_ms", "gold_6240_ms"),
                   ("Pixel 3 → Raspberry Pi 4", "pixel3_ms", "raspi4_ms"),
                   ("Raspberry Pi 4 → Xeon Gold 6226", "raspi4_ms", "gold_6226_ms"))
ONEPROXY = "oneproxy_nb201_1999x18_plus_help.csv"
ONEPROXY_CPU_PAIRS = (("nn-Meter Pixel 4 A76 → HW-NAS-Bench Pixel 3", "true_a76_ms", "rice_pixel3_ms"),
                      ("nn-Meter Pixel 4 A76 → HW-NAS-Bench Raspberry Pi 4", "true_a76_ms", "rice_raspi4_ms"),
                      ("nn-Meter Pixel 4 A76 → BRP-NAS Snapdragon 855 CPU", "true_a76_ms", "eagle_cpu_855_ms"),
                      ("nn-Meter Pixel 4 A76 → BRP-NAS Core i7", "true_a76_ms", "eagle_i7_ms"))


def within(estimate: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean(np.abs(estimate - truth) / truth <= WITHIN))


def in_sample(columns: list[np.ndarray], device: np.ndarray) -> float:
    design = np.column_stack([np.ones_like(device), *columns])
    coefficients, *_ = np.linalg.lstsq(design, np.log(device), rcond=None)
    return within(np.exp(design @ coefficients), device)


def quadratic_cv(columns: list[np.ndarray], device: np.ndarray, seed: int = 0) -> float:
    """10-fold cross-validated share within ±10 % of a ridge fit on the columns, their squares and products."""
    base = np.column_stack(columns)
    base = (base - base.mean(axis=0)) / np.where(base.std(axis=0) > 0, base.std(axis=0), 1.0)
    width = base.shape[1]
    expanded = np.column_stack([base, *(base[:, i] * base[:, j] for i in range(width) for j in range(i, width))])
    design = np.column_stack([np.ones(device.size), expanded])
    target = np.log(device)
    folds = np.random.default_rng(seed).permutation(device.size) % FOLDS
    estimate = np.empty(device.size)
    for fold in range(FOLDS):
        train = folds != fold
        gram = design[train].T @ design[train]
        penalty = RIDGE * np.trace(gram) / gram.shape[0] * np.eye(gram.shape[0])
        penalty[0, 0] = 0.0  # the intercept is not shrunk
        coefficients = np.linalg.solve(gram + penalty, design[train].T @ target[train])
        estimate[~train] = design[~train] @ coefficients
    return within(np.exp(estimate), device)


def row(label: str, sim: np.ndarray, device: np.ndarray, sets: dict[str, list[np.ndarray]]) -> str:
    cells = [f"{100 * in_sample([np.log(sim), *columns], device):.1f}" for columns in sets.values()]
    widest = list(sets.values())[-1]
    return (f"| {label} | {device.size} | {' | '.join(cells)} | "
            f"{100 * quadratic_cv([np.log(sim), *widest], device):.1f} |")


def nb201_columns(features: dict[str, np.ndarray], keep: np.ndarray) -> dict[str, list[np.ndarray]]:
    work_size = [np.log(features["flops"][keep]), np.log(features["size_bytes"][keep])]
    rest = [np.log(features[name][keep]) for name in LOG_FEATURES[2:]] + [features[n][keep] for n in SHARE_FEATURES]
    return {"sim": [], "work, size": work_size, "all": work_size + rest}


def oneproxy_rows(features: dict[str, np.ndarray], order: list[int]) -> list[str]:
    """OneProxy's nn-Meter A76 channel on the NB201 cells whose features were read (the overlap with the sample)."""
    with open(DATA_DIR / ONEPROXY, newline="") as handle:
        latency = {int(r["nb201_idx"]): r for r in csv.DictReader(handle)}
    position = {arch: i for i, arch in enumerate(order)}
    shared = [arch for arch in order if arch in latency]
    keep = np.array([position[arch] for arch in shared], dtype=int)
    rows = []
    for label, sim_column, device_column in ONEPROXY_CPU_PAIRS:
        number = lambda text: float(text) if text not in ("", None) else np.nan  # noqa: E731
        sim = np.array([number(latency[arch][sim_column]) for arch in shared])
        device = np.array([number(latency[arch][device_column]) for arch in shared])
        usable = np.isfinite(sim) & np.isfinite(device) & (sim >= SMALLEST_VALID_MS) & (device >= SMALLEST_VALID_MS)
        rows.append(row(f"OneProxy: {label}", sim[usable], device[usable], nb201_columns(features, keep[usable])))
    return rows


def nb201_order() -> list[int]:
    with NB201_FEATURES_FILE.open(newline="") as handle:
        return sorted(int(r["arch_idx"]) for r in csv.DictReader(handle))


def main() -> None:
    header = ["| device pair | models | in-sample: sim | in-sample: + work, size | in-sample: + all farm reads | "
              "10-fold CV, quadratic in all |", "|---|---|---|---|---|---|"]
    rows = list(header)
    for label, column in QED_TARGETS:
        pair = DevicePair(label, QED, "pixel4|1large|float|mean", f"{column}|float|mean", ("FLOPS", "size"), 1e-3)
        sim, device, features = load_columns(pair)
        work_size = [np.log(features["FLOPS"]), np.log(features["size"])]
        rows.append(row(f"qed: Pixel 4 big core → {label}", sim, device,
                        {"sim": [], "work, size": work_size, "all": work_size}))
    latencies, _ = load_nb201()
    features = _all_nb201_features()
    for label, sim_column, device_column in NB201_CPU_PAIRS:
        sim, device = latencies[sim_column], latencies[device_column]
        keep = np.flatnonzero((sim >= SMALLEST_VALID_MS) & (device >= SMALLEST_VALID_MS))
        rows.append(row(f"NB201: {label}", sim[keep], device[keep], nb201_columns(features, keep)))
    rows += oneproxy_rows(features, nb201_order())
    print("\n".join(["### Ceiling: share within ±10 % no fit on these columns beats", "",
                     "qed has FLOPS and size only (its `all` = `work, size`).", "", *rows]))


def _all_nb201_features() -> dict[str, np.ndarray]:
    """Every feature column of benchmarks/data/nb201_features.csv, in arch_idx order (as load_nb201)."""
    with NB201_FEATURES_FILE.open(newline="") as handle:
        rows = sorted(csv.DictReader(handle), key=lambda r: int(r["arch_idx"]))
    return {name: np.array([float(r[name]) for r in rows]) for name in (*LOG_FEATURES, *SHARE_FEATURES)}


if __name__ == "__main__":
    main()
