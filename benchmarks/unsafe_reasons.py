"""Why the unsafe verdict fires, and what allowing for the exponent's own error would change (issue 31).

Run by hand: ``cd benchmarks && ../.venv/bin/python unsafe_reasons.py [--draws 100] [--z 1.645]``.

The same k = 10 draws as ``calibration.py --bayes`` (qed, held-out class priors, FLOPS and size) and
``--nb201`` (generated NB201 cells, shipped priors, FLOPs, size and the per-layer shares). Per pair: the share of
draws called unsafe now; the share if the exponent test fired only when the sim-only exponent is outside
``UNSAFE_EXPONENT`` by more than ``z`` standard errors (every other reason kept); how many draws that lifts and how
well those draws' fits predict the held-out models against every draw's. Reads the data, changes nothing.
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

import numpy as np
from calibration import (
    BAYES_TARGETS,
    CONFIDENCE,
    NB201_SHARES,
    NB201_TARGETS,
    NB201_WORK_SIZE,
    SMALLEST_VALID_MS,
    load_nb201,
)
from population_prior import class_priors, load_qed

from farm.controller.analysis.calibration import UNSAFE_EXPONENT, Pair, calibrate, class_priors_from_json


def exponent_outside(sim: np.ndarray, device: np.ndarray, z: float) -> bool:
    """The sim-only power law's exponent outside the band by more than ``z`` of its standard error."""
    x, y = np.log(sim), np.log(device)
    centred = x - x.mean()
    slope = float(centred @ (y - y.mean()) / (centred @ centred))
    residuals = y - y.mean() - slope * centred
    error = math.sqrt(float(residuals @ residuals) / (x.size - 2) / float(centred @ centred))
    return slope + z * error < UNSAFE_EXPONENT[0] or slope - z * error > UNSAFE_EXPONENT[1]


def pair_row(label: str, sim: np.ndarray, device: np.ndarray, features: dict[str, np.ndarray], priors: Any,
             draws: int, z: float, generator: np.random.Generator) -> str:
    usable = np.flatnonzero(np.isfinite(sim) & np.isfinite(device) & (sim > 0) & (device > 0))
    now = allowed = 0
    lifted, every = [], []
    for _ in range(draws):
        picked = generator.choice(usable, size=10, replace=False)
        held = np.setdiff1d(usable, picked)
        pairs = [Pair(f"m{i}", sim[i], device[i], features={n: float(v[i]) for n, v in features.items()})
                 for i in picked]
        try:
            calibration = calibrate(pairs, confidence=CONFIDENCE, features=list(features), class_priors=priors)
        except ValueError:
            continue
        estimate, _, _ = calibration.chosen_fit.predict_arrays(sim[held], {n: v[held] for n, v in features.items()},
                                                               CONFIDENCE)
        within = float(np.mean(np.abs(estimate - device[held]) / device[held] <= 0.10))
        every.append(within)
        others = [reason for reason in calibration.unsafe_reasons if "scales as sim^" not in reason]
        verdict = bool(others) or exponent_outside(sim[picked], device[picked], z)
        now += calibration.unsafe
        allowed += verdict
        if calibration.unsafe and not verdict:
            lifted.append(within)
    lifted_cell = f"{100 * statistics.fmean(lifted):.1f}" if lifted else "—"
    return (f"| {label} | {100 * now / len(every):.0f} % | {100 * allowed / len(every):.0f} % | {len(lifted)} | "
            f"{lifted_cell} | {100 * statistics.fmean(every):.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--z", type=float, default=1.645, help="standard errors the exponent test allows")
    arguments = parser.parse_args()
    generator = np.random.default_rng(arguments.seed)
    print(f"| pair | unsafe now | unsafe, exponent test allowing {arguments.z:g} standard errors | draws no longer "
          "flagged | their held-out ±10 % | every draw's held-out ±10 % |")
    print("|---|---|---|---|---|---|")
    sim, devices, features = load_qed()
    qed_features = {"FLOPS": features["flops"], "size": features["size"]}
    for label, column in BAYES_TARGETS:
        phone = column.split("|")[0]
        others = {name: values for name, values in devices.items() if name.split("|")[0] != phone}
        held_out = class_priors_from_json(class_priors(sim, others, features, f"qed phones other than {phone}"))
        device = np.where(devices[column] >= SMALLEST_VALID_MS * 1e3, devices[column], np.nan)
        print(pair_row(f"qed: {label}", np.where(sim >= SMALLEST_VALID_MS * 1e3, sim, np.nan), device, qed_features,
                       held_out, arguments.draws, arguments.z, generator), flush=True)
    latencies, cells = load_nb201()
    names = (*NB201_WORK_SIZE, *NB201_SHARES)
    for label, sim_column, device_column, _ in NB201_TARGETS:
        nb_sim, nb_device = latencies[sim_column], latencies[device_column]
        keep = (nb_sim >= SMALLEST_VALID_MS) & (nb_device >= SMALLEST_VALID_MS)
        print(pair_row(f"NB201: {label}", np.where(keep, nb_sim, np.nan), np.where(keep, nb_device, np.nan),
                       {name: cells[name] for name in names}, None, arguments.draws, arguments.z, generator), flush=True)


if __name__ == "__main__":
    main()
