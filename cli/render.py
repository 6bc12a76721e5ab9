"""Turning run records into what a person (table) or a script (csv, json) reads."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from farm.controller.analysis.export import results_csv as results_csv, to_json as to_json  # shared with the dashboard
from farm.proto.escape import printable

if TYPE_CHECKING:  # web/ imports this module too: the answer models load with the commands that print them
    from farm.controller.analysis.results import AveragedRecord, RunPair
    from farm.proto.questions import CalibrationVersion, RecordLimits, RunRecord

# How a table writes a moment (farm.cli.console.when): an answer's datetime or Unix seconds, None for never.
When = Callable[[dt.datetime | float | None], str]


def _fmt(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _ms(v: float | None) -> str:
    """Three significant figures: 0.0123 ms and 1234 ms both stay readable."""
    if v is None:
        return "—"
    return f"{v:.3g}" if v < 1000 else f"{v:.0f}"


def _budget(lim: RecordLimits) -> str:
    budget = f"{_fmt(lim.cpus, 2).rstrip('0').rstrip('.')} cpu" if lim.cpus else "no cpu cap"
    if lim.memory_mb:
        budget += f", {lim.memory_mb:g} MB"
    if lim.cpuset:
        budget += f" @{lim.cpuset}"
    return budget


def _status(r: AveragedRecord) -> str:
    from farm.controller.analysis.results import is_contended  # the controller's stack: not on an agent-only install

    if r.status != "completed":
        return r.status if not r.failure_class else f"[red]{r.failure_class}[/red]"
    ok = "ok" if r.completed == r.runs else f"{r.completed}/{r.runs} ok"
    if is_contended(r) or r.contended:
        return f"[yellow]{ok} {CONTENDED_MARK}[/yellow]"
    return f"[green]{ok}[/green]" if r.completed == r.runs else f"[yellow]{ok}[/yellow]"


def _has(records: list[AveragedRecord], figure: Callable[[AveragedRecord], object]) -> bool:
    """A figure only some runs have (a script's whole-run time, a board's energy): shown only where some record
    carries it."""
    return any(figure(r) is not None for r in records)


@dataclass(frozen=True)
class _ModelTableColumn:
    """A column of a ModelTable after the model: its header and rich's layout for it."""
    header: str
    justify: Literal["left", "right"] = "left"
    overflow: Literal["fold", "ellipsis"] = "ellipsis"


class ModelTable:
    """A table whose first column is a model name, which is never cut. When whole names leave the
    figures too little room, each model's name gets a line of its own above its rows instead
    (the columns keep one width throughout, so they still line up). Built like a rich Table:
    add_column for the columns after the model, add_row(name, *cells)."""

    def __init__(self, title: str | None, wide: bool) -> None:
        # a title carries the job's name: shown as text, never as markup or a terminal escape
        self.title = Text(printable(title, limit=None)) if title is not None else None
        self.wide = wide
        self.columns: list[_ModelTableColumn] = []
        self.rows: list[tuple[Text, list[str | Text]]] = []
        self.notes: list[str] = []

    def add_column(self, header: str, *, justify: Literal["left", "right"] = "left",
                   overflow: Literal["fold", "ellipsis"] = "ellipsis") -> None:
        self.columns.append(_ModelTableColumn(header, justify, overflow))

    def add_row(self, name: Text, *cells: str | Text) -> None:
        self.rows.append((name, list(cells)))

    def _table(self, rows: list[tuple[Text, list[str | Text]]], *, model: bool, widths: list[int] | None = None,
               header: bool = True, title: Text | None = None) -> Table:
        t = Table(title=title, header_style="bold", show_edge=self.wide, pad_edge=self.wide, show_header=header)
        if model:
            t.add_column("model", no_wrap=True, min_width=max([5] + [n.cell_len for n, _ in rows]))
        for i, column in enumerate(self.columns):
            t.add_column(column.header, justify=column.justify, overflow=column.overflow,
                         width=widths[i] if widths else None, no_wrap=bool(widths))
        for name, cells in rows:
            t.add_row(*([name] if model else []), *cells)
        return t

    def _natural_widths(self) -> list[int]:
        widths = []
        for i, column in enumerate(self.columns):
            head = column.header
            cells = [c if isinstance(c, Text) else Text.from_markup(c) for _, row in self.rows for c in row[i:i + 1]]
            widths.append(max([len(line) for line in head.split("\n")] + [c.cell_len for c in cells]))
        return widths

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        names = max([5] + [n.cell_len for n, _ in self.rows])
        whole = self._table(self.rows, model=True, title=self.title)
        natural = Measurement.get(console, options.update_width(100_000), whole).maximum
        if self.wide or natural <= options.max_width or names <= options.max_width * 0.45:
            yield whole  # fits, or rich can wrap the figures' columns and still leave them readable
        else:
            widths = self._natural_widths()
            groups: list[tuple[Text, list[tuple[Text, list[str | Text]]]]] = []
            for name, cells in self.rows:
                if not groups or groups[-1][0].plain != name.plain:
                    groups.append((name, []))
                groups[-1][1].append((name, cells))
            for i, (name, rows) in enumerate(groups):
                if i == 0:
                    yield self._table([], model=False, widths=widths, title=self.title)
                yield Text.assemble(name, style="bold")
                yield self._table(rows, model=False, widths=widths, header=False)
        for note in self.notes:
            yield Text(note, style="dim")


