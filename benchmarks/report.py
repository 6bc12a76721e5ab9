"""How long `farm report JOB -o page.html --png DIR` takes on a store, as a user runs it.

The store is given (`--db`): e.g. the one tests/test_phones_experiment.py leaves under pytest's
--basetemp, after `farm calibrate --job 1 --metric latency --metric peak_memory --metric whole_run
--metric avg_memory` (36 calibrations: two phones × three thread counts × four metrics, plus the
per-family fits). Each repeat is a fresh process (imports included), so a number is what the
command costs end to end. Prints the median and range; with `--label` it says which code ran.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True, help="the store (farm.db) holding the job")
    parser.add_argument("--job", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--label", default="this checkout")
    args = parser.parse_args()
    farm = [sys.executable, "-m", "farm.cli.main"]
    spent, files = [], 0
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as folder:
            started = time.perf_counter()
            run = subprocess.run([*farm, "report", str(args.job), "--db", args.db, "-o", f"{folder}/r.html",
                                  "--png", f"{folder}/png"], capture_output=True, text=True)
            spent.append(time.perf_counter() - started)
            if run.returncode != 0:
                raise SystemExit(run.stderr[-2000:])
            files = len(list(Path(folder, "png").glob("*.png")))
    print(f"{args.label}: farm report job {args.job}: median {statistics.median(spent):.2f} s "
          f"(min {min(spent):.2f}, max {max(spent):.2f}, {args.repeats} runs), {files} PNG figure(s)")


if __name__ == "__main__":
    main()
