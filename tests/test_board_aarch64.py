"""The board path on a real foreign architecture: a Debian arm64 board (tests/arm_board.py) whose
binaries run under qemu-user, reached over its own sshd. Its runtimes come from aarch64 wheels that
farm's own board set-up (a script's pip requirements → the harness's cached venv) installs from the
board's offline wheelhouse; then benchmark and script workloads run there with the harness pushed
by hash. The jobs through the controller (a model family paired with sim twins, the Jetson experiment's short
form) are in test_board_aarch64_family.py and test_board_aarch64_jetson.py, and a requirement with no aarch64 wheel
in test_board_aarch64_wheels.py, so that `make test`'s workers run them side by side (the fixtures are in
tests/board_aarch64.py); `pytest -k aarch64` runs the four."""

from __future__ import annotations

from pathlib import Path

import pytest

from board_aarch64 import (  # noqa: F401 (the `arm` and `setup_run` module fixtures)
    REMOTE_DIR, RUNTIMES, SETUP, arm_fixture, board_config, board_task, emulated_type, script_workload,
    setup_run_fixture)
from farm.agents.boards.driver import BoardDriver
from farm.proto.results import RunResult
from sshd_peer import SshdPeer

pytestmark = [pytest.mark.timeout(1800)]


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
    result = BoardDriver(board_config(arm, python=setup_run.environment["venv_python"])).run(
        board_task(model, workload, task_id=22), lambda: False)
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
    with SshTransport(board_config(arm).target()) as ssh:
        _, listing, _ = ssh.run(f"sha256sum {REMOTE_DIR}/{sha}.py", 60)
        assert listing.split()[0] == sha  # the set-up run pushed it under its hash
    # tampered with in a folder of this test's own: the other board files' runs share REMOTE_DIR at the same time
    config = board_config(arm, remote_dir="/tmp/farm-tamper")
    with SshTransport(config.target()) as ssh:
        ssh.run("rm -rf /tmp/farm-tamper", 60)
        assert ssh.upload_by_hash(HARNESS_FILE, "/tmp/farm-tamper").uploaded
        ssh.run(f"echo tampered >> /tmp/farm-tamper/{sha}.py", 60)  # a changed file on the board is never run
    workload = {"type": "benchmark", "iterations": 2, "warmup": 0, "use_xnnpack": True}
    result = BoardDriver(config).run(board_task(mobilenet_models["mobilenetv2_w0.35_r96.onnx"], workload), lambda: False)
    # the probe saw a different hash, so the harness went again; the run starts and needs its runtime
    assert result.environment["board_harness_sha256"] == sha
    assert result.failure_class == "job" and "no numpy" in result.message  # the system python3 has no runtime
    with SshTransport(config.target()) as ssh:
        _, listing, _ = ssh.run(f"sha256sum /tmp/farm-tamper/{sha}.py", 60)
        assert not ssh.run("ls /tmp/farm-tamper/*.part 2>/dev/null", 60)[1]  # no upload's partial file left
    assert listing.split()[0] == sha


def test_aarch64_a_board_python_older_than_the_harness_supports_is_refused(arm: SshdPeer, mobilenet_models) -> None:
    from arm_board import cache_dir
    # the interpreter an old board image ships (Debian stretch's python3 is 3.5): it answers the version probe
    old = cache_dir() / "root" / "usr/local/bin/python3.5"
    old.write_text("#!/bin/sh\necho 3.5.3\n")
    old.chmod(0o755)
    try:
        workload = {"type": "benchmark", "iterations": 2, "warmup": 0, "use_xnnpack": True}
        result = BoardDriver(board_config(arm, python="/usr/local/bin/python3.5")).run(
            board_task(mobilenet_models["mobilenetv2_w0.35_r96.onnx"], workload), lambda: False)
    finally:
        old.unlink()
    assert result.failure_class == "infrastructure"
    assert "3.5.3" in result.message and "3.6 or newer" in result.message


def test_aarch64_a_slow_board_gets_the_timeout_its_type_declares(arm: SshdPeer, mobilenet_models,
                                                               tmp_path: Path) -> None:
    workload = script_workload(tmp_path, "import time; time.sleep(4); print('latency_ms: 1')", [])
    workload["dir"] = str(tmp_path / "job")
    task = board_task(mobilenet_models["mobilenetv2_w0.35_r96.onnx"], workload, timeout_s=2)
    # written for the sim, 2 s is too short for this board's 4 s of work (and its slow start)…
    plain = BoardDriver(board_config(arm)).run(task, lambda: False)
    assert plain.failure_class == "timeout", plain.message
    assert plain.environment["run_timeout_s"] == 2
    # …but the board type says it is ten times slower than the sim, so it gets 20 s
    slow = BoardDriver(board_config(arm), emulated_type(tmp_path)).run(task, lambda: False)
    assert slow.ok, slow.message + slow.log_tail
    assert slow.environment["run_timeout_s"] == 20 and slow.whole_run_s >= 4




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
    workload = script_workload(tmp_path, SETUP, RUNTIMES)
    workload["dir"] = str(tmp_path / "job")
    setup = BoardDriver(board_config(arm_bullseye, env_timeout_s=1200)).run(board_task(model, workload), lambda: False)
    assert setup.ok, setup.message + setup.log_tail
    assert "machine aarch64 python 3.9" in setup.log_tail
    assert setup.environment["device"]["python"].startswith("3.9.")
    for name in ("mobilenetv2_w0.35_r96.onnx", "mobilenetv2_w0.35_r96.tflite"):
        result = BoardDriver(board_config(arm_bullseye, python=setup.environment["venv_python"])).run(
            board_task(mobilenet_models[name], {"type": "benchmark", "iterations": 3, "warmup": 1, "use_xnnpack": True},
                  task_id=23), lambda: False)
        assert result.ok, name + ": " + result.message + result.log_tail
        assert len(result.iterations_ms) == 3 and result.environment["device"]["arch"] == "aarch64"
        assert result.environment["device"]["python"].startswith("3.9.")
