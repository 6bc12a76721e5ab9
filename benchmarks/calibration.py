"""Calibration accuracy on real multi-device latencies, and fit time for 10⁶ pairs.

Run by hand: ``/tmp/v/bin/python benchmarks/calibration.py [--draws 200] [--seed 0]``.

For each device pair (one column used as "sim", another as "device"), k calibration models are
drawn at random (k = 5, 10, 20; ``--draws`` draws each, fixed seed); every fit kind is fitted on
them and scored on all the other models of the file: share of predictions within ±10 %, median
over draws of the held-out MAPE, and coverage of the 90 % prediction interval. ``ols`` is plain
least squares (the published method); ``chosen`` is the kind picked by leave-one-out error.
Data: ``../shared/data/latency/`` next to the repository (see its README), read at bench time and
not copied into the repository; values < 0.1 ms dropped. The qed rows offer FLOPS and file size
as model features.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import math
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # the machine is shared; one core keeps timings comparable
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402  (after the thread limits, which numpy reads at import)

from farm.controller.analysis.calibration import (  # noqa: E402
    FIT_KINDS,
    Pair,
    Prior,
    calibrate,
    fit_population_prior,
    suggest_models,
)

# FARM_LATENCY_DATA overrides it (a worktree sits deeper than ../shared)
DATA_DIR = Path(os.environ.get("FARM_LATENCY_DATA")
                or Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "latency")
KS = (5, 10, 20)
PREVIOUS_MODELS = 20  # the "previous version" of a device's calibration in the prior rows
CONFIDENCE = 0.9
SMALLEST_VALID_MS = 0.1  # the README: ~273 NB201 cells are degenerate (≈ 0 ms)


@dataclass(frozen=True)
class DevicePair:
    label: str
    file: str
    sim_column: str
    device_column: str
    features: tuple[str, ...] = ()  # model-feature columns offered to the fits
    scale: float = 1.0  # multiplies every latency (the qed file is in µs)


QED = "qed_tflite_nas_e2e.csv.gz"
QED_FEATURES = ("FLOPS", "size")
DEVICE_PAIRS = [
    *(DevicePair(f"qed: Pixel 4 big core → {label}", QED, "pixel4|1large|float|mean", f"{column}|float|mean",
                 QED_FEATURES, 1e-3)
      for label, column in (("Galaxy S10 big core", "s10|1large"), ("Mi 8 SE big core", "mi8se|1large"),
                            ("Galaxy A03s big core", "a03s|1large"), ("iPhone XS big core", "iphonexs|1large"),
                            ("Pixel 4 GPU", "pixel4|gpu"))),
    DevicePair("similar CPUs: Xeon Silver 4114 → Silver 4210R", "help_nb201_latency_all_devices.csv.gz",
               "silver_4114_ms", "silver_4210r_ms"),
    DevicePair("similar CPUs: Xeon Gold 6226 → Gold 6240", "help_nb201_latency_all_devices.csv.gz",
               "gold_6226_ms", "gold_6240_ms"),
    DevicePair("phone → phone: Pixel 4 A76 (nn-Meter) → Pixel 3 (HW-NAS-Bench)", "oneproxy_nb201_1999x18_plus_help.csv",
               "true_a76_ms", "rice_pixel3_ms"),
    DevicePair("phone → phone: Galaxy A50 → Galaxy S7 (whole ms)", "help_nb201_latency_all_devices.csv.gz",
               "samsung_a50_ms", "samsung_s7_ms"),
    DevicePair("phone → board: Pixel 3 → Raspberry Pi 4", "help_nb201_latency_all_devices.csv.gz",
               "pixel3_ms", "raspi4_ms"),
    DevicePair("desktop GPU → phone: Titan RTX (batch 1) → Pixel 3", "help_nb201_latency_all_devices.csv.gz",
               "titan_rtx_1_ms", "pixel3_ms"),
    DevicePair("desktop GPU → phone: GTX (BRP-NAS) → Pixel 4 A76", "oneproxy_nb201_1999x18_plus_help.csv",
               "eagle_gtx_ms", "true_a76_ms"),
]


@dataclass
class KindScores:
    within: list[float]
    mape: list[float]
    coverage: list[float]


def load_columns(pair: DevicePair) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    path = DATA_DIR / pair.file
    if not path.exists():
        sys.exit(f"error: {path} not found: this benchmark reads the shared latency data in {DATA_DIR} "
                 f"(a folder named shared/data/latency next to the repository)")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {pair.sim_column, pair.device_column, *pair.features} - set(reader.fieldnames or ())
        if missing:
            sys.exit(f"error: {path}: no column(s) {sorted(missing)}")
        rows = list(reader)
    number = lambda text: float(text) if text else np.nan  # noqa: E731
    sim = np.array([number(row[pair.sim_column]) for row in rows]) * pair.scale
    device = np.array([number(row[pair.device_column]) for row in rows]) * pair.scale
    features = {name: np.array([number(row[name]) for row in rows]) for name in pair.features}
    usable = (sim >= SMALLEST_VALID_MS) & (device >= SMALLEST_VALID_MS)  # also drops NaN and −1
    for values in features.values():
        usable &= np.isfinite(values) & (values > 0)
    return sim[usable], device[usable], {name: values[usable] for name, values in features.items()}


PLAIN_OLS = "plain ols"
KINDS = (PLAIN_OLS, *FIT_KINDS, "chosen")


def evaluate(pair: DevicePair, k: int, draws: int, generator: np.random.Generator, previous: int = 0) -> dict:
    """``previous`` > 0: each draw first calibrates on that many other models (the device's previous
    version) and the k-model calibration is shrunk toward it."""
    sim, device, features = load_columns(pair)
    scores = {kind: KindScores([], [], []) for kind in KINDS}
    chosen_counts: Counter[str] = Counter()
    warned = skipped = 0
    prior_weights: list[float] = []

    def pairs_of(indices: np.ndarray) -> list[Pair]:
        return [Pair(f"m{i}", sim[i], device[i], features={name: float(values[i]) for name, values in features.items()})
                for i in indices]

    for _ in range(draws):
        picked_all = generator.choice(sim.size, size=k + previous, replace=False)
        picked, earlier = picked_all[:k], picked_all[k:]
        held_out = np.ones(sim.size, dtype=bool)
        held_out[picked_all] = False
        try:
            prior = Prior()
            if previous:
                version_1 = calibrate(pairs_of(earlier), confidence=CONFIDENCE, features=list(features))
                prior = Prior.from_fits([version_1.fits["log_ridge"]], list(features), "previous version")
            calibration = calibrate(pairs_of(picked), confidence=CONFIDENCE, features=list(features), prior=prior)
            prior_weights.append(calibration.fits["log_ridge"].prior_weight)
        except ValueError:  # NotEnoughPairs or too-concentrated sim values
            skipped += 1  # whole-ms columns can give < 3 distinct sim values at k = 5
            continue
        chosen_counts[calibration.chosen] += 1
        warned += calibration.unsafe
        truth = device[held_out]
        held_features = {name: values[held_out] for name, values in features.items()}
        slope, intercept = np.polyfit(sim[picked], device[picked], 1)  # the published method, nothing else
        relative = np.abs(slope * sim[held_out] + intercept - truth) / truth
        scores[PLAIN_OLS].within.append(float(np.mean(relative <= 0.10)))
        scores[PLAIN_OLS].mape.append(float(np.mean(relative)))
        for kind in (*FIT_KINDS, "chosen"):
            fit = calibration.fits.get(calibration.chosen if kind == "chosen" else kind)
            if fit is None:
                continue
            estimate, low, high = fit.predict_arrays(sim[held_out], held_features, confidence=CONFIDENCE)
            relative = np.abs(estimate - truth) / truth
            scores[kind].within.append(float(np.mean(relative <= 0.10)))
            scores[kind].mape.append(float(np.mean(relative)))
            scores[kind].coverage.append(float(np.mean((truth >= low) & (truth <= high))))
    return {"scores": scores, "chosen": chosen_counts, "warned": warned, "skipped": skipped,
            "prior_weight": statistics.fmean(prior_weights) if prior_weights else math.nan,
            "fitted": draws - skipped, "models": sim.size}


def cell(values: list[float], percent_digits: int = 0) -> str:
    return f"{100 * statistics.fmean(values):.{percent_digits}f}" if values else "–"


def median_cell(values: list[float]) -> str:
    return f"{100 * statistics.median(values):.1f}" if values else "–"


def selected(pair: DevicePair, only: str | None) -> bool:
    return not only or any(text.strip() and text.strip() in pair.label for text in only.split(","))


def accuracy_tables(draws: int, seed: int, only: str | None = None) -> str:
    generator = np.random.default_rng(seed)
    kinds = KINDS
    accuracy = ["| device pair (sim → device) | k | " + " | ".join(
        f"{kind} ±10 % / MAPE" for kind in kinds) + " | chosen " + "/".join(FIT_KINDS) + " | unsafe |",
                "|---|---|" + "---|" * (len(kinds) + 2)]
    coverage = ["| device pair | k | " + " | ".join(f"{kind} {CONFIDENCE:.0%} PI coverage" for kind in kinds[1:])
                + " |", "|---|---|" + "---|" * (len(kinds) - 1)]
    for pair in DEVICE_PAIRS:
        if not selected(pair, only):
            continue
        for k in KS:
            result = evaluate(pair, k, draws, generator)
            scores, chosen = result["scores"], result["chosen"]
            label = f"{pair.label} (`{pair.sim_column}` → `{pair.device_column}`, {result['models']} models)"
            accuracy.append(
                f"| {label} | {k} | " + " | ".join(
                    f"{cell(scores[kind].within)} % / {median_cell(scores[kind].mape)} %" for kind in kinds)
                + " | " + "/".join(str(chosen[kind]) for kind in FIT_KINDS)
                + f" | {100 * result['warned'] / max(result['fitted'], 1):.0f} %"
                + (f" ({result['skipped']} draws skipped)" if result["skipped"] else "") + " |")
            coverage.append(f"| {pair.label} | {k} | " + " | ".join(f"{cell(scores[kind].coverage)} %"
                                                                  for kind in kinds[1:]) + " |")
    with_prior = ["| device pair | k new + previous | log_ridge ±10 % / MAPE | chosen ±10 % / MAPE | "
                  "log_ridge PI coverage | mean prior weight | unsafe |", "|---|---|---|---|---|---|---|"]
    for pair in DEVICE_PAIRS:
        if not pair.features or not selected(pair, only):
            continue
        for k in (5, 10):
            result = evaluate(pair, k, draws, generator, previous=PREVIOUS_MODELS)
            scores = result["scores"]
            with_prior.append(
                f"| {pair.label} | {k} + {PREVIOUS_MODELS} | "
                + " | ".join(f"{cell(scores[kind].within)} % / {median_cell(scores[kind].mape)} %"
                             for kind in ("log_ridge", "chosen"))
                + f" | {cell(scores['log_ridge'].coverage)} % | {100 * result['prior_weight']:.0f} %"
                + f" | {100 * result['warned'] / max(result['fitted'], 1):.0f} % |")
    return "\n".join([
        f"### Held-out accuracy ({draws} draws per row, seed {seed})",
        "",
        "Each cell: mean share of held-out predictions within ±10 % / median over draws of the held-out "
        "MAPE. `plain ols` is np.polyfit on x alone (the published method); `ols` may add model features; "
        "`log` is the plain power law; `log_ridge` the shrunk log-space fit with features; `chosen` what "
        "calibrate picks. \"unsafe\": share of draws whose calibration carried the unsafe verdict.",
        "",
        *accuracy,
        "",
        f"### Coverage of the {CONFIDENCE:.0%} prediction intervals on held-out models",
        "",
        *coverage,
        *(["", f"### With a prior: the device's previous version, fitted on {PREVIOUS_MODELS} other models",
           "", "The k new models are fitted with log_ridge shrunk toward the previous version's coefficients; "
           "the prior weight is how much of the shrunk terms the prior decided (0 = the data alone).", "",
           *with_prior] if len(with_prior) > 2 else []),
    ])


def suggest_table(draws: int, seed: int, only: str | None = None, k: int = 10, pool_size: int = 200,
                  nb201: bool = False) -> str:
    """`--suggest` against random choice: from a candidate list of ``pool_size`` models measured in the
    sim, calibrate on the k that ``suggest_models`` picks and on k random ones of the same list (paired by
    list); judge on the rest. The qed phones with no feature, FLOPS, FLOPS and size; with ``nb201`` the
    NB201 CPU pairs with no feature, FLOPs and size, and those plus the per-layer shares farm read from the
    generated networks. Each gain comes with the standard error of its mean over the lists; a feature
    set's mean gain over the pairs with √(Σ SE²) / pairs."""
    generator = np.random.default_rng(seed)
    rows = ["| device pair | features | k | suggested ±10 % / MAPE | random ±10 % / MAPE | gain (points) ± SE |",
            "|---|---|---|---|---|---|"]
    gains: dict[str, list[tuple[float, float]]] = {}
    for label, sim, device, every, feature_sets in _suggest_pairs(only, nb201):
        for names in feature_sets:
            features = {name: every[name] for name in names}
            row, gain = _suggest_row(label, sim, device, features, draws, generator, k, pool_size)
            rows.append(row)
            gains.setdefault(", ".join(names) or "none", []).append(gain)
    summary = "; ".join(
        f"{names}: {statistics.fmean(m for m, _ in values):+.1f} ± "
        f"{math.sqrt(sum(e * e for _, e in values)) / len(values):.1f}" for names, values in gains.items())
    return "\n".join([f"### `--suggest` against random choice ({draws} candidate lists of {pool_size} models, "
                      f"seed {seed})", "", *rows, "", f"Mean gain (points) ± SE by feature set, CPU pairs: {summary}."])


