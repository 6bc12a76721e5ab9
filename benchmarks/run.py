"""`make bench`: the foundation's measurement goals, measured side by side as ratios.

1. Sampler overhead at 50 ms, as % of one core (the sampler's own thread CPU time / wall).
2. Fidelity: per-inference latency through farm (sim driver: sandbox + sampler) vs the
   same harness run bare on the same core; interleaved rounds, ratio of medians. Aim <= 1.02.
3. Peak-memory error on spiky workloads: farm's figure vs the kernel's counter, and what
   sampling every 50 ms and every 3 s (the original tool's floor) would have reported.

Prints a markdown report and writes it to benchmarks/results/<date>-<backend>.{md,json}.
"""

from __future__ import annotations

import argparse
import hashlib
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from farm.agents.environment import host_facts
from farm.agents.harness.task import HarnessOutput, HarnessTask
from farm.agents.sandbox import choose_backend
from farm.agents.sandbox.base import Budget
from farm.agents.sim.driver import SimDriver
from farm.agents.sim.telemetry import TelemetrySampler
from farm.model_generators.generate import generate_examples
from farm.proto.tasks import TaskPlan, TaskSpec

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent


def sampler_overhead(backend_name: str, seconds: float) -> dict:
    backend = choose_backend(backend_name)
    script = f"x = 0\nimport time\nend = time.time() + {seconds}\nwhile time.time() < end: x += 1\n"
    rows = {}
    for interval in (50.0, 10.0):
        with tempfile.TemporaryDirectory() as d:
            sb = backend.start([sys.executable, "-c", script], Budget(cpus=1, cpuset="0"),
                               env={"PATH": os.environ["PATH"]}, cwd=Path(d), mounts=[])
            sampler = TelemetrySampler(sb, interval).start()
            info = sb.wait(seconds + 30)
            sampler.stop()
            sb.close()
        t = sampler.summary(info)
        rows[f"{interval:g} ms"] = {"sampler_cpu_percent_of_one_core": round(t.sampler_cpu_percent, 3),
                                    "samples": len(t.samples), "run_s": round(info.wall_s, 2)}
    return {"backend": backend.name, "by_interval": rows}


def _task(model: Path, iterations: int, backend: str) -> TaskSpec:
    return TaskSpec(task_id=0, job_id=0, attempt=1, target="sim", model_name=model.stem, model_path=str(model),
                    model_sha256=hashlib.sha256(Path(model).read_bytes()).hexdigest(), model_family=None, threads=1, batch_size=1, input_size=None, repeat=0,
                    plan=TaskPlan(workload={"type": "benchmark", "iterations": iterations, "warmup": 10, "input_shapes": {},
                              "use_xnnpack": True},
                    sim={"cpus": 1.0, "cpuset": "0", "memory": 2 << 30, "backend": backend,
                         "sample_interval_ms": 50.0},
                    run_timeout_s=600, base_dir=str(model.parent)))


def _bare(model: Path, iterations: int, work: Path) -> float:
    """The harness alone, pinned to the same core, no sandbox, no sampler."""
    task_file, out_file = work / "bare-task.json", work / "bare-out.json"
    HarnessTask(kind="benchmark", model_path=str(model), iterations=iterations, warmup=10).write(task_file)
    subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "farm.agents.harness", str(task_file), str(out_file)],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return statistics.median(HarnessOutput.read(out_file).iterations_ms)


def fidelity(models: list[Path], rounds: int, iterations: int, backend: str) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        driver = SimDriver(work)
        for model in models:
            farm_ms, bare_ms = [], []
            for _ in range(rounds):  # interleaved: drift of the shared machine hits both alike
                r = driver.run(_task(model, iterations, backend), lambda: False)
                assert r.ok, r.message
                farm_ms.append(r.latency.p50)
                bare_ms.append(_bare(model, iterations, work))
            rows.append({"model": model.name, "backend": r.backend, "farm_p50_ms": round(statistics.median(farm_ms), 4),
                         "bare_p50_ms": round(statistics.median(bare_ms), 4),
                         "ratio": round(statistics.median(farm_ms) / statistics.median(bare_ms), 4)})
    return rows


SPIKY = """
import time
time.sleep(0.5)
for size_mb, hold_s in {spikes}:
    b = bytearray(size_mb << 20)
    for i in range(0, len(b), 4096): b[i] = 1
    time.sleep(hold_s)
    del b
    time.sleep(0.7)
"""


