"""The calibration's core types and settings: the lowest part of the package, importing no other part.

Pair, FitResult, Calibration, Prior and what every fit shares (``_Shared``, ``_LinearModel``, the
confidence and NaN helpers); the fit kinds and every threshold the package's module doc names.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats

FIT_KINDS: tuple[str, ...] = ("ols", "log", "robust", "log_ridge", "log_work", "log_pop", "log_bayes")
LOG_KINDS = ("log", "log_ridge", "log_work", "log_pop", "log_bayes")
# Kinds with more than two free coefficients that nothing shrinks toward a prior (ols and log_ridge with
# features chosen inside, log_work's three) are fitted and reported at any size but offered to the choice
# only from RICH_MIN_MODELS models on: below it they win by luck (issue 31).
RICH_MIN_MODELS = 20
# The work feature of the ``log_work`` kind: the first offered feature with one of these names
# (any case). FLOPs or MACs — the two differ by a constant factor, which the intercept absorbs.
WORK_FEATURES: tuple[str, ...] = ("flops", "macs", "gflops", "gmacs", "mflops", "mmacs")
JSON_FORMAT = "farm.calibration/1"
WITHIN_SHARE = 0.10  # "within ±10 %" as in nn-Meter / HELP reporting
MAX_LISTED_FLIPS = 1000  # longer flip lists are counted, not listed, to keep calibrations small
ALL_PAIR_FLIPS_LIMIT = 2000  # above it observed flips are looked for among sim-adjacent models only
THEIL_SEN_EXACT_LIMIT = 2000  # scipy's exact Theil–Sen needs all n²/2 slopes in memory
THEIL_SEN_SAMPLED_PAIRS = 1_000_000
ROBUST_EXACT_LOO_LIMIT = 200
# A feature must cut the OLS leave-one-out MAPE by this share to be kept. A pure-noise column
# still gets in by chance in ~10 % of draws at n = 10, ~4 % at n = 20 (2 % with no threshold: ~20 %).
FEATURE_MIN_RELATIVE_GAIN = 0.10
# Ridge strengths tried (times n, on standardized columns): 0 is plain least squares, inf the prior.
RIDGE_LAMBDAS: tuple[float, ...] = (0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, math.inf)
# A line (sim only: two coefficients, an honest leave-one-out) replaces the chosen log kind only with a
# leave-one-out MAPE at most 60 % of its (an additive offset, as in peak memory, needs a line).
CHOICE_MARGIN = 0.4
# A log kind's error counts CHOICE_TERM_MARGIN/√n more per term more or fewer than the reference
# kind's (module doc): 45 % at n = 5, 32 % at 10, 22 % at 20. Over 100 draws of the shared qed phones
# at k = 5/10/20 this lost least to the best fixed kind known in hindsight (0.2 flat: −3.3 points at k = 5).
CHOICE_TERM_MARGIN = 1.0
NESTED_LOO_LIMIT = 30  # above it the choice of λ and features is not redone per left-out model (n refits × grid)
# The "unsafe" verdict: the sim is not a scaled copy of the device when the plain power-law fit
# leaves typical (RMS leave-one-out) errors above 20 %, or when the device scales as sim^a with a
# far from 1 (a model 10× slower in the sim would be < 6.3× or > 17.8× slower on the device), or
# when the chosen 90 %-style interval is wider than a factor UNSAFE_INTERVAL_RATIO (high/low).
UNSAFE_LOG_ERROR = 0.20
UNSAFE_EXPONENT = (0.8, 1.25)
UNSAFE_INTERVAL_RATIO = 3.0
UNSAFE_LINEAR_MAPE = 0.20  # for metrics that cannot go to log space (values ≤ 0)
# Model features do not lift the verdict: on k models a features fit can look good by chance where
# the sim does not track the device (the Pixel 4 CPU → GPU case: nested LOO 4–8 % on some 10-model
# draws, 44 % of held-out models within ±10 %).
# Extrapolation (issue 31): a model further than EXTRAPOLATION_TOLERANCE of the range's span outside the
# sim values or features the fit saw is "extrapolating"; its log interval's half-width grows by
# EXTRAPOLATION_WIDENING per span beyond (a model 10× above a 10×-wide range: twice as wide).
EXTRAPOLATION_TOLERANCE = 0.02
EXTRAPOLATION_WIDENING = 1.0
EXTRAPOLATION_MIN_SHARE_SPAN = 0.1  # a share seen only between 0.30 and 0.31 still counts its span as 0.1
EXTRAPOLATION_MIN_LINEAR_SPAN = 0.1
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
class Estimate:
    """A device estimate with its prediction interval at the requested confidence.

    ``verdict`` is "extrapolating" when the model lies outside the range of sim values or features the
    fit saw (``extrapolation`` says which, with the range; the interval is wider for it), else "ok"."""

    estimate: float
    low: float
    high: float
    verdict: str = "ok"
    extrapolation: tuple[OutOfRange, ...] = ()


@dataclass(frozen=True)
class OutOfRange:
    """One input of a prediction outside what the fit saw: its value and the fit's range ``[low, high]``."""

    input: str  # "x" (the sim value) or a feature name
    value: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{'sim' if self.input == 'x' else self.input} {self.value:.4g} outside {self.low:.4g}–{self.high:.4g}"


