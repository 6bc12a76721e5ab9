"""Spawning and reaping the sandboxed command, shared by the cgroup and process backends.

The command's output goes to a file (no pipe to fill up and block the run), and a
reaper thread calls wait4() so the exit time and the kernel's rusage are exact.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

OUTPUT_TAIL_BYTES = 64 * 1024
PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent() -> None:
    """In a child before exec: the kernel kills it if farm dies (even by kill -9), so no
    orphaned run keeps loading the cores the next measurement uses."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class ReapedProcess:
    """A child process whose exit is collected by a thread the moment it happens."""

    def __init__(self, argv: list[str], *, env: dict[str, str], cwd: Path, output_path: Path,
                 preexec_fn=None, pass_fds: tuple[int, ...] = ()) -> None:
        self.output_path = output_path
        self._output = open(output_path, "w+b")  # read back through this handle: the path may be swapped
        self.started_at = time.monotonic()
        def child_setup() -> None:
            die_with_parent()
            if preexec_fn is not None:
                preexec_fn()

        self.proc = subprocess.Popen(
            argv, env=env, cwd=str(cwd), stdin=subprocess.DEVNULL, stdout=self._output,
            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=child_setup, pass_fds=pass_fds,
        )
        self.pid = self.proc.pid
        self.exited = threading.Event()
        self.status: int | None = None
        self.max_rss_bytes: int | None = None
        self.cpu_ns: int | None = None
        self.ended_at: float | None = None
        self.exit_waits: dict[int, int] = {}  # thread -> its run-queue wait at exit, where known (warm runs)
        threading.Thread(target=self._reap, name=f"reap-{self.pid}", daemon=True).start()

    def _reap(self) -> None:
        _, status, rusage = os.wait4(self.pid, 0)
        self.ended_at = time.monotonic()
        self.status = os.waitstatus_to_exitcode(status)
        self.proc.returncode = self.status  # keep Popen from reaping a reused pid later
        self.max_rss_bytes = rusage.ru_maxrss * 1024  # Linux reports KiB
        self.cpu_ns = int((rusage.ru_utime + rusage.ru_stime) * 1e9)  # the tree's CPU, for contention
        self.exited.set()

    @property
    def wall_s(self) -> float:
        end = self.ended_at if self.ended_at is not None else time.monotonic()
        return end - self.started_at

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        self.signal_group(signal.SIGKILL)

    def wait_until(self, timeout_s: float | None, cancel_check=None, poll_s: float = 0.05) -> tuple[bool, bool]:
        """Block until exit. Returns (timed_out, canceled); kills the group on either."""
        deadline = None if timeout_s is None else self.started_at + timeout_s
        while not self.exited.wait(poll_s):
            if cancel_check is not None and cancel_check():
                self.kill()
                self.exited.wait(10)
                return False, True
            if deadline is not None and time.monotonic() > deadline:
                self.kill()
                self.exited.wait(10)
                return True, False
        return False, False

    def output_tail(self) -> str:
        """The end of the command's output, from the file farm opened (a link put in its place is not followed)."""
        self._output.flush()
        try:
            fd = self._output.fileno()
            size = os.fstat(fd).st_size
            return os.pread(fd, OUTPUT_TAIL_BYTES, max(0, size - OUTPUT_TAIL_BYTES)).decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""

    def close(self) -> None:
        if not self.exited.is_set():
            self.kill()
            self.exited.wait(10)
        self._output.close()
