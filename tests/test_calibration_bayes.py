"""Issue 31: the Bayesian log-linear default (log_bayes), features by role, no kind winning by luck,
calibrated intervals and the extrapolation verdict.

Data: tests/data/calibration_qed_phones_300.csv (300 qed NAS CNNs, see its .md), Pixel 4 big core as the sim.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from farm.controller.analysis.calibration import (
    DEVICE_CLASSES,
    RICH_MIN_MODELS,
    Calibration,
    Pair,
    calibrate,
    feature_role,
    predict_rows,
    shipped_class_priors,
)

QED_CSV = Path(__file__).parent / "data" / "calibration_qed_phones_300.csv"
SIM = "pixel4_cpu_ms"
CPU_DEVICES = ("s10_cpu_ms", "mi8se_cpu_ms", "iphonexs_cpu_ms")


def columns() -> dict[str, np.ndarray]:
    with QED_CSV.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    return {c: np.array([float(r[c]) for r in rows]) for c in rows[0] if c != "model"}


def pairs_of(data: dict[str, np.ndarray], device: str, picked: np.ndarray, work: str = "FLOPS") -> list[Pair]:
    return [Pair(f"m{i}", data[SIM][i], data[device][i], features={work: data["FLOPS"][i], "size": data["size"][i]})
            for i in picked]


def test_features_are_recognised_by_role_not_exact_name() -> None:
    assert feature_role("flops_total") == "work" and feature_role("FLOPS") == "work" and feature_role("gmacs") == "work"
    assert feature_role("depthwise_macs_share") == "share" and feature_role("conv1x1_flops_fraction") == "share"
    assert feature_role("size_bytes") == "size" and feature_role("param_count") == "size"
    assert feature_role("activation_bytes") == "activation" and feature_role("op_count") == "layers"
    assert feature_role("note") is None
    data = columns()
    picked = np.arange(12)
    # a FLOPs column named otherwise still feeds the 3-term kind and the Bayesian default
    calibration = calibrate(pairs_of(data, "s10_cpu_ms", picked, work="flops_total"), features=["flops_total", "size"])
    assert "log_work" in calibration.fits and calibration.fits["log_work"].features_used == ["flops_total"]
    assert calibration.fits["log_bayes"].features_used[0] == "flops_total"


def test_shipped_prior_is_one_gaussian_per_device_class() -> None:
    priors = shipped_class_priors()
    assert set(priors) == set(DEVICE_CLASSES)
    single, gpu = priors["single_core"], priors["gpu"]
    assert 0.85 <= single.mean[0] <= 1.2  # a single big core scales with the sim nearly in proportion
    assert abs(single.mean[0] - gpu.mean[0]) > 0.3  # a GPU does not
    assert single.covariance[0][0] < 0.1  # not the spread of every class pooled (0.33 when pooled)


def test_log_bayes_is_the_default_and_the_choice_names_a_runner_up() -> None:
    data = columns()
    calibration = calibrate(pairs_of(data, "s10_cpu_ms", np.arange(10)), features=["FLOPS", "size"])
    assert calibration.chosen == "log_bayes"
    fit = calibration.chosen_fit
    assert fit.device_class == "single_core" and "by evidence" in (fit.prior_source or "")
    assert calibration.choice.runner_up not in (None, "log_bayes")
    restored = Calibration.from_json(json.loads(json.dumps(calibration.to_json())))
    assert restored.chosen_fit.device_class == "single_core" and restored.chosen_fit.ranges == fit.ranges
    given = calibrate(pairs_of(data, "s10_cpu_ms", np.arange(10)), features=["FLOPS", "size"], device_class="gpu")
    assert given.fits["log_bayes"].device_class == "gpu" and "given" in (given.fits["log_bayes"].prior_source or "")


def test_a_rich_fit_never_wins_below_the_size_it_needs() -> None:
    """ols with a feature fits these 10 models far better than any log kind (device = sim + 5·feature),
    but it has three free coefficients chosen on its own error: below RICH_MIN_MODELS it is not offered."""
    generator = np.random.default_rng(4)
    sim = generator.uniform(5, 50, 30)
    extra = generator.uniform(1, 20, 30)
    device = sim + 5 * extra
    small = calibrate([Pair(f"m{i}", sim[i], device[i], features={"extra": extra[i]}) for i in range(10)],
                      features=["extra"])
    assert small.fits["ols"].features_used == ["extra"] and small.fits["ols"].loo_mape < 1e-6
    assert small.chosen != "ols" and "ols" in small.choice.not_offered
    large = calibrate([Pair(f"m{i}", sim[i], device[i], features={"extra": extra[i]}) for i in range(RICH_MIN_MODELS)],
                      features=["extra"])
    assert large.chosen == "ols"  # with enough models it may win


def test_chosen_fit_90_percent_intervals_cover_85_to_95_percent() -> None:
    """Over 40 draws of k = 10 calibration models per CPU pair, the chosen fit's 90 % interval covers the
    other 290 models 85–95 % of the time over the pairs together (measured 92 %), and no pair is off by
    more than 3 points more (measured per pair: 89–95 %)."""
    data = columns()
    generator = np.random.default_rng(11)
    every = []
    for device in CPU_DEVICES:
        covered = []
        for _ in range(40):
            picked = generator.choice(300, size=10, replace=False)
            held = np.setdiff1d(np.arange(300), picked)
            calibration = calibrate(pairs_of(data, device, picked), features=["FLOPS", "size"])
            _, low, high = calibration.chosen_fit.predict_arrays(
                data[SIM][held], {"FLOPS": data["FLOPS"][held], "size": data["size"][held]}, 0.9)
            truth = data[device][held]
            covered.append(float(np.mean((truth >= low) & (truth <= high))))
        assert 0.82 <= np.mean(covered) <= 0.98, (device, np.mean(covered))
        every += covered
    assert 0.85 <= np.mean(every) <= 0.95, np.mean(every)


def test_a_model_ten_times_outside_the_range_is_always_flagged() -> None:
    data = columns()
    generator = np.random.default_rng(5)
    for _ in range(20):
        picked = generator.choice(300, size=10, replace=False)
        calibration = calibrate(pairs_of(data, "mi8se_cpu_ms", picked), features=["FLOPS", "size"])
        fit = calibration.chosen_fit
        inside = picked[0]
        features = {"FLOPS": data["FLOPS"][inside], "size": data["size"][inside]}
        ok = calibration.predict(data[SIM][inside], features)
        assert ok.verdict == "ok" and ok.extrapolation == ()
        for x, flops in ((10 * data[SIM][picked].max(), features["FLOPS"]),
                         (data[SIM][picked].min() / 10, features["FLOPS"]),
                         (data[SIM][inside], 10 * data["FLOPS"][picked].max())):
            far = calibration.predict(x, {**features, "FLOPS": flops})
            assert far.verdict == "extrapolating", (x, flops, fit.ranges)
            (entry, *_) = far.extrapolation
            assert entry.low < entry.high and not entry.low <= entry.value <= entry.high
        # the interval is wider than the fit's own would be at that point
        x_far = 10 * data[SIM][picked].max()
        wide = calibration.predict(x_far, features)
        saved = fit.ranges
        fit.ranges = {}
        plain = calibration.predict(x_far, features)
        fit.ranges = saved
        assert np.log(wide.high / wide.low) >= 1.5 * np.log(plain.high / plain.low)


def test_predict_rows_carry_the_verdict_and_honour_the_confidence() -> None:
    data = columns()
    calibration = calibrate(pairs_of(data, "s10_cpu_ms", np.arange(10)), features=["FLOPS", "size"])
    rows = [{"model": "in", "x": str(data[SIM][0]), "FLOPS": str(data["FLOPS"][0]), "size": str(data["size"][0])},
            {"model": "out", "x": str(100 * data[SIM][:10].max()), "FLOPS": str(data["FLOPS"][0]),
             "size": str(data["size"][0])}]
    at_90 = predict_rows(calibration, rows)
    at_50 = predict_rows(calibration, rows, confidence=0.5)
    assert [r["verdict"] for r in at_90] == ["ok", "extrapolating"] and "sim" in at_90[1]["extrapolation"]
    assert at_50[0]["high"] - at_50[0]["low"] < at_90[0]["high"] - at_90[0]["low"]
    with pytest.raises(ValueError):
        predict_rows(calibration, rows, confidence=1.5)


def test_cpu_to_gpu_is_called_unsafe() -> None:
    data = columns()
    generator = np.random.default_rng(6)
    unsafe = [calibrate(pairs_of(data, "pixel4_gpu_ms", generator.choice(300, size=10, replace=False)),
                        features=["FLOPS", "size"]).unsafe for _ in range(20)]
    assert np.mean(unsafe) >= 0.9


def test_other_devices_fits_join_their_class_prior() -> None:
    """The store's other devices (lab_class_priors) widen or narrow a class prior with their log_bayes fits."""
    data = columns()
    fit = calibrate(pairs_of(data, "s10_cpu_ms", np.arange(40)), features=["FLOPS", "size"]).fits["log_bayes"]
    single = shipped_class_priors()["single_core"]
    joined = single.with_fits([fit], "device(s) in this store")
    assert joined.devices == single.devices + 1 and joined.mean != single.mean


