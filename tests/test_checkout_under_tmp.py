"""A checkout under /tmp runs its sim jobs: runs as `nobody` get a private /tmp, so every folder
farm's code lives in there is bound back read-only. A checkout has one folder per role (agents/,
proto/, models/, controller/, cli/, farm/) beside its venv — more than the sandbox's entry script
can hold one by one — and `make demo` from such a clone once failed every run with
"No module named 'farm.proto'"."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import write_job

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.wheel, pytest.mark.cgroup, pytest.mark.timeout(900)]


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_a_checkout_under_tmp_runs_its_sim_jobs_in_namespaces(tmp_path: Path, tiny_models) -> None:
    if os.geteuid() != 0:
        pytest.skip("runs as nobody in namespaces need root")
    assert str(tmp_path).startswith("/tmp/")
    clone = tmp_path / "checkout"  # the committed code (HEAD), as CI and a user clone it
    p = _run(["git", "clone", "--quiet", str(ROOT), str(clone)], cwd=tmp_path)
    if p.returncode != 0:
        pytest.skip(f"cannot clone this checkout: {p.stderr[-300:]}")
    # a venv of its own for the clone's editable install; the libraries (pip and setuptools too) come
    # from this environment, so nothing is downloaded
    venv = clone / ".venv"
    assert _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=clone).returncode == 0
    (site_dir,) = venv.glob("lib/python3*/site-packages")
    (site_dir / "libraries.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    install = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "-e", str(clone)], cwd=clone)
    assert install.returncode == 0, install.stderr[-3000:]

    shutil.copy(tiny_models["tflite"], tmp_path / "tiny.tflite")
    job = write_job(tmp_path, "name: tmp-checkout\nmodels: [tiny.tflite]\n"
                              "workload: {type: benchmark, iterations: 3, warmup: 1}\n"
                              "sim: {cpus: 1, memory: 512m, backend: cgroup}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FARM_", "PYTHON", "VIRTUAL_ENV"))}
    env["FARM_DB"] = str(tmp_path / "farm.db")
    run = _run([str(venv / "bin" / "farm"), "submit", str(job), "--json"], cwd=tmp_path, env=env)
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
