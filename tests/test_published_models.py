"""The published Jetson experiment's models, as `farm models generate --published` writes them: each one's
parameters and MACs from `farm inspect` against the published figures, its depth against the published
architecture's, and every one loading and running in ONNX Runtime.

Sources of the expected figures:
- Image models: torchvision's model pages (weights metadata `num_params` and `GFLOPS`, which counts one
  multiply-add as one operation) for shufflenet_v2_x0_5 (1,366,792; 0.04), squeezenet1_1 (1,235,496;
  0.35), mobilenet_v2 (3,504,872; 0.30), resnet18 (11,689,512; 1.81) and inception_v3 (27,161,264 with
  the training-only auxiliary classifier, whose 3,326,696 weights an inference does not use; 5.71);
  ShuffleNetV2 0.5x: 41 MFLOPs (Ma et al. 2018, Table 5, multiply-adds); MobileNetV2: 300M multiply-adds
  (Sandler et al. 2018). Depths (conv and fully connected layers on the longest path) as MATLAB's
  pretrained-network table lists them: squeezenet 18, inceptionv3 48, resnet18 18, mobilenetv2 53.
- Video models: the layer tables of Köpüklü et al., "Resource Efficient 3D Convolutional Neural
  Networks" (ICCVW 2019) and their Efficient-3DCNNs models/ (16x112x112 clips, Kinetics-600's 600
  classes), counted here in closed form, one line per layer, apart from the generator and from
  farm's MAC counter.
Tolerances: parameters 1 % (batch norm is folded into the convolutions: one bias per channel where
PyTorch counts a BN weight and bias), MACs 2 % (3 % against figures published to two digits).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from farm.controller.scheduling.jobfile import JobFileError, load_job
from farm.model_generators.published_nets import (
    IMAGE_FAMILY,
    JETSON_EXPERIMENT_MODELS,
    VIDEO_FAMILY,
    mobilenetv2_3d,
    shufflenetv2,
)

# name -> (parameters, MACs, relative MAC tolerance, depth) of the published image models
IMAGE_FIGURES: dict[str, tuple[int, float, float, int | None]] = {
    "shufflenetv2_x0.5": (1_366_792, 41e6, 0.03, None),
    "squeezenet1_1": (1_235_496, 0.35e9, 0.03, 18),
    "mobilenetv2_w1.0_r224": (3_504_872, 300e6, 0.02, 53),
    "resnet18": (11_689_512, 1.81e9, 0.02, 18),
    "inception_v3": (27_161_264 - 3_326_696, 5.71e9, 0.02, 48),
}


# --- the video models, counted in closed form from the published layer tables ---------------------

class _Count:
    """Parameters and MACs of a sequence of 3-D convolutions (BN folded: a bias per output channel)."""

    def __init__(self) -> None:
        self.params = 0
        self.macs = 0
        self.depth = 0  # conv and fc layers on the longest path, added by hand per block

    def conv(self, cin: int, cout: int, kernel: int, out: tuple[int, int, int], groups: int = 1) -> None:
        per_output = cin // groups * kernel ** 3
        self.params += cout * per_output + cout
        self.macs += math.prod(out) * cout * per_output

    def fc(self, features: int, classes: int = 600) -> None:
        self.params += features * classes + classes
        self.macs += features * classes
        self.depth += 1


def _half(thw: tuple[int, int, int]) -> tuple[int, int, int]:
    return tuple(-(-d // 2) for d in thw)  # type: ignore[return-value]  # 3x3x3, stride 2, pad 1


def _mobilenetv2_3d(width: float) -> _Count:
    # Köpüklü et al. model_generators/mobilenetv2.py: (t, c, n, s) as in MobileNetV2's Table 2, strides in time too
    table = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]
    n = _Count()
    thw = (16, 56, 56)
    c = int(32 * width)
    n.conv(3, c, 3, thw)
    n.depth += 1
    for t, channels, repeats, stride in table:
        out = int(channels * width)
        for i in range(repeats):
            hidden = round(c * t)
            if t != 1:
                n.conv(c, hidden, 1, thw)
                n.depth += 1
            if i == 0 and stride == 2:
                thw = _half(thw)
            n.conv(hidden, hidden, 3, thw, groups=hidden)
            n.conv(hidden, out, 1, thw)
            n.depth += 2
            c = out
    last = int(1280 * width) if width > 1 else 1280
    n.conv(c, last, 1, thw)
    n.depth += 1
    n.fc(last)
    return n


def _shufflenetv2_3d(channels: tuple[int, int, int, int]) -> _Count:
    # Köpüklü et al. models/shufflenetv2.py: conv1 3x3x3 /1x2x2, max pool /2, stages of 4, 8, 4 units
    n = _Count()
    thw = (16, 56, 56)
    n.conv(3, 24, 3, thw)
    n.depth += 1
    thw, c = _half(thw), 24
    for out, repeats in zip(channels[:3], (4, 8, 4)):
        half = out // 2
        for i in range(repeats):
            if i == 0:
                before, thw = thw, _half(thw)
                n.conv(c, c, 3, thw, groups=c)  # branch 1: depthwise /2, then 1x1
                n.conv(c, half, 1, thw)
                n.conv(c, half, 1, before)  # branch 2: 1x1, depthwise /2, 1x1
            else:
                n.conv(half, half, 1, thw)
            n.conv(half, half, 3, thw, groups=half)
            n.conv(half, half, 1, thw)
            n.depth += 3
            c = out
    n.conv(c, channels[3], 1, thw)
    n.depth += 1
    n.fc(channels[3])
    return n


def _squeezenet_3d() -> _Count:
    # Köpüklü et al. models/squeezenet.py, version 1.1: a max pool /2 after conv1, fire3, fire5 and fire7
    fires = [(64, 16, 64), (128, 16, 64), (128, 32, 128), (256, 32, 128), (256, 48, 192), (384, 48, 192),
             (384, 64, 256), (512, 64, 256)]
    n = _Count()
    thw = (16, 56, 56)
    n.conv(3, 64, 3, thw)
    n.depth += 1
    thw = _half(thw)
    for index, (cin, squeeze, expand) in enumerate(fires):
        n.conv(cin, squeeze, 1, thw)
        n.conv(squeeze, expand, 1, thw)
        n.conv(squeeze, expand, 3, thw)
        n.depth += 2
        if index in (1, 3, 5):
            thw = _half(thw)
    n.conv(512, 600, 1, thw)  # the classifier is a 1x1 conv to the classes, then the average
    n.depth += 1
    return n


VIDEO_COUNTS: dict[str, _Count] = {
    "squeezenet_3d": _squeezenet_3d(),
    **{f"shufflenetv2_3d_x{w:g}": _shufflenetv2_3d(c) for w, c in {
        0.25: (32, 64, 128, 1024), 0.5: (48, 96, 192, 1024), 1.0: (116, 232, 464, 1024),
        1.5: (176, 352, 704, 1024), 2.0: (224, 488, 976, 2048)}.items()},
    **{f"mobilenetv2_3d_x{w:g}": _mobilenetv2_3d(w) for w in (0.25, 0.5, 0.75, 1.0, 2.0)},
}


# --- the generated files ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The models as a user gets them: `farm models generate DIR --published` (no MobileNetV2 grid, no zoo)."""
    dest = tmp_path_factory.mktemp("published")
    run = subprocess.run([sys.executable, "-m", "farm.cli.main", "models", "generate", str(dest), "--published",
                          "--no-zoo", "--formats", "onnx", "--widths", "1.0", "--sizes", "224", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    written = {entry["name"]: entry for entry in json.loads(run.stdout)}
    assert set(written) == {m.name for m in JETSON_EXPERIMENT_MODELS}
    # MobileNetV2 1.0x at 224 comes from the MobileNetV2 grid (--widths 1.0 --sizes 224), so it is labelled as its family
    assert {name for name, e in written.items() if e["family"] == IMAGE_FAMILY} == set(IMAGE_FIGURES) - {
        "mobilenetv2_w1.0_r224"}
    assert {name for name, e in written.items() if e["family"] == VIDEO_FAMILY} == set(VIDEO_COUNTS)
    return {name: Path(entry["path"]) for name, entry in written.items()}


def _depth(model: onnx.ModelProto) -> int:
    """Conv and Gemm nodes on the longest path from the input to the output."""
    made_by: dict[str, onnx.NodeProto] = {out: node for node in model.graph.node for out in node.output}
    memo: dict[str, int] = {}

    def depth(tensor: str) -> int:
        if tensor not in made_by:
            return 0
        if tensor not in memo:
            node = made_by[tensor]
            memo[tensor] = max((depth(i) for i in node.input), default=0) + (node.op_type in ("Conv", "Gemm"))
        return memo[tensor]

    return depth(model.graph.output[0].name)


def test_the_experiment_has_its_five_image_and_eleven_video_models() -> None:
    assert [m.name for m in JETSON_EXPERIMENT_MODELS if m.family == IMAGE_FAMILY] == list(IMAGE_FIGURES)
    assert len([m for m in JETSON_EXPERIMENT_MODELS if m.family == VIDEO_FAMILY]) == 11


@pytest.mark.parametrize("name", list(IMAGE_FIGURES))
def test_image_models_match_their_published_parameters_macs_and_depth(published, name: str, farm) -> None:
    params, macs, tolerance, depth = IMAGE_FIGURES[name]
    report = farm("inspect", str(published[name]), "--json").json()
    assert report["param_count"] == pytest.approx(params, rel=0.01)
    assert report["macs"] == pytest.approx(macs, rel=tolerance)
    size = 299 if name == "inception_v3" else 224
    assert report["inputs"][0]["shape"] == ["batch", 3, size, size]
    assert report["outputs"][0]["shape"] == ["batch", 1000]
    if depth is not None:
        assert _depth(onnx.load(published[name], load_external_data=False)) == depth


@pytest.mark.parametrize("name", list(VIDEO_COUNTS))
def test_video_models_match_the_published_layer_tables(published, name: str, farm) -> None:
    expected = VIDEO_COUNTS[name]
    report = farm("inspect", str(published[name]), "--json").json()
    assert report["inputs"][0]["shape"] == ["batch", 3, 16, 112, 112]  # 16-frame RGB clips
    assert report["outputs"][0]["shape"] == ["batch", 600]
    assert report["param_count"] == pytest.approx(expected.params, rel=0.001)
    assert report["macs"] == pytest.approx(expected.macs, rel=0.001)
    model = onnx.load(published[name], load_external_data=False)
    assert _depth(model) == expected.depth
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert convs and all(len(a.ints) == 3 for n in convs for a in n.attribute if a.name == "kernel_shape")


@pytest.mark.parametrize("name", [m.name for m in JETSON_EXPERIMENT_MODELS])
def test_every_model_runs_in_onnx_runtime(published, name: str) -> None:
    session = ort.InferenceSession(str(published[name]), providers=["CPUExecutionProvider"])
    first = session.get_inputs()[0]
    clip = np.random.default_rng(0).random([2, *first.shape[1:]], dtype=np.float32)  # batch 2: the batch is free
    (scores,) = session.run(None, {first.name: clip})
    assert scores.shape == (2, 600 if len(first.shape) == 5 else 1000) and np.isfinite(scores).all()


def test_a_second_generate_rewrites_nothing(published, tmp_path: Path, farm) -> None:
    dest = published["resnet18"].parent
    run = farm("models", "generate", str(dest), "--published", "--no-zoo", "--formats", "onnx", "--widths", "1.0",
               "--sizes", "224")
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("(unchanged)") == len(JETSON_EXPERIMENT_MODELS), run.stderr


def test_video_models_run_in_the_sim_with_the_built_in_benchmark(published, tmp_path: Path, farm) -> None:
    """The sim's ONNX Runtime benchmark fills a 5-D clip input like an image one: batch from the matrix, the rest
    from the model (16 frames of 112x112)."""
    job = tmp_path / "video.yaml"
    job.write_text(f"""
name: video-sim
models:
  - {{path: {published['shufflenetv2_3d_x0.25']}, family: video}}
  - {{path: {published['mobilenetv2_3d_x0.25']}, family: video}}
workload: {{type: benchmark, iterations: 3, warmup: 1}}
matrix: {{threads: [1], batch_sizes: [1, 2]}}
targets: [sim]
sim: {{cpus: 1, memory: 2g}}
""")
    run = farm("submit", str(job), "--json")
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    records = run.json()["results"]
    assert len(records) == 4 and all(r["status"] == "completed" for r in records), [r["message"] for r in records]
    assert all(r["model"]["family"] == "video" and r["latency_ms"]["count"] == 3 for r in records)
    # the clip's other dimensions are fixed in the model: a run that asked for others would have been refused
    assert sorted(r["batch_size"] for r in records) == [1, 1, 2, 2]
    assert all(r["samples_per_s"] == pytest.approx(r["throughput_per_s"] * r["batch_size"], rel=0.01) for r in records)


def test_a_missing_published_model_says_which_command_writes_it(tmp_path: Path) -> None:
    example = (Path(__file__).resolve().parent.parent / "examples" / "jetson-experiment.yaml").read_text()
    (tmp_path / "jetson-experiment").mkdir()
    (tmp_path / "jetson-experiment" / "infer.py").write_text("")
    # its sim twins only (no Nano here), before `make models`
    (tmp_path / "jetson-experiment.yaml").write_text(example.replace("targets: [type:jetson-nano]", "targets: [sim]"))
    with pytest.raises(JobFileError) as e:
        load_job(tmp_path / "jetson-experiment.yaml")
    message = str(e.value)
    for name in ("resnet18.onnx", "shufflenetv2_3d_x0.25.onnx", "mobilenetv2_3d_x2.onnx"):
        assert f"{name}' does not exist" in message
    assert f"farm models generate {tmp_path / 'models'} --published" in message


def test_a_width_the_papers_do_not_define_is_refused() -> None:
    with pytest.raises(ValueError, match="ShuffleNetV2 has no width 0.3; published: "):
        shufflenetv2(0.3, video=True)
    with pytest.raises(ValueError, match="width multiplier must be positive"):
        mobilenetv2_3d(0.0)
