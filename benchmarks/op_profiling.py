"""What workload.op_profiling costs a sim run, and whether it changes the figures it sits beside.

The same ONNX task through SimDriver, interleaved, with and without op profiling: median wall per run
(the profiled pass is extra work), median p50 latency and peak RSS of the timed loop (which the
profiled pass must not change), and how the per-operator sum compares with the timed average.

Usage: python benchmarks/op_profiling.py [--rounds 5] [--width 1.0] [--size 224]
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import statistics
import tempfile
import time
from pathlib import Path

from farm.agents.sim.driver import SimDriver, SimSlot
from farm.model_generators.generate import generate_examples
from farm.proto.tasks import TaskPlan, TaskSpec


def measure(rounds: int, width: float, size: int, work: Path) -> dict[str, dict[str, float]]:
    model = next(m.path for m in generate_examples(work / "models", widths=[width], input_sizes=[size], zoo=False,
                                                   formats=("onnx",)))
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    driver = SimDriver(work / "runs", run_as=None)
    figures: dict[str, dict[str, list[float]]] = {label: {"wall_s": [], "p50_ms": [], "peak_rss_mb": [], "ops_ms": []}
                                                   for label in ("plain", "op_profiling")}
    for round_ in range(rounds):
        for label in figures:
            task = TaskSpec(task_id=round_, job_id=1, attempt=1, target="sim", model_name="m", model_path=str(model),
                            model_sha256=sha, model_family=None, threads=1, batch_size=1, input_size=None, repeat=0,
                            plan=TaskPlan(workload={"type": "benchmark", "iterations": 50, "warmup": 5,
                                      "op_profiling": label == "op_profiling"},
                            sim={"cpuset": "0"}, run_timeout_s=300, base_dir=str(model.parent)))
            started = time.perf_counter()
            result = driver.run(task, SimSlot(0), lambda: False)
            if result.latency is None:
                raise RuntimeError(f"{label}: {result.message}")
            f = figures[label]
            f["wall_s"].append(time.perf_counter() - started)
            f["p50_ms"].append(result.latency.p50)
            f["peak_rss_mb"].append((result.peak_rss_bytes or 0) / 2**20)
            f["ops_ms"].append(sum(o.avg_ms for o in result.op_profile if o.kind == "op_type"))
    return {label: {k: statistics.median(v) for k, v in f.items()} for label, f in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--size", type=int, default=224)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        result = measure(args.rounds, args.width, args.size, Path(d))
    print(f"{platform.node()} {time.strftime('%Y-%m-%d')} MobileNetV2 {args.width:g}/{args.size} ONNX, 1 thread, "
          f"50 iterations, {args.rounds} rounds (medians)")
    for label, f in result.items():
        print(f"  {label:13} wall {f['wall_s']:.2f} s  p50 {f['p50_ms']:.2f} ms  peak RSS {f['peak_rss_mb']:.1f} MiB"
              + (f"  op sum {f['ops_ms']:.2f} ms" if f["ops_ms"] else ""))


if __name__ == "__main__":
    main()
