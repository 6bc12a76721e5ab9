"""Per-device calibration: turn sim measurements into device estimates, and say how far to trust them.

A calibration maps a sim value x (latency, memory, … measured in the constrained sandbox) to a
device value y for one device × metric (× threads × runtime × precision × family — grouping is the
caller's business). Seven fit kinds are computed and all are reported; which one is used is
said after the list:

``ols``
    Ordinary least squares, ``y = a·x + b`` — the published method. Optional extra regressors
    (model features such as ``param_count``) enter its design matrix only where leave-one-out says
    they cut the error. Prediction interval: the classic t-based interval with leverage,
    ``ŷ ± t(n−p) · s · √(1 + x₀ᵀ(XᵀX)⁻¹x₀)``.
``log``
    Least squares in log space, ``log y = b + a·log x``, i.e. the power law ``y = e^b·x^a``
    (stored as ``exponent`` and ``factor`` = e^b). Predictions are back-transformed with ``exp``, so
    the estimate is the geometric-mean (median) prediction. Interval: in log space from the
    leave-one-out error as for every log kind (below), back-transformed (asymmetric on the original
    scale, proportional to the estimate).
``robust``
    Theil–Sen (``scipy.stats.theilslopes``, joint intercept = median of ``y − a·x``), which ignores
    up to ~29 % outliers. Interval: the OLS-form t-interval with leverage, centred on the Theil–Sen
    line, with ``s`` the root-mean-square residual about that line (n−2 degrees of freedom). Points
    the line ignores still widen the interval, because a new model may be such an outlier too.
    Above ``THEIL_SEN_EXACT_LIMIT`` pairs the slope is the median of a fixed-seed random sample of
    ``THEIL_SEN_SAMPLED_PAIRS`` pairwise slopes; above ``ROBUST_EXACT_LOO_LIMIT`` pairs its
    leave-one-out residuals are approximated as ``e_i / (1 − h_ii)`` with the OLS leverages (one
    point moves a median of ~n²/2 slopes very little); a warning says so and ``loo_exact`` is False.

``log_ridge``
    The few-shot fit: in log space, ``log y = b + a·log x + Σ c_j·f_j`` over model features f_j
    (counts and sizes enter as their log, shares as they are), shrunk by ridge toward a prior:
    by default "the device is a constant factor of the sim" (a = 1, every c_j = 0, b free), or
    the device's previous calibration / its device type's (``Prior``). The penalty
    ``λ·n·Σ sd_j²·(θ_j − prior_j)²`` is scale-free; λ (from ``RIDGE_LAMBDAS``, 0 = plain
    least squares, ∞ = the prior itself) and the features (greedy forward selection, each must
    cut the leave-one-out error by ``FEATURE_MIN_RELATIVE_GAIN``) are chosen by leave-one-out
    squared log error; a prior from an earlier fit brings that fit's features along. Because
    that choice is itself fitted, its ``loo_*`` figures come from *nested* leave-one-out (the
    whole choice redone without each model, up to ``NESTED_LOO_LIMIT`` pairs) — and selected
    features are dropped again unless they lower that nested error too — and its interval is
    ``ŷ ± t(n−2)·s·√((1 + h₀)/(1 + h̄))`` in log space with ``s`` the RMS nested-LOO log error, ``h₀`` the new model's leverage under the
    ridge and ``h̄`` the mean leverage of the calibration models (a new model is judged like a
    left-out one, wider when it sits further out). ``prior_weight`` says how much of the fit is
    the prior: 1 − (data degrees of freedom of the shrunk terms) / (their number).

``log_work``
    The simple candidate that is hard to beat on phones: ``log y = b + a·log x + c·log FLOPs``
    (or MACs: the first offered feature named in ``WORK_FEATURES``), plain least squares with
    nothing chosen inside, so its closed-form leave-one-out error is honest.

``log_bayes`` (issue 31; the default)
    The Bayesian log-linear fit, ``log y = b + a·log x + Σ c_j·f_j``, features taken by *role*
    (``feature_role``: the work — FLOPs or MACs however named — and the size in log, per-layer shares
    as they are), with a prior learned across devices: (a, c_work, c_size) ~ N(mean, Σ) of the device's
    *class* (``DEVICE_CLASSES``: a single core, several cores, a GPU; never one Gaussian over all), each
    share's c ~ N(0, ``SHARE_PRIOR_SD``²), b flat. The class is the one given (``device_class``), else the
    one whose prior makes the pairs most likely (the evidence); the lab's store adds its other devices'
    fits to each class's prior (``calibrations.lab_class_priors``), and the shipped priors are fitted on
    the shared public data (benchmarks/population_prior.py). The noise σ is estimated with the posterior
    mean (ν₀ = ``BAYES_NOISE_DOF`` pseudo-observations at the class's residual std). Interval: the
    posterior predictive, ``ŷ ± t(ν₀ + n − tr H)·σ̂·√(1 + x₀ᵀ(XᵀX + σ̂²Σ⁻¹)⁻¹x₀)`` in log space. Its
    ``loo_*`` figures redo the class choice without each model (nested).

Every fit keeps the range of the sim values and features it saw (``FitResult.ranges``): a prediction
outside it gets the verdict "extrapolating" with the inputs and ranges (``Prediction.extrapolation``),
and its interval's half-width grows by ``EXTRAPOLATION_WIDENING`` per span of the range beyond it.

Every other log kind's interval is the same cross-validated form: ``ŷ ± t(n−2)·s·√((1 + h₀)/(1 + h̄))``
with ``s`` its RMS leave-one-out log error (nested for ``log_ridge``) and one degree of freedom
fewer for the choice of the kind with the lowest such error (``_cross_validated_interval``). The
classic in-sample t-interval was too narrow with 5 models (81–87 % coverage for a 90 % interval).

The choice (``_choose_kind``, which supersedes the paragraph below where they differ): kinds with more
than two free coefficients that no prior shrinks are not offered below ``RICH_MIN_MODELS`` models; the
kinds without a prior learned elsewhere pay the term margin against ``log_bayes``; ``log_pop`` is not
offered beside ``log_bayes``; the runner-up and the kinds not offered are recorded in ``choice``.

Before issue 31: the chosen kind was the log kind (``log``, ``log_work``, ``log_ridge``) with the lowest RMS
leave-one-out log error (``loo_log_rmse``; nested for ``log_ridge``), each counted
``CHOICE_TERM_MARGIN``/√n more per term it has more or fewer than the reference (``log_work`` when
FLOPs are offered, else ``log``; ``log_ridge`` when it has a prior from elsewhere); ``Calibration.choice`` records the criterion, every candidate's
error and the runner-up. A line replaces it only when its leave-one-out MAPE is at most
(1 − ``CHOICE_MARGIN``) of the log choice's (an additive offset, as in peak memory, needs a line).
For data that cannot go to log space it is the kind with the lowest leave-one-out MAPE.

The ``unsafe`` verdict (``Calibration.unsafe_reasons``) says the sim does not track the device:
the plain power law leaves an RMS leave-one-out error above ``UNSAFE_LOG_ERROR``, or its exponent
is outside ``UNSAFE_EXPONENT``, or the chosen fit's intervals span more than a factor
``UNSAFE_INTERVAL_RATIO``; when a line is chosen (an additive offset, or values ≤ 0), the
sim-only line's leave-one-out MAPE above ``UNSAFE_LINEAR_MAPE``. Spearman ρ on k points alone is
too noisy at k = 5–10 to decide it (it stays a warning: close models may swap).

Every prediction interval of a quantity that was never negative stays ≥ 0 (``lower_bound``).

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
import json
import math
import warnings as python_warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy import linalg, stats

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
class Prediction:
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

    def to_json(self) -> dict[str, Any]:
        return {"input": self.input, "value": self.value, "low": self.low, "high": self.high}


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

POPULATION_FORMAT = "farm.population-prior/1"
# The roles a population prior knows, and the feature names that play them (coefficients of logs are unit-free).
POPULATION_ROLES: dict[str, tuple[str, ...]] = {
    "work": ("flops", "macs", "gflops", "gmacs", "mflops", "mmacs"),
    "size": ("size", "size_bytes", "param_bytes", "model_bytes"),
}
POPULATION_PRIOR_FILE = Path(__file__).with_name("population_prior.json")


def feature_role(name: str) -> str | None:
    """The role a model feature plays, read from its name, not its exact spelling (issue 31).

    ``share`` (a per-layer share of the work: ``depthwise_macs_share``, ``conv1x1_flops_fraction``),
    ``work`` (FLOPs or MACs however named: ``FLOPS``, ``flops_total``, ``gmacs``), ``size`` (the model's
    size or parameter count: ``size``, ``size_bytes``, ``param_count``), ``activation`` (activation
    volume) or ``layers`` (layer/operator count); None for anything else."""
    low = name.lower()
    if "share" in low or "fraction" in low or low.endswith("_frac"):
        return "share"
    if "flop" in low or "mac" in low:
        return "work"
    if "activation" in low:
        return "activation"
    if "size" in low or "param" in low or low.endswith("bytes") or low == "weights":
        return "size"
    if low in ("op_count", "layer_count", "layers", "ops", "node_count"):
        return "layers"
    return None


def population_role(name: str) -> str | None:
    """The population-prior role (``work``, ``size``) a feature name plays, if any (see :func:`feature_role`)."""
    role = feature_role(name)
    return role if role in POPULATION_ROLES else None


@dataclass(frozen=True)
class PopulationPrior:
    """An empirical-Bayes prior on a device's log-space exponent and feature coefficients, learned across devices.

    Every device of a public data set was fitted as ``log y = b + a·log x + Σ c_j·log f_j``;
    ``terms`` are ``exponent`` (a) and the feature roles (c_j), ``mean`` and ``covariance`` their
    mean and covariance across those devices. They are strongly correlated (a device whose time
    grows faster than the sim's grows slower with FLOPs at a given sim time), so the prior is joint:
    a ``log_pop`` fit keeps each device's scale b free, takes (a, c) ~ N(mean, covariance) with the
    noise fixed at ``residual_std`` (the devices' typical log residual) and reports the posterior
    mean — a ridge whose weight falls as the device's own pairs grow.
    """

    terms: tuple[str, ...]  # "exponent", then roles of POPULATION_ROLES
    mean: tuple[float, ...]
    covariance: tuple[tuple[float, ...], ...]
    residual_std: float
    devices: int
    source: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any], origin: str = "population prior") -> PopulationPrior:
        if not isinstance(data, Mapping) or data.get("format") != POPULATION_FORMAT:
            raise CalibrationInputError(f"{origin}: not a farm population prior (format must be {POPULATION_FORMAT!r})")
        try:
            terms = tuple(str(t) for t in data["terms"])
            mean = tuple(float(data["mean"][t]) for t in terms)
            covariance = tuple(tuple(float(v) for v in row) for row in data["covariance"])
            residual_std, devices = float(data["residual_std"]), int(data["devices"])
            source = str(data.get("source", origin))[:200]
        except (KeyError, TypeError, ValueError) as e:
            raise CalibrationInputError(f"{origin}: malformed population prior ({e!r})") from None
        if not terms or terms[0] != "exponent" or any(t not in POPULATION_ROLES for t in terms[1:]) \
                or len(set(terms)) != len(terms):
            raise CalibrationInputError(f"{origin}: terms must be 'exponent' then distinct roles of "
                                        f"{', '.join(POPULATION_ROLES)}")
        matrix = np.array(covariance, dtype=float) if covariance else np.zeros((0, 0))
        if matrix.shape != (len(terms), len(terms)) or not np.all(np.isfinite(matrix)) \
                or not np.all(np.isfinite(mean)) or not np.allclose(matrix, matrix.T) \
                or np.linalg.eigvalsh(matrix).min() <= 0:
            raise CalibrationInputError(f"{origin}: covariance must be a finite symmetric positive-definite "
                                        f"{len(terms)}×{len(terms)} matrix and every mean finite")
        if not (math.isfinite(residual_std) and residual_std > 0) or devices < 2:
            raise CalibrationInputError(f"{origin}: residual_std must be finite and > 0, devices at least 2")
        return cls(terms, mean, covariance, residual_std, devices, source)

    def to_json(self) -> dict[str, Any]:
        return {"format": POPULATION_FORMAT, "source": self.source, "devices": self.devices,
                "residual_std": self.residual_std, "terms": list(self.terms),
                "mean": dict(zip(self.terms, self.mean, strict=True)),
                "covariance": [list(row) for row in self.covariance]}

    @classmethod
    def shipped(cls, device_class: str = "single_core") -> PopulationPrior:
        """One device class's prior shipped with farm (benchmarks/population_prior.py, the shared public data)."""
        return shipped_class_priors()[device_class]

    def with_fits(self, fits: Sequence[FitResult], source: str) -> PopulationPrior:
        """This prior with other devices' log fits (the lab's store) added as more devices of the population.

        A fit counts when it used a feature for every role of the prior, in log space."""
        samples = []
        for fit in fits:
            roles = {population_role(name): index for index, name in enumerate(fit.features_used)
                     if fit.feature_transforms.get(name, "log") == "log"}
            if fit.log_space and all(term in roles for term in self.terms[1:]):
                vector = [fit.a, *(fit.feature_coefficient(roles[term]) for term in self.terms[1:])]
                if all(math.isfinite(v) for v in vector):
                    samples.append(vector)
        if not samples:
            return self
        m, mean, covariance = self.devices, np.array(self.mean), np.array(self.covariance)
        added = np.array(samples)
        total = m + len(samples)
        new_mean = (m * mean + added.sum(axis=0)) / total
        shift, spread = mean - new_mean, added - new_mean
        pooled = ((m - 1) * covariance + m * np.outer(shift, shift) + spread.T @ spread) / (total - 1)
        return PopulationPrior(self.terms, tuple(float(v) for v in new_mean),
                               tuple(tuple(float(v) for v in row) for row in pooled), self.residual_std, total,
                               f"{self.source} + {len(samples)} {source}")


DEVICE_CLASSES: tuple[str, ...] = ("single_core", "multi_core", "gpu")
CLASS_PRIORS_FORMAT = "farm.population-prior/2"


def class_priors_from_json(data: Mapping[str, Any], origin: str = "population prior") -> dict[str, PopulationPrior]:
    """Per-device-class priors (``farm.population-prior/2``: {"classes": {class: a /1 prior}}); a /1 file
    is one class, ``single_core``."""
    if isinstance(data, Mapping) and data.get("format") == POPULATION_FORMAT:
        return {"single_core": PopulationPrior.from_json(data, origin)}
    if not isinstance(data, Mapping) or data.get("format") != CLASS_PRIORS_FORMAT \
            or not isinstance(data.get("classes"), Mapping) or not data["classes"]:
        raise CalibrationInputError(f"{origin}: not a farm population prior (format must be {CLASS_PRIORS_FORMAT!r} "
                                    f"with classes, or {POPULATION_FORMAT!r})")
    unknown = [name for name in data["classes"] if name not in DEVICE_CLASSES]
    if unknown:
        raise CalibrationInputError(f"{origin}: unknown device class(es) {unknown}; known: {list(DEVICE_CLASSES)}")
    return {str(name): PopulationPrior.from_json(body, f"{origin} ({name})") for name, body in data["classes"].items()}


_SHIPPED_CLASS_PRIORS: dict[str, PopulationPrior] = {}


def shipped_class_priors() -> dict[str, PopulationPrior]:
    """The per-class priors shipped with farm (read once)."""
    if not _SHIPPED_CLASS_PRIORS:
        _SHIPPED_CLASS_PRIORS.update(class_priors_from_json(json.loads(POPULATION_PRIOR_FILE.read_text()),
                                                            POPULATION_PRIOR_FILE.name))
    return dict(_SHIPPED_CLASS_PRIORS)


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
                confidence: float = 0.9) -> Prediction:
        """Device estimate and prediction interval for one sim value (features as used by the fit)."""
        feature_arrays = {name: np.asarray([value], dtype=float) for name, value in (features or {}).items()}
        estimate, low, high = self.predict_arrays(np.asarray([x], dtype=float), feature_arrays, confidence)
        outside = tuple(self.extrapolation(np.asarray([x], dtype=float), feature_arrays)[0])
        return Prediction(float(estimate[0]), float(low[0]), float(high[0]),
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
    # How ``chosen`` was chosen: {"criterion", "errors" (kind → its error), "runner_up" (kind or None)}.
    choice: dict[str, Any] = field(default_factory=dict)

    @property
    def runner_up(self) -> FitResult | None:
        """The kind that came second in the choice, to compare the chosen one with."""
        kind = self.choice.get("runner_up")
        return self.fits.get(kind) if kind else None

    @property
    def unsafe(self) -> bool:
        """The verdict: do not trust estimates or rankings from this calibration (see unsafe_reasons)."""
        return bool(self.unsafe_reasons)

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
            "unsafe": self.unsafe,
            "unsafe_reasons": list(self.unsafe_reasons),
            "choice": dict(self.choice),
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
                   choice=dict(data.get("choice") or {}))


# ----------------------------------------------------------------------------------------------
# Fitting


def calibrate(pairs: Iterable[Pair], *, kinds: Sequence[str] = FIT_KINDS, confidence: float = 0.9,
              min_pairs: int = 4, unsafe_rho: float = 0.9, features: Sequence[str] = (),
              prior: Prior = DEFAULT_PRIOR, population: PopulationPrior | None = None,
              class_priors: Mapping[str, PopulationPrior] | None = None,
              device_class: str | None = None) -> Calibration:
    """Fit every kind in ``kinds`` to the pairs and choose the one with the lowest leave-one-out MAPE.

    Pairs with the same model name are repeats: their x, y and features are averaged into one pair
    per model before fitting (a warning says how many models had repeats), so ``n`` counts models.
    The same model with *different* feature values (another batch size, input size…) is another
    configuration, not a repeat: that is refused rather than averaged.
    ``features`` names entries of ``Pair.features`` offered to the OLS fit and the ``log_ridge`` fit
    as extra regressors; greedy forward selection keeps one only if it lowers the fit's leave-one-out
    error by at least ``FEATURE_MIN_RELATIVE_GAIN`` (10 %) relative, and only while ≥ 2 residual
    degrees of freedom remain. ``prior`` is what ``log_ridge`` shrinks toward (module doc).
    ``population`` (a :class:`PopulationPrior`) adds the ``log_pop`` kind: the offered FLOPs/MACs and
    size features with coefficients shrunk toward what other devices showed; without it (or without
    such a feature) ``log_pop`` is not fitted. ``class_priors`` (default: the shipped ones) are the
    per-device-class priors of the ``log_bayes`` kind, ``device_class`` the device's class when known
    (else the class whose prior makes the pairs most likely).

    Raises :class:`NotEnoughPairs` with fewer than ``min_pairs`` models or fewer than 3 distinct sim
    values, and ``ValueError`` for non-finite values or a bad argument. Warns (in
    ``Calibration.warnings``) when Spearman ρ < ``unsafe_rho``, when the log kind is skipped for
    non-positive values, and when a figure had to be approximated or truncated.
    """
    _check_confidence(confidence)
    priors = dict(shipped_class_priors() if class_priors is None else class_priors)
    if device_class is not None:
        if device_class not in priors:
            raise ValueError(f"device class {device_class!r} has no prior; known: {', '.join(priors) or 'none'}")
        priors = {device_class: priors[device_class]}
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
            (f"Spearman ρ = {rho:.3f} < {unsafe_rho:g}" if math.isfinite(rho) else
             "Spearman ρ cannot be computed (every device value is the same)")
            + " between sim and device order: models close in the sim may swap places on the device")
    zero_device = int(np.count_nonzero(device == 0))
    if zero_device:
        warnings.append(f"{zero_device} device value(s) are 0: left out of the MAPE and ±10 % figures")

    shared = _Shared(sim=sim, device=device, names=names, tau=tau, rho=rho, observed=observed,
                     observed_count=observed_count, confidence=confidence, features=feature_matrix)
    nonpositive = [names[i] for i in np.flatnonzero((sim <= 0) | (device <= 0))]
    fits: dict[str, FitResult] = {}
    for kind in kinds:
        if kind in LOG_KINDS:
            if kind == "log_pop" and population is None:
                continue  # no population prior given: nothing to borrow
            if nonpositive:
                warnings.append(f"{kind} fit skipped: {len(nonpositive)} pair(s) have non-positive values "
                                f"(e.g. {', '.join(nonpositive[:3])})")
                continue
            log_fit = (_fit_log(shared, warnings) if kind == "log"
                       else _fit_log_work(shared, feature_matrix) if kind == "log_work"
                       else _fit_log_pop(shared, feature_matrix, population) if kind == "log_pop"
                       else _fit_log_bayes(shared, feature_matrix, priors, class_given=device_class is not None)
                       if kind == "log_bayes"
                       else _fit_log_ridge(shared, feature_matrix, prior, warnings))
            if log_fit is not None:
                fits[kind] = log_fit
        elif kind == "ols":
            fits[kind] = _fit_ols(shared, feature_matrix)
        else:
            fits[kind] = _fit_robust(shared, warnings)
    if not fits:
        raise ValueError(f"no fit kind could be fitted ({'; '.join(warnings[-1:])}): add 'ols' or 'robust' to kinds")
    if not np.any(device < 0):
        for fit in fits.values():
            fit.lower_bound = 0.0  # a device figure that was never negative cannot be predicted below 0
    chosen, choice = _choose_kind(fits, prior_given=prior != DEFAULT_PRIOR)
    for fit in fits.values():
        if fit.possible_flip_count > len(fit.possible_flips):
            warnings.append(f"{fit.kind}: {fit.possible_flip_count} possible flips, the first "
                            f"{len(fit.possible_flips)} listed")
            break
    unsafe_reasons = _unsafe_reasons(shared, fits[chosen], log_possible=not nonpositive,
                                     bayes=fits.get("log_bayes"), class_given=device_class is not None)
    if unsafe_reasons:
        warnings.append(f"unsafe: {'; '.join(unsafe_reasons)}: a linear map is unsafe for this device and metric "
                        f"(rankings and estimates from the sim may mislead)")
    return Calibration(chosen=chosen, fits=fits, warnings=warnings, pairs=merged, confidence=confidence,
                       unsafe_reasons=unsafe_reasons, choice=choice)


