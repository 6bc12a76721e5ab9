"""Run records for `farm results`: the JSON contract other tools and later issues rely on.

One record per task, from its latest run (a retried task shows the attempt that counted).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import TypedDict

from farm.proto.accelerators import UNIT_CLASS, Accelerator, default_precision
from farm.controller.store import Store
from pydantic import JsonValue, ValidationError

from farm.controller.store.rows import StoredOpProfileRow, ResultRow
from farm.proto.copying import replaced
from farm.proto.results import FIGURES
from farm.proto.questions import CpuPercent, IoBytes, Latency, Model, RecordLimits, RunModel, RunRecord, Sampler
from farm.proto.spec import SimBudget, default_cpus

MiB = 1 << 20
# Model facts a record carries beside name, size and parameters: what calibrations use as features.
MODEL_FACTS_IN_RECORDS = ("macs", "conv_macs_share", "depthwise_macs_share", "fc_macs_share", "other_macs_share",
                          "conv1x1_macs_share", "conv3x3_macs_share", "grouped_macs_share",
                          "activation_bytes", "op_count")
# Facts added after stores were written (issue 31): a record carries them only where the model's facts have them.
LATER_MODEL_FACTS = ("conv1x1_macs_share", "conv3x3_macs_share", "grouped_macs_share")


def _mb(v: float | None) -> float | None:
    return None if v is None else round(v / MiB, 2)


def _round(v: float | None, digits: int = 4) -> float | None:
    return None if v is None else round(v, digits)


def _limits(row: ResultRow, sim: SimBudget | None) -> RecordLimits:
    """The budget a run really had; for a sim task not run yet, the budget it will be given."""
    if row.run_id is not None or sim is None:
        return RecordLimits(cpus=row.limits_cpus, cpuset=row.limits_cpuset, memory_mb=row.limits_memory_mb)
    return RecordLimits(cpus=default_cpus(sim.cpus, row.threads), cpuset=sim.cpuset, memory_mb=_mb(sim.memory))


def samples_per_s(throughput: float | None, batch_size: int | None) -> float | None:
    """Samples (inputs) per second: every inference of a batch-N run handles N of them."""
    return None if throughput is None else throughput * (batch_size or 1)


def _planned_sim(row: ResultRow) -> SimBudget | None:
    """A sim task's budget as its plan holds it (matrix.cpus, sim.cpus...); None on a device, which has none imposed."""
    if row.target != "sim":
        return None
    return SimBudget.model_validate(json.loads(row.task_spec_json or "{}").get("sim") or {})  # bytes, as stored


def _planned_unit(row: ResultRow) -> str:
    """The compute unit the task was planned on (`cuda`, `tensorrt:fp16`); cpu for every sim run and older rows."""
    plan = json.loads(row.task_spec_json or "{}")
    unit = plan.get("accelerator") or "cpu"
    if unit not in UNIT_CLASS:  # a plan written by a newer version: shown as stored
        return str(unit)
    return str(Accelerator(unit, plan.get("precision") or default_precision(unit)))


def _latency(row: ResultRow) -> Latency | None:
    if row.latency_avg_ms is None:
        return None
    return Latency(init=_round(row.latency_init_ms), first=_round(row.latency_first_ms), avg=_round(row.latency_avg_ms),
                   p50=_round(row.latency_p50_ms), p90=_round(row.latency_p90_ms), p99=_round(row.latency_p99_ms),
                   std=_round(row.latency_std_ms), min=_round(row.latency_min_ms), max=_round(row.latency_max_ms),
                   warmup_avg=_round(row.latency_warmup_avg_ms), count=row.latency_count)


def _run_model(row: ResultRow) -> RunModel:
    facts = json.loads(row.model_facts_json or "{}")
    # every task is scheduled with its model's digest (schedule.py); a row without one reads as ""
    return RunModel(name=row.model_name, sha256=row.model_sha256 or "", family=row.model_family, path=row.model_path,
                    size_bytes=row.model_size_bytes, param_count=row.model_param_count,
                    **{name: facts.get(name) for name in MODEL_FACTS_IN_RECORDS
                       if name not in LATER_MODEL_FACTS or facts.get(name) is not None})


class SparseParts(TypedDict, total=False):
    """A record's fields (RunRecord.SPARSE) its JSON has only when they are set."""

    gpu: dict[str, JsonValue]  # NVIDIA hosts: the GPU's figures over the run (agents/parsers/nvidia_smi)
    accuracy: dict[str, JsonValue]  # workload.dataset's pass (proto/accuracy.py)
    op_profile: list[JsonValue]  # with `ops`: op types, then nodes
    op_profile_note: str | None  # with `ops`: why a run asked for a profile and has none


def _sparse_parts(environment: dict[str, JsonValue], profile: list[JsonValue] | None) -> SparseParts:
    """The GPU's and the dataset pass's figures where the run has them, the op profile (and why there is none)
    when asked for."""
    parts = SparseParts()
    if isinstance(gpu := environment.get("gpu"), dict):
        parts["gpu"] = gpu
    if isinstance(accuracy := environment.get("accuracy"), dict):
        parts["accuracy"] = accuracy
    if profile is not None:
        note = environment.get("op_profile_note")
        parts["op_profile"] = profile
        parts["op_profile_note"] = note if isinstance(note, str) else None
    return parts


