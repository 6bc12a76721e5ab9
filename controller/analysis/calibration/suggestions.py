"""Choosing what to measure: the Bayesian design of ``suggest_models``. Imports ``core``, ``priors``,
``pairs`` and ``fitting``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from farm.controller.analysis.calibration.core import _SAMPLING_SEED, Pair
from farm.controller.analysis.calibration.fitting import (
    SHARE_PRIOR_SD,
    _bayes_design,
    _bayes_terms,
)
from farm.controller.analysis.calibration.pairs import _feature_columns
from farm.controller.analysis.calibration.priors import (
    PopulationPrior,
    shipped_class_priors,
)

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
        return np.asarray(noise * np.exp(-0.5 * distance / SUGGEST_LENGTH_SCALE ** 2), dtype=float)

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
