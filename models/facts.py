"""What farm can learn about a model file without running it: ModelFacts, and unsupported operators."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import math
import os
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from ai_edge_litert import schema_py_generated as tflite_schema

from farm.models.tflite_writer import single_custom_op_tflite
from farm.models.graph import (  # re-exported: callers import ModelError, model_format... from here
    DEFAULT_ONNX_DOMAINS as DEFAULT_ONNX_DOMAINS,
    ModelError as ModelError,
    model_format as model_format,
    _read,
    _BUILTIN_NAMES,
    _parse_tflite,
    _ints,
    _tflite_builtin_code,
    _tflite_op_name,
    _decode,
    _tflite_buffer_has_data,
    _parse_onnx,
    set_onnx_input_shapes as set_onnx_input_shapes,
)
from farm.models.runtimes import litert_interpreter, onnx_session
from farm.proto.results import ModelFacts, TensorInfo

DYNAMIC_DIM = "?"  # how a dimension unknown until run time is shown when it has no name


def inspect_model(path: Path, input_shapes: dict[str, list[int]] | None = None) -> ModelFacts:
    """Size, hash, inputs/outputs, operator and parameter counts of a .tflite or .onnx file.

    input_shapes fixes inputs' shapes (ONNX: dynamic dimensions) so MACs can be counted, as a run fixes them.
    Raises ModelError naming the file when it cannot be read or parsed, or when input_shapes does not fit.
    """
    path = Path(path)
    data = _read(path)
    facts = ModelFacts(
        path=str(path),
        format=model_format(path),
        size_bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )
    if facts.format == "tflite":
        if input_shapes:
            raise ModelError(f"{path}: input shapes can be given for .onnx models only (a .tflite file's MACs are "
                             "counted at the shapes its converter wrote)")
        tflite_model = _parse_tflite(path, data)
        _fill_tflite_facts(facts, tflite_model)
        _fill_mac_profile(facts, tflite_model)
    elif facts.format == "onnx":
        onnx_model = set_onnx_input_shapes(path, _parse_onnx(path, data), input_shapes or {})
        _fill_onnx_facts(facts, onnx_model)
        _fill_mac_profile(facts, onnx_model)
    return facts


def _fill_mac_profile(facts: ModelFacts, parsed: Any) -> None:
    """MACs, their split by operator kind and activation bytes; left None when not estimable."""
    try:
        from farm.models import macs  # imported here: macs builds on this module's parsers

        profile = macs.tflite_mac_profile(parsed) if facts.format == "tflite" else macs.onnx_mac_profile(parsed)
    except Exception:  # a graph the estimator misreads must not cost the user the facts it already has
        return
    if profile is None:
        return
    facts.macs = profile.total
    shares = profile.shares()
    facts.conv_macs_share, facts.depthwise_macs_share = shares["conv_macs_share"], shares["depthwise_macs_share"]
    facts.fc_macs_share, facts.other_macs_share = shares["fc_macs_share"], shares["other_macs_share"]
    facts.conv1x1_macs_share, facts.conv3x3_macs_share = shares["conv1x1_macs_share"], shares["conv3x3_macs_share"]
    facts.grouped_macs_share = shares["grouped_macs_share"]
    facts.activation_bytes = profile.activation_bytes


@dataclasses.dataclass(frozen=True)
class RuntimeRefusal:
    """The runtime that would run a model cannot load it: its own message, and the operators it names."""

    runtime: str  # "litert" | "onnxruntime"
    message: str  # the runtime's words, first lines only
    ops: tuple[str, ...]  # operator names found in the message (or custom codes the resolver lacks); may be empty


def runtime_refusal(path: Path, *, use_xnnpack: bool = True, parsed_sha256: str | None = None) -> RuntimeRefusal | None:
    """Why the runtime a run uses cannot load this model, or None when it loads.

    The verdict is the runtime's own: the model is loaded exactly as a run loads it (models.runtimes;
    for TFLite, use_xnnpack picks the same op resolver as the job's workload.use_xnnpack). Static
    operator lists never refuse a model: ONNX Runtime folds Constant nodes and inlines functions, and
    LiteRT ships some custom ops, so only loading tells. None for 'other' files.
    Raises ModelError for files that do not parse as their format.

    parsed_sha256: the sha256 of bytes the caller has already parsed without error (inspect_model's
    facts.sha256). When the bytes read now hash the same, they are not parsed again before loading
    (a .tflite parse is pure Python: ~0.02 CPU-s for a MobileNetV2); the file is always re-read and
    re-hashed, so a file changed since it was inspected is parsed in full.
    """
    path = Path(path)
    fmt = model_format(path)
    if fmt not in ("tflite", "onnx"):
        return None
    data = _read(path)
    parsed = parsed_sha256 is not None and hashlib.sha256(data).hexdigest() == parsed_sha256
    if fmt == "tflite":
        model = None if parsed else _parse_tflite(path, data)
        message = _litert_load_error(data, use_xnnpack)
        if message is None:
            return None
        model = model or _parse_tflite(path, data)  # a refusal names its operators from the parsed graph
        return RuntimeRefusal("litert", _first_lines(message), tuple(_tflite_unsupported_ops(message, model, use_xnnpack)))
    if fmt == "onnx":
        if not parsed:
            _parse_onnx(path, data)
        message = _onnxruntime_load_error(data)
        if message is None:
            return None
        return RuntimeRefusal("onnxruntime", _first_lines(message), tuple(_onnxruntime_ops_named_in_error(message)))
    return None


def find_unsupported_ops(path: Path, *, use_xnnpack: bool = True) -> list[str]:
    """Operators the installed runtime (LiteRT / onnxruntime) names when it refuses the model; [] when it loads.

    TFLite: custom ops no resolver provides (by custom_code) and builtin codes this LiteRT does
    not know ('BUILTIN_<code>'), or an op at a version it lacks ('NAME v<version>').
    ONNX: the op types ONNX Runtime's error names, as 'Op' in the default domain and 'domain:Op' elsewhere.
    A model the runtime refuses for another reason gives [] here: runtime_refusal() has the verdict.
    """
    refusal = runtime_refusal(path, use_xnnpack=use_xnnpack)
    return [] if refusal is None else list(refusal.ops)


def _first_lines(message: str, limit: int = 600) -> str:
    text = " ".join(line.strip() for line in message.strip().splitlines()[:4] if line.strip())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _unique(names: list[str]) -> list[str]:
    return list(dict.fromkeys(names))


# --- TFLite -----------------------------------------------------------------------------------

TFLITE_DTYPES: dict[int, str] = {
    value: name.lower()  # FLOAT32 -> float32, BFLOAT16 -> bfloat16: the numpy / ml_dtypes names
    for name, value in vars(tflite_schema.TensorType).items()
    if not name.startswith("_") and isinstance(value, int)
}


def _tflite_tensor_info(tensor: tflite_schema.TensorT) -> TensorInfo:
    signature = _ints(tensor.shapeSignature)
    dims = signature if signature else _ints(tensor.shape)
    shape: list[int | str] = [DYNAMIC_DIM if dim < 0 else dim for dim in dims]
    return TensorInfo(
        name=_decode(tensor.name),
        shape=shape,
        dtype=TFLITE_DTYPES.get(int(tensor.type), f"tflite_type_{tensor.type}"),
    )


def _fill_tflite_facts(facts: ModelFacts, model: tflite_schema.ModelT) -> None:
    codes = model.operatorCodes or []
    buffers = model.buffers or []
    main = model.subgraphs[0]
    tensors = main.tensors or []
    facts.inputs = [_tflite_tensor_info(tensors[i]) for i in _ints(main.inputs)]
    facts.outputs = [_tflite_tensor_info(tensors[i]) for i in _ints(main.outputs)]

    op_types: Counter[str] = Counter()
    constant_elements: dict[int, int] = {}  # buffer index -> elements; a shared buffer counts once
    for subgraph in model.subgraphs:
        for operator in subgraph.operators or []:
            op_types[_tflite_op_name(codes[operator.opcodeIndex])] += 1
        for tensor in subgraph.tensors or []:
            if tensor.buffer > 0 and _tflite_buffer_has_data(buffers[tensor.buffer]):
                constant_elements[tensor.buffer] = math.prod(_ints(tensor.shape))
    facts.op_count = sum(op_types.values())
    facts.op_types = dict(op_types)
    facts.param_count = sum(constant_elements.values())


def _tflite_unsupported_ops(message: str, model: tflite_schema.ModelT, use_xnnpack: bool) -> list[str]:
    """The operators behind LiteRT's refusal `message`: those it names, unknown builtins, missing custom ops."""
    codes = model.operatorCodes or []
    used = {op.opcodeIndex for sg in model.subgraphs for op in sg.operators or []}
    custom_codes = [
        _tflite_op_name(codes[i])
        for i in sorted(used)
        if _tflite_builtin_code(codes[i]) == tflite_schema.BuiltinOperator.CUSTOM
    ]
    unknown_builtins = [
        _tflite_op_name(codes[i]) for i in sorted(used) if _tflite_builtin_code(codes[i]) not in _BUILTIN_NAMES
    ]
    unsupported = [*_tflite_ops_named_in_error(message), *unknown_builtins]
    unsupported += [name for name in custom_codes if name not in unsupported and not _litert_has_custom_op(name, use_xnnpack)]
    return _unique(unsupported)


