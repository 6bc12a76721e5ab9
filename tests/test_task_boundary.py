"""A task crosses the store and the wire as the spec's own models: what a user writes in
job.yaml is what the sandbox gets, and what a driver reads is the spec's default, not its own.

The path is written down in docs/architecture.md; these tests walk it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from conftest import require_backend
from farm.agents.android.driver import benchmark_command
from farm.agents.sandbox import backend_class
from farm.agents.sim.driver import SimDriver, SimSlot
from farm.controller.scheduling.controller import Controller
from farm.controller.scheduling.jobfile import JobFileError, load_job_text
from farm.controller.store import SQLiteStore as Store
from farm.controller.analysis.calibrations import CalibrationSource, SimSide
from farm.controller.service import _measurement
from farm.proto.device_types import load_device_types
from farm.proto.generated import common_pb2
from farm.proto.results import RunResult, RunStatus, run_result_from_dict
from farm.proto.job_overrides import OverrideError, apply_overrides
from farm.proto.spec import BenchmarkWorkload, ScriptWorkload, SimBudget, default_cpus
from farm.proto.tasks import TaskSpec
from farm.proto.wire import result_from_message, result_to_message, task_from_message, task_to_message

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
    assert isinstance(task.plan.sim, SimBudget) and isinstance(task.plan.workload, BenchmarkWorkload)
    assert task.plan.sim.memory == 512 * MiB
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
                model_sha256="ab" * 32, model_family=None, threads=1, batch_size=1, input_size=None, repeat=0)
    plan = dict(workload={"type": "benchmark"}, run_timeout_s=60, base_dir="/")
    with pytest.raises(ValidationError, match="memroy"):
        TaskSpec.model_validate({**base, "plan": {**plan, "sim": {"memroy": 1 << 30}}})
    with pytest.raises(ValidationError, match="warmup"):
        TaskSpec.model_validate({**base, "plan": {**plan, "workload": {"type": "benchmark", "warmup": -1}, "sim": {}}})


def test_a_device_types_budget_past_its_profile_uses_the_one_default_cpu_rule() -> None:
    g6 = load_device_types()["lg-g6"]
    assert g6.budget_for(64).cpus == default_cpus(None, 64, g6.cores) == g6.cores


def test_a_stored_result_comes_back_validated_and_ignores_fields_it_does_not_know() -> None:
    data = RunResult(status=RunStatus.COMPLETED, iterations_ms=[1.0, 2.0]).to_dict()
    back = run_result_from_dict({**data, "field_from_a_newer_agent": 1})
    assert back.to_dict() == data and back.status is RunStatus.COMPLETED
    with pytest.raises(ValidationError):
        run_result_from_dict({**data, "iterations_ms": ["fast"]})


# --- sizes are bytes from the job file on: no unit is written back and read again ----------------
def _wire(task: TaskSpec) -> common_pb2.TaskSpec:
    return common_pb2.TaskSpec.FromString(task_to_message(task, common_pb2.TaskSpec()).SerializeToString())


def _task(plan: dict, **fields) -> TaskSpec:
    return TaskSpec.model_validate({
        "task_id": 1, "job_id": 1, "attempt": 1, "target": "sim", "model_name": "m", "model_path": "/m.onnx",
        "model_sha256": "ab" * 32, "model_family": None, "threads": 1, "batch_size": 1, "input_size": None,
        "repeat": 0, "plan": {"workload": {"type": "benchmark"}, "sim": {}, "run_timeout_s": 60, "base_dir": "/",
                              **plan}, **fields})


def test_an_odd_byte_count_survives_the_store_and_the_wire_exactly(tmp_path: Path, tiny_models) -> None:
    task = _leased_task(tmp_path, tiny_models, f"{{memory: {512 * MiB + 1}b, disk: {64 * MiB + 3}b}}")
    assert (task.plan.sim.memory, task.plan.sim.disk) == (512 * MiB + 1, 64 * MiB + 3)
    # a size no float holds: read back through a unit ("Nb" -> float) it would lose its last byte
    huge = (1 << 60) + 1
    arrived = task_from_message(_wire(task.model_copy(update={"plan": task.plan.model_copy(
        update={"sim": task.plan.sim.model_copy(update={"memory": huge})})})))
    assert arrived.plan.sim.memory == huge and type(arrived.plan.sim.memory) is int


@pytest.mark.parametrize("size, said", [(True, "boolean"), (1024, "below 1 MiB"), (-5, "below 1 MiB"),
                                        ("512", "no unit"), (1.5e9, "whole number of bytes"), (float("nan"), "whole number of bytes"), ("inf", "not a memory size")])
def test_a_hostile_size_on_the_wire_is_refused_naming_the_field(size, said: str) -> None:
    message = _wire(_task({}))
    message.sim_json = json.dumps({"memory": size})
    with pytest.raises(ValidationError) as refused:
        task_from_message(message)
    assert "plan.sim.memory" in str(refused.value).replace("\n", ".") and said in str(refused.value)


def test_a_job_file_and_set_still_refuse_a_bare_number(tmp_path: Path, tiny_models) -> None:
    os.symlink(tiny_models["tflite"], tmp_path / "tiny.tflite")
    with pytest.raises(JobFileError, match="sim.memory.*no unit"):
        load_job_text(f"models: [tiny.tflite]\nsim: {{memory: {512 * MiB}}}\n", "job.yaml", tmp_path)
    with pytest.raises(OverrideError, match="--set sim.memory=.*no unit"):
        apply_overrides("models: [tiny.tflite]\n", [f"sim.memory={512 * MiB}"])
    assert load_job_text("models: [tiny.tflite]\nsim: {memory: 512m}\n", "job.yaml", tmp_path).spec.sim.memory == 512 * MiB


# --- the script archive is a typed field: a sha256 that travels, a local path that does not -----
def test_the_script_archive_crosses_the_wire_as_agents_read_it_and_the_local_path_stays_home() -> None:
    sha = "cd" * 32
    task = _task({"workload": {"type": "script", "script": "run.py"}, "script_archive": sha},
                 script_archive_path="/var/lib/farm/artifacts/x.tar")
    assert task.script_archive_path == Path("/var/lib/farm/artifacts/x.tar")
    message = _wire(task)
    assert json.loads(message.extra_json) == {"script_archive": sha}  # the field number and shape of v1
    arrived = task_from_message(message)
    assert arrived.plan.script_archive == sha and arrived.script_archive_path is None
    assert arrived == task.model_copy(update={"script_archive_path": None})
    assert json.loads(_wire(_task({})).extra_json) == {}


def test_a_workload_at_its_defaults_crosses_the_wire_without_the_newer_fields() -> None:
    """An agent of an earlier version refuses a workload key it does not know: fields left at their default
    (a dataset, a vocabulary size, an Android mode ...) are not sent, and arrive as their defaults."""
    task = _task({"workload": {"type": "benchmark", "iterations": 7}})
    sent = json.loads(_wire(task).workload_json)
    assert sent == {"type": "benchmark", "iterations": 7}
    assert task_from_message(_wire(task)) == task
    with_vocab = _task({"workload": {"type": "benchmark", "vocab_size": 30522}})
    assert json.loads(_wire(with_vocab).workload_json)["vocab_size"] == 30522
    assert task_from_message(_wire(with_vocab)) == with_vocab


@pytest.mark.parametrize("extra, said", [({"script_archive": "../../etc/passwd"}, "plan.script_archive"),
                                         ({"script_archive": "AB" * 32}, "plan.script_archive"),
                                         ({"script_archive_path": "/etc/shadow"}, "script_archive_path")])
def test_a_hostile_script_archive_on_the_wire_is_refused(extra: dict, said: str) -> None:
    message = _wire(_task({}))
    message.extra_json = json.dumps(extra)
    with pytest.raises(ValidationError) as refused:
        task_from_message(message)
    assert said.split(".")[-1] in str(refused.value)


def test_a_leased_script_task_carries_its_jobs_archive_in_the_plan(tmp_path: Path, tiny_models) -> None:
    os.symlink(tiny_models["tflite"], tmp_path / "tiny.tflite")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "run.py").write_text("print('{}')\n")
    job = load_job_text("models: [tiny.tflite]\nworkload: {type: script, script: run.py, dir: bench}\n",
                        "job.yaml", tmp_path)
    job.script_archive = "ef" * 32  # as a controller sets it from the client's upload
    controller = Controller(Store(tmp_path / "farm.db"))
    controller.submit(job)
    task = controller.lease("agent-1", {"sim"})
    assert task is not None and task.plan.script_archive == "ef" * 32 and task.script_archive_path is None
    assert task.plan.base_dir == str(tmp_path) and isinstance(task.plan.workload, ScriptWorkload)


# --- prediction builds its JobSpec, as a job file would give it ----------------------------------
def test_a_predictions_job_spec_equals_the_one_its_job_file_gives(tmp_path: Path, tiny_models) -> None:
    os.symlink(tiny_models["onnx"], tmp_path / "tiny.onnx")
    user = load_job_text(
        f"name: predict tiny.onnx\nmodels: [{{path: {tmp_path / 'tiny.onnx'}, name: tiny}}]\n"
        "workload: {type: benchmark, iterations: 7, warmup: 2}\nsim: {cpus: 1, memory: 768m, disk: 1g}\n"
        "matrix: {threads: [2]}\npriority: interactive\n", "job.yaml", tmp_path)
    # what a calibration records of its sim side: the stored spec's budget and workload (bytes, all fields)
    stored = {"sim": user.spec.sim.model_dump(mode="json"), "workload": user.spec.workload.model_dump(mode="json")}
    measured = _measurement(tmp_path / "tiny.onnx", "tiny.onnx", 2, SimSide.model_validate(stored))
    assert measured.spec == user.spec and measured.spec.sim.memory == 768 * MiB
    assert [m.facts.sha256 for m in measured.models] == [m.facts.sha256 for m in user.models]
    # the text stored with the prediction job is a job file that gives the same spec back
    again = load_job_text(measured.source, "stored.yaml", tmp_path)
    assert again.spec == measured.spec


def test_a_calibration_whose_stored_sim_side_no_longer_validates_records_none(tmp_path: Path) -> None:
    """The stored source is parsed once, where it is read: a sim side this farm no longer accepts (below 1 MiB is
    never a real budget) reads as none recorded, so `farm predict` says to refit rather than measure it wrongly."""
    stored = json.dumps({"job": 3, "sim": {"memory": 1024}, "workload": {"type": "benchmark"}})
    source = CalibrationSource.of(stored)
    assert source.sim is None and source.workload is None and source.job == 3  # the job it came from stays
    assert CalibrationSource.of('{"job": "x"}') == CalibrationSource() and CalibrationSource.of("[1]") == CalibrationSource()
    good = json.dumps({"job": 3, "sim": {"memory": 768 * MiB}, "workload": {"type": "benchmark"}})
    assert CalibrationSource.of(good).sim is not None  # the same source with a real budget keeps it


# --- a calibration key is a result field: typed on the wire, stored where old rows have it -------
def test_the_runtime_crosses_the_wire_as_a_field_of_its_own() -> None:
    result = RunResult(status=RunStatus.COMPLETED, iterations_ms=[1.0], environment={"input_shapes": {}},
                       runtime="litert")
    message = result_to_message(result, common_pb2.RunResult())
    assert message.runtime == "litert" and "runtime" not in json.loads(message.environment_json)
    assert result_from_message(common_pb2.RunResult.FromString(message.SerializeToString())) == result


def test_a_result_from_an_older_agent_has_its_runtime_lifted_out_of_the_environment() -> None:
    old = result_to_message(RunResult(status=RunStatus.COMPLETED), common_pb2.RunResult())
    old.environment_json = json.dumps({"runtime": "onnxruntime", "x": 1})  # as this version's predecessor sent it
    arrived = result_from_message(old)
    assert arrived.runtime == "onnxruntime" and arrived.environment == {"x": 1}
    old.environment_json = '{"runtime": [1]}'
    hostile = result_from_message(old)
    assert hostile.runtime is None  # not a name: left where it was, never a calibration key


def test_a_stored_runtime_reads_back_alike_for_new_and_old_rows(tmp_path: Path, tiny_models) -> None:
    from farm.controller.analysis.calibrations import job_values
    from farm.controller.analysis.results import run_records

    os.symlink(tiny_models["tflite"], tmp_path / "tiny.tflite")
    store = Store(tmp_path / "farm.db")
    controller = Controller(store)
    for runtime, environment in (("litert", {}), (None, {"runtime": "onnxruntime"})):  # a new, then an old agent
        job = controller.submit(load_job_text("models: [tiny.tflite]\n", "job.yaml", tmp_path))
        task = controller.lease("agent-1", {"sim"}, job_id=job)
        assert task is not None
        result = RunResult(status=RunStatus.COMPLETED, whole_run_s=1.5, environment=dict(environment), runtime=runtime)
        controller.complete(task.task_id, task.attempt, "agent-1", 0.0, result)
        [value] = job_values(store, job, "whole_run")
        [record] = run_records(store, job)
        assert value.runtime == record.runtime == (runtime or environment["runtime"])


def test_every_field_of_the_plan_and_the_task_has_a_place_in_the_message() -> None:
    from farm.proto.tasks import TaskPlan
    from farm.proto.wire import _PLAN_FIELDS, _TaskExtra

    # a field added to the plan without a place here would be dropped on the way to a remote agent
    assert set(TaskPlan.model_fields) == {*_PLAN_FIELDS, *_TaskExtra.model_fields}
    message_fields = {f.name.removesuffix("_json") for f in common_pb2.TaskSpec.DESCRIPTOR.fields}
    own = set(TaskSpec.model_fields) - {"plan", "script_archive_path"}  # the local path never travels
    assert message_fields == own | set(_PLAN_FIELDS) | {"extra"}