def _suggest_pairs(only: str | None, nb201: bool):
    """(label, sim, device, features, feature sets) of the CPU pairs the --suggest table runs."""
    if nb201:
        latencies, features = load_nb201()
        for label, sim_column, device_column, cross in NB201_TARGETS:
            if cross or (only and not any(part.strip() in label for part in only.split(","))):
                continue
            sim, device = latencies[sim_column], latencies[device_column]
            usable = (sim >= SMALLEST_VALID_MS) & (device >= SMALLEST_VALID_MS)
            yield (f"NB201: {label}", sim[usable], device[usable], {n: v[usable] for n, v in features.items()},
                   ((), NB201_WORK_SIZE, (*NB201_WORK_SIZE, *NB201_SHARES)))
        return
    for pair in DEVICE_PAIRS:
        if pair.features and selected(pair, only) and "GPU" not in pair.label:
            sim, device, every = load_columns(pair)
            yield pair.label, sim, device, every, ((), pair.features[:1], pair.features)


def _suggest_row(label: str, sim: np.ndarray, device: np.ndarray, features: dict[str, np.ndarray], draws: int,
                 generator: np.random.Generator, k: int, pool_size: int) -> tuple[str, tuple[float, float]]:
    within: dict[str, list[float]] = {"suggested": [], "random": []}
    mape: dict[str, list[float]] = {"suggested": [], "random": []}
    for _ in range(draws):
        pool = generator.choice(sim.size, size=pool_size, replace=False)
        candidates = [Pair(f"m{i}", sim[i], math.nan, features={n: float(v[i]) for n, v in features.items()})
                      for i in pool]
        picks = {"suggested": [int(name[1:]) for name in suggest_models(candidates, k, features=list(features))],
                 "random": generator.choice(pool, size=k, replace=False).tolist()}
        for name, picked in picks.items():
            held = np.ones(sim.size, dtype=bool)
            held[picked] = False
            calibration = calibrate([Pair(f"m{i}", sim[i], device[i],
                                          features={n: float(v[i]) for n, v in features.items()}) for i in picked],
                                    confidence=CONFIDENCE, features=list(features))
            estimate, _, _ = calibration.chosen_fit.predict_arrays(
                sim[held], {n: v[held] for n, v in features.items()}, confidence=CONFIDENCE)
            relative = np.abs(estimate - device[held]) / device[held]
            within[name].append(float(np.mean(relative <= 0.10)))
            mape[name].append(float(np.mean(relative)))
    paired = [100 * (a - b) for a, b in zip(within["suggested"], within["random"])]
    gain, error = statistics.fmean(paired), statistics.stdev(paired) / math.sqrt(len(paired))
    return (f"| {label} | {', '.join(features) or 'none'} | {k} | {cell(within['suggested'])} % / "
            f"{median_cell(mape['suggested'])} % | {cell(within['random'])} % / {median_cell(mape['random'])} % | "
            f"{gain:+.1f} ± {error:.1f} |"), (gain, error)