@contextlib.contextmanager
def _without_delegate_banner() -> Iterator[None]:
    """LiteRT's C++ side prints "INFO: Created TensorFlow Lite XNNPACK delegate" on fd 2 for every
    interpreter; validation is not a run, so that line is dropped and anything else passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            rest = [line for line in captured.read().splitlines(keepends=True) if b"XNNPACK delegate" not in line]
            if rest:
                os.write(2, b"".join(rest))


def _litert_load_error(model_content: bytes, use_xnnpack: bool) -> str | None:
    """LiteRT's message when it cannot build and allocate the model as a run would, else None."""
    try:
        with _without_delegate_banner():
            litert_interpreter(model_content, threads=1, use_xnnpack=use_xnnpack).allocate_tensors()
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return None


_TFLITE_ERROR_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"unresolved custom op: ([^\s.]+(?:\.[^\s.]+)*)\."), "{0}"),
    (re.compile(r"Didn't find op for builtin opcode '(\w+)' version '(\d+)'"), "{0} v{1}"),
    (re.compile(r"builtin_code out of range: (\d+)"), "BUILTIN_{0}"),
    (re.compile(r"Could not get '([\w.]+)' operation parameters"), "{0}"),
)


def _tflite_ops_named_in_error(message: str) -> list[str]:
    names: list[str] = []
    for pattern, template in _TFLITE_ERROR_PATTERNS:
        for match in pattern.finditer(message):
            names.append(template.format(*match.groups()))
    return names


