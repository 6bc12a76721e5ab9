"""`farm compare JOB_A [JOB_B]`: before/after per model (controller/analysis/compare.py), as a table or --json.

The comparison is made here from each job's results, which the embedded store and a controller answer alike
(`farm.results`), so it works against either; a model's lineage (`farm quantize`'s sidecar or metadata) is read
where the record's model path is readable from this machine, else models pair by name."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from farm.cli.console import UserError, open_farm, out
from farm.proto.escape import printable

if TYPE_CHECKING:
    from farm.controller.analysis.compare import Comparison, JudgedFigure
    from farm.controller.analysis.pareto import ParetoView
    from farm.proto.questions import RunRecord


def _job_id(text: str) -> int:
    try:
        return int(str(text).removeprefix("job-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a job id (see `farm jobs`)") from None


def _figure(v: float | None, unit: str) -> str:
    if v is None:
        return "—"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


NOISE_STYLE = {"within": "dim", "beyond": "bold", "unknown": "yellow"}


def _change(m: JudgedFigure) -> Text:
    text = "—" if m.change is None else f"{m.change:+.0%}"
    return Text(text, style=NOISE_STYLE[m.noise])


def _noise(m: JudgedFigure) -> Text:
    if m.noise == "unknown":
        return Text("noise unknown (1 run)" if m.n_a == m.n_b == 1 else "noise unknown", style="yellow")
    runs = f" ({m.n_a}/{m.n_b} runs)"
    return Text("within noise" + runs, style="dim") if m.noise == "within" else Text("beyond noise" + runs, style="bold")


def _mb(n: int | None) -> str:
    return "—" if n is None else f"{n / 1e6:.2f}"


def compare_table(report: Comparison) -> Table:
    pairs = report.pairs
    rows = [(p, r) for p in pairs for r in p.rows]
    show_energy = any(r.metrics.energy_per_inference_mj for _, r in rows)
    accuracy_columns = [(key, label) for key, label in (
        ("agreement_cosine", "cosine\nA → B"), ("agreement_top1", "top-1 agree\nA → B"),
        ("accuracy_top1", "acc top-1\nA → B")) if any(r.metrics.get(key) for _, r in rows)]  # workload.dataset
    show_unit = any(r.accelerator != "cpu" for _, r in rows)
    title = (f"job {report.job_a} → job {report.job_b}" if report.job_a != report.job_b
             else f"job {report.job_a}: variants")
    t = Table(title=title, header_style="bold", title_justify="left")
    t.add_column("model A → B", no_wrap=True)
    t.add_column("on")
    if show_unit:
        t.add_column("unit")
    t.add_column("thr", justify="right")
    t.add_column("size MB\nA → B", justify="right")
    t.add_column("latency avg ms\nA → B", justify="right")
    t.add_column("Δ", justify="right")
    t.add_column("p50 ms\nA → B", justify="right")
    t.add_column("peak MB\nA → B", justify="right")
    t.add_column("Δ", justify="right")
    if show_energy:
        t.add_column("mJ/inf\nA → B", justify="right")
        t.add_column("Δ", justify="right")
    for _, label in accuracy_columns:
        t.add_column(label, justify="right")
    t.add_column("latency vs noise")
    for p, r in rows:
        m = r.metrics
        names = Text(printable(f"{p.model_a.name} → {p.model_b.name}", limit=None))
        cells: list[str | Text] = [names, Text(printable(r.target))]
        if show_unit:
            cells.append(Text(printable(r.accelerator)))
        cells.append(str(r.threads))
        cells.append(f"{_mb(p.size.a)} → {_mb(p.size.b)}")

        def pair_of(figure: JudgedFigure | None, unit: str) -> list[str | Text]:
            if figure is None:
                return ["—", ""]
            return [f"{_figure(figure.a, unit)} → {_figure(figure.b, unit)}", _change(figure)]

        cells += pair_of(m.latency_avg_ms, "ms")
        p50 = m.latency_p50_ms
        cells.append(f"{_figure(p50.a, 'ms')} → {_figure(p50.b, 'ms')}" if p50 else "—")
        cells += pair_of(m.peak_memory_mb, "MB")
        if show_energy:
            cells += pair_of(m.energy_per_inference_mj, "mJ")
        for key, _ in accuracy_columns:
            figure = m.get(key)
            cells.append(f"{figure.a:.4g} → {figure.b:.4g}" if figure else "—")
        cells.append(_noise(m.latency_avg_ms) if m.latency_avg_ms else Text("no latency", style="dim"))
        t.add_row(*cells)
    matched = "; ".join(f"{p.model_b.name}: {p.matched_by}" for p in pairs)
    t.caption = (f"paired by {matched}. Δ: B against A; within/beyond noise: Welch's t at 95 % over the repeats"
                 if pairs else None)
    return t


def pareto_table(view: ParetoView) -> list[Table]:
    """A table per setting: each model's latency and accuracy figure, the front marked, the dominated named."""
    from farm.controller.analysis.pareto import group_title

    several = len(view.jobs) > 1
    tables = []
    for group in view.groups:
        t = Table(title=f"Pareto · {printable(group_title(group), limit=None)}", header_style="bold",
                  title_justify="left")
        t.add_column("job · model" if several else "model", no_wrap=True)
        t.add_column("latency avg ms", justify="right")
        t.add_column(printable(group.quality_label), justify="right")
        t.add_column("runs", justify="right")
        t.add_column("front")
        for p in group.points:
            mark = (Text("on the front", style="bold") if p.on_front else
                    Text("dominated by " + printable(", ".join(p.dominated_by), limit=None), style="dim"))
            t.add_row(Text(printable(p.label, limit=None)), _figure(p.latency_avg_ms, "ms"),
                      f"{p.quality:.4g}", f"{p.runs}{' !' if p.contended else ''}", mark)
        captions = (["! only contended runs: latency not the budget's"] if any(p.contended for p in group.points)
                    else []) + (["no figure: " + printable(", ".join(group.without_quality), limit=None)]
                                if group.without_quality else [])
        t.caption = "; ".join(captions) or None
        tables.append(t)
    return tables


