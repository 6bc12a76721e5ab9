"""Per-model inputs (issue 30): a model entry carries its own `inputs` and `input_shapes` (the workload's are
defaults), every shape conflict of every model is found at submit in one message, and runs record what they fed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import write_job
from model_fixtures import CONTROL_WIDTH, dynamic_conv_onnx, write_control_flow_models
from test_cli_errors import one_paragraph_error


@pytest.fixture
def two_kinds(tmp_path: Path) -> Path:
    """if_sr.onnx (input [1, 256], sr int64 scalar) and dyn.onnx (images [batch, 3, height, width]): no input
    name in common, one of them with dimensions only the job can fix."""
    write_control_flow_models(tmp_path)
    (tmp_path / "dyn.onnx").write_bytes(dynamic_conv_onnx())
    return tmp_path


MIXED = """models:
  - path: if_sr.onnx
    inputs:
      sr: {value: 8000}
      input: {file: half.npy}
  - path: dyn.onnx
    input_shapes:
      images: [1, 3, 16, 24]
workload: {type: benchmark, iterations: 3, warmup: 1}
sim: {on_contention: flag}
"""


def test_a_job_mixes_two_models_with_different_inputs(two_kinds: Path, farm_inprocess) -> None:
    np.save(two_kinds / "half.npy", np.full((1, CONTROL_WIDTH), 0.5, np.float32))
    run = farm_inprocess("submit", str(write_job(two_kinds, MIXED)))
    assert run.returncode == 0, run.stderr
    records = {r["model"]["name"]: r for r in farm_inprocess("results", "1", "--format", "json").json()}
    assert {n: r["status"] for n, r in records.items()} == {"if_sr": "completed", "dyn": "completed"}
    assert records["if_sr"]["input_values"] == {"input": "file half.npy (given)", "sr": "value 8000 (given)"}
    assert records["if_sr"]["input_shapes"] == {"input": [1, CONTROL_WIDTH], "sr": []}
    assert records["dyn"]["input_shapes"] == {"images": [1, 3, 16, 24]}  # the shape actually fed


def test_the_workload_gives_defaults_and_an_entry_replaces_them(two_kinds: Path, farm_inprocess) -> None:
    job = write_job(two_kinds, """models:
  - if_sr.onnx
  - {path: if_sr.onnx, name: given, inputs: {sr: {value: 8000}}}
workload:
  type: benchmark
  iterations: 2
  warmup: 0
  inputs: {sr: {value: 16000}}
sim: {on_contention: flag}
""")
    run = farm_inprocess("submit", str(job))
    assert run.returncode == 0, run.stderr
    values = {r["model"]["name"]: r["input_values"]["sr"]
              for r in farm_inprocess("results", "1", "--format", "json").json()}
    assert values == {"if_sr": "value 16000 (given)", "given": "value 8000 (given)"}


def test_every_shape_conflict_of_every_model_in_one_message(two_kinds: Path, farm_inprocess) -> None:
    np.save(two_kinds / "wide.npy", np.zeros((1, CONTROL_WIDTH + 1), np.float32))
    job = write_job(two_kinds, """models:
  - path: if_sr.onnx
    inputs:
      input: {file: wide.npy}
      sr: {value: [1, 2]}
  - path: dyn.onnx
  - path: dyn.onnx
    name: second
    input_shapes: {images: [1, 3, 8, 8]}
    inputs: {images: {value: [[1, 2, 3]]}}
workload: {type: benchmark, iterations: 2}
""")
    one_paragraph_error(farm_inprocess("submit", str(job)), [
        "models[0].inputs.input", "wide.npy", f"[1, {CONTROL_WIDTH + 1}]",  # the .npy disagrees with the model
        "models[0].inputs.sr", "[2]",  # a value for a scalar input
        "models[1].inputs.images", "dynamic dimension",  # left unset
        "models[2].inputs.images", "[1, 3]", "[1, 3, 8, 8]",  # a value that input_shapes contradicts
    ])
    assert farm_inprocess("jobs", "--json").json() == []  # nothing stored


def test_an_entry_names_an_input_its_model_lacks(two_kinds: Path, farm_inprocess) -> None:
    job = write_job(two_kinds, "models:\n  - {path: dyn.onnx, input_shapes: {input: [1, 3]}}\n")
    one_paragraph_error(farm_inprocess("submit", str(job)), ["models[0].input_shapes.input", "no input named 'input'"])


def test_a_per_model_input_file_outside_the_folder_is_refused(two_kinds: Path, farm_inprocess) -> None:
    job = write_job(two_kinds, "models:\n  - {path: if_sr.onnx, inputs: {input: {file: ../x.npy}}}\n")
    one_paragraph_error(farm_inprocess("submit", str(job)), ["models[0].inputs.input.file", "outside the job's folder"])


def test_a_script_workload_takes_no_model_inputs(two_kinds: Path, farm_inprocess) -> None:
    job = write_job(two_kinds, "models:\n  - {path: if_sr.onnx, inputs: {sr: {value: 1}}}\n"
                               "workload: {type: script, command: 'true'}\n")
    one_paragraph_error(farm_inprocess("submit", str(job)), ["models[0]", "script workload"])


def test_token_ids_stay_below_the_vocabulary_the_user_sets() -> None:
    from farm.agents.board_harness import board_harness
    from farm.agents.harness.inputs import feed

    ids, why = feed("input_ids", [4, 64], np.dtype(np.int64), None, np.random.default_rng(0), {}, vocab_size=5)
    board, board_why = board_harness.feed(np, "input_ids", [4, 64], np.int64, None, np.random.RandomState(0), 5)
    assert ids.min() >= 0 and ids.max() == 4 and board.min() >= 0 and board.max() == 4
    assert why == board_why == "random token ids [0, 4] (workload.vocab_size 5)"
    given, _ = feed("input_ids", [1, 2], np.dtype(np.int64), {"value": 7}, np.random.default_rng(0), {}, vocab_size=5)
    assert given.tolist() == [[7, 7]]  # a value given for the input still wins
