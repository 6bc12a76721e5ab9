"""`farm report JOB`: one self-contained HTML file (plots embedded as PNG) per job.

Per calibration that used the job's runs: the sim-vs-device scatter with the fitted line,
formula and R² (as in the published figures), the residuals, and per model the measured
and predicted values; then the ranking tables.
"""

from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: render to memory
import matplotlib.pyplot as plt  # noqa: E402

from farm.controller.calibrations import METRICS, StoredCalibration, stored_calibration  # noqa: E402
from farm.controller.ranking import RankError, rank_job  # noqa: E402
from farm.controller.store import Store  # noqa: E402

FIGURE_SIZE_IN = (6.4, 4.8)
FIGURE_DPI = 100  # 640 × 480 px


class ReportError(ValueError):
    pass


@dataclass
class Figure:
    name: str
    png: bytes


def calibrations_for_job(store: Store, job_id: int) -> list[StoredCalibration]:
    """The newest version of every calibration fitted on this job's runs (either side)."""
    rows = store.calibrations_of_job(job_id)
    newest: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        newest[(row["device"], row["metric"], row["threads"], row["runtime"], row["family"])] = row
    return [stored_calibration(r) for r in newest.values()]


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=FIGURE_DPI)
    plt.close(fig)
    return buf.getvalue()


def _label(c: StoredCalibration) -> str:
    fam = f", family {c.family}" if c.family else ""
    size = f" · input {c.input_size}" if c.input_size else ""
    return (f"{c.device} · {c.metric} · {c.threads} thread(s) · batch {c.batch_size}{size} · {c.precision}{fam}"
            f" · v{c.version}")


