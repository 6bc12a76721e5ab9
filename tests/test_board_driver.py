"""One task on a Jetson-like board over ssh: farm's harness runs there while tegrastats samples,
and comes back as a RunResult with the board's facts, power mode and energy per inference."""

from __future__ import annotations

import sys
from pathlib import Path


from farm.agents.boards.driver import BoardDeviceConfig, BoardDriver
from farm.proto.tasks import TaskPlan, TaskSpec
from sshd_peer import SshdPeer


def _config(peer: SshdPeer, kind: str = "jetson", **kw) -> BoardDeviceConfig:
    # this machine plays the board: its interpreter has farm and the runtimes, as a provisioned board would
    return BoardDeviceConfig(name="nano-1", kind=kind, host=peer.host, port=peer.port, username=peer.username,
                             key_path=peer.client_key, known_hosts=kw.pop("known_hosts", peer.known_hosts),
                             python=sys.executable, sample_interval_ms=50,
                             nv_tegra_release=str(peer.fake_bin / "nv_tegra_release"),
                             device_tree_model=str(peer.fake_bin / "device_tree_model"), **kw)


def _task(model: Path) -> TaskSpec:
    return TaskSpec(task_id=7, job_id=1, attempt=1, target="nano-1", model_name=model.stem, model_path=str(model),
                    model_sha256="", model_family=None, threads=1, batch_size=1, input_size=None, repeat=0,
                    plan=TaskPlan(workload={"type": "benchmark", "iterations": 40, "warmup": 2, "use_xnnpack": True},
                    sim={}, run_timeout_s=120, base_dir=str(model.parent)))


def test_jetson_run_has_latency_power_mode_and_energy(board: SshdPeer, mobilenet_models) -> None:
    model = mobilenet_models["mobilenetv2_w1.0_r96.tflite"]
    result = BoardDriver(_config(board)).run(_task(model), lambda: False)
    assert result.ok, result.message
    assert result.latency.count == 40 and len(result.iterations_ms) == 40
    device = result.environment["device"]
    assert device["nvpmodel_mode"] == "MAXN" and device["l4t_release"] == "32.7.4"
    assert result.environment["energy_per_inference_mj"] > 0
    assert result.telemetry.samples  # tegrastats lines, parsed
    assert 0 < result.throughput_per_s <= 1000 / result.latency.avg * 1.001  # over the loop's own wall time
    assert result.startup_ms == result.latency.init + result.latency.first


def test_linux_board_run_samples_proc(board: SshdPeer, mobilenet_models) -> None:
    result = BoardDriver(_config(board, kind="linux")).run(
        _task(mobilenet_models["mobilenetv2_w0.35_r96.onnx"]), lambda: False)
    assert result.ok, result.message
    assert result.backend == "linux"
    assert "energy_per_inference_mj" not in result.environment


def test_unknown_host_key_is_refused_with_its_fingerprint(board: SshdPeer, mobilenet_models) -> None:
    result = BoardDriver(_config(board, known_hosts=board.empty_known_hosts)).run(
        _task(mobilenet_models["mobilenetv2_w0.35_r96.tflite"]), lambda: False)
    assert result.failure_class == "infrastructure"
    assert board.host_key_fingerprint in result.message


def test_an_unsupported_operator_is_a_job_failure_naming_it(board: SshdPeer, tiny_models) -> None:
    result = BoardDriver(_config(board)).run(_task(tiny_models["unsupported_tflite"]), lambda: False)
    assert result.failure_class == "job" and "FarmUnknownOp" in result.message


def test_jtop_samples_when_it_is_usable_and_tegrastats_stands_in_when_not(board: SshdPeer, mobilenet_models) -> None:
    from sshd_peer import sshd_peer
    model = mobilenet_models["mobilenetv2_w0.35_r96.tflite"]
    fallback = BoardDriver(_config(board, telemetry="jtop")).run(_task(model), lambda: False)
    assert fallback.ok and fallback.environment["telemetry_source"] == "tegrastats (jtop unusable)"

    fake_jtop = Path(__file__).parent / "fake_jtop"
    with sshd_peer(extra_env={"PYTHONPATH": str(fake_jtop)}) as with_jtop:
        result = BoardDriver(_config(with_jtop, telemetry="jtop")).run(_task(model), lambda: False)
    assert result.ok, result.message
    assert result.environment["telemetry_source"] == "jtop"
    assert result.telemetry.cpu_avg_percent == 112  # CPU1..4 added up, the OFF core left out
    assert result.environment["energy_per_inference_mj"] > 0  # from jtop's Power TOT
