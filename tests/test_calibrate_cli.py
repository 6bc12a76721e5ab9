"""The calibration loop as a user runs it: measure a family in the sim, measure it again
on a "device" (here: the sim under half the CPU, standing in until device drivers land),
calibrate, list, predict a new model, rank, report — all through the CLI."""

from __future__ import annotations

import csv
import json
import math
import struct
from pathlib import Path

import pytest

from conftest import write_job
from farm.controller.analysis.calibration import LOG_KINDS

G6_LATENCY = [(0.0111, 0.020), (0.0218, 0.054), (0.0380, 0.090), (0.0544, 0.117), (0.0616, 0.253), (0.3626, 1.309)]


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> Path:
    from farm.model_generators.generate import generate_examples
    d = tmp_path_factory.mktemp("family")
    generate_examples(d, widths=[0.35, 0.5, 0.75, 1.0, 1.4], input_sizes=[96], formats=("tflite",), zoo=False)
    return d


def _job(d: Path, name: str, cpus: float, models: str) -> Path:
    return write_job(d, f"""
name: {name}
models: [{models}]
workload: {{type: benchmark, iterations: 30, warmup: 3}}
sim: {{cpus: {cpus}, memory: 1g, on_contention: flag}}
""", f"{name}.yaml")  # contended runs are kept and marked, not measured again: the policy is test_contention.py's


