#!/usr/bin/env python3
"""farm's board harness: the one file a board needs to run farm's workloads.

The agent pushes this file to a Jetson or any Linux board by its sha256, checks the hash on the
board before each run, and runs it with the board's own python3. It needs the standard library
of Python 3.6 or newer (JetPack 4 ships 3.6), plus, for the built-in benchmark, numpy and the
runtime the model asks for (tflite_runtime or ai_edge_litert, onnxruntime).

    python3 board_harness.py run TASK.json    a benchmark or a script, under the board's telemetry
    python3 board_harness.py env VENV_ROOT    make (or reuse) the venv for the requirements on stdin

Each prints exactly one result line, `@@farm-harness <json>`, last; the agent's parser
(farm.agents.boards.harness_output) reads it. A script's own output never reaches stdout: only its
timing lines and a bounded tail are kept, so a script that prints gigabytes cannot flood the link.

Kept 3.6-compatible (`vermin --target=3.6-` in the tests): no dataclasses, no walrus, no
`from __future__ import annotations`, no subprocess capture_output, no perf_counter_ns.
"""

import ctypes
import fcntl
import hashlib
import json
import math
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections import deque

PROTOCOL = 1
RESULT_MARK = "@@farm-harness "
# The script-timing protocol, shared with the sim (farm.agents.harness.script_runner imports these).
TIMING_KEYS = ("latency_ms", "inference_ms")
# The timing line nearly every script prints, `{"latency_ms": 1.5}`: one timing key, a JSON number that is not
# negative (a minus sign, -0 included, takes json.loads's path) and at most 300 digits before any fraction or exponent
# (float() of such text is the value json.loads gives for it; a longer integer overflows float() there). JSON's own
# whitespace only (the line is already stripped); anything else is read by json.loads.
PLAIN_TIMING_TEXT = (r'\{[ \t\n\r]*"(' + "|".join(TIMING_KEYS) + r')"[ \t\n\r]*:[ \t\n\r]*'
                     r'((?:0|[1-9][0-9]{0,299})(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)[ \t\n\r]*\}')
PLAIN_TIMING = re.compile(PLAIN_TIMING_TEXT + r"\Z")
MAX_TIMINGS = 200000  # more timing lines than this are counted, not kept: the result must stay small
TAIL_LINES = 40
TAIL_LINE_CHARS = 400
READ_CHUNK = 65536  # a line longer than this is read in pieces: no single line can exhaust memory
OUTPUT_DRAIN_S = 2.0
MAX_ARCHIVE_ENTRIES = 10000
# pip's words when the board could not reach the package index: the board's fault, not the job's
NETWORK_WORDS = ("NewConnectionError", "Could not fetch URL", "Temporary failure in name resolution",
                 "Network is unreachable", "ConnectTimeoutError", "ReadTimeoutError", "ProxyError",
                 "No route to host", "Connection refused")

# pip's words when nothing it can install matches the board (an x86-only package on an ARM board)
NO_BUILD = re.compile(r"No matching distribution found for ([A-Za-z0-9._-]+)")


class BadTiming(ValueError):
    """A timing line whose value no statistic can use (NaN, infinite, negative)."""


class JobError(Exception):
    """The job's own fault (its model, its script, its requirements): never retried."""


class BoardError(Exception):
    """The board cannot do what every job needs (an agent of another protocol): infrastructure.
    A missing runtime is the job's (fail fast, no quarantine): the message says what to install."""


def parse_timing_line(line):
    """The per-inference time in ms a script printed on this line, if any.

    Raises BadTiming for a timing key whose value is not a finite number >= 0.
    """
    line = line.strip()
    if not line.startswith("{"):
        return None
    plain = PLAIN_TIMING.match(line)
    if plain is not None:  # what json.loads would give, at a fifth of the cost (a script may print millions)
        return _checked_timing(plain.group(1), float(plain.group(2)))
    try:
        data = json.loads(line)  # accepts NaN and Infinity; 1e400 becomes inf
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    for key in TIMING_KEYS:
        value = data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return _checked_timing(key, value)
    return None


def _checked_timing(key, value):
    try:
        value = float(value)
    except OverflowError:  # an integer of more than 308 digits: no float holds it (it stopped the reader before)
        value = math.inf
    if not math.isfinite(value) or value < 0:
        raise BadTiming("{} is {!r}; a timing must be a finite number of milliseconds >= 0".format(key, value))
    return value


def emit(result):
    """The one line the agent reads: last on stdout, after anything a runtime printed."""
    sys.stdout.flush()
    sys.stdout.write("\n" + RESULT_MARK + json.dumps(result, allow_nan=False, sort_keys=True) + "\n")
    sys.stdout.flush()


