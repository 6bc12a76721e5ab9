"""Per-layer features of NAS-Bench-201 networks, read by `farm inspect`'s own code (issue 31 item 5).

Run by hand: ``.venv/bin/python benchmarks/nb201_features.py [--cells 1000] [--seed 0]``.

HELP's NB201 latency table (``help_nb201_latency_all_devices.csv.gz`` in the shared latency data)
holds each cell's ``arch_str``; farm builds the network (model_generators/nb201.py) as ONNX, reads
its facts with ``farm.models.facts.inspect_model`` — FLOPs, size, parameters, the depthwise, 1×1,
3×3 and fully-connected shares, activation bytes, layer count — and writes them, not the models,
to ``benchmarks/data/nb201_features.csv`` (a fixed-seed sample of cells; degenerate cells, whose
output is constant, are left out). calibration.py ``--nb201`` joins them with the latencies.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from farm.model_generators.nb201 import ArchError, nb201_network
from farm.models.facts import inspect_model

DATA_DIR = Path(os.environ.get("FARM_LATENCY_DATA") or "/work/shared/data/latency")
HELP_NB201 = "help_nb201_latency_all_devices.csv.gz"
FEATURES_FILE = Path(__file__).resolve().parent / "data" / "nb201_features.csv"
COLUMNS = ("arch_idx", "flops", "size_bytes", "param_count", "depthwise_macs_share", "conv1x1_macs_share",
           "conv3x3_macs_share", "fc_macs_share", "activation_bytes", "op_count")


def cell_features(arch: str, folder: Path) -> dict[str, float]:
    path = folder / "cell.onnx"
    path.write_bytes(nb201_network(arch).SerializeToString())
    facts = inspect_model(path)
    if facts.macs is None:
        raise ArchError(f"{arch}: MACs not countable")
    return {"flops": 2 * facts.macs, "size_bytes": facts.size_bytes, "param_count": facts.param_count or 0,
            "depthwise_macs_share": facts.depthwise_macs_share or 0.0,
            "conv1x1_macs_share": facts.conv1x1_macs_share or 0.0, "conv3x3_macs_share": facts.conv3x3_macs_share or 0.0,
            "fc_macs_share": facts.fc_macs_share or 0.0, "activation_bytes": facts.activation_bytes or 0,
            "op_count": facts.op_count or 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=1000, help="cells sampled from the 15,625 (fixed seed)")
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args()
    with gzip.open(DATA_DIR / HELP_NB201, "rt", newline="") as handle:
        archs = {int(row["arch_idx"]): row["arch_str"] for row in csv.DictReader(handle)}
    picked = sorted(np.random.default_rng(arguments.seed).choice(sorted(archs), arguments.cells, replace=False))
    FEATURES_FILE.parent.mkdir(exist_ok=True)
    skipped = 0
    with tempfile.TemporaryDirectory() as folder, FEATURES_FILE.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(COLUMNS)
        for n, index in enumerate(picked):
            try:
                features = cell_features(archs[int(index)], Path(folder))
            except ArchError:
                skipped += 1
                continue
            writer.writerow([int(index), *(f"{features[c]:.6g}" if isinstance(features[c], float) else features[c]
                                           for c in COLUMNS[1:])])
            if n % 100 == 0:
                print(f"{n}/{len(picked)}", file=sys.stderr, flush=True)
    print(f"{len(picked) - skipped} cells written to {FEATURES_FILE} ({skipped} degenerate left out)")


if __name__ == "__main__":
    main()
