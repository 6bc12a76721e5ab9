"""workload.dataset on a phone (issue 30): each sample through the phone's own benchmark_model, after the timed loop.

benchmark_model reads an input's values from a raw file (`--input_layer=NAME --input_layer_shape=1,...
--input_layer_value_files=NAME:PATH`, the file exactly the tensor's bytes) and writes every output tensor's bytes,
in output order, to `--output_filepath` when it ends (TensorFlow's tensorflow/lite/tools/benchmark/
benchmark_tflite_model.cc: PopulateInputValueFiles, LoadInputTensorData, OutputSaver). So each sample is one run of
the tool (one inference, no warm-up): its inputs pushed content-addressed (a sample already there is not sent
again), its outputs pulled back, sized against the model's declared output shapes, dequantized with the model's own
scale and zero point as the sim does, and the accuracy block is made by the same code as the sim's
(agents/harness/dataset.py), so the phone's outputs are compared with the same reference.

A dataset must give every input of the model (the tool would fill the others with random values each run, so
samples could not be compared); the outputs' shapes must be fixed at batch 1.
"""

from __future__ import annotations

import shlex
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from farm.agents.android.adb import AndroidDevice, AndroidInfrastructureError
from farm.agents.harness.dataset import run_dataset
from farm.proto.accuracy import MAX_PACKED_BYTES, unpack
from farm.proto.spec import BenchmarkWorkload
from farm.proto.tasks import TaskSpec

REMOTE_DIR = "/data/local/tmp/farm/dataset"


class PhoneDatasetError(Exception):
    """The dataset cannot run on this phone as given (the message says why); the timings stay."""


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        raise PhoneDatasetError(f"an input or output of type {name!r} cannot be fed from or read into a file") from None


Layout = tuple[list[tuple[str, np.dtype]], list[tuple[str, list[int], np.dtype, tuple[float, int] | None]]]


def _layout(model: Path) -> Layout:
    """From one read of the model: (name, dtype) per input, and (name, shape at batch 1, dtype, (scale, zero point)
    or None) per output, in the model's order; dtype names from farm's model inspection (TFLITE_DTYPES)."""
    from ai_edge_litert import schema_py_generated as schema

    from farm.models.facts import TFLITE_DTYPES

    def named(tensor: Any) -> tuple[str, np.dtype]:
        name = tensor.name.decode() if isinstance(tensor.name, bytes) else str(tensor.name)
        return name, _dtype(TFLITE_DTYPES.get(int(tensor.type), f"type {tensor.type}"))

    graph = schema.ModelT.InitFromPackedBuf(bytearray(model.read_bytes()), 0).subgraphs[0]
    outputs = []
    for index in graph.outputs:
        tensor = graph.tensors[index]
        name, dtype = named(tensor)
        shape = [int(d) for d in (tensor.shapeSignature if tensor.shapeSignature is not None else tensor.shape)]
        if shape and shape[0] == -1:
            shape[0] = 1
        if any(d < 0 for d in shape):
            raise PhoneDatasetError(f"output {name!r} has a dynamic shape {shape}; the phone's output file is sized "
                                    "from the model's fixed output shapes")
        q = tensor.quantization
        scale = float(q.scale[0]) if q is not None and q.scale is not None and len(q.scale) == 1 else 0.0
        zero = int(q.zeroPoint[0]) if q is not None and q.zeroPoint is not None and len(q.zeroPoint) == 1 else 0
        outputs.append((name, shape, dtype, (scale, zero) if scale else None))
    return [named(graph.tensors[index]) for index in graph.inputs], outputs


def phone_dataset_pass(device: AndroidDevice, tool: str, model_remote: str, model_local: Path, task: TaskSpec,
                       prefix: Callable[[str], str] = lambda command: command) -> dict[str, Any]:
    """Every sample of the task's dataset through benchmark_model on the phone; the run's accuracy block.
    prefix: what the timed loop's command was wrapped in (its taskset mask)."""
    workload = task.plan.workload
    assert isinstance(workload, BenchmarkWorkload) and workload.dataset is not None
    dataset = workload.dataset.model_dump()
    samples, _, _ = unpack(dataset["packed"])
    model_inputs, outputs = _layout(model_local)
    missing = [name for name, _ in model_inputs if name not in samples]
    if missing:
        raise PhoneDatasetError(f"the dataset gives no values for input(s) {', '.join(missing)}; on a phone every "
                                "input must come from the dataset")
    if any("," in name for name, _ in model_inputs):
        raise PhoneDatasetError("an input name holds ',', which benchmark_model's --input_layer cannot carry")
    expected = sum(int(np.prod(shape)) * dtype.itemsize for _, shape, dtype, _ in outputs)
    if expected > MAX_PACKED_BYTES:
        raise PhoneDatasetError(f"one sample's outputs are {expected} bytes, over {MAX_PACKED_BYTES}")
    dtypes = dict(model_inputs)
    out_path = f"{REMOTE_DIR}/out-{task.task_id}-{task.attempt}.bin"
    device.check(f"mkdir -p {shlex.quote(REMOTE_DIR)}")

    def infer(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        files: list[str] = []
        shapes: list[str] = []
        with tempfile.TemporaryDirectory(prefix="farm-sample-") as folder:
            for name, _ in model_inputs:
                value = np.ascontiguousarray(feeds[name], dtype=dtypes[name])
                local = Path(folder) / f"input{len(files)}.bin"
                local.write_bytes(value.tobytes())
                pushed = device.push_by_hash(local, REMOTE_DIR)
                files.append(f"{name.replace(':', '::')}:{pushed.remote_path}")
                shapes.append(",".join(str(d) for d in value.shape))
        flags = [f"--graph={model_remote}", f"--num_threads={task.threads}", "--num_runs=1", "--warmup_runs=0",
                 "--min_secs=0", "--warmup_min_secs=0", f"--use_xnnpack={'true' if workload.use_xnnpack else 'false'}",
                 f"--input_layer={','.join(name for name, _ in model_inputs)}",
                 f"--input_layer_shape={':'.join(shapes)}", f"--input_layer_value_files={','.join(files)}",
                 f"--output_filepath={out_path}"]
        command = prefix(" ".join([shlex.quote(tool), *map(shlex.quote, flags)]))
        device.shell(f"rm -f {shlex.quote(out_path)}", idempotent=True)
        ran = device.shell(command, timeout_s=task.plan.run_timeout_s)
        if not ran.ok:
            raise PhoneDatasetError(f"benchmark_model failed on a sample (status {ran.exit_status}): "
                                    f"{ran.output.strip()[-300:]}")
        try:
            data = device.pull_bytes(out_path, expected)
        except AndroidInfrastructureError as e:  # no file: a build older than --output_filepath ignores the flag
            raise PhoneDatasetError(f"benchmark_model left no outputs file ({e}); does this build have "
                                    "--output_filepath?") from None
        if len(data) != expected:
            raise PhoneDatasetError(f"benchmark_model wrote {len(data)} bytes of outputs; the model's outputs are "
                                    f"{expected} bytes")
        found, offset = {}, 0
        for name, shape, dtype, quantization in outputs:
            size = int(np.prod(shape)) * dtype.itemsize
            value = np.frombuffer(data[offset:offset + size], dtype=dtype).reshape(shape)
            offset += size
            found[name] = (value.astype(np.float32) - quantization[1]) * quantization[0] if quantization else value
        return found

    try:
        return run_dataset(dataset, infer, {}, [name for name, _, _, _ in outputs])
    finally:
        device.shell(f"rm -f {shlex.quote(out_path)}", idempotent=True)  # the samples stay: pushed by content
