"""Before/after: two jobs' runs (or two models of one job) side by side, with a judgement of the run-to-run noise.

`compare_records(a, b)` reads the records `farm results --format json` has (the same on a controller and embedded:
the client asks for each job's results and compares them here, so no new question crosses the wire).

Models are paired, in this order:
1. by lineage: B's model was made from A's (`farm quantize` recorded the source's sha256; its sidecar or the
   model's metadata is read where the record's model path is readable here), or the other way round;
2. by name: the same model name in both jobs;
3. when each side has exactly one model left, those two.
Within one job (A is B), only lineage pairs count.

Each pair is compared per cell: target, compute unit (`accelerator`), threads, batch, input size and the CPU and
memory budget. Figures are each cell's completed runs (clean runs when there are any; contended ones only where a
cell has no clean run, as `average_repeats` does): latency avg and p50, peak memory, energy per inference where
measured, and the model files' sizes. A difference is judged against the repeats' spread with Welch's t test at
95 % (two-sided): "within noise" when |t| is under the critical t of Welch's degrees of freedom, else "beyond
noise". With one run on a side the spread is unknown, and the judgement says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from pydantic import JsonValue

from farm.controller.analysis.results import is_contended, json_number
from farm.proto.questions import Model, RunModel, RunRecord, Sparse

# Student's t, two-sided 95 % (0.975 quantile), for 1..30 degrees of freedom; beyond: 40, 60, 120, then 1.96.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def _latency_avg(r: RunRecord) -> float | None:
    return r.latency_ms.avg if r.latency_ms else None


def _latency_p50(r: RunRecord) -> float | None:
    return r.latency_ms.p50 if r.latency_ms else None


def _accuracy(*path: str) -> Callable[[RunRecord], float | None]:
    """A figure of workload.dataset's pass (issue 30): agreement with the reference or accuracy against the labels."""
    def figure(r: RunRecord) -> float | None:
        return json_number(r.accuracy, *path) if r.accuracy else None
    return figure


# (the figure's name in the answer, how a record gives it, the unit)
METRICS: tuple[tuple[str, Callable[[RunRecord], float | None], str], ...] = (
    ("latency_avg_ms", _latency_avg, "ms"),
    ("latency_p50_ms", _latency_p50, "ms"),
    ("peak_memory_mb", lambda r: r.peak_memory_mb, "MB"),
    ("energy_per_inference_mj", lambda r: r.energy_per_inference_mj, "mJ"),
    # workload.dataset (issue 30): agreement with the reference and accuracy against the labels, shares 0..1
    ("agreement_cosine", _accuracy("agreement", "cosine"), ""),
    ("agreement_top1", _accuracy("agreement", "top1"), ""),
    ("agreement_max_abs_error", _accuracy("agreement", "max_abs_error"), ""),
    ("accuracy_top1", _accuracy("accuracy", "top1"), ""),
    ("accuracy_top5", _accuracy("accuracy", "top5"), ""),
)
ACCURACY_METRICS = {"agreement_cosine", "agreement_top1", "agreement_max_abs_error", "accuracy_top1", "accuracy_top5"}
ONE_RUN = "one run each: noise unknown"


class JudgedFigure(Model):
    """One figure of a compared cell: A's and B's means over their runs, the difference, and whether it is inside
    the runs' noise (Welch's t at 95 %; `noise` is within, beyond or unknown)."""

    unit: str = ""
    a: float
    b: float
    sd_a: float | None
    sd_b: float | None
    n_a: int
    n_b: int
    diff: float
    change: float | None
    t: float | None = None
    df: float | None = None
    t_critical: float | None = None
    noise: str
    verdict: str


