"""`farm report A B`: one self-contained HTML page of two jobs, before (A) and after (B) (issue 30).

In order: what each job is and any warning; a summary, one line per model pair and run condition, saying for each
figure measured on both sides whether B differs from A beyond the run-to-run noise or inside it (Welch's t at 95 %
over the repeats, controller/analysis/compare.py: the same judgement as `farm compare A B`); the before/after table
(every figure: size, latency avg and p50, peak memory, energy, agreement and accuracy, A → B, the change and the
noise verdict); the Pareto view of both jobs' models together (accuracy against latency per setting, figures and
tables, as `farm compare A B --pareto`); then each job's own summary: its results averaged over repeats, its failed
runs and its spec. Rendered where the store is, as `farm report JOB` is; every string from a job is escaped.
"""

from __future__ import annotations

from farm.controller.analysis.compare import ComparedCell, Comparison, JudgedFigure, compare_records, lineage_at_path
from farm.controller.analysis.plots import Figure
from farm.controller.analysis.report import (
    STYLE, ReportError, _e, _e_lines, _failures, _g, _table, _when, pareto_section, results_section, spec_yaml,
)
from farm.controller.analysis.results import average_repeats, run_records
from farm.controller.store import Store
from farm.controller.store.rows import JobRow
from farm.proto.questions import RunRecord

# the figures the page judges, in its order: (key in compare's metrics, what a person reads, lower is better)
FIGURES: tuple[tuple[str, str, bool], ...] = (
    ("latency_avg_ms", "latency avg ms", True),
    ("latency_p50_ms", "latency p50 ms", True),
    ("peak_memory_mb", "peak memory MB", True),
    ("energy_per_inference_mj", "energy mJ/inference", True),
    ("agreement_cosine", "cosine with the reference", False),
    ("agreement_top1", "top-1 agreement with the reference", False),
    ("agreement_max_abs_error", "max abs error against the reference", True),
    ("accuracy_top1", "accuracy top-1", False),
    ("accuracy_top5", "accuracy top-5", False),
)


def _judged(m: JudgedFigure, lower_is_better: bool) -> str:
    """B against A in words: which way, and whether it is inside the run-to-run noise."""
    if m.noise == "unknown":
        return f"{m.verdict}: no judgement of the noise"
    if m.noise == "within":
        return "inside the run-to-run noise: no difference shown"
    better = (m.diff < 0) == lower_is_better
    return f"beyond the run-to-run noise: B is {'better' if better else 'worse'}"


def _change(m: JudgedFigure) -> str:
    return f"{m.change:+.1%}" if m.change is not None else "—"


def _condition(row: ComparedCell) -> str:
    budget = f", {_g(row.cpus, 3)} cpu" if row.cpus is not None else ""
    unit = f" {row.accelerator}" if row.accelerator != "cpu" else ""
    return f"{row.target}{unit}, {row.threads} thread(s), batch {row.batch_size}{budget}"


def summary_section(report: Comparison) -> str:
    """A line per pair and condition: each figure both sides have, A → B, its change and the noise verdict."""
    items = []
    for pair in report.pairs:
        names = f"{pair.model_a.name} → {pair.model_b.name}"
        for row in pair.rows:
            said = [f"{label} {_g(m.a)} → {_g(m.b)} ({_change(m)}), {_judged(m, lower)}"
                    for key, label, lower in FIGURES if (m := row.metrics.get(key)) is not None]
            items.append(f"<li><b>{_e(names)}</b> on {_e(_condition(row))}: "
                         + ("; ".join(_e(s) for s in said) or "no figure on both sides") + "</li>")
    if not items:
        return ""
    return f"<ul class=summary>{''.join(items)}</ul>"


def pairs_table(report: Comparison) -> str:
    """Every figure of every pair and condition, one row each: A, B, the change, the noise verdict in full."""
    def mb(n: int | None) -> str:
        return _g(n / 1e6, 3) if isinstance(n, (int, float)) else "—"

    rows = []
    for pair in report.pairs:
        names = f"{pair.model_a.name} → {pair.model_b.name}"
        size = pair.size
        for row in pair.rows:
            first = [names, pair.matched_by, _condition(row)]
            rows.append([*first, "file size MB", mb(size.a), mb(size.b),
                         f"{size.ratio - 1:+.1%}" if size.ratio else "—", "one file each: no noise"])
            for key, label, _ in FIGURES:
                m = row.metrics.get(key)
                if m is not None:
                    rows.append([*first, label, _g(m.a), _g(m.b), _change(m), m.verdict])
    if not rows:
        return ""
    return _table(["model A → B", "paired by", "condition", "figure", "A", "B", "change", "noise (Welch's t, 95 %)"],
                  rows)


