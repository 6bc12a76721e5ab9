"""The board path on a real foreign architecture: a Debian arm64 board (tests/arm_board.py) whose
binaries run under qemu-user, reached over its own sshd. Its runtimes come from aarch64 wheels that
farm's own board set-up (a script's pip requirements → the harness's cached venv) installs from the
board's offline wheelhouse; then benchmark and script workloads run there with the harness pushed
by hash. `pytest -k aarch64` runs this module alone."""

from __future__ import annotations

import io
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from farm.agents.boards.driver import BoardDeviceConfig, BoardDriver
from farm.proto.results import RunResult
from farm.proto.tasks import TaskPlan, TaskSpec
from sshd_peer import SshdPeer

pytestmark = [pytest.mark.timeout(1800)]
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


@pytest.fixture(scope="module")
def arm() -> SshdPeer:
    from arm_board import ArmBoardUnavailable, arm_board
    try:
        with arm_board() as peer:
            yield peer
    except ArmBoardUnavailable as e:
        print(f"skipping: {e}")
        pytest.skip(f"the arm64 board cannot be built or started here: {e}")


# The board's /proc sampler is a shell loop of date, grep, grep and sleep: four emulated process starts a tick, about
# 0.2 CPU-s under qemu-user (measured, issue 34), so at 100 ms it wants more than this machine's two cores and slows
# the run it samples. Telemetry is what these tests check, not its density: one tick a second (and one at the start).
SAMPLE_INTERVAL_MS = 1000


def _config(peer: SshdPeer, python: str = "python3", **kw) -> BoardDeviceConfig:
    return BoardDeviceConfig(name="arm-1", kind="linux", host=peer.host, port=peer.port, username=peer.username,
                             key_path=peer.client_key, known_hosts=peer.known_hosts, python=python,
                             remote_dir=REMOTE_DIR, sample_interval_ms=SAMPLE_INTERVAL_MS, **kw)


def _task(model: Path, workload: dict, timeout_s: float = 600, task_id: int = 21) -> TaskSpec:
    return TaskSpec(task_id=task_id, job_id=1, attempt=1, target="arm-1", model_name=model.stem,
                    model_path=str(model), model_sha256="", model_family=None, threads=1, batch_size=1,
                    input_size=None, repeat=0, plan=TaskPlan(workload=workload, sim={}, run_timeout_s=timeout_s,
                    base_dir=str(model.parent)))


def _script_workload(tmp: Path, text: str, requirements: list[str], name: str = "job") -> dict:
    d = tmp / name
    d.mkdir(exist_ok=True)
    (d / "work.py").write_text(text)
    return {"type": "script", "command": "python", "script": "work.py", "args": [], "dir": f"../{d.name}",
            "pip_requirements": requirements}


@pytest.fixture(scope="module")
def setup_run(arm: SshdPeer, mobilenet_models, tmp_path_factory) -> RunResult:
    """A script job that needs the runtimes: the harness makes the board's venv from the aarch64 wheels."""
    tmp = tmp_path_factory.mktemp("arm-setup")
    model = mobilenet_models["mobilenetv2_w0.35_r96.onnx"]
    workload = _script_workload(tmp, SETUP, RUNTIMES)
    workload["dir"] = str(tmp / "job")
    return BoardDriver(_config(arm, env_timeout_s=1200)).run(_task(model, workload), lambda: False)


def test_aarch64_runtimes_install_from_wheels_by_the_board_setup(setup_run: RunResult) -> None:
    assert setup_run.ok, setup_run.message + setup_run.log_tail
    assert "machine aarch64 python 3.11" in setup_run.log_tail
    assert setup_run.environment["venv_python"].startswith(f"{REMOTE_DIR}/venvs/venv-")
    assert setup_run.environment["device"]["arch"] == "aarch64"  # the architecture, in the result's environment
    assert setup_run.environment["device"]["python"].startswith("3.11.")
    # the script's own peak, measured by the harness from the board's /proc, holds its 40 MiB buffer
    assert setup_run.environment["process_memory"]["peak_bytes"] > 40 * 2**20
    assert len(setup_run.environment["board_harness_sha256"]) == 64
    assert "energy_mj" not in setup_run.environment and setup_run.environment["telemetry_source"] == "proc"


