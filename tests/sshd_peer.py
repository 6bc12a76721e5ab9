"""A Jetson-like ssh host for tests: Debian's real OpenSSH server on a loopback port.

Sessions find the fake `tegrastats`, `nvpmodel` and `jetson_clocks` from tests/fake_jetson_bin
first on PATH. Everything (host key, client key, config, known_hosts) lives in a temp dir; the
server runs in the foreground as our child under a lifetime bound, so it stops by itself even
if the test process dies.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import psutil

SSHD = "/usr/sbin/sshd"
FAKE_JETSON_BIN = Path(__file__).resolve().parent / "fake_jetson_bin"
# The server kills itself after this long, whatever happens to the test process.
MAX_LIFETIME_S = 600


class SshdUnavailable(RuntimeError):
    """OpenSSH's server is not installed and could not be installed."""


@dataclass(frozen=True)
class SshdPeer:
    host: str
    port: int
    username: str
    host_key_fingerprint: str  # "SHA256:…", as `ssh-keygen -l` prints it
    host_key_line: str  # "ssh-ed25519 AAAA…", for writing a known_hosts entry
    client_key: Path
    known_hosts: Path  # holds this server's key
    empty_known_hosts: Path  # knows nobody: for the unknown-host-key refusal
    fake_bin: Path
    process: subprocess.Popen[bytes]
    log: Path  # sshd's own messages (-e)

    def jetson_lab_entry(self, name: str = "nano-1") -> str:
        """A lab file's `devices:` entry for this peer as a Jetson Nano (the fake board tools in fake_bin)."""
        return (f"  - name: {name}\n    driver: jetson\n    type: jetson-nano\n    host: {self.host}\n"
                f"    port: {self.port}\n    username: {self.username}\n    ssh_key: {self.client_key}\n"
                f"    known_hosts: {self.known_hosts}\n    python: {sys.executable}\n"
                f"    nv_tegra_release: {self.fake_bin / 'nv_tegra_release'}\n"
                f"    device_tree_model: {self.fake_bin / 'device_tree_model'}\n")

    def kill(self) -> None:
        """Pull the plug: the listener, every per-connection sshd and their sessions die at once."""
        # Each connection's sshd calls setsid(), so the listener's process group does not hold them.
        with contextlib.suppress(psutil.NoSuchProcess):
            family = psutil.Process(self.process.pid).children(recursive=True)
            for process in family:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.send_signal(signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)


def ensure_sshd() -> None:
    if Path(SSHD).exists():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SshdUnavailable("openssh-server is missing and this session cannot apt-get install it (needs root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for args in (["apt-get", "install", "-y", "-qq", "openssh-server"],
                 ["sh", "-c", "apt-get update -qq && apt-get install -y -qq openssh-server"]):
        if subprocess.run(args, env=env, capture_output=True, timeout=600).returncode == 0 and Path(SSHD).exists():
            return
    raise SshdUnavailable("apt-get install openssh-server failed")


def sha256_fingerprint(public_key_line: str) -> str:
    blob = base64.b64decode(public_key_line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)],
                   check=True, capture_output=True)
    return " ".join(path.with_suffix(".pub").read_text().split()[:2])


def _wait_for_banner(port: int, process: subprocess.Popen[bytes], log: Path, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if process.poll() is not None:
            raise RuntimeError(f"sshd exited with {process.returncode}: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            if s.recv(64).startswith(b"SSH-2.0"):
                return
        time.sleep(0.05)
    raise RuntimeError(f"sshd did not answer on 127.0.0.1:{port} within {deadline_s}s")


@contextlib.contextmanager
def sshd_peer(extra_env: dict[str, str] | None = None) -> Iterator[SshdPeer]:
    """Start sshd on a free loopback port, yield how to reach it, stop it on exit."""
    ensure_sshd()
    if os.geteuid() != 0:
        raise SshdUnavailable("the test sshd runs as root (it must switch to the logged-in user)")
    # sshd refuses to start without its privilege-separation directory.
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="farm-sshd-") as tmp:
        d = Path(tmp)
        host_key_line = _keygen(d / "host_ed25519")
        client_pub = _keygen(d / "client_ed25519")
        (d / "authorized_keys").write_text(client_pub + "\n")
        port = free_loopback_port()
        path = f"{FAKE_JETSON_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        # sshd keeps only the first SetEnv line, so every variable goes on that one line
        env_lines = ["SetEnv " + " ".join([f"PATH={path}"] + [f"{k}={v}" for k, v in (extra_env or {}).items()])]
        (d / "sshd_config").write_text("\n".join([
            f"Port {port}",
            "ListenAddress 127.0.0.1",
            f"HostKey {d / 'host_ed25519'}",
            f"PidFile {d / 'sshd.pid'}",
            f"AuthorizedKeysFile {d / 'authorized_keys'}",
            "UsePAM no",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PubkeyAuthentication yes",
            "PermitRootLogin prohibit-password",
            "StrictModes no",  # the temp dir's permissions are not ssh's business here
            "AllowTcpForwarding no",
            "X11Forwarding no",
            "PrintMotd no",
            "LogLevel ERROR",
            "Subsystem sftp internal-sftp",
            *env_lines,
            "",
        ]))
        known_hosts = d / "known_hosts"
        known_hosts.write_text(f"[127.0.0.1]:{port} {host_key_line}\n")
        empty_known_hosts = d / "empty_known_hosts"
        empty_known_hosts.write_text("")
        log = d / "sshd.log"
        with log.open("wb") as log_file:  # a file, not a pipe: a chatty sshd must never block on it
            process = subprocess.Popen(
                ["timeout", "-s", "KILL", str(MAX_LIFETIME_S), SSHD, "-D", "-e", "-f", str(d / "sshd_config")],
                stdout=subprocess.DEVNULL, stderr=log_file, start_new_session=True,
            )
        peer = SshdPeer(
            host="127.0.0.1", port=port, username="root",
            host_key_fingerprint=sha256_fingerprint(host_key_line), host_key_line=host_key_line,
            client_key=d / "client_ed25519", known_hosts=known_hosts, empty_known_hosts=empty_known_hosts,
            fake_bin=FAKE_JETSON_BIN, process=process, log=log,
        )
        try:
            _wait_for_banner(port, process, log)
            yield peer
        finally:
            peer.kill()
