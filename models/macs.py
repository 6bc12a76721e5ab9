"""Multiply-accumulate (MAC) count of one inference, estimated from a model's graph without running it.

Only the operators that dominate compute are counted: convolutions (plain, grouped, depthwise,
transposed, 3-D in TFLite) and matrix products (fully connected, Gemm, MatMul, batch matmul,
and ONNX's quantised forms of these). Element-wise ops, activations, pooling, normalisation,
softmax and data movement count as 0, which is how the usual published figures are counted
(MobileNetV2's "300M multiply-adds", torchvision's per-model GFLOPS).

Shapes are those the model declares, with a dynamic batch taken as 1. Bodies of control-flow
ops (TFLite WHILE/IF subgraphs, ONNX If/Loop/Scan) are not counted: how often they run is
only known at run time. They are not left out in silence: an ONNX control-flow node whose body
holds a counted operator says so in its layer's `note` (and `farm inspect` in its report), so the
total is read as "at least".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from ai_edge_litert import schema_py_generated as tflite_schema

from farm.models.graph import (
    DEFAULT_ONNX_DOMAINS,
    _decode,
    _ints,
    _parse_onnx,
    _parse_tflite,
    _read,
    _tflite_buffer_has_data,
    _tflite_builtin_code,
    _tflite_op_name,
    model_format,
    set_onnx_input_shapes,
)

# A dimension that is unknown (symbolic, or not inferred); any MAC-counted op touching one makes the total unknown.
Shape = list[int | None]

# Where a model's MACs are done: latency per MAC differs by kind (a depthwise MAC is memory-bound,
# a 1x1 conv MAC is not), which is what lets a calibration tell models with equal MACs apart.
MAC_KINDS: tuple[str, ...] = ("conv", "depthwise", "fc", "other")
# Finer splits of the convolution MACs (issue 31): a 1×1 (pointwise) conv, a 3×3 one and a grouped one
# (more than one group, not depthwise) run at different speeds per MAC on the same core. A MAC counts in
# at most one of them; a 5×5 or 7×7 plain conv is in none (it stays in "conv").
CONV_SHAPES: tuple[str, ...] = ("conv1x1", "conv3x3", "grouped")


@dataclass(frozen=True)
class MacProfile:
    """MACs of one inference by kind of operator, and the bytes of every non-constant tensor."""

    by_kind: dict[str, int]
    activation_bytes: int | None  # inputs, outputs and intermediates at the declared shapes; None if unknown
    by_shape: dict[str, int] = field(default_factory=dict)  # MACs of CONV_SHAPES (a part of by_kind's)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def shares(self) -> dict[str, float]:
        """``<kind>_macs_share`` for each kind and conv shape (0 when the model has no MACs at all)."""
        total = self.total
        counts = {**{kind: self.by_kind.get(kind, 0) for kind in MAC_KINDS},
                  **{kind: self.by_shape.get(kind, 0) for kind in CONV_SHAPES}}
        return {f"{kind}_macs_share": (count / total if total else 0.0) for kind, count in counts.items()}

# Initializers up to this many elements stay in the copy given to shape inference: shape, axes and
# index tensors are this small, and inference reads their values; larger ones only need their dims.
SMALL_INITIALIZER_ELEMENTS = 1024


class _UnknownShape(Exception):
    """A shape a MAC-counted operator needs could not be determined."""


def _conv_shape(kernel: Sequence[int], grouped: bool) -> str | None:
    """The CONV_SHAPES entry of a (non-depthwise) convolution with this spatial kernel, if any."""
    if grouped:
        return "grouped"
    if kernel and all(k == 1 for k in kernel):
        return "conv1x1"
    if kernel and all(k == 3 for k in kernel):
        return "conv3x3"
    return None


def estimate_macs(path: Path) -> int | None:
    """MACs of one inference of the .tflite or .onnx model at `path`, at its declared input shape.

    Convolutions and matrix products only; element-wise, activation and pooling ops count as 0.
    None for other formats, and when a counted operator's shapes cannot be determined (for
    example a dynamic dimension other than the batch). Raises facts.ModelError when the file is
    missing or not a valid model, exactly as inspect_model does.
    """
    path = Path(path)
    fmt = model_format(path)
    if fmt == "tflite":
        data = _read(path)
        return tflite_macs(_parse_tflite(path, data))
    if fmt == "onnx":
        data = _read(path)
        return onnx_macs(_parse_onnx(path, data))
    return None


# --- TFLite -----------------------------------------------------------------------------------


def _tflite_shape(tensors: Sequence[tflite_schema.TensorT], index: int) -> list[int]:
    """Concrete dims of a tensor: `shape` holds the converter's example sizes; a negative batch becomes 1."""
    if index < 0:
        raise _UnknownShape("omitted optional tensor")
    dims = _ints(tensors[index].shape)
    if not dims:
        raise _UnknownShape(f"tensor {index} has no shape")
    if dims[0] < 0:
        dims[0] = 1  # dynamic batch: count one sample
    if any(dim < 0 for dim in dims):
        raise _UnknownShape(f"tensor {index} has a dynamic dimension {dims}")
    return dims