def run_record(row: ResultRow, profile: list[JsonValue] | None = None) -> RunRecord:
    """A task's record (`farm results --format json`) from its result row; `profile`: its run's op profile, when
    asked for."""
    environment = json.loads(row.environment_json or "{}")  # read once: several figures come from it
    sim = _planned_sim(row)
    return RunRecord(
        job=row.job, task=row.task, model=_run_model(row), target=row.target, threads=row.threads,
        cpus=default_cpus(sim.cpus, row.threads) if sim else None,  # the swept figure
        batch_size=row.batch_size, input_size=row.input_size, accelerator=_planned_unit(row), repeat=row.repeat,
        pair_key=row.pair_key, status=row.task_status, attempts=row.attempts, failure_class=row.task_failure_class,
        message=row.task_message or "", latency_ms=_latency(row), whole_run_s=_round(row.whole_run_s),
        # inferences (batches) per second over the timed loop, and samples per second (x batch size)
        throughput_per_s=_round(row.throughput_per_s, 3),
        samples_per_s=_round(samples_per_s(row.throughput_per_s, row.batch_size), 3),
        startup_ms=_round(row.startup_ms),  # init + first inference: a cold start
        peak_memory_mb=_mb(row.peak_memory_bytes), peak_memory_source=row.peak_memory_source,
        avg_memory_mb=_mb(row.avg_memory_bytes),
        # boards with power rails (Jetsons) integrate it over the timed loop; None elsewhere
        energy_per_inference_mj=_round(environment.get("energy_per_inference_mj")),
        baseline_memory_mb=_mb(row.baseline_memory_bytes), peak_rss_mb=_mb(row.peak_rss_bytes),
        cpu_percent=CpuPercent(avg=_round(row.cpu_avg_percent, 1), peak=_round(row.cpu_peak_percent, 1)),
        io=IoBytes(block_read_bytes=row.block_read_bytes, block_write_bytes=row.block_write_bytes,
                   net_rx_bytes=row.net_rx_bytes, net_tx_bytes=row.net_tx_bytes),
        sampler=Sampler(interval_ms=row.sample_interval_ms, samples=row.sample_count,
                        cpu_percent=_round(row.sampler_cpu_percent, 3)),
        wall_s=_round(row.wall_s), backend=row.backend,
        approximate=bool(row.approximate) if row.approximate is not None else None,
        limits=_limits(row, sim), run=row.run_id, runtime=environment.get("runtime"),
        input_shapes=environment.get("input_shapes") or {},
        input_values=environment.get("input_values") or {},  # where each input's values came from
        image_build=environment.get("build"),
        contention=json.loads(row.contention_json) if row.contention_json else None,
        tool_versions=json.loads(row.tool_versions_json) if row.tool_versions_json else {},
        **_sparse_parts(environment, profile),
        # the declared run figures (proto/results.py, RunFigure) the run has, each under its record key
        **{f.record: f.shown(row.figures[f.name]) for f in FIGURES if row.figures.get(f.name) is not None})


def _profile(profiles: dict[int, list[StoredOpProfileRow]], run_id: int | None) -> list[JsonValue]:
    return [] if run_id is None else [p.as_dict() for p in profiles.get(run_id, [])]


def run_records(store: Store, job_id: int, *, ops: bool = False) -> list[RunRecord]:
    """One record per task, built once here (the service answers with them, renderers read them); with `ops`,
    each carries its run's op profile (`op_profile`: op types, then nodes)."""
    rows = store.runs.results(job_id)
    profiles = store.runs.op_profiles([r.run_id for r in rows if r.run_id is not None]) if ops else {}
    records = [run_record(row, _profile(profiles, row.run_id) if ops else None) for row in rows]
    job = store.jobs.get(job_id)
    spec = json.loads(job.spec_json or "{}") if job else {}
    if spec.get("predict_for"):
        from farm.controller.analysis.calibrations import add_predictions
        add_predictions(store, records, spec["predict_for"], _job_sim(spec.get("sim")))
    return records


def _job_sim(stored: object) -> SimBudget | None:
    """A job's stored sim budget; None where this farm cannot read it (no calibration then counts as its budget)."""
    try:
        return SimBudget.model_validate(stored)
    except ValidationError:
        return None


class RunPair(Model):
    """A device run beside its sim twin (same pair key), both completed: `farm results --pairs`'s row."""

    pair_key: str
    model: RunModel
    device: str
    threads: int
    batch_size: int
    input_size: int | None
    repeat: int
    sim: RunRecord
    device_run: RunRecord


def paired_records(records: list[RunRecord]) -> list[RunPair]:
    """Device runs beside their sim twins (same pair key); only pairs where both completed."""
    sims = {r.pair_key: r for r in records if r.target == "sim" and r.status == "completed"}
    pairs = []
    for r in records:
        if r.target == "sim" or r.status != "completed" or r.pair_key is None or r.pair_key not in sims:
            continue
        pairs.append(RunPair(pair_key=r.pair_key, model=r.model, device=r.target, threads=r.threads,
                             batch_size=r.batch_size, input_size=r.input_size, repeat=r.repeat,
                             sim=sims[r.pair_key], device_run=r))
    return pairs