def new_result():
    return {"protocol": PROTOCOL, "ok": False, "failure_class": None, "message": "", "runtime": "",
            "init_ms": None, "first_ms": None, "warmup_ms": [], "iterations_ms": [], "whole_run_s": None,
            "measure_wall_s": None, "baseline_rss_bytes": None, "peak_rss_bytes": None, "input_shapes": {},
            "input_values": {},
            "tool_versions": {"python": platform.python_version()}, "process_memory_avg_bytes": None,
            "process_memory_peak_bytes": None, "process_memory_samples": 0, "output_bytes": 0,
            "output_tail": "", "timings_dropped": 0, "leftovers": [], "accelerator": None}


def status_bytes(field, pid="self"):
    try:
        with open("/proc/{}/status".format(pid)) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# ---- the built-in benchmark -------------------------------------------------------------------

def resolve_shape(name, declared, layout, batch_size, input_size, overrides):
    """Fill batch, spatial and explicitly given dimensions of one input (the sim's rule:
    farm.models.runtimes.resolve_shape; a test keeps the two equal)."""
    if name in overrides:
        shape = list(overrides[name])
        if len(shape) != len(declared):
            raise JobError("input {!r} has {} dimensions, input_shapes gives {}".format(name, len(declared), len(shape)))
    else:
        shape = [d if isinstance(d, int) and d > 0 else None for d in declared]
    first_dynamic = bool(declared) and not (isinstance(declared[0], int) and declared[0] > 0)
    if shape and (shape[0] is None or (name not in overrides and batch_size != 1)
                  or (first_dynamic and batch_size != 1)):  # as models/runtimes.py: a swept batch is the batch run
        shape[0] = batch_size
    if input_size is not None and len(shape) == 4:
        for i in ((1, 2) if layout == "nhwc" else (2, 3)):
            shape[i] = input_size
    missing = [i for i, d in enumerate(shape) if d is None]
    if missing:
        raise JobError("input {!r} has dynamic dimension(s) {} in shape {}; set workload.input_shapes.{} to a full "
                       "shape".format(name, missing, declared, name))
    return [int(d) for d in shape]


def random_input(np, shape, dtype, rng):
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return rng.random_sample(shape).astype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.randint(max(info.min, 0), min(info.max, 127) + 1, size=shape).astype(dtype)
    if dtype.kind == "b":
        return rng.randint(0, 2, size=shape).astype(bool)
    raise JobError("inputs of type {} are not supported by the built-in benchmark".format(dtype))


SAMPLE_RATE_NAMES = ("sr", "sample_rate", "samplerate", "sampling_rate", "fs")


def feed(np, name, shape, dtype, spec, rng, vocab_size=None):
    """What one input gets and where its values came from, as the sim's harness (agents/harness/inputs.py)
    decides: workload.inputs' value or random range, else 16000 for a sample-rate input, else random."""
    dtype = np.dtype(dtype)
    spec = spec or {}
    if spec.get("value") is not None:
        try:
            values = np.broadcast_to(np.asarray(spec["value"], dtype=np.float64), shape)
        except ValueError:
            raise JobError("workload.inputs.{}: a value of shape {} does not fit the input's shape {}".format(
                name, list(np.shape(spec["value"])), shape))
        where = "file {}".format(spec["file"]) if spec.get("file") else "value"
        return checked(np, name, values, dtype), "{} (given)".format(where)
    if spec.get("random") is not None:
        low, high = float(spec["random"]["low"]), float(spec["random"]["high"])
        if dtype.kind in "iu":
            values = rng.randint(int(math.ceil(low)), int(math.floor(high)) + 1, size=shape)
        else:
            values = rng.uniform(low, high, size=shape)
        return checked(np, name, values, dtype), "random uniform [{:g}, {:g}] (given)".format(low, high)
    lower = name.lower()
    if dtype.kind in "iub" and (lower == "mask" or lower.endswith("_mask")):  # as agents/harness/inputs.py
        return np.ones(shape, dtype=dtype), "value 1 (default for an attention mask: every token attended)"
    if dtype.kind in "iu" and lower in ("token_type_ids", "segment_ids", "type_ids", "token_types"):
        return np.zeros(shape, dtype=dtype), "value 0 (default for token type ids: one segment)"
    if dtype.kind in "iu" and lower == "position_ids" and shape:
        return (np.broadcast_to(np.arange(shape[-1]), shape).astype(dtype),
                "0, 1, 2, ... along the last axis (default for position ids)")
    if dtype.kind in "iu" and lower in ("input_ids", "token_ids", "ids") and vocab_size is not None:
        high = min(int(vocab_size) - 1, int(np.iinfo(dtype).max))  # workload.vocab_size, as agents/harness/inputs.py
        return (rng.randint(0, high + 1, size=shape).astype(dtype),
                "random token ids [0, {}] (workload.vocab_size {})".format(high, vocab_size))
    if lower in SAMPLE_RATE_NAMES and dtype.kind in "iuf":
        return np.full(shape, 16000, dtype=dtype), "value 16000 (default for a sample-rate input)"
    return random_input(np, shape, dtype, rng), "random"


