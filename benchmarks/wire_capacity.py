"""`make bench` (wire part): what the controller holds up under, as issue 9 asks.

1. 1,000 agents connected at once: a real `farm controller serve` process, and 1,000 lightweight
   agents (a hello with one sim device, then a heartbeat per interval; one gRPC connection each,
   all on one asyncio loop in a child process). Measured: the time from the first dial to the
   last welcome, the controller's resident memory and threads before and after (per agent), and
   ListJobs latency while they are connected.
2. A 20 MB result (2.5 M per-iteration timings, the size the report's poison script produced)
   written to the store while another process calls ListJobs in a loop: ListJobs p50/p99/max
   during the write (aim p99 < 100 ms). The controller runs in this process so the write can
   be applied directly: over the wire a result is capped at 8 MiB (farm.proto.wire), so this is
   more than an agent can send.
3. Device registration: one hello with 5,000 devices, sent twice, then 10,000 (the most one
   agent may register): the time to the welcome each time (linear means the second equals the first).

Prints a markdown report and writes it to benchmarks/results/<date>-wire.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import multiprocessing
import os
import platform
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from results_file import write_results  # benchmarks/ is on sys.path when a benchmark runs

ROOT = Path(__file__).resolve().parent
FARM = [sys.executable, "-m", "farm.cli.main"]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _proc_status(pid: int) -> dict[str, int]:
    text = Path(f"/proc/{pid}/status").read_text()
    return {"rss_kib": int(re.search(r"VmRSS:\s+(\d+)", text).group(1)),
            "threads": int(re.search(r"Threads:\s+(\d+)", text).group(1))}


# --- 1. many agents ---------------------------------------------------------------------------
def _lightweight_agents(address: str, count: int, out: str, ready: "multiprocessing.Event",
                        stop: "multiprocessing.Event") -> None:
    """The child process: `count` agents on one asyncio loop, each with its own connection."""
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    import grpc

    from farm.proto.generated import agent_pb2, agent_pb2_grpc

    async def one(i: int, welcomed: list[float], channels: list) -> None:
        channel = grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        channels.append(channel)
        name = f"light{i:04d}"
        queue: asyncio.Queue = asyncio.Queue()
        hello = agent_pb2.Hello(agent_name=name, farm_version="bench", protocol_version=1, hostname="bench")
        hello.devices.add(name=f"{name}/sim", driver="sim", device_type="sim", slots=1)
        await queue.put(agent_pb2.AgentMessage(hello=hello))

        async def messages():
            while (message := await queue.get()) is not None:
                yield message

        call = agent_pb2_grpc.AgentServiceStub(channel).Connect(messages())
        interval = 1.0
        async for message in call:
            if message.WhichOneof("kind") == "welcome":
                welcomed.append(time.perf_counter())
                interval = message.welcome.heartbeat_interval_s

                async def beat() -> None:
                    while True:
                        await asyncio.sleep(interval)
                        await queue.put(agent_pb2.AgentMessage(heartbeat=agent_pb2.Heartbeat()))

                asyncio.get_running_loop().create_task(beat())

    async def main() -> None:
        welcomed: list[float] = []
        channels: list = []
        started = time.perf_counter()
        tasks = [asyncio.create_task(one(i, welcomed, channels)) for i in range(count)]
        while len(welcomed) < count and time.perf_counter() - started < 300:
            await asyncio.sleep(0.05)
        Path(out).write_text(json.dumps({"connected": len(welcomed), "connect_s": (max(welcomed) - started) if welcomed else None}))
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.2)
        for t in tasks:
            t.cancel()
        for c in channels:
            await c.close()

    asyncio.run(main())


def many_agents(count: int) -> dict:
    import grpc

    from farm.proto.generated import farm_pb2, farm_pb2_grpc

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "controller.log"
        with log.open("wb") as handle:
            controller = subprocess.Popen([*FARM, "controller", "serve", "--listen", "127.0.0.1:0", "--no-auth",
                                           "--db", str(Path(tmp) / "c.db")], stdout=handle, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while not (match := re.search(r"listening on (127\.0\.0\.1:\d+)", log.read_text())):
                if time.monotonic() > deadline or controller.poll() is not None:
                    raise RuntimeError(f"the controller did not start: {log.read_text()}")
                time.sleep(0.1)
            address = match.group(1)
            time.sleep(1.0)
            idle = _proc_status(controller.pid)
            ctx = multiprocessing.get_context("spawn")
            ready, stop = ctx.Event(), ctx.Event()
            out = Path(tmp) / "agents.json"
            child = ctx.Process(target=_lightweight_agents, args=(address, count, str(out), ready, stop))
            child.start()
            try:
                if not ready.wait(330):
                    raise RuntimeError("the agents did not report within 330 s")
                time.sleep(2.0)  # a heartbeat round
                loaded = _proc_status(controller.pid)
                channel = grpc.insecure_channel(address)
                stub = farm_pb2_grpc.FarmServiceStub(channel)
                latencies = []
                for _ in range(50):
                    t0 = time.perf_counter()
                    stub.ListJobs(farm_pb2.ListJobsRequest(), timeout=30)
                    latencies.append(time.perf_counter() - t0)
                agents = stub.ListAgents(farm_pb2.ListAgentsRequest(), timeout=60).agents
                online = sum(1 for a in agents if a.state == "online")
                channel.close()
            finally:
                stop.set()
                child.join(60)
                if child.is_alive():
                    child.kill()
            connected = json.loads(out.read_text())
        finally:
            controller.send_signal(signal.SIGTERM)
            try:
                controller.wait(30)
            except subprocess.TimeoutExpired:
                controller.kill()
    return {
        "agents": count, "connected": connected["connected"], "online_per_controller": online,
        "connect_s": round(connected["connect_s"], 2) if connected["connect_s"] else None,
        "controller_rss_mib": {"idle": round(idle["rss_kib"] / 1024, 1), "loaded": round(loaded["rss_kib"] / 1024, 1)},
        "rss_per_agent_kib": round((loaded["rss_kib"] - idle["rss_kib"]) / count, 1),
        "controller_threads": {"idle": idle["threads"], "loaded": loaded["threads"]},
        "list_jobs_ms_with_agents": {"p50": round(_percentile(latencies, 0.5) * 1000, 2),
                                     "p99": round(_percentile(latencies, 0.99) * 1000, 2)},
    }


# --- 2. a large write beside readers ------------------------------------------------------------
def _list_jobs_loop(address: str, out: str, ready: "multiprocessing.Event", stop: "multiprocessing.Event") -> None:
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    import grpc

    from farm.proto.generated import farm_pb2, farm_pb2_grpc

    channel = grpc.insecure_channel(address)
    stub = farm_pb2_grpc.FarmServiceStub(channel)
    stub.ListJobs(farm_pb2.ListJobsRequest(), timeout=30)
    ready.set()
    samples: list[tuple[float, float]] = []
    while not stop.is_set():
        t0 = time.time()
        stub.ListJobs(farm_pb2.ListJobsRequest(), timeout=60)
        samples.append((t0, time.time() - t0))
        time.sleep(0.01)
    Path(out).write_text(json.dumps(samples))


def large_write(iterations: int) -> dict:
    from farm.controller.grpc_server import serve
    from farm.controller.scheduling.jobfile import load_job_text
    from farm.controller.store import SQLiteStore as Store
    from farm.model_generators.generate import write_tiny_onnx
    from farm.proto.results import LatencyStats, RunResult, RunStatus

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        write_tiny_onnx(tmp_path / "tiny.onnx")
        store = Store(tmp_path / "bench.db")
        server = serve(store, "127.0.0.1:0", tokens=None, lease_ttl_s=600)
        address = f"127.0.0.1:{server.port}"
        controller = server.farm.controller
        for _ in range(20):  # something to list
            controller.submit(load_job_text("models: [tiny.onnx]\nrepeats: 5\n", "job.yaml", tmp_path))
        task = controller.lease("bench", {"sim"})
        result = RunResult(status=RunStatus.COMPLETED, iterations_ms=[1.0 + (i % 7) * 0.01 for i in range(iterations)],
                           latency=LatencyStats(None, None, None, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.1, iterations))
        ctx = multiprocessing.get_context("spawn")
        ready, stop = ctx.Event(), ctx.Event()
        out = tmp_path / "list_jobs.json"
        child = ctx.Process(target=_list_jobs_loop, args=(address, str(out), ready, stop))
        child.start()
        try:
            ready.wait(60)
            time.sleep(1.0)  # a baseline before the write
            write_started = time.time()
            controller.complete(task.task_id, task.attempt, "bench", time.time(), result)
            write_s = time.time() - write_started
            time.sleep(1.0)
        finally:
            stop.set()
            child.join(60)
            server.stop()
        samples = json.loads(out.read_text())
    during = [d for t0, d in samples if write_started <= t0 <= write_started + write_s or
              t0 < write_started < t0 + d]
    every = [d for _, d in samples]
    return {
        "iterations": iterations, "result_mb": round(iterations * 8 / 1e6, 1), "write_s": round(write_s, 2),
        "list_jobs_during_write": {"n": len(during), "p50_ms": round(_percentile(during, 0.5) * 1000, 1),
                                   "p99_ms": round(_percentile(during, 0.99) * 1000, 1),
                                   "max_ms": round(max(during) * 1000, 1)} if during else None,
        "list_jobs_all": {"n": len(every), "p99_ms": round(_percentile(every, 0.99) * 1000, 1)},
    }


# --- 3. device registration ------------------------------------------------------------------------
def registration(sizes: list[int]) -> list[dict]:
    import grpc

    from farm.controller.grpc_server import serve
    from farm.controller.store import SQLiteStore as Store
    from farm.proto.generated import agent_pb2, agent_pb2_grpc

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "bench.db")
        server = serve(store, "127.0.0.1:0", tokens=None)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                for n in sizes:
                    hello = agent_pb2.Hello(agent_name="rack", farm_version="bench", protocol_version=1)
                    for i in range(n):
                        hello.devices.add(name=f"phone{i:05d}", driver="android", device_type="lg-g6", slots=1)
                    t0 = time.perf_counter()
                    call = stub.Connect(iter([agent_pb2.AgentMessage(hello=hello)]), timeout=120)
                    first = next(call)
                    assert first.WhichOneof("kind") == "welcome"
                    rows.append({"devices": n, "welcome_s": round(time.perf_counter() - t0, 3)})
                    call.cancel()
                    time.sleep(0.5)  # the old session closes before the next hello takes it over
        finally:
            server.stop()
    return rows


def report(r: dict) -> str:
    a, w = r["agents"], r["large_write"]
    d = w["list_jobs_during_write"] or {}
    lines = [
        f"# Wire capacity, {r['date']} ({r['machine']})",
        "",
        "| measure | value | aim |",
        "|---|---|---|",
        f"| agents connected at once | {a['connected']} of {a['agents']} ({a['online_per_controller']} online per ListAgents) | 1,000 |",
        f"| connect time, first dial → last welcome | {a['connect_s']} s | |",
        f"| controller RSS idle → with the agents | {a['controller_rss_mib']['idle']} → {a['controller_rss_mib']['loaded']} MiB | |",
        f"| controller memory per agent | {a['rss_per_agent_kib']} KiB | |",
        f"| controller threads idle → with the agents | {a['controller_threads']['idle']} → {a['controller_threads']['loaded']} | |",
        f"| ListJobs p50 / p99 with the agents connected | {a['list_jobs_ms_with_agents']['p50']} / {a['list_jobs_ms_with_agents']['p99']} ms | |",
        f"| a {w['result_mb']} MB result ({w['iterations']:,} timings) written in | {w['write_s']} s | |",
        f"| ListJobs during that write: calls, p50 / p99 / max | {d.get('n')}, {d.get('p50_ms')} / {d.get('p99_ms')} / {d.get('max_ms')} ms | p99 < 100 ms |",
    ]
    for row in r["registration"]:
        lines.append(f"| a hello with {row['devices']:,} devices, to the welcome | {row['welcome_s']} s | linear |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--iterations", type=int, default=2_500_000, help="timings in the large result (8 bytes each)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * args.agents + 256)), hard))
    result = {"date": str(dt.date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                                                       f"{platform.python_implementation()} {platform.python_version()}"}
    result["agents"] = many_agents(args.agents)
    result["large_write"] = large_write(args.iterations)
    result["registration"] = registration([5000, 5000, 10000])
    text = report(result)
    print(text)
    if not args.no_write:
        write_results("wire", text, result)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
