"""The nightly refresh works from a normal install: farm is built as a wheel, installed into a
fresh venv (no site packages, nothing from this checkout), and `farm refresh` run from an
unrelated directory finds the reference suite that ships inside the package and generates its
models into the data directory. The controller's --refresh-cron path submits the same suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adb_emulator import AdbDeviceEmulator
from farm.agents.android.adb import load_or_create_lab_key

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.wheel, pytest.mark.timeout(900)]


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory, farm_wheel: Path) -> Path:
    """bin/ of a fresh venv holding farm installed from its wheel, its dependencies (the nightly needs the controller
    and analysis extras) from a base cached per requirement list (tests/wheel_deps.py: installing them each run was
    ~80 CPU-s). Without --system-site-packages; --no-compile: the modules a test imports compile as Python loads them."""
    from wheel_deps import install_wheel
    return install_wheel(farm_wheel, "all", tmp_path_factory.mktemp("wheel") / "venv")


def _clean_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FARM_", "PYTHON", "VIRTUAL_ENV"))}
    (tmp_path / "data").mkdir(exist_ok=True)  # a store path someone gives must be in a folder that exists
    return {**env, "FARM_DB": str(tmp_path / "data" / "farm.db"), "HOME": str(tmp_path / "home")}


def test_the_installed_package_is_the_wheel_not_this_checkout(installed: Path, tmp_path: Path) -> None:
    where = _run([str(installed / "python"), "-c", "import farm; print(farm.__file__)"],
                 cwd=tmp_path, env=_clean_env(tmp_path)).stdout.strip()
    assert "site-packages" in where and not Path(where).is_relative_to(ROOT)
    assert Path(where).is_relative_to(installed.parent), where  # the venv's own wheel, not the cached dependencies'
    # what the wheel declares is installed and consistent (pip reads the venv's path, the cached base included)
    check = _run([sys.executable, "-m", "pip", "--python", str(installed / "python"), "check"], cwd=tmp_path,
                 env=_clean_env(tmp_path))
    assert "No broken requirements found" in check.stdout, check.stdout


def test_farm_refresh_runs_the_bundled_suite_from_a_wheel(installed: Path, tmp_path: Path) -> None:
    key = tmp_path / "adbkey"
    load_or_create_lab_key(key)
    env = _clean_env(tmp_path)
    with AdbDeviceEmulator(tmp_path / "phone", authorized_keys=[Path(f"{key}.pub").read_text()]) as phone:
        lab = tmp_path / "lab.yaml"
        lab.write_text(f"devices:\n  - {{name: g6-1, driver: android, type: lg-g6, host: 127.0.0.1, "
                       f"port: {phone.port}, adb_key: {key}}}\n")
        # This test is about the wheel, not the machine: on a busy host contended sim runs would be left
        # out of the fit (tests/test_contention.py checks that), so they are kept here.
        refresh = _run([str(installed / "farm"), "refresh", "--devices", str(lab), "--json", "--include-contended"],
                       cwd=tmp_path, env=env, timeout=900)
    report = json.loads(refresh.stdout)
    assert {c["threads"] for c in report["calibrations"] if c["device"] == "g6-1" and c["family"] is None} == {1, 2}, \
        json.dumps({k: v for k, v in report.items() if k != "calibrations"} | {"fits": [(c["device"], c["family"], c["threads"]) for c in report["calibrations"]]})
    models = tmp_path / "data" / "reference-suite" / "models"  # generated beside the store, on first use
    assert sorted(p.name for p in models.iterdir()) == [
        f"mobilenetv2_w{w}_r160.tflite" for w in ("0.35", "0.5", "0.75", "1.0", "1.4")]
    jobs = json.loads(_run([str(installed / "farm"), "jobs", "--json"], cwd=tmp_path, env=env).stdout)
    assert [(j["name"], j["status"], j["completed"], j["tasks"]) for j in jobs] == [("reference-suite", "completed", 20, 20)]

    # the controller's nightly path (what --refresh-cron calls) submits the same bundled suite, as a health check
    script = ("from farm.controller.operations.nightly import Cron, NightlyRefresh\n"
              "from farm.controller.scheduling.jobfile import DeviceTarget\n"
              "from farm.controller.store import SQLiteStore as Store, default_db_path\n"
              "store = Store(default_db_path())\n"
              "job = NightlyRefresh(store, None, Cron.parse('@daily'), lambda: [DeviceTarget('g6-1')]).submit()\n"
              "row = store.jobs.get(job)\n"
              "print(row.name, row.kind, row.priority, len(store.jobs.tasks(job)))\n")
    nightly = _run([str(installed / "python"), "-c", script], cwd=tmp_path, env=env)
    assert nightly.stdout.split() == ["reference-suite", "health_check", "low", "20"], nightly.stderr
