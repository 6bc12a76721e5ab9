"""CPU time of the store's part of a result: `store.runs.record` on SQLite, per result.

    python benchmarks/store_record_cpu.py [--tasks 400] [--rounds 3]

Each round fills a fresh store (a file, WAL, synchronous=NORMAL as the controller sets it) with one job's
tasks, leases them all, then records a realistic result per task (benchmarks/store_backends.py's: 100
timings, 25 telemetry samples), timing the recording with process CPU time, not wall time, so other load
on the machine weighs less. Prints the fastest round's ms per result, every round's, and what packing 100
timings costs. Compare two commits by running it on each (benchmarks/results/2026-11-28-store.md).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from store_backends import _fill, _result  # noqa: E402

from farm.controller.store import SQLiteStore  # noqa: E402
from farm.controller.store.samples import pack_iterations  # noqa: E402


def _round(tasks: int, rng: random.Random) -> float:
    with tempfile.TemporaryDirectory() as folder:
        store = SQLiteStore(Path(folder) / "farm.db")
        store.sync_normal()
        try:
            _fill(store, tasks)
            with store.transaction():
                leased = store.leases.next_pending({"sim"}, tasks)
                for task in leased:
                    store.leases.lease(task.id, 1, "agent", time.time() + 600)
            results = [_result(rng) for _ in leased]
            started = time.process_time()
            for task, result in zip(leased, results):
                store.runs.record(task, 1, "agent", time.time(), result, {"status": "completed"})
            return (time.process_time() - started) / len(leased) * 1000
        finally:
            store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(3)
    rounds = [_round(args.tasks, rng) for _ in range(args.rounds)]
    timings = _result(rng).iterations_ms
    started = time.process_time()
    for _ in range(20_000):
        pack_iterations(timings)
    pack_us = (time.process_time() - started) / 20_000 * 1e6
    print(f"record, CPU ms per result: {min(rounds):.3f} (rounds: {', '.join(f'{r:.3f}' for r in rounds)}); "
          f"packing 100 timings: {pack_us:.1f} us, {len(pack_iterations(timings))} B")


if __name__ == "__main__":
    main()
