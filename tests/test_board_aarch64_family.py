"""The arm64 board (tests/arm_board.py, fixtures in tests/board_aarch64.py) through the controller: a MobileNetV2
family, each board run beside its sim twin, calibrated with the architecture in the key, and a held-out width
predicted. A file of its own so that `make test`'s workers run it beside the board's other files (issue 34)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from board_aarch64 import (  # noqa: F401 (the `arm` and `setup_run` module fixtures)
    arm_fixture, board_config, board_lab, board_task, setup_run_fixture)
from farm.agents.boards.driver import BoardDriver
from farm.proto.results import RunResult
from sshd_peer import SshdPeer

pytestmark = [pytest.mark.timeout(1800)]


# each emulated inference costs ~10-30x a native one (issue 34): five a run still average out a busy host's
# spikes in the sim twins, and the latency fit needs their ranking, not more precision
FAMILY_ITERATIONS = 5


def test_aarch64_mobilenet_family_pairs_with_sim_twins_calibrates_and_predicts(
        arm: SshdPeer, setup_run: RunResult, tmp_path: Path, farm) -> None:
    from farm.model_generators.generate import generate_examples
    lab, env = board_lab(tmp_path, arm, setup_run)
    models = tmp_path / "models"
    generate_examples(models, widths=[0.35, 0.5, 0.75, 1.0, 1.4], input_sizes=[96], formats=["tflite"], zoo=False)
    train = [f"mobilenetv2_w{w}_r96.tflite" for w in ("0.35", "0.5", "0.75", "1.4")]
    job = tmp_path / "arm.yaml"
    job.write_text(f"""
name: arm-mobilenetv2
models: [{", ".join(f"{{path: models/{m}, family: mobilenetv2}}" for m in train)}]
workload: {{type: benchmark, iterations: {FAMILY_ITERATIONS}, warmup: 1}}
matrix: {{threads: [1]}}
targets: [arm-1]
sim: {{cpus: 1, memory: 2g}}
""")
    run = farm("submit", str(job), "--devices", str(lab), "--json", env=env, timeout=1200)
    records = run.json()["results"]
    assert run.returncode == 0, [(r["target"], r["failure_class"], r["message"]) for r in records] or run.stderr[-3000:]
    assert len(records) == 4 * 2 and all(r["status"] == "completed" for r in records)
    assert {r["target"] for r in records} == {"arm-1", "sim"}  # each board run beside its sim twin

    cal = farm("calibrate", "--job", "1", "--device", "arm-1", "--metric", "latency", "--metric", "peak_memory",
               "--include-contended", "--json", env=env)
    assert cal.returncode == 0, cal.stderr + cal.stdout
    fits = {c["metric"]: c for c in cal.json()["calibrations"]}
    latency = fits["latency"]
    assert latency["n"] == 4
    history = farm("calibrations", "--device", "arm-1", "--json", env=env).json()
    assert history and all(r["runtime"].endswith(";arch=aarch64") or r["runtime"].endswith("@arch=aarch64")
                           for r in history), history  # the architecture is in the calibration key
    assert latency["fits"]["ols"]["a"] > 1  # the emulated board is slower than the sim per unit of sim time
    pred = farm("predict", str(models / "mobilenetv2_w1.0_r96.tflite"), "--device", "arm-1", "--json",
                "--include-contended", env=env)  # about the board, not this machine's load (as the calibration above)
    assert pred.returncode == 0, pred.stderr
    p = next(p for p in pred.json() if p["metric"] == "latency")
    assert p["low"] <= p["estimate"] <= p["high"] and p["estimate"] > p["sim"]
    # the board's own measurement of the held-out model, for BENCHMARKS.md (not asserted: a busy host moves it)
    actual = BoardDriver(board_config(arm, python=setup_run.environment["venv_python"])).run(board_task(
        models / "mobilenetv2_w1.0_r96.tflite", {"type": "benchmark", "iterations": FAMILY_ITERATIONS, "warmup": 1}),
        lambda: False)
    assert actual.ok, actual.message
    print("AARCH64-CALIBRATION", json.dumps({"latency": {k: latency.get(k) for k in (
        "kind", "n", "r2", "loo_mape", "loo_within_10", "kendall_tau", "spearman_rho", "formula", "features_used")},
        "ols": latency["fits"]["ols"], "peak_memory": {k: fits.get("peak_memory", {}).get(k) for k in (
            "kind", "n", "r2", "loo_mape", "spearman_rho", "formula")},
        "predicted_w1.0": {k: p[k] for k in ("sim", "estimate", "low", "high")}, "key": history[0]["runtime"],
        "measured_w1.0": actual.latency.avg}, default=str))
