"""MobileNetV2 as a .tflite flatbuffer (NHWC, float32), written with LiteRT's schema object API."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import flatbuffers
import numpy as np
from ai_edge_litert import schema_py_generated as schema

from farm.models.mobilenetv2 import DEFAULT_SEED, ConvLayer, build_mobilenetv2, model_name

TFLITE_FILE_IDENTIFIER = b"TFL3"
TFLITE_SCHEMA_VERSION = 3
# Opcodes at or above this value live only in OperatorCode.builtin_code; older readers see 127.
PLACEHOLDER_FOR_GREATER_OP_CODES = schema.BuiltinOperator.PLACEHOLDER_FOR_GREATER_OP_CODES
BUFFER_ALIGNMENT = 16  # the schema declares Buffer.data force_align: 16; flatc honours it, Python does not
INPUT_NAME = "input"
OUTPUT_NAME = "logits"

FLOAT32 = np.dtype(np.float32)
_TENSOR_TYPES: dict[np.dtype[Any], int] = {
    np.dtype(np.float32): schema.TensorType.FLOAT32,
    np.dtype(np.int32): schema.TensorType.INT32,
}


class _AlignedBufferT(schema.BufferT):  # type: ignore[misc]  # generated code is untyped
    """BufferT whose bytes start on a 16-byte boundary, so kernels can read floats in place."""

    def Pack(self, builder: flatbuffers.Builder) -> int:  # the name the generated ModelT.Pack calls
        data_offset = None
        if self.data is not None and len(self.data) > 0:
            raw = memoryview(self.data).cast("B")
            builder.StartVector(1, len(raw), BUFFER_ALIGNMENT)
            builder.head = builder.head - len(raw)
            builder.Bytes[builder.head : builder.head + len(raw)] = raw
            data_offset = builder.EndVector()
        schema.BufferStart(builder)
        if data_offset is not None:
            schema.BufferAddData(builder, data_offset)
        return int(schema.BufferEnd(builder))


def operator_code(builtin: int, custom_code: str | None = None, version: int = 1) -> schema.OperatorCodeT:
    """An OperatorCode with both the legacy int8 field and the int32 field filled in."""
    code = schema.OperatorCodeT()
    code.builtinCode = builtin
    code.deprecatedBuiltinCode = min(builtin, PLACEHOLDER_FOR_GREATER_OP_CODES)
    code.customCode = custom_code
    code.version = version
    return code


class TFLiteGraphBuilder:
    """Accumulates tensors, constant buffers and operators of one subgraph, then packs a ModelT."""

    def __init__(self, *, dynamic_batch: bool = False) -> None:
        self.dynamic_batch = dynamic_batch
        self.tensors: list[schema.TensorT] = []
        self.buffers: list[schema.BufferT] = [schema.BufferT()]  # buffer 0: the empty sentinel
        self.operators: list[schema.OperatorT] = []
        self.operator_codes: list[schema.OperatorCodeT] = []
        self._opcode_index: dict[tuple[int, str | None, int], int] = {}

    def activation(self, name: str, shape: list[int], dtype: np.dtype[Any] = FLOAT32) -> int:
        """A runtime tensor (no data); dimension 0 is the batch."""
        tensor = schema.TensorT()
        tensor.name = name
        tensor.shape = list(shape)
        tensor.type = _TENSOR_TYPES[np.dtype(dtype)]
        tensor.buffer = 0
        if self.dynamic_batch:
            tensor.shapeSignature = [-1, *shape[1:]]
        self.tensors.append(tensor)
        return len(self.tensors) - 1

    def constant(self, name: str, array: np.ndarray) -> int:
        array = np.ascontiguousarray(array)
        buffer = _AlignedBufferT()
        buffer.data = array.tobytes()
        self.buffers.append(buffer)
        tensor = schema.TensorT()
        tensor.name = name
        tensor.shape = list(array.shape)
        tensor.type = _TENSOR_TYPES[array.dtype]
        tensor.buffer = len(self.buffers) - 1
        self.tensors.append(tensor)
        return len(self.tensors) - 1

    def opcode(self, builtin: int, custom_code: str | None = None, version: int = 1) -> int:
        key = (builtin, custom_code, version)
        if key not in self._opcode_index:
            self._opcode_index[key] = len(self.operator_codes)
            self.operator_codes.append(operator_code(builtin, custom_code, version))
        return self._opcode_index[key]

    def operator(
        self,
        builtin: int,
        inputs: list[int],
        outputs: list[int],
        options_type: int = schema.BuiltinOptions.NONE,
        options: object | None = None,
        *,
        custom_code: str | None = None,
    ) -> None:
        op = schema.OperatorT()
        op.opcodeIndex = self.opcode(builtin, custom_code)
        op.inputs = list(inputs)
        op.outputs = list(outputs)
        op.builtinOptionsType = options_type
        op.builtinOptions = options
        if custom_code is not None:
            op.customOptions = []
        self.operators.append(op)

    def to_bytes(self, inputs: list[int], outputs: list[int], description: str) -> bytes:
        subgraph = schema.SubGraphT()
        subgraph.tensors = self.tensors
        subgraph.inputs = list(inputs)
        subgraph.outputs = list(outputs)
        subgraph.operators = self.operators
        subgraph.name = "main"

        signature = schema.SignatureDefT()
        signature.signatureKey = "serving_default"
        signature.subgraphIndex = 0
        signature.inputs = [self._tensor_map(i) for i in inputs]
        signature.outputs = [self._tensor_map(i) for i in outputs]

        model = schema.ModelT()
        model.version = TFLITE_SCHEMA_VERSION
        model.description = description
        model.operatorCodes = self.operator_codes
        model.subgraphs = [subgraph]
        model.buffers = self.buffers
        model.signatureDefs = [signature]

        builder = flatbuffers.Builder(1024 + sum(len(b.data or b"") for b in self.buffers))
        builder.Finish(model.Pack(builder), file_identifier=TFLITE_FILE_IDENTIFIER)
        return bytes(builder.Output())

    def _tensor_map(self, index: int) -> schema.TensorMapT:
        tensor_map = schema.TensorMapT()
        tensor_map.name = self.tensors[index].name
        tensor_map.tensorIndex = index
        return tensor_map


def _conv(graph: TFLiteGraphBuilder, layer: ConvLayer, x: int, spatial: int) -> tuple[int, int]:
    """CONV_2D or DEPTHWISE_CONV_2D with fused RELU6 (or none for projections); returns (tensor, size)."""
    out_spatial = -(-spatial // layer.stride)
    activation = schema.ActivationFunctionType.RELU6 if layer.relu6 else schema.ActivationFunctionType.NONE
    if layer.kind == "depthwise":
        # OIHW (C, 1, kH, kW) -> 1HWO (1, kH, kW, C)
        weight = graph.constant(f"{layer.name}_weight", layer.weight.transpose(1, 2, 3, 0))
        options: Any = schema.DepthwiseConv2DOptionsT()
        options.depthMultiplier = 1
        options_type = schema.BuiltinOptions.DepthwiseConv2DOptions
        builtin = schema.BuiltinOperator.DEPTHWISE_CONV_2D
    else:
        # OIHW -> OHWI
        weight = graph.constant(f"{layer.name}_weight", layer.weight.transpose(0, 2, 3, 1))
        options = schema.Conv2DOptionsT()
        options_type = schema.BuiltinOptions.Conv2DOptions
        builtin = schema.BuiltinOperator.CONV_2D
    options.padding = schema.Padding.SAME
    options.strideH = options.strideW = layer.stride
    options.dilationHFactor = options.dilationWFactor = 1
    options.fusedActivationFunction = activation
    bias = graph.constant(f"{layer.name}_bias", layer.bias)
    out = graph.activation(layer.name, [1, out_spatial, out_spatial, layer.out_channels])
    graph.operator(builtin, [x, weight, bias], [out], options_type, options)
    return out, out_spatial


def mobilenetv2_tflite(
    width: float = 1.0,
    input_size: int = 224,
    *,
    dynamic_batch: bool = False,
    seed: int = DEFAULT_SEED,
) -> bytes:
    """The .tflite bytes of MobileNetV2 at `width`: input (1, size, size, 3), output (1, 1000) logits."""
    net = build_mobilenetv2(width, seed)
    graph = TFLiteGraphBuilder(dynamic_batch=dynamic_batch)
    model_input = graph.activation(INPUT_NAME, [1, input_size, input_size, 3])

    x, spatial = _conv(graph, net.stem, model_input, input_size)
    for block in net.blocks:
        block_input = x
        for layer in block.layers:
            x, spatial = _conv(graph, layer, x, spatial)
        if block.residual:
            added = graph.activation(f"{block.name}_add", [1, spatial, spatial, block.layers[-1].out_channels])
            graph.operator(
                schema.BuiltinOperator.ADD,
                [block_input, x],
                [added],
                schema.BuiltinOptions.AddOptions,
                schema.AddOptionsT(),
            )
            x = added
    x, spatial = _conv(graph, net.head, x, spatial)

    axes = graph.constant("global_pool_axes", np.array([1, 2], dtype=np.int32))
    pooled = graph.activation("global_pool", [1, net.head.out_channels])
    mean_options = schema.ReducerOptionsT()
    mean_options.keepDims = False
    graph.operator(schema.BuiltinOperator.MEAN, [x, axes], [pooled], schema.BuiltinOptions.ReducerOptions, mean_options)

    weight = graph.constant("classifier_weight", net.classifier_weight)  # (out, in), as FULLY_CONNECTED wants
    bias = graph.constant("classifier_bias", net.classifier_bias)
    logits = graph.activation(OUTPUT_NAME, [1, net.classifier_bias.size])
    graph.operator(
        schema.BuiltinOperator.FULLY_CONNECTED,
        [pooled, weight, bias],
        [logits],
        schema.BuiltinOptions.FullyConnectedOptions,
        schema.FullyConnectedOptionsT(),
    )
    description = f"{model_name(width, input_size)}: MobileNetV2, random weights (seed {seed}); generated by farm"
    return graph.to_bytes([model_input], [logits], description)


def write_mobilenetv2_tflite(
    path: Path,
    width: float = 1.0,
    input_size: int = 224,
    *,
    dynamic_batch: bool = False,
    seed: int = DEFAULT_SEED,
) -> Path:
    path.write_bytes(mobilenetv2_tflite(width, input_size, dynamic_batch=dynamic_batch, seed=seed))
    return path


def tiny_tflite() -> bytes:
    """One 3x3 conv with fused ReLU on a (1, 8, 8, 3) input: loads and runs in milliseconds."""
    rng = np.random.default_rng(DEFAULT_SEED)
    graph = TFLiteGraphBuilder()
    x = graph.activation(INPUT_NAME, [1, 8, 8, 3])
    weight = graph.constant("conv_weight", (rng.standard_normal((4, 3, 3, 3)) * 0.1).astype(np.float32))
    bias = graph.constant("conv_bias", np.zeros(4, dtype=np.float32))
    out = graph.activation(OUTPUT_NAME, [1, 8, 8, 4])
    options = schema.Conv2DOptionsT()
    options.padding = schema.Padding.SAME
    options.strideH = options.strideW = 1
    options.fusedActivationFunction = schema.ActivationFunctionType.RELU
    graph.operator(
        schema.BuiltinOperator.CONV_2D, [x, weight, bias], [out], schema.BuiltinOptions.Conv2DOptions, options
    )
    return graph.to_bytes([x], [out], "tiny: one conv; generated by farm")


UNSUPPORTED_TFLITE_OP = "FarmUnknownOp"


def single_custom_op_tflite(custom_code: str) -> bytes:
    """One custom operator on a (1, 4) float tensor: probes whether LiteRT resolves `custom_code`."""
    graph = TFLiteGraphBuilder()
    x = graph.activation(INPUT_NAME, [1, 4])
    out = graph.activation(OUTPUT_NAME, [1, 4])
    graph.operator(schema.BuiltinOperator.CUSTOM, [x], [out], custom_code=custom_code)
    return graph.to_bytes([x], [out], f"probe for custom op {custom_code}")


def unsupported_op_tflite() -> bytes:
    """A valid model whose second operator is the custom op FarmUnknownOp, which no resolver knows."""
    graph = TFLiteGraphBuilder()
    x = graph.activation(INPUT_NAME, [1, 4])
    relu = graph.activation("relu", [1, 4])
    out = graph.activation(OUTPUT_NAME, [1, 4])
    graph.operator(schema.BuiltinOperator.RELU, [x], [relu])
    graph.operator(schema.BuiltinOperator.CUSTOM, [relu], [out], custom_code=UNSUPPORTED_TFLITE_OP)
    return graph.to_bytes([x], [out], "unsupported custom op; generated by farm")


def delegate_only_op_tflite() -> bytes:
    """MediaPipe's custom op Convolution2DTransposeBias (as in selfie_segmentation): no builtin
    kernel, but the XNNPACK delegate of LiteRT's AUTO resolver runs it."""
    graph = TFLiteGraphBuilder()
    x = graph.activation(INPUT_NAME, [1, 4, 4, 2])
    weights = graph.constant("weights", np.full((3, 2, 2, 2), 0.5, np.float32))  # O, H, W, I
    bias = graph.constant("bias", np.zeros((3,), np.float32))
    out = graph.activation(OUTPUT_NAME, [1, 8, 8, 3])
    graph.operator(schema.BuiltinOperator.CUSTOM, [x, weights, bias], [out], custom_code="Convolution2DTransposeBias")
    # TfLiteTransposeConvParams as MediaPipe packs it: padding (VALID = 2), stride_width, stride_height
    graph.operators[-1].customOptions = list(struct.pack("<iii", 2, 2, 2))
    return graph.to_bytes([x], [out], "MediaPipe transposed convolution; generated by farm")
