"""Concrete input shapes and the data a run feeds each input: the job's workload.inputs, else a
default (a sample-rate input gets 16000, as the model's callers give it), else random numbers.
Each run says which it used (HarnessOutput.input_values)."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from farm.models.runtimes import InputShapeError, resolve_shape  # shared with the validator

__all__ = ["InputShapeError", "default_value", "feed", "random_input", "resolve_shape"]

# Audio models take the sample rate as an int64 scalar and branch on it (silero-vad's `sr`): a random
# value times a path no caller takes.
SAMPLE_RATE_NAME = re.compile(r"^(sr|sample_?rate|sampling_?rate|samplerate|fs)$", re.IGNORECASE)
DEFAULT_SAMPLE_RATE = 16000
# Transformer inputs whose values mean something (issue 30): random ids up to 127 in a 0/1 field make a BERT-style
# model fail on an index, and an attention mask of random ints is no mask. Integer (or bool) inputs only.
MASK_NAME = re.compile(r"(^|_)mask$", re.IGNORECASE)  # attention_mask, input_mask: every token attended
TYPE_IDS_NAME = re.compile(r"^(token_type_ids|segment_ids|type_ids|token_types)$", re.IGNORECASE)  # one segment
POSITION_IDS_NAME = re.compile(r"^position_ids$", re.IGNORECASE)  # 0, 1, 2, ... along the sequence
TOKEN_IDS_NAME = re.compile(r"^(input_ids|token_ids|ids)$", re.IGNORECASE)  # below workload.vocab_size


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


def _random_description(dtype: np.dtype) -> str:
    if dtype.kind == "f":
        return "random uniform [0, 1)"
    if dtype.kind in "iu":
        return f"random integers [{max(np.iinfo(dtype).min, 0)}, {min(np.iinfo(dtype).max, 127)}]"
    return "random booleans"


def default_value(name: str, dtype: np.dtype, metadata: dict[str, str]) -> tuple[float, str] | None:
    """A value the model's metadata (a key named like the input) or the input's name suggests, with why."""
    text = metadata.get(name)
    if text is not None:
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if math.isfinite(number):
            return number, f"the model's metadata {name}={text[:40]}"
    if SAMPLE_RATE_NAME.match(name) and np.dtype(dtype).kind in "iuf":
        return DEFAULT_SAMPLE_RATE, "default for a sample-rate input"
    return None


def _cast(values: np.ndarray, dtype: np.dtype, name: str) -> np.ndarray:
    dtype = np.dtype(dtype)
    if not np.all(np.isfinite(values.astype(np.float64))):
        raise InputShapeError(f"workload.inputs.{name}: values must be finite numbers")
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        as_float = values.astype(np.float64)
        if np.any(as_float != np.round(as_float)) or as_float.min() < info.min or as_float.max() > info.max:
            raise InputShapeError(f"workload.inputs.{name}: input {name!r} is {dtype}, so its values must be whole "
                                  f"numbers in [{info.min}, {info.max}]")
    return values.astype(dtype)


def feed(name: str, shape: list[int], dtype: np.dtype, spec: dict[str, Any] | None, rng: np.random.Generator,
         metadata: dict[str, str], vocab_size: int | None = None) -> tuple[np.ndarray, str]:
    """The array one input gets, and a one-line account of where its values came from."""
    dtype = np.dtype(dtype)
    spec = spec or {}
    value, random = spec.get("value"), spec.get("random")
    if value is not None:
        array = np.asarray(value, dtype=np.float64 if dtype.kind != "b" else bool)
        try:
            array = np.broadcast_to(array, shape)
        except ValueError:
            raise InputShapeError(f"workload.inputs.{name}: a value of shape {list(array.shape)} does not fit the "
                                  f"input's shape {shape}") from None
        where = f"file {spec['file']}" if spec.get("file") else (
            f"value {value:g}" if isinstance(value, (int, float)) else f"value of shape {list(np.shape(value))}")
        return _cast(np.ascontiguousarray(array), dtype, name), f"{where} (given)"
    if random is not None:
        low, high = float(random["low"]), float(random["high"])
        if dtype.kind in "iu":
            array = rng.integers(math.ceil(low), math.floor(high), size=shape, endpoint=True)
        elif dtype.kind == "f":
            array = rng.uniform(low, high, size=shape)
        else:
            raise InputShapeError(f"workload.inputs.{name}: a random range needs a numeric input, not {dtype}")
        return _cast(array, dtype, name), f"random uniform [{low:g}, {high:g}] (given)"
    if dtype.kind in "iub" and MASK_NAME.search(name):
        return np.ones(shape, dtype=dtype), "value 1 (default for an attention mask: every token attended)"
    if dtype.kind in "iu" and TYPE_IDS_NAME.match(name):
        return np.zeros(shape, dtype=dtype), "value 0 (default for token type ids: one segment)"
    if dtype.kind in "iu" and POSITION_IDS_NAME.match(name) and shape:
        return (np.broadcast_to(np.arange(shape[-1]), shape).astype(dtype),
                "0, 1, 2, ... along the last axis (default for position ids)")
    if dtype.kind in "iu" and TOKEN_IDS_NAME.match(name) and vocab_size is not None:
        high = min(vocab_size - 1, int(np.iinfo(dtype).max))
        return (rng.integers(0, high, size=shape, endpoint=True).astype(dtype),
                f"random token ids [0, {high}] (workload.vocab_size {vocab_size})")
    suggested = default_value(name, dtype, metadata)
    if suggested is not None:
        number, why = suggested
        return _cast(np.full(shape, number, dtype=np.float64), dtype, name), f"value {number:g} ({why})"
    return random_input(shape, dtype, rng), _random_description(dtype)
