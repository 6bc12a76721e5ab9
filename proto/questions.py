"""Every question a user asks a farm, defined once: its request model, its answer model, one table line.

`QUESTIONS` is the table: the gRPC method, the `farm.controller.service` function that answers, the
request and the answer. The controller's FarmServicer and the remote client are built from it (with
farm.proto.wire's model <-> message mapping); the embedded client calls the same service function.
Adding a question: a service function, two models here, one `Question(...)` line (its `access` rule and `role`:
the table refuses a line without a rule; farm.controller.service.answer checks both first), one CLI command
(docs/architecture.md walks one through).

Answers are pydantic models, never `dict[str, Any]`: the parts a farm does not interpret (a model's
input shapes, a run's contention evidence, a fit's choice figures) are `JsonValue`, typed as JSON.
A moment is a `Timestamp`: a UTC datetime here, an ISO 8601 string in JSON (`2026-11-24T19:40:00.123Z`),
Unix seconds (a double) on the wire and in the store; durations stay numbers of seconds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Generic, Literal, TypeVar

from pydantic import (
    AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, JsonValue, PlainSerializer, SerializationInfo,
    SerializerFunctionWrapHandler, ValidationError, computed_field, create_model, field_validator, model_serializer,
)

from farm.proto.escape import printable
from farm.proto.job_summary import iso_utc as iso_utc  # one spelling of a moment, with the listing that needs no model
from farm.proto.results import FIGURES, check_figures

MAX_LIST = 256  # metrics, device jobs, devices in one request
Metric = Annotated[str, Field(max_length=40)]
# Names a person gives a device or a model: bounded here, checked for printable characters by the service.
Name = Annotated[str, Field(max_length=200)]


def _none_if_empty(value: object) -> object:
    """The wire has no None for a plain scalar: 0 and "" stand for "not given"."""
    return value or None


OptionalId = Annotated[int | None, BeforeValidator(_none_if_empty)]
OptionalName = Annotated[Name | None, BeforeValidator(_none_if_empty)]
OptionalText = Annotated[str | None, BeforeValidator(_none_if_empty)]


def _utc(value: datetime) -> datetime:
    """A moment from the store or the wire (Unix seconds, read as UTC) or from JSON (ISO 8601 with its zone)."""
    if value.tzinfo is None:
        raise ValueError("a time without a time zone: give it in UTC (...Z or +00:00)")
    return value.astimezone(UTC)


# A moment: a UTC datetime in Python, ISO 8601 in JSON; built from Unix seconds (store, wire) or ISO text (JSON).
Timestamp = Annotated[datetime, AfterValidator(_utc), PlainSerializer(iso_utc, return_type=str, when_used="json")]
# The wire's 0 is "never" (a double has no None), as for ids and names.
OptionalTimestamp = Annotated[Timestamp | None, BeforeValidator(_none_if_empty)]


class Model(BaseModel):
    """What every request and answer shares: extra keys from a newer peer are ignored, and a float that is
    not finite crosses the wire as "Infinity"/"NaN" (strict JSON output flags it, in both modes alike)."""

    model_config = ConfigDict(ser_json_inf_nan="strings", populate_by_name=True, defer_build=True)
    LOCAL: ClassVar[tuple[str, ...]] = ()  # fields only one side has (never on the wire: its message has no such field)


class Sparse(Model):
    """A record whose `SPARSE` fields are left out of its JSON when never set (a power law has no `a`,
    a run asked without op profiles has no `op_profile`), as the documents always were."""

    SPARSE: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _leave_out_unset(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        data = handler(self)
        for name in self.SPARSE:
            if name not in self.model_fields_set:
                data.pop(name, None)
        return data


def explain(error: ValidationError) -> str:
    """A request or answer that is not its model, said in one line: the field and what is wrong with it."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "the message"
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return printable(f"{where}: {first['msg']}{more}")


# --- requests --------------------------------------------------------------------------------------
class Ask(Model):
    """A request. job_ids: the jobs it names, which the controller checks the caller may read."""

    def job_ids(self) -> list[int]:
        return []


class NoAsk(Ask):
    """A question without parameters (the devices, the agents, the device health list)."""


class JobAsk(Ask):
    job_id: int
    ops: bool = False  # results: each record carries its run's op profile

    def job_ids(self) -> list[int]:
        return [self.job_id]


