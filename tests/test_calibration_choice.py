"""The fit choice on real phone latencies: never meaningfully worse than the simple candidates
(log-linear, log-linear + log FLOPs) over many random draws, and features never lift "unsafe"."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest

from farm.controller.analysis.calibration import CalibrationInputError, Pair, calibrate

QED_CSV = Path(__file__).parent / "data" / "calibration_qed_phones_300.csv"
SIM = "pixel4_cpu_ms"
FEATURE_SETS: tuple[tuple[str, ...], ...] = ((), ("FLOPS",), ("FLOPS", "size"))


def qed_columns() -> dict[str, np.ndarray]:
    with QED_CSV.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    return {column: np.array([float(row[column]) for row in rows]) for column in rows[0] if column != "model"}


def held_out_scores(device_column: str, k: int, draws: int, seed: int) -> dict[str, tuple[float, float]]:
    """kind → (mean share within ±10 %, median MAPE) of the held-out models over random k-model draws."""
    data = qed_columns()
    sim, device = data[SIM], data[device_column]
    generator = np.random.default_rng(seed)
    within: dict[str, list[float]] = {}
    mape: dict[str, list[float]] = {}
    for _ in range(draws):
        picked = generator.choice(sim.size, size=k, replace=False)
        held = np.ones(sim.size, dtype=bool)
        held[picked] = False
        pairs = [Pair(f"m{i}", sim[i], device[i], features={"FLOPS": data["FLOPS"][i], "size": data["size"][i]})
                 for i in picked]
        calibration = calibrate(pairs, features=["FLOPS", "size"])
        for kind in ("log", "log_work", "chosen"):
            fit = calibration.chosen_fit if kind == "chosen" else calibration.fits[kind]
            estimate, _, _ = fit.predict_arrays(sim[held], {"FLOPS": data["FLOPS"][held], "size": data["size"][held]})
            relative = np.abs(estimate - device[held]) / device[held]
            within.setdefault(kind, []).append(float(np.mean(relative <= 0.10)))
            mape.setdefault(kind, []).append(float(np.mean(relative)))
    return {kind: (float(np.mean(within[kind])), float(np.median(mape[kind]))) for kind in within}


# k → (share-within-±10 % points, median-MAPE ratio) the choice may lose to the better simple fit
# known only in hindsight. At k = 5 a three-term fit's leave-one-out error is too noisy to choose
# well: the choice then costs up to ~5 points (iPhone XS) where log_work alone happens to win.
TOLERANCE = {5: (0.06, 1.30), 10: (0.02, 1.10), 20: (0.02, 1.10)}


@pytest.mark.parametrize("k", sorted(TOLERANCE))
@pytest.mark.parametrize("device_column", ["s10_cpu_ms", "mi8se_cpu_ms", "iphonexs_cpu_ms"])
def test_never_meaningfully_worse_than_the_simple_candidates(device_column: str, k: int) -> None:
    """Over 40 draws the chosen fit keeps close to the better of the two simple fits (TOLERANCE)."""
    scores = held_out_scores(device_column, k, draws=40, seed=k)
    best_within = max(scores["log"][0], scores["log_work"][0])
    best_mape = min(scores["log"][1], scores["log_work"][1])
    chosen_within, chosen_mape = scores["chosen"]
    points, ratio = TOLERANCE[k]
    assert chosen_within >= best_within - points, scores
    assert chosen_mape <= ratio * best_mape, scores


def test_choice_and_runner_up_are_reported() -> None:
    data = qed_columns()
    pairs = [Pair(f"m{i}", data[SIM][i], data["iphonexs_cpu_ms"][i], features={"FLOPS": data["FLOPS"][i]})
             for i in range(12)]
    calibration = calibrate(pairs, features=["FLOPS"])
    choice = calibration.choice
    assert calibration.chosen in choice.errors and choice.runner_up in choice.errors
    assert choice.runner_up != calibration.chosen and calibration.runner_up is not None
    assert "leave-one-out" in choice.criterion
    work = calibration.fits["log_work"]
    assert work.features_used == ["FLOPS"] and "FLOPS^" in work.formula
    errors = choice.errors
    assert all(0 < value < 1 for value in errors.values())
    assert json_round_trip(calibration).choice == choice


def json_round_trip(calibration):  # type: ignore[no-untyped-def]
    from farm.controller.analysis.calibration import Calibration
    return Calibration.from_json(calibration.to_json())


def test_cpu_to_gpu_stays_unsafe_whatever_features_are_offered() -> None:
    """Pixel 4 CPU → Pixel 4 GPU: the sim does not track the device. In every draw where the sim
    alone is called unsafe, offering features (which may fit the k models well by chance) keeps it
    unsafe; over 40 draws at k = 10 at least 85 % are unsafe (35/40 on this 300-model subset)."""
    data = qed_columns()
    sim, device = data[SIM], data["pixel4_gpu_ms"]
    generator = np.random.default_rng(7)
    unsafe = dict.fromkeys(FEATURE_SETS, 0)
    for _ in range(40):
        picked = generator.choice(sim.size, size=10, replace=False)
        verdicts = {}
        for features in FEATURE_SETS:
            pairs = [Pair(f"m{i}", sim[i], device[i], features={name: data[name][i] for name in features})
                     for i in picked]
            verdicts[features] = calibrate(pairs, features=list(features)).unsafe
            unsafe[features] += verdicts[features]
        assert all(verdicts.values()) or not verdicts[()], verdicts
    assert all(count >= 34 for count in unsafe.values()), unsafe


def test_without_flops_no_log_work_fit() -> None:
    data = qed_columns()
    pairs = [Pair(f"m{i}", data[SIM][i], data["s10_cpu_ms"][i], features={"size": data["size"][i]})
             for i in range(10)]
    calibration = calibrate(pairs, features=["size"])
    assert "log_work" not in calibration.fits and calibration.chosen in ("log", "log_ridge", "log_bayes")
    nonpositive = [Pair(p.model, p.x, p.y, features={"FLOPS": 0.0 if i == 0 else 1e9 + i}) for i, p in enumerate(pairs)]
    assert "log_work" not in calibrate(nonpositive, features=["FLOPS"]).fits  # log 0 is no feature


def test_suggested_models_beat_random_choice() -> None:
    """From a candidate list of 150 models measured in the sim, the 10 `suggest_models` picks
    calibrate better than 10 random ones (held-out share within ±10 %, 20 lists, Mi 8 SE and A03s)."""
    from farm.controller.analysis.calibration import suggest_models

    data = qed_columns()
    sim = data[SIM]
    generator = np.random.default_rng(11)
    gains = []
    for device_column in ("mi8se_cpu_ms", "a03s_cpu_ms"):
        device = data[device_column]
        for _ in range(20):
            pool = generator.choice(sim.size, size=150, replace=False)
            candidates = [Pair(f"m{i}", sim[i], math.nan, features={"FLOPS": data["FLOPS"][i]}) for i in pool]
            suggested = [int(name[1:]) for name in suggest_models(candidates, 10, features=["FLOPS"])]
            assert len(set(suggested)) == 10 and set(suggested) <= set(pool.tolist())
            shares = []
            for picked in (suggested, generator.choice(pool, size=10, replace=False).tolist()):
                held = np.ones(sim.size, dtype=bool)
                held[picked] = False
                calibration = calibrate([Pair(f"m{i}", sim[i], device[i], features={"FLOPS": data["FLOPS"][i]})
                                         for i in picked], features=["FLOPS"])
                estimate, _, _ = calibration.chosen_fit.predict_arrays(sim[held], {"FLOPS": data["FLOPS"][held]})
                shares.append(float(np.mean(np.abs(estimate - device[held]) / device[held] <= 0.10)))
            gains.append(shares[0] - shares[1])
    assert np.mean(gains) >= 0.03, np.mean(gains)


def test_suggest_counts_what_is_measured_and_refuses_bad_input() -> None:
    from farm.controller.analysis.calibration import suggest_models

    candidates = [Pair(f"m{i}", float(x), math.nan) for i, x in enumerate([1, 2, 4, 8, 16, 32, 64])]
    # issue 31: the design reduces the predictive variance over the candidates (not D-optimal): the middle
    # of the sim range first, then its ends — representative, not only extreme (was: the two ends)
    assert suggest_models(candidates, 1) == ["m3"] and set(suggest_models(candidates, 3)) == {"m0", "m3", "m6"}
    measured = [Pair("a", 1.0, 2.0), Pair("b", 1.1, 2.2)]
    assert suggest_models(candidates, 1, measured=measured) == ["m6"]  # the low end is known: the far end
    for count in (0, -1, 8):
        with pytest.raises(ValueError, match="suggest"):
            suggest_models(candidates, count)
    for bad in (math.nan, math.inf, 0.0, -3.0):
        with pytest.raises(ValueError, match="'bad'"):
            suggest_models([*candidates, Pair("bad", bad, math.nan)], 2)
    with pytest.raises(CalibrationInputError, match="FLOPS"):
        suggest_models(candidates, 2, features=["FLOPS"])


def test_python_api_suggest() -> None:
    from farm.api import suggest

    candidates = [{"model": f"m{i}", "x": x, "flops": 1e8 * x} for i, x in enumerate([1, 2, 4, 8, 16])]
    # m0 is what "a" already measured: the pick lies away from it (issue 31's design: m3, was the far end m4)
    assert suggest(candidates, 1, features=["flops"], measured=[{"model": "a", "x": 1.0, "flops": 1e8}]) in (["m3"], ["m4"])
    with pytest.raises(ValueError, match="1 to 5"):
        suggest(candidates, 6)


def test_a_prior_from_elsewhere_makes_log_ridge_the_reference() -> None:
    """With a prior learned on 20 other models (the device's previous version), log_ridge is the
    reference of the choice, and over 30 draws at k = 5 the choice beats log_work known in hindsight."""
    from farm.controller.analysis.calibration import Prior

    data = qed_columns()
    sim, device = data[SIM], data["s10_cpu_ms"]
    generator = np.random.default_rng(3)
    shares: dict[str, list[float]] = {"chosen": [], "log_work": []}
    for _ in range(30):
        picked = generator.choice(sim.size, size=25, replace=False)
        pairs = [Pair(f"m{i}", sim[i], device[i], features={"FLOPS": data["FLOPS"][i]}) for i in picked]
        previous = calibrate(pairs[5:], features=["FLOPS"])
        prior = Prior.from_fits([previous.fits["log_ridge"]], ["FLOPS"], "previous version")
        calibration = calibrate(pairs[:5], features=["FLOPS"], prior=prior)
        assert "without the prior" in calibration.choice.criterion
        held = np.ones(sim.size, dtype=bool)
        held[picked] = False
        for kind in shares:
            fit = calibration.chosen_fit if kind == "chosen" else calibration.fits[kind]
            estimate, _, _ = fit.predict_arrays(sim[held], {"FLOPS": data["FLOPS"][held]})
            shares[kind].append(float(np.mean(np.abs(estimate - device[held]) / device[held] <= 0.10)))
    assert np.mean(shares["chosen"]) > np.mean(shares["log_work"]) + 0.03, {k: np.mean(v) for k, v in shares.items()}
