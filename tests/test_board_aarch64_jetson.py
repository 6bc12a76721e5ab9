"""The short form of examples/jetson-experiment.yaml on the arm64 board (tests/arm_board.py, fixtures in
tests/board_aarch64.py): image and video models, each board run beside its sim twin, calibrated per family. A file
of its own so that `make test`'s workers run it beside the board's other files (issue 34)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from board_aarch64 import arm_fixture, board_lab, setup_run_fixture  # noqa: F401 (the `arm` and `setup_run` fixtures)
from farm.proto.results import RunResult
from sshd_peer import SshdPeer

pytestmark = [pytest.mark.timeout(1800)]


# the short form of examples/jetson-experiment.yaml: four of each family (a fit needs four models), the
# smallest of the published ones, one inference a run (whole_run is the metric: the script's start, model load
# and inference, which one inference already has), one repeat (emulated onnxruntime is slow)
JETSON_SHORT = {"image": ["shufflenetv2_x0.5", "squeezenet1_1", "mobilenetv2_w1.0_r224", "resnet18"],
                "video": ["shufflenetv2_3d_x0.25", "shufflenetv2_3d_x0.5", "shufflenetv2_3d_x1", "mobilenetv2_3d_x0.25"]}


def test_aarch64_jetson_experiment_short_form_pairs_and_calibrates_per_family(
        arm: SshdPeer, setup_run: RunResult, tmp_path: Path, farm) -> None:
    from farm.model_generators.generate import serialize_onnx
    from farm.model_generators.published_nets import JETSON_EXPERIMENT_MODELS
    lab, env = board_lab(tmp_path, arm, setup_run)
    examples = Path(__file__).resolve().parents[1] / "examples"
    shutil.copy(examples / "jetson-experiment.yaml", tmp_path / "jetson-experiment.yaml")
    shutil.copytree(examples / "jetson-experiment", tmp_path / "jetson-experiment")
    (tmp_path / "models").mkdir()
    wanted = {name: family for family, names in JETSON_SHORT.items() for name in names}
    for model in JETSON_EXPERIMENT_MODELS:
        if model.name in wanted:
            assert model.family == wanted[model.name]
            (tmp_path / "models" / f"{model.name}.onnx").write_bytes(serialize_onnx(model.build(seed=0)))
    models = ", ".join(f"{{path: models/{name}.onnx, family: {family}}}" for name, family in wanted.items())
    run = farm("submit", "jetson-experiment.yaml", "--devices", str(lab), "--json", "--set", f"models=[{models}]",
               "--set", "repeats=1", "--set", 'workload.args=["{model}","{threads}","{batch_size}","1"]',
               "--set", "targets=[arm-1]", "--set", "sim.memory=2g", env=env, timeout=1500)
    records = run.json()["results"]
    assert run.returncode == 0, [(r["target"], r["failure_class"], r["message"]) for r in records] or run.stderr[-3000:]
    assert len(records) == 8 * 2 and all(r["status"] == "completed" for r in records)
    assert {r["target"] for r in records} == {"arm-1", "sim"}  # each board run beside its sim twin

    cal = farm("calibrate", "--job", "1", "--device", "arm-1", "--metric", "whole_run", "--include-contended",
               "--json", env=env)
    assert cal.returncode == 0, cal.stderr + cal.stdout
    fits = {c["family"]: c for c in cal.json()["calibrations"] if c["metric"] == "whole_run"}
    assert {"image", "video"} <= set(fits), cal.stdout  # calibrated apart, as the published figures 3 and 4
    for family in ("image", "video"):
        assert fits[family]["n"] == 4 and fits[family]["kind"], fits[family]
    print("AARCH64-JETSON", json.dumps({family: {k: fit.get(k) for k in (
        "kind", "n", "r2", "loo_mape", "spearman_rho", "formula", "runtime")} for family, fit in fits.items()}
        | {"pairs": [(r["model"], r["target"], r.get("whole_run_s")) for r in records]}, default=str))
