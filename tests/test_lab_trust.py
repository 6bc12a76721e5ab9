"""Issue 32 items 5 and 6 as a lab manager meets them: a failed run says why wherever its results are shown,
the report's job spec reads as the job file it came from, and failure texts are one clean paragraph.
The audit of every bullet is docs/how-to/lab-trust.md."""

from __future__ import annotations

import html
import re
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import write_job


@pytest.fixture
def failed_job(tmp_path: Path, tiny_models, farm) -> Path:
    """Job 1: one model that runs and one its runtime refuses (stored as a `job` failure by --skip-invalid)."""
    shutil.copy(tiny_models["onnx"], tmp_path / "tiny.onnx")
    shutil.copy(tiny_models["unsupported_onnx"], tmp_path / "custom_op.onnx")
    job = write_job(tmp_path, "name: trust\nmodels: [tiny.onnx, custom_op.onnx]\n"
                              "workload: {type: benchmark, iterations: 5, warmup: 1}\ntargets: [sim]\n"
                              "sim: {memory: 512m}\n")
    submitted = farm("submit", str(job), "--skip-invalid", "--quiet")
    assert submitted.returncode == 1, submitted.stderr  # the job ran, a run failed
    return job


@pytest.mark.parametrize("form", [(), ("--wide",), ("--runs",)])
def test_results_tables_say_why_a_run_failed(failed_job: Path, farm, form: tuple[str, ...]) -> None:
    shown = farm("results", "1", *form)
    assert shown.returncode == 0, shown.stderr
    lines = [line for line in shown.stderr.splitlines() if line.startswith("failed ")]
    assert len(lines) == 1, shown.stderr  # one paragraph for the one failed run, none for the one that ran
    assert lines[0].startswith("failed custom_op (threads 1, repeat 0): job: ") and "FarmUnknownOp" in lines[0]


def test_report_shows_the_job_spec_as_yaml(failed_job: Path, farm, tmp_path: Path) -> None:
    page_path = tmp_path / "report.html"
    made = farm("report", "1", "-o", str(page_path))
    assert made.returncode == 0, made.stderr
    page = page_path.read_text()
    block = re.search(r"<h2 id=spec>.*?<summary>(.*?)</summary><pre>(.*?)</pre>", page, re.S)
    assert block is not None and "YAML" in block.group(1)
    text = html.unescape(block.group(2))
    assert "\\n" not in text and text.count("\n") > 20  # one field a line, not one line of literal \n
    spec = yaml.safe_load(text)  # the stored spec back, field for field
    assert spec["name"] == "trust" and spec["models"] == ["tiny.onnx", "custom_op.onnx"]
    assert spec["matrix"]["threads"] == [1] and spec["targets"] == ["sim"]
    assert spec["workload"]["iterations"] == 5 and spec["sim"]["on_contention"] == "flag"


def test_a_fetch_failure_is_one_clean_paragraph(tmp_path: Path) -> None:
    """A model the controller does not hold: the run's message is the controller's status and words on one line,
    not grpc's object repr (`<_MultiThreadedRendezvous ...>` with its debug_error_string)."""
    import grpc

    from farm.agents.link.remote_controller import RemoteController
    from farm.proto.tasks import TaskPlan, TaskSpec
    from grpc_processes import Cluster

    cluster = Cluster(tmp_path, env={})
    try:
        cluster.serve_in_process()
        agent = RemoteController(str(cluster.address), name="rack", token=None, devices=[],
                                 artifact_dir=tmp_path / "cache")
        task = TaskSpec(task_id=1, job_id=1, attempt=1, target="sim", model_name="m", model_path="/elsewhere/m.onnx",
                        model_sha256="ab" * 32, model_family=None, threads=1, batch_size=1, input_size=None, repeat=0,
                        plan=TaskPlan(workload={"type": "benchmark"}, sim={}, run_timeout_s=60, base_dir="/elsewhere"))
        with pytest.raises(grpc.RpcError) as raised:
            agent.local_model_path(task)
        message = agent.fetch_failure(task, raised.value)
    finally:
        cluster.stop_all()
    assert "\n" not in message and "<_" not in message and "debug_error_string" not in message
    assert message.startswith(f"agent rack could not fetch model {'ab' * 6} (or the script folder): the controller at ")
    assert "answered NOT_FOUND: no artifact with sha256" in message
    assert not list((tmp_path / "cache").glob("*.part"))  # nothing half-written left in the cache
