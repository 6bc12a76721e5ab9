"""A model file read as its graph, before anything is learnt from it: the format by name, the bytes read
within the size limit, the TFLite flatbuffer or ONNX protobuf parsed and checked, ONNX input shapes fixed.
Shared by facts.py (what a model is) and macs.py (what it costs), which both read graphs this way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
from ai_edge_litert import schema_py_generated as tflite_schema

from farm.proto.regular_files import MAX_MODEL_FILE_BYTES, FileRefused, read_regular_file

TFLITE_SUFFIXES = frozenset({".tflite"})
ONNX_SUFFIXES = frozenset({".onnx"})
TFLITE_FILE_IDENTIFIER = b"TFL3"


DEFAULT_ONNX_DOMAINS = frozenset({"", "ai.onnx"})


class ModelError(ValueError):
    """The model file is missing, unreadable or not a valid model of its format."""


def model_format(path: Path) -> str:
    """'tflite', 'onnx' or 'other', from the file name."""
    suffix = path.suffix.lower()
    if suffix in TFLITE_SUFFIXES:
        return "tflite"
    if suffix in ONNX_SUFFIXES:
        return "onnx"
    return "other"


def _read(path: Path) -> bytes:
    try:
        return read_regular_file(path, "model file", MAX_MODEL_FILE_BYTES)  # a FIFO or /dev/zero refused unread
    except FileRefused as exc:
        raise ModelError(str(exc)) from None
    except FileNotFoundError:
        raise ModelError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise ModelError(f"{path} is a directory, not a model file") from None
    except OSError as exc:
        raise ModelError(f"{path} cannot be read: {exc.strerror or exc}") from None


_BUILTIN_NAMES: dict[int, str] = {
    value: name
    for name, value in vars(tflite_schema.BuiltinOperator).items()
    if not name.startswith("_") and isinstance(value, int)
}


def _parse_tflite(path: Path, data: bytes) -> tflite_schema.ModelT:
    if len(data) < 8:
        raise ModelError(f"{path} is not a valid TFLite flatbuffer (only {len(data)} bytes)")
    identifier = data[4:8]
    if identifier != TFLITE_FILE_IDENTIFIER:
        shown = identifier.decode("ascii", errors="backslashreplace")
        raise ModelError(f"{path} is not a valid TFLite flatbuffer (file identifier {shown!r}, expected 'TFL3')")
    try:
        model = tflite_schema.ModelT.InitFromPackedBuf(data, 0)
    except Exception as exc:  # the generated reader has no verifier: garbage offsets fail anywhere
        raise ModelError(f"{path} is not a valid TFLite flatbuffer (truncated or corrupt: {exc})") from None
    problem = _tflite_structure_problem(model)
    if problem:
        raise ModelError(f"{path} is not a valid TFLite flatbuffer ({problem})")
    return model


def _tflite_structure_problem(model: tflite_schema.ModelT) -> str | None:
    """The first broken cross-reference in the model, so later code can index freely."""
    subgraphs = model.subgraphs or []
    if not subgraphs:
        return "no subgraphs"
    buffer_count = len(model.buffers or [])
    opcode_count = len(model.operatorCodes or [])
    for sg_index, subgraph in enumerate(subgraphs):
        if subgraph is None:
            return f"subgraph {sg_index} is missing"
        tensors = subgraph.tensors or []
        for tensor in tensors:
            if tensor is None:
                return f"subgraph {sg_index} has a missing tensor"
            if not 0 <= tensor.buffer < max(buffer_count, 1):
                return f"tensor {tensor.name!r} refers to buffer {tensor.buffer} of {buffer_count}"
        for io_index in [*_ints(subgraph.inputs), *_ints(subgraph.outputs)]:
            if not 0 <= io_index < len(tensors):
                return f"subgraph {sg_index} input/output {io_index} is not one of its {len(tensors)} tensors"
        for op_index, operator in enumerate(subgraph.operators or []):
            if operator is None or not 0 <= operator.opcodeIndex < opcode_count:
                return f"operator {op_index} of subgraph {sg_index} has no valid operator code"
            for tensor_index in [*_ints(operator.inputs), *_ints(operator.outputs)]:
                if not -1 <= tensor_index < len(tensors):  # -1 marks an omitted optional input
                    return f"operator {op_index} of subgraph {sg_index} uses tensor {tensor_index} of {len(tensors)}"
    return None


def _ints(values: Any) -> list[int]:
    return [] if values is None else [int(v) for v in values]


def _tflite_builtin_code(code: tflite_schema.OperatorCodeT) -> int:
    # Writers fill deprecated_builtin_code (int8, <=127) and builtin_code (int32); old files only the former.
    return max(int(code.builtinCode), int(code.deprecatedBuiltinCode))


def _tflite_op_name(code: tflite_schema.OperatorCodeT) -> str:
    builtin = _tflite_builtin_code(code)
    if builtin == tflite_schema.BuiltinOperator.CUSTOM:
        return _decode(code.customCode) or "CUSTOM"
    return _BUILTIN_NAMES.get(builtin, f"BUILTIN_{builtin}")


def _decode(value: str | bytes | None) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


def _tflite_buffer_has_data(buffer: tflite_schema.BufferT | None) -> bool:
    if buffer is None:
        return False
    return (buffer.data is not None and len(buffer.data) > 0) or buffer.size > 0  # size: data outside the flatbuffer


def _parse_onnx(path: Path, data: bytes) -> onnx.ModelProto:
    try:
        model = onnx.load_model_from_string(data)
    except Exception as exc:  # protobuf DecodeError and friends
        raise ModelError(f"{path} is not a valid ONNX model (protobuf does not parse: {exc})") from None
    # Random bytes can decode as a protobuf of unknown fields: demand the parts every model has.
    if not model.HasField("graph") or not model.opset_import:
        missing = "graph" if not model.HasField("graph") else "opset_import"
        raise ModelError(f"{path} is not a valid ONNX model (no {missing}; IR version {model.ir_version})")
    return model


def set_onnx_input_shapes(path: Path, model: onnx.ModelProto, shapes: dict[str, list[int]]) -> onnx.ModelProto:
    """The model with these inputs' shapes fixed (a copy); ModelError for a name it lacks or a rank or fixed
    dimension that differs."""
    if not shapes:
        return model
    initializers = {init.name for init in model.graph.initializer}
    inputs = {value.name: value for value in model.graph.input if value.name not in initializers}
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    targets = {value.name: value for value in fixed.graph.input}
    for name, shape in shapes.items():
        if name not in inputs:
            raise ModelError(f"{path}: no input named {name!r} (its inputs: {', '.join(inputs)})")
        dims = targets[name].type.tensor_type.shape.dim
        if len(dims) != len(shape):
            raise ModelError(f"{path}: input {name!r} has {len(dims)} dimensions, the shape given has {len(shape)}")
        for axis, (dim, want) in enumerate(zip(dims, shape)):
            if dim.HasField("dim_value") and dim.dim_value > 0 and dim.dim_value != want:  # -1: exporters' "dynamic"
                raise ModelError(f"{path}: input {name!r} has a fixed dimension {axis} of {dim.dim_value}, not {want}")
            dim.dim_value = int(want)
    return fixed
