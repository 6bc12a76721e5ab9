"""What the store's repositories return: frozen, typed rows, the same from every database.

A row is a frozen dataclass named for what it is; its fields are the columns a query returns, read as
attributes (`row.status`); `as_dict()` gives a plain dict for JSON or for code that edits one. Only the two rows
controller/grpc_server.py still reads by name keep `row["field"]` (ItemAccess), until that module's carve lands.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, TypeVar

from farm.proto.results import FIGURES

R = TypeVar("R", bound="Row")


@dataclass(frozen=True, slots=True)
class Row:
    """Base of every row: its fields are read as attributes."""

    def keys(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)]

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.keys()}

    @classmethod
    def of(cls: type[R], values: Mapping[str, Any]) -> R:
        """The row from a query's columns (named as the fields)."""
        return cls(**values)


class ItemAccess:
    """`row["field"]` and `row.get("field")`, read-only, for the rows whose readers have not moved to attributes
    yet: controller/grpc_server.py's (RunningAttempt, DeviceRow), which another branch carves this session (issue
    #35). Every other row is read by attribute; this goes when those readers do."""

    __slots__ = ()

    def __getitem__(self, name: str) -> Any:
        try:
            return getattr(self, name)
        except AttributeError:
            raise KeyError(name) from None

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name, default)


def plain(row: Row | None) -> dict[str, Any] | None:
    """A row as a plain dict (None stays None): for code that still edits or serializes dicts."""
    return None if row is None else row.as_dict()


def plain_rows(rows: Iterable[Row]) -> list[dict[str, Any]]:
    return [row.as_dict() for row in rows]


@dataclass(frozen=True, slots=True)
class JobRow(Row):
    id: int
    name: str
    status: str
    priority: str
    created_at: float
    started_at: float | None
    finished_at: float | None
    spec_json: str | None
    spec_yaml: str | None
    source_path: str | None
    base_dir: str | None
    owner_pid: int | None
    owner_host: str | None
    message: str | None
    kind: str
    submitted_by: str | None
    team: str | None
    deadline_at: float | None = None  # timeouts.job from submission (or the last `farm retry`)


@dataclass(frozen=True, slots=True)
class TaskRow(Row):
    id: int
    job_id: int
    seq: int
    target: str
    model_name: str
    model_path: str | None
    model_sha256: str | None
    model_family: str | None
    model_facts_json: str | None
    threads: int
    batch_size: int | None
    input_size: int | None
    repeat: int
    status: str
    attempts: int
    max_attempts: int
    pair_key: str | None
    spec_json: str | None
    leased_by: str | None
    lease_expires_at: float | None
    priority: int
    created_at: float | None
    finished_at: float | None
    last_run_id: int | None
    failure_class: str | None
    message: str | None
    model_size_bytes: int | None
    model_param_count: int | None
    plan_id: int | None = None  # its job's plan (task_plans), read into spec_json by every query of tasks
    facts_id: int | None = None  # its job's model facts (model_facts), read into model_facts_json likewise


@dataclass(frozen=True, slots=True)
class JobListing(Row):
    """A job as `farm jobs` lists it: its tasks by status (`counts`) and their sums."""
    id: int
    name: str
    status: str
    priority: str
    created_at: float
    started_at: float | None
    finished_at: float | None
    message: str | None
    owner_pid: int | None
    owner_host: str | None
    submitted_by: str | None
    team: str | None
    counts: dict[str, int]
    tasks: int
    completed: int
    failed: int


@dataclass(frozen=True, slots=True)
class DashboardJob(Row):
    """A job as the dashboard lists it, with its tasks by status."""
    id: int
    name: str
    kind: str
    status: str
    priority: str
    created_at: float
    started_at: float | None
    finished_at: float | None
    message: str | None
    counts: dict[str, int]


@dataclass(frozen=True, slots=True)
class JobSpecRow(Row):
    id: int
    spec_json: str | None


@dataclass(frozen=True, slots=True)
class TaskOutcome(Row):
    status: str
    failure_class: str | None
    message: str | None