@pytest.mark.parametrize("name", ["mobilenetv2_w0.35_r96.onnx", "mobilenetv2_w0.35_r96.tflite"])
def test_aarch64_benchmark_runs_in_the_runtimes_venv(arm: SshdPeer, setup_run: RunResult, mobilenet_models,
                                                     name: str) -> None:
    assert setup_run.ok, setup_run.message
    model = mobilenet_models[name]
    workload = {"type": "benchmark", "iterations": 5, "warmup": 1, "use_xnnpack": True}
    result = BoardDriver(_config(arm, python=setup_run.environment["venv_python"])).run(
        _task(model, workload, task_id=22), lambda: False)
    assert result.ok, result.message + result.log_tail
    assert len(result.iterations_ms) == 5 and result.latency.avg > 0
    assert result.environment["device"]["arch"] == "aarch64"
    assert result.telemetry.samples and result.telemetry.memory_peak_bytes > 0  # the board's own /proc
    assert result.peak_rss_bytes and result.peak_rss_bytes > result.baseline_memory_bytes
    assert "energy_per_inference_mj" not in result.environment  # a plain Linux board has no power rails
    assert result.wall_s > sum(result.iterations_ms) / 1000  # the per-run overhead is the difference


def test_aarch64_harness_is_pushed_once_by_hash_and_checked(arm: SshdPeer, setup_run: RunResult,
                                                            mobilenet_models) -> None:
    from farm.agents.board_harness import HARNESS_FILE
    from farm.agents.boards.ssh_transport import SshTransport, file_sha256
    sha = file_sha256(HARNESS_FILE)
    assert setup_run.environment["board_harness_sha256"] == sha
    config = _config(arm)
    with SshTransport(config.target()) as ssh:
        _, listing, _ = ssh.run(f"sha256sum {REMOTE_DIR}/{sha}.py", 60)
        assert listing.split()[0] == sha
        ssh.run(f"echo tampered >> {REMOTE_DIR}/{sha}.py", 60)  # a changed file on the board is never run
    workload = {"type": "benchmark", "iterations": 2, "warmup": 0, "use_xnnpack": True}
    result = BoardDriver(config).run(_task(mobilenet_models["mobilenetv2_w0.35_r96.onnx"], workload), lambda: False)
    # the probe saw a different hash, so the harness went again; the run starts and needs its runtime
    assert result.environment["board_harness_sha256"] == sha
    assert result.failure_class == "job" and "no numpy" in result.message  # the system python3 has no runtime
    with SshTransport(config.target()) as ssh:
        _, listing, _ = ssh.run(f"sha256sum {REMOTE_DIR}/{sha}.py", 60)
    assert listing.split()[0] == sha


def test_aarch64_a_wheel_without_an_aarch64_build_names_package_and_platform(arm: SshdPeer, mobilenet_models,
                                                                           tmp_path: Path) -> None:
    from arm_board import BOARD_WHEELHOUSE, cache_dir
    # a wheelhouse holding the package for x86_64 only, as many binary packages ship
    wheel = cache_dir() / "root" / BOARD_WHEELHOUSE.lstrip("/") / "farm_x86_only-1.0-py3-none-manylinux2014_x86_64.whl"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("farm_x86_only/__init__.py", "")
        z.writestr("farm_x86_only-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: farm-x86-only\nVersion: 1.0\n")
        z.writestr("farm_x86_only-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: false\n"
                   "Tag: py3-none-manylinux2014_x86_64\n")
        z.writestr("farm_x86_only-1.0.dist-info/RECORD", "")
    wheel.write_bytes(buffer.getvalue())
    try:
        workload = _script_workload(tmp_path, "print('never')", ["farm-x86-only"])
        workload["dir"] = str(tmp_path / "job")
        result = BoardDriver(_config(arm)).run(_task(mobilenet_models["mobilenetv2_w0.35_r96.onnx"], workload),
                                               lambda: False)
    finally:
        wheel.unlink()
    assert result.failure_class == "job"
    assert "farm-x86-only" in result.message and "aarch64" in result.message, result.message


