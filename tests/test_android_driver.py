"""One task on an emulated phone through the android driver: the command it builds, the result
it returns, and the failure class of every way it can go wrong."""

from __future__ import annotations

import hashlib
import sys
import threading
from pathlib import Path

import pytest

from adb_emulator import AdbDeviceEmulator, EmulatedPhone
from farm.agents.android.adb import load_or_create_lab_key
from farm.agents.android.driver import AndroidDeviceConfig, AndroidDriver, benchmark_command
from farm.proto.device_types import load_device_types
from farm.proto.tasks import TaskPlan, TaskSpec


def _task(model: Path, threads: int = 1) -> TaskSpec:
    return TaskSpec(task_id=1, job_id=1, attempt=1, target="phone", model_name=model.stem, model_path=str(model),
                    model_sha256="", model_family=None, threads=threads, batch_size=1, input_size=None, repeat=0,
                    plan=TaskPlan(workload={"type": "benchmark", "iterations": 50, "warmup": 2, "use_xnnpack": True},
                    sim={}, run_timeout_s=30, base_dir=str(model.parent)))


@pytest.fixture
def lab_key(tmp_path: Path) -> Path:
    key = tmp_path / "lab" / "adbkey"
    load_or_create_lab_key(key)
    return key


def _driver(emulator: AdbDeviceEmulator, key: Path, **kw) -> AndroidDriver:
    config = AndroidDeviceConfig(name="g6-1", host="127.0.0.1", port=emulator.port, key_path=key,
                                 cooldown_poll_s=0.1, **kw)
    return AndroidDriver(config, load_device_types()["lg-g6"])


def test_a_run_on_the_phone_returns_latency_memory_and_facts(tmp_path: Path, lab_key: Path, tiny_models) -> None:
    with AdbDeviceEmulator(tmp_path / "phone", authorized_keys=[Path(f"{lab_key}.pub").read_text()]) as phone:
        result = _driver(phone, lab_key).run(_task(tiny_models["tflite"]), lambda: False)
    assert result.ok, result.message
    assert result.latency.avg == pytest.approx(55.0432) and result.latency.init == pytest.approx(18.777)
    assert result.peak_rss_bytes == int(18.7227 * (1 << 20))
    env = result.environment
    assert env["device"]["model"] == "LG-H870" and env["device_type"] == "lg-g6"
    assert env["temperature_before_c"] == 36.0 and env["thermal_throttled"] is False
    assert "--num_threads=1" in env["command"] and "--num_runs=50" in env["command"]


def test_the_command_uses_the_types_flags_and_taskset_mask(tmp_path: Path) -> None:
    pixel = load_device_types()["pixel-4"]
    command = benchmark_command("/data/local/tmp/farm/abc", "/data/local/tmp/farm/m.tflite",
                                _task(tmp_path / "m.tflite", threads=2), pixel)
    assert command.startswith("taskset c0 /data/local/tmp/farm/abc ")
    assert command.count("--num_runs=") == 1  # the job's run count wins over the profile's default
    assert "--enable_op_profiling" not in command  # profiling costs time: only when the job asks
    task = _task(tmp_path / "m.tflite", threads=2)
    task.plan.workload = task.plan.workload.model_copy(update={"op_profiling": True})
    assert "--enable_op_profiling=true" in benchmark_command("bm", "m.tflite", task, pixel)


def test_unsupported_operator_and_garbage_are_job_failures_with_raw_output(tmp_path: Path, lab_key: Path,
                                                                           tiny_models) -> None:
    model = tiny_models["tflite"]
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    for phone_config, expected in ((EmulatedPhone(unsupported_ops={digest: "FarmUnknownOp"}), "FarmUnknownOp"),
                                   (EmulatedPhone(garbage_output={digest: "Segmentation fault"}), "raw output")):
        with AdbDeviceEmulator(tmp_path / f"phone-{expected[:3]}", phone=phone_config,
                               authorized_keys=[Path(f"{lab_key}.pub").read_text()]) as phone:
            result = _driver(phone, lab_key).run(_task(model), lambda: False)
        assert result.failure_class == "job" and expected in result.message
        if expected == "raw output":
            assert "Segmentation fault" in result.log_tail


def _unplug_once_benchmarking(phone: AdbDeviceEmulator) -> None:
    for _ in range(6000):  # a hang guard of 120 s, not a timing
        if any("benchmark_model --graph" in s for s in list(phone.services_opened)):
            break
        threading.Event().wait(0.02)
    phone.kill()


