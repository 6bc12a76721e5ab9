"""A malformed job file is refused before anything runs: one paragraph naming the file,
line and field, exit code 2, no traceback, nothing stored.

The validator's messages are a pure rule: each is checked through `farm.cli.main.main(argv)` in this
process (`farm_inprocess`: the same exit code, streams and store), and one refusal goes through a real
`farm submit` process (issue 34)."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import onnx
import pytest

from conftest import write_job
from farm.client.runner import run_job_embedded
from farm.controller.scheduling.controller import Controller
from farm.controller.scheduling.jobfile import DeviceTarget, HostCapacity, load_job_text
from farm.controller.store import SQLiteStore as Store
from model_fixtures import write_delegate_only_op_tflite

GOOD_WORKLOAD = "workload: {type: benchmark, iterations: 3, warmup: 1}\n"
# the jobs that run keep a contended run, marked, instead of measuring it again: the policy is test_contention.py's
FLAG_CONTENTION = "sim: {on_contention: flag}\n"

CASES = {
    # name: (job text, expected line, fragments that must all appear)
    "unknown field": (
        "models: [tiny.tflite]\nworkload:\n  type: benchmark\n  iteratons: 5\n",
        4, ["workload.iteratons", "unknown field"]),
    "wrong type": (
        "models: [tiny.tflite]\n" + GOOD_WORKLOAD + "repeats: lots\n",
        3, ["repeats", "integer"]),
    "missing model": (
        "models:\n  - tiny.tflite\n  - path: nowhere/resnet.tflite\n" + GOOD_WORKLOAD,
        3, ["models[1]", "nowhere/resnet.tflite", "does not exist"]),
    "negative iterations": (
        "models: [tiny.tflite]\nworkload:\n  type: benchmark\n  iterations: -5\n",
        4, ["workload.iterations", "greater than 0"]),
    "duplicate threads": (
        "models: [tiny.tflite]\n" + GOOD_WORKLOAD + "matrix:\n  threads: [1, 1, 1]\n",
        4, ["matrix.threads", "1 listed more than once", "repeats"]),
    "duplicate input sizes": (
        "models: [tiny.tflite]\n" + GOOD_WORKLOAD + "matrix:\n  input_sizes: [null, 96, null]\n",
        4, ["matrix.input_sizes", "null listed more than once"]),
    "a 100,000-character job name": (
        "models: [tiny.tflite]\n" + GOOD_WORKLOAD + "name: " + "n" * 100_000 + "\n",
        3, ["name", "100,000 characters long", "at most 200"]),
    "a 100,000-character model name": (
        "models:\n  - {path: tiny.tflite, name: " + "m" * 100_000 + "}\n" + GOOD_WORKLOAD,
        2, ["models[0].name", "100,000 characters long", "at most 200"]),
    "zero threads": (
        "models: [tiny.tflite]\n" + GOOD_WORKLOAD + "matrix:\n  threads: [1, 0]\n",
        4, ["matrix.threads", "at least 1"]),
    "bad memory string": (
        "models: [tiny.tflite]\n" + GOOD_WORKLOAD + "sim:\n  memory: 2 gigs\n",
        4, ["sim.memory", "not a memory size"]),
    "empty model list": (
        "models: []\n" + GOOD_WORKLOAD,
        1, ["models", "at least one model"]),
    "corrupt tflite": (
        "models: [corrupt.tflite]\n" + GOOD_WORKLOAD,
        1, ["models[0]", "corrupt.tflite"]),
    "unsupported operator tflite": (
        "models: [custom_op.tflite]\n" + GOOD_WORKLOAD,
        1, ["models[0]", "custom_op.tflite", "FarmUnknownOp"]),
    "unsupported operator onnx": (
        "models: [custom_op.onnx]\n" + GOOD_WORKLOAD,
        1, ["models[0]", "custom_op.onnx", "FarmUnknownOp", "cannot be loaded", "onnxruntime says"]),
    "missing script": (
        "models: [tiny.tflite]\nworkload:\n  type: script\n  script: infer.py\n",
        4, ["workload.script", "infer.py", "does not exist"]),
    "script is a directory": (
        "models: [tiny.tflite]\nworkload:\n  type: script\n  script: scripts\n",
        4, ["workload.script", "scripts", "does not exist"]),
    "not yaml": (
        "models: [tiny.tflite\nworkload: {type: benchmark}\n",
        None, ["not valid YAML"]),
    "glob matches nothing": (
        "models: ['zoo/*.onnx']\n" + GOOD_WORKLOAD,
        1, ["models[0]", "zoo/*.onnx", "matches no file"]),
    "bad cpuset": (
        "models: [tiny.tflite]\n" + GOOD_WORKLOAD + "sim: {cpuset: 'first two'}\n",
        3, ["sim.cpuset", "not a cpuset"]),
    "unknown target": (
        "models: [tiny.tflite]\n" + GOOD_WORKLOAD + "targets: [pixel7]\n",
        3, ["targets[0]", "pixel7", "no device matches"]),
    "bad duration": (
        "models: [tiny.tflite]\n" + GOOD_WORKLOAD + "timeouts: {run: soon}\n",
        3, ["timeouts.run", "not a duration"]),
    "non-finite timeout": (  # a NaN limit would never trip
        "models: [tiny.tflite]\n" + GOOD_WORKLOAD + "timeouts: {run: .nan}\n",
        3, ["timeouts.run", "not a finite duration"]),
    "infinite build timeout": (
        "models: [tiny.tflite]\n" + GOOD_WORKLOAD + "sim: {backend: docker, build: {run: ['true'], timeout: .inf}}\n",
        3, ["sim.build.timeout", "not a finite duration"]),
    "unknown workload type": (
        "models: [tiny.tflite]\nworkload: {type: profile}\n",
        2, ["workload", "type"]),
    # a bare number is refused whether quoted or not, with the unit it most likely lacks
    "bare memory number": (
        "models: [tiny.tflite]\n" + GOOD_WORKLOAD + "sim:\n  memory: 1024\n",
        4, ["sim.memory", "no unit", "did you mean 1024m?"]),
    "quoted bare memory number": (
        "models: [tiny.tflite]\n" + GOOD_WORKLOAD + "sim:\n  memory: '512'\n",
        4, ["sim.memory", "no unit", "did you mean 512m?"]),
    "memory below a MiB": (
        "models: [tiny.tflite]\n" + GOOD_WORKLOAD + "sim:\n  memory: 512k\n",
        4, ["sim.memory", "below 1 MiB", "did you mean 512m?"]),
    "cpuset backwards": (
        "models: [tiny.tflite]\n" + GOOD_WORKLOAD + "sim:\n  cpuset: '5-3'\n",
        4, ["sim.cpuset", "'5-3'", "runs backwards", "3-5"]),
    "cpuset cores this host lacks": (
        "models: [tiny.tflite]\n" + GOOD_WORKLOAD + "sim:\n  cpuset: '0,4000-4001'\n",
        4, ["sim.cpuset", "4000,4001", "cannot use"]),
    "unknown placeholder": (
        "models: [tiny.tflite]\nworkload:\n  type: script\n  script: run.py\n  args: ['--model', '{modle}']\n",
        5, ["workload.args", "unknown placeholder {modle}", "{model}", "{threads}"]),
    "stray brace in args": (
        "models: [tiny.tflite]\nworkload:\n  type: script\n  args: ['--x={']\n",
        4, ["workload.args", "'--x={'", "{{"]),
    "duplicate key": (
        "models: [tiny.tflite]\n" + GOOD_WORKLOAD + "repeats: 2\nsim: {cpus: 1}\nrepeats: 3\n",
        5, ["repeats", "duplicate key", "first at line 3"]),
    "duplicate nested key": (
        "models: [tiny.tflite]\nworkload:\n  type: benchmark\n  iterations: 3\n  iterations: 30\n",
        5, ["workload.iterations", "duplicate key", "first at line 4"]),
    "symlink loop": (
        "models: [tiny.tflite, loop_a.tflite]\n" + GOOD_WORKLOAD,
        1, ["models[1]", "loop_a.tflite", "symlink loop"]),
    "dangling symlink": (
        "models: [dangling.tflite]\n" + GOOD_WORKLOAD,
        1, ["models[0]", "dangling.tflite", "symlink to", "does not exist"]),
    "dynamic onnx dimension without input_shapes": (
        "models: [dynamic.onnx]\n" + GOOD_WORKLOAD,
        1, ["models[0]", "dynamic.onnx", "input 'tokens'", "dynamic dimension(s) [1]", "workload.input_shapes.tokens"]),
    "task explosion": (
        "models: [tiny.tflite]\n" + GOOD_WORKLOAD + "matrix: {threads: [1, 2], batch_sizes: [1, 2, 3]}\nrepeats: 1000\n"
        "targets: [sim]\n",
        1, ["expands to 6,000", "1 model(s) × 6 matrix cell(s) × 1,000 repeat(s) × 1 target run(s)", "--max-tasks"]),
    # "billion laughs": ten levels of aliases would be 10^10 entries if anything walked them out
    "yaml alias bomb": (
        "l0: &a0 [tiny.tflite, tiny.tflite, tiny.tflite, tiny.tflite, tiny.tflite, tiny.tflite, tiny.tflite]\n"
        + "".join(f"l{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 11)) + "models: *a10\n",
        1, ["l0: unknown field", "models[0]"]),
}
# Run with --max-tasks 5000 so "task explosion" stays a small file; the default limit has its own test.
EXTRA_ARGS = {"task explosion": ["--max-tasks", "5000"]}


@pytest.fixture
def job_dir(tmp_path: Path, tiny_models) -> Path:
    for key, name in (("tflite", "tiny.tflite"), ("corrupt_tflite", "corrupt.tflite"),
                      ("unsupported_tflite", "custom_op.tflite"), ("unsupported_onnx", "custom_op.onnx")):
        os.symlink(tiny_models[key], tmp_path / name)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "run.py").write_text("print('hi')\n")
    os.symlink("loop_b.tflite", tmp_path / "loop_a.tflite")
    os.symlink("loop_a.tflite", tmp_path / "loop_b.tflite")
    os.symlink("gone.tflite", tmp_path / "dangling.tflite")
    write_dynamic_onnx(tmp_path / "dynamic.onnx")
    return tmp_path


def write_dynamic_onnx(path: Path) -> Path:
    """A model whose input is (batch, tokens): the second dimension is known only at run time."""
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["tokens"], ["out"])], "dynamic",
        [onnx.helper.make_tensor_value_info("tokens", onnx.TensorProto.FLOAT, ["batch", "length"])],
        [onnx.helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, ["batch", "length"])])
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)]), path)
    return path


def _refused_with_file_line_and_field(case: str, job_dir: Path, farm, farm_db: Path) -> None:
    text, line, fragments = CASES[case]
    write_job(job_dir, text)
    result = farm("submit", "job.yaml", *EXTRA_ARGS.get(case, []), cwd=job_dir)
    assert result.returncode == 2, result.stderr
    message = result.stderr
    assert "Traceback" not in message
    assert result.stdout == ""
    assert message.startswith("error: job.yaml")
    if line is not None:
        assert f"job.yaml:{line}:" in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    # one paragraph: no blank line inside the message, and never the whole of a hostile value
    assert "\n\n" not in message.strip() and len(message) < 5000
    # nothing was stored for a refused job
    if farm_db.exists():
        assert sqlite3.connect(farm_db).execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_job_is_refused_with_file_line_and_field(case: str, job_dir: Path, farm_inprocess, farm_db: Path) -> None:
    _refused_with_file_line_and_field(case, job_dir, farm_inprocess, farm_db)


@pytest.mark.parametrize("case", ["unknown field", "corrupt tflite"])
def test_a_refused_job_through_a_real_process(case: str, job_dir: Path, farm, farm_db: Path) -> None:
    # the smoke test: the console script's process says the same as main() in-process (streams, exit code)
    _refused_with_file_line_and_field(case, job_dir, farm, farm_db)


def test_missing_job_file(farm_inprocess, tmp_path: Path) -> None:
    result = farm_inprocess("submit", "nope.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert "nope.yaml: no such job file" in result.stderr


def test_schema_lists_every_field(farm_inprocess) -> None:
    schema = farm_inprocess("schema").json()
    props = schema["properties"]
    for key in ("models", "workload", "matrix", "repeats", "targets", "sim", "timeouts"):
        assert key in props
    defs = schema["$defs"]
    assert defs["Strict"] if "Strict" in defs else True
    assert defs["SimBudget"]["additionalProperties"] is False
    assert "memory" in defs["SimBudget"]["properties"]


def test_every_bad_model_is_listed_at_once_and_as_json(job_dir: Path, farm_inprocess, farm_db: Path) -> None:
    write_job(job_dir, "models:\n  - tiny.tflite\n  - loop_a.tflite\n  - custom_op.tflite\n  - corrupt.tflite\n"
                       "  - nowhere.onnx\n" + GOOD_WORKLOAD)
    result = farm_inprocess("submit", "job.yaml", "--json", cwd=job_dir)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error: job.yaml:3: models[1]") and "symlink loop" in lines[0]
    assert [line.split(": ")[1] for line in lines[1:]] == ["models[2]", "models[3]", "models[4]", "models"]
    assert "the other 1 model(s) can run: `farm submit --skip-invalid` runs them" in lines[4]
    assert "FarmUnknownOp" in lines[1] and "corrupt.tflite" in lines[2] and "does not exist" in lines[3]
    document = json.loads(result.stdout)  # the same, for scripts
    assert document["exit_code"] == 2
    assert [(p["file"], p["line"], p["field"]) for p in document["problems"]] == [
        ("job.yaml", 3, "models[1]"), ("job.yaml", 4, "models[2]"), ("job.yaml", 5, "models[3]"),
        ("job.yaml", 6, "models[4]"), ("job.yaml", None, "models")]
    assert not farm_db.exists() or sqlite3.connect(farm_db).execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 0


def test_skip_invalid_runs_the_rest_and_records_the_bad_ones(job_dir: Path, farm, farm_db: Path) -> None:
    write_job(job_dir, "models: [tiny.tflite, custom_op.tflite, nowhere.onnx]\n" + GOOD_WORKLOAD + FLAG_CONTENTION)
    result = farm("submit", "job.yaml", "--skip-invalid", "--json", cwd=job_dir)
    assert result.returncode == 1, result.stderr  # the job ran; some of it failed
    assert "skipped: job.yaml:1: models[1]" in result.stderr and "skipped: job.yaml:1: models[2]" in result.stderr
    records = {r["model"]["name"]: r for r in json.loads(result.stdout)["results"]}
    assert records["tiny"]["status"] == "completed"
    for name, fragment in (("custom_op", "FarmUnknownOp"), ("nowhere", "does not exist")):
        assert records[name]["status"] == "failed" and records[name]["failure_class"] == "job"
        assert fragment in records[name]["message"] and records[name]["attempts"] == 0
    # nothing but the good model ran (a contention retry may run it twice: still one task)
    assert sqlite3.connect(farm_db).execute("SELECT COUNT(DISTINCT task_id) FROM runs").fetchone()[0] == 1
    write_job(job_dir, "models: [custom_op.tflite]\n" + GOOD_WORKLOAD)
    all_bad = farm("submit", "job.yaml", "--skip-invalid", cwd=job_dir)
    assert all_bad.returncode == 2 and "no model of the job can run" in all_bad.stderr


def test_a_huge_job_is_refused_before_it_is_expanded(job_dir: Path, farm_inprocess, farm_db: Path) -> None:
    # ~1 MiB of YAML that would expand to 10^8 tasks: refused with the counts, under the default limit
    values = ", ".join(str(i) for i in range(1, 10_001))
    text = f"models: [tiny.tflite]\n{GOOD_WORKLOAD}matrix:\n  threads: [{values}]\n  batch_sizes: [{values}]\n"
    write_job(job_dir, text)
    result = farm_inprocess("submit", "job.yaml", cwd=job_dir)
    assert result.returncode == 2, result.stderr
    assert "expands to 100,000,000 runs" in result.stderr and "100,000,000 matrix cell(s)" in result.stderr
    assert "over the limit of 10,000 per job" in result.stderr
    assert not farm_db.exists() or sqlite3.connect(farm_db).execute("SELECT COUNT(*) FROM tasks").fetchone()[0] == 0


def test_the_validator_loads_a_model_as_the_harness_does(tmp_path: Path, farm) -> None:
    # MediaPipe's Convolution2DTransposeBias has no builtin kernel: only XNNPACK (the AUTO resolver) runs it.
    write_delegate_only_op_tflite(tmp_path / "deconv.tflite")
    write_job(tmp_path, "models: [deconv.tflite]\n" + GOOD_WORKLOAD + FLAG_CONTENTION)
    run = farm("submit", "job.yaml", "--json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["results"][0]["status"] == "completed"
    assert "XNNPACK delegate" not in run.stderr.split("job 1:")[0]  # validation prints no runtime banner
    # without XNNPACK the harness could not run it, and the validator says so before any run
    write_job(tmp_path, "models: [deconv.tflite]\nworkload: {type: benchmark, iterations: 3, use_xnnpack: false}\n")
    refused = farm("submit", "job.yaml", cwd=tmp_path)
    assert refused.returncode == 2 and "Convolution2DTransposeBias" in refused.stderr
    assert "job.yaml:1: models[0]" in refused.stderr


def test_budgets_above_the_host_are_warnings(job_dir: Path, farm) -> None:
    host = HostCapacity.here()
    too_much = f"{host.memory_bytes * 2 // (1 << 30) + 1}g"
    write_job(job_dir, f"models: [tiny.tflite]\n{GOOD_WORKLOAD}sim:\n  cpus: 1000\n  memory: {too_much}\n"
                       "  on_contention: flag\n")
    result = farm("submit", "job.yaml", "--json", cwd=job_dir)
    assert result.returncode == 0, result.stderr
    assert (f"warning: job.yaml:4: sim.cpus: 1000 CPUs is more than the {len(host.cores)} core(s) this host has; "
            "the sim cannot give more than it has") in result.stderr
    assert "warning: job.yaml:5: sim.memory:" in result.stderr and "more than this host's" in result.stderr
    assert [w["field"] for w in json.loads(result.stdout)["warnings"]] == ["sim.cpus", "sim.memory"]


def test_thread_counts_above_the_host_are_a_warning(job_dir: Path) -> None:
    text = f"models: [tiny.tflite]\n{GOOD_WORKLOAD}matrix: {{threads: [1, 1000]}}\n"
    two_cores = HostCapacity(cores=[0, 1], memory_bytes=24 << 30)  # the machine of the report
    job = load_job_text(text, "job.yaml", job_dir, host=two_cores)
    assert [str(w) for w in job.warnings] == [
        "job.yaml:3: matrix.threads: 1000 threads get a budget of as many CPUs, more than the 2 core(s) this host "
        "has; the sim cannot give more than it has, so those runs get at most 2 and their threads share cores."]
    assert load_job_text(text, "job.yaml", job_dir).warnings == []  # a controller does not know the agents' hosts


def test_a_cpuset_the_agent_lacks_fails_the_run_as_job_without_retry(job_dir: Path, tmp_path: Path) -> None:
    # A controller validates without knowing the agent's host; the agent's sim driver refuses the cores.
    job = load_job_text(f"models: [tiny.tflite]\n{GOOD_WORKLOAD}sim: {{cpuset: '0,4000'}}\n", "job.yaml", job_dir)
    store = Store(tmp_path / "store.db")
    job_id = Controller(store).submit(job)
    assert run_job_embedded(store, job_id)
    task = store.jobs.tasks(job_id)[0]
    assert (task.status, task.failure_class, task.attempts) == ("failed", "job", 1)
    assert "sim.cpuset '0,4000' names core(s) 4000" in task.message and "cannot use" in task.message


def test_device_twin_budgets_above_the_host_are_a_warning(job_dir: Path) -> None:
    from farm.proto.device_types import load_device_types
    orin = load_device_types()["jetson-orin-nano"]
    devices = [DeviceTarget("orin-1", orin, ["rack-a"])]
    text = f"models: [tiny.tflite]\n{GOOD_WORKLOAD}matrix: {{threads: [1, 4]}}\ntargets: [sim, tag:rack-a]\n"
    job = load_job_text(text, "job.yaml", job_dir, devices=devices, host=HostCapacity(cores=[0, 1], memory_bytes=24 << 30))
    assert [str(w) for w in job.warnings] == [
        "job.yaml:3: matrix.threads: 4 threads get a budget of as many CPUs, more than the 2 core(s) this host has; "
        "the sim cannot give more than it has, so those runs get at most 2 and their threads share cores.",
        "job.yaml:4: targets[1]: the sim twins of orin-1 get up to 4 CPUs and 4.0 GiB (device type jetson-orin-nano), "
        "more than the 2 core(s) this host has or this host's memory; the sim cannot give more than it has."]


# --- farm submit --set: any field, for one submission --------------------------------------------------
SET_CASES = {
    # --set, fragments the one-paragraph error must hold
    "repeats=lots": ["--set repeats=lots", "repeats", "integer"],
    "matrix.threads=[1": ["--set matrix.threads", "not valid YAML", "quote it"],
    "workload.iterations.x=3": ["--set workload.iterations.x=3", "workload.iterations is 3, not a mapping"],
    "workload.iteratons=3": ["--set workload.iteratons=3", "workload.iteratons", "unknown field"],
    "models.4.path=x.onnx": ["--set models.4.path=x.onnx", "models is a list of 1", "0 to 0"],
    "iterations": ["--set 'iterations'", "FIELD=VALUE"],
    "matrix.threads=[0]": ["--set matrix.threads=[0]", "at least 1"],
}


@pytest.mark.parametrize("override", list(SET_CASES))
def test_a_bad_set_is_refused_naming_the_set(override: str, job_dir: Path, farm_inprocess, farm_db: Path) -> None:
    write_job(job_dir, "models: [tiny.tflite]\n" + GOOD_WORKLOAD)
    result = farm_inprocess("submit", "job.yaml", "--set", override, cwd=job_dir)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("error: job.yaml: ") and "\n\n" not in result.stderr.strip()
    for fragment in SET_CASES[override]:
        assert fragment in result.stderr, (fragment, result.stderr)
    assert not farm_db.exists() or sqlite3.connect(farm_db).execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 0


def test_set_overrides_fields_and_the_stored_job_is_the_one_that_ran(job_dir: Path, farm, farm_db: Path) -> None:
    write_job(job_dir, "name: long\nmodels: [tiny.tflite]\nworkload: {type: benchmark, iterations: 500, warmup: 5}\n"
                       "matrix: {threads: [1, 2, 4]}\nrepeats: 5\n" + FLAG_CONTENTION)
    result = farm("submit", "job.yaml", "--json", "--set", "workload.iterations=4", "--set", "repeats=1",
                  "--set", "matrix.threads=[1]", "--set", "sim.memory=256m", "--set", "models.0.name=small",
                  cwd=job_dir)
    assert "Traceback" not in result.stderr, result.stderr
    records = result.json()["results"]
    assert len(records) == 1 and records[0]["threads"] == 1 and records[0]["model"]["name"] == "small"
    name, spec_json, spec_yaml = sqlite3.connect(farm_db).execute(
        "SELECT name, spec_json, spec_yaml FROM jobs").fetchone()
    spec = json.loads(spec_json)
    assert name == "long" and spec["workload"]["iterations"] == 4 and spec["repeats"] == 1
    assert spec["matrix"]["threads"] == [1] and spec["sim"]["memory"] == 256 << 20
    # the stored text says what was changed on the command line
    assert spec_yaml.startswith("# farm submit --set workload.iterations=4\n# farm submit --set repeats=1\n")
    assert (job_dir / "job.yaml").read_text().count("iterations: 500") == 1  # the file itself is untouched