@functools.lru_cache(maxsize=256)
def _litert_has_custom_op(custom_code: str, use_xnnpack: bool) -> bool:
    """Whether LiteRT's resolver provides `custom_code` (some custom ops ship built in)."""
    message = _litert_load_error(single_custom_op_tflite(custom_code), use_xnnpack)
    return message is None or "unresolved custom op" not in message


# --- ONNX -------------------------------------------------------------------------------------


def _onnx_dtype(elem_type: int) -> str:
    if elem_type == onnx.TensorProto.STRING:
        return "string"
    try:
        return str(onnx.helper.tensor_dtype_to_np_dtype(elem_type).name)
    except (KeyError, ValueError, TypeError):
        return onnx.TensorProto.DataType.Name(elem_type).lower() if elem_type else "undefined"


def _onnx_value_info(value: onnx.ValueInfoProto) -> TensorInfo:
    kind = value.type.WhichOneof("value")
    if kind != "tensor_type":
        return TensorInfo(name=value.name, shape=[], dtype=kind or "undefined")  # sequence, map, optional
    tensor_type = value.type.tensor_type
    shape: list[int | str] = []
    for dim in tensor_type.shape.dim:
        if dim.HasField("dim_value"):
            shape.append(int(dim.dim_value))
        else:
            shape.append(dim.dim_param or DYNAMIC_DIM)
    return TensorInfo(name=value.name, shape=shape, dtype=_onnx_dtype(tensor_type.elem_type))


def _onnx_op_key(node: onnx.NodeProto) -> str:
    return node.op_type if node.domain in DEFAULT_ONNX_DOMAINS else f"{node.domain}:{node.op_type}"


def _onnx_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node, including those in If/Loop/Scan bodies."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _onnx_nodes(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for subgraph in attribute.graphs:
                    yield from _onnx_nodes(subgraph)


