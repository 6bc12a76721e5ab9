"""What a run produces: the result types every driver returns and the store keeps.

These are pydantic dataclasses: the same objects cross the gRPC wire field for field
(proto/wire.py), go to the store as `dataclasses.asdict` JSON, and come back validated
by pydantic (run_result_from_dict) rather than rebuilt by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import field
from enum import StrEnum
from typing import Any, Collection, Iterable

from farm.proto.op_profile import OpProfileRow
from pydantic import ConfigDict, TypeAdapter
# Positional construction, dataclasses.asdict/replace and field() keep working; pydantic checks every
# field's type, and a field this version does not know (a newer agent's, a newer store's) is ignored.
from pydantic.dataclasses import dataclass

# validators are built on first use, not at import: `farm jobs` and `farm --help` never validate a result
_DEFERRED = ConfigDict(defer_build=True)


class FailureClass(StrEnum):
    """Why a run did not complete; decides retry vs fail (taken from LAVA)."""

    INFRASTRUCTURE = "infrastructure"  # agent, transport or device lost: retry elsewhere
    JOB = "job"  # bad spec, missing/corrupt model, unsupported operator: never retry
    RESOURCE = "resource"  # out of memory at the limit
    TIMEOUT = "timeout"
    CANCELED = "canceled"
    BUG = "bug"  # farm itself failed
    ACCURACY = "accuracy"  # the outputs mismatch the reference or labels beyond workload.dataset.thresholds: never retried


class RunStatus(StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"


class TaskStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELED = "canceled"


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"  # every task completed
    FAILED = "failed"  # finished, at least one task failed
    CANCELED = "canceled"
    INTERRUPTED = "interrupted"  # the process that ran it died; `farm resume` carries on


@dataclass(config=_DEFERRED)
class TensorInfo:
    name: str
    shape: list[int | str]  # str for a symbolic (dynamic) dimension
    dtype: str


@dataclass(config=_DEFERRED)
class ModelFacts:
    """What farm knows about a model file without running it."""

    path: str
    format: str  # "tflite" | "onnx" | "other"
    size_bytes: int
    sha256: str
    inputs: list[TensorInfo] = field(default_factory=list)
    outputs: list[TensorInfo] = field(default_factory=list)
    op_count: int | None = None
    param_count: int | None = None
    op_types: dict[str, int] = field(default_factory=dict)
    macs: int | None = None  # multiply-accumulates of one inference (batch 1); None if not estimable
    # Where the MACs are done (shares sum to 1) and the bytes of inputs, outputs and intermediates:
    # the features a calibration uses to tell models with equal MACs apart. None if not estimable.
    conv_macs_share: float | None = None
    depthwise_macs_share: float | None = None
    fc_macs_share: float | None = None
    other_macs_share: float | None = None
    # Parts of conv_macs_share (issue 31): 1×1 convs, 3×3 convs, grouped (not depthwise) convs.
    conv1x1_macs_share: float | None = None
    conv3x3_macs_share: float | None = None
    grouped_macs_share: float | None = None
    activation_bytes: int | None = None


@dataclass(config=_DEFERRED)
class LatencyStats:
    """Per-inference latency in milliseconds."""

    init: float | None
    first: float | None
    warmup_avg: float | None
    avg: float
    p50: float
    p90: float
    p99: float
    std: float
    min: float
    max: float
    count: int


@dataclass(config=_DEFERRED)
class Limits:
    """The budget a run really had (after the backend applied it)."""

    cpus: float | None = None
    cpuset: str | None = None
    memory_mb: float | None = None


@dataclass(config=_DEFERRED)
class TelemetrySample:
    t_s: float  # seconds since the sandbox started
    cpu_percent: float  # of one core
    memory_bytes: int


@dataclass(config=_DEFERRED)
class Telemetry:
    interval_ms: float
    cpu_avg_percent: float | None = None
    cpu_peak_percent: float | None = None
    memory_avg_bytes: float | None = None
    memory_peak_bytes: int | None = None
    # "kernel" (cgroup high-water mark), "rusage" (per-process max RSS) or "sampled"
    memory_peak_source: str = "sampled"
    block_read_bytes: int | None = None
    block_write_bytes: int | None = None
    net_rx_bytes: int | None = None
    net_tx_bytes: int | None = None
    sampler_cpu_percent: float | None = None  # the sampler's own cost, % of one core
    samples: list[TelemetrySample] = field(default_factory=list)


@dataclass(config=_DEFERRED)
class Contention:
    """Evidence that something other than the run used the run's cores (or the host's clock) while it ran.

    Figures are shares of the run's wall time; the verdict (`contended`, `reasons`) comes
    from thresholds measured on this project's machines (BENCHMARKS.md, "Contention").
    """

    contended: bool = False
    reasons: list[str] = field(default_factory=list)
    cores: str | None = None  # the cores the run could use, as a cpuset
    window_s: float | None = None  # spawn to exit, as the host's counters were read
    run_cpu_s: float | None = None  # CPU time the run itself got
    budget_cpus: float | None = None  # cores the budget allowed (quota, or the cpuset's size)
    cpu_of_budget: float | None = None  # run_cpu_s / (budget_cpus * window_s)
    others_cpu_share: float | None = None  # other tasks' CPU on the run's cores / (cores * window)
    # the CPU the run was entitled to (budget, cores and threads allowing) but did not get while
    # other tasks ran on its cores, as a share of that entitlement: the verdict's figure
    lost_share: float | None = None
    steal_share: float | None = None  # hypervisor steal on the run's cores / (cores * window)
    throttled_s: float | None = None  # time the CFS quota held the run back (its own budget, not contention)
    run_wait_s: float | None = None  # the run's threads' run-queue wait, summed (/proc/<tid>/schedstat)
    host_pressure_share: float | None = None  # /proc/pressure/cpu "some" over the window (whole host)
    cgroup_pressure_share: float | None = None  # the run's own cgroup v2 cpu.pressure "some"
    freq_mhz_start: float | None = None  # mean clock of the run's cores
    freq_mhz_end: float | None = None
    governor_start: str | None = None
    governor_end: str | None = None
    quiet_wait_s: float | None = None  # how long the run waited for its cores to be quiet
    quiet_before: bool | None = None  # whether they were, when it started
    exclusive: str | None = None  # what the kernel granted for an exclusive cpuset, in words


@dataclasses.dataclass(frozen=True)
class RunFigure:
    """A run figure declared once, as a RunResult field's metadata (`figure(...)`): the field's name is the
    summaries column the store writes and reads, `column` its type there, `record` its key in `farm results
    --json` (the stored value divided by `per`, rounded to `digits`), `unit` the record's unit. The wire
    carries it under the field's name (proto/wire.py fills messages by name): a figure needs its field in
    the RunResult message of proto/farm/v1/common.proto, nothing else outside its declaration and its driver.
    docs/architecture.md, "Adding a result figure", walks through one; docs/reference/run-figures.md lists them."""

    unit: str
    column: type[int] | type[float]
    record: str
    doc: str
    per: float = 1.0
    digits: int = 4
    name: str = ""  # the RunResult field's (filled in by FIGURES)

    def shown(self, stored: float | None) -> float | int | None:
        """The record's value of a stored one."""
        if stored is None:
            return None
        if self.per == 1.0 and self.column is int:
            return int(stored)
        return round(stored / self.per, self.digits)


