"""Issue 34: where the suite's CPU goes, per test file.

As a pytest plugin (on PYTHONPATH, `-p suite_cpu`), it writes one JSON line per test — wall time, CPU of the pytest
process and of the processes it reaped in that test (getrusage) — to $SUITE_CPU_DIR/<xdist worker>.jsonl:

    PYTHONPATH=benchmarks SUITE_CPU_DIR=/tmp/cpu make test PYTEST_ARGS="-p suite_cpu"

As a script it sums those lines per file, most CPU first, as a markdown table:

    python benchmarks/suite_cpu.py /tmp/cpu [--top 15]

A process is counted where it is reaped (a session peer lands on the test that ended it); daemons never reaped by
pytest (dockerd, the PostgreSQL peer) are not counted."""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import time
from pathlib import Path
from typing import IO, Any

import pytest

_out: list[IO[str]] = []


def _cpu() -> tuple[float, float]:
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    if not _out:
        folder = Path(os.environ.get("SUITE_CPU_DIR", "suite-cpu"))
        folder.mkdir(parents=True, exist_ok=True)
        _out.append((folder / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl").open("a"))
    start, (own, reaped) = time.monotonic(), _cpu()
    yield
    own_after, reaped_after = _cpu()
    _out[0].write(json.dumps({"id": item.nodeid, "wall": time.monotonic() - start, "self": own_after - own,
                              "children": reaped_after - reaped}) + "\n")
    _out[0].flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    rows = [json.loads(line) for path in sorted(args.folder.glob("*.jsonl")) for line in path.open()]
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for row in rows:
        totals = files[row["id"].split("::")[0]]
        totals[0] += row["wall"]
        totals[1] += row["self"] + row["children"]
        totals[2] += 1
    cpu = sum(t[1] for t in files.values()) or 1.0
    print(f"{len(rows)} tests, {cpu / 60:.1f} CPU-min counted (pytest workers + the processes they reaped)\n")
    print("| file | tests | wall s | CPU s | share of CPU |\n|---|---|---|---|---|")
    for name, (wall, used, count) in sorted(files.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"| {name.removeprefix('tests/')} | {count:.0f} | {wall:.0f} | {used:.0f} | {100 * used / cpu:.1f} % |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