def _tflite_conv_2d(operator: tflite_schema.OperatorT, tensors: Sequence[tflite_schema.TensorT]) -> int:
    # Weight is OHWI with I = input channels / groups, so each output element costs kH*kW*I MACs.
    output = _tflite_shape(tensors, operator.outputs[0])
    weight = _tflite_shape(tensors, operator.inputs[1])
    return math.prod(output) * math.prod(weight[1:])


def _tflite_conv_shape(operator: tflite_schema.OperatorT, tensors: Sequence[tflite_schema.TensorT]) -> str | None:
    # Weight OHWI: I below the input's channels means groups (TFLite infers them from the two).
    weight = _tflite_shape(tensors, operator.inputs[1])
    channels = _tflite_shape(tensors, operator.inputs[0])[-1]
    return _conv_shape(weight[1:3], grouped=channels != weight[3])


def _tflite_depthwise_conv_2d(operator: tflite_schema.OperatorT, tensors: Sequence[tflite_schema.TensorT]) -> int:
    # Weight is 1HWC: each output element reads one kH x kW window of one input channel.
    output = _tflite_shape(tensors, operator.outputs[0])
    weight = _tflite_shape(tensors, operator.inputs[1])
    return math.prod(output) * weight[1] * weight[2]


def _tflite_conv_3d(operator: tflite_schema.OperatorT, tensors: Sequence[tflite_schema.TensorT]) -> int:
    # Weight is DHWIO: each output element costs kD*kH*kW*I MACs.
    output = _tflite_shape(tensors, operator.outputs[0])
    weight = _tflite_shape(tensors, operator.inputs[1])
    return math.prod(output) * math.prod(weight[:-1])


def _tflite_transpose_conv(operator: tflite_schema.OperatorT, tensors: Sequence[tflite_schema.TensorT]) -> int:
    # Inputs are (output_shape, weight OHWI, input): every input element is scattered through kH*kW*O weights.
    weight = _tflite_shape(tensors, operator.inputs[1])
    data = _tflite_shape(tensors, operator.inputs[2])
    return math.prod(data) * math.prod(weight[:-1])


def _tflite_fully_connected(operator: tflite_schema.OperatorT, tensors: Sequence[tflite_schema.TensorT]) -> int:
    # Weight is (units, depth); each output element is one dot product of length `depth`.
    output = _tflite_shape(tensors, operator.outputs[0])
    weight = _tflite_shape(tensors, operator.inputs[1])
    return math.prod(output) * weight[-1]


def _tflite_batch_matmul(operator: tflite_schema.OperatorT, tensors: Sequence[tflite_schema.TensorT]) -> int:
    # Output (..., M, N) from lhs (..., M, K), or (..., K, M) when adjX is set.
    output = _tflite_shape(tensors, operator.outputs[0])
    lhs = _tflite_shape(tensors, operator.inputs[0])
    options = operator.builtinOptions
    adjoint_lhs = bool(getattr(options, "adjX", False))
    depth = lhs[-2] if adjoint_lhs and len(lhs) >= 2 else lhs[-1]
    return math.prod(output) * depth


