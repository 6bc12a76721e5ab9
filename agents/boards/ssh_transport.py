"""ssh to a board (Jetson, Raspberry Pi, any Linux): commands, uploads by hash, background samplers.

Host keys are checked against a known_hosts file. An unknown key is refused and its SHA256
fingerprint shown, unless the device entry pins that fingerprint or the user opted in to
trust on first use; a changed key is always refused. Every transport fault (refused, timed out,
connection lost) is an `SshInfrastructureError`: the board or the network failed, not the model.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import shlex
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import paramiko

from farm.proto.results import FailureClass

# Size of one read from a channel and of one upload chunk.
_CHUNK = 256 * 1024
# How often a waiting loop looks at the channel again.
_POLL_S = 0.01

# A command's first line says its shell's pid (the leader of its process group), so we can signal it.
_PID_MARK = "__FARM_PID="


def _strip_pid_line(output: bytearray) -> tuple[int | None, bytes]:
    """Split our `__FARM_PID=<pid>` first line off a command's output."""
    first, _, rest = bytes(output).partition(b"\n")
    text = first.decode(errors="replace")
    if text.startswith(_PID_MARK) and text[len(_PID_MARK):].isdigit():
        return int(text[len(_PID_MARK):]), rest
    return None, bytes(output)


# paramiko's exit status when none came: the connection died, or a signal ended the command
# (paramiko ignores `exit-signal`).
_NO_EXIT_STATUS = -1


def _transport_dies_soon(transport: paramiko.Transport, grace_s: float = 1.0) -> bool:
    """Tell a lost connection from a command killed by a signal.

    paramiko closes the channels of a dead connection a moment before it marks the
    connection inactive, so a closed channel alone does not say which it was.
    """
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        if not transport.is_active():
            return True
        time.sleep(_POLL_S)
    return not transport.is_active()


class SshInfrastructureError(Exception):
    """The board or the link failed: retry elsewhere, then quarantine the device."""

    failure_class = FailureClass.INFRASTRUCTURE


class SshTimeoutError(SshInfrastructureError):
    """A command, or the connection itself, took longer than allowed."""


class SshCanceled(SshInfrastructureError):
    """The caller canceled while a command ran; the command's process group was killed on the board."""


class HostKeyError(SshInfrastructureError):
    """The host's key is not the one we trust; nothing was sent to it."""


class UnknownHostKeyError(HostKeyError):
    def __init__(self, host_label: str, key_type: str, fingerprint: str, known_hosts: Path) -> None:
        self.host_label, self.key_type, self.fingerprint = host_label, key_type, fingerprint
        super().__init__(
            f"refused {host_label}: its host key is unknown ({key_type} {fingerprint}). Compare it with "
            f"`ssh-keygen -lf /etc/ssh/ssh_host_{key_type.removeprefix('ssh-')}_key.pub` run on the device, then pin "
            f"it in the device entry (host_key_fingerprint: {fingerprint}), add it to {known_hosts}, "
            f"or allow trust on first use for this device"
        )


class ChangedHostKeyError(HostKeyError):
    def __init__(self, host_label: str, fingerprint: str, expected: str, known_hosts: Path) -> None:
        self.host_label, self.fingerprint, self.expected = host_label, fingerprint, expected
        super().__init__(
            f"refused {host_label}: its host key changed (now {fingerprint}, {known_hosts} has {expected}). "
            f"If the board was reinstalled, remove its line from {known_hosts} (`ssh-keygen -R '{host_label}' "
            f"-f {known_hosts}`) and check the new key; otherwise someone may be intercepting the connection"
        )


@dataclass(frozen=True)
class SshTarget:
    """How to reach one board; mirrors the device entry in the lab config."""

    host: str
    username: str
    key_path: Path
    known_hosts: Path
    port: int = 22
    pinned_fingerprint: str | None = None  # "SHA256:…": accept exactly this key even if not in known_hosts
    trust_on_first_use: bool = False  # accept an unknown key once and write it to known_hosts
    connect_timeout_s: float = 15.0
    keepalive_s: int = 5  # notices a board that vanished without closing the TCP connection

    @property
    def label(self) -> str:
        """The host as known_hosts names it."""
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"


class CommandResult(NamedTuple):
    """`status, out, err = ssh.run(...)` reads naturally at call sites, each part typed."""

    status: int  # -1 when a signal ended the command (ssh reports no exit code then)
    stdout: str
    stderr: str


