"""What a user can ask of a farm, whichever farm it is: `Farm`, with two implementations.

`farm.client.embedded.EmbeddedFarm` answers from a local store (runs go to an agent in this
process); `farm.client.remote.RemoteFarm` asks a controller over gRPC. Both answer the questions
of farm.proto.questions' table with its typed answer models, so the CLI and the Python API render
and compute nothing twice, and no `dict[str, Any]` crosses this interface (tests/test_client_types.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from pydantic import ValidationError

from farm.proto.questions import (
    CALIBRATE, CANCEL_JOB, DEVICE_HEALTH, DRIFT, FORGET_DEVICE, GET_JOB, GET_RESULTS, LIST_AGENTS, LIST_CALIBRATIONS,
    LIST_DEVICES, LIST_JOBS, RANK, REPORT, RETRY_JOB, SET_DEVICE_HEALTH, TERMINAL, AgentInfo, AnswerT, AskT, CalibrateAnswer,
    CalibrateAsk, CalibrationVersion, DeviceHealth, DeviceInfo, DriftRecord, ForgetDeviceAnswer, JobInfo, Prediction,
    Problem, Question, RankAnswer, RankAsk, RefreshAnswer, ReportAnswer, ReportFile, RetryAnswer, RunRecord,
    SetDeviceHealthAnswer,
    explain,
)
from farm.proto.regular_files import MAX_JOB_FILE_BYTES, FileRefused, read_regular_file
# the exit codes, the refusal and a job's progress live where the CLI's start-up reaches them without pydantic
from farm.client.errors import EXIT_BAD_INPUT, EXIT_ENVIRONMENT, EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNS_FAILED
from farm.client.errors import FarmError, Progress

if TYPE_CHECKING:  # the job model (pydantic) loads only when a job is read: `farm jobs` never needs it
    from farm.proto.spec import Priority

Report = ReportAnswer  # the report's files (the HTML page first) and what it warns about

__all__ = ["EXIT_BAD_INPUT", "EXIT_ENVIRONMENT", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_RUNS_FAILED", "AgentInfo",
           "CalibrateAnswer", "CalibrateAsk", "CalibrationVersion", "DeviceHealth", "DeviceInfo", "DriftRecord", "Farm", "FarmError", "ForgetDeviceAnswer", "JobInfo", "PredictAsk", "Prediction", "Problem",
           "Progress", "RankAnswer", "RankAsk", "RefreshAnswer", "RefreshAsk", "Report", "ReportFile", "RetryAnswer",
           "RunRecord",
           "SetDeviceHealthAnswer", "Submitted", "TERMINAL", "explain"]


@dataclass(frozen=True)
class Submitted:
    job: int
    tasks: int
    models: int
    where: str  # "store PATH" or "controller HOST:PORT"
    warnings: list[Problem] = field(default_factory=list)
    log: Path | None = None  # embedded --detach: the background run's output


@dataclass(frozen=True)
class PredictAsk:
    model: Path
    device: str
    metrics: tuple[str, ...] = ("latency",)
    threads: int | None = None
    confidence: float = 0.9
    include_contended: bool = False


@dataclass(frozen=True)
class RefreshAsk:
    k: float = 3.0
    max_slope_change: float = 0.30
    max_prediction_shift: float = 0.25
    max_intercept_change: float = 0.30
    max_r2_drop: float = 0.05
    include_contended: bool = False
    suite: Path | None = None  # embedded: the suite's job file (None: $FARM_REFERENCE_SUITE, else farm's own)


OnProgress = Callable[[Progress], None]


class Farm(ABC):
    """Every question a `farm` command asks; the CLI picks the implementation, never the command."""

    embedded = False  # True: jobs run in this process (or one it starts), from a local store

    @property
    @abstractmethod
    def where(self) -> str:
        """`store PATH` or `controller HOST:PORT`: said in messages, so nobody wonders which farm answered."""

    # --- jobs ---------------------------------------------------------------------------
    @staticmethod
    def job_text(source: Path, text: str | None, overrides: Sequence[str]) -> str | None:
        """The job's text with its --set overrides applied; None (no overrides, no text): read the file as usual."""
        if not overrides:
            return text
        from farm.proto.job_overrides import OverrideError, apply_overrides
        if text is None:
            try:
                text = read_regular_file(source, "job file", MAX_JOB_FILE_BYTES).decode()
            except FileNotFoundError:
                raise FarmError(f"{source}: no such job file.") from None
            except (OSError, UnicodeDecodeError, ValueError) as e:  # FileRefused is a ValueError
                raise FarmError(f"{source}: cannot read the job file: {e}." if not isinstance(e, FileRefused)
                                else str(e)) from None
        try:
            return apply_overrides(text, overrides)
        except OverrideError as e:
            raise FarmError(f"{source}: {e}") from None

    @abstractmethod
    def submit(self, source: Path, text: str | None = None, *, priority: Priority | None = None,
               max_tasks: int | None = None, skip_invalid: bool = False, detach: bool = False,
               on_warning: Callable[[str, str], None] | None = None, on_progress: OnProgress | None = None,
               overrides: Sequence[str] = ()) -> Submitted:
        """Queue a job file (or `text` in its place: relative model paths start at `source`'s folder).
        overrides: `--set FIELD=VALUE` strings applied to the job before it is validated and stored.
        detach: embedded, a background process runs it; remote, the controller does anyway.
        on_warning(kind, message) hears what the job file got away with; on_progress, any health check run first."""

    @abstractmethod
    def wait(self, job: int, on_progress: OnProgress | None = None) -> bool:
        """Until the job ends: run it here (embedded, when nobody else does) or watch it. False: interrupted."""

    @abstractmethod
    def resume(self, job: int) -> None:
        """Take an interrupted job back into the queue (then `wait` runs it)."""

    @abstractmethod
    def ask(self, question: Question[AskT, AnswerT], request: AskT) -> AnswerT:
        """Answer one question of farm.proto.questions' table: here (embedded) or by the controller."""

    def _ask(self, question: Question[AskT, AnswerT], **fields: object) -> AnswerT:
        """ask() with the request built (and checked) from keyword fields: a bad one is a FarmError naming it."""
        try:
            request = question.ask.model_validate(fields)
        except ValidationError as e:
            raise FarmError(explain(e)) from None
        return self.ask(question, request)

    def job(self, job: int) -> JobInfo:
        return self._ask(GET_JOB, job_id=job)

    def jobs(self, limit: int = 50) -> list[JobInfo]:
        return self._ask(LIST_JOBS, limit=limit).jobs

    def cancel(self, job: int) -> int:
        """Unfinished runs canceled."""
        return self._ask(CANCEL_JOB, job_id=job).canceled_tasks

    def retry(self, job: int, *, failed: bool = False, canceled: bool = False) -> RetryAnswer:
        """A finished job's failed (lost among them) and/or canceled tasks wait again, as new attempts of the
        same tasks (every earlier attempt stays stored); then `wait` runs (embedded) or watches it."""
        return self._ask(RETRY_JOB, job_id=job, failed=failed, canceled=canceled)

    def results(self, job: int, *, ops: bool = False) -> list[RunRecord]:
        """The run records (`farm results --format json`); with `ops`, each run's op profile too."""
        return self._ask(GET_RESULTS, job_id=job, ops=ops).records

    # --- devices ------------------------------------------------------------------------
    def devices(self) -> list[DeviceInfo]:
        return self._ask(LIST_DEVICES).devices

    def agents(self) -> list[AgentInfo]:
        return self._ask(LIST_AGENTS).agents

    def device_health(self) -> list[DeviceHealth]:
        return self._ask(DEVICE_HEALTH).devices

    def set_device_health(self, device: str, action: str, reason: str | None = None) -> SetDeviceHealthAnswer:
        """quarantine | release | maintenance."""
        return self._ask(SET_DEVICE_HEALTH, device=device, action=action, reason=reason)

    def forget_device(self, device: str) -> ForgetDeviceAnswer:
        return self._ask(FORGET_DEVICE, device=device)

    # --- analysis -----------------------------------------------------------------------
    def calibrate(self, ask: CalibrateAsk) -> CalibrateAnswer:
        return self.ask(CALIBRATE, ask)

    def calibrations(self, device: str | None = None, metric: str | None = None) -> list[CalibrationVersion]:
        return self._ask(LIST_CALIBRATIONS, device=device, metric=metric).calibrations

    @abstractmethod
    def predict(self, ask: PredictAsk, on_progress: OnProgress | None = None) -> list[Prediction]: ...

    def rank(self, ask: RankAsk) -> RankAnswer:
        return self.ask(RANK, ask)

    def report(self, job: int, *, html: bool = True, png: bool = False, compare: int | None = None) -> ReportAnswer:
        """The job's report; with `compare`, one before/after report of job -> compare."""
        return self._ask(REPORT, job=job, html=html, png=png, compare=compare)

    @abstractmethod
    def refresh(self, ask: RefreshAsk, on_progress: OnProgress | None = None) -> RefreshAnswer | None:
        """Reference suite on every device, refit, drift, golden checks; None when interrupted."""

    def drift(self, device: str | None = None) -> list[DriftRecord]:
        return self._ask(DRIFT, device=device).drift

    def close(self) -> None:
        pass

    def __enter__(self) -> "Farm":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