@dataclass(frozen=True)
class _Column:
    """One column of `farm results`: its header, its cell for a record, and rich's layout for it."""

    header: str
    cell: Callable[[AveragedRecord], str | Text]
    justify: Literal["left", "right"] = "left"
    overflow: Literal["fold", "ellipsis"] = "ellipsis"


def _right(header: str, cell: Callable[[AveragedRecord], str | Text]) -> _Column:
    return _Column(header, cell, justify="right")


def _cpus(r: AveragedRecord) -> str:
    cpus = r.limits.cpus
    return _fmt(cpus, 2).rstrip("0").rstrip(".") if cpus else "—"


def _avg_sd(r: AveragedRecord) -> str:
    lat = r.latency_ms
    return f"{_ms(lat.avg)} ± {_ms(lat.std)}" if lat else "—"


def _p90(r: AveragedRecord) -> str:
    return _ms(r.latency_ms.p90) if r.latency_ms else "—"


def _gpu(r: AveragedRecord, figure: str) -> float | None:
    from farm.controller.analysis.results import json_number

    return json_number(r.gpu, figure) if r.gpu else None


def _result_columns(records: list[AveragedRecord], *, wide: bool, runs: bool) -> list[_Column]:
    """The columns these records need, in their order: a column nobody's record fills is left out, and the detail
    (p90, avg memory, CPU, wall time, backend, budget) only with `wide`."""
    wanted: list[tuple[bool, list[_Column]]] = [
        (any(r.target != "sim" for r in records), [_Column("on", lambda r: Text(printable(r.target)),
                                                           overflow="fold")]),
        (True, [_right("thr", lambda r: str(r.threads))]),
        (not wide and any(r.limits.cpus not in (None, r.threads) for r in records), [_right("cpu", _cpus)]),
        (any(r.batch_size != 1 for r in records), [_right("batch", lambda r: str(r.batch_size))]),
        (any(r.input_size for r in records), [_right("size", lambda r: str(r.input_size or "—"))]),
        # a job with matrix.accelerators
        (any(r.accelerator != "cpu" for r in records), [_Column("unit", lambda r: Text(printable(r.accelerator)))]),
        (runs and any(r.repeat for r in records), [_right("rep", lambda r: str(r.repeat))]),
        (_shows_n(records, runs), [_right("n", lambda r: str(r.averaged or r.runs))]),
        (wide, [_Column("budget", lambda r: _budget(r.limits))]),
        (True, [_Column("status", _status)]),
        # a script job: its whole-run time is the figure it is run for
        (_has(records, lambda r: r.whole_run_s), [_right("whole run\ns", lambda r: _fmt(r.whole_run_s, 3))]),
        (True, [_right("latency ms\navg ± sd", _avg_sd)]),
        (wide, [_right("p90 ms", _p90)]),
        (True, [_right("peak MB", lambda r: _fmt(r.peak_memory_mb, 1))]),
        (wide, [_right("avg MB", lambda r: _fmt(r.avg_memory_mb, 1))]),
        (_has(records, lambda r: r.throughput_per_s), [_right("inf/s", lambda r: _ms(r.throughput_per_s))]),
        (wide and any(r.samples_per_s is not None and r.batch_size != 1 for r in records),
         [_right("samples/s", lambda r: _ms(r.samples_per_s))]),
        (wide and _has(records, lambda r: r.startup_ms), [_right("startup ms", lambda r: _ms(r.startup_ms))]),
        # boards with power rails
        (_has(records, lambda r: r.energy_per_inference_mj),
         [_right("mJ per\ninference", lambda r: _fmt(r.energy_per_inference_mj))]),
        # NVIDIA hosts: the GPU's power and memory
        (any(r.gpu for r in records), [
            _right("GPU W\navg/peak", lambda r: f"{_fmt(_gpu(r, 'power_avg_w'), 0)}/{_fmt(_gpu(r, 'power_peak_w'), 0)}"),
            _right("GPU MiB\npeak", lambda r: _fmt(_gpu(r, "memory_peak_mib"), 0))]),
        (wide, [
            _right("CPU %\navg/peak", lambda r: f"{_fmt(r.cpu_percent.avg, 0)}/{_fmt(r.cpu_percent.peak, 0)}"),
            _right("wall s", lambda r: _fmt(r.wall_s)),
            _Column("backend", lambda r: (r.backend or "—") + ("*" if r.approximate else ""))]),
    ]
    return [column for shown, columns in wanted if shown for column in columns]


