"""The runtime decides what runs: a model is refused only when the runtime that runs it cannot load it,
with the runtime's own words. Constant nodes (folded at load time, so no kernel), If and Loop run."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from conftest import write_job
from farm.controller.scheduling.jobfile import JobFileError
from farm.models.facts import inspect_model, runtime_refusal
from farm.proto.spec import MAX_INPUT_FILE_BYTES
from model_fixtures import (
    CONTROL_WIDTH,
    dynamic_conv_onnx,
    type_clash_onnx,
    write_control_flow_models,
    write_unsupported_op_onnx,
)
from test_cli_errors import one_paragraph_error

JOB = "models: [{models}]\nworkload: {{type: benchmark, iterations: 5, warmup: 1}}\n"


@pytest.fixture
def control_flow(tmp_path: Path) -> dict[str, Path]:
    return write_control_flow_models(tmp_path)


def test_constant_if_and_loop_models_load_and_are_not_refused(control_flow: dict[str, Path]) -> None:
    for path in control_flow.values():
        onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])  # the bare runtime loads it
        assert runtime_refusal(path) is None
    assert inspect_model(control_flow["constant"]).op_types["Constant"] == 2


def test_constant_if_and_loop_models_run_through_farm_submit(control_flow: dict[str, Path], farm,
                                                             tmp_path: Path) -> None:
    job = write_job(tmp_path, JOB.format(models=", ".join(p.name for p in control_flow.values())))
    run = farm("submit", str(job))
    assert run.returncode == 0, run.stderr
    records = farm("results", "1", "--format", "json").json()
    assert sorted((r["model"]["name"], r["status"]) for r in records) == [
        ("constant", "completed"), ("if_sr", "completed"), ("loop", "completed")]
    assert all(r["latency_ms"]["p50"] > 0 for r in records)


def test_an_unknown_operator_is_refused_with_the_runtimes_message(farm, tmp_path: Path) -> None:
    write_unsupported_op_onnx(tmp_path / "custom_op.onnx")
    one_paragraph_error(farm("submit", str(write_job(tmp_path, JOB.format(models="custom_op.onnx")))),
                        ["custom_op.onnx", "cannot be loaded", "farm.test:FarmUnknownOp",
                         "onnxruntime says", "is not a registered function/op"])
    assert farm("jobs", "--json").json() == []  # nothing stored


def test_a_load_failure_without_an_operator_name_is_still_refused(farm, tmp_path: Path) -> None:
    """No op list could see this one: only loading it tells."""
    path = tmp_path / "clash.onnx"
    path.write_bytes(type_clash_onnx())
    with pytest.raises(Exception, match="Type"):
        onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    refusal = runtime_refusal(path)
    assert refusal is not None and refusal.ops == () and refusal.runtime == "onnxruntime"
    one_paragraph_error(farm("submit", str(write_job(tmp_path, JOB.format(models="clash.onnx")))),
                        ["clash.onnx", "cannot be loaded", "onnxruntime says"])



# --- workload.inputs: values users control --------------------------------------------------------

IF_JOB = """models: [if_sr.onnx]
workload:
  type: benchmark
  iterations: 30
  warmup: 3
{inputs}"""


def _p50_and_values(farm, job: Path, number: int) -> tuple[float, dict[str, str]]:
    run = farm("submit", str(job))
    assert run.returncode == 0, run.stderr
    (record,) = farm("results", str(number), "--format", "json").json()
    assert record["status"] == "completed", record["message"]
    return record["latency_ms"]["p50"], record["input_values"]


def test_an_int64_control_input_given_a_value_picks_the_branch(control_flow: dict[str, Path], farm,
                                                               tmp_path: Path) -> None:
    """silero-vad's shape: `sr == 16000` takes the expensive branch; a random int never does."""
    given_8k = write_job(tmp_path, IF_JOB.format(inputs="  inputs:\n    sr: {value: 8000}\n"), "8k.yaml")
    given_16k = write_job(tmp_path, IF_JOB.format(inputs="  inputs:\n    sr: {value: 16000}\n"), "16k.yaml")
    defaulted = write_job(tmp_path, IF_JOB.format(inputs=""), "default.yaml")
    cheap, values_8k = _p50_and_values(farm, given_8k, 1)
    costly, values_16k = _p50_and_values(farm, given_16k, 2)
    by_default, values_default = _p50_and_values(farm, defaulted, 3)
    assert values_8k["sr"] == "value 8000 (given)" and values_16k["sr"] == "value 16000 (given)"
    assert values_default == {"input": "random uniform [0, 1)", "sr": "value 16000 (default for a sample-rate input)"}
    # 24 chained 256x256 products against one: a gap no busy machine closes (the ratio is ~10x quiet)
    assert costly > 2 * cheap and by_default > 2 * cheap, (cheap, costly, by_default)


