"""The renderers read run records as models (issue 35 item 2): what they print must not move by a byte.

Two jobs' records (sim runs with repeats, one contended, device twins, a failed run, a run failed as `accuracy`,
a quantized variant, GPU figures, predictions, an op profile, a script's whole-run time) go through every
renderer of the run-record flow: `farm results` (JSON, CSV, the tables), `--pairs`, `farm compare` (JSON, CSV,
table), `--pareto` (JSON, CSV, tables), the report's sections and the dashboard's tables. The expected files in
tests/fixtures/record_renderers were written by the same calls on the code before the renderers took models
(commit 02fe1eb, which read each record's dict form), so any change in what a person or a script reads fails here.
`python tests/test_record_renderers.py --write` rewrites them (only for a deliberate change of an output).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from run_records import run_record

EXPECTED = Path(__file__).resolve().parent / "fixtures" / "record_renderers"
LINEAGE = {"source": {"sha256": "a" * 64, "path": "net.onnx"}, "method": "dynamic"}  # net-int8 was made from net


def _sim(job: int, task: int, name: str, sha: str, latency: float, *, repeat: int = 0, threads: int = 1,
         **more: Any) -> Any:
    lat = {"init": 20.0 + latency, "first": 2 * latency, "avg": latency, "p50": latency * 0.99, "p90": latency * 1.1,
           "p99": latency * 1.2, "std": latency / 50, "min": latency * 0.9, "max": latency * 1.3, "warmup_avg": latency,
           "count": 50}
    fields: dict[str, Any] = {
        "job": job, "task": task, "model": {"name": name, "sha256": sha, "family": "fam", "path": None,
                                            "size_bytes": 4_000_000 if name == "net" else 1_000_000,
                                            "param_count": 3_500_000, "macs": 300_000_000, "op_count": 60},
        "threads": threads, "cpus": float(threads), "repeat": repeat, "pair_key": f"{name}-{threads}-{repeat}",
        "latency_ms": lat, "throughput_per_s": round(1000 / latency, 3), "samples_per_s": round(1000 / latency, 3),
        "startup_ms": 20.0 + 3 * latency, "peak_memory_mb": 40.0 + latency, "avg_memory_mb": 30.0 + latency,
        "peak_memory_source": "cgroup", "cpu_percent": {"avg": 95.5 + repeat, "peak": 101.0 + repeat},
        "wall_s": 1.25 + repeat, "backend": "cgroup", "approximate": False,
        "limits": {"cpus": float(threads), "cpuset": "0", "memory_mb": 1024.0}, "run": task * 10, "runtime": "onnxruntime",
        "tool_versions": {"onnxruntime": "1.17"}}
    fields.update(more)
    return run_record(**fields)


def _device(sim: Any, latency: float, **more: Any) -> Any:
    return run_record(**{**sim.model_dump(exclude_unset=False), "task": sim.task + 100, "target": "phone-1",
                         "cpus": None, "limits": {"cpus": None, "cpuset": None, "memory_mb": None},
                         "latency_ms": {**sim.latency_ms.model_dump(), "avg": latency, "std": latency / 30},
                         "energy_per_inference_mj": 12.5, "backend": None, "runtime": "onnxruntime@arch=aarch64",
                         "run": sim.run + 100, **more})


def _records() -> tuple[list[Any], list[Any]]:
    """Job 1 (before) and job 2 (after)."""
    acc = {"accuracy": {"top1": 0.8, "top5": 0.95}, "agreement": {"top1": 1.0, "cosine": 1.0, "max_abs_error": 0.0}}
    low = {"accuracy": {"top1": 0.78, "top5": 0.93}, "agreement": {"top1": 0.97, "cosine": 0.999, "max_abs_error": 0.02}}
    one = [_sim(1, 1 + r, "net", "a" * 64, v, repeat=r, accuracy=acc) for r, v in enumerate((10.0, 10.4, 9.8))]
    one += [_device(s, v) for s, v in zip(one[:3], (35.0, 36.5, 34.25))]
    one += [_sim(1, 4, "net-int8", "b" * 64, 4.0, accuracy=low),
            _sim(1, 5, "net-int8", "b" * 64, 4.5, repeat=1, accuracy=low,
                 contention={"contended": True, "why": "steal 30 %"}),
            _sim(1, 6, "net", "a" * 64, 6.0, threads=2, accuracy=acc,
                 gpu={"power_avg_w": 50.5, "power_peak_w": 70.0, "memory_peak_mib": 1234},
                 predictions={"phone-1": {"latency": {"estimate": 21.0, "low": 18.5, "high": 23.5, "version": 2,
                                                      "same_sim_budget": True}}},
                 op_profile=[{"kind": "op_type", "node_type": "Conv", "name": None, "avg_ms": 3.5, "percent": 61.2,
                              "first_ms": None, "count": 12, "times_called": 600, "mem_kb": None},
                             {"kind": "node", "node_type": "Conv", "name": "conv_1", "avg_ms": 0.75, "percent": 12.5,
                              "first_ms": 1.5, "count": None, "times_called": 50, "mem_kb": None}],
                 op_profile_note="the 2 slowest nodes kept"),
            run_record(job=1, task=7, model={"name": "broken", "sha256": "d" * 64}, status="failed", attempts=2,
                       failure_class="runtime", message="boom: the model did not load\nline two", run=70),
            _sim(1, 8, "acc-fail", "c" * 64, 3.0, status="failed", failure_class="accuracy",
                 message="top-1 0.30 < 0.75", accuracy={"accuracy": {"top1": 0.3, "top5": 0.5}}),
            _sim(1, 9, "script", "e" * 64, 2.0, batch_size=4, input_size=160, accelerator="cuda", latency_ms=None,
                 whole_run_s=12.125, samples_per_s=None, throughput_per_s=None)]
    two = [_sim(2, 11 + r, "net", "a" * 64, v, repeat=r, accuracy=acc) for r, v in enumerate((8.0, 8.1, 8.25))]
    two += [_device(s, v) for s, v in zip(two, (30.0, 29.5, 31.0))]
    two += [_sim(2, 14 + r, "net-int8", "b" * 64, v, repeat=r, accuracy=low) for r, v in enumerate((3.9, 4.1))]
    two += [_sim(2, 16, "new-model", "f" * 64, 7.0)]
    return one, two


def _lineage(model: Any) -> dict[str, Any] | None:
    return LINEAGE if model.name == "net-int8" else None


def _text(renderable: Any) -> str:
    from rich.console import Console

    console = Console(width=200, record=True, color_system=None, file=open("/dev/null", "w"))
    console.print(renderable)
    return console.export_text()


def _outputs() -> dict[str, Callable[[], str]]:
    """Every output of the run-record flow, by the file its expected text is kept in."""
    from dataclasses import asdict

    from farm.cli.compare_commands import compare_table, pareto_table
    from farm.cli.op_profile_view import op_profile_tables
    from farm.cli.render import failures, pairs_table, results_table
    from farm.controller.analysis import compare_report, report
    from farm.controller.analysis.compare import compare_records, flat_rows, variant_rows
    from farm.controller.analysis.export import results_csv, rows_csv, to_json
    from farm.controller.analysis.pareto import csv_rows, pareto
    from farm.controller.analysis.results import average_repeats, paired_records
    from farm.web import pages, views

    one, two = _records()
    both = one + two
    comparison = compare_records(one, two, job_a=1, job_b=2, lineage_of=_lineage)
    within = compare_records(one, one, job_a=1, job_b=1, lineage_of=_lineage)
    front = pareto([(1, one), (2, two)])
    return {
        "results.json": lambda: to_json([r.model_dump() for r in both]),
        "results.csv": lambda: results_csv(both),
        "results-table.txt": lambda: _text(results_table(one, title="job 1")),
        "results-runs-wide.txt": lambda: _text(results_table(both, title="jobs", wide=True, runs=True)),
        "failures.txt": lambda: "\n".join(failures(both)),
        "ops.txt": lambda: _text(op_profile_tables(one)),
        "pairs.json": lambda: to_json([p.model_dump() for p in paired_records(both)]),
        "pairs.txt": lambda: _text(pairs_table(paired_records(both), title="pairs", wide=True)),
        "compare.json": lambda: to_json(comparison.model_dump()),
        "compare-within.json": lambda: to_json(within.model_dump()),
        "compare.csv": lambda: rows_csv(flat_rows(comparison)),
        "compare.txt": lambda: _text(compare_table(comparison)),
        "pareto.json": lambda: to_json(front.model_dump()),
        "pareto.csv": lambda: rows_csv([asdict(r) for r in csv_rows(front)]),
        "pareto.txt": lambda: "".join(_text(t) for t in pareto_table(front)),
        "report-results.html": lambda: report.results_section(average_repeats(both)),
        "report-failures.html": lambda: report._failures(both),
        "report-facts.html": lambda: report.facts_section(both),
        "report-variants.html": lambda: "".join(
            f"{v.source}|{v.variant}|{v.method}|{v.latency_a}|{v.latency_b}|{v.latency_change}|{v.verdict}|"
            f"{v.memory_a}|{v.memory_b}|{v.sides('accuracy_top1')}|{v.sides('energy_per_inference_mj')}\n"
            for v in variant_rows(1, one, _lineage)),
        "compare-report.html": lambda: (compare_report.summary_section(comparison)
                                        + compare_report.pairs_table(comparison)),
        "page-pairs.html": lambda: pages.pairs_table(paired_records(both)),
        "page-predictions.html": lambda: pages.predictions_table([r for r in both if r.predictions]),
        "page-variants.html": lambda: pages.variants_table(variant_rows(1, one, _lineage)),
        "page-averages.html": lambda: pages.averages_table(views.averages(both)),
        "page-failures.html": lambda: "".join(
            pages.failure_section(f, f"failure-{f.task}") for f in views.failures(both, {70: "last line\n"})),
    }


def test_every_renderer_prints_what_it_printed_from_the_dict_records() -> None:
    outputs = _outputs()
    expected = sorted(p.name for p in EXPECTED.iterdir())
    assert sorted(outputs) == expected, "an output without its expected file, or the other way round"
    # bytes: a CSV's lines end in CRLF, as the csv module writes them
    moved = [file for file, render in outputs.items() if render().encode() != (EXPECTED / file).read_bytes()]
    assert not moved, f"these outputs differ from the dict-reading code's: {moved}"


if __name__ == "__main__" and "--write" in sys.argv:
    EXPECTED.mkdir(parents=True, exist_ok=True)
    for file, render in _outputs().items():
        (EXPECTED / file).write_bytes(render().encode())
