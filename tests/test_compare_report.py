"""`farm report A B` (issue 30): one before/after page of two jobs — the comparison with its run-to-run noise
judgement, the Pareto view of both jobs' models, each job's own results — rendered where the store is, embedded or
on a controller alike.

Real models: the MobileNetV2 fixture and its int8 variant made by `farm quantize`, a dataset with labels and the
float model as the reference. Dataset figures are deterministic (the same inputs, one thread), so the noise
judgements asserted are of those; latency is shown, never asserted."""

from __future__ import annotations

import html
import json
import re
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from conftest import write_job

MODEL = "mobilenetv2_w0.35_r96.onnx"

JOB = """name: {name}
models: [{model}]
repeats: 3
workload:
  iterations: 3
  warmup: 1
  dataset: {{path: x.npy, labels: labels.npy, reference: float.onnx}}
sim: {{on_contention: flag}}
"""


@pytest.fixture
def three_jobs(farm_inprocess, mobilenet_models: dict[str, Path], tmp_path: Path) -> Path:
    """Job 1 the float model, job 2 its int8 variant (`farm quantize`), job 3 the float model again."""
    (tmp_path / "float.onnx").write_bytes(mobilenet_models[MODEL].read_bytes())
    made = farm_inprocess("quantize", str(tmp_path / "float.onnx"), "-o", str(tmp_path / "int8.onnx"))
    assert made.returncode == 0, made.stderr
    rng = np.random.default_rng(5)
    np.save(tmp_path / "x.npy", rng.random((4, 3, 96, 96), dtype=np.float32))
    np.save(tmp_path / "labels.npy", rng.integers(0, 1000, 4))
    for name, model in (("before", "float.onnx"), ("after", "int8.onnx"), ("again", "float.onnx")):
        run = farm_inprocess("submit", str(write_job(tmp_path, JOB.format(name=name, model=model), f"{name}.yaml")))
        assert run.returncode == 0, run.stderr
    return tmp_path


def _report(farm_inprocess, folder: Path, *jobs: str, where: tuple[str, ...] = ()) -> tuple[str, list[Path]]:
    out = folder / f"report-{'-'.join(jobs)}{'-remote' if where else ''}"
    out.mkdir(exist_ok=True)
    run = farm_inprocess("report", *jobs, "-o", str(out / "report.html"), "--png", str(out / "png"), "--json", *where)
    assert run.returncode == 0, run.stderr
    written = [Path(p) for p in json.loads(run.stdout)["written"]]
    return (out / "report.html").read_text(), written


def _judged(farm_inprocess, *jobs: int) -> bool:
    """Whether every job has two runs or more to judge the noise by (this machine is shared): its clean runs where it
    has any, else all its completed ones, contended too, as `farm compare` takes them."""
    for job in jobs:
        records = farm_inprocess("results", str(job), "--format", "json").json()
        done = [r for r in records if r["status"] == "completed"]
        clean = [r for r in done if not (r.get("contention") or {}).get("contended")]
        if len(clean or done) < 2:
            return False
    return True


def _text(page: str) -> str:
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page)))


def test_a_before_after_report_of_a_model_and_its_int8_variant(three_jobs: Path, farm_inprocess) -> None:
    page, written = _report(farm_inprocess, three_jobs, "1", "2")
    text = _text(page)
    assert "farm report · job 1 → job 2" in text
    assert "float → int8" in text and "lineage" in text  # paired by `farm quantize`'s lineage, not by name
    # the int8 outputs differ from the reference the same way in every run: beyond the noise, and worse
    summary = text[text.index("Summary B against A") if "Summary B against A" in text else text.rindex("Summary"):]
    summary = summary[:summary.index("Before → after")]
    # (with one clean run on a side the page says the noise is unknown instead; both are what it must say)
    verdict = "beyond the run-to-run noise: B is worse" if _judged(farm_inprocess, 1, 2) else "noise unknown"
    assert re.search(r"cosine with the reference 1 → 0\.\d+ \(-\d+\.\d%\), [^;]*" + verdict, summary), summary
    assert "latency avg ms" in summary and "peak memory MB" in summary
    # the full table: the file got smaller, each figure with Welch's verdict
    assert re.search(r"file size MB [\d.]+ [\d.]+ -\d+\.\d% one file each", text), text
    assert "noise (Welch's t, 95 %)" in text
    # the Pareto view of both jobs' models together: both placed, labelled by job
    assert "Accuracy and latency" in text and "float (job 1)" in text and "int8 (job 2)" in text
    pngs = [p for p in written if p.suffix == ".png"]
    assert pngs and all(p.stat().st_size > 1000 for p in pngs)
    # each job's own summary and spec
    assert "Before: job 1 · before" in text and "After: job 2 · after" in text
    assert page.count("as submitted (YAML") == 2
    assert "bytes packed by farm" in text and "UEsDB" not in page  # the packed samples named, not pasted


