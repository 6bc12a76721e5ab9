"""What the arm64 board's test files share (issue 34: the board's tests were one ~5-minute file on one xdist
worker; split, its long tests land on different workers): the board fixture, the set-up run that makes the
runtimes' venv on the board, the driver config and task builders, the emulated board type.

Each test file that imports the fixtures starts its own emulated sshd from the one cached root
(tests/arm_board.py; built once, under the cache's file lock). The runtimes' venv lives in the root, under
REMOTE_DIR/venvs, made once under the board harness's own lock, so the second file's set-up reuses it; uploads by
hash go to per-upload partial files, so two boards pushing the same harness or model at once do not collide."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from farm.agents.boards.driver import BoardDeviceConfig, BoardDriver
from farm.proto.results import RunResult
from farm.proto.tasks import TaskPlan, TaskSpec
from sshd_peer import SshdPeer

RUNTIMES = ["numpy", "onnxruntime", "ai-edge-litert"]
REMOTE_DIR = "/tmp/farm"  # on the board; the runtimes' venv stays there between sessions, as on a real board

SETUP = """
import platform, sys, time
import numpy, onnxruntime
from ai_edge_litert.interpreter import Interpreter
print("machine", platform.machine(), "python", platform.python_version(), "exe", sys.executable)
print("numpy", numpy.__version__, "onnxruntime", onnxruntime.__version__)
blob = bytearray(40 * 2**20)  # a peak the board's /proc must see
t = time.perf_counter(); sum(range(200000)); print("latency_ms: %.3f" % ((time.perf_counter() - t) * 1000))
"""

# The board's /proc sampler is a shell loop of date, grep, grep and sleep: four emulated process starts a tick, about
# 0.2 CPU-s under qemu-user (measured, issue 34), so at 100 ms it wants more than this machine's two cores and slows
# the run it samples. Telemetry is what these tests check, not its density: one tick a second (and one at the start).
SAMPLE_INTERVAL_MS = 1000


@pytest.fixture(scope="module", name="arm")
def arm_fixture() -> SshdPeer:
    from arm_board import ArmBoardUnavailable, arm_board
    try:
        with arm_board() as peer:
            yield peer
    except ArmBoardUnavailable as e:
        print(f"skipping: {e}")
        pytest.skip(f"the arm64 board cannot be built or started here: {e}")


def board_config(peer: SshdPeer, python: str = "python3", **kw) -> BoardDeviceConfig:
    kw.setdefault("remote_dir", REMOTE_DIR)
    return BoardDeviceConfig(name="arm-1", kind="linux", host=peer.host, port=peer.port, username=peer.username,
                             key_path=peer.client_key, known_hosts=peer.known_hosts, python=python,
                             sample_interval_ms=SAMPLE_INTERVAL_MS, **kw)


def board_task(model: Path, workload: dict, timeout_s: float = 600, task_id: int = 21) -> TaskSpec:
    return TaskSpec(task_id=task_id, job_id=1, attempt=1, target="arm-1", model_name=model.stem,
                    model_path=str(model), model_sha256="", model_family=None, threads=1, batch_size=1,
                    input_size=None, repeat=0, plan=TaskPlan(workload=workload, sim={}, run_timeout_s=timeout_s,
                    base_dir=str(model.parent)))


def script_workload(tmp: Path, text: str, requirements: list[str], name: str = "job") -> dict:
    d = tmp / name
    d.mkdir(exist_ok=True)
    (d / "work.py").write_text(text)
    return {"type": "script", "command": "python", "script": "work.py", "args": [], "dir": f"../{d.name}",
            "pip_requirements": requirements}


@pytest.fixture(scope="module", name="setup_run")
def setup_run_fixture(arm: SshdPeer, mobilenet_models, tmp_path_factory) -> RunResult:
    """A script job that needs the runtimes: the harness makes the board's venv from the aarch64 wheels."""
    tmp = tmp_path_factory.mktemp("arm-setup")
    model = mobilenet_models["mobilenetv2_w0.35_r96.onnx"]
    workload = script_workload(tmp, SETUP, RUNTIMES)
    workload["dir"] = str(tmp / "job")
    return BoardDriver(board_config(arm, env_timeout_s=1200)).run(board_task(model, workload), lambda: False)


EMULATED_TYPE = """
# The tests' arm64 board: Debian bookworm under qemu-user on the test machine. Pure Python runs there
# about 9x slower than natively (issue 24), so a job's sim-sized timeouts get 10x on it.
name: emulated-arm64
os: linux
abi: aarch64
memory_mb: 2048
clusters:
  - {kind: big, count: 1, max_mhz: 1000, core: qemu-user}
native_tool: {name: harness, telemetry: [proc]}
sim_budget:
  "1": {cpus: 1, memory: 2g}
relative_speed: 0.1
"""


def emulated_type(tmp: Path):
    from farm.proto.device_types import load_device_type
    path = tmp / "emulated_arm64.yaml"
    path.write_text(EMULATED_TYPE)
    return load_device_type(path)


def board_lab(tmp: Path, peer: SshdPeer, setup: RunResult) -> tuple[Path, dict[str, str]]:
    """A lab file with the board as arm-1 of the emulated type, and the environment that finds the type."""
    assert setup.ok, setup.message
    problem = sim_run_user_problem()
    if problem:
        pytest.skip(problem)
    types = tmp / "types"
    types.mkdir()
    emulated_type(types)
    lab = tmp / "lab.yaml"
    lab.write_text(f"""
devices:
  - {{name: arm-1, driver: linux, type: emulated-arm64, host: {peer.host}, port: {peer.port}, username: root,
     ssh_key: {peer.client_key}, known_hosts: {peer.known_hosts}, python: {setup.environment['venv_python']}}}
""")
    return lab, {"FARM_DEVICE_TYPES": str(types)}


def sim_run_user_problem() -> str | None:
    """Why the sim's twins cannot start here: as root, the sim runs jobs as nobody, who must be able to run
    this Python and import farm's dependencies (a Python under a 0700 home cannot be)."""
    import subprocess
    import sys
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return None
    probe = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c",
                            "import pydantic"], capture_output=True, text=True, timeout=60)
    if probe.returncode == 0:
        return None
    return (f"the sim runs jobs as nobody, who cannot run this Python and its packages ({sys.executable}): "
            f"{probe.stderr.strip()[-200:]}; give others search permission on its folders")