def checked(np, name, values, dtype):
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if np.any(values != np.round(values)) or values.min() < info.min or values.max() > info.max:
            raise JobError("workload.inputs.{}: input {!r} is {}, so its values must be whole numbers in [{}, {}]".format(
                name, name, dtype, info.min, info.max))
    return np.ascontiguousarray(values).astype(dtype)


def time_inferences(invoke, out, warmup, iterations, loop_probe=None):
    """The sim's timing loop: the first inference apart, warmups, then the timed iterations.
    loop_probe: called just before and just after the timed loop, outside every timed span; its two
    readings go to out["loop_probe"] (the sim judges contention over the loop with them)."""
    clock = time.perf_counter
    t0 = clock()
    invoke()
    out["first_ms"] = (clock() - t0) * 1e3
    for _ in range(max(0, warmup - 1)):  # the first inference counts as the first warmup run
        t0 = clock()
        invoke()
        out["warmup_ms"].append((clock() - t0) * 1e3)
    samples = []
    before = loop_probe() if loop_probe is not None else None
    start = clock()
    for _ in range(iterations):
        t0 = clock()
        invoke()
        samples.append(clock() - t0)
    out["measure_wall_s"] = clock() - start
    if loop_probe is not None:
        out["loop_probe"] = (before, loop_probe())
    out["iterations_ms"] = [s * 1e3 for s in samples]


def tflite_interpreter_class(out):
    """tflite_runtime (what Jetsons and Pis usually have), else LiteRT, else full TensorFlow."""
    try:
        from tflite_runtime.interpreter import Interpreter
        import tflite_runtime
        out["tool_versions"]["tflite_runtime"] = getattr(tflite_runtime, "__version__", "unknown")
        return Interpreter, "tflite_runtime"
    except ImportError:
        pass
    try:
        from ai_edge_litert.interpreter import Interpreter
        out["tool_versions"]["ai-edge-litert"] = "present"
        return Interpreter, "litert"
    except ImportError:
        pass
    try:
        import tensorflow as tf
        out["tool_versions"]["tensorflow"] = tf.__version__
        return tf.lite.Interpreter, "tensorflow"
    except ImportError:
        raise JobError("this board's python ({}) has no TFLite runtime for a .tflite model: pip install "
                       "tflite-runtime or ai-edge-litert there, or send .onnx models".format(sys.executable))


def run_tflite(task, out):
    if (task.get("accelerator") or "cpu") != "cpu":
        raise JobError("the board harness runs .tflite models on the CPU only (LiteRT's GPU delegate is driven on "
                       "phones by benchmark_model); send the .onnx model for {}".format(task.get("accelerator")))
    import numpy as np
    interpreter_class, out["runtime"] = tflite_interpreter_class(out)
    out["baseline_rss_bytes"] = status_bytes("VmRSS")
    kwargs = {"model_path": task["model_path"], "num_threads": task["threads"]}
    if not task.get("use_xnnpack", True):
        try:  # plain builtin kernels, as the sim does with use_xnnpack: false
            from ai_edge_litert.interpreter import OpResolverType
            kwargs["experimental_op_resolver_type"] = OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
        except ImportError:
            pass
    t0 = time.perf_counter()
    try:
        interp = interpreter_class(**kwargs)
        for d in interp.get_input_details():
            declared = [int(x) for x in d.get("shape_signature", d["shape"])]
            shape = resolve_shape(d["name"], declared, "nhwc", task["batch_size"], task.get("input_size"),
                                  task.get("input_shapes") or {})
            if list(d["shape"]) != shape:
                interp.resize_tensor_input(d["index"], shape)
            out["input_shapes"][d["name"]] = shape
        interp.allocate_tensors()
    except (ValueError, RuntimeError) as e:
        raise JobError(str(e).strip())
    out["init_ms"] = (time.perf_counter() - t0) * 1e3
    rng = np.random.RandomState(task.get("seed", 0))  # numpy 1.13 on JetPack 4 has no default_rng
    for d in interp.get_input_details():
        data, out["input_values"][d["name"]] = feed(np, d["name"], list(d["shape"]), d["dtype"],
                                                    (task.get("inputs") or {}).get(d["name"]), rng,
                                                    task.get("vocab_size"))
        interp.set_tensor(d["index"], data)
    try:
        time_inferences(interp.invoke, out, task["warmup"], task["iterations"])
    except (ValueError, RuntimeError) as e:
        raise JobError(str(e).strip())
    if task.get("dataset"):  # after the timed loop: it never touches the timings
        details = dict((d["name"], d) for d in interp.get_input_details())
        fixed = dict((n, interp.get_tensor(d["index"])) for n, d in details.items())
        if task["batch_size"] != 1:  # a sample is one
            for d in details.values():
                interp.resize_tensor_input(d["index"], [1] + list(d["shape"])[1:])
            interp.allocate_tensors()
            fixed = dict((n, v[:1]) for n, v in fixed.items())
        outputs = interp.get_output_details()

        def infer(feeds):
            for name, value in feeds.items():
                interp.set_tensor(details[name]["index"], np.ascontiguousarray(value, dtype=details[name]["dtype"]))
            interp.invoke()
            found = {}
            for d in outputs:
                value = interp.get_tensor(d["index"])
                scale, zero = d.get("quantization", (0.0, 0))
                found[d["name"]] = (value.astype(np.float32) - zero) * scale if scale else value
            return found
        try:
            out["accuracy"] = dataset_pass(np, task["dataset"], infer, fixed, [d["name"] for d in outputs])
        except (ValueError, RuntimeError, KeyError) as e:
            raise JobError("the dataset pass failed: {}".format(str(e).strip()))


