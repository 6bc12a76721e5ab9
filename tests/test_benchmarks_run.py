"""The benchmarks still run: each in a small form, asserting only that it finishes and prints its table.

`make bench` runs them in full; nothing else did, so the scheduling benchmark broke unnoticed when
the driver API changed (its instant driver had no `in_slot`). Figures are not checked here: they
belong in BENCHMARKS.md, measured side by side, never in a unit test on a shared machine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

SMALL_FORMS = {
    # 3 agents in one child process, 30 tasks with realistic (~1.7 KB) results
    "scheduling": (["scheduling.py", "--agents", "3", "--tasks", "30", "--rounds", "1", "--no-write"],
                   ["tasks/s, submit to last result stored", "pending → driver start",
                    "| a grpc.aio echo of the same messages, CPU per round trip (same run) |"]),
    "lease": (["lease.py", "--depths", "1000", "--leases", "20", "--no-old", "--no-write"], ["| pending |"]),
    "list_jobs": (["list_jobs.py", "--pending", "4000", "--calls", "5", "--no-write"], ["| EmbeddedFarm.jobs(50) |",
                                                                                      "| ListJobs(50) over gRPC |"]),
    "store_size": (["store_size.py", "--runs", "20"], ["bytes per task, task row included"]),
    # the controller's own work per task without gRPC (lease, offer, decode, apply), and the echo it is judged by
    "result_path": (["result_path.py", "--tasks", "40", "--rounds", "1"], ["SQLite: "]),
    # the statements the same loop sends to SQLite per task (a result batch is a statement per table)
    "result_path_statements": (["result_path.py", "--tasks", "64", "--statements"], ["statements sent per task"]),
    "grpc_echo": (["grpc_echo.py", "--streams", "3", "--trips", "30"], ["cpu_ms_per_trip"]),
    # 5 open lab pages, idle 1 s, each way, over a lab of 6 devices and 6 jobs (the full form's 200 devices seed 54
    # calibration fits per pass, one per device up to 50: most of this test's CPU, and nothing it checks)
    "web_streams": (["web_streams.py", "--pages", "5", "--idle-s", "1", "--devices", "6", "--jobs", "6",
                     "--no-write"],
                    ["| a change reaches every page: median / last |"]),
    # the scheduling rounds on SQLite and on a private PostgreSQL, side by side
    "scheduling_postgresql": (["scheduling.py", "--agents", "2", "--tasks", "20", "--rounds", "1", "--postgresql",
                               "--no-write"], ["| tasks/s, submit to last result stored |"]),
    # lab sizes of 2 and 3 agents, 2 tasks each, on SQLite
    "scheduling_sweep": (["scheduling.py", "--sweep", "2,3", "--tasks-per-agent", "2", "--no-write"],
                         ["| agents | store | tasks | tasks/s |", "| 3 | sqlite | 6 |"]),
    # the soak: 3 agents, a job of 6 tasks submitted again as it ends, for 3 seconds
    "scheduling_soak": (["scheduling.py", "--agents", "3", "--tasks", "6", "--soak", "0.05", "--no-write"],
                        ["| jobs | tasks | tasks/s |", "tasks retried"]),
    # both stores side by side (PostgreSQL on a private server, or a line saying why it was skipped)
    "store_backends": (["store_backends.py", "--tasks", "40"], ["ms per operation"]),
    # one cold and one warm job of 2 runs of the tiny ONNX model, embedded
    # 4 samples read from a folder, a .tar and a .tar.gz at submit (issue 30 item 3)
    "dataset_archive": (["dataset_archive.py", "--samples", "4", "--rounds", "1"], ["samples.tar.gz", "ms/sample"]),
    # the process backend's watcher beside a 0.3 s run, the tree found every tick and every TREE_RESCAN_S
    "process_watch": (["process_watch.py", "--seconds", "0.3", "--rounds", "1"], ["| every tick |"]),
    "run_overhead": (["run_overhead.py", "--runs", "2", "--rounds", "1", "--models", "onnx", "--cli-calls", "0",
                      "--no-write"], ["| onnx | warm / cold |", "warm: forked from a kept onnx harness"]),
}


@pytest.mark.parametrize("name", sorted(SMALL_FORMS))
def test_benchmark_runs_in_small_form(name: str) -> None:
    argv, expected = SMALL_FORMS[name]
    if "--postgresql" in argv and not list(Path("/usr/lib/postgresql").glob("*/bin/postgres")):
        pytest.skip("needs Debian's postgresql (.ci/run installs it)")
    done = subprocess.run([sys.executable, str(BENCHMARKS / argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=300, cwd=BENCHMARKS.parent)
    assert done.returncode == 0, f"benchmarks/{argv[0]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    for text in expected:
        assert text in done.stdout, f"benchmarks/{argv[0]} printed no {text!r}:\n{done.stdout[-2000:]}"
