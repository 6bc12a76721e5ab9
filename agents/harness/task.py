"""The contract between a driver and the harness: what to run, and what comes back.

Both sides are JSON files, so the same harness runs in a local sandbox, in a container,
or on a board over ssh.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from farm.proto.spec import BenchmarkWorkload
from farm.proto.tasks import TaskSpec


@dataclass
class HarnessTask:
    kind: str  # "benchmark" | "script"
    model_path: str
    threads: int = 1
    batch_size: int = 1
    input_size: int | None = None
    iterations: int = 50
    warmup: int = 5
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)  # workload.inputs, as plain data
    vocab_size: int | None = None  # workload.vocab_size: token-id inputs' random range
    dataset: dict[str, Any] | None = None  # workload.dataset (with its packed samples): the dataset pass
    use_xnnpack: bool = True
    seed: int = 0
    op_profiling: bool = False  # after the timed loop, a profiled pass gives per-operator times
    max_trace_bytes: int = 64 << 20  # ONNX Runtime's profiler trace: the most a profiled pass may write (onnx_runner)
    accelerator: str = "cpu"  # the compute unit (boards: ONNX Runtime's provider); the sim is always cpu
    precision: str = "fp32"
    # script mode
    command: list[str] = field(default_factory=list)  # already formatted argv
    script_dir: str | None = None

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def read(cls, path: Path) -> "HarnessTask":
        return cls(**json.loads(path.read_text()))


def benchmark_task(task: TaskSpec, model_path: str) -> HarnessTask:
    """The harness's benchmark task for a farm task, with the model at `model_path` where the harness runs.

    The one place a task's workload becomes what the harness runs (sim, boards)."""
    w = task.plan.workload
    if not isinstance(w, BenchmarkWorkload):
        raise ValueError(f"task {task.task_id} has a {w.type} workload, not a benchmark")
    return HarnessTask(kind="benchmark", model_path=model_path, threads=task.threads, batch_size=task.batch_size,
                       input_size=task.input_size, iterations=w.iterations, warmup=w.warmup,
                       input_shapes=w.shape_overrides(),
                       inputs={n: s.model_dump(exclude_none=True) for n, s in w.inputs.items()}, vocab_size=w.vocab_size,
                       dataset=w.dataset.model_dump() if w.dataset is not None else None,
                       use_xnnpack=w.use_xnnpack, seed=task.repeat,
                       op_profiling=w.op_profiling, accelerator=task.plan.accelerator, precision=task.plan.precision)


def script_task(task: TaskSpec, model_path: str, command: list[str], script_dir: str) -> HarnessTask:
    """The harness's script task: `command` already formatted (agents/sim/driver.py fills the placeholders)."""
    return HarnessTask(kind="script", model_path=model_path, threads=task.threads, batch_size=task.batch_size,
                       input_size=task.input_size, command=command, script_dir=script_dir,
                       accelerator=task.plan.accelerator, precision=task.plan.precision)


def runtime_env(threads: int) -> dict[str, str]:
    """What a run's environment says about threads: runtimes must not size their pools from the host's cores."""
    return {"OMP_NUM_THREADS": str(threads)}


@dataclass
class HarnessOutput:
    ok: bool
    failure_class: str | None = None
    message: str = ""
    runtime: str = ""
    init_ms: float | None = None
    first_ms: float | None = None
    warmup_ms: list[float] = field(default_factory=list)
    iterations_ms: list[float] = field(default_factory=list)
    # LatencyStats's fields over every timing where iterations_ms holds only the first MAX_SAMPLES (a script's flood);
    # None: the driver summarises iterations_ms
    latency: dict[str, Any] | None = None
    whole_run_s: float | None = None
    measure_wall_s: float | None = None  # from first timed iteration to last
    loop_cpu_s: float | None = None  # the process's CPU time over the timed loop
    loop_wait_s: float | None = None  # its threads' run-queue wait over the timed loop (schedstat)
    baseline_rss_bytes: int | None = None
    peak_rss_bytes: int | None = None
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    input_values: dict[str, str] = field(default_factory=dict)  # input name -> where its values came from
    tool_versions: dict[str, str] = field(default_factory=dict)
    op_profile: list[dict[str, Any]] = field(default_factory=list)  # OpProfileRow fields, one dict a row
    op_profile_note: str = ""  # why a run asked for an op profile and has none
    accuracy: dict[str, Any] | None = None  # the dataset pass's block (agents/harness/dataset.py)

    def write_fd(self, fd: int) -> None:
        """The result into the channel the agent opened for it (agents/sim/driver.py read_harness_result)."""
        data = json.dumps(dataclasses.asdict(self)).encode()
        while data:
            data = data[os.write(fd, data):]
        os.close(fd)

    def write(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self)))
        tmp.replace(path)  # a reader never sees half a result

    @classmethod
    def read(cls, path: Path) -> "HarnessOutput":
        data: dict[str, Any] = json.loads(path.read_text())
        return cls(**data)