@dataclass(frozen=True)
class UploadResult:
    remote_path: str
    sha256: str
    size_bytes: int
    uploaded: bool  # False when the board already had this content


def key_fingerprint(key: paramiko.PKey) -> str:
    """The SHA256 fingerprint as OpenSSH prints it (`ssh-keygen -l`)."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Called only for keys known_hosts does not list (paramiko itself refuses changed ones)."""

    def __init__(self, target: SshTarget) -> None:
        self.target = target

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        fingerprint = key_fingerprint(key)
        if self.target.pinned_fingerprint is not None:
            if fingerprint == self.target.pinned_fingerprint:
                return
            raise ChangedHostKeyError(self.target.label, fingerprint, self.target.pinned_fingerprint,
                                      self.target.known_hosts)
        if self.target.trust_on_first_use:
            client.get_host_keys().add(hostname, key.get_name(), key)
            # Appended, not rewritten: the user's other entries stay as they were.
            with self.target.known_hosts.open("a") as f:
                f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
            return
        raise UnknownHostKeyError(self.target.label, key.get_name(), fingerprint, self.target.known_hosts)


class SshTransport:
    """One ssh connection to a board. Use as a context manager."""

    def __init__(self, target: SshTarget) -> None:
        self.target = target
        self._client: paramiko.SSHClient | None = None

    def __enter__(self) -> "SshTransport":
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        t = self.target
        client = paramiko.SSHClient()
        if t.known_hosts.exists():
            client.load_host_keys(str(t.known_hosts))
        client.set_missing_host_key_policy(_HostKeyPolicy(t))
        where = f"{t.username}@{t.label}"
        try:
            client.connect(
                t.host, port=t.port, username=t.username, key_filename=str(t.key_path),
                timeout=t.connect_timeout_s, banner_timeout=t.connect_timeout_s, auth_timeout=t.connect_timeout_s,
                allow_agent=False, look_for_keys=False,
            )
        except HostKeyError:
            client.close()
            raise
        except paramiko.BadHostKeyException as e:
            client.close()
            raise ChangedHostKeyError(t.label, key_fingerprint(e.key), key_fingerprint(e.expected_key),
                                      t.known_hosts) from e
        except paramiko.AuthenticationException as e:
            client.close()
            raise SshInfrastructureError(
                f"{where} did not accept the key {t.key_path}: add {t.key_path}.pub to "
                f"~{t.username}/.ssh/authorized_keys on the device ({e})"
            ) from e
        except (socket.timeout, TimeoutError) as e:
            client.close()
            raise SshTimeoutError(
                f"{where}: no answer within {t.connect_timeout_s:g}s; check the board is powered and on the network"
            ) from e
        except (OSError, paramiko.SSHException, EOFError) as e:
            client.close()
            raise SshInfrastructureError(
                f"cannot reach {where}: {e or type(e).__name__}; check the board is up and sshd runs on port {t.port}"
            ) from e
        transport = client.get_transport()
        assert transport is not None
        transport.set_keepalive(t.keepalive_s)
        self._client = client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    @property
    def connected(self) -> bool:
        transport = self._client.get_transport() if self._client else None
        return bool(transport and transport.is_active())

    def _transport(self) -> paramiko.Transport:
        transport = self._client.get_transport() if self._client else None
        if transport is None or not transport.is_active():
            raise SshInfrastructureError(self.lost_message("the connection is not open"))
        return transport

    def lost_message(self, what: str) -> str:
        return (f"connection to {self.target.username}@{self.target.label} lost: {what}; "
                f"check the board is up and reachable (it may have rebooted or dropped off the network)")

    def _open_channel(self, command: str) -> paramiko.Channel:
        try:
            channel = self._transport().open_session(timeout=self.target.connect_timeout_s)
            channel.exec_command(command)
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise SshInfrastructureError(self.lost_message(f"could not start `{command}` ({e})")) from e
        return channel

    def run(self, command: str, timeout_s: float, stdin: bytes | None = None,
            cancel_check: Callable[[], bool] | None = None) -> CommandResult:
        """Run a shell command on the board and wait for it; a non-zero exit is a result, not an error.

        Over its timeout the command's whole process group is killed on the board (ssh itself
        cannot signal it), so a hung workload does not keep the board busy for the next run.
        """
        # The session's shell leads its process group; its pid, on stderr first, lets a timeout kill the group.
        channel = self._open_channel(f"echo {_PID_MARK}$$ >&2; {command}")
        if stdin is not None:
            channel.sendall(stdin)
        channel.shutdown_write()
        err = bytearray()
        try:
            out, _ = self._collect(channel, command, time.monotonic() + timeout_s, timeout_s, err, cancel_check)
        except (SshTimeoutError, SshCanceled):
            self._kill_group(_strip_pid_line(err)[0])
            raise
        pid_free_err = _strip_pid_line(err)[1]
        return CommandResult(channel.recv_exit_status(), out, pid_free_err.decode(errors="replace"))

    def _kill_group(self, pid: int | None) -> None:
        if pid is None:
            return
        try:
            self.run(f"kill -KILL -- -{pid} 2>/dev/null || kill -KILL {pid} 2>/dev/null; true", 10)
        except SshInfrastructureError:
            pass  # the timeout is the error worth reporting

    def _collect(self, channel: paramiko.Channel, command: str, deadline: float, timeout_s: float,
                 err: bytearray | None = None, cancel_check: Callable[[], bool] | None = None) -> tuple[str, str]:
        out = bytearray()
        err = bytearray() if err is None else err
        transport = channel.get_transport()
        try:
            while True:
                progressed = False
                while channel.recv_ready():
                    out += channel.recv(_CHUNK)
                    progressed = True
                while channel.recv_stderr_ready():
                    err += channel.recv_stderr(_CHUNK)
                    progressed = True
                if channel.exit_status_ready() and not channel.recv_ready() and not channel.recv_stderr_ready():
                    break
                if not transport.is_active():
                    raise SshInfrastructureError(self.lost_message(f"`{command}` was running"))
                if time.monotonic() > deadline:
                    raise SshTimeoutError(
                        f"`{command}` on {self.target.label} did not finish within {timeout_s:g}s; "
                        f"raise the timeout or check whether the board is overloaded or hung"
                    )
                if not progressed:
                    if cancel_check is not None and cancel_check():
                        raise SshCanceled(f"`{command}` on {self.target.label} was canceled")
                    time.sleep(_POLL_S)
        finally:
            if not channel.exit_status_ready():
                channel.close()
        if channel.exit_status == _NO_EXIT_STATUS and _transport_dies_soon(transport):
            raise SshInfrastructureError(self.lost_message(f"`{command}` was running"))
        return out.decode(errors="replace"), err.decode(errors="replace")

    def remote_sha256(self, remote_path: str, timeout_s: float = 60) -> str | None:
        status, out, _ = self.run(f"sha256sum -- {shlex.quote(remote_path)} 2>/dev/null", timeout_s)
        return out.split()[0] if status == 0 and out.split() else None

    def upload_by_hash(self, local: Path, remote_dir: str, timeout_s: float = 600, *,
                       known_missing: bool = False) -> UploadResult:
        """Copy a file under its sha256 name (extension kept); skip it when the board already has it
        (`known_missing`: the caller just asked the board, skip asking again)."""
        sha = file_sha256(local)
        size = local.stat().st_size
        remote_path = f"{remote_dir.rstrip('/')}/{sha}{local.suffix}"
        if not known_missing and self.remote_sha256(remote_path) == sha:
            return UploadResult(remote_path, sha, size, uploaded=False)
        # a name of this upload's own: two agents (or two test boards sharing one root) pushing the same file at once
        # must not write into one partial file; the rename into place is atomic, so either copy may win
        partial = f"{remote_path}.{secrets.token_hex(6)}.part"
        quoted_dir, quoted_partial = shlex.quote(remote_dir), shlex.quote(partial)
        # A plain `cat` works on any board, also those without an sftp subsystem.
        channel = self._open_channel(f"mkdir -p {quoted_dir} && cat > {quoted_partial}")
        deadline = time.monotonic() + timeout_s
        try:
            with local.open("rb") as f:
                for chunk in iter(lambda: f.read(_CHUNK), b""):
                    if time.monotonic() > deadline:
                        raise SshTimeoutError(f"upload of {local} to {self.target.label} took over {timeout_s:g}s")
                    channel.sendall(chunk)
            channel.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException) as e:
            raise SshInfrastructureError(self.lost_message(f"uploading {local} ({e})")) from e
        _, err = self._collect(channel, "upload", deadline, timeout_s)
        if channel.recv_exit_status() != 0:
            raise SshInfrastructureError(f"could not write {partial} on {self.target.label}: {err.strip()}")
        if self.remote_sha256(partial) != sha:
            self.run(f"rm -f -- {quoted_partial}", 60)
            raise SshInfrastructureError(f"upload of {local} to {self.target.label} arrived corrupted; retry")
        self.run(f"mv -f -- {quoted_partial} {shlex.quote(remote_path)}", 60)
        return UploadResult(remote_path, sha, size, uploaded=True)

    def run_sampled(self, sampler: str, command: str, timeout_s: float,
                    cancel_check: Callable[[], bool] | None = None,
                    first_output_s: float = 10.0) -> tuple[CommandResult, CommandResult, float]:
        """Run `command` while `sampler` runs beside it; returns (command result, sampler output, wall s)."""
        background = self.start_background(sampler, max_s=timeout_s + 60)
        started = time.monotonic()
        try:
            result = self.run(command, timeout_s, cancel_check=cancel_check)
        except BaseException:
            background.stop_quietly()
            raise
        wall_s = time.monotonic() - started
        # A run shorter than the sampler's start-up (tegrastats prints after one period, jtop after its
        # Python starts) would have no reading at all; the first one, just after the run, is the nearest there is.
        background.wait_for_output(first_output_s)
        return result, background.stop(), wall_s

    def start_background(self, command: str, max_s: float) -> "BackgroundCommand":
        """Start a long-running command (a sampler); `.stop()` ends it and returns its output.

        It runs under `timeout max_s`, so it ends by itself if we never come back to stop it.
        """
        wrapped = f"echo {_PID_MARK}$$; exec timeout {max(1, int(max_s))} sh -c {shlex.quote(command)}"
        return BackgroundCommand(self, self._open_channel(wrapped), command)


