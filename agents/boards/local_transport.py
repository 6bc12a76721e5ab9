"""This host as a board (`host: local` in a device entry): the ssh transport's few verbs — run a shell command,
copy a file by hash, run a sampler beside a command — done with local processes, so a GPU workstation or an edge
box runs its own agent and the board driver, harness and parsers are the very same as over ssh.

Each command is `sh -c` in a process group of its own, so a timeout or a cancel ends everything it started.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from farm.agents.boards.ssh_transport import (
    CommandResult, SshCanceled, SshInfrastructureError, SshTimeoutError, UploadResult, file_sha256,
)

_POLL_S = 0.02


def _kill_group(process: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class LocalTarget:
    label = "localhost (local)"


class LocalTransport:
    """The SshTransport interface on this host. Use as a context manager."""

    target = LocalTarget()

    def __enter__(self) -> "LocalTransport":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    @property
    def connected(self) -> bool:
        return True

    def lost_message(self, what: str) -> str:
        return f"on this host: {what}"

    def _start(self, command: str, stdin: bool) -> subprocess.Popen:
        try:
            return subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        except OSError as e:
            raise SshInfrastructureError(f"cannot start a shell on this host: {e}") from e

    def run(self, command: str, timeout_s: float, stdin: bytes | None = None,
            cancel_check: Callable[[], bool] | None = None) -> CommandResult:
        """Run a shell command and wait; a non-zero exit is a result. Over its timeout, or canceled, its whole
        process group is killed."""
        process = self._start(command, stdin is not None)
        out: list[bytes] = []
        err: list[bytes] = []
        readers = [threading.Thread(target=lambda s=stream, b=buf: b.append(s.read()), daemon=True)
                   for stream, buf in ((process.stdout, out), (process.stderr, err))]
        for r in readers:
            r.start()
        if stdin is not None:
            assert process.stdin is not None
            try:
                process.stdin.write(stdin)
                process.stdin.close()
            except BrokenPipeError:
                pass
        deadline = time.monotonic() + timeout_s
        while process.poll() is None:
            if time.monotonic() > deadline:
                _kill_group(process)
                process.wait()
                raise SshTimeoutError(f"`{command}` on this host did not finish within {timeout_s:g}s; "
                                      "raise the timeout or check whether the host is overloaded or hung")
            if cancel_check is not None and cancel_check():
                _kill_group(process)
                process.wait()
                raise SshCanceled(f"`{command}` on this host was canceled")
            time.sleep(_POLL_S)
        for r in readers:
            r.join()
        status = process.returncode if process.returncode >= 0 else -1  # a signal: ssh reports no status either
        return CommandResult(status, b"".join(out).decode(errors="replace"), b"".join(err).decode(errors="replace"))

    def remote_sha256(self, remote_path: str, timeout_s: float = 60) -> str | None:
        path = Path(remote_path)
        return file_sha256(path) if path.is_file() else None

    def upload_by_hash(self, local: Path, remote_dir: str, timeout_s: float = 600, *,
                       known_missing: bool = False) -> UploadResult:
        """Copy a file under its sha256 name (extension kept) unless it is there already; written under a
        temporary name and renamed, so a half-copied file never has the final name."""
        sha = file_sha256(local)
        size = local.stat().st_size
        target = Path(remote_dir, f"{sha}{local.suffix}")
        if not known_missing and self.remote_sha256(str(target)) == sha:
            return UploadResult(str(target), sha, size, uploaded=False)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".part-", delete=False) as f:
                digest = hashlib.sha256()
                with local.open("rb") as source:
                    for chunk in iter(lambda: source.read(1 << 20), b""):
                        digest.update(chunk)
                        f.write(chunk)
            if digest.hexdigest() != sha:
                os.unlink(f.name)
                raise SshInfrastructureError(f"{local} changed while it was copied to {target}; retry")
            os.replace(f.name, target)
        except OSError as e:
            raise SshInfrastructureError(f"cannot copy {local} to {target} on this host: {e}") from e
        return UploadResult(str(target), sha, size, uploaded=True)

    def run_sampled(self, sampler: str, command: str, timeout_s: float,
                    cancel_check: Callable[[], bool] | None = None,
                    first_output_s: float = 10.0) -> tuple[CommandResult, CommandResult, float]:
        """Run `command` while `sampler` runs beside it; returns (command result, sampler output, wall s)."""
        background = LocalBackground(self._start(sampler, stdin=False), sampler)
        started = time.monotonic()
        try:
            result = self.run(command, timeout_s, cancel_check=cancel_check)
        except BaseException:
            background.stop()
            raise
        wall_s = time.monotonic() - started
        background.wait_for_output(first_output_s)  # a run shorter than the sampler's start-up: its first reading
        return result, background.stop(), wall_s


class LocalBackground:
    def __init__(self, process: subprocess.Popen, command: str) -> None:
        self.process, self.command = process, command
        self._out, self._err = bytearray(), bytearray()
        self._readers = [threading.Thread(target=self._drain, args=(s, b), daemon=True)
                         for s, b in ((process.stdout, self._out), (process.stderr, self._err))]
        for r in self._readers:
            r.start()

    @staticmethod
    def _drain(stream, buffer: bytearray) -> None:
        for chunk in iter(lambda: stream.read1(1 << 16), b""):
            buffer += chunk

    def wait_for_output(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._out:
            if self.process.poll() is not None or time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
        return True

    def stop(self, timeout_s: float = 10) -> CommandResult:
        if self.process.poll() is None:
            _kill_group(self.process, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(self.process)
                self.process.wait()
        for r in self._readers:
            r.join(timeout_s)
        status = self.process.returncode if self.process.returncode >= 0 else -1
        return CommandResult(status, bytes(self._out).decode(errors="replace"), bytes(self._err).decode(errors="replace"))
