"""Make a Docker engine available to the tests, starting Debian's dockerd when none runs.

CI runs on a fresh machine where .ci/install-docker.sh installed docker.io but nothing
started the daemon, so the docker tests start it themselves: in the background, its log in
a file, with the first set of flags this host accepts (overlay2, then vfs, then without
iptables and the default bridge for hosts where network setup fails).

    reason = ensure_engine()
    if reason: pytest.skip(reason)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

SOCKET_PATH = Path("/var/run/docker.sock")
PID_FILE = Path("/var/run/docker.pid")
START_TIMEOUT_S = 30.0
LOG_PATH = Path(tempfile.gettempdir()) / "farm-dockerd.log"

# Tried in order; a set is dropped as soon as dockerd exits or stays silent past the timeout.
DOCKERD_FLAG_SETS: list[list[str]] = [
    ["--storage-driver=overlay2"],
    ["--storage-driver=vfs"],
    ["--storage-driver=vfs", "--iptables=false", "--bridge=none"],
]


def engine_answers(timeout_s: float = 5.0) -> bool:
    """True when the engine the SDK would use replies to a ping."""
    try:
        import docker
    except ImportError:
        return False
    try:
        client = docker.from_env(timeout=timeout_s)
    except Exception:
        return False
    try:
        return bool(client.ping())
    except Exception:
        return False
    finally:
        client.close()


def find_dockerd() -> str | None:
    # sbin is missing from PATH for some CI shells, and Debian puts dockerd there.
    return shutil.which("dockerd") or next(
        (str(p) for p in (Path("/usr/sbin/dockerd"), Path("/usr/bin/dockerd")) if p.exists()), None
    )


def _daemon_already_starting() -> bool:
    """A dockerd from elsewhere (systemd, another test process) that has not opened its socket yet."""
    try:
        pid = int(PID_FILE.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True


def _wait_for_engine(process: subprocess.Popen[bytes] | None, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if SOCKET_PATH.exists() and engine_answers(timeout_s=2.0):
            return True
        if process is not None and process.poll() is not None:
            return False  # dockerd gave up: its log says why
        time.sleep(0.25)
    return False


def _log_tail(lines: int = 5) -> str:
    try:
        return " | ".join(LOG_PATH.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


INSTALL_SCRIPT = Path(__file__).resolve().parent.parent / ".ci" / "install-docker.sh"


def install_engine() -> str | None:
    """Install Debian's docker.io as CI does (.ci/install-docker.sh), as sshd and adb are installed
    by their tests: `make test` on a fresh machine then runs what `.ci/run` runs. Returns dockerd's path."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None
    with LOG_PATH.open("ab") as log:
        subprocess.run(["bash", str(INSTALL_SCRIPT)], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, timeout=900)
    return find_dockerd()


def ensure_engine() -> str | None:
    """None when an engine answers (started here if need be), else why none could."""
    try:
        import docker  # noqa: F401
    except ImportError:
        return "the `docker` Python package is not installed (pip install -e '.[test]')"
    if engine_answers():
        return None
    if os.environ.get("DOCKER_HOST"):
        return f"DOCKER_HOST={os.environ['DOCKER_HOST']} does not answer and is not ours to start"
    if _daemon_already_starting() and _wait_for_engine(None, START_TIMEOUT_S):
        return None
    dockerd = find_dockerd() or install_engine()
    if dockerd is None:
        return ("no Docker engine runs and dockerd is not installed, nor could it be here (needs root and apt-get): "
                f"run .ci/install-docker.sh (apt-get install docker.io); its output: {_log_tail(2)}")
    if os.geteuid() != 0:
        return "no Docker engine runs and starting dockerd needs root"
    failures = []
    for flags in DOCKERD_FLAG_SETS:
        with LOG_PATH.open("ab") as log:
            log.write(f"\n=== farm tests: {dockerd} {' '.join(flags)}\n".encode())
            log.flush()
            # Its own session, so the daemon outlives this test process and its signals.
            process = subprocess.Popen(
                [dockerd, *flags],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        if _wait_for_engine(process, START_TIMEOUT_S):
            return None
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        failures.append(f"[{' '.join(flags)}] {_log_tail(2)}")
    return f"dockerd would not start (log {LOG_PATH}): " + " ;; ".join(failures)
