"""The fit kinds (ols, log, log_work, log_pop, log_bayes, log_ridge, robust) and the least-squares, ridge,
Bayesian and rank-agreement helpers under them. Imports ``core`` and ``priors``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import linalg, stats

from farm.controller.analysis.calibration.core import (
    _SAMPLING_SEED,
    ALL_PAIR_FLIPS_LIMIT,
    FEATURE_MIN_RELATIVE_GAIN,
    MAX_LISTED_FLIPS,
    NESTED_LOO_LIMIT,
    RIDGE_LAMBDAS,
    ROBUST_EXACT_LOO_LIMIT,
    THEIL_SEN_EXACT_LIMIT,
    THEIL_SEN_SAMPLED_PAIRS,
    WITHIN_SHARE,
    FitResult,
    Flip,
    Prior,
    _LinearModel,
    _Shared,
)
from farm.controller.analysis.calibration.priors import (
    PopulationPrior,
    feature_role,
    population_role,
)


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