class ComparedFigures(Sparse):
    """The figures measured on both sides of a cell; a figure one side lacks is left out (of the JSON too)."""

    SPARSE: ClassVar[tuple[str, ...]] = tuple(key for key, _figure, _unit in METRICS)
    latency_avg_ms: JudgedFigure | None = None
    latency_p50_ms: JudgedFigure | None = None
    peak_memory_mb: JudgedFigure | None = None
    energy_per_inference_mj: JudgedFigure | None = None
    agreement_cosine: JudgedFigure | None = None
    agreement_top1: JudgedFigure | None = None
    agreement_max_abs_error: JudgedFigure | None = None
    accuracy_top1: JudgedFigure | None = None
    accuracy_top5: JudgedFigure | None = None

    def judged(self) -> list[JudgedFigure]:
        """The figures there are, in METRICS' order."""
        return [f for f in (getattr(self, key) for key, _figure, _unit in METRICS) if isinstance(f, JudgedFigure)]

    def get(self, key: str) -> JudgedFigure | None:
        """A figure by its name in METRICS (None where not measured on both sides)."""
        found = getattr(self, key, None) if key in self.SPARSE else None
        return found if isinstance(found, JudgedFigure) else None


class Setting(Model):
    """A condition's fields (target, unit, threads, batch, input size, budget): a compared cell's, a Pareto group's."""

    target: str
    accelerator: str
    threads: int
    batch_size: int
    input_size: int | None
    cpus: float | None
    memory_mb: float | None


class ComparedCell(Setting):
    """A pair's runs under one condition on both sides."""

    runs_a: int
    runs_b: int
    used_a: int
    used_b: int
    contended_a: int
    contended_b: int
    metrics: ComparedFigures


class SizeChange(Model):
    """The model files' sizes (bytes), B against A."""

    a: int | None
    b: int | None
    diff: int | None
    ratio: float | None


class ComparedPair(Model):
    model_a: RunModel
    model_b: RunModel
    matched_by: str
    lineage: dict[str, JsonValue] | None
    size: SizeChange
    rows: list[ComparedCell]
    unmatched_conditions: int

    @property
    def method(self) -> str | None:
        """How B was made from A (`farm quantize`'s method), where the pair is by lineage."""
        method = (self.lineage or {}).get("method")
        return method if isinstance(method, str) else None


class Comparison(Model):
    """`farm compare --json`: the pairs, the models left unpaired on each side, and notes on what to read how."""

    job_a: int
    job_b: int
    pairs: list[ComparedPair]
    unmatched_a: list[str]
    unmatched_b: list[str]
    notes: list[str]


def t_critical(df: float) -> float:
    """The 0.975 quantile of Student's t for `df` degrees of freedom (rounded down: the stricter side)."""
    if not math.isfinite(df) or df > 120:
        return 1.96
    whole = max(1, math.floor(df))
    if whole <= 30:
        return _T975[whole - 1]
    return 2.021 if whole < 60 else (2.000 if whole < 120 else 1.980)


def _mean_sd(values: list[float]) -> tuple[float, float | None]:
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def judge(a: list[float], b: list[float], unit: str = "") -> JudgedFigure:
    """A's and B's figures over their runs: means, the difference, and whether it is inside the runs' noise."""
    mean_a, sd_a = _mean_sd(a)
    mean_b, sd_b = _mean_sd(b)
    diff = mean_b - mean_a
    means = {"unit": unit, "a": mean_a, "b": mean_b, "sd_a": sd_a, "sd_b": sd_b, "n_a": len(a), "n_b": len(b),
             "diff": diff, "change": diff / mean_a if mean_a else None}
    if sd_a is None or sd_b is None:
        verdict = ONE_RUN if len(a) == len(b) == 1 else f"one run {'in A' if sd_a is None else 'in B'}: noise unknown"
        return JudgedFigure.model_validate({**means, "noise": "unknown", "verdict": verdict})
    se2_a, se2_b = sd_a ** 2 / len(a), sd_b ** 2 / len(b)
    se = math.sqrt(se2_a + se2_b)
    if se == 0:
        within = diff == 0
        return JudgedFigure.model_validate({
            **means, "noise": "within" if within else "beyond",
            "verdict": "no difference, no spread" if within else "beyond noise (the runs did not vary)"})
    t = diff / se
    df = (se2_a + se2_b) ** 2 / ((se2_a ** 2 / (len(a) - 1) if se2_a else 0) + (se2_b ** 2 / (len(b) - 1) if se2_b else 0))
    critical = t_critical(df)
    within = abs(t) < critical
    return JudgedFigure.model_validate({
        **means, "t": t, "df": df, "t_critical": critical, "noise": "within" if within else "beyond",
        "verdict": (f"within noise (|t| {abs(t):.2f} < {critical:.2f}, n {len(a)}/{len(b)})" if within else
                    f"beyond noise (|t| {abs(t):.2f} ≥ {critical:.2f}, n {len(a)}/{len(b)})")})


