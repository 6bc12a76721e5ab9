"""Issue 30 items 3 and 4: `farm quantize` makes an int8 variant of a real model with ONNX Runtime's quantizer and
records its lineage; `farm compare` puts two jobs (or one job's variants) side by side and judges the noise.

Real models only: the MobileNetV2 fixtures (generated ONNX files with real weights' shapes). The sim jobs keep
contended runs (flagged, not retried) and run few iterations: this machine is shared, and timings are not asserted."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from conftest import write_job
from run_records import run_record

from farm.controller.analysis.compare import ONE_RUN, judge, pair_models
from farm.proto.questions import RunRecord

MODEL = "mobilenetv2_w0.35_r96.onnx"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _quantize(farm_inprocess, *args: str):
    result = farm_inprocess("quantize", *args, "--json")
    assert result.returncode == 0, result.stderr
    return result.json()


def test_quantize_dynamic_makes_a_smaller_model_with_its_lineage_shown_by_inspect(
        farm_inprocess, mobilenet_models: dict[str, Path], tmp_path: Path) -> None:
    source = mobilenet_models[MODEL]
    out = tmp_path / "small.int8.onnx"
    answer = _quantize(farm_inprocess, str(source), "-o", str(out))
    assert out.is_file() and answer["output_size_bytes"] == out.stat().st_size
    assert out.stat().st_size < 0.5 * source.stat().st_size  # int8 weights: about a quarter
    sidecar = tmp_path / "small.int8.onnx.farm-lineage.json"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary or pre-processed file left
    lineage = json.loads(sidecar.read_text())
    assert lineage["source"] == {"path": str(source), "sha256": _sha(source), "size_bytes": source.stat().st_size}
    assert lineage["method"] == "dynamic" and lineage["calibration"] is None
    assert lineage["preprocess"].startswith("onnxruntime quant_pre_process")  # ONNX Runtime's own preparation
    assert lineage["tool"]["onnxruntime"] and lineage["created"].endswith("Z")
    assert lineage["output"]["sha256"] == _sha(out)

    shown = farm_inprocess("inspect", str(out), "--json")
    assert shown.returncode == 0, shown.stderr
    assert shown.json()["lineage"]["source"]["sha256"] == _sha(source)
    table = farm_inprocess("inspect", str(out))
    assert "lineage: int8 by --method dynamic from" in " ".join(table.stdout.split()), table.stdout
    assert farm_inprocess("inspect", str(source), "--json").json()["lineage"] is None

    # the lineage travels in the model's own metadata too: a copy without its sidecar still says what it was made from
    copy = tmp_path / "copy.onnx"
    copy.write_bytes(out.read_bytes())
    assert farm_inprocess("inspect", str(copy), "--json").json()["lineage"]["source"]["sha256"] == _sha(source)


def test_static_and_qdq_take_real_calibration_files_and_record_them(
        farm_inprocess, mobilenet_models: dict[str, Path], tmp_path: Path) -> None:
    import onnx
    source = mobilenet_models[MODEL]
    (name,) = [i.name for i in onnx.load(str(source), load_external_data=False).graph.input]
    rng = np.random.default_rng(1)
    npz = tmp_path / "calib.npz"
    np.savez(npz, **{name: rng.random((4, 1, 3, 96, 96), dtype=np.float32)})  # a stack of 4 samples
    static = _quantize(farm_inprocess, str(source), "-o", str(tmp_path / "s.onnx"), "--method", "static",
                       "--calibration", str(npz))
    assert static["lineage"]["calibration"] == {"source": "file", "path": str(npz), "sha256": _sha(npz), "samples": 4}
    assert static["output_size_bytes"] < 0.5 * source.stat().st_size

    folder = tmp_path / "calib"
    folder.mkdir()
    for i in range(3):
        np.save(folder / f"{i}.npy", rng.random((1, 3, 96, 96), dtype=np.float32))  # one sample each
    qdq = _quantize(farm_inprocess, str(source), "-o", str(tmp_path / "q.onnx"), "--method", "qdq",
                    "--calibration", str(folder))
    assert qdq["lineage"]["calibration"]["samples"] == 3 and len(qdq["lineage"]["calibration"]["sha256"]) == 64

    # no calibration: random inputs, and the command says so
    plain = farm_inprocess("quantize", str(source), "-o", str(tmp_path / "r.onnx"), "--method", "static")
    assert plain.returncode == 0, plain.stderr
    assert "random inputs" in plain.stderr
    assert json.loads((tmp_path / "r.onnx.farm-lineage.json").read_text())["calibration"]["source"] == "random"


def _bad(farm_inprocess, *args: str) -> str:
    result = farm_inprocess("quantize", *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    return " ".join(result.stderr.split())


def test_bad_inputs_are_refused_naming_the_file_and_the_flag(
        farm_inprocess, mobilenet_models: dict[str, Path], tiny_models: dict[str, Path], tmp_path: Path) -> None:
    source = str(mobilenet_models[MODEL])
    message = _bad(farm_inprocess, str(tiny_models["tflite"]))
    assert str(tiny_models["tflite"]) in message and "TFLiteConverter" in message

    message = _bad(farm_inprocess, str(tiny_models["unsupported_onnx"]), "-o", str(tmp_path / "x.onnx"))
    assert str(tiny_models["unsupported_onnx"]) in message and "ONNX Runtime cannot load it" in message

    taken = tmp_path / "taken.onnx"
    taken.write_bytes(b"keep me")
    message = _bad(farm_inprocess, source, "-o", str(taken))
    assert f"-o {taken}" in message and "--force" in message
    assert taken.read_bytes() == b"keep me"
    assert farm_inprocess("quantize", source, "-o", str(taken), "--force").returncode == 0
    assert taken.stat().st_size > 1000

    wrong_name = tmp_path / "wrong_name.npz"
    np.savez(wrong_name, pixels=np.zeros((1, 3, 96, 96), np.float32))
    message = _bad(farm_inprocess, source, "-o", str(tmp_path / "a.onnx"), "--method", "static",
                   "--calibration", str(wrong_name))
    assert f"--calibration {wrong_name}" in message and "missing" in message and "pixels" in message

    wrong_shape = tmp_path / "wrong_shape.npy"
    np.save(wrong_shape, np.zeros((1, 3, 64, 64), np.float32))
    message = _bad(farm_inprocess, source, "-o", str(tmp_path / "b.onnx"), "--method", "qdq",
                   "--calibration", str(wrong_shape))
    assert f"--calibration {wrong_shape}" in message and "1×3×64×64" in message

    disguised = tmp_path / "evil.npy"
    disguised.write_bytes(pickle.dumps({"x": 1}))
    message = _bad(farm_inprocess, source, "-o", str(tmp_path / "c.onnx"), "--method", "static",
                   "--calibration", str(disguised))
    assert f"--calibration {disguised}" in message and "allow_pickle=False" in message
    object_npy = tmp_path / "objects.npy"
    np.save(object_npy, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    message = _bad(farm_inprocess, source, "-o", str(tmp_path / "d.onnx"), "--method", "static",
                   "--calibration", str(object_npy))
    assert f"--calibration {object_npy}" in message and "pickled objects are refused" in message

    message = _bad(farm_inprocess, source, "-o", str(tmp_path / "e.onnx"), "--calibration", str(wrong_name))
    assert "--method dynamic uses no calibration data" in message
    message = _bad(farm_inprocess, source, "-o", str(tmp_path / "f.onnx"), "--method", "static",
                   "--calibration", str(tmp_path / "nowhere.npz"))
    assert f"--calibration {tmp_path / 'nowhere.npz'}: no such file" in message
    message = _bad(farm_inprocess, source, "-o", str(tmp_path / "h.onnx"), "--method", "static", "--shape",
                   "pixels=1x3x96x96")
    assert "--shape pixels" in message and "no such input" in message
    message = _bad(farm_inprocess, source, "-o", str(tmp_path / "h.onnx"), "--shape", "x=1x3x96x96")
    assert "--shape" in message and "--method static or qdq" in message
    import importlib.util
    if importlib.util.find_spec("onnxconverter_common") is None:  # not a farm dependency: fp16 says what it needs
        message = _bad(farm_inprocess, source, "-o", str(tmp_path / "h.onnx"), "--method", "fp16")
        assert "--method fp16" in message and "onnxconverter-common" in message and source in message
    message = _bad(farm_inprocess, source, "-o", str(tmp_path / "g.tflite"))
    assert "-o" in message and ".onnx" in message
    assert not list(tmp_path.glob("[a-h].onnx"))  # nothing written for a refusal


def _job(directory: Path, name: str, models: list[Path], repeats: int) -> Path:
    listed = ", ".join(str(m) for m in models)
    return write_job(directory, f"name: {name}\nmodels: [{listed}]\n"
                                "workload: {type: benchmark, iterations: 5, warmup: 1}\n"
                                f"repeats: {repeats}\nsim: {{on_contention: flag}}\n", name=f"{name}.yaml")


def test_compare_a_float_job_with_its_quantized_job(farm_inprocess, mobilenet_models: dict[str, Path],
                                                   tmp_path: Path) -> None:
    source = mobilenet_models[MODEL]
    quantized = tmp_path / "mnv2.int8.onnx"
    _quantize(farm_inprocess, str(source), "-o", str(quantized))
    jobs = []
    for name, model in (("float", source), ("int8", quantized)):
        submitted = farm_inprocess("submit", str(_job(tmp_path, name, [model], repeats=2)), "--json", "--create")
        assert submitted.returncode == 0, submitted.stderr  # the quantized model runs through farm submit
        jobs.append(submitted.json()["job"])
        assert submitted.json()["status"] == "completed"

    answer = farm_inprocess("compare", str(jobs[0]), str(jobs[1]), "--json")
    assert answer.returncode == 0, answer.stderr
    report = answer.json()
    (pair,) = report["pairs"]
    assert pair["matched_by"] == "lineage"  # different names: paired because B was made from A
    assert pair["model_a"]["sha256"] == _sha(source) and pair["lineage"]["source"]["sha256"] == _sha(source)
    assert pair["size"]["ratio"] < 0.5
    (row,) = pair["rows"]
    assert row["target"] == "sim" and row["accelerator"] == "cpu" and row["runs_a"] == row["runs_b"] == 2
    # a run the contention check flagged counts only where a cell has no clean one (this machine is shared)
    assert row["used_a"] == 2 - row["contended_a"] or row["used_a"] in (1, 2)
    for key in ("latency_avg_ms", "latency_p50_ms", "peak_memory_mb"):
        figure = row["metrics"][key]
        assert figure["a"] > 0 and figure["b"] > 0
        assert (figure["n_a"], figure["n_b"]) == (row["used_a"], row["used_b"]) and "noise" in figure["verdict"]
        if figure["n_a"] == figure["n_b"] == 2:
            assert figure["noise"] in ("within", "beyond")
            assert figure["t_critical"] is not None or figure["sd_a"] == figure["sd_b"] == 0  # Welch's, or no spread
        else:
            assert figure["noise"] == "unknown" and "noise unknown" in figure["verdict"]
    assert "energy_per_inference_mj" not in row["metrics"]  # not measured in the sim

    table = farm_inprocess("compare", str(jobs[0]), f"job-{jobs[1]}")
    assert table.returncode == 0, table.stderr
    text = " ".join(table.stdout.split())
    assert "mnv2.int8" in text and "lineage" in text and "noise" in text


def test_compare_variants_within_one_job_with_one_run_says_noise_unknown(
        farm_inprocess, farm_db: Path, mobilenet_models: dict[str, Path], tmp_path: Path) -> None:
    source = mobilenet_models[MODEL]
    variant, other = tmp_path / "variant.onnx", tmp_path / "other.onnx"
    _quantize(farm_inprocess, str(source), "-o", str(variant), "--method", "qdq")
    _quantize(farm_inprocess, str(source), "-o", str(other), "--method", "dynamic")
    submitted = farm_inprocess("submit", str(_job(tmp_path, "both", [source, variant, other], repeats=1)), "--json",
                               "--create")
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.json()["job"]
    report = farm_inprocess("compare", str(job), "--json").json()
    # one source, two variants: each variant is paired with it, never with each other or the source with itself
    assert sorted((p["model_a"]["name"], p["model_b"]["name"]) for p in report["pairs"]) == [
        (source.stem, "other"), (source.stem, "variant")]
    assert report["unmatched_a"] == [] and report["unmatched_b"] == []
    for pair in report["pairs"]:
        latency = pair["rows"][0]["metrics"]["latency_avg_ms"]
        assert latency["noise"] == "unknown" and latency["verdict"] == ONE_RUN
    assert any("repeats" in note for note in report["notes"])
    table = farm_inprocess("compare", str(job))
    assert table.returncode == 0 and "noise unknown" in table.stdout
    page = tmp_path / "report.html"
    written = farm_inprocess("report", str(job), "-o", str(page))
    assert written.returncode == 0, written.stderr
    variants = page.read_text().split("<h2 id=variants>Variants</h2>")[1].split("<h2")[0]
    assert "<td>variant</td><td>qdq</td>" in variants and "<td>other</td><td>dynamic</td>" in variants
    assert ONE_RUN in variants

    # the dashboard's job page: the same rows (lineage from the sidecars, no model parsed per visit)
    from farm.controller.store import open_store
    from farm.web.pages import job_page
    from farm.web.views import job_view
    store = open_store(farm_db)
    try:
        view = job_view(store, job)
    finally:
        store.close()
    assert view is not None
    assert sorted((v.source, v.variant, v.method) for v in view.variants) == [
        (source.stem, "other", "dynamic"), (source.stem, "variant", "qdq")]
    page = job_page(view, csrf="x", may_cancel=False)
    assert "Variants beside their source" in page and 'id="variants"' in page and ONE_RUN in page

    missing = farm_inprocess("compare", str(job), "999")
    assert missing.returncode != 0 and "999" in missing.stderr


def test_judge_uses_the_repeats_spread() -> None:
    assert judge([10.0], [12.0]).verdict == ONE_RUN
    assert judge([10.0, 10.2], [12.0]).verdict == "one run in B: noise unknown"
    close = judge([10.0, 10.4, 9.8, 10.1], [10.2, 9.9, 10.3, 10.0])
    assert close.noise == "within" and close.t_critical is not None and close.t_critical > 2
    far = judge([10.0, 10.4, 9.8, 10.1], [20.2, 19.9, 20.3, 20.0])
    assert far.noise == "beyond" and far.change == pytest.approx(1.0, abs=0.03)
    assert judge([5.0, 5.0], [5.0, 5.0]).noise == "within"
    assert judge([5.0, 5.0], [6.0, 6.0]).noise == "beyond"


def _record(name: str, sha: str) -> RunRecord:
    return run_record(model={"name": name, "sha256": sha, "path": None, "size_bytes": 10})


def test_models_pair_by_lineage_then_name_then_the_one_left_on_each_side() -> None:
    lineage = {"source": {"sha256": "f" * 64}}
    pairs, left_a, left_b = pair_models(
        [_record("net", "f" * 64), _record("shared", "1" * 64), _record("old", "2" * 64)],
        [_record("net-int8", "e" * 64), _record("shared", "3" * 64), _record("new", "4" * 64)],
        same_job=False, lineage_of=lambda model: lineage if model.name == "net-int8" else None)
    assert [(p.a.name, p.b.name, p.matched_by) for p in pairs] == [
        ("net", "net-int8", "lineage"), ("shared", "shared", "name"), ("old", "new", "only model on each side")]
    assert left_a == left_b == []
    # A is the variant: still paired, and said so
    pairs, _, _ = pair_models([_record("net-int8", "e" * 64)], [_record("net", "f" * 64), _record("x", "9" * 64)],
                              same_job=False, lineage_of=lambda model: lineage if model.name == "net-int8" else None)
    assert [(p.a.name, p.b.name, p.matched_by) for p in pairs] == [
        ("net-int8", "net", "lineage (A is the variant)")]


def test_compare_says_the_same_through_a_controller(farm_inprocess, farm_db: Path, mobilenet_models: dict[str, Path],
                                                    tmp_path: Path) -> None:
    """The comparison is made in the client from the two jobs' results: a controller's answer is the embedded one."""
    import sqlite3

    from grpc_processes import Cluster

    source = mobilenet_models[MODEL]
    quantized = tmp_path / "remote.int8.onnx"
    _quantize(farm_inprocess, str(source), "-o", str(quantized), "--method", "static")
    for name, model in (("float", source), ("int8", quantized)):
        submitted = farm_inprocess("submit", str(_job(tmp_path, name, [model], repeats=1)), "--json", "--create")
        assert submitted.returncode == 0, submitted.stderr
    embedded = farm_inprocess("compare", "1", "2", "--json")
    assert embedded.returncode == 0, embedded.stderr

    root = tmp_path / "cluster"
    root.mkdir()
    cluster = Cluster(root, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_DEVICES": "",
                                 "FARM_CONFIG": str(root / "none.toml"), "FARM_DB": str(root / "unused.db")})
    try:
        with sqlite3.connect(farm_db) as store, sqlite3.connect(root / "controller.db") as copy:
            store.backup(copy)
        cluster.start_controller("--no-auth")
        remote = cluster.farm("compare", "1", "2", "--json", "--controller", str(cluster.address), timeout=300)
        assert remote.returncode == 0, remote.stderr
        assert json.loads(remote.stdout) == embedded.json()
        assert embedded.json()["pairs"][0]["matched_by"] == "lineage"
        missing = cluster.farm("compare", "1", "7", "--controller", str(cluster.address), timeout=300)
        assert missing.returncode == 2 and "7" in missing.stderr, missing.stderr
    finally:
        cluster.stop_all()
