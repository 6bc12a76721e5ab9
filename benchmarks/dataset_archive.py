"""Reading a dataset at submit from a .tar / .tar.gz beside the same files in a folder (issue 30 item 3).

What `farm submit` spends reading `workload.dataset.path` before anything is stored: controller/scheduling/datasets.py's
_files and _read (stat, the archive's one checked pass in memory, numpy loads, stacking). No model is run and no
reference: the figure is the archive's cost over the folder's. Samples: float32 [3, 96, 96] (MobileNetV2 at 96 px),
one .npy each. Run: python benchmarks/dataset_archive.py [--samples N] [--rounds R] [--json]
"""

from __future__ import annotations

import argparse
import json
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from farm.controller.scheduling.datasets import _files, _read
from farm.proto.spec import DatasetSpec

from dataset import best_of  # the same best-of-N timer as the folder benchmark (this folder is on sys.path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    class Model:  # what _read asks of the job's models: their inputs' names (one input, "input")
        class facts:
            inputs = [type("T", (), {"name": "input"})()]

    rng = np.random.default_rng(0)
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "samples").mkdir()
        for i in range(args.samples):
            np.save(root / "samples" / f"{i:05d}.npy", rng.random((3, 96, 96), dtype=np.float32))
        for name, mode in (("samples.tar", "w"), ("samples.tar.gz", "w:gz")):
            with tarfile.open(root / name, mode) as tar:
                for path in sorted((root / "samples").iterdir()):
                    tar.add(path, arcname=f"samples/{path.name}")
        for path in ("samples", "samples.tar", "samples.tar.gz"):
            spec = DatasetSpec(path=path)
            seconds = best_of(lambda spec=spec: _read(spec, [Model()], root), args.rounds)
            size = sum(p.stat().st_size for p in (root / path).iterdir()) if (root / path).is_dir() \
                else (root / path).stat().st_size
            found[path] = {"seconds": seconds, "ms_per_sample": 1000 * seconds / args.samples, "bytes_on_disk": size}
            assert len(_files(spec, root)[0]) == args.samples
    found["sample_count"] = args.samples
    if args.json:
        print(json.dumps(found, indent=2))
        return
    for path, figure in found.items():
        if isinstance(figure, dict):
            print(f"{path:16} {figure['seconds'] * 1000:8.1f} ms  {figure['ms_per_sample']:.3f} ms/sample  "
                  f"{figure['bytes_on_disk'] / 1e6:.1f} MB on disk")


if __name__ == "__main__":

    main()
