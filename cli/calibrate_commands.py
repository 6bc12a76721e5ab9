"""`farm calibrate`, `farm calibrations`, `farm predict`, `farm rank`, `farm report`: the answer users come for.

Two modes each: against the farm (jobs measured by farm; the local store or a controller,
whichever open_farm picks) and offline (CSV in, JSON or CSV out, computed here, no store), so
the math can be checked on published data and used with numbers measured elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import logging
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from farm.proto.names import BACKEND_CHOICES
from farm.cli.console import UserError, err, job_progress, open_farm, out, output_file, when
from farm.proto import strict_json
from farm.proto.escape import printable

if TYPE_CHECKING:
    from pydantic import JsonValue

    from farm.proto.questions import CalibrationFit, FitFigures, RunnerUp, SuggestAnswer

    Labels = tuple[str | int | None, ...]  # a fit's label cells (device, metric, ... or its group), as the columns name them
    Fitted = list[tuple[Labels, FitFigures | CalibrationFit]]

INCLUDE_CONTENDED_HELP = "also use sim runs whose cores other work used (left out by default)"


def _fmt(v: float | None, spec: str = ".3g", why: str = "") -> str:
    """A figure, or a dash with the reason it cannot be computed (never "nan")."""
    if v is None or not math.isfinite(v):
        return f"— ({why})" if why else "—"
    return format(v, spec)


def _prior_cell(weight: float | None, source: str | None) -> str:
    return "—" if weight is None else f"{100 * weight:.0f} % ({source})"


def _runner_up_cell(runner_up: RunnerUp | None) -> str:
    """The fit the choice ranked second and its leave-one-out MAPE: what the chosen one beat."""
    if not runner_up:
        return "— (one candidate)"
    mape = runner_up.loo_mape
    return f"{runner_up.kind} ({'no figure' if mape is None else format(100 * mape, '.1f')})"


def _fit_table(rows: Fitted, label_cols: list[str]) -> Table:
    t = Table(header_style="bold")
    for c in label_cols + ["fit", "formula", "R²", "n", "LOO MAPE %", "±10 %", "runner-up (LOO MAPE %)", "τ", "ρ",
                           "prior weight", "verdict", "may flip"]:
        t.add_column(c)
    for labels, r in rows:
        flips = ", ".join(f"{a}/{b}" for a, b in r.possible_flips[:3]) + (" …" if len(r.possible_flips) > 3 else "")
        t.add_row(*[Text(str(label)) for label in labels], r.kind, Text(r.formula),
                  _fmt(r.r2, ".3f", "device values all equal"), str(r.n),
                  _fmt(100 * r.loo_mape if r.loo_mape is not None else None, ".1f", "device values all 0"),
                  _fmt(100 * r.loo_within_10 if r.loo_within_10 is not None else None, ".0f",
                       "device values all 0"),
                  Text(_runner_up_cell(r.runner_up)), _fmt(r.kendall_tau, ".2f", "no order: values tie"),
                  _fmt(r.spearman_rho, ".2f", "no order: values tie"),
                  Text(_prior_cell(r.prior_weight, r.prior_source) + (
                      f"; log_pop: population {100 * r.population_weight:.0f} %"
                      if r.population_weight is not None and r.kind != "log_pop" else "")),
                  Text("unsafe", style="red") if r.unsafe else Text("ok"), Text(flips or "—"))
    return t


WIDE_HINT = ("±10 % and MAPE: leave-one-out, on models each fit did not see. --wide: R², runner-up, Kendall τ, "
             "Spearman ρ, prior weight, models whose order may flip")


def _compact_table(rows: Fitted, label_cols: list[str]) -> Table:
    """One line per calibration: what it is, the whole formula (folded, never cut), how well it
    predicts models it did not see (leave-one-out) and the verdict; --wide has every column."""
    t = Table(header_style="bold", caption=WIDE_HINT, caption_justify="left", caption_style="dim")
    for c in label_cols:
        t.add_column(c, overflow="fold")
    t.add_column("n", no_wrap=True)
    t.add_column("formula", overflow="fold", ratio=1)  # takes the width the short columns leave
    for c in ("±10 %", "MAPE %", "verdict"):
        t.add_column(c, no_wrap=True)
    for labels, r in rows:
        all_zero = "device values all 0"
        t.add_row(*[Text(str(label) if label is not None else "—") for label in labels], str(r.n),
                  Text(f"{r.kind}: {r.formula.split('  (')[0]}"),  # the log-space restatement: --wide
                  _fmt(100 * r.loo_within_10 if r.loo_within_10 is not None else None, ".0f", all_zero),
                  _fmt(100 * r.loo_mape if r.loo_mape is not None else None, ".1f", all_zero),
                  Text("unsafe", style="red") if r.unsafe else Text("ok"))
    return t


def _print_fits(rows: Fitted, label_cols: list[str], compact_cols: list[str], wide: bool) -> None:
    """The fits, each with its label cells (as label_cols name them); the compact table keeps the compact_cols
    among them that some fit has a value for."""
    from farm.cli.render import show

    if wide:
        show(out, _fit_table(rows, label_cols), wide=True)
        return
    kept = [i for i, c in enumerate(label_cols) if c in compact_cols and any(labels[i] not in (None, "")
                                                                            for labels, _ in rows)]
    out.print(_compact_table([(tuple(labels[i] for i in kept), r) for labels, r in rows], [label_cols[i] for i in kept]))


# --- calibrate ------------------------------------------------------------------------------
def cmd_calibrate(args: argparse.Namespace) -> int:
    if args.suggest is not None:
        if args.pairs:
            return _suggest_offline(args)
        if args.device:
            return _suggest_from_store(args)
        raise UserError("--suggest needs --device D (candidates: the store's models measured in the sim, not yet on D) "
                        "or --pairs CSV (the candidate models with their sim value (x) and features; rows with a "
                        "device value (y) count as already measured)")
    if args.pairs:
        return _calibrate_offline(args)
    from farm.client.api import CalibrateAsk

    answer = open_farm(args).calibrate(CalibrateAsk(
        job=args.job, sim_job=args.sim_job, device_job=args.device_job, device=args.device,
        metrics=list(args.metric or ["latency"]), min_pairs=args.min_pairs, include_contended=args.include_contended))
    results = answer.calibrations
    if args.json:
        print(strict_json.dumps(answer, indent=2))
    else:
        if results:  # the same tables as the offline fits'
            _print_fits([((r.device, r.metric, r.threads, r.family, r.version), r) for r in results],
                        ["device", "metric", "threads", "family", "version"], ["device", "metric", "threads", "family"],
                        args.wide)
        _say_left_out(answer.contended_left_out)
        for line in answer.refused:
            err.print(Text.assemble(("not fitted ", "yellow"), line))
        for r in results:
            for w in r.warnings:
                err.print(Text.assemble(("warning ", "yellow"), f"{r.device} {r.metric} threads={r.threads}: {w}"))
    return 0 if results else 1


def _say_left_out(n: int) -> None:
    if n:
        err.print(Text.assemble(("left out ", "yellow"), f"{n} contended run(s): other work used their cores "
                                "(--include-contended uses them)"))


PLOT_WIDTH, PLOT_HEIGHT = 60, 18


def scatter_plot(measured: list[float], predicted: list[float], title: str) -> str:
    """A terminal scatter of predicted against measured (log-log when all > 0): `*` a model,
    `.` the diagonal where a prediction is exact. Plain ASCII, so any terminal shows it."""
    values = [v for v in (*measured, *predicted) if math.isfinite(v)]
    if not values:
        return f"{title}: nothing to plot (no finite values)"
    log = min(values) > 0
    scale = (lambda v: math.log10(v)) if log else (lambda v: v)  # noqa: E731
    low, high = scale(min(values)), scale(max(values))
    span = high - low or 1.0
    grid = [[" "] * PLOT_WIDTH for _ in range(PLOT_HEIGHT)]

    def cell(v: float, size: int) -> int:
        return min(size - 1, max(0, round((scale(v) - low) / span * (size - 1))))

    for column in range(PLOT_WIDTH):  # the diagonal y = x
        value = low + span * column / (PLOT_WIDTH - 1)
        grid[PLOT_HEIGHT - 1 - min(PLOT_HEIGHT - 1, round((value - low) / span * (PLOT_HEIGHT - 1)))][column] = "."
    for x, y in zip(measured, predicted):
        if math.isfinite(x) and math.isfinite(y):
            grid[PLOT_HEIGHT - 1 - cell(y, PLOT_HEIGHT)][cell(x, PLOT_WIDTH)] = "*"
    top, bottom = max(values), min(values)
    lines = [f"{title} (predicted ↑ against measured →{', log-log' if log else ''}; . = exact)"]
    for index, row in enumerate(grid):
        label = f"{top:.3g}" if index == 0 else f"{bottom:.3g}" if index == PLOT_HEIGHT - 1 else ""
        lines.append(f"{label:>9} |{''.join(row)}")
    lines.append(" " * 10 + "+" + "-" * PLOT_WIDTH)
    lines.append(" " * 10 + f"{bottom:<.3g}".ljust(PLOT_WIDTH - 8) + f"{top:>.3g}")
    return "\n".join(lines)


def _plot_calibration(cal: Any, group: str) -> str:
    fit = cal.chosen_fit
    features = {name: [p.features[name] for p in cal.pairs] for name in fit.features_used}
    estimate, _, _ = fit.predict_arrays([p.x for p in cal.pairs], features, cal.confidence)
    return scatter_plot([p.y for p in cal.pairs], [float(v) for v in estimate], f"{group}: {cal.chosen}")


def _suggest_offline(args: argparse.Namespace) -> int:
    """--suggest K --pairs CSV: the K candidates (rows without a y value) to measure on the device next."""
    from farm.controller.analysis.calibration import CalibrationInputError, read_pairs_csv, suggest_models

    try:
        groups = read_pairs_csv(Path(args.pairs), x=args.x, y=args.y, model=args.model_col,
                                features=args.feature or (), require_y=False)
        rows = [pair for pairs in groups.values() for pair in pairs]
        measured = [pair for pair in rows if pair.y == pair.y]  # NaN ≠ NaN: rows without y are candidates
        candidates = [pair for pair in rows if pair.y != pair.y]
        if not candidates:
            raise UserError(f"{args.pairs}: every row has a {args.y!r} value: nothing left to suggest "
                            f"(leave {args.y!r} empty for the models not measured on the device yet)")
        chosen = suggest_models(candidates, args.suggest, features=sorted(rows[0].features), measured=measured)
    except (CalibrationInputError, ValueError, OSError) as e:
        raise UserError(f"{args.pairs}: {e}") from None
    if args.json:
        print(strict_json.dumps({"suggested": chosen, "measured": len(measured), "candidates": len(candidates)},
                                indent=2))
    else:
        for name in chosen:
            out.print(Text(name))
        err.print(f"{len(chosen)} of {len(candidates)} candidate(s), spread over sim and features "
                  f"(the most predictive variance removed over the candidates, {len(measured)} already measured)")
    return 0


def _suggest_from_store(args: argparse.Namespace) -> int:
    """--suggest K --device D: the K models of the farm (a local store or a controller's) to measure on D next;
    -o writes a job file that runs exactly those on D (the workload of the sim job the first came from)."""
    from farm.client.errors import FarmError
    from farm.proto.questions import SUGGEST

    if args.output and Path(args.output).expanduser().exists() and not args.force:  # before any work is done
        raise UserError(f"-o {args.output}: the file is already there; farm calibrate --suggest keeps it. Give another "
                        "file name, or --force to replace it. Nothing was written.")
    metric = (args.metric or ["latency"])[0]
    with open_farm(args) as farm:  # embedded or a controller: the same question of the table
        try:
            suggested = farm._ask(SUGGEST, device=args.device, count=args.suggest, metric=metric,
                                  threads=args.threads, include_contended=args.include_contended)
        except FarmError as e:
            raise UserError(f"--suggest {args.suggest} --device {printable(args.device)}: {e}") from None
    if args.output:
        output_file(args.output).write_text(_suggested_job(suggested))
    if args.json:  # the answer without the workload (the job file carries it), and the job file written
        print(strict_json.dumps({**suggested.model_dump(mode="json", exclude={"workload"}),
                                 **({"job_file": str(args.output)} if args.output else {})}, indent=2))
        return 0
    t = Table(header_style="bold", title=f"measure next on {printable(args.device)} ({metric}, "
                                         f"{suggested.threads} thread(s))")
    for c in ("model", "sim", "file", "sim job"):
        t.add_column(c, overflow="fold")
    for s in suggested.suggested:
        t.add_row(Text(printable(s.model)), _fmt(s.sim), Text(printable(s.path or "—")), str(s.job))
    out.print(t)
    err.print(f"{len(suggested.suggested)} of {suggested.candidates} candidate(s), spread over sim and "
              f"{', '.join(suggested.features) or 'no model facts'} (the most predictive variance removed over the candidates; {suggested.measured} already measured)"
              + (f"; job written to {args.output}: `farm submit {args.output}`" if args.output else ""))
    return 0


def _suggested_job(answer: SuggestAnswer) -> str:
    """A job file that measures the suggested models on the device, as their sim job measured them."""
    import yaml

    job: dict[str, JsonValue] = {"name": f"suggested-for-{answer.device}",
                                 "models": [{"path": s.path, **({"family": s.family} if s.family else {})}
                                            for s in answer.suggested],
                                 "workload": answer.workload or {"type": "benchmark"},
                                 "matrix": {"threads": [answer.threads]},
                                 "targets": [answer.device]}
    return ("# farm calibrate --suggest: the models that most sharpen the calibration, on this device\n"
            + yaml.safe_dump(job, sort_keys=False))


def _population_prior(choice: str) -> Any:
    """The population prior ``--population-prior`` names: the shipped one, none, or a JSON file."""
    from farm.controller.analysis.calibration import CalibrationInputError, PopulationPrior

    if choice == "none":
        return None
    if choice == "shipped":
        return PopulationPrior.shipped()
    path = Path(choice)
    try:
        if path.stat().st_size > 1_000_000:
            raise UserError(f"--population-prior {choice}: larger than 1 MB, not a population prior")
        return PopulationPrior.from_json(json.loads(path.read_text()), str(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"--population-prior {choice}: cannot read it as JSON ({e})") from None
    except CalibrationInputError as e:
        raise UserError(str(e)) from None


def _calibrate_offline(args: argparse.Namespace) -> int:
    from farm.controller.analysis.calibration import CalibrationInputError, calibrate, read_pairs_csv
    from farm.controller.service import GROUP_ALL, fit_figures

    population = _population_prior(args.population_prior)
    try:
        groups = read_pairs_csv(Path(args.pairs), x=args.x, y=args.y, model=args.model_col, group=args.group,
                                features=args.feature or ())
    except (CalibrationInputError, OSError) as e:
        raise UserError(str(e)) from None
    fits, rows, refused, plots = {}, [], [], []
    fitted: Fitted = []
    for group, pairs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        try:
            cal = calibrate(pairs, min_pairs=args.min_pairs, features=sorted(pairs[0].features), population=population)
        except ValueError as e:  # too few pairs, or values too bunched up to fit
            refused.append(f"{group or GROUP_ALL}: {e}")
            continue
        fits[group or GROUP_ALL] = cal.to_json()
        chosen = fit_figures(cal)
        fitted.append(((group or GROUP_ALL,), chosen))
        rows.append({"group": group or GROUP_ALL, **chosen.model_dump()})  # --json: the group, then the figures
        if args.plot and not args.json:
            plots.append(_plot_calibration(cal, str(group or GROUP_ALL)))
    document = {"farm_calibration": 1, "x": args.x, "y": args.y, "group": args.group, "groups": fits}
    if args.output:
        output_file(args.output).write_text(strict_json.dumps(document, indent=2))
    if args.json:
        print(strict_json.dumps({"calibrations": rows, "refused": refused, "written": args.output}, indent=2))
    else:
        if fitted:
            _print_fits(fitted, ["group"], ["group"], args.wide)
        for plot in plots:
            out.print(Text(plot))
        for line in refused:
            err.print(Text.assemble(("not fitted ", "yellow"), line))
        for (group_label,), figures in fitted:
            for w in figures.warnings:
                err.print(Text.assemble(("warning ", "yellow"), f"{group_label}: {w}"))
        if args.output:
            out.print(f"fit written to {args.output}")
    return 0 if rows else 1


def cmd_calibrations(args: argparse.Namespace) -> int:
    from farm.cli.render import calibrations_table, show

    rows = open_farm(args).calibrations(args.device, args.metric)
    if args.json:
        print(strict_json.dumps(rows, indent=2))
        return 0
    show(out, calibrations_table(rows, when, wide=args.wide), wide=args.wide)
    return 0


# --- predict ---------------------------------------------------------------------------------
def cmd_predict(args: argparse.Namespace) -> int:
    if args.calibration:
        return _predict_offline(args)
    if not (args.model and args.device):
        raise UserError("farm predict needs MODEL --device D (uses the store's calibration), or "
                            "--calibration fit.json --input x.csv (offline).")
    farm = open_farm(args)
    if args.backend and not farm.embedded:
        raise UserError(f"--backend chooses the sandbox of a run in this process; the {farm.where} measures with its "
                        "agents' own (`farm agent --backend`): drop --backend")
    from farm.client.api import PredictAsk

    confidence = DEFAULT_CONFIDENCE if args.confidence is None else args.confidence
    ask = PredictAsk(model=Path(args.model), device=args.device, metrics=tuple(args.metric or ["latency"]),
                     threads=args.threads, confidence=confidence, include_contended=args.include_contended)
    with job_progress(args, 0) as update:  # the sim run of the model, when no earlier one can be reused
        predictions = farm.predict(ask, update)
    if args.json:
        print(strict_json.dumps(predictions, indent=2))
        return 0
    t = Table(header_style="bold", title=f"{Path(args.model).name} on {args.device}")
    for c in ("metric", "threads", "sim", "predicted", f"{confidence:.0%} interval", "verdict", "calibration",
              "sim run"):
        t.add_column(c)
    for p in predictions:
        t.add_row(p.metric, str(p.threads), f"{_fmt(p.sim)} {p.unit}", f"{_fmt(p.estimate)} {p.unit}",
                  f"{_fmt(p.low)} – {_fmt(p.high)}", _verdict_cell(p.unsafe, p.verdict, p.extrapolation),
                  f"#{p.calibration.id} v{p.calibration.version} {p.calibration.kind}",
                  "reused" if p.sim_reused else "measured now")
    out.print(t)
    for p in predictions:
        for w in p.warnings:
            err.print(Text.assemble(("warning ", "yellow"), f"{p.metric} threads={p.threads}: {w}"))
    return 0


DEFAULT_CONFIDENCE = 0.9


def _verdict_cell(unsafe: bool, verdict: str, extrapolation: Any) -> Text:
    """"unsafe" (red) and/or "extrapolating" with the inputs outside the range the fit saw (yellow), else "ok"."""
    parts: list[tuple[str, str]] = []
    if unsafe:
        parts.append(("unsafe", "red"))
    if verdict == "extrapolating":
        outside = "; ".join(f"{'sim' if o.input == 'x' else o.input} {o.value:.4g} outside {o.low:.4g}–{o.high:.4g}"
                            for o in extrapolation)
        parts.append((f"extrapolating ({outside})" if outside else "extrapolating", "yellow"))
    if not parts:
        return Text("ok")
    text = Text()
    for index, (word, style) in enumerate(parts):
        text.append((", " if index else "") + word, style=style)
    return text


def _predict_offline(args: argparse.Namespace) -> int:
    from farm.controller.analysis.calibration import Calibration, CalibrationInputError, predict_rows
    from farm.controller.service import GROUP_ALL

    try:
        document = json.loads(Path(args.calibration).read_text())
        groups = {g: Calibration.from_json(c) for g, c in document["groups"].items()}
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{args.calibration}: not a farm calibration file ({e}); write one with "
                            "`farm calibrate --pairs pairs.csv -o fit.json`.") from None
    if not args.input:
        raise UserError("farm predict --calibration needs --input x.csv (columns: model, x[, group]).")
    try:
        with open(args.input, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise UserError(f"{args.input}: {e.strerror}") from None
    x_col = args.x or document.get("x") or "x"
    group_col = document.get("group")
    out_rows = []
    try:
        for line, row in enumerate(rows, start=2):
            group = row.get(group_col) if group_col else None
            cal = groups.get(group or GROUP_ALL)
            if cal is None:
                raise UserError(f"{args.input}:{line}: no calibration for group {group!r} in {args.calibration} "
                                    f"(it has {', '.join(groups)})")
            out_rows += predict_rows(cal, [row], x=x_col, source=args.input, first_line=line,
                                     confidence=args.confidence)
    except (CalibrationInputError, ValueError) as e:
        raise UserError(str(e)) from None
    extrapolating = [row for row in out_rows if row.get("verdict") == "extrapolating"]
    if extrapolating:  # stderr, so the CSV on stdout stays a CSV
        err.print(Text.assemble(("extrapolating ", "yellow"), f"{len(extrapolating)} of {len(out_rows)} row(s) lie "
                                "outside the range the fit saw (the verdict and extrapolation columns say which; "
                                "their intervals are widened): "
                                + ", ".join(printable(str(row.get("model", "?"))) for row in extrapolating[:5])
                                + (" …" if len(extrapolating) > 5 else "")))
    if args.output:
        with open(output_file(args.output), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(out_rows[0]) if out_rows else ["model"])
            writer.writeheader()
            writer.writerows(out_rows)
    if args.json:
        print(strict_json.dumps(out_rows, indent=2))
    elif not args.output:
        writer = csv.DictWriter(sys.stdout, fieldnames=list(out_rows[0]) if out_rows else ["model"])
        writer.writeheader()
        writer.writerows(out_rows)
    else:
        out.print(f"{len(out_rows)} prediction(s) written to {args.output}")
    return 0


# --- rank ------------------------------------------------------------------------------------
def cmd_rank(args: argparse.Namespace) -> int:
    from farm.client.api import RankAsk

    ranking = open_farm(args).rank(RankAsk(job=args.job, metric=args.metric, device_jobs=list(args.device_job or ()),
                                           devices=list(args.device or ()), include_contended=args.include_contended))
    if args.json:
        print(strict_json.dumps(ranking, indent=2))
        return 0
    for group in ranking.groups:
        t = Table(header_style="bold",
                  title=f"job {args.job} · {args.metric} · threads {group.threads} · batch {group.batch_size}")
        t.add_column("#")
        for col in group.columns:
            name = escape(printable(col.name))
            t.add_column(f"{name}\nτ = {_fmt(col.kendall_tau, '.2f')}" if col.kendall_tau is not None else name)
        for i in range(max(len(col.order) for col in group.columns)):
            cells = []
            for col in group.columns:
                model, value = col.order[i] if i < len(col.order) else ("", None)
                cells.append(Text(f"{printable(model)} ({_fmt(value)})" if model else ""))
            t.add_row(str(i + 1), *cells)
        out.print(t)
        for col in group.columns:
            for note in col.notes:
                out.print(Text(printable(f"{col.name}: {note}", limit=None)), style="yellow")
    _say_left_out(ranking.contended_left_out)
    return 0


@contextlib.contextmanager
def _report_progress(here: bool) -> Iterator[None]:
    """While the report renders in this process, each figure it starts is a line on stderr (with the
    seconds since the start); a controller renders it remotely, which a line says instead."""
    from farm.controller.analysis.report import progress_log

    if not here:
        err.print("rendering the report on the controller…", style="dim")
        yield
        return
    started = time.monotonic()

    class Line(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            err.print(Text(f"report {time.monotonic() - started:5.1f} s  {printable(record.getMessage())}"),
                      style="dim")

    handler = Line(logging.INFO)
    level, propagate = progress_log.level, progress_log.propagate
    progress_log.addHandler(handler)
    progress_log.setLevel(logging.INFO)
    progress_log.propagate = False
    try:
        yield
    finally:
        progress_log.removeHandler(handler)
        progress_log.setLevel(level)
        progress_log.propagate = propagate


def cmd_report(args: argparse.Namespace) -> int:
    from farm.controller.service import REPORT_HTML

    if not args.output and not args.png:
        raise UserError("farm report needs -o report.html and/or --png DIR")
    output = output_file(args.output) if args.output else None
    png_dir = Path(args.png).expanduser().absolute() if args.png else None
    farm = open_farm(args)
    with _report_progress(farm.embedded):
        report = farm.report(args.job, html=output is not None, png=png_dir is not None, compare=args.job_b)
    warnings = report.warnings
    written = []
    try:  # rendered where the data is (a controller, or here); written here
        for f in report.files:
            path = output if f.name == REPORT_HTML else png_dir / f.name
            if path is None:
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(f.data)
            written.append(path)
    except OSError as e:
        raise UserError(f"cannot write the report: {e.strerror or e} ({e.filename}).") from None
    for warning in warnings:
        err.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False)
    if args.json:
        print(strict_json.dumps({"written": [str(p) for p in written], "warnings": warnings}, indent=2))
    else:
        out.print(f"{len(written)} file(s) written: " + ", ".join(str(p) for p in written[:4]) + (" …" if len(written) > 4 else ""))
    return 0


def add_commands(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("calibrate", parents=[common], help="fit device ≈ a·sim + b from paired runs or a CSV")
    s.add_argument("--job", type=int, help="a job with device targets: pairs device runs with their sim twins")
    s.add_argument("--sim-job", type=int, help="the job measured in the sim")
    s.add_argument("--device-job", type=int, help="the same models measured on the device (or another budget)")
    s.add_argument("--device", help="the name the calibration is stored under")
    s.add_argument("--metric", action="append", choices=["latency", "whole_run", "peak_memory", "avg_memory", "energy"],
                   help="repeatable; default latency (energy: per inference, boards with power rails)")
    s.add_argument("--pairs", help="offline: a CSV with model, x (sim) and y (device) columns")
    s.add_argument("--feature", action="append", metavar="COL",
                   help="offline, repeatable: a numeric column offered as a model feature (MACs, params, size…); "
                        "'auto' = every numeric column but x, y, model and group")
    s.add_argument("--x", default="x", help="offline: the sim column (default x)")
    s.add_argument("--y", default="y", help="offline: the device column (default y)")
    s.add_argument("--model-col", default="model", help="offline: the model name column (default model)")
    s.add_argument("--group", help="offline: fit one calibration per value of this column")
    s.add_argument("-o", "--output", help="offline: write the fit as JSON here; with --suggest --device, the job file "
                   "that measures the suggested models")
    s.add_argument("--force", action="store_true", help="with --suggest -o: replace a file that is already there")
    s.add_argument("--min-pairs", type=int, default=4, help="refuse a fit from fewer model pairs (default 4)")
    s.add_argument("--include-contended", action="store_true", help=INCLUDE_CONTENDED_HELP)
    s.add_argument("--population-prior", default="shipped", metavar="shipped|none|FILE",
                   help="offline: what the FLOPs/MACs and size coefficients are shrunk toward (the log_pop fit): "
                        "the prior shipped with farm (default), none, or a JSON written by benchmarks/population_prior.py")
    s.add_argument("--plot", action="store_true", help="offline: a terminal scatter of predicted against measured")
    s.add_argument("--wide", action="store_true",
                   help="every column: R², runner-up, τ, ρ, prior weight, order flips (default: one compact line each)")
    s.add_argument("--suggest", type=int, metavar="K",
                   help="print the K models to measure on the device next: with --device, from the store's models "
                        "measured in the sim (-o job.yaml writes a job running them on it); with --pairs, rows without y")
    s.add_argument("--threads", type=int, help="with --suggest --device: the thread count (default: the newest "
                                               "calibration's, else 1)")
    s.set_defaults(func=cmd_calibrate)

    s = sub.add_parser("calibrations", parents=[common], help="stored calibrations with their history")
    s.add_argument("--device", help="only this device's calibrations")
    s.add_argument("--metric", help="only this metric's (latency, whole_run, peak_memory, avg_memory, energy)")
    s.add_argument("--wide", action="store_true", help="every column: batch, input size, precision, family, when, fit, ρ, prior")
    s.set_defaults(func=cmd_calibrations)

    s = sub.add_parser(
        "predict", parents=[common], help="on-device estimate of a model from the sim alone",
        description="On-device estimate of a model from the sim alone, with its prediction interval and a verdict. "
                    "Columns (table, --json and the offline CSV): estimate (the predicted device value), low and high "
                    "(the --confidence prediction interval), verdict ('ok', or 'extrapolating' when the model lies "
                    "outside the sim values or features the calibration saw; the interval is then widened and "
                    "extrapolation names each input, its value and the range seen) and, against the farm, unsafe "
                    "(the sim does not track this device).")
    s.add_argument("model", nargs="?", help="a .tflite or .onnx file")
    s.add_argument("--device", help="a device with a stored calibration")
    s.add_argument("--metric", action="append", choices=["latency", "whole_run", "peak_memory", "avg_memory"],
                   help="repeatable; default latency")
    s.add_argument("--threads", type=int, help="default: every thread count the device is calibrated for")
    s.add_argument("--backend", choices=BACKEND_CHOICES, default=None,
                   help="the sandbox backend of the sim run (default: auto)")
    s.add_argument("--confidence", type=float, default=None,
                   help="the level of the low–high prediction interval (default 0.9; offline: the calibration's own)")
    s.add_argument("--calibration", help="offline: a fit written by `farm calibrate --pairs ... -o`")
    s.add_argument("--input", help="offline: CSV with model and x columns")
    s.add_argument("--x", help="offline: the x column (default: the one the fit used)")
    s.add_argument("-o", "--output", help="offline: write predictions CSV here")
    s.add_argument("--include-contended", action="store_true", help=INCLUDE_CONTENDED_HELP)
    s.set_defaults(func=cmd_predict)

    s = sub.add_parser("rank", parents=[common], help="models ordered by sim and by each device, with Kendall τ")
    s.add_argument("job", type=int, help="the sim job whose models are ranked (see `farm jobs`)")
    s.add_argument("--metric", default="latency", choices=["latency", "whole_run", "peak_memory", "avg_memory"],
                   help="what to order by (default latency)")
    s.add_argument("--device-job", type=int, action="append", help="a job measured on a device (repeatable)")
    s.add_argument("--device", action="append", help="a calibrated device: its predicted order (repeatable)")
    s.add_argument("--include-contended", action="store_true", help=INCLUDE_CONTENDED_HELP)
    s.set_defaults(func=cmd_rank)

    _add_report(sub, common)


def _add_report(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("report", parents=[common], help="one self-contained HTML page: results, sweep and telemetry plots, calibrations, rankings; "
                       "with two jobs, before → after")
    s.add_argument("job", type=int, help="the job to report on (see `farm jobs`)")
    s.add_argument("job_b", type=int, nargs="?", metavar="JOB_B",
                   help="a second job: one before → after page of JOB → JOB_B (the compare table with the run-to-run "
                        "noise, the Pareto view of both, each job's results)")
    s.add_argument("-o", "--output", help="the HTML file (plots embedded)")
    s.add_argument("--png", help="also write the figures as PNG files into this folder")
    s.set_defaults(func=cmd_report)
