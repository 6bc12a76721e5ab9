"""Built-in benchmark of an .onnx model with ONNX Runtime (CPU, intra_op_num_threads)."""

from __future__ import annotations

import dataclasses
import re
import tempfile
import time
from pathlib import Path

import numpy as np

from farm.agents.harness.memory import status_kib
from farm.agents.harness.dataset import run_dataset
from farm.agents.harness.inputs import InputShapeError, feed, resolve_shape
from farm.agents.harness.task import HarnessOutput, HarnessTask
from farm.agents.harness.timing import time_inferences
from farm.agents.harness.tflite_runner import ModelRejected
from farm.agents.harness.onnxruntime_profile import control_flow_parents, ort_op_profile_file
from farm.models.runtimes import onnx_session
from farm.proto.op_profile import bounded

PROFILED_RUNS = 20  # inferences of the profiled pass: the first (cold) is kept apart from the average
# The profiler holds every event in memory until the pass ends, and a model with a Loop logs its body's
# nodes once per iteration: one run's trace decides how many runs fit under this many bytes of trace.
MAX_TRACE_BYTES = HarnessTask.max_trace_bytes

_ORT_DTYPES = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_,
}
_NO_KERNEL = re.compile(r"Could not find an implementation for (\w+)\(")
_NO_DOMAIN = re.compile(r"(?:No opset import for domain|Unrecognized attribute|No Op registered for) '?([\w.]+)'?")


def _explain(error: Exception) -> str:
    text = str(error).strip()
    for pattern in (_NO_KERNEL, _NO_DOMAIN):
        m = pattern.search(text)
        if m:
            return f"unsupported operator {m.group(1)}: ONNX Runtime has no kernel for it ({text.splitlines()[0][:300]})"
    return text


def run(task: HarnessTask, out: HarnessOutput, rss_now) -> None:
    import onnxruntime as ort

    out.runtime = "onnxruntime"
    out.tool_versions["onnxruntime"] = ort.__version__
    out.baseline_rss_bytes = rss_now()
    t0 = time.perf_counter_ns()
    try:
        session = onnx_session(task.model_path, threads=task.threads)
    except Exception as e:  # ORT raises its own pybind exception types for every load failure
        raise ModelRejected(_explain(e)) from e
    out.init_ms = (time.perf_counter_ns() - t0) / 1e6
    rng = np.random.default_rng(task.seed)
    feeds = {}
    metadata = dict(session.get_modelmeta().custom_metadata_map)
    for i in session.get_inputs():
        declared: list[int | str | None] = [d if isinstance(d, int) else None for d in i.shape]
        shape = resolve_shape(i.name, declared, layout="nchw", batch_size=task.batch_size,
                              input_size=task.input_size, overrides=task.input_shapes)
        fixed = [d for d in i.shape]
        for axis, (want, have) in enumerate(zip(shape, fixed)):
            if isinstance(have, int) and have > 0 and have != want:
                raise ModelRejected(
                    f"input {i.name!r} has a fixed dimension {axis} of {have} but the run asks for {want} "
                    f"(batch_size / input_size); export the model with a dynamic dimension there"
                )
        out.input_shapes[i.name] = shape
        dtype = _ORT_DTYPES.get(i.type)
        if dtype is None:
            raise ModelRejected(f"input {i.name!r} has type {i.type}, which the built-in benchmark cannot fill")
        try:
            feeds[i.name], out.input_values[i.name] = feed(i.name, shape, np.dtype(dtype), task.inputs.get(i.name),
                                                           rng, metadata, task.vocab_size)
        except InputShapeError as e:
            raise ModelRejected(str(e)) from e
    try:
        time_inferences(lambda: session.run(None, feeds), out, warmup=task.warmup, iterations=task.iterations)
    except Exception as e:
        if isinstance(e, MemoryError):
            raise
        raise ModelRejected(_explain(e)) from e
    if task.dataset is not None:  # after the timed loop, so it never touches the timings
        out.peak_rss_bytes = status_kib("VmHWM")
        names = [o.name for o in session.get_outputs()]
        try:
            out.accuracy = run_dataset(task.dataset, lambda f: dict(zip(names, session.run(None, f))), feeds, names)
        except Exception as e:
            if isinstance(e, MemoryError):
                raise
            raise ModelRejected(f"the dataset pass failed: {_explain(e)}") from e
    if task.op_profiling:
        out.peak_rss_bytes = status_kib("VmHWM")  # the timed session's peak, before a second session exists
        del session
        profile_ops(task, feeds, out, task.max_trace_bytes)


def profile_ops(task: HarnessTask, feeds: dict, out: HarnessOutput, max_trace_bytes: int = MAX_TRACE_BYTES) -> None:
    """A separate, traced session after the timed loop, so tracing never slows the timings it sits beside.

    Bounded: one traced run first; its trace's size sets how many runs the full pass may trace (a trace
    of one run over max_trace_bytes gives no profile). Whatever fails here, memory included, leaves the
    timed figures as they are and says why in out.op_profile_note."""
    wanted = max(2, min(task.iterations, PROFILED_RUNS))
    notes = []
    try:
        with tempfile.TemporaryDirectory(prefix="farm-ort-profile-") as folder:
            one_run = _traced(task, feeds, Path(folder) / "probe", 1)
            size = one_run.stat().st_size
            if size > max_trace_bytes:
                out.op_profile_note = (f"no op profile: the profiler's trace of one run is {_size(size)}, "
                                       f"over the {_size(max_trace_bytes)} it may take (each node "
                                       f"is traced each time it runs: a Loop's body once per iteration)")
                return
            runs = min(wanted, max(1, max_trace_bytes // max(size, 1)))
            trace = one_run
            if runs >= 2:
                one_run.unlink()
                trace = _traced(task, feeds, Path(folder) / "ops", runs)
            if runs < wanted:
                notes.append(f"op profile of {runs} run(s), not {wanted}: one run's trace is {_size(size)} "
                             f"and the trace may take {_size(max_trace_bytes)}")
            rows = ort_op_profile_file(trace, control_flow_parents(Path(task.model_path)))
    except MemoryError:
        out.op_profile_note = "the profiled pass ran out of memory, so there is no op profile; the timings stand"
        return
    except Exception as e:  # the timed figures stand; the run says why it has no op profile
        out.op_profile_note = f"the profiled pass failed, so there is no op profile: {_explain(e)[:300]}"
        return
    out.op_profile = [dataclasses.asdict(r) for r in bounded(rows)]
    out.op_profile_note = "; ".join(notes)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _traced(task: HarnessTask, feeds: dict, prefix: Path, runs: int) -> Path:
    """The trace file of `runs` inferences of a fresh profiling session."""
    session = onnx_session(task.model_path, threads=task.threads, profile_prefix=str(prefix))
    for _ in range(runs):
        session.run(None, feeds)
    return Path(session.end_profiling())
