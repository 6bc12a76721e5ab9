"""Bytes a stored task takes: its task row (with its job's plan, as `farm submit` makes it) and its run, a
realistic result (100 timings, telemetry samples, a summary, an environment).

    python benchmarks/store_size.py [--runs 400] [--synthetic] [--tables] [--candidates]

Each task's result carries the timings and telemetry of one of four real MobileNet v2 sim runs
(tests/data/mobilenetv2_sim_runs.json, in turn); --synthetic gives the Gaussian timings (2 ms, sd 0.05) and
regular telemetry of the scripts before 2026-11-29 instead. --tables prints the bytes per task of each table
and index (SQLite's dbstat). --candidates prints, for the real runs' timings, the size of each way of storing
them farm considered and its worst rounding error (docs/measurement.md, "How precisely a run is kept").

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
import struct
import tempfile
import time
import zlib
from array import array
from pathlib import Path

from farm.controller.store import SQLiteStore
from farm.proto.results import LatencyStats, RunResult, RunStatus, Telemetry, TelemetrySample
from farm.proto.spec import BenchmarkWorkload, SimBudget
from farm.proto.tasks import TaskPlan

REAL_RUNS = Path(__file__).resolve().parent.parent / "tests" / "data" / "mobilenetv2_sim_runs.json"


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


def _real_runs() -> list[dict]:
    return json.loads(REAL_RUNS.read_text())["runs"]


def _samples(k: int, synthetic: bool, rng: random.Random) -> tuple[list[float], list[TelemetrySample]]:
    """The k-th task's timings and telemetry samples: a real run's (in turn), or the older scripts' Gaussian ones."""
    if synthetic:
        return ([2.0 + rng.gauss(0, 0.05) for _ in range(100)],
                [TelemetrySample(i * 0.04, rng.uniform(80, 100), 50_000_000 + rng.randint(0, 1 << 20)) for i in range(25)])
    runs = _real_runs()
    run = runs[k % len(runs)]
    return list(run["iterations_ms"]), [TelemetrySample(*s) for s in run["telemetry"]]


def _varints(values: list[int]) -> bytes:
    out = bytearray()
    for v in values:
        z = (v << 1) ^ (v >> 63)  # zigzag
        while z > 0x7F:
            out.append(z & 0x7F | 0x80)
            z >>= 7
        out.append(z)
    return bytes(out)


def _frame_of_reference(values: list[int]) -> int:
    return 14 + len(values) * (((max(values) - min(values)).bit_length() + 7) // 8)


def candidates() -> None:
    """Each way of storing the real runs' timings farm considered: bytes, and worst error against the float64."""
    from farm.agents.harness.stats import latency_stats

    def deltas(ints: list[int]) -> list[int]:
        return [b - a for a, b in zip([0] + ints, ints)]

    for run in _real_runs():
        t = run["iterations_ms"]
        ns, us = [round(v * 1e6) for v in t], [round(v * 1e3) for v in t]
        f32 = list(array("f", t))
        shuffled = b"".join(struct.pack("<100d", *t)[j::8] for j in range(8))
        rows = [("float64 (format 1)", 801, t), ("float64, zlib", 1 + len(zlib.compress(struct.pack("<100d", *t), 6)), t),
                ("float64 byte-shuffled, zlib", 1 + len(zlib.compress(shuffled, 6)), t),
                ("float32", 1 + 400, f32),
                ("whole ns, frame of reference (format 3)", _frame_of_reference(ns), [v / 1e6 for v in ns]),
                ("whole ns, zigzag delta varints", 1 + len(_varints(deltas(ns))), [v / 1e6 for v in ns]),
                ("whole us, frame of reference", _frame_of_reference(us), [v / 1e3 for v in us]),
                ("whole us, zigzag delta varints", 1 + len(_varints(deltas(us))), [v / 1e3 for v in us])]
        exact = latency_stats(t)
        print(f"run t{run['threads']}{' contended' if run['contended'] else ''}: avg {exact.avg:.3f} ms, "
              f"sd {exact.std:.3f} ms, range {max(t) - min(t):.3f} ms")
        for name, size, back in rows:
            error_ns = max(abs(a - b) for a, b in zip(t, back)) * 1e6
            stats = latency_stats(back)
            drift = max(abs(getattr(stats, f) - getattr(exact, f)) / getattr(exact, f)
                        for f in ("avg", "p50", "p90", "p99", "std"))
            print(f"  {name:42} {size:4} B  worst error {error_ns:9.3f} ns ({error_ns / 1e6 / exact.std:.1e} of "
                  f"the sd)  summary moves {drift:.1e} (relative)")


def _tables(path: Path, runs: int) -> None:
    conn = sqlite3.connect(path)
    rows = conn.execute("SELECT name, SUM(pgsize), SUM(payload) FROM dbstat GROUP BY name ORDER BY 2 DESC").fetchall()
    conn.close()
    for name, pages, payload in rows:
        if pages / runs >= 20:  # more than a page or two (an empty table takes one)
            print(f"  {name:32} {pages / runs:7.1f} B/task in pages, {payload / runs:7.1f} B payload")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=400)
    parser.add_argument("--synthetic", action="store_true")
    parser.add_argument("--tables", action="store_true")
    parser.add_argument("--candidates", action="store_true")
    args = parser.parse_args()
    if args.candidates:
        candidates()
        return
    runs = args.runs
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
        for k, task in enumerate(tasks):
            timings, samples = _samples(k, args.synthetic, rng)
            result = RunResult(
                status=RunStatus.COMPLETED, backend="cgroup", wall_s=1.3,
                latency=LatencyStats(5.1, 3.2, 2.4, 2.0, 2.0, 2.1, 2.2, 0.05, 1.9, 2.3, 100),
                iterations_ms=timings,
                telemetry=Telemetry(interval_ms=40, cpu_avg_percent=95.0, memory_peak_bytes=60_000_000,
                                    memory_avg_bytes=55e6, samples=samples),
                environment={"runtime": "onnxruntime", "python": "3.11.2"})
            store.runs.record(task, 1, "agent", time.time(), result, {"status": "completed"})
        per_record_ms = (time.perf_counter() - started) / runs * 1000
        store.close()
        full = _vacuumed_size(path)
        print(f"{(full - empty) / runs:.0f} bytes per task, task row included ({runs} tasks, each plan "
              f"{len(plan)} B, each model's facts {len(_facts_json(0))} B, {'synthetic' if args.synthetic else 'real'} "
              f"timings); runs alone {(full - base) / runs:.0f} B; {per_record_ms:.2f} ms per runs.record")
        if args.tables:
            _tables(path, runs)


if __name__ == "__main__":
    main()