def ceiling_table(only: str | None = None) -> str:
    """What no calibration from these columns can beat: least squares in log space on *all* models
    of the file (sim and every feature), judged on those same models."""
    rows = ["| device pair | features | in-sample ±10 % / MAPE |", "|---|---|---|"]
    for pair in DEVICE_PAIRS:
        if not pair.features or not selected(pair, only):
            continue
        sim, device, features = load_columns(pair)
        for names in ((), tuple(features)):
            design = np.column_stack([np.ones_like(sim), np.log(sim), *(np.log(features[name]) for name in names)])
            coefficients, *_ = np.linalg.lstsq(design, np.log(device), rcond=None)
            relative = np.abs(np.exp(design @ coefficients) - device) / device
            rows.append(f"| {pair.label} | {', '.join(('sim', *names))} | "
                        f"{100 * np.mean(relative <= 0.10):.0f} % / {100 * np.mean(relative):.1f} % |")
    return "\n".join(["### Ceiling: a log-space fit on all models, judged on the same models", "", *rows])


def timing_table(pair_count: int = 1_000_000, repeats: int = 3) -> str:
    generator = np.random.default_rng(1)
    sim = generator.uniform(1.0, 50.0, pair_count)
    device = 3.0 * sim * np.exp(generator.normal(0.0, 0.05, pair_count)) + 1.0
    started = time.perf_counter()
    pairs = [Pair(f"m{i}", x, y) for i, (x, y) in enumerate(zip(sim.tolist(), device.tolist()))]
    build_s = time.perf_counter() - started
    rows = [f"| kinds | `calibrate` on 10⁶ pairs, best of {repeats} (s) |", "|---|---|",
            f"| (building the 10⁶ `Pair` objects, not included below) | {build_s:.2f} |"]
    for kinds in (("ols",), ("log",), ("robust",), FIT_KINDS):
        times = []
        for _ in range(repeats):  # best of a few: the machine is shared
            started = time.perf_counter()
            calibrate(pairs, kinds=kinds)
            times.append(time.perf_counter() - started)
        rows.append(f"| {', '.join(kinds)} | {min(times):.2f} |")
    return "\n".join(["### Fit time", "", *rows])