def _free_terms(fit: FitResult) -> int:
    """Coefficients a fit estimates beyond the intercept and the sim's: its features, unless a prior shrinks them."""
    return len(fit.features_used)


def _offered(fit: FitResult, prior_given: bool) -> bool:
    """Whether the choice may take this kind: a kind with more than two free, unshrunk coefficients needs
    RICH_MIN_MODELS models (log_bayes and log_pop are shrunk toward a prior learned elsewhere; log_ridge is
    too when it was given one)."""
    shrunk = fit.kind in ("log_bayes", "log_pop") or (fit.kind == "log_ridge" and prior_given)
    return shrunk or _free_terms(fit) == 0 or fit.n >= RICH_MIN_MODELS


def _choose_kind(fits: Mapping[str, FitResult], prior_given: bool = False) -> tuple[str, dict[str, Any]]:
    """(chosen kind, how it was chosen): among the log kinds offered, the lowest leave-one-out log error.

    Every offered kind's error is honest: ``log`` and ``log_work`` choose nothing inside (plain
    closed-form leave-one-out), ``log_ridge`` and ``log_bayes`` (which chooses its class prior) are
    judged by *nested* leave-one-out, ``log_pop`` has a fixed penalty. A kind with more than two free
    coefficients that no prior shrinks is offered only from ``RICH_MIN_MODELS`` models on (``_offered``):
    below it, it is fitted and reported but not chosen; ``log_pop`` (one Gaussian over every device class)
    is not offered beside ``log_bayes`` (the same prior per class). The choice between the offered kinds is itself a
    small fit, so the kinds without a prior learned elsewhere (``log_bayes``, ``log_pop``, ``log_ridge``
    given a ``Prior``) count their error ``CHOICE_TERM_MARGIN``/√n more; with no such kind, each counts it
    per term it has more or fewer than the reference (``log_work`` with FLOPs, else the power law).
    A line (``ols``/``robust`` on the sim alone below RICH_MIN_MODELS: an additive offset, as in peak
    memory) replaces the log choice only with a leave-one-out MAPE at most (1 − ``CHOICE_MARGIN``) of its;
    without log kinds the lowest MAPE wins. The runner-up is the kind that came second.
    """
    def mape(kind: str) -> float:
        return fits[kind].loo_mape if math.isfinite(fits[kind].loo_mape) else math.inf

    log_kinds = [kind for kind in ("log", "log_work", "log_ridge", "log_pop", "log_bayes") if kind in fits
                 and fits[kind].loo_log_rmse is not None and math.isfinite(fits[kind].loo_log_rmse or math.nan)
                 and _offered(fits[kind], prior_given)]
    if "log_bayes" in log_kinds and "log_pop" in log_kinds:  # the same prior, one Gaussian over every class
        log_kinds.remove("log_pop")
    lines = [kind for kind in fits if kind not in LOG_KINDS and _offered(fits[kind], prior_given)]
    if not log_kinds:
        candidates = lines or list(fits)
        ranked = sorted(candidates, key=mape)
        return ranked[0], {"criterion": "leave-one-out MAPE",
                           "errors": {k: _nan_to_none(fits[k].loo_mape) for k in ranked},
                           "runner_up": ranked[1] if len(ranked) > 1 else None,
                           "not_offered": sorted(set(fits) - set(candidates))}

    def has_prior(kind: str) -> bool:  # shrunk toward something learned elsewhere
        return kind in ("log_pop", "log_bayes") or (prior_given and kind == "log_ridge")

    with_prior = any(has_prior(kind) for kind in log_kinds)
    reference = 1.0 if "log_work" in log_kinds else 0.0
    reference_kind = ("log_work" if "log_work" in log_kinds else "sim^a") if not with_prior else \
        " and ".join(kind for kind in log_kinds if has_prior(kind))
    margin = CHOICE_TERM_MARGIN / math.sqrt(fits[log_kinds[0]].n)

    def penalized(kind: str) -> float:
        if with_prior:  # the kinds without the prior pay one term's margin
            return float(fits[kind].loo_log_rmse or math.inf) * (1.0 + margin * (not has_prior(kind)))
        return float(fits[kind].loo_log_rmse or math.inf) * (1.0 + margin * abs(_extra_terms(fits[kind]) - reference))

    ranked = sorted(log_kinds, key=lambda kind: (penalized(kind), kind != "log_bayes"))
    best = ranked[0]
    line = min(lines, key=mape) if lines else None
    if line is not None and mape(line) < (1.0 - CHOICE_MARGIN) * mape(best):
        ranked, best = [line, *ranked], line
    errors = {kind: fits[kind].loo_log_rmse for kind in log_kinds}
    return best, {"criterion": "leave-one-out RMS log error (nested for log_ridge and log_bayes), "
                               + (f"+{100 * margin:.0f} % for the kinds without the prior" if with_prior else
                                  f"+{100 * margin:.0f} % per term more or fewer than {reference_kind}"),
                  "errors": errors, "runner_up": ranked[1] if len(ranked) > 1 else None,
                  "not_offered": sorted(kind for kind in fits if not _offered(fits[kind], prior_given))}


