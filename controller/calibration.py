"""Per-device calibration: turn sim measurements into device estimates, and say how far to trust them.

A calibration maps a sim value x (latency, memory, … measured in the constrained sandbox) to a
device value y for one device × metric (× threads × runtime × precision × family — grouping is the
caller's business). Three fit kinds are computed and all are reported; the one with the lowest
leave-one-out MAPE is chosen:

``ols``
    Ordinary least squares, ``y = a·x + b`` — the published method. Optional extra regressors
    (model features such as ``param_count``) enter its design matrix only where leave-one-out says
    they cut the error. Prediction interval: the classic t-based interval with leverage,
    ``ŷ ± t(n−p) · s · √(1 + x₀ᵀ(XᵀX)⁻¹x₀)``.
``log``
    Least squares in log space, ``log y = log b + a·log x``, i.e. the power law ``y = b·x^a``
    (``a`` is the exponent, ``b`` the factor). Predictions are back-transformed with ``exp``, so
    the estimate is the geometric-mean (median) prediction. Interval: the classic t-interval in log
    space, back-transformed (asymmetric on the original scale, proportional to the estimate).
``robust``
    Theil–Sen (``scipy.stats.theilslopes``, joint intercept = median of ``y − a·x``), which ignores
    up to ~29 % outliers. Interval: the OLS-form t-interval with leverage, centred on the Theil–Sen
    line, with ``s`` the root-mean-square residual about that line (n−2 degrees of freedom). Points
    the line ignores still widen the interval, because a new model may be such an outlier too.
    Above ``THEIL_SEN_EXACT_LIMIT`` pairs the slope is the median of a fixed-seed random sample of
    ``THEIL_SEN_SAMPLED_PAIRS`` pairwise slopes; above ``ROBUST_EXACT_LOO_LIMIT`` pairs its
    leave-one-out residuals are approximated as ``e_i / (1 − h_ii)`` with the OLS leverages (one
    point moves a median of ~n²/2 slopes very little); a warning says so and ``loo_exact`` is False.

For every kind: ``r2`` is ``1 − SS_res/SS_tot`` of the kind's predictions on the *original* scale
(for OLS without features this equals the squared Pearson correlation); ``loo_mape`` and
``loo_within_10`` come from exact leave-one-out refits (closed form via the hat matrix for the least
squares kinds) and are fractions (0.05 = 5 %); ``residual_std`` is the residual spread in the fit's
own space (original units for ols/robust, natural-log units — roughly a relative spread — for log),
the ``s`` used by its intervals.

Pure library: numpy and scipy only; the store and the CLI live elsewhere.
"""

from __future__ import annotations

import csv
import math
import warnings as python_warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy import linalg, stats

FIT_KINDS: tuple[str, ...] = ("ols", "log", "robust")
JSON_FORMAT = "farm.calibration/1"
WITHIN_SHARE = 0.10  # "within ±10 %" as in nn-Meter / HELP reporting
MAX_LISTED_FLIPS = 1000  # longer flip lists are counted, not listed, to keep calibrations small
ALL_PAIR_FLIPS_LIMIT = 2000  # above it observed flips are looked for among sim-adjacent models only
THEIL_SEN_EXACT_LIMIT = 2000  # scipy's exact Theil–Sen needs all n²/2 slopes in memory
THEIL_SEN_SAMPLED_PAIRS = 1_000_000
ROBUST_EXACT_LOO_LIMIT = 200
# A feature must cut the OLS leave-one-out MAPE by this share to be kept. A pure-noise column
# still gets in by chance in ~10 % of draws at n = 10, ~4 % at n = 20 (2 % with no threshold: ~20 %).
FEATURE_MIN_RELATIVE_GAIN = 0.10  # exact robust LOO is n refits of an O(n² log n) estimator
_SAMPLING_SEED = 20211206  # fixed so a sampled Theil–Sen fit is reproducible


class NotEnoughPairs(ValueError):
    """Too few distinct models (or distinct sim values) to fit and validate a calibration."""

    def __init__(self, needed: int, have: int, what: str = "pairs (distinct models)") -> None:
        super().__init__(f"calibration needs at least {needed} {what}, have {have}")
        self.needed = needed
        self.have = have


class CalibrationInputError(ValueError):
    """Bad input data: the message names the file, line and column (or the model and field)."""


