"""Controllers and agents on 127.0.0.1 for the gRPC tests: in this process (farm.client.compose) by default,
real `farm controller serve` and `farm agent` processes where the process is the point (kill -9, signals, exit
codes, what the command prints).

`Cluster.farm` runs the `farm` CLI as a process, or, for a Cluster made with cli_in_process=True, as
`farm.cli.main.main(argv)` in this process (tests/cli_inprocess.py) unless pytest runs with --farm-subprocess.

Every process gets PR_SET_PDEATHSIG, so it dies with the test run even if pytest is killed,
and is stopped at the end of its test; tests talk to them through the real CLI or raw stubs.
An in-process controller (Cluster.serve_in_process) runs on threads of pytest's process and may be shared by a
module's tests; a test passes it a clock to move instead of sleeping through a lease TTL.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import sqlite3
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import conftest
from conftest import FARM
from farm.client.compose import (
    AgentRunner, AgentSettings, ControllerServer, ControllerSettings, build_agent, build_controller,
)

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# Every wait here guards against a hang; none checks a speed. Beside two CPU hogs and a second test worker a process
# start or a job's progress took over 30 s (controller starts timed out at load 16), so no wait gives up sooner.
HANG_GUARD_MIN_S = 90


def wait_for(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.1) -> object:
    timeout = max(timeout, HANG_GUARD_MIN_S)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


class OffsetClock:
    """Real time plus an offset a test moves forward: leases, heartbeats and deadlines judged by a controller
    given this clock run out at once when the test jumps past their TTL, and keep flowing otherwise."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