def _extra_terms(fit: FitResult) -> float:
    """Terms beyond the power law's two, counted as the data degrees of freedom a ridge leaves them."""
    if fit.prior_weight is not None:
        return len(fit.features_used) * (1.0 - fit.prior_weight)
    return float(len(fit.features_used))


def _unsafe_reasons(shared: _Shared, chosen: FitResult, *, log_possible: bool, bayes: FitResult | None = None,
                    class_given: bool = False) -> list[str]:
    """Why the sim does not track this device, from the sim-only power law whenever every value is > 0
    (whatever kind was chosen: a line that happens to fit 10 models does not make the device tracked),
    else the sim-only line: its leave-one-out error, its scaling, the chosen fit's interval width, and
    (class not given) the log_bayes evidence naming the GPU class for a sim that is a CPU."""
    reasons = []
    if not shared.rho > 0:  # also NaN: constant device values
        reasons.append(f"the device does not rise with the sim (Spearman ρ = {shared.rho:.2f})" if math.isfinite(shared.rho)
                       else "the device does not rise with the sim (every device value is the same)")
    if log_possible and bayes is not None and not class_given and bayes.device_class == "gpu":
        reasons.append("the device scales like a GPU against the sim (the gpu class prior explains these models "
                       "best): a CPU sim's order is not the device's")
    if log_possible:
        log_sim, log_device = np.log(shared.sim), np.log(shared.device)
        plain = _least_squares([np.ones_like(log_sim), log_sim], log_device)
        if plain is not None:
            loo_error = float(np.sqrt(np.mean((plain.residuals / (1.0 - plain.leverage)) ** 2)))
            exponent = float(plain.coefficients[1] / plain.column_scale[1])
            if loo_error > UNSAFE_LOG_ERROR:
                reasons.append(f"the sim alone leaves a typical leave-one-out error of {100 * loo_error:.0f} % "
                               f"(> {100 * UNSAFE_LOG_ERROR:.0f} %)")
            if not UNSAFE_EXPONENT[0] <= exponent <= UNSAFE_EXPONENT[1]:
                reasons.append(f"the device scales as sim^{exponent:.2f}, not in proportion "
                               f"(outside {UNSAFE_EXPONENT[0]:g}–{UNSAFE_EXPONENT[1]:g})")
        _, low, high = chosen.predict_arrays(shared.sim, shared.feature_values(chosen), shared.confidence)
        ratio = float(np.median(high / low)) if chosen.log_space else 1.0  # a line's low may be 0
        if ratio > UNSAFE_INTERVAL_RATIO:
            reasons.append(f"its {shared.confidence:.0%} intervals span a factor of {ratio:.1f} "
                           f"(> {UNSAFE_INTERVAL_RATIO:g})")
    else:  # a line fits (an additive offset, or values ≤ 0): the sim-only line's error decides
        line = _least_squares([np.ones_like(shared.sim), shared.sim], shared.device)
        line_mape = _ols_loo_mape(line, shared.device) if line is not None else math.inf
        if not line_mape <= UNSAFE_LINEAR_MAPE:
            reasons.append(f"the sim alone (a line) leaves a leave-one-out MAPE of {100 * line_mape:.0f} % "
                           f"(> {100 * UNSAFE_LINEAR_MAPE:.0f} %)")
    return reasons


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