_BuiltinOperator = tflite_schema.BuiltinOperator
_TFLITE_COUNTERS: dict[int, Callable[[tflite_schema.OperatorT, Sequence[tflite_schema.TensorT]], int]] = {
    _BuiltinOperator.CONV_2D: _tflite_conv_2d,
    _BuiltinOperator.DEPTHWISE_CONV_2D: _tflite_depthwise_conv_2d,
    _BuiltinOperator.CONV_3D: _tflite_conv_3d,
    _BuiltinOperator.TRANSPOSE_CONV: _tflite_transpose_conv,
    _BuiltinOperator.FULLY_CONNECTED: _tflite_fully_connected,
    _BuiltinOperator.BATCH_MATMUL: _tflite_batch_matmul,
}


def _has_dynamic_non_batch_input(subgraph: tflite_schema.SubGraphT) -> bool:
    # `shape` then holds placeholder 1s for those dims: counting at them would understate the model.
    tensors = subgraph.tensors or []
    return any(dim < 0 for index in _ints(subgraph.inputs) for dim in _ints(tensors[index].shapeSignature)[1:])


_TFLITE_KINDS: dict[int, str] = {
    _BuiltinOperator.CONV_2D: "conv",
    _BuiltinOperator.DEPTHWISE_CONV_2D: "depthwise",
    _BuiltinOperator.FULLY_CONNECTED: "fc",
    _BuiltinOperator.BATCH_MATMUL: "fc",
}  # CONV_3D and TRANSPOSE_CONV: "other"
_TFLITE_ITEM_BYTES: dict[int, int] = {
    getattr(tflite_schema.TensorType, name): size for name, size in (
        ("FLOAT32", 4), ("FLOAT16", 2), ("FLOAT64", 8), ("INT32", 4), ("UINT32", 4), ("INT64", 8),
        ("UINT64", 8), ("INT16", 2), ("UINT16", 2), ("INT8", 1), ("UINT8", 1), ("BOOL", 1), ("COMPLEX64", 8))
    if hasattr(tflite_schema.TensorType, name)}


def tflite_macs(model: tflite_schema.ModelT) -> int | None:
    """MACs of the main subgraph of a parsed (and facts-validated) TFLite model; None if a shape is unknown."""
    profile = tflite_mac_profile(model)
    return None if profile is None else profile.total


def tflite_mac_profile(model: tflite_schema.ModelT) -> MacProfile | None:
    """MACs by operator kind and activation bytes of the main subgraph; None if a counted shape is unknown."""
    codes = model.operatorCodes or []
    main = model.subgraphs[0]
    tensors = main.tensors or []
    if _has_dynamic_non_batch_input(main):
        return None
    by_kind = dict.fromkeys(MAC_KINDS, 0)
    by_shape = dict.fromkeys(CONV_SHAPES, 0)
    try:
        for operator in main.operators or []:
            code = _tflite_builtin_code(codes[operator.opcodeIndex])
            counter = _TFLITE_COUNTERS.get(code)
            if counter is not None:
                macs = counter(operator, tensors)
                by_kind[_TFLITE_KINDS.get(code, "other")] += macs
                shape = _tflite_conv_shape(operator, tensors) if code == _BuiltinOperator.CONV_2D else None
                if shape is not None:
                    by_shape[shape] += macs
    except (_UnknownShape, IndexError, TypeError):  # IndexError/TypeError: an op with too few inputs or outputs
        return None
    buffers = model.buffers or []
    activation_bytes = 0
    for tensor in tensors:
        buffer = buffers[tensor.buffer] if 0 <= tensor.buffer < len(buffers) else None
        if _tflite_buffer_has_data(buffer):
            continue  # a weight, not an activation
        activation_bytes += math.prod(max(dim, 1) for dim in _ints(tensor.shape)) * _TFLITE_ITEM_BYTES.get(tensor.type, 4)
    return MacProfile(by_kind, activation_bytes, by_shape)


