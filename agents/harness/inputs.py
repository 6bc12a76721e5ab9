"""Concrete input shapes and random input data for a model's declared inputs."""

from __future__ import annotations

import numpy as np

from farm.models.runtimes import InputShapeError, resolve_shape  # shared with the validator

__all__ = ["InputShapeError", "random_input", "resolve_shape"]


def random_input(shape: list[int], dtype: np.dtype, rng: np.random.Generator) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return rng.random(shape, dtype=np.float32).astype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, 0), min(info.max, 127), size=shape, endpoint=True).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 1, size=shape, endpoint=True).astype(bool)
    raise InputShapeError(f"inputs of type {dtype} are not supported by the built-in benchmark")