class ServerLog(logging.Handler):
    """What in-process controllers log, as `farm controller serve` prints it (the `farm` loggers at INFO)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        self._logger = logging.getLogger("farm")
        self._level = self._logger.level
        self._logger.setLevel(logging.INFO)
        self._logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def text(self) -> str:
        return "\n".join(self.lines)

    def detach(self) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)


@dataclass
class FarmProcess:
    name: str
    process: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill9(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self, timeout: float = 15) -> int:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode


@dataclass
class Cluster:
    """A controller and its agents for one test; address is 127.0.0.1:PORT."""

    root: Path
    env: dict[str, str]
    processes: list[FarmProcess] = field(default_factory=list)
    address: str | None = None
    servers: list[ControllerServer] = field(default_factory=list)  # controllers on threads of this process
    runners: list[AgentRunner] = field(default_factory=list)  # agents on threads of this process
    log: ServerLog | None = None  # what the in-process controllers logged (serve_in_process)
    cli_in_process: bool = False  # farm(): main(argv) in this process, unless pytest --farm-subprocess

    def spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> FarmProcess:
        log = self.root / f"{name}.log"
        handle = log.open("ab")
        p = subprocess.Popen([*FARM, *args], stdout=handle, stderr=subprocess.STDOUT, cwd=self.root,
                             env={**os.environ, **self.env, **(env or {})}, preexec_fn=_die_with_parent)
        handle.close()
        proc = FarmProcess(name, p, log)
        self.processes.append(proc)
        return proc

    def start_controller(self, *extra: str, port: int = 0, db: Path | None = None, name: str = "controller",
                         env: dict[str, str] | None = None) -> FarmProcess:
        db = db or self.root / "controller.db"
        proc = self.spawn(name, "controller", "serve", "--listen", f"127.0.0.1:{port}", "--db", str(db), *extra, env=env)

        def listening() -> str | None:
            if not proc.alive():
                raise AssertionError(f"the controller exited: {proc.output()}")
            match = re.search(r"listening on (127\.0\.0\.1:\d+)", proc.output())
            return match.group(1) if match else None

        self.address = str(wait_for(listening, 120, "the controller to listen"))  # one that exits is told at once
        return proc

    def serve_in_process(self, *, clock: Callable[[], float] = time.time, **settings: Any) -> ControllerServer:
        """A controller on threads of this process (no `--db`: ROOT/controller.db); `settings` are
        ControllerSettings fields (no_auth=True unless tokens is given)."""
        settings.setdefault("db", self.root / "controller.db")
        settings.setdefault("no_auth", "tokens" not in settings)
        if self.log is None:
            self.log = ServerLog()
        server = build_controller(ControllerSettings(**settings), clock=clock).start()
        self.servers.append(server)
        self.address = server.address
        return server

    def agent_in_process(self, name: str, *, clock: Callable[[], float] = time.monotonic, **settings: Any) -> AgentRunner:
        """An agent on threads of this process, connected to self.address; `settings` are AgentSettings fields,
        `clock` says when its heartbeats are due."""
        settings.setdefault("work_dir", self.root / f"work-{name}")
        runner = build_agent(AgentSettings(controller=str(self.address), name=name, **settings), clock=clock).start()
        self.runners.append(runner)
        assert runner.client is not None
        wait_for(runner.client.connected.is_set, 120, f"agent {name} to connect")
        return runner

    def start_agent(self, name: str, *extra: str, token: str | None = None) -> FarmProcess:
        args = ["agent", "--controller", self.address, "--name", name, "--work-dir", str(self.root / f"work-{name}"),
                *extra]
        if token:
            args += ["--token", token]
        return self.spawn(f"agent-{name}", *args)

    def farm(self, *args: str, timeout: float = 120, env: dict[str, str] | None = None) -> Any:
        """`farm ARGS` in ROOT with the cluster's environment: a CompletedProcess, or a FarmRun (the same
        returncode, stdout and stderr) when the CLI runs in this process; `timeout` bounds a process only."""
        if self.cli_in_process and not conftest.SUBPROCESS_CLI:
            from cli_inprocess import run_farm_inprocess
            return run_farm_inprocess(*args, cwd=self.root, env={**self.env, **(env or {})})
        return subprocess.run([*FARM, *args], capture_output=True, text=True, timeout=timeout, cwd=self.root,
                              env={**os.environ, **self.env, **(env or {})})

    def db(self, path: Path | None = None) -> sqlite3.Connection:
        return sqlite3.connect(path or self.root / "controller.db", timeout=30)

    def stop_all(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        for runner in reversed(self.runners):
            runner.stop()
        self.runners.clear()
        for server in reversed(self.servers):
            server.stop()
        self.servers.clear()
        if self.log is not None:
            self.log.detach()
            self.log = None

    def server_output(self) -> str:
        """The in-process controllers' log so far (a process's output(), for a controller on threads)."""
        return self.log.text() if self.log else ""


def in_process_cluster(tmp_path: Path, monkeypatch: Any) -> Cluster:
    """A Cluster whose controller, agents and `farm` calls run on threads of this process, none of them reading the
    user's own settings (a test's fixture yields it and calls stop_all)."""
    env = {"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_DEVICES": "", "FARM_CONFIG": str(tmp_path / "none.toml"),
           "FARM_DB": str(tmp_path / "unused.db")}
    for key, value in env.items():  # what an agent or controller on a thread here reads from the environment
        monkeypatch.setenv(key, value)
    return Cluster(tmp_path, env=env, cli_in_process=True)


def sleep_job(directory: Path, model: Path, *, tasks: int, seconds: float, name: str = "job.yaml") -> Path:
    """A script job whose runs take `seconds` each: long enough to kill something mid-run."""
    (directory / "slow-script").mkdir(exist_ok=True)  # workload.dir is uploaded: the script's own folder
    (directory / "slow-script" / "slow.py").write_text(
        "import json, sys, time\n"
        f"time.sleep({seconds})\n"
        "print(json.dumps({'latency_ms': 1.0}))\n")
    link = directory / model.name
    if not link.exists():
        os.symlink(model, link)
    job = directory / name
    job.write_text(f"""
name: slow
models: [{model.name}]
workload: {{type: script, command: python, script: slow.py, dir: slow-script}}
repeats: {tasks}
sim: {{memory: 512m, backend: process, on_contention: flag}}
""")  # several agents on this host share its cores: flag contended runs, do not measure them again
    return job
