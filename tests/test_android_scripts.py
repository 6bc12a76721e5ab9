"""Script workloads on a phone: shell scripts run over adb (folder pushed by hash, timing lines read
by the sim's rule, a timeout that cleans up); anything needing Python is refused saying what runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from adb_emulator import AdbDeviceEmulator
from farm.agents.android.adb import load_or_create_lab_key
from farm.agents.android.driver import AndroidDeviceConfig, AndroidDriver
from farm.proto.device_types import load_device_types
from farm.proto.tasks import TaskPlan, TaskSpec


@pytest.fixture
def lab_key(tmp_path: Path) -> Path:
    key = tmp_path / "lab" / "adbkey"
    load_or_create_lab_key(key)
    return key


def _task(model: Path, script_dir: Path, timeout_s: float = 60, **workload) -> TaskSpec:
    w = {"type": "script", "command": "sh", "script": "run.sh", "args": ["{model}", "{threads}"],
         "dir": script_dir.name, "pip_requirements": [], **workload}
    return TaskSpec(task_id=3, job_id=1, attempt=1, target="g6-1", model_name=model.stem, model_path=str(model),
                    model_sha256="", model_family=None, threads=2, batch_size=1, input_size=None, repeat=0,
                    plan=TaskPlan(workload=w, sim={}, run_timeout_s=timeout_s, base_dir=str(script_dir.parent)))


def _run(tmp_path: Path, lab_key: Path, task: TaskSpec):
    with AdbDeviceEmulator(tmp_path / "phone", authorized_keys=[Path(f"{lab_key}.pub").read_text()]) as phone:
        driver = AndroidDriver(AndroidDeviceConfig(name="g6-1", host="127.0.0.1", port=phone.port, key_path=lab_key,
                                                   cooldown_poll_s=0.1), load_device_types()["lg-g6"])
        result = driver.run(task, lambda: False)
        runs = phone.device_path("/data/local/tmp/farm/runs")
        left = list(runs.iterdir()) if runs.exists() else []
    return result, left


def _script(tmp_path: Path, text: str) -> Path:
    d = tmp_path / "job"
    d.mkdir()
    (d / "run.sh").write_text(text)
    return d


def test_a_shell_script_runs_on_the_phone_with_its_timings(tmp_path: Path, lab_key: Path, tiny_models) -> None:
    script_dir = _script(tmp_path, 'test -s "$1" || exit 9\necho "threads $2"\n'
                                   'for t in 1.5 2.5 3.5; do echo "{\\"latency_ms\\": $t}"; done\n')
    result, left = _run(tmp_path, lab_key, _task(tiny_models["tflite"], script_dir))
    assert result.ok, result.message + result.log_tail
    assert result.backend == "android" and result.iterations_ms == [1.5, 2.5, 3.5]
    assert result.whole_run_s > 0 and "threads 2" in result.log_tail
    assert result.environment["device"]["model"] == "LG-H870"
    assert not left  # the run's directory is gone


def test_a_shell_script_that_never_ends_times_out_and_the_phone_is_cleaned(tmp_path: Path, lab_key: Path,
                                                                          tiny_models) -> None:
    script_dir = _script(tmp_path, "echo started\nsleep 300\n")
    result, left = _run(tmp_path, lab_key, _task(tiny_models["tflite"], script_dir, timeout_s=2))
    assert result.failure_class == "timeout" and "timeouts.run = 2 s" in result.message
    assert not left


@pytest.mark.parametrize("workload, words", [
    ({"command": "python", "script": "run.sh"}, "command 'python' does not run on a phone"),
    ({"pip_requirements": ["numpy"]}, "pip_requirements need Python"),
])
def test_what_a_phone_cannot_run_is_refused_saying_what_does(tmp_path: Path, lab_key: Path, tiny_models,
                                                            workload: dict, words: str) -> None:
    script_dir = _script(tmp_path, "true\n")
    result, _ = _run(tmp_path, lab_key, _task(tiny_models["tflite"], script_dir, **workload))
    assert result.failure_class == "job" and words in result.message
    assert "type: benchmark" in result.message and "command: sh" in result.message
    assert "Linux and Jetson boards" in result.message
