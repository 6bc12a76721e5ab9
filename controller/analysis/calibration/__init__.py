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
outside it gets the verdict "extrapolating" with the inputs and ranges (``Estimate.extrapolation``),
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

The package's parts import downward only (issue #35): ``core`` (the types, settings and shared
helpers) under ``priors`` and ``pairs``, under ``fitting`` (the kinds), under ``choice`` and
``suggestions``; this ``__init__`` holds :func:`calibrate` and re-exports every public name, so
``from farm.controller.analysis.calibration import X`` works as it did for the single module.
"""

from __future__ import annotations

import math
import warnings as python_warnings
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from scipy import stats

from farm.controller.analysis.calibration.choice import _choose_kind, _unsafe_reasons
from farm.controller.analysis.calibration.core import (
    ALL_PAIR_FLIPS_LIMIT,
    CHOICE_MARGIN,
    CHOICE_TERM_MARGIN,
    DEFAULT_PRIOR,
    EXTRAPOLATION_MIN_LINEAR_SPAN,
    EXTRAPOLATION_MIN_SHARE_SPAN,
    EXTRAPOLATION_TOLERANCE,
    EXTRAPOLATION_WIDENING,
    FEATURE_MIN_RELATIVE_GAIN,
    FIT_KINDS,
    JSON_FORMAT,
    LOG_KINDS,
    MAX_LISTED_FLIPS,
    NESTED_LOO_LIMIT,
    RICH_MIN_MODELS,
    RIDGE_LAMBDAS,
    ROBUST_EXACT_LOO_LIMIT,
    THEIL_SEN_EXACT_LIMIT,
    THEIL_SEN_SAMPLED_PAIRS,
    UNSAFE_EXPONENT,
    UNSAFE_INTERVAL_RATIO,
    UNSAFE_LINEAR_MAPE,
    UNSAFE_LOG_ERROR,
    WITHIN_SHARE,
    WORK_FEATURES,
    Calibration,
    CalibrationInputError,
    FitResult,
    Flip,
    NotEnoughPairs,
    OutOfRange,
    Pair,
    Estimate,
    Prior,
    _check_confidence,
    _Shared,
)
from farm.controller.analysis.calibration.fitting import (
    BAYES_NOISE_DOF,
    SHARE_PRIOR_SD,
    _fit_log,
    _fit_log_bayes,
    _fit_log_pop,
    _fit_log_ridge,
    _fit_log_work,
    _fit_ols,
    _fit_robust,
    _observed_flips,
)
from farm.controller.analysis.calibration.pairs import (
    _average_repeats,
    _feature_columns,
    predict_rows,
    read_pairs_csv,
)
from farm.controller.analysis.calibration.priors import (
    CLASS_PRIORS_FORMAT,
    DEVICE_CLASSES,
    POPULATION_FORMAT,
    POPULATION_MIN_MODELS,
    POPULATION_PRIOR_FILE,
    POPULATION_ROLES,
    PopulationPrior,
    class_priors_from_json,
    feature_role,
    fit_population_prior,
    population_role,
    shipped_class_priors,
)
from farm.controller.analysis.calibration.suggestions import (
    MAX_SUGGEST_CANDIDATES,
    SUGGEST_LENGTH_SCALE,
    SUGGEST_REFERENCE_MODELS,
    suggest_models,
)

__all__ = [
    "ALL_PAIR_FLIPS_LIMIT",
    "BAYES_NOISE_DOF",
    "CHOICE_MARGIN",
    "CHOICE_TERM_MARGIN",
    "CLASS_PRIORS_FORMAT",
    "Calibration",
    "CalibrationInputError",
    "DEFAULT_PRIOR",
    "DEVICE_CLASSES",
    "EXTRAPOLATION_MIN_LINEAR_SPAN",
    "EXTRAPOLATION_MIN_SHARE_SPAN",
    "EXTRAPOLATION_TOLERANCE",
    "EXTRAPOLATION_WIDENING",
    "FEATURE_MIN_RELATIVE_GAIN",
    "FIT_KINDS",
    "FitResult",
    "Flip",
    "JSON_FORMAT",
    "LOG_KINDS",
    "MAX_LISTED_FLIPS",
    "MAX_SUGGEST_CANDIDATES",
    "NESTED_LOO_LIMIT",
    "NotEnoughPairs",
    "OutOfRange",
    "POPULATION_FORMAT",
    "POPULATION_MIN_MODELS",
    "POPULATION_PRIOR_FILE",
    "POPULATION_ROLES",
    "Pair",
    "PopulationPrior",
    "Estimate",
    "Prior",
    "RICH_MIN_MODELS",
    "RIDGE_LAMBDAS",
    "ROBUST_EXACT_LOO_LIMIT",
    "SHARE_PRIOR_SD",
    "SUGGEST_LENGTH_SCALE",
    "SUGGEST_REFERENCE_MODELS",
    "THEIL_SEN_EXACT_LIMIT",
    "THEIL_SEN_SAMPLED_PAIRS",
    "UNSAFE_EXPONENT",
    "UNSAFE_INTERVAL_RATIO",
    "UNSAFE_LINEAR_MAPE",
    "UNSAFE_LOG_ERROR",
    "WITHIN_SHARE",
    "WORK_FEATURES",
    "calibrate",
    "class_priors_from_json",
    "feature_role",
    "fit_population_prior",
    "population_role",
    "predict_rows",
    "read_pairs_csv",
    "shipped_class_priors",
    "suggest_models",
]


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
    priors = _checked_arguments(kinds, confidence, min_pairs, class_priors, device_class)
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
    shared = _shared_figures(sim, device, names, feature_matrix, confidence, unsafe_rho, warnings)
    nonpositive = [names[i] for i in np.flatnonzero((sim <= 0) | (device <= 0))]
    fits = _fit_every_kind(kinds, shared, nonpositive, warnings, prior=prior, population=population, priors=priors,
                           class_given=device_class is not None)
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


def _checked_arguments(kinds: Sequence[str], confidence: float, min_pairs: int,
                       class_priors: Mapping[str, PopulationPrior] | None,
                       device_class: str | None) -> dict[str, PopulationPrior]:
    """:func:`calibrate`'s arguments checked (a ``ValueError`` naming the bad one); the class priors it uses."""
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
    return priors


