"""The warm harness (a kept interpreter per runtime, forking each run) still puts every run under its own
cgroup, limits, namespaces and run user, with memory figures of its own; docker and scripts stay cold.

The cgroup cases need root (CI runs as root); figures are compared warm vs cold side by side, never to
absolute times."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import require_backend
from farm.agents.harness.task import HarnessTask
from farm.agents.sandbox.docker import DockerBackend
from farm.agents.sandbox.isolation import run_uid_range
from farm.agents.sandbox.warm import WARM_ENV, Zygote, anonymous_bytes
from farm.agents.sim.driver import SimDriver
from farm.proto.results import FailureClass
from farm.proto.tasks import TaskPlan, TaskSpec

MiB = 1 << 20


def _task(model: Path, *, iterations: int = 20, memory: str | int = "512m", backend: str = "cgroup",
          task_id: int = 1) -> TaskSpec:
    return TaskSpec(task_id=task_id, job_id=1, attempt=1, target="sim", model_name=model.stem, model_path=str(model),
                    model_sha256=hashlib.sha256(model.read_bytes()).hexdigest(), model_family=None, threads=1,
                    batch_size=1, input_size=None, repeat=0,
                    plan=TaskPlan(workload={"type": "benchmark", "iterations": iterations, "warmup": 2},
                                  sim={"backend": backend, "memory": memory}, run_timeout_s=120,
                                  base_dir=str(model.parent)))


def _driver(tmp_path: Path, warm: bool, monkeypatch, name: str) -> SimDriver:
    monkeypatch.setenv(WARM_ENV, "1" if warm else "0")
    return SimDriver(tmp_path / name)


def _big_constant_onnx(path: Path, floats: int) -> Path:
    """y = x + sum(c): the session holds a `floats`-long constant, so a small sim.memory cannot load it."""
    c = numpy_helper.from_array(np.ones(floats, dtype=np.float32), "c")
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["c"], ["s"], keepdims=0), helper.make_node("Add", ["x", "s"], ["y"])],
        "big", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], initializer=[c])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_a_warm_run_is_forked_into_its_own_cgroup_namespaces_and_user(tmp_path: Path, tiny_models, monkeypatch) -> None:
    require_backend("cgroup")
    driver = _driver(tmp_path, True, monkeypatch, "warm")
    if driver.run_as is None:
        pytest.skip("the run user and namespaces need root")
    seen: dict[str, str] = {}

    def look() -> None:  # from outside, while the run runs: who it is, where it lives
        zygote = driver.zygotes.get("onnx") if driver.zygotes else None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and zygote is not None:
            pids = zygote.running()
            if pids:
                pid = pids[0]
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    seen["cgroup"] = Path(f"/proc/{pid}/cgroup").read_text()
                    seen["mounts"] = Path(f"/proc/{pid}/mountinfo").read_text()
                    seen["status"] = status
                    seen["fds"] = " ".join(os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
                    seen["maps"] = Path(f"/proc/{pid}/maps").read_text()
                except OSError:
                    continue
                if "Uid:\t0" not in status:  # past the switch to the run user
                    return
            time.sleep(0.002)

    looker = threading.Thread(target=look)
    looker.start()
    result = driver.run(_task(tiny_models["onnx"], iterations=100_000), lambda: False)
    looker.join()
    assert result.ok, result.message
    assert result.environment["harness"] == "warm: forked from a kept onnx harness"
    assert "(a uid of its own), mount + PID namespaces, no other run's directory mounted" in \
        result.environment["isolation"]
    first, count = run_uid_range()
    status = dict(line.split(":\t", 1) for line in seen["status"].splitlines() if ":\t" in line)
    uid = int(status["Uid"].split()[0])
    assert status["Uid"].split()[:3] == [str(uid)] * 3 and first <= uid < first + count, status["Uid"]
    assert status["Gid"].split()[:3] == [str(uid)] * 3, status["Gid"]
    assert status["NSpid"].split()[-1] == "1"  # PID 1 of a namespace of its own, as under unshare --fork
    assert status["NoNewPrivs"].strip() == "1" and status["Groups"].strip() == ""
    assert "farm/run-" in seen["cgroup"]  # joined the run's cgroup, not the zygote's
    assert "socket:" not in seen["fds"] and "pid:[" not in seen["fds"], seen["fds"]  # nothing of the zygote's
    assert "onnxruntime.db" not in seen["fds"] and "farm-zygote-home" not in seen["fds"], seen["fds"]
    # no shared mapping of a file the zygote's imports opened (onnxruntime's telemetry store)
    shared = [line for line in seen["maps"].splitlines() if len(line.split()) > 5 and line.split()[1][3] == "s"
              and not line.split()[5].startswith("/tmp/run/")]
    assert shared == [], shared
    mounts = [line.split() for line in seen["mounts"].splitlines()]
    assert any(m[4] == "/tmp" and "farm-tmp" in m for m in mounts)  # a private /tmp
    assert any(m[4] == "/tmp/run" for m in mounts)
    # the kernel's counters are the run's: its CPU time was charged to its cgroup
    assert result.contention is not None and (result.contention.run_cpu_s or 0) > 0


def test_warm_and_cold_runs_report_the_same_kind_of_figures(tmp_path: Path, tiny_models, monkeypatch) -> None:
    require_backend("cgroup")
    cold = _driver(tmp_path, False, monkeypatch, "cold").run(_task(tiny_models["onnx"]), lambda: False)
    driver = _driver(tmp_path, True, monkeypatch, "warm")
    warm = driver.run(_task(tiny_models["onnx"]), lambda: False)
    assert cold.ok and warm.ok, (cold.message, warm.message)
    assert cold.environment["harness"] == f"cold: {WARM_ENV}=0"
    assert warm.environment["harness"].startswith("warm")
    assert cold.telemetry and warm.telemetry
    assert warm.telemetry.memory_peak_source == cold.telemetry.memory_peak_source == "kernel"
    # the run's peak counts what it shares with the zygote (uncharged to its cgroup): never below a cold run's
    zygote = driver.zygotes.get("onnx") if driver.zygotes else None
    assert zygote is not None and zygote.process is not None
    inherited = anonymous_bytes(zygote.process.pid) or 0
    assert inherited > 4 * MiB  # the interpreter, numpy and the runtime
    assert warm.telemetry.memory_peak_bytes >= inherited
    assert 0.9 * cold.telemetry.memory_peak_bytes <= warm.telemetry.memory_peak_bytes <= 1.5 * cold.telemetry.memory_peak_bytes
    # the harness's own high-water mark starts at the fork, not at the zygote's: what the model costs above the
    # baseline is the same kind of figure in both
    assert warm.peak_rss_bytes and warm.baseline_memory_bytes and cold.peak_rss_bytes and cold.baseline_memory_bytes
    warm_delta = warm.peak_rss_bytes - warm.baseline_memory_bytes
    cold_delta = cold.peak_rss_bytes - cold.baseline_memory_bytes
    assert abs(warm_delta - cold_delta) < 8 * MiB, (warm_delta, cold_delta)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_model_past_the_memory_limit_fails_as_resource_warm_or_cold(warm: bool, tmp_path: Path, monkeypatch) -> None:
    require_backend("cgroup")
    model = _big_constant_onnx(tmp_path / "big.onnx", 48 * MiB // 4 * 2)  # 96 MiB of weights, twice over once loaded
    result = _driver(tmp_path, warm, monkeypatch, "w").run(_task(model, memory=64 * MiB), lambda: False)
    assert result.failure_class == FailureClass.RESOURCE, result.message
    assert "64 MiB limit" in result.message and "peak reached" in result.message
    assert result.environment["harness"].startswith("warm" if warm else "cold")


def test_the_process_backend_runs_warm_with_its_limits(tmp_path: Path, tiny_models, monkeypatch) -> None:
    result = _driver(tmp_path, True, monkeypatch, "p").run(_task(tiny_models["tflite"], backend="process"),
                                                           lambda: False)
    assert result.ok, result.message
    assert result.environment["harness"] == "warm: forked from a kept tflite harness"
    assert result.telemetry and result.telemetry.memory_peak_source == "rusage"
    assert result.limits and result.limits.cpuset  # pinned to the budget's cores, as cold


def test_docker_scripts_and_other_files_stay_cold(tmp_path: Path, tiny_models, monkeypatch) -> None:
    driver = _driver(tmp_path, True, monkeypatch, "d")
    docker = DockerBackend.__new__(DockerBackend)  # the class's choice, no engine needed to read it
    benchmark = HarnessTask(kind="benchmark", model_path=str(tiny_models["onnx"]))
    assert driver.warm_launch(benchmark, docker, tmp_path, None, None, None, 3) is None
    assert driver.harness_mode(benchmark, docker, None) == "cold: the docker backend starts each run in its own container"
    script = HarnessTask(kind="script", model_path=str(tiny_models["onnx"]))
    process = driver.backend_for(_task(tiny_models["onnx"], backend="process"))
    assert driver.warm_launch(script, process, tmp_path, None, None, None, 3) is None
    odd = HarnessTask(kind="benchmark", model_path=str(tmp_path / "model.pt"))
    assert driver.warm_launch(odd, process, tmp_path, None, None, None, 3) is None


def test_a_dead_zygote_is_started_again_and_one_whose_agent_is_gone_exits(tmp_path: Path, tiny_models,
                                                                          monkeypatch) -> None:
    driver = _driver(tmp_path, True, monkeypatch, "z")
    task = _task(tiny_models["tflite"], backend="process")
    assert driver.run(task, lambda: False).ok
    zygote = driver.zygotes.get("tflite") if driver.zygotes else None
    assert zygote is not None and zygote.process is not None
    first = zygote.process.pid
    os.kill(first, 9)
    zygote.process.wait()
    again = driver.run(task, lambda: False)
    assert again.ok and again.environment["harness"].startswith("warm"), again.message
    assert zygote.process is not None and zygote.process.pid != first
    # the agent dies (kill -9): the zygote sees its socket end and exits by itself
    agent = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom farm.agents.sandbox.warm import Zygote\n"
                              "z = Zygote('tflite'); z.inherited_bytes(); print(z.process.pid, flush=True); "
                              "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout is not None
        zygote_pid = int(agent.stdout.readline())
        assert Path(f"/proc/{zygote_pid}").exists()
    finally:
        agent.kill()
        agent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(zygote_pid):
        time.sleep(0.05)
    assert not _alive(zygote_pid), "the zygote outlived its agent"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie waits for init (or this test's reaper) only


def test_an_unchanged_model_is_hashed_once_and_a_changed_one_is_still_caught(tmp_path: Path, monkeypatch) -> None:
    import farm.agents.sim.driver as sim

    model = tmp_path / "m.onnx"
    model.write_bytes(os.urandom(3 << 20))
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    hashed = []
    real = hashlib.sha256
    monkeypatch.setattr(sim.hashlib, "sha256", lambda *a: hashed.append(1) or real(*a))
    for n in range(3):
        sim.stage_model(model, tmp_path / f"copy{n}", sha)
        assert (tmp_path / f"copy{n}").read_bytes() == model.read_bytes()
    assert len(hashed) == 1  # the first run hashed it; the next two copied the same, unchanged file
    with model.open("r+b") as f:  # changed in place: same inode, new ctime
        f.write(b"\0" * 16)
    with pytest.raises(sim.ModelChanged, match="changed since it was submitted"):
        sim.stage_model(model, tmp_path / "copy3", sha)
    os.replace(tmp_path / "copy0", model)  # the right bytes again, but another file: hashed again, and passes
    sim.stage_model(model, tmp_path / "copy4", sha)
    assert len(hashed) == 3


def test_a_zygote_that_cannot_start_says_why() -> None:
    from farm.agents.sandbox.base import SandboxError

    with pytest.raises(SandboxError, match="did not start: unknown runtime 'bogus'"):
        Zygote("bogus").inherited_bytes()