def test_aarch64_a_board_python_older_than_the_harness_supports_is_refused(arm: SshdPeer, mobilenet_models) -> None:
    from arm_board import cache_dir
    # the interpreter an old board image ships (Debian stretch's python3 is 3.5): it answers the version probe
    old = cache_dir() / "root" / "usr/local/bin/python3.5"
    old.write_text("#!/bin/sh\necho 3.5.3\n")
    old.chmod(0o755)
    try:
        workload = {"type": "benchmark", "iterations": 2, "warmup": 0, "use_xnnpack": True}
        result = BoardDriver(_config(arm, python="/usr/local/bin/python3.5")).run(
            _task(mobilenet_models["mobilenetv2_w0.35_r96.onnx"], workload), lambda: False)
    finally:
        old.unlink()
    assert result.failure_class == "infrastructure"
    assert "3.5.3" in result.message and "3.6 or newer" in result.message


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


def _emulated_type(tmp: Path):
    from farm.proto.device_types import load_device_type
    path = tmp / "emulated_arm64.yaml"
    path.write_text(EMULATED_TYPE)
    return load_device_type(path)


def test_aarch64_a_slow_board_gets_the_timeout_its_type_declares(arm: SshdPeer, mobilenet_models,
                                                               tmp_path: Path) -> None:
    workload = _script_workload(tmp_path, "import time; time.sleep(4); print('latency_ms: 1')", [])
    workload["dir"] = str(tmp_path / "job")
    task = _task(mobilenet_models["mobilenetv2_w0.35_r96.onnx"], workload, timeout_s=2)
    # written for the sim, 2 s is too short for this board's 4 s of work (and its slow start)…
    plain = BoardDriver(_config(arm)).run(task, lambda: False)
    assert plain.failure_class == "timeout", plain.message
    assert plain.environment["run_timeout_s"] == 2
    # …but the board type says it is ten times slower than the sim, so it gets 20 s
    slow = BoardDriver(_config(arm), _emulated_type(tmp_path)).run(task, lambda: False)
    assert slow.ok, slow.message + slow.log_tail
    assert slow.environment["run_timeout_s"] == 20 and slow.whole_run_s >= 4


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


# each emulated inference costs ~10-30x a native one (issue 34): five a run still average out a busy host's
# spikes in the sim twins, and the latency fit needs their ranking, not more precision
FAMILY_ITERATIONS = 5