POPULATION_TARGETS = (("Galaxy S10 big core", "s10|1large|float|mean"), ("Mi 8 SE big core", "mi8se|1large|float|mean"),
                      ("Galaxy A03s big core", "a03s|1large|float|mean"),
                      ("iPhone XS big core", "iphonexs|1large|float|mean"), ("Pixel 4 GPU", "pixel4|gpu|float|mean"))


def population_holdout(draws: int, seed: int, k: int, targets: tuple[tuple[str, str], ...] = POPULATION_TARGETS,
                       ) -> dict[str, dict[str, list[float]]]:
    """Device hold-out on the qed phones: for each target, a population prior fitted on every float
    configuration of the *other* phones, then k random models calibrate the target with and without
    it (the same draws); the held-out models are predicted by the chosen fit. Per target: share
    within ±10 % and MAPE per draw for "without" and "with", and the log_pop prior weight."""
    from population_prior import load_qed  # benchmarks/ is on sys.path when this file runs as a script

    sim, devices, features = load_qed()
    generator = np.random.default_rng(seed)
    out: dict[str, dict[str, list[float]]] = {}
    for label, column in targets:
        phone = column.split("|")[0]
        others = {name: values for name, values in devices.items() if name.split("|")[0] != phone}
        population = fit_population_prior(sim, others, features, f"qed phones other than {phone}")
        device = devices[column]
        usable = np.flatnonzero(np.isfinite(sim) & np.isfinite(device) & (sim > 0) & (device > 0))
        result: dict[str, list[float]] = {"without": [], "with": [], "without_mape": [], "with_mape": [], "weight": []}
        for _ in range(draws):
            picked = generator.choice(usable, size=k, replace=False)
            held = np.setdiff1d(usable, picked)
            pairs = [Pair(f"m{i}", sim[i], device[i], features={"FLOPS": features["flops"][i], "size": features["size"][i]})
                     for i in picked]
            held_features = {"FLOPS": features["flops"][held], "size": features["size"][held]}
            for name, given in (("without", None), ("with", population)):
                try:
                    calibration = calibrate(pairs, confidence=CONFIDENCE, features=["FLOPS", "size"], population=given)
                except ValueError:
                    continue
                estimate, _, _ = calibration.chosen_fit.predict_arrays(sim[held], held_features, CONFIDENCE)
                relative = np.abs(estimate - device[held]) / device[held]
                result[name].append(float(np.mean(relative <= 0.10)))
                result[f"{name}_mape"].append(float(np.mean(relative)))
                if given is not None and "log_pop" in calibration.fits:
                    result["weight"].append(float(calibration.fits["log_pop"].prior_weight or 0.0))
        out[label] = result
    return out