def test_calibrate_predict_rank_report(family: Path, farm, tmp_path: Path) -> None:
    train = ", ".join(f"mobilenetv2_w{w}_r96.tflite" for w in ("0.35", "0.5", "0.75", "1.4"))
    assert farm("submit", str(_job(family, "sim", 1.0, train)), "--quiet").returncode == 0
    assert farm("submit", str(_job(family, "slow-device", 0.5, train)), "--quiet").returncode == 0

    # This is the CLI flow; leaving contended runs out is tests/test_contention.py's subject, and on a busy
    # machine it can leave fewer than 4 pairs here. Contended runs are kept, and still marked.
    cal = farm("calibrate", "--sim-job", "1", "--device-job", "2", "--device", "half-cpu",
               "--metric", "latency", "--metric", "peak_memory", "--include-contended", "--json")
    assert cal.returncode == 0, cal.stderr
    fits = {c["metric"]: c for c in cal.json()["calibrations"]}
    lat = fits["latency"]
    assert lat["n"] == 4 and lat["version"] == 1
    # Half the CPU: slower. About twice on a quiet machine; a loaded one throttles the half-CPU runs more (CI saw
    # 3.8 once over 4 points). Below 1.3 the budget did not bite or the axes are swapped; above 6 is garbage.
    assert 1.3 < lat["fits"]["ols"]["a"] < 6.0
    assert lat["spearman_rho"] > 0.7

    # a second fit is a new version; history keeps both
    farm("calibrate", "--sim-job", "1", "--device-job", "2", "--device", "half-cpu", "--include-contended", "--json")
    history = farm("calibrations", "--device", "half-cpu", "--json").json()
    assert sorted(r["version"] for r in history if r["metric"] == "latency") == [1, 2]
    for r in history:  # the whole formula, under honest names
        assert r["formula"].startswith("y = ") and r["batch_size"] == 1
        assert ("exponent" in r) == (r["kind"] in LOG_KINDS) and ("a" in r) != ("exponent" in r)

    # predict a model the calibration never saw, from the sim alone
    pred = farm("predict", str(family / "mobilenetv2_w1.0_r96.tflite"), "--device", "half-cpu", "--json")
    assert pred.returncode == 0, pred.stderr
    p = pred.json()[0]
    assert p["metric"] == "latency" and p["sim_reused"] is False and p["calibration"]["version"] == 2
    assert p["low"] <= p["estimate"] <= p["high"] and p["estimate"] > p["sim"]
    again = farm("predict", str(family / "mobilenetv2_w1.0_r96.tflite"), "--device", "half-cpu", "--json").json()[0]
    assert again["sim_reused"] is True  # an identical sim run is reused, not repeated

    # predict_for: every run of a new job comes back with the device's estimate beside it
    (family / "new.yaml").write_text(_job(family, "new", 1.0, "mobilenetv2_w1.0_r96.tflite").read_text()
                                     + "predict_for: [half-cpu]\n")
    new = farm("submit", str(family / "new.yaml"), "--json")
    assert new.returncode == 0, new.stderr
    predicted = new.json()["results"][0]["predictions"]["half-cpu"]["latency"]
    assert predicted["estimate"] > 0 and predicted["same_sim_budget"] is True

    # what to measure next on the device: the store's model measured in the sim but not on half-cpu
    job_file = tmp_path / "next.yaml"
    suggest = farm("calibrate", "--suggest", "1", "--device", "half-cpu", "-o", str(job_file), "--json",
                   "--include-contended")  # as above: a busy machine may contend the sim run
    assert suggest.returncode == 0, suggest.stderr
    answer = suggest.json()
    assert answer["measured"] == 4 and answer["candidates"] == 1 and answer["threads"] == 1
    (chosen,) = answer["suggested"]
    assert chosen["model"] == "mobilenetv2_w1.0_r96" and chosen["sim"] > 0 and chosen["path"].endswith("w1.0_r96.tflite")
    # per-layer facts spread the choice (a fact equal across the family, like its layer count, drops out)
    assert {"macs", "depthwise_macs_share", "activation_bytes"} <= set(answer["features"])
    from farm.controller.scheduling.jobfile import parse_job_text
    spec, _ = parse_job_text(job_file.read_text(), str(job_file))  # farm submit takes it as it is
    assert [str(m.path) for m in spec.models] == [chosen["path"]] and spec.targets == ["half-cpu"]
    from farm.api import connect
    with connect(db=tmp_path / "farm.db") as lab:  # the same from Python
        asked = lab.suggest("half-cpu", 1, include_contended=True)
    assert [s["model"] for s in asked["suggested"]] == ["mobilenetv2_w1.0_r96"]
    for bad, said in ((["--suggest", "0"], "1 to 1"),
                      (["--suggest", "1", "--device", "half-cpu", "--metric", "latency", "--threads", "7"], "7 thread")):
        refused = farm("calibrate", *bad, *([] if "--device" in bad else ["--device", "half-cpu"]), "--include-contended")
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr
    new_device = farm("calibrate", "--suggest", "2", "--device", "new\x1b[31m", "--include-contended")
    assert new_device.returncode == 0 and "0 already measured" in " ".join(new_device.stderr.split())  # not calibrated yet
    assert "\x1b" not in new_device.stdout and "new\\x1b[31m" in new_device.stdout  # its name shown, not obeyed

    ranking = farm("rank", "1", "--device-job", "2", "--device", "half-cpu", "--include-contended", "--json").json()
    cols = ranking["groups"][0]["columns"]
    assert [c["name"] for c in cols] == ["sim (job 1)", "job 2", "half-cpu (predicted)"]
    sim_order = cols[0]["order"]
    assert [v for _, v in sim_order] == sorted(v for _, v in sim_order)  # fastest first
    # w1.4 has 5x the MACs of w0.35: slowest for sure (w0.35 and w0.5 are close enough to swap). One measurement
    # on a loaded machine can flip it; then the family is measured again and that is judged (retry-and-judge).
    if sim_order[-1][0] != "mobilenetv2_w1.4_r96":
        again = farm("submit", str(_job(family, "sim-again", 1.0, train)), "--json")
        assert again.returncode == 0, again.stderr
        remeasured = farm("rank", str(again.json()["job"]), "--include-contended", "--json").json()
        order = remeasured["groups"][0]["columns"][0]["order"]
        assert order[-1][0] == "mobilenetv2_w1.4_r96", (sim_order, order)

    report = tmp_path / "report.html"
    pngs = tmp_path / "png"
    made = farm("report", "1", "-o", str(report), "--png", str(pngs), "--json")
    assert made.returncode == 0, made.stderr
    page = report.read_text()
    assert "half-cpu" in page and "data:image/png;base64," in page and "Rankings" in page
    assert "y = " in page and "batch 1" in page  # every fit's formula, and the calibration key
    assert "sim side: job 1 (sim) · device side: job 2 (slow-device)" in page  # the jobs it came from, named
    assert "device, measured (ms)" in page and "predicted (ms)" in page  # units in the tables
    figures = sorted(pngs.glob("calibrations-*.png"))
    assert len(figures) == 1  # one figure per family and setting: a panel for latency, one for peak memory
    head = figures[0].read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert (width, height) == (1040, 440)
    assert "half-cpu · latency" in page and "half-cpu · peak_memory" in page  # each calibration's own section