def _job_part(job_id: int, job: JobRow, records: list[RunRecord], label: str) -> str:
    done = sum(r.status == "completed" for r in records)
    when = "".join(f" · {word} {_when(moment)}" for word, moment in (("created", job.created_at),
                                                                     ("finished", job.finished_at)) if moment)
    spec = spec_yaml(job.spec_json or "{}")
    targets = sorted({r.target for r in records})
    return (f"<h2 id=job{job_id}>{label}: job {job_id} · {_e(job.name or '')}</h2>"
            f"<p>status <b>{_e(job.status)}</b> · {len(records)} run(s), {done} completed · "
            f"{len({r.model.sha256 for r in records})} model(s) · on {_e(', '.join(targets) or '—')}{_e(when)}</p>"
            f"{_failures(records)}<div class=wrap>{results_section(average_repeats(records))}</div>"
            f"<details><summary>job {job_id} as submitted (YAML, {len(spec.splitlines())} lines)</summary>"
            f"<pre>{_e_lines(spec)}</pre></details>")


def build_compare_report(store: Store, job_a: int, job_b: int) -> tuple[str, list[Figure], list[str]]:
    """The before/after page of job_a → job_b, its figures (the Pareto view's, also written with --png) and the
    warnings shown at its top."""
    if job_a == job_b:
        raise ReportError(f"`farm report {job_a} {job_b}` compares two jobs; give two different ones (`farm report "
                          f"{job_a}` alone has its own variants, made by `farm quantize`, beside their sources).")
    jobs: dict[int, tuple[JobRow, list[RunRecord]]] = {}
    for job_id in (job_a, job_b):
        job = store.jobs.get(job_id)
        if job is None:
            raise ReportError(f"no job {job_id} in {store.location}; `farm jobs` lists the jobs there.")
        jobs[job_id] = (job, run_records(store, job_id))
    (info_a, records_a), (info_b, records_b) = jobs[job_a], jobs[job_b]
    report = compare_records(records_a, records_b, job_a=job_a, job_b=job_b, lineage_of=lineage_at_path)
    warnings = [f"job {job_id} has no completed run: it has nothing to compare; `farm status` and `farm results` "
                "say why." for job_id, (_, records) in jobs.items() if not any(r.status == "completed" for r in records)]
    if not report.pairs:
        warnings.append(f"jobs {job_a} and {job_b} share no model: none has the same name, none was made from the "
                        f"other's (`farm quantize` lineage), and they are not one model each. A: "
                        f"{', '.join(report.unmatched_a) or 'none'}; B: {', '.join(report.unmatched_b) or 'none'}")
    warnings += [f"{note}." for note in report.notes]
    figures: list[Figure] = []
    front = pareto_section(job_a, records_a, figures, more=[(job_b, records_b)])
    left = [f"A {', '.join(report.unmatched_a)}" if report.unmatched_a else "",
            f"B {', '.join(report.unmatched_b)}" if report.unmatched_b else ""]
    unpaired = "; ".join(x for x in left if x)
    toc = [("summary", "Summary"), ("table", "Before → after"), *([("pareto", "Accuracy and latency")] if front else []),
           (f"job{job_a}", f"Job {job_a}"), (f"job{job_b}", f"Job {job_b}")]
    title = f"farm report · job {job_a} → job {job_b}"
    page = f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title} · {_e(info_a.name or '')} → {_e(info_b.name or '')}</title><style>{STYLE}</style></head><body>
<h1>{title}</h1>
<p>before: job {job_a} · {_e(info_a.name or '')} ({len(records_a)} run(s)) · after: job {job_b} ·
 {_e(info_b.name or '')} ({len(records_b)} run(s)) · {len(report.pairs)} model pair(s)</p>
<nav>{' · '.join(f"<a href='#{a}'>{t}</a>" for a, t in toc)}</nav>
{''.join(f"<p class=warn>⚠ {_e(w)}</p>" for w in warnings)}
<h2 id=summary>Summary</h2>{summary_section(report) or '<p class=note>no model pair with completed runs under one condition</p>'}
<p class=note>B against A per model pair and run condition (target, unit, threads, batch, input size, budget). A
difference is inside the run-to-run noise when Welch's t over the repeats is under its 95 % critical value; with one
run on a side the noise is unknown (<code>repeats: 3</code> or more). {f'Not paired: {_e(unpaired)}.' if unpaired else ''}</p>
<h2 id=table>Before → after</h2><div class=wrap>{pairs_table(report) or '<p class=note>nothing to compare</p>'}</div>
{f'<h2 id=pareto>Accuracy and latency</h2><div class=wrap>{front}</div>' if front else ''}
{_job_part(job_a, info_a, records_a, "Before")}
{_job_part(job_b, info_b, records_b, "After")}
</body></html>"""
    return page, figures, warnings
