"""examples/jetson-experiment.yaml, the published Jetson Nano experiment, run end to end against
the Jetson-like ssh peer: every script run on the board comes back beside its sim twin with
whole-script runtime and average and peak memory on both sides, ready to calibrate."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from farm.cli.main import build_parser
from farm.model_generators.generate import serialize_onnx
from farm.model_generators.mobilenetv2 import INPUT_SIZES, WIDTHS, model_name
from farm.model_generators.published_nets import JETSON_EXPERIMENT_MODELS
from farm.model_generators.zoo import zoo_models
from farm.proto.spec import JobSpec
from grpc_processes import in_process_cluster
from sshd_peer import SshdPeer

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _lab(tmp_path: Path, board: SshdPeer) -> Path:
    lab = tmp_path / "lab.yaml"
    lab.write_text(f"""
devices:
{board.jetson_lab_entry()}""")
    return lab


# The example's short form: the overrides `farm submit --set` takes, applied to the file as it would
SHORT_FORM: dict[str, Any] = {"repeats": 1, "workload.args": ["{model}", "{threads}", "{batch_size}", "20"]}
# four image and four video models of the example, the lightest (InceptionV3 on one contended CPU takes minutes):
# enough for each family's own fit
SHORT_IMAGE = ("shufflenetv2_x0.5", "squeezenet1_1", "mobilenetv2_w1.0_r224", "resnet18")
SHORT_VIDEO = ("shufflenetv2_3d_x0.25", "shufflenetv2_3d_x1", "mobilenetv2_3d_x0.25", "squeezenet_3d")


def _override(spec: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = spec
        for key in parents:
            node = node[key]
        node[leaf] = value
    return spec


@pytest.fixture(scope="module")
def published_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    # the eight of the short form only (generating all sixteen, InceptionV3 among them, cost 4 CPU-s, these 1)
    dest = tmp_path_factory.mktemp("published")
    models = {}
    for m in JETSON_EXPERIMENT_MODELS:
        if m.name in SHORT_IMAGE + SHORT_VIDEO:
            models[f"{m.name}.onnx"] = dest / f"{m.name}.onnx"
            models[f"{m.name}.onnx"].write_bytes(serialize_onnx(m.build()))
    assert len(models) == len(SHORT_IMAGE + SHORT_VIDEO)
    return models


def _example_with(tmp_path: Path, models: dict[str, Path]) -> Path:
    """The example as published in its short form, with only `models` of its own (the same script, matrix,
    targets, budget and families)."""
    spec = _override(yaml.safe_load((EXAMPLES / "jetson-experiment.yaml").read_text()), SHORT_FORM)
    shutil.copytree(EXAMPLES / "jetson-experiment", tmp_path / "jetson-experiment")
    (tmp_path / "models").mkdir()
    for name, path in models.items():
        os.symlink(path, tmp_path / "models" / name)
    spec["models"] = [entry for entry in spec["models"] if Path(entry["path"]).name in models]
    assert len(spec["models"]) == len(models)
    job = tmp_path / "jetson-experiment.yaml"
    job.write_text(yaml.safe_dump(spec))
    return job


def _make_models_writes() -> set[str]:
    """Every file name the Makefile's `models` target writes into examples/models, read from its commands."""
    names: set[str] = set()
    makefile = (EXAMPLES.parent / "Makefile").read_text()
    commands = re.findall(r"^\t\$\(FARM\) (models generate examples/models .*)$", makefile, flags=re.M)
    assert commands, "the Makefile's models target no longer generates examples/models"
    for command in commands:
        args = build_parser().parse_args(shlex.split(command))
        widths = [float(w) for w in args.widths.split(",")] if args.widths else list(WIDTHS)
        sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else list(INPUT_SIZES)
        formats = args.formats.split(",")
        names |= {f"{model_name(w, size)}.{fmt}" for w in widths for size in sizes for fmt in formats}
        names |= set() if args.no_zoo else {f"{name}.onnx" for name in zoo_models()}
        names |= {f"{m.name}.onnx" for m in JETSON_EXPERIMENT_MODELS} if args.published else set()
    return names


def test_the_example_is_the_published_setup() -> None:
    spec = JobSpec.model_validate(yaml.safe_load((EXAMPLES / "jetson-experiment.yaml").read_text()))
    assert spec.workload.type == "script" and spec.workload.script == "infer.py"
    assert spec.workload.args[-1] == "500" and spec.repeats == 5  # 500 inferences x 5 repeats, as published
    assert spec.matrix.threads == [1] and spec.sim.cpus == 1 and spec.sim.memory == 4 << 30
    assert spec.targets == ["type:jetson-nano"]
    assert (EXAMPLES / spec.workload.dir / spec.workload.script).is_file()
    # the five image and eleven video models, each in its own family: calibrated apart, as figures 3 and 4
    assert [(Path(e.path).stem, e.family) for e in spec.models] == [(m.name, m.family) for m in JETSON_EXPERIMENT_MODELS]
    assert [e.family for e in spec.models].count("image") == 5 and [e.family for e in spec.models].count("video") == 11
    # every model is one `make models` writes
    make_models = _make_models_writes()
    for entry in spec.models:
        assert Path(entry.path).parent == Path("models") and Path(entry.path).name in make_models, entry.path