def scatter_figure(c: StoredCalibration) -> bytes:
    cal = c.calibration
    fit = cal.fits[cal.chosen]
    unit = METRICS.get(c.metric, ("", ""))[1]
    xs = [p.x for p in cal.pairs]
    ys = [p.y for p in cal.pairs]
    fig, ax = plt.subplots(figsize=FIGURE_SIZE_IN)
    ax.scatter(xs, ys, color="tab:blue", zorder=3)
    for p in cal.pairs:
        ax.annotate(p.model, (p.x, p.y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if fit.features_used:
        # the fit also uses model facts, so it is no single line in x: show its value per model
        fitted = [fit.predict(p.x, features=p.features, confidence=cal.confidence) for p in cal.pairs]
        ax.errorbar(xs, [f.estimate for f in fitted], yerr=[[f.estimate - f.low for f in fitted],
                    [f.high - f.estimate for f in fitted]], fmt="x", color="tab:red",
                    label=f"{cal.chosen} + {', '.join(fit.features_used)}")
    else:
        lo, hi = min(xs), max(xs)
        grid = [lo + (hi - lo) * i / 50 for i in range(51)]
        preds = [fit.predict(x, confidence=cal.confidence) for x in grid]
        ax.plot(grid, [p.estimate for p in preds], color="tab:red", label=cal.chosen)
        ax.fill_between(grid, [p.low for p in preds], [p.high for p in preds], color="tab:red", alpha=0.15,
                        label=f"{int(cal.confidence * 100)} % prediction interval")
    formula = fit.formula
    ax.text(0.04, 0.94, f"{formula}\nR² = {fit.r2:.3f}", transform=ax.transAxes, va="top",
            bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
    ax.set_xlabel(f"sim {c.metric} ({unit})")
    ax.set_ylabel(f"{c.device} {c.metric} ({unit})")
    ax.set_title(_label(c), fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def residual_figure(c: StoredCalibration) -> bytes:
    cal = c.calibration
    fit = cal.fits[cal.chosen]
    fig, ax = plt.subplots(figsize=FIGURE_SIZE_IN)
    residuals = [p.y - fit.predict(p.x, features=p.features).estimate for p in cal.pairs]
    ax.axhline(0, color="grey", lw=1)
    ax.scatter([p.x for p in cal.pairs], residuals, color="tab:purple")
    for p, r in zip(cal.pairs, residuals):
        ax.annotate(p.model, (p.x, r), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel(f"sim {c.metric}")
    ax.set_ylabel("device − fitted")
    ax.set_title(f"residuals · {_label(c)}", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _g(v: float | None) -> str:
    return "—" if v is None else f"{v:.4g}"


def build_report(store: Store, job_id: int) -> tuple[str, list[Figure]]:
    job = store.job(job_id)
    if job is None:
        raise ReportError(f"no job {job_id} in {store.path}")
    calibrations = calibrations_for_job(store, job_id)
    figures: list[Figure] = []
    sections: list[str] = []
    for c in calibrations:
        cal = c.calibration
        fit = cal.fits[cal.chosen]
        slug = (f"{c.device}-{c.metric}-t{c.threads}-b{c.batch_size}{'-i' + str(c.input_size) if c.input_size else ''}"
                f"-{c.precision}{'-' + c.family if c.family else ''}-v{c.version}").replace("/", "_")
        scatter = Figure(f"{slug}-scatter.png", scatter_figure(c))
        residual = Figure(f"{slug}-residuals.png", residual_figure(c))
        figures += [scatter, residual]
        kinds = _table(["fit", "formula", "R²", "LOO MAPE %", "within ±10 %", "prior weight"],
                       [[k, f.formula, _g(f.r2), _g(100 * f.loo_mape), _g(100 * f.loo_within_10),
                         "—" if f.prior_weight is None else f"{100 * f.prior_weight:.0f} % ({f.prior_source})"]
                        for k, f in cal.fits.items()])
        per_model = _table(["model", "sim", "device (measured)", "predicted", "error %"],
                           [[p.model, _g(p.x), _g(p.y), _g(fit.predict(p.x, features=p.features).estimate),
                             _g(100 * (fit.predict(p.x, features=p.features).estimate - p.y) / p.y if p.y else None)] for p in cal.pairs])
        flips = ", ".join(f"{f.first} / {f.second}" for f in fit.possible_flips) or "none"
        warnings = "".join(f"<p class=warn>{html.escape(w)}</p>" for w in cal.warnings)
        sections.append(
            f"<section><h2>{html.escape(_label(c))}</h2>{warnings}"
            f"<p>chosen fit <b>{html.escape(cal.chosen)}</b>: {html.escape(fit.formula)} · "
            f"{'<b class=warn>unsafe</b>' if cal.unsafe else 'sim tracks the device'} · n = {fit.n} · "
            f"Kendall τ = {_g(fit.kendall_tau)} · Spearman ρ = {_g(fit.spearman_rho)} · "
            f"order may flip: {html.escape(flips)}</p>"
            f"<div class=figs><img alt='scatter' src='data:image/png;base64,{base64.b64encode(scatter.png).decode()}'>"
            f"<img alt='residuals' src='data:image/png;base64,{base64.b64encode(residual.png).decode()}'></div>"
            f"{kinds}<h3>per model</h3>{per_model}</section>")
    device_jobs = sorted({c.source.get("device_job") for c in calibrations if c.source.get("device_job")} - {job_id})
    rankings = []
    for metric in sorted({c.metric for c in calibrations} or {"latency"}):
        try:
            ranking = rank_job(store, job_id, metric, device_jobs=device_jobs, devices=[])
        except RankError:
            continue
        for group in ranking["groups"]:
            cols = group["columns"]
            headers = ["#"] + [f"{c['name']}" + (f" (τ = {c['kendall_tau']:.2f})" if c["kendall_tau"] is not None else "")
                               for c in cols]
            rows = [[i + 1] + [f"{col['order'][i][0]} ({col['order'][i][1]:.4g})" if i < len(col["order"]) else ""
                               for col in cols] for i in range(max(len(c["order"]) for c in cols))]
            rankings.append(f"<h3>{html.escape(metric)} · {group['threads']} thread(s) · batch {group['batch_size']}</h3>"
                            f"{_table(headers, rows)}")
    empty = "" if calibrations else (
        "<p>No calibration uses this job's runs yet: run <code>farm calibrate --sim-job A --device-job B "
        "--device NAME</code>, then make the report again.</p>")
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>farm report · job {job_id}</title>
<style>body{{font-family:sans-serif;max-width:1320px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;margin:.5em 0}}td,th{{border:1px solid #ccc;padding:2px 8px;font-size:13px}}
.figs img{{margin:4px;border:1px solid #eee}}.warn{{color:#a60}}</style></head><body>
<h1>farm report · job {job_id} · {html.escape(job['name'] or '')}</h1>
<p>{len(calibrations)} calibration(s). Spec:</p><pre>{html.escape(json.dumps(json.loads(job['spec_json']), indent=1))}</pre>
{empty}{''.join(sections)}<h2>Rankings</h2>{''.join(rankings) or '<p>no completed runs to rank</p>'}
</body></html>"""
    return page, figures


def write_report(store: Store, job_id: int, output: Path | None, png_dir: Path | None) -> list[Path]:
    page, figures = build_report(store, job_id)
    written = []
    if output is not None:
        output.write_text(page)
        written.append(output)
    if png_dir is not None:
        png_dir.mkdir(parents=True, exist_ok=True)
        for f in figures:
            (png_dir / f.name).write_bytes(f.png)
            written.append(png_dir / f.name)
    return written