def population_table(draws: int, seed: int) -> str:
    rows = ["### Population prior: device hold-out on the qed phones (Pixel 4 big core as sim)", "",
            f"{draws} draws per k, seed {seed}; the prior is fitted on every float configuration of the other "
            "phones; chosen fit, held-out models: share within ±10 % (median MAPE %)", "",
            "| device | k | without prior | with population prior | gain (points) | log_pop prior weight |",
            "|---|---|---|---|---|---|"]
    for k in (5, 10):
        gains = []
        for label, result in population_holdout(draws, seed, k).items():
            gain = 100 * (statistics.fmean(result["with"]) - statistics.fmean(result["without"]))
            gains.append(gain)
            rows.append(f"| {label} | {k} | {cell(result['without'], 1)} ({median_cell(result['without_mape'])}) | "
                        f"{cell(result['with'], 1)} ({median_cell(result['with_mape'])}) | {gain:+.1f} | "
                        f"{cell(result['weight'])} % |")
        rows.append(f"| mean gain | {k} | | | {statistics.fmean(gains):+.1f} | |")
    return "\n".join(rows)


def coverage_table(draws: int, seed: int, only: str | None = None) -> str:
    """Coverage of the chosen fit's 90 % interval on the held-out models, k = 5, 10, 20, without and
    (qed phones) with the population prior fitted on the *other* phones; the same draws for both.
    Also the share of draws called unsafe (which the interval width feeds)."""
    from population_prior import load_qed  # benchmarks/ is on sys.path when this file runs as a script

    qed_sim, qed_devices, qed_features = load_qed()
    rows = [f"### {CONFIDENCE:.0%} interval coverage of the chosen fit, held-out models", "",
            f"{draws} draws per cell, seed {seed}; aim 85–95 %. Cells: coverage % (share of draws called unsafe)", "",
            "| device pair | k | without prior | with population prior (other phones) |", "|---|---|---|---|"]
    for pair in DEVICE_PAIRS:
        if not selected(pair, only):
            continue
        sim, device, features = load_columns(pair)
        population = None
        if pair.file == QED:
            phone = pair.device_column.split("|")[0]
            others = {name: values for name, values in qed_devices.items() if name.split("|")[0] != phone}
            population = fit_population_prior(qed_sim, others, qed_features, f"qed phones other than {phone}")
        for k in KS:
            generator = np.random.default_rng(seed)
            result: dict[str, tuple[list[float], list[float]]] = {"without": ([], []), "with": ([], [])}
            for _ in range(draws):
                picked = generator.choice(sim.size, size=k, replace=False)
                held = np.ones(sim.size, dtype=bool)
                held[picked] = False
                pairs = [Pair(f"m{i}", sim[i], device[i], features={name: float(values[i]) for name, values in features.items()})
                         for i in picked]
                for name, given in (("without", None), ("with", population)):
                    if name == "with" and given is None:
                        continue
                    try:
                        calibration = calibrate(pairs, confidence=CONFIDENCE, features=list(features), population=given)
                    except ValueError:
                        continue
                    _, low, high = calibration.chosen_fit.predict_arrays(
                        sim[held], {n: v[held] for n, v in features.items()}, CONFIDENCE)
                    truth = device[held]
                    result[name][0].append(float(np.mean((truth >= low) & (truth <= high))))
                    result[name][1].append(float(calibration.unsafe))
            cells = [f"{cell(c, 1)} % ({cell(u)} %)" if c else "—" for c, u in result.values()]
            rows.append(f"| {pair.label} | {k} | {cells[0]} | {cells[1]} |")
    return "\n".join(rows)


