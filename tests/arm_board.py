"""An ARM board for the tests: a Debian arm64 root (debootstrap, run under qemu-user-static's binfmt
handler) with its own OpenSSH server on a loopback port, the fake Jetson tools on its PATH, and a
wheelhouse of aarch64 runtime wheels its pip installs from (no index, as on an offline board).

The root and the wheels are built once into /var/cache/farm-tests/arm-board/<key>/, the key being a
hash of the recipe below (release, packages, wheels): change the recipe and a new cache is built.
The board's sshd runs chrooted inside a private mount and PID namespace (`unshare`), so its /proc is
the board's own and every mount goes away with it.

    python tests/arm_board.py build [bullseye]   # build the cache (what `make arm-board` runs)
    python tests/arm_board.py shell [bullseye]   # start the board and print how to ssh in (Ctrl-C stops it)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sshd_peer import FAKE_JETSON_BIN, SshdPeer, _keygen, _wait_for_banner, free_loopback_port, sha256_fingerprint  # noqa: E402
from cache_lock import cache_lock  # noqa: E402

CACHE = Path(os.environ.get("FARM_TEST_CACHE", "/var/cache/farm-tests")) / "arm-board"
# The emulated board serves a whole test module (set-up, benchmarks, the Jetson experiment's short form):
# over ten minutes on a busy host, past the x86 peer's 600 s. Still a bound, so a leaked board dies.
BOARD_LIFETIME_S = 3600
RELEASE = "bookworm"  # Python 3.11: the default board
# the Debian releases still in the registry, each with its Python (buster, 3.7, is gone: 404)
RELEASE_PYTHON = {"bookworm": "3.11", "bullseye": "3.9"}
MIRROR = "http://deb.debian.org/debian"
PACKAGES = ["python3", "python3-venv", "openssh-server"]
WHEELS = ["ai-edge-litert", "onnxruntime", "numpy"]
# pip takes platform tags literally: bookworm's glibc 2.36 runs every one of these
WHEEL_PLATFORMS = ["manylinux2014_aarch64", "manylinux_2_17_aarch64", "manylinux_2_27_aarch64", "manylinux_2_28_aarch64"]
RECIPE_VERSION = 1  # bump when the steps below change in a way the lists above do not show
BOARD_WHEELHOUSE = "/opt/wheelhouse"  # inside the root; /etc/pip.conf points pip at it
BOARD_FAKE_BIN = "/opt/farm-fake-jetson"
BUILD_TIMEOUT_S = 900


class ArmBoardUnavailable(RuntimeError):
    """What the ARM board needs is missing (binfmt, debootstrap, the registry); the message says which."""


def recipe_key(release: str = RELEASE) -> str:
    recipe = json.dumps([RECIPE_VERSION, release, PACKAGES, WHEELS, WHEEL_PLATFORMS, RELEASE_PYTHON[release]])
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def cache_dir(release: str = RELEASE) -> Path:
    return CACHE / f"{release}-arm64-{recipe_key(release)}"


def binfmt_problem() -> str | None:
    """Why aarch64 binaries cannot run here, or None."""
    handler = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    if not Path("/proc/sys/fs/binfmt_misc/status").exists() and os.geteuid() == 0:
        subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", "/proc/sys/fs/binfmt_misc"], capture_output=True)
    if not handler.exists() and shutil.which("update-binfmts") and os.geteuid() == 0:
        subprocess.run(["update-binfmts", "--enable", "qemu-aarch64"], capture_output=True)
    if not handler.exists():
        return "no binfmt_misc handler for aarch64 (install qemu-user-static and binfmt-support)"
    text = handler.read_text()
    if not text.startswith("enabled"):
        return "the aarch64 binfmt handler is disabled (update-binfmts --enable qemu-aarch64)"
    if "F" not in next((line for line in text.splitlines() if line.startswith("flags:")), ""):
        return "the aarch64 binfmt handler lacks the F flag, so it cannot run inside a chroot"
    return None


def _run(argv: list[str], what: str, timeout: float = BUILD_TIMEOUT_S, **kw) -> subprocess.CompletedProcess[str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired:
        raise ArmBoardUnavailable(f"{what} did not finish within {timeout:g} s") from None
    if p.returncode != 0:
        raise ArmBoardUnavailable(f"{what} failed ({p.returncode}): {(p.stdout + p.stderr).strip()[-800:]}")
    return p


def download_wheels(dest: Path, python: str) -> None:
    """The aarch64 runtime wheels for that Python and their dependencies, from PyPI."""
    platforms = [a for p in WHEEL_PLATFORMS for a in ("--platform", p)]
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--dest", str(dest),
          *platforms, "--python-version", python, "--implementation", "cp", "--only-binary=:all:", *WHEELS],
         "pip download of the aarch64 wheels (is PyPI reachable?)", timeout=600)


def build(log=print, release: str = RELEASE) -> Path:
    """The cached root of that release (built when missing, by one test run at a time): returns its path."""
    if release in RELEASE_PYTHON and (cache_dir(release) / "ready").exists():
        return cache_dir(release) / "root"
    with cache_lock(CACHE):  # another run building it: wait, then find it ready
        return _build(log, release)


def _build(log, release: str) -> Path:
    if release not in RELEASE_PYTHON:
        raise ArmBoardUnavailable(f"no arm64 board recipe for Debian {release!r} (known: {', '.join(RELEASE_PYTHON)})")
    where = cache_dir(release)
    root = where / "root"
    if (where / "ready").exists():
        return root
    if os.geteuid() != 0:
        raise ArmBoardUnavailable("building the arm64 root needs root (debootstrap, chroot)")
    if shutil.which("debootstrap") is None:
        raise ArmBoardUnavailable("debootstrap is not installed")
    problem = binfmt_problem()
    if problem:
        raise ArmBoardUnavailable(problem)
    where.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(root, ignore_errors=True)  # a half-built one from a build that died
    started = time.monotonic()
    wheels = where / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    download_wheels(wheels, RELEASE_PYTHON[release])
    log(f"arm-board: wheels downloaded in {time.monotonic() - started:.0f} s")
    _run(["debootstrap", "--arch=arm64", "--variant=minbase", f"--include={','.join(PACKAGES)}", release, str(root),
          MIRROR], f"debootstrap --arch=arm64 {release} (is the Debian registry reachable?)")
    log(f"arm-board: root built in {time.monotonic() - started:.0f} s")
    shutil.copytree(wheels, root / BOARD_WHEELHOUSE.lstrip("/"))
    shutil.copytree(FAKE_JETSON_BIN, root / BOARD_FAKE_BIN.lstrip("/"))
    # an offline board: pip installs from the wheelhouse only, as a lab without internet would set it up
    (root / "etc/pip.conf").write_text(f"[global]\nno-index = true\nfind-links = {BOARD_WHEELHOUSE}\n")
    (root / "run/sshd").mkdir(parents=True, exist_ok=True)
    (where / "build.json").write_text(json.dumps({"seconds": round(time.monotonic() - started, 1),
                                                  "key": recipe_key(release), "release": release}))
    (where / "ready").write_text("")
    return root


@contextlib.contextmanager
def arm_board(release: str = RELEASE) -> Iterator[SshdPeer]:
    """Start the board's sshd (aarch64, emulated) on a free loopback port; yield how to reach it."""
    root = build(release=release)
    with tempfile.TemporaryDirectory(prefix="farm-arm-") as tmp:
        d = Path(tmp)
        session = f"/run/farm-{d.name}"  # the per-session keys and config, inside the root
        inside = root / session.lstrip("/")
        inside.mkdir(parents=True)
        try:
            host_key_line = _keygen(d / "host_ed25519")
            client_pub = _keygen(d / "client_ed25519")
            shutil.copy(d / "host_ed25519", inside / "host_ed25519")
            (inside / "authorized_keys").write_text(client_pub + "\n")
            port = free_loopback_port()
            path = f"{BOARD_FAKE_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
            (inside / "sshd_config").write_text("\n".join([
                f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {session}/host_ed25519",
                f"PidFile {session}/sshd.pid", f"AuthorizedKeysFile {session}/authorized_keys", "UsePAM no",
                "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PubkeyAuthentication yes",
                "PermitRootLogin prohibit-password", "StrictModes no", "AllowTcpForwarding no", "X11Forwarding no",
                "PrintMotd no", "LogLevel ERROR", "Subsystem sftp internal-sftp", f"SetEnv PATH={path}", "",
            ]))
            known_hosts = d / "known_hosts"
            known_hosts.write_text(f"[127.0.0.1]:{port} {host_key_line}\n")
            (d / "empty_known_hosts").write_text("")
            log = d / "sshd.log"
            # a private mount and PID namespace: the board's /proc lists the board's processes, and its
            # mounts (proc, sys, dev) vanish with the namespace. /sys holds only the CPU lists: onnxruntime
            # 1.19 (Python 3.9's) aborts at import without /sys/devices/system/cpu/possible, and 1.32 crashes
            # under qemu-user when it reads the host's whole (x86) sysfs
            cpu = f"{root}/sys/devices/system/cpu"
            inner = (f"mount --make-rprivate / && mount -t proc proc {root}/proc && "
                     f"mount -t tmpfs -o size=1m,mode=0755 farm-sys {root}/sys && mkdir -p {cpu} && "
                     f"cat /sys/devices/system/cpu/possible > {cpu}/possible && "
                     f"cat /sys/devices/system/cpu/present > {cpu}/present && "
                     f"cat /sys/devices/system/cpu/online > {cpu}/online && "
                     f"mount -o remount,ro {root}/sys && mount --rbind /dev {root}/dev && "
                     f"exec chroot {root} /usr/sbin/sshd -D -e -f {session}/sshd_config")
            with log.open("wb") as log_file:
                process = subprocess.Popen(
                    ["timeout", "-s", "KILL", str(BOARD_LIFETIME_S), "unshare", "--mount", "--pid", "--fork",
                     "sh", "-c", inner], stdout=subprocess.DEVNULL, stderr=log_file, start_new_session=True)
            peer = SshdPeer(host="127.0.0.1", port=port, username="root",
                            host_key_fingerprint=sha256_fingerprint(host_key_line), host_key_line=host_key_line,
                            client_key=d / "client_ed25519", known_hosts=known_hosts,
                            empty_known_hosts=d / "empty_known_hosts", fake_bin=Path(BOARD_FAKE_BIN),
                            process=process, log=log)
            try:
                _wait_for_banner(port, process, log, deadline_s=60)  # sshd starts slowly under emulation
                yield peer
            finally:
                peer.kill()
        finally:
            shutil.rmtree(inside, ignore_errors=True)


def main(argv: list[str]) -> int:
    release = argv[1] if len(argv) > 1 else RELEASE
    if argv[:1] == ["build"]:
        started = time.monotonic()
        print(build(release=release))
        print(f"arm-board: ready in {time.monotonic() - started:.0f} s ({cache_dir(release)})")
        return 0
    if argv[:1] == ["shell"]:
        with arm_board(release) as peer:
            print(f"ssh -i {peer.client_key} -o UserKnownHostsFile={peer.known_hosts} -p {peer.port} root@127.0.0.1")
            with contextlib.suppress(KeyboardInterrupt):
                peer.process.wait()
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
