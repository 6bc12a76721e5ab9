"""`make bench-scheduling`: how fast the gRPC controller hands out work, with an instant driver.

The controller runs in this process (so its per-step timings can be read); the agents run in
one child process (or --agent-processes of them), each agent with its own channel and stream and
one slot whose driver returns a result at once. Measured:

- throughput: tasks per second from SubmitJob to the last result stored;
- dispatch latency: from the controller's offer (its clock) to the driver starting (the
  agent's clock; same host), p50 / p99;
- where the controller's time goes: seconds in lease / complete / heartbeat / lease expiry.

Prints a markdown report and writes it to benchmarks/results/<date>-scheduling.{md,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import multiprocessing
import os
import signal
import io
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import tomllib
from pathlib import Path
from typing import Iterator
from grpc_echo import echo_cpu_ms  # benchmarks/ is on sys.path when a benchmark runs
from results_file import write_results

ROOT = Path(__file__).resolve().parent


def _agents(address: str, first: int, count: int, out_path: str, ready: "multiprocessing.Event",
            stop: "multiprocessing.Event", work: str) -> None:
    """The child process: `count` agents with an instant driver; writes their dispatch latencies."""
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from farm.agents.agent import Agent
    from farm.agents.link.remote_controller import AgentDevice, RemoteController
    from farm.proto.results import RunResult

    latencies: list[float] = []
    warm: list[float] = []  # the same, for an agent's later tasks: its first waits for the model's download too
    ran: set[str] = set()
    starts: list[float] = []  # wall clock at each driver start: the parent counts from the moment tasks were pending

    class InstantDriver:
        """A sim driver that 'runs' a task in no time: only the scheduling path is measured.

        Its result is the size of a real one (100 iterations, 25 telemetry samples, ~1.7 KB on the
        wire), so decoding and applying it costs what a real result costs."""

        name = "sim"

        def __init__(self, client: RemoteController) -> None:
            self.client = client

        def in_slot(self, slot) -> "InstantDriver":  # the agent asks for its slot's driver; one serves all
            return self

        def run(self, task, cancel_check) -> RunResult:
            starts.append(time.time())
            offered = self.client.offered_at.get((task.task_id, task.attempt))
            if offered:
                latencies.append(time.time() - offered)
                if self.client.name in ran:
                    warm.append(latencies[-1])
            ran.add(self.client.name)
            return realistic_result()

    clients, threads = [], []
    for i in range(first, first + count):
        name = f"bench{i:04d}"
        # Models come from the controller's artifact store into each agent's own cache, as on a real farm.
        client = RemoteController(address, name=name, token=None, devices=[AgentDevice(f"{name}/sim", "sim", "sim")],
                                  artifact_dir=Path(work) / name).start()
        agent = Agent(client, InstantDriver(client), name=name, slots=1)
        thread = threading.Thread(target=agent.run_job, args=(None,), daemon=True)
        thread.start()
        clients.append(client)
        threads.append(thread)
    for client in clients:
        client.connected.wait(30)
    cpu_ready = time.process_time()
    ready.set()
    stop.wait()
    cpu_s = time.process_time() - cpu_ready  # the agents' CPU while the job ran (and a moment after)
    for client in clients:
        client.drain()
    for client in clients:
        client.wait_for_acks(10)
        client.close()
    Path(out_path).write_text(json.dumps({"latencies": latencies, "warm": warm, "starts": starts, "cpu_s": cpu_s}))


def realistic_result():
    """What a 100-iteration sim run sends back: per-iteration times, 25 telemetry samples, limits."""
    from farm.proto.results import LatencyStats, Limits, RunResult, RunStatus, Telemetry, TelemetrySample

    iterations = [1.0 + 0.001 * (i % 17) for i in range(100)]
    samples = [TelemetrySample(t_s=0.04 * i, cpu_percent=97.5 + i % 3, memory_bytes=48_000_000 + 4096 * i)
               for i in range(25)]
    return RunResult(status=RunStatus.COMPLETED, backend="instant", limits=Limits(cpus=1.0, cpuset="0",
                     memory_mb=512.0), wall_s=1.2, iterations_ms=iterations,
                     latency=LatencyStats(12.0, 1.3, 1.01, 1.008, 1.008, 1.015, 1.016, 0.005, 1.0, 1.016, 100),
                     telemetry=Telemetry(interval_ms=40.0, cpu_avg_percent=98.0, cpu_peak_percent=99.5,
                                         memory_avg_bytes=48_050_000.0, memory_peak_bytes=48_100_000,
                                         samples=samples),
                     baseline_memory_bytes=30_000_000, peak_rss_bytes=48_100_000)


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) of each of this process's OS threads so far, by name: a Python thread's name
    (its native id matched), else the OS name (gRPC's C threads name themselves); pool threads summed by prefix.
    Read from /proc (Linux); empty elsewhere."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                stat = (task / "stat").read_text()
                comm, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
                name = names.get(int(task.name), f"os:{comm}")
                name = name.rstrip("0123456789").rstrip("_-") or name  # rpc_3, agent-msg_0, Thread-12 summed
                out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _thread_split(before: dict[str, float], after: dict[str, float], tasks: int) -> dict[str, float]:
    """CPU-ms per task of each thread (by name) between two thread_cpu_s() readings, largest first."""
    per = {k: (after[k] - before.get(k, 0.0)) * 1000 / tasks for k in after}
    return {k: round(v, 3) for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v > 0}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _fresh_database(server_url: str, name: str) -> str:
    """A new, empty database on the PostgreSQL server of `server_url`: each round starts from nothing."""
    import psycopg

    base, _, _ = server_url.rpartition("/")
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
    return f"{base}/{name}"


@contextlib.contextmanager
def _postgres_server() -> Iterator[str]:
    """A private PostgreSQL (tests/postgres_server.py: Debian's postgresql on a temp folder, fsync off)."""
    sys.path.insert(0, str(ROOT.parent / "tests"))
    from postgres_server import postgres_server  # type: ignore[import-not-found]
    with postgres_server() as peer:
        yield peer.url


def run(agents: int, tasks: int, processes: int = 1, db: str | None = None, connect_timeout_s: float = 120.0,
        soak_s: float = 0.0) -> dict:
    """One round; `db` a PostgreSQL URL to use (an empty database), else a fresh SQLite file. With `soak_s`,
    the job is submitted again each time it ends until that many seconds have passed (the controller's
    memory and threads noted after each)."""
    import psutil

    from farm.controller.grpc_server import serve
    from farm.controller.store import open_store
    from farm.model_generators.generate import write_tiny_onnx
    from farm.proto.generated import farm_pb2, farm_pb2_grpc

    import grpc

    # the ceiling the controller's CPU per task is judged against, in this same run (issue 35): gRPC and protobuf
    # alone, farm's messages echoed by a grpc.aio server with nothing behind it (grpc_echo.py)
    echo = None if soak_s else echo_cpu_ms(agents, min(tasks, 2000))
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        write_tiny_onnx(tmp_path / "tiny.onnx")
        store = open_store(db or tmp_path / "bench.db")
        server = serve(store, "127.0.0.1:0", tokens=None, lease_ttl_s=60, models_roots=[tmp_path])  # the job names tiny.onnx here
        address = f"127.0.0.1:{server.port}"
        ctx = multiprocessing.get_context("spawn")
        # The agents are split over `processes` child processes (one Python process caps them at one core).
        stop = ctx.Event()
        readies = [ctx.Event() for _ in range(processes)]
        outs = [tmp_path / f"agents-{k}.json" for k in range(processes)]
        counts = [agents // processes + (k < agents % processes) for k in range(processes)]
        children = [ctx.Process(target=_agents, args=(address, sum(counts[:k]), counts[k], str(outs[k]), readies[k], stop,
                                                      str(tmp_path / "agents"))) for k in range(processes)]
        me = psutil.Process()
        rss_before, threads_before, dialled = me.memory_info().rss, me.num_threads(), time.perf_counter()
        for child in children:
            child.start()
        try:
            if not all(ready.wait(connect_timeout_s) for ready in readies):
                raise RuntimeError(f"the agents did not connect within {connect_timeout_s:.0f} s")
            # What the connected agents cost the controller while idle: its memory and OS threads (gRPC's own too).
            connected = {"seconds": round(time.perf_counter() - dialled, 2),
                         "controller_kib_per_agent": round((me.memory_info().rss - rss_before) / 1024 / agents, 1),
                         "controller_threads": me.num_threads(), "controller_threads_before": threads_before}
            cells = -(-tasks // 1000)  # the job file allows at most 1000 repeats; more tasks come from more cells
            if tasks % cells:
                raise ValueError(f"--tasks {tasks}: use a multiple of {cells}")
            job = f"name: bench\nmodels: [tiny.onnx]\nmatrix: {{threads: {list(range(1, cells + 1))}}}\nrepeats: {tasks // cells}\n"
            channel = grpc.insecure_channel(address)
            stub = farm_pb2_grpc.FarmServiceStub(channel)
            started, cpu_started = time.perf_counter(), time.process_time()
            threads_started = thread_cpu_s()
            times_started = os.times()
            jobs: list[dict] = []  # with soak_s, the same job again and again until that long has passed
            while True:
                job_id = stub.SubmitJob(farm_pb2.SubmitJobRequest(job_yaml=job, base_dir=str(tmp_path))).job_id
                if not jobs:  # every task is pending once SubmitJob returns
                    submitted, pending_since = time.perf_counter(), time.time()
                while store.jobs.has_open_tasks(job_id):  # the counts the store keeps per job, on either store
                    time.sleep(0.005)
                if (done := store.jobs.task_counts(job_id).get("completed", 0)) != tasks:
                    raise RuntimeError(f"{tasks - done} of {tasks} tasks did not complete (a benchmark of failures "
                                       f"measures nothing): {store.jobs.task_counts(job_id)}")
                jobs.append({"at_s": round(time.perf_counter() - started, 1), "rss_mib": round(me.memory_info().rss / 2**20, 1),
                             "threads": me.num_threads()})
                if time.perf_counter() - started >= soak_s:
                    break
            finished, controller_cpu_s = time.perf_counter(), time.process_time() - cpu_started
            threads_cpu = thread_cpu_s()
            times_done = os.times()
            # a task run more than once lost its lease on the way (a heartbeat late or not renewed)
            retried = int(store.query("SELECT COUNT(*) AS n FROM tasks WHERE attempts > 1")[0]["n"])
            channel.close()
        finally:
            stop.set()
            for child in children:
                child.join(60)
                if child.is_alive():
                    child.kill()
            timings = {k: {"seconds": round(v[0], 3), "calls": int(v[1])} for k, v in server.farm.timings.items()}
            server.stop()
            store.close()  # before the private server stops: its listener would report a lost connection
        agents_out = [json.loads(out.read_text()) for out in outs if out.exists()]
        latencies = [x for part in agents_out for x in part["latencies"]]
        warm = [x for part in agents_out for x in part.get("warm", [])]
        waits = [x - pending_since for part in agents_out for x in part["starts"]]
        agents_cpu_s = sum(part["cpu_s"] for part in agents_out) if len(agents_out) == processes else None
    wall = finished - started
    tasks *= len(jobs)
    return {
        "agents": agents, "tasks": tasks, "cores": os.cpu_count(), "jobs": jobs, "retried_tasks": retried,
        "farm_from": str(Path(sys.modules[serve.__module__].__file__).parent),  # which tree ran (baseline or this one)
        "submit_s": round(submitted - started, 3), "wall_s": round(wall, 3),
        "tasks_per_s": round(tasks / wall, 1),
        "tasks_per_s_after_submit": round(tasks / (finished - submitted), 1),
        "dispatch_ms": {"p50": round(_percentile(latencies, 0.5) * 1000, 2), "p99": round(_percentile(latencies, 0.99) * 1000, 2),
                        "mean": round(statistics.fmean(latencies) * 1000, 2), "n": len(latencies)} if latencies else None,
        "dispatch_warm_ms": {"p50": round(_percentile(warm, 0.5) * 1000, 2), "p99": round(_percentile(warm, 0.99) * 1000, 2),
                             "n": len(warm)} if warm else None,
        # pending -> driver start: the wait for a lease counted too (all tasks are queued at once, so this
        # grows with tasks per agent; it is the figure a user waiting for a run sees)
        "pending_to_start_ms": {"p50": round(_percentile(waits, 0.5) * 1000, 1),
                                "p99": round(_percentile(waits, 0.99) * 1000, 1)} if waits else None,
        "controller_time": timings,
        # CPU seconds while the job ran: the controller process (every thread) and the agents' process
        "cpu_s": {"controller": round(controller_cpu_s, 2),
                  "agents": None if agents_cpu_s is None else round(agents_cpu_s, 2)},
        "agent_processes": processes,
        "connected": connected,
        "controller_cpu_ms_per_task": round(controller_cpu_s * 1000 / tasks, 3),
        # the same by OS thread (clock ticks of 10 ms: read it over a whole job, not per call)
        "controller_cpu_ms_per_task_by_thread": _thread_split(threads_started, threads_cpu, tasks),
        # of the process's CPU per task, the kernel's share (system time: wake-ups, locks, sockets)
        "controller_system_ms_per_task": round((times_done.system - times_started.system) * 1000 / tasks, 3),
        "echo": echo,
        "load_1min": round(os.getloadavg()[0], 1),  # the machine is shared: what else ran meanwhile
    }


def report(r: dict, rounds: list[dict]) -> str:
    d, w = r["dispatch_ms"] or {}, r.get("dispatch_warm_ms") or {}
    t = r["controller_time"]
    store_s = sum(v["seconds"] for v in t.values())
    lines = [
        f"# Scheduling benchmark, {dt.date.today()} ({r['agents']} agents, {r['tasks']} tasks, {r['cores']} cores)",
        "",
        f"The median of {len(rounds)} rounds by throughput (all rounds: "
        f"{', '.join(str(x['tasks_per_s']) for x in rounds)} tasks/s; p99 "
        f"{', '.join(str((x['dispatch_ms'] or {}).get('p99')) for x in rounds)} ms).",
        "",
        "| measure | value | aim |",
        "|---|---|---|",
        f"| tasks/s, submit to last result stored | {r['tasks_per_s']} | ≥ 1000 |",
        f"| tasks/s after SubmitJob returned | {r['tasks_per_s_after_submit']} | |",
        f"| SubmitJob (validate + expand + insert) | {r['submit_s']} s | |",
        f"| dispatch p50, offer → driver start | {d.get('p50')} ms | |",
        f"| dispatch p99 | {d.get('p99')} ms | < 50 ms |",
        f"| dispatch p50 / p99, the model already in the agent's cache | {w.get('p50')} / {w.get('p99')} ms | |",
        f"| pending → driver start p50 / p99 (all tasks queued at submit) | "
        f"{(r['pending_to_start_ms'] or {}).get('p50')} / {(r['pending_to_start_ms'] or {}).get('p99')} ms | |",
        f"| CPU while the job ran: controller / agents process | {r['cpu_s']['controller']} / {r['cpu_s']['agents']} s | |",
        f"| controller CPU per task | {r['controller_cpu_ms_per_task']} ms | ≤ 0.5 ms (SQLite) |",
        f"| a grpc.aio echo of the same messages, CPU per round trip (same run) | "
        f"{(r.get('echo') or {}).get('cpu_ms_per_trip')} ms | |",
        "",
        "Controller time per step (in its gRPC handler threads and the dispatcher):",
        "",
        "| step | seconds | calls | ms/call |",
        "|---|---|---|---|",
    ]
    for step, v in t.items():
        per = v["seconds"] / v["calls"] * 1000 if v["calls"] else 0
        lines.append(f"| {step} | {v['seconds']} | {v['calls']} | {per:.2f} |")
    lines += [
        "",
        f"Where the time goes: {store_s:.2f} s of the {r['wall_s']} s wall are the controller's store steps: "
        "the dispatcher's lease transactions (up to 16 slots each) and expiry checks, and the result writer's "
        "transactions (every result queued meanwhile, one commit; \"complete\" counts results). The two threads "
        "share the one SQLite writer. The rest is Python gRPC framing on both ends: the agents share one Python "
        "process here, and with the controller that is two GIL-bound processes on two cores (see the CPU row).",
    ]
    return "\n".join(lines) + "\n"


# Top-level source folders and where pyproject's package-dir puts them under farm (read from it, so a new
# role folder is in the baseline too).
PACKAGE_DIRS = {name.removeprefix("farm."): folder for name, folder in tomllib.loads(
    (ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].items() if name != "farm"}


def baseline_tree(rev: str, into: Path) -> Path:
    """farm as it was at git revision `rev`, laid out as a plain package; PYTHONPATH=<returned folder>
    puts it ahead of the editable install (whose finder comes after the path's)."""
    archive, src = into / "archive", into / "src"
    archive.mkdir(parents=True)
    present = set(subprocess.run(["git", "-C", str(ROOT.parent), "ls-tree", "--name-only", rev], check=True,
                                 capture_output=True, text=True).stdout.split())
    folders = {package: folder for package, folder in PACKAGE_DIRS.items() if folder in present}  # as of that rev
    data = subprocess.run(["git", "-C", str(ROOT.parent), "archive", rev, "farm", *folders.values()],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(archive, filter="data")
    shutil.copytree(archive / "farm", src / "farm")
    for package, folder in folders.items():
        (src / "farm" / package).symlink_to(archive / folder, target_is_directory=True)
    return src


def one_round(agents: int, tasks: int, processes: int, pythonpath: Path | None) -> dict:
    """One run in a fresh process: with `pythonpath`, of the farm found there (the baseline)."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    done = subprocess.run([sys.executable, __file__, "--agents", str(agents), "--tasks", str(tasks),
                           "--agent-processes", str(processes), "--one-round-json"],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _thread_pick(name: str):
    """A round's CPU-ms per task in the controller's thread(s) `name` (None for a round run without the split)."""
    return lambda r: (r.get("controller_cpu_ms_per_task_by_thread") or {}).get(name)


def compare(agents: int, tasks: int, processes: int, rounds: int, rev: str) -> tuple[str, dict]:
    """Rounds of the baseline and of this tree, interleaved (so both see the same machine), as ratios."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = baseline_tree(rev, Path(tmp))
        runs: dict[str, list[dict]] = {"baseline": [], "current": []}
        for _ in range(rounds):
            runs["baseline"].append(one_round(agents, tasks, processes, tree))
            runs["current"].append(one_round(agents, tasks, processes, None))
    commit = subprocess.run(["git", "-C", str(ROOT.parent), "rev-parse", "--short", rev], capture_output=True,
                            text=True).stdout.strip()

    def med(name: str, pick) -> float:
        values = [pick(r) for r in runs[name] if pick(r) is not None]
        return statistics.median(values) if values else float("nan")

    rows = [("tasks/s, submit to last result stored", lambda r: r["tasks_per_s"]),
            ("dispatch p50 (ms)", lambda r: (r["dispatch_ms"] or {}).get("p50")),
            ("dispatch p99 (ms)", lambda r: (r["dispatch_ms"] or {}).get("p99")),
            ("dispatch p99, model cached (ms)", lambda r: (r.get("dispatch_warm_ms") or {}).get("p99")),
            ("controller CPU while the job ran (s)", lambda r: r["cpu_s"]["controller"]),
            ("agents' CPU while the job ran (s)", lambda r: r["cpu_s"]["agents"]),
            ("controller CPU per task (ms)", lambda r: r["cpu_s"]["controller"] / r["tasks"] * 1000),
            ("grpc.aio echo CPU per round trip (ms, same run)", lambda r: (r.get("echo") or {}).get("cpu_ms_per_trip")),
            ("controller CPU per task ÷ echo per round trip", lambda r: r["cpu_s"]["controller"] / r["tasks"] * 1000
             / r["echo"]["cpu_ms_per_trip"] if r.get("echo") else None),
            *((f"… of which thread {name} (ms per task)", _thread_pick(name))
              for name in ("result-writer", "grpc-loop", "dispatcher", "agent-msg", "rpc", "MainThread")),
            ("load average at the round's end (1 min)", lambda r: r.get("load_1min")),
            ("result application, ms per result", lambda r: r["controller_time"]["complete"]["seconds"]
             / max(1, r["controller_time"]["complete"]["calls"]) * 1000),
            ("lease, ms per transaction", lambda r: r["controller_time"]["lease"]["seconds"]
             / max(1, r["controller_time"]["lease"]["calls"]) * 1000)]
    lines = [f"# Scheduling before/after, {dt.date.today()} ({agents} agents in {processes} process(es), {tasks} tasks, "
             f"{os.cpu_count()} cores)", "",
             f"Baseline: farm at {rev} ({commit}); current: this tree. {rounds} rounds each, interleaved; medians.", "",
             "| measure | baseline | current | current / baseline |", "|---|---|---|---|"]
    for label, pick in rows:
        before, after = med("baseline", pick), med("current", pick)
        lines.append(f"| {label} | {before:.3g} | {after:.3g} | {after / before:.2f} |")
    lines += ["", "All rounds, tasks/s: baseline " + ", ".join(str(r["tasks_per_s"]) for r in runs["baseline"])
              + "; current " + ", ".join(str(r["tasks_per_s"]) for r in runs["current"]) + "."]
    return "\n".join(lines) + "\n", {"baseline_rev": rev, "baseline_commit": commit, **runs}


def both_stores(agents: int, tasks: int, processes: int, rounds: int) -> tuple[str, dict]:
    """The same rounds on SQLite and on PostgreSQL, interleaved (this machine is shared and noisy)."""
    runs: dict[str, list[dict]] = {"sqlite": [], "postgresql": []}
    with _postgres_server() as server_url:
        for k in range(rounds):
            runs["sqlite"].append(run(agents, tasks, processes))
            runs["postgresql"].append(run(agents, tasks, processes, _fresh_database(server_url, f"bench{k}")))

    def med(name: str, pick) -> float:
        return statistics.median(pick(r) for r in runs[name])

    rows = [("tasks/s, submit to last result stored", lambda r: r["tasks_per_s"]),
            ("dispatch p50 (ms, offer → driver start)", lambda r: r["dispatch_ms"]["p50"]),
            ("dispatch p99 (ms)", lambda r: r["dispatch_ms"]["p99"]),
            ("pending → driver start p99 (ms)", lambda r: r["pending_to_start_ms"]["p99"]),
            ("controller CPU per task (ms)", lambda r: r["cpu_s"]["controller"] / r["tasks"] * 1000),
            ("grpc.aio echo CPU per round trip (ms, same run)", lambda r: r["echo"]["cpu_ms_per_trip"]),
            ("controller CPU per task ÷ echo", lambda r: r["cpu_s"]["controller"] / r["tasks"] * 1000
             / r["echo"]["cpu_ms_per_trip"])]
    lines = [f"## Scheduling on both stores ({dt.date.today()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})",
             "", f"{agents} agents with an instant driver in {processes} process(es), {tasks} tasks with realistic "
             f"results; {rounds} rounds each, interleaved; medians. PostgreSQL: a private server on this machine "
             "(fsync off), a fresh database a round.", "",
             "| measure | SQLite | PostgreSQL | PostgreSQL / SQLite |", "|---|---|---|---|"]
    for label, pick in rows:
        a, b = med("sqlite", pick), med("postgresql", pick)
        lines.append(f"| {label} | {a:.3g} | {b:.3g} | {b / a:.2f} |")
    return "\n".join(lines) + "\n", runs


def _per_task_ms(r: dict, side: str) -> str:
    """CPU milliseconds per task on one side (the controller process counts its every thread, the poller too)."""
    cpu = r["cpu_s"][side]
    return "?" if cpu is None else f"{cpu * 1000 / r['tasks']:.2f}"


def sweep(counts: list[int], tasks_per_agent: int, processes: int, postgresql: bool) -> tuple[str, dict]:
    """One round per lab size (and store): how throughput, dispatch and the controller's cost per agent move as
    the lab grows. Every agent gets `tasks_per_agent` tasks, so a bigger lab is not judged on a thinner job."""
    stores = ["sqlite", "postgresql"] if postgresql else ["sqlite"]
    runs: dict[str, list[dict]] = {name: [] for name in stores}
    with (_postgres_server() if postgresql else contextlib.nullcontext("")) as server_url:
        for count in counts:
            tasks = count * tasks_per_agent
            tasks -= tasks % -(-tasks // 1000)  # a multiple of the job's cells (at most 1,000 repeats a cell)
            for name in stores:
                db = _fresh_database(server_url, f"sweep{count}") if name == "postgresql" else None
                try:
                    runs[name].append(run(count, tasks, processes, db, connect_timeout_s=300))
                except RuntimeError as e:  # a size the machine cannot hold is a finding, not a crash
                    runs[name].append({"agents": count, "tasks": tasks, "failed": str(e)})
                print(f"{name}, {count} agents: {runs[name][-1].get('tasks_per_s', runs[name][-1].get('failed'))}",
                      file=sys.stderr, flush=True)
    lines = [f"## Scheduling as the lab grows ({dt.date.today()}, {os.cpu_count()} cores, load "
             f"{os.getloadavg()[0]:.1f})", "",
             f"Agents with an instant driver in {processes} process(es), {tasks_per_agent} tasks per agent with "
             "realistic results, one round per size and store. Memory and threads: the controller process once "
             "every agent is connected and idle, against before the first dialled.", "",
             "| agents | store | tasks | tasks/s | dispatch p50 / p99 ms (p99, model cached) | pending → start p99 s | all connected in s "
             "| controller KiB per agent | controller threads | CPU ms per task: controller / agents |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in stores:
        for r in runs[name]:
            if "failed" in r:
                lines.append(f"| {r['agents']} | {name} | {r['tasks']} | failed: {r['failed']} | | | | | | |")
                continue
            d, c = r["dispatch_ms"], r["connected"]
            cached = (r.get("dispatch_warm_ms") or {}).get("p99")
            lines.append(f"| {r['agents']} | {name} | {r['tasks']} | {r['tasks_per_s']} | {d['p50']} / {d['p99']} "
                         f"({cached}) | "
                         f"{r['pending_to_start_ms']['p99'] / 1000:.2f} | {c['seconds']} | "
                         f"{c['controller_kib_per_agent']} | {c['controller_threads_before']} → "
                         f"{c['controller_threads']} | {_per_task_ms(r, 'controller')} / {_per_task_ms(r, 'agents')} |")
    return "\n".join(lines) + "\n", runs


def soak_report(r: dict, minutes: float) -> str:
    """The soak as one table row: did the lab hold, and did the controller's memory or threads grow."""
    jobs, d = r["jobs"], r["dispatch_ms"] or {}
    rss = [j["rss_mib"] for j in jobs]
    threads = [j["threads"] for j in jobs]
    return "\n".join([
        f"## Scheduling soak ({dt.date.today()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})", "",
        f"{r['agents']} agents with an instant driver in {r['agent_processes']} process(es); the job of "
        f"{r['tasks'] // len(jobs)} tasks submitted again each time it ended, for {minutes:g} minutes. Memory and "
        "threads: the controller process after each job.", "",
        "| jobs | tasks | tasks/s | dispatch p50 / p99 ms | tasks retried (a lease lost) | controller RSS MiB, first "
        "job → last (max) | controller threads | CPU ms per task: controller / agents |",
        "|---|---|---|---|---|---|---|---|",
        f"| {len(jobs)} | {r['tasks']} | {r['tasks_per_s']} | {d.get('p50')} / {d.get('p99')} | {r['retried_tasks']} | "
        f"{rss[0]} → {rss[-1]} ({max(rss)}) | {min(threads)}–{max(threads)} | "
        f"{_per_task_ms(r, 'controller')} / {_per_task_ms(r, 'agents')} |", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=100)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3, help="runs; the median by throughput is reported")
    parser.add_argument("--agent-processes", type=int, default=1, help="child processes the agents are split over")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--baseline", metavar="REV", help="also run farm as of git revision REV (rounds interleaved) "
                                                          "and report current / baseline")
    parser.add_argument("--postgresql", action="store_true",
                        help="also run every round on PostgreSQL (a private server from tests/postgres_server.py) "
                             "and report both stores side by side")
    parser.add_argument("--sweep", metavar="N,N,…", help="lab sizes to run one round each (e.g. 10,100,500,1000), "
                                                       "with --tasks-per-agent tasks each; with --postgresql on both "
                                                       "stores")
    parser.add_argument("--tasks-per-agent", type=int, default=10, help="with --sweep")
    parser.add_argument("--soak", type=float, metavar="MINUTES",
                        help="--agents agents and the --tasks job submitted again as it ends, for MINUTES")
    parser.add_argument("--one-round-json", action="store_true", help=argparse.SUPPRESS)  # compare()'s child
    args = parser.parse_args()
    if args.sweep:
        try:
            counts = [int(x) for x in args.sweep.split(",") if x.strip()]
        except ValueError:
            counts = []
        if not counts or min(counts) < 1 or args.tasks_per_agent < 1:
            parser.error("--sweep takes positive agent counts, e.g. 10,100,500,1000")
        if max(counts) * args.tasks_per_agent > 10_000:  # a job holds at most 10,000 tasks (the controller's default)
            parser.error(f"{max(counts)} agents x {args.tasks_per_agent} tasks is over one job's 10,000: lower "
                         "--tasks-per-agent")
        text, data = sweep(counts, args.tasks_per_agent, args.agent_processes, args.postgresql)
        print(text)
        if not args.no_write:
            write_results("scheduling-sweep", text, data)
        return
    if args.soak:
        if args.soak <= 0 or args.tasks > 10_000:
            parser.error("--soak takes a positive number of minutes, with --tasks at most 10,000 (one job)")
        data = run(args.agents, args.tasks, args.agent_processes, connect_timeout_s=300, soak_s=args.soak * 60)
        text = soak_report(data, args.soak)
        print(text)
        if not args.no_write:
            write_results("scheduling-soak", text, data)
        return
    if args.postgresql:
        text, data = both_stores(args.agents, args.tasks, args.agent_processes, args.rounds)
        print(text)
        if not args.no_write:
            write_results("scheduling-stores", text, data)
        return
    if args.one_round_json:
        print(json.dumps(run(args.agents, args.tasks, args.agent_processes)))
        return
    if args.baseline:
        text, data = compare(args.agents, args.tasks, args.agent_processes, args.rounds, args.baseline)
        print(text)
        if not args.no_write:
            write_results("scheduling-compare", text, data)
        return
    rounds = [run(args.agents, args.tasks, args.agent_processes) for _ in range(args.rounds)]
    result = sorted(rounds, key=lambda x: x["tasks_per_s"])[len(rounds) // 2]
    result["rounds"] = [{"tasks_per_s": x["tasks_per_s"], "dispatch_ms": x["dispatch_ms"]} for x in rounds]
    text = report(result, rounds)
    print(text)
    if not args.no_write:
        write_results("scheduling", text, result)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