def test_input_values_from_a_file_and_a_random_range(control_flow: dict[str, Path], farm, tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.full((1, CONTROL_WIDTH), 0.5, np.float32))
    job = write_job(tmp_path, IF_JOB.format(inputs="  inputs:\n    input: {file: x.npy}\n"
                                                   "    sr: {random: {low: 8000, high: 8000}}\n"))
    _, values = _p50_and_values(farm, job, 1)
    assert values == {"input": "file x.npy (given)", "sr": "random uniform [8000, 8000] (given)"}
    stored = farm("jobs", "--json").json()
    assert stored and stored[0]["status"] == "completed"


@pytest.mark.parametrize("inputs, fragments", [
    ("    sr: {value: .nan}\n", ["workload.inputs.sr.value", "not a finite number"]),
    ("    sr: {value: 16000.5}\n", ["workload.inputs.sr", "int64", "whole numbers"]),
    ("    sr: {value: 99999999999999999999999}\n", ["workload.inputs.sr", "whole numbers"]),
    ("    sr: {value: hello}\n", ["workload.inputs.sr.value", "number"]),
    ("    sr: {}\n", ["workload.inputs.sr", "give value, file, random or shape"]),
    ("    sr: {random: {low: 5, high: 1}}\n", ["workload.inputs.sr.random", "above high"]),
    ("    sr: {random: {low: 0, high: .inf}}\n", ["workload.inputs.sr.random", "finite"]),
    ("    sr: {value: 1, random: {low: 0, high: 1}}\n", ["workload.inputs.sr", "not random with another"]),
    ("    nosuch: {value: 1}\n", ["workload.inputs", "no input named 'nosuch'"]),
    ("    \"bad\\x1bname\": {value: 1}\n", ["without control characters"]),
    ("    input: {value: [[1, 2], [3]]}\n", ["workload.inputs.input.value", "ragged"]),
    ("    input: {file: ../outside.npy}\n", ["workload.inputs.input.file", "outside the job's folder"]),
    ("    input: {file: fifo.npy}\n", ["workload.inputs.input.file", "not a regular file"]),
    ("    input: {file: nan.npy}\n", ["workload.inputs.input.file", "NaN or infinite"]),
    ("    input: {file: pickle.npy}\n", ["workload.inputs.input.file", "without pickles"]),
    ("    input: {file: big.npy}\n", ["workload.inputs.input.file", "bytes; input files are at most"]),
    ("    input: {file: nowhere.npy}\n", ["workload.inputs.input.file", "cannot be opened"]),
], ids=lambda v: v if isinstance(v, str) else None)
def test_hostile_input_values_are_refused_naming_the_field(control_flow: dict[str, Path], farm, tmp_path: Path,
                                                           inputs: str, fragments: list[str]) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    for path in control_flow.values():
        (job_dir / path.name).write_bytes(path.read_bytes())
    (tmp_path / "outside.npy").write_bytes(b"")
    os.mkfifo(job_dir / "fifo.npy")  # a reader would block forever: refused by type before any open
    np.save(job_dir / "nan.npy", np.array([[np.nan] * CONTROL_WIDTH], np.float32))
    np.save(job_dir / "pickle.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with open(job_dir / "big.npy", "wb") as f:
        f.truncate(MAX_INPUT_FILE_BYTES + 1)  # sparse: the size is checked before any read
    one_paragraph_error(farm("submit", str(write_job(job_dir, IF_JOB.format(inputs="  inputs:\n" + inputs))),
                             timeout=120), fragments)
    assert farm("jobs", "--json").json() == []


def test_inspect_counts_weights_in_constant_nodes_and_subgraphs(control_flow: dict[str, Path], farm) -> None:
    counts = {name: farm("inspect", str(path), "--json").json()["param_count"] for name, path in control_flow.items()}
    assert counts == {
        "constant": CONTROL_WIDTH * 16 + 16,  # Constant-node weight and bias
        "if_sr": 2 * CONTROL_WIDTH * CONTROL_WIDTH + 1,  # a weight in each If branch, and the 16000 it compares with
        "loop": CONTROL_WIDTH * CONTROL_WIDTH + 2,  # the body's weight, the trip count and the condition
    }


def test_inspect_with_shape_counts_macs_of_a_dynamic_model(farm, tmp_path: Path) -> None:
    path = tmp_path / "dynamic.onnx"
    path.write_bytes(dynamic_conv_onnx())
    unknown = farm("inspect", str(path), "--json").json()
    assert unknown["macs"] is None
    assert "--shape" in farm("inspect", str(path)).stdout
    report = farm("inspect", str(path), "--shape", "images=1x3x64x48", "--json").json()
    # 3x3 conv, 3 -> 8 channels, same padding: every output element costs 3*3*3 MACs
    assert report["macs"] == 8 * 64 * 48 * 3 * 3 * 3
    assert report["inputs"][0]["shape"] == [1, 3, 64, 48]
    assert farm("inspect", str(path), "--shape", "images=2x3x64x48", "--json").json()["macs"] == 2 * report["macs"]
    for bad, fragment in (("images=1x3x64", "has 4 dimensions"), ("nosuch=1x3x8x8", "no input named 'nosuch'"),
                          ("images=1x0x8x8", "positive whole dimensions"), ("images", "NAME=DIMS"),
                          ("images=1x4x8x8", "fixed dimension 1 of 3")):
        one_paragraph_error(farm("inspect", str(path), "--shape", bad), [fragment])


def test_the_board_harness_feeds_inputs_as_the_sim_does() -> None:
    """Boards run their own Python 3.6-safe harness: the same inputs rule, so a board times the same branch."""
    from farm.agents.board_harness import board_harness

    rng = np.random.RandomState(0)
    data, where = board_harness.feed(np, "sr", [], np.int64, None, rng)
    assert (data.item(), where) == (16000, "value 16000 (default for a sample-rate input)")
    data, where = board_harness.feed(np, "sr", [], np.int64, {"value": 8000}, rng)
    assert (data.item(), where) == (8000, "value (given)")
    data, _ = board_harness.feed(np, "x", [2, 3], np.float32, {"random": {"low": 5, "high": 6}}, rng)
    assert data.shape == (2, 3) and data.dtype == np.float32 and 5 <= data.min() and data.max() <= 6
    with pytest.raises(board_harness.JobError, match="whole numbers"):
        board_harness.feed(np, "sr", [], np.int64, {"value": 0.5}, rng)


@pytest.mark.parametrize("name, dtype, expected, why", [
    ("attention_mask", np.int64, [[1, 1, 1, 1]], "attention mask"),
    ("input_mask", np.int32, [[1, 1, 1, 1]], "attention mask"),
    ("token_type_ids", np.int64, [[0, 0, 0, 0]], "token type ids"),
    ("segment_ids", np.int64, [[0, 0, 0, 0]], "token type ids"),
    ("position_ids", np.int64, [[0, 1, 2, 3]], "position ids"),
])
def test_transformer_inputs_get_values_that_mean_something(name: str, dtype, expected: list, why: str) -> None:
    """Issue 30: a BERT-style model's 0/1 fields are not fed random ids up to 127; the sim and the board agree."""
    from farm.agents.board_harness import board_harness
    from farm.agents.harness.inputs import feed

    sim, sim_why = feed(name, [1, 4], np.dtype(dtype), None, np.random.default_rng(0), {})
    board, board_why = board_harness.feed(np, name, [1, 4], dtype, None, np.random.RandomState(0))
    assert sim.tolist() == board.tolist() == expected and sim.dtype == board.dtype == np.dtype(dtype)
    assert why in sim_why and sim_why == board_why
    given, _ = feed(name, [1, 4], np.dtype(dtype), {"value": 1}, np.random.default_rng(0), {})
    assert given.tolist() == [[1, 1, 1, 1]]  # workload.inputs still wins
    ids, _ = feed("input_ids", [1, 4], np.dtype(np.int64), None, np.random.default_rng(0), {})
    assert ids.max() <= 127  # token ids stay random in the vocabulary's low range


def test_a_fixed_leading_dimension_is_kept_at_batch_1() -> None:
    """silero-vad's state is [2, 1, 128]: its 2 is layers, not a batch; only another batch replaces it."""
    from farm.models.runtimes import resolve_shape

    assert resolve_shape("state", [2, 1, 128], layout="nchw", batch_size=1, input_size=None, overrides={}) == [2, 1, 128]
    # issue 30: a swept batch is the batch run, also where input_shapes gives the other dimensions
    assert resolve_shape("x", ["N", 3, None, None], layout="nchw", batch_size=4, input_size=None,
                         overrides={"x": [1, 3, 64, 64]}) == [4, 3, 64, 64]
    assert resolve_shape("x", ["N", 3, None, None], layout="nchw", batch_size=1, input_size=None,
                         overrides={"x": [2, 3, 64, 64]}) == [2, 3, 64, 64]  # batch 1 leaves a given batch alone
    assert resolve_shape("x", [None, 3], layout="nchw", batch_size=1, input_size=None, overrides={}) == [1, 3]
    assert resolve_shape("x", [1, 3], layout="nhwc", batch_size=4, input_size=None, overrides={}) == [4, 3]


def test_a_controller_never_reads_an_input_file_named_over_the_wire() -> None:
    from farm.controller.scheduling.submission import load_submitted_job
    from farm.proto.generated import farm_pb2

    request = farm_pb2.SubmitJobRequest(
        job_yaml="models: [m.onnx]\nworkload:\n  type: benchmark\n  inputs:\n    x: {file: /etc/shadow}\n",
        file_name="job.yaml", base_dir="/")
    with pytest.raises(JobFileError, match=r"workload.inputs.x.file: input files are read where the job is submitted"):
        load_submitted_job(request, None, [])  # type: ignore[arg-type]  # refused before any file is looked at


def test_a_batch_sweep_runs_the_batch_it_records(farm, tmp_path: Path) -> None:
    """Issue 30: with input_shapes and matrix.batch_sizes both set, each run is fed the swept batch (it used to keep
    input_shapes' batch while results said batch 4 and multiplied samples/s by 4)."""
    (tmp_path / "dynamic.onnx").write_bytes(dynamic_conv_onnx())
    job = tmp_path / "job.yaml"
    job.write_text("""
models: [dynamic.onnx]
workload: {iterations: 5, warmup: 1, input_shapes: {images: [1, 3, 32, 32]}}
matrix: {batch_sizes: [1, 4]}
sim: {on_contention: flag}
""")
    run = farm("submit", str(job), "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    fed = sorted((r["batch_size"], r["input_shapes"]["images"]) for r in run.json()["results"])
    assert fed == [(1, [1, 3, 32, 32]), (4, [4, 3, 32, 32])]