def _finite(value: float | None) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


# What two runs must share to be compared: target, compute unit, threads, batch, input size, cpus, memory MB.
Condition = tuple[str, str, int, int, int | None, float | None, float | None]


def condition(record: RunRecord) -> Condition:
    """What two runs must share to be compared: everything a cell is but the model."""
    return (record.target, record.accelerator, record.threads, record.batch_size, record.input_size,
            record.limits.cpus, record.limits.memory_mb)


def _model_key(record: RunRecord) -> tuple[str, str]:
    return record.model.name, record.model.sha256


def _runs_used(runs: list[RunRecord]) -> tuple[list[RunRecord], int]:
    done = [r for r in runs if r.status == "completed"]
    clean = [r for r in done if not is_contended(r)]
    return (clean or done), (0 if clean else len(done))


def _with_accuracy(runs: list[RunRecord], used: list[RunRecord]) -> list[RunRecord]:
    return used + [r for r in runs if r.status == "failed" and r.failure_class == "accuracy"]


Lineage = dict[str, JsonValue]  # `farm quantize`'s sidecar (models/quantize.py): source, method, settings
LineageReader = Callable[[RunModel], Lineage | None]


def lineage_at_path(model: RunModel) -> Lineage | None:
    """A record's model's `farm quantize` lineage, read from its path where that file is readable here."""
    from pathlib import Path

    from farm.models.quantize import read_lineage

    path = model.path
    return read_lineage(Path(path)) if path and Path(path).is_file() else None


def sidecar_lineage(model: RunModel) -> Lineage | None:
    """The lineage from the sidecar file only, never parsing the model: for pages drawn on every visit."""
    from pathlib import Path

    from farm.models.quantize import read_lineage

    path = model.path
    return read_lineage(Path(path), metadata=False) if path else None


def _source_sha256(lineage: Lineage | None) -> str | None:
    """The digest of the model a lineage says this one was made from."""
    source = (lineage or {}).get("source")
    sha = source.get("sha256") if isinstance(source, dict) else None
    return sha if isinstance(sha, str) else None


def flat_rows(report: Comparison) -> list[dict[str, JsonValue]]:
    """One flat row per (A model, B model, cell) of a comparison: every figure as A, B, change and noise.
    What `farm compare --format csv` writes (CSV columns, one per figure and side); a figure not measured on both
    sides is left out of its row."""
    rows = []
    for pair in report.pairs:
        for row in pair.rows:
            flat: dict[str, JsonValue] = {
                "job_a": report.job_a, "job_b": report.job_b, "model_a": pair.model_a.name,
                "model_b": pair.model_b.name, "matched_by": pair.matched_by, "method": pair.method,
                **row.model_dump(include={"target", "accelerator", "threads", "batch_size", "input_size", "cpus",
                                          "memory_mb", "runs_a", "runs_b", "used_a", "used_b"}),
                "size_bytes_a": pair.size.a, "size_bytes_b": pair.size.b, "size_ratio": pair.size.ratio}
            for key, _figure, _unit in METRICS:
                figure = row.metrics.get(key)
                if figure is not None:
                    flat.update({f"{key}_a": figure.a, f"{key}_b": figure.b, f"{key}_change": figure.change,
                                 f"{key}_noise": figure.noise})
            rows.append(flat)
    return rows


@dataclass(frozen=True)
class VariantRow:
    """A pair's cell as the flat row a report table shows (before → after); a figure is None where a side did not
    measure it."""

    source: str
    variant: str
    method: str | None
    target: str
    accelerator: str
    threads: int
    size_a: int | None
    size_b: int | None
    size_ratio: float | None
    latency: JudgedFigure | None
    peak_memory: JudgedFigure | None
    figures: ComparedFigures  # every judged figure: energy and the dataset's beside latency and memory

    @property
    def latency_a(self) -> float | None:
        return self.latency.a if self.latency else None

    @property
    def latency_b(self) -> float | None:
        return self.latency.b if self.latency else None

    @property
    def latency_change(self) -> float | None:
        return self.latency.change if self.latency else None

    @property
    def verdict(self) -> str | None:
        return self.latency.verdict if self.latency else None

    @property
    def memory_a(self) -> float | None:
        return self.peak_memory.a if self.peak_memory else None

    @property
    def memory_b(self) -> float | None:
        return self.peak_memory.b if self.peak_memory else None

    def sides(self, key: str) -> tuple[float | None, float | None]:
        """A's and B's means of a figure in METRICS (energy, agreement, accuracy), (None, None) where not both."""
        figure = self.figures.get(key)
        return (figure.a, figure.b) if figure else (None, None)


