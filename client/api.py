"""What a user can ask of a farm, whichever farm it is: `Farm`, with two implementations.

`farm.client.embedded.EmbeddedFarm` answers from a local store (runs go to an agent in this
process); `farm.client.remote.RemoteFarm` asks a controller over gRPC. Both return the records
below, so the CLI and the Python API render and compute nothing twice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from farm.proto.regular_files import MAX_JOB_FILE_BYTES, FileRefused, read_regular_file

if TYPE_CHECKING:  # the job model (pydantic) loads only when a job is read: `farm jobs` never needs it
    from farm.proto.spec import Priority

# farm's exit codes, the one set: every command's, and the code a FarmError carries (README.md: "Exit codes").
EXIT_OK, EXIT_RUNS_FAILED, EXIT_BAD_INPUT, EXIT_ENVIRONMENT, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
TERMINAL = ("completed", "failed", "canceled")
# A JSON document exactly as the command's --json prints it (calibrate, rank, predict...).
Document = dict[str, Any]


class FarmError(Exception):
    """A refusal said so a person can act on it; exit_code is the CLI's (2 bad input, 3 environment)."""

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT, problems: list[dict] | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.problems = problems or []  # file / line / field / message, for scripts


@dataclass(frozen=True)
class JobInfo:
    job: int
    name: str
    status: str
    priority: str
    total: int
    pending: int
    running: int
    completed: int
    failed: int
    canceled: int
    created_at: float | None
    started_at: float | None
    finished_at: float | None
    message: str | None
    owner_pid: int | None = None  # embedded: the process running it (a controller keeps its own)
    owner_host: str | None = None

    @property
    def done(self) -> int:
        return self.completed + self.failed + self.canceled

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL

    def to_json(self) -> dict[str, Any]:
        # `id` and `tasks` too: `farm jobs --json` has always named them so
        return {**asdict(self), "id": self.job, "tasks": self.total}


@dataclass(frozen=True)
class Submitted:
    job: int
    tasks: int
    models: int
    where: str  # "store PATH" or "controller HOST:PORT"
    warnings: list[dict[str, Any]] = field(default_factory=list)
    log: Path | None = None  # embedded --detach: the background run's output


@dataclass(frozen=True)
class Progress:
    """One step of a job being run or watched; `last` names the run that just finished, when known."""

    job: int
    status: str
    total: int
    completed: int
    failed: int
    running: int
    canceled: int = 0
    last: str | None = None

    @property
    def done(self) -> int:
        return self.completed + self.failed + self.canceled


@dataclass(frozen=True)
class ReportFile:
    name: str  # "report.html" or a figure's file name
    data: bytes


@dataclass(frozen=True)
class Report:
    files: list[ReportFile]
    warnings: list[str]  # what the page warns about: no completed run (then no figures), contended runs...


@dataclass(frozen=True)
class CalibrateAsk:
    job: int | None = None
    sim_job: int | None = None
    device_job: int | None = None
    device: str | None = None
    metrics: tuple[str, ...] = ("latency",)
    min_pairs: int = 4
    include_contended: bool = False


@dataclass(frozen=True)
class RankAsk:
    job: int
    metric: str = "latency"
    device_jobs: tuple[int, ...] = ()
    devices: tuple[str, ...] = ()
    include_contended: bool = False


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
    def job(self, job: int) -> JobInfo: ...

    @abstractmethod
    def jobs(self, limit: int = 50) -> list[JobInfo]: ...

    @abstractmethod
    def cancel(self, job: int) -> int:
        """Unfinished runs canceled."""

    @abstractmethod
    def results(self, job: int, *, ops: bool = False) -> list[dict[str, Any]]:
        """The run records (`farm results --format json`); with `ops`, each run's op profile too."""

    # --- devices ------------------------------------------------------------------------
    @abstractmethod
    def devices(self) -> list[dict[str, Any]]: ...

    @abstractmethod
    def agents(self) -> list[dict[str, Any]]: ...

    @abstractmethod
    def device_health(self) -> list[dict[str, Any]]: ...

    @abstractmethod
    def set_device_health(self, device: str, action: str, reason: str | None = None) -> dict[str, Any]:
        """quarantine | release | maintenance."""

    @abstractmethod
    def forget_device(self, device: str) -> dict[str, Any]: ...

    # --- analysis -----------------------------------------------------------------------
    @abstractmethod
    def calibrate(self, ask: CalibrateAsk) -> Document: ...

    @abstractmethod
    def calibrations(self, device: str | None = None, metric: str | None = None) -> list[dict[str, Any]]: ...

    @abstractmethod
    def predict(self, ask: PredictAsk, on_progress: OnProgress | None = None) -> list[dict[str, Any]]: ...

    @abstractmethod
    def rank(self, ask: RankAsk) -> Document: ...

    @abstractmethod
    def report(self, job: int, *, html: bool = True, png: bool = False) -> Report: ...

    @abstractmethod
    def refresh(self, ask: RefreshAsk, on_progress: OnProgress | None = None) -> Document | None:
        """Reference suite on every device, refit, drift, golden checks; None when interrupted."""

    @abstractmethod
    def drift(self, device: str | None = None) -> list[dict[str, Any]]: ...

    def close(self) -> None:
        pass

    def __enter__(self) -> "Farm":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