def test_the_short_form_is_the_example_with_fewer_runs() -> None:
    full = JobSpec.model_validate(yaml.safe_load((EXAMPLES / "jetson-experiment.yaml").read_text()))
    short = JobSpec.model_validate(_override(yaml.safe_load((EXAMPLES / "jetson-experiment.yaml").read_text()),
                                             SHORT_FORM))
    assert short.repeats == 1 and short.workload.args[-1] == "20"
    assert short.model_copy(update={"repeats": full.repeats, "workload": full.workload}) == full


def test_the_jetson_experiment_runs_end_to_end_paired(board: SshdPeer, published_models, tmp_path: Path,
                                                      farm) -> None:
    job = _example_with(tmp_path, published_models)
    run = farm("submit", str(job), "--devices", str(_lab(tmp_path, board)), "--json")
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    records = run.json()["results"]
    assert len(records) == 8 * 1 * 2  # models × repeats × (board + sim twin)
    assert all(r["status"] == "completed" for r in records), [r["message"][-600:] for r in records]
    assert {r["model"]["name"]: r["model"]["family"] for r in records} == {
        **dict.fromkeys(SHORT_IMAGE, "image"), **dict.fromkeys(SHORT_VIDEO, "video")}

    pairs = farm("results", "1", "--pairs", "--json").json()
    assert len(pairs) == 8
    for p in pairs:
        board_run, sim = p["device_run"], p["sim"]
        assert board_run["backend"] == "jetson" and sim["backend"] in ("cgroup", "docker", "process")
        assert sim["limits"]["cpus"] == 1 and sim["limits"]["memory_mb"] == 4096  # the Nano's budget
        for side in (board_run, sim):
            assert side["whole_run_s"] > 0 and side["latency_ms"]["count"] == 20  # 20 images or clips, one per line
            assert side["avg_memory_mb"] > 0 and side["peak_memory_mb"] >= side["avg_memory_mb"], json.dumps(side)[:3000]
        assert board_run["energy_per_inference_mj"] > 0  # the fake Nano's power rails
    table = farm("results", "1", "--pairs").stdout
    assert "nano-1" in table
    # the pairs go to calibration on the experiment's metrics, and image and video models get fits of their own,
    # as figures 3 and 4 (contended twins counted too: on a busy test machine the sim's honest contention flag
    # is not the point here)
    cal = farm("calibrate", "--job", "1", "--device", "nano-1", "--metric", "whole_run", "--metric", "avg_memory",
               "--metric", "peak_memory", "--include-contended", "--json")
    assert cal.returncode == 0, cal.stdout + cal.stderr
    fits = {(c["metric"], c["family"]): c for c in cal.json()["calibrations"]}
    for metric in ("whole_run", "avg_memory", "peak_memory"):
        for family, models in (("image", SHORT_IMAGE), ("video", SHORT_VIDEO)):
            assert fits[(metric, family)]["n"] == len(models), (metric, family, sorted(fits))


def test_the_jetson_experiment_through_a_controller_and_a_remote_agent(board: SshdPeer, published_models,
                                                                      tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`farm agent --devices lab.yaml` on a rack host: the script folder goes client → controller → agent
    → board, each hop by content hash (over gRPC; the controller and the agent on threads of this process, as
    `farm controller serve` and `farm agent` compose them); a video model, whose clips are 5-D."""
    job = _example_with(tmp_path, {"shufflenetv2_3d_x0.25.onnx": published_models["shufflenetv2_3d_x0.25.onnx"]})
    cluster = in_process_cluster(tmp_path, monkeypatch)
    try:
        cluster.serve_in_process()
        cluster.agent_in_process("rack1", devices=_lab(tmp_path, board))  # returns once it is connected
        run = cluster.farm("submit", str(job), "--controller", cluster.address, "--json")
        assert run.returncode == 0, run.stderr[-3000:] + cluster.server_output()[-3000:]
    finally:
        cluster.stop_all()
    records = json.loads(run.stdout)["results"]
    assert len(records) == 1 * 2 and all(r["status"] == "completed" for r in records), records
    board_runs = [r for r in records if r["target"] == "nano-1"]
    assert all(r["backend"] == "jetson" and r["whole_run_s"] > 0 for r in board_runs)
    assert {r["pair_key"] for r in board_runs} == {r["pair_key"] for r in records if r["target"] == "sim"}