def variant_rows(job_id: int, records: list[RunRecord], lineage_of: LineageReader) -> list[VariantRow]:
    """One flat row per (source, variant, cell) of a job's `farm quantize` variants: what a report or a page shows.
    Energy and the dataset's figures (agreement with the reference, accuracy against labels) are None where a side
    did not measure them."""
    report = compare_records(records, records, job_a=job_id, job_b=job_id, lineage_of=lineage_of)
    return [variant_row(pair, row) for pair in report.pairs for row in pair.rows]


def variant_row(pair: ComparedPair, row: ComparedCell) -> VariantRow:
    """A pair's cell as the flat row a report table shows (before → after)."""
    return VariantRow(source=pair.model_a.name, variant=pair.model_b.name, method=pair.method, target=row.target,
                      accelerator=row.accelerator, threads=row.threads, size_a=pair.size.a, size_b=pair.size.b,
                      size_ratio=pair.size.ratio, latency=row.metrics.latency_avg_ms,
                      peak_memory=row.metrics.peak_memory_mb, figures=row.metrics)


@dataclass(frozen=True)
class ModelMatch:
    """A's model and B's, how they were paired (lineage, name, only model on each side) and the lineage read."""

    a: RunModel
    b: RunModel
    matched_by: str
    lineage: Lineage | None


def pair_models(a: list[RunRecord], b: list[RunRecord], *, same_job: bool,
                lineage_of: LineageReader) -> tuple[list[ModelMatch], list[RunModel], list[RunModel]]:
    """[(A's model, B's model, how they were matched, the lineage)], and the models of each side left over.
    One source may have several variants (dynamic, static, qdq): by lineage an A model pairs with each of them."""
    models_a = {_model_key(r): r.model for r in a}
    models_b = {_model_key(r): r.model for r in b}
    lineages = {k: lineage_of(m) for k, m in {**models_a, **models_b}.items()}
    pairs: list[ModelMatch] = []
    paired_a: set[tuple[str, str]] = set()
    paired_b: set[tuple[str, str]] = set()

    def take(ka: tuple[str, str], kb: tuple[str, str], how: str, lineage: Lineage | None) -> None:
        pairs.append(ModelMatch(models_a[ka], models_b[kb], how, lineage))
        paired_a.add(ka)
        paired_b.add(kb)
        if same_job:  # one list on both sides: a source is never an "after", a variant never paired again
            paired_a.add(kb)
            paired_b.add(ka)

    for kb in models_b:  # B made from A (the usual: B is the optimized one)
        source = _source_sha256(lineages.get(kb))
        ka = next((k for k in models_a if k[1] == source and k != kb), None)
        if source and ka is not None and kb not in paired_b:
            take(ka, kb, "lineage", lineages[kb])
    if not same_job:
        for ka in models_a:  # A made from B: compared as given, said so
            source = _source_sha256(lineages.get(ka))
            variant_of = next((k for k in models_b if k[1] == source and k not in paired_b), None)
            if source and variant_of is not None and ka not in paired_a:
                take(ka, variant_of, "lineage (A is the variant)", lineages[ka])
        for ka in [k for k in models_a if k not in paired_a]:
            named = next((k for k in models_b if k[0] == ka[0] and k not in paired_b), None)
            if named is not None:
                take(ka, named, "name", None)
        left_a = [k for k in models_a if k not in paired_a]
        left_b = [k for k in models_b if k not in paired_b]
        if len(left_a) == 1 and len(left_b) == 1:
            take(left_a[0], left_b[0], "only model on each side", None)
    unmatched_a = [m for k, m in models_a.items() if k not in paired_a]
    unmatched_b = [] if same_job else [m for k, m in models_b.items() if k not in paired_b]
    return pairs, unmatched_a, unmatched_b


