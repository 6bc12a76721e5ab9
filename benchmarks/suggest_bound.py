"""How much *can* a design beat random choice? (issue 31, `--suggest`)

Run by hand: ``cd benchmarks && ../.venv/bin/python suggest_bound.py [--lists 30] [--seed 3]``.

For each CPU pair of ``calibration.py --suggest`` (qed, and with NB201 features the NB201 pairs) and each
feature set, take the pair's own log-linear model as the truth — least squares on *all* its models,
Gaussian residuals of the same spread σ — and the prior the ``log_bayes`` fit uses (the shipped
single-core class prior; shares N(0, 0.3²)). Then, for a list of 200 candidates, the expected share of
every model of the file within ±10 % after calibrating on k = 10 of them is exact:
``mean_c [2Φ(log 1.1 / √(σ² + x_cᵀ V x_c)) − 1]`` with V the posterior covariance of the coefficients.
Per list it is computed for 10 random candidates, for the 10 ``suggest_models`` picks, and for the
greedy I-optimal picks under that very model (each step the candidate that most reduces
``Σ_c x_cᵀ V x_c``: the best a variance-reducing design does when the model is exactly right); and a bound
no design of k models can pass: the device's scale is unknown, so every prediction keeps at least the
variance σ²/k (the mean of k residuals) even with the exponent and feature coefficients known exactly —
expected share ≤ 2Φ(log 1.1 / (σ√(1 + 1/k))) − 1. The
gains over random are what design alone can buy if the data were the model; real data add misfit
and heavy tails, which can move a real gain either way (calibration.py ``--suggest`` measures it).
"""

from __future__ import annotations

import argparse
import math
import statistics

import numpy as np
from calibration import DEVICE_PAIRS, NB201_SHARES, NB201_TARGETS, NB201_WORK_SIZE, load_columns, load_nb201
from scipy.stats import norm

from farm.controller.analysis.calibration import Pair, suggest_models
from farm.controller.analysis.calibration.fitting import SHARE_PRIOR_SD
from farm.controller.analysis.calibration.priors import feature_role, shipped_class_priors

HALF_WIDTH = math.log(1.1)  # ±10 % in log space (the judged band, to within its asymmetry)
K, POOL = 10, 200


def _columns(sim: np.ndarray, features: dict[str, np.ndarray], names: tuple[str, ...]) -> np.ndarray:
    return np.column_stack([np.ones_like(sim), np.log(sim),
                            *(features[n] if feature_role(n) == "share" else np.log(features[n]) for n in names)])


def _prior_precision(names: tuple[str, ...]) -> np.ndarray:
    """Of (intercept, exponent, features): the intercept flat, the rest the shipped single-core prior's."""
    prior = shipped_class_priors()["single_core"]
    logged = [n for n in names if feature_role(n) != "share"]
    index = [0, *(prior.terms.index(feature_role(n)) for n in logged)]
    covariance = np.zeros((1 + len(names),) * 2)
    covariance[:1 + len(logged), :1 + len(logged)] = np.array(prior.covariance)[np.ix_(index, index)]
    for i in range(1 + len(logged), 1 + len(names)):
        covariance[i, i] = SHARE_PRIOR_SD ** 2
    precision = np.zeros((2 + len(names),) * 2)
    precision[1:, 1:] = np.linalg.inv(covariance)
    return precision


def expected_share(design: np.ndarray, picked: np.ndarray, sigma: float, precision: np.ndarray) -> float:
    covariance = np.linalg.inv(design[picked].T @ design[picked] / sigma ** 2 + precision)
    variance = np.einsum("ij,jk,ik->i", design, covariance, design)
    return float(np.mean(2 * norm.cdf(HALF_WIDTH / np.sqrt(sigma ** 2 + variance)) - 1))


def i_optimal(design: np.ndarray, pool: np.ndarray, sigma: float, precision: np.ndarray) -> np.ndarray:
    """Greedy: each step the candidate that most reduces the summed predictive variance over the candidates."""
    rows = design[pool]
    covariance = np.linalg.inv(precision + np.diag([1e-4] + [0.0] * (design.shape[1] - 1)))  # intercept: vague
    chosen: list[int] = []
    for _ in range(K):
        cross = rows @ covariance @ rows.T
        gain = (cross ** 2).sum(axis=0) / (sigma ** 2 + np.diag(cross))
        gain[chosen] = -np.inf
        best = int(np.argmax(gain))
        chosen.append(best)
        x = rows[best]
        covariance = covariance - np.outer(covariance @ x, x @ covariance) / (sigma ** 2 + x @ covariance @ x)
    return pool[chosen]