def test_a_difference_inside_the_noise_is_said_to_be(three_jobs: Path, farm_inprocess) -> None:
    page, _ = _report(farm_inprocess, three_jobs, "1", "3")
    text = _text(page)
    assert "float → float" in text  # the same model in both jobs: paired by name
    verdict = "inside the run-to-run noise: no difference shown" if _judged(farm_inprocess, 1, 3) else "noise unknown"
    assert re.search(r"cosine with the reference 1 → 1 \(\+0\.0%\), [^;]*" + verdict, text), text
    assert "accuracy top-1" in text


def test_two_reports_refused_naming_the_job(three_jobs: Path, farm_inprocess) -> None:
    same = farm_inprocess("report", "1", "1", "-o", str(three_jobs / "same.html"))
    assert same.returncode == 2 and "compares two jobs" in same.stderr, same.stderr
    missing = farm_inprocess("report", "1", "9", "-o", str(three_jobs / "missing.html"))
    assert missing.returncode == 2 and "no job 9" in missing.stderr, missing.stderr
    assert not (three_jobs / "same.html").exists() and not (three_jobs / "missing.html").exists()


def test_the_before_after_report_through_a_controller_is_the_embedded_one(three_jobs: Path, farm_inprocess, farm_db: Path,
                                                                        tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from grpc_processes import Cluster

    root = tmp_path / "cluster"
    root.mkdir()
    env = {"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_DEVICES": "", "FARM_CONFIG": str(root / "none.toml"),
           "FARM_DB": str(root / "unused.db")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cluster = Cluster(root, env=env, cli_in_process=True)
    try:
        with sqlite3.connect(farm_db) as store, sqlite3.connect(root / "controller.db") as copy:
            store.backup(copy)
        cluster.serve_in_process(no_auth=True)
        embedded, _ = _report(farm_inprocess, three_jobs, "1", "2")
        remote = cluster.farm("report", "1", "2", "-o", str(root / "remote.html"), "--controller", str(cluster.address))
        assert remote.returncode == 0, remote.stderr
        assert (root / "remote.html").read_text() == embedded
        refused = cluster.farm("report", "1", "7", "-o", str(root / "x.html"), "--controller", str(cluster.address))
        assert refused.returncode == 2 and "7" in refused.stderr, refused.stderr
    finally:
        cluster.stop_all()


def test_jobs_that_share_no_model_still_get_their_page_and_say_so(three_jobs: Path, farm_inprocess, tiny_models) -> None:
    """Two models against one, none named alike nor made from the other: nothing pairs (one each would)."""
    (three_jobs / "other.onnx").write_bytes(tiny_models["onnx"].read_bytes())
    (three_jobs / "third.tflite").write_bytes(tiny_models["tflite"].read_bytes())
    job = write_job(three_jobs, "name: other\nmodels: [other.onnx, third.tflite]\nworkload: {iterations: 2}\n"
                                "sim: {on_contention: flag}\n", "other.yaml")
    run = farm_inprocess("submit", str(job))
    assert run.returncode == 0, run.stderr
    page, _ = _report(farm_inprocess, three_jobs, "1", "4")
    text = _text(page)
    assert "jobs 1 and 4 share no model" in text and "A: float; B: other, third" in text
    assert "nothing to compare" in text and "Accuracy and latency" in text  # job 1's dataset figures still placed
    assert "Before: job 1 · before" in text and "After: job 4 · other" in text
