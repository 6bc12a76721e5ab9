"""`make bench`: does farm see contention, and are budgets shaped like a device? (issue 10)

1. Detection. The same benchmark run, side by side in interleaved rounds: on a quiet core,
   and on another core where a real CPU hog (a pinned busy loop, tests/cpu_hog.py) runs —
   once at farm's own CPU weight (an equal competitor, e.g. a second agent's sandbox) and
   once as a plain nice-0 process. Reported: the share of hogged runs farm flags (aim 100 %),
   quiet runs it flags (aim 0 %), and the latency error of every run it accepts against the
   quiet runs' median (aim <= 3 %), with the figures behind the thresholds.
2. Budget shape. farm / bare (the harness pinned to the same cores with taskset) at 1, 2
   and 4 threads, for a whole-core budget given as a cpuset (farm's default now) and as a
   CFS quota (farm's default before issue 10). Aim <= 1.02.

Prints markdown and writes benchmarks/results/<date>-contention-<backend>.{md,json}.
"""

from __future__ import annotations

import argparse
import hashlib
import datetime as dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "tests"))  # the tests' real hog, one definition of it

from cpu_hog import cpu_hog  # noqa: E402

from farm.agents.sim.driver import contention  # noqa: E402
from farm.agents.environment import host_facts  # noqa: E402
from farm.agents.harness.task import HarnessOutput, HarnessTask  # noqa: E402
from farm.agents.sandbox import choose_backend  # noqa: E402
from farm.agents.sandbox.base import Budget, MountSpec, format_cpuset  # noqa: E402
from farm.agents.sandbox.process import claim_cpu_weight  # noqa: E402
from farm.agents.sim.driver import SimDriver, SimSlot  # noqa: E402
from farm.agents.sim.telemetry import TelemetrySampler  # noqa: E402
from farm.model_generators.generate import generate_examples  # noqa: E402
from farm.proto.tasks import TaskPlan, TaskSpec  # noqa: E402


def _task(model: Path, iterations: int, backend: str, threads: int, sim: dict) -> TaskSpec:
    return TaskSpec(task_id=0, job_id=0, attempt=1, target="sim", model_name=model.stem, model_path=str(model),
                    model_sha256=hashlib.sha256(Path(model).read_bytes()).hexdigest(), model_family=None, threads=threads, batch_size=1, input_size=None, repeat=0,
                    plan=TaskPlan(workload={"type": "benchmark", "iterations": iterations, "warmup": 10, "input_shapes": {},
                              "use_xnnpack": True},
                    sim={"memory": 2 << 30, "backend": backend, "sample_interval_ms": 50.0, **sim},
                    run_timeout_s=600, base_dir=str(model.parent)))


def _pct(values: list[float], q: float) -> float:
    return round(statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1], 4) if len(values) > 1 else \
        round(values[0], 4)


def detection(model: Path, rounds: int, iterations: int, backend: str, quiet_core: int, hog_core: int) -> dict:
    runs: dict[str, list[dict]] = {"quiet": [], "hog at farm's weight": [], "hog at nice 0": []}
    with tempfile.TemporaryDirectory() as d:
        driver = SimDriver(Path(d))
        for _ in range(rounds):  # interleaved: the machine's drift hits every kind alike
            for kind in runs:
                core = quiet_core if kind == "quiet" else hog_core
                task = _task(model, iterations, backend, 1, {"cpus": 1.0, "cpuset": str(core)})
                if kind == "quiet":
                    r = driver.run(task, lambda: False)
                else:
                    with cpu_hog(core, weighted=kind == "hog at farm's weight"):
                        r = driver.run(task, lambda: False)
                assert r.ok, r.message
                c = r.contention
                runs[kind].append({"p50_ms": r.latency.p50, "contended": c.contended, "lost": c.lost_share,
                                   "others": c.others_cpu_share, "steal": c.steal_share,
                                   "host_pressure": c.host_pressure_share, "backend": r.backend})
    quiet_ok = [x["p50_ms"] for x in runs["quiet"] if not x["contended"]] or [x["p50_ms"] for x in runs["quiet"]]
    reference = statistics.median(quiet_ok)
    accepted = [x for kind in runs for x in runs[kind] if not x["contended"]]
    errors = [abs(x["p50_ms"] / reference - 1) * 100 for x in accepted]
    rows = []
    for kind, xs in runs.items():
        rows.append({"kind": kind, "runs": len(xs), "flagged_pct": round(100 * sum(x["contended"] for x in xs) / len(xs), 1),
                     "p50_ms_median": round(statistics.median(x["p50_ms"] for x in xs), 4),
                     "slowdown_vs_quiet": round(statistics.median(x["p50_ms"] for x in xs) / reference, 3),
                     "lost_min": min(x["lost"] for x in xs), "lost_median": round(statistics.median(x["lost"] for x in xs), 4),
                     "lost_max": max(x["lost"] for x in xs), "others_median": round(statistics.median(x["others"] for x in xs), 4),
                     "host_pressure_median": round(statistics.median(x["host_pressure"] or 0 for x in xs), 3)})
    return {"model": model.name, "backend": runs["quiet"][0]["backend"], "quiet_core": quiet_core, "hog_core": hog_core,
            "lost_max_threshold": contention.LOST_MAX, "reference_p50_ms": round(reference, 4), "rows": rows,
            "accepted": len(accepted), "accepted_error_pct_mean": round(statistics.mean(errors), 2) if errors else None,
            "accepted_error_pct_max": round(max(errors), 2) if errors else None, "runs": runs}