class BackgroundCommand:
    """A command left running on the board while something else runs; its output is drained meanwhile."""

    def __init__(self, ssh: SshTransport, channel: paramiko.Channel, command: str) -> None:
        self._ssh, self._channel, self.command = ssh, channel, command
        self._out, self._err = bytearray(), bytearray()
        self._reader = threading.Thread(target=self._drain, name=f"ssh-bg:{command[:30]}", daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        # Reading as it comes keeps the ssh window open: an unread sampler would stall after ~2 MB.
        channel = self._channel
        while True:
            progressed = False
            if channel.recv_ready():
                self._out += channel.recv(_CHUNK)
                progressed = True
            if channel.recv_stderr_ready():
                self._err += channel.recv_stderr(_CHUNK)
                progressed = True
            # OpenSSH sends EOF before the exit status: ending at EOF alone left the status unknown (-1).
            ended = channel.eof_received and channel.status_event.is_set()
            if ended and not channel.recv_ready() and not channel.recv_stderr_ready():
                return
            if channel.closed or not channel.get_transport().is_active():
                return
            if not progressed:
                time.sleep(_POLL_S)

    def _pid(self) -> int | None:
        return _strip_pid_line(self._out)[0]

    def wait_for_output(self, timeout_s: float) -> bool:
        """Wait until the command has printed one whole line (beyond our pid line), or has ended, or
        `timeout_s` passed; True if there is a line."""
        deadline = time.monotonic() + timeout_s
        while True:
            if b"\n" in _strip_pid_line(self._out)[1]:
                return True
            if not self._reader.is_alive() or time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)

    def stop_quietly(self) -> None:
        """Stop after the foreground command failed: that error is the one to report, not ours."""
        try:
            self.stop(timeout_s=5)
        except SshInfrastructureError:
            pass

    def stop(self, timeout_s: float = 10) -> CommandResult:
        """Signal the command's whole process group, then return everything it printed."""
        deadline = time.monotonic() + timeout_s
        while self._pid() is None and self._reader.is_alive() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        pid = self._pid()
        if pid is not None and self._reader.is_alive():
            # The session's shell leads its own process group; killing the group takes `sleep` & co. along.
            self._ssh.run(f"kill -TERM -- -{pid} 2>/dev/null || kill -TERM {pid} 2>/dev/null; true",
                          max(1.0, deadline - time.monotonic()))
        self._reader.join(max(0.0, deadline - time.monotonic()))
        if self._reader.is_alive():
            self._channel.close()
            raise SshTimeoutError(f"`{self.command}` on {self._ssh.target.label} did not stop within {timeout_s:g}s")
        if self._channel.exit_status == _NO_EXIT_STATUS and not self._ssh.connected:
            raise SshInfrastructureError(self._ssh.lost_message(f"`{self.command}` was running in the background"))
        status = self._channel.exit_status  # -1 after our own SIGTERM: it ends by a signal
        output = _strip_pid_line(self._out)[1]
        return CommandResult(status, output.decode(errors="replace"), bytes(self._err).decode(errors="replace"))
