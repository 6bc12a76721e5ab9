"""A dataset's samples as they travel with a task, and the accuracy block a run records (issue 30).

The samples, labels and reference outputs are read once where the job is submitted
(controller/scheduling/datasets.py) and packed into `workload.dataset.packed`: one .npz, base64,
loaded anywhere with allow_pickle=False. A run's accuracy block is written by the harness (agents/harness/
dataset.py) inside the sandbox, so the agent bounds it (`bounded_block`) before it is stored, and judges it
against the job's thresholds itself (`verdict`): a run never decides its own pass.
"""

from __future__ import annotations

import base64
import io
import math
from typing import Any

MAX_DATASET_BYTES = 64 << 20  # a dataset's files on disk, summed from their sizes before any is read
MAX_PACKED_BYTES = 16 << 20  # the samples, labels and reference outputs packed: carried with every task
MAX_KEPT_VALUES = 4096  # outputs kept whole (every sample's values) up to this many numbers in all
MAX_OUTPUTS = 32  # outputs a block describes
DATASET_ARTIFACT_NAME = "dataset.npz"  # a packed dataset uploaded to a controller (SubmitJobRequest.dataset_sha256)


def pack(inputs: dict[str, Any], labels: Any | None, reference: dict[str, Any]) -> str:
    """The samples (by input name, first axis the sample), labels and reference outputs as one base64 .npz."""
    import numpy as np

    arrays: dict[str, Any] = {"input_names": np.array(list(inputs), dtype=str),
                              "reference_names": np.array(list(reference), dtype=str)}
    arrays.update({f"in{i}": a for i, a in enumerate(inputs.values())})
    arrays.update({f"ref{i}": a for i, a in enumerate(reference.values())})
    if labels is not None:
        arrays["labels"] = labels
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return base64.b64encode(buffer.getvalue()).decode()