def test_offline_calibration_reproduces_the_published_g6_fit(tmp_path: Path, farm) -> None:
    pairs = tmp_path / "g6.csv"
    with open(pairs, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "x", "y"])
        for i, (x, y) in enumerate(G6_LATENCY):
            w.writerow([f"m{i}", x, y])
    fit_file = tmp_path / "fit.json"
    run = farm("calibrate", "--pairs", str(pairs), "-o", str(fit_file), "--json")
    assert run.returncode == 0, run.stderr
    ols = run.json()["calibrations"][0]["fits"]["ols"]
    assert ols["a"] == pytest.approx(3.70, abs=0.05) and ols["r2"] >= 0.99

    new = tmp_path / "new.csv"
    new.write_text("model,x\nbig,0.2\nsmall,0.015\n")
    out = tmp_path / "pred.csv"
    assert farm("predict", "--calibration", str(fit_file), "--input", str(new), "-o", str(out)).returncode == 0
    rows = list(csv.DictReader(open(out)))
    assert [r["model"] for r in rows] == ["big", "small"]
    doc = json.loads(fit_file.read_text())
    assert doc["groups"]


def test_too_few_pairs_is_refused_with_the_number_needed(tmp_path: Path, farm) -> None:
    pairs = tmp_path / "few.csv"
    pairs.write_text("model,x,y\na,1,2\nb,2,4\n")
    run = farm("calibrate", "--pairs", str(pairs))
    assert run.returncode == 1 and "4" in run.stderr


def test_bad_pairs_file_names_line_and_column(tmp_path: Path, farm) -> None:
    pairs = tmp_path / "bad.csv"
    pairs.write_text("model,x,y\na,1,2\nb,fast,4\n")
    run = farm("calibrate", "--pairs", str(pairs))
    assert run.returncode == 2 and "bad.csv" in run.stderr and "3" in run.stderr and "x" in run.stderr


