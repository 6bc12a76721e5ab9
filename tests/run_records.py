"""Run records for tests of the renderers and the analysis: a RunRecord (proto/questions.py) from only the fields a
test is about, the rest as a run that reported nothing (None, 0, empty). The record is the model the service answers
with, validated as such, so a test cannot hand a renderer a shape the service never would."""

from __future__ import annotations

from typing import Any

from farm.proto.questions import RunRecord

_MODEL = {"name": "m", "sha256": "", "family": None, "path": None, "size_bytes": None, "param_count": None}
_LATENCY = dict.fromkeys(("init", "first", "avg", "p50", "p90", "p99", "std", "min", "max", "warmup_avg", "count"))
_RECORD: dict[str, Any] = {
    "job": 1, "task": 1, "target": "sim", "threads": 1, "cpus": None, "batch_size": 1, "input_size": None,
    "accelerator": "cpu", "repeat": 0, "pair_key": None, "status": "completed", "attempts": 1, "failure_class": None,
    "message": "", "latency_ms": None, "whole_run_s": None, "throughput_per_s": None, "samples_per_s": None,
    "startup_ms": None, "peak_memory_mb": None, "peak_memory_source": None, "avg_memory_mb": None,
    "energy_per_inference_mj": None, "baseline_memory_mb": None, "peak_rss_mb": None,
    "cpu_percent": {"avg": None, "peak": None},
    "io": {"block_read_bytes": None, "block_write_bytes": None, "net_rx_bytes": None, "net_tx_bytes": None},
    "sampler": {"interval_ms": None, "samples": None, "cpu_percent": None}, "wall_s": None, "backend": None,
    "approximate": None, "limits": {"cpus": None, "cpuset": None, "memory_mb": None}, "run": None, "runtime": None,
    "input_shapes": {}, "input_values": {}, "image_build": None, "contention": None, "tool_versions": {},
}


def run_record(**fields: Any) -> RunRecord:
    """A record with `fields` set; a nested part given in part (model, latency_ms, limits, cpu_percent) keeps the
    rest of that part empty."""
    data = {**_RECORD, **fields}
    data["model"] = {**_MODEL, **(fields.get("model") or {})}
    if fields.get("latency_ms") is not None:
        data["latency_ms"] = {**_LATENCY, **fields["latency_ms"]}
    for part in ("limits", "cpu_percent"):
        data[part] = {**_RECORD[part], **(fields.get(part) or {})}
    return RunRecord.model_validate(data)
