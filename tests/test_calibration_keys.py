"""Stored calibrations as a lab builds them: a job measured the same models at two batch sizes on
a Jetson-like board (latency and energy per inference) beside their sim twins. Each batch size
gets its own calibration, energy is a result and a calibration metric, and a refit with few
models leans on what the lab already knows (the device's previous version, or its device type)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from rich.console import Console

from farm.cli.render import results_table
from farm.controller.analysis.calibrations import calibration_history, fit_and_store, pair_within_job
from farm.controller.analysis.ranking import rank_job
from farm.controller.analysis.results import run_records
from farm.controller.scheduling.schedule import pair_key
from farm.controller.store import SQLiteStore as Store
from farm.proto.results import LatencyStats, RunResult, RunStatus

SIM_MS = [3.0, 5.5, 8.0, 12.0, 17.0, 25.0]  # six models, batch 1 in the sim
BETWEEN_M2_AND_M3 = {"macs": 3.5e8, "size_bytes": 4.5e6, "param_count": 3.5e5}  # the facts of a model at 10 ms
BOARD_POWER_W = 0.8  # energy per inference (mJ) = W × latency (ms)


def _latency(ms: float) -> LatencyStats:
    return LatencyStats(init=None, first=ms, warmup_avg=ms, avg=ms, p50=ms, p90=ms, p99=ms, std=0.0, min=ms,
                        max=ms, count=10)


def _job(store: Store) -> int:
    return store.db["jobs"].insert({"name": "bench", "status": "completed", "created_at": time.time(),
                                    "spec_json": json.dumps({"sim": {"cpus": 1.0}, "workload": {}})}).last_pk


def _measure(store: Store, job: int, device: str | None, model: int, batch: int, sim_ms: float,
             device_ms: float | None, energy_mj: float | None) -> None:
    """One model at one batch size: the device task and its sim twin (device None: the sim task
    alone), all completed, as the scheduler writes tasks and the controller records runs."""
    sha = f"{model:016x}" + "0" * 48  # pair keys use the first 16 hex digits
    facts = {"macs": 1e8 * (model + 1), "size_bytes": 1e6 * (model + 2), "param_count": 1e5 * (model + 1)}
    key = pair_key(sha, 1, batch, None, device or "sim", 0)
    sides = [("sim", sim_ms, {"runtime": "litert"})]
    if device is not None:
        sides.append((device, device_ms, {"runtime": "litert", **(
            {"energy_per_inference_mj": energy_mj} if energy_mj is not None else {})}))
    for target, ms, environment in sides:
        task_id = store.db["tasks"].insert({
            "job_id": job, "seq": store.db["tasks"].count, "target": target, "model_name": f"m{model}",
            "model_path": f"m{model}.tflite", "model_sha256": sha, "model_family": None,
            "model_facts_json": json.dumps(facts), "model_size_bytes": facts["size_bytes"],
            "model_param_count": facts["param_count"], "threads": 1, "batch_size": batch, "input_size": None,
            "repeat": 0, "status": "running", "attempts": 1, "max_attempts": 3, "pair_key": key, "leased_by": "agent-1",
            "spec_json": "{}", "priority": 1, "created_at": time.time()}).last_pk
        task = store.jobs.task(task_id)
        result = RunResult(status=RunStatus.COMPLETED, backend="test", latency=_latency(ms), environment=environment)
        store.runs.record(task, 1, "agent-1", time.time(), result, {"status": "completed"})


def _lab(tmp_path: Path) -> tuple[Store, int]:
    store = Store(tmp_path / "farm.db")
    job = _job(store)
    for model, sim_ms in enumerate(SIM_MS):
        for batch, ratio in ((1, 2.0), (8, 3.0)):  # at batch 8 the board is 3× the sim, at batch 1 2×
            device_ms = ratio * batch * sim_ms * (1.0 + 0.01 * (model % 3 - 1))
            _measure(store, job, "nano-1", model, batch, batch * sim_ms, device_ms, BOARD_POWER_W * device_ms)
    return store, job


def test_batch_sizes_are_never_averaged_together(tmp_path: Path) -> None:
    store, job = _lab(tmp_path)
    paired = pair_within_job(store, job, "nano-1", "latency")
    assert sorted({p.batch_size for p in paired}) == [1, 8] and len(paired) == 12
    stored, refused = fit_and_store(store, "nano-1", "latency", paired, source=None)
    assert refused == []
    by_batch = {s.batch_size: s for s in stored}
    assert sorted(by_batch) == [1, 8]
    for batch, ratio in ((1, 2.0), (8, 3.0)):
        calibration = by_batch[batch].calibration
        assert calibration.chosen_fit.n == 6  # six models, not twelve averaged into six
        assert not any("averaged" in w for w in calibration.warnings)
        # the default fit (log_bayes) takes the model's features: a model between m2 and m3
        assert calibration.predict(10.0 * batch, BETWEEN_M2_AND_M3).estimate == pytest.approx(ratio * 10.0 * batch,
                                                                                              rel=0.03)
        assert by_batch[batch].version == 1  # versions count per key
    history = calibration_history(store, "nano-1")
    assert sorted((r.batch_size, r.precision) for r in history) == [(1, "fp32"), (8, "fp32")]
    for row in history:
        assert row.formula.startswith("y = ")
        assert ("exponent" in row.model_dump(mode="json")) == row.formula.startswith("y = e^")  # honest names for a power law


def test_energy_per_inference_is_a_result_and_a_calibration_metric(tmp_path: Path) -> None:
    store, job = _lab(tmp_path)
    records = run_records(store, job)
    board = [r for r in records if r.target == "nano-1"]
    assert all(r.latency_ms and r.energy_per_inference_mj == pytest.approx(BOARD_POWER_W * r.latency_ms.avg)
               for r in board)
    assert all(r.energy_per_inference_mj is None for r in records if r.target == "sim")  # the sim has no rails
    console = Console(record=True, width=250)
    console.print(results_table(records))
    shown = console.export_text()
    assert "mJ per" in shown and f"{BOARD_POWER_W * board[0].latency_ms.avg:.2f}" in shown
    paired = pair_within_job(store, job, "nano-1", "energy")
    assert len(paired) == 12
    assert all(p.pair.y == pytest.approx(BOARD_POWER_W * 2.0 * p.pair.x, rel=0.02) for p in paired if p.batch_size == 1)
    stored, _ = fit_and_store(store, "nano-1", "energy", paired, source=None)
    batch_1 = next(s for s in stored if s.batch_size == 1)
    assert batch_1.metric == "energy"
    # energy from the sim's latency: 0.8 W × 2 × sim ms
    assert batch_1.calibration.predict(10.0, BETWEEN_M2_AND_M3).estimate == pytest.approx(16.0, rel=0.03)


def test_a_refit_with_few_models_leans_on_the_previous_version_then_on_the_device_type(tmp_path: Path) -> None:
    store, job = _lab(tmp_path)
    paired = [p for p in pair_within_job(store, job, "nano-1", "latency") if p.batch_size == 1]
    first, _ = fit_and_store(store, "nano-1", "latency", paired, source=None)
    assert first[0].calibration.fits["log_ridge"].prior_source == "device = constant factor × sim"
    second, _ = fit_and_store(store, "nano-1", "latency", paired[:4], source=None)
    refit = second[0].calibration.fits["log_ridge"]
    assert second[0].version == 2 and refit.prior_source == "nano-1 version 1"
    assert 0.0 <= refit.prior_weight <= 1.0
    # a second board of the same type, calibrated for the first time, starts from its peer
    for name in ("nano-1", "nano-2"):
        store.db["devices"].insert({"name": name, "agent": "agent-1", "driver": "jetson", "device_type": "jetson-nano",
                                    "tags_json": "[]", "facts_json": "{}", "slots": 1, "state": "idle",
                                    "last_seen": time.time()})
    other_job = _job(store)
    for model, sim_ms in enumerate(SIM_MS[:4]):
        _measure(store, other_job, "nano-2", model, 1, sim_ms, 2.1 * sim_ms, None)
    peer_fit, _ = fit_and_store(store, "nano-2", "latency", pair_within_job(store, other_job, "nano-2", "latency"),
                                source=None)
    assert peer_fit[0].calibration.fits["log_ridge"].prior_source == "1 other device(s) of type jetson-nano"


def test_rankings_predict_each_batch_size_with_its_own_calibration(tmp_path: Path) -> None:
    store, job = _lab(tmp_path)
    fit_and_store(store, "nano-1", "latency", pair_within_job(store, job, "nano-1", "latency"), source=None)
    new_job = _job(store)
    for model, sim_ms in enumerate(SIM_MS):
        for batch in (1, 8):
            _measure(store, new_job, None, model, batch, batch * sim_ms, None, None)
    ranking = rank_job(store, new_job, "latency", device_jobs=[], devices=["nano-1"])
    groups = {group.batch_size: group for group in ranking.groups}
    assert sorted(groups) == [1, 8]
    for batch, ratio in ((1, 2.0), (8, 3.0)):
        predicted = dict(groups[batch].columns[1].order)
        assert predicted["m2"] == pytest.approx(ratio * batch * SIM_MS[2], rel=0.03)