def _compared_cell(cond: Condition, runs_a: list[RunRecord], runs_b: list[RunRecord]) -> ComparedCell:
    """One condition's runs on both sides, every figure both sides measured judged against the runs' noise."""
    used_a, contended_a = _runs_used(runs_a)
    used_b, contended_b = _runs_used(runs_b)
    figures: dict[str, JudgedFigure] = {}
    for key, figure, unit in METRICS:
        # a run failed as `accuracy` still has its figures: they are why it failed
        from_a = _with_accuracy(runs_a, used_a) if key in ACCURACY_METRICS else used_a
        from_b = _with_accuracy(runs_b, used_b) if key in ACCURACY_METRICS else used_b
        values_a = [v for v in (_finite(figure(r)) for r in from_a) if v is not None]
        values_b = [v for v in (_finite(figure(r)) for r in from_b) if v is not None]
        if values_a and values_b:
            figures[key] = judge(values_a, values_b, unit)
    target, accelerator, threads, batch, size, cpus, memory = cond
    return ComparedCell(target=target, accelerator=accelerator, threads=threads, batch_size=batch, input_size=size,
                        cpus=cpus, memory_mb=memory, runs_a=len(runs_a), runs_b=len(runs_b), used_a=len(used_a),
                        used_b=len(used_b), contended_a=contended_a, contended_b=contended_b,
                        metrics=ComparedFigures(**figures))


def _compared_pair(pair: ModelMatch, a: list[RunRecord], b: list[RunRecord]) -> ComparedPair:
    ka, kb = (pair.a.name, pair.a.sha256), (pair.b.name, pair.b.sha256)
    cells_a: dict[Condition, list[RunRecord]] = {}
    cells_b: dict[Condition, list[RunRecord]] = {}
    for r in a:
        if _model_key(r) == ka:
            cells_a.setdefault(condition(r), []).append(r)
    for r in b:
        if _model_key(r) == kb:
            cells_b.setdefault(condition(r), []).append(r)
    rows = [_compared_cell(cond, cells_a[cond], cells_b[cond])
            for cond in sorted(set(cells_a) & set(cells_b), key=repr)]
    size_a, size_b = pair.a.size_bytes, pair.b.size_bytes
    return ComparedPair(model_a=pair.a, model_b=pair.b, matched_by=pair.matched_by, lineage=pair.lineage,
                        size=SizeChange(a=size_a, b=size_b, diff=(size_b - size_a) if size_a and size_b else None,
                                        ratio=size_b / size_a if size_a and size_b else None),
                        rows=rows, unmatched_conditions=len(set(cells_a) ^ set(cells_b)))


def compare_records(a: list[RunRecord], b: list[RunRecord], *, job_a: int, job_b: int,
                    lineage_of: LineageReader | None = None) -> Comparison:
    """The comparison (`farm compare --json` is its JSON form)."""
    same_job = job_a == job_b
    pairs, left_a, left_b = pair_models(a, b, same_job=same_job, lineage_of=lineage_of or (lambda _model: None))
    found = [_compared_pair(pair, a, b) for pair in pairs]
    judged = [m for p in found for r in p.rows for m in r.metrics.judged()]
    notes = []
    if any(m.noise == "unknown" for m in judged):
        notes.append("a cell with one run on a side has no spread to judge noise by: set `repeats: 3` or more")
    if any(m.noise == "within" and min(m.n_a, m.n_b) < 3 and abs(m.change or 0) > 0.2 for m in judged):
        notes.append("with 2 runs on a side Welch's test has about one degree of freedom: only very large "
                     "differences show as beyond noise; `repeats: 3` or more sharpens it")
    if same_job and not pairs:
        notes.append(f"job {job_a} holds no model made from another of its models (no `farm quantize` lineage "
                     "readable here); give two jobs to compare by name")
    return Comparison(job_a=job_a, job_b=job_b, pairs=found, unmatched_a=[m.name for m in left_a],
                      unmatched_b=[m.name for m in left_b], notes=notes)