ORT_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
              "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int8)": "int8", "tensor(uint8)": "uint8",
              "tensor(bool)": "bool"}


# ONNX Runtime's execution provider for each compute unit the board harness can drive (issue 29)
ORT_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "gpu": "CUDAExecutionProvider",
                 "tensorrt": "TensorrtExecutionProvider"}


def ort_providers(ort, unit, precision):
    """The providers a session is asked for, most wanted first; JobError when this onnxruntime lacks the unit."""
    wanted = ORT_PROVIDERS.get(unit)
    if wanted is None:
        raise JobError("the board harness runs .onnx models on {} only; {} is not one (ask for it on a device "
                       "whose own tool drives it)".format(", ".join(sorted(ORT_PROVIDERS)), unit))
    available = ort.get_available_providers()
    if wanted not in available:
        raise JobError("this board's onnxruntime {} has no {} for accelerator {} (it has: {}); install the build "
                       "that has it (onnxruntime-gpu) or ask for accelerators: [cpu]".format(
                           ort.__version__, wanted, unit, ", ".join(available)))
    if unit in ("cuda", "gpu") and precision != "fp32":
        raise JobError("ONNX Runtime's CUDA provider computes a model in its own precision; for {} use "
                       "tensorrt:{} or a model exported in that precision".format(precision, precision))
    if wanted == "TensorrtExecutionProvider":
        options = {"trt_fp16_enable": precision == "fp16", "trt_int8_enable": precision == "int8"}
        return [(wanted, options), "CUDAExecutionProvider", "CPUExecutionProvider"]
    return [wanted] + (["CPUExecutionProvider"] if wanted != "CPUExecutionProvider" else [])


def run_onnx(task, out):
    import numpy as np
    try:
        import onnxruntime as ort
    except ImportError:
        raise JobError("this board's python ({}) has no onnxruntime for an .onnx model: pip install onnxruntime "
                       "there, or send .tflite models".format(sys.executable))
    out["runtime"] = "onnxruntime"
    out["tool_versions"]["onnxruntime"] = ort.__version__
    out["baseline_rss_bytes"] = status_bytes("VmRSS")
    t0 = time.perf_counter()
    try:
        options = ort.SessionOptions()
        options.intra_op_num_threads = task["threads"]
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        unit, precision = task.get("accelerator") or "cpu", task.get("precision") or "fp32"
        providers = ort_providers(ort, unit, precision)
        session = ort.InferenceSession(task["model_path"], sess_options=options, providers=providers)
    except JobError:
        raise
    except Exception as e:  # ORT raises its own pybind types for every load failure
        raise JobError(str(e).strip())
    got = session.get_providers()
    out["accelerator"] = {"unit": unit, "precision": precision, "providers": got[:8]}
    first = providers[0] if isinstance(providers[0], str) else providers[0][0]
    if first not in got:  # ORT falls back to the CPU when a provider cannot load its libraries, with a log line only
        raise JobError("asked for {} ({}), but onnxruntime gave the session only {}: the provider could not load "
                       "on this board (its CUDA/TensorRT libraries); no CPU figure is reported as a {} one".format(
                           unit, first, ", ".join(got), unit))
    out["init_ms"] = (time.perf_counter() - t0) * 1e3
    rng = np.random.RandomState(task.get("seed", 0))
    feeds = {}
    for i in session.get_inputs():
        declared = [d if isinstance(d, int) else None for d in i.shape]
        shape = resolve_shape(i.name, declared, "nchw", task["batch_size"], task.get("input_size"),
                              task.get("input_shapes") or {})
        for axis, (want, have) in enumerate(zip(shape, i.shape)):
            if isinstance(have, int) and have > 0 and have != want:
                raise JobError("input {!r} has a fixed dimension {} of {} but the run asks for {} (batch_size / "
                               "input_size); export the model with a dynamic dimension there".format(
                                   i.name, axis, have, want))
        if i.type not in ORT_DTYPES:
            raise JobError("input {!r} has type {}, which the built-in benchmark cannot fill".format(i.name, i.type))
        out["input_shapes"][i.name] = shape
        feeds[i.name], out["input_values"][i.name] = feed(np, i.name, shape, ORT_DTYPES[i.type],
                                                          (task.get("inputs") or {}).get(i.name), rng,
                                                          task.get("vocab_size"))
    try:
        time_inferences(lambda: session.run(None, feeds), out, task["warmup"], task["iterations"])
    except MemoryError:
        raise
    except Exception as e:
        raise JobError(str(e).strip())
    if task.get("dataset"):  # after the timed loop: it never touches the timings
        names = [o.name for o in session.get_outputs()]
        try:
            out["accuracy"] = dataset_pass(np, task["dataset"], lambda f: dict(zip(names, session.run(None, f))),
                                           feeds, names)
        except MemoryError:
            raise
        except Exception as e:
            raise JobError("the dataset pass failed: {}".format(str(e).strip()))