class RetryAsk(Ask):
    """`farm retry JOB --failed [--canceled]`: which finished tasks of a job run again."""
    job_id: int
    failed: bool = False  # failed tasks, those whose attempts were lost among them
    canceled: bool = False  # tasks canceled before they finished (by `farm cancel` or timeouts.job)

    def job_ids(self) -> list[int]:
        return [self.job_id]

    def statuses(self) -> list[str]:
        return [s for s, wanted in (("failed", self.failed), ("canceled", self.canceled)) if wanted]


class JobsAsk(Ask):
    limit: int = Field(50, ge=0, le=100_000)

    @field_validator("limit", mode="before")
    @classmethod
    def _default(cls, value: object) -> object:
        return value or 50


class CalibrateAsk(Ask):
    job: OptionalId = None
    sim_job: OptionalId = None
    device_job: OptionalId = None
    device: OptionalName = None
    metrics: list[Metric] = Field(default_factory=lambda: ["latency"], max_length=MAX_LIST)
    min_pairs: Annotated[int, BeforeValidator(lambda v: v or 4)] = 4  # the wire's 0: not given
    include_contended: bool = False

    @field_validator("metrics", mode="before")
    @classmethod
    def _latency_by_default(cls, value: object) -> object:
        return list(value) if value else ["latency"]  # type: ignore[call-overload]

    def job_ids(self) -> list[int]:
        return [j for j in (self.job, self.sim_job, self.device_job) if j]


class CalibrationsAsk(Ask):
    device: OptionalName = None
    metric: Annotated[Metric | None, BeforeValidator(_none_if_empty)] = None


class RankAsk(Ask):
    job: int
    metric: Metric = "latency"
    device_jobs: list[int] = Field(default_factory=list, max_length=MAX_LIST)
    devices: list[Name] = Field(default_factory=list, max_length=MAX_LIST)
    include_contended: bool = False

    @field_validator("metric", mode="before")
    @classmethod
    def _latency_by_default(cls, value: object) -> object:
        return value or "latency"

    def job_ids(self) -> list[int]:
        return [self.job, *self.device_jobs]


class ReportAsk(Ask):
    job: int
    html: bool = True
    png: bool = False
    compare: int | None = None  # `farm report A B`: one before/after report of job -> compare

    def job_ids(self) -> list[int]:
        return [self.job] + ([self.compare] if self.compare is not None else [])


class DriftAsk(Ask):
    device: OptionalName = None


class SetDeviceHealthAsk(Ask):
    device: Name
    action: Literal["quarantine", "release", "maintenance"]
    reason: OptionalText = None


class ForgetDeviceAsk(Ask):
    device: Name = Field(alias="name")  # the wire's ForgetDeviceRequest.name


class PredictUploadedAsk(Ask):
    """`farm predict` against a controller: the model is an uploaded artifact (MissingArtifacts/UploadArtifact first)."""

    model_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    model_name: Name  # for display: the client's file name
    device: Name
    metrics: list[Metric] = Field(default_factory=lambda: ["latency"], max_length=MAX_LIST)
    threads: int | None = None
    confidence: Annotated[float, BeforeValidator(lambda v: v or 0.9)] = 0.9  # the wire's 0: not given
    include_contended: bool = False
    measured_jobs: list[int] = Field(default_factory=list, max_length=64)  # measured for this question so far

    @field_validator("metrics", mode="before")
    @classmethod
    def _latency_by_default(cls, value: object) -> object:
        return list(value) if value else ["latency"]  # type: ignore[call-overload]

    def job_ids(self) -> list[int]:
        return list(self.measured_jobs)


class FinishRefreshAsk(Ask):
    job: int
    k: float = 3.0
    max_slope_change: float = 0.30
    max_prediction_shift: float = 0.25
    max_intercept_change: float = 0.30
    max_r2_drop: float = 0.05
    include_contended: bool = False

    def job_ids(self) -> list[int]:
        return [self.job]


# --- answers: jobs ---------------------------------------------------------------------------------
TERMINAL = ("completed", "failed", "canceled")


class TaskCounts(Model):
    """A job's tasks by state: what a job's progress is, wherever it is shown."""

    total: int
    pending: int
    running: int
    completed: int
    failed: int
    canceled: int

    @property
    def done(self) -> int:
        return self.completed + self.failed + self.canceled


