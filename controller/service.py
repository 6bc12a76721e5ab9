"""What a user can ask of a farm, over one store: the single place each answer is computed.

The embedded client (farm.client.embedded) calls these on a local store; the gRPC servicer
(FarmServicer) calls them on the controller's, so `farm calibrate` says the same thing in both
modes. A question of farm.proto.questions' table is answered by `function(scope, ask) -> answer`:
the request and answer models are pydantic (a request from the wire is validated as its model
before it gets here). Errors are ServiceError: a message for the person who asked; NotFound and
NotAllowed say which kind of refusal it is (the servicer's status codes).

The calibration stack (numpy, scipy, matplotlib) is imported by the functions that use it:
`farm jobs` or `farm status` should not wait a second for scipy.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from pydantic import ValidationError

from farm.controller.scheduling.artifacts import GC_GRACE_S, ArtifactStore, SharedArtifactStore
from farm.controller.scheduling.controller import Controller, RetryRefused
from farm.controller.scheduling.job_state import job_fields
from farm.controller.store import Store
from farm.controller.store.rows import JobListing, JobRow
from farm.proto.questions import (
    AgentInfo, AgentsAnswer, CalibrateAnswer, CalibrateAsk, CalibrationFit, CalibrationsAnswer, CalibrationsAsk,
    CancelAnswer, DeviceHealth, DeviceHealthAnswer, DeviceInfo, DevicesAnswer, DriftAnswer, DriftAsk, DriftRecord,
    FinishRefreshAsk, FitFigures, FitSummary, ForgetDeviceAnswer, ForgetDeviceAsk, JobAsk, JobInfo, JobsAnswer,
    JobsAsk, NoAsk, PredictAnswer, Prediction, PredictionCalibration, PredictionOutOfRange, PredictUploadedAsk,
    RankAnswer, RankAsk, RefreshAnswer, ReportAnswer, ReportAsk, ReportFile, ResultsAnswer, RetryAnswer, RetryAsk,
    RunnerUp, SetDeviceHealthAnswer, SetDeviceHealthAsk, SuggestAnswer, SuggestAsk,
)
from farm.proto.questions import MAX_LIST as MAX_LIST
from farm.proto.questions import Question
from farm.proto.results import UNENFORCED_BUDGET

if TYPE_CHECKING:  # the job-file models (and yaml) load when a job is made: `farm jobs` never needs them
    from farm.controller.analysis.calibration import Calibration, FitResult
    from farm.controller.analysis.calibrations import CalibrationSource, SimSide, StoredCalibration
    from farm.controller.operations.alerts import DriftEvent
    from farm.controller.scheduling.jobfile import ResolvedJob

GROUP_ALL = "(all)"
CALIBRATE_METRICS = ("latency", "whole_run", "peak_memory", "avg_memory", "energy")
PREDICT_METRICS = ("latency", "whole_run", "peak_memory", "avg_memory")
DEVICE_ACTIONS = ("quarantine", "release", "maintenance")
# Names a person gives a device or a model: printable, bounded (they reach tables, HTML and logs).
NAME = re.compile(r"^[^\x00-\x1f\x7f]{1,200}$")
MAX_REASON_CHARS = 2000


class ServiceError(ValueError):
    """The question cannot be answered as asked; the message says why and what to do."""


class NotFound(ServiceError):
    """What the question names is not there, or not for this caller to see (then it is as good as absent)."""


class NotAllowed(ServiceError):
    """The caller may see it but not change it (another team's job)."""


class Refused(ServiceError):
    """Not now: the farm's state does not allow it (a device whose agent is connected cannot be forgotten)."""


def check_name(what: str, value: str) -> str:
    if not NAME.match(value or ""):
        raise ServiceError(f"{what} {value[:80]!r}: give 1-200 printable characters")
    return value


def check_finite(what: str, value: float, low: float | None = None, high: float | None = None) -> float:
    if not math.isfinite(value) or (low is not None and value < low) or (high is not None and value > high):
        raise ServiceError(f"{what} {value!r}: give a finite number" +
                           (f" between {low:g} and {high:g}" if low is not None and high is not None else ""))
    return value


def _with_coefficients(figures: FitFigures | FitSummary, fit: FitResult) -> None:
    """A line's a (slope) and b (intercept); a power law's exponent and factor: never one name for both."""
    if fit.log_space:
        figures.exponent, figures.factor = fit.a, fit.b
    else:
        figures.a, figures.b = fit.a, fit.b


def _summary(fit: FitResult) -> FitSummary:
    summary = FitSummary(formula=fit.formula, r2=fit.r2, loo_mape=fit.loo_mape, loo_within_10=fit.loo_within_10)
    _with_coefficients(summary, fit)
    return summary


def fit_figures(cal: Calibration) -> FitFigures:
    """One fitted calibration's figures, as `farm calibrate --json` lists them (offline, under its group)."""
    f, population, runner_up = cal.chosen_fit, cal.fits.get("log_pop"), cal.runner_up
    figures = FitFigures(
        kind=cal.chosen, formula=f.formula, features_used=list(f.features_used), r2=f.r2, n=f.n,
        loo_mape=f.loo_mape, loo_within_10=f.loo_within_10, kendall_tau=f.kendall_tau, spearman_rho=f.spearman_rho,
        unsafe=cal.unsafe, unsafe_reasons=list(cal.unsafe_reasons), prior_weight=f.prior_weight,
        prior_source=f.prior_source,
        # the population prior's weight in the log_pop fit (None: no prior given or no FLOPs/size feature)
        population_weight=None if population is None else population.prior_weight,
        population_source=None if population is None else population.prior_source,
        possible_flips=[[p.first, p.second] for p in f.possible_flips], warnings=list(cal.warnings),
        choice=cal.choice_json(),
        # the fit that came second in the choice, with its leave-one-out figures (to compare with the chosen)
        runner_up=None if runner_up is None else RunnerUp(
            kind=runner_up.kind, formula=runner_up.formula, loo_mape=runner_up.loo_mape,
            loo_within_10=runner_up.loo_within_10, loo_log_rmse=runner_up.loo_log_rmse),
        fits={k: _summary(v) for k, v in cal.fits.items()})
    _with_coefficients(figures, f)
    return figures


def calibration_fit(stored: StoredCalibration) -> CalibrationFit:
    """One stored calibration's fit as `farm calibrate --json` lists it: what it is for, then its figures."""
    return CalibrationFit(id=stored.id, device=stored.device, metric=stored.metric, threads=stored.threads,
                          family=stored.family or GROUP_ALL, version=stored.version,
                          **fit_figures(stored.calibration).model_dump())


# --- who may see and change a job (issue 18, N11) ------------------------------------------------
JOB_SHARING = ("shared", "team")  # the lab's setting: may every client read every job, or only its team's


@dataclass(frozen=True)
class Viewer:
    """Who asks: a client token's id and team. `owner` None is an admin, embedded mode or a lab without tokens."""

    owner: str | None = None
    team: str | None = None

    @property
    def sees_all(self) -> bool:
        return self.owner is None

    def owns(self, job: OwnedJob) -> bool:
        """May cancel it: its own token's job or its team's (never shared); the lab's own jobs are the admins'."""
        if self.sees_all:
            return True
        if job.submitted_by is None:
            return False
        return job.submitted_by == self.owner or (self.team is not None and job.team == self.team)

    def may_read(self, job: OwnedJob, sharing: str) -> bool:
        """Reading: everything in a `shared` lab; in a `team` lab, its own, its team's and the lab's own jobs."""
        return sharing == "shared" or job.submitted_by is None or self.owns(job)

    def visible(self, sharing: str) -> tuple[str, str | None] | None:
        """The store's job_list filter for this viewer (None: every job)."""
        return None if sharing == "shared" or self.owner is None else (self.owner, self.team)


EVERYONE = Viewer()


class OwnedJob(Protocol):
    """What the reading and changing rules read of a job (a stored job row, a listing's)."""

    @property
    def submitted_by(self) -> str | None: ...

    @property
    def team(self) -> str | None: ...


@dataclass(frozen=True)
class Scope:
    """Where a question is answered: the farm's controller (and its store), who asks, what the lab shares.

    cancel: how this farm cancels a job (a gRPC controller also tells the agents running it at once);
    agents: the controller's connected agents (None embedded: there are none to list or forget);
    alert: the webhook a refresh's drift and quarantines go to."""

    controller: Controller
    viewer: Viewer = EVERYONE
    sharing: str = "shared"
    cancel: Callable[[int], int] | None = None
    agents: Any = None  # scheduling.sessions.Sessions
    artifact: Callable[[str], Path | None] | None = None  # an uploaded model by its sha256 (a controller's store)
    submit: Callable[[ResolvedJob], int] | None = None  # queue a job for this caller (a controller: its agents run it)
    alert: Callable[[DriftEvent], None] | None = field(default=None, compare=False)  # alerts.Webhook.send_async

    @property
    def store(self) -> Store:
        return self.controller.store

    def readable_job(self, job_id: int, missing: type[ServiceError] = NotFound) -> JobRow:
        """The job's row, when this caller may read it; another team's job in a `team` lab is as good as absent."""
        job = self.store.jobs.get(job_id) if job_id else None
        if job is None or not self.viewer.may_read(job, self.sharing):
            raise missing(f"no job {job_id} in this farm; `farm jobs` lists them")
        return job


# --- artifacts no job names (`farm artifacts gc`, and the nightly) --------------------------------
@dataclass(frozen=True)
class ArtifactsCollected:
    """What `farm artifacts gc` removed (or, dry run, would remove): `--json` prints these fields in this order."""

    removed: list[str]
    files: int
    bytes: int
    dry_run: bool
    store: str  # a PostgreSQL lab's artifacts: its database, lab-wide, and this host's copies


def collect_artifacts(store: Store, artifacts: ArtifactStore, *, grace_s: float = GC_GRACE_S,
                      dry_run: bool = False) -> ArtifactsCollected:
    """Remove the artifact store's files no job names."""
    check_finite("grace", grace_s, 0, 3650 * 86400.0)
    removed = artifacts.collect(store.artifacts.referenced(), grace_s, dry_run=dry_run)
    if not dry_run:  # what is gone no longer counts against its uploader's quota
        store.artifacts.forget_uploads([name[:64] for name, _ in removed if not name.startswith(".")])
    return ArtifactsCollected(removed=[name for name, _ in removed], files=len(removed),
                              bytes=sum(size for _, size in removed), dry_run=dry_run,
                              store=f"{store.location} and {artifacts.root}" if isinstance(artifacts, SharedArtifactStore)
                              else str(artifacts.root))


def _need_job(scope: Scope, job: int) -> None:
    scope.readable_job(job, ServiceError)  # as a question about a job that does not exist: no more is said


def _owned_job(scope: Scope, job_id: int, verb: str) -> None:
    """Changing a job: reading may be shared, changing never is (its owner, its owner's team, an admin)."""
    row = scope.readable_job(job_id)
    if not scope.viewer.owns(row):
        whose = (f"belongs to another token{' (team ' + row.team + ')' if row.team else ''}; only its owner, "
                 f"its owner's team or an admin may {verb} it") if row.submitted_by else (
            f"is the lab's own (an admin's, the nightly's, or from before jobs had owners); only an admin may {verb} it")
        raise NotAllowed(f"job {job_id} {whose}")


# --- the table's rules, checked before any question's own function runs ------------------------------
def _read(scope: Scope, job_id: int, question: Question[Any, Any]) -> None:
    scope.readable_job(job_id)


# What each of the table's job-access rules (farm.proto.questions.ACCESS_RULES) checks on one job the request names;
# "none" and "admin" check no job ("admin": the role check is the rule, an admin reads every job).
_ACCESS: dict[str, Callable[[Scope, int, Question[Any, Any]], None]] = {
    "read": _read,
    "read-args": lambda scope, job_id, question: _need_job(scope, job_id),
    "own": lambda scope, job_id, question: _owned_job(scope, job_id, question.service),
}


def answer(question: Question[Any, Any], scope: Scope, ask: Any) -> Any:
    """A question of farm.proto.questions' table answered: who may ask it and its job-access rule are checked
    here, from the table line, for every job the request names; then its service function answers. The
    embedded client and the gRPC servicer both ask through this, so no question can forget a rule."""
    if question.role == "admin" and not scope.viewer.sees_all:
        raise NotAllowed(f"{question.rpc} is an admin's question: ask it with an admin token")
    arguments = globals().get(f"{question.service}_arguments")  # a request wrong in itself is told so first
    if arguments is not None:
        arguments(ask)
    check = _ACCESS.get(question.access or "")
    if check is not None:
        for job_id in ask.job_ids():
            check(scope, job_id, question)
    function: Callable[[Scope, Any], Any] = globals()[question.service]
    return function(scope, ask)


# --- jobs --------------------------------------------------------------------------------------
def job_info(controller: Controller, job_id: int) -> JobInfo | None:
    """A job and its progress as `farm status --json` shows it, or None."""
    job = controller.store.jobs.get(job_id)
    if job is None:
        return None
    return job_info_of(job, controller.store.jobs.task_counts(job_id))


def job_info_of(job: JobRow | JobListing, counts: dict[str, int] | None = None) -> JobInfo:
    """job_info from a job row and its counts (default: the listing's own, as Store.job_list gives them)."""
    # job_fields is the one reading of a job's fields (client/local_jobs.py reads a listing's plain form by it)
    return JobInfo(**job_fields(job.as_dict(), counts))


def job(scope: Scope, ask: JobAsk) -> JobInfo:
    """`farm status`: the job, when this caller may read it."""
    return job_info_of(scope.readable_job(ask.job_id), scope.store.jobs.task_counts(ask.job_id))


def jobs(scope: Scope, ask: JobsAsk) -> JobsAnswer:
    """`farm jobs`: the newest jobs this caller may read, every job's counts in one grouped query."""
    rows = scope.store.jobs.listing(ask.limit, scope.viewer.visible(scope.sharing))
    for row in rows:  # the listing's filter is the reading rule; a row it let through by mistake is refused
        if not scope.viewer.may_read(row, scope.sharing):
            raise NotFound(f"no job {row.id} in this farm; `farm jobs` lists them")
    return JobsAnswer(jobs=[job_info_of(row) for row in rows])


def cancel(scope: Scope, ask: JobAsk) -> CancelAnswer:
    """`farm cancel`: reading may be shared; cancelling never is (the table's `own` rule, checked by answer())."""
    canceled = (scope.cancel or scope.controller.cancel_job)(ask.job_id)
    return CancelAnswer(job_id=ask.job_id, canceled_tasks=canceled)


def retry(scope: Scope, ask: RetryAsk) -> RetryAnswer:
    """`farm retry JOB --failed` (and `farm resume` of a controller's job): a finished job's failed or lost
    tasks run again as new attempts; changing a job is its owner's, as cancelling is (the `own` rule)."""
    statuses = ask.statuses()
    if not statuses:
        raise ServiceError("say which tasks to run again: --failed (failed runs, lost ones among them) and/or "
                           "--canceled (runs canceled before they finished)")
    try:
        n = scope.controller.retry(ask.job_id, statuses)
    except RetryRefused as e:
        raise Refused(str(e)) from None
    return RetryAnswer(job_id=ask.job_id, retried_tasks=n, total=scope.controller.progress(ask.job_id).total)


def results(scope: Scope, ask: JobAsk) -> ResultsAnswer:
    """`farm results --format json`: a record per task; with `ops`, each run's op profile too."""
    from farm.controller.analysis.results import run_records

    return ResultsAnswer(records=run_records(scope.store, ask.job_id, ops=ask.ops))


# --- calibrate ---------------------------------------------------------------------------------
def calibrate_arguments(ask: CalibrateAsk) -> None:
    """`farm calibrate`'s arguments checked on their own, before any job is read (answer() calls it first)."""
    job, sim_job, device_job, device = ask.job, ask.sim_job, ask.device_job, ask.device
    if not job and not (sim_job and device_job and device):
        raise ServiceError("farm calibrate needs --job J [--device D] (device runs and their sim twins), "
                           "--sim-job A --device-job B --device NAME (two jobs), or --pairs FILE.")
    for metric in ask.metrics:
        if metric not in CALIBRATE_METRICS:
            raise ServiceError(f"unknown metric {metric[:40]!r}; choose one of {', '.join(CALIBRATE_METRICS)}")
    if not 2 <= ask.min_pairs <= 100_000:
        raise ServiceError(f"--min-pairs {ask.min_pairs}: give a number from 2 to 100000")
    if device is not None:
        check_name("--device", device)
    if not job and sim_job == device_job:  # a job fitted against itself is always "device = sim"
        raise ServiceError(f"--sim-job {sim_job} --device-job {device_job}: the same job on both sides would fit the "
                           "sim against itself; give the job whose runs stand for the device as --device-job (or "
                           "--job J for a job whose device runs have sim twins).")


def calibrate(scope: Scope, ask: CalibrateAsk) -> CalibrateAnswer:
    """Fit and store a calibration per device × metric × key: {calibrations, refused, contended_left_out}."""
    from farm.controller.analysis.calibrations import (
        CalibrationError, calibration_source, contended_left_out, fit_and_store, job_devices, pair_jobs,
        pair_within_job,
    )

    store, job, sim_job, device_job, device = scope.store, ask.job, ask.sim_job, ask.device_job, ask.device
    metrics, min_pairs, include_contended = ask.metrics, ask.min_pairs, ask.include_contended
    fitted: list[CalibrationFit] = []
    refused: list[str] = []
    try:
        if job:
            devices = [device] if device else job_devices(store, job)
            if not devices:
                raise ServiceError(f"job {job} ran on no device, only in the sim: nothing to pair")
            within_job = job

            def within(name: str) -> Callable[[str], list[Any]]:
                return lambda metric: pair_within_job(store, within_job, name, metric,
                                                      include_contended=include_contended)
            groups: list[tuple[str, Callable[[str], list[Any]], CalibrationSource]] = [
                (d, within(d), calibration_source(store, job)) for d in devices]
            jobs = [job]
        else:
            assert sim_job is not None and device_job is not None and device is not None  # checked above
            sim_side, device_side = sim_job, device_job
            groups = [(device, lambda metric: pair_jobs(store, sim_side, device_side, metric,
                                                        include_contended=include_contended),
                       calibration_source(store, sim_side, device_side))]
            jobs = [sim_side, device_side]
        left_out = 0 if include_contended else contended_left_out(store, jobs)
        for name, pairs_for, source in groups:
            for metric in metrics:
                paired = pairs_for(metric)
                if not paired:
                    refused.append(f"{name} {metric}: no completed device run with a completed sim twin")
                    continue
                stored, why = fit_and_store(store, name, metric, paired, min_pairs=min_pairs, source=source)
                refused += why
                fitted += [calibration_fit(s) for s in stored]
    except CalibrationError as e:
        raise ServiceError(str(e)) from None
    unenforced = _unenforced_budget_runs(store, jobs)
    if unenforced:
        for fit in fitted:
            fit.warnings = [*fit.warnings, unenforced]
    return CalibrateAnswer(calibrations=fitted, refused=refused, contended_left_out=left_out)


def _unenforced_budget_runs(store: Store, jobs: list[int]) -> str | None:
    """A warning when runs of these jobs had a CPU budget their backend could not enforce."""
    from farm.controller.analysis.results import run_records

    flagged = [(job, r) for job in jobs for r in run_records(store, job) if r.message.startswith(UNENFORCED_BUDGET)]
    if not flagged:
        return None
    job, first = flagged[0]
    return (f"{len(flagged)} run(s) of job(s) {', '.join(str(j) for j in sorted({j for j, _ in flagged}))} had a CPU "
            f"budget their backend did not enforce ({first.message.removeprefix(UNENFORCED_BUDGET)}) The factor "
            "understates what the budget does; rerun those jobs with the cgroup or docker backend.")


def calibrations(scope: Scope, ask: CalibrationsAsk) -> CalibrationsAnswer:
    from farm.controller.analysis.calibrations import calibration_history
    return CalibrationsAnswer(calibrations=calibration_history(scope.store, ask.device, ask.metric))


# --- rank, report, drift -----------------------------------------------------------------------
def rank(scope: Scope, ask: RankAsk) -> RankAnswer:
    from farm.controller.analysis.ranking import RankError, rank_job

    if len(ask.device_jobs) > MAX_LIST or len(ask.devices) > MAX_LIST:
        raise ServiceError(f"rank at most {MAX_LIST} device jobs and {MAX_LIST} devices at once")
    for d in ask.devices:
        check_name("--device", d)
    try:
        return RankAnswer.model_validate(rank_job(scope.store, ask.job, ask.metric, device_jobs=ask.device_jobs,
                                                  devices=ask.devices, include_contended=ask.include_contended))
    except RankError as e:
        raise ServiceError(str(e)) from None


REPORT_HTML = "report.html"


def report(scope: Scope, ask: ReportAsk) -> ReportAnswer:
    """The report's files, rendered here — the HTML page first — and its warnings."""
    from farm.controller.analysis.compare_report import build_compare_report
    from farm.controller.analysis.report import ReportError, build_report

    try:
        page, figures, warnings = build_report(scope.store, ask.job) if ask.compare is None else \
            build_compare_report(scope.store, ask.job, ask.compare)
    except ReportError as e:
        raise ServiceError(str(e)) from None
    files = ([ReportFile(name=REPORT_HTML, data=page.encode())] if ask.html else []) + \
        ([ReportFile(name=f.name, data=f.png) for f in figures] if ask.png else [])
    return ReportAnswer(files=files, warnings=warnings)


def suggest(scope: Scope, ask: SuggestAsk) -> SuggestAnswer:
    """`farm calibrate --suggest K --device D`: the models (of the jobs this caller may read) to measure on D next,
    and the workload their first one's sim job ran, so the client writes a job file that measures them alike."""
    from farm.controller.analysis.calibrations import CalibrationError, sim_side
    from farm.controller.analysis.suggestions import suggest_for_device

    try:  # the device may be one no calibration names yet: its name is shown escaped, never refused
        answer = suggest_for_device(scope.store, ask.device, ask.count, metric=ask.metric, threads=ask.threads,
                                    include_contended=ask.include_contended,
                                    visible_to=scope.viewer.visible(scope.sharing))
    except (CalibrationError, ValueError) as e:
        raise ServiceError(str(e)) from None
    first = scope.store.jobs.get(answer.suggested[0].job) if answer.suggested else None
    side = sim_side(first.spec_json) if first else None  # the workload the first suggestion's sim job ran
    if side is not None:
        answer.workload = side.workload.model_dump(mode="json")
    return answer


def drift(scope: Scope, ask: DriftAsk) -> DriftAnswer:
    from farm.controller.operations.refresh import drift_history
    return DriftAnswer(drift=[DriftRecord.model_validate(r) for r in drift_history(scope.store, ask.device)])


# --- devices -----------------------------------------------------------------------------------
def device_health(scope: Scope, ask: NoAsk) -> DeviceHealthAnswer:
    return DeviceHealthAnswer(devices=[DeviceHealth.model_validate(r) for r in scope.controller.device_health()])


def devices(scope: Scope, ask: NoAsk) -> DevicesAnswer:
    """The devices the controller's agents registered (online or not); embedded lists its lab's instead."""
    from farm.proto.device_types import load_device_types

    types = load_device_types()
    return DevicesAnswer(devices=[DeviceInfo(
        name=r.name, driver=r.driver or "", device_type=r.device_type or "", tags=json.loads(r.tags_json or "[]"),
        units=list(types[r.device_type].accelerators) if r.device_type in types else ["cpu"],
        facts=json.loads(r.facts_json or "{}"), slots=r.slots or 0, state=r.state or "", agent=r.agent or "",
        last_seen=r.last_seen or 0.0) for r in scope.store.devices.all()])


def agents(scope: Scope, ask: NoAsk) -> AgentsAnswer:
    """The controller's agents, each with its live session's last word and running tasks when connected."""
    if scope.agents is None:
        raise ServiceError("`farm agents` lists a controller's agents: pass --controller HOST:PORT (or set "
                           "FARM_CONTROLLER); embedded runs have one agent, in the process that runs the job")
    listed = []
    presence = scope.agents.presence  # agents on the lab's other controllers, as those last published them
    elsewhere = {s.agent: s for s in presence.fresh(time.time() - scope.controller.lease_ttl_s)} if presence else {}
    for r in scope.store.devices.agents():
        session = scope.agents.by_name.get(r.name)
        seen = None if session else elsewhere.get(r.name)
        listed.append(AgentInfo(
            name=r.name, state=seen.state if seen else (r.state or ""), farm_version=r.farm_version or "",
            capabilities=json.loads(r.capabilities_json or "[]"), hostname=r.hostname or "", peer=r.peer or "",
            connected_at=r.connected_at or 0.0,
            last_seen=session.last_seen if session else seen.last_seen if seen else (r.last_seen or 0.0),
            running=len(session.running) if session else seen.busy if seen else 0,
            controller=scope.agents.address if session else seen.controller if seen else ""))
    return AgentsAnswer(agents=listed)


def forget_device(scope: Scope, ask: ForgetDeviceAsk) -> ForgetDeviceAnswer:
    """An admin frees a device name its agent registered (admin only: auth.SERVICE_ROLES)."""
    if scope.agents is None:
        raise ServiceError("`farm device forget NAME` frees a name on a controller: pass --controller HOST:PORT and an "
                           "admin --token")
    try:
        owner = scope.agents.forget_device(ask.device)
    except LookupError as e:
        raise NotFound(str(e)) from None
    except ValueError as e:
        raise Refused(str(e)) from None
    return ForgetDeviceAnswer(device=ask.device, agent=owner)


def set_device_health(scope: Scope, ask: SetDeviceHealthAsk) -> SetDeviceHealthAnswer:
    """quarantine | release | maintenance: {device, action, failed_tasks}."""
    controller, device, action, reason = scope.controller, ask.device, ask.action, ask.reason
    check_name("device", device)
    if action not in DEVICE_ACTIONS:
        raise ServiceError(f"device action {action[:40]!r}: one of {', '.join(DEVICE_ACTIONS)}")
    if reason and len(reason) > MAX_REASON_CHARS:
        raise ServiceError(f"--reason is {len(reason)} characters; give at most {MAX_REASON_CHARS}")
    failed = 0
    if action == "release":
        controller.release(device)
    elif action == "quarantine":
        failed = controller.quarantine(device, reason or "quarantined by a person")
    else:
        failed = controller.quarantine(device, reason or "in maintenance", health="maintenance")
    return SetDeviceHealthAnswer(device=device, action=action, failed_tasks=failed)


# --- refresh -----------------------------------------------------------------------------------
def finish_refresh(scope: Scope, ask: FinishRefreshAsk) -> RefreshAnswer:
    """After a reference-suite job: refit, record drift, quarantine devices whose golden results moved."""
    from farm.controller.operations.reference_suite import HEALTH_CHECK
    from farm.controller.operations.refresh import DriftThresholds, after_reference_run, report_json

    store, job, k, include_contended = scope.store, ask.job, ask.k, ask.include_contended
    max_slope_change, max_prediction_shift = ask.max_slope_change, ask.max_prediction_shift
    max_intercept_change, max_r2_drop = ask.max_intercept_change, ask.max_r2_drop

    values = [check_finite("--k", k, 0.1, 1000)] + [check_finite(name, v, 0, 1000) for name, v in (
        ("--max-slope-change", max_slope_change), ("--max-prediction-shift", max_prediction_shift),
        ("--max-intercept-change", max_intercept_change), ("--max-r2-drop", max_r2_drop))]
    row = store.jobs.get(job)
    if row is None or row.kind != HEALTH_CHECK:
        raise ServiceError(f"job {job} is not a reference suite farm submitted; `farm refresh` starts one")
    if row.status not in ("completed", "failed", "canceled"):
        raise ServiceError(f"job {job} is {row.status}: the refresh checks it once it has finished")
    thresholds = DriftThresholds(slope_change=values[1], prediction_shift=values[2], intercept_change=values[3],
                                 r2_drop=values[4])
    return RefreshAnswer.model_validate(report_json(after_reference_run(
        store, job, thresholds=thresholds, k=k, alert=scope.alert, include_contended=include_contended)))


# --- predict -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MeasureFirst:
    """No sim run of the model fits the calibration yet: run this job (sim only), then ask again."""

    job: ResolvedJob
    threads: int


def _reusable_job(store: Store, sha256: str, threads: int, side: SimSide) -> int | None:
    """A job measured with the same sim budget and workload that has this model at these threads."""
    from farm.controller.analysis.calibrations import sim_side

    wanted = side.model_dump(mode="json")
    for row in store.jobs.completed_with_model(sha256, threads):
        measured = sim_side(row.spec_json)
        if measured is not None and measured.model_dump(mode="json") == wanted:
            return row.id
    return None


def _measurement(model: Path, model_name: str, threads: int, source: SimSide) -> ResolvedJob:
    """The sim job that measures `model` as the calibration's sim side was measured (its budget and workload)."""
    from farm.controller.scheduling.jobfile import JobFileError, resolve_job
    from farm.proto.spec import JobSpec, Matrix, ModelEntry, job_file_text

    try:
        spec = JobSpec(name=f"predict {model_name}",
                       models=[ModelEntry(path=str(model), name=Path(model_name).stem or "model")],
                       workload=source.workload, sim=source.sim,  # bytes, as the calibration stored them
                       matrix=Matrix(threads=[threads]), priority="interactive")
    except ValidationError as e:
        raise ServiceError(f"the calibration's sim side no longer makes a job ({e.errors()[0]['loc']}: "
                           f"{e.errors()[0]['msg']}); refit it") from None
    try:
        return resolve_job(spec, None, job_file_text(spec), f"prediction job for {model_name}", model.parent)
    except JobFileError as e:
        raise ServiceError(str(e)) from None


def predict(store: Store, model: Path, model_name: str, device: str, metrics: list[str], *, threads: int | None,
            confidence: float, include_contended: bool = False,
            measured_jobs: tuple[int, ...] = ()) -> list[Prediction] | MeasureFirst:
    """On-device estimates of `model` from the sim alone, or the sim job to run first.

    `model` is a file on the store's host (the user's, embedded; an uploaded artifact, remote);
    measured_jobs are the jobs run for this question so far (their runs are `measured now`)."""
    from farm.controller.analysis.calibrations import (
        METRICS, SIM_SIDE, SimSide, calibration_history, contended_left_out, current_calibration, job_values,
        model_features,
    )
    from farm.models.facts import ModelError, inspect_model

    check_name("--device", device)
    check_name("model name", model_name)
    check_finite("--confidence", confidence, 0.5, 0.999)
    if threads is not None and not 1 <= threads <= 1024:
        raise ServiceError(f"--threads {threads}: give 1 to 1024")
    if not metrics or len(metrics) > len(PREDICT_METRICS) or any(m not in PREDICT_METRICS for m in metrics):
        raise ServiceError(f"--metric: one or more of {', '.join(PREDICT_METRICS)}")
    if not model.exists():
        raise ServiceError(f"{model_name}: no such model file")
    try:
        facts = inspect_model(model)
    except ModelError as e:
        raise ServiceError(f"{model_name}: {e}") from None
    history = calibration_history(store, device)
    if not history:
        raise ServiceError(f"no calibration for device {device!r} in this farm; run `farm calibrate` first")
    thread_counts = sorted({r.threads for r in history if threads in (None, r.threads)})
    if not thread_counts:
        raise ServiceError(f"device {device!r} has no calibration at {threads} thread(s); it has "
                           f"{sorted({r.threads for r in history})}")
    predictions = []
    for t in thread_counts:
        newest = current_calibration(store, device, metrics[0] if metrics[0] in METRICS else "latency", t)
        source = newest.source if newest else None
        if source is None or source.sim is None or source.workload is None:
            raise ServiceError(f"calibration #{newest.id if newest else '?'} does not record its sim budget; refit it")
        side = SimSide(sim=source.sim, workload=source.workload)
        job_id = _reusable_job(store, facts.sha256, t, side)
        if job_id is None:  # a measurement of this question that did not complete says why below
            job_id = next((j for j in measured_jobs if store.jobs.model_tasks(j, facts.sha256, t)), None)
        if job_id is None:
            return MeasureFirst(_measurement(model, model_name, t, side), t)
        values = [v for v in job_values(store, job_id, "latency", include_contended=include_contended, target="sim")
                  if v.sha256 == facts.sha256 and v.threads == t]  # x is the sim's, never a paired device's
        if not values and not include_contended and contended_left_out(store, [job_id]):
            raise ServiceError(f"the sim run of {model_name} at {t} thread(s) was contended (other work used its "
                               f"cores; job {job_id}, `farm results {job_id} --json` shows why): measure again on "
                               "quieter cores, or pass --include-contended")
        if not values:
            task = store.jobs.model_tasks(job_id, facts.sha256, t)
            why = f"{task[0].failure_class}: {task[0].message}" if task else "no run"
            raise ServiceError(f"the sim run of {model_name} at {t} thread(s) did not complete ({why}); job {job_id}")
        runtime = values[0].runtime
        for metric in metrics:
            measured = [v.value for v in job_values(store, job_id, SIM_SIDE.get(metric, metric),
                                                    include_contended=include_contended, target="sim")
                        if v.sha256 == facts.sha256 and v.threads == t]
            stored = current_calibration(store, device, metric, t, runtime=runtime, batch_size=values[0].batch_size)
            if stored is None or not measured:
                raise ServiceError(f"device {device!r} has no {metric} calibration for {runtime} at {t} thread(s)")
            x = sum(measured) / len(measured)
            fit = stored.calibration.fits[stored.calibration.chosen]
            p = fit.predict(x, features=model_features(facts), confidence=confidence)
            predictions.append(Prediction(
                model=model_name, sha256=facts.sha256, device=device, metric=metric, threads=t,
                unit=METRICS[metric][1], sim=x, estimate=p.estimate, low=p.low, high=p.high,
                confidence=confidence, sim_job=job_id, sim_reused=job_id not in measured_jobs,
                calibration=PredictionCalibration(id=stored.id, version=stored.version, kind=stored.calibration.chosen,
                                                  family=stored.family or None, n=fit.n, r2=fit.r2),
                unsafe=stored.calibration.unsafe, formula=fit.formula,
                warnings=list(stored.calibration.warnings)
                + ([f"extrapolating: {'; '.join(map(str, p.extrapolation))} (the interval is widened)"]
                   if p.extrapolation else []),
                verdict=p.verdict, extrapolation=[PredictionOutOfRange(input=o.input, value=o.value, low=o.low,
                                                                       high=o.high) for o in p.extrapolation]))
    return predictions


def predict_uploaded(scope: Scope, ask: PredictUploadedAsk) -> PredictAnswer:
    """`farm predict` against a controller: the estimates, or the sim-only job it queued to measure the model
    (its agents run it like any job; the client watches it, then asks again)."""
    if scope.artifact is None or scope.submit is None:
        raise ServiceError("an uploaded model is predicted by a controller; embedded, `farm predict MODEL` reads the file")
    model = scope.artifact(ask.model_sha256)
    if model is None:
        raise ServiceError(f"no uploaded model with sha256 {ask.model_sha256!r} on this controller; `farm predict` "
                           "uploads it first")
    answer = predict(scope.store, model, ask.model_name, ask.device, ask.metrics, threads=ask.threads,
                     confidence=ask.confidence, include_contended=ask.include_contended,
                     measured_jobs=tuple(ask.measured_jobs))
    if isinstance(answer, MeasureFirst):  # sim only: the agents measure it like any job
        return PredictAnswer(predictions=[], measure_job=scope.submit(answer.job))
    return PredictAnswer(predictions=answer)