# ---- the dataset pass (workload.dataset; the sim's agents/harness/dataset.py, in this file's Python) ----------

KEPT_VALUES = 4096  # farm.proto.accuracy.MAX_KEPT_VALUES
PEAK_DB = 200.0


def _db(signal_power, noise_power):
    if noise_power <= 0:
        return PEAK_DB
    if signal_power <= 0:
        return -PEAK_DB
    return max(-PEAK_DB, min(PEAK_DB, 10 * math.log10(signal_power / noise_power)))


def _top(np, rows, k):
    k = min(k, rows.shape[1])
    return np.argsort(-rows, axis=1)[:, :k]


def output_agreement(np, outputs, reference):
    y = outputs.reshape(len(outputs), -1).astype(np.float64)
    r = reference.reshape(len(reference), -1).astype(np.float64)
    err = y - r
    norms = float(np.linalg.norm(y)) * float(np.linalg.norm(r))
    found = {"max_abs_error": float(np.max(np.abs(err))) if err.size else 0.0,
             "mean_abs_error": float(np.mean(np.abs(err))) if err.size else 0.0,
             "cosine": max(-1.0, min(1.0, float(np.sum(y * r) / norms))) if norms > 0 else (
                 1.0 if not np.any(y) and not np.any(r) else 0.0),
             "psnr_db": _db(float(np.max(np.abs(r))) ** 2 if r.size else 0.0, float(np.mean(err ** 2))),
             "snr_db": _db(float(np.sum(r ** 2)), float(np.sum(err ** 2))), "top1": None, "top5": None}
    if y.shape[1] >= 2:
        best = np.argmax(r, axis=1)
        found["top1"] = float(np.mean(np.argmax(y, axis=1) == best))
        if y.shape[1] >= 5:
            found["top5"] = float(np.mean(np.any(_top(np, y, 5) == best[:, None], axis=1)))
    return found


def dataset_pass(np, dataset, infer, fixed, output_names):
    """Every sample through infer (other inputs keep the timed loop's feeds): the block the sim's harness writes."""
    import base64
    import io
    raw = base64.b64decode(dataset["packed"])
    with np.load(io.BytesIO(raw), allow_pickle=False) as data:
        names = [str(n) for n in data["input_names"]]
        inputs = dict((n, data["in{}".format(i)]) for i, n in enumerate(names))
        reference = dict((str(n), data["ref{}".format(i)]) for i, n in enumerate(data["reference_names"]))
        labels = data["labels"] if "labels" in data.files else None
    count = len(inputs[names[0]])
    started = time.perf_counter()
    collected = dict((n, []) for n in output_names[:32])
    for i in range(count):
        feeds = dict(fixed)
        for name, samples in inputs.items():
            feeds[name] = samples[i:i + 1].astype(fixed[name].dtype if name in fixed else samples.dtype)
        produced = infer(feeds)
        for name in collected:
            collected[name].append(np.asarray(produced[name]))
    primary = dataset.get("output") or output_names[0]
    block = {"samples": count, "output": primary, "wall_s": time.perf_counter() - started,
             "reference": dataset.get("reference"), "outputs": {}}
    stacked = dict((n, np.concatenate(parts)) for n, parts in collected.items())
    for name, values in stacked.items():
        data = np.ascontiguousarray(values)
        as_float = data.astype(np.float64)
        entry = {"sha256": hashlib.sha256(str(data.dtype).encode() + str(list(data.shape)).encode()
                                          + data.tobytes()).hexdigest(),
                 "shape": [int(d) for d in data.shape], "min": float(as_float.min()), "max": float(as_float.max()),
                 "mean": float(as_float.mean()), "std": float(as_float.std())}
        if data.size <= KEPT_VALUES:
            entry["values"] = [float(v) for v in as_float.reshape(-1)]
        if name in reference:
            entry["agreement"] = output_agreement(np, values, reference[name])
        block["outputs"][name] = entry
    if primary in stacked and primary in reference:
        block["agreement"] = block["outputs"][primary]["agreement"]
    if labels is not None and primary in stacked:
        scores = stacked[primary].reshape(count, -1).astype(np.float64)
        wanted = labels.reshape(-1).astype(np.int64)
        block["accuracy"] = {
            "top1": float(np.mean(np.argmax(scores, axis=1) == wanted)) if scores.shape[1] >= 2 else None,
            "top5": float(np.mean(np.any(_top(np, scores, 5) == wanted[:, None], axis=1)))
            if scores.shape[1] >= 5 else None}
    return block