class JobInfo(TaskCounts):
    """A job and its progress, as `farm status --json` shows it."""

    LOCAL: ClassVar[tuple[str, ...]] = ("owner_pid", "owner_host")
    job: int = Field(alias="id")  # the wire's Job.id
    name: str
    status: str
    priority: str
    created_at: OptionalTimestamp
    started_at: OptionalTimestamp
    finished_at: OptionalTimestamp
    message: OptionalText
    owner_pid: int | None = None  # embedded: the process running it (a controller keeps its own)
    owner_host: str | None = None

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL

    def to_json(self) -> dict[str, JsonValue]:
        # `id` and `tasks` too: `farm jobs --json` has always named them so
        return {**self.model_dump(mode="json"), "id": self.job, "tasks": self.total}


class JobsAnswer(Model):
    jobs: list[JobInfo]


class CancelAnswer(Model):
    job_id: int
    canceled_tasks: int


class RetryAnswer(Model):
    job_id: int
    retried_tasks: int  # tasks waiting again, as new attempts (the earlier ones stay stored as runs)
    total: int  # the job's tasks


# --- answers: results ------------------------------------------------------------------------------
class RunModel(Sparse):
    # issue 31's conv parts are left out where a model was inspected before them: an older store's results read
    # back as they were written, byte for byte
    SPARSE: ClassVar[tuple[str, ...]] = ("conv1x1_macs_share", "conv3x3_macs_share", "grouped_macs_share")

    name: str
    sha256: str
    family: str | None
    path: str | None
    size_bytes: int | None
    param_count: int | None
    macs: int | None = None
    conv_macs_share: float | None = None
    depthwise_macs_share: float | None = None
    fc_macs_share: float | None = None
    other_macs_share: float | None = None
    # Parts of conv_macs_share (issue 31): 1×1 convs, 3×3 convs, grouped (not depthwise) convs.
    conv1x1_macs_share: float | None = None
    conv3x3_macs_share: float | None = None
    grouped_macs_share: float | None = None
    activation_bytes: int | None = None
    op_count: int | None = None  # the layer count: a per-layer feature of the calibration


class Latency(Model):
    """Milliseconds over the timed loop (init and first inference apart), and how many were timed."""

    init: float | None
    first: float | None
    avg: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    std: float | None
    min: float | None
    max: float | None
    warmup_avg: float | None
    count: int | None


class CpuPercent(Model):
    avg: float | None
    peak: float | None


class IoBytes(Model):
    block_read_bytes: int | None
    block_write_bytes: int | None
    net_rx_bytes: int | None
    net_tx_bytes: int | None


class Sampler(Model):
    interval_ms: float | None
    samples: int | None
    cpu_percent: float | None


class RecordLimits(Model):
    cpus: float | None
    cpuset: str | None
    memory_mb: float | None


class RunRecordFields(Sparse):
    """A RunRecord's fields but the declared run figures' (RunRecord adds those)."""

    SPARSE: ClassVar[tuple[str, ...]] = ("op_profile", "op_profile_note", "predictions", "gpu", "accuracy",
                                         *(f.record for f in FIGURES))
    job: int
    task: int
    model: RunModel
    target: str
    threads: int
    cpus: float | None
    batch_size: int
    input_size: int | None
    accelerator: str = "cpu"  # the compute unit (and precision, when not fp32) the task was planned on
    repeat: int
    pair_key: str | None
    status: str
    attempts: int
    failure_class: str | None
    message: str
    latency_ms: Latency | None
    whole_run_s: float | None
    throughput_per_s: float | None
    samples_per_s: float | None
    startup_ms: float | None
    peak_memory_mb: float | None
    peak_memory_source: str | None
    avg_memory_mb: float | None
    energy_per_inference_mj: float | None
    baseline_memory_mb: float | None
    peak_rss_mb: float | None
    cpu_percent: CpuPercent
    io: IoBytes
    sampler: Sampler
    wall_s: float | None
    backend: str | None
    approximate: bool | None
    limits: RecordLimits
    run: int | None
    runtime: str | None
    input_shapes: dict[str, JsonValue]
    input_values: JsonValue
    image_build: JsonValue
    contention: JsonValue
    tool_versions: dict[str, JsonValue]
    op_profile: list[JsonValue] = Field(default_factory=list)  # with `ops`: op types, then nodes
    op_profile_note: str | None = None  # why a run asked for a profile and has none
    predictions: dict[str, JsonValue] | None = None  # a job with predict_for: each device's estimates
    gpu: dict[str, JsonValue] | None = None  # NVIDIA hosts: the GPU's figures over the run (agents/parsers/nvidia_smi)
    # workload.dataset: outputs' digests and summaries, agreement with the reference, accuracy (proto/accuracy.py)
    accuracy: dict[str, JsonValue] | None = None


