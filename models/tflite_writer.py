"""A .tflite flatbuffer written with LiteRT's schema object API: the graph builder the example-model
generators (farm.model_generators) use, and the one-operator probe models/facts.py writes to ask LiteRT whether it
resolves a custom operator."""

from __future__ import annotations

from typing import Any

import flatbuffers
import numpy as np
from ai_edge_litert import schema_py_generated as schema

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


def single_custom_op_tflite(custom_code: str) -> bytes:
    """One custom operator on a (1, 4) float tensor: probes whether LiteRT resolves `custom_code`."""
    graph = TFLiteGraphBuilder()
    x = graph.activation(INPUT_NAME, [1, 4])
    out = graph.activation(OUTPUT_NAME, [1, 4])
    graph.operator(schema.BuiltinOperator.CUSTOM, [x], [out], custom_code=custom_code)
    return graph.to_bytes([x], [out], f"probe for custom op {custom_code}")
