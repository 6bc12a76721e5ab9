"""What each dashboard page shows, read from the store and the controller's own modules.

No SQL here (the store's dashboard queries own it) and no HTML (pages.py): plain data, so the
pages, the JSON endpoints and the tests see the same numbers.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from farm.controller.analysis.calibration import FitResult
from farm.controller.analysis.calibrations import METRICS, current_calibration, model_features, stored_calibration
from farm.controller.operations.refresh import last_reference_checks
from farm.controller.analysis.results import RunPair, is_contended, paired_records, run_records
from farm.controller.store import Store
from farm.controller.store.rows import (
    AgentRow, CalibrationRow, DashboardJob, DriftRow, EarlierAttempt, JobRow, LatestCalibration, QueuedWork, RunningTask,
)
from farm.web.svg import Band, Chart

if TYPE_CHECKING:  # sessions.py brings the gRPC messages; `farm web` over a store never needs them
    from pydantic import JsonValue

    from farm.controller.analysis.compare import Comparison, VariantRow
    from farm.controller.analysis.pareto import ParetoGroup, ParetoView
    from farm.controller.scheduling.sessions import Sessions
    from farm.proto.questions import RunRecord

JOBS_SHOWN = 200  # newest jobs on the jobs page; older ones by URL
DEVICES_PER_PAGE = 50  # a 200-device lab is four short pages, not one 69,000 px one
PANEL_ROWS = 10  # recent failures and drift alerts on the lab page
LAB_ROWS_SHOWN = 100  # running tasks and queue rows on the lab page
SWEEP_DIMENSIONS = (("threads", "threads"), ("batch_size", "batch size"), ("input_size", "input size"),
                    ("cpus", "CPU budget (cores)"))
MIN_LOO_MODELS = 3  # leaving one of two models out fits a line through one point: its "0 %" error means nothing
SHORT_LABELS = {"threads": "threads", "batch_size": "batch", "input_size": "input", "cpus": "cpus"}
OP_ROWS_SHOWN = 200  # per-operator rows per run; a model with thousands of ops lists its heaviest
FAILURES_SHOWN = 50  # failed runs explained on a job page; the JSON download has every one
LOG_LINES_SHOWN = 30  # the last lines of a failed run's kept output
UNSUPPORTED_OP = re.compile(r"unsupported operator[s]?:? ([A-Za-z0-9_.:/\-]{1,80})", re.IGNORECASE)


@dataclass(frozen=True)
class LabTask:
    """A running task as the lab page shows it: the device it occupies and, with live sessions, whether one runs it."""

    task: RunningTask
    device: str
    in_session: bool | None = None  # None: no live sessions to ask (the dashboard over a store alone)
    hidden: bool = False  # another team's task: its device shows busy, and nothing more is said

    @property
    def id(self) -> int:
        return self.task.id

    @property
    def job_id(self) -> int:
        return self.task.job_id


@dataclass(frozen=True)
class LabAgent:
    """An agent as the lab page lists it: its stored registration, with live sessions' state where there are some."""

    name: str
    state: str | None
    hostname: str | None
    peer: str | None
    farm_version: str | None
    connected_at: float | None
    last_seen: float | None
    running: int | None = None  # busy slots (None: no live sessions to ask)
    controller: str = ""  # the controller it is connected to (HOST:PORT)

    @classmethod
    def stored(cls, row: AgentRow) -> LabAgent:
        return cls(row.name, row.state, row.hostname, row.peer, row.farm_version, row.connected_at, row.last_seen)


@dataclass(frozen=True)
class RecentFailure:
    """A failed run (the newest of its task's failed attempts), or a task failed without a run (a quarantine's)."""

    run_id: int | None
    job_id: int
    task_id: int
    attempt: int | None
    failure_class: str | None
    message: str | None
    finished_at: float | None
    limits_memory_mb: float | None
    target: str
    model_name: str
    failed_attempts: int | None


@dataclass(frozen=True)
class JobLine:
    """A job as the jobs page lists it, with its progress."""

    job: DashboardJob
    progress: dict[str, int]


