"""Built-in benchmark of a .tflite model with the LiteRT interpreter (XNNPACK, num_threads)."""

from __future__ import annotations

import re
import time

import numpy as np

from farm.agents.harness.inputs import InputShapeError, feed, resolve_shape
from farm.agents.harness.task import HarnessOutput, HarnessTask
from farm.agents.harness.timing import time_inferences
from farm.models.runtimes import litert_interpreter


class ModelRejected(Exception):
    """The runtime refused the model (corrupt file, unsupported operator): a job failure."""


_UNRESOLVED_OP = re.compile(r"(?:unresolved custom op|Didn't find op for builtin opcode|op builtin_code out of range)[:\s'\"]*([\w.\-]+)", re.IGNORECASE)


def _explain(error: Exception) -> str:
    text = str(error)
    m = _UNRESOLVED_OP.search(text)
    if m:
        return f"unsupported operator {m.group(1)}: the LiteRT runtime has no kernel for it ({text.strip().splitlines()[0]})"
    return text.strip()


def run(task: HarnessTask, out: HarnessOutput, rss_now) -> None:
    import ai_edge_litert.interpreter  # noqa: F401  the runtime loads before the baseline and the init timer

    out.runtime = "litert"
    out.tool_versions["ai-edge-litert"] = _version()
    out.baseline_rss_bytes = rss_now()
    t0 = time.perf_counter_ns()
    try:
        interp = litert_interpreter(task.model_path, threads=task.threads, use_xnnpack=task.use_xnnpack)
        details = interp.get_input_details()
        for d in details:
            declared = [int(x) for x in d.get("shape_signature", d["shape"])]
            shape = resolve_shape(d["name"], declared, layout="nhwc", batch_size=task.batch_size,
                                  input_size=task.input_size, overrides=task.input_shapes)
            if list(d["shape"]) != shape:
                interp.resize_tensor_input(d["index"], shape, strict=False)
            out.input_shapes[d["name"]] = shape
        interp.allocate_tensors()
    except (ValueError, RuntimeError) as e:
        raise ModelRejected(_explain(e)) from e
    out.init_ms = (time.perf_counter_ns() - t0) / 1e6
    rng = np.random.default_rng(task.seed)
    for d in interp.get_input_details():
        try:
            data, out.input_values[d["name"]] = feed(d["name"], list(d["shape"]), d["dtype"], task.inputs.get(d["name"]),
                                                     rng, {}, task.vocab_size)
        except InputShapeError as e:
            raise ModelRejected(str(e)) from e
        interp.set_tensor(d["index"], data)
    try:
        time_inferences(interp.invoke, out, warmup=task.warmup, iterations=task.iterations)
    except (ValueError, RuntimeError) as e:
        raise ModelRejected(_explain(e)) from e
    if task.dataset is not None:  # after the timed loop, so it never touches the timings
        try:
            out.accuracy = dataset_pass(interp, task)
        except (ValueError, RuntimeError) as e:
            raise ModelRejected(f"the dataset pass failed: {_explain(e)}") from e
    if task.op_profiling:
        out.op_profile_note = (f"no per-operator profile: the LiteRT Python interpreter ({_version()}) exposes no "
                               "op profiler; benchmark_model on a phone or board gives one")


def dataset_pass(interp, task: HarnessTask) -> dict:
    """The dataset's samples one at a time (batch 1), outputs dequantized where the model quantizes them."""
    from farm.agents.harness.dataset import run_dataset

    inputs = {d["name"]: d for d in interp.get_input_details()}
    assert task.dataset is not None
    fixed = {name: interp.get_tensor(d["index"]) for name, d in inputs.items()}
    if task.batch_size != 1:  # the timed loop ran another batch: a sample is one
        for name, d in inputs.items():
            interp.resize_tensor_input(d["index"], [1, *list(d["shape"])[1:]], strict=False)
        interp.allocate_tensors()
        fixed = {name: value[:1] for name, value in fixed.items()}
    outputs = interp.get_output_details()

    def infer(feeds: dict) -> dict:
        for name, value in feeds.items():
            interp.set_tensor(inputs[name]["index"], np.ascontiguousarray(value, dtype=inputs[name]["dtype"]))
        interp.invoke()
        found = {}
        for d in outputs:
            value = interp.get_tensor(d["index"])
            scale, zero = d.get("quantization", (0.0, 0))
            found[d["name"]] = (value.astype(np.float32) - zero) * scale if scale else value
        return found

    return run_dataset(task.dataset, infer, fixed, [d["name"] for d in outputs])


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("ai-edge-litert")
    except Exception:
        return "unknown"
