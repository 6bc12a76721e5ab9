"""Run records for `farm results`: the JSON contract other tools and later issues rely on.

One record per task, from its latest run (a retried task shows the attempt that counted).
"""

from __future__ import annotations

import json
from typing import Any

from farm.controller.store import Store
from farm.proto.spec import default_cpus

MiB = 1 << 20
# Model facts a record carries beside name, size and parameters: what calibrations use as features.
MODEL_FACTS_IN_RECORDS = ("macs", "conv_macs_share", "depthwise_macs_share", "fc_macs_share", "other_macs_share",
                          "activation_bytes")

def _mb(v: float | None) -> float | None:
    return None if v is None else round(v / MiB, 2)


def _round(v: float | None, digits: int = 4) -> float | None:
    return None if v is None else round(v, digits)


def _limits(row: dict[str, Any]) -> dict[str, Any]:
    """The budget a run really had; for a sim task not run yet, the budget it will be given."""
    if row["run_id"] is not None or row["target"] != "sim":
        return {"cpus": row["limits_cpus"], "cpuset": row["limits_cpuset"], "memory_mb": row["limits_memory_mb"]}
    sim = json.loads(row["task_spec_json"])["sim"]
    return {"cpus": default_cpus(sim.get("cpus"), row["threads"]), "cpuset": sim.get("cpuset"),
            "memory_mb": _mb(sim.get("memory"))}


def run_records(store: Store, job_id: int) -> list[dict[str, Any]]:
    records = []
    for row in store.run_rows(job_id):
        facts = json.loads(row["model_facts_json"] or "{}")
        latency = None
        if row.get("latency_avg_ms") is not None:
            latency = {k: _round(row[f"latency_{k}_ms"]) for k in
                       ("init", "first", "avg", "p50", "p90", "p99", "std", "min", "max")}
            latency["warmup_avg"] = _round(row["latency_warmup_avg_ms"])
            latency["count"] = row["latency_count"]
        records.append({
            "job": row["job"],
            "task": row["task"],
            "model": {"name": row["model_name"], "sha256": row["model_sha256"], "family": row["model_family"],
                      "path": row["model_path"], "size_bytes": row["model_size_bytes"],
                      "param_count": row["model_param_count"],
                      **{name: facts.get(name) for name in MODEL_FACTS_IN_RECORDS}},
            "target": row["target"],
            "threads": row["threads"],
            "batch_size": row["batch_size"],
            "input_size": row["input_size"],
            "repeat": row["repeat"],
            "pair_key": row["pair_key"],
            "status": row["task_status"],
            "attempts": row["attempts"],
            "failure_class": row["task_failure_class"],
            "message": row["task_message"] or "",
            "latency_ms": latency,
            "whole_run_s": _round(row["whole_run_s"]),
            "peak_memory_mb": _mb(row.get("peak_memory_bytes")),
            "peak_memory_source": row.get("peak_memory_source"),
            "avg_memory_mb": _mb(row.get("avg_memory_bytes")),
            # boards with power rails (Jetsons) integrate it over the timed loop; None elsewhere
            "energy_per_inference_mj": _round((json.loads(row["environment_json"] or "{}")
                                               .get("energy_per_inference_mj")) if row["environment_json"] else None),
            "baseline_memory_mb": _mb(row.get("baseline_memory_bytes")),
            "peak_rss_mb": _mb(row.get("peak_rss_bytes")),
            "cpu_percent": {"avg": _round(row.get("cpu_avg_percent"), 1), "peak": _round(row.get("cpu_peak_percent"), 1)},
            "io": {"block_read_bytes": row.get("block_read_bytes"), "block_write_bytes": row.get("block_write_bytes"),
                   "net_rx_bytes": row.get("net_rx_bytes"), "net_tx_bytes": row.get("net_tx_bytes")},
            "sampler": {"interval_ms": row.get("sample_interval_ms"), "samples": row.get("sample_count"),
                        "cpu_percent": _round(row.get("sampler_cpu_percent"), 3)},
            "wall_s": _round(row["wall_s"]),
            "backend": row["backend"],
            "approximate": bool(row["approximate"]) if row["approximate"] is not None else None,
            "limits": _limits(row),
            "run": row["run_id"],
            "runtime": json.loads(row["environment_json"]).get("runtime") if row["environment_json"] else None,
            "contention": json.loads(row["contention_json"]) if row.get("contention_json") else None,
            "tool_versions": json.loads(row["tool_versions_json"]) if row["tool_versions_json"] else {},
        })
    spec = json.loads(store.job(job_id)["spec_json"])
    if spec.get("predict_for"):
        from farm.controller.calibrations import add_predictions
        add_predictions(store, job_id, records, spec["predict_for"], spec["sim"])
    return records


def paired_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Device runs beside their sim twins (same pair key); only pairs where both completed."""
    sims = {r["pair_key"]: r for r in records if r["target"] == "sim" and r["status"] == "completed"}
    pairs = []
    for r in records:
        if r["target"] == "sim" or r["status"] != "completed" or r["pair_key"] not in sims:
            continue
        sim = sims[r["pair_key"]]
        pairs.append({"pair_key": r["pair_key"], "model": r["model"], "device": r["target"], "threads": r["threads"],
                      "batch_size": r["batch_size"], "input_size": r["input_size"], "repeat": r["repeat"],
                      "sim": sim, "device_run": r})
    return pairs
