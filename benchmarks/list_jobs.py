"""`make bench-list-jobs`: how long listing jobs takes with 100k tasks pending.

A real store (WAL, synchronous=NORMAL as the controller runs it) is filled through Controller.submit
with jobs of 2,000 pending tasks each (a phone with no agent, pixel-9: half device tasks, half their
sim twins). Then, call by call: EmbeddedFarm.jobs(50) — what `farm jobs` and farm.api ask, and what
the gRPC ListJobs answers from (the job rows, each job's counts by status and its status) — and
store.jobs.listing(50) alone; and ListJobs(50) over gRPC (issue 35), the controller served in this process
on a local port: wall time per call, and this process's CPU per call (server and client both).

Prints a markdown report and writes it to benchmarks/results/<date>-list-jobs.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from farm.client.embedded import EmbeddedFarm
from farm.controller.scheduling.controller import Controller
from farm.controller.scheduling.jobfile import DeviceTarget, load_job_text
from farm.controller.store import SQLiteStore as Store
from farm.model_generators.generate import write_tiny_onnx
from results_file import write_results  # benchmarks/ is on sys.path when a benchmark runs
from timing import ms_summary, timed

TASKS_PER_JOB = 2000


def measure(tmp: Path, pending: int, calls: int) -> dict:
    model = tmp / "tiny.onnx"
    write_tiny_onnx(model)
    path = tmp / f"list-{pending}.db"
    store = Store(path)
    store.db.execute("PRAGMA synchronous = NORMAL")
    job = load_job_text(f"models: [{model}]\nrepeats: {TASKS_PER_JOB // 2}\ntargets: [pixel-9]\n", "bench.yaml",
                        model.parent, devices=[DeviceTarget("pixel-9")])
    controller = Controller(store)
    for _ in range(max(1, pending // TASKS_PER_JOB)):
        controller.submit(job)
    stored = store.query("SELECT COUNT(*) AS n FROM tasks WHERE status = 'pending'")[0]["n"]
    farm = EmbeddedFarm(path)
    listed = len(farm.jobs(50))
    return {"pending": stored, "jobs_listed": listed, "calls": calls,
            "farm_jobs_ms": ms_summary(timed(lambda: farm.jobs(50), calls)),
            "job_list_ms": ms_summary(timed(lambda: store.jobs.listing(50), calls)),
            **_over_grpc(store, calls)}


def _over_grpc(store: Store, calls: int) -> dict:
    """ListJobs(50) through a served controller: wall ms per call, and CPU ms per call of this process."""
    import grpc

    from farm.controller.grpc_server import serve
    from farm.proto.generated import farm_pb2, farm_pb2_grpc

    server = serve(store, "127.0.0.1:0", tokens=None)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = farm_pb2_grpc.FarmServiceStub(channel)
            listed = len(stub.ListJobs(farm_pb2.ListJobsRequest(limit=50)).jobs)  # connected and warm
            cpu = time.process_time()
            wall = timed(lambda: stub.ListJobs(farm_pb2.ListJobsRequest(limit=50)), calls)
            cpu_ms = (time.process_time() - cpu) * 1000 / calls
    finally:
        server.stop()
    return {"grpc_jobs_listed": listed, "grpc_list_jobs_ms": ms_summary(wall), "grpc_cpu_ms_per_call": round(cpu_ms, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pending", type=int, default=100_000)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--no-write", action="store_true", help="print only (the smoke run)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        figures = measure(Path(tmp), args.pending, args.calls)
    text = (f"# listing jobs, {figures['pending']:,} tasks pending, {figures['jobs_listed']} jobs listed, "
            f"{figures['calls']} calls\n\n| call | median ms | p99 ms |\n| --- | --- | --- |\n"
            f"| EmbeddedFarm.jobs(50) | {figures['farm_jobs_ms']['median']} | {figures['farm_jobs_ms']['p99']} |\n"
            f"| store.jobs.listing(50) | {figures['job_list_ms']['median']} | {figures['job_list_ms']['p99']} |\n"
            f"| ListJobs(50) over gRPC | {figures['grpc_list_jobs_ms']['median']} | {figures['grpc_list_jobs_ms']['p99']} |\n"
            f"\nListJobs over gRPC: {figures['grpc_cpu_ms_per_call']} CPU ms per call (this process: the controller "
            "and the client both).\n")
    print(text)
    print(json.dumps(figures))
    if not args.no_write:
        print(f"written to {write_results('list-jobs', text, figures)}")


if __name__ == "__main__":
    main()
