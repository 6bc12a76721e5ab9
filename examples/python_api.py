"""farm from Python: measure a model family under two CPU budgets, calibrate one against the other,
and predict a new model on the slower "device" from the sim alone.

    python examples/python_api.py [WORK_DIR]

Runs embedded (a store in WORK_DIR) unless FARM_CONTROLLER names a controller.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import farm
from farm.model_generators.generate import generate_examples

WIDTHS = [0.35, 0.5, 0.75, 1.0]


def main(work: Path) -> None:
    models = generate_examples(work / "models", widths=WIDTHS + [1.4], input_sizes=[96], formats=("tflite",), zoo=False)
    train = [str(m.path) for m in models if "w1.4" not in m.path.name]
    new_model = next(m.path for m in models if "w1.4" in m.path.name)

    # the default backend (cgroup, else docker): the process backend cannot hold a run to half a CPU
    with farm.connect(db=work / "farm.db") as lab:
        print(f"connected to the {lab.where}")
        jobs = {}
        for name, cpus in (("sim", 1.0), ("half-cpu", 0.5)):
            job = lab.submit({"name": name, "models": train,
                              "workload": {"type": "benchmark", "iterations": 10, "warmup": 1},
                              "sim": {"cpus": cpus, "memory": "1g", "on_contention": "flag"}})
            info = job.wait(progress=True)
            print(f"job {job.id} ({name}): {info.status}, {info.completed}/{info.total} runs")
            jobs[name] = job

        results = jobs["sim"].results()
        for r in results:
            print(f"  {r.model:28} {r.threads} thread(s): {r.latency_ms:.2f} ms, peak {r.peak_memory_mb:.1f} MB")
        try:
            print(results.to_pandas()[["model", "latency_ms", "peak_memory_mb"]])
        except farm.FarmError as e:  # pandas is optional
            print(e)

        fits = lab.calibrate(sim_job=jobs["sim"].id, device_job=jobs["half-cpu"].id, device="half-cpu",
                             include_contended=True)  # a shared host's runs may be contended; keep them here
        for c in fits:
            print(f"calibration #{c.id} {c.device} {c.metric}: {c.formula} (R² {c.r2:.3f}, n={c.n})")
            for warning in c.warnings:
                print(f"  warning: {warning}")

        for p in lab.predict(new_model, device="half-cpu", include_contended=True):
            print(f"{p.model} on {p.device}: {p.estimate:.2f} {p.unit} "
                  f"({p.low:.2f} – {p.high:.2f} at {p.confidence:.0%}), sim {p.sim:.2f} {p.unit}")

        facts = lab.inspect(new_model)  # what farm knows of a file without running it
        print(f"{new_model.name}: {facts.param_count} parameters, {facts.macs} MACs")
        versions = lab.calibrations(device="half-cpu")
        print(f"{len(versions)} calibration version(s) stored for half-cpu")
        page = jobs["sim"].report(work / "report")[0]  # `farm report`: the page first, then its figures
        print(f"report written: {page.name}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as d:
            main(Path(d))