BAYES_TARGETS = (("Galaxy S10 big core", "s10|1large|float|mean"), ("Mi 8 SE big core", "mi8se|1large|float|mean"),
                 ("Galaxy A03s big core", "a03s|1large|float|mean"), ("iPhone XS big core", "iphonexs|1large|float|mean"),
                 ("iPhone 7 big core", "iphone7|1large|float|mean"), ("Pixel 4 GPU (CPU→GPU)", "pixel4|gpu|float|mean"),
                 ("Galaxy S10 GPU (CPU→GPU)", "s10|gpu|float|mean"))


def bayes_table(draws: int, seed: int, k: int = 10) -> str:
    """Issue 31's benchmark: Pixel 4 big core as the sim, k calibration models per draw, the rest predicted.
    Per device pair, in the same draws: the default (chosen) fit, with the per-class prior fitted on the
    *other* phones (device hold-out) and with the shipped prior, against a plain 3-term least-squares fit
    ``log y ~ log x + log FLOPs``: share within ±10 %, 90 % interval coverage, the kinds chosen, and the
    share of draws called unsafe (CPU→GPU pairs should be)."""
    from population_prior import class_priors, load_qed  # benchmarks/ is on sys.path when run as a script

    from farm.controller.analysis.calibration import class_priors_from_json

    sim, devices, features = load_qed()
    generator = np.random.default_rng(seed)
    rows = [f"### Bayesian log-linear default against a 3-term fit (k = {k}, {draws} draws per pair, seed {seed})", "",
            "Pixel 4 big core (qed, TFLite float) as the sim; features FLOPS and size. `held-out prior`: the class "
            "priors fitted on every float configuration of the *other* phones; `shipped`: the priors farm ships "
            "(fitted on all phones, the target included). Cells: mean share of the other models within ±10 %.", "",
            "| device pair | 3-term LS ±10 % | chosen, held-out prior ±10 % | gap (points) | 90 % coverage | chosen, "
            "shipped prior ±10 % | kinds chosen | unsafe |", "|---|---|---|---|---|---|---|---|"]
    cpu_gaps, cpu_within, coverages = [], [], []
    for label, column in BAYES_TARGETS:
        phone = column.split("|")[0]
        others = {name: values for name, values in devices.items() if name.split("|")[0] != phone}
        held_out = class_priors_from_json(class_priors(sim, others, features, f"qed phones other than {phone}"))
        device = devices[column]
        usable = np.flatnonzero(np.isfinite(sim) & np.isfinite(device) & (sim >= SMALLEST_VALID_MS * 1e3)
                                & (device >= SMALLEST_VALID_MS * 1e3))
        three, within, shipped, coverage, unsafe = [], [], [], [], []
        chosen: Counter[str] = Counter()
        for _ in range(draws):
            picked = generator.choice(usable, size=k, replace=False)
            held = np.setdiff1d(usable, picked)
            truth = device[held]
            design = np.column_stack([np.ones(k), np.log(sim[picked]), np.log(features["flops"][picked])])
            coefficients, *_ = np.linalg.lstsq(design, np.log(device[picked]), rcond=None)
            estimate = np.exp(np.column_stack([np.ones(held.size), np.log(sim[held]),
                                               np.log(features["flops"][held])]) @ coefficients)
            three.append(float(np.mean(np.abs(estimate - truth) / truth <= 0.10)))
            pairs = [Pair(f"m{i}", sim[i], device[i], features={"FLOPS": features["flops"][i], "size": features["size"][i]})
                     for i in picked]
            held_features = {"FLOPS": features["flops"][held], "size": features["size"][held]}
            for priors, sink in ((held_out, within), (None, shipped)):
                calibration = calibrate(pairs, confidence=CONFIDENCE, features=["FLOPS", "size"], class_priors=priors)
                estimate, low, high = calibration.chosen_fit.predict_arrays(sim[held], held_features, CONFIDENCE)
                sink.append(float(np.mean(np.abs(estimate - truth) / truth <= 0.10)))
                if priors is not None:
                    chosen[calibration.chosen] += 1
                    coverage.append(float(np.mean((truth >= low) & (truth <= high))))
                    unsafe.append(float(calibration.unsafe))
        gap = 100 * (statistics.fmean(within) - statistics.fmean(three))
        if "GPU" not in label:
            cpu_gaps.append(gap)
            cpu_within.append(statistics.fmean(within))
        coverages.append(statistics.fmean(coverage))
        rows.append(f"| {label} | {cell(three, 1)} | {cell(within, 1)} | {gap:+.1f} | {cell(coverage, 1)} | "
                    f"{cell(shipped, 1)} | {', '.join(f'{kind} {count}' for kind, count in chosen.most_common())} | "
                    f"{cell(unsafe)} % |")
    rows += ["", f"CPU pairs: mean {100 * statistics.fmean(cpu_within):.1f} % within ±10 %, worst gap to the 3-term fit "
                 f"{min(cpu_gaps):+.1f} points; coverage {100 * min(coverages):.1f}–{100 * max(coverages):.1f} %."]
    return "\n".join(rows)