def _shows_n(records: list[AveragedRecord], runs: bool) -> bool:
    """Averaged records say how many runs each stands for when any stands for more than one."""
    return not runs and any(r.runs > 1 for r in records)


def _result_notes(records: list[AveragedRecord], per_run: list[RunRecord], *, wide: bool,
                  runs: bool) -> list[str]:
    from farm.controller.analysis.results import is_contended

    notes = []
    if _shows_n(records, runs):
        notes.append("n: runs averaged (a cell's repeats; sd is their spread, `--runs` lists each)")
    contended = sum(is_contended(r) for r in per_run)
    if contended:
        notes.append(f"{CONTENDED_MARK} contended ({contended} run(s)): other work used the run's cores, its figures "
                     "are not the budget's; calibrate, predict and rank leave it out (--include-contended keeps it)")
    if not wide:
        notes.append("--wide: p90, avg memory, CPU, wall time, backend and budget")
    return notes


def results_table(per_run: list[RunRecord], title: str | None = None, *, wide: bool = False,
                  runs: bool = False) -> ModelTable:
    """Averaged over repeats unless `runs`; readable at 100 columns unless `wide`: model names are
    never cut (other columns wrap), detail (p90, avg memory, CPU, wall time, backend, budget) is in --wide."""
    from farm.controller.analysis.results import AveragedRecord, average_repeats  # the controller's stack

    records = [AveragedRecord.of_run(r) for r in per_run] if runs else average_repeats(per_run)
    columns = _result_columns(records, wide=wide, runs=runs)
    t = ModelTable(title, wide)
    for column in columns:
        t.add_column(column.header, justify=column.justify, overflow=column.overflow)
    for r in records:
        t.add_row(Text(printable(r.model.name, limit=None)), *(column.cell(r) for column in columns))
    t.notes = _result_notes(records, per_run, wide=wide, runs=runs)
    return t


CONTENDED_MARK = "!"


def pairs_table(pairs: list[RunPair], title: str | None = None, *, wide: bool = False) -> RenderableType:
    from farm.controller.analysis.results import is_contended

    t = ModelTable(title, wide)
    for c in ("thr", "rep", "device", "sim\nlat ms", "device\nlat ms", "device\n/ sim"):
        t.add_column(c, justify="left" if c == "device" else "right")
    if wide:
        t.add_column("sim\npeak MB", justify="right")
        t.add_column("device\npeak MB", justify="right")
    for p in pairs:
        s_lat = p.sim.latency_ms.avg if p.sim.latency_ms else None
        d_lat = p.device_run.latency_ms.avg if p.device_run.latency_ms else None
        ratio = d_lat / s_lat if s_lat and d_lat else None
        mark = f" {CONTENDED_MARK}" if is_contended(p.sim) else ""
        cells: list[str | Text] = [str(p.threads), str(p.repeat), Text(printable(p.device)),
                                   _ms(s_lat) + mark, _ms(d_lat), _fmt(ratio)]
        if wide:
            cells += [_fmt(p.sim.peak_memory_mb, 1), _fmt(p.device_run.peak_memory_mb, 1)]
        t.add_row(Text(printable(p.model.name, limit=None)), *cells)
    if not pairs:
        return Text(f"{printable(title, limit=None) + ': ' if title else ''}no completed pairs. A pair is a device run and its sim twin, both "
                    "completed: give the job a device target (targets: [NAME]), or compare two jobs with "
                    "`farm rank A --device-job B`.")
    t.notes = [] if wide else ["--wide: peak memory on both sides"]
    return t


def jobs_table(jobs: list[Any], when: When, *, wide: bool = False) -> RenderableType:
    """`farm jobs`; `when` formats a timestamp. An empty store says how to fill it."""
    t = Table(header_style="bold", show_edge=wide, pad_edge=wide)
    t.add_column("job", justify="right")
    t.add_column("name", overflow="fold")
    for col in ("status", "runs", "ok", "failed"):
        t.add_column(col, justify="left" if col == "status" else "right")
    t.add_column("created")
    if wide:
        t.add_column("finished")
    for j in jobs:
        row = [str(j.job), Text(printable(j.name or "", limit=None)), j.status, str(j.total),
               str(j.completed), str(j.failed), when(j.created_at)]
        if wide:
            row.append(when(j.finished_at))
        t.add_row(*row)
    if not jobs:
        return Text("no jobs in this store yet: `farm submit examples/quickstart.yaml` runs one "
                    "(`make demo` generates its models first).")
    return t


