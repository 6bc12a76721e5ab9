"""`make bench`: the real-model corpus (tests/corpus_models.json, wheels from PyPI) through farm.

Per file: does farm run it (and does the bare runtime), parameters and MACs as `farm inspect` counts
them, and farm's p50 over the bare runtime's at 1 and 2 threads. Each figure is interleaved — bare, farm,
bare on the same cores, the bare loop in a sandbox of its own with the same budget — and the ratio is
farm's p50 over the mean of the two bare ones. Prints a markdown table (with the geometric mean and the
worst ratio per thread count, and the share of runnable models farm runs) and writes results/<date>-corpus.*.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "tests"))  # the corpus list and its bare-runtime helpers live with the tests

from farm.agents.environment import host_facts  # noqa: E402
from farm.agents.sim.driver import SimDriver  # noqa: E402
from farm.cli.inspect_commands import inspect_report  # noqa: E402
from farm.controller.scheduling.jobfile import JobFileError, load_job_text  # noqa: E402
from farm.proto.tasks import TaskPlan, TaskSpec  # noqa: E402
from real_corpus import CorpusModel, bare_load_error, bare_p50_ms_sandboxed, fetch_corpus  # noqa: E402
from results_file import write_results  # noqa: E402


def _task(model: CorpusModel, threads: int, cpuset: str, iterations: int) -> TaskSpec:
    assert model.file is not None
    return TaskSpec(task_id=0, job_id=0, attempt=1, target="sim", model_name=model.name, model_path=str(model.file),
                    model_sha256=hashlib.sha256(model.file.read_bytes()).hexdigest(), model_family=None,
                    threads=threads, batch_size=1, input_size=None, repeat=0,
                    plan=TaskPlan(workload={"type": "benchmark", "iterations": iterations, "warmup": 5,
                              "input_shapes": model.shapes, "use_xnnpack": True},
                    sim={"cpus": float(threads), "cpuset": cpuset, "memory": 2 << 30, "sample_interval_ms": 50.0},
                    run_timeout_s=600, base_dir=str(model.file.parent)))


def _farm_refusal(model: CorpusModel) -> str | None:
    shapes = "".join(f"    {name!r}: {shape}\n" for name, shape in model.shapes.items())
    text = f"models: [{model.file}]\nworkload:\n  type: benchmark\n" + (f"  input_shapes:\n{shapes}" if shapes else "")
    try:
        load_job_text(text, "job.yaml", Path(tempfile.gettempdir()))
    except JobFileError as e:
        return str(e)
    return None


def measure(iterations: int, thread_counts: list[int]) -> list[dict]:
    cores = sorted(os.sched_getaffinity(0))
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        driver = SimDriver(Path(folder))
        for model in fetch_corpus():
            assert model.file is not None
            report = inspect_report(model.file, model.shapes)
            bare_error, farm_error = bare_load_error(model.file), _farm_refusal(model)
            row = {"model": Path(model.path).name, "package": model.package, "exporter": model.exporter,
                   "bare_runs": bare_error is None, "farm_runs": farm_error is None,
                   "params": report["param_count"], "macs": report["macs"]}
            for threads in thread_counts:
                if farm_error is not None or threads > len(cores):
                    continue
                cpuset = ",".join(str(c) for c in cores[-threads:])
                before = bare_p50_ms_sandboxed(model.file, model.shapes, threads=threads, iterations=iterations,
                                               warmup=5, cpuset=cpuset)
                result = driver.run(_task(model, threads, cpuset, iterations), lambda: False)
                after = bare_p50_ms_sandboxed(model.file, model.shapes, threads=threads, iterations=iterations,
                                              warmup=5, cpuset=cpuset)
                if not result.ok or result.latency is None:
                    row[f"error_t{threads}"] = result.message[:200]
                    continue
                bare = statistics.mean([before, after])
                row[f"farm_p50_ms_t{threads}"] = round(result.latency.p50, 4)
                row[f"bare_p50_ms_t{threads}"] = round(bare, 4)
                row[f"ratio_t{threads}"] = round(result.latency.p50 / bare, 4)
                row[f"contended_t{threads}"] = bool(result.contention and result.contention.contended)
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    return rows


def _si(n: int | None) -> str:
    if n is None:
        return "?"
    for factor, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= factor:
            return f"{n / factor:.3g}{prefix}"
    return str(n)


def markdown(rows: list[dict], thread_counts: list[int], machine: dict, iterations: int) -> str:
    lines = [f"### Real-model corpus — {machine['date']}, {machine['cpu_model']}, {machine['cpu_count']} cores, "
             f"load average {machine['load_before']} before; {iterations} iterations per figure", ""]
    header = "| model | package | exporter | runs (farm / bare) | params | MACs | " + " | ".join(
        f"farm/bare {t} thr" for t in thread_counts) + " |"
    lines += [header, "|" + "---|" * (6 + len(thread_counts))]
    for row in rows:
        ratios = [f"{row[f'ratio_t{t}']:.3f}" + (" (c)" if row.get(f"contended_t{t}") else "")
                  if f"ratio_t{t}" in row else "—" for t in thread_counts]
        runs = f"{'yes' if row['farm_runs'] else 'no'} / {'yes' if row['bare_runs'] else 'no'}"
        lines.append(f"| {row['model']} | {row['package']} | {row['exporter']} | {runs} | {_si(row['params'])} | "
                     f"{_si(row['macs'])} | " + " | ".join(ratios) + " |")
    lines.append("")
    for t in thread_counts:
        ratios = [row[f"ratio_t{t}"] for row in rows if f"ratio_t{t}" in row]
        if ratios:
            geomean = math.exp(statistics.mean(math.log(r) for r in ratios))
            worst = max(ratios, key=lambda r: abs(math.log(r)))
            lines.append(f"- {t} thread(s): farm/bare geometric mean **{geomean:.3f}**, worst {worst:.3f} "
                         f"({len(ratios)} models; (c) = farm flagged the run as contended)")
    runnable = [row for row in rows if row["bare_runs"]]
    share = sum(row["farm_runs"] for row in runnable) / len(runnable) if runnable else 0.0
    lines.append(f"- farm runs {sum(row['farm_runs'] for row in runnable)} of the {len(runnable)} files the bare runtime "
                 f"loads ({share:.0%}); it refuses {sum(not row['farm_runs'] for row in rows)}, each one the runtime "
                 "cannot load either")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    facts = host_facts()
    machine = {"date": str(__import__("datetime").date.today()), "cpu_model": facts.get("cpu_model") or platform.processor(),
               "cpu_count": os.cpu_count(), "load_before": round(os.getloadavg()[0], 1)}
    rows = measure(args.iterations, args.threads)
    text = markdown(rows, args.threads, machine, args.iterations)
    print(text)
    print(write_results("corpus", text, {"machine": machine, "rows": rows}), file=sys.stderr)


if __name__ == "__main__":
    main()