@dataclass(frozen=True, slots=True)
class RunningAttempt(ItemAccess, Row):
    """A running task's lease: whose it is and which attempt."""
    id: int
    job_id: int
    attempts: int
    max_attempts: int
    leased_by: str | None


@dataclass(frozen=True, slots=True)
class LeaseState(Row):
    task_status: str
    attempts: int
    lease_expires_at: float | None
    job_status: str
    leased_by: str | None


@dataclass(frozen=True, slots=True)
class RunningTask(Row):
    id: int
    job_id: int
    target: str
    model_name: str
    threads: int
    repeat: int
    attempts: int
    leased_by: str | None


@dataclass(frozen=True, slots=True)
class QueuedWork(Row):
    """Pending tasks of one job for one target."""
    target: str
    job_id: int
    priority: int
    pending: int


@dataclass(frozen=True, slots=True)
class EarlierAttempt(Row):
    """A task's run before its counted one (store.reads.earlier_attempts): why the task was run again."""
    attempt: int
    status: str | None
    failure_class: str | None
    contended: int | None  # 1: other work used the run's cores (a contention retry)


@dataclass(frozen=True, slots=True)
class TelemetrySampleRow(Row):
    t_s: float
    cpu_percent: float | None
    memory_bytes: int | None


@dataclass(frozen=True, slots=True)
class StoredOpProfileRow(Row):
    kind: str
    node_type: str | None
    name: str | None
    avg_ms: float | None
    percent: float | None
    first_ms: float | None
    count: int | None
    times_called: int | None
    mem_kb: float | None


@dataclass(frozen=True, slots=True)
class ResultRow(Row):
    """A task of a job with the run that counted and its summary (None where the task never ran)."""
    task: int
    job: int
    model_name: str
    model_sha256: str | None
    model_family: str | None
    model_path: str | None
    target: str
    threads: int
    batch_size: int | None
    input_size: int | None
    repeat: int
    task_status: str
    attempts: int
    pair_key: str | None
    task_failure_class: str | None
    task_message: str | None
    model_size_bytes: int | None
    model_param_count: int | None
    model_facts_json: str | None
    task_spec_json: str | None
    run_id: int | None
    attempt: int | None
    run_status: str | None
    failure_class: str | None
    message: str | None
    backend: str | None
    approximate: int | None
    limits_cpus: float | None
    limits_cpuset: str | None
    limits_memory_mb: float | None
    wall_s: float | None
    whole_run_s: float | None
    started_at: float | None
    finished_at: float | None
    tool_versions_json: str | None
    environment_json: str | None
    contention_json: str | None
    latency_init_ms: float | None
    latency_first_ms: float | None
    latency_warmup_avg_ms: float | None
    latency_avg_ms: float | None
    latency_p50_ms: float | None
    latency_p90_ms: float | None
    latency_p99_ms: float | None
    latency_std_ms: float | None
    latency_min_ms: float | None
    latency_max_ms: float | None
    latency_count: int | None
    peak_memory_bytes: int | None
    peak_memory_source: str | None
    avg_memory_bytes: float | None
    baseline_memory_bytes: int | None
    peak_rss_bytes: int | None
    cpu_avg_percent: float | None
    cpu_peak_percent: float | None
    block_read_bytes: int | None
    block_write_bytes: int | None
    net_rx_bytes: int | None
    net_tx_bytes: int | None
    sampler_cpu_percent: float | None
    sample_interval_ms: float | None
    sample_count: int | None
    throughput_per_s: float | None
    startup_ms: float | None
    # the declared run figures (farm.proto.results.FIGURES), by field name: a figure added there needs no field here
    figures: Mapping[str, float | None] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> ResultRow:
        named = {f.name for f in FIGURES}
        return cls(**{k: v for k, v in values.items() if k not in named},
                   figures={k: v for k, v in values.items() if k in named})


@dataclass(frozen=True, slots=True)
class DeviceLatency(Row):
    model_sha256: str | None
    model_name: str
    threads: int
    latency_avg_ms: float | None


