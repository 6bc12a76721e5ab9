"""`farm report JOB`: one self-contained HTML file (plots embedded as PNG, no script, no CDN) per job.

In order: what the job is and any warning; the results table (units in every header, averaged
over repeats); sweep plots per model family (controller/analysis/plots.py says what a family is) — for a job with
device targets one figure per family with every target and thread count on it; an overview of every
cell; memory and CPU over time from the stored telemetry samples (lines stop at gaps); model facts;
per-operator tables where runs carry `op_profile`; the calibrations that used the job's runs, one
figure per family and setting (a panel per metric and device, every thread count's points, fitted
line, formula and R² in it, as in the published figures), then per calibration its fits and per
model the measured and predicted values; rankings; the job spec, folded. One figure per question:
the phones experiment's 36 calibrations are two figures, not 72. Progress goes to the `farm.report`
logger (the CLI shows it on stderr).
Every string from a job or a device is escaped.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import json
import logging
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from pydantic import JsonValue

from farm.controller.analysis import plots
from farm.controller.analysis.calibrations import METRICS, StoredCalibration, stored_calibration
from farm.controller.analysis.plots import Figure, plain, safe_file_name
from farm.controller.analysis.ranking import RankError, rank_job
from farm.controller.analysis.results import AveragedRecord, average_repeats, is_contended, json_number, run_records
from farm.controller.store import Store
from farm.controller.store.rows import CalibrationRow
from farm.proto.escape import cut_list, printable
from farm.proto.questions import RankGroup, RunModel, RunRecord

FIGURE_SIZE_IN = (6.4, 4.8)
MAX_TELEMETRY_FIGURES = 12  # one per model; a job of hundreds of models keeps its samples in the store
MAX_SWEEP_FIGURES = 40  # a figure per family and swept parameter; past this the page stops being read
MAX_OP_TABLES = 24
MAX_CALIBRATION_PANELS = 12  # panels (metric × device) in one calibration figure; more devices: more figures
TOP_OPS = 20

__all__ = ["Figure", "ReportError", "build_report", "write_report"]


class ReportError(ValueError):
    pass


progress_log = logging.getLogger("farm.report")  # `farm report` shows these on stderr while it renders


def _progress(what: str) -> None:
    progress_log.info("%s", what)


def calibrations_for_job(store: Store, job_id: int) -> list[StoredCalibration]:
    """The newest version of every calibration fitted on this job's runs (either side)."""
    newest: dict[tuple[str, str, int, str, str], CalibrationRow] = {}
    for row in store.calibrations.using_job(job_id):
        newest[(row.device, row.metric, row.threads, row.runtime, row.family)] = row
    return [stored_calibration(r) for r in newest.values()]


def _e(value: Any) -> str:
    """Text from a job or a device as HTML: control characters shown as escapes, markup as text."""
    return html.escape(printable(value, limit=None), quote=True)


def _e_lines(value: str) -> str:
    """As _e, keeping line breaks (a block shown in <pre>): only other control characters become escapes."""
    return html.escape(printable(value, limit=None, multiline=True), quote=True)


def spec_yaml(spec_json: str) -> str:
    """The stored job spec as the YAML a job file is written in, one field a line, in the stored order; a packed
    dataset (farm's own field, up to 16 MiB of base64) is named by its size, not shown."""
    import yaml

    spec = json.loads(spec_json)
    dataset = (spec.get("workload") or {}).get("dataset") if isinstance(spec, dict) else None
    if isinstance(dataset, dict) and isinstance(dataset.get("packed"), str):
        dataset["packed"] = f"({len(dataset['packed']) * 3 // 4:,} bytes packed by farm: the samples, labels, reference)"
    dumped: str = yaml.safe_dump(spec, sort_keys=False, allow_unicode=True, default_flow_style=False, width=100)
    return dumped


def _g(v: Any, digits: int = 4) -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        return "—"
    return f"{v:.{digits}g}"