def test_offline_features_round_trip(tmp_path: Path, farm) -> None:
    """calibrate --pairs CSV --feature … → fit.json → predict --input x.csv → out.csv, with the same columns."""
    import numpy as np

    from farm.controller.analysis.calibration import Calibration

    generator = np.random.default_rng(2)
    macs = generator.uniform(2e8, 6e9, 14)
    sim = macs / 1e8 * generator.uniform(0.7, 1.4, 14)
    size = generator.uniform(1e6, 3e7, 14)
    device = 2.0 * sim * (macs / 1e9) ** 0.2 * np.exp(generator.normal(0, 0.02, 14))
    pairs = tmp_path / "pairs.csv"
    with open(pairs, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "x", "y", "macs", "size", "note"])
        for i in range(12):
            w.writerow([f"m{i}", sim[i], device[i], macs[i], size[i], "measured"])
    fit_file = tmp_path / "fit.json"
    run = farm("calibrate", "--pairs", str(pairs), "--feature", "auto", "-o", str(fit_file), "--json")
    assert run.returncode == 0, run.stderr
    row = run.json()["calibrations"][0]
    # device ∝ sim · macs^0.2: log-linear + log MACs (log_work) is the right model; log_ridge may match it
    # issue 31: below 20 models log_work and log_ridge with features are not offered; the default log_bayes
    # takes MACs by role, and the plain power law may beat it honestly (was: log_work or log_ridge chosen)
    assert row["kind"] in ("log", "log_bayes") and "macs^" in row["fits"]["log_bayes"]["formula"]
    assert row["formula"].startswith("y = e^") and "exponent" in row and "a" not in row
    assert row["unsafe"] is False and row["fits"]["log_ridge"]["formula"].startswith("y = e^")
    explicit = farm("calibrate", "--pairs", str(pairs), "--feature", "macs", "--json")
    assert "macs^" in explicit.json()["calibrations"][0]["fits"]["log_bayes"]["formula"]  # was: the chosen's features

    new = tmp_path / "new.csv"
    with open(new, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "x", "macs", "size"])
        for i in (12, 13):
            w.writerow([f"m{i}", sim[i], macs[i], size[i]])
    out = tmp_path / "out.csv"
    assert farm("predict", "--calibration", str(fit_file), "--input", str(new), "-o", str(out)).returncode == 0
    rows = list(csv.DictReader(open(out)))
    calibration = Calibration.from_json(json.loads(fit_file.read_text())["groups"]["(all)"])
    for i, r in zip((12, 13), rows):
        expected = calibration.predict(float(sim[i]), {"macs": float(macs[i]), "size": float(size[i])})
        assert float(r["estimate"]) == pytest.approx(expected.estimate, rel=1e-9)
        assert float(r["low"]) < float(r["estimate"]) < float(r["high"])
        assert float(r["estimate"]) == pytest.approx(device[i], rel=0.1)  # the held-out models' truth

    missing = tmp_path / "missing.csv"
    missing.write_text(f"model,x\nm12,{sim[12]}\n")
    # a fit whose chosen kind uses MACs (the honest choice above may be the plain power law since issue 31)
    document = json.loads(fit_file.read_text())
    document["groups"]["(all)"]["chosen"] = "log_bayes"
    fit_file.write_text(json.dumps(document))
    refused = farm("predict", "--calibration", str(fit_file), "--input", str(missing))
    assert refused.returncode == 2 and "macs" in refused.stderr and "missing.csv" in refused.stderr


def test_offline_feature_auto_with_a_feature_without_spread(tmp_path: Path, farm) -> None:
    """Per-layer columns where no calibration model has a depthwise layer (flops_dw all 0), or only
    one has (left out, the rest are all 0): the fit leaves the feature out instead of refusing."""
    import numpy as np

    generator = np.random.default_rng(5)
    flops = generator.uniform(2e8, 6e9, 10)
    sim = flops / 1e8 * generator.uniform(0.7, 1.4, 10)
    device = 1.7 * sim * np.exp(generator.normal(0, 0.03, 10))
    for name, dw in (("none", np.zeros(10)), ("one", np.r_[3e7, np.zeros(9)])):
        pairs = tmp_path / f"{name}.csv"
        with open(pairs, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["model", "x", "y", "flops", "flops_dw", "layers"])
            for i in range(10):
                w.writerow([f"m{i}", sim[i], device[i], flops[i], dw[i], 30 + i % 3])
        run = farm("calibrate", "--pairs", str(pairs), "--feature", "auto", "--json")
        assert run.returncode == 0, run.stderr
        row = run.json()["calibrations"][0]
        assert "flops_dw" not in row["features_used"] and row["unsafe"] is False
        assert "SVD" not in run.stderr and "divide" not in run.stderr
        # The choice is reported: every candidate's error and the runner-up with its own figures.
        assert row["kind"] in row["choice"]["errors"] and row["runner_up"]["kind"] == row["choice"]["runner_up"]
        assert row["runner_up"]["kind"] != row["kind"] and 0 < row["runner_up"]["loo_mape"] < 1
    text = farm("calibrate", "--pairs", str(pairs), "--feature", "auto", "--wide")
    assert text.returncode == 0 and "runner-up" in text.stdout and "nan" not in text.stdout