def run_benchmark(task, out):
    path = task["model_path"].lower()
    try:
        import numpy  # noqa: F401  every runtime's inputs are numpy arrays
    except ImportError:
        raise JobError("this board's python ({}) has no numpy, which the built-in benchmark needs: pip install "
                       "numpy there (or run the model from a script workload)".format(sys.executable))
    if path.endswith(".tflite"):
        run_tflite(task, out)
    elif path.endswith(".onnx"):
        run_onnx(task, out)
    else:
        raise JobError("{}: the built-in benchmark runs .tflite and .onnx files only".format(task["model_path"]))
    out["peak_rss_bytes"] = status_bytes("VmHWM")


# ---- script workloads --------------------------------------------------------------------------

def unpack_script_dir(archive, destination):
    """The job's folder, as the agent checked it, checked again here: files and folders only, all inside."""
    with tarfile.open(archive, mode="r:") as tar:
        members = []
        for member in tar:
            if len(members) >= MAX_ARCHIVE_ENTRIES:
                raise JobError("the script archive has more than {} entries".format(MAX_ARCHIVE_ENTRIES))
            parts = member.name.split("/")
            if member.name.startswith("/") or ".." in parts:
                raise JobError("the script archive names {!r}, outside its own folder".format(member.name))
            if not (member.isreg() or member.isdir()):
                raise JobError("the script archive's {!r} is a link, device or pipe; only files and folders are "
                               "accepted".format(member.name))
            member.mode &= 0o755
            members.append(member)
        tar.extractall(destination, members=members)


PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans():
    """Make the harness the subreaper of what the script starts: a child that leaves the script's process
    group (setsid, a daemon) is still re-parented here, so it can be found and ended (the sim does the same)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux, or no prctl: the process group alone is what gets cleaned up


def group_members(pgid, parent=None):
    """(pid, name, rss bytes) of every process in a process group (or, given `parent`, a child of it),
    read from /proc."""
    page = os.sysconf("SC_PAGE_SIZE")
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/{}/stat".format(entry)) as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.find("(") + 1:stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2:].split()
        try:  # fields[0] is the state: pgrp is field 5 of stat(5), rss field 24
            if int(fields[2]) == pgid or (parent is not None and int(fields[1]) == parent):
                found.append((int(entry), name, int(fields[21]) * page))
        except (IndexError, ValueError):
            continue
    return found


class GroupMemorySampler(object):
    """Sums the resident memory of the script's process group every period (average and peak)."""

    def __init__(self, pgid, interval_s):
        self.pgid, self.interval_s = pgid, interval_s
        self.samples, self.peak = 0, 0
        self.total = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="group-memory")
        self._thread.daemon = True

    def start(self):
        self._thread.start()
        return self

    def _loop(self):
        while not self._stop.is_set():
            rss = sum(m[2] for m in group_members(self.pgid))
            if rss:
                self.samples += 1
                self.total += rss
                self.peak = max(self.peak, rss)
            self._stop.wait(self.interval_s)

    def stop(self, out):
        self._stop.set()
        self._thread.join(5)
        out["process_memory_samples"] = self.samples
        if self.samples:
            out["process_memory_avg_bytes"] = self.total / self.samples
            out["process_memory_peak_bytes"] = self.peak


def end_leftovers(pgid, out):
    """Kill what the script left running (its group, and orphans re-parented here) and say what it was
    (the sim's rule)."""
    left = group_members(pgid, parent=os.getpid())
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
    for pid, _, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for _ in left:  # reap the orphans: they are the harness's children now
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                break
        except ChildProcessError:
            break
    out["leftovers"] = ["{} (pid {})".format(name, pid) for pid, name, _ in left][:20]
    if not left:
        return ""
    listed = ", ".join(out["leftovers"][:5]) + (" ..." if len(left) > 5 else "")
    return ("the script exited leaving {} process(es) running: {}; they were ended, and whole_run_s stops at the "
            "script's own exit".format(len(left), listed))