def _bare(model: Path, iterations: int, threads: int, cores: list[int], work: Path) -> tuple[float, bool]:
    """The harness alone under taskset, at the priority farm's sandboxes get (nice -20 where allowed, as
    the process backend), judged for contention like a farm run. Returns (p50 ms, contended)."""
    task_file, out_file = work / "bare-task.json", work / "bare-out.json"
    HarnessTask(kind="benchmark", model_path=str(model), threads=threads, iterations=iterations, warmup=10).write(task_file)
    before, used0 = contention.snapshot(cores), resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(["taskset", "-c", format_cpuset(cores), sys.executable, "-m", "farm.agents.harness", str(task_file),
                    str(out_file)], check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                   preexec_fn=claim_cpu_weight)
    after, used1 = contention.snapshot(cores), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (used1.ru_utime + used1.ru_stime) - (used0.ru_utime + used0.ru_stime)
    verdict = contention.judge(before, after, run_cpu_s=cpu_s, budget_cpus=float(len(cores)), demand_cpus=float(threads))
    return statistics.median(HarnessOutput.read(out_file).iterations_ms), verdict.contended


def _quota_shaped(model: Path, iterations: int, threads: int, backend_name: str, work: Path) -> float:
    """farm's budget before issue 10: `threads` cores as a CFS quota over every core, no cpuset."""
    backend = choose_backend(backend_name)
    task_file, out_file = work / "quota-task.json", work / "quota-out.json"
    HarnessTask(kind="benchmark", model_path=str(model), threads=threads, iterations=iterations, warmup=10).write(task_file)
    sandbox = backend.start([sys.executable, "-m", "farm.agents.harness", str(task_file), str(out_file)],
                            Budget(cpus=float(threads), memory_bytes=2 << 30),
                            env={"PATH": os.environ["PATH"], "OMP_NUM_THREADS": str(threads), "LANG": "C.UTF-8"},
                            cwd=work, mounts=[MountSpec(work, read_only=False), MountSpec(model)])
    sampler = TelemetrySampler(sandbox, 50).start()
    sandbox.wait(600)
    sampler.stop()
    sandbox.close()
    return statistics.median(HarnessOutput.read(out_file).iterations_ms)


