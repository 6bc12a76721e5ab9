"""workload.dataset (issue 30): every target runs the model on real samples after the timed loop and records its
outputs' digests and summaries, agreement with a reference (the float model, run once where the job is submitted,
or a reference output file) and, with labels, accuracy; thresholds turn a mismatch into an `accuracy` failure that
keeps the run's timings. Hostile datasets are refused at submit naming the file and the field, nothing stored.

Sim jobs keep contended runs flagged (this machine is shared) and assert no timing."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from conftest import write_job
from test_cli_errors import one_paragraph_error

MODEL = "mobilenetv2_w0.35_r96.onnx"
SAMPLES = 6


@pytest.fixture
def float_and_int8(farm_inprocess, mobilenet_models: dict[str, Path], tmp_path: Path) -> Path:
    """The float MobileNetV2 and its int8 variant made by `farm quantize`, with a dataset and labels beside them."""
    (tmp_path / "float.onnx").write_bytes(mobilenet_models[MODEL].read_bytes())
    made = farm_inprocess("quantize", str(tmp_path / "float.onnx"), "-o", str(tmp_path / "int8.onnx"))
    assert made.returncode == 0, made.stderr
    rng = np.random.default_rng(3)
    np.save(tmp_path / "x.npy", rng.random((SAMPLES, 3, 96, 96), dtype=np.float32))
    np.save(tmp_path / "labels.npy", rng.integers(0, 1000, SAMPLES))
    return tmp_path


DATASET_JOB = """models: [float.onnx, int8.onnx]
workload:
  iterations: 2
  warmup: 1
  dataset: {{path: x.npy, labels: labels.npy, reference: float.onnx{extra}}}
