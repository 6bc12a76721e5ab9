"""The process backend's watcher: CPU it spends beside a quiet run, finding the run's tree every tick (the old way,
TREE_RESCAN_S = 0) and every TREE_RESCAN_S (the default), side by side in one run.

    python benchmarks/process_watch.py [--seconds 3] [--rounds 3]

Each round starts the same `sleep` run in a process sandbox and measures this process's CPU (the watchdog thread's:
the run itself is a child) over its wait, with the number of processes on the host beside it — a scan reads every
process's /proc/N/stat, so the old way's cost grows with the host, not with the run."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from farm.agents.sandbox import backend_class
from farm.agents.sandbox import process as process_backend
from farm.agents.sandbox.base import Budget


def watcher_cpu_s(seconds: float, rescan_s: float) -> float:
    process_backend.TREE_RESCAN_S = rescan_s
    with tempfile.TemporaryDirectory() as d:
        start = time.process_time()
        sandbox = backend_class("process")().start(["sleep", str(seconds)], Budget(memory_bytes=256 << 20),
                                                   env={"PATH": os.environ["PATH"]}, cwd=Path(d), mounts=[])
        sandbox.wait(seconds + 30)
        sandbox.close()
        return time.process_time() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    default = process_backend.TREE_RESCAN_S
    hosts = sum(name.isdigit() for name in os.listdir("/proc"))
    figures: dict[str, list[float]] = {"every tick": [], f"every {default} s": []}
    for _ in range(args.rounds):  # interleaved: the two ways see the same load
        figures["every tick"].append(watcher_cpu_s(args.seconds, 0.0))
        figures[f"every {default} s"].append(watcher_cpu_s(args.seconds, default))
    print(f"process watcher over a {args.seconds:g} s quiet run, {hosts} processes on the host, "
          f"load {os.getloadavg()[0]:.1f}, median of {args.rounds}")
    print("| tree found | CPU-s | % of a core |\n|---|---|---|")
    for name, values in figures.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.3f} | {100 * median / args.seconds:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