def _table(headers: list[str], rows: list[list[Any]], cls: str = "") -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_e(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table class='{cls}'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _img(f: Figure) -> str:
    return (f"<figure><img alt='{_e(f.title or f.name)}' src='data:image/png;base64,{base64.b64encode(f.png).decode()}'>"
            "</figure>")


# --- calibration sections -------------------------------------------------------------------
def _label(c: StoredCalibration) -> str:
    fam = f", family {c.family}" if c.family else ""
    size = f" · input {c.input_size}" if c.input_size else ""
    return (f"{c.device} · {c.metric} · {c.threads} thread(s) · batch {c.batch_size}{size} · {c.precision}{fam}"
            f" · v{c.version}")


def _unit(metric: str) -> str:
    return METRICS.get(metric, ("", ""))[1]


def _sim_metric(c: StoredCalibration) -> str:
    return "latency" if c.metric == "energy" else c.metric  # energy is calibrated against the sim's latency


def _r2_text(r2: float) -> str:
    return f"R² = {r2:.3f}" if math.isfinite(r2) else "R² n/a (device values all equal)"


def calibration_figure(title: str, group: list[StoredCalibration]) -> Figure:
    """Every calibration of one family and setting in one figure, as the published ones: a panel per
    metric and device (one row of panels for one device), in each the sim-vs-device points of every
    thread count with its fitted line (a fit that also uses model facts: its fitted values, ×) and
    its formula and R² in the legend."""
    metrics = sorted({c.metric for c in group}, key=lambda m: list(METRICS).index(m) if m in METRICS else 99)
    devices = sorted({c.device for c in group})
    cells = [(m, d) for m in metrics for d in devices if any(c.metric == m and c.device == d for c in group)]
    if len(devices) == 1 or len(cells) <= 3:
        shape = (1, len(cells))
    else:
        shape = (len(metrics), len(devices))
    fig, axes = plt.subplots(*shape, figsize=(5.2 * shape[1], 4.4 * shape[0]), squeeze=False)
    used = []
    for index, (metric, device) in enumerate(cells):
        ax = axes[index // shape[1]][index % shape[1]] if shape[0] == 1 else \
            axes[metrics.index(metric)][devices.index(device)]
        used.append(ax)
        panel = sorted((c for c in group if c.metric == metric and c.device == device), key=lambda c: c.threads)
        for i, c in enumerate(panel):
            cal = c.calibration
            fit = cal.fits[cal.chosen]
            colour = f"C{i % 10}"
            xs = [p.x for p in cal.pairs]
            formula = plain(fit.formula.split("  (")[0], 70)
            ax.scatter(xs, [p.y for p in cal.pairs], color=colour, s=18, zorder=3,
                       label=f"t{c.threads}: {formula}, {_r2_text(fit.r2)}" + (" (unsafe)" if cal.unsafe else ""))
            if fit.features_used:  # no single line in x: the fitted value of each model
                ax.scatter(xs, [fit.predict(p.x, features=p.features).estimate for p in cal.pairs], color=colour,
                           marker="x", s=22, zorder=3)
            else:
                lo, hi = min(xs), max(xs)
                grid = [lo + (hi - lo) * k / 40 for k in range(41)]
                ax.plot(grid, [fit.predict(x).estimate for x in grid], color=colour, lw=1.2)
        if len(panel) == 1:
            plots.place_labels(ax, [(p.x, p.y) for p in panel[0].calibration.pairs],
                               [p.model for p in panel[0].calibration.pairs], fontsize=6)
        sim_metric = "latency" if metric == "energy" else metric  # energy is calibrated against the sim's latency
        ax.set_xlabel(f"sim {sim_metric.replace('_', ' ')} ({_unit(sim_metric)})")
        ax.set_ylabel(f"{plain(device, 30)} {metric.replace('_', ' ')} ({_unit(metric)})")
        ax.set_title(plain(f"{device} · {metric.replace('_', ' ')}", 60), fontsize=9)
        ax.legend(loc="upper left", fontsize=6, frameon=True, framealpha=0.8)
        ax.grid(alpha=0.3)
    for row in axes:
        for ax in row:
            if ax not in used:
                ax.set_visible(False)
    fig.suptitle(plain(title, 120), fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    return Figure(safe_file_name(f"calibrations-{title}", 120) + ".png", plots.png_bytes(fig), f"calibrations {title}")


def _group_title(c: StoredCalibration) -> str:
    size = f" · input {c.input_size}" if c.input_size else ""
    return f"{'family ' + c.family if c.family else 'every model'} · batch {c.batch_size}{size} · {c.precision}"


def _job_name(store: Store, job_id: Any) -> str:
    if not isinstance(job_id, int):
        return ""
    job = store.jobs.get(job_id)
    return f"job {job_id}" + (f" ({job.name})" if job and job.name else "" if job else " (not in this store)")


def _sources(store: Store, c: StoredCalibration) -> str:
    src = c.source
    if src.device_job is not None:
        return f"sim side: {_job_name(store, src.sim_job)} · device side: {_job_name(store, src.device_job)}"
    if src.job is not None:
        return f"device runs and their sim twins: {_job_name(store, src.job)}"
    return "fitted from pairs outside any job"


def calibrations_section(store: Store, calibrations: list[StoredCalibration], figures: list[Figure]) -> str:
    """Per family and setting, one figure with all its calibrations, then each calibration's tables."""
    groups: dict[str, list[StoredCalibration]] = {}
    for c in calibrations:
        groups.setdefault(_group_title(c), []).append(c)
    parts = []
    for title, group in sorted(groups.items()):
        devices = sorted({c.device for c in group})
        per_figure = max(1, MAX_CALIBRATION_PANELS // len({c.metric for c in group}))
        images = []
        for start in range(0, len(devices), per_figure):  # a lab of many devices: a figure per few of them
            some = set(devices[start:start + per_figure])
            part = title if len(devices) <= per_figure else f"{title} · devices {start + 1}–{start + len(some)}"
            _progress(f"calibration figure {part}")
            figure = calibration_figure(part, [c for c in group if c.device in some])
            figures.append(figure)
            images.append(_img(figure))
        group.sort(key=lambda c: (c.metric, c.device, c.threads))
        parts.append(f"<h3>{_e(title)}</h3>{''.join(images)}" + "".join(calibration_section(store, c) for c in group))
    return "".join(parts)


def calibration_section(store: Store, c: StoredCalibration) -> str:
    cal = c.calibration
    fit = cal.fits[cal.chosen]
    unit, sim_unit = _unit(c.metric), _unit(_sim_metric(c))
    kinds = _table(["fit", "formula", "R²", "LOO MAPE (%)", "within ±10 % (%)", "prior weight"],
                   [[k, f.formula, _g(f.r2), _g(100 * f.loo_mape), _g(100 * f.loo_within_10),
                     "—" if f.prior_weight is None else f"{100 * f.prior_weight:.0f} % ({f.prior_source})"]
                    for k, f in cal.fits.items()])
    rows = []
    for p in cal.pairs:
        predicted = fit.predict(p.x, features=p.features).estimate
        rows.append([p.model, _g(p.x), _g(p.y), _g(predicted), _g(100 * (predicted - p.y) / p.y if p.y else None, 3)])
    per_model = _table(["model", f"sim ({sim_unit})", f"device, measured ({unit})", f"predicted ({unit})", "error (%)"], rows)
    flips = ", ".join(f"{f.first} / {f.second}" for f in fit.possible_flips) or "none"
    warnings = "".join(f"<p class=warn>{_e(w)}</p>" for w in cal.warnings)
    return (f"<section><h4>{_e(_label(c))}</h4><p class=src>{_e(_sources(store, c))}</p>{warnings}"
            f"<p>chosen fit <b>{_e(cal.chosen)}</b>: {_e(fit.formula)} · "
            f"{'<b class=warn>unsafe</b>' if cal.unsafe else 'sim tracks the device'} · n = {fit.n} · "
            f"Kendall τ = {_g(fit.kendall_tau) if math.isfinite(fit.kendall_tau) else 'n/a (values tie)'} · "
            f"Spearman ρ = {_g(fit.spearman_rho) if math.isfinite(fit.spearman_rho) else 'n/a (values tie)'} · "
            f"order may flip: {_e(flips)}</p>"
            f"<details><summary>every fit and each model's error</summary>{kinds}{per_model}</details></section>")


def rankings_section(store: Store, job_id: int, calibrations: list[StoredCalibration]) -> str:
    device_jobs = sorted({job for c in calibrations if (job := c.source.device_job) is not None} - {job_id})
    parts = []
    for metric in sorted({c.metric for c in calibrations if c.metric != "energy"} or {"latency"}):
        try:
            ranking = rank_job(store, job_id, metric, device_jobs=device_jobs, devices=[])
        except RankError as e:  # an empty ranking says why
            parts.append(f"<p class=note>{_e(metric)}: not ranked: {_e(e)}</p>")
            continue
        if ranking.contended_left_out:
            parts.append(f"<p class=note>{_e(metric)}: {ranking.contended_left_out} contended run(s) left out of "
                         "the ranking (<code>farm rank --include-contended</code> uses them)</p>")
        for group in ranking.groups:
            parts.append(_ranking_group(metric, group))
    return "".join(parts) or "<p>no completed runs to rank</p>"


def _ranking_group(metric: str, group: RankGroup) -> str:
    """One cell's ranking table, then which models a column lacks and why (none left out silently)."""
    cols = group.columns
    headers = ["#"] + [c.name + (f" (τ = {c.kendall_tau:.2f})" if c.kendall_tau is not None else "") for c in cols]
    rows = [[i + 1] + [f"{col.order[i][0]} ({_g(col.order[i][1])} {_unit(metric)})" if i < len(col.order) else ""
                       for col in cols]
            for i in range(max(len(c.order) for c in cols))]
    ranked = {m for m, _ in cols[0].order}
    notes = [f"{c.name}: no completed figure for {cut_list(sorted(ranked - {m for m, _ in c.order}))}"
             for c in cols[1:] if ranked - {m for m, _ in c.order}]
    notes += [n for c in cols for n in c.notes]
    return (f"<h3>{_e(metric)} · {group.threads} thread(s) · batch {group.batch_size}</h3>{_table(headers, rows)}"
            + "".join(f"<p class=note>{_e(n)}</p>" for n in notes))


# --- results, plots, facts ------------------------------------------------------------------
def _has(records: list[AveragedRecord], figure: Callable[[AveragedRecord], object]) -> bool:
    return any(figure(r) is not None for r in records)


def _gpu(r: RunRecord, figure: str) -> str:
    return _g(json_number(r.gpu, figure) if r.gpu else None, 3)


def _latency(r: RunRecord, figure: str, digits: int = 4) -> str:
    return _g(getattr(r.latency_ms, figure) if r.latency_ms else None, digits)


def results_section(averaged: list[AveragedRecord]) -> str:
    """One row per cell; a column only where some run has the figure (energy: boards with rails)."""
    Column = tuple[str, Callable[[AveragedRecord], object]]
    columns: list[Column] = [
        ("model", lambda r: r.model.name),
        *([("target", lambda r: r.target)] if any(r.target != "sim" for r in averaged) else []),
        ("threads", lambda r: r.threads),
        ("budget (cores · MB)", lambda r: f"{_g(r.limits.cpus)} · {_g(r.limits.memory_mb)}"),
        *([("batch", lambda r: r.batch_size)] if any(r.batch_size != 1 for r in averaged) else []),
        *([("input (px)", lambda r: r.input_size or "model's")] if any(r.input_size for r in averaged) else []),
        *([("unit", lambda r: r.accelerator)] if any(r.accelerator != "cpu" for r in averaged) else []),
        ("runs (ok/all)", lambda r: f"{r.completed}/{r.runs}" + (f", {r.contended} contended" if r.contended else "")),
        ("status", lambda r: ("ok" if r.status == "completed" else r.status)
         + (f": {r.failure_class}" if r.failure_class else "")),
        *([("whole run (s)", lambda r: _g(r.whole_run_s, 3))] if _has(averaged, lambda r: r.whole_run_s) else []),
        ("latency avg ± sd (ms)", lambda r: f"{_latency(r, 'avg')} ± {_latency(r, 'std', 2)}" if r.latency_ms else "—"),
        ("latency p90 (ms)", lambda r: _latency(r, "p90")),
        ("first (ms)", lambda r: _latency(r, "first")),
        *([("startup (ms)", lambda r: _g(r.startup_ms))] if _has(averaged, lambda r: r.startup_ms) else []),
        ("throughput (inf/s)", lambda r: _g(plots.throughput_of(r))),
        *([("samples/s", lambda r: _g(r.samples_per_s))] if _has(averaged, lambda r: r.samples_per_s) else []),
        ("peak memory (MB)", lambda r: _g(r.peak_memory_mb)),
        ("avg memory (MB)", lambda r: _g(r.avg_memory_mb)),
        ("CPU avg/peak (%)", lambda r: f"{_g(r.cpu_percent.avg, 3)}/{_g(r.cpu_percent.peak, 3)}"),
        *([("energy (mJ/inference)", lambda r: _g(r.energy_per_inference_mj))]
          if _has(averaged, lambda r: r.energy_per_inference_mj) else []),
        *([("GPU power avg/peak (W)", lambda r: f"{_gpu(r, 'power_avg_w')}/{_gpu(r, 'power_peak_w')}"),
           ("GPU memory peak (MiB)", lambda r: _g(json_number(r.gpu, "memory_peak_mib") if r.gpu else None))]
          if any(r.gpu for r in averaged) else []),
        ("wall (s)", lambda r: _g(r.wall_s, 3)),
        ("backend", lambda r: (r.backend or "—") + (" (approximate)" if r.approximate else "")),
    ]
    rows = [[get(r) for _, get in columns] for r in averaged]
    note = ("<p class=note>One row per model and setting: figures are the mean over its completed repeats "
            "(contended runs only where a cell has no clean one); sd is the spread of the repeats' "
            "averages where there are two or more, else the run's own; first: the first inference. Throughput (inferences/s) is the run's own figure, or "
            "1000 / average latency. <code>farm results JOB --runs --wide</code> lists every run.</p>")
    return _table([h for h, _ in columns], rows, "results") + note


def _attempts(record: RunRecord) -> str:
    """A failed task tried more than once is one item, its last attempt's words, saying how many there were."""
    attempts = record.attempts or 0
    return f", the last of {attempts} attempts" if attempts > 1 else ""


def _failures(records: list[RunRecord]) -> str:
    failed = [r for r in records if r.status == "failed"]
    if not failed:
        return ""
    items = "".join(f"<li><b>{_e(r.model.name)}</b> (threads {r.threads}, repeat {r.repeat}, "
                    f"{_e(r.target)}){_e(_attempts(r))}: {_e(r.failure_class)}: <pre class=msg>"
                    f"{html.escape(printable(r.message, limit=2000, multiline=True))}</pre></li>"
                    for r in failed[:50])
    more = f"<li>… and {len(failed) - 50} more (<code>farm results JOB --format json</code>)</li>" if len(failed) > 50 else ""
    return f"<details class=warn><summary>{len(failed)} failed run(s)</summary><ul>{items}{more}</ul></details>"


def sweep_section(averaged: list[AveragedRecord], figures: list[Figure]) -> str:
    done = [r for r in averaged if r.status == "completed" and r.completed]
    parts = []
    _progress("overview figure")
    overview = plots.overview_figure(done)
    swept = plots.swept_params(done)
    families: dict[str, list[AveragedRecord]] = {}
    for r in done:
        families.setdefault(plots.family_of(r), []).append(r)
    if any(r.target != "sim" for r in done):
        # a device experiment: one figure per family with every target and thread count on it (as published)
        for family, rows in sorted(families.items()):
            _progress(f"family figure {family}")
            fig = plots.family_figure(family, rows)
            if fig is not None:
                figures.append(fig)
                parts.append(f"<h3>{_e(family)} on every target and thread count</h3>{_img(fig)}")
        swept = [p for p in swept if p.key not in ("threads", "cpus")]
    left_out = 0
    for x in swept:
        others = [p for p in swept if p is not x and not (x.key == "input_size" and p.key == "input_size")]
        for family, rows in sorted(families.items()):
            if len([f for f in figures if f.name.startswith("sweep-")]) >= MAX_SWEEP_FIGURES:
                left_out += 1
                continue
            _progress(f"sweep figure {family} against {x.label}")
            fig = plots.sweep_figure(family, rows, x, others)
            if fig is not None:
                figures.append(fig)
                parts.append(f"<h3>{_e(family)} against {_e(x.label)}</h3>{_img(fig)}")
            single = plots.single_point_series(rows, x, others)
            if single:  # never a model silently missing from a chart: say which and why
                parts.append(f"<p class=note>{_e(family)} against {_e(x.label)}: {len(single)} line(s) not drawn, "
                             f"each with one {_e(x.label)} value (the results table has them): "
                             f"{_e(cut_list(single))}</p>")
    if left_out:
        parts.append(f"<p class=warn>{left_out} more family × parameter figure(s) left out: the page shows the first "
                     f"{MAX_SWEEP_FIGURES}; give models a shared <code>family:</code> in the job to group them.</p>")
    if not swept:
        parts.append("<p class=note>Nothing was swept (one thread count, CPU budget, batch size and input size per "
                     "model): the overview below compares the models. <code>matrix: {threads: [1, 2, 4]}</code> "
                     "(also <code>batch_sizes</code>, <code>input_sizes</code>) gives a line per model.</p>")
    if overview is not None:
        figures.append(overview)
        parts.append(f"<h3>every model and setting</h3>{_img(overview)}")
    return "".join(parts)


def telemetry_section(store: Store, records: list[RunRecord], figures: list[Figure]) -> str:
    by_model: dict[str, list[RunRecord]] = {}
    for r in records:
        if r.status == "completed" and r.run is not None:
            by_model.setdefault(r.model.name, []).append(r)
    parts, skipped = [], 0
    for i, (model, runs) in enumerate(sorted(by_model.items())):
        if i >= MAX_TELEMETRY_FIGURES:
            skipped += 1
            continue
        lines = []
        ordered = sorted(runs, key=lambda r: (r.repeat, r.target, r.threads, r.batch_size, r.input_size or 0))
        for r in ordered[:plots.MAX_LINES]:
            label = f"t{r.threads}" + (f" b{r.batch_size}" if r.batch_size != 1 else "") \
                + (f" r{r.input_size}" if r.input_size else "") + (f" on {plain(r.target, 24)}" if r.target != "sim" else "") \
                + f" rep {r.repeat}"
            lines.append((label, store.runs.telemetry(r.run or 0)))
        _progress(f"telemetry figure {model}")
        fig = plots.telemetry_figure(model, lines)
        if fig is not None:
            figures.append(fig)
            parts.append(_img(fig))
    if not parts:
        return "<p class=note>No telemetry samples are stored for this job's completed runs.</p>"
    more = (f"<p class=note>{skipped} more model(s) have samples in the store (the figure shows the first "
            f"{MAX_TELEMETRY_FIGURES}).</p>") if skipped else ""
    return ("<p class=note>Sampled every <code>sim.sample_interval_ms</code> during each run; the first "
            f"{plots.MAX_LINES} runs of each model.</p>" + "".join(parts) + more)


def facts_section(records: list[RunRecord]) -> str:
    seen: dict[tuple[str, str], RunModel] = {}  # (name, sha256) -> the record's model
    for r in records:
        seen.setdefault((r.model.name, r.model.sha256), r.model)
    known = {"name", "sha256", "family", "path", "size_bytes", "param_count"}
    facts = [name for name in RunModel.model_fields if name not in known]  # what calibrations use as features
    extra = sorted({k for m in seen.values() for k in facts if getattr(m, k) is not None})

    def fmt(key: str, v: float | None) -> str:
        if key.endswith("_share"):
            return _g(100 * v, 3) + " %" if isinstance(v, (int, float)) else "—"
        if key in ("macs", "flops"):
            return _g(v / 1e6, 4) if isinstance(v, (int, float)) else "—"
        if key.endswith("_bytes"):
            return _g(v / (1 << 20), 4) if isinstance(v, (int, float)) else "—"
        return _g(v) if isinstance(v, (int, float)) else str(v)

    def header(key: str) -> str:
        if key in ("macs", "flops"):
            return f"{key.upper()} (M)"
        if key.endswith("_bytes"):
            return key.removesuffix("_bytes").replace("_", " ") + " (MB)"
        return key.replace("_", " ")

    headers = ["model", "family", "format", "file size (KB)", "parameters (M)", *[header(k) for k in extra], "sha256"]
    rows = [[m.name, m.family or "—", Path(m.path or "").suffix.lstrip(".") or "—",
             _g((m.size_bytes or 0) / 1024) if m.size_bytes else "—",
             _g(m.param_count / 1e6) if m.param_count is not None else "—",
             *[fmt(k, getattr(m, k)) for k in extra], (m.sha256 or "")[:16]] for m in seen.values()]
    return _table(headers, rows)


def _op_rows(profile: list[JsonValue]) -> list[list[str]] | None:
    """A run's `op_profile` as table rows, or None when it is not a list of {op, count, avg_ms, pct}."""
    rows = []
    for entry in profile:
        op = entry.get("op") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or not isinstance(op, str):
            continue
        rows.append([op, _g(entry.get("count")), _g(entry.get("avg_ms")), _g(entry.get("pct"), 3)])
    rows.sort(key=lambda row: -float(row[3]) if row[3] != "—" else 0.0)
    return rows or None


def ops_section(records: list[RunRecord]) -> str:
    parts, seen = [], set()
    for r in records:
        rows = _op_rows(r.op_profile)
        key = (r.model.name, r.target, r.threads, r.batch_size, r.input_size)
        if rows is None or key in seen:
            continue
        seen.add(key)
        if len(seen) > MAX_OP_TABLES:
            parts.append(f"<p class=note>More runs carry operator profiles: <code>farm results JOB --format json</code> "
                         f"(the first {MAX_OP_TABLES} are shown).</p>")
            break
        more = f"<p class=note>{len(rows) - TOP_OPS} more operator(s) below these.</p>" if len(rows) > TOP_OPS else ""
        parts.append(f"<h3>{_e(r.model.name)} · {r.threads} thread(s) · {_e(r.target)} · repeat {r.repeat}</h3>"
                     f"{_table(['operator', 'count', 'avg (ms)', 'share of time (%)'], rows[:TOP_OPS])}{more}")
    return "".join(parts)


STYLE = """body{font-family:system-ui,sans-serif;max-width:1360px;margin:1.5em auto;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px;vertical-align:top}
th{background:#f4f4f4;text-align:left}table.results td{white-space:nowrap}
td{overflow-wrap:anywhere}td:first-child{white-space:nowrap}figure{margin:6px 0}img{max-width:100%;border:1px solid #eee}
.figs{display:flex;flex-wrap:wrap;gap:6px}.warn{color:#a60}.note{color:#555;font-size:13px}.src{font-size:14px}
pre{white-space:pre-wrap;overflow-wrap:anywhere;background:#f8f8f8;padding:.5em}pre.msg{margin:.2em 0}
.wrap{overflow-x:auto}"""


VARIANT_FIGURES = (  # (row key, column header): shown where some variant row has the figure on both sides
    ("energy_per_inference_mj", "mJ/inference"),
    ("agreement_cosine", "cosine with the reference"),
    ("agreement_top1", "top-1 agreement"),
    ("agreement_max_abs_error", "max abs error"),
    ("accuracy_top1", "accuracy top-1"),
    ("accuracy_top5", "accuracy top-5"),
)


def variants_section(job_id: int, records: list[RunRecord]) -> str:
    """The job's models made from another of its models (`farm quantize` lineage): before → after per cell, with
    energy where measured and the dataset's agreement and accuracy figures where the job had `workload.dataset`."""
    from farm.controller.analysis.compare import lineage_at_path, variant_rows

    def mb(n: int | None) -> str:
        return _g(n / 1e6, 3) if isinstance(n, (int, float)) else "—"

    variants = variant_rows(job_id, records, lineage_at_path)
    extra = [(key, header) for key, header in VARIANT_FIGURES if any(v.figures.get(key) for v in variants)]
    rows = [[v.source, v.variant, v.method or "—", v.target, v.accelerator, v.threads,
             f"{mb(v.size_a)} → {mb(v.size_b)}", f"{_g(v.latency_a, 3)} → {_g(v.latency_b, 3)}",
             f"{v.latency_change:+.0%}" if v.latency_change is not None else "—",
             f"{_g(v.memory_a, 3)} → {_g(v.memory_b, 3)}",
             *[f"{_g(v.sides(key)[0])} → {_g(v.sides(key)[1])}" for key, _ in extra], v.verdict or "—"]
            for v in variants]
    if not rows:
        return ""
    return (_table(["source", "variant", "method", "on", "unit", "threads", "size MB", "latency avg ms", "Δ latency",
                    "peak MB", *[header for _, header in extra], "latency vs noise"], rows)
            + "<p class=note>Variants made by <code>farm quantize</code> beside their source (<code>farm compare "
            f"{job_id}</code> has every figure); noise: Welch's t at 95 % over the repeats.</p>")


MAX_PARETO_FIGURES = 12  # one per setting; the table under them lists every point


def pareto_section(job_id: int, records: list[RunRecord], figures: list[Figure],
                   more: list[tuple[int, list[RunRecord]]] | None = None) -> str:
    """Accuracy against latency per setting (controller/analysis/pareto.py): a figure and a table per setting with
    the front marked and each dominated model named with what dominates it. Empty without dataset figures.
    `more`: other jobs' records on the same figures (a before/after report; points labelled by job)."""
    from farm.controller.analysis.pareto import group_title, pareto

    view = pareto([(job_id, records), *(more or [])])
    parts = []
    for i, group in enumerate(view.groups):
        title = group_title(group)
        if i < MAX_PARETO_FIGURES:
            _progress(f"Pareto figure: {title}")
            figure = plots.pareto_figure(title, group)
            if figure is not None:
                figures.append(figure)
                parts.append(f"<div class=figs>{_img(figure)}</div>")
        rows = [[p.label, _g(p.latency_avg_ms), _g(p.quality), f"{p.runs}{' (contended)' if p.contended else ''}",
                 "on the front" if p.on_front else "dominated by " + ", ".join(p.dominated_by)]
                for p in group.points]
        parts.append(f"<h3>{_e(title)}</h3>" + _table(["model", "latency avg ms", group.quality_label, "runs",
                                                       "Pareto"], rows))
        if group.without_quality:
            parts.append(f"<p class=note>no figure: {_e(', '.join(group.without_quality))}</p>")
    if not parts:
        return ""
    return "".join(parts) + ("<p class=note>A model is dominated when another is at least as fast and at least as "
                             "accurate, and better in one (means over the runs; <code>farm compare --pareto</code> "
                             "has the same as JSON and CSV).</p>")


def build_report(store: Store, job_id: int) -> tuple[str, list[Figure], list[str]]:
    """The page, its figures (also written with --png) and the warnings shown at its top."""
    job = store.jobs.get(job_id)
    if job is None:
        raise ReportError(f"no job {job_id} in {store.location}; `farm jobs` lists the jobs there.")
    _progress(f"reading job {job_id}")
    records = run_records(store, job_id)
    averaged = average_repeats(records)
    calibrations = calibrations_for_job(store, job_id)
    figures: list[Figure] = []
    warnings: list[str] = []
    done = sum(r.status == "completed" for r in records)
    if not done:
        warnings.append(f"job {job_id} has no completed run ({len(records)} run(s): "
                        + ", ".join(f"{n} {s}" for s, n in sorted(Counter(r.status for r in records).items()))
                        + "): there is nothing to plot; `farm status` and `farm results` say why.")
    sweeps = sweep_section(averaged, figures) if done else ""
    telemetry = telemetry_section(store, records, figures) if done else ""
    ops = ops_section(records)
    variants = variants_section(job_id, records) if done else ""
    front = pareto_section(job_id, records, figures) if done else ""
    cal_sections = calibrations_section(store, calibrations, figures)
    if not calibrations:
        cal_sections = ("<p class=note>No calibration uses this job's runs yet: <code>farm calibrate --sim-job A "
                        "--device-job B --device NAME</code> (or <code>--job J</code> for a job with device targets), "
                        "then make the report again.</p>")
    _progress("rankings")
    rankings = rankings_section(store, job_id, calibrations)
    if any(r.approximate for r in records):
        warnings.append("some runs used the approximate process backend: limits best-effort, memory sampled.")
    contended = sum(is_contended(r) for r in records)
    if contended:
        warnings.append(f"{contended} run(s) contended: other work used their cores; their figures are not the budget's.")
    targets = sorted({r.target for r in records})
    spec = spec_yaml(job.spec_json or "{}")
    when = "".join(f" · {label} {_when(moment)}" for label, moment in (("created", job.created_at),
                                                                        ("finished", job.finished_at)) if moment)
    toc = [("results", "Results"), ("sweeps", "Plots"), ("telemetry", "Memory and CPU over time"), ("facts", "Models"),
           *([("variants", "Variants")] if variants else []), *([("pareto", "Accuracy and latency")] if front else []),
           *([("ops", "Operators")] if ops else []), ("calibrations", "Calibrations"), ("rankings", "Rankings"),
           ("spec", "Job spec")]
    page = f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>farm report · job {job_id} · {_e(job.name or '')}</title><style>{STYLE}</style></head><body>
<h1>farm report · job {job_id} · {_e(job.name or '')}</h1>
<p>status <b>{_e(job.status)}</b> · {len(records)} run(s), {done} completed · {len({r.model.sha256 for r in records})} model(s)
 · on {_e(', '.join(targets))}{_e(when)} · {len(calibrations)} calibration(s)</p>
<nav>{' · '.join(f"<a href='#{a}'>{t}</a>" for a, t in toc)}</nav>
{''.join(f"<p class=warn>⚠ {_e(w)}</p>" for w in warnings)}{_failures(records)}
<h2 id=results>Results</h2><div class=wrap>{results_section(averaged)}</div>
<h2 id=sweeps>Plots</h2>{sweeps or '<p class=note>no completed run to plot</p>'}
<h2 id=telemetry>Memory and CPU over time</h2>{telemetry or '<p class=note>no completed run</p>'}
<h2 id=facts>Models</h2><div class=wrap>{facts_section(records)}</div>
{f'<h2 id=variants>Variants</h2><div class=wrap>{variants}</div>' if variants else ''}
{f'<h2 id=pareto>Accuracy and latency</h2><div class=wrap>{front}</div>' if front else ''}
{f'<h2 id=ops>Operators</h2>{ops}' if ops else ''}
<h2 id=calibrations>Calibrations</h2>{cal_sections}
<h2 id=rankings>Rankings</h2>{rankings}
<h2 id=spec>Job spec</h2><details><summary>the job as submitted (YAML, {len(spec.splitlines())} lines)</summary><pre>{_e_lines(spec)}</pre></details>
</body></html>"""
    return page, figures, warnings


def _when(ts: float | None) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC") if ts else "—"


def write_report(store: Store, job_id: int, output: Path | None, png_dir: Path | None) -> tuple[list[Path], list[str]]:
    """Write the page and/or the figures; the warnings say what the report could not show
    (a PNG folder is not made when there is no figure to put in it)."""
    page, figures, warnings = build_report(store, job_id)
    written = []
    if output is not None:
        output.write_text(page, encoding="utf-8")
        written.append(output)
    if png_dir is not None:
        if not figures:
            warnings.append(f"no figures, so {png_dir} was not written: the job has no completed run to plot.")
        else:
            png_dir.mkdir(parents=True, exist_ok=True)
            names: set[str] = set()
            for f in figures:
                name = f.name
                n = 1
                while name in names:  # two families that make one safe file name
                    n += 1
                    name = f"{Path(f.name).stem}-{n}.png"
                names.add(name)
                (png_dir / name).write_bytes(f.png)
                written.append(png_dir / name)
    return written, warnings