@dataclass
class DeviceLine:
    name: str
    device_type: str | None
    driver: str | None
    agent: str | None
    state: str  # the agent's connection: online / offline / unknown
    health: str  # good / bad / maintenance / unknown
    reason: str | None
    changed_at: float | None
    last_check: float | None  # the last reference-suite run that completed on it
    calibration_age_s: float | None
    current: list[LabTask] = field(default_factory=list)  # running tasks on it

    @property
    def busy(self) -> bool:
        return bool(self.current)


@dataclass(frozen=True)
class AgentNow:
    """One connected agent as its session says: its state, when it last spoke, the attempts it runs."""

    name: str
    state: str
    last_seen: float
    connected_at: float
    running: tuple[tuple[int, int], ...]  # (task, attempt); another controller's agent: ()
    controller: str = ""  # the controller it is connected to (HOST:PORT)
    busy: int | None = None  # another controller's agent: its busy slots as that controller last published them
    here: bool = True  # on this controller's own streams


def agents_now(sessions: Sessions) -> dict[str, AgentNow]:
    """The lab's connected agents by name: this controller's, read under the sessions' lock (the state the
    dispatcher leases by, so the lab page cannot disagree with the scheduler or with `farm agents`), and those
    other controllers on the same store published within a lease TTL (store/presence.py)."""
    with sessions.lock:
        now = {s.name: AgentNow(s.name, s.state, s.last_seen, s.connected_at, tuple(sorted(s.running)),
                                sessions.address, len(s.running)) for s in sessions.by_name.values()}
    if sessions.presence is not None:
        for seen in sessions.presence.fresh(time.time() - sessions.controller.lease_ttl_s):
            if seen.agent not in now and seen.controller != sessions.address:
                now[seen.agent] = AgentNow(seen.agent, seen.state, seen.last_seen, seen.connected_at, (),
                                           seen.controller, seen.busy, here=False)
    return now


@dataclass
class LabView:
    devices: list[DeviceLine]
    agents: list[LabAgent]
    running: list[LabTask]
    queue: list[QueuedWork]
    live: bool = False  # connection and last-seen come from the controller's sessions (else from the store)
    recent_failures: list[RecentFailure] = field(default_factory=list)
    drift_alerts: list[DriftRow] = field(default_factory=list)
    hidden_pending: int = 0  # pending tasks of jobs this viewer may not read (counted, never named)

    @property
    def pending(self) -> int:
        return sum(q.pending for q in self.queue) + self.hidden_pending


def _device_of(task: RunningTask, sim_device: dict[str, str]) -> str:
    """The device a running task occupies: a sim task runs on its agent's own sim device (`AGENT/sim`)."""
    if task.target == "sim" and task.leased_by is not None and task.leased_by in sim_device:
        return sim_device[task.leased_by]
    return task.target


def _in_session(task: RunningTask, live: dict[str, AgentNow], held: set[int], elsewhere: set[str]) -> bool:
    """Whether a live session runs the task: a lease the store holds for an agent that is gone, or that no session
    runs, is not (another controller's agent: its controller vouches for it)."""
    agent = task.leased_by
    return (task.id in held and agent is not None and agent in live) or (agent is not None and agent in elsewhere)


def _live_agent(row: AgentRow, session: AgentNow | None) -> LabAgent:
    """An agent as its live session (this controller's, or another's published one) says; no session: offline."""
    if session is None:
        return LabAgent(row.name, "offline", row.hostname, row.peer, row.farm_version, row.connected_at,
                        row.last_seen, 0, "")
    return LabAgent(row.name, session.state, row.hostname, row.peer, row.farm_version, session.connected_at,
                    session.last_seen, len(session.running) if session.busy is None else session.busy,
                    session.controller)