# --- ONNX -------------------------------------------------------------------------------------


def _constant_of_shape_weights(graph: onnx.GraphProto) -> dict[str, list[int]]:
    """Output name -> shape of each ConstantOfShape fed by a constant shape tensor.

    The zoo's light models rebuild every weight that way; declaring those shapes up front lets
    Conv/Gemm weight shapes resolve whatever the installed onnx's inference does with them.
    """
    constant_values: dict[str, onnx.TensorProto] = {init.name: init for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in DEFAULT_ONNX_DOMAINS and node.output:
            for attribute in node.attribute:
                if attribute.name == "value" and attribute.type == onnx.AttributeProto.TENSOR:
                    constant_values[node.output[0]] = attribute.t
    shapes: dict[str, list[int]] = {}
    for node in graph.node:
        if node.op_type != "ConstantOfShape" or node.domain not in DEFAULT_ONNX_DOMAINS:
            continue
        if not node.input or node.input[0] not in constant_values or not node.output:
            continue
        dims = onnx.numpy_helper.to_array(constant_values[node.input[0]]).reshape(-1)
        shapes[node.output[0]] = [int(dim) for dim in dims]
    return shapes


def _constant_of_shape_dtype(node: onnx.NodeProto) -> int:
    # ConstantOfShape yields float32 unless its `value` attribute says otherwise.
    for attribute in node.attribute:
        if attribute.name == "value" and attribute.type == onnx.AttributeProto.TENSOR:
            return int(attribute.t.data_type)
    return onnx.TensorProto.FLOAT


def _inference_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """A weightless copy for shape inference: big initializers become shape-only inputs, batch is 1."""
    source = model.graph
    graph = onnx.GraphProto(name=source.name)
    graph.node.extend(source.node)
    graph.output.extend(source.output)
    graph.value_info.extend(source.value_info)

    declared_inputs = {value.name for value in source.input}
    initializer_names = {init.name for init in source.initializer}
    for value in source.input:
        batch_one = onnx.ValueInfoProto()
        batch_one.CopyFrom(value)
        if value.name not in initializer_names and value.type.HasField("tensor_type"):
            dims = batch_one.type.tensor_type.shape.dim
            if len(dims) > 0 and not dims[0].HasField("dim_value"):
                dims[0].dim_value = 1  # dynamic batch: count one sample
        graph.input.append(batch_one)
    for init in source.initializer:
        if math.prod(init.dims) <= SMALL_INITIALIZER_ELEMENTS:
            graph.initializer.append(init)
        elif init.name not in declared_inputs:
            graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    for sparse in source.sparse_initializer:
        if sparse.values.name not in declared_inputs:
            graph.input.append(
                onnx.helper.make_tensor_value_info(sparse.values.name, sparse.values.data_type, list(sparse.dims))
            )

    known_outputs = {value.name for value in graph.value_info}
    producers = {node.output[0]: node for node in source.node if node.output}
    for name, shape in _constant_of_shape_weights(source).items():
        if name not in known_outputs:
            dtype = _constant_of_shape_dtype(producers[name])
            graph.value_info.append(onnx.helper.make_tensor_value_info(name, dtype, shape))

    light = onnx.ModelProto(
        ir_version=model.ir_version,
        producer_name=model.producer_name,
        domain=model.domain,
        model_version=model.model_version,
    )
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    light.graph.CopyFrom(graph)
    return light


def _onnx_shapes(model: onnx.ModelProto) -> tuple[dict[str, Shape], dict[str, int]]:
    """Every tensor shape shape inference can work out (unknown dims are None), and element sizes."""
    inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    graph = inferred.graph
    shapes: dict[str, Shape] = {init.name: [int(d) for d in init.dims] for init in graph.initializer}
    item_bytes: dict[str, int] = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        if not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
            continue
        shapes[value.name] = [
            int(dim.dim_value) if dim.HasField("dim_value") else None for dim in value.type.tensor_type.shape.dim
        ]
        elem_type = value.type.tensor_type.elem_type
        if elem_type:
            item_bytes[value.name] = onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize
    return shapes, item_bytes


RUNTIME_SHAPE_INPUT_ELEMENTS = 1 << 23  # one inference at most this big (inputs' elements) to learn shapes


def _runtime_shapes(model: onnx.ModelProto, names: list[str]) -> dict[str, Shape]:
    """Shapes ONNX Runtime gives these main-graph tensors in one inference on zeros (a sample-rate input
    gets 16000), when static inference cannot follow the graph (shapes computed through If branches,
    Paddle2ONNX's shape arithmetic). Empty when an input's shape is not fixed or the run fails."""
    import numpy as np
    import onnxruntime as ort

    from farm.models.runtimes import onnx_session

    initializers = {init.name for init in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        dims = value.type.tensor_type.shape.dim
        shape = [int(d.dim_value) if d.HasField("dim_value") and d.dim_value > 0 else 0 for d in dims]
        if any(d == 0 for d in shape) or math.prod(shape) > RUNTIME_SHAPE_INPUT_ELEMENTS:
            return {}
        dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        rate = value.name.lower() in ("sr", "sample_rate", "sampling_rate") and dtype.kind in "iu"
        feeds[value.name] = np.full(shape, 16000 if rate else 0, dtype=dtype)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    outputs = {value.name for value in probe.graph.output}
    for name in names:
        if name not in outputs and name not in initializers and name not in feeds:
            probe.graph.output.append(onnx.ValueInfoProto(name=name))
            outputs.add(name)
    try:
        session = onnx_session(probe.SerializeToString(), threads=1)
        wanted = [o.name for o in session.get_outputs()]
        values = session.run(wanted, feeds)
    except (ort.capi.onnxruntime_pybind11_state.Fail, ort.capi.onnxruntime_pybind11_state.RuntimeException,
            ort.capi.onnxruntime_pybind11_state.InvalidArgument, ort.capi.onnxruntime_pybind11_state.InvalidGraph,
            ValueError, RuntimeError, MemoryError):
        return {}
    found: dict[str, Shape] = {name: list(np.shape(value)) for name, value in zip(wanted, values)}
    found.update({name: list(array.shape) for name, array in feeds.items()})
    return found


def _with_runtime_shapes(model: onnx.ModelProto, shapes: dict[str, Shape]) -> dict[str, Shape]:
    """shapes, with what the runtime says for the counted nodes' tensors that inference left unknown."""
    unknown = []
    for node in model.graph.node:
        if node.domain in DEFAULT_ONNX_DOMAINS and node.op_type in _ONNX_COUNTERS:
            for name in [*node.input, *node.output]:
                shape = shapes.get(name)
                if name and (shape is None or any(dim is None for dim in shape)):
                    unknown.append(name)
    if not unknown:
        return shapes
    return {**shapes, **_runtime_shapes(model, unknown)}


def _known(shapes: dict[str, Shape], node: onnx.NodeProto, position: int, *, output: bool = False) -> list[int]:
    names = node.output if output else node.input
    if position >= len(names) or not names[position]:
        raise _UnknownShape(f"{node.op_type} {node.name!r} lacks {'output' if output else 'input'} {position}")
    shape = shapes.get(names[position])
    if shape is None or any(dim is None for dim in shape):
        raise _UnknownShape(f"shape of {names[position]!r} is not known")
    return [int(dim) for dim in shape if dim is not None]


def _onnx_int_attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    for attribute in node.attribute:
        if attribute.name == name:
            return int(attribute.i)
    return default


def _onnx_conv(node: onnx.NodeProto, shapes: dict[str, Shape], weight_input: int) -> int:
    # Weight (M, C/group, k...): each output element costs prod(C/group, k...) MACs; groups are in the weight.
    output = _known(shapes, node, 0, output=True)
    weight = _known(shapes, node, weight_input)
    return math.prod(output) * math.prod(weight[1:])


def _onnx_conv_transpose(node: onnx.NodeProto, shapes: dict[str, Shape]) -> int:
    # Weight (C, M/group, k...): every input element is scattered through prod(M/group, k...) weights.
    data = _known(shapes, node, 0)
    weight = _known(shapes, node, 1)
    return math.prod(data) * math.prod(weight[1:])


def _onnx_gemm(node: onnx.NodeProto, shapes: dict[str, Shape]) -> int:
    # Y (M, N) = A (M, K) · B (K, N), with transA/transB swapping A's and B's axes.
    output = _known(shapes, node, 0, output=True)
    try:
        a = _known(shapes, node, 0)
        depth = a[0] if _onnx_int_attribute(node, "transA", 0) else a[-1]
    except _UnknownShape:
        b = _known(shapes, node, 1)
        depth = b[-1] if _onnx_int_attribute(node, "transB", 0) else b[0]
    return math.prod(output) * depth


def _onnx_matmul(node: onnx.NodeProto, shapes: dict[str, Shape], a_input: int, b_input: int) -> int:
    # numpy matmul: the contracted axis is A's last (a 1-D A is one row), else B's second to last.
    output = _known(shapes, node, 0, output=True)
    try:
        depth = _known(shapes, node, a_input)[-1]
    except _UnknownShape:
        b = _known(shapes, node, b_input)
        depth = b[0] if len(b) == 1 else b[-2]
    return math.prod(output) * depth


_ONNX_COUNTERS: dict[str, Callable[[onnx.NodeProto, dict[str, Shape]], int]] = {
    "Conv": lambda node, shapes: _onnx_conv(node, shapes, weight_input=1),
    "ConvInteger": lambda node, shapes: _onnx_conv(node, shapes, weight_input=1),
    "QLinearConv": lambda node, shapes: _onnx_conv(node, shapes, weight_input=3),  # x, x_scale, x_zp, w, ...
    "ConvTranspose": _onnx_conv_transpose,
    "Gemm": _onnx_gemm,
    "MatMul": lambda node, shapes: _onnx_matmul(node, shapes, a_input=0, b_input=1),
    "MatMulInteger": lambda node, shapes: _onnx_matmul(node, shapes, a_input=0, b_input=1),
    "QLinearMatMul": lambda node, shapes: _onnx_matmul(node, shapes, a_input=0, b_input=3),  # a, a_scale, a_zp, b
}


def onnx_macs(model: onnx.ModelProto) -> int | None:
    """MACs of the main graph of a parsed ONNX model; None if a counted node's shapes stay unknown."""
    counted = [
        node for node in model.graph.node if node.domain in DEFAULT_ONNX_DOMAINS and node.op_type in _ONNX_COUNTERS
    ]
    if not counted:
        return 0  # nothing to infer: skip the costly shape inference
    profile = onnx_mac_profile(model)
    return None if profile is None else profile.total


def _onnx_kind(node: onnx.NodeProto, shapes: dict[str, Shape]) -> str:
    if node.op_type in ("Conv", "ConvInteger", "QLinearConv"):
        weight = shapes.get(node.input[3 if node.op_type == "QLinearConv" else 1]) or []
        # each output channel sees one input channel: a depthwise convolution
        return "depthwise" if _onnx_int_attribute(node, "group", 1) > 1 and len(weight) > 1 and weight[1] == 1 else "conv"
    return "other" if node.op_type == "ConvTranspose" else "fc"


def _onnx_conv_shape(node: onnx.NodeProto, shapes: dict[str, Shape]) -> str | None:
    # Weight (M, C/group, k...); a kind "conv" node with group > 1 is grouped (depthwise is its own kind).
    weight = _known(shapes, node, 3 if node.op_type == "QLinearConv" else 1)
    return _conv_shape(weight[2:], grouped=_onnx_int_attribute(node, "group", 1) > 1)


def onnx_mac_profile(model: onnx.ModelProto) -> MacProfile | None:
    """MACs by operator kind and activation bytes of the main graph; None if a counted shape is unknown."""
    try:
        shapes, item_bytes = _onnx_shapes(_inference_copy(model))
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, ValueError):
        return None  # the graph is inconsistent enough that inference gives up even in non-strict mode
    shapes = _with_runtime_shapes(model, shapes)
    by_kind = dict.fromkeys(MAC_KINDS, 0)
    by_shape = dict.fromkeys(CONV_SHAPES, 0)
    try:
        for node in model.graph.node:
            if node.domain in DEFAULT_ONNX_DOMAINS and node.op_type in _ONNX_COUNTERS:
                macs = _ONNX_COUNTERS[node.op_type](node, shapes)
                kind = _onnx_kind(node, shapes)
                by_kind[kind] += macs
                conv_shape = _onnx_conv_shape(node, shapes) if kind == "conv" else None
                if conv_shape is not None:
                    by_shape[conv_shape] += macs
    except _UnknownShape:
        return None
    weights = {init.name for init in model.graph.initializer}
    activations = {value.name for value in model.graph.input if value.name not in weights}
    activations |= {name for node in model.graph.node for name in node.output if name and node.op_type != "Constant"}
    activation_bytes = 0
    for name in activations:
        shape = shapes.get(name)
        if shape is None or any(dim is None for dim in shape):
            return MacProfile(by_kind, None, by_shape)
        activation_bytes += math.prod([int(dim or 0) for dim in shape]) * item_bytes.get(name, 4)
    return MacProfile(by_kind, activation_bytes, by_shape)


# --- per layer (`farm inspect`) -----------------------------------------------------------------


CONTROL_FLOW = ("Loop", "If", "Scan")


def _bodies(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [g for a in node.attribute
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs))]