def peak_error(backend_name: str) -> list[dict]:
    backend = choose_backend(backend_name)
    workloads = {
        "one 100 ms spike of 300 MB": [(300, 0.1)],
        "three 50 ms spikes of 150/250/200 MB": [(150, 0.05), (250, 0.05), (200, 0.05)],
        "one 2 s plateau of 200 MB": [(200, 2.0)],
    }
    rows = []
    for name, spikes in workloads.items():
        with tempfile.TemporaryDirectory() as d:
            sb = backend.start([sys.executable, "-c", SPIKY.format(spikes=spikes)], Budget(memory_bytes=2 << 30),
                               env={"PATH": os.environ["PATH"]}, cwd=Path(d), mounts=[])
            sampler = TelemetrySampler(sb, 50).start()
            info = sb.wait(60)
            sampler.stop()
            sb.close()
        t = sampler.summary(info)
        kernel = info.peak_memory_bytes  # cgroup: memory.max_usage_in_bytes / memory.peak; process: ru_maxrss
        sampled_50 = max(s.memory_bytes for s in t.samples)
        # every 60th 50-ms sample is what a 3 s sampler sees; over all 60 start phases
        phases_3s = [max(s.memory_bytes for s in t.samples[k::60]) for k in range(min(60, len(t.samples)))]
        err_3s = [100 * (p - kernel) / kernel for p in phases_3s]
        rows.append({
            "workload": name, "backend": backend.name, "kernel_peak_mb": round(kernel / MiB, 1),
            "farm_peak_mb": round(t.memory_peak_bytes / MiB, 1),
            "farm_error_pct": round(100 * (t.memory_peak_bytes - kernel) / kernel, 2),
            "sampled_50ms_error_pct": round(100 * (sampled_50 - kernel) / kernel, 1),
            "sampled_3s_error_pct_mean": round(statistics.mean(err_3s), 1),
            "sampled_3s_error_pct_worst": round(min(err_3s), 1),
        })
    return rows


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"### {report['date']} — {m['cpu_model']}, {m['cpu_count']} cores, {m['memory_total_bytes'] // (1 << 30)} GiB, "
             f"kernel {m['kernel']}, Python {m['python']}", ""]
    o = report["sampler_overhead"]
    lines += [f"**Sampler overhead** ({o['backend']} backend, CPU-bound run on one core)", "",
              "| interval | sampler CPU, % of one core | samples | run s |", "|---|---|---|---|"]
    for k, v in o["by_interval"].items():
        lines.append(f"| {k} | {v['sampler_cpu_percent_of_one_core']} | {v['samples']} | {v['run_s']} |")
    lines += ["", "**Fidelity** (median per-inference latency, 1 thread on core 0; farm = sandbox + 50 ms sampler)", "",
              "| model | backend | farm p50 ms | bare p50 ms | farm / bare |", "|---|---|---|---|---|"]
    for r in report["fidelity"]:
        lines.append(f"| {r['model']} | {r['backend']} | {r['farm_p50_ms']} | {r['bare_p50_ms']} | {r['ratio']} |")
    lines += ["", "**Peak memory on spiky workloads** (error vs the kernel's high-water mark)", "",
              "| workload | backend | kernel peak MB | farm peak MB | farm error % | 50 ms sampling error % "
              "| 3 s sampling error %, mean over start phases | worst |",
              "|---|---|---|---|---|---|---|---|"]
    for r in report["peak_error"]:
        lines.append(f"| {r['workload']} | {r['backend']} | {r['kernel_peak_mb']} | {r['farm_peak_mb']} | "
                     f"{r['farm_error_pct']} | {r['sampled_50ms_error_pct']} | {r['sampled_3s_error_pct_mean']} | "
                     f"{r['sampled_3s_error_pct_worst']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="auto")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--overhead-seconds", type=float, default=10.0)
    args = p.parse_args()

    models_dir = ROOT.parent / "examples" / "models"
    generated = generate_examples(models_dir, widths=[0.35, 1.0], input_sizes=[224], zoo=["squeezenet"])
    models = [m.path for m in generated if m.path.name in
              ("mobilenetv2_w0.35_r224.tflite", "mobilenetv2_w1.0_r224.tflite", "mobilenetv2_w1.0_r224.onnx",
               "squeezenet.onnx")]
    report = {
        "date": dt.date.today().isoformat(),
        "machine": {**host_facts(), "platform": platform.platform()},
        "sampler_overhead": sampler_overhead(args.backend, args.overhead_seconds),
        "fidelity": fidelity(models, args.rounds, args.iterations, args.backend),
        # the process backend has no kernel cgroup counter: its peak is the rusage high-water mark
        "peak_error": peak_error(args.backend) + peak_error("process"),
    }
    text = markdown(report)
    print(text)
    out = ROOT / "results"
    out.mkdir(exist_ok=True)
    stem = f"{report['date']}-{report['sampler_overhead']['backend']}"
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