def bound_row(label: str, sim: np.ndarray, device: np.ndarray, features: dict[str, np.ndarray],
              names: tuple[str, ...], lists: int, generator: np.random.Generator) -> tuple[str, float, float, float]:
    design = _columns(sim, features, names)
    coefficients, *_ = np.linalg.lstsq(design, np.log(device), rcond=None)
    sigma = float(np.std(np.log(device) - design @ coefficients))
    precision = _prior_precision(names)
    gains: dict[str, list[float]] = {"suggest": [], "i-optimal": []}
    shares = []
    for _ in range(lists):
        pool = generator.choice(sim.size, size=POOL, replace=False)
        base = expected_share(design, generator.choice(pool, size=K, replace=False), sigma, precision)
        shares.append(base)
        candidates = [Pair(f"m{i}", sim[i], math.nan, features={n: float(features[n][i]) for n in names})
                      for i in pool]
        suggested = np.array([int(name[1:]) for name in suggest_models(candidates, K, features=list(names))])
        gains["suggest"].append(100 * (expected_share(design, suggested, sigma, precision) - base))
        gains["i-optimal"].append(100 * (expected_share(design, i_optimal(design, pool, sigma, precision), sigma,
                                                        precision) - base))
    mean = {name: statistics.fmean(values) for name, values in gains.items()}
    # No design does better: the device's scale is unknown (flat), so after any k models every prediction keeps
    # at least the variance σ²/k of a mean of k residuals, even with every other coefficient known exactly.
    known = 100 * (2 * norm.cdf(HALF_WIDTH / (sigma * math.sqrt(1 + 1 / K))) - 1 - statistics.fmean(shares))
    return (f"| {label} | {', '.join(names) or 'none'} | {sigma:.3f} | {100 * statistics.fmean(shares):.1f} | "
            f"{mean['suggest']:+.2f} | {mean['i-optimal']:+.2f} | {known:+.2f} |", mean["suggest"], mean["i-optimal"], known)


def rows_to_run():
    for pair in DEVICE_PAIRS:
        if pair.features and "GPU" not in pair.label:
            sim, device, every = load_columns(pair)
            for names in ((), pair.features[:1], pair.features):
                yield pair.label, sim, device, every, names
    latencies, features = load_nb201()
    for label, sim_column, device_column, cross in NB201_TARGETS:
        if not cross:
            sim, device = latencies[sim_column], latencies[device_column]
            usable = (sim >= 0.1) & (device >= 0.1)
            for names in ((), NB201_WORK_SIZE, (*NB201_WORK_SIZE, NB201_SHARES[1])):  # depthwise: 0 in NB201
                yield (f"NB201: {label}", sim[usable], device[usable], {n: v[usable] for n, v in features.items()},
                       names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lists", type=int, default=30)
    parser.add_argument("--seed", type=int, default=3)
    arguments = parser.parse_args()
    generator = np.random.default_rng(arguments.seed)
    print(f"### What a design can gain over random if the data were the model ({arguments.lists} lists of {POOL}, "
          f"k = {K}, seed {arguments.seed})\n")
    print("| device pair | features | σ (log) | random: expected ±10 % | suggest gain | I-optimal gain | "
          "bound for any design |\n|---|---|---|---|---|---|---|")
    best: dict[str, list[float]] = {}
    bounds: dict[str, list[float]] = {}
    for label, sim, device, features, names in rows_to_run():
        text, _, optimal, bound = bound_row(label, sim, device, features, names, arguments.lists, generator)
        print(text, flush=True)
        best.setdefault("qed" if label.startswith("qed") else "NB201", []).append(optimal)
        bounds.setdefault("qed" if label.startswith("qed") else "NB201", []).append(bound)
    print("\nLargest I-optimal gain: " + "; ".join(f"{name} {max(values):+.2f}" for name, values in best.items()))
    print("Mean bound for any design: " + "; ".join(f"{name} {statistics.fmean(values):+.2f}"
                                                    for name, values in bounds.items()))


if __name__ == "__main__":
    main()
