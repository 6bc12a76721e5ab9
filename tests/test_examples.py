"""The jobs in examples/ as a user meets them after `make models`: each one loads, the sim ones run
end to end (calibration and report included), the lab file loads, and a model that was not
generated is named with the command that writes it."""

from __future__ import annotations

import glob
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from farm.agents.lab import load_lab
from farm.controller.scheduling.jobfile import JobFileError, load_job
from conftest import FARM


REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
BUNDLED_SUITE = REPO / "controller" / "operations" / "reference-suite.yaml"


def _make_models_commands() -> list[list[str]]:
    """The `farm models generate ...` lines of the Makefile's models recipe, as argument lists."""
    return [shlex.split(ln.strip().replace("$(FARM)", "", 1))
            for ln in (REPO / "Makefile").read_text().splitlines() if ln.strip().startswith("$(FARM) models generate")]


EXAMPLE_JOBS = sorted(p.name for p in EXAMPLES.glob("*.yaml") if p.name != "lab.yaml")  # lab.yaml lists devices


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> Path:
    """A copy of examples/ with the models `make models` writes: the Makefile's own commands, run here."""
    d = tmp_path_factory.mktemp("examples") / "examples"
    shutil.copytree(EXAMPLES, d, ignore=shutil.ignore_patterns("models"))
    commands = _make_models_commands()
    assert commands, "the Makefile's models recipe no longer runs `farm models generate`"
    for argv in commands:
        p = subprocess.run([*FARM, *argv], cwd=d.parent, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr
    return d


@pytest.mark.parametrize("name", EXAMPLE_JOBS)
def test_make_models_writes_every_model_each_example_names(examples: Path, name: str) -> None:
    spec = yaml.safe_load((EXAMPLES / name).read_text())
    for entry in spec["models"]:
        path = entry if isinstance(entry, str) else entry["path"]
        matches = glob.glob(str(examples / path))
        assert matches, f"examples/{name} names {path}, which `make models` does not write"
    from farm.controller.scheduling.jobfile import DeviceTarget
    lab = [DeviceTarget(d.name, d.device_type, d.tags) for d in load_lab(EXAMPLES / "lab.yaml")]
    job = load_job(examples / name, lab)  # and the job loads with nothing refused, on the example lab
    assert job.models and not job.invalid


def test_sim_and_device_examples_calibrate_and_report(examples: Path, farm, tmp_path: Path) -> None:
    sim = load_job(examples / "sim.yaml")
    assert len(sim.models) == 6 and {m.family for m in sim.models} == {"mobilenetv2"}  # a family, ≥ 4 models
    assert sim.spec.sim.cpus == 1.0 and load_job(examples / "device.yaml").spec.sim.cpus == 0.5
    assert farm("submit", str(examples / "sim.yaml"), "--quiet").returncode == 0
    assert farm("submit", str(examples / "device.yaml"), "--quiet").returncode == 0
    # docs/how-to/calibrate-and-predict.md's commands, as written there (contended runs kept: this machine is
    # shared, not the point here)
    cal = farm("calibrate", "--sim-job", "1", "--device-job", "2", "--device", "half-cpu", "--metric", "latency",
               "--metric", "peak_memory", "--include-contended", "--json")
    assert cal.returncode == 0, cal.stdout + cal.stderr
    assert {c["metric"] for c in cal.json()["calibrations"]} == {"latency", "peak_memory"}
    listed = farm("calibrations", env={"COLUMNS": "100"}).stdout
    assert "half-cpu" in listed and "peak_memory" in listed and max(len(ln) for ln in listed.splitlines()) <= 100
    report = tmp_path / "report.html"
    assert farm("report", "1", "-o", str(report), "--png", str(tmp_path / "figures")).returncode == 0
    page = report.read_text()
    assert "half-cpu" in page and "device side: job 2 (half-cpu)" in page


def test_script_example_runs_its_script(examples: Path, farm) -> None:
    run = farm("submit", str(examples / "script.yaml"), "--json")
    assert run.returncode == 0, run.stderr
    results = run.json()["results"]
    assert len(results) == 4 and all(r["status"] == "completed" for r in results)
    assert all(r["latency_ms"]["count"] == 30 and r["whole_run_s"] > 0 for r in results)


def test_lab_example_loads_every_device_with_its_type() -> None:
    devices = load_lab(EXAMPLES / "lab.yaml")
    assert {d.name: d.device_type.name for d in devices} == {
        "g6-1": "lg-g6", "s8-1": "samsung-s8", "nano-1": "jetson-nano", "pi4-1": "raspberry-pi-4"}
    # a job can target them by name, type and tag
    from farm.controller.scheduling.jobfile import DeviceTarget
    targets = [DeviceTarget(d.name, d.device_type, d.tags) for d in devices]
    assert {d.entry.driver for d in devices} == {"android", "jetson", "linux"} and targets


def test_the_reference_suite_runs_on_make_models_output(examples: Path, tmp_path: Path) -> None:
    # after `make models`, every model the reference suite names is there
    shutil.copy(BUNDLED_SUITE, examples / "reference-suite.yaml")
    assert len(load_job(examples / "reference-suite.yaml").models) == 5
    # without them, the error says how to get them
    shutil.copy(BUNDLED_SUITE, tmp_path / "suite.yaml")
    with pytest.raises(JobFileError) as e:
        load_job(tmp_path / "suite.yaml")
    message = str(e.value)
    assert "mobilenetv2_w0.35_r160.tflite' does not exist" in message
    assert f"farm models generate {tmp_path / 'models'} --widths 0.35 --sizes 160 --formats tflite" in message
    assert "--widths 1.4 --sizes 160" in message  # every missing model is named, each with its command