def _pareto_jobs(args: argparse.Namespace, job_b: int, records_a: list[RunRecord],
                 records_b: list[RunRecord]) -> list[tuple[int, list[RunRecord]]]:
    return [(args.job_a, records_a)] + ([] if job_b == args.job_a else [(job_b, records_b)])


def _print_pareto(args: argparse.Namespace, view: ParetoView) -> int:
    from dataclasses import asdict

    from farm.controller.analysis.export import rows_csv, to_json
    from farm.controller.analysis.pareto import CSV_COLUMNS, csv_rows

    if args.format == "json":
        print(to_json(view.model_dump()))
        return 0
    if args.format == "csv":
        rows = csv_rows(view)
        print(rows_csv([asdict(r) for r in rows]) if rows else ",".join(CSV_COLUMNS), end="" if rows else "\n")
        return 0
    if not view.groups:
        raise UserError(f"no accuracy or agreement figure in job(s) {', '.join(map(str, view.jobs))}: the "
                        "Pareto view needs runs with `workload.dataset` (labels, or a reference)")
    for t in pareto_table(view):
        out.print(t)
    for note in view.notes:
        out.print(Text(f"note: {note}", style="yellow"), highlight=False)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from farm.controller.analysis.export import rows_csv, to_json
    from farm.controller.analysis.compare import compare_records, flat_rows, lineage_at_path
    from farm.controller.analysis.pareto import pareto

    if args.json:
        args.format = "json"
    job_b = args.job_b if args.job_b is not None else args.job_a
    farm = open_farm(args)
    for job in dict.fromkeys((args.job_a, job_b)):
        farm.job(job)  # an unknown job is the answer's own error, naming it
    records_a = farm.results(args.job_a)
    records_b = records_a if job_b == args.job_a else farm.results(job_b)
    if args.pareto:
        return _print_pareto(args, pareto(_pareto_jobs(args, job_b, records_a, records_b)))
    report = compare_records(records_a, records_b, job_a=args.job_a, job_b=job_b, lineage_of=lineage_at_path)
    if args.format == "json":
        print(to_json(report.model_dump()))
        return 0
    if args.format == "csv":
        rows = flat_rows(report)
        print(rows_csv(rows) if rows else "job_a,job_b,model_a,model_b", end="" if rows else "\n")
        return 0
    if not report.pairs:
        if report.notes:
            raise UserError(report.notes[-1])
        raise UserError(f"jobs {args.job_a} and {job_b} share no model: none has the same name, none was made from "
                        f"the other's (`farm quantize` lineage), and they are not one model each. A: "
                        f"{', '.join(report.unmatched_a) or 'none'}; B: {', '.join(report.unmatched_b) or 'none'}")
    out.print(compare_table(report))
    for p in report.pairs:
        if not p.rows:
            out.print(Text(f"{p.model_a.name} → {p.model_b.name}: no run condition (target, unit, threads, "
                           "batch, size, budget) in common with completed runs", style="yellow"), highlight=False)
    if report.unmatched_a or report.unmatched_b:
        out.print(Text(f"not paired: A {', '.join(report.unmatched_a) or '—'}; B "
                       f"{', '.join(report.unmatched_b) or '—'}", style="dim"), highlight=False)
    for note in report.notes:
        out.print(Text(f"note: {note}", style="yellow"), highlight=False)
    return 0


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("compare", parents=[common],
                       help="before/after: two jobs' models (or one job's variants) side by side, with the noise")
    s.add_argument("job_a", type=_job_id, help="the 'before' job (42 or job-42)")
    s.add_argument("job_b", type=_job_id, nargs="?", default=None,
                   help="the 'after' job; left out: the variants within JOB_A (paired by `farm quantize` lineage)")
    s.add_argument("--format", choices=["table", "csv", "json"], default="table",
                   help="a table (default), CSV (one row per model pair and setting, or per point with --pareto), "
                        "or JSON (as --json)")
    s.add_argument("--pareto", action="store_true",
                   help="accuracy against latency per setting instead: every model of the job(s), the Pareto front "
                        "marked and each dominated model named with what dominates it (needs workload.dataset)")
    s.set_defaults(func=cmd_compare)