def _cross_validated_interval(loo_residual: np.ndarray, leverage: np.ndarray) -> tuple[float, float, float]:
    """The interval of every log kind, (s, dof, h̄): ``ŷ ± t(n−2)·s·√((1 + h₀)/(1 + h̄))`` in log space
    with ``s`` the kind's RMS leave-one-out log error — a new model is judged like a left-out one.
    n − 2, not n − 1: the chosen kind is the one whose leave-one-out error came out lowest, which
    makes that error a little optimistic; one degree of freedom pays for the choice. On the qed phones
    this brings the 90 % intervals' coverage at k = 5 from 81–87 % to 85–93 % (BENCHMARKS.md)."""
    return (float(np.sqrt(np.mean(loo_residual ** 2))), float(max(1, loo_residual.size - 2)), float(np.mean(leverage)))


def _fit_log(shared: _Shared, warnings: list[str]) -> FitResult | None:
    log_sim, log_device = np.log(shared.sim), np.log(shared.device)
    model = _least_squares([np.ones_like(log_sim), log_sim], log_device)
    if model is None:
        warnings.append("log fit skipped: in log space the sim values are too concentrated to fit and validate")
        return None
    loo_residual = model.residuals / (1.0 - model.leverage)
    return _finish_fit("log", shared, model, np.exp(log_device - loo_residual), log_space=True,
                       interval=_cross_validated_interval(loo_residual, model.leverage),
                       loo_log_rmse=float(np.sqrt(np.mean(loo_residual ** 2))))


def _work_feature(feature_matrix: Mapping[str, np.ndarray]) -> str | None:
    """The first offered feature whose role is work (FLOPs/MACs however named), usable in log space."""
    for name in feature_matrix:
        values = feature_matrix[name]
        if feature_role(name) == "work" and np.all(values > 0) and _has_spread(values):
            return name
    return None


def _fit_log_work(shared: _Shared, feature_matrix: Mapping[str, np.ndarray]) -> FitResult | None:
    """``log y = b + a·log x + c·log FLOPs``: plain least squares, three terms, nothing chosen inside it
    (so its closed-form leave-one-out error is honest). Skipped without a FLOPs/MACs feature."""
    name = _work_feature(feature_matrix)
    if name is None or shared.sim.size < 5:  # 3 terms + a left-out model + 1 residual degree of freedom
        return None
    log_sim, log_device, log_work = np.log(shared.sim), np.log(shared.device), np.log(feature_matrix[name])
    model = _least_squares([np.ones_like(log_sim), log_sim, log_work], log_device)
    if model is None:
        return None
    loo_residual = model.residuals / (1.0 - model.leverage)
    return _finish_fit("log_work", shared, model, np.exp(log_device - loo_residual), log_space=True,
                       features_used=[name], feature_values={name: feature_matrix[name]},
                       interval=_cross_validated_interval(loo_residual, model.leverage),
                       feature_transforms={name: "log"}, loo_log_rmse=float(np.sqrt(np.mean(loo_residual ** 2))))


POPULATION_MIN_MODELS = 20  # a device measured on fewer models says too little about its coefficients


def fit_population_prior(sim: np.ndarray, devices: Mapping[str, np.ndarray], features: Mapping[str, np.ndarray],
                         source: str) -> PopulationPrior:
    """The empirical-Bayes prior of many devices measured on the same models against one sim.

    Each device is fitted by least squares as ``log y = b + a·log x + Σ c_j·log f_j`` on its models
    with every value > 0 and finite (NaN marks a model it was not measured on); the prior is the mean
    and covariance of (a, c) across devices and the median residual std. ``features`` are named so
    that :func:`population_role` knows them (FLOPs/MACs, size); at least 3 devices are needed.
    """
    named = {population_role(name): np.asarray(values, dtype=float) for name, values in features.items()}
    roles = [role for role in POPULATION_ROLES if role in named]
    if not roles:
        raise ValueError("no feature plays a population role; name one of "
                         f"{sorted(name for names in POPULATION_ROLES.values() for name in names)}")
    sim = np.asarray(sim, dtype=float)
    vectors: list[np.ndarray] = []
    residuals: list[float] = []
    for values in devices.values():
        y = np.asarray(values, dtype=float)
        with np.errstate(invalid="ignore"):
            ok = np.isfinite(sim) & np.isfinite(y) & (sim > 0) & (y > 0)
            for role in roles:
                ok &= np.isfinite(named[role]) & (named[role] > 0)
        if ok.sum() < max(POPULATION_MIN_MODELS, len(roles) + 3):
            continue
        design = np.column_stack([np.ones(ok.sum()), np.log(sim[ok]), *(np.log(named[r][ok]) for r in roles)])
        coefficients, *_ = np.linalg.lstsq(design, np.log(y[ok]), rcond=None)
        residual = np.log(y[ok]) - design @ coefficients
        residuals.append(float(np.sqrt(np.sum(residual ** 2) / (ok.sum() - design.shape[1]))))
        vectors.append(coefficients[1:])
    if len(vectors) < len(roles) + 2:
        raise ValueError(f"a population prior needs at least {len(roles) + 2} devices with ≥ "
                         f"{POPULATION_MIN_MODELS} usable models (found {len(vectors)})")
    stacked = np.array(vectors)
    covariance = np.cov(stacked, rowvar=False) + 1e-8 * np.eye(stacked.shape[1])  # positive definite
    return PopulationPrior(("exponent", *roles), tuple(float(v) for v in stacked.mean(axis=0)),
                           tuple(tuple(float(v) for v in row) for row in covariance),
                           float(np.median(residuals)), len(vectors), source)


