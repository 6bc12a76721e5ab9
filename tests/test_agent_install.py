"""An agent-only host installs farm's base distribution (no extras): built as a wheel from this tree and
installed in a fresh venv, it has none of the controller's stack, runs a real controller's sim task, and a
command that needs an extra names it instead of a traceback. The base's requirements come from PyPI once
and are kept in /var/cache/farm-tests/base-install/ (the test skips, saying so, when PyPI is unreachable)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cache_lock import cache_lock

from grpc_processes import _die_with_parent, in_process_cluster, wait_for

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.wheel, pytest.mark.timeout(900)]
CONTROLLER_STACK = ("scipy", "matplotlib", "sqlite_utils", "croniter", "prometheus_client", "grpc_health",
                    "grpc_reflection", "pandas", "docker")
WHEELS = Path("/var/cache/farm-tests/base-install")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def agent_bin(tmp_path_factory: pytest.TempPathFactory, farm_wheel: Path) -> Path:
    root = tmp_path_factory.mktemp("base-install")
    # without --system-site-packages; this session's pip installs into it (--python: the venv's own pip would cost
    # ~7 CPU-s to seed), without byte-compiling every module (--no-compile: Python compiles what it imports)
    _run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")])
    pip = [sys.executable, "-m", "pip", "--python", str(root / "venv" / "bin" / "python"), "install", "--quiet",
           "--no-compile", "--no-index", "--find-links", str(WHEELS), str(farm_wheel)]
    if subprocess.run(pip, capture_output=True, timeout=600).returncode != 0:  # the cache lacks a requirement
        with cache_lock(WHEELS):  # one test run fills it at a time
            _fill_wheels(farm_wheel)
        _run(pip, cwd=root)
    return root / "venv" / "bin"


def _fill_wheels(farm_wheel: Path) -> None:
    # pip wheel, not pip download: a requirement published only as an sdist (adb-shell) is cached built
    fetched = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(WHEELS),
                              str(farm_wheel)], capture_output=True, text=True, timeout=600)
    for stale in [*WHEELS.glob("farm-*.whl"), *WHEELS.glob("*.tar.gz")]:  # the tree's wheel is rebuilt each session
        stale.unlink()
    if fetched.returncode != 0:
        pytest.skip(f"PyPI unreachable for the base install's requirements: {fetched.stderr.strip()[-300:]}")


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FARM_", "PYTHON", "VIRTUAL_ENV"))}
    return {**env, "HOME": str(tmp_path / "home"), "FARM_DB": str(tmp_path / "farm.db")}


def test_the_agent_install_lacks_the_controller_stack(agent_bin: Path, tmp_path: Path) -> None:
    probe = ("import importlib.util, json, farm\n"
             f"print(json.dumps([farm.__file__, [m for m in {CONTROLLER_STACK!r} if importlib.util.find_spec(m)]]))\n")
    where, present = json.loads(_run([str(agent_bin / "python"), "-c", probe], cwd=tmp_path, env=_env(tmp_path)).stdout)
    assert "site-packages" in where and not Path(where).is_relative_to(ROOT)
    assert present == []
    pip_list = _run([sys.executable, "-m", "pip", "--python", str(agent_bin / "python"), "list", "--format=json"],
                    cwd=tmp_path).stdout
    assert "farm" in {d["name"] for d in json.loads(pip_list)}


def test_the_agent_command_runs_in_the_base_install(agent_bin: Path, tmp_path: Path) -> None:
    p = _run([str(agent_bin / "farm"), "agent", "--help"], cwd=tmp_path, env=_env(tmp_path))
    assert "--controller" in p.stdout


@pytest.mark.parametrize("command, extras", [(["calibrate"], "farm[analysis]"),
                                             (["web"], "farm[web]"),
                                             (["jobs"], "farm[controller]")])
def test_a_command_that_needs_an_extra_names_it(agent_bin: Path, tmp_path: Path, command: list[str],
                                                extras: str) -> None:
    p = subprocess.run([str(agent_bin / "farm"), *command], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env=_env(tmp_path))
    assert p.returncode == 3, p.stdout + p.stderr
    message = " ".join(p.stderr.split())  # rich wraps the paragraph at the terminal's width
    assert f"pip install '{extras}'" in message, message
    assert "Traceback" not in p.stderr
    if command == ["calibrate"]:
        assert "`farm calibrate` needs the 'analysis' extra" in message, message


def test_the_agent_install_runs_a_controllers_sim_task(agent_bin: Path, tmp_path: Path, tiny_models,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # the agent from the base install is the process under test; the controller and the `farm` calls that watch it
    # run on threads of this process (issue 34: each `farm agents` poll was a process start)
    cluster = in_process_cluster(tmp_path, monkeypatch)
    try:
        cluster.serve_in_process()
        log = tmp_path / "slim-agent.log"
        with log.open("ab") as handle:
            agent = subprocess.Popen([str(agent_bin / "farm"), "agent", "--controller", str(cluster.address), "--name",
                                      "slim", "--work-dir", str(tmp_path / "work-slim")], stdout=handle,
                                     stderr=subprocess.STDOUT, cwd=tmp_path, env=_env(tmp_path),
                                     preexec_fn=_die_with_parent)
        try:
            wait_for(lambda: "slim" in cluster.farm("agents", "--controller", str(cluster.address)).stdout, 60,
                     "the agent from the base install to register")
            os.symlink(tiny_models["onnx"], tmp_path / "tiny.onnx")
            (tmp_path / "job.yaml").write_text("models: [tiny.onnx]\nworkload: {iterations: 5, warmup: 1}\n"
                                               "sim: {on_contention: flag}\n")
            run = cluster.farm("submit", str(tmp_path / "job.yaml"), "--controller", str(cluster.address), "--json",
                               timeout=300)
            assert run.returncode == 0, run.stderr + run.stdout[:3000] + log.read_text(errors="replace")[-2000:]
            (result,) = json.loads(run.stdout)["results"]
            assert result["status"] == "completed" and result["latency_ms"]["avg"] > 0, result
        finally:
            agent.terminate()
            agent.wait(30)
    finally:
        cluster.stop_all()


def test_the_python_apis_pandas_frame_names_its_extra(agent_bin: Path, tmp_path: Path) -> None:
    probe = ("from farm.api import Results\nfrom farm.client.api import FarmError\n"
             "try:\n    Results([]).to_pandas()\nexcept FarmError as e:\n    print(e)\n")
    message = _run([str(agent_bin / "python"), "-c", probe], cwd=tmp_path, env=_env(tmp_path)).stdout
    assert "pip install 'farm[pandas]'" in message, message
