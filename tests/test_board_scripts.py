"""Script workloads on a Jetson-like board over ssh, with farm's one-file board harness: the
job's folder goes there by hash, the script runs under the board's telemetry, and whatever the
script does (never ends, prints gigabytes, links out of its folder, needs packages that do not
exist) the run says what happened and the board is left clean."""

from __future__ import annotations

import io
import os
import sys
import time
import uuid
import zipfile
from pathlib import Path

import psutil

from farm.proto.spec import BenchmarkWorkload
from farm.agents.boards.driver import BoardDeviceConfig, BoardDriver
from farm.agents.boards.workload import harness_command
from farm.agents.boards.ssh_transport import SshTransport, UploadResult
from farm.proto.tasks import TaskPlan, TaskSpec
from sshd_peer import SshdPeer


def _config(peer: SshdPeer, tmp_path: Path, kind: str = "jetson", **kw) -> BoardDeviceConfig:
    # this machine plays the board; its interpreter has numpy and the runtimes, as a provisioned board's would
    kw.setdefault("python", sys.executable)
    return BoardDeviceConfig(name="nano-1", kind=kind, host=peer.host, port=peer.port, username=peer.username,
                             key_path=peer.client_key, known_hosts=peer.known_hosts, sample_interval_ms=50,
                             remote_dir=str(tmp_path / "board"),
                             nv_tegra_release=str(peer.fake_bin / "nv_tegra_release"),
                             device_tree_model=str(peer.fake_bin / "device_tree_model"), **kw)


def _script_task(model: Path, script_dir: Path, timeout_s: float = 120, **workload) -> TaskSpec:
    w = {"type": "script", "command": "python", "script": "work.py", "args": ["{model}", "{threads}"],
         "dir": script_dir.name, "pip_requirements": [], **workload}
    return TaskSpec(task_id=11, job_id=1, attempt=1, target="nano-1", model_name=model.stem, model_path=str(model),
                    model_sha256="", model_family=None, threads=1, batch_size=1, input_size=None, repeat=0,
                    plan=TaskPlan(workload=w, sim={}, run_timeout_s=timeout_s, base_dir=str(script_dir.parent)))


def _script(tmp_path: Path, text: str, name: str = "job") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "work.py").write_text(text)
    return d


def _board_is_clean(tmp_path: Path) -> bool:
    runs = tmp_path / "board" / "runs"
    return not runs.exists() or not any(runs.iterdir())


INFER = """
import json, sys, time
import numpy as np
model, threads = sys.argv[1], int(sys.argv[2])
assert open(model, 'rb').read(4), 'the model reached the board'
weights = np.random.rand(256, 256).astype(np.float32)
keep = [np.ones((1024, 1024), np.float32) for _ in range(8)]  # ~32 MB the memory figures must see
for _ in range(20):
    t0 = time.perf_counter()
    for _ in range(20):
        weights = np.tanh(weights @ weights)
    print(json.dumps({"latency_ms": (time.perf_counter() - t0) * 1e3}), flush=True)
    time.sleep(0.01)
print('done', threads)
"""


def test_a_script_on_the_jetson_has_whole_run_time_memory_and_energy(board: SshdPeer, tiny_models,
                                                                     tmp_path: Path) -> None:
    script_dir = _script(tmp_path, INFER)
    result = BoardDriver(_config(board, tmp_path)).run(_script_task(tiny_models["tflite"], script_dir), lambda: False)
    assert result.ok, result.message + result.log_tail
    assert result.backend == "jetson" and len(result.iterations_ms) == 20 and result.latency.count == 20
    assert 0 < sum(result.iterations_ms) / 1000 < result.whole_run_s <= result.wall_s
    process = result.environment["process_memory"]
    assert process["samples"] > 0 and process["peak_bytes"] > 32 << 20  # the script's own pages, summed
    assert result.peak_rss_bytes > 32 << 20  # getrusage of the script, as the sim reports it
    assert result.telemetry.memory_avg_bytes > 0 and result.telemetry.samples  # tegrastats, board-wide
    assert result.environment["energy_mj"] > 0 and result.environment["energy_per_inference_mj"] > 0
    assert result.environment["device"]["python"].startswith("3.")
    assert "done 1" in result.log_tail
    assert _board_is_clean(tmp_path)