def _fit_log_pop(shared: _Shared, feature_matrix: Mapping[str, np.ndarray],
                 population: PopulationPrior | None) -> FitResult | None:
    """``log y = b + a·log x + Σ c_j·log f_j`` with b free and (a, c) ~ N(population mean, covariance).

    The posterior mean with the noise fixed at the population's residual std: a ridge whose penalty
    is known in advance (nothing is chosen inside), so its closed-form leave-one-out error is honest.
    Only the offered features' part of the prior is used (the marginal of a Gaussian). The prior
    weight is the share of the (a, c) degrees of freedom the prior supplies rather than the data.
    """
    if population is None:
        return None
    roles: dict[str, str] = {}
    for name in sorted(feature_matrix):
        role = population_role(name)
        values = feature_matrix[name]
        if (role is not None and role in population.terms and role not in roles.values()
                and np.all(values > 0) and _has_spread(values)):
            roles[name] = role
    n = shared.sim.size
    if not roles or n < 4:  # the free scale + a left-out model + residual degrees of freedom
        return None
    names = list(roles)
    index = [0, *(population.terms.index(roles[name]) for name in names)]
    mean = np.array(population.mean)[index]
    covariance_prior = np.array(population.covariance)[np.ix_(index, index)]
    log_sim, log_device = np.log(shared.sim), np.log(shared.device)
    design = np.column_stack([np.ones(n), log_sim, *(np.log(feature_matrix[name]) for name in names)])
    scale = np.max(np.abs(design), axis=0)
    scale[scale == 0] = 1.0
    scaled = design / scale
    p = design.shape[1]
    prior_scaled = np.concatenate([[0.0], mean * scale[1:]])
    precision = np.zeros((p, p))
    inverse_scale = np.diag(1.0 / scale[1:])
    precision[1:, 1:] = population.residual_std ** 2 * (inverse_scale @ np.linalg.inv(covariance_prior) @ inverse_scale)
    gram = scaled.T @ scaled + precision
    if np.linalg.cond(gram) > 1e12:
        return None
    covariance = np.linalg.inv(gram)
    coefficients = covariance @ (scaled.T @ log_device + precision @ prior_scaled)
    leverage = np.einsum("ij,jk,ik->i", scaled, covariance, scaled)
    if leverage.max() > 1.0 - 1e-9:
        return None
    model = _LinearModel(coefficients, scale, covariance, log_device - scaled @ coefficients, leverage)
    loo_residual = model.residuals / (1.0 - leverage)
    prior_weight = min(1.0, max(0.0, 1.0 - (float(leverage.sum()) - 1.0) / (p - 1)))
    residual_std = float(np.sqrt(np.mean(loo_residual ** 2)))
    return _finish_fit(
        "log_pop", shared, model, np.exp(log_device - loo_residual), log_space=True, features_used=names,
        feature_values={name: feature_matrix[name] for name in names},
        interval=_cross_validated_interval(loo_residual, leverage),
        feature_transforms={name: "log" for name in names}, prior_weight=prior_weight,
        prior_source=f"population: {population.source}", loo_log_rmse=residual_std)


# ----------------------------------------------------------------------------------------------
# The Bayesian log-linear kind (issue 31)

SHARE_PRIOR_SD = 0.3  # a share's coefficient ~ N(0, 0.3²): all the work moving into depthwise layers changes time by ~±30 %
BAYES_NOISE_DOF = 1.0  # ν₀: the class's residual std counts as one observation of the noise (σ̂²)


@dataclass
class _BayesPosterior:
    """A Gaussian posterior on scaled columns (intercept flat, the rest from a class prior), noise estimated."""

    device_class: str
    coefficients: np.ndarray
    covariance: np.ndarray  # (XᵀX + σ̂²·Σ⁻¹)⁻¹: the coefficients' covariance is σ̂² times it
    scale: np.ndarray
    residual_std: float  # σ̂
    dof: float  # ν₀ + n − tr H
    log_evidence: float
    leverage: np.ndarray
    residuals: np.ndarray
    prior_weight: float


def _bayes_terms(feature_matrix: Mapping[str, np.ndarray], prior: PopulationPrior) -> list[tuple[str, str]]:
    """(feature, role) the log_bayes kind takes, by role: the first work feature and the first size feature
    the prior knows (in log, every value > 0), then every share (0…1) that varies over the models."""
    terms: list[tuple[str, str]] = []
    for name, values in feature_matrix.items():
        role = feature_role(name)
        if not _has_spread(values):
            continue
        if role in ("work", "size") and role in prior.terms and role not in {r for _, r in terms} \
                and np.all(values > 0):
            terms.append((name, role))
        elif role == "share" and np.all((values >= 0) & (values <= 1)):
            terms.append((name, role))
    return terms


def _bayes_design(log_sim: np.ndarray, feature_matrix: Mapping[str, np.ndarray],
                  terms: Sequence[tuple[str, str]]) -> np.ndarray:
    return np.column_stack([np.ones_like(log_sim), log_sim,
                            *(np.log(feature_matrix[name]) if role != "share" else feature_matrix[name]
                              for name, role in terms)])


def _bayes_posterior(design: np.ndarray, target: np.ndarray, terms: Sequence[tuple[str, str]],
                     prior: PopulationPrior, device_class: str) -> _BayesPosterior | None:
    """The posterior with the coefficients' prior fixed at the class's spread: β ~ N(m₀, Σ) (Σ, m₀ the class
    prior's covariance and mean, shares ~ N(0, SHARE_PRIOR_SD²), the intercept flat), and the noise σ²
    estimated (fixed noise, empirical Bayes): σ̂² = (ν₀·s₀² + RSS) / (ν₀ + n − tr H), iterated with the
    posterior mean. A prior that scaled with the noise (the fully conjugate form) would hold the
    coefficients tighter the less noisy a device is, which is backwards; this one does not."""
    n, p = design.shape
    index = [0, *(prior.terms.index(role) for _, role in terms if role != "share")]
    mean = np.zeros(p - 1)
    covariance = np.zeros((p - 1, p - 1))
    known = [0, *(1 + i for i, (_, role) in enumerate(terms) if role != "share")]
    mean[known] = np.array(prior.mean)[index]
    covariance[np.ix_(known, known)] = np.array(prior.covariance)[np.ix_(index, index)]
    for i, (_, role) in enumerate(terms):
        if role == "share":
            covariance[1 + i, 1 + i] = SHARE_PRIOR_SD ** 2
    scale = np.max(np.abs(design), axis=0)
    scale[scale == 0] = 1.0
    scaled = design / scale
    inverse_scale = np.diag(1.0 / scale[1:])
    prior_precision = np.zeros((p, p))  # of the scaled coefficients, σ² not included
    try:
        prior_precision[1:, 1:] = inverse_scale @ np.linalg.inv(covariance) @ inverse_scale
    except np.linalg.LinAlgError:
        return None
    prior_mean = np.concatenate([[0.0], mean * scale[1:]])
    s0 = prior.residual_std
    variance = s0 ** 2
    gram_data = scaled.T @ scaled
    for _ in range(6):  # σ̂² and the posterior mean settle in a few rounds
        gram = gram_data + variance * prior_precision
        if np.linalg.cond(gram) > 1e12:
            return None
        posterior_covariance = np.linalg.inv(gram)
        coefficients = posterior_covariance @ (scaled.T @ target + variance * prior_precision @ prior_mean)
        residuals = target - scaled @ coefficients
        leverage = np.einsum("ij,jk,ik->i", scaled, posterior_covariance, scaled)
        dof = BAYES_NOISE_DOF + n - float(leverage.sum())
        variance = (BAYES_NOISE_DOF * s0 ** 2 + float(residuals @ residuals)) / max(dof, 1.0)
    if leverage.max() > 1.0 - 1e-9:
        return None
    shift = coefficients - prior_mean
    # The evidence at σ̂² (Gaussian, exact): the flat intercept adds the same constant for every class.
    _, log_det_posterior = np.linalg.slogdet(gram_data / variance + prior_precision)
    _, log_det_prior = np.linalg.slogdet(prior_precision[1:, 1:])
    log_evidence = (-0.5 * (float(residuals @ residuals) / variance + float(shift @ prior_precision @ shift))
                    - 0.5 * (n - 1) * math.log(2 * math.pi * variance) + 0.5 * log_det_prior - 0.5 * log_det_posterior)
    prior_weight = min(1.0, max(0.0, 1.0 - (float(leverage.sum()) - 1.0) / (p - 1)))
    return _BayesPosterior(device_class, coefficients, posterior_covariance, scale, math.sqrt(variance),
                           max(dof, 1.0), log_evidence, leverage, residuals, prior_weight)


