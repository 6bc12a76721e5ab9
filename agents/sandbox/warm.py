"""The agent's end of the warm harness (agents/harness/zygote.py): a kept interpreter per runtime that has
imported it once and forks each run, which the cgroup and process backends then hold exactly as they hold a
cold process — its own cgroup, limits, namespaces and run user, its output file, its exit and rusage.

What a warm run measures the same as a cold one, and the one difference (docs/trust.md, "Warm harness"):
- its cgroup's counters (CPU time, throttling, pressure, OOM kills, pids, block I/O) are the run's alone:
  the child joins the run's fresh cgroup before any of the run's code;
- its memory figures: the harness's VmHWM and the rusage peak start at what the child holds when forked
  (the interpreter, numpy and the runtime: what a cold harness holds after its imports), reset in the child;
  the cgroup's high-water mark and limit count only pages charged after the fork, so the zygote's anonymous
  memory at the fork (`inherited_bytes`, read from /proc) is added to the run's peak and taken off the memory
  limit the kernel enforces: the run may hold no more than sim.memory in all, as a cold run, and its peak never
  reads lower than what it held (pages it copied on write count twice, so it may read a little higher).
- the backends that cannot fork inside their isolation (docker: the run lives in a container) stay cold.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import IO, Any

from farm.agents.harness.run_world import RESULT_FD
from farm.agents.sandbox.base import SandboxError
from farm.agents.sandbox.process_tree import ReapedProcess

WARM_ENV = "FARM_WARM_HARNESS"  # 0: every run starts a fresh interpreter (the cold harness)
READY_TIMEOUT_S = 120.0
RUNTIMES = {".onnx": "onnx", ".tflite": "tflite"}


def warm_enabled() -> bool:
    return os.environ.get(WARM_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def runtime_of(model_path: str) -> str | None:
    return RUNTIMES.get(Path(model_path).suffix.lower())


def anonymous_bytes(pid: int) -> int | None:
    """RssAnon of a process (/proc/PID/status): the private memory a child forked from it starts with."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


class Zygote:
    """One kept interpreter with one runtime imported; forks runs on request. Thread-safe (one request at a time)."""

    def __init__(self, runtime: str) -> None:
        self.runtime = runtime
        self._lock = threading.Lock()
        self._replies: list[dict[str, Any]] = []
        self._reply = threading.Condition()
        self._exits: dict[int, dict[str, Any]] = {}
        self._waiting: dict[int, "WarmProcess"] = {}
        self.process: subprocess.Popen[bytes] | None = None
        self._errors: IO[bytes] | None = None
        self.control: socket.socket | None = None
        self._home: str | None = None

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._errors = tempfile.TemporaryFile()  # a file, not a pipe: a zygote that says much never blocks on it
        # A home of its own, empty and root's alone, removed with it: what a runtime writes under its home as it is
        # imported (onnxruntime's telemetry store) is not the agent's user's, and no run reaches it (zygote.py).
        self._home = tempfile.mkdtemp(prefix="farm-zygote-home-")
        # an allow-listed environment, as a run's: the zygote's memory is what every run starts with
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
               "HOME": self._home,
               "OMP_NUM_THREADS": "1"}  # numpy's BLAS starts no threads in the zygote (a fork keeps only one)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "farm.agents.harness.zygote", self.runtime, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=env, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=self._errors, start_new_session=True)
        except OSError as e:
            ours.close()
            raise SandboxError(f"cannot start the warm {self.runtime} harness: {e}") from None
        finally:
            theirs.close()
        self.control = ours
        ours.settimeout(READY_TIMEOUT_S)
        try:
            ready = json.loads(ours.recv(1 << 16) or b"{}")
        except (OSError, ValueError):
            ready = {}
        ours.settimeout(None)
        if "ready" not in ready:
            error = self._stop()
            raise SandboxError(f"the warm {self.runtime} harness did not start: {error or 'no answer'}")
        # this zygote's runs and early exits: a later zygote (after a restart) gets dicts of its own
        self._waiting, self._exits = {}, {}
        threading.Thread(target=self._read, args=(ours, self._waiting, self._exits), name=f"zygote-{self.runtime}",
                         daemon=True).start()

    def _read(self, control: socket.socket, waiting: dict[int, "WarmProcess"], exits: dict[int, dict[str, Any]]) -> None:
        while True:
            try:
                data = control.recv(1 << 16)
            except OSError:
                data = b""
            if not data:  # the zygote died: every run it had is over, status unknown
                with self._reply:
                    if control is self.control:  # not an earlier zygote's socket, closed on purpose
                        self._replies.append({"error": "the warm harness stopped"})
                        self._reply.notify_all()
                    lost = dict(waiting)
                    waiting.clear()
                for process in lost.values():
                    process.exit_reported({"status": None})
                return
            message = json.loads(data)
            if "exit" in message:
                with self._reply:
                    found: WarmProcess | None = waiting.pop(message["exit"], None)
                    if found is None:
                        exits[message["exit"]] = message  # it exited before its spawn was registered
                if found is not None:
                    found.exit_reported(message)
            else:
                with self._reply:
                    self._replies.append(message)
                    self._reply.notify_all()

    def inherited_bytes(self) -> int:
        """The zygote's private memory now (started first if it is not running): what a child starts with."""
        with self._lock:
            if not self.alive():
                self._stop()
                self._start()
            assert self.process is not None
            return anonymous_bytes(self.process.pid) or 0

    def running(self) -> list[int]:
        """The host pids of the runs it forked that have not exited yet."""
        with self._reply:
            return sorted(self._waiting)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def spawn(self, request: dict[str, Any], output_fd: int, result_fd: int,
              process: "WarmProcess") -> tuple[int, float, int | None]:
        """Fork a run; returns its pid, its fork time and the zygote's anonymous memory just before the fork."""
        with self._lock:
            if not self.alive():
                self._stop()
                self._start()
            assert self.control is not None and self.process is not None
            inherited = anonymous_bytes(self.process.pid)
            with self._reply:
                self._replies.clear()
            try:
                socket.send_fds(self.control, [json.dumps(request).encode()], [output_fd, result_fd])
            except OSError as e:
                raise SandboxError(f"the warm {self.runtime} harness is gone: {e}") from None
            with self._reply:
                if not self._reply.wait_for(lambda: bool(self._replies), READY_TIMEOUT_S):
                    raise SandboxError(f"the warm {self.runtime} harness did not answer")
                reply = self._replies.pop(0)
                if "pid" in reply:
                    early = self._exits.pop(reply["pid"], None)
                    if early is None:
                        self._waiting[reply["pid"]] = process
            if "pid" not in reply:
                raise SandboxError(f"the warm {self.runtime} harness could not fork the run: {reply.get('error')}")
            if early is not None:
                process.exit_reported(early)
            return reply["pid"], reply["started_at"], inherited

    def _stop(self) -> str:
        error = ""
        if self.control is not None:
            try:  # shutdown, not only close: the reader thread's recv holds the socket open until it returns
                self.control.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.control.close()  # the zygote sees the end of its socket and exits
            self.control = None
        if self.process is not None:
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
        if self._home is not None:
            shutil.rmtree(self._home, ignore_errors=True)
            self._home = None
        if self._errors is not None:
            self._errors.seek(0)
            error = self._errors.read()[-2000:].decode("utf-8", "replace").strip()[-500:]
            self._errors.close()
            self._errors = None
        return error

    def close(self) -> None:
        with self._lock:
            self._stop()


