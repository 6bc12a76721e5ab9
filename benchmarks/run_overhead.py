"""`make bench-run-overhead`: what farm costs per run beyond the model's own time, cold harness vs warm.

Embedded, as `farm submit` runs a job (each job in a fresh interpreter): a job of N runs of a tiny model (10 iterations, 1 warmup;
on_contention: flag, so a busy host retries none) is submitted to a fresh store and run in this process by
EmbeddedFarm.wait; the two modes — FARM_WARM_HARNESS=0 (a fresh interpreter per run) and the warm harness
(forked from a kept one), and with --base the code before this work — alternate round by round, side by side.

Per run: the cycle from one run's start to the next one's record ((last finished_at − first started_at) / N,
each cycle holding lease, set-up, checks, the run and recording it), minus the model's own time (init, first,
warmup and timed inferences as the harness measured them). Also: submit → first run started, and the memory
figures both modes report (the kernel's peak for the run, the harness's VmHWM), so the accounting can be compared.

Prints a markdown report and writes it to benchmarks/results/<date>-run-overhead.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from farm.client.embedded import EmbeddedFarm
from farm.model_generators.generate import write_tiny_onnx, write_tiny_tflite
from results_file import write_results  # benchmarks/ is on sys.path when a benchmark runs

MODES = {"cold": "0", "warm": "1"}
WARMUP = 1


def one_job(folder: Path, model: Path, runs: int, backend: str, mode: str) -> dict:
    db = folder / f"{mode}-{time.monotonic_ns()}.db"
    job_file = folder / "job.yaml"
    job_file.write_text(f"models: [{model}]\nworkload: {{type: benchmark, iterations: 10, warmup: {WARMUP}}}\n"
                        f"matrix: {{threads: [1]}}\nrepeats: {runs}\ntargets: [sim]\nsim: {{backend: {backend}, memory: 512m, on_contention: flag}}\n")
    farm = EmbeddedFarm(db, create=True, health_check_max_age_h=0)
    submitted = time.time()
    job = farm.submit(job_file).job
    farm.wait(job)
    rows = farm.store.runs.results(job)  # the results with when each run started and was recorded
    farm.close()
    ok = [r for r in rows if r.run_status == "completed"]
    if len(ok) != runs:
        failed = [r.message for r in rows if r.run_status != "completed"]
        raise SystemExit(f"{mode}: {len(ok)} of {runs} runs completed: {failed[:2]}")
    started = [r.started_at for r in ok]
    finished = [r.finished_at for r in ok]
    own_s = [((r.latency_init_ms or 0) + (r.latency_first_ms or 0) + (r.latency_warmup_avg_ms or 0) * WARMUP
              + (r.latency_avg_ms or 0) * (r.latency_count or 0)) / 1000 for r in ok]
    cycle = (max(finished) - min(started)) / len(ok)
    harness = {json.loads(r.environment_json or "{}").get("harness", "?") for r in ok}
    return {"cycle_s": cycle, "own_s": statistics.mean(own_s), "overhead_s": cycle - statistics.mean(own_s),
            "first_start_s": min(started) - submitted,
            "init_ms": statistics.median(r.latency_init_ms for r in ok),
            "p50_ms": statistics.median(r.latency_p50_ms for r in ok),
            "peak_mib": statistics.median(r.peak_memory_bytes or 0 for r in ok) / (1 << 20),
            "vmhwm_mib": statistics.median(r.peak_rss_bytes or 0 for r in ok) / (1 << 20),
            "harness": sorted(harness)}


def cli_startup(calls: int) -> dict:
    """`farm --version` and `farm jobs` wall times, fresh interpreters (the aims: 0.25 s and 0.4 s)."""
    farm = [sys.executable, "-m", "farm.cli.main"]
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for name, argv in (("farm --version", ["--version"]), ("farm jobs", ["jobs", "--db", f"{d}/x.db", "--create"])):
            spent = []
            for _ in range(calls):
                t = time.perf_counter()
                subprocess.run([*farm, *argv], capture_output=True, check=True)
                spent.append(time.perf_counter() - t)
            if spent:
                out[name] = round(statistics.median(spent), 3)
    return out


def job_in_a_process(folder: Path, model: Path, runs: int, backend: str, mode: str, base: str | None) -> dict:
    """One job in a fresh interpreter, as `farm submit` runs it: `base` mode with the code in --base (the commit
    before the warm harness), the others with this checkout's."""
    env = {**os.environ, "FARM_WARM_HARNESS": MODES.get(mode, "0")}
    if mode == "base":
        env["PYTHONPATH"] = str(base)
    done = subprocess.run([sys.executable, __file__, "--job", mode, str(model), str(runs), backend, str(folder)],
                          capture_output=True, text=True, env=env, cwd=folder, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{mode} job failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--job":  # one job, in this process: what job_in_a_process starts
        mode, model, runs, backend, folder = sys.argv[2:7]
        print(json.dumps(one_job(Path(folder), Path(model), int(runs), backend, mode)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per job")
    parser.add_argument("--rounds", type=int, default=3, help="jobs of each mode, alternating, per model")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--models", default="onnx,tflite", help="which tiny models: onnx, tflite or both")
    parser.add_argument("--base", help="a tree of farm before the warm harness (a `farm` package folder's parent): "
                                       "its jobs run side by side as mode `base`")
    parser.add_argument("--cli-calls", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print only (the smoke run)")
    args = parser.parse_args()
    modes = (["base"] if args.base else []) + list(MODES)
    rows: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        writers = {"onnx": write_tiny_onnx, "tflite": write_tiny_tflite}
        models = {name: writers[name](folder / f"tiny.{name}") for name in args.models.split(",")}
        for name, model in models.items():
            rows[name] = {mode: [] for mode in modes}
            for _ in range(args.rounds):
                for mode in modes:
                    rows[name][mode].append(job_in_a_process(folder, model, args.runs, args.backend, mode, args.base))
    cli = cli_startup(args.cli_calls)
    load = os.getloadavg()
    lines = [f"# per-run overhead, embedded ({args.runs} runs a job, {args.rounds} rounds, backend {args.backend}; "
             f"{platform.node()}, {os.cpu_count()} cores, load {load[0]:.1f})\n",
             "| model | mode | per-run overhead s | cycle s | model's own s | submit → first run s | peak MiB (kernel) "
             "| harness VmHWM MiB | init ms | p50 ms | how it started |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    figures: dict = {"runs": args.runs, "rounds": args.rounds, "backend": args.backend, "load": load, "cli": cli}
    keys = ("overhead_s", "cycle_s", "own_s", "first_start_s", "peak_mib", "vmhwm_mib", "init_ms", "p50_ms")
    for name, by_mode in rows.items():
        med = {mode: {k: statistics.median(r[k] for r in results) for k in keys} for mode, results in by_mode.items()}
        for mode, m in med.items():
            lines.append(f"| {name} | {mode} | {m['overhead_s']:.3f} | {m['cycle_s']:.3f} | {m['own_s']:.4f} | "
                         f"{m['first_start_s']:.3f} | {m['peak_mib']:.1f} | {m['vmhwm_mib']:.1f} | {m['init_ms']:.2f} | "
                         f"{m['p50_ms']:.4f} | {'; '.join(by_mode[mode][0]['harness'])} |")
        ratios = {}
        for low, high in (("warm", "cold"), ("warm", "base")):
            if high not in med:
                continue
            ratio = {k: round(med[low][k] / med[high][k], 3) if med[high][k] else None
                     for k in ("overhead_s", "first_start_s", "peak_mib", "vmhwm_mib", "init_ms", "p50_ms")}
            ratios[f"{low}/{high}"] = ratio
            lines.append(f"| {name} | {low} / {high} | ×{ratio['overhead_s']} | | | ×{ratio['first_start_s']} | "
                         f"×{ratio['peak_mib']} | ×{ratio['vmhwm_mib']} | ×{ratio['init_ms']} | ×{ratio['p50_ms']} | |")
        figures[name] = {"median": med, "ratios": ratios, "rounds": by_mode}
    if cli:
        lines += ["", "| CLI start-up (median wall s) | |", "| --- | --- |",
                  *(f"| {name} | {s:.3f} |" for name, s in cli.items())]
    text = "\n".join(lines) + "\n"
    print(text)
    print(json.dumps({k: v for k, v in figures.items() if k not in models}))
    if not args.no_write:
        print(f"written to {write_results('run-overhead', text, figures)}")


if __name__ == "__main__":
    main()