def _bayes_best(log_sim: np.ndarray, target: np.ndarray, feature_matrix: Mapping[str, np.ndarray],
                priors: Mapping[str, PopulationPrior]) -> tuple[_BayesPosterior, list[tuple[str, str]]] | None:
    """The posterior under the class prior with the highest evidence (one class given: that one)."""
    best: tuple[_BayesPosterior, list[tuple[str, str]]] | None = None
    for device_class, prior in priors.items():
        terms = _bayes_terms(feature_matrix, prior)
        posterior = _bayes_posterior(_bayes_design(log_sim, feature_matrix, terms), target, terms, prior, device_class)
        if posterior is not None and (best is None or posterior.log_evidence > best[0].log_evidence):
            best = (posterior, terms)
    return best


def _fit_log_bayes(shared: _Shared, feature_matrix: Mapping[str, np.ndarray],
                   priors: Mapping[str, PopulationPrior], *, class_given: bool) -> FitResult | None:
    """``log y = b + a·log x + Σ c_j·f_j`` with a Normal-inverse-gamma posterior (module doc).

    The class prior is the one given, else the class whose prior makes these models most likely (its
    evidence); that choice is redone without each model for the leave-one-out error (nested), which is
    what the kind is judged by. The interval is the posterior predictive: Student t with νₙ degrees of
    freedom and scale sₙ·√(1 + x₀ᵀΛₙ⁻¹x₀), wider where the new model sits far from the calibration models."""
    if not priors or shared.sim.size < 4:
        return None
    log_sim, log_device = np.log(shared.sim), np.log(shared.device)
    found = _bayes_best(log_sim, log_device, feature_matrix, priors)
    if found is None:
        return None
    posterior, terms = found
    n = log_sim.size
    loo_residual = posterior.residuals / (1.0 - posterior.leverage)  # the closed form, above NESTED_LOO_LIMIT
    keep = np.ones(n, dtype=bool)
    for index in range(n if n <= NESTED_LOO_LIMIT else 0):
        keep[index] = False
        inner = _bayes_best(log_sim[keep], log_device[keep], {name: v[keep] for name, v in feature_matrix.items()},
                            priors)
        keep[index] = True
        if inner is None:  # too concentrated without this model: the closed form of the full choice
            loo_residual[index] = posterior.residuals[index] / (1.0 - posterior.leverage[index])
            continue
        row = _bayes_design(log_sim[index:index + 1], {name: v[index:index + 1] for name, v in feature_matrix.items()},
                            inner[1])
        loo_residual[index] = log_device[index] - float(((row / inner[0].scale) @ inner[0].coefficients)[0])
    model = _LinearModel(posterior.coefficients, posterior.scale, posterior.covariance, posterior.residuals,
                         posterior.leverage)
    names = [name for name, _ in terms]
    prior = priors[posterior.device_class]
    return _finish_fit(
        "log_bayes", shared, model, np.exp(log_device - loo_residual), log_space=True, features_used=names,
        feature_values={name: feature_matrix[name] for name in names},
        interval=(posterior.residual_std, posterior.dof, None),
        feature_transforms={name: "linear" if role == "share" else "log" for name, role in terms},
        prior_weight=posterior.prior_weight,
        prior_source=f"{posterior.device_class} class ({'given' if class_given else 'by evidence'}): {prior.source}",
        loo_log_rmse=float(np.sqrt(np.mean(loo_residual ** 2))), device_class=posterior.device_class)


@dataclass
class _RidgeChoice:
    """One log_ridge model: which features, which λ, and the fit on scaled columns."""

    used: list[str]
    model: _LinearModel
    ridge_lambda: float
    prior_weight: float
    score: float  # mean squared leave-one-out log error (λ and features fixed)


def _ridge(columns: Sequence[np.ndarray], target: np.ndarray, prior_vector: np.ndarray,
           penalize_intercept: bool, ridge_lambda: float) -> tuple[_LinearModel, float] | None:
    """Ridge toward ``prior_vector`` with penalty λ·n·Σ sd_j²·(θ_j − prior_j)²; (model, prior weight).

    Columns are max-abs scaled as in ``_least_squares``; sd_j is the spread of column j over the
    calibration models (the intercept's weight is 1 when it is shrunk, else 0). The closed-form
    leave-one-out residuals e_i/(1 − h_ii) keep this penalty (sd_j, n) fixed while a model is left out.
    """
    design = np.column_stack(columns)
    scale = np.max(np.abs(design), axis=0)
    scale[scale == 0] = 1.0
    scaled = design / scale
    prior_scaled = prior_vector * scale
    n, p = scaled.shape
    weights = scaled.std(axis=0) ** 2
    weights[0] = 1.0 if penalize_intercept else 0.0
    penalized = p - (0 if penalize_intercept else 1)
    if math.isinf(ridge_lambda):  # the prior itself, with the intercept re-estimated when it is free
        coefficients = prior_scaled.copy()
        covariance = np.zeros((p, p))
        if not penalize_intercept:
            coefficients[0] = float(np.mean(target - scaled[:, 1:] @ prior_scaled[1:]))
            covariance[0, 0] = 1.0 / n
        leverage = np.full(n, 0.0 if penalize_intercept else 1.0 / n)
        model = _LinearModel(coefficients, scale, covariance, target - scaled @ coefficients, leverage)
        return model, 1.0
    penalty = np.diag(ridge_lambda * n * weights)
    gram = scaled.T @ scaled + penalty
    try:
        covariance = np.linalg.inv(gram)
    except np.linalg.LinAlgError:
        return None
    if not np.all(np.isfinite(covariance)) or np.linalg.cond(gram) > 1e12:
        return None  # collinear columns without enough shrinkage: no unique fit
    coefficients = covariance @ (scaled.T @ target + penalty @ prior_scaled)
    leverage = np.einsum("ij,jk,ik->i", scaled, covariance, scaled)
    if leverage.max() > 1.0 - 1e-9:
        return None  # some point alone determines a coefficient: its LOO error is undefined
    data_dof = float(leverage.sum()) - (0.0 if penalize_intercept else 1.0)
    prior_weight = min(1.0, max(0.0, 1.0 - data_dof / penalized)) if penalized else 0.0
    return _LinearModel(coefficients, scale, covariance, target - scaled @ coefficients, leverage), prior_weight


def _ridge_path_scores(columns: Sequence[np.ndarray], target: np.ndarray, prior_vector: np.ndarray,
                       penalize_intercept: bool) -> np.ndarray:
    """Mean squared leave-one-out residual of ``_ridge`` for every λ of RIDGE_LAMBDAS from one SVD.

    The same penalty in raw units, λ·n·(β₀² if shrunk + Σ sd_j²·β_j²) around the prior, written with
    standardized columns Z so that it is λ·n·‖γ‖²: then H(λ) = [1/n] + U·diag(s²/(s² + λn))·Uᵀ.
    inf marks a λ whose fit is not unique or whose leave-one-out error is undefined.
    """
    design = np.column_stack(columns)
    n = design.shape[0]
    shifted = target - design @ prior_vector  # the prior becomes 0
    rest = design[:, 1:]
    spread = rest.std(axis=0)
    if not np.all(spread > 0):  # a constant column (the caller drops them): no fit is unique
        return np.full(len(RIDGE_LAMBDAS), np.inf)
    if penalize_intercept:
        standardized, response, base = np.column_stack([np.ones(n), rest / spread]), shifted, 0.0
    else:
        standardized, response, base = (rest - rest.mean(axis=0)) / spread, shifted - shifted.mean(), 1.0 / n
    u, singular, _ = np.linalg.svd(standardized, full_matrices=False)
    projected = u.T @ response
    squared = singular ** 2
    scores = np.full(len(RIDGE_LAMBDAS), np.inf)
    for index, ridge_lambda in enumerate(RIDGE_LAMBDAS):
        if math.isinf(ridge_lambda):
            shrink = np.zeros_like(squared)
        elif ridge_lambda == 0.0:
            if singular.min() <= 1e-6 * singular.max():
                continue  # collinear columns without shrinkage: no unique fit
            shrink = np.ones_like(squared)
        else:
            shrink = squared / (squared + ridge_lambda * n)
        leverage = base + (u ** 2) @ shrink
        if leverage.max() > 1.0 - 1e-9:
            continue
        residual = response - u @ (shrink * projected)
        scores[index] = float(np.mean((residual / (1.0 - leverage)) ** 2))
    return scores


