"""Real models from the wild (tests/corpus_models.json: files shipped inside wheels on PyPI, exported by
PyTorch, Paddle2ONNX, tf2onnx, spox, the TFLite converter and MediaPipe). For every file: farm refuses it
exactly when the bare runtime cannot load it; `farm inspect` counts the same weights as an independent
reader and MACs for every convolution and matrix product; farm's p50 at 1 thread stays close to the
runtime called directly, measured side by side. The strict 5 % fidelity figure is benchmarks/corpus.py's.

The wheels are downloaded once into /var/cache/farm-tests/corpus (skipped, with the reason, when the
package index cannot be reached)."""

from __future__ import annotations

import hashlib
import math
import os
import statistics
from pathlib import Path

import pytest

from farm.agents.sim.driver import SimDriver
from farm.cli.inspect_commands import inspect_report
from farm.controller.scheduling.jobfile import JobFileError, load_job_text
from farm.proto.tasks import TaskPlan, TaskSpec
from real_corpus import BareLoop, CorpusModel, CorpusUnavailable, bare_load_error, fetch_corpus, weight_elements

COUNTED_OPS = {"Conv", "ConvTranspose", "ConvInteger", "QLinearConv", "Gemm", "MatMul", "MatMulInteger",
               "QLinearMatMul", "CONV_2D", "DEPTHWISE_CONV_2D", "CONV_3D", "TRANSPOSE_CONV", "FULLY_CONNECTED",
               "BATCH_MATMUL"}
ITERATIONS, WARMUP = 15, 3
pytestmark = pytest.mark.corpus


@pytest.fixture(scope="module")
def corpus() -> list[CorpusModel]:
    try:
        return fetch_corpus()
    except CorpusUnavailable as e:
        pytest.skip(str(e))


def _job(model: CorpusModel) -> str:
    shapes = "".join(f"    {name!r}: {shape}\n" for name, shape in model.shapes.items())
    return (f"models: [{model.file}]\nworkload:\n  type: benchmark\n  iterations: {ITERATIONS}\n  warmup: {WARMUP}\n"
            + (f"  input_shapes:\n{shapes}" if shapes else ""))


def test_the_corpus_is_broad(corpus: list[CorpusModel]) -> None:
    assert len(corpus) >= 40 and len({m.package for m in corpus}) >= 8
    assert {".onnx", ".tflite"} <= {Path(m.path).suffix for m in corpus}


def test_farm_refuses_a_model_exactly_when_the_bare_runtime_cannot_load_it(corpus: list[CorpusModel],
                                                                          tmp_path: Path) -> None:
    refused = []
    for model in corpus:
        assert model.file is not None
        bare = bare_load_error(model.file)
        try:
            load_job_text(_job(model), "job.yaml", tmp_path)
            farm_refusal = None
        except JobFileError as e:
            farm_refusal = str(e)
        assert (farm_refusal is None) == (bare is None), (model.label, bare, farm_refusal)
        if farm_refusal is not None:
            assert "cannot be loaded" in farm_refusal and bare is not None
            refused.append(model.label)
    assert len(refused) < len(corpus) / 4, refused  # the runtimes run nearly all of these


def test_inspect_counts_every_weight_and_the_macs_of_every_product(corpus: list[CorpusModel]) -> None:
    for model in corpus:
        assert model.file is not None
        report = inspect_report(model.file, model.shapes)
        assert report["param_count"] == weight_elements(model.file), model.label
        counted = [layer for layer in report["layers"] if layer["op"] in COUNTED_OPS]
        assert all(layer["macs"] is not None and layer["macs"] > 0 for layer in counted), (
            model.label, [layer["name"] for layer in counted if not layer["macs"]])
        if counted:
            assert report["macs"] == sum(layer["macs"] for layer in counted), model.label


def test_inspect_shape_flag_on_a_real_dynamic_model(corpus: list[CorpusModel], farm) -> None:
    (nudenet,) = [m for m in corpus if m.path.endswith("320n.onnx")]
    assert farm("inspect", str(nudenet.file), "--json").json()["macs"] is None
    at_320 = farm("inspect", str(nudenet.file), "--shape", "images=1x3x320x320", "--json").json()["macs"]
    at_640 = farm("inspect", str(nudenet.file), "--shape", "images=1x3x640x640", "--json").json()["macs"]
    assert at_320 > 1e8 and at_640 == 4 * at_320  # a fully convolutional detector: MACs scale with the pixels