@dataclass(frozen=True, slots=True)
class AgentRow(Row):
    name: str
    session_id: str | None
    state: str | None
    farm_version: str | None
    capabilities_json: str | None
    hostname: str | None
    peer: str | None
    connected_at: float | None
    last_seen: float | None


@dataclass(frozen=True, slots=True)
class DeviceRow(ItemAccess, Row):
    name: str
    agent: str | None
    driver: str | None
    device_type: str | None
    tags_json: str | None
    facts_json: str | None
    slots: int | None
    state: str | None
    last_seen: float | None


@dataclass(frozen=True, slots=True)
class HealthRow(Row):
    name: str
    health: str
    reason: str | None
    changed_at: float | None


@dataclass(frozen=True, slots=True)
class QuarantinedTarget(Row):
    name: str
    reason: str | None


@dataclass(frozen=True, slots=True)
class LabDeviceRow(Row):
    """A device the lab knows (registered by an agent, or only judged), with its health."""
    name: str
    agent: str | None
    driver: str | None
    device_type: str | None
    tags_json: str | None
    slots: int | None
    state: str | None
    last_seen: float | None
    health: str | None
    reason: str | None
    changed_at: float | None


@dataclass(frozen=True, slots=True)
class CalibrationRow(Row):
    """A stored calibration version; fields in the order `farm calibrations` lists them, the line's a/b last."""
    id: int
    device: str
    metric: str
    threads: int
    runtime: str
    batch_size: int | None
    input_size: int | None
    precision: str | None
    family: str
    version: int
    created_at: float | None
    kind: str | None
    n: int | None
    r2: float | None
    loo_mape: float | None
    within_10: float | None
    kendall_tau: float | None
    spearman_rho: float | None
    warnings_json: str | None
    source: str | None
    fit_json: str | None
    a: float | None
    b: float | None


@dataclass(frozen=True, slots=True)
class LatestCalibration(Row):
    """The newest version of a calibration key, with how many versions the key has."""
    id: int
    device: str
    metric: str
    threads: int
    runtime: str
    batch_size: int | None
    input_size: int | None
    precision: str | None
    family: str
    version: int
    created_at: float | None
    kind: str | None
    n: int | None
    r2: float | None
    loo_mape: float | None
    kendall_tau: float | None
    spearman_rho: float | None
    fit_json: str | None
    source: str | None
    versions: int


@dataclass(frozen=True, slots=True)
class CalibrationFitRow(Row):
    device: str
    version: int
    fit_json: str | None


@dataclass(frozen=True, slots=True)
class CalibrationTime(Row):
    device: str
    metric: str
    newest: float


@dataclass(frozen=True, slots=True)
class MeasuredRow(Row):
    """One completed run's value of a metric, with its model's facts."""
    model_name: str
    model_sha256: str | None
    model_family: str | None
    threads: int
    batch_size: int | None
    input_size: int | None
    repeat: int
    model_size_bytes: int | None
    model_param_count: int | None
    model_facts_json: str | None
    run_id: int
    environment_json: str | None
    value: float | None


@dataclass(frozen=True, slots=True)
class PairedRow(Row):
    """A completed device run beside its completed sim twin: x from the sim, y from the device."""
    model_name: str
    model_family: str | None
    threads: int
    batch_size: int | None
    input_size: int | None
    model_size_bytes: int | None
    model_param_count: int | None
    model_facts_json: str | None
    sim_run: int
    device_run: int
    environment_json: str | None
    device_environment: str | None
    x: float | None
    y: float | None


@dataclass(frozen=True, slots=True)
class DriftRow(Row):
    id: int
    device: str
    metric: str
    threads: int | None
    calibration_id: int | None
    previous_id: int | None
    slope_change: float | None
    intercept_change: float | None
    r2_drop: float | None
    prediction_shift: float | None
    exceeded: int | None
    reasons: str | None
    created_at: float | None


@dataclass(frozen=True, slots=True)
class LatestDrift(Row):
    device: str
    metric: str
    threads: int | None
    prediction_shift: float | None
    exceeded: int | None