NB201_FEATURES_FILE = Path(__file__).resolve().parent / "data" / "nb201_features.csv"
NB201_WORK_SIZE = ("flops", "size_bytes")
NB201_SHARES = ("depthwise_macs_share", "conv1x1_macs_share")
# (label, sim column, device column, cross-class): HELP's NB201 devices that are measured, not simulated,
# and not whole milliseconds (pixel2, samsung_*, essential_ph_1 are; a 3 ms model then cannot be within ±10 %)
NB201_TARGETS = (
    ("Xeon Silver 4114 → Silver 4210R", "silver_4114_ms", "silver_4210r_ms", False),
    ("Xeon Gold 6226 → Gold 6240", "gold_6226_ms", "gold_6240_ms", False),
    ("Xeon Silver 4114 → Gold 6240", "silver_4114_ms", "gold_6240_ms", False),
    ("Pixel 3 → Raspberry Pi 4", "pixel3_ms", "raspi4_ms", False),
    ("Raspberry Pi 4 → Xeon Gold 6226", "raspi4_ms", "gold_6226_ms", False),
    ("Pixel 3 → Titan RTX batch 1 (CPU→GPU)", "pixel3_ms", "titan_rtx_1_ms", True),
    ("Xeon Gold 6240 → GTX 1080 Ti batch 1 (CPU→GPU)", "gold_6240_ms", "1080ti_1_ms", True),
)


