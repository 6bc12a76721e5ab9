"""The population prior (issue 20 item 2): feature coefficients borrowed from other devices.

Data: tests/data/calibration_qed_phones_300.csv (see its .md), Pixel 4 big core as the sim; each
held-out device is calibrated with a prior fitted on the *other* devices of the file only.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from farm.controller.analysis.calibration import (
    FIT_KINDS,
    Calibration,
    CalibrationInputError,
    Pair,
    PopulationPrior,
    calibrate,
    fit_population_prior,
)
from farm.controller.service import fit_figures

QED_CSV = Path(__file__).parent / "data" / "calibration_qed_phones_300.csv"
SIM = "pixel4_cpu_ms"
DEVICES = ("s10_cpu_ms", "mi8se_cpu_ms", "a03s_cpu_ms", "iphonexs_cpu_ms", "pixel4_gpu_ms")


def columns() -> dict[str, np.ndarray]:
    with QED_CSV.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    return {name: np.array([float(row[name]) for row in rows]) for name in rows[0] if name != "model"}


def pairs_of(data: dict[str, np.ndarray], device: str, indices) -> list[Pair]:
    return [Pair(f"m{i}", data[SIM][i], data[device][i], features={"FLOPS": data["FLOPS"][i], "size": data["size"][i]})
            for i in indices]


def prior_without(data: dict[str, np.ndarray], device: str) -> PopulationPrior:
    return fit_population_prior(data[SIM], {d: data[d] for d in DEVICES if d != device},
                                {"flops": data["FLOPS"], "size": data["size"]}, f"test devices but {device}")


def test_shipped_prior_loads_and_is_used_and_reported():
    data = columns()
    shipped = PopulationPrior.shipped()
    assert shipped.terms[0] == "exponent" and {"work", "size"} <= set(shipped.terms) and shipped.devices >= 10
    calibration = calibrate(pairs_of(data, "iphonexs_cpu_ms", range(10)), features=["FLOPS", "size"],
                            population=shipped)
    fit = calibration.fits["log_pop"]
    assert fit.features_used == ["FLOPS", "size"] and 0.0 < fit.prior_weight < 1.0
    assert fit.prior_source.startswith("population: ") and "FLOPS^" in fit.formula
    figures = fit_figures(calibration)
    assert figures.population_weight == fit.prior_weight and figures.population_source == fit.prior_source
    again = Calibration.from_json(json.loads(json.dumps(calibration.to_json())))
    assert again.fits["log_pop"].prior_weight == fit.prior_weight
    held = np.arange(10, 20)
    assert np.allclose(again.fits["log_pop"].predict_arrays(data[SIM][held], {n: data[n][held] for n in ("FLOPS", "size")})[0],
                       fit.predict_arrays(data[SIM][held], {n: data[n][held] for n in ("FLOPS", "size")})[0])
    # without a prior, or without a FLOPs/size feature, there is nothing to borrow
    assert "log_pop" not in calibrate(pairs_of(data, "iphonexs_cpu_ms", range(10)), features=["FLOPS", "size"]).fits
    assert "log_pop" not in calibrate(pairs_of(data, "iphonexs_cpu_ms", range(10)), population=shipped).fits


def test_prior_weight_falls_as_the_device_pairs_grow():
    data = columns()
    pairs = pairs_of(data, "mi8se_cpu_ms", range(300))
    weights = [calibrate(pairs[:k], features=["FLOPS", "size"], population=PopulationPrior.shipped(),
                         kinds=("log", "log_pop")).fits["log_pop"].prior_weight for k in (5, 10, 20, 80, 300)]
    assert all(a > b for a, b in zip(weights, weights[1:], strict=False)), weights
    assert weights[0] > 0.4 and weights[-1] < 0.15


def test_device_holdout_with_prior_is_not_worse_than_without():
    """Fixed seed: each held-out device calibrated on k random models, with a prior from the other
    devices and without; the chosen fit predicts the other models. Over all four cells the prior
    must gain (measured +0.5 to +6 points on 20 draws), and no cell may lose more than 1 point."""
    data = columns()
    generator = np.random.default_rng(0)
    gains = []
    for device in ("mi8se_cpu_ms", "iphonexs_cpu_ms"):
        population = prior_without(data, device)
        for k in (5, 10):
            within = {"without": [], "with": []}
            for _ in range(20):
                picked = generator.choice(300, size=k, replace=False)
                held = np.setdiff1d(np.arange(300), picked)
                features = {name: data[name][held] for name in ("FLOPS", "size")}
                # since issue 31 the prior reaches the choice through log_bayes (log_pop is not offered beside
                # it): "without" is every kind that borrows nothing from other devices
                for name, given in (("without", None), ("with", population)):
                    fit = calibrate(pairs_of(data, device, picked), features=["FLOPS", "size"],
                                    kinds=FIT_KINDS if given else ("ols", "log", "robust", "log_ridge", "log_work"),
                                    class_priors={"single_core": given} if given else None).chosen_fit
                    estimate, _, _ = fit.predict_arrays(data[SIM][held], features)
                    within[name].append(float(np.mean(np.abs(estimate - data[device][held]) <= 0.1 * data[device][held])))
            gains.append(float(np.mean(within["with"]) - np.mean(within["without"])))
            assert gains[-1] >= -0.01, (device, k, gains[-1])
    assert np.mean(gains) > 0, gains


def test_store_peers_join_the_population():
    data = columns()
    shipped = PopulationPrior.shipped()
    peers = [calibrate(pairs_of(data, device, range(100)), features=["FLOPS", "size"], population=shipped,
                       kinds=("log_pop",)).fits["log_pop"] for device in ("s10_cpu_ms", "a03s_cpu_ms")]
    joined = shipped.with_fits(peers, "device(s) in this store")
    assert joined.devices == shipped.devices + 2 and joined.mean != shipped.mean
    assert joined.source.endswith("2 device(s) in this store")
    PopulationPrior.from_json(joined.to_json())  # still a valid prior
    line = calibrate(pairs_of(data, "s10_cpu_ms", range(10)), kinds=("log",)).fits["log"]
    assert shipped.with_fits([line], "x") is shipped  # a fit without the features adds nothing


@pytest.mark.parametrize("mutate, complaint", [
    (lambda d: d.update(format="something else"), "not a farm population prior"),
    (lambda d: d["mean"].update(work=math.inf), "finite"),
    (lambda d: d.update(covariance=[[1, 0, 0], [0, -1, 0], [0, 0, 1]]), "positive-definite"),
    (lambda d: d.update(covariance=[[1, 0], [0, 1]]), "3×3"),
    (lambda d: d.update(terms=["exponent", "work", "bogus"]), "malformed|terms"),
    (lambda d: d.update(residual_std=0), "residual_std"),
    (lambda d: d.pop("mean"), "malformed"),
])
def test_hostile_prior_files_are_refused(mutate, complaint):
    document = PopulationPrior.shipped().to_json()
    mutate(document)
    with pytest.raises(CalibrationInputError, match=complaint):
        PopulationPrior.from_json(document, "evil.json")


def test_cli_population_prior_option(tmp_path, capsys):
    from farm.cli.main import main

    data = columns()
    path = tmp_path / "pairs.csv"
    path.write_text("model,x,y,FLOPS,size\n" + "".join(
        f"m{i},{data[SIM][i]},{data['a03s_cpu_ms'][i]},{data['FLOPS'][i]},{data['size'][i]}\n" for i in range(10)))
    assert main(["calibrate", "--pairs", str(path), "--feature", "FLOPS", "--feature", "size", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["calibrations"][0]
    assert 0 < row["population_weight"] < 1 and "log_pop" in row["fits"]
    assert main(["calibrate", "--pairs", str(path), "--feature", "FLOPS", "--feature", "size", "--json",
                 "--population-prior", "none"]) == 0
    row = json.loads(capsys.readouterr().out)["calibrations"][0]
    assert row["population_weight"] is None and "log_pop" not in row["fits"]
    bad = tmp_path / "bad-prior.json"
    bad.write_text('{"format": "farm.population-prior/1", "terms": ["exponent"], "mean": {"exponent": NaN}}')
    assert main(["calibrate", "--pairs", str(path), "--feature", "FLOPS", "--population-prior", str(bad)]) == 2
    assert "bad-prior.json: malformed population prior" in capsys.readouterr().err