def budget_shape(model: Path, rounds: int, iterations: int, backend: str) -> list[dict]:
    cores = sorted(os.sched_getaffinity(0))
    rows = []
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        os.chmod(work, 0o777)  # a container's user writes its result here
        driver = SimDriver(work)
        for threads in (1, 2, 4):
            used = cores[:min(threads, len(cores))]
            farm_ms, quota_ms, bare_ms, bare_all_ms, flagged, bare_flagged = [], [], [], [], 0, 0
            for _ in range(rounds):
                r = driver.run(_task(model, iterations, backend, threads, {"cpuset": format_cpuset(used)}),
                               SimSlot(0), lambda: False)
                assert r.ok, r.message
                flagged += r.contention.contended
                farm_ms.append(r.latency.p50)
                ms, spoiled = _bare(model, iterations, threads, used, work)
                bare_ms.append(ms)
                quota_ms.append(_quota_shaped(model, iterations, threads, backend, work))
                ms, spoiled_all = _bare(model, iterations, threads, cores, work)
                bare_all_ms.append(ms)
                bare_flagged += spoiled + spoiled_all
            rows.append({"threads": threads, "cores": format_cpuset(used), "backend": r.backend,
                         "limits": f"{r.limits.cpus:g} cpu @{r.limits.cpuset}",
                         "farm_p50_ms": round(statistics.median(farm_ms), 4),
                         "bare_p50_ms": round(statistics.median(bare_ms), 4),
                         "cpuset_ratio": round(statistics.median(farm_ms) / statistics.median(bare_ms), 4),
                         "quota_p50_ms": round(statistics.median(quota_ms), 4),
                         "bare_all_cores_p50_ms": round(statistics.median(bare_all_ms), 4),
                         "quota_ratio": round(statistics.median(quota_ms) / statistics.median(bare_all_ms), 4),
                         "farm_runs_flagged": flagged, "bare_runs_flagged": bare_flagged})
    return rows


def markdown(report: dict) -> str:
    m, det = report["machine"], report["detection"]
    lines = [f"### {report['date']} {report['time']} UTC — {m['cpu_model']}, {m['cpu_count']} cores, kernel {m['kernel']}, "
             f"load average at start {report['load_before']}", "",
             f"**Detection** ({det['backend']} backend, {det['model']}, 1 thread, 1 core; quiet core {det['quiet_core']}, "
             f"hog core {det['hog_core']}; verdict threshold: lost share > {det['lost_max_threshold']})", "",
             "| runs | n | flagged % | p50 ms (median) | vs quiet | lost share min / median / max | others' share (median) "
             "| host PSI some (median) |", "|---|---|---|---|---|---|---|---|"]
    for r in det["rows"]:
        lines.append(f"| {r['kind']} | {r['runs']} | {r['flagged_pct']} | {r['p50_ms_median']} | {r['slowdown_vs_quiet']} | "
                     f"{r['lost_min']} / {r['lost_median']} / {r['lost_max']} | {r['others_median']} | "
                     f"{r['host_pressure_median']} |")
    lines += ["", f"Runs farm accepts (not flagged): {det['accepted']}; their p50 against the quiet runs' median "
              f"({det['reference_p50_ms']} ms): mean error {det['accepted_error_pct_mean']} %, "
              f"worst {det['accepted_error_pct_max']} %.", "",
              "**Budget shape** (farm / bare, median p50 of each side; bare = the harness under taskset on the same cores)", "",
              "| threads | farm limits | farm p50 ms | bare p50 ms | cpuset shape: farm / bare | quota shape p50 ms "
              "| bare on all cores | quota shape / bare | contended: farm / bare runs |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["budget_shape"]:
        lines.append(f"| {r['threads']} | {r['limits']} | {r['farm_p50_ms']} | {r['bare_p50_ms']} | {r['cpuset_ratio']} | "
                     f"{r['quota_p50_ms']} | {r['bare_all_cores_p50_ms']} | {r['quota_ratio']} | "
                     f"{r['farm_runs_flagged']} / {r['bare_runs_flagged']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="cgroup")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--shape-rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=100)
    args = p.parse_args()
    models_dir = ROOT.parent / "examples" / "models"
    generated = generate_examples(models_dir, widths=[1.0], input_sizes=[224], zoo=False)
    model = next(m.path for m in generated if m.path.name == "mobilenetv2_w1.0_r224.tflite")
    cores = sorted(os.sched_getaffinity(0))
    now = dt.datetime.now(dt.timezone.utc)
    report = {"date": now.date().isoformat(), "time": now.strftime("%H:%M"),
              "machine": {**host_facts(), "platform": platform.platform()},
              "load_before": [round(x, 2) for x in os.getloadavg()],
              "detection": detection(model, args.rounds, args.iterations, args.backend, cores[0], cores[-1]),
              "budget_shape": budget_shape(model, args.shape_rounds, args.iterations, args.backend)}
    text = markdown(report)
    print(text)
    out = ROOT / "results"
    out.mkdir(exist_ok=True)
    stem = f"{report['date']}-contention-{report['detection']['backend']}"
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