class Zygotes:
    """The driver's kept harnesses, one per runtime, started on first use; shared by its slots."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_runtime: dict[str, Zygote] = {}
        # a driver dropped (an embedded job done) takes its kept interpreters with it
        weakref.finalize(self, _close_all, self._by_runtime)

    def get(self, runtime: str) -> Zygote:
        with self._lock:
            if runtime not in self._by_runtime:
                self._by_runtime[runtime] = Zygote(runtime)
            return self._by_runtime[runtime]

    def close(self) -> None:
        with self._lock:
            zygotes = list(self._by_runtime.values())
            self._by_runtime.clear()
        for zygote in zygotes:
            zygote.close()


def _close_all(zygotes: dict[str, Zygote]) -> None:
    for zygote in list(zygotes.values()):
        zygote.close()


class WarmLaunch:
    """How a backend starts a run warm: the zygote, the harness's task file, the descriptor its result goes to
    (the child holds it as RESULT_FD), the isolation to set up."""

    def __init__(self, zygote: Zygote, task_file: str, result_fd: int, *, isolate: dict[str, Any] | None = None,
                 user: dict[str, int] | None = None) -> None:
        self.zygote, self.isolate, self.user = zygote, isolate, user
        self.argv, self.result_fd = [task_file, f"fd:{RESULT_FD}"], result_fd

    def start(self, *, env: dict[str, str], cwd: Path, output_path: Path, procs: list[str] | None = None,
              limits: dict[str, Any] | None = None) -> "WarmProcess":
        request = {"argv": self.argv, "env": env, "cwd": str(cwd), "procs": procs or [], "limits": limits,
                   "isolate": self.isolate, "user": self.user}
        return WarmProcess(self.zygote, request, output_path, self.result_fd)


class WarmProcess(ReapedProcess):
    """A run forked by a zygote, with ReapedProcess's interface: the zygote reaps it and reports the exit."""

    def __init__(self, zygote: Zygote, request: dict[str, Any], output_path: Path, result_fd: int) -> None:
        self.output_path = output_path
        self._output = open(output_path, "w+b")
        self.exited = threading.Event()
        self.status: int | None = None
        self.max_rss_bytes: int | None = None
        self.cpu_ns: int | None = None
        self.ended_at: float | None = None
        self.exit_waits: dict[int, int] = {}
        self.started_at = time.monotonic()
        try:
            self.pid, self.started_at, self.inherited_bytes = zygote.spawn(request, self._output.fileno(), result_fd,
                                                                           self)
        except BaseException:
            self._output.close()
            raise

    def exit_reported(self, message: dict[str, Any]) -> None:
        self.ended_at = message.get("ended_at") or time.monotonic()
        self.status = message.get("status")
        self.max_rss_bytes = message.get("max_rss_bytes")
        self.cpu_ns = message.get("cpu_ns")
        if message.get("wait_ns") is not None and message.get("exit"):
            self.exit_waits = {int(message["exit"]): int(message["wait_ns"])}
        self.exited.set()