def _counted_in_bodies(node: onnx.NodeProto) -> dict[str, int]:
    """Operators of a control-flow node's bodies (every depth) whose MACs would count: op type -> nodes."""
    found: dict[str, int] = {}
    stack = _bodies(node)
    while stack:
        for inner in stack.pop().node:
            if inner.domain in DEFAULT_ONNX_DOMAINS and inner.op_type in _ONNX_COUNTERS:
                found[inner.op_type] = found.get(inner.op_type, 0) + 1
            stack.extend(_bodies(inner))
    return found


def body_note(node: onnx.NodeProto) -> str:
    """A layer's words for a control-flow node's uncounted body ("" when nothing in it would count)."""
    found = _counted_in_bodies(node) if node.op_type in CONTROL_FLOW else {}
    if not found:
        return ""
    ops = ", ".join(f"{n} {op}" for op, n in sorted(found.items()))
    return f"not counted: its body's {ops} run a number of times known only at run time"


@dataclass(frozen=True)
class Layer:
    """One operator of the main graph: what it is, the MACs it does, the weights it reads first, what it makes."""

    index: int
    name: str
    op: str
    kind: str | None  # MAC kind (conv, depthwise, fc, other); None for an operator whose MACs count as 0
    macs: int | None  # None: a counted operator whose shapes are not known
    params: int  # weight elements, each counted at its first consumer (so they sum to the model's)
    output_shape: list[int | None]  # at batch 1; None for a dimension not known before running
    note: str = ""  # a control-flow node (Loop/If/Scan): its body's MACs are not counted, and which they are


