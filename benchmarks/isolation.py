"""What running jobs as nobody in their own namespaces costs, and what uploading models costs.

1. The same sim task through SimDriver, interleaved: as root without isolation vs. as the run
   user in mount + PID namespaces. Reported: median wall per run (staging, namespaces, setpriv
   included) and median p50 latency of the model (what a user compares).
2. A controller on loopback: a client uploads a model of --upload-mib MiB (first submit), then
   submits the same job again (deduplicated: MissingArtifacts answers "none missing").
3. --setup-only: the cost of a run's setup, cold and warm (issue 33): the median wall of an isolated run of a tiny
   model (5 iterations) through SimDriver on the process backend, where the run's own work is a few ms, so the wall
   is the setup (uid, staging, namespaces, the harness's start or fork, the result read back). Run the same file
   against two checkouts to compare them.

Usage: python benchmarks/isolation.py [--rounds 7] [--upload-mib 64] [--setup-only]  (root, for parts 1 and 3)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from farm.agents.sim.driver import SimDriver
from farm.model_generators.generate import generate_examples
from farm.proto.tasks import TaskPlan, TaskSpec


def isolation_overhead(rounds: int, work: Path) -> dict[str, dict[str, float]]:
    model = generate_examples(work / "models", widths=[0.35], input_sizes=[96], zoo=False)[0].path
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    drivers = {"root, no isolation": SimDriver(work / "plain", run_as=None),
               "nobody + namespaces": SimDriver(work / "isolated")}
    walls: dict[str, list[float]] = {k: [] for k in drivers}
    p50s: dict[str, list[float]] = {k: [] for k in drivers}
    for round_ in range(rounds):
        for label, driver in drivers.items():
            task = TaskSpec(task_id=round_, job_id=1, attempt=1, target="sim", model_name="m", model_path=str(model),
                            model_sha256=sha, model_family=None, threads=1, batch_size=1, input_size=None, repeat=0,
                            plan=TaskPlan(workload={"type": "benchmark", "iterations": 50, "warmup": 5},
                            sim={"backend": "cgroup", "cpuset": "0"}, run_timeout_s=120, base_dir=str(model.parent)))
            started = time.perf_counter()
            result = driver.run(task, lambda: False)
            walls[label].append(time.perf_counter() - started)
            if result.latency is None:
                raise RuntimeError(f"{label}: {result.message}")
            p50s[label].append(result.latency.p50)
    return {label: {"wall_s": statistics.median(walls[label]), "p50_ms": statistics.median(p50s[label])}
            for label in drivers}


def setup_cost(rounds: int, work: Path) -> dict[str, float]:
    """Median wall of one isolated run of a tiny model, cold and warm (the zygote started by a first, unmeasured run)."""
    from farm.model_generators.generate import write_tiny_onnx

    model = work / "tiny.onnx"
    write_tiny_onnx(model)
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    walls: dict[str, list[float]] = {"cold": [], "warm": []}
    drivers = {}
    for mode in walls:
        os.environ["FARM_WARM_HARNESS"] = "1" if mode == "warm" else "0"  # read when a driver is made
        drivers[mode] = SimDriver(work / f"setup-{mode}")
    for round_ in range(rounds + 1):
        for mode, driver in drivers.items():
            task = TaskSpec(task_id=round_, job_id=1, attempt=1, target="sim", model_name="tiny", model_path=str(model),
                            model_sha256=sha, model_family=None, threads=1, batch_size=1, input_size=None, repeat=0,
                            plan=TaskPlan(workload={"type": "benchmark", "iterations": 5, "warmup": 1},
                                          sim={"backend": "process", "on_contention": "flag"}, run_timeout_s=120,
                                          base_dir=str(model.parent)))
            started = time.perf_counter()
            result = driver.run(task, lambda: False)
            if round_ and result.ok:  # the first round starts the zygote
                walls[mode].append(time.perf_counter() - started)
            elif not result.ok:
                raise RuntimeError(f"{mode}: {result.message}")
    return {mode: statistics.median(values) * 1000 for mode, values in walls.items()}


def upload_cost(mib: int, work: Path) -> dict[str, float]:
    from farm.client.config import Credentials
    from farm.client.remote import RemoteFarm
    from farm.controller.grpc_server import serve
    from farm.controller.store import SQLiteStore as Store

    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = work / "big.onnx"  # one Add with a weight of `mib` MiB: a valid model of that size
    weight = numpy_helper.from_array(np.random.default_rng(0).random(mib << 18, dtype=np.float32), "w")
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "big",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [mib << 18])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [mib << 18])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), model)
    job = work / "job.yaml"
    job.write_text("models: [big.onnx]\n")
    store = Store(work / "ctl.db")
    server = serve(store, "127.0.0.1:0", tokens=None)
    try:
        remote = RemoteFarm(f"127.0.0.1:{server.port}", Credentials())  # no token: the controller runs without one
        started = time.perf_counter()
        remote._upload_job_files(job, job.read_text())  # the upload `farm submit --controller` makes
        first = time.perf_counter() - started
        started = time.perf_counter()
        remote._upload_job_files(job, job.read_text())  # the same sha256 again: the controller says it has it
        again = time.perf_counter() - started
        remote.close()
    finally:
        server.stop()  # the store closes with the process: the dispatcher may still be finishing a round
    return {"size_mib": model.stat().st_size / (1 << 20), "first_s": first, "deduplicated_s": again}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--upload-mib", type=int, default=64)
    parser.add_argument("--setup-only", action="store_true", help="only part 3: a run's setup, cold and warm")
    args = parser.parse_args()
    print(f"# {platform.node()} · {os.cpu_count()} cpus · Python {sys.version.split()[0]} · "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · load {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.setup_only:
            setup = setup_cost(args.rounds, work)
            print(f"isolated run of a tiny model, median wall over {args.rounds} rounds: cold {setup['cold']:.0f} ms, "
                  f"warm {setup['warm']:.0f} ms · load after {os.getloadavg()[0]:.1f}")
            return
        if os.geteuid() == 0:
            rows = isolation_overhead(args.rounds, work)
            print("| run | median wall s | median p50 ms |\n|---|---|---|")
            for label, row in rows.items():
                print(f"| {label} | {row['wall_s']:.3f} | {row['p50_ms']:.3f} |")
        else:
            print("(not root: runs are not isolated, nothing to compare)")
        up = upload_cost(args.upload_mib, work)
        print(f"\nupload of a {up['size_mib']:.0f} MiB model: first submit {up['first_s']:.2f} s (hash + inspect + "
              f"upload), the same job again {up['deduplicated_s']:.2f} s (hash + inspect, nothing uploaded)")


if __name__ == "__main__":
    main()