def test_suggest_offline(tmp_path: Path, farm) -> None:
    """calibrate --suggest K --pairs candidates.csv: rows without y are candidates, rows with y measured."""
    candidates = tmp_path / "candidates.csv"
    with open(candidates, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "x", "y", "flops"])
        w.writerow(["done", 1.0, 2.0, 1e8])
        for i, x in enumerate([1.2, 2, 4, 8, 16, 32, 64]):
            w.writerow([f"m{i}", x, "", 1e8 * x])
    run = farm("calibrate", "--pairs", str(candidates), "--suggest", "2", "--feature", "flops", "--json")
    assert run.returncode == 0, run.stderr
    document = run.json()
    assert document["measured"] == 1 and document["candidates"] == 7 and len(document["suggested"]) == 2
    # issue 31: the design removes the most predictive variance (was D-optimal: the far end m6 first); never
    # the measured model or m0 beside it
    assert not {"done", "m0"} & set(document["suggested"])
    text = farm("calibrate", "--pairs", str(candidates), "--suggest", "1")
    assert text.returncode == 0 and text.stdout.split() == document["suggested"][:1]

    for count, message in (("0", "1 to 7"), ("99", "1 to 7")):
        refused = farm("calibrate", "--pairs", str(candidates), "--suggest", count)
        assert refused.returncode == 2 and message in refused.stderr and "candidates.csv" in refused.stderr
    hostile = tmp_path / "hostile.csv"
    hostile.write_text("model,x\nm0,1\nm1,nan\nm2,3\n")
    refused = farm("calibrate", "--pairs", str(hostile), "--suggest", "1")
    assert refused.returncode == 2 and "hostile.csv" in refused.stderr and "x" in refused.stderr
    assert farm("calibrate", "--suggest", "1").returncode == 2


def test_offline_table_never_prints_nan(tmp_path: Path, farm) -> None:
    """Every device value equal: R², τ, ρ cannot be computed; the table and warnings say why instead of nan."""
    pairs = tmp_path / "flat.csv"
    pairs.write_text("model,x,y\na,1,5\nb,2,5\nc,3,5\nd,4,5\ne,5,5\n")
    for width in ([], ["--wide"]):
        run = farm("calibrate", "--pairs", str(pairs), *width, env={"COLUMNS": "250"})
        assert run.returncode == 0, run.stderr
        assert "nan" not in (run.stdout + run.stderr).lower()
        assert "every device value is the same" in run.stderr
    assert "device values all equal" in run.stdout  # --wide: R² cannot be computed, and why


def test_the_default_table_is_one_compact_line_per_calibration_with_the_whole_formula(tmp_path: Path, farm) -> None:
    """Default: group, n, the whole formula (folded in a narrow terminal, never cut with …), leave-one-out
    figures and the verdict; --wide adds R², runner-up, τ, ρ, prior and flips."""
    import numpy as np

    generator = np.random.default_rng(3)
    pairs = tmp_path / "two.csv"
    with open(pairs, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "x", "y", "phone", "macs_with_a_long_column_name"])
        for phone in ("g6", "s8"):
            for i in range(8):
                macs = float(generator.uniform(1e8, 3e9))
                x = macs / 1e8 * float(generator.uniform(0.8, 1.25))
                w.writerow([f"m{i}", x, 2.5 * x * float(np.exp(generator.normal(0, 0.05))), phone, macs])
    wide = farm("calibrate", "--pairs", str(pairs), "--group", "phone", "--feature", "auto", "--wide", "--json")
    formulas = {r["group"]: r["formula"].split("  (")[0] for r in wide.json()["calibrations"]}
    for columns in (60, 80, 120):
        run = farm("calibrate", "--pairs", str(pairs), "--group", "phone", "--feature", "auto",
                   env={"COLUMNS": str(columns)})
        assert run.returncode == 0, run.stderr
        text = run.stdout
        assert "…" not in text and max(len(line) for line in text.splitlines()) <= columns
        headers = text[:text.index("┡")]
        for header in ("group", "formula", "±10 %", "MAPE %", "verdict"):
            assert header in headers
        assert "runner-up" not in headers and "R²" not in headers and "--wide" in text
        cells = "".join(line.split("│")[3] for line in text.splitlines() if line.startswith("│")).replace(" ", "")
        for formula in formulas.values():  # every character of each formula, folded over lines
            assert formula.replace(" ", "") in cells, (formula, text)
    full = farm("calibrate", "--pairs", str(pairs), "--group", "phone", "--feature", "auto", "--wide",
                env={"COLUMNS": "80"})
    assert "runner-up" in full.stdout and "R²" in full.stdout and "(log y =" in full.stdout