def _task(model: CorpusModel, cpu: str) -> TaskSpec:
    return TaskSpec(task_id=0, job_id=0, attempt=1, target="sim", model_name=model.name, model_path=str(model.file),
                    model_sha256=hashlib.sha256(Path(str(model.file)).read_bytes()).hexdigest(), model_family=None, threads=1, batch_size=1, input_size=None, repeat=0,
                    plan=TaskPlan(workload={"type": "benchmark", "iterations": ITERATIONS, "warmup": WARMUP,
                              "input_shapes": model.shapes, "use_xnnpack": True},
                    sim={"cpus": 1.0, "cpuset": cpu, "memory": 2 << 30, "sample_interval_ms": 50.0},
                    run_timeout_s=300, base_dir=str(Path(str(model.file)).parent)))


def _side_by_side(driver: SimDriver, bare: BareLoop, model: CorpusModel, cpu: str) -> tuple[float, bool]:
    """Bare, farm, bare on one core: farm's p50 over the mean of the bare pair, and whether the run was contended
    (farm's own flag, or the two bare loops around it disagreeing by 1.5x)."""
    assert model.file is not None
    before = bare.p50_ms(model.file, model.shapes, iterations=ITERATIONS, warmup=WARMUP)
    result = driver.run(_task(model, cpu), lambda: False)
    assert result.ok and result.latency is not None, f"{model.label}: {result.message}"
    after = bare.p50_ms(model.file, model.shapes, iterations=ITERATIONS, warmup=WARMUP)
    contended = bool(result.contention and result.contention.contended) or not 0.67 < before / after < 1.5
    return result.latency.p50 / statistics.mean([before, after]), contended


def test_farm_latency_matches_the_bare_runtime_side_by_side(corpus: list[CorpusModel], tmp_path: Path) -> None:
    """Per model: bare, farm, bare on the same core, the bare loop in a sandbox of its own with the same budget
    (so a busy machine weighs on both alike; one sandboxed process serves every bare measurement, a fresh
    runtime session each); the ratio of farm's p50 to the bare pair's. Single ratios move on
    a busy machine (a 2.5 ms model's p50 of 15 doubled once in CI with both bare loops calm), so a ratio out of
    bounds is measured twice more and the model's ratio is the median of three: a real overhead repeats, a
    burst does not. The bounds are wide per model and tighter on the geometric mean; a miss on a machine where
    farm flagged most runs as contended is skipped with that evidence (the premise failed, not farm)."""
    cpu = str(sorted(os.sched_getaffinity(0))[-1])
    driver = SimDriver(tmp_path / "work")
    rows = []
    with BareLoop(threads=1, cpuset=cpu) as bare:
        for model in corpus:
            assert model.file is not None
            if bare_load_error(model.file) is not None:
                continue
            ratio, contended = _side_by_side(driver, bare, model, cpu)
            if not 0.5 < ratio < 2.0:
                again = [_side_by_side(driver, bare, model, cpu) for _ in range(2)]
                ratio = statistics.median([ratio] + [r for r, _ in again])
                contended = contended or any(c for _, c in again)
            rows.append((model.label, ratio, contended))
    ratios = [ratio for _, ratio, _ in rows]
    geomean = math.exp(statistics.mean(math.log(r) for r in ratios))
    outliers = [(label, round(ratio, 2), contended) for label, ratio, contended in rows if not 0.5 < ratio < 2.0]
    busy = sum(c for *_, c in rows)
    if (outliers or not 0.8 < geomean < 1.25) and busy > len(rows) / 2:
        pytest.skip(f"the machine was too busy to compare: {busy} of {len(rows)} runs contended (farm's own flag, or "
                    f"the two bare loops around a run disagreeing by 1.5x); geometric mean {geomean:.2f}, "
                    f"outliers {outliers}")
    assert not outliers, outliers
    assert 0.8 < geomean < 1.25, (geomean, rows)