def test_aarch64_mobilenet_family_pairs_with_sim_twins_calibrates_and_predicts(
        arm: SshdPeer, setup_run: RunResult, tmp_path: Path, farm) -> None:
    import json

    from farm.model_generators.generate import generate_examples
    assert setup_run.ok, setup_run.message
    problem = sim_run_user_problem()
    if problem:
        pytest.skip(problem)
    models = tmp_path / "models"
    generate_examples(models, widths=[0.35, 0.5, 0.75, 1.0, 1.4], input_sizes=[96], formats=["tflite"], zoo=False)
    types = tmp_path / "types"
    types.mkdir()
    _emulated_type(types)
    lab = tmp_path / "lab.yaml"
    lab.write_text(f"""
devices:
  - {{name: arm-1, driver: linux, type: emulated-arm64, host: {arm.host}, port: {arm.port}, username: root,
     ssh_key: {arm.client_key}, known_hosts: {arm.known_hosts}, python: {setup_run.environment['venv_python']}}}
""")
    train = [f"mobilenetv2_w{w}_r96.tflite" for w in ("0.35", "0.5", "0.75", "1.4")]
    job = tmp_path / "arm.yaml"
    job.write_text(f"""
name: arm-mobilenetv2
models: [{", ".join(f"{{path: models/{m}, family: mobilenetv2}}" for m in train)}]
workload: {{type: benchmark, iterations: {FAMILY_ITERATIONS}, warmup: 1}}
matrix: {{threads: [1]}}
targets: [arm-1]
sim: {{cpus: 1, memory: 2g}}
""")
    env = {"FARM_DEVICE_TYPES": str(types)}
    run = farm("submit", str(job), "--devices", str(lab), "--json", env=env, timeout=1200)
    records = run.json()["results"]
    assert run.returncode == 0, [(r["target"], r["failure_class"], r["message"]) for r in records] or run.stderr[-3000:]
    assert len(records) == 4 * 2 and all(r["status"] == "completed" for r in records)
    assert {r["target"] for r in records} == {"arm-1", "sim"}  # each board run beside its sim twin

    cal = farm("calibrate", "--job", "1", "--device", "arm-1", "--metric", "latency", "--metric", "peak_memory",
               "--include-contended", "--json", env=env)
    assert cal.returncode == 0, cal.stderr + cal.stdout
    fits = {c["metric"]: c for c in cal.json()["calibrations"]}
    latency = fits["latency"]
    assert latency["n"] == 4
    history = farm("calibrations", "--device", "arm-1", "--json", env=env).json()
    assert history and all(r["runtime"].endswith(";arch=aarch64") or r["runtime"].endswith("@arch=aarch64")
                           for r in history), history  # the architecture is in the calibration key
    assert latency["fits"]["ols"]["a"] > 1  # the emulated board is slower than the sim per unit of sim time
    pred = farm("predict", str(models / "mobilenetv2_w1.0_r96.tflite"), "--device", "arm-1", "--json", env=env)
    assert pred.returncode == 0, pred.stderr
    p = next(p for p in pred.json() if p["metric"] == "latency")
    assert p["low"] <= p["estimate"] <= p["high"] and p["estimate"] > p["sim"]
    # the board's own measurement of the held-out model, for BENCHMARKS.md (not asserted: a busy host moves it)
    actual = BoardDriver(_config(arm, python=setup_run.environment["venv_python"])).run(_task(
        models / "mobilenetv2_w1.0_r96.tflite", {"type": "benchmark", "iterations": FAMILY_ITERATIONS, "warmup": 1}),
        lambda: False)
    assert actual.ok, actual.message
    print("AARCH64-CALIBRATION", json.dumps({"latency": {k: latency.get(k) for k in (
        "kind", "n", "r2", "loo_mape", "loo_within_10", "kendall_tau", "spearman_rho", "formula", "features_used")},
        "ols": latency["fits"]["ols"], "peak_memory": {k: fits.get("peak_memory", {}).get(k) for k in (
            "kind", "n", "r2", "loo_mape", "spearman_rho", "formula")},
        "predicted_w1.0": {k: p[k] for k in ("sim", "estimate", "low", "high")}, "key": history[0]["runtime"],
        "measured_w1.0": actual.latency.avg}, default=str))


# the short form of examples/jetson-experiment.yaml: four of each family (a fit needs four models), the
# smallest of the published ones, one inference a run (whole_run is the metric: the script's start, model load
# and inference, which one inference already has), one repeat (emulated onnxruntime is slow)
JETSON_SHORT = {"image": ["shufflenetv2_x0.5", "squeezenet1_1", "mobilenetv2_w1.0_r224", "resnet18"],
                "video": ["shufflenetv2_3d_x0.25", "shufflenetv2_3d_x0.5", "shufflenetv2_3d_x1", "mobilenetv2_3d_x0.25"]}