def figure(unit: str, column: type[int] | type[float], record: str, doc: str, *, per: float = 1.0,
           digits: int = 4) -> Any:
    """A RunResult field that is a run figure (None when a run does not measure it): see RunFigure."""
    return field(default=None, metadata={"figure": RunFigure(unit, column, record, doc, per, digits)})


def check_figures(figures: Iterable[RunFigure], *, columns: Collection[str] = (),
                  records: Collection[str] = ()) -> tuple[RunFigure, ...]:
    """The declared figures, or TypeError naming the RunResult field whose declaration cannot work: a column type
    the store has no column for, a `per` or `digits` out of range, a record key that is no identifier or is another
    figure's, or a name or record key already written by hand (`columns`: the result row's; `records`: RunRecord's)."""
    figures = tuple(figures)
    seen: set[str] = set()
    for f in figures:
        where = f"RunResult.{f.name}"
        if f.column not in (int, float):
            raise TypeError(f"{where}: a run figure's column is int or float, not {f.column!r}")
        if not (math.isfinite(f.per) and f.per > 0) or not 0 <= f.digits <= 15:
            raise TypeError(f"{where}: per must be a positive number and digits 0..15 (per={f.per!r}, digits={f.digits!r})")
        if not f.record.isidentifier() or f.record in seen:
            raise TypeError(f"{where}: record key {f.record!r} is not an identifier, or another figure's")
        if f.name in columns:
            raise TypeError(f"{where}: the store's result row already has {f.name!r}, written by hand")
        if f.record in records:
            raise TypeError(f"{where}: record key {f.record!r} is already a RunRecord field")
        seen.add(f.record)
    return figures