def _stored(calibration: Calibration, version: int):
    from farm.controller.analysis.calibrations import CalibrationSource, StoredCalibration

    return StoredCalibration(id=version, device="phone-1", metric="latency", threads=1, runtime="litert", family="",
                             version=version, calibration=calibration, source=CalibrationSource())


def test_drift_compares_like_with_like() -> None:
    """Issue 32: an unchanged device calibrated on other models (a hand-made first version) raises nothing:
    the line is compared only over models both measured, predictions only inside the old fit's range;
    a device twice as slow on the same models is drift, and the reason says what it was computed on."""
    from farm.controller.operations.refresh import DriftThresholds, drift_between

    data = columns()
    device = "s10_cpu_ms"
    small = calibrate(pairs_of(data, device, np.argsort(data[SIM])[:8]), features=["FLOPS", "size"])  # small models
    other = calibrate(pairs_of(data, device, np.argsort(data[SIM])[100:112]), features=["FLOPS", "size"])
    quiet = drift_between(_stored(small, 1), _stored(other, 2), DriftThresholds())
    assert not quiet.exceeded, quiet.reasons
    same = np.arange(12)
    before = calibrate(pairs_of(data, device, same), features=["FLOPS", "size"])
    slower = [Pair(p.model, p.x, 2 * p.y, features=p.features) for p in pairs_of(data, device, same)]
    after = calibrate(slower, features=["FLOPS", "size"])
    moved = drift_between(_stored(before, 1), _stored(after, 2), DriftThresholds())
    assert moved.exceeded and any("12 model(s) both measured" in r for r in moved.reasons), moved.reasons
    assert any(r.startswith("prediction_shift") and "inside the old fit's range" in r for r in moved.reasons)


