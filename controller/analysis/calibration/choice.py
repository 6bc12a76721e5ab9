"""Which fit kind a calibration uses (``_choose_kind``) and the ``unsafe`` verdict (``_unsafe_reasons``).
Imports ``core`` and ``fitting``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from farm.controller.analysis.calibration.core import (
    CHOICE_MARGIN,
    CHOICE_TERM_MARGIN,
    LOG_KINDS,
    RICH_MIN_MODELS,
    UNSAFE_EXPONENT,
    UNSAFE_INTERVAL_RATIO,
    UNSAFE_LINEAR_MAPE,
    UNSAFE_LOG_ERROR,
    FitChoice,
    FitResult,
    _nan_to_none,
    _Shared,
)
from farm.controller.analysis.calibration.fitting import _least_squares, _ols_loo_mape


def _free_terms(fit: FitResult) -> int:
    """Coefficients a fit estimates beyond the intercept and the sim's: its features, unless a prior shrinks them."""
    return len(fit.features_used)


def _offered(fit: FitResult, prior_given: bool) -> bool:
    """Whether the choice may take this kind: a kind with more than two free, unshrunk coefficients needs
    RICH_MIN_MODELS models (log_bayes and log_pop are shrunk toward a prior learned elsewhere; log_ridge is
    too when it was given one)."""
    shrunk = fit.kind in ("log_bayes", "log_pop") or (fit.kind == "log_ridge" and prior_given)
    return shrunk or _free_terms(fit) == 0 or fit.n >= RICH_MIN_MODELS


def _choose_kind(fits: Mapping[str, FitResult], prior_given: bool = False) -> tuple[str, FitChoice]:
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
        return ranked[0], FitChoice(criterion="leave-one-out MAPE",
                                    errors={k: _nan_to_none(fits[k].loo_mape) for k in ranked},
                                    runner_up=ranked[1] if len(ranked) > 1 else None,
                                    not_offered=sorted(set(fits) - set(candidates)))

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
    return best, FitChoice(criterion="leave-one-out RMS log error (nested for log_ridge and log_bayes), "
                           + (f"+{100 * margin:.0f} % for the kinds without the prior" if with_prior else
                              f"+{100 * margin:.0f} % per term more or fewer than {reference_kind}"),
                           errors=errors, runner_up=ranked[1] if len(ranked) > 1 else None,
                           not_offered=sorted(kind for kind in fits if not _offered(fits[kind], prior_given)))


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