def test_phone_unplugged_mid_run_is_infrastructure(tmp_path: Path, lab_key: Path, tiny_models) -> None:
    with AdbDeviceEmulator(tmp_path / "phone", phone=EmulatedPhone(benchmark_seconds=5),
                           authorized_keys=[Path(f"{lab_key}.pub").read_text()]) as phone:
        # unplugged once benchmark_model is running (a fixed timer fired before it started on a loaded machine)
        threading.Thread(target=_unplug_once_benchmarking, args=(phone,), daemon=True).start()
        result = _driver(phone, lab_key).run(_task(tiny_models["tflite"]), lambda: False)
    assert result.failure_class == "infrastructure" and "g6-1" in result.message


def test_a_hot_phone_is_waited_for_and_a_hot_finish_is_flagged(tmp_path: Path, lab_key: Path, tiny_models) -> None:
    hot = EmulatedPhone(thermal_zones={"tsens_tz_sensor0": 52000, "battery": 30000})
    with AdbDeviceEmulator(tmp_path / "phone", phone=hot, authorized_keys=[Path(f"{lab_key}.pub").read_text()]) as phone:
        result = _driver(phone, lab_key, cooldown_timeout_s=0.3).run(_task(tiny_models["tflite"]), lambda: False)
    assert result.ok and result.environment["thermal_throttled"] is True
    assert result.environment["temperature_before_c"] == 52.0


def test_the_emulated_phone_runs_its_shell_under_a_cgroup_budget(tmp_path: Path, lab_key: Path) -> None:
    from conftest import require_backend
    from farm.agents.android.adb import AdbTarget, AndroidDevice
    from farm.agents.sandbox.base import Budget
    require_backend("cgroup")
    budget = Budget(cpus=0.5, memory_bytes=64 << 20)
    with AdbDeviceEmulator(tmp_path / "phone", budget=budget,
                           authorized_keys=[Path(f"{lab_key}.pub").read_text()]) as phone:
        target = AdbTarget(host="127.0.0.1", port=phone.port, key_path=lab_key)
        with AndroidDevice(target) as device:
            where = device.shell("cat /proc/self/cgroup", idempotent=True).output
            hog = device.shell(f"{sys.executable} -c 'b = bytearray(200 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1'",
                               timeout_s=30)
        assert "emulated-phone" in where  # the phone's shell lives in the phone's cgroup
        assert hog.exit_status != 0  # 200 MB does not fit a 64 MB phone


def _on(task: TaskSpec, unit: str, precision: str = "fp32") -> TaskSpec:
    return task.model_copy(update={"plan": task.plan.model_copy(update={"accelerator": unit, "precision": precision})})


def test_delegates_reach_the_tool_and_what_they_took_is_reported(tmp_path: Path, lab_key: Path, tiny_models) -> None:
    """Issue 29 on the ADB emulator: each unit's flags reach benchmark_model, which prints real captured delegate
    lines; a full delegation is a figure of the unit, a partial one says what stayed on the CPU, a delegate that took
    nothing (or failed) is a job failure, never a CPU figure filed under the unit."""
    model = tiny_models["tflite"]
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    cases = [("gpu", "fp16", "gpu_complete.txt", "completed", "--gpu_precision_loss_allowed=true"),
             ("gpu", "fp32", "gpu_partial_logcat.txt", "completed", "--use_gpu=true"),
             ("nnapi", "fp32", "nnapi_none.txt", "failed", "--use_nnapi=true"),
             ("hexagon", "int8", "hexagon_failed.txt", "failed", "--use_hexagon=true"),
             ("qnn", "int8", "qnn_none.txt", "failed", "--external_delegate_path=/data/local/tmp/qnn_delegate/")]
    seen = {}
    for unit, precision, fixture, status, flag in cases:
        phone_config = EmulatedPhone(delegate_output={digest: fixture})
        with AdbDeviceEmulator(tmp_path / f"phone-{fixture[:-4]}", phone=phone_config,
                               authorized_keys=[Path(f"{lab_key}.pub").read_text()]) as phone:
            result = _driver(phone, lab_key).run(_on(_task(model), unit, precision), lambda: False)
        assert result.status == status, (fixture, result.message)
        assert flag in result.environment["command"]
        assert result.environment["accelerator"]["unit"] == unit
        seen[fixture] = result
    assert seen["gpu_complete.txt"].environment["accelerator"]["verdict"] == "complete"
    assert seen["gpu_complete.txt"].latency.avg == pytest.approx(55.0432)
    partial = seen["gpu_partial_logcat.txt"]
    assert partial.environment["accelerator"]["unsupported_ops"] == ["UNPACK: Operation is not supported."]
    assert "rest ran on the CPU" in partial.message
    assert seen["nnapi_none.txt"].failure_class == "job" and "took none" in seen["nnapi_none.txt"].message
    assert "failed to apply" in seen["hexagon_failed.txt"].message
    assert "0 of 31 nodes" in seen["qnn_none.txt"].message


