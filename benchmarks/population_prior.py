"""Fit the per-device-class population priors farm ships (controller/analysis/population_prior.json) on public data.

Run by hand: ``.venv/bin/python benchmarks/population_prior.py [--write]``.

Every float configuration of the qed phone file (``qed_tflite_nas_e2e.csv.gz`` in the shared latency
data, MIT licence, 1,000 NAS CNNs × 6 phones × core sets) is fitted against the Pixel 4 big core
(the "sim") as ``log y = b + a·log x + c_work·log FLOPS + c_size·log size`` by least squares on all
its models (``fit_population_prior``). The prior is the mean and spread of c_work and c_size across
those devices and the median log residual std, one prior per device class (issue 31: never one
Gaussian over all): ``single_core`` (one core: 1large, 1med, 1small), ``multi_core`` (two or more
cores) and ``gpu``. A single big core scales with the Pixel 4 big core almost in proportion; a GPU
does not, and mixing them gave a mean exponent of 1.24 with a spread no single core shows. Coefficients of logs are unit-free, so they apply
to MACs and to bytes in any unit; they do assume a sim that relates to the device roughly as one
phone's big core relates to another phone's cores.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
import re
from pathlib import Path

import numpy as np

from farm.controller.analysis.calibration import CLASS_PRIORS_FORMAT, POPULATION_PRIOR_FILE, fit_population_prior

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


def device_class(column: str) -> str:
    """The device class of a qed column (``phone|cores|float|mean``): gpu, single_core or multi_core."""
    cores = column.split("|")[1]
    if cores == "gpu":
        return "gpu"
    return "single_core" if sum(int(c) for c in re.findall(r"\d+", cores)) == 1 else "multi_core"


def class_priors(sim: np.ndarray, devices: dict[str, np.ndarray], features: dict[str, np.ndarray],
                 source: str) -> dict[str, object]:
    """The ``farm.population-prior/2`` document: one prior per device class of ``devices``."""
    classes = {}
    for name in ("single_core", "multi_core", "gpu"):
        members = {column: values for column, values in devices.items() if device_class(column) == name}
        prior = fit_population_prior(sim, members, features, f"{source}, {len(members)} {name} configurations")
        classes[name] = prior.to_json()
    return {"format": CLASS_PRIORS_FORMAT, "source": source, "classes": classes}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {POPULATION_PRIOR_FILE}")
    args = parser.parse_args()
    sim, devices, features = load_qed()
    document = class_priors(sim, devices, features, "qed phones (EdgeSys 2024, MIT) vs Pixel 4 big core")
    text = json.dumps(document, indent=2) + "\n"
    print(text)
    if args.write:
        POPULATION_PRIOR_FILE.write_text(text)
        print(f"written {POPULATION_PRIOR_FILE}")


if __name__ == "__main__":
    main()
