"""The ADB device emulator is faithful: Debian's real `adb` client connects, runs a shell, pushes, pulls.

Everything here is private to the test: HOME, ADB_VENDOR_KEYS and the adb server's port, and the
server is killed at the end, so a developer's own adb server and keys are never touched.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from adb_shell.auth.keygen import keygen

from adb_emulator import AdbDeviceEmulator


def _ensure_adb() -> str | None:
    """Path of Debian's adb, installing the package when we are root and it is missing."""
    found = shutil.which("adb")
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for command in (["apt-get", "install", "-y", "-qq", "adb"], ["apt-get", "update", "-qq"],
                        ["apt-get", "install", "-y", "-qq", "adb"]):
            subprocess.run(command, env=env, capture_output=True, timeout=300)
            if shutil.which("adb"):
                return shutil.which("adb")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab_key(tmp_path: Path) -> Path:
    key = tmp_path / "lab" / "adbkey"
    key.parent.mkdir()
    keygen(str(key))
    return key


@pytest.fixture
def real_adb(tmp_path: Path):
    adb = _ensure_adb()
    if adb is None:
        print("skipping: Debian's adb package is not installed and could not be installed here")
        pytest.skip("Debian's adb client is not available (apt-get install adb failed or not root)")
    home = tmp_path / "home"
    home.mkdir()
    # TMPDIR too: the adb server writes its log there (adb.UID.log), not in the shared /tmp.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "ANDROID_SDK_HOME": str(home),
           "TMPDIR": str(home), "ANDROID_ADB_SERVER_PORT": str(_free_port())}

    def run(*args: str, vendor_keys: Path | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
        full_env = {**env, **({"ADB_VENDOR_KEYS": str(vendor_keys)} if vendor_keys else {})}
        return subprocess.run([adb, *args], env=full_env, capture_output=True, text=True, timeout=timeout)

    yield run
    run("kill-server", timeout=15)


def test_real_adb_client_connects_runs_shell_pushes_and_pulls(tmp_path: Path, lab_key: Path, real_adb):
    with AdbDeviceEmulator(tmp_path / "phone", authorized_keys=[Path(f"{lab_key}.pub").read_text()]) as phone:
        real_adb("start-server", vendor_keys=lab_key)  # the server reads ADB_VENDOR_KEYS when it starts
        assert f"connected to {phone.serial}" in real_adb("connect", phone.serial).stdout
        devices = real_adb("devices", "-l").stdout
        assert f"{phone.serial}" in devices and "device product:lucye_global_com model:LG_H870" in devices

        model = real_adb("-s", phone.serial, "shell", "getprop", "ro.product.model")
        assert (model.returncode, model.stdout) == (0, "LG-H870\n")

        payload = tmp_path / "model.tflite"
        payload.write_bytes(os.urandom(300_000))  # several sync DATA chunks and several WRTE messages
        pushed = real_adb("-s", phone.serial, "push", str(payload), "/data/local/tmp/")
        assert pushed.returncode == 0, pushed.stderr
        assert phone.device_path("/data/local/tmp/model.tflite").read_bytes() == payload.read_bytes()

        digest = real_adb("-s", phone.serial, "shell", "sha256sum /data/local/tmp/model.tflite").stdout
        assert digest.split() == [subprocess.run(["sha256sum", str(payload)], capture_output=True,
                                                 text=True).stdout.split()[0], "/data/local/tmp/model.tflite"]

        back = tmp_path / "back.tflite"
        pulled = real_adb("-s", phone.serial, "pull", "/data/local/tmp/model.tflite", str(back))
        assert pulled.returncode == 0, pulled.stderr
        assert back.read_bytes() == payload.read_bytes()

        missing = real_adb("-s", phone.serial, "pull", "/data/local/tmp/nope", str(tmp_path / "nope"))
        assert missing.returncode != 0 and "does not exist" in missing.stdout + missing.stderr
        assert phone.services_opened.count("sync:") >= 2


def test_real_adb_client_sees_an_unknown_key_as_unauthorized(tmp_path: Path, lab_key: Path, real_adb):
    other = tmp_path / "other" / "adbkey"
    other.parent.mkdir()
    keygen(str(other))
    with AdbDeviceEmulator(tmp_path / "phone", authorized_keys=[Path(f"{other}.pub").read_text()]) as phone:
        real_adb("start-server", vendor_keys=lab_key)
        real_adb("connect", phone.serial, vendor_keys=lab_key)
        devices = ""
        for _ in range(20):  # the server finishes the handshake in the background
            devices = real_adb("devices").stdout
            if "unauthorized" in devices:
                break
            subprocess.run(["sleep", "0.2"])
        assert f"{phone.serial}\tunauthorized" in devices
        assert phone.offered_keys, "the host should have offered its public key for the user to allow"
        shell = real_adb("-s", phone.serial, "shell", "true")
        assert shell.returncode != 0 and "unauthorized" in shell.stderr