@dataclass(frozen=True)
class Flip:
    """Two models whose device order may differ (possible) or differs (observed) from the sim order.

    ``first`` ranks below ``second`` in the sim order (for possible flips: in the predicted order).
    """

    first: str
    second: str


@dataclass(frozen=True)
class Prior:
    """What a ``log_ridge`` fit is shrunk toward when pairs are few, in its log space.

    ``log_factor`` None leaves the intercept free (the default prior "device = constant factor ×
    sim"); a number (from a previous calibration) shrinks it too. ``features`` gives a prior
    coefficient per feature; features not named are pulled toward 0.
    """

    exponent: float = 1.0
    log_factor: float | None = None
    features: Mapping[str, float] = field(default_factory=dict)
    feature_transforms: Mapping[str, str] = field(default_factory=dict)  # "log" / "linear", as the fit took them
    source: str = "device = constant factor × sim"

    @classmethod
    def from_fits(cls, fits: Sequence[FitResult], features: Sequence[str], source: str) -> Prior:
        """The mean log-space coefficients of earlier log_ridge fits (a feature a fit did not use: 0)."""
        exponents = [fit.a for fit in fits]
        log_factors = [fit.coefficients[0] / fit.column_scale[0] for fit in fits]
        coefficients: dict[str, float] = {}
        transforms: dict[str, str] = {}
        for name in features:
            values = [fit.feature_coefficient(fit.features_used.index(name)) if name in fit.features_used else 0.0
                      for fit in fits]
            used = [fit.feature_transforms[name] for fit in fits if name in fit.features_used]
            if used:
                coefficients[name], transforms[name] = float(np.mean(values)), used[0]
        return cls(exponent=float(np.mean(exponents)), log_factor=float(np.mean(log_factors)),
                   features=coefficients, feature_transforms=transforms, source=source)

    def feature_prior(self, name: str, transform: str) -> float:
        """The prior coefficient of a feature entering as ``transform`` (0 when the prior took it otherwise)."""
        return self.features.get(name, 0.0) if self.feature_transforms.get(name, transform) == transform else 0.0


DEFAULT_PRIOR = Prior()