def _choose_ridge(log_sim: np.ndarray, target: np.ndarray, candidates: Mapping[str, np.ndarray],
                  prior: Prior, transforms: Mapping[str, str]) -> _RidgeChoice | None:
    """Features by greedy forward selection and λ from RIDGE_LAMBDAS, both by leave-one-out log error.

    A feature with no spread over these models (all zero depthwise FLOPs once the one depthwise
    model is left out) says nothing about them and cannot be standardized: it is left out.
    """
    candidates = {name: values for name, values in candidates.items() if _has_spread(values)}

    def setup(used: list[str]) -> tuple[list[np.ndarray], np.ndarray]:
        columns = [np.ones_like(log_sim), log_sim, *(candidates[name] for name in used)]
        prior_vector = np.array([prior.log_factor or 0.0, prior.exponent,
                                 *(prior.feature_prior(name, transforms[name]) for name in used)])
        return columns, prior_vector

    def best_for(used: list[str]) -> tuple[float, int] | None:
        """(score, index into RIDGE_LAMBDAS); a tie keeps the smaller λ."""
        columns, prior_vector = setup(used)
        scores = _ridge_path_scores(columns, target, prior_vector, prior.log_factor is not None)
        best: tuple[float, int] | None = None
        for index, score in enumerate(scores):
            if math.isfinite(score) and (best is None or score < best[0] * (1.0 - 1e-12)):
                best = (float(score), index)
        return best

    # A prior from an earlier fit brings its features: its exponent only means what it says beside them.
    used = _prior_features(candidates, prior, transforms)
    best = best_for(used)
    if best is None:
        return None
    remaining = [name for name in candidates if name not in used]
    while remaining and log_sim.size - (len(used) + 3) >= 2:  # keep ≥ 2 residual degrees of freedom
        trials = [(trial, name) for name in remaining if (trial := best_for([*used, name])) is not None]
        if not trials:
            break
        trial, name = min(trials, key=lambda t: t[0][0])
        # A feature must cut the RMS leave-one-out log error by FEATURE_MIN_RELATIVE_GAIN to stay.
        if not math.sqrt(trial[0]) < math.sqrt(best[0]) * (1.0 - FEATURE_MIN_RELATIVE_GAIN):
            break
        used.append(name)
        remaining.remove(name)
        best = trial
    ridge_lambda = RIDGE_LAMBDAS[best[1]]
    columns, prior_vector = setup(used)
    fitted = _ridge(columns, target, prior_vector, prior.log_factor is not None, ridge_lambda)
    if fitted is None:  # the scaled solve judged the columns collinear where the SVD did not
        return None
    model, weight = fitted
    return _RidgeChoice(used, model, ridge_lambda, weight, best[0])


def _prior_features(candidates: Mapping[str, np.ndarray], prior: Prior, transforms: Mapping[str, str]) -> list[str]:
    """The offered features the prior has a coefficient for, taken the same way (always in the model)."""
    return [name for name in candidates
            if name in prior.features and prior.feature_transforms.get(name, transforms[name]) == transforms[name]]


def _has_spread(values: np.ndarray) -> bool:
    """Whether a feature varies over these models beyond rounding (else it carries no information)."""
    return bool(np.ptp(values) > 1e-9 * max(1.0, float(np.max(np.abs(values)))))