def lab_view(store: Store, now: float | None = None, live: dict[str, AgentNow] | None = None,
             may_read: Callable[[JobRow], bool] | None = None) -> LabView:
    """The lab; with `live` (the controller's sessions) connection, last-seen and what runs come from them.
    may_read (a job row -> whether this viewer may read it; None: everything): another team's running task is
    shown as a busy device and nothing more, its queue rows as a count, its failures not at all (issue 33)."""
    now = now or time.time()
    jobs: dict[int, bool] = {}

    def readable(job_id: int) -> bool:
        if may_read is None:
            return True
        if job_id not in jobs:
            job = store.jobs.get(job_id)
            jobs[job_id] = job is not None and may_read(job)
        return jobs[job_id]

    checks = last_reference_checks(store)
    calibrated = store.calibrations.newest_by_device()
    stored_devices = store.reads.devices()
    sim_device = {d.agent: d.name for d in stored_devices if d.driver == "sim" and d.agent}
    held = {task for agent in live.values() for task, _ in agent.running} if live is not None else set()
    elsewhere = {name for name, agent in live.items() if not agent.here} if live is not None else set()
    running = [LabTask(task, _device_of(task, sim_device),
                       None if live is None else _in_session(task, live, held, elsewhere),
                       hidden=not readable(task.job_id)) for task in store.reads.running_tasks()]
    by_device: dict[str, list[LabTask]] = {}
    for lab_task in running:
        by_device.setdefault(lab_task.device, []).append(lab_task)
    running = [lab_task for lab_task in running if not lab_task.hidden]
    queue = store.reads.queue()
    hidden_pending = sum(q.pending for q in queue if not readable(q.job_id))

    def state(agent: str | None, stored: str | None) -> str:
        if live is None or not agent:
            return stored or "unknown"
        return live[agent].state if agent in live else "offline"

    devices = [DeviceLine(name=d.name, device_type=d.device_type, driver=d.driver, agent=d.agent,
                         state=state(d.agent, d.state), health=d.health or "unknown", reason=d.reason,
                         changed_at=d.changed_at, last_check=checks.get(d.name),
                         calibration_age_s=now - calibrated[d.name] if d.name in calibrated else None,
                         current=by_device.get(d.name, []))
               for d in stored_devices]
    known = {d.name for d in devices}
    # a device only calibrated so far (embedded labs register none): listed, its health unknown
    devices += [DeviceLine(name=name, device_type=None, driver=None, agent=None, state="unknown", health="unknown",
                          reason=None, changed_at=None, last_check=checks.get(name), calibration_age_s=now - at,
                          current=by_device.get(name, [])) for name, at in sorted(calibrated.items()) if name not in known]
    agents = [LabAgent.stored(a) if live is None else _live_agent(a, live.get(a.name)) for a in store.reads.agents()]
    # the store's dashboard queries answer these two as plain rows: read into their shapes here, once
    failures = [failure for failure in (RecentFailure(**f) for f in store.reads.recent_failures(PANEL_ROWS * 4))
                if readable(failure.job_id)]
    drift = [DriftRow.of(d) for d in store.reads.drift_alerts(PANEL_ROWS)]
    return LabView(devices, agents, running, [q for q in queue if readable(q.job_id)], live=live is not None,
                   recent_failures=failures[:PANEL_ROWS], drift_alerts=drift, hidden_pending=hidden_pending)


HEALTHS = ("good", "bad", "maintenance", "unknown")
CONNECTIONS = ("online", "draining", "offline", "unknown")
ACTIVITIES = ("busy", "idle")


@dataclass(frozen=True)
class LabFilter:
    """What the lab page lists: a health, a connection, busy or idle, a name fragment, and which page of it."""

    health: str | None = None
    state: str | None = None
    activity: str | None = None
    name: str = ""
    page: int = 1

    @classmethod
    def from_query(cls, query: dict[str, str]) -> "LabFilter":
        """From the URL; anything not one of the known words is no filter (a hostile query filters nothing)."""
        page = query.get("page", "1")
        return cls(query.get("health") if query.get("health") in HEALTHS else None,
                   query.get("state") if query.get("state") in CONNECTIONS else None,
                   query.get("activity") if query.get("activity") in ACTIVITIES else None,
                   query.get("name", "").strip()[:100],
                   max(1, min(int(page), 100_000)) if page.isdigit() and len(page) < 7 else 1)

    def matches(self, d: DeviceLine) -> bool:
        return ((self.health is None or d.health == self.health) and (self.state is None or d.state == self.state)
                and (self.activity is None or (self.activity == "busy") == d.busy)
                and (not self.name or self.name.casefold() in d.name.casefold()))

    def query(self, **change: Any) -> dict[str, str]:
        """This filter as URL fields (only the set ones), with `change` applied."""
        fields = {"health": self.health, "state": self.state, "activity": self.activity, "name": self.name or None,
                  "page": self.page if self.page > 1 else None, **change}
        return {k: str(v) for k, v in fields.items() if v not in (None, "", 1)}