def _shared_figures(sim: np.ndarray, device: np.ndarray, names: list[str], feature_matrix: dict[str, np.ndarray],
                    confidence: float, unsafe_rho: float, warnings: list[str]) -> _Shared:
    """What every fit kind shares: the rank agreement of sim and device (warning when it is low) and the flips
    observed."""
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
    return _Shared(sim=sim, device=device, names=names, tau=tau, rho=rho, observed=observed,
                   observed_count=observed_count, confidence=confidence, features=feature_matrix)


def _fit_every_kind(kinds: Sequence[str], shared: _Shared, nonpositive: list[str], warnings: list[str], *,
                    prior: Prior, population: PopulationPrior | None, priors: Mapping[str, PopulationPrior],
                    class_given: bool) -> dict[str, FitResult]:
    """Every kind of ``kinds`` that can be fitted (a log kind is skipped, with a warning, for values ≤ 0)."""
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
                       else _fit_log_work(shared, shared.features) if kind == "log_work"
                       else _fit_log_pop(shared, shared.features, population) if kind == "log_pop"
                       else _fit_log_bayes(shared, shared.features, priors, class_given=class_given)
                       if kind == "log_bayes"
                       else _fit_log_ridge(shared, shared.features, prior, warnings))
            if log_fit is not None:
                fits[kind] = log_fit
        elif kind == "ols":
            fits[kind] = _fit_ols(shared, shared.features)
        else:
            fits[kind] = _fit_robust(shared, warnings)
    return fits