def test_a_unit_benchmark_model_cannot_drive_is_the_jobs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not tensorrt"):
        benchmark_command("bm", "m.tflite", _on(_task(tmp_path / "m.tflite"), "tensorrt"), None)
    nnapi = benchmark_command("bm", "m.tflite", _on(_task(tmp_path / "m.tflite"), "nnapi", "fp16"), None)
    assert "--use_nnapi=true" in nnapi and "--nnapi_allow_fp16=true" in nnapi


def _app(task: TaskSpec) -> TaskSpec:
    workload = task.plan.workload.model_copy(update={"android_mode": "app"})
    return task.model_copy(update={"plan": task.plan.model_copy(update={"workload": workload})})


def test_app_mode_runs_the_benchmark_apk_and_reads_logcat(tmp_path: Path, lab_key: Path, tiny_models) -> None:
    """Issue 29: TensorFlow's benchmark app started as an activity (am start, its flags in one `args` extra) and its
    lines read back from logcat (the logcat line shape stripped by the parser): the same figures as the shell binary,
    recorded with the mode; a delegate's flags reach it too."""
    model = tiny_models["tflite"]
    with AdbDeviceEmulator(tmp_path / "phone", authorized_keys=[Path(f"{lab_key}.pub").read_text()]) as phone:
        shell = _driver(phone, lab_key).run(_task(model), lambda: False)
        app = _driver(phone, lab_key).run(_app(_task(model)), lambda: False)
        gpu = _driver(phone, lab_key).run(_app(_on(_task(model), "gpu", "fp16")), lambda: False)
    assert shell.ok and app.ok, app.message
    assert app.environment["android_mode"] == "app" and shell.environment["android_mode"] == "shell"
    assert app.environment["command"].startswith(
        "am start -S -n org.tensorflow.lite.benchmark/.BenchmarkModelActivity --es args '--graph=")
    assert app.latency.avg == shell.latency.avg == pytest.approx(55.0432)
    assert app.peak_rss_bytes == shell.peak_rss_bytes
    assert "I tflite" in app.log_tail  # the raw logcat lines are kept
    assert gpu.ok and gpu.environment["accelerator"]["verdict"] == "complete"
    assert "--use_gpu=true --gpu_precision_loss_allowed=true" in gpu.environment["command"]


def test_app_mode_without_the_app_says_how_to_install_it(tmp_path: Path, lab_key: Path, tiny_models) -> None:
    with AdbDeviceEmulator(tmp_path / "phone", phone=EmulatedPhone(benchmark_apk=False),
                           authorized_keys=[Path(f"{lab_key}.pub").read_text()]) as phone:
        result = _driver(phone, lab_key).run(_app(_task(tiny_models["tflite"])), lambda: False)
    assert result.failure_class == "infrastructure"
    assert "benchmark app (org.tensorflow.lite.benchmark) is not installed" in result.message
    assert "adb install -r -d -g" in result.message and "android_mode: shell" in result.message


def test_a_sustained_run_keeps_every_window_and_the_jobs_cool_down(tmp_path: Path, lab_key: Path, tiny_models) -> None:
    """Issue 29's stability controls: sustained_s repeats the timed loop and keeps each window (burst vs sustained);
    cooldown_c is the job's own start temperature (a phone at 52 °C: waited for under 45, not under 60)."""
    warm = EmulatedPhone(thermal_zones={"tsens_tz_sensor0": 52000, "battery": 30000}, benchmark_seconds=0.2)
    task = _task(tiny_models["tflite"])
    sustained = task.model_copy(update={"plan": task.plan.model_copy(update={"workload": task.plan.workload.model_copy(
        update={"sustained_s": 1.0, "cooldown_c": 60.0})})})
    with AdbDeviceEmulator(tmp_path / "phone", phone=warm, authorized_keys=[Path(f"{lab_key}.pub").read_text()]) as phone:
        result = _driver(phone, lab_key, cooldown_timeout_s=30).run(sustained, lambda: False)
        guarded = _driver(phone, lab_key, cooldown_timeout_s=0.3).run(task, lambda: False)
    assert result.ok, result.message
    env = result.environment
    assert env["cooldown_c"] == 60.0 and env["cooldown_waited_s"] < 5 and env["thermal_throttled"] is False
    windows = env["sustained"]["windows"]
    # two windows at least, however slow the host (a first window alone may outlast sustained_s under load)
    assert len(windows) >= 2 and windows[0]["t_s"] == 0.0 and windows[-1]["t_s"] > windows[0]["t_s"]
    assert all(w["avg_ms"] == pytest.approx(55.0432) and w["temperature_c"] == 52.0 for w in windows)
    assert env["sustained"]["last_over_first"] == 1.0 and result.latency.avg == pytest.approx(55.0432)
    assert guarded.environment["cooldown_c"] == 45.0 and guarded.environment["cooldown_waited_s"] >= 0.3