if TYPE_CHECKING:  # the figures' fields are read by name (farm.proto.results.RunFigure.record), never as attributes
    _WithFigures = RunRecordFields
else:
    _WithFigures = create_model(
        "RunRecordFigures", __base__=RunRecordFields, __module__=__name__,
        **{f.record: (int | None if f.column is int and f.per == 1.0 else float | None, None)
           for f in check_figures(FIGURES, records=RunRecordFields.model_fields)})


class RunRecord(_WithFigures):
    """One task's run as `farm results --format json` has it: RunRecordFields, then one optional field per declared
    run figure (farm.proto.results.FIGURES), set only where the run measured it."""


class ResultsAnswer(Model):
    records: list[RunRecord]


# --- answers: devices and agents -------------------------------------------------------------------
class DeviceInfo(Sparse):
    """A device: embedded, from the lab's list with its health, last check and calibration age; from a
    controller, as its agent registered it (agent, slots, state, facts). Each mode prints its own fields."""

    SPARSE: ClassVar[tuple[str, ...]] = ("health", "reason", "last_check", "calibration_age_s", "agent", "slots", "state", "last_seen", "facts")
    name: str
    driver: str
    device_type: str | None
    tags: list[str]
    units: list[str] = Field(default_factory=lambda: ["cpu"])  # the compute units a job may ask of it (its type's)
    health: str | None = None
    reason: str | None = None
    last_check: OptionalTimestamp = None
    calibration_age_s: float | None = None
    agent: str | None = None
    slots: int | None = None
    state: str | None = None
    last_seen: OptionalTimestamp = None
    facts: dict[str, JsonValue] | None = None


class DevicesAnswer(Model):
    devices: list[DeviceInfo]


class AgentInfo(Model):
    name: str
    state: str
    farm_version: str
    hostname: str
    peer: str
    capabilities: list[str]
    running: int
    connected_at: Timestamp
    last_seen: Timestamp
    controller: str = ""  # the controller it is connected to, any of the lab's (store/presence.py)


class AgentsAnswer(Model):
    agents: list[AgentInfo]


class DeviceHealth(Model):
    name: str
    health: str
    reason: str | None
    changed_at: OptionalTimestamp


class DeviceHealthAnswer(Model):
    devices: list[DeviceHealth]


class SetDeviceHealthAnswer(Model):
    device: str
    action: str
    failed_tasks: int


class ForgetDeviceAnswer(Model):
    device: str = Field(alias="name")  # the wire's ForgetDeviceResponse.name
    agent: str

    @computed_field  # type: ignore[prop-decorator]
    @property
    def action(self) -> str:
        return "forget"


# --- answers: calibrations -------------------------------------------------------------------------
class Coefficients(Sparse):
    """A line's a (slope) and b (intercept); a power law's exponent and factor: never one name for both."""

    SPARSE: ClassVar[tuple[str, ...]] = ("a", "b", "exponent", "factor")
    a: float | None = None
    b: float | None = None
    exponent: float | None = None
    factor: float | None = None


class FitSummary(Coefficients):
    formula: str
    r2: float | None
    loo_mape: float | None
    loo_within_10: float | None


class RunnerUp(Model):
    kind: str
    formula: str
    loo_mape: float | None
    loo_within_10: float | None
    loo_log_rmse: float | None


class FitFigures(Sparse):
    """One fitted calibration's figures (its chosen fit, the choice, every kind's summary): `farm calibrate
    --pairs --json` lists them under their group, CalibrationFit under what the calibration is for."""

    SPARSE: ClassVar[tuple[str, ...]] = ("a", "b", "exponent", "factor")
    kind: str
    formula: str
    features_used: list[str]
    a: float | None = None  # a line's slope and intercept
    b: float | None = None
    exponent: float | None = None  # a power law's
    factor: float | None = None
    r2: float | None
    n: int
    loo_mape: float | None
    loo_within_10: float | None
    kendall_tau: float | None
    spearman_rho: float | None
    unsafe: bool
    unsafe_reasons: list[str]
    prior_weight: float | None
    prior_source: str | None
    population_weight: float | None
    population_source: str | None
    possible_flips: list[list[str]]
    warnings: list[str]
    choice: dict[str, JsonValue]
    runner_up: RunnerUp | None
    fits: dict[str, FitSummary]