def is_contended(record: RunRecord) -> bool:
    """Another process used the run's cores (its contention evidence says so): its figures are not the budget's."""
    return isinstance(record.contention, dict) and bool(record.contention.get("contended"))


def json_number(value: JsonValue, *path: str) -> float | None:
    """The finite number at `path` inside a record's JSON part (its accuracy or GPU figures), None when absent."""
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


# --- r13-report: repeats averaged into one row per cell (tables and the report share this rule) ---
# Model name, sha256, target, threads, batch, input size, compute unit, cpus, memory MB.
CellKey = tuple[str, str, str, int, int, int | None, str, float | None, float | None]


def cell_key(record: RunRecord) -> CellKey:
    """What makes runs repeats of one another: everything but the repeat number and the cores they got."""
    return (record.model.name, record.model.sha256, record.target, record.threads, record.batch_size,
            record.input_size, record.accelerator, record.limits.cpus, record.limits.memory_mb)


class AveragedRecord(RunRecord):
    """One matrix cell's runs on one target as a record: its figures the mean over the runs used.

    `runs`, `completed` and `contended` say what went in, `averaged` how many runs the figures are the mean of;
    `repeat` is None (repeats averaged). A single run read as itself (`of_run`) stands for one run."""

    repeat: int | None  # type: ignore[assignment]  # None: the cell's repeats averaged
    runs: int = 1
    completed: int = 1
    contended: int = 0
    averaged: int = 0

    @classmethod
    def of_run(cls, record: RunRecord, **counts: int) -> AveragedRecord:
        """The record as a cell of its own (`farm results --runs`), or with `counts` (runs, completed...) a cell's."""
        return cls.model_validate({**{name: getattr(record, name) for name in record.model_fields_set}, **counts})


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _numbers(values: Iterable[float | None]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]


# Figures averaged over repeats: the record's own, then its latency's (the cpu share's average is averaged too).
AVERAGED_FIGURES = ("peak_memory_mb", "avg_memory_mb", "peak_rss_mb", "baseline_memory_mb", "wall_s", "whole_run_s",
                    "energy_per_inference_mj", "throughput_per_s", "samples_per_s", "startup_ms")
AVERAGED_LATENCIES = ("avg", "p50", "p90", "p99", "init", "first", "min", "max")


def _averaged_figures(first: RunRecord, used: list[RunRecord]) -> dict[str, object]:
    """The figures of a cell's record: each the mean over the runs used (None where none has it); latency_ms.std is
    the spread of the runs' averages when there are two or more (repeat to repeat), else the run's own spread."""
    figures: dict[str, object] = {name: _mean(_numbers(getattr(r, name) for r in used)) for name in AVERAGED_FIGURES}
    for f in FIGURES:  # declared figures stay sparse: a key only where a run measured it (stores written before)
        value = _mean(_numbers(getattr(r, f.record, None) for r in used))
        if value is not None or f.record in first.model_fields_set:
            figures[f.record] = value
    if first.latency_ms is not None:
        latency = {name: _mean(_numbers(getattr(r.latency_ms, name, None) for r in used)) for name in AVERAGED_LATENCIES}
        avgs = _numbers(r.latency_ms.avg if r.latency_ms else None for r in used)
        if len(avgs) >= 2:
            m = sum(avgs) / len(avgs)
            latency["std"] = (sum((v - m) ** 2 for v in avgs) / (len(avgs) - 1)) ** 0.5
        figures["latency_ms"] = replaced(first.latency_ms, **latency)
    peaks = _numbers(r.cpu_percent.peak for r in used)
    figures["cpu_percent"] = replaced(first.cpu_percent, avg=_mean(_numbers(r.cpu_percent.avg for r in used)),
                                      peak=max(peaks) if peaks else None)
    return figures


def average_repeats(records: list[RunRecord]) -> list[AveragedRecord]:
    """One record per matrix cell and target: figures are the mean over its completed runs.

    Contended runs count only when a cell has no clean one. `runs`, `completed` and `contended`
    say what went in; latency_ms.std is the spread of the runs' averages when there are two or
    more (repeat to repeat), else the run's own spread."""
    cells: dict[CellKey, list[RunRecord]] = {}
    for r in records:
        cells.setdefault(cell_key(r), []).append(r)
    averaged = []
    for runs in cells.values():
        done = [r for r in runs if r.status == "completed"]
        clean = [r for r in done if not is_contended(r)]
        used = clean or done
        first = (used or runs)[0]
        update: dict[str, object] = {"repeat": None, "runs": len(runs), "completed": len(done),
                                     "contended": len(done) - len(clean), "averaged": len(used)}
        if done and len(done) < len(runs):
            update.update(status="completed", failure_class=None)
        if used:
            update.update(_averaged_figures(first, used))
        averaged.append(replaced(AveragedRecord.of_run(first), **update))
    return averaged
