"""workload.dataset on a phone (issue 30): the android driver pushes each sample, runs it through the phone's
benchmark_model (--input_layer_value_files, --output_filepath), pulls the outputs back and records the same
accuracy block as the sim — compared here with the sim's own outputs for the same samples.

The phone is tests/adb_emulator.py: its benchmark_model stand-in reads the input files and writes the output file
as TensorFlow's tool does (benchmark_tflite_model.cc), running the pushed model with LiteRT's interpreter."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest

from adb_emulator import AdbDeviceEmulator
from conftest import write_job
from farm.agents.android.adb import load_or_create_lab_key
from farm.agents.android.driver import AndroidDeviceConfig, AndroidDriver
from farm.proto.accuracy import pack
from farm.proto.device_types import load_device_types
from farm.proto.results import FailureClass
from farm.proto.tasks import TaskPlan, TaskSpec

SAMPLES = 4


@pytest.fixture
def lab_key(tmp_path: Path) -> Path:
    key = tmp_path / "lab" / "adbkey"
    load_or_create_lab_key(key)
    return key


def _driver(emulator: AdbDeviceEmulator, key: Path) -> AndroidDriver:
    config = AndroidDeviceConfig(name="g6-1", host="127.0.0.1", port=emulator.port, key_path=key, cooldown_poll_s=0.1)
    return AndroidDriver(config, load_device_types()["lg-g6"])


def _task(model: Path, dataset: dict, mode: str = "shell") -> TaskSpec:
    workload = {"type": "benchmark", "iterations": 5, "warmup": 1, "android_mode": mode, "dataset": dataset}
    return TaskSpec(task_id=1, job_id=1, attempt=1, target="phone", model_name=model.stem, model_path=str(model),
                    model_sha256="", model_family=None, threads=1, batch_size=1, input_size=None, repeat=0,
                    plan=TaskPlan(workload=workload, sim={}, run_timeout_s=60, base_dir=str(model.parent)))


def _sim_record(farm_inprocess, folder: Path, model: Path, samples: np.ndarray, labels: np.ndarray) -> dict:
    """The same model and samples as a sim job: what the sim records for them."""
    folder.mkdir()
    (folder / "tiny.tflite").write_bytes(model.read_bytes())
    np.save(folder / "x.npy", samples)
    np.save(folder / "labels.npy", labels)
    job = write_job(folder, "models: [tiny.tflite]\nworkload:\n  iterations: 2\n"
                            "  dataset: {path: x.npy, labels: labels.npy}\nsim: {on_contention: flag}\n")
    run = farm_inprocess("submit", str(job))
    assert run.returncode == 0, run.stderr
    (record,) = farm_inprocess("results", "1", "--format", "json").json()
    return record["accuracy"]


def test_a_dataset_runs_on_the_phone_and_its_outputs_are_the_sims(farm_inprocess, tiny_models, tmp_path: Path,
                                                                   lab_key: Path) -> None:
    from ai_edge_litert.interpreter import Interpreter

    model = tiny_models["tflite"]
    samples = np.random.default_rng(7).random((SAMPLES, 8, 8, 3), dtype=np.float32)
    interp = Interpreter(model_path=str(model))
    interp.allocate_tensors()
    (inp,), (out,) = interp.get_input_details(), interp.get_output_details()
    expected = []
    for sample in samples:  # the bare interpreter on this machine: the reference
        interp.set_tensor(inp["index"], sample[None])
        interp.invoke()
        expected.append(interp.get_tensor(out["index"]).copy())
    reference = np.concatenate(expected)
    labels = reference.reshape(SAMPLES, -1).argmax(axis=1)
    labels[0] = (labels[0] + 1) % reference.reshape(SAMPLES, -1).shape[1]  # one wrong
    sim = _sim_record(farm_inprocess, tmp_path / "sim", model, samples, labels)

    packed = pack({inp["name"]: samples}, labels, {out["name"]: reference})
    dataset = {"path": "x.npy", "reference": "ref.npz", "packed": packed}
    with AdbDeviceEmulator(tmp_path / "phone", authorized_keys=[Path(f"{lab_key}.pub").read_text()]) as phone:
        result = _driver(phone, lab_key).run(_task(model, dataset), lambda: False)
        pushed = list((tmp_path / "phone" / "data" / "local" / "tmp" / "farm" / "dataset").glob("*.bin"))
    assert result.ok, result.message
    assert result.latency.count == 5  # the timed loop as it was
    block = result.environment["accuracy"]
    assert block["samples"] == SAMPLES
    phone_out = block["outputs"][out["name"]]
    assert phone_out["sha256"] == sim["outputs"][out["name"]]["sha256"]  # the phone's outputs are the sim's
    assert block["agreement"]["max_abs_error"] < 1e-5 and block["agreement"]["cosine"] == pytest.approx(1, abs=1e-6)
    assert block["accuracy"]["top1"] == pytest.approx((SAMPLES - 1) / SAMPLES) == sim["accuracy"]["top1"]
    assert len(pushed) == SAMPLES  # one file per sample, content-addressed; the outputs' file removed

    # a threshold the outputs miss: an `accuracy` failure, its timings and its block kept
    strict = {**dataset, "packed": pack({inp["name"]: samples}, labels, {out["name"]: reference + 0.5}),
              "thresholds": {"max_abs_error": 0.01}}
    with AdbDeviceEmulator(tmp_path / "phone2", authorized_keys=[Path(f"{lab_key}.pub").read_text()]) as phone:
        failed = _driver(phone, lab_key).run(_task(model, strict), lambda: False)
    assert failed.failure_class == FailureClass.ACCURACY and "max_abs_error" in failed.message, failed.message
    assert failed.latency is not None and failed.latency.count == 5
    assert failed.environment["accuracy"]["agreement"]["max_abs_error"] == pytest.approx(0.5, abs=1e-4)


def test_app_mode_keeps_its_timings_and_says_the_dataset_did_not_run(tiny_models, tmp_path: Path,
                                                                     lab_key: Path) -> None:
    from adb_emulator import EmulatedPhone

    model = tiny_models["tflite"]
    samples = np.zeros((2, 8, 8, 3), np.float32)
    dataset = {"path": "x.npy", "packed": pack({"input": samples}, None, {})}
    assert base64.b64decode(dataset["packed"])
    with AdbDeviceEmulator(tmp_path / "phone", phone=EmulatedPhone(benchmark_apk=True),
                           authorized_keys=[Path(f"{lab_key}.pub").read_text()]) as phone:
        result = _driver(phone, lab_key).run(_task(model, dataset, mode="app"), lambda: False)
    assert result.ok, result.message
    assert "accuracy" not in result.environment
    assert "shell mode only" in result.environment["dataset_note"] and "dataset pass" in result.message


def test_farm_submit_runs_a_dataset_job_on_a_phone_and_its_sim_twin_alike(farm, tiny_models, tmp_path: Path,
                                                                            lab_key: Path) -> None:
    """From the command line: a dataset job targeting an emulated phone; the phone run and its sim twin record the
    same outputs, and `farm compare` reads both runs' dataset figures."""
    from ai_edge_litert.interpreter import Interpreter

    (tmp_path / "tiny.tflite").write_bytes(tiny_models["tflite"].read_bytes())
    x = np.random.default_rng(8).random((3, 8, 8, 3), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "labels.npy", np.array([0, 1, 2]))
    interp = Interpreter(model_path=str(tmp_path / "tiny.tflite"))
    interp.allocate_tensors()
    (inp,), (out,) = interp.get_input_details(), interp.get_output_details()
    outputs = []
    for sample in x:  # the reference: the bare interpreter here
        interp.set_tensor(inp["index"], sample[None])
        interp.invoke()
        outputs.append(interp.get_tensor(out["index"]).copy())
    np.savez(tmp_path / "ref.npz", **{out["name"]: np.concatenate(outputs)})
    job = write_job(tmp_path, "name: phone-dataset\nmodels: [tiny.tflite]\nworkload:\n  iterations: 3\n  warmup: 1\n"
                              "  dataset: {path: x.npy, labels: labels.npy, reference: ref.npz}\n"
                              "targets: [g6-1]\nsim: {on_contention: flag}\n")
    with AdbDeviceEmulator(tmp_path / "g6", authorized_keys=[Path(f"{lab_key}.pub").read_text()]) as g6:
        lab = tmp_path / "lab.yaml"
        lab.write_text(f"devices:\n  - {{name: g6-1, driver: android, type: lg-g6, host: 127.0.0.1, port: {g6.port}, "
                       f"adb_key: {lab_key}}}\n")
        run = farm("submit", str(job), "--devices", str(lab), "--json", timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    records = {r["target"]: r for r in run.json()["results"]}
    assert set(records) == {"g6-1", "sim"}
    phone, sim = records["g6-1"]["accuracy"], records["sim"]["accuracy"]
    assert records["g6-1"]["backend"] == "android" and phone["samples"] == sim["samples"] == 3
    (name,) = phone["outputs"]
    assert phone["outputs"][name]["sha256"] == sim["outputs"][name]["sha256"]
    assert phone["agreement"]["max_abs_error"] == sim["agreement"]["max_abs_error"] < 1e-5
    assert phone["accuracy"] == sim["accuracy"]
