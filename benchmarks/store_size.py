"""Bytes a stored task takes: its task row (with its job's plan, as `farm submit` makes it) and its run, a
realistic result (100 timings, 25 telemetry samples, a summary, an environment).

    python benchmarks/store_size.py [--runs 400]

Fills a fresh store through the store's own repositories (jobs.insert, leases, then runs.record, as the
controller does), VACUUMs, and prints the file's growth per task (the task row included: the aim, "Store
<= 1.5 KB per run"), the part of it the runs take, and the time per record. Run it at two commits side by
side to compare layouts (BENCHMARKS.md, "Packed samples"; benchmarks/results/2026-11-28-result-path.md).
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import tempfile
import time
from pathlib import Path

from farm.controller.store import SQLiteStore
from farm.proto.results import LatencyStats, RunResult, RunStatus, Telemetry, TelemetrySample
from farm.proto.spec import BenchmarkWorkload, SimBudget
from farm.proto.tasks import TaskPlan


# A model's facts as `farm submit` stores them (dataclasses.asdict of inspect's ModelFacts, as
# scheduling/schedule.py writes them): MobileNet v2's, 7 models in the job as in the tasks below (sha256 differs).
def _facts_json(k: int) -> str:
    sha = f"{k:x}" * 64
    return json.dumps({
        "path": "/home/someone/experiments/mobilenets/models/mobilenet_v2_1.0_224.onnx", "format": "onnx",
        "size_bytes": 13964571, "sha256": sha,
        "inputs": [{"name": "input", "shape": [1, 3, 224, 224], "dtype": "float32"}],
        "outputs": [{"name": "output", "shape": [1, 1000], "dtype": "float32"}], "op_count": 105,
        "param_count": 3487816, "op_types": {"Conv": 52, "Clip": 35, "Add": 10, "GlobalAveragePool": 1,
                                             "Shape": 1, "Gather": 1, "Unsqueeze": 1, "Concat": 1, "Reshape": 1,
                                             "Gemm": 1, "Flatten": 1},
        "macs": 300774272, "conv_macs_share": 0.9957, "depthwise_macs_share": 0.0604, "fc_macs_share": 0.0043,
        "other_macs_share": 0.0, "activation_bytes": 28224000})


def _vacuumed_size(path: Path) -> int:
    conn = sqlite3.connect(path)
    conn.execute("VACUUM")  # freed pages go back to the file system, so sizes compare
    conn.close()
    return path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=400)
    runs = parser.parse_args().runs
    rng = random.Random(3)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "farm.db"
        store = SQLiteStore(path)
        store.close()
        empty = _vacuumed_size(path)
        store = SQLiteStore(path)
        # each task's plan as expand_tasks writes it (the job's workload, sim budget, timeouts and folder)
        plan = TaskPlan(workload=BenchmarkWorkload(), sim=SimBudget(), run_timeout_s=600.0,
                        base_dir="/home/someone/experiments/mobilenets").model_dump_json()
        store.jobs.insert({"name": "size", "kind": "user", "status": "queued", "priority": "normal", "created_at": 0.0},
                          [{"seq": i, "target": "sim", "model_name": "mobilenet_v2_1.0_224.onnx",
                            "model_path": "models/mobilenet_v2_1.0_224.onnx", "model_sha256": f"{i % 7:x}" * 64,
                            "model_facts_json": _facts_json(i % 7),
                            "model_size_bytes": 13964571, "model_param_count": 3487816, "threads": 1,
                            "batch_size": 1, "repeat": i, "status": "pending", "attempts": 0, "max_attempts": 3,
                            "pair_key": f"{i % 7:x}" * 16 + f"|1|1|-|sim|{i}", "spec_json": plan, "priority": 1,
                            "created_at": 1.7e9} for i in range(runs)])
        store.close()
        base = _vacuumed_size(path)
        store = SQLiteStore(path)
        with store.transaction():
            tasks = store.leases.next_pending({"sim"}, runs)
            for task in tasks:
                store.leases.lease(task.id, 1, "agent", time.time() + 600)
        started = time.perf_counter()
        for task in tasks:
            result = RunResult(
                status=RunStatus.COMPLETED, backend="cgroup", wall_s=1.3,
                latency=LatencyStats(5.1, 3.2, 2.4, 2.0, 2.0, 2.1, 2.2, 0.05, 1.9, 2.3, 100),
                iterations_ms=[2.0 + rng.gauss(0, 0.05) for _ in range(100)],
                telemetry=Telemetry(interval_ms=40, cpu_avg_percent=95.0, memory_peak_bytes=60_000_000,
                                    memory_avg_bytes=55e6, samples=[
                                        TelemetrySample(i * 0.04, rng.uniform(80, 100), 50_000_000 + rng.randint(0, 1 << 20))
                                        for i in range(25)]),
                environment={"runtime": "onnxruntime", "python": "3.11.2"})
            store.runs.record(task, 1, "agent", time.time(), result, {"status": "completed"})
        per_record_ms = (time.perf_counter() - started) / runs * 1000
        store.close()
        full = _vacuumed_size(path)
        print(f"{(full - empty) / runs:.0f} bytes per task, task row included ({runs} tasks, each plan "
              f"{len(plan)} B, each model's facts {len(_facts_json(0))} B); runs alone {(full - base) / runs:.0f} B; {per_record_ms:.2f} ms per runs.record")


if __name__ == "__main__":
    main()