sim: {{on_contention: flag}}
"""


def _records(farm_inprocess, job: int = 1) -> dict[str, dict]:
    return {r["model"]["name"]: r for r in farm_inprocess("results", str(job), "--format", "json").json()}


def test_a_quantized_model_agrees_with_its_float_reference_on_the_sim(float_and_int8: Path, farm_inprocess) -> None:
    run = farm_inprocess("submit", str(write_job(float_and_int8, DATASET_JOB.format(extra=""))))
    assert run.returncode == 0, run.stderr
    records = _records(farm_inprocess)
    same, int8 = records["float"]["accuracy"], records["int8"]["accuracy"]
    assert same["samples"] == int8["samples"] == SAMPLES and same["reference"] == "float.onnx"
    # the float model against itself: identical outputs
    assert same["agreement"]["max_abs_error"] == 0 and same["agreement"]["cosine"] == pytest.approx(1)
    assert same["agreement"]["top1"] == 1 and same["agreement"]["psnr_db"] == 200
    # the int8 variant: close, not equal
    agreement = int8["agreement"]
    assert 0 < agreement["max_abs_error"] and 0.5 < agreement["cosine"] < 1, agreement
    assert agreement["snr_db"] < 200 and 0 <= agreement["top1"] <= 1 and 0 <= agreement["top5"] <= 1
    for block in (same, int8):  # labels: accuracy of each, its own figure
        assert set(block["accuracy"]) == {"top1", "top5"} and 0 <= block["accuracy"]["top1"] <= block["accuracy"]["top5"] <= 1
    (name,) = same["outputs"]
    assert same["outputs"][name]["shape"] == [SAMPLES, 1000] and len(same["outputs"][name]["sha256"]) == 64
    assert "values" not in same["outputs"][name]  # 6,000 numbers: over the size kept whole, the digest stays
    assert same["outputs"][name]["min"] <= same["outputs"][name]["mean"] <= same["outputs"][name]["max"]
    assert same["outputs"][name]["sha256"] != int8["outputs"][name]["sha256"]
    assert records["int8"]["latency_ms"]["count"] == 2  # the timed loop as it was

    shown = farm_inprocess("compare", "1", "1", "--json")
    assert shown.returncode == 0, shown.stderr
    text = farm_inprocess("compare", "1", "1")
    assert "cosine" in text.stdout and "acc top-1" in text.stdout, text.stdout
    _the_before_after_report_and_the_pareto_view(float_and_int8, farm_inprocess, records)


def _the_before_after_report_and_the_pareto_view(folder: Path, farm_inprocess, records: dict[str, dict]) -> None:
    """The same job's variant against its base as CSV, in the report and on the dashboard; accuracy against latency
    with the dominated model named (which one depends on this run's timings and figures: computed from the records)."""
    import csv
    import io

    from farm.controller.store import open_store
    from farm.web.pages import job_page
    from farm.web.views import job_view

    flat = farm_inprocess("compare", "1", "--format", "csv")
    assert flat.returncode == 0, flat.stderr
    (row,) = list(csv.DictReader(io.StringIO(flat.stdout)))
    assert (row["model_a"], row["model_b"], row["matched_by"], row["method"]) == ("float", "int8", "lineage", "dynamic")
    assert float(row["agreement_cosine_a"]) == pytest.approx(1) and float(row["agreement_cosine_b"]) < 1
    assert float(row["size_ratio"]) < 0.5 and float(row["latency_avg_ms_a"]) > 0

    answer = farm_inprocess("compare", "1", "--pareto", "--json")
    assert answer.returncode == 0, answer.stderr
    (group,) = answer.json()["groups"]
    assert group["quality_metric"] == "accuracy_top1" and group["target"] == "sim"  # labels: accuracy is the figure
    points = {p["model"]: p for p in group["points"]}
    assert set(points) == {"float", "int8"}
    for name, point in points.items():
        assert point["quality"] == records[name]["accuracy"]["accuracy"]["top1"]
        assert point["latency_avg_ms"] == pytest.approx(records[name]["latency_ms"]["avg"])
    fast, slow = sorted(points.values(), key=lambda p: (p["latency_avg_ms"], -p["quality"]))
    dominated = slow["quality"] <= fast["quality"] and slow["latency_avg_ms"] > fast["latency_avg_ms"]
    assert slow["on_front"] is not dominated and fast["on_front"]
    assert slow["dominated_by"] == ([fast["model"]] if dominated else [])
    table = farm_inprocess("compare", "1", "--pareto")
    assert "on the front" in table.stdout and "accuracy top-1" in table.stdout, table.stdout
    points_csv = farm_inprocess("compare", "1", "--pareto", "--format", "csv")
    assert sorted(r["model"] for r in csv.DictReader(io.StringIO(points_csv.stdout))) == ["float", "int8"]

    page = folder / "report.html"
    written = farm_inprocess("report", "1", "-o", str(page), "--png", str(folder / "figures"))
    assert written.returncode == 0, written.stderr
    html = page.read_text()
    variants = html.split("<h2 id=variants>Variants</h2>")[1].split("<h2")[0]
    assert "cosine with the reference" in variants and "accuracy top-1" in variants
    front = html.split("<h2 id=pareto>Accuracy and latency</h2>")[1].split("<h2")[0]
    assert "on the front" in front and "<img" in front and ("dominated by" in front) is dominated
    assert [p.name for p in (folder / "figures").glob("pareto-*.png")]

    store = open_store(folder / "farm.db")  # the farm_db fixture's store: the fixture's folder is the job's
    try:
        view = job_view(store, 1)
    finally:
        store.close()
    assert view is not None and [g.quality_metric for g, _ in view.pareto] == ["accuracy_top1"]
    shown = job_page(view, csrf="x", may_cancel=False)
    assert 'id="pareto-chart-0"' in shown and "on the front" in shown and "cosine with the reference" in shown
    assert 'action="/compare"' in shown  # the way to the comparison page
    _the_dashboards_compare_page(folder / "farm.db")


def _the_dashboards_compare_page(db: Path) -> None:
    """/compare/A/B: the before/after table, the Pareto chart and table, CSV and JSON downloads; a job that is not
    there is "no job N", and the job page's form (a GET with a and b) lands on the page."""
    import csv
    import io

    from farm.controller.scheduling.controller import Controller
    from farm.controller.store import open_store
    from farm.web.server import DashboardApp, Operator

    store = open_store(db)
    try:
        dashboard = DashboardApp(store, Operator.embedded(Controller(store)), tokens=None, tls=False, loopback=True)

        def get(path: str):
            return dashboard.handle("GET", path, {"Host": "127.0.0.1"}, b"")

        page = get("/compare/1/1")
        assert page.status == 200, page.body[:500]
        html = page.body.decode()
        assert 'id="compare"' in html and "<td" in html.split('id="compare"')[1] and 'id="pareto-chart-0"' in html
        assert "cosine with the reference" in html and "on the front" in html
        rows = list(csv.DictReader(io.StringIO(get("/compare/1/1.csv").body.decode())))
        assert [(r["model_a"], r["model_b"]) for r in rows] == [("float", "int8")]
        answer = json.loads(get("/compare/1/1.json").body)
        assert answer["pairs"][0]["matched_by"] == "lineage" and answer["pareto"]["groups"][0]["points"]
        moved = get("/compare?a=1&b=1")
        assert moved.status == 303 and moved.headers["Location"] == "/compare/1/1"
        assert get("/compare?a=1&b=x").status == 400
        missing = get("/compare/1/99")
        assert missing.status == 404 and b"no job 99" in missing.body
    finally:
        store.close()

    # a `team` lab: another team's job is "no job 1" here too, page and downloads alike
    import sqlite3

    from farm.controller.auth import TokenTable
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE jobs SET submitted_by = 'someone-else', team = 'speech' WHERE id = 1")
    (db.parent / "tokens").write_text("client vision-token-0123456789 team=vision\n")
    store = open_store(db)
    try:
        guarded = DashboardApp(store, Operator.embedded(Controller(store)), tokens=TokenTable.from_file(db.parent / "tokens"),
                            tls=False, loopback=True, job_sharing="team")
        for path in ("/compare/1/1", "/compare/1/1.csv", "/compare/1/1.json"):
            refused = guarded.handle("GET", path, {"Host": "127.0.0.1",
                                                   "Authorization": "Bearer vision-token-0123456789"}, b"")
            assert refused.status == 404 and b"no job 1" in refused.body and b"int8" not in refused.body
    finally:
        store.close()


def test_outputs_beyond_the_threshold_fail_as_accuracy_and_keep_their_timings(float_and_int8: Path,
                                                                             farm_inprocess) -> None:
    job = write_job(float_and_int8, DATASET_JOB.format(extra=", thresholds: {min_cosine: 0.999999}"))
    run = farm_inprocess("submit", str(job))
    assert run.returncode == 1, run.stderr  # the job ran, a run failed
    records = _records(farm_inprocess)
    assert records["float"]["status"] == "completed"
    failed = records["int8"]
    assert failed["status"] == "failed" and failed["failure_class"] == "accuracy" and failed["attempts"] == 1
    assert "workload.dataset.thresholds.min_cosine 0.999999" in failed["message"]
    assert failed["latency_ms"]["count"] == 2 and failed["accuracy"]["agreement"]["cosine"] < 0.999999


def test_a_reference_output_file_and_a_folder_of_images(farm_inprocess, tiny_models: dict[str, Path],
                                                        tmp_path: Path) -> None:
    from PIL import Image
    import onnxruntime

    (tmp_path / "tiny.onnx").write_bytes(tiny_models["onnx"].read_bytes())
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    # the reference file: what the model gives for the same preprocessing, computed here apart from farm
    session = onnxruntime.InferenceSession(str(tmp_path / "tiny.onnx"), providers=["CPUExecutionProvider"])
    batch = []
    for i in range(3):
        pixels = np.asarray(Image.open(folder / f"{i}.png").convert("RGB").resize((8, 8), Image.Resampling.BILINEAR),
                            dtype=np.float32)
        batch.append(((pixels / 255 - 0.5) / 0.25).transpose(2, 0, 1))
    (output,) = [o.name for o in session.get_outputs()]
    reference = np.concatenate([session.run(None, {"input": b[None]})[0] for b in batch])
    np.savez(tmp_path / "ref.npz", **{output: reference})
    job = write_job(tmp_path, """models: [tiny.onnx]
workload:
  iterations: 2
  dataset:
    path: images
    reference: ref.npz
    image: {size: [8, 8], layout: nchw, mean: [0.5, 0.5, 0.5], std: [0.25, 0.25, 0.25]}
sim: {on_contention: flag}
""")
    run = farm_inprocess("submit", str(job))
    assert run.returncode == 0, run.stderr
    (record,) = farm_inprocess("results", "1", "--format", "json").json()
    assert record["accuracy"]["samples"] == 3
    assert record["accuracy"]["agreement"]["max_abs_error"] < 1e-4  # the same preprocessing, the same outputs
    (kept,) = record["accuracy"]["outputs"].values()
    assert np.allclose(kept["values"], reference.reshape(-1), atol=1e-4)  # 768 numbers: kept whole
    assert "accuracy" not in record["accuracy"] or record["accuracy"].get("accuracy") is None  # no labels


def _sparse(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


@pytest.mark.parametrize("dataset, prepare, fragments", [
    ("{path: x.npy, labels: short.npy}", "short", ["workload.dataset.labels", "short.npy", "2 row(s)", "6 sample(s)"]),
    ("{path: wrong_shape.npy}", "wrong_shape", ["workload.dataset.path", "wrong_shape.npy", "[3, 64, 64]", "float.onnx"]),
    ("{path: wrong_dtype.npy}", "wrong_dtype", ["workload.dataset.path", "wrong_dtype.npy", "int64", "float32"]),
    ("{path: pickle.npy}", "pickle", ["workload.dataset.path", "pickle.npy", "without pickles"]),
    ("{path: huge.npz}", "huge", ["workload.dataset.path", "huge.npz", "10,737,418,240 bytes", "budget"]),
    ("{path: ../outside.npy}", None, ["workload.dataset.path", "outside the job's folder"]),
    ("{path: x.npy, labels: ../../etc/passwd}", None, ["workload.dataset.labels", "outside the job's folder"]),
    ("{path: x.npy, reference: ref_short.npz}", "ref_short", ["workload.dataset.reference", "ref_short.npz", "fewer"]),
    ("{path: x.npy, packed: bm90IGEgemlw}", None, ["workload.dataset.packed", "not a dataset farm packed"]),
], ids=["short-labels", "shape", "dtype", "pickle", "10GB", "escape", "labels-escape", "short-reference", "packed"])
def test_hostile_datasets_are_refused_at_submit_naming_the_file_and_field(
        farm_inprocess, mobilenet_models: dict[str, Path], tmp_path: Path, dataset: str, prepare: str | None,
        fragments: list[str]) -> None:
    (tmp_path / "float.onnx").write_bytes(mobilenet_models[MODEL].read_bytes())
    np.save(tmp_path / "x.npy", np.zeros((SAMPLES, 3, 96, 96), np.float32))
    if prepare == "short":
        np.save(tmp_path / "short.npy", np.arange(2))
    elif prepare == "wrong_shape":
        np.save(tmp_path / "wrong_shape.npy", np.zeros((2, 3, 64, 64), np.float32))
    elif prepare == "wrong_dtype":
        np.save(tmp_path / "wrong_dtype.npy", np.zeros((2, 3, 96, 96), np.int64))
    elif prepare == "pickle":
        (tmp_path / "pickle.npy").write_bytes(pickle.dumps({"not": "an array"}))
    elif prepare == "huge":
        _sparse(tmp_path / "huge.npz", 10 << 30)  # 10 GiB of nothing: refused from its size, never read
    elif prepare == "ref_short":
        np.savez(tmp_path / "ref_short.npz", output=np.zeros((1, 1000), np.float32))
    job = write_job(tmp_path, f"models: [float.onnx]\nworkload:\n  dataset: {dataset}\n")
    one_paragraph_error(farm_inprocess("submit", str(job)), fragments)
    assert farm_inprocess("jobs", "--json").json() == []  # nothing stored
    if prepare == "huge":
        assert os.stat(tmp_path / "huge.npz").st_blocks == 0  # still sparse: nothing was read or written


def test_the_board_harness_runs_the_dataset_as_the_sim_does(board, mobilenet_models: dict[str, Path],
                                                             tmp_path: Path) -> None:
    """The sshd board peer runs farm's one-file board harness: the same outputs, digests and figures as the sim's
    harness computes for the same samples, and the driver judges the thresholds."""
    import onnxruntime

    from farm.agents.boards.driver import BoardDriver
    from farm.agents.harness.dataset import run_dataset
    from farm.controller.scheduling.datasets import load_dataset
    from farm.models.facts import inspect_model
    from farm.proto.spec import BenchmarkWorkload
    from farm.proto.tasks import TaskPlan, TaskSpec
    from test_board_driver import _config

    model = tmp_path / "float.onnx"
    model.write_bytes(mobilenet_models[MODEL].read_bytes())
    rng = np.random.default_rng(5)
    np.save(tmp_path / "x.npy", rng.random((3, 3, 96, 96), dtype=np.float32))
    np.save(tmp_path / "labels.npy", np.array([1, 2, 3]))
    workload = BenchmarkWorkload.model_validate({"iterations": 3, "warmup": 1, "dataset": {
        "path": "x.npy", "labels": "labels.npy", "reference": "float.onnx",
        "thresholds": {"min_accuracy_top1": 0.99}}})

    class Resolved:  # what load_dataset reads of a resolved model
        path, facts = model, inspect_model(model)
    load_dataset(workload, [Resolved()], tmp_path)
    task = TaskSpec(task_id=7, job_id=1, attempt=1, target="nano-1", model_name="float", model_path=str(model),
                    model_sha256="", model_family=None, threads=1, batch_size=1, input_size=None, repeat=0,
                    plan=TaskPlan(workload=workload, sim={}, run_timeout_s=120, base_dir=str(tmp_path)))
    result = BoardDriver(_config(board, kind="linux")).run(task, lambda: False)
    block = result.environment["accuracy"]
    assert block["samples"] == 3 and block["agreement"]["max_abs_error"] == 0 and block["agreement"]["top1"] == 1
    # random weights and labels: accuracy under the threshold, so the run fails as accuracy with its timings
    assert result.failure_class == "accuracy" and "min_accuracy_top1" in result.message
    assert result.latency is not None and result.latency.count == 3

    session = onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    assert workload.dataset is not None
    here = run_dataset(workload.dataset.model_dump(), lambda f: dict(zip(names, session.run(None, f))),
                       {}, names)  # the dataset gives the one input
    (name,) = names
    assert block["outputs"][name]["sha256"] == here["outputs"][name]["sha256"]
    assert block["accuracy"] == here["accuracy"]


def test_a_hostile_accuracy_block_is_bounded_before_it_is_stored() -> None:
    """The block comes from inside the sandbox (or a board): known keys, finite numbers, a bounded size."""
    from farm.proto.accuracy import MAX_KEPT_VALUES, bounded_block, verdict
    from farm.proto.spec import AccuracyThresholds

    raw = {"samples": "many", "output": "y" * 10_000, "injected": {"x": 1},
           "outputs": {f"o{i}": {"sha256": "f" * 1000, "shape": [1, "x", 3], "min": float("nan"), "max": "big",
                                 "values": [1.0] * MAX_KEPT_VALUES, "agreement": {"cosine": True, "extra": 1}}
                       for i in range(100)},
           "agreement": {"cosine": float("nan"), "top1": 0.2}, "accuracy": {"top1": [1], "top5": 0.9}}
    block = bounded_block(raw)
    assert block is not None and "injected" not in block and block["samples"] is None and len(block["output"]) == 200
    assert len(block["outputs"]) == 32 and sum("values" in o for o in block["outputs"].values()) == 1
    first = block["outputs"]["o0"]
    assert first["shape"] == [1, 3] and first["min"] is None and first["max"] is None and len(first["sha256"]) == 64
    assert first["agreement"]["cosine"] is None and "extra" not in first["agreement"]
    assert block["agreement"]["cosine"] is None and block["accuracy"] == {"top1": None, "top5": 0.9}
    assert bounded_block(["not", "a", "dict"]) is None
    # a threshold on a figure the run lacks is a failure that says so, not a pass
    why = verdict(block, AccuracyThresholds(min_cosine=0.9, min_top1_agreement=0.5))
    assert why is not None and "min_cosine is set but the run has no such figure" in why and "top1_agreement 0.2 is below" in why


def test_a_tflite_model_runs_the_dataset_on_the_sim(farm_inprocess, tiny_models: dict[str, Path],
                                                    tmp_path: Path) -> None:
    """LiteRT's side of the sim harness: samples fed one at a time (the timed loop at batch 2), outputs compared with
    the same model's outputs computed here with the bare interpreter."""
    from ai_edge_litert.interpreter import Interpreter

    (tmp_path / "tiny.tflite").write_bytes(tiny_models["tflite"].read_bytes())
    samples = np.random.default_rng(2).random((4, 8, 8, 3), dtype=np.float32)
    np.save(tmp_path / "x.npy", samples)
    interp = Interpreter(model_path=str(tmp_path / "tiny.tflite"))
    interp.allocate_tensors()
    (inp,), (out,) = interp.get_input_details(), interp.get_output_details()
    expected = []
    for sample in samples:
        interp.set_tensor(inp["index"], sample[None])
        interp.invoke()
        expected.append(interp.get_tensor(out["index"]).copy())
    np.savez(tmp_path / "ref.npz", **{out["name"]: np.concatenate(expected)})
    job = write_job(tmp_path, "models: [tiny.tflite]\nmatrix: {batch_sizes: [2]}\nworkload:\n  iterations: 2\n"
                              "  dataset: {path: x.npy, reference: ref.npz}\nsim: {on_contention: flag}\n")
    run = farm_inprocess("submit", str(job))
    assert run.returncode == 0, run.stderr
    (record,) = farm_inprocess("results", "1", "--format", "json").json()
    assert record["input_shapes"] == {"input": [2, 8, 8, 3]}  # the timed loop's batch
    assert record["accuracy"]["samples"] == 4 and record["accuracy"]["agreement"]["max_abs_error"] < 1e-5


def _tar(path: Path, members: list[tuple[str, bytes | None, dict]]) -> Path:
    """A tar written member by member: (name, data or None, TarInfo fields such as type, linkname, size)."""
    import io
    import tarfile

    mode = "w:gz" if path.name.endswith(".gz") else "w"
    with tarfile.open(path, mode) as tar:
        for name, data, fields in members:
            info = tarfile.TarInfo(name)
            info.size = len(data) if data is not None else 0
            for key, value in fields.items():
                setattr(info, key, value)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _npy(array: np.ndarray) -> bytes:
    import io
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def test_a_tar_gz_dataset_runs_as_its_folder_would(farm_inprocess, mobilenet_models: dict[str, Path],
                                                   tmp_path: Path) -> None:
    """Issue 30: a .tar.gz of .npy samples, in a subfolder, one of them a link to another member: read in memory,
    never extracted, and the run's outputs are the same as the folder's."""
    import tarfile

    (tmp_path / "float.onnx").write_bytes(mobilenet_models[MODEL].read_bytes())
    rng = np.random.default_rng(5)
    samples = [rng.random((3, 96, 96), dtype=np.float32) for _ in range(3)]
    folder = tmp_path / "samples"
    folder.mkdir()
    for i, sample in enumerate(samples):
        np.save(folder / f"{i}.npy", sample)
    np.save(folder / "3.npy", samples[0])  # the folder's twin of the link below
    _tar(tmp_path / "samples.tar.gz", [("samples/", None, {"type": tarfile.DIRTYPE}),
                                       *[(f"samples/{i}.npy", _npy(s), {}) for i, s in enumerate(samples)],
                                       ("samples/3.npy", None, {"type": tarfile.SYMTYPE, "linkname": "0.npy"}),
                                       ("samples/._0.npy", b"resource fork", {})])  # hidden: skipped as in a folder
    for path in ("samples", "samples.tar.gz"):
        job = write_job(tmp_path, f"name: {path}\nmodels: [float.onnx]\nworkload:\n  iterations: 2\n"
                                  f"  dataset: {{path: {path}, reference: float.onnx}}\nsim: {{on_contention: flag}}\n",
                        name=f"{path}.yaml")
        run = farm_inprocess("submit", str(job))
        assert run.returncode == 0, run.stderr
    folder_run, tar_run = (farm_inprocess("results", str(job), "--format", "json").json()[0]["accuracy"]
                           for job in (1, 2))
    assert tar_run["samples"] == folder_run["samples"] == 4
    assert tar_run["outputs"] == folder_run["outputs"]  # the same samples in the same order: the same digests
    assert tar_run["agreement"]["max_abs_error"] == 0


@pytest.mark.parametrize("members, fragments", [
    ([("/abs/0.npy", "npy", {})], ["'/abs/0.npy'", "absolute name or `..`"]),
    ([("a/../../0.npy", "npy", {})], ["'a/../../0.npy'", "absolute name or `..`"]),
    ([("0.npy", None, {"type": "sym", "linkname": "/etc/passwd"})], ["'0.npy'", "link out of the archive",
                                                                      "/etc/passwd"]),
    ([("0.npy", None, {"type": "sym", "linkname": "../../x.npy"})], ["link out of the archive", "../../x.npy"]),
    ([("0.npy", None, {"type": "hard", "linkname": "/etc/shadow"})], ["link out of the archive", "/etc/shadow"]),
    ([("0.npy", None, {"type": "sym", "linkname": "missing.npy"})], ["links to 'missing.npy'", "not a regular file"]),
    ([("0.npy", None, {"type": "fifo"})], ["'0.npy'", "not a regular file"]),
    ([("0.npy", None, {"type": "chr", "devmajor": 1, "devminor": 3})], ["'0.npy'", "not a regular file"]),
    ([("0.npy", "npy", {}), ("notes.txt", b"hello", {})], ["notes.txt", ".txt file"]),
    ([("0.npy", "npy", {}), ("bomb.npy", "bomb", {})], ["bomb.npy", "67,108,864 bytes", "headers"]),
    ([("0.npy", b"\x80\x04pickle", {})], ["0.npy", "without pickles"]),
    ([("0.npy", "wrong_shape", {})], ["[3, 64, 64]", "float.onnx"]),
    ("not a tar", ["'data.tar.gz'", "not a tar archive"]),
], ids=["absolute", "dotdot", "symlink-abs", "symlink-up", "hardlink-out", "dangling", "fifo", "device", "suffix",
        "bomb", "pickle", "shape", "garbage"])
def test_hostile_tar_datasets_are_refused_at_submit_naming_the_member(
        farm_inprocess, mobilenet_models: dict[str, Path], tmp_path: Path, members, fragments: list[str]) -> None:
    import gzip
    import tarfile

    (tmp_path / "float.onnx").write_bytes(mobilenet_models[MODEL].read_bytes())
    archive = tmp_path / "data.tar.gz"
    if isinstance(members, str):
        archive.write_bytes(gzip.compress(members.encode()))
    else:
        types = {"sym": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE, "chr": tarfile.CHRTYPE}
        written = []
        for name, data, fields in members:
            fields = {**fields, **({"type": types[fields["type"]]} if "type" in fields else {})}
            if data == "npy":
                data = _npy(np.zeros((3, 96, 96), np.float32))
            elif data == "wrong_shape":
                data = _npy(np.zeros((2, 3, 64, 64), np.float32))  # one member: its first axis is the sample
            elif data == "bomb":  # 64 MiB of zeros: a few hundred KiB gzipped, refused from its header
                data = bytes(64 << 20)
            written.append((name, data, fields))
        _tar(archive, written)
    assert archive.stat().st_size < 1 << 20
    job = write_job(tmp_path, "models: [float.onnx]\nworkload:\n  dataset: {path: data.tar.gz}\n")
    one_paragraph_error(farm_inprocess("submit", str(job)), ["workload.dataset.path", "data.tar.gz", *fragments])
    assert farm_inprocess("jobs", "--json").json() == []  # nothing stored
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("farm.db")) == [
        "data.tar.gz", "float.onnx", "job.yaml"]  # nothing extracted