def unpack(packed: str) -> tuple[dict[str, Any], Any | None, dict[str, Any]]:
    """pack's arrays back; ValueError for anything that is not what pack writes (no pickle is ever loaded)."""
    import binascii

    try:
        raw = base64.b64decode(packed, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise ValueError(str(e) or type(e).__name__) from None
    return unpack_bytes(raw)


def unpack_bytes(raw: bytes) -> tuple[dict[str, Any], Any | None, dict[str, Any]]:
    """unpack for the .npz bytes themselves: a dataset uploaded to a controller as an artifact (dataset.npz)."""
    import zipfile

    try:
        return _unpack(raw)
    except (zipfile.BadZipFile, KeyError, OSError, EOFError, TypeError, UnicodeError) as e:
        raise ValueError(str(e) or type(e).__name__) from None


def _unpack(raw: bytes) -> tuple[dict[str, Any], Any | None, dict[str, Any]]:
    import zipfile

    import numpy as np

    if len(raw) > MAX_PACKED_BYTES:
        raise ValueError(f"the packed dataset is {len(raw)} bytes, over {MAX_PACKED_BYTES}")
    with zipfile.ZipFile(io.BytesIO(raw)) as archive:  # sizes from the directory, before anything is inflated
        inflated = sum(member.file_size for member in archive.infolist())
    if inflated > MAX_PACKED_BYTES:
        raise ValueError(f"the packed dataset inflates to {inflated} bytes, over {MAX_PACKED_BYTES}")
    with np.load(io.BytesIO(raw), allow_pickle=False) as data:
        names = [str(n) for n in data["input_names"]]
        ref_names = [str(n) for n in data["reference_names"]]
        inputs = {n: data[f"in{i}"] for i, n in enumerate(names)}
        reference = {n: data[f"ref{i}"] for i, n in enumerate(ref_names)}
        labels = data["labels"] if "labels" in data.files else None
    return inputs, labels, reference


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else (math.copysign(1e308, value) if math.isinf(value) else None)


_FIGURES = ("max_abs_error", "mean_abs_error", "cosine", "psnr_db", "snr_db", "top1", "top5")
_SUMMARY = ("min", "max", "mean", "std")


def bounded_block(raw: Any) -> dict[str, Any] | None:
    """A harness's accuracy block as the store may keep it: known keys, finite numbers, bounded strings."""
    if not isinstance(raw, dict):
        return None
    block: dict[str, Any] = {"samples": int(raw["samples"]) if isinstance(raw.get("samples"), int) else None,
                             "reference": str(raw.get("reference") or "")[:200] or None,
                             "output": str(raw.get("output") or "")[:200] or None}
    outputs: dict[Any, Any] = raw["outputs"] if isinstance(raw.get("outputs"), dict) else {}
    block["outputs"] = {}
    kept_total = 0
    for name, entry in list(outputs.items())[:MAX_OUTPUTS]:
        if not isinstance(entry, dict):
            continue
        kept: dict[str, Any] = {"sha256": str(entry.get("sha256", ""))[:64],
                                "shape": [int(d) for d in entry.get("shape", []) if isinstance(d, int)][:8]}
        kept.update({k: _number(entry.get(k)) for k in _SUMMARY})
        if isinstance(entry.get("agreement"), dict):
            kept["agreement"] = {k: _number(entry["agreement"].get(k)) for k in _FIGURES}
        values = entry.get("values")
        if isinstance(values, list) and kept_total + len(values) <= MAX_KEPT_VALUES:  # the whole block's budget
            kept["values"] = [_number(v) for v in values]
            kept_total += len(values)
        block["outputs"][str(name)[:200]] = kept
    if isinstance(raw.get("agreement"), dict):
        block["agreement"] = {k: _number(raw["agreement"].get(k)) for k in _FIGURES}
    if isinstance(raw.get("accuracy"), dict):
        block["accuracy"] = {k: _number(raw["accuracy"].get(k)) for k in ("top1", "top5")}
    wall = _number(raw.get("wall_s"))
    if wall is not None:
        block["wall_s"] = wall
    return block


def verdict(block: dict[str, Any] | None, thresholds: Any) -> str | None:
    """Why the run's outputs fail the job's thresholds (DatasetSpec.thresholds), or None."""
    if block is None:
        return None
    agreement = block.get("agreement") or {}
    accuracy = block.get("accuracy") or {}
    checks = (
        ("max_abs_error", agreement.get("max_abs_error"), thresholds.max_abs_error, "above"),
        ("min_cosine", agreement.get("cosine"), thresholds.min_cosine, "below"),
        ("min_snr_db", agreement.get("snr_db"), thresholds.min_snr_db, "below"),
        ("min_top1_agreement", agreement.get("top1"), thresholds.min_top1_agreement, "below"),
        ("min_accuracy_top1", accuracy.get("top1"), thresholds.min_accuracy_top1, "below"),
    )
    problems = []
    for name, value, limit, side in checks:
        if limit is None:
            continue
        if value is None:
            problems.append(f"workload.dataset.thresholds.{name} is set but the run has no such figure "
                            f"({'give dataset.labels' if name == 'min_accuracy_top1' else 'give dataset.reference'})")
        elif (value > limit) if side == "above" else (value < limit):
            problems.append(f"{name.removeprefix('min_').removeprefix('max_')} {value:.6g} is {side} "
                            f"workload.dataset.thresholds.{name} {limit:g}")
    if not problems:
        return None
    return f"output of {block.get('output') or 'the model'} mismatches: " + "; ".join(problems)


def judge_accuracy(result: Any, raw: Any, task: Any) -> None:
    """A driver's last word on a run's dataset pass: the block bounded into the run's environment, and a completed
    run whose outputs fail the job's thresholds turned into an `accuracy` failure (its timings stay with it)."""
    from farm.proto.results import FailureClass, RunStatus
    from farm.proto.spec import BenchmarkWorkload

    workload = task.plan.workload
    dataset = workload.dataset if isinstance(workload, BenchmarkWorkload) else None
    if dataset is None:
        return
    block = bounded_block(raw)
    if block is not None:
        result.environment["accuracy"] = block
    if not result.ok:
        return
    if block is None:
        result.status, result.failure_class = RunStatus.FAILED, FailureClass.BUG
        result.message = "the run has workload.dataset but its harness reported no dataset pass"
        return
    why = verdict(block, dataset.thresholds)
    if why is not None:
        result.status, result.failure_class, result.message = RunStatus.FAILED, FailureClass.ACCURACY, why