def test_a_script_on_a_linux_board_is_sampled_from_proc(board: SshdPeer, tiny_models, tmp_path: Path) -> None:
    script_dir = _script(tmp_path, INFER)
    result = BoardDriver(_config(board, tmp_path, kind="linux")).run(
        _script_task(tiny_models["onnx"], script_dir), lambda: False)
    assert result.ok, result.message
    assert result.environment["telemetry_source"] == "proc" and "energy_mj" not in result.environment
    assert result.telemetry.memory_peak_bytes > 0 and result.whole_run_s > 0


def test_a_script_that_never_ends_times_out_and_the_board_is_cleaned(board: SshdPeer, tiny_models,
                                                                     tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    script_dir = _script(tmp_path, "import subprocess, sys, time\n"
                                   f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', '{marker}'])\n"
                                   "time.sleep(300)\n")
    result = BoardDriver(_config(board, tmp_path)).run(
        _script_task(tiny_models["tflite"], script_dir, timeout_s=3), lambda: False)
    assert result.failure_class == "timeout", result.message
    assert "timeouts.run = 3 s" in result.message and result.whole_run_s < 30
    assert _board_is_clean(tmp_path)
    left = [p for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]
    assert not left, left


def test_a_canceled_script_stops_at_once_and_the_board_is_cleaned(board: SshdPeer, tiny_models,
                                                                  tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    script_dir = _script(tmp_path, "import subprocess, sys, time\n"
                                   f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', '{marker}'])\n"
                                   "time.sleep(300)\n")
    started = time.monotonic()
    result = BoardDriver(_config(board, tmp_path)).run(_script_task(tiny_models["tflite"], script_dir, timeout_s=300),
                                                       lambda: time.monotonic() - started > 3)
    assert result.failure_class == "canceled", result.message
    assert time.monotonic() - started < 60
    assert _board_is_clean(tmp_path)
    assert not [p for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]


def test_a_link_to_a_folder_outside_is_refused_and_a_linked_file_arrives_as_a_file(
        board: SshdPeer, tiny_models, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not for the board")
    script_dir = _script(tmp_path, "import json, os\nassert not os.path.islink('data.txt')\n"
                                   "print(json.dumps({'latency_ms': len(open('data.txt').read())}))\n")
    os.symlink(outside / "secret.txt", script_dir / "data.txt")
    result = BoardDriver(_config(board, tmp_path)).run(_script_task(tiny_models["tflite"], script_dir), lambda: False)
    assert result.ok, result.message
    assert result.iterations_ms == [17.0]  # the file's content, packed as a file

    os.symlink(outside, script_dir / "escape")
    refused = BoardDriver(_config(board, tmp_path)).run(_script_task(tiny_models["tflite"], script_dir), lambda: False)
    assert refused.failure_class == "job" and "escape" in refused.message and "link to a folder" in refused.message


def test_a_huge_output_is_counted_not_carried(board: SshdPeer, tiny_models, tmp_path: Path) -> None:
    script_dir = _script(tmp_path, "import json, sys\nline = 'x' * 1023 + '\\n'\n"
                                   "for _ in range(60 * 1024):\n    sys.stdout.write(line)\n"
                                   "sys.stdout.write('y' * (5 << 20))\n"  # 5 MB without a newline
                                   "print()\nprint(json.dumps({'latency_ms': 4.5}))\n")
    result = BoardDriver(_config(board, tmp_path)).run(_script_task(tiny_models["tflite"], script_dir), lambda: False)
    assert result.ok, result.message
    assert result.iterations_ms == [4.5]
    assert result.environment["script_output_bytes"] > 65 << 20
    assert len(result.log_tail) <= 4000


def test_a_board_without_python3_is_an_infrastructure_failure_that_says_what_to_install(
        board: SshdPeer, tiny_models, tmp_path: Path) -> None:
    script_dir = _script(tmp_path, "print(1)\n")
    result = BoardDriver(_config(board, tmp_path, python="/opt/no-such/python3")).run(
        _script_task(tiny_models["tflite"], script_dir), lambda: False)
    assert result.failure_class == "infrastructure"
    assert "install python3 (3.6 or newer)" in result.message and "/opt/no-such/python3" in result.message
    assert _board_is_clean(tmp_path)  # the task file sent with the probe is gone again


def _python_shim(tmp_path: Path, version: str) -> Path:
    """A board python that says it is `version` and, like a real 3.6, refuses a file with newer syntax
    (vermin judges the file; then this machine's interpreter runs it)."""
    vermin = Path(sys.executable).with_name("vermin")
    shim = tmp_path / f"python{version}"
    shim.write_text(f"""#!/bin/sh
if [ "$1" = "-c" ]; then case "$2" in *version_info*) echo {version}; exit 0;; esac; fi
case "$1" in *.py)
  {vermin} --target={version.rsplit('.', 1)[0]}- --no-tips --violations -q "$1" >/dev/null 2>&1 || {{
    echo "SyntaxError: $1 needs a newer Python than {version}" >&2; exit 1; }};;
esac
exec {sys.executable} "$@"
""")
    shim.chmod(0o755)
    return shim


def test_a_python_36_board_runs_the_harness_and_an_older_one_is_refused(board: SshdPeer, tiny_models,
                                                                        tmp_path: Path) -> None:
    script_dir = _script(tmp_path, "import json\nprint(json.dumps({'latency_ms': 1.25}))\n")
    old = BoardDriver(_config(board, tmp_path, python=str(_python_shim(tmp_path, "3.5.2")))).run(
        _script_task(tiny_models["tflite"], script_dir), lambda: False)
    assert old.failure_class == "infrastructure" and "Python 3.5.2" in old.message and "3.6" in old.message
    assert _board_is_clean(tmp_path)

    jetpack4 = BoardDriver(_config(board, tmp_path, python=str(_python_shim(tmp_path, "3.6.9"))))
    result = jetpack4.run(_script_task(tiny_models["tflite"], script_dir), lambda: False)
    assert result.ok, result.message + result.log_tail
    assert result.environment["device"]["python"] == "3.6.9" and result.iterations_ms == [1.25]


def _wheel(directory: Path, name: str) -> Path:
    """A pure-Python wheel built by hand (nothing can be downloaded here)."""
    path = directory / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.py", "ANSWER = 42\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_requirements_go_into_a_cached_venv_and_a_failed_install_is_the_jobs_fault(
        board: SshdPeer, tiny_models, tmp_path: Path) -> None:
    name = f"farmtestpkg{uuid.uuid4().hex[:8]}"
    wheel = _wheel(tmp_path, name)
    script_dir = _script(tmp_path, f"import json, {name}\nprint(json.dumps({{'latency_ms': {name}.ANSWER}}))\n")
    driver = BoardDriver(_config(board, tmp_path))
    task = _script_task(tiny_models["tflite"], script_dir, pip_requirements=[str(wheel)])
    first = driver.run(task, lambda: False)
    assert first.ok, first.message + first.log_tail
    assert first.iterations_ms == [42.0]
    again = driver.run(task, lambda: False)
    assert again.ok and again.environment["venv_python"] == first.environment["venv_python"]
    assert len([p for p in (tmp_path / "board" / "venvs").iterdir() if p.is_dir()]) == 1  # made once

    missing = driver.run(_script_task(tiny_models["tflite"], script_dir,
                                      pip_requirements=[str(tmp_path / "no-such-1.0-py3-none-any.whl")]), lambda: False)
    assert missing.failure_class == "job", missing.message
    assert "pip could not install" in missing.message and "no-such-1.0-py3-none-any.whl" in missing.message
    assert _board_is_clean(tmp_path)


def test_a_script_that_fails_is_a_job_failure_with_its_last_output(board: SshdPeer, tiny_models,
                                                                   tmp_path: Path) -> None:
    script_dir = _script(tmp_path, "print('loading the model')\nraise SystemExit('no GPU here')\n")
    result = BoardDriver(_config(board, tmp_path)).run(_script_task(tiny_models["tflite"], script_dir), lambda: False)
    assert result.failure_class == "job"
    assert "exited with status 1" in result.message and "no GPU here" in result.message


def test_a_changed_harness_on_the_board_is_not_run(board: SshdPeer, tiny_models, tmp_path: Path) -> None:
    from farm.agents.board_harness import HARNESS_FILE
    from farm.agents.boards.ssh_transport import file_sha256
    driver = BoardDriver(_config(board, tmp_path))
    script_dir = _script(tmp_path, "import json\nprint(json.dumps({'latency_ms': 2}))\n")
    assert driver.run(_script_task(tiny_models["tflite"], script_dir), lambda: False).ok
    pushed = tmp_path / "board" / f"{file_sha256(HARNESS_FILE)}.py"
    assert pushed.read_bytes() == HARNESS_FILE.read_bytes()
    uploaded = UploadResult(str(pushed), file_sha256(HARNESS_FILE), pushed.stat().st_size, uploaded=False)
    with io.open(pushed, "a") as f:  # replaced on the board after it was pushed
        f.write("\nimport os; os.system('echo owned')\n")
    with SshTransport(driver.config.target()) as ssh:
        status, out, err = ssh.run(harness_command(sys.executable, uploaded, "version"), 30)
    assert status == 97 and "owned" not in out and "not the file that was pushed" in err
    # the next run pushes it again: upload_by_hash sees the wrong hash
    assert driver.run(_script_task(tiny_models["tflite"], script_dir), lambda: False).ok
    assert pushed.read_bytes() == HARNESS_FILE.read_bytes()


def test_a_board_that_cannot_reach_the_package_index_is_an_infrastructure_failure(board: SshdPeer, tiny_models,
                                                                                 tmp_path: Path) -> None:
    script_dir = _script(tmp_path, "print(1)\n")
    # nothing listens on port 1: the index is unreachable, which is the board's network, not the job
    task = _script_task(tiny_models["tflite"], script_dir,
                        pip_requirements=["--index-url", "http://127.0.0.1:1/simple", "farm-nothing-here"])
    result = BoardDriver(_config(board, tmp_path)).run(task, lambda: False)
    assert result.failure_class == "infrastructure", result.message
    assert "could not reach the package index" in result.message and "Connection refused" in result.message
    assert _board_is_clean(tmp_path)


def test_what_a_script_leaves_running_is_ended_and_named_as_the_sim_does(board: SshdPeer, tiny_models,
                                                                        tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    script_dir = _script(tmp_path, "import json, subprocess, sys\n"
                                   f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', '{marker}'])\n"
                                   "print(json.dumps({'latency_ms': 2.5}))\n")
    result = BoardDriver(_config(board, tmp_path)).run(_script_task(tiny_models["tflite"], script_dir), lambda: False)
    assert result.ok, result.message
    assert result.whole_run_s < 30  # the script's own life, not its child's 120 s
    assert "leaving 1 process(es) running: python" in result.message and "were ended" in result.message
    assert not [p for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]


def test_a_board_python_without_numpy_fails_the_benchmark_as_the_jobs_saying_what_to_install(
        board: SshdPeer, tiny_models, tmp_path: Path) -> None:
    # Debian's own python3 here has no numpy, like a fresh board
    task = _script_task(tiny_models["tflite"], tmp_path)
    task.plan.workload = BenchmarkWorkload(type="benchmark", iterations=5, warmup=1, use_xnnpack=True)
    result = BoardDriver(_config(board, tmp_path, python="/usr/bin/python3")).run(task, lambda: False)
    assert result.failure_class == "job", result.message
    assert "has no numpy" in result.message and "pip install numpy" in result.message
    assert result.environment["device"]["python"].startswith("3.")
