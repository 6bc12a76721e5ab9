"""examples/phones-experiment.yaml, the published phones experiment, end to end against two emulated
phones (an LG G6 and a Galaxy S8) and their sim twins.

The test runs the example file as published with `--set workload.iterations=3 --set repeats=1`
(instead of 500 and 5); everything else (models, threads, targets, the twins' budgets from the
device types) is the example's own, and the published figures are checked on the example file itself.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
import yaml

from adb_emulator import AdbDeviceEmulator, EmulatedPhone
from farm.agents.android.adb import load_or_create_lab_key

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "phones-experiment.yaml"
S8_PROPERTIES = {"ro.product.model": "SM-G950F", "ro.product.manufacturer": "samsung",
                 "ro.build.fingerprint": "samsung/dreamltexx/dreamlte:9/PPR1.180610.011/G950FXXU9DTJ1:user/release-keys",
                 "ro.product.cpu.abi": "arm64-v8a", "ro.soc.model": "Exynos8895", "ro.build.version.sdk": "28"}


def test_the_example_is_the_published_setup() -> None:
    spec = yaml.safe_load(EXAMPLE.read_text())
    names = [Path(m["path"]).stem for m in spec["models"]]
    assert names == ["mobilenetv2_w0.25_r224", "mobilenetv2_w0.5_r224", "mobilenetv2_w0.75_r224",
                     "mobilenetv2_w1.0_r224", "squeezenet1_1", "inception_v1"]
    assert spec["workload"]["iterations"] == 500 and spec["repeats"] == 5 and spec["matrix"]["threads"] == [1, 2, 4]
    assert spec["targets"] == ["type:lg-g6", "type:samsung-s8"]


@pytest.fixture
def two_phones(tmp_path: Path):
    key = tmp_path / "lab" / "adbkey"
    load_or_create_lab_key(key)
    pub = [Path(f"{key}.pub").read_text()]
    with AdbDeviceEmulator(tmp_path / "g6", authorized_keys=pub) as g6, \
            AdbDeviceEmulator(tmp_path / "s8", phone=EmulatedPhone(properties=S8_PROPERTIES), authorized_keys=pub) as s8:
        lab = tmp_path / "lab.yaml"
        lab.write_text(f"""devices:
  - {{name: g6-1, driver: android, type: lg-g6, host: 127.0.0.1, port: {g6.port}, adb_key: {key}}}
  - {{name: s8-1, driver: android, type: samsung-s8, host: 127.0.0.1, port: {s8.port}, adb_key: {key}}}
""")
        yield lab


def test_the_phones_experiment_runs_end_to_end_on_emulated_phones(tmp_path: Path, two_phones: Path, farm) -> None:
    folder = tmp_path / "examples"
    folder.mkdir()
    generated = farm("models", "generate", str(folder / "models"), "--widths", "0.25,0.5,0.75,1.0", "--sizes", "224",
                     "--formats", "tflite", "--quiet")
    assert generated.returncode == 0, generated.stderr
    job = folder / "phones-experiment.yaml"
    shutil.copy(EXAMPLE, job)  # as published; shortened on the command line (see the module's docstring)

    run = farm("submit", str(job), "--devices", str(two_phones), "--json", "--set", "workload.iterations=3",
               "--set", "workload.warmup=1", "--set", "repeats=1", timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-2000:]
    records = run.json()["results"]
    assert len(records) == 6 * 3 * 2 * 2  # models × threads × phones × (phone run + sim twin)
    assert all(r["status"] == "completed" for r in records), [r["message"] for r in records if r["message"]]

    pairs = farm("results", "1", "--pairs", "--json").json()
    assert len(pairs) == 36 and {p["device"] for p in pairs} == {"g6-1", "s8-1"}
    for p in pairs:
        # each twin had its phone type's budget: as many CPUs as threads, 2 GB
        assert p["sim"]["limits"]["memory_mb"] == 2048 and p["sim"]["cpus"] == p["threads"]
        assert p["device_run"]["backend"] == "android" and p["device_run"]["throughput_per_s"] > 0
        assert p["device_run"]["startup_ms"] > 0 and p["sim"]["startup_ms"] > 0
    commands = [json.loads(e)["command"] for (e,) in sqlite3.connect(tmp_path / "farm.db").execute(
        "SELECT r.environment_json FROM runs r JOIN tasks t ON t.id = r.task_id WHERE t.target != 'sim'")]
    assert len(commands) == 36
    # the job's run count wins over the type's default --num_runs=500; 4 threads reach the tool
    assert all("--num_runs=3" in c and "--num_runs=500" not in c for c in commands)
    assert sum("--num_threads=4" in c for c in commands) == 12