@dataclass
class LabPage:
    """One page of the devices a filter matches, and the counts of the whole lab."""

    shown: list[DeviceLine]
    matched: int
    page: int
    pages: int
    health: dict[str, int]
    connection: dict[str, int]
    busy: int


def lab_page(devices: list[DeviceLine], f: LabFilter, per_page: int = DEVICES_PER_PAGE) -> LabPage:
    matched = [d for d in devices if f.matches(d)]
    pages = max(1, -(-len(matched) // per_page))
    page = min(f.page, pages)
    health = {h: 0 for h in HEALTHS}
    connection = {c: 0 for c in CONNECTIONS}
    for d in devices:
        health[d.health] = health.get(d.health, 0) + 1
        connection[d.state] = connection.get(d.state, 0) + 1
    return LabPage(matched[(page - 1) * per_page:page * per_page], len(matched), page, pages, health, connection,
                   sum(d.busy for d in devices))


def job_progress(counts: dict[str, int]) -> dict[str, int]:
    total = sum(counts.values())
    done = sum(counts.get(s, 0) for s in ("completed", "failed", "canceled"))
    return {"total": total, "done": done, **{s: counts.get(s, 0) for s in
                                             ("pending", "running", "completed", "failed", "canceled")}}


def jobs_view(store: Store, limit: int = JOBS_SHOWN,
              visible_to: tuple[str, str | None] | None = None) -> tuple[list[JobLine], int]:
    """The newest jobs; visible_to (owner, team) keeps to what that viewer may read (service.Viewer)."""
    return ([JobLine(j, job_progress(j.counts)) for j in store.reads.jobs(limit, visible_to)],
            store.reads.job_count(visible_to))


@dataclass
class AverageRow:
    """One matrix cell of one model on one target, over its repeats (contended runs left out)."""

    model: str
    target: str
    threads: int
    batch_size: int
    input_size: int | None
    cpus: float | None  # the run's CPU budget (a sim budget may be swept too)
    runs: int  # completed, uncontended
    contended: int
    latency_ms: float | None
    latency_spread_ms: float | None  # standard deviation of the repeats' averages
    peak_memory_mb: float | None
    avg_memory_mb: float | None


@dataclass
class Failure:
    """Why one run failed, with what shows it: the limit and the peak, the kept output, the operators."""

    task: int
    title: str  # which run (model @ target, threads, repeat)
    failure_class: str
    message: str
    memory_limit_mb: float | None = None
    memory_peak_mb: float | None = None
    log_lines: list[str] = field(default_factory=list)
    operators: list[str] = field(default_factory=list)


@dataclass
class JobView:
    job: JobRow
    progress: dict[str, int]
    records: list[RunRecord]
    averages: list[AverageRow]
    pairs: list[RunPair]
    sweeps: list[Sweep]
    op_tables: list[tuple[str, list[str], list[list[JsonValue]]]]  # (title, columns, rows)
    failures: list[Failure] = field(default_factory=list)
    pair_charts: list[Chart] = field(default_factory=list)  # device vs sim, with the device's current calibration
    earlier: dict[int, list[EarlierAttempt]] = field(default_factory=dict)  # task -> its runs before the counted one
    variants: list[VariantRow] = field(default_factory=list)  # `farm quantize` variants beside their sources
    pareto: list[tuple[ParetoGroup, Chart]] = field(default_factory=list)  # accuracy vs latency per setting


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def averages(records: list[RunRecord]) -> list[AverageRow]:
    groups: dict[tuple[str, str, str, int, int, int | None, float | None], list[RunRecord]] = {}
    for r in records:
        key = (r.model.name, r.model.sha256, r.target, r.threads, r.batch_size, r.input_size, r.limits.cpus)
        groups.setdefault(key, []).append(r)
    rows = []
    for (model, _, target, threads, batch, size, cpus), group in groups.items():
        done = [r for r in group if r.status == "completed"]
        quiet = [r for r in done if not is_contended(r)]
        lat = [r.latency_ms.avg for r in quiet if r.latency_ms and r.latency_ms.avg is not None]
        peak = [r.peak_memory_mb for r in quiet if r.peak_memory_mb is not None]
        avg_mem = [r.avg_memory_mb for r in quiet if r.avg_memory_mb is not None]
        rows.append(AverageRow(model, target, threads, batch, size, cpus, len(quiet), len(done) - len(quiet), _mean(lat),
                               statistics.stdev(lat) if len(lat) > 1 else None, _mean(peak), _mean(avg_mem)))
    return rows


@dataclass
class Sweep:
    """Latency against one matrix dimension: the series that vary along it as lines, the ones measured at
    one value only as rows of a table under it (a lone point is no line, and a dot named in a legend is unreadable)."""

    label: str
    chart: Chart | None  # None when no series has two values of the dimension
    single: list[tuple[str, float, float]]  # (series, its one value of the dimension, latency avg ms)


def _follows(rows: list[AverageRow], dependent: str, on: str) -> bool:
    """True when `dependent` is a function of `on` in these rows (the CPU budget set by the thread count):
    it then names no series of its own on `on`'s chart. A device run has no budget (None): it breaks no rule."""
    seen: dict[Any, Any] = {}
    return all(seen.setdefault(getattr(r, on), getattr(r, dependent)) == getattr(r, dependent) for r in rows
               if getattr(r, dependent) is not None)


def sweep_charts(rows: list[AverageRow]) -> list[Sweep]:
    """Latency against each matrix dimension that varies, one line per model, target and other varying dimension."""
    sweeps: list[Sweep] = []
    charted: list[str] = []
    for attr, label in SWEEP_DIMENSIONS:
        if len({getattr(r, attr) for r in rows if getattr(r, attr) is not None}) < 2:
            continue
        if any(_follows(rows, attr, a) and _follows(rows, a, attr) for a in charted):
            continue  # moves in step with a dimension already charted (cpus = threads): the same chart again
        charted.append(attr)
        others = [a for a, _ in SWEEP_DIMENSIONS if a != attr and len({getattr(r, a) for r in rows}) > 1
                  and not _follows(rows, a, attr)]
        series: dict[str, list[tuple[float, float]]] = {}
        for r in rows:
            if r.latency_ms is None or getattr(r, attr) is None:
                continue
            name = f"{r.model} @ {r.target}" + "".join(
                f" · {SHORT_LABELS[a]} {getattr(r, a):g}" for a in others if getattr(r, a) is not None)
            series.setdefault(name, []).append((float(getattr(r, attr)), r.latency_ms))
        lines = {name: points for name, points in series.items() if len({x for x, _ in points}) > 1}
        single = sorted((name, x, y) for name, points in series.items() if name not in lines for x, y in points)
        chart = Chart(f"latency by {label}", label, "latency avg (ms)", series=lines) if lines else None
        sweeps.append(Sweep(label, chart, single))
    return sweeps


def _op_table(profile: list[JsonValue]) -> tuple[list[str], list[list[JsonValue]]] | None:
    """A record's `op_profile` (a list of per-op objects: op types, then nodes) as columns and rows."""
    rows = [p for p in profile if isinstance(p, dict)][:OP_ROWS_SHOWN]
    if not rows:
        return None
    columns: list[str] = []
    for p in rows:
        columns += [str(k) for k in p if str(k) not in columns and not isinstance(p[k], (dict, list))]
    return columns, [[p.get(c) for c in columns] for p in rows]


_PEAK_IN_MESSAGE = re.compile(r"peak (?:reached )?([0-9.]+) ?MiB")


def run_title(r: RunRecord) -> str:
    return f"{r.model.name} @ {r.target} · threads {r.threads} · repeat {r.repeat}"


def failures(records: list[RunRecord], log_tails: dict[int, str]) -> list[Failure]:
    """Every failed task's class and message with its evidence, as the store keeps it."""
    out = []
    for r in records:
        if r.status != "failed" or not r.failure_class:
            continue
        message = r.message or ""
        tail = log_tails.get(r.run, "") if r.run is not None else ""
        failure = Failure(r.task, run_title(r), r.failure_class, message,
                          log_lines=tail.rstrip("\n").splitlines()[-LOG_LINES_SHOWN:] if tail else [])
        if r.failure_class == "resource":
            failure.memory_limit_mb = r.limits.memory_mb
            failure.memory_peak_mb = r.peak_memory_mb
            found = _PEAK_IN_MESSAGE.search(message)
            if failure.memory_peak_mb is None and found:
                try:  # the sandbox's own words when no telemetry row survived the kill
                    failure.memory_peak_mb = float(found.group(1))  # the store's MB are MiB too
                except ValueError:
                    pass
        for text in (message, tail):
            for op in UNSUPPORTED_OP.findall(text):
                op = op.rstrip(".:")
                if op and op not in failure.operators:
                    failure.operators.append(op)
        out.append(failure)
    return out


def job_view(store: Store, job_id: int) -> JobView | None:
    job = store.jobs.get(job_id)
    if job is None:
        return None
    progress = job_progress(store.jobs.task_counts(job_id))
    records = run_records(store, job_id, ops=True)  # with each run's op profile: the per-operator tables
    rows = averages(records)
    tables = []
    for r in records:
        table = _op_table(r.op_profile)
        if table:
            tables.append((run_title(r), *table))
    failed_runs = [r.run for r in records if r.status == "failed" and r.run is not None]
    pairs = paired_records(records)
    from farm.controller.analysis.compare import sidecar_lineage, variant_rows  # sidecars only: no model parsed per visit
    return JobView(job, progress, records, rows, pairs, sweep_charts(rows), tables,
                   failures=failures(records, store.reads.log_tails(failed_runs)),
                   earlier=store.reads.earlier_attempts(job_id), pair_charts=pair_charts(store, pairs) if pairs else [],
                   variants=variant_rows(job_id, records, sidecar_lineage), pareto=pareto_charts(job_id, records))


@dataclass
class CompareView:
    """Two jobs (or one job's variants) side by side: `farm compare A B`'s figures and the Pareto view of both."""

    job_a: JobRow
    job_b: JobRow
    report: Comparison  # compare_records' answer
    rows: list[VariantRow]  # one flat row per pair and setting (compare.variant_row)
    pareto: list[tuple[ParetoGroup, Chart]]
    pareto_notes: list[str]
    pareto_data: ParetoView  # pareto()'s answer, for the JSON download


def compare_view(store: Store, job_a: JobRow, job_b: JobRow) -> CompareView:
    """Both jobs already checked readable by the caller; lineage from the sidecars only (no model parsed per visit)."""
    from farm.controller.analysis.compare import compare_records, sidecar_lineage, variant_row
    from farm.controller.analysis.pareto import pareto

    a, b = job_a.id, job_b.id
    records_a = run_records(store, a)
    records_b = records_a if b == a else run_records(store, b)
    report = compare_records(records_a, records_b, job_a=a, job_b=b, lineage_of=sidecar_lineage)
    both = [(a, records_a)] + ([] if b == a else [(b, records_b)])
    view = pareto(both)
    return CompareView(job_a, job_b, report, [variant_row(p, r) for p in report.pairs for r in p.rows],
                       _charts(view.groups), view.notes, view)


MAX_PARETO_CHARTS = 12  # one per setting (target, unit, threads, batch, size, budget)


def pareto_charts(job_id: int, records: list[RunRecord]) -> list[tuple[ParetoGroup, Chart]]:
    """Accuracy against latency per setting (controller/analysis/pareto.py), each with its chart: the front as a
    line, every model a labelled point; empty for a job without `workload.dataset` figures."""
    from farm.controller.analysis.pareto import pareto

    return _charts(pareto([(job_id, records)]).groups)


def _charts(groups: list[ParetoGroup]) -> list[tuple[ParetoGroup, Chart]]:
    from farm.controller.analysis.pareto import group_title

    found = []
    for group in groups[:MAX_PARETO_CHARTS]:
        front = [(p.latency_avg_ms, p.quality) for p in group.points if p.on_front]
        chart = Chart(title=f"Pareto · {group_title(group)}", x_label="latency avg (ms)",
                      y_label=group.quality_label, series={"Pareto front": front},
                      points=[(p.label + ("" if p.on_front else " (dominated)"), p.latency_avg_ms, p.quality)
                              for p in group.points], point_axes=("latency ms", group.quality_metric))
        found.append((group, chart))
    return found


def _avg_latency(record: RunRecord) -> float | None:
    return record.latency_ms.avg if record.latency_ms else None


def pair_charts(store: Store, pairs: list[RunPair]) -> list[Chart]:
    """One scatter per device and thread count: this job's pairs, with the line and band of the device's current
    latency calibration (what `farm predict` would use), so a point off the band stands out."""
    groups: dict[tuple[str, int, str | None, int], list[RunPair]] = {}  # device, threads, runtime, batch
    for p in pairs:
        groups.setdefault((p.device, p.threads, p.device_run.runtime, p.batch_size), []).append(p)
    charts = []
    for (device, threads, runtime, batch), group in sorted(groups.items(), key=lambda g: str(g[0])):
        points = [(p.model.name, _avg_latency(p.sim), _avg_latency(p.device_run)) for p in group]
        finite = [(m, x, y) for m, x, y in points if x is not None and y is not None]
        chart = Chart(f"{device} · {threads} thread(s): device vs sim latency", "sim latency avg (ms)",
                      "device latency avg (ms)", points=finite)
        stored = current_calibration(store, device, "latency", threads, runtime=runtime, batch_size=batch)
        if stored is not None and finite:
            cal = stored.calibration
            fit = cal.chosen_fit
            chart.note = f"calibration v{stored.version}: {fit.formula}\nR² = {fit.r2:.3f}"
            if fit.features_used:  # no single line in x: each model's predicted value with its interval
                by_name = {p.model.name: p.model for p in group}
                for name, x, _ in finite:
                    f = fit.predict(x, features=model_features(by_name[name].model_dump()), confidence=cal.confidence)
                    chart.error_bars.append((x, f.estimate, f.low, f.high))
            else:
                lo, hi = min(x for _, x, _ in finite), max(x for _, x, _ in finite)
                lo, hi = (lo * 0.9, hi * 1.1) if hi > lo else (lo * 0.8, hi * 1.2 + 1e-9)
                grid = [lo + (hi - lo) * i / 60 for i in range(61)]
                estimate, low, high = fit.predict_arrays(grid, confidence=cal.confidence)
                chart.band = Band(grid, estimate.tolist(), low.tolist(), high.tolist(),
                                  f"calibration v{stored.version} ({cal.chosen}), {cal.confidence:.0%} prediction interval")
        else:
            chart.note = "no latency calibration for this device yet"
        charts.append(chart)
    return charts


@dataclass(frozen=True)
class JobSummary:
    """What the live parts of a job page poll for (/api/jobs/N)."""
    id: int
    status: str
    progress: dict[str, int]  # job_progress: total, done and each status's count

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "status": self.status, "progress": self.progress})