class CalibrationFit(Coefficients):
    """One fitted calibration as `farm calibrate --json` lists it."""

    id: int
    device: str
    metric: str
    threads: int
    family: str
    version: int
    kind: str
    formula: str
    features_used: list[str]
    r2: float | None
    n: int
    loo_mape: float | None
    loo_within_10: float | None
    kendall_tau: float | None
    spearman_rho: float | None
    unsafe: bool
    unsafe_reasons: list[str]
    prior_weight: float | None
    prior_source: str | None
    population_weight: float | None
    population_source: str | None
    possible_flips: list[list[str]]
    warnings: list[str]
    choice: dict[str, JsonValue]
    runner_up: RunnerUp | None
    fits: dict[str, FitSummary]


class CalibrateAnswer(Model):
    calibrations: list[CalibrationFit]
    refused: list[str]
    contended_left_out: int


class CalibrationVersion(Coefficients):
    """One stored calibration version as `farm calibrations --json` lists it."""

    id: int
    device: str
    metric: str
    threads: int
    runtime: str | None
    batch_size: int | None
    input_size: int | None
    precision: str | None
    family: str | None
    version: int
    created_at: OptionalTimestamp
    kind: str | None
    n: int | None
    r2: float | None
    loo_mape: float | None
    within_10: float | None
    kendall_tau: float | None
    spearman_rho: float | None
    source: str | None
    warnings: list[str]
    formula: str
    features_used: list[str]
    unsafe: bool
    prior_weight: float | None
    prior_source: str | None


class CalibrationsAnswer(Model):
    calibrations: list[CalibrationVersion]


# --- answers: predict, rank, report, drift, refresh ------------------------------------------------
class PredictionCalibration(Model):
    id: int
    version: int
    kind: str
    family: str | None
    n: int
    r2: float | None


class PredictionOutOfRange(Model):
    """One input of a prediction outside what its calibration saw: "x" (the sim value) or a feature."""

    input: str
    value: float
    low: float
    high: float


class Prediction(Model):
    """One on-device estimate from the sim, as `farm predict --json` prints it."""

    model: str
    sha256: str
    device: str
    metric: str
    threads: int
    unit: str
    sim: float
    estimate: float
    low: float
    high: float
    confidence: float
    sim_job: int
    sim_reused: bool
    calibration: PredictionCalibration
    unsafe: bool
    formula: str
    warnings: list[str]
    # "extrapolating": the model lies outside the sim values or features the calibration saw (``extrapolation``
    # names each input, its value and the range seen; the interval is wider for it), else "ok"
    verdict: str = "ok"
    extrapolation: list[PredictionOutOfRange] = []


class PredictAnswer(Model):
    """The estimates; or, when no sim run of the model fits yet, the sim-only job queued to measure it first
    (watch it, then ask again with it among measured_jobs: its run is reused)."""

    predictions: list[Prediction]
    measure_job: int | None = None


class RankColumn(Model):
    name: str
    kendall_tau: float | None
    order: list[tuple[str, float]]
    notes: list[str]


class RankGroup(Model):
    threads: int
    batch_size: int
    input_size: int | None
    columns: list[RankColumn]


class RankAnswer(Model):
    job: int
    metric: str
    groups: list[RankGroup]
    contended_left_out: int


# A report file's name from the wire becomes a file on the client: a plain name, nothing else.
REPORT_FILE = re.compile(r"^[^/\\\x00-\x1f\x7f.][^/\\\x00-\x1f\x7f]{0,250}\.(png|html)$")
MAX_REPORT_WARNINGS = 50


class ReportFile(Model):
    name: str  # "report.html" or a figure's file name
    data: bytes

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not REPORT_FILE.match(value):
            raise ValueError(f"a report file named {value[:80]!r}: not a plain file name")
        return value