# A completed run's message starts with this when its backend could not enforce its CPU budget per
# inference (the process backend's fractional CPUs): reports and calibrations flag such runs.
UNENFORCED_BUDGET = "budget not enforced: "


@dataclass(config=_DEFERRED)
class RunResult:
    """One attempt at one task, as a driver reports it."""

    status: RunStatus
    failure_class: FailureClass | None = None
    message: str = ""
    backend: str = ""
    limits: Limits = field(default_factory=Limits)
    approximate: bool = False  # True when limits or peaks are best-effort (process backend)
    wall_s: float | None = None  # wall time of the sandboxed process, spawn to exit
    latency: LatencyStats | None = None
    iterations_ms: list[float] = field(default_factory=list)
    whole_run_s: float | None = None  # script mode: the user's process start to end
    telemetry: Telemetry | None = None
    baseline_memory_bytes: int | None = None  # harness RSS before the model was loaded
    peak_rss_bytes: int | None = None  # harness VmHWM: comparable to benchmark_model's delta
    model: ModelFacts | None = None
    environment: dict[str, Any] = field(default_factory=dict)
    tool_versions: dict[str, str] = field(default_factory=dict)
    log_tail: str = ""  # last lines of the sandbox's output, kept for failures
    contention: Contention | None = None  # sim runs: was the run's CPU its own?
    throughput_per_s: float | None = None  # inferences (batches) per second over the timed loop
    startup_ms: float | None = None  # init + first inference: what a cold start costs
    op_profile: list[OpProfileRow] = field(default_factory=list)  # slowest nodes and op types (proto/op_profile.py)
    # Calibration keys the run decides (the device's are its type's and its facts'): what ran the model
    # (onnxruntime, litert, script), so a fit never mixes two runtimes. None: a driver that does not say.
    runtime: str | None = None
    # --- run figures declared once (RunFigure): store columns, records, wire and reference derive from these ---
    gpu_memory_peak_bytes: int | None = figure(
        "MiB", int, "gpu_memory_peak_mb", "the GPU's memory in use at its peak over the run (NVIDIA hosts: "
        "nvidia-smi's or NVML's memory.used, whole GPU)", per=1 << 20, digits=2)

    def __post_init__(self) -> None:
        # a result written before runtime was a field (an older agent, a stored row) had it in its environment
        if self.runtime is None and isinstance(self.environment.get("runtime"), str):
            self.runtime = self.environment["runtime"]
            self.environment = {k: v for k, v in self.environment.items() if k != "runtime"}

    @property
    def ok(self) -> bool:
        return self.status == RunStatus.COMPLETED

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def failed(cls, failure_class: FailureClass, message: str, **kw: Any) -> "RunResult":
        return cls(status=RunStatus.FAILED, failure_class=failure_class, message=message, **kw)

    def stored_environment(self) -> dict[str, Any]:
        """The environment as the store keeps it (runs.environment_json): with the calibration keys, where
        rows of every version have them, so old and new rows read alike."""
        return self.environment if self.runtime is None else {**self.environment, "runtime": self.runtime}


# Every declared run figure, in declaration order (the store and RunRecord check them against their own names).
FIGURES: tuple[RunFigure, ...] = check_figures(
    dataclasses.replace(f.metadata["figure"], name=f.name) for f in dataclasses.fields(RunResult)
    if "figure" in f.metadata)


@functools.cache
def _adapter(kind: type) -> TypeAdapter[Any]:
    return TypeAdapter(kind)  # built on first use (issue 34: start-up stays light)


def run_result_from_dict(data: dict[str, Any]) -> RunResult:
    """A RunResult from `to_dict()` output that crossed a process or came out of the store, validated."""
    return _adapter(RunResult).validate_python(data)  # type: ignore[no-any-return]


def model_facts_from_dict(data: dict[str, Any]) -> ModelFacts:
    return _adapter(ModelFacts).validate_python(data)  # type: ignore[no-any-return]


class ResultRefused(Exception):
    """A result for a task attempt that is not leased to the agent sending it; nothing was stored.

    The message says why (superseded, not running, leased elsewhere); an agent is told it in its ack."""