def _onnx_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """The graph and every If/Loop/Scan body inside it, at any depth."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _onnx_graphs(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for subgraph in attribute.graphs:
                    yield from _onnx_graphs(subgraph)


def _constant_node_elements(node: onnx.NodeProto) -> int:
    """Elements of the tensor a Constant node makes (its one value attribute)."""
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.TENSOR:
            return int(math.prod(attribute.t.dims))
        if attribute.type == onnx.AttributeProto.SPARSE_TENSOR:
            return int(math.prod(attribute.sparse_tensor.dims))
        if attribute.type in (onnx.AttributeProto.FLOATS, onnx.AttributeProto.INTS, onnx.AttributeProto.STRINGS):
            return len(attribute.floats) + len(attribute.ints) + len(attribute.strings)
        if attribute.type in (onnx.AttributeProto.FLOAT, onnx.AttributeProto.INT, onnx.AttributeProto.STRING):
            return 1
    return 0


def _onnx_param_count(graph: onnx.GraphProto) -> int:
    """Elements of every constant tensor: initializers (sparse too) and Constant nodes, in the main graph
    and in every If/Loop/Scan body (PyTorch and Paddle2ONNX exports keep weights in Constant nodes, often
    inside If branches). A shape initializer feeding only a ConstantOfShape counts as the tensor it makes:
    the model zoo's 'light' models keep only weight shapes and rebuild the weights at load time.
    """
    graphs = list(_onnx_graphs(graph))
    initializers = {init.name: init for g in graphs for init in g.initializer}
    materialised: dict[str, int] = {}
    consumers: Counter[str] = Counter()
    for node in _onnx_nodes(graph):
        consumers.update(node.input)
        if node.op_type == "ConstantOfShape" and node.input and node.input[0] in initializers:
            shape = onnx.numpy_helper.to_array(initializers[node.input[0]])
            materialised[node.input[0]] = int(np.prod(shape, dtype=np.int64))
    total = 0
    for g in graphs:
        for init in g.initializer:
            only_a_shape = init.name in materialised and consumers[init.name] == 1
            total += materialised[init.name] if only_a_shape else int(math.prod(init.dims))
        total += sum(int(math.prod(sparse.dims)) for sparse in g.sparse_initializer)
        total += sum(_constant_node_elements(node) for node in g.node
                     if node.op_type == "Constant" and node.domain in DEFAULT_ONNX_DOMAINS)
    return total


def _fill_onnx_facts(facts: ModelFacts, model: onnx.ModelProto) -> None:
    graph = model.graph
    initializer_names = {init.name for init in graph.initializer}
    # Before IR 4 every initializer was also listed as a graph input: those are weights, not inputs.
    facts.inputs = [_onnx_value_info(v) for v in graph.input if v.name not in initializer_names]
    facts.outputs = [_onnx_value_info(v) for v in graph.output]
    op_types = Counter(_onnx_op_key(node) for node in _onnx_nodes(graph))
    facts.op_count = sum(op_types.values())
    facts.op_types = dict(op_types)
    facts.param_count = _onnx_param_count(graph)


def _onnxruntime_load_error(data: bytes) -> str | None:
    try:
        # onnxruntime print()s an "EP Error ... falling back" banner before re-raising: keep it off stdout.
        with contextlib.redirect_stdout(io.StringIO()):
            onnx_session(data, threads=1)
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph/... classes
        return str(exc)
    return None


_ONNX_ERROR_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Could not find an implementation for (\w+)\((\d+)\)"), "{0}"),
    (re.compile(r"Fatal error: ([\w.]*):(\w+)\(-?\d+\) is not a registered function/op"), "{0}:{1}"),
    (re.compile(r"No Op registered for (\w+) with domain_version"), "{0}"),
    (re.compile(r'In Node, \("[^"]*", (\w+), "([^"]*)", -?\d+\).*?No opset import for domain'), "{1}:{0}"),
    (re.compile(r"Unrecognized (?:op|operator)[^\w]*(\w+)"), "{0}"),
)


def _onnxruntime_ops_named_in_error(message: str | None) -> list[str]:
    if not message:
        return []
    names: list[str] = []
    for pattern, template in _ONNX_ERROR_PATTERNS:
        for match in pattern.finditer(message):
            # Default-domain ops are named without a domain, as in ModelFacts.op_types.
            names.append(template.format(*match.groups()).removeprefix("ai.onnx:").removeprefix(":"))
    return _unique(names)
