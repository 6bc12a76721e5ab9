"""The failover gap of a lab on many hosts (issue 32): the last result through controller A to the first through B,
over repeated `kill -9` of the controller the agents are on.

    python benchmarks/failover_gap.py [--kills 10] [--agents 3] [--tasks 400] [--url postgresql://...]

Starts two real controllers (`farm controller serve`) on one PostgreSQL database, each with its own data folder
(two hosts), on fixed loopback ports, and --agents agents (`farm agent --controller A,B`: the same list). Submits
one script job of --tasks short runs (0.2 s each) through A and B (`farm submit --detach --controller A,B`), then
--kills times: waits for results to flow, finds the controller the agents are on (agent_presence), kills it with
SIGKILL, and waits for the next result; the killed controller is started again on its port (data folder and all)
before the next round, so the lab has two controllers again.

A result counts when its row is first seen in `runs` (the database is polled every 10 ms, so each figure is within
about 10 ms): the gap is from the last result the killed controller committed (seen before the kill, or at the kill
when the poll right after its death finds more) to the first one committed after that (through the other
controller), and "kill to first" from the kill itself. After the last kill the job runs to its end and the store is checked: every
task completed, no task with two completed runs (duplicated), none failed (lost).
Without --url a private PostgreSQL is started (tests/postgres_server.py; fsync off).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lab_artifacts import _postgres  # the private PostgreSQL server (or --url), as the artifact benchmark starts it

FARM = [sys.executable, "-m", "farm.cli.main"]
POLL_S = 0.01


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(root: Path, name: str) -> dict[str, str]:
    return {**os.environ, "XDG_DATA_HOME": str(root / f"{name}-data"), "FARM_CONTROLLER": "", "FARM_TOKEN": "",
            "FARM_CONFIG": str(root / "none.toml")}


def _controller(root: Path, name: str, db: str, port: int) -> subprocess.Popen[bytes]:
    log = root / f"{name}.log"
    with log.open("ab") as handle:
        proc = subprocess.Popen([*FARM, "controller", "serve", "--listen", f"127.0.0.1:{port}", "--db", db,
                                 "--no-auth"], stdout=handle, stderr=subprocess.STDOUT, env=_env(root, name), cwd=root)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return proc
        if proc.poll() is not None:
            raise SystemExit(f"controller {name} exited: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    raise SystemExit(f"controller {name} did not start: {log.read_text()[-2000:]}")


def _job(root: Path, tasks: int) -> Path:
    from farm.model_generators.generate import write_tiny_onnx

    write_tiny_onnx(root / "tiny.onnx")
    (root / "script").mkdir()
    (root / "script" / "run.py").write_text("import json, time\ntime.sleep(0.2)\nprint(json.dumps({'latency_ms': 1.0}))\n")
    job = root / "job.yaml"
    job.write_text("name: failover-gap\nmodels: [tiny.onnx]\n"
                   "workload: {type: script, command: python, script: run.py, dir: script}\n"
                   f"repeats: {tasks}\nsim: {{memory: 512m, backend: process, on_contention: flag}}\n")
    return job


class Results:
    """Runs as they appear in the store, with the time each was first seen."""

    def __init__(self, url: str) -> None:
        import psycopg

        self.conn = psycopg.connect(url, autocommit=True)
        self.last_id = 0
        self.seen: list[tuple[int, float]] = []  # (run id, first seen)

    def poll(self) -> int:
        rows = self.conn.execute("SELECT id FROM runs WHERE id > %s AND status = 'completed' ORDER BY id",
                                 [self.last_id]).fetchall()
        now = time.time()
        for (run_id,) in rows:
            self.seen.append((run_id, now))
            self.last_id = run_id
        return len(rows)

    def wait_new(self, n: int, timeout: float) -> None:
        start, got = len(self.seen), time.monotonic() + timeout
        while len(self.seen) - start < n:
            if time.monotonic() > got:
                raise SystemExit(f"no {n} new result(s) in {timeout:g} s")
            self.poll()
            time.sleep(POLL_S)

    def agents_on(self) -> dict[str, int]:
        rows = self.conn.execute("SELECT controller, COUNT(*) FROM agent_presence WHERE last_seen > %s "
                                 "GROUP BY controller", [time.time() - 30]).fetchall()
        return {str(r[0]): int(r[1]) for r in rows}


def _kill_round(results: Results, controllers: dict[str, subprocess.Popen[bytes]], ports: dict[str, int],
                root: Path, url: str) -> tuple[float, float, str]:
    results.wait_new(5, 120)  # results flow through the controller the agents are on
    on = results.agents_on()
    victim = max(ports, key=lambda name: on.get(f"127.0.0.1:{ports[name]}", 0)) if on else "a"
    results.poll()
    last_through_victim = results.seen[-1][1]
    controllers[victim].send_signal(signal.SIGKILL)
    killed = time.time()
    controllers[victim].wait(10)
    if results.poll():  # committed by the victim between the last poll and its death: its last results
        last_through_victim = killed
    before = len(results.seen)
    results.wait_new(1, 300)
    first = results.seen[before][1]
    controllers[victim] = _controller(root, victim, url, ports[victim])  # the lab has two controllers again
    return first - last_through_victim, first - killed, victim


def _check(url: str) -> dict[str, int]:
    import psycopg

    with psycopg.connect(url) as conn:
        tasks = dict(conn.execute("SELECT status, COUNT(*) FROM tasks GROUP BY status").fetchall())
        duplicated = conn.execute("SELECT COUNT(*) FROM (SELECT task_id FROM runs WHERE status = 'completed' "
                                  "GROUP BY task_id HAVING COUNT(*) > 1) d").fetchone()[0]
        retried = conn.execute("SELECT COUNT(*) FROM tasks WHERE attempts > 1").fetchone()[0]
        lost_runs = conn.execute("SELECT COUNT(*) FROM runs WHERE status != 'completed'").fetchone()[0]
        for row in conn.execute("SELECT task_id, attempt, agent, failure_class, message FROM runs "
                                "WHERE status != 'completed' ORDER BY id").fetchall():
            print(f"not completed: task {row[0]} attempt {row[1]} on {row[2]}: {row[3]}: {str(row[4])[:300]}")
    return {**{f"tasks {k}": int(v) for k, v in tasks.items()}, "tasks with 2+ completed runs": int(duplicated),
            "tasks run more than once": int(retried), "attempts stored as failed (lost, retried)": int(lost_runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=400)
    parser.add_argument("--url", help="an empty PostgreSQL database (default: a private server)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="farm-failover-") as tmp, _postgres(args.url) as url:
        root = Path(tmp)
        ports = {"a": _free_port(), "b": _free_port()}
        controllers = {name: _controller(root, name, url, port) for name, port in ports.items()}
        addresses = ",".join(f"127.0.0.1:{p}" for p in ports.values())
        agents = []
        for i in range(args.agents):
            with (root / f"agent-{i}.log").open("ab") as handle:
                agents.append(subprocess.Popen([*FARM, "agent", "--controller", addresses, "--name", f"rack-{i}",
                                                "--work-dir", str(root / f"work-{i}")], stdout=handle,
                                               stderr=subprocess.STDOUT, env=_env(root, f"agent-{i}"), cwd=root))
        try:
            job = _job(root, args.tasks)
            submitted = subprocess.run([*FARM, "submit", str(job), "--detach", "--controller", addresses],
                                       capture_output=True, text=True, env=_env(root, "client"), cwd=root, timeout=300)
            if submitted.returncode:
                raise SystemExit(f"submit failed: {submitted.stderr[-2000:]}")
            results = Results(url)
            gaps, firsts = [], []
            for kill in range(1, args.kills + 1):
                gap, first, victim = _kill_round(results, controllers, ports, root, url)
                gaps.append(gap)
                firsts.append(first)
                print(f"kill {kill:2d} of controller {victim}: gap {gap * 1000:7.0f} ms, kill to first result "
                      f"{first * 1000:7.0f} ms", flush=True)
            watched = subprocess.run([*FARM, "watch", "1", "--quiet", "--controller", addresses], capture_output=True,
                                     text=True, env=_env(root, "client"), cwd=root, timeout=1800)
            print(f"farm watch 1: exit {watched.returncode}")
            print("store:", _check(url))
            q = statistics.quantiles(gaps, n=10, method="inclusive") if len(gaps) >= 2 else gaps
            print(f"gap over {len(gaps)} kills: median {statistics.median(gaps) * 1000:.0f} ms, p90 {q[-1] * 1000:.0f} ms, "
                  f"max {max(gaps) * 1000:.0f} ms, min {min(gaps) * 1000:.0f} ms; kill to first result median "
                  f"{statistics.median(firsts) * 1000:.0f} ms, max {max(firsts) * 1000:.0f} ms")
        finally:
            for proc in [*agents, *controllers.values()]:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
            for proc in [*agents, *controllers.values()]:
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    main()
