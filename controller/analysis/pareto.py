"""Accuracy against latency (issue 30 item 4): which models of a job, or of two compared jobs, are worth keeping.

Points are grouped by setting — target, compute unit, threads, batch, input size and budget, everything a run's
cell is but the model — so a group's models ran under the same conditions. Each point is one model (of one job) in
one group: its latency is the mean of the cell's runs' average latency (clean runs where there are any, as
`farm compare` takes them; `contended` counts the runs used where a cell had no clean one), its quality the mean of one figure `workload.dataset` recorded, the first of these
that any point of the group has:

1. accuracy top-1 against the dataset's labels;
2. top-1 agreement with the reference (the float model, or a reference output file);
3. cosine similarity with the reference.

A run failed as `accuracy` (outputs beyond the user's threshold) keeps its figures and counts: it is a point, and
usually a dominated one. A point is *dominated* when another point of its group is at least as fast and at least as
accurate, and strictly better in one; the others form the Pareto front. The judgement is on means: two points
inside each other's run-to-run noise are still ordered (`farm compare` judges the noise per pair).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from farm.controller.analysis.compare import Condition, Setting, _accuracy, _finite, _runs_used, _with_accuracy, condition
from farm.proto.questions import Model, RunRecord

PointKey = tuple[int, str, str]  # (job, model name, sha256)

QUALITY: tuple[tuple[str, Callable[[RunRecord], float | None], str], ...] = (
    ("accuracy_top1", _accuracy("accuracy", "top1"), "accuracy top-1"),
    ("agreement_top1", _accuracy("agreement", "top1"), "top-1 agreement with the reference"),
    ("agreement_cosine", _accuracy("agreement", "cosine"), "cosine with the reference"),
)
CSV_COLUMNS = ("job", "model", "sha256", "target", "accelerator", "threads", "batch_size", "input_size", "cpus",
               "memory_mb", "latency_avg_ms", "quality_metric", "quality", "runs", "contended", "on_front", "dominated_by")


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class _Measured:
    """One model of one job in one setting, before the group's quality figure is chosen."""

    job: int
    model: str
    sha256: str
    latency_avg_ms: float
    runs: int
    contended: int
    figures: dict[str, float]  # each QUALITY figure the runs have: its mean


class ParetoPoint(Model):
    """A model (of one job) in a setting: its mean latency, the group's quality figure, and the front's verdict."""

    job: int
    model: str
    sha256: str
    latency_avg_ms: float
    runs: int
    contended: int
    figures: dict[str, float]
    label: str
    quality: float
    dominated_by: list[str]
    on_front: bool


class ParetoGroup(Setting):
    """A setting (everything a cell is but the model) and its models placed by latency and one quality figure."""

    quality_metric: str
    quality_label: str
    points: list[ParetoPoint]
    without_quality: list[str]


class ParetoView(Model):
    """`farm compare --pareto --json`: the jobs, a group per setting with a quality figure, and notes."""

    jobs: list[int]
    groups: list[ParetoGroup]
    notes: list[str]


def _cells(jobs: list[tuple[int, list[RunRecord]]]) -> dict[Condition, dict[PointKey, list[RunRecord]]]:
    """{setting: {(job, model name, sha256): runs}}."""
    cells: dict[Condition, dict[PointKey, list[RunRecord]]] = {}
    for job, records in jobs:
        for r in records:
            key = (job, r.model.name, r.model.sha256)
            cells.setdefault(condition(r), {}).setdefault(key, []).append(r)
    return cells


def _point(key: PointKey, runs: list[RunRecord]) -> _Measured | None:
    used, contended = _runs_used(runs)
    latency = _mean([v for v in (_finite(r.latency_ms.avg if r.latency_ms else None) for r in used) if v is not None])
    if latency is None:  # no completed run with a latency: nothing to place
        return None
    with_accuracy = _with_accuracy(runs, used)
    quality = {name: _mean([v for v in (figure(r) for r in with_accuracy) if v is not None])
               for name, figure, _ in QUALITY}
    job, model, sha = key
    return _Measured(job=job, model=model, sha256=sha, latency_avg_ms=latency, runs=len(with_accuracy),
                     contended=contended, figures={k: v for k, v in quality.items() if v is not None})


