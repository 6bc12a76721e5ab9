"""`make bench` (web): server time of the dashboard's pages on a lab-sized store.

The store is filled through farm's own paths: 10 agents register 200 devices (FarmServer.open_session,
as a Hello does), 1,000 jobs are submitted (Controller.submit; 4 tasks each: two repeats on one
phone and their sim twins), the first 300 run to completion through lease/complete with measured-
looking results (a contended sim run among them), plus one job of 60 runs over threads 1, 2, 4, 20 devices are quarantined, and one key is
calibrated 50 times (fit_and_store: 50 versions), 49 other devices once. Then each page is fetched over HTTP on loopback
with a bearer token, as a script or the browser would, and the time from request to the last byte
is taken (median, p95 over --repeats fetches, after one warm-up).

Prints a markdown report and writes it to benchmarks/results/<date>-web.{md,json}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from farm.controller.analysis.calibration import Pair
from farm.controller.analysis.calibrations import CalibrationSource, PairedRun, fit_and_store
from farm.controller.scheduling.controller import Controller
from farm.controller.grpc_server import FarmServer
from farm.controller.scheduling.jobfile import DeviceTarget, load_job_text
from farm.controller.store import SQLiteStore as Store
from farm.model_generators.generate import write_tiny_onnx
from farm.proto.generated import agent_pb2, common_pb2
from farm.proto.results import Contention, LatencyStats, Limits, RunResult, RunStatus, Telemetry
from farm.web.server import Operator, start_dashboard
from farm.controller.auth import Identity, TokenTable
from results_file import write_results  # benchmarks/ is on sys.path when a benchmark runs

TOKEN = "bench-admin-token-0123456789"


def fake_result(rng: random.Random, contended: bool = False) -> RunResult:
    avg = rng.uniform(2, 40)
    return RunResult(status=RunStatus.COMPLETED, backend="process", limits=Limits(cpus=1.0, memory_mb=512),
                     wall_s=avg / 100, latency=LatencyStats(None, avg, avg, avg, avg, avg * 1.1, avg * 1.2, avg * 0.05,
                                                            avg * 0.9, avg * 1.3, 50),
                     telemetry=Telemetry(interval_ms=100, cpu_avg_percent=95, cpu_peak_percent=100,
                                         memory_avg_bytes=40e6, memory_peak_bytes=int(60e6)),
                     environment={"runtime": "onnxruntime"},
                     contention=Contention(contended=contended, reasons=["other work"] if contended else []))


def seed(store: Store, model: Path, *, jobs: int, devices: int, versions: int, completed_jobs: int) -> dict[str, int]:
    rng = random.Random(7)
    farm = FarmServer(store)
    names = [f"phone-{i:03d}" for i in range(devices)]
    for a in range(10):
        hello = agent_pb2.Hello(agent_name=f"rack{a}", farm_version="bench", hostname=f"rack{a}.lab", devices=[
            common_pb2.Device(name=n, driver="android", device_type="pixel", slots=1)
            for n in names[a::10]])
        farm.open_session(hello, f"ipv4:10.0.0.{a}:5000")
    controller = farm.controller
    targets = [DeviceTarget(n) for n in names]
    for i in range(jobs):
        device = names[i % devices]
        job = load_job_text(f"name: bench-{i}\nmodels: [{model}]\nrepeats: 2\ntargets: [{device}]\n", "bench.yaml",
                            model.parent, devices=targets)
        controller.submit(job)
    for job_id in range(1, completed_jobs + 1):
        for task in store.jobs.tasks(job_id):
            spec = controller.lease(f"rack{names.index(task.target) % 10 if task.target != 'sim' else 0}",
                                    {task.target}, job_id=job_id)
            if spec is None:
                continue
            leased = store.jobs.task(spec.task_id)
            controller.complete(spec.task_id, spec.attempt, leased.leased_by, time.time() - 1,
                                fake_result(rng, contended=spec.task_id % 7 == 0))
    big = controller.submit(load_job_text(f"name: sweep\nmodels: [{model}]\nmatrix: {{threads: [1, 2, 4]}}\nrepeats: 10\n"
                                          f"targets: [{names[1]}]\n", "bench.yaml", model.parent, devices=targets))
    while (spec := controller.lease("rack1", {"sim", names[1]}, job_id=big)) is not None:
        controller.complete(spec.task_id, spec.attempt, "rack1", time.time() - 1,
                            fake_result(rng, contended=spec.task_id % 7 == 0))
    for n in names[:20]:
        controller.quarantine(n, "3 infrastructure failures in a row; last: adb: device offline")
    models = [f"net-{k}" for k in range(10)]
    cal_id = 0
    for v in range(versions):
        paired = [PairedRun(Pair(m, x := 5 + 3 * k, 2.1 * x + 4 + rng.gauss(0, 0.5 + v / 50)), 1, "onnxruntime", 0, 0)
                  for k, m in enumerate(models)]
        stored, _ = fit_and_store(store, names[0], "latency", paired, source=CalibrationSource(job=1))
        cal_id = stored[0].id
    for name in names[1:50]:  # the calibrations list: 50 keys, one of them with every version
        paired = [PairedRun(Pair(m, x := 5 + 3 * k, 1.7 * x + 2 + rng.gauss(0, 0.5)), 1, "onnxruntime", 0, 0)
                  for k, m in enumerate(models)]
        fit_and_store(store, name, "latency", paired, source=CalibrationSource(job=1))
    return {"job": 1, "big_job": big, "calibration": cal_id}


def fetch(url: str) -> float:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--devices", type=int, default=200)
    parser.add_argument("--versions", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_tiny_onnx(root / "tiny.onnx")
        store = Store(root / "web.db")
        started = time.perf_counter()
        ids = seed(store, model, jobs=args.jobs, devices=args.devices, versions=args.versions, completed_jobs=300)
        seeded_s = time.perf_counter() - started
        tokens = TokenTable({TOKEN: Identity("admin", None, 1)})
        running = start_dashboard(store, "127.0.0.1:0", Operator.embedded(Controller(store)), tokens=tokens)
        pages = {"lab (200 devices)": "lab", "jobs (newest 200)": "jobs", "jobs (all)": f"jobs?limit={args.jobs + 1}",
                 f"job {ids['job']} (4 runs)": f"jobs/{ids['job']}",
                 f"job {ids['big_job']} (60 runs, threads sweep)": f"jobs/{ids['big_job']}",
                 "calibrations (50 keys)": "calibrations", f"calibration ({args.versions} versions)": f"calibrations/{ids['calibration']}"}
        rows = []
        for label, path in pages.items():
            url = running.url + path
            fetch(url)  # warm-up: first-use imports and SQLite's page cache
            times = sorted(fetch(url) for _ in range(args.repeats))
            rows.append({"page": label, "path": "/" + path, "median_ms": round(statistics.median(times) * 1000, 1),
                         "p95_ms": round(times[min(len(times) - 1, int(0.95 * len(times)))] * 1000, 1)})
        running.stop()
        store.close()
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    lines = [f"# Dashboard page times, {dt.date.today()} ({machine})", "",
             f"Store: {args.jobs + 1:,} jobs ({args.jobs * 4 + 60:,} tasks, 301 jobs run), {args.devices} devices on 10 agents "
             f"(20 quarantined), 50 calibration keys, one of them with {args.versions} versions (seeded in {seeded_s:.0f} s). "
             f"Time from request to last byte over loopback HTTP with a bearer token, {args.repeats} fetches each.", "",
             "| page | path | median ms | p95 ms |", "|---|---|---|---|"]
    lines += [f"| {r['page']} | `{r['path']}` | {r['median_ms']} | {r['p95_ms']} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    path = write_results("web", text, {"machine": machine, "jobs": args.jobs, "devices": args.devices,
                                       "versions": args.versions, "pages": rows})
    print(f"written to {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
