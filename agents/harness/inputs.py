"""Concrete input shapes and random input data for a model's declared inputs."""

from __future__ import annotations

import numpy as np


class InputShapeError(ValueError):
    """A shape the job must fix (names the input and what to set)."""


def resolve_shape(name: str, declared: list[int | str | None], *, layout: str, batch_size: int,
                  input_size: int | None, overrides: dict[str, list[int]]) -> list[int]:
    """Fill batch, spatial and explicitly given dimensions of one input.

    layout is "nhwc" (TFLite) or "nchw" (ONNX): where the spatial dims of a 4-D image are.
    """
    if name in overrides:
        shape = list(overrides[name])
        if len(shape) != len(declared):
            raise InputShapeError(f"input {name!r} has {len(declared)} dimensions, input_shapes gives {len(shape)}")
    else:
        shape = [d if isinstance(d, int) and d > 0 else None for d in declared]
    if shape and (shape[0] is None or name not in overrides):
        shape[0] = batch_size
    if input_size is not None and len(shape) == 4:
        spatial = (1, 2) if layout == "nhwc" else (2, 3)
        for i in spatial:
            shape[i] = input_size
    missing = [i for i, d in enumerate(shape) if d is None]
    if missing:
        raise InputShapeError(
            f"input {name!r} has dynamic dimension(s) {missing} in shape {declared}; "
            f"set workload.input_shapes.{name} to a full shape"
        )
    return [int(d) for d in shape]


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