def _counted(counter: Callable[[], int]) -> int | None:
    try:
        return counter()
    except (_UnknownShape, IndexError, TypeError):
        return None


def tflite_layers(model: tflite_schema.ModelT) -> list[Layer]:
    """Every operator of the main subgraph, in execution order."""
    codes = model.operatorCodes or []
    main = model.subgraphs[0]
    tensors = main.tensors or []
    buffers = model.buffers or []
    dynamic = _has_dynamic_non_batch_input(main)
    seen_buffers: set[int] = set()
    layers = []
    for index, operator in enumerate(main.operators or []):
        code = _tflite_builtin_code(codes[operator.opcodeIndex])
        counter = _TFLITE_COUNTERS.get(code)
        macs: int | None = 0
        if counter is not None:
            macs = None if dynamic else _counted(lambda: counter(operator, tensors))
        params = 0
        for i in _ints(operator.inputs):
            if 0 <= i < len(tensors):
                b = tensors[i].buffer
                if b > 0 and b not in seen_buffers and b < len(buffers) and _tflite_buffer_has_data(buffers[b]):
                    seen_buffers.add(b)
                    params += math.prod(_ints(tensors[i].shape))
        outputs = _ints(operator.outputs)
        out = tensors[outputs[0]] if outputs and 0 <= outputs[0] < len(tensors) else None
        dims = (_ints(out.shapeSignature) or _ints(out.shape)) if out is not None else []
        shape: list[int | None] = [1 if k == 0 and d < 0 else (None if d < 0 else d) for k, d in enumerate(dims)]
        name = (_decode(out.name) if out is not None else "") or f"op{index}"
        layers.append(Layer(index, name, _tflite_op_name(codes[operator.opcodeIndex]),
                            _TFLITE_KINDS.get(code, "other") if counter is not None else None, macs, params, shape))
    return layers