def _log_feature_columns(feature_matrix: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Counts and sizes (all > 0, some > 1) enter in log space as their log; shares (0…1) as they are.

    Features that do not vary over the calibration models carry no information and are left out.
    """
    columns, transforms = {}, {}
    for name, values in feature_matrix.items():
        if not _has_spread(values):
            continue
        transform = "log" if np.all(values > 0) and np.max(values) > 1 else "linear"
        columns[name] = np.log(values) if transform == "log" else values
        transforms[name] = transform
    return columns, transforms


def _fit_log_ridge(shared: _Shared, feature_matrix: Mapping[str, np.ndarray], prior: Prior,
                   warnings: list[str]) -> FitResult | None:
    log_sim, log_device = np.log(shared.sim), np.log(shared.device)
    candidates, transforms = _log_feature_columns(feature_matrix)
    choice = _choose_ridge(log_sim, log_device, candidates, prior, transforms)
    if choice is None:
        warnings.append("log_ridge fit skipped: in log space the sim values are too concentrated to fit and validate")
        return None
    n = log_sim.size
    nested = n <= NESTED_LOO_LIMIT
    loo_residual = _nested_loo(log_sim, log_device, candidates, prior, transforms, choice) if nested else \
        choice.model.residuals / (1.0 - choice.model.leverage)
    without_features: float | None = None
    if candidates:
        # Features must earn their place in the honest (nested) error too, not only in the plain LOO
        # that chose them: else a constant-ratio family picks up a chance feature now and then.
        forced = {name: candidates[name] for name in _prior_features(candidates, prior, transforms)}
        plain = choice if choice.used == list(forced) else (
            _choose_ridge(log_sim, log_device, forced, prior, transforms) or choice)
        plain_residual = loo_residual if plain is choice else (
            _nested_loo(log_sim, log_device, forced, prior, transforms, plain) if nested
            else plain.model.residuals / (1.0 - plain.model.leverage))
        without_features = _loo_errors(shared.device, np.exp(log_device - plain_residual))[0]
        if plain is not choice and not np.mean(loo_residual ** 2) < np.mean(plain_residual ** 2):
            choice, loo_residual = plain, plain_residual
    residual_std = float(np.sqrt(np.mean(loo_residual ** 2)))
    loo_prediction = np.exp(log_device - loo_residual)
    return _finish_fit(
        "log_ridge", shared, choice.model, loo_prediction, log_space=True, features_used=choice.used,
        loo_mape_without_features=without_features,
        feature_values={name: feature_matrix[name] for name in choice.used},
        loo_exact=nested, interval=_cross_validated_interval(loo_residual, choice.model.leverage),
        feature_transforms={name: transforms[name] for name in choice.used}, ridge_lambda=choice.ridge_lambda,
        prior_weight=choice.prior_weight, prior_source=prior.source, loo_log_rmse=residual_std)


def _nested_loo(log_sim: np.ndarray, log_device: np.ndarray, candidates: Mapping[str, np.ndarray], prior: Prior,
                transforms: Mapping[str, str], choice: _RidgeChoice) -> np.ndarray:
    """Log residual of each model predicted by the whole choice (features, λ) redone without it."""
    n = log_sim.size
    residual = np.empty(n)
    keep = np.ones(n, dtype=bool)
    for index in range(n):
        keep[index] = False
        inner = _choose_ridge(log_sim[keep], log_device[keep],
                              {name: values[keep] for name, values in candidates.items()}, prior, transforms)
        keep[index] = True
        if inner is None:  # too concentrated without this model: fall back to the closed form
            residual[index] = choice.model.residuals[index] / (1.0 - choice.model.leverage[index])
            continue
        row = np.array([1.0, log_sim[index], *(candidates[name][index] for name in inner.used)])
        residual[index] = log_device[index] - (row / inner.model.column_scale) @ inner.model.coefficients
    return residual


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
                feature_values: Mapping[str, np.ndarray] | None = None, loo_exact: bool = True,
                interval: tuple[float, float, float | None] | None = None, **extra: Any) -> FitResult:
    """Compute the figures every kind reports, from its linear model in fit space.

    ``interval`` (residual_std, dof, mean_leverage) replaces the classic least-squares interval
    figures; ``extra`` sets further FitResult fields (the log_ridge kind's transforms and prior).
    """
    if interval is None:
        dof = float(shared.sim.size - model.coefficients.size)
        interval = (float(np.sqrt(np.sum(model.residuals ** 2) / dof)), dof, None)
    residual_std, dof, mean_leverage = interval
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
        covariance_factor=[[float(v) for v in row] for row in model.covariance_factor], dof=dof,
        mean_leverage=mean_leverage, **extra,
    )
    fit.ranges = {"x": [float(shared.sim.min()), float(shared.sim.max())],
                  **{name: [float(np.min(v)), float(np.max(v))] for name, v in (feature_values or {}).items()}}
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
    for model, group in by_model.items():
        differing = sorted({name for pair in group for name in pair.features
                            if len({p.features.get(name) for p in group}) > 1})
        if differing:  # another batch size or input size is another configuration, not a repeat
            raise CalibrationInputError(
                f"model {model!r} appears with different {', '.join(differing)} values: those are different "
                f"configurations, not repeats to average; calibrate them apart (a group per configuration) "
                f"or give them different model names")
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


def _t_quantile(confidence: float, dof: float) -> float:
    return float(stats.t.ppf(0.5 + confidence / 2.0, dof))


def _nan_to_none(value: float) -> float | None:
    return None if value is None or math.isnan(value) else float(value)


def _none_to_nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


# ----------------------------------------------------------------------------------------------
# Choosing what to measure


MAX_SUGGEST_CANDIDATES = 100_000  # more is a mistake, not a lab
SUGGEST_REFERENCE_MODELS = 2000  # above it the design chooses among a fixed-seed sample of the candidates
SUGGEST_LENGTH_SCALE = 1.0  # of the smooth departure from the line, in standard deviations of each column


def suggest_models(candidates: Sequence[Pair], count: int, *, features: Sequence[str] = (),
                   measured: Sequence[Pair] = (), class_priors: Mapping[str, PopulationPrior] | None = None,
                   device_class: str = "single_core") -> list[str]:
    """The ``count`` candidate models whose device measurements would most sharpen the predictions.

    A Bayesian design on the ``log_bayes`` model (issue 31): the columns are 1, log sim and the offered
    features by role (``_bayes_terms``), the coefficients' prior that of ``device_class`` (the shipped
    class priors unless given), the noise the class's residual std. Each step adds the candidate that
    most reduces the predictive variance summed over every candidate, ``Σ_c (x_cᵀVx_j)² / (σ² + x_jᵀVx_j)``
    with V the posterior covariance given the models measured so far (``measured`` already count), then
    updates V — over the joint prior of the predictions, the line's plus a smooth departure from it (a
    Gaussian process over the standardized columns, as large as the noise): a line alone would chase the
    corners, and where the prior already pins the exponent a model where many candidates lie teaches more. ``Pair.y`` of
    candidates is ignored. Raises ``ValueError`` for a bad count, a non-positive or non-finite sim value,
    or a feature missing from a candidate.
    """
    if not 1 <= count <= len(candidates):
        raise ValueError(f"--suggest needs 1 to {len(candidates)} (the candidates), got {count}")
    if len(candidates) > MAX_SUGGEST_CANDIDATES:
        raise ValueError(f"{len(candidates)} candidates: at most {MAX_SUGGEST_CANDIDATES}")
    everyone = [*measured, *candidates]
    sim = np.array([p.x for p in everyone], dtype=float)
    bad = np.flatnonzero(~(np.isfinite(sim) & (sim > 0)))
    if bad.size:
        raise ValueError(f"sim value of model {everyone[bad[0]].model!r} must be a finite number > 0")
    feature_matrix = _feature_columns(everyone, features)
    priors = shipped_class_priors() if class_priors is None else dict(class_priors)
    prior = priors.get(device_class) or next(iter(priors.values()))
    terms = _bayes_terms(feature_matrix, prior)
    design = _bayes_design(np.log(sim), feature_matrix, terms)
    pool_rows = design[len(measured):]
    centre = pool_rows.mean(axis=0)
    centre[0] = 0.0
    design = design - centre  # the intercept then stands for the candidates' typical model
    p = design.shape[1]
    covariance = np.zeros((p, p))
    covariance[0, 0] = 100.0  # the device's scale: unknown (a factor e^10 either way)
    index = [0, *(prior.terms.index(role) for _, role in terms if role != "share")]
    known = [1, *(2 + i for i, (_, role) in enumerate(terms) if role != "share")]
    covariance[np.ix_(known, known)] = np.array(prior.covariance)[np.ix_(index, index)]
    for i, (_, role) in enumerate(terms):
        if role == "share":
            covariance[2 + i, 2 + i] = SHARE_PRIOR_SD ** 2
    noise = prior.residual_std ** 2
    # What the line cannot say: a smooth departure from it (a Gaussian process over the standardized
    # columns), as large as the noise. It makes the design representative, not only extreme or central.
    rest = design[:, 1:]
    spread_of = rest[len(measured):].std(axis=0)
    standardized = rest / np.where(spread_of > 0, spread_of, 1.0)
    limit = min(len(candidates), SUGGEST_REFERENCE_MODELS)
    reference = np.arange(len(candidates)) if limit == len(candidates) else \
        np.sort(np.random.default_rng(_SAMPLING_SEED).choice(len(candidates), size=limit, replace=False))
    rows = np.concatenate([np.arange(len(measured)), len(measured) + reference])

    def local(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        distance = ((standardized[a][:, None, :] - standardized[b][None, :, :]) ** 2).sum(axis=2)
        return noise * np.exp(-0.5 * distance / SUGGEST_LENGTH_SCALE ** 2)

    joint = design[rows] @ covariance @ design[rows].T + local(rows, rows)  # prior covariance of the predictions
    already = np.arange(len(measured))
    if already.size:  # condition on the models already measured
        solve = np.linalg.solve(joint[np.ix_(already, already)] + noise * np.eye(already.size), joint[already])
        joint = joint - joint[:, already] @ solve
    pool_index = np.arange(len(measured), rows.size)
    joint = joint[np.ix_(pool_index, pool_index)]  # the candidates (or their reference sample)
    pool = list(range(pool_index.size))
    chosen: list[int] = []
    for _ in range(count):
        column = joint[:, pool]
        gain = (column ** 2).sum(axis=0) / (noise + np.diag(joint)[pool])
        best = pool.pop(int(np.argmax(gain)))  # ties: the first listed, so the answer is reproducible
        chosen.append(best)
        joint = joint - np.outer(joint[:, best], joint[best]) / (noise + joint[best, best])
    return [candidates[int(reference[index])].model for index in chosen]


# ----------------------------------------------------------------------------------------------
# CSV helpers for the offline mode


def read_pairs_csv(path: str | Path, x: str = "x", y: str = "y", model: str = "model", group: str | None = None,
                   features: Sequence[str] = (), require_y: bool = True) -> dict[str | None, list[Pair]]:
    """Pairs from a CSV with a header, grouped by the ``group`` column (one group ``None`` without it).

    A ``family`` column, when present, fills ``Pair.family``. ``features`` are columns read into
    ``Pair.features``; ``"auto"`` among them stands for every column but x, y, model, group and
    family whose every cell is a finite number. Errors name file, line and column. With
    ``require_y`` False (candidates for ``suggest_models``) the y column may be absent or empty: y is NaN.
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
        auto = "auto" in features
        features = [name for name in dict.fromkeys(features) if name != "auto"]
        needed = [model, x, *([y] if require_y else []), *([group] if group else []), *features]
        missing = [column for column in needed if column not in header]
        if missing:
            raise CalibrationInputError(f"{path}:1: column(s) {', '.join(map(repr, missing))} not in the "
                                        f"header (columns: {', '.join(header)})")
        rows = list(reader)
        if auto:
            reserved = {model, x, y, group, "family"}
            features += [column for column in header if column not in reserved and column not in features
                         and rows and all(_is_number(row.get(column)) for row in rows)]
        groups: dict[str | None, list[Pair]] = {}
        for index, row in enumerate(rows):
            line = index + 2
            name = _text_cell(row, model, path, line)
            has_y = require_y or (y in header and (row.get(y) or "").strip() != "")
            pair = Pair(model=name, x=_number_cell(row, x, path, line),
                        y=_number_cell(row, y, path, line) if has_y else math.nan,
                        family=(row.get("family") or None) if "family" in header else None,
                        features={f: _number_cell(row, f, path, line) for f in features})
            key = _text_cell(row, group, path, line) if group else None
            groups.setdefault(key, []).append(pair)
    if not groups:
        raise CalibrationInputError(f"{path}:2: no data rows after the header")
    return groups


def predict_rows(calibration: Calibration, rows: Iterable[Mapping[str, Any]], *, x: str = "x",
                 kind: str | None = None, source: str | None = None, first_line: int = 2,
                 confidence: float | None = None) -> list[dict[str, Any]]:
    """Each row with ``estimate``, ``low``, ``high`` (chosen fit; ``confidence``, default the calibration's),
    ``verdict`` ("ok" or "extrapolating") and ``extrapolation`` (the inputs outside the fit's range, as text).

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
    level = calibration.confidence if confidence is None else confidence
    _check_confidence(level)
    estimate, low, high = fit.predict_arrays(sim, feature_values, level)
    outside = fit.extrapolation(sim, feature_values)
    for row, e, lo, hi, out in zip(materialised, estimate, low, high, outside):
        row.update(estimate=float(e), low=float(lo), high=float(hi), verdict="extrapolating" if out else "ok",
                   extrapolation="; ".join(map(str, out)))
    return materialised


def _is_number(text: Any) -> bool:
    try:
        return text is not None and math.isfinite(float(text))
    except ValueError:
        return False


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
