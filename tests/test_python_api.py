"""farm from Python, as a notebook user has it: the example script runs end to end, `import farm`
stays cheap, and results are typed records."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "python_api.py"


def test_the_python_api_example_runs(tmp_path: Path) -> None:
    env = {**os.environ, "FARM_CONTROLLER": "", "FARM_CONFIG": str(tmp_path / "none.toml")}
    run = subprocess.run([sys.executable, str(EXAMPLE), str(tmp_path)], capture_output=True, text=True, timeout=900,
                         env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert f"connected to the store {tmp_path / 'farm.db'}" in run.stdout
    assert "job 1 (sim): completed, 4/4 runs" in run.stdout and "job 2 (half-cpu): completed, 4/4 runs" in run.stdout
    assert "calibration #1 half-cpu latency: y = " in run.stdout
    assert "mobilenetv2_w1.4_r96.tflite on half-cpu: " in run.stdout
    assert "calibration version(s) stored for half-cpu" in run.stdout and "report written: report.html" in run.stdout
    assert (tmp_path / "report" / "report.html").is_file()
    assert "parameters" in run.stdout and " MACs" in run.stdout
    # wait(progress=True): a tqdm bar (text when not in a notebook) reaching every run
    assert "job 1: 100%" in run.stderr and "4/4" in run.stderr


def test_wait_refuses_a_timeout_it_cannot_keep_and_bad_arguments(tmp_path: Path, tiny_models) -> None:
    import farm

    with farm.connect(db=tmp_path / "farm.db") as lab:
        job = lab.submit({"name": "t", "models": [str(tiny_models["onnx"])], "workload": {"iterations": 2}},
                         base_dir=tmp_path)
        for bad in (0, -1, float("nan"), True, "10"):
            with pytest.raises(farm.FarmError, match="wait\\(timeout="):
                job.wait(timeout=bad)
        with pytest.raises(farm.FarmError, match="wait\\(progress="):
            job.wait(progress="bar")
        with pytest.raises(farm.FarmError, match="runs in this process"):
            job.wait(timeout=30)  # embedded, not detached: leaving it half run is not an option
        assert job.wait(progress="lines").status == "completed"
        assert job.wait(timeout=30).status == "completed"  # nothing left to run: an answer at once
        assert job.pairs() == []  # a sim-only job has no device twins
        with pytest.raises(farm.FarmError, match="no such model file"):
            lab.inspect(tmp_path / "missing.onnx")


def test_import_farm_loads_nothing_else() -> None:
    code = "import farm, sys; print(sorted(m for m in sys.modules if m.startswith(('farm', 'grpc', 'numpy'))))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "['farm', 'farm.version']"  # __version__'s own module


def test_results_are_typed_records_and_pandas_is_optional(tmp_path: Path, tiny_models) -> None:
    import farm

    with farm.connect(db=tmp_path / "farm.db", backend="process") as lab:
        job = lab.submit({"name": "tiny", "models": [str(tiny_models["tflite"])],
                          "workload": {"type": "benchmark", "iterations": 3},
                          "sim": {"memory": "256m", "on_contention": "flag"}})
        assert job.wait().status == "completed"
        results = job.results()
        assert [(r.model, r.status, r.threads) for r in results] == [("tiny", "completed", 1)]
        assert results[0].latency_ms > 0 and results[0].record["latency_ms"]["avg"] == results[0].latency_ms
        try:
            import pandas  # noqa: F401
        except ImportError:
            with pytest.raises(farm.FarmError, match="pip install pandas"):
                results.to_pandas()
        else:
            frame = results.to_pandas()
            assert list(frame["model"]) == ["tiny"] and frame["latency_ms"][0] == results[0].latency_ms
            # every result field is a column: the budget, contention, throughput, input size...
            for column in ("cpus", "input_size", "throughput_per_s", "limits.memory_mb", "latency_ms.p90", "model.sha256",
                           "whole_run_s", "message"):
                assert column in frame.columns, column
        with pytest.raises(farm.FarmError, match="no job 99"):
            lab.job(99)


def test_a_budget_the_backend_cannot_enforce_is_said_before_the_job_runs(tmp_path: Path, tiny_models, capsys) -> None:
    # the process backend duty-cycles the whole run: half a CPU makes the run slower, not each inference
    import farm
    from farm.agents.sandbox import backend_class

    process, exact = backend_class("process"), [backend_class(n) for n in ("cgroup", "docker")]
    assert "cannot hold each inference to 0.5 CPU" in (process.unenforced_cpus(0.5) or "")
    assert process.unenforced_cpus(1.0) is None and process.unenforced_cpus(None) is None  # whole cores are pinned
    assert all(b.unenforced_cpus(0.5) is None for b in exact)
    with farm.connect(db=tmp_path / "farm.db", backend="process") as lab:
        for cpus, warned in ((0.5, True), (1.0, False)):
            lab.submit({"name": f"cpus-{cpus}", "models": [str(tiny_models["tflite"])], "sim": {"cpus": cpus}})
            said = capsys.readouterr().err
            assert ("warning: " in said and "sim.cpus: the process backend cannot hold each inference to 0.5 CPU"
                    in said and "cgroup or docker backend" in said) == warned, said
        lab.submit({"name": "sweep", "models": [str(tiny_models["tflite"])], "matrix": {"cpus": [1, 0.25]}})
        assert "matrix.cpus: the process backend cannot hold each inference to 0.25 CPU" in capsys.readouterr().err


def test_a_calibration_over_runs_whose_budget_was_not_enforced_says_so(tmp_path: Path) -> None:
    import farm
    from farm.model_generators.generate import generate_examples

    models = [str(m.path) for m in generate_examples(tmp_path / "models", widths=[0.35, 0.5, 0.75, 1.0],
                                                     input_sizes=[96], formats=("tflite",), zoo=False)]
    with farm.connect(db=tmp_path / "farm.db", backend="process") as lab:
        jobs = []
        for cpus in (1.0, 0.5):
            job = lab.submit({"name": f"cpus-{cpus}", "models": models, "workload": {"iterations": 5, "warmup": 1},
                              "sim": {"cpus": cpus, "memory": "1g", "on_contention": "flag"}})
            assert job.wait().status == "completed"
            jobs.append(job)
        flagged = [r for r in lab.farm.results(jobs[1].id) if r.message.startswith("budget not enforced: ")]
        whole_cpu = lab.farm.results(jobs[0].id)  # 1 CPU is a pinned core: enforced, nothing said
        assert len(flagged) == 4 and not any("budget not enforced" in r.message for r in whole_cpu)
        fits = lab.calibrate(sim_job=jobs[0].id, device_job=jobs[1].id, device="half-cpu", include_contended=True)
    assert fits and all(any("4 run(s) of job(s) 2 had a CPU budget their backend did not enforce" in w
                            for w in c.warnings) for c in fits)