def load_nb201() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(latency column → values, feature → values) of the NB201 cells whose features nb201_features.py read."""
    if not NB201_FEATURES_FILE.exists():
        sys.exit(f"error: {NB201_FEATURES_FILE} not found: run benchmarks/nb201_features.py first")
    with NB201_FEATURES_FILE.open(newline="") as handle:
        feature_rows = {int(row["arch_idx"]): row for row in csv.DictReader(handle)}
    with gzip.open(DATA_DIR / "help_nb201_latency_all_devices.csv.gz", "rt", newline="") as handle:
        latency_rows = {int(row["arch_idx"]): row for row in csv.DictReader(handle) if int(row["arch_idx"]) in feature_rows}
    order = sorted(feature_rows)
    columns = {c for _, sim, device, _ in NB201_TARGETS for c in (sim, device)}
    latencies = {c: np.array([float(latency_rows[i][c]) for i in order]) for c in columns}
    names = (*NB201_WORK_SIZE, *NB201_SHARES, "conv3x3_macs_share")
    return latencies, {name: np.array([float(feature_rows[i][name]) for i in order]) for name in names}


def _three_term(sim: np.ndarray, device: np.ndarray, flops: np.ndarray, picked: np.ndarray,
                held: np.ndarray) -> float:
    design = np.column_stack([np.ones(picked.size), np.log(sim[picked]), np.log(flops[picked])])
    coefficients, *_ = np.linalg.lstsq(design, np.log(device[picked]), rcond=None)
    estimate = np.exp(np.column_stack([np.ones(held.size), np.log(sim[held]), np.log(flops[held])]) @ coefficients)
    return float(np.mean(np.abs(estimate - device[held]) / device[held] <= 0.10))


def _ceiling(sim: np.ndarray, device: np.ndarray, features: dict[str, np.ndarray]) -> float:
    """In-sample ±10 % of least squares in log space on every model: sim, log FLOPs, log size, the shares."""
    design = np.column_stack([np.ones_like(sim), np.log(sim), np.log(features["flops"]), np.log(features["size_bytes"]),
                              features["conv1x1_macs_share"], features["conv3x3_macs_share"]])
    coefficients, *_ = np.linalg.lstsq(design, np.log(device), rcond=None)
    return float(np.mean(np.abs(np.exp(design @ coefficients) - device) / device <= 0.10))


def nb201_table(draws: int, seed: int, k: int = 10) -> str:
    """Issue 31 item 5: the default fit on NAS-Bench-201 networks whose per-layer features farm read itself.
    Per pair, in the same draws: a plain 3-term fit, the default (chosen) fit with FLOPs and size, and with
    the depthwise and 1×1 shares too; coverage, unsafe share and the in-sample ceiling. The class priors are
    the shipped ones, fitted on the qed phones: none of these devices informed them (device hold-out)."""
    latencies, features = load_nb201()
    generator = np.random.default_rng(seed)
    rows = [f"### NAS-Bench-201 networks with per-layer features (k = {k}, {draws} draws per pair, seed {seed})", "",
            f"{features['flops'].size} cells (a fixed-seed sample, benchmarks/data/nb201_features.csv); "
            "cells: mean share of the other cells within ±10 %.", "",
            "| device pair | 3-term LS | default, FLOPs + size | default, + shares | gap to 3-term | 90 % coverage "
            "| kinds chosen | unsafe | in-sample ceiling |", "|---|---|---|---|---|---|---|---|---|"]
    cpu_within, cpu_gaps, coverages = [], [], []
    for label, sim_column, device_column, cross in NB201_TARGETS:
        sim, device = latencies[sim_column], latencies[device_column]
        usable = np.flatnonzero((sim >= SMALLEST_VALID_MS) & (device >= SMALLEST_VALID_MS))
        three, plain, shares, coverage, unsafe = [], [], [], [], []
        chosen: Counter[str] = Counter()
        for _ in range(draws):
            picked = generator.choice(usable, size=k, replace=False)
            held = np.setdiff1d(usable, picked)
            truth = device[held]
            three.append(_three_term(sim, device, features["flops"], picked, held))
            for names, sink in ((NB201_WORK_SIZE, plain), ((*NB201_WORK_SIZE, *NB201_SHARES), shares)):
                pairs = [Pair(f"m{i}", sim[i], device[i], features={n: float(features[n][i]) for n in names})
                         for i in picked]
                try:
                    calibration = calibrate(pairs, confidence=CONFIDENCE, features=list(names))
                except ValueError:
                    continue
                estimate, low, high = calibration.chosen_fit.predict_arrays(
                    sim[held], {n: features[n][held] for n in names}, CONFIDENCE)
                sink.append(float(np.mean(np.abs(estimate - truth) / truth <= 0.10)))
                if sink is shares:
                    chosen[calibration.chosen] += 1
                    coverage.append(float(np.mean((truth >= low) & (truth <= high))))
                    unsafe.append(float(calibration.unsafe))
        gap = 100 * (statistics.fmean(shares) - statistics.fmean(three))
        if not cross:
            cpu_within.append(statistics.fmean(shares))
            cpu_gaps.append(gap)
        coverages.append(statistics.fmean(coverage))
        rows.append(f"| {label} | {cell(three, 1)} | {cell(plain, 1)} | {cell(shares, 1)} | {gap:+.1f} | "
                    f"{cell(coverage, 1)} | {', '.join(f'{kind} {count}' for kind, count in chosen.most_common())} | "
                    f"{cell(unsafe)} % | {100 * _ceiling(sim[usable], device[usable], {n: v[usable] for n, v in features.items()}):.1f} |")
    rows += ["", f"CPU pairs: mean {100 * statistics.fmean(cpu_within):.1f} % within ±10 % (with shares), worst gap to "
                 f"the 3-term fit {min(cpu_gaps):+.1f} points; coverage {100 * min(coverages):.1f}–"
                 f"{100 * max(coverages):.1f} %."]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=200, help="random calibration sets per device pair and k")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-timing", action="store_true", help="leave out the 10⁶-pair fit time")
    parser.add_argument("--only-timing", action="store_true", help="only the 10⁶-pair fit time")
    parser.add_argument("--ceiling", action="store_true", help="only the in-sample ceiling of the feature pairs")
    parser.add_argument("--suggest", action="store_true", help="only --suggest against random choice (k = 10); "
                        "with --nb201 on the NB201 CPU pairs")
    parser.add_argument("--population", action="store_true", help="only the population prior's device hold-out")
    parser.add_argument("--coverage", action="store_true", help="only the chosen fit's interval coverage (and unsafe share)")
    parser.add_argument("--bayes", action="store_true", help="only issue 31's table: the default fit against a 3-term "
                                                            "least-squares fit at k = 10 (device hold-out priors)")
    parser.add_argument("--nb201", action="store_true", help="only the NAS-Bench-201 table with per-layer features "
                                                            "(benchmarks/nb201_features.py first)")
    parser.add_argument("--only", help="only device pairs whose label contains one of these comma-separated texts "
                                       "(e.g. qed, or 'similar,phone,desktop' for the HELP rows)")
    arguments = parser.parse_args()
    print("## Calibration benchmark\n")
    if arguments.ceiling:
        print(ceiling_table(arguments.only))
        return
    if arguments.population:
        print(population_table(arguments.draws, arguments.seed))
        return
    if arguments.bayes:
        print(bayes_table(arguments.draws, arguments.seed))
        return
    if arguments.suggest:
        print(suggest_table(arguments.draws, arguments.seed, arguments.only, nb201=arguments.nb201))
        return
    if arguments.nb201:
        print(nb201_table(arguments.draws, arguments.seed))
        return
    if arguments.coverage:
        print(coverage_table(arguments.draws, arguments.seed, arguments.only))
        return
    if not arguments.only_timing:
        print(accuracy_tables(arguments.draws, arguments.seed, arguments.only))
        print()
    if not arguments.skip_timing:
        print(timing_table())


if __name__ == "__main__":
    main()
