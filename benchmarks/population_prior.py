"""Fit the population prior farm ships (controller/analysis/population_prior.json) on public data.

Run by hand: ``.venv/bin/python benchmarks/population_prior.py [--write]``.

Every float configuration of the qed phone file (``qed_tflite_nas_e2e.csv.gz`` in the shared latency
data, MIT licence, 1,000 NAS CNNs × 6 phones × core sets) is fitted against the Pixel 4 big core
(the "sim") as ``log y = b + a·log x + c_work·log FLOPS + c_size·log size`` by least squares on all
its models (``fit_population_prior``). The prior is the mean and spread of c_work and c_size across
those devices and the median log residual std. Coefficients of logs are unit-free, so they apply
to MACs and to bytes in any unit; they do assume a sim that relates to the device roughly as one
phone's big core relates to another phone's cores.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
from pathlib import Path

import numpy as np

from farm.controller.analysis.calibration import POPULATION_PRIOR_FILE, fit_population_prior

DATA_DIR = Path(os.environ.get("FARM_LATENCY_DATA") or "/work/shared/data/latency")
QED = "qed_tflite_nas_e2e.csv.gz"
SIM_COLUMN = "pixel4|1large|float|mean"


def load_qed() -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(sim latencies, device column → latencies with NaN where not measured, features) of the qed file."""
    with gzip.open(DATA_DIR / QED, "rt", newline="") as handle:
        rows = list(csv.DictReader(handle))

    def number(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            return float("nan")

    columns = [c for c in rows[0] if c.endswith("|float|mean") and c != SIM_COLUMN]
    devices = {c: np.array([number(r[c]) for r in rows]) for c in columns}
    features = {"flops": np.array([float(r["FLOPS"]) for r in rows]), "size": np.array([float(r["size"]) for r in rows])}
    return np.array([number(r[SIM_COLUMN]) for r in rows]), devices, features


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {POPULATION_PRIOR_FILE}")
    args = parser.parse_args()
    sim, devices, features = load_qed()
    prior = fit_population_prior(sim, devices, features,
                                 f"qed phones (EdgeSys 2024, MIT), {len(devices)} float configurations vs Pixel 4 big core")
    text = json.dumps(prior.to_json(), indent=2) + "\n"
    print(text)
    if args.write:
        POPULATION_PRIOR_FILE.write_text(text)
        print(f"written {POPULATION_PRIOR_FILE}")


if __name__ == "__main__":
    main()
