"""A malformed job file is refused before anything runs: one paragraph naming the file,
line and field, exit code 2, no traceback, nothing stored."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from conftest import write_job

GOOD_WORKLOAD = "workload: {type: benchmark, iterations: 3, warmup: 1}\n"

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
        1, ["models[0]", "custom_op.onnx", "FarmUnknownOp", "not support"]),
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
    "unknown workload type": (
        "models: [tiny.tflite]\nworkload: {type: profile}\n",
        2, ["workload", "type"]),
}


@pytest.fixture
def job_dir(tmp_path: Path, tiny_models) -> Path:
    for key, name in (("tflite", "tiny.tflite"), ("corrupt_tflite", "corrupt.tflite"),
                      ("unsupported_tflite", "custom_op.tflite"), ("unsupported_onnx", "custom_op.onnx")):
        os.symlink(tiny_models[key], tmp_path / name)
    (tmp_path / "scripts").mkdir()
    return tmp_path


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_job_is_refused_with_file_line_and_field(case: str, job_dir: Path, farm, farm_db: Path) -> None:
    text, line, fragments = CASES[case]
    write_job(job_dir, text)
    result = farm("submit", "job.yaml", cwd=job_dir)
    assert result.returncode == 2, result.stderr
    message = result.stderr
    assert "Traceback" not in message
    assert result.stdout == ""
    assert message.startswith("error: job.yaml")
    if line is not None:
        assert f"job.yaml:{line}:" in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    # one paragraph: no blank line inside the message
    assert "\n\n" not in message.strip()
    # nothing was stored for a refused job
    if farm_db.exists():
        assert sqlite3.connect(farm_db).execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 0


def test_missing_job_file(farm, tmp_path: Path) -> None:
    result = farm("submit", "nope.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert "nope.yaml: no such job file" in result.stderr


def test_schema_lists_every_field(farm) -> None:
    schema = farm("schema").json()
    props = schema["properties"]
    for key in ("models", "workload", "matrix", "repeats", "targets", "sim", "timeouts"):
        assert key in props
    defs = schema["$defs"]
    assert defs["Strict"] if "Strict" in defs else True
    assert defs["SimBudget"]["additionalProperties"] is False
    assert "memory" in defs["SimBudget"]["properties"]