def test_the_1x1_share_a_stored_run_carries_enters_the_default_fit_by_role() -> None:
    """farm inspect's 1×1 share (issue 31 item 1) reaches calibrations: a results record's model offers it,
    log_bayes takes it as a share, and a device whose time per FLOP differs on 1×1 convs is predicted better
    with it than without (the law below: 1×1 work 40 % cheaper per unit of sim time, 2 % noise)."""
    from farm.controller.analysis.calibrations import FEATURES, model_features

    assert "conv1x1_macs_share" in FEATURES and feature_role("conv1x1_macs_share") == "share"
    record_model = {"name": "m", "macs": 3e8, "size_bytes": 4e6, "conv1x1_macs_share": 0.55,
                    "depthwise_macs_share": 0.05, "conv3x3_macs_share": 0.1}
    assert model_features(record_model)["conv1x1_macs_share"] == 0.55
    generator = np.random.default_rng(7)
    n = 300
    sim = generator.uniform(5, 80, n)
    share = generator.uniform(0.0, 0.9, n)
    macs = sim * 1e7 * generator.uniform(0.7, 1.3, n)
    device = 1.8 * sim * np.exp(-0.5 * share) * np.exp(generator.normal(0, 0.02, n))
    picked, held = np.arange(12), np.arange(12, n)

    def within(names: list[str]) -> float:
        pairs = [Pair(f"m{i}", sim[i], device[i], features={"macs": macs[i], "conv1x1_macs_share": share[i]})
                 for i in picked]
        calibration = calibrate(pairs, features=names)
        fit = calibration.fits["log_bayes"]
        estimate, _, _ = fit.predict_arrays(sim[held], {name: {"macs": macs, "conv1x1_macs_share": share}[name][held]
                                                        for name in fit.features_used}, 0.9)
        if "conv1x1_macs_share" in names:
            assert "conv1x1_macs_share" in fit.features_used and fit.feature_transforms["conv1x1_macs_share"] == "linear"
        return float(np.mean(np.abs(estimate - device[held]) / device[held] <= 0.10))

    assert within(["macs", "conv1x1_macs_share"]) > within(["macs"]) + 0.2
