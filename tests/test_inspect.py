"""`farm inspect MODEL`: the figures a user checks a model by, against published architectures.

- MobileNetV2 1.0 at 224x224: 300M multiply-adds and 3.4M parameters (Sandler et al., "MobileNetV2:
  Inverted Residuals and Linear Bottlenecks", CVPR 2018, Table 4). farm's generator builds it with
  batch norm folded into the convolutions' biases, as a deployed model is.
- ResNet-50 from the ONNX model zoo (shipped in the onnx package's backend test data): 4.09 G
  multiply-adds ("GFLOPS 4.09" in torchvision's model table, which counts MACs) and 25,557,032
  parameters (torchvision's resnet50); the zoo's Caffe2 export also keeps batch norm's running mean
  and variance (2 x 26,560 more elements).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from farm.model_generators.generate import mobilenetv2_bytes
from farm.model_generators.zoo import zoo_models


@pytest.fixture(scope="module")
def mobilenetv2_224(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("mobilenetv2_224")
    paths = {}
    for fmt in ("tflite", "onnx"):
        paths[fmt] = d / f"mobilenetv2_w1.0_r224.{fmt}"
        paths[fmt].write_bytes(mobilenetv2_bytes(fmt, 1.0, 224))
    return paths


@pytest.mark.parametrize("fmt", ["tflite", "onnx"])
def test_mobilenetv2_matches_its_published_macs_and_parameters(mobilenetv2_224, fmt: str, farm) -> None:
    run = farm("inspect", str(mobilenetv2_224[fmt]), "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["macs"] == pytest.approx(300e6, rel=0.01)
    assert report["flops"] == 2 * report["macs"]
    assert report["param_count"] == pytest.approx(3.4e6, rel=0.03)
    assert report["size_bytes"] == mobilenetv2_224[fmt].stat().st_size and len(report["sha256"]) == 64
    layers = report["layers"]
    # the per-layer table adds up to the model: every MAC and every weight sits in exactly one layer
    assert sum(layer["macs"] for layer in layers) == report["macs"]
    assert sum(layer["params"] for layer in layers) == report["param_count"]
    convs = [layer for layer in layers if layer["kind"] in ("conv", "depthwise")]
    assert len(convs) == 52  # stem, 17 blocks (16 with an expansion: 3 convs, the first: 2), head 1x1
    first = layers[0]
    assert first["macs"] == 112 * 112 * 32 * 3 * 3 * 3 and first["params"] == 32 * 3 * 3 * 3 + 32
    spatial = first["output_shape"][1:3] if fmt == "tflite" else first["output_shape"][2:4]
    assert spatial == [112, 112]
    assert layers[-1]["op"] in ("FULLY_CONNECTED", "Gemm") and layers[-1]["macs"] == 1280 * 1000
    shape = report["inputs"][0]["shape"]
    assert shape == ([1, 224, 224, 3] if fmt == "tflite" else [1, 3, 224, 224])
    ops = report["op_types"]
    assert (ops["CONV_2D"] + ops["DEPTHWISE_CONV_2D"] if fmt == "tflite" else ops["Conv"]) == 52
    # the per-layer shares a calibration uses (issue 31): the 3×3 stem and the rest 1×1, no grouped convs
    conv_shares = report["conv_shares"]
    stem_share = first["macs"] / report["macs"]
    assert conv_shares["3x3"] == pytest.approx(stem_share) and conv_shares["grouped"] == 0.0
    assert conv_shares["1x1"] + conv_shares["3x3"] == pytest.approx(report["mac_shares"]["conv"])
    assert report["layer_count"] == len(layers)


def test_resnet50_from_the_onnx_model_zoo_matches_its_published_figures(farm) -> None:
    zoo = zoo_models()
    if "resnet50" not in zoo:
        pytest.skip("this onnx package ships no model zoo")
    report = json.loads(farm("inspect", str(zoo["resnet50"]), "--json").stdout)
    assert report["macs"] == pytest.approx(4.09e9, rel=0.01)
    assert report["param_count"] == pytest.approx(25_557_032 + 2 * 26_560, rel=0.001)
    assert report["op_types"]["Conv"] == 53 and report["op_types"]["Gemm"] == 1
    # the zoo's weights are rebuilt by ConstantOfShape at load time: they are weights, not layers
    assert "ConstantOfShape" not in {layer["op"] for layer in report["layers"]}
    assert sum(layer["macs"] for layer in report["layers"]) == report["macs"]
    assert report["layers"][-1]["output_shape"] == [1, 1000]


def test_the_table_names_layers_and_says_what_is_left_out(mobilenetv2_224, farm) -> None:
    run = farm("inspect", str(mobilenetv2_224["tflite"]))
    assert run.returncode == 0, run.stderr
    assert "MACs 301 M" in run.stdout and "parameters 3.49 M" in run.stdout
    assert "block17_project" in run.stdout or "layers (40 of" in run.stdout
    assert "--all-layers" in run.stdout
    every = farm("inspect", str(mobilenetv2_224["tflite"]), "--all-layers").stdout
    assert "logits" in every and "--all-layers shows" not in every


def test_a_missing_or_foreign_file_is_bad_input(tmp_path: Path, farm) -> None:
    missing = farm("inspect", str(tmp_path / "nope.onnx"), "--json")
    assert missing.returncode == 2 and "does not exist" in json.loads(missing.stdout)["error"]
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    other = farm("inspect", str(text))
    assert other.returncode == 2 and ".tflite and .onnx" in other.stderr
    broken = tmp_path / "broken.tflite"
    broken.write_bytes(b"\x00" * 64)
    assert farm("inspect", str(broken)).returncode == 2


def test_the_classics_built_as_tflite_match_the_zoos_onnx_originals(tmp_path: Path, farm) -> None:
    """SqueezeNet 1.1 and GoogLeNet, built by farm for phones, against the onnx package's zoo copies
    (an independent export of the same architectures): the same weights count and the same MACs for
    SqueezeNet (its maps are the original's); GoogLeNet within the paper's "1.5 billion multiply-adds"."""
    run = farm("models", "generate", str(tmp_path / "m"), "--widths", "0.25", "--sizes", "96", "--json")
    assert run.returncode == 0, run.stderr
    generated = {m["name"]: m for m in json.loads(run.stdout) if m["format"] == "tflite"}
    assert generated["squeezenet1_1"]["family"] == generated["inception_v1"]["family"] == "zoo"
    squeeze = json.loads(farm("inspect", generated["squeezenet1_1"]["path"], "--json").stdout)
    inception = json.loads(farm("inspect", generated["inception_v1"]["path"], "--json").stdout)
    assert squeeze["param_count"] == 1_235_496 + 2  # torchvision's squeezenet1_1, plus the pool's 2 axes
    assert squeeze["macs"] == pytest.approx(0.35e9, rel=0.01)  # torchvision: 0.35 GFLOPS (MACs)
    assert inception["macs"] == pytest.approx(1.5e9, rel=0.06)
    assert inception["op_types"]["CONCATENATION"] == 9 and inception["op_types"]["CONV_2D"] == 57
    zoo = zoo_models()
    if "squeezenet" in zoo and "inception_v1" in zoo:
        zoo_squeeze = json.loads(farm("inspect", str(zoo["squeezenet"]), "--json").stdout)
        zoo_inception = json.loads(farm("inspect", str(zoo["inception_v1"]), "--json").stdout)
        assert squeeze["macs"] == zoo_squeeze["macs"]
        assert abs(inception["param_count"] - zoo_inception["param_count"]) <= 2