def job_summary(store: Store, job_id: int) -> JobSummary | None:
    """What the live parts of a job page poll for."""
    job = store.jobs.get(job_id)
    if job is None:
        return None
    return JobSummary(job_id, job.status, job_progress(store.jobs.task_counts(job_id)))


@dataclass
class CalibrationSummary:
    row: LatestCalibration
    unsafe: bool
    formula: str


def calibrations_view(store: Store) -> list[CalibrationSummary]:
    out = []
    for row in store.calibrations.latest():
        cal = stored_calibration(row).calibration
        out.append(CalibrationSummary(row, cal.unsafe,
                                      cal.chosen_fit.formula))
    return out


@dataclass(frozen=True)
class FittedModel:
    """One pair of a calibration with the chosen fit's value and interval at its sim value."""
    model: str
    family: str | None
    sim: float
    device: float
    fitted: float
    low: float
    high: float


@dataclass(frozen=True)
class VersionLine:
    """One stored version of a calibration's key, with its fit's verdict and formula."""
    row: CalibrationRow
    unsafe: bool
    formula: str


@dataclass
class CalibrationView:
    row: CalibrationRow
    unit: str
    chosen: str
    formula: str
    fit: FitResult  # the chosen fit
    unsafe_reasons: list[str]
    warnings: list[str]
    confidence: float
    chart: Chart
    versions: list[VersionLine]
    history_charts: list[Chart]
    drift: list[DriftRow]
    drift_chart: Chart
    models: list[FittedModel]  # each pair with its fitted value and interval


