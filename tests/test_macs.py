"""farm.models.macs: MAC estimates against published figures, hand counts, and inspect_model's use of them.

References: MobileNetV2 width 1.0 / 0.35 at 224 -> 300M / 59M multiply-adds (Sandler et al. 2018,
Table 6 and the width/resolution table of the paper's repository). ResNet-50 -> 4.09 and
SqueezeNet 1.1 -> 0.35 (SqueezeNet 1.0: 0.82) "GFLOPS" on torchvision's model pages, which count
one multiply-add as one operation. The zoo's squeezenet starts with a 3x3/2 conv to 64 channels,
i.e. version 1.1, so the accepted band 0.35-0.85 G spans both versions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from ai_edge_litert import schema_py_generated as schema
from onnx import TensorProto, helper

from farm.models.facts import ModelError, inspect_model
from farm.model_generators.generate import mobilenetv2_bytes, write_tiny_tflite
from farm.models.tflite_writer import TFLiteGraphBuilder
from farm.models.macs import estimate_macs, model_layers
from farm.model_generators.zoo import zoo_models
from model_fixtures import write_corrupt_onnx, write_corrupt_tflite

MOBILENETV2_1_0_R224_MACS = 300e6
MOBILENETV2_0_35_R224_MACS = 59e6
RESNET50_MACS = 4.1e9
SQUEEZENET_MACS_RANGE = (0.35e9 * 0.95, 0.85e9)  # v1.1 (0.35G) with a little slack .. v1.0 (0.82G)

# (width, input size) variants written once per module: enough for size, width and format checks.
VARIANTS: tuple[tuple[float, int], ...] = ((1.0, 224), (0.35, 224), (1.0, 128), (0.5, 224))


@pytest.fixture(scope="module")
def mobilenets(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[float, int, str], Path]:
    dest = tmp_path_factory.mktemp("mobilenets")
    paths: dict[tuple[float, int, str], Path] = {}
    for width, size in VARIANTS:
        for fmt in ("tflite", "onnx"):
            path = dest / f"mbv2_{width}_{size}.{fmt}"
            path.write_bytes(mobilenetv2_bytes(fmt, width, size))
            paths[(width, size, fmt)] = path
    return paths


def within(value: int | None, reference: float, tolerance: float) -> bool:
    return value is not None and abs(value - reference) <= tolerance * reference


# --- published figures -----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["tflite", "onnx"])
def test_mobilenetv2_matches_the_papers_multiply_adds(
    mobilenets: dict[tuple[float, int, str], Path], fmt: str
) -> None:
    full = estimate_macs(mobilenets[(1.0, 224, fmt)])
    slim = estimate_macs(mobilenets[(0.35, 224, fmt)])
    assert within(full, MOBILENETV2_1_0_R224_MACS, 0.10), full
    assert within(slim, MOBILENETV2_0_35_R224_MACS, 0.15), slim


def test_tflite_and_onnx_twins_agree(mobilenets: dict[tuple[float, int, str], Path]) -> None:
    for width, size in VARIANTS:
        tflite = estimate_macs(mobilenets[(width, size, "tflite")])
        onnx_count = estimate_macs(mobilenets[(width, size, "onnx")])
        assert tflite is not None and onnx_count is not None
        assert abs(tflite - onnx_count) <= 0.01 * onnx_count, (width, size, tflite, onnx_count)


def test_macs_grow_with_width_and_input_size(mobilenets: dict[tuple[float, int, str], Path]) -> None:
    for fmt in ("tflite", "onnx"):
        by_width = [estimate_macs(mobilenets[(width, 224, fmt)]) or 0 for width in (0.35, 0.5, 1.0)]
        assert by_width == sorted(by_width) and len(set(by_width)) == 3, by_width
        small, large = (estimate_macs(mobilenets[(1.0, size, fmt)]) or 0 for size in (128, 224))
        # Convolutions scale with the pixel count; only the classifier does not.
        assert 0 < small < large and large / small == pytest.approx((224 / 128) ** 2, rel=0.05)


@pytest.fixture(scope="module")
def zoo() -> dict[str, Path]:
    models = zoo_models()
    if not {"resnet50", "squeezenet"} <= models.keys():
        pytest.skip("this onnx package ships no light model zoo")
    return models


def test_zoo_resnet50_and_squeezenet(zoo: dict[str, Path]) -> None:
    resnet = estimate_macs(zoo["resnet50"])
    assert within(resnet, RESNET50_MACS, 0.10), resnet
    squeezenet = estimate_macs(zoo["squeezenet"])
    assert squeezenet is not None and SQUEEZENET_MACS_RANGE[0] <= squeezenet <= SQUEEZENET_MACS_RANGE[1], squeezenet


def test_zoo_weights_built_by_constant_of_shape_resolve_in_every_model(zoo: dict[str, Path]) -> None:
    # Every light model holds its Conv/Gemm weights as ConstantOfShape outputs: none may come back unknown.
    for name, path in zoo.items():
        macs = estimate_macs(path)
        assert macs is not None and macs > 1e8, (name, macs)


# --- hand counts of small graphs -------------------------------------------------------------


def test_tiny_tflite_conv_by_hand(tmp_path: Path) -> None:
    path = write_tiny_tflite(tmp_path / "tiny.tflite")
    assert estimate_macs(path) == 8 * 8 * 4 * (3 * 3 * 3)  # output H*W*C x kernel H*W*in C


def test_tflite_transpose_conv_and_batch_matmul_by_hand(tmp_path: Path) -> None:
    graph = TFLiteGraphBuilder()
    image = graph.activation("image", [1, 4, 4, 8])
    output_shape = graph.constant("output_shape", np.array([1, 8, 8, 16], dtype=np.int32))
    weight = graph.constant("weight", np.zeros((16, 3, 3, 8), dtype=np.float32))  # OHWI
    upsampled = graph.activation("upsampled", [1, 8, 8, 16])
    options = schema.TransposeConvOptionsT()
    options.padding = schema.Padding.SAME
    options.strideH = options.strideW = 2
    graph.operator(
        schema.BuiltinOperator.TRANSPOSE_CONV,
        [output_shape, weight, image],
        [upsampled],
        schema.BuiltinOptions.TransposeConvOptions,
        options,
    )
    lhs = graph.activation("lhs", [1, 2, 5, 7])  # (batch, heads, M, K)
    rhs = graph.activation("rhs", [1, 2, 7, 3])
    product = graph.activation("product", [1, 2, 5, 3])
    graph.operator(
        schema.BuiltinOperator.BATCH_MATMUL,
        [lhs, rhs],
        [product],
        schema.BuiltinOptions.BatchMatMulOptions,
        schema.BatchMatMulOptionsT(),
    )
    path = tmp_path / "ops.tflite"
    path.write_bytes(graph.to_bytes([image, lhs, rhs], [upsampled, product], "hand-count fixture"))
    transpose_conv = (4 * 4 * 8) * (16 * 3 * 3)  # every input element through kH*kW*out channels
    batch_matmul = 2 * 5 * 3 * 7
    assert estimate_macs(path) == transpose_conv + batch_matmul


def _save(model: onnx.ModelProto, path: Path) -> Path:
    path.write_bytes(model.SerializeToString())
    return path


def test_onnx_grouped_conv_transpose_gemm_and_matmul_by_hand(tmp_path: Path) -> None:
    def weight(name: str, shape: list[int]) -> TensorProto:
        return helper.make_tensor(name, TensorProto.FLOAT, shape, np.zeros(shape, dtype=np.float32).ravel().tolist())

    nodes = [
        helper.make_node("Conv", ["x", "w_grouped"], ["grouped"], group=4, kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("ConvTranspose", ["grouped", "w_up"], ["up"], strides=[2, 2], kernel_shape=[2, 2]),
        helper.make_node("GlobalAveragePool", ["up"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"]),
        helper.make_node("Gemm", ["flat", "w_fc"], ["fc"], transB=1),
        helper.make_node("MatMul", ["fc", "w_mm"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "hand_count",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            weight("w_grouped", [16, 2, 3, 3]),  # 8 in channels / 4 groups
            weight("w_up", [16, 4, 2, 2]),
            weight("w_fc", [10, 4]),
            weight("w_mm", [10, 5]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    grouped = (16 * 6 * 6) * (2 * 3 * 3)
    conv_transpose = (16 * 6 * 6) * (4 * 2 * 2)
    gemm = 10 * 4
    matmul = 5 * 10
    assert estimate_macs(_save(model, tmp_path / "ops.onnx")) == grouped + conv_transpose + gemm + matmul


def test_onnx_conv3d_plain_grouped_and_depthwise_by_hand(tmp_path: Path) -> None:
    """Video models' 3-D convolutions: kT*kH*kW*(C/groups) MACs per output element, strides in time too."""
    def weight(name: str, shape: list[int]) -> TensorProto:
        return helper.make_tensor(name, TensorProto.FLOAT, shape, np.zeros(shape, dtype=np.float32).ravel().tolist())

    nodes = [  # (1, 3, 8, 16, 16) -> stem 3x3x3 /1x2x2 -> (1, 8, 8, 8, 8)
        helper.make_node("Conv", ["x", "w_stem"], ["stem"], kernel_shape=[3, 3, 3], strides=[1, 2, 2],
                         pads=[1, 1, 1, 1, 1, 1]),
        # grouped 3x1x1 in time only, 2 groups: (1, 12, 8, 8, 8)
        helper.make_node("Conv", ["stem", "w_grouped"], ["grouped"], group=2, kernel_shape=[3, 1, 1],
                         pads=[1, 0, 0, 1, 0, 0]),
        # depthwise 3x3x3 /2: (1, 12, 4, 4, 4)
        helper.make_node("Conv", ["grouped", "w_dw"], ["y"], group=12, kernel_shape=[3, 3, 3], strides=[2, 2, 2],
                         pads=[1, 1, 1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes, "conv3d_hand_count",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [weight("w_stem", [8, 3, 3, 3, 3]), weight("w_grouped", [12, 4, 3, 1, 1]), weight("w_dw", [12, 1, 3, 3, 3])],
    )
    path = _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
                 tmp_path / "conv3d.onnx")
    stem = (8 * 8 * 8 * 8) * (3 * 27)
    grouped = (12 * 8 * 8 * 8) * (4 * 3)
    depthwise = (12 * 4 * 4 * 4) * 27
    assert estimate_macs(path) == stem + grouped + depthwise
    layers = model_layers(path)
    assert [(layer.kind, layer.macs, layer.params) for layer in layers] == [
        ("conv", stem, 8 * 3 * 27), ("conv", grouped, 12 * 4 * 3), ("depthwise", depthwise, 12 * 27)]
    assert [layer.output_shape for layer in layers] == [[1, 8, 8, 8, 8], [1, 12, 8, 8, 8], [1, 12, 4, 4, 4]]


def test_dynamic_batch_counts_one_sample(tmp_path: Path, mobilenets: dict[tuple[float, int, str], Path]) -> None:
    for fmt in ("tflite", "onnx"):
        dynamic = tmp_path / f"dynamic.{fmt}"
        dynamic.write_bytes(mobilenetv2_bytes(fmt, 1.0, 128, dynamic_batch=True))
        assert estimate_macs(dynamic) == estimate_macs(mobilenets[(1.0, 128, fmt)])


def test_dynamic_spatial_size_is_unknown_not_a_guess(tmp_path: Path) -> None:
    conv = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3])
    graph = helper.make_graph(
        [conv],
        "dynamic_spatial",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "height", "width"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [helper.make_tensor("w", TensorProto.FLOAT, [4, 3, 3, 3], [0.0] * 108)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = _save(model, tmp_path / "dynamic_spatial.onnx")
    assert estimate_macs(path) is None
    assert inspect_model(path).macs is None


def test_tflite_dynamic_spatial_size_is_unknown(tmp_path: Path) -> None:
    graph = TFLiteGraphBuilder()
    image = graph.activation("image", [1, 8, 8, 3])
    graph.tensors[image].shapeSignature = [-1, -1, -1, 3]  # as converters mark a free image size
    weight = graph.constant("weight", np.zeros((4, 3, 3, 3), dtype=np.float32))
    features = graph.activation("features", [1, 8, 8, 4])
    graph.tensors[features].shapeSignature = [-1, -1, -1, 4]
    options = schema.Conv2DOptionsT()
    options.padding = schema.Padding.SAME
    options.strideH = options.strideW = 1
    graph.operator(
        schema.BuiltinOperator.CONV_2D, [image, weight, -1], [features], schema.BuiltinOptions.Conv2DOptions, options
    )
    path = tmp_path / "dynamic_spatial.tflite"
    path.write_bytes(graph.to_bytes([image], [features], "free image size"))
    assert estimate_macs(path) is None
    assert inspect_model(path).macs is None


def test_other_formats_have_no_estimate(tmp_path: Path) -> None:
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\x00" * 64)
    assert estimate_macs(other) is None
    assert inspect_model(other).macs is None


# --- inspect_model ---------------------------------------------------------------------------


def test_inspect_model_fills_macs(mobilenets: dict[tuple[float, int, str], Path]) -> None:
    for fmt in ("tflite", "onnx"):
        path = mobilenets[(1.0, 224, fmt)]
        facts = inspect_model(path)
        assert facts.macs is not None and facts.macs == estimate_macs(path)


def test_corrupt_files_still_raise_model_error(tmp_path: Path) -> None:
    for path in (write_corrupt_tflite(tmp_path / "corrupt.tflite"), write_corrupt_onnx(tmp_path / "corrupt.onnx")):
        with pytest.raises(ModelError, match="not a valid"):
            inspect_model(path)
        with pytest.raises(ModelError, match="not a valid"):
            estimate_macs(path)


def test_an_estimator_failure_leaves_macs_none(
    mobilenets: dict[tuple[float, int, str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from farm.models import macs

    def broken(_model: object) -> int:
        raise RuntimeError("estimator bug")

    monkeypatch.setattr(macs, "onnx_mac_profile", broken)
    monkeypatch.setattr(macs, "tflite_mac_profile", broken)
    for fmt in ("tflite", "onnx"):
        facts = inspect_model(mobilenets[(0.35, 224, fmt)])
        assert facts.macs is None
        assert facts.param_count is not None  # everything else is still there


# --- where the MACs are: the op mix a calibration uses as features ----------------------------


def test_mac_shares_split_mobilenetv2_the_same_way_in_both_formats(
    mobilenets: dict[tuple[float, int, str], Path],
) -> None:
    facts = {fmt: inspect_model(mobilenets[(1.0, 224, fmt)]) for fmt in ("tflite", "onnx")}
    for fmt, f in facts.items():
        shares = [f.conv_macs_share, f.depthwise_macs_share, f.fc_macs_share, f.other_macs_share]
        assert sum(shares) == pytest.approx(1.0), fmt
        # MobileNetV2 is mostly 1x1 convs; its 3x3 depthwise layers do a few percent, the classifier less.
        assert f.conv_macs_share > 0.8 and 0.01 < f.depthwise_macs_share < 0.15 and 0 < f.fc_macs_share < 0.01, shares
        assert f.other_macs_share == 0.0
    assert facts["tflite"].depthwise_macs_share == pytest.approx(facts["onnx"].depthwise_macs_share, rel=0.02)
    # inputs, outputs and every intermediate at float32: larger than the input and output alone
    for f in facts.values():
        assert f.activation_bytes is not None and f.activation_bytes > (224 * 224 * 3 + 1000) * 4
    # the ONNX twin keeps separate normalisation/activation nodes (each writes a tensor) where TFLite fuses them
    assert facts["onnx"].activation_bytes > facts["tflite"].activation_bytes


def test_tiny_conv_profile_by_hand(tmp_path: Path) -> None:
    from farm.model_generators.generate import write_tiny_onnx

    # TFLite: one CONV_2D, float32 input and output only; ONNX: Conv then Relu, one tensor more
    for path, tensors in ((write_tiny_tflite(tmp_path / "tiny.tflite"), [8 * 8 * 3, 8 * 8 * 4]),
                          (write_tiny_onnx(tmp_path / "tiny.onnx"), [8 * 8 * 3, 8 * 8 * 4, 8 * 8 * 4])):
        facts = inspect_model(path)
        assert facts.conv_macs_share == 1.0 and facts.depthwise_macs_share == 0.0
        assert facts.activation_bytes == 4 * sum(tensors)


# --- finer conv shares (issue 31): 1×1, 3×3 and grouped convs, the same in both formats -------------------


def _share_fixture_macs() -> dict[str, int]:
    """The hand counts of the fixture below: 8×8 maps, 8 → 16 channels by 3×3, 16 → 16 by 1×1 (twice as
    a grouped 3×3 with 4 groups in between), a 3×3 depthwise, a 5×5 plain conv and a 16 → 10 classifier."""
    hw = 8 * 8
    return {"conv3x3": hw * 16 * (8 * 9), "conv1x1": hw * 16 * 16, "grouped": hw * 16 * (4 * 9),
            "depthwise": hw * 16 * 9, "conv5x5": hw * 16 * (16 * 25), "fc": 16 * 10}


def _share_fixture_onnx(path: Path) -> Path:
    def weight(name: str, shape: list[int]) -> TensorProto:
        return helper.make_tensor(name, TensorProto.FLOAT, shape, np.zeros(shape, dtype=np.float32).ravel().tolist())

    nodes = [
        helper.make_node("Conv", ["x", "w3"], ["a"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["a", "w1"], ["b"], kernel_shape=[1, 1]),
        helper.make_node("Conv", ["b", "wg"], ["c"], group=4, kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c", "wd"], ["d"], group=16, kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["d", "w5"], ["e"], kernel_shape=[5, 5], pads=[2, 2, 2, 2]),
        helper.make_node("GlobalAveragePool", ["e"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "wfc"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes, "shares", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [weight("w3", [16, 8, 3, 3]), weight("w1", [16, 16, 1, 1]), weight("wg", [16, 4, 3, 3]),
         weight("wd", [16, 1, 3, 3]), weight("w5", [16, 16, 5, 5]), weight("wfc", [10, 16])])
    return _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)


def _share_fixture_tflite(path: Path) -> Path:
    graph = TFLiteGraphBuilder()
    x = graph.activation("x", [1, 8, 8, 8])

    def conv(name: str, source: int, weight_shape: tuple[int, ...], depthwise: bool = False) -> int:
        out = graph.activation(name, [1, 8, 8, 16])
        weight = graph.constant(f"{name}_w", np.zeros(weight_shape, dtype=np.float32))
        bias = graph.constant(f"{name}_b", np.zeros(16, dtype=np.float32))
        if depthwise:
            options = schema.DepthwiseConv2DOptionsT()
            options.depthMultiplier = 1
            op, kind = schema.BuiltinOperator.DEPTHWISE_CONV_2D, schema.BuiltinOptions.DepthwiseConv2DOptions
        else:
            options = schema.Conv2DOptionsT()
            op, kind = schema.BuiltinOperator.CONV_2D, schema.BuiltinOptions.Conv2DOptions
        options.padding = schema.Padding.SAME
        options.strideH = options.strideW = 1
        graph.operator(op, [source, weight, bias], [out], kind, options)
        return out

    a = conv("a", x, (16, 3, 3, 8))  # OHWI
    b = conv("b", a, (16, 1, 1, 16))
    c = conv("c", b, (16, 3, 3, 4))  # I = 16 input channels / 4 groups
    d = conv("d", c, (1, 3, 3, 16), depthwise=True)
    e = conv("e", d, (16, 5, 5, 16))
    pooled = graph.activation("pooled", [1, 16])
    graph.operator(schema.BuiltinOperator.RESHAPE, [e], [pooled], schema.BuiltinOptions.ReshapeOptions,
                   schema.ReshapeOptionsT())  # not counted: stands in for the pool (its MACs count as 0 anyway)
    y = graph.activation("y", [1, 10])
    fc_w = graph.constant("fc_w", np.zeros((10, 16), dtype=np.float32))
    graph.operator(schema.BuiltinOperator.FULLY_CONNECTED, [pooled, fc_w], [y],
                   schema.BuiltinOptions.FullyConnectedOptions, schema.FullyConnectedOptionsT())
    path.write_bytes(graph.to_bytes([x], [y], "conv shares fixture"))
    return path


@pytest.mark.parametrize("fmt", ["onnx", "tflite"])
def test_conv_shares_by_hand(tmp_path: Path, fmt: str) -> None:
    path = (_share_fixture_onnx if fmt == "onnx" else _share_fixture_tflite)(tmp_path / f"shares.{fmt}")
    macs = _share_fixture_macs()
    total = sum(macs.values())
    facts = inspect_model(path)
    assert facts.macs == total
    assert facts.conv1x1_macs_share == pytest.approx(macs["conv1x1"] / total)
    assert facts.conv3x3_macs_share == pytest.approx(macs["conv3x3"] / total)
    assert facts.grouped_macs_share == pytest.approx(macs["grouped"] / total)
    assert facts.depthwise_macs_share == pytest.approx(macs["depthwise"] / total)
    assert facts.fc_macs_share == pytest.approx(macs["fc"] / total)
    # the parts of the conv share: the 5×5 conv is in none of them
    conv = macs["conv3x3"] + macs["conv1x1"] + macs["grouped"] + macs["conv5x5"]
    assert facts.conv_macs_share == pytest.approx(conv / total)
    parts = facts.conv1x1_macs_share + facts.conv3x3_macs_share + facts.grouped_macs_share
    assert facts.conv_macs_share - parts == pytest.approx(macs["conv5x5"] / total)


def test_mobilenetv2_is_mostly_1x1_in_both_formats(mobilenets: dict[tuple[float, int, str], Path]) -> None:
    facts = {fmt: inspect_model(mobilenets[(1.0, 224, fmt)]) for fmt in ("tflite", "onnx")}
    for fmt, f in facts.items():
        # every plain conv but the 3×3 stem is 1×1; no grouped convs
        assert f.grouped_macs_share == 0.0, fmt
        assert 0.0 < f.conv3x3_macs_share < 0.05, fmt
        assert f.conv1x1_macs_share + f.conv3x3_macs_share == pytest.approx(f.conv_macs_share), fmt
    assert facts["tflite"].conv1x1_macs_share == pytest.approx(facts["onnx"].conv1x1_macs_share, rel=0.02)