class ScriptOutputReader(object):
    """The script's output as a thread reads it: its timings (MAX_TIMINGS kept, the rest counted), the timing lines
    no statistic can use, a bounded tail of its lines and the bytes it printed."""

    def __init__(self):
        self.timings, self.bad, self.tail = [], [], deque(maxlen=TAIL_LINES)
        self.bytes, self.dropped = 0, 0
        self._thread = None

    def take(self, raw, number):
        line = raw.decode("utf-8", "replace")
        try:
            value = parse_timing_line(line)
        except BadTiming as e:
            self.bad.append("output line {}: {}".format(number, e))
            return
        if value is not None:
            if len(self.timings) < MAX_TIMINGS:
                self.timings.append(value)
            else:
                self.dropped += 1
        self.tail.append(line.rstrip()[:TAIL_LINE_CHARS])

    def read(self, stream):
        number = 0
        partial = b""
        while True:
            chunk = stream.readline(READ_CHUNK)
            if not chunk:
                break
            self.bytes += len(chunk)
            if not chunk.endswith(b"\n") and len(partial) < READ_CHUNK:
                partial += chunk  # the rest of a long line comes in the next read
                continue
            number += 1
            self.take((partial + chunk)[:READ_CHUNK * 2], number)
            partial = b""
        if partial:  # the last line, without its newline
            self.take(partial, number + 1)

    def follow(self, stream):
        self._thread = threading.Thread(target=self.read, args=(stream,), name="script-output")
        self._thread.daemon = True
        self._thread.start()

    def drain(self):
        """Wait a bounded time for the last of the output: whatever still holds the pipe is dead or not ours, so
        never wait forever."""
        self._thread.join(OUTPUT_DRAIN_S)

    def keep(self, out):
        out["output_bytes"], out["output_tail"] = self.bytes, "\n".join(self.tail)


def run_script(task, out):
    """A script workload as named steps: its folder, the start in a session of its own, its output read by a thread
    and its memory sampled, the wait (the timeout ends the whole group), the clean-up, the verdict. True: it ran."""
    out["runtime"] = "script"
    script_dir = task["script_dir"]
    if task.get("archive"):
        os.makedirs(script_dir)
        try:
            unpack_script_dir(task["archive"], script_dir)
        except tarfile.TarError as e:
            raise JobError("the script archive cannot be unpacked: {}".format(e))
    out["baseline_rss_bytes"] = status_bytes("VmRSS")
    output = ScriptOutputReader()
    adopt_orphans()
    t0 = time.perf_counter()
    proc = start_script(task, script_dir)
    if task.get("pgid_file"):
        with open(task["pgid_file"], "w") as f:
            f.write(str(proc.pid))
    sampler = GroupMemorySampler(proc.pid, max(0.02, task.get("sample_interval_ms", 100) / 1000.0)).start()
    output.follow(proc.stdout)
    timeout_s = task.get("timeout_s")
    try:
        status = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        out["whole_run_s"] = time.perf_counter() - t0
        sampler.stop(out)
        end_leftovers(proc.pid, out)
        proc.wait()
        output.drain()
        output.keep(out)
        out["failure_class"] = "timeout"
        out["message"] = ("the script ran longer than timeouts.run = {:g} s and was stopped, with every process it "
                          "started".format(timeout_s))
        return False
    out["whole_run_s"] = time.perf_counter() - t0
    sampler.stop(out)
    leftovers = end_leftovers(proc.pid, out)
    output.drain()
    return script_verdict(status, output, leftovers, out)