def test_plot_is_a_terminal_scatter(tmp_path: Path, farm) -> None:
    from farm.cli.calibrate_commands import PLOT_HEIGHT, scatter_plot

    text = scatter_plot([1.0, 10.0, 100.0], [1.0, 12.0, 90.0], "g")
    lines = text.splitlines()
    assert lines[0].startswith("g (predicted") and "log-log" in lines[0] and len(lines) == PLOT_HEIGHT + 3
    assert sum(line.count("*") for line in lines) == 3 and lines[1].rstrip().endswith("*")  # 100 → 90 top right
    assert "nothing to plot" in scatter_plot([math.nan], [math.nan], "g")
    assert "log-log" not in scatter_plot([-1.0, 2.0], [0.0, 2.0], "g").splitlines()[0]  # values ≤ 0: linear axes
    pairs = tmp_path / "flat.csv"
    pairs.write_text("model,x,y\na,1,5\nb,2,5\nc,3,5\nd,4,5\ne,5,5\n")
    run = farm("calibrate", "--pairs", str(pairs), "--plot")
    assert run.returncode == 0 and "predicted ↑ against measured" in run.stdout and "*" in run.stdout


def test_offline_predict_says_extrapolating_and_honours_confidence(tmp_path: Path, farm) -> None:
    """Issue 31: a model 10× outside the sim range gets verdict "extrapolating" (CSV column and a stderr line),
    --confidence changes the interval offline, and --help names the estimate/low/high columns."""
    import numpy as np

    generator = np.random.default_rng(3)
    sim = generator.uniform(5, 50, 10)
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("model,x,y\n" + "".join(f"m{i},{x},{2 * x * generator.uniform(0.97, 1.03)}\n"
                                             for i, x in enumerate(sim)))
    fit_file = tmp_path / "fit.json"
    assert farm("calibrate", "--pairs", str(pairs), "-o", str(fit_file)).returncode == 0
    new = tmp_path / "new.csv"
    new.write_text(f"model,x\ninside,20\nfar,{10 * sim.max()}\n")
    run = farm("predict", "--calibration", str(fit_file), "--input", str(new))
    assert run.returncode == 0, run.stderr
    rows = list(csv.DictReader(run.stdout.splitlines()))
    assert [r["verdict"] for r in rows] == ["ok", "extrapolating"] and "outside" in rows[1]["extrapolation"]
    assert "extrapolating" in run.stderr and "far" in run.stderr
    narrow = list(csv.DictReader(farm("predict", "--calibration", str(fit_file), "--input", str(new),
                                      "--confidence", "0.5").stdout.splitlines()))
    assert float(narrow[0]["high"]) - float(narrow[0]["low"]) < float(rows[0]["high"]) - float(rows[0]["low"])
    bad = farm("predict", "--calibration", str(fit_file), "--input", str(new), "--confidence", "2")
    assert bad.returncode == 2 and "confidence" in bad.stderr
    shown = " ".join(farm("predict", "--help").stdout.split())
    assert all(word in shown for word in ("estimate", "low", "high", "verdict", "extrapolating"))
