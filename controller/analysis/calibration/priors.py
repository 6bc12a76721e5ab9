"""Population priors learned across devices (issue 31): feature roles, the per-class priors shipped with
farm, and fitting one from many devices. Imports only ``core``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from farm.controller.analysis.calibration.core import CalibrationInputError, FitResult

POPULATION_FORMAT = "farm.population-prior/1"
# The roles a population prior knows, and the feature names that play them (coefficients of logs are unit-free).
POPULATION_ROLES: dict[str, tuple[str, ...]] = {
    "work": ("flops", "macs", "gflops", "gmacs", "mflops", "mmacs"),
    "size": ("size", "size_bytes", "param_bytes", "model_bytes"),
}
POPULATION_PRIOR_FILE = Path(__file__).parent.with_name("population_prior.json")  # beside the package, in analysis/


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