def show(console: Console, renderable: RenderableType, *, wide: bool = False) -> None:
    """Print; --wide tables at their natural width, past the terminal's edge rather than squeezed into it."""
    if not wide:
        console.print(renderable)
        return
    natural = Measurement.get(console, console.options.update_width(100_000), renderable).maximum
    before = console.width
    console.width = max(before, natural)
    try:
        console.print(renderable)
    finally:
        console.width = before


def failures(records: list[RunRecord]) -> list[str]:
    # a message may quote an agent or a script: escaped, but its lines kept
    return [f"{printable(r.model.name)} (threads {r.threads}, repeat {r.repeat}): {r.failure_class}: "
            f"{printable(r.message, limit=None, multiline=True)}{after_attempts(r)}" for r in records
            if r.failure_class and r.status not in ("completed", "canceled")]


def after_attempts(record: RunRecord) -> str:
    """A failed task tried more than once is told once, its last attempt's words, saying how many there were
    (each attempt is a run of its own: `farm results JOB --runs`)."""
    attempts = record.attempts or 0
    return f" (the last of {attempts} attempts)" if attempts > 1 else ""


def calibrations_table(rows: list[CalibrationVersion], when: When, *, wide: bool = False) -> RenderableType:
    """`farm calibrations`: what each version is and how good, in 100 columns; the key's rest in --wide."""
    if not rows:
        return Text("no calibrations stored yet: `farm calibrate --sim-job A --device-job B --device NAME` fits one "
                    "(see examples/sim.yaml and examples/device.yaml), or `farm refresh --devices lab.yaml`.")
    t = Table(header_style="bold", show_edge=wide, pad_edge=wide)
    t.add_column("id", justify="right")
    t.add_column("device", overflow="fold")
    t.add_column("metric", overflow="fold")
    t.add_column("thr", justify="right")
    show_unit = any("unit=" in (r.runtime or "") for r in rows)  # a GPU/NPU/DSP pair's fit: never a CPU's
    if show_unit:
        t.add_column("unit")
    if wide:
        for c in ("runtime", "batch", "input", "precision", "family", "created", "fit"):
            t.add_column(c)
    t.add_column("v", justify="right")
    t.add_column("formula", overflow="fold")
    t.add_column("R²", justify="right")
    t.add_column("n", justify="right")
    t.add_column("LOO\nMAPE %", justify="right")
    if wide:
        t.add_column("ρ", justify="right")
        t.add_column("prior weight")
    t.add_column("warnings", overflow="fold")

    def num(v: float | None, spec: str) -> str:
        return "—" if v is None else format(v, spec)

    for r in rows:
        row: list[str | Text] = [str(r.id), Text(printable(r.device, limit=None)), r.metric, str(r.threads)]
        if show_unit:
            row.append(Text(printable(calibration_unit(r.runtime))))
        if wide:
            prior = "—" if r.prior_weight is None else f"{100 * r.prior_weight:.0f} % ({r.prior_source})"
            row += [Text(printable(r.runtime or "—", limit=None)), str(r.batch_size or 1), str(r.input_size or "—"), r.precision or "fp32",
                    Text(printable(r.family or "(all)", limit=None)), when(r.created_at), r.kind or ""]
        row += [str(r.version), Text(r.formula), num(r.r2, ".3f"), str(r.n),
                num(100 * r.loo_mape if r.loo_mape is not None else None, ".1f")]
        if wide:
            row += [num(r.spearman_rho, ".2f"), Text(prior)]
        row.append(Text(printable("; ".join(r.warnings) or "—", limit=None)))
        t.add_row(*row)
    if wide:
        return t
    return Group(t, Text("--wide: runtime key, batch, input size, precision, family, when, fit kind, ρ, prior weight",
                         style="dim"))


def calibration_unit(runtime: str | None) -> str:
    """The compute unit a calibration's runtime key names (`onnxruntime@arch=aarch64;unit=tensorrt:fp16`), or cpu."""
    qualifiers = (runtime or "").partition("@")[2].split(";")
    return next((q[len("unit="):] for q in qualifiers if q.startswith("unit=")), "cpu")


def empty_list(kind: str, what_to_do: str) -> Text:
    """What a list command prints instead of bare headers."""
    return Text(f"no {kind} yet: {what_to_do}")