def test_aarch64_jetson_experiment_short_form_pairs_and_calibrates_per_family(
        arm: SshdPeer, setup_run: RunResult, tmp_path: Path, farm) -> None:
    import json

    from farm.model_generators.generate import serialize_onnx
    from farm.model_generators.published_nets import JETSON_EXPERIMENT_MODELS
    assert setup_run.ok, setup_run.message
    problem = sim_run_user_problem()
    if problem:
        pytest.skip(problem)
    examples = Path(__file__).resolve().parents[1] / "examples"
    shutil.copy(examples / "jetson-experiment.yaml", tmp_path / "jetson-experiment.yaml")
    shutil.copytree(examples / "jetson-experiment", tmp_path / "jetson-experiment")
    (tmp_path / "models").mkdir()
    wanted = {name: family for family, names in JETSON_SHORT.items() for name in names}
    for model in JETSON_EXPERIMENT_MODELS:
        if model.name in wanted:
            assert model.family == wanted[model.name]
            (tmp_path / "models" / f"{model.name}.onnx").write_bytes(serialize_onnx(model.build(seed=0)))
    types = tmp_path / "types"
    types.mkdir()
    _emulated_type(types)
    lab = tmp_path / "lab.yaml"
    lab.write_text(f"""
devices:
  - {{name: arm-1, driver: linux, type: emulated-arm64, host: {arm.host}, port: {arm.port}, username: root,
     ssh_key: {arm.client_key}, known_hosts: {arm.known_hosts}, python: {setup_run.environment['venv_python']}}}
""")
    models = ", ".join(f"{{path: models/{name}.onnx, family: {family}}}" for name, family in wanted.items())
    env = {"FARM_DEVICE_TYPES": str(types)}
    run = farm("submit", "jetson-experiment.yaml", "--devices", str(lab), "--json", "--set", f"models=[{models}]",
               "--set", "repeats=1", "--set", 'workload.args=["{model}","{threads}","{batch_size}","1"]',
               "--set", "targets=[arm-1]", "--set", "sim.memory=2g", env=env, timeout=1500)
    records = run.json()["results"]
    assert run.returncode == 0, [(r["target"], r["failure_class"], r["message"]) for r in records] or run.stderr[-3000:]
    assert len(records) == 8 * 2 and all(r["status"] == "completed" for r in records)
    assert {r["target"] for r in records} == {"arm-1", "sim"}  # each board run beside its sim twin

    cal = farm("calibrate", "--job", "1", "--device", "arm-1", "--metric", "whole_run", "--include-contended",
               "--json", env=env)
    assert cal.returncode == 0, cal.stderr + cal.stdout
    fits = {c["family"]: c for c in cal.json()["calibrations"] if c["metric"] == "whole_run"}
    assert {"image", "video"} <= set(fits), cal.stdout  # calibrated apart, as the published figures 3 and 4
    for family in ("image", "video"):
        assert fits[family]["n"] == 4 and fits[family]["kind"], fits[family]
    print("AARCH64-JETSON", json.dumps({family: {k: fit.get(k) for k in (
        "kind", "n", "r2", "loo_mape", "spearman_rho", "formula", "runtime")} for family, fit in fits.items()}
        | {"pairs": [(r["model"], r["target"], r.get("whole_run_s")) for r in records]}, default=str))



# --- a second board with an older Python: Debian bullseye arm64 (3.9; buster is gone from the registry) ----

@pytest.fixture(scope="module")
def arm_bullseye() -> SshdPeer:
    from arm_board import ArmBoardUnavailable, arm_board
    try:
        with arm_board("bullseye") as peer:
            yield peer
    except ArmBoardUnavailable as e:
        pytest.skip(f"the bullseye arm64 board cannot be built or started here: {e}")


def test_aarch64_bullseye_board_runs_the_harness_on_its_python_39(arm_bullseye: SshdPeer, mobilenet_models,
                                                                  tmp_path: Path) -> None:
    """The harness's older-Python claim on a real older interpreter: the runtimes' venv made by farm's own
    set-up from the board's Python 3.9 wheels, then both runtimes' benchmarks."""
    model = mobilenet_models["mobilenetv2_w0.35_r96.onnx"]
    workload = _script_workload(tmp_path, SETUP, RUNTIMES)
    workload["dir"] = str(tmp_path / "job")
    setup = BoardDriver(_config(arm_bullseye, env_timeout_s=1200)).run(_task(model, workload), lambda: False)
    assert setup.ok, setup.message + setup.log_tail
    assert "machine aarch64 python 3.9" in setup.log_tail
    assert setup.environment["device"]["python"].startswith("3.9.")
    for name in ("mobilenetv2_w0.35_r96.onnx", "mobilenetv2_w0.35_r96.tflite"):
        result = BoardDriver(_config(arm_bullseye, python=setup.environment["venv_python"])).run(
            _task(mobilenet_models[name], {"type": "benchmark", "iterations": 3, "warmup": 1, "use_xnnpack": True},
                  task_id=23), lambda: False)
        assert result.ok, name + ": " + result.message + result.log_tail
        assert len(result.iterations_ms) == 3 and result.environment["device"]["arch"] == "aarch64"
        assert result.environment["device"]["python"].startswith("3.9.")