class ReportAnswer(Model):
    files: list[ReportFile]
    warnings: list[str]  # what the page warns about: no completed run (then no figures), contended runs...

    @field_validator("warnings")
    @classmethod
    def _printable(cls, value: list[str]) -> list[str]:
        return [printable(w) for w in value[:MAX_REPORT_WARNINGS]]


class DriftRecord(Model):
    """How a device's calibration moved between two refreshes (one stored row)."""

    id: int
    device: str
    metric: str
    threads: int
    calibration_id: int
    previous_id: int
    slope_change: float
    intercept_change: float
    r2_drop: float
    prediction_shift: float
    exceeded: int
    reasons: str | None
    created_at: OptionalTimestamp


class DriftAnswer(Model):
    drift: list[DriftRecord]


class SuggestAsk(Ask):
    """`farm calibrate --suggest K --device D`: the K models measured in the sim to measure on D next."""
    device: Name
    count: int = Field(le=100_000)  # 1 or more: the service says so, naming how many candidates there are
    metric: Annotated[Metric, BeforeValidator(lambda v: v or "latency")] = "latency"
    threads: OptionalId = None
    include_contended: bool = False


class SuggestedModel(Model):
    model: str
    sim: float
    sha256: str
    family: str | None
    path: str | None
    job: int  # the sim job the model's run came from


class SuggestAnswer(Model):
    device: str
    metric: str
    threads: int
    measured: int
    candidates: int
    features: list[str]
    suggested: list[SuggestedModel]
    workload: JsonValue = None  # the first suggestion's sim job's workload: a job file measures them as it did


class DriftCheck(Model):
    """The drift one refresh measured (what `farm refresh --json` lists)."""

    device: str
    metric: str
    threads: int
    calibration_id: int
    previous_id: int
    slope_change: float
    intercept_change: float
    r2_drop: float
    prediction_shift: float
    reasons: list[str]
    exceeded: bool


class RefitCalibration(Model):
    id: int
    device: str
    threads: int
    family: str | None
    version: int


class RefreshAnswer(Model):
    job: int
    calibrations: list[RefitCalibration]
    refused: list[str]
    drift: list[DriftCheck]
    quarantined: dict[str, list[str]]
    contended_left_out: int


class Problem(Model):
    """One thing wrong with (or got away with by) a job file: for scripts, beside the message for a person."""

    file: str
    line: int | None
    field: str | None
    message: str


# --- the table ---------------------------------------------------------------------------------------
AskT = TypeVar("AskT", bound=Ask)
AnswerT = TypeVar("AnswerT", bound=Model)


# Who may ask a question: a client token (or an admin), or an admin only. The controller's token check
# (farm.controller.auth.SERVICE_ROLES) reads the admin-only questions from this table.
ASKERS = ("client", "admin")
# A question's job-access rule, checked by farm.controller.service.answer before its service function runs,
# on every job the request names (its `job_ids()`):
ACCESS_RULES = {
    "none": "the request names no job (a listing filters what it lists by the caller itself)",
    "read": "the caller may read each job; another team's job is as good as absent (NotFound)",
    "read-args": "as read, but refused as a bad argument, as a question about a job that does not exist",
    "own": "the caller may read the job and change it: its owner, its owner's team or an admin (NotAllowed)",
    "admin": "an admin-only question: an admin reads every job, so the role is the rule",
}


class QuestionTableError(TypeError):
    """A table line that leaves a rule out or contradicts itself: refused when the module defines it."""


