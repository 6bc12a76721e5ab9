"""Loading a model into its runtime, and the input shapes a run feeds it.

The one place both sides of a run share: the validator (models.facts, before a job is
accepted) and the harness (inside the sandbox) call these same functions, so a model the
validator accepts is a model the harness can load, and the other way round. Imports stay
light: the runtimes are native libraries, loaded on first use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class InputShapeError(ValueError):
    """A shape the job must fix (names the input and what to set)."""


def litert_interpreter(model: str | bytes, *, threads: int, use_xnnpack: bool) -> Any:
    """A LiteRT interpreter as a run builds it: AUTO (XNNPACK and the ops it provides) or plain builtins."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    resolver = OpResolverType.AUTO if use_xnnpack else OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
    source = {"model_content": model} if isinstance(model, bytes) else {"model_path": model}
    return Interpreter(**source, num_threads=threads, experimental_op_resolver_type=resolver)


def onnx_session(model: str | bytes, *, threads: int, profile_prefix: str | None = None) -> Any:
    """An ONNX Runtime CPU session as a run builds it; with profile_prefix, one that traces every node
    (its trace file is named by `session.end_profiling()`)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # errors only: no "removing unused initializer" chatter
    return ort.InferenceSession(model, sess_options=options, providers=["CPUExecutionProvider"])


def resolve_shape(name: str, declared: Sequence[int | str | None], *, layout: str, batch_size: int,
                  input_size: int | None, overrides: dict[str, list[int]]) -> list[int]:
    """Fill batch, spatial and explicitly given dimensions of one input.

    layout is "nhwc" (TFLite) or "nchw" (ONNX): where the spatial dims of a 4-D image are.
    """
    shape: list[int | None]
    if name in overrides:
        shape = list(overrides[name])
        if len(shape) != len(declared):
            raise InputShapeError(f"input {name!r} has {len(declared)} dimensions, input_shapes gives {len(shape)}")
    else:
        shape = [d if isinstance(d, int) and d > 0 else None for d in declared]
    # The batch fills a dynamic first dimension; a fixed one only when a batch other than 1 is asked for:
    # a fixed leading 2 is often not a batch at all (an RNN state's layers, silero-vad's [2, 1, 128]). A swept batch
    # (other than 1) sets a dynamic first dimension even where input_shapes gives the rest: the run is the batch
    # its results claim (issue 30; it used to keep input_shapes' batch and multiply samples/s by the swept one).
    first_dynamic = bool(declared) and not (isinstance(declared[0], int) and declared[0] > 0)
    if shape and (shape[0] is None or (name not in overrides and batch_size != 1)
                  or (first_dynamic and batch_size != 1)):
        shape[0] = batch_size
    if input_size is not None and len(shape) == 4:
        spatial = (1, 2) if layout == "nhwc" else (2, 3)
        for i in spatial:
            shape[i] = input_size
    missing = [i for i, d in enumerate(shape) if d is None]
    if missing:
        raise InputShapeError(
            f"input {name!r} has dynamic dimension(s) {missing} in shape {declared}; "
            f"set workload.input_shapes.{name} to a full shape"
        )
    return [d for d in shape if d is not None]  # none is, after the check above
