"""Issue 34: what a set of test files costs, with the `farm` fixture in-process (the default) or as a process
per call (`--farm-subprocess`, as before issue 34).

    python benchmarks/suite.py [--farm-subprocess] [--label NAME] tests/test_a.py tests/test_b.py ...

Runs pytest once over the files (-q, --durations=15, no cache) and prints the wall time and the CPU time of pytest
and every process it waited for (resource.getrusage(RUSAGE_CHILDREN): user + system), then pytest's summary line.
The figures go into benchmarks/results/<date>-suite.md by hand, with the machine's load beside them."""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--farm-subprocess", action="store_true", help="every `farm` call as a process (the old way)")
    parser.add_argument("--label", default="")
    parser.add_argument("--pytest-arg", action="append", default=[], help="passed on to pytest (e.g. -n2)")
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=15", *args.pytest_arg,
               *(["--farm-subprocess"] if args.farm_subprocess else []), *args.files]
    load = os.getloadavg()[0]
    start = time.monotonic()
    p = subprocess.run(command)  # pytest's own output as it goes
    wall = time.monotonic() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    mode = "subprocess" if args.farm_subprocess else "in-process"
    print(f"suite[{args.label or mode}]: {len(args.files)} files, {wall:.0f} s wall, "
          f"{usage.ru_utime + usage.ru_stime:.0f} CPU-s (pytest + children), load at start {load:.1f}, exit {p.returncode}")
    return p.returncode


if __name__ == "__main__":
    sys.exit(main())
