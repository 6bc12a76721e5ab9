"""Pairs in and predictions out: averaging repeats, feature columns, and the CSV helpers of the offline
mode. Imports only ``core``.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from farm.controller.analysis.calibration.core import (
    Calibration,
    CalibrationInputError,
    Pair,
    _check_confidence,
)

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


def predict_rows(calibration: Calibration, rows: Iterable[Mapping[str, str | None]], *, x: str = "x",
                 kind: str | None = None, source: str | None = None, first_line: int = 2,
                 confidence: float | None = None) -> list[dict[str, str | float | None]]:
    """Each row with ``estimate``, ``low``, ``high`` (chosen fit; ``confidence``, default the calibration's),
    ``verdict`` ("ok" or "extrapolating") and ``extrapolation`` (the inputs outside the fit's range, as text).

    Rows are dicts such as ``csv.DictReader`` yields; the sim value is in column ``x`` and the fit's
    features (if any) in columns of the same name. ``source`` (a file name) makes error messages
    read ``source:line: column …``; the first row is on line ``first_line`` (2: after a header).
    """
    fit = calibration.fit(kind)
    materialised: list[dict[str, str | float | None]] = [dict(row) for row in rows]  # a CSV row, its cells as read
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