def start_script(task, script_dir):
    """The script's process, in its own session: the group is what the timeout, the memory sampler and the clean-up
    act on; JobError when the command cannot start."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = str(task["threads"])
    try:
        return subprocess.Popen(task["command"], cwd=script_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    except (OSError, ValueError) as e:
        missing = isinstance(e, OSError) and e.errno == 2
        raise JobError("command {!r} {} on this board: {}".format(
            task["command"][0], "was not found" if missing else "cannot be started", e))


def script_verdict(status, output, leftovers, out):
    """A script that exited: its memory, timings and notes kept, then MemoryError or JobError for a run that has
    no usable timings (killed, a non-zero status, a timing line no statistic can use)."""
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    output.keep(out)
    out["timings_dropped"] = output.dropped
    notes = [leftovers] if leftovers else []
    if output.dropped:
        notes.append("the script printed more than {} timings; the {} after them were counted, not kept".format(
            MAX_TIMINGS, output.dropped))
    out["message"] = "; ".join(notes)
    if status == -signal.SIGKILL:
        raise MemoryError("the script was killed (SIGKILL), most likely out of memory")
    if status != 0:
        raise JobError("the script exited with status {}; its last output:\n{}".format(
            status, "\n".join(list(output.tail)[-5:])))
    bad = output.bad
    if bad:
        more = " (and {} more)".format(len(bad) - 3) if len(bad) > 3 else ""
        raise JobError("the script printed timings no statistic can use: " + "; ".join(bad[:3]) + more)
    out["iterations_ms"] = output.timings
    return True


def command_run(task_path):
    out = new_result()
    try:
        with open(task_path) as f:
            task = json.load(f)
        if task.get("protocol") != PROTOCOL:
            raise BoardError("the agent speaks harness protocol {!r}, this file {}".format(task.get("protocol"), PROTOCOL))
        if task["kind"] == "script":
            out["ok"] = run_script(task, out) is not False
        else:
            run_benchmark(task, out)
            out["ok"] = True
    except MemoryError as e:
        out["failure_class"], out["message"] = "resource", "out of memory: {}".format(e or "MemoryError")
    except JobError as e:
        out["failure_class"], out["message"] = "job", str(e)
    except BoardError as e:
        out["failure_class"], out["message"] = "infrastructure", str(e)
    except Exception as e:
        import traceback
        out["failure_class"], out["message"] = "bug", "the board harness failed: {}\n{}".format(
            e, traceback.format_exc(limit=6))
    emit(out)
    return 0


# ---- cached virtual environments for pip requirements --------------------------------------------

def venv_key(requirements):
    """The cache key: this interpreter and the requirements, in any order."""
    text = sys.executable + "\n" + platform.python_version() + "\n" + "\n".join(sorted(requirements))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def run_quietly(argv, timeout_s, cwd=None):
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            cwd=cwd, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None, ""
    return proc.returncode, output.decode("utf-8", "replace")


def command_env(venv_root, requirements, timeout_s, cwd):
    """Make (once) a venv with the requirements; print where its python is."""
    out = {"protocol": PROTOCOL, "ok": False, "failure_class": None, "message": "", "python": None, "reused": False}
    key = venv_key(requirements)
    venv = os.path.join(venv_root, "venv-" + key)
    python = os.path.join(venv, "bin", "python")
    ready = os.path.join(venv, ".farm-ready")
    if not os.path.isdir(venv_root):
        os.makedirs(venv_root)
    with open(os.path.join(venv_root, "venv-" + key + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two agents sharing a board build it once
        if os.path.exists(ready):
            out.update(ok=True, python=python, reused=True)
            emit(out)
            return 0
        shutil.rmtree(venv, ignore_errors=True)  # a half-built one from a run that died
        # system-site-packages: the runtimes the board already has (numpy, onnxruntime) need no download
        status, text = run_quietly([sys.executable, "-m", "venv", "--system-site-packages", venv], timeout_s)
        if status != 0:
            out["failure_class"] = "infrastructure"
            out["message"] = ("the board's python ({}) cannot make a virtual environment{}: {}; install its venv "
                              "module (Debian, Ubuntu, JetPack: apt install python3-venv)".format(
                                  sys.executable, " in time" if status is None else "", text.strip()[-300:]))
            emit(out)
            return 0
        argv = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--quiet"]
        status, text = run_quietly(argv + list(requirements), timeout_s, cwd=cwd)
        if status != 0:
            shutil.rmtree(venv, ignore_errors=True)
            lines = " ".join(text.strip().splitlines()[-6:])[-600:]
            if status is None:
                out["failure_class"] = "timeout"
                out["message"] = "pip did not install {} within {:g} s".format(requirements, timeout_s)
            elif any(word in text for word in NETWORK_WORDS):
                out["failure_class"] = "infrastructure"
                out["message"] = ("the board could not reach the package index to install {}: {}; check its network "
                                  "or proxy".format(requirements, lines))
            elif NO_BUILD.search(text):
                out["failure_class"] = "job"
                out["message"] = ("no build of {} for this board's platform (Linux {}, CPython {}): pip found no "
                                  "wheel or source it can install there (many binary packages ship x86_64 wheels "
                                  "only); pin a version that has one, or give the board a wheelhouse with it: "
                                  "{}".format(", ".join(sorted(set(NO_BUILD.findall(text)))), platform.machine(),
                                              platform.python_version(), lines))
            else:
                out["failure_class"] = "job"
                out["message"] = "pip could not install {} on the board: {}".format(requirements, lines)
            emit(out)
            return 0
        with open(ready, "w") as f:
            f.write("\n".join(requirements))
    out.update(ok=True, python=python)
    emit(out)
    return 0


def main(argv):
    if len(argv) >= 2 and argv[0] == "run":
        return command_run(argv[1])
    if len(argv) >= 2 and argv[0] == "env":
        request = json.loads(sys.stdin.read() or "{}")
        return command_env(argv[1], [str(r) for r in request.get("requirements", [])],
                           float(request.get("timeout_s", 1800)), request.get("cwd"))
    if argv == ["version"]:
        emit({"protocol": PROTOCOL, "ok": True, "python": platform.python_version()})
        return 0
    sys.stderr.write("usage: board_harness.py run TASK.json | env VENV_ROOT < request.json | version\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