def key_label(row: CalibrationRow | LatestCalibration) -> str:
    size = f" · input {row.input_size}" if row.input_size else ""
    family = f" · family {row.family}" if row.family else ""
    return (f"{row.device} · {row.metric} · {row.threads} thread(s) · batch {row.batch_size or 1}"
            f"{size} · {row.precision or 'fp32'}{family}")


DRIFT_FIGURES: tuple[tuple[str, Callable[[DriftRow], float | None]], ...] = (
    ("slope change", lambda d: d.slope_change), ("intercept change", lambda d: d.intercept_change),
    ("R² drop", lambda d: d.r2_drop), ("prediction shift", lambda d: d.prediction_shift))


def calibration_view(store: Store, calibration_id: int) -> CalibrationView | None:
    row = store.calibrations.get(calibration_id)
    if row is None:
        return None
    cal = stored_calibration(row).calibration
    fit = cal.chosen_fit
    unit = METRICS.get(row.metric, ("", ""))[1]
    chart = Chart(f"{key_label(row)} · v{row.version}", f"sim {row.metric} ({unit})",
                  f"device {row.metric} ({unit})", points=[(p.model, p.x, p.y) for p in cal.pairs],
                  note=f"{fit.formula}\nR² = {fit.r2:.3f}")
    fitted = [fit.predict(p.x, features=p.features, confidence=cal.confidence) for p in cal.pairs]
    if fit.features_used:  # no single line in x: each model's fitted value with its interval
        chart.error_bars = [(p.x, f.estimate, f.low, f.high) for p, f in zip(cal.pairs, fitted)]
    elif cal.pairs:
        lo, hi = min(p.x for p in cal.pairs), max(p.x for p in cal.pairs)
        grid = [lo + (hi - lo) * i / 60 for i in range(61)]
        estimate, low, high = fit.predict_arrays(grid, confidence=cal.confidence)  # one call, not one per point
        chart.band = Band(grid, estimate.tolist(), low.tolist(), high.tolist(),
                          f"{cal.chosen}, {cal.confidence:.0%} prediction interval")
    models = [FittedModel(p.model, p.family, p.x, p.y, f.estimate, f.low, f.high) for p, f in zip(cal.pairs, fitted)]
    versions = []
    for v in store.calibrations.versions(row.id):
        c = stored_calibration(v).calibration
        versions.append(VersionLine(v, c.unsafe, c.chosen_fit.formula))
    # by date, R² and the error each on its own axis (two values of different scales), fit-kind changes marked
    changes = [(v.row.created_at, f"→ {v.row.kind}") for prev, v in zip(versions, versions[1:])
               if v.row.kind != prev.row.kind and v.row.created_at is not None]
    history = [
        Chart("R² by date", "stored (UTC)", "R²", dates_x=True, markers=changes,
              series={"R²": [(v.row.created_at, v.row.r2) for v in versions if v.row.r2 is not None and v.row.created_at]}),
        Chart("leave-one-out error by date", "stored (UTC)", "mean absolute error (%)", dates_x=True, markers=changes,
              series={"LOO error %": [(v.row.created_at, 100 * v.row.loo_mape) for v in versions
                                      if v.row.loo_mape is not None and v.row.created_at
                                      and (v.row.n or 0) >= MIN_LOO_MODELS]})]
    drift = store.calibrations.drift_history(row.device, metric=row.metric, threads=row.threads)
    drift_chart = Chart("drift at each refresh (relative to the calibration before)", "refresh", "change",
                        integer_x=True, series={
        name: [(i, value) for i, d in enumerate(drift, 1) if (value := figure(d)) is not None]
        for name, figure in DRIFT_FIGURES})
    return CalibrationView(row, unit, cal.chosen, fit.formula, fit, cal.unsafe_reasons, cal.warnings, cal.confidence,
                           chart, versions, history, drift, drift_chart, models)