@dataclass
class Pair:
    """One model measured in the sim (x) and on the device (y)."""

    model: str
    x: float
    y: float
    family: str | None = None
    features: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Prediction:
    """A device estimate with its prediction interval at the requested confidence."""

    estimate: float
    low: float
    high: float


@dataclass(frozen=True)
class Flip:
    """Two models whose device order may differ (possible) or differs (observed) from the sim order.

    ``first`` ranks below ``second`` in the sim order (for possible flips: in the predicted order).
    """

    first: str
    second: str


@dataclass
class FitResult:
    """One fit kind's coefficients, quality figures and everything needed to predict with intervals."""

    kind: str
    a: float  # slope of x (ols, robust) or exponent (log)
    b: float  # intercept (ols, robust) or factor (log)
    r2: float  # 1 − SS_res/SS_tot on the original scale
    n: int  # distinct models used
    loo_mape: float  # fraction
    loo_within_10: float  # share of leave-one-out predictions within ±10 %
    residual_std: float  # in the fit's own space; the s of the intervals
    kendall_tau: float  # sim order vs device order (τ-b)
    spearman_rho: float
    possible_flips: list[Flip]
    observed_flips: list[Flip]
    features_used: list[str] = field(default_factory=list)
    loo_mape_without_features: float | None = None  # None when no features were offered
    possible_flip_count: int = 0  # may exceed len(possible_flips) (listing is capped)
    observed_flip_count: int = 0
    loo_exact: bool = True  # False when the robust LOO was approximated (large n)
    # The interval model, a linear model in the fit space over columns [1, x or log x, *features]:
    log_space: bool = False
    coefficients: list[float] = field(default_factory=list)  # for the scaled columns
    column_scale: list[float] = field(default_factory=list)  # columns are divided by these
    covariance_factor: list[list[float]] = field(default_factory=list)  # (X_sᵀ X_s)⁻¹
    dof: int = 1  # degrees of freedom of the t quantile

    @property
    def formula(self) -> str:
        """The fit as a human-readable equation (for the log kind with its log-space form too)."""
        if self.log_space:
            log_factor = self.coefficients[0] / self.column_scale[0]
            return f"y = {self.b:.4g}·x^{self.a:.4g}  (log y = {log_factor:.4g} + {self.a:.4g}·log x)"
        terms = f"y = {self.a:.4g}·x {'−' if self.b < 0 else '+'} {abs(self.b):.4g}"
        for index, name in enumerate(self.features_used):
            coefficient = self.coefficients[2 + index] / self.column_scale[2 + index]
            terms += f" {'−' if coefficient < 0 else '+'} {abs(coefficient):.4g}·{name}"
        return terms

    def predict(self, x: float, features: Mapping[str, float] | None = None,
                confidence: float = 0.9) -> Prediction:
        """Device estimate and prediction interval for one sim value (features as used by the fit)."""
        feature_arrays = {name: np.asarray([value], dtype=float) for name, value in (features or {}).items()}
        estimate, low, high = self.predict_arrays(np.asarray([x], dtype=float), feature_arrays, confidence)
        return Prediction(float(estimate[0]), float(low[0]), float(high[0]))

    def predict_arrays(self, x: Sequence[float] | np.ndarray,
                       features: Mapping[str, Sequence[float] | np.ndarray] | None = None,
                       confidence: float = 0.9) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Vectorised :meth:`predict`: arrays of estimates, lows and highs."""
        _check_confidence(confidence)
        sim = np.atleast_1d(np.asarray(x, dtype=float))
        if self.log_space and np.any(sim <= 0):
            raise ValueError("the log fit needs sim values > 0")
        columns = [np.ones_like(sim), np.log(sim) if self.log_space else sim]
        for name in self.features_used:
            if features is None or name not in features:
                raise ValueError(f"this {self.kind} fit uses feature {name!r}: pass it to predict")
            columns.append(np.broadcast_to(np.asarray(features[name], dtype=float), sim.shape))
        design = np.column_stack(columns) / np.asarray(self.column_scale)
        centre = design @ np.asarray(self.coefficients)
        leverage = np.einsum("ij,jk,ik->i", design, np.asarray(self.covariance_factor), design)
        half_width = _t_quantile(confidence, self.dof) * self.residual_std * np.sqrt(1.0 + leverage)
        low, high = centre - half_width, centre + half_width
        if self.log_space:
            return np.exp(centre), np.exp(low), np.exp(high)
        return centre, low, high

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types; NaN becomes null."""
        return {
            "kind": self.kind, "a": _nan_to_none(self.a), "b": _nan_to_none(self.b),
            "r2": _nan_to_none(self.r2), "n": self.n, "loo_mape": _nan_to_none(self.loo_mape),
            "loo_within_10": _nan_to_none(self.loo_within_10),
            "residual_std": _nan_to_none(self.residual_std),
            "kendall_tau": _nan_to_none(self.kendall_tau), "spearman_rho": _nan_to_none(self.spearman_rho),
            "possible_flips": [[f.first, f.second] for f in self.possible_flips],
            "observed_flips": [[f.first, f.second] for f in self.observed_flips],
            "features_used": list(self.features_used),
            "loo_mape_without_features": self.loo_mape_without_features,
            "possible_flip_count": self.possible_flip_count, "observed_flip_count": self.observed_flip_count,
            "loo_exact": self.loo_exact, "log_space": self.log_space,
            "coefficients": list(self.coefficients), "column_scale": list(self.column_scale),
            "covariance_factor": [list(row) for row in self.covariance_factor], "dof": self.dof,
            "formula": self.formula,  # informational; recomputed on read
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FitResult:
        return cls(
            kind=data["kind"], a=_none_to_nan(data["a"]), b=_none_to_nan(data["b"]),
            r2=_none_to_nan(data["r2"]), n=int(data["n"]), loo_mape=_none_to_nan(data["loo_mape"]),
            loo_within_10=_none_to_nan(data["loo_within_10"]),
            residual_std=_none_to_nan(data["residual_std"]),
            kendall_tau=_none_to_nan(data["kendall_tau"]), spearman_rho=_none_to_nan(data["spearman_rho"]),
            possible_flips=[Flip(first, second) for first, second in data["possible_flips"]],
            observed_flips=[Flip(first, second) for first, second in data["observed_flips"]],
            features_used=list(data["features_used"]),
            loo_mape_without_features=data["loo_mape_without_features"],
            possible_flip_count=int(data["possible_flip_count"]),
            observed_flip_count=int(data["observed_flip_count"]),
            loo_exact=bool(data["loo_exact"]), log_space=bool(data["log_space"]),
            coefficients=[float(v) for v in data["coefficients"]],
            column_scale=[float(v) for v in data["column_scale"]],
            covariance_factor=[[float(v) for v in row] for row in data["covariance_factor"]],
            dof=int(data["dof"]),
        )


@dataclass
class Calibration:
    """All fits of one device × metric group, the chosen one, and the warnings a user must see.

    ``pairs`` are the pairs the fits used: one per model, repeats already averaged.
    """

    chosen: str
    fits: dict[str, FitResult]
    warnings: list[str]
    pairs: list[Pair]
    confidence: float

    @property
    def chosen_fit(self) -> FitResult:
        return self.fits[self.chosen]

    def predict(self, x: float, features: Mapping[str, float] | None = None,
                kind: str | None = None) -> Prediction:
        """Predict with the chosen fit (or ``kind``) at this calibration's confidence."""
        return self.fit(kind).predict(x, features, self.confidence)

    def fit(self, kind: str | None = None) -> FitResult:
        """The fit of ``kind``, or the chosen one; a clear error for a kind that was not fitted."""
        if kind is None:
            return self.chosen_fit
        if kind not in self.fits:
            raise ValueError(f"this calibration has no {kind!r} fit (it has {', '.join(self.fits)})")
        return self.fits[kind]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": JSON_FORMAT,
            "chosen": self.chosen,
            "confidence": self.confidence,
            "warnings": list(self.warnings),
            "fits": {kind: fit.to_json() for kind, fit in self.fits.items()},
            "pairs": [{"model": p.model, "x": float(p.x), "y": float(p.y), "family": p.family,
                       "features": {name: float(value) for name, value in p.features.items()}}
                      for p in self.pairs],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Calibration:
        if data.get("format") != JSON_FORMAT:
            raise CalibrationInputError(
                f"not a farm calibration: format is {data.get('format')!r}, expected {JSON_FORMAT!r}")
        fits = {kind: FitResult.from_json(fit) for kind, fit in data["fits"].items()}
        if data["chosen"] not in fits:
            raise CalibrationInputError(f"calibration chooses {data['chosen']!r}, which has no fit")
        pairs = [Pair(model=p["model"], x=float(p["x"]), y=float(p["y"]), family=p.get("family"),
                      features={k: float(v) for k, v in p.get("features", {}).items()})
                 for p in data["pairs"]]
        return cls(chosen=data["chosen"], fits=fits, warnings=list(data["warnings"]), pairs=pairs,
                   confidence=float(data["confidence"]))


# ----------------------------------------------------------------------------------------------
# Fitting


def calibrate(pairs: Iterable[Pair], *, kinds: Sequence[str] = FIT_KINDS, confidence: float = 0.9,
              min_pairs: int = 4, unsafe_rho: float = 0.9, features: Sequence[str] = ()) -> Calibration:
    """Fit every kind in ``kinds`` to the pairs and choose the one with the lowest leave-one-out MAPE.

    Pairs with the same model name are repeats: their x, y and features are averaged into one pair
    per model before fitting (a warning says how many models had repeats), so ``n`` counts models.
    ``features`` names entries of ``Pair.features`` offered to the OLS fit as extra regressors;
    greedy forward selection keeps one only if it lowers the OLS leave-one-out MAPE by at least
    ``FEATURE_MIN_RELATIVE_GAIN`` (10 %) relative, and only while ≥ 2 residual degrees of freedom remain.

    Raises :class:`NotEnoughPairs` with fewer than ``min_pairs`` models or fewer than 3 distinct sim
    values, and ``ValueError`` for non-finite values or a bad argument. Warns (in
    ``Calibration.warnings``) when Spearman ρ < ``unsafe_rho``, when the log kind is skipped for
    non-positive values, and when a figure had to be approximated or truncated.
    """
    _check_confidence(confidence)
    unknown = [kind for kind in kinds if kind not in FIT_KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown fit kind(s) {unknown}; choose from {list(FIT_KINDS)}")
    if min_pairs < 3:
        raise ValueError("min_pairs must be at least 3: a line plus an interval needs one spare point")

    warnings: list[str] = []
    merged = _average_repeats(list(pairs), warnings)
    if len(merged) < min_pairs:
        raise NotEnoughPairs(min_pairs, len(merged))
    sim = np.array([p.x for p in merged], dtype=float)
    device = np.array([p.y for p in merged], dtype=float)
    names = [p.model for p in merged]
    for values, axis in ((sim, "sim (x)"), (device, "device (y)")):
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            raise ValueError(f"{axis} value of model {names[bad[0]]!r} is not a finite number")
    distinct_sim = np.unique(sim).size
    if distinct_sim < 3:
        raise NotEnoughPairs(3, distinct_sim, "distinct sim values")
    feature_matrix = _feature_columns(merged, features)

    with np.errstate(invalid="ignore", divide="ignore"), python_warnings.catch_warnings():
        # Constant device values give NaN ranks; the ρ warning below says so in farm's own words.
        python_warnings.simplefilter("ignore", stats.ConstantInputWarning)
        tau = float(stats.kendalltau(sim, device).statistic)
        rho = float(stats.spearmanr(sim, device).statistic)
    observed, observed_count = _observed_flips(sim, device, names, warnings)
    if not rho >= unsafe_rho:  # also catches NaN (constant device values)
        warnings.append(
            f"Spearman ρ = {rho:.3f} < {unsafe_rho:g} between sim and device order: a linear map is "
            f"unsafe for this device and metric (rankings and estimates from the sim may mislead)")
    zero_device = int(np.count_nonzero(device == 0))
    if zero_device:
        warnings.append(f"{zero_device} device value(s) are 0: left out of the MAPE and ±10 % figures")

    shared = _Shared(sim=sim, device=device, names=names, tau=tau, rho=rho, observed=observed,
                     observed_count=observed_count, confidence=confidence)
    fits: dict[str, FitResult] = {}
    for kind in kinds:
        if kind == "log":
            nonpositive = [names[i] for i in np.flatnonzero((sim <= 0) | (device <= 0))]
            if nonpositive:
                warnings.append(f"log fit skipped: {len(nonpositive)} pair(s) have non-positive values "
                                f"(e.g. {', '.join(nonpositive[:3])})")
                continue
            log_fit = _fit_log(shared, warnings)
            if log_fit is not None:
                fits[kind] = log_fit
        elif kind == "ols":
            fits[kind] = _fit_ols(shared, feature_matrix)
        else:
            fits[kind] = _fit_robust(shared, warnings)
    if not fits:
        raise ValueError(f"no fit kind could be fitted ({'; '.join(warnings[-1:])}): add 'ols' or 'robust' to kinds")
    chosen = min(fits, key=lambda k: fits[k].loo_mape if math.isfinite(fits[k].loo_mape) else math.inf)
    for fit in fits.values():
        if fit.possible_flip_count > len(fit.possible_flips):
            warnings.append(f"{fit.kind}: {fit.possible_flip_count} possible flips, the first "
                            f"{len(fit.possible_flips)} listed")
            break
    return Calibration(chosen=chosen, fits=fits, warnings=warnings, pairs=merged, confidence=confidence)


@dataclass
class _Shared:
    """What every fit kind of one calibration shares."""

    sim: np.ndarray
    device: np.ndarray
    names: list[str]
    tau: float
    rho: float
    observed: list[Flip]
    observed_count: int
    confidence: float


@dataclass
class _LinearModel:
    """A least squares fit on scaled columns, with what LOO and intervals need."""

    coefficients: np.ndarray
    column_scale: np.ndarray
    covariance_factor: np.ndarray
    residuals: np.ndarray
    leverage: np.ndarray


def _least_squares(columns: Sequence[np.ndarray], target: np.ndarray) -> _LinearModel | None:
    """QR least squares on max-abs-scaled columns (raw MACs next to ms would be ill-conditioned)."""
    design = np.column_stack(columns)
    scale = np.max(np.abs(design), axis=0)
    scale[scale == 0] = 1.0
    scaled = design / scale
    q, r = np.linalg.qr(scaled)
    diagonal = np.abs(np.diag(r))
    if diagonal.min() <= 1e-10 * diagonal.max():
        return None  # collinear columns: no unique fit
    coefficients = linalg.solve_triangular(r, q.T @ target)
    leverage = np.einsum("ij,ij->i", q, q)
    if leverage.max() > 1.0 - 1e-9:
        return None  # some point alone determines a coefficient: its LOO error is undefined
    r_inverse = linalg.solve_triangular(r, np.eye(r.shape[0]))
    return _LinearModel(coefficients=coefficients, column_scale=scale,
                        covariance_factor=r_inverse @ r_inverse.T,
                        residuals=target - scaled @ coefficients, leverage=leverage)


def _loo_errors(device: np.ndarray, loo_prediction: np.ndarray) -> tuple[float, float]:
    """(MAPE, share within ±10 %) as fractions, over the points with a non-zero device value."""
    usable = device != 0
    if not usable.any():
        return math.nan, math.nan
    relative = np.abs(loo_prediction[usable] - device[usable]) / np.abs(device[usable])
    relative = np.where(np.isfinite(relative), relative, np.inf)
    return float(np.mean(relative)), float(np.mean(relative <= WITHIN_SHARE))


def _r2(device: np.ndarray, fitted: np.ndarray) -> float:
    total = float(np.sum((device - device.mean()) ** 2))
    return 1.0 - float(np.sum((device - fitted) ** 2)) / total if total > 0 else math.nan


def _ols_loo_mape(model: _LinearModel, device: np.ndarray) -> float:
    # Closed-form leave-one-out residual e_i / (1 − h_ii).
    return _loo_errors(device, device - model.residuals / (1.0 - model.leverage))[0]


def _fit_ols(shared: _Shared, feature_matrix: dict[str, np.ndarray]) -> FitResult:
    sim, device = shared.sim, shared.device
    columns = [np.ones_like(sim), sim]
    model = _require_fit(_least_squares(columns, device))
    best_mape = _ols_loo_mape(model, device)
    baseline_mape = best_mape
    used: list[str] = []
    remaining = list(feature_matrix)
    while remaining and sim.size - (len(columns) + 1) >= 2:  # keep ≥ 2 residual degrees of freedom
        trials: dict[str, tuple[float, _LinearModel]] = {}
        for name in remaining:
            candidate = _least_squares([*columns, feature_matrix[name]], device)
            if candidate is not None:
                trials[name] = (_ols_loo_mape(candidate, device), candidate)
        if not trials:
            break
        name = min(trials, key=lambda n: trials[n][0])
        if not trials[name][0] < best_mape * (1.0 - FEATURE_MIN_RELATIVE_GAIN):
            break
        best_mape, model = trials[name]
        columns.append(feature_matrix[name])
        used.append(name)
        remaining.remove(name)
    loo_prediction = device - model.residuals / (1.0 - model.leverage)
    return _finish_fit("ols", shared, model, loo_prediction, log_space=False, features_used=used,
                       loo_mape_without_features=baseline_mape if feature_matrix else None,
                       feature_values={name: feature_matrix[name] for name in used})


def _require_fit(model: _LinearModel | None) -> _LinearModel:
    if model is None:
        raise ValueError("the sim values are too concentrated to fit and validate a line: leaving one model "
                         "out leaves the others with (almost) a single sim value; add models with other sim values")
    return model


def _fit_log(shared: _Shared, warnings: list[str]) -> FitResult | None:
    log_sim, log_device = np.log(shared.sim), np.log(shared.device)
    model = _least_squares([np.ones_like(log_sim), log_sim], log_device)
    if model is None:
        warnings.append("log fit skipped: in log space the sim values are too concentrated to fit and validate")
        return None
    loo_prediction = np.exp(log_device - model.residuals / (1.0 - model.leverage))
    return _finish_fit("log", shared, model, loo_prediction, log_space=True)


def _theil_sen(sim: np.ndarray, device: np.ndarray) -> tuple[float, float]:
    """(slope, intercept): exact via scipy when small, else from a fixed-seed sample of slopes."""
    if sim.size <= THEIL_SEN_EXACT_LIMIT:
        result = stats.theilslopes(device, sim, method="joint")
        return float(result.slope), float(result.intercept)
    generator = np.random.default_rng(_SAMPLING_SEED)
    first = generator.integers(0, sim.size, THEIL_SEN_SAMPLED_PAIRS)
    second = generator.integers(0, sim.size, THEIL_SEN_SAMPLED_PAIRS)
    run = sim[second] - sim[first]
    keep = run != 0
    slope = float(np.median((device[second][keep] - device[first][keep]) / run[keep]))
    return slope, float(np.median(device - slope * sim))


def _fit_robust(shared: _Shared, warnings: list[str]) -> FitResult:
    sim, device = shared.sim, shared.device
    slope, intercept = _theil_sen(sim, device)
    # The interval model: OLS geometry ((XᵀX)⁻¹, leverage) around the Theil–Sen line.
    geometry = _require_fit(_least_squares([np.ones_like(sim), sim], device))
    scale = geometry.column_scale
    geometry.coefficients = np.array([intercept * scale[0], slope * scale[1]])
    geometry.residuals = device - (intercept + slope * sim)
    exact = sim.size <= ROBUST_EXACT_LOO_LIMIT
    if exact:
        loo_prediction = np.empty_like(device)
        keep = np.ones(sim.size, dtype=bool)
        for index in range(sim.size):
            keep[index] = False
            loo_slope, loo_intercept = _theil_sen(sim[keep], device[keep])
            loo_prediction[index] = loo_intercept + loo_slope * sim[index]
            keep[index] = True
    else:
        # Approximate LOO residual e_i / (1 − h_ii) with the OLS leverages, as for a linear smoother.
        loo_prediction = device - geometry.residuals / (1.0 - geometry.leverage)
        warnings.append(f"robust: leave-one-out error approximated from the residuals and leverages "
                        f"({sim.size} pairs > {ROBUST_EXACT_LOO_LIMIT} exact refits)")
    return _finish_fit("robust", shared, geometry, loo_prediction, log_space=False, loo_exact=exact)


def _finish_fit(kind: str, shared: _Shared, model: _LinearModel, loo_prediction: np.ndarray, *,
                log_space: bool, features_used: Sequence[str] = (), loo_mape_without_features: float | None = None,
                feature_values: Mapping[str, np.ndarray] | None = None, loo_exact: bool = True) -> FitResult:
    """Compute the figures every kind reports, from its linear model in fit space."""
    parameter_count = model.coefficients.size
    dof = shared.sim.size - parameter_count
    residual_std = float(np.sqrt(np.sum(model.residuals ** 2) / dof))
    slope = float(model.coefficients[1] / model.column_scale[1])
    intercept = float(model.coefficients[0] / model.column_scale[0])
    fit = FitResult(
        kind=kind, a=slope, b=math.exp(intercept) if log_space else intercept, r2=math.nan, n=shared.sim.size,
        loo_mape=math.nan, loo_within_10=math.nan, residual_std=residual_std, kendall_tau=shared.tau,
        spearman_rho=shared.rho, possible_flips=[], observed_flips=list(shared.observed),
        features_used=list(features_used), loo_mape_without_features=loo_mape_without_features,
        observed_flip_count=shared.observed_count, loo_exact=loo_exact, log_space=log_space,
        coefficients=[float(v) for v in model.coefficients],
        column_scale=[float(v) for v in model.column_scale],
        covariance_factor=[[float(v) for v in row] for row in model.covariance_factor], dof=int(dof),
    )
    fit.loo_mape, fit.loo_within_10 = _loo_errors(shared.device, loo_prediction)
    estimate, low, high = fit.predict_arrays(shared.sim, feature_values, shared.confidence)
    fit.r2 = _r2(shared.device, estimate)
    fit.possible_flips, fit.possible_flip_count = _possible_flips(estimate, low, high, shared.names)
    return fit


# ----------------------------------------------------------------------------------------------
# Rank agreement


def _possible_flips(estimate: np.ndarray, low: np.ndarray, high: np.ndarray,
                    names: Sequence[str]) -> tuple[list[Flip], int]:
    """Models adjacent in predicted order whose prediction intervals overlap."""
    order = np.argsort(estimate, kind="stable")
    below, above = order[:-1], order[1:]
    # est_below ≤ est_above, so low_below ≤ high_above always: overlap iff low_above ≤ high_below.
    overlapping = np.flatnonzero(low[above] <= high[below])
    flips = [Flip(names[below[i]], names[above[i]]) for i in overlapping[:MAX_LISTED_FLIPS]]
    return flips, int(overlapping.size)


def _observed_flips(sim: np.ndarray, device: np.ndarray, names: Sequence[str],
                    warnings: list[str]) -> tuple[list[Flip], int]:
    """Pairs of models strictly ordered one way by the sim and the other way by the device."""
    order = np.argsort(sim, kind="stable")
    sim_sorted, device_sorted = sim[order], device[order]
    if sim.size <= ALL_PAIR_FLIPS_LIMIT:
        sim_step = np.sign(sim_sorted[None, :] - sim_sorted[:, None])
        device_step = np.sign(device_sorted[None, :] - device_sorted[:, None])
        lower, upper = np.nonzero(np.triu(sim_step * device_step < 0, k=1))
    else:
        lower = np.flatnonzero((np.diff(sim_sorted) > 0) & (np.diff(device_sorted) < 0))
        upper = lower + 1
        warnings.append(f"observed flips looked for among sim-adjacent models only ({sim.size} pairs > "
                        f"{ALL_PAIR_FLIPS_LIMIT})")
    flips = [Flip(names[order[i]], names[order[j]]) for i, j in zip(lower[:MAX_LISTED_FLIPS],
                                                                    upper[:MAX_LISTED_FLIPS])]
    if lower.size > MAX_LISTED_FLIPS:
        warnings.append(f"{lower.size} observed flips, the first {MAX_LISTED_FLIPS} listed")
    return flips, int(lower.size)


# ----------------------------------------------------------------------------------------------
# Input preparation


def _average_repeats(pairs: list[Pair], warnings: list[str]) -> list[Pair]:
    """One pair per model: x, y and each feature averaged over that model's repeats."""
    if len({pair.model for pair in pairs}) == len(pairs):
        return list(pairs)  # the common case, kept fast for 10⁶ pairs
    by_model: dict[str, list[Pair]] = {}
    for pair in pairs:
        by_model.setdefault(pair.model, []).append(pair)
    repeated = sum(1 for group in by_model.values() if len(group) > 1)
    warnings.append(f"{repeated} model(s) had repeated pairs: averaged to one pair per model")
    merged = []
    for model, group in by_model.items():
        if len(group) == 1:
            merged.append(group[0])
            continue
        feature_names = {name for pair in group for name in pair.features}
        features = {name: float(np.mean([p.features[name] for p in group if name in p.features]))
                    for name in sorted(feature_names)}
        family = next((p.family for p in group if p.family is not None), None)
        merged.append(Pair(model=model, x=float(np.mean([p.x for p in group])),
                           y=float(np.mean([p.y for p in group])), family=family, features=features))
    return merged


def _feature_columns(pairs: Sequence[Pair], features: Sequence[str]) -> dict[str, np.ndarray]:
    columns: dict[str, np.ndarray] = {}
    for name in features:
        values = []
        for pair in pairs:
            value = pair.features.get(name)
            if value is None or not math.isfinite(float(value)):
                raise CalibrationInputError(f"model {pair.model!r} has no finite value for feature {name!r}")
            values.append(float(value))
        columns[name] = np.array(values)
    return columns


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be between 0 and 1 (exclusive), got {confidence}")


def _t_quantile(confidence: float, dof: int) -> float:
    return float(stats.t.ppf(0.5 + confidence / 2.0, dof))


def _nan_to_none(value: float) -> float | None:
    return None if value is None or math.isnan(value) else float(value)


def _none_to_nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


# ----------------------------------------------------------------------------------------------
# CSV helpers for the offline mode


def read_pairs_csv(path: str | Path, x: str = "x", y: str = "y", model: str = "model", group: str | None = None,
                   features: Sequence[str] = ()) -> dict[str | None, list[Pair]]:
    """Pairs from a CSV with a header, grouped by the ``group`` column (one group ``None`` without it).

    A ``family`` column, when present, fills ``Pair.family``. Errors name file, line and column.
    """
    path = Path(path)
    try:
        handle = path.open(newline="", encoding="utf-8-sig")
    except OSError as error:
        raise CalibrationInputError(f"{path}: cannot read: {error.strerror or error}") from error
    with handle:
        reader = csv.DictReader(handle)
        header = reader.fieldnames
        if not header:
            raise CalibrationInputError(f"{path}:1: empty file, expected a header with columns "
                                        f"{', '.join([model, x, y])}")
        needed = [model, x, y, *([group] if group else []), *features]
        missing = [column for column in needed if column not in header]
        if missing:
            raise CalibrationInputError(f"{path}:1: column(s) {', '.join(map(repr, missing))} not in the "
                                        f"header (columns: {', '.join(header)})")
        groups: dict[str | None, list[Pair]] = {}
        for row in reader:
            line = reader.line_num
            name = _text_cell(row, model, path, line)
            pair = Pair(model=name, x=_number_cell(row, x, path, line), y=_number_cell(row, y, path, line),
                        family=(row.get("family") or None) if "family" in header else None,
                        features={f: _number_cell(row, f, path, line) for f in features})
            key = _text_cell(row, group, path, line) if group else None
            groups.setdefault(key, []).append(pair)
    if not groups:
        raise CalibrationInputError(f"{path}:2: no data rows after the header")
    return groups


def predict_rows(calibration: Calibration, rows: Iterable[Mapping[str, Any]], *, x: str = "x",
                 kind: str | None = None, source: str | None = None, first_line: int = 2) -> list[dict[str, Any]]:
    """Each row with ``estimate``, ``low`` and ``high`` added (chosen fit, calibration's confidence).

    Rows are dicts such as ``csv.DictReader`` yields; the sim value is in column ``x`` and the fit's
    features (if any) in columns of the same name. ``source`` (a file name) makes error messages
    read ``source:line: column …``; the first row is on line ``first_line`` (2: after a header).
    """
    fit = calibration.fit(kind)
    materialised = [dict(row) for row in rows]
    where = Path(source) if source else Path("<rows>")
    sim = np.array([_number_cell(row, x, where, first_line + index) for index, row in enumerate(materialised)])
    feature_values = {name: np.array([_number_cell(row, name, where, first_line + index)
                                      for index, row in enumerate(materialised)])
                      for name in fit.features_used}
    if fit.log_space:
        nonpositive = np.flatnonzero(sim <= 0)
        if nonpositive.size:
            raise CalibrationInputError(f"{where}:{first_line + nonpositive[0]}: column {x!r}: the log fit needs "
                                        f"values > 0, got {sim[nonpositive[0]]:g}")
    if not materialised:
        return []
    estimate, low, high = fit.predict_arrays(sim, feature_values, calibration.confidence)
    for row, e, lo, hi in zip(materialised, estimate, low, high):
        row.update(estimate=float(e), low=float(lo), high=float(hi))
    return materialised


def _text_cell(row: Mapping[str, Any], column: str, path: Path, line: int) -> str:
    value = row.get(column)
    if value is None or str(value).strip() == "":
        raise CalibrationInputError(f"{path}:{line}: column {column!r}: missing value")
    return str(value).strip()


def _number_cell(row: Mapping[str, Any], column: str, path: Path, line: int) -> float:
    text = _text_cell(row, column, path, line)
    try:
        value = float(text)
    except ValueError:
        raise CalibrationInputError(f"{path}:{line}: column {column!r}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise CalibrationInputError(f"{path}:{line}: column {column!r}: {text!r} is not a finite number")
    return value