@dataclass(frozen=True)
class Question(Generic[AskT, AnswerT]):
    """One line of the table: `rpc` is the FarmService method, `service` the function of
    farm.controller.service that answers it, as `service(scope, ask) -> answer`; `role` who may ask it
    and `access` its job-access rule (ACCESS_RULES), which every line must state."""

    rpc: str
    service: str
    ask: type[AskT]
    answer: type[AnswerT]
    changes_devices: bool = False  # the controller's dispatcher looks at the queue again after it
    timeout_s: float = 120  # how long the remote client waits for the answer
    access: str | None = None
    role: str = "client"

    def __post_init__(self) -> None:
        if self.access is None:
            raise QuestionTableError(f"question {self.rpc}: no job-access rule; say access= one of "
                                     f"{', '.join(ACCESS_RULES)} (what it means: farm.proto.questions.ACCESS_RULES)")
        if self.access not in ACCESS_RULES:
            raise QuestionTableError(f"question {self.rpc}: access {self.access!r} is not a rule; choose one of "
                                     f"{', '.join(ACCESS_RULES)}")
        if self.role not in ASKERS:
            raise QuestionTableError(f"question {self.rpc}: role {self.role!r}; choose one of {', '.join(ASKERS)}")
        if self.access == "admin" and self.role != "admin":
            raise QuestionTableError(f"question {self.rpc}: access 'admin' is for a question only admins ask "
                                     "(role='admin')")
        names_jobs = self.ask.job_ids is not Ask.job_ids
        if names_jobs and self.access == "none":
            raise QuestionTableError(f"question {self.rpc}: {self.ask.__name__} names jobs (job_ids), so access "
                                     "'none' would let any caller name any job; say which rule checks them")
        if not names_jobs and self.access not in ("none", "admin"):
            raise QuestionTableError(f"question {self.rpc}: access {self.access!r} checks the jobs a request names, "
                                     f"but {self.ask.__name__} has no job_ids(); give it one, or say access='none'")


GET_JOB = Question("GetJob", "job", JobAsk, JobInfo, timeout_s=30, access="read")
LIST_JOBS = Question("ListJobs", "jobs", JobsAsk, JobsAnswer, access="none")  # lists only what the caller may read
CANCEL_JOB = Question("CancelJob", "cancel", JobAsk, CancelAnswer, access="own")
RETRY_JOB = Question("RetryJob", "retry", RetryAsk, RetryAnswer, changes_devices=True,  # the queue changed
                     access="own")
GET_RESULTS = Question("GetResults", "results", JobAsk, ResultsAnswer, access="read")
LIST_DEVICES = Question("ListDevices", "devices", NoAsk, DevicesAnswer, access="none")
LIST_AGENTS = Question("ListAgents", "agents", NoAsk, AgentsAnswer, access="none")
DEVICE_HEALTH = Question("DeviceHealth", "device_health", NoAsk, DeviceHealthAnswer, access="none")
# Admin-only: they change what the lab's devices do (quarantine, forgetting a name, the refresh's quarantines).
SET_DEVICE_HEALTH = Question("SetDeviceHealth", "set_device_health", SetDeviceHealthAsk, SetDeviceHealthAnswer,
                             changes_devices=True, access="none", role="admin")
FORGET_DEVICE = Question("ForgetDevice", "forget_device", ForgetDeviceAsk, ForgetDeviceAnswer, changes_devices=True,
                         access="none", role="admin")
CALIBRATE = Question("Calibrate", "calibrate", CalibrateAsk, CalibrateAnswer, access="read-args")
LIST_CALIBRATIONS = Question("ListCalibrations", "calibrations", CalibrationsAsk, CalibrationsAnswer, access="none")
RANK = Question("Rank", "rank", RankAsk, RankAnswer, access="read-args")
REPORT = Question("Report", "report", ReportAsk, ReportAnswer, timeout_s=300, access="read-args")
DRIFT = Question("Drift", "drift", DriftAsk, DriftAnswer, access="none")
# reads only the jobs the caller may read (the listing's filter), like ListJobs
SUGGEST = Question("Suggest", "suggest", SuggestAsk, SuggestAnswer, access="none")
PREDICT = Question("Predict", "predict_uploaded", PredictUploadedAsk, PredictAnswer, access="read-args")
FINISH_REFRESH = Question("FinishRefresh", "finish_refresh", FinishRefreshAsk, RefreshAnswer, timeout_s=600,
                          access="admin", role="admin")

# Every question answered the same way in both modes. Not here, and why: SubmitJob and UploadArtifact
# carry files (uploaded by content first), WatchJob streams, StartRefresh submits the controller's own suite.
# Predict is here for a controller; embedded, the client runs the measuring job itself between two asks.
QUESTIONS: tuple[Question[Any, Any], ...] = (
    GET_JOB, LIST_JOBS, CANCEL_JOB, RETRY_JOB, GET_RESULTS, LIST_DEVICES, LIST_AGENTS, DEVICE_HEALTH, SET_DEVICE_HEALTH,
    FORGET_DEVICE, CALIBRATE, LIST_CALIBRATIONS, RANK, REPORT, DRIFT, PREDICT, FINISH_REFRESH, SUGGEST,
)
