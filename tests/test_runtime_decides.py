"""The runtime decides what runs: a model is refused only when the runtime that runs it cannot load it,
with the runtime's own words. Constant nodes (folded at load time, so no kernel), If and Loop run."""

from __future__ import annotations

from pathlib import Path

import onnxruntime
import pytest

from conftest import write_job
from farm.models.facts import inspect_model, runtime_refusal
from model_fixtures import (
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