@dataclass
class FitResult:
    """One fit kind's coefficients, quality figures and everything needed to predict with intervals.

    ``a`` and ``b`` are the generic pair of a two-term fit: slope and intercept for the linear
    kinds; for the log kinds ``a`` is the exponent and ``b`` the factor e^(log-space intercept),
    stored in JSON under those honest names (``exponent``, ``factor``).
    """

    kind: str
    a: float  # slope of x (ols, robust) or exponent (log kinds)
    b: float  # intercept (ols, robust) or factor (log kinds)
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
    covariance_factor: list[list[float]] = field(default_factory=list)  # (X_sᵀ X_s + Λ)⁻¹
    dof: float = 1.0  # degrees of freedom of the t quantile
    # log_ridge only: how each feature enters ("log" or "linear"), the shrinkage and its prior.
    feature_transforms: dict[str, str] = field(default_factory=dict)
    mean_leverage: float | None = None  # set: half-width scales by √((1 + h₀)/(1 + h̄)), see module doc
    ridge_lambda: float | None = None
    prior_weight: float | None = None  # 0 = the data alone, 1 = the prior alone
    prior_source: str | None = None
    lower_bound: float | None = None  # 0 for a quantity that cannot be negative (latency, memory, energy)
    loo_log_rmse: float | None = None  # log kinds: RMS leave-one-out log error (nested for log_ridge), the choice criterion
    device_class: str | None = None  # log_bayes: the class prior it used (DEVICE_CLASSES)
    # The range of every input the fit saw, "x" (the sim value) and each feature used: [lowest, highest].
    # A prediction outside it is "extrapolating" (``extrapolation``), with a wider interval.
    ranges: dict[str, list[float]] = field(default_factory=dict)

    @property
    def exponent(self) -> float | None:
        return self.a if self.log_space else None

    @property
    def factor(self) -> float | None:
        return self.b if self.log_space else None

    def feature_coefficient(self, index: int) -> float:
        """The coefficient of ``features_used[index]`` in the fit's own space (unscaled)."""
        return self.coefficients[2 + index] / self.column_scale[2 + index]

    @property
    def formula(self) -> str:
        """The whole fit as an equation a person can apply by hand (every term, every feature)."""
        if self.log_space:
            log_factor = self.coefficients[0] / self.column_scale[0]
            terms = [f"e^{log_factor:.4g}", f"x^{self.a:.4g}"]
            log_terms = [f"{log_factor:.4g}", f"{self.a:.4g}·log x"]
            for index, name in enumerate(self.features_used):
                c = self.feature_coefficient(index)
                if self.feature_transforms.get(name, "log") == "log":
                    terms.append(f"{name}^{c:.4g}")
                    log_terms.append(f"{c:.4g}·log {name}")
                else:
                    terms.append(f"e^({c:.4g}·{name})")
                    log_terms.append(f"{c:.4g}·{name}")
            return f"y = {' · '.join(terms)}  (log y = {' + '.join(log_terms)})".replace("+ -", "− ")
        line = f"y = {self.a:.4g}·x {'−' if self.b < 0 else '+'} {abs(self.b):.4g}"
        for index, name in enumerate(self.features_used):
            coefficient = self.feature_coefficient(index)
            line += f" {'−' if coefficient < 0 else '+'} {abs(coefficient):.4g}·{name}"
        return line

    def predict(self, x: float, features: Mapping[str, float] | None = None,
                confidence: float = 0.9) -> Estimate:
        """Device estimate and prediction interval for one sim value (features as used by the fit)."""
        feature_arrays = {name: np.asarray([value], dtype=float) for name, value in (features or {}).items()}
        estimate, low, high = self.predict_arrays(np.asarray([x], dtype=float), feature_arrays, confidence)
        outside = tuple(self.extrapolation(np.asarray([x], dtype=float), feature_arrays)[0])
        return Estimate(float(estimate[0]), float(low[0]), float(high[0]),
                          "extrapolating" if outside else "ok", outside)

    def _inputs(self, sim: np.ndarray, features: Mapping[str, Sequence[float] | np.ndarray] | None
                ) -> dict[str, np.ndarray]:
        values = {"x": sim}
        for name in self.features_used:
            if features is not None and name in features:
                values[name] = np.broadcast_to(np.asarray(features[name], dtype=float), sim.shape)
        return values

    def _distances(self, sim: np.ndarray,
                   features: Mapping[str, Sequence[float] | np.ndarray] | None) -> dict[str, np.ndarray]:
        """Per input the fit kept a range for, how far each row lies beyond it, in units of the range's
        span in the fit's own space (logs for the sim and counts, the value for shares); 0 inside."""
        out: dict[str, np.ndarray] = {}
        for name, values in self._inputs(sim, features).items():
            if name not in self.ranges:
                continue
            lowest, highest = self.ranges[name]
            in_log = (self.log_space if name == "x" else self.feature_transforms.get(name) == "log") and lowest > 0
            if in_log:
                with np.errstate(divide="ignore", invalid="ignore"):
                    v, lo, hi = np.log(np.maximum(values, 1e-300)), math.log(lowest), math.log(highest)
                span = max(hi - lo, math.log(2.0))
            else:
                v, lo, hi = values, lowest, highest
                share = name != "x" and self.feature_transforms.get(name) == "linear" and 0 <= lo and hi <= 1
                span = max(hi - lo, EXTRAPOLATION_MIN_SHARE_SPAN if share
                           else EXTRAPOLATION_MIN_LINEAR_SPAN * max(abs(lo), abs(hi), 1e-12))
            out[name] = (np.maximum(lo - v, 0.0) + np.maximum(v - hi, 0.0)) / span
        return out

    def _extrapolation_distance(self, sim: np.ndarray,
                                features: Mapping[str, Sequence[float] | np.ndarray] | None) -> np.ndarray:
        """The largest of :meth:`_distances` per row."""
        distance = np.zeros(sim.shape)
        for values in self._distances(sim, features).values():
            distance = np.maximum(distance, values)
        return distance

    def extrapolation(self, x: Sequence[float] | np.ndarray,
                      features: Mapping[str, Sequence[float] | np.ndarray] | None = None) -> list[list[OutOfRange]]:
        """Per row, the inputs outside the fit's ranges (beyond ``EXTRAPOLATION_TOLERANCE`` of the span):
        empty lists where the model sits among the calibration models."""
        sim = np.atleast_1d(np.asarray(x, dtype=float))
        inputs = self._inputs(sim, features)
        rows: list[list[OutOfRange]] = [[] for _ in range(sim.size)]
        for name, distance in self._distances(sim, features).items():
            lowest, highest = self.ranges[name]
            for row in np.flatnonzero(distance > EXTRAPOLATION_TOLERANCE):
                rows[row].append(OutOfRange(name, float(inputs[name][row]), lowest, highest))
        return rows

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
            values = np.broadcast_to(np.asarray(features[name], dtype=float), sim.shape)
            if self.feature_transforms.get(name) == "log":
                if np.any(values <= 0):
                    raise ValueError(f"this {self.kind} fit uses log {name}: {name} must be > 0")
                values = np.log(values)
            columns.append(values)
        design = np.column_stack(columns) / np.asarray(self.column_scale)
        centre = design @ np.asarray(self.coefficients)
        leverage = np.einsum("ij,jk,ik->i", design, np.asarray(self.covariance_factor), design)
        spread = (1.0 + leverage) / (1.0 + self.mean_leverage) if self.mean_leverage is not None else 1.0 + leverage
        half_width = _t_quantile(confidence, self.dof) * self.residual_std * np.sqrt(spread)
        # Outside the range the fit saw, the form of the fit itself is a guess: the interval widens with the distance.
        half_width = half_width * (1.0 + EXTRAPOLATION_WIDENING * self._extrapolation_distance(sim, features))
        low, high = centre - half_width, centre + half_width
        if self.log_space:
            return np.exp(centre), np.exp(low), np.exp(high)
        if self.lower_bound is not None:  # a latency interval reaching below 0 ms says nothing true
            centre, low, high = (np.maximum(v, self.lower_bound) for v in (centre, low, high))
        return centre, low, high

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types; NaN becomes null. Log fits store ``exponent``/``factor``, the others ``a``/``b``."""
        coefficients = ({"exponent": _nan_to_none(self.a), "factor": _nan_to_none(self.b)} if self.log_space
                        else {"a": _nan_to_none(self.a), "b": _nan_to_none(self.b)})
        return {
            "kind": self.kind, **coefficients,
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
            "feature_transforms": dict(self.feature_transforms), "mean_leverage": self.mean_leverage,
            "ridge_lambda": None if self.ridge_lambda is None or math.isinf(self.ridge_lambda) else self.ridge_lambda,
            "ridge_lambda_infinite": self.ridge_lambda is not None and math.isinf(self.ridge_lambda),
            "prior_weight": self.prior_weight, "prior_source": self.prior_source, "lower_bound": self.lower_bound,
            "loo_log_rmse": self.loo_log_rmse, "device_class": self.device_class,
            "ranges": {name: list(r) for name, r in self.ranges.items()},
            "formula": self.formula,  # informational; recomputed on read
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FitResult:
        log_space = bool(data["log_space"])
        first, second = ("exponent", "factor") if log_space and "exponent" in data else ("a", "b")
        ridge_lambda = math.inf if data.get("ridge_lambda_infinite") else data.get("ridge_lambda")
        return cls(
            kind=data["kind"], a=_none_to_nan(data[first]), b=_none_to_nan(data[second]),
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
            loo_exact=bool(data["loo_exact"]), log_space=log_space,
            coefficients=[float(v) for v in data["coefficients"]],
            column_scale=[float(v) for v in data["column_scale"]],
            covariance_factor=[[float(v) for v in row] for row in data["covariance_factor"]],
            dof=float(data["dof"]),
            feature_transforms={str(k): str(v) for k, v in (data.get("feature_transforms") or {}).items()},
            mean_leverage=None if data.get("mean_leverage") is None else float(data["mean_leverage"]),
            ridge_lambda=None if ridge_lambda is None else float(ridge_lambda),
            prior_weight=None if data.get("prior_weight") is None else float(data["prior_weight"]),
            prior_source=data.get("prior_source"),
            lower_bound=None if data.get("lower_bound") is None else float(data["lower_bound"]),
            loo_log_rmse=None if data.get("loo_log_rmse") is None else float(data["loo_log_rmse"]),
            device_class=data.get("device_class"),
            ranges={str(k): [float(v[0]), float(v[1])] for k, v in (data.get("ranges") or {}).items()},
        )


@dataclass(frozen=True)
class FitChoice:
    """How a calibration's kind was chosen (``_choose_kind``): the criterion, every candidate kind's error under it,
    the kind that came second, the kinds fitted but not offered. Its JSON (``dataclasses.asdict``) is the
    calibration's ``choice``, in this order."""

    criterion: str
    errors: dict[str, float | None]
    runner_up: str | None
    not_offered: list[str]

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> FitChoice | None:
        """A stored choice; None for a calibration stored without one."""
        if not data:
            return None
        return cls(str(data.get("criterion") or ""), {str(k): v for k, v in (data.get("errors") or {}).items()},
                   data.get("runner_up"), [str(k) for k in data.get("not_offered") or []])


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
    unsafe_reasons: list[str] = field(default_factory=list)  # empty: the sim tracks this device
    choice: FitChoice | None = None  # how ``chosen`` was chosen (None: a calibration stored without it)

    @property
    def runner_up(self) -> FitResult | None:
        """The kind that came second in the choice, to compare the chosen one with."""
        kind = self.choice.runner_up if self.choice else None
        return self.fits.get(kind) if kind else None

    def choice_json(self) -> dict[str, str | list[str] | dict[str, float | None] | None]:
        """The choice as the calibration's JSON has it ({} when it has none)."""
        return dataclasses.asdict(self.choice) if self.choice else {}

    @property
    def unsafe(self) -> bool:
        """The verdict: do not trust estimates or rankings from this calibration (see unsafe_reasons)."""
        return bool(self.unsafe_reasons)

    @property
    def chosen_fit(self) -> FitResult:
        return self.fits[self.chosen]

    def predict(self, x: float, features: Mapping[str, float] | None = None,
                kind: str | None = None) -> Estimate:
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
            "unsafe": self.unsafe,
            "unsafe_reasons": list(self.unsafe_reasons),
            "choice": self.choice_json(),
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
        for fit in fits.values():  # a calibration written before ranges were kept: its pairs have them
            if not fit.ranges and data.get("pairs"):
                fit.ranges = {"x": [min(float(p["x"]) for p in data["pairs"]), max(float(p["x"]) for p in data["pairs"])]}
                for name in fit.features_used:
                    values = [float(p["features"][name]) for p in data["pairs"] if name in (p.get("features") or {})]
                    if values:
                        fit.ranges[name] = [min(values), max(values)]
        if data["chosen"] not in fits:
            raise CalibrationInputError(f"calibration chooses {data['chosen']!r}, which has no fit")
        pairs = [Pair(model=p["model"], x=float(p["x"]), y=float(p["y"]), family=p.get("family"),
                      features={k: float(v) for k, v in p.get("features", {}).items()})
                 for p in data["pairs"]]
        return cls(chosen=data["chosen"], fits=fits, warnings=list(data["warnings"]), pairs=pairs,
                   confidence=float(data["confidence"]), unsafe_reasons=list(data.get("unsafe_reasons") or []),
                   choice=FitChoice.from_json(data.get("choice")))


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
    features: dict[str, np.ndarray] = field(default_factory=dict)  # every offered feature, raw values

    def feature_values(self, fit: FitResult) -> dict[str, np.ndarray]:
        return {name: self.features[name] for name in fit.features_used}


@dataclass
class _LinearModel:
    """A least squares fit on scaled columns, with what LOO and intervals need."""

    coefficients: np.ndarray
    column_scale: np.ndarray
    covariance_factor: np.ndarray
    residuals: np.ndarray
    leverage: np.ndarray


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be between 0 and 1 (exclusive), got {confidence}")


def _t_quantile(confidence: float, dof: float) -> float:
    return float(stats.t.ppf(0.5 + confidence / 2.0, dof))


def _nan_to_none(value: float) -> float | None:
    return None if value is None or math.isnan(value) else float(value)


def _none_to_nan(value: float | None) -> float:
    return math.nan if value is None else float(value)