def onnx_layers(model: onnx.ModelProto) -> list[Layer]:
    """Every node of the main graph but the ones that only make weights (Constant, ConstantOfShape)."""
    graph = model.graph
    try:
        shapes, _ = _onnx_shapes(_inference_copy(model))
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, ValueError):
        shapes = {}
    shapes = _with_runtime_shapes(model, shapes)
    initializers = {init.name: int(math.prod(init.dims)) for init in graph.initializer}
    consumers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1
    weights = dict(initializers)
    weight_makers = set()
    for name, dims in _constant_of_shape_weights(graph).items():
        weights[name] = math.prod(dims)  # the zoo's light models rebuild each weight from its shape
    for node in graph.node:
        if node.op_type == "ConstantOfShape" and node.domain in DEFAULT_ONNX_DOMAINS and node.input:
            weight_makers.update(node.output)
            if consumers.get(node.input[0]) == 1:
                weights.pop(node.input[0], None)  # only a shape: counted as the tensor it makes
        elif node.op_type == "Constant" and node.domain in DEFAULT_ONNX_DOMAINS:
            weight_makers.update(node.output)
    seen: set[str] = set()
    layers = []
    for index, node in enumerate(graph.node):
        if node.output and all(o in weight_makers for o in node.output if o):
            continue
        op = node.op_type if node.domain in DEFAULT_ONNX_DOMAINS else f"{node.domain}:{node.op_type}"
        counted = node.domain in DEFAULT_ONNX_DOMAINS and node.op_type in _ONNX_COUNTERS
        macs: int | None = 0
        kind = None
        if counted:
            macs = _counted(lambda: _ONNX_COUNTERS[node.op_type](node, shapes))
            kind = _onnx_kind(node, shapes) if macs is not None else None
        params = 0
        for name in node.input:
            if name in weights and name not in seen:
                seen.add(name)
                params += weights[name]
        shape = shapes.get(node.output[0]) if node.output else None
        note = body_note(node) if node.domain in DEFAULT_ONNX_DOMAINS else ""
        layers.append(Layer(index, node.name or (node.output[0] if node.output else f"node{index}"), op, kind, macs,
                            params, list(shape) if shape is not None else [], note))
    return layers


def model_layers(path: Path, input_shapes: dict[str, list[int]] | None = None) -> list[Layer]:
    """The per-layer table of a .tflite or .onnx file; empty for other formats. Raises facts.ModelError.
    input_shapes: as facts.inspect_model's (ONNX only)."""
    path = Path(path)
    fmt = model_format(path)
    if fmt == "tflite":
        return tflite_layers(_parse_tflite(path, _read(path)))
    if fmt == "onnx":
        return onnx_layers(set_onnx_input_shapes(path, _parse_onnx(path, _read(path)), input_shapes or {}))
    return []
