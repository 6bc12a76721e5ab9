"""A task crosses the store and the wire as the spec's own models: what a user writes in
job.yaml is what the sandbox gets, and what a driver reads is the spec's default, not its own.

The path is written down in docs/architecture.md; these tests walk it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from conftest import require_backend
from farm.agents.android.driver import benchmark_command
from farm.agents.sandbox import backend_class
from farm.agents.sim.driver import SimDriver, SimSlot
from farm.controller.scheduling.controller import Controller
from farm.controller.scheduling.jobfile import load_job_text
from farm.controller.store import SQLiteStore as Store
from farm.proto.device_types import load_device_types
from farm.proto.generated import common_pb2
from farm.proto.results import RunResult, RunStatus, run_result_from_dict
from farm.proto.spec import BenchmarkWorkload, SimBudget, default_cpus
from farm.proto.tasks import TaskSpec
from farm.proto.wire import task_from_message, task_to_message

MiB = 1 << 20


def _leased_task(tmp_path: Path, tiny_models, sim: str) -> TaskSpec:
    os.symlink(tiny_models["tflite"], tmp_path / "tiny.tflite")
    job = load_job_text(f"models: [tiny.tflite]\nmatrix: {{threads: [2]}}\nsim: {sim}\n", "job.yaml", tmp_path)
    controller = Controller(Store(tmp_path / "farm.db"))
    controller.submit(job)
    task = controller.lease("agent-1", {"sim"})
    assert task is not None
    # and across the wire, as a remote agent receives it
    wire = common_pb2.TaskSpec.FromString(task_to_message(task, common_pb2.TaskSpec()).SerializeToString())
    arrived = task_from_message(wire)
    assert arrived == task
    return arrived


def test_sim_memory_from_yaml_reaches_the_budget_as_bytes_in_the_spec_model(tmp_path: Path, tiny_models) -> None:
    task = _leased_task(tmp_path, tiny_models, "{memory: 512m}")
    assert isinstance(task.sim, SimBudget) and isinstance(task.workload, BenchmarkWorkload)
    assert task.sim.memory == 512 * MiB
    budget = SimDriver(tmp_path / "work", run_as=None).budget_for(task, SimSlot(0))
    assert budget.memory_bytes == 512 * MiB
    assert budget.cpus == default_cpus(None, 2) == 2.0  # no sim.cpus: one core per thread


def test_sim_memory_reaches_the_cgroup_file(tmp_path: Path, tiny_models) -> None:
    require_backend("cgroup")
    task = _leased_task(tmp_path, tiny_models, "{memory: 96m, cpus: 1}")
    budget = SimDriver(tmp_path / "work", run_as=None).budget_for(task, SimSlot(0))
    backend = backend_class("cgroup")()
    sandbox = backend.start(["sleep", "30"], budget, env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path, mounts=[])
    try:
        dirs = sandbox.dirs  # type: ignore[attr-defined]
        limit = dirs[""] / "memory.max" if "" in dirs else dirs["memory"] / "memory.limit_in_bytes"
        assert int(limit.read_text()) == 96 * MiB
    finally:
        sandbox.kill()
        sandbox.close()


def test_the_android_driver_warms_up_as_the_spec_says(tmp_path: Path, tiny_models) -> None:
    task = _leased_task(tmp_path, tiny_models, "{}")  # the job names no warmup
    command = benchmark_command("benchmark_model", "/data/local/tmp/m.tflite", task, None)
    assert f"--warmup_runs={BenchmarkWorkload().warmup}" in command and "--warmup_runs=5" in command
    assert "--num_threads=2" in command


def test_a_task_with_an_unknown_budget_field_is_refused_on_arrival() -> None:
    base = dict(task_id=1, job_id=1, attempt=1, target="sim", model_name="m", model_path="/m.onnx",
                model_sha256="ab" * 32, model_family=None, threads=1, batch_size=1, input_size=None, repeat=0,
                workload={"type": "benchmark"}, run_timeout_s=60, base_dir="/")
    with pytest.raises(ValidationError, match="memroy"):
        TaskSpec(**base, sim={"memroy": 1 << 30})
    with pytest.raises(ValidationError, match="warmup"):
        TaskSpec(**{**base, "workload": {"type": "benchmark", "warmup": -1}}, sim={})


def test_a_device_types_budget_past_its_profile_uses_the_one_default_cpu_rule() -> None:
    g6 = load_device_types()["lg-g6"]
    assert g6.budget_for(64).cpus == default_cpus(None, 64, g6.cores) == g6.cores


def test_a_stored_result_comes_back_validated_and_ignores_fields_it_does_not_know() -> None:
    data = RunResult(status=RunStatus.COMPLETED, iterations_ms=[1.0, 2.0]).to_dict()
    back = run_result_from_dict({**data, "field_from_a_newer_agent": 1})
    assert back.to_dict() == data and back.status is RunStatus.COMPLETED
    with pytest.raises(ValidationError):
        run_result_from_dict({**data, "iterations_ms": ["fast"]})
