"""Accuracy against latency (issue 30 item 4): the Pareto view's rules on plain run records — which figure a setting
is judged by, which models are dominated and by what, what a failed-as-accuracy run and a job without a dataset
give. The view through the CLI, the report and the dashboard on real runs is in tests/test_dataset.py."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from run_records import run_record

from farm.controller.analysis.pareto import ParetoPoint, csv_rows, dominates, pareto
from farm.proto.questions import RunRecord


def _run(model: str, latency: float | None, *, top1: float | None = None, agree: float | None = None,
         cosine: float | None = None, threads: int = 1, status: str = "completed", failure: str | None = None,
         contended: bool = False) -> RunRecord:
    accuracy: dict[str, Any] = {}
    if top1 is not None:
        accuracy["accuracy"] = {"top1": top1, "top5": min(1.0, top1 + 0.1)}
    if agree is not None or cosine is not None:
        accuracy["agreement"] = {k: v for k, v in (("top1", agree), ("cosine", cosine)) if v is not None}
    return run_record(model={"name": model, "sha256": model * 4}, target="sim", accelerator="cpu", threads=threads,
                      batch_size=1, input_size=96, limits={"cpus": 1.0, "memory_mb": 1024}, status=status,
                      failure_class=failure, contention={"contended": contended},
                      latency_ms={"avg": latency} if latency is not None else None, accuracy=accuracy or None)


def _point(latency: float, quality: float) -> ParetoPoint:
    return ParetoPoint(job=1, model="m", sha256="", latency_avg_ms=latency, runs=1, contended=0, figures={},
                       label="m", quality=quality, dominated_by=[], on_front=True)


def test_the_front_and_the_dominated_models_named_with_what_dominates_them() -> None:
    records = [_run("float", 10.0, top1=0.80), _run("float", 12.0, top1=0.80),  # mean 11 ms
               _run("int8", 4.0, top1=0.78), _run("int8", 4.0, top1=0.78),
               _run("pruned", 6.0, top1=0.70),  # slower and less accurate than int8: dominated
               _run("tie", 4.0, top1=0.78)]  # equal to int8 in both: neither dominates the other
    (group,) = pareto([(1, records)]).groups
    assert group.quality_metric == "accuracy_top1" and group.threads == 1
    points = {p.model: p for p in group.points}
    assert points["float"].latency_avg_ms == 11.0 and points["float"].runs == 2
    assert points["float"].on_front and points["int8"].on_front and points["tie"].on_front
    assert not points["pruned"].on_front and sorted(points["pruned"].dominated_by) == ["int8", "tie"]
    assert [p.model for p in group.points][0] in ("int8", "tie")  # sorted by latency
    assert dominates(_point(1, 0.5), _point(1, 0.4))
    assert not dominates(_point(1, 0.5), _point(1, 0.5))

    rows = csv_rows(pareto([(1, records)]))
    assert {r.model: (r.on_front, r.dominated_by) for r in rows}["pruned"] == (False, "int8; tie")


def test_the_figure_is_accuracy_else_agreement_else_cosine_per_setting() -> None:
    records = [_run("a", 5.0, agree=1.0, cosine=1.0), _run("b", 3.0, agree=0.9, cosine=0.99),
               _run("a", 3.0, cosine=1.0, threads=2), _run("b", 2.0, cosine=0.98, threads=2),
               _run("c", 2.5, threads=2)]  # no dataset figure: listed as such, not placed
    one, two = pareto([(4, records)]).groups
    assert (one.threads, one.quality_metric) == (1, "agreement_top1")
    assert (two.threads, two.quality_metric) == (2, "agreement_cosine") and two.without_quality == ["c"]
    assert all(p.on_front for p in one.points + two.points)


def test_an_accuracy_failure_counts_and_contended_runs_only_without_clean_ones() -> None:
    records = [_run("float", 10.0, top1=0.8),
               # outputs beyond the user's threshold: failed as accuracy, its figures are why, it still counts
               _run("int8", 3.0, top1=0.3, status="failed", failure="accuracy"),
               _run("int8", 3.0, top1=0.3),
               # a contended run is left out where the cell has a clean one
               _run("float", 100.0, top1=0.8, contended=True),
               _run("crashed", None, status="failed", failure="runtime")]
    view = pareto([(2, records)])
    (group,) = view.groups
    points = {p.model: p for p in group.points}
    assert set(points) == {"float", "int8"}  # a run with no latency places nothing
    assert points["float"].latency_avg_ms == 10.0 and points["int8"].runs == 2
    assert points["float"].contended == 0 and not view.notes
    only_contended = pareto([(2, [_run("late", 7.0, top1=0.5, contended=True)])])
    assert only_contended.groups[0].points[0].contended == 1 and "contended" in only_contended.notes[0]
    assert points["float"].on_front and points["int8"].on_front


def test_two_jobs_label_their_models_and_a_job_without_a_dataset_has_no_front() -> None:
    before = [_run("net", 10.0, top1=0.8)]
    after = [_run("net", 4.0, top1=0.8)]
    (group,) = pareto([(1, before), (2, after)]).groups
    points = {p.label: p for p in group.points}
    assert set(points) == {"net (job 1)", "net (job 2)"}
    assert points["net (job 1)"].dominated_by == ["net (job 2)"]
    plain = pareto([(3, [_run("x", 1.0), _run("y", 2.0)])])
    assert plain.groups == [] and "workload.dataset" in plain.notes[0]


def test_hostile_model_names_stay_text_in_the_report_the_dashboard_and_the_csv() -> None:
    """Model names come from job files: markup stays text on both pages, a formula stays text in a spreadsheet."""
    import csv
    import io

    from farm.controller.analysis.export import rows_csv
    from farm.controller.analysis.report import pareto_section
    from farm.web.pages import pareto_part
    from farm.web.views import pareto_charts

    evil, formula = "<script>alert(1)</script>", "=HYPERLINK(\"http://x\")"
    records = [_run(evil, 2.0, top1=0.5), _run(formula, 1.0, top1=0.9)]  # the formula dominates the script
    figures: list = []
    html = pareto_section(7, records, figures)
    assert "<script>" not in html and "&lt;script&gt;" in html and "dominated by =HYPERLINK" in html.replace(
        "&quot;", '"')
    assert len(figures) == 1 and figures[0].png.startswith(b"\x89PNG")
    page = pareto_part(pareto_charts(7, records))
    assert "<script>" not in page and "&lt;script&gt;" in page and "<svg" in page
    rows = list(csv.DictReader(io.StringIO(rows_csv([asdict(r) for r in csv_rows(pareto([(7, records)]))]))))
    assert {r["model"] for r in rows} == {evil, "'" + formula}
