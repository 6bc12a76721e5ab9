"""Dataset throughput on the sim (issue 30): the dataset pass (agents/harness/dataset.py: every sample through the
model, outputs stacked, digested, summarised and compared with the reference) beside a bare loop of
`session.run` over the same samples in the same process, so the figure is farm's overhead per input, not the model.

Then the same through `farm submit` on the sim: a job with and without `workload.dataset`, wall time of the whole
submit (the reference run at submit, the packing, the pass in the sandbox) divided by the samples.

Model: MobileNetV2 w0.35 at 96 px (generated, real shapes). Run: python benchmarks/dataset.py [--samples N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def best_of(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import onnxruntime

    from farm.agents.harness.dataset import run_dataset
    from farm.models.runtimes import onnx_session
    from farm.proto.accuracy import pack

    folder = Path(tempfile.mkdtemp(prefix="farm-bench-dataset-"))
    subprocess.run([sys.executable, "-m", "farm.cli.main", "models", "generate", str(folder), "--widths", "0.35",
                    "--sizes", "96", "--formats", "onnx", "--no-zoo"], check=True, capture_output=True)
    (model,) = sorted(folder.glob("mobilenetv2_w0.35_r96*.onnx"))
    session = onnx_session(str(model), threads=1)
    (name,) = [i.name for i in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]
    rng = np.random.default_rng(0)
    samples = rng.random((args.samples, 3, 96, 96), dtype=np.float32)
    reference = {outputs[0]: np.concatenate([session.run(None, {name: samples[i:i + 1]})[0]
                                             for i in range(args.samples)])}
    dataset = {"packed": pack({name: samples}, rng.integers(0, 1000, args.samples), reference), "output": None,
               "reference": "float"}

    def bare() -> None:
        for i in range(args.samples):
            session.run(None, {name: samples[i:i + 1]})

    def farm_pass() -> None:
        run_dataset(dataset, lambda f: dict(zip(outputs, session.run(None, f))), {}, outputs)

    bare_s = best_of(bare, args.rounds)
    pass_s = best_of(farm_pass, args.rounds)

    np.save(folder / "x.npy", samples)
    base = "models: [{model}]\nworkload: {{iterations: 5, warmup: 1{dataset}}}\nsim: {{on_contention: flag}}\n"
    (folder / "plain.yaml").write_text(base.format(model=model.name, dataset=""))
    (folder / "data.yaml").write_text(base.format(model=model.name, dataset=", dataset: {path: x.npy, reference: "
                                                  f"{model.name}}}"))
    env = {**os.environ, "FARM_DB": str(folder / "farm.db")}
    walls = {}
    for job in ("plain", "data"):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "farm.cli.main", "submit", str(folder / f"{job}.yaml")], check=True,
                       capture_output=True, env=env)
        walls[job] = time.perf_counter() - start
    found = {
        "samples": args.samples, "onnxruntime": onnxruntime.__version__, "load": os.getloadavg()[0],
        "bare_inputs_per_s": args.samples / bare_s, "pass_inputs_per_s": args.samples / pass_s,
        "overhead_per_input_ms": (pass_s - bare_s) / args.samples * 1e3,
        "submit_plain_s": walls["plain"], "submit_dataset_s": walls["data"],
        "submit_extra_per_input_ms": (walls["data"] - walls["plain"]) / args.samples * 1e3,
    }
    if args.json:
        print(json.dumps(found, indent=2))
        return
    print(f"{args.samples} samples, MobileNetV2 w0.35 r96, 1 thread, load {found['load']:.1f}")
    print(f"bare loop:    {found['bare_inputs_per_s']:8.1f} inputs/s")
    print(f"dataset pass: {found['pass_inputs_per_s']:8.1f} inputs/s  ({found['overhead_per_input_ms']:+.3f} ms/input)")
    print(f"farm submit:  {walls['plain']:.2f} s plain, {walls['data']:.2f} s with the dataset "
          f"({found['submit_extra_per_input_ms']:+.2f} ms/input, reference run at submit and the pass included)")


if __name__ == "__main__":
    main()