def dominates(q: ParetoPoint, p: ParetoPoint) -> bool:
    """q is at least as fast and as accurate as p, and strictly better in one."""
    return (q.latency_avg_ms <= p.latency_avg_ms and q.quality >= p.quality
            and (q.latency_avg_ms < p.latency_avg_ms or q.quality > p.quality))


def _label(point: _Measured, several_jobs: bool) -> str:
    return f"{point.model} (job {point.job})" if several_jobs else point.model


def _group(setting: Condition, points: list[_Measured], several_jobs: bool) -> ParetoGroup | None:
    metric = next(((name, label) for name, _, label in QUALITY if any(name in p.figures for p in points)), None)
    if metric is None:
        return None
    placed = [ParetoPoint(job=p.job, model=p.model, sha256=p.sha256, latency_avg_ms=p.latency_avg_ms, runs=p.runs,
                          contended=p.contended, figures=p.figures, label=_label(p, several_jobs),
                          quality=p.figures[metric[0]], dominated_by=[], on_front=True)
              for p in points if metric[0] in p.figures]
    for p in placed:
        p.dominated_by = [q.label for q in placed if q is not p and dominates(q, p)]
        p.on_front = not p.dominated_by
    placed.sort(key=lambda p: (p.latency_avg_ms, -p.quality, p.label))
    target, accelerator, threads, batch, size, cpus, memory = setting
    return ParetoGroup(target=target, accelerator=accelerator, threads=threads, batch_size=batch, input_size=size,
                       cpus=cpus, memory_mb=memory, quality_metric=metric[0], quality_label=metric[1], points=placed,
                       without_quality=[_label(p, several_jobs) for p in points if metric[0] not in p.figures])


def pareto(jobs: list[tuple[int, list[RunRecord]]]) -> ParetoView:
    """The Pareto view of one job's records ([(job, records)]) or of several jobs' together.

    Groups without any accuracy or agreement figure are left out and counted: a job without `workload.dataset`
    has latency only, and there is no front to draw."""
    several = len({job for job, _ in jobs}) > 1
    groups = []
    without = 0
    for setting, models in sorted(_cells(jobs).items(), key=lambda item: repr(item[0])):
        points = [p for p in (_point(key, runs) for key, runs in sorted(models.items())) if p is not None]
        group = _group(setting, points, several) if points else None
        if group is None:
            without += bool(points)
        else:
            groups.append(group)
    notes = []
    if any(p.contended for g in groups for p in g.points):
        notes.append("a point marked contended has only contended runs (other work used their cores): its latency "
                     "is not the budget's; run it again")
    if without:
        notes.append(f"{without} setting(s) have latency but no accuracy or agreement figure: add `workload.dataset` "
                     "(with labels, or a reference) to place their models")
    return ParetoView(jobs=sorted({job for job, _ in jobs}), groups=groups, notes=notes)


def group_title(group: ParetoGroup) -> str:
    budget = "" if group.cpus is None else f" · {group.cpus:g} cpu"
    memory = "" if group.memory_mb is None else f" {group.memory_mb} MB"
    size = "" if group.input_size in (None, 0) else f" · input {group.input_size}"
    return (f"{group.target} · {group.accelerator} · {group.threads} thread(s) · batch "
            f"{group.batch_size}{size}{budget}{memory}")


@dataclass(frozen=True)
class ParetoCsvRow:
    """One point of a group, flat: what `farm compare --pareto --format csv` writes (CSV_COLUMNS, in order)."""

    job: int
    model: str
    sha256: str
    target: str
    accelerator: str
    threads: int
    batch_size: int
    input_size: int | None
    cpus: float | None
    memory_mb: float | None
    latency_avg_ms: float
    quality_metric: str
    quality: float
    runs: int
    contended: int
    on_front: bool
    dominated_by: str


def csv_rows(view: ParetoView) -> list[ParetoCsvRow]:
    """One row per point, every group: what `farm compare --pareto --format csv` writes."""
    return [ParetoCsvRow(job=p.job, model=p.model, sha256=p.sha256, target=group.target,
                         accelerator=group.accelerator, threads=group.threads, batch_size=group.batch_size,
                         input_size=group.input_size, cpus=group.cpus, memory_mb=group.memory_mb,
                         latency_avg_ms=p.latency_avg_ms, quality_metric=group.quality_metric, quality=p.quality,
                         runs=p.runs, contended=p.contended, on_front=p.on_front,
                         dominated_by="; ".join(p.dominated_by))
            for group in view.groups for p in group.points]
