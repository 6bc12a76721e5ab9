"""A private PostgreSQL server for tests: Debian's `postgresql` on a loopback port and a temp data folder.

The cluster is made with `initdb` in a temp dir (trust auth on loopback only, fsync off: the data is
thrown away), and the server runs in the foreground as our child under a lifetime bound, so it stops
by itself even if the test process dies. PostgreSQL refuses to run as root, so a root session runs it
as the `postgres` system user (or `nobody` when that user is missing).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

# The server kills itself after this long, whatever happens to the test process: longer than any test session
# (CI's limit is 90 minutes; a session-scoped peer first used early must live to the session's end).
MAX_LIFETIME_S = 3 * 3600
START_TIMEOUT_S = 120  # a busy 2-core machine can take a while to run initdb and recovery


class PostgresUnavailable(RuntimeError):
    """Debian's postgresql is not installed and could not be installed."""


@dataclass
class PostgresPeer:
    host: str
    port: int
    user: str
    database: str
    data_dir: Path
    log: Path  # the server's own messages
    process: subprocess.Popen[bytes]
    argv: tuple[str, ...] = ()  # how it was started, so restart() starts it the same way
    account: pwd.struct_passwd | None = None

    @property
    def url(self) -> str:
        """The address a farm command takes: `postgresql://user@host:port/database`."""
        return f"postgresql://{self.user}@{self.host}:{self.port}/{self.database}"

    def kill(self) -> None:
        """Pull the plug: the postmaster and every backend die at once (like a host losing power)."""
        postmaster = self._postmaster_pid()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        if postmaster is not None:  # the postmaster by its own pid too, whatever group it ended up in
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(postmaster), signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(postmaster, signal.SIGKILL)
        self.process.wait(timeout=10)
        deadline = time.monotonic() + 10  # gone when its port refuses: a test's next statement sees it down
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            except OSError:
                return
            time.sleep(0.05)

    def stop(self) -> None:
        """PostgreSQL's fast shutdown (SIGINT): every session ends at once, as in a restart; the data stays."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGINT)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()

    def start(self) -> None:
        """The server again, on the same data folder and port, after stop() or kill(); back once it accepts."""
        self.process = _launch(self.argv, self.log, self.account)
        _wait_accepting(self.port, self.process, self.log)

    def _postmaster_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((self.data_dir / "postmaster.pid").read_text().split()[0])
        return None


def _bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


def ensure_postgres() -> Path:
    """The folder holding `initdb` and `postgres`, installing Debian's postgresql when missing and allowed."""
    found = _bin_dir()
    if found is not None:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise PostgresUnavailable("postgresql is missing and this session cannot apt-get install it (needs root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for args in (["apt-get", "install", "-y", "-qq", "postgresql"],
                 ["sh", "-c", "apt-get update -qq && apt-get install -y -qq postgresql"]):
        if subprocess.run(args, env=env, capture_output=True, timeout=900).returncode == 0:
            found = _bin_dir()
            if found is not None:
                return found
    raise PostgresUnavailable("apt-get install postgresql failed (is the Debian mirror reachable?)")


def _run_as() -> pwd.struct_passwd | None:
    """The account the server runs as: None keeps ours; root must hand it to an unprivileged user."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise PostgresUnavailable("running as root and neither a 'postgres' nor a 'nobody' user exists")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _demote(account: pwd.struct_passwd | None):  # type: ignore[no-untyped-def]
    def child() -> None:
        os.setsid()  # its own process group, so kill() takes the backends too
        if account is not None:
            os.setgroups([])
            os.setgid(account.pw_gid)
            os.setuid(account.pw_uid)
    return child


def _launch(argv: Sequence[str], log: Path, account: pwd.struct_passwd | None) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, preexec_fn=_demote(account))


def _wait_accepting(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"postgres exited with {process.returncode} while starting:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            # The port is open before recovery ends; pg_isready's answer is the real readiness.
            ready = subprocess.run([str(_bin_dir() / "pg_isready"), "-h", "127.0.0.1", "-p", str(port)],  # type: ignore[operator]
                                   capture_output=True, timeout=30)
            if ready.returncode == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"postgres did not accept connections within {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def postgres_server_or_skip() -> Iterator[PostgresPeer]:
    """postgres_server() for a fixture, or the test skipped with the reason it cannot run here (psycopg missing,
    no PostgreSQL to start); CI installs both (.ci/install-deps.sh), so there it always runs."""
    import pytest

    pytest.importorskip("psycopg", reason="psycopg 3 is not installed (pip install 'farm[postgresql]')")
    try:
        with postgres_server() as server:
            yield server
    except PostgresUnavailable as exc:
        pytest.skip(str(exc))


@contextlib.contextmanager
def postgres_server(database: str = "farm", user: str = "farm") -> Iterator[PostgresPeer]:
    """A fresh PostgreSQL cluster with one database owned by `user`; gone when the block ends."""
    bin_dir = ensure_postgres()
    account = _run_as()
    root = Path(tempfile.mkdtemp(prefix="farm-pg-"))
    try:
        data, sockets, log = root / "data", root / "sockets", root / "postgres.log"
        sockets.mkdir()
        log.touch()
        if account is not None:
            for path in (root, sockets, log):
                os.chown(path, account.pw_uid, account.pw_gid)
        init = subprocess.run([str(bin_dir / "initdb"), "-D", str(data), "-U", user, "--auth=trust",
                               "--encoding=UTF8", "--locale=C.UTF-8", "--no-sync"],
                              preexec_fn=_demote(account), capture_output=True, timeout=START_TIMEOUT_S)
        if init.returncode != 0:
            raise RuntimeError(f"initdb failed:\n{init.stdout.decode()[-2000:]}{init.stderr.decode()[-2000:]}")
        port = _free_port()
        # `timeout` bounds the server's life even if this process is killed; -k: sockets stay in our temp dir.
        argv = ["timeout", "-s", "KILL", str(MAX_LIFETIME_S), str(bin_dir / "postgres"), "-D", str(data),
                "-p", str(port), "-k", str(sockets), "-c", "listen_addresses=127.0.0.1",
                "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                "-c", "max_connections=200", "-c", "shared_buffers=32MB"]
        process = _launch(argv, log, account)
        peer = PostgresPeer(host="127.0.0.1", port=port, user=user, database=database, data_dir=data,
                            log=log, process=process, argv=tuple(argv), account=account)
        try:
            _wait_accepting(port, process, log)
            created = subprocess.run([str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", user,
                                      database], capture_output=True, timeout=60)
            if created.returncode != 0:
                raise RuntimeError(f"createdb failed: {created.stderr.decode()[-2000:]}")
            yield peer
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(peer.process.pid, signal.SIGINT)  # PostgreSQL's fast shutdown: backends end now
            try:
                peer.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                peer.kill()
    finally:
        shutil.rmtree(root, ignore_errors=True)
