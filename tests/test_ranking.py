"""`farm rank` on a paired job (sim twins + a phone target), the seed's first scenario: the sim
column is the sim's runs only, the phone column the phone's own runs, and predictions come only
from a calibration fitted on the model's family; a family nobody calibrated is named, never
predicted 0 ms, and stays out of Kendall τ."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from scipy.stats import kendalltau

from farm.controller.analysis.calibrations import fit_and_store, pair_within_job
from farm.controller.analysis.ranking import rank_job
from farm.controller.scheduling.schedule import pair_key
from farm.controller.store import SQLiteStore as Store
from farm.proto.results import LatencyStats, RunResult, RunStatus

PHONE = "phone-1"
# family -> sim ms of its five models; the phone is 3× the sim for "cnn", 1.5× for "vit"
FAMILIES = {"cnn": [2.0, 3.5, 5.0, 7.5, 11.0], "vit": [4.0, 6.0, 9.0, 13.0, 19.0], "rnn": [1.0, 8.0, 30.0]}
PHONE_RATIO = {"cnn": 3.0, "vit": 1.5, "rnn": 0.5}


def _latency(ms: float) -> LatencyStats:
    return LatencyStats(init=None, first=ms, warmup_avg=ms, avg=ms, p50=ms, p90=ms, p99=ms, std=0.0, min=ms,
                        max=ms, count=10)


def _job(store: Store) -> int:
    return store.db["jobs"].insert({"name": "paired", "status": "completed", "created_at": time.time(),
                                    "spec_json": json.dumps({"sim": {"cpus": 1.0}, "workload": {}})}).last_pk


def _paired(store: Store, job: int, family: str, index: int, sim_ms: float, phone_ms: float) -> None:
    """One model's phone task and its sim twin, completed, as the scheduler writes tasks and the
    controller records runs."""
    number = {"cnn": 0, "vit": 100, "rnn": 200}.get(family, 300) + index
    sha = f"{number:016x}" + "0" * 48
    facts = {"macs": 1e8 * (index + 1), "size_bytes": 1e6 * (index + 2), "param_count": 1e5 * (index + 1)}
    key = pair_key(sha, 1, 1, None, PHONE, 0)
    for target, ms in (("sim", sim_ms), (PHONE, phone_ms)):
        task_id = store.db["tasks"].insert({
            "job_id": job, "seq": store.db["tasks"].count, "target": target, "model_name": f"{family}{index}",
            "model_path": f"{family}{index}.tflite", "model_sha256": sha, "model_family": family,
            "model_facts_json": json.dumps(facts), "model_size_bytes": facts["size_bytes"],
            "model_param_count": facts["param_count"], "threads": 1, "batch_size": 1, "input_size": None,
            "repeat": 0, "status": "running", "attempts": 1, "max_attempts": 3, "pair_key": key,
            "leased_by": "agent-1", "spec_json": "{}", "priority": 1, "created_at": time.time()}).last_pk
        result = RunResult(status=RunStatus.COMPLETED, backend="test", latency=_latency(ms),
                           environment={"runtime": "litert"})
        store.runs.record(store.jobs.task(task_id), 1, "agent-1", time.time(), result, {"status": "completed"})


@pytest.fixture
def paired_job(tmp_path: Path) -> tuple[Store, int]:
    store = Store(tmp_path / "farm.db")
    calibration_job = _job(store)  # an earlier job calibrated the phone for cnn and vit only
    for family in ("cnn", "vit"):
        for i, ms in enumerate(FAMILIES[family]):
            _paired(store, calibration_job, family, i, ms, PHONE_RATIO[family] * ms)
    stored, refused = fit_and_store(store, PHONE, "latency", pair_within_job(store, calibration_job, PHONE, "latency"),
                                    source=None)
    assert refused == [] and {s.family for s in stored} == {"", "cnn", "vit"}
    job = _job(store)
    for family, values in FAMILIES.items():
        for i, ms in enumerate(values):
            _paired(store, job, family, i, ms, PHONE_RATIO[family] * ms)
    return store, job


def test_a_paired_job_ranks_sim_and_phone_from_their_own_runs(paired_job: tuple[Store, int]) -> None:
    store, job = paired_job
    ranking = rank_job(store, job, "latency", device_jobs=[], devices=[PHONE])
    [group] = ranking.groups
    sim, phone, predicted = group.columns
    sim_values = dict(sim.order)
    expected_sim = {f"{f}{i}": ms for f, values in FAMILIES.items() for i, ms in enumerate(values)}
    assert sim_values == pytest.approx(expected_sim)  # the sim's runs only, never averaged with the phone's
    assert phone.name == f"{PHONE} (job {job})"
    expected_phone = {m: PHONE_RATIO[m[:3]] * ms for m, ms in expected_sim.items()}
    assert dict(phone.order) == pytest.approx(expected_phone)
    common = sorted(expected_sim)
    tau = kendalltau([expected_sim[m] for m in common], [expected_phone[m] for m in common]).statistic
    assert phone.kendall_tau == pytest.approx(tau)


def test_an_uncalibrated_family_is_named_and_left_out_of_tau(paired_job: tuple[Store, int]) -> None:
    store, job = paired_job
    [group] = rank_job(store, job, "latency", device_jobs=[], devices=[PHONE]).groups
    predicted = group.columns[-1]
    assert predicted.name == f"{PHONE} (predicted)"
    values = dict(predicted.order)
    assert not any(m.startswith("rnn") for m in values)  # never a made-up 0 ms
    assert all(v > 0 for v in values.values())
    for family in ("cnn", "vit"):  # each family predicted by its own fit
        for i, ms in enumerate(FAMILIES[family]):
            assert values[f"{family}{i}"] == pytest.approx(PHONE_RATIO[family] * ms, rel=0.05)
    notes = predicted.notes
    assert len(notes) == 3 and all("no calibration for this family (rnn)" in n for n in notes)
    calibrated = sorted(values)
    sim = dict(group.columns[0].order)
    tau = kendalltau([sim[m] for m in calibrated], [values[m] for m in calibrated]).statistic
    assert predicted.kendall_tau == pytest.approx(tau)  # over the calibrated models only


def test_rank_cli_prints_the_note(paired_job: tuple[Store, int], farm) -> None:
    store, job = paired_job
    r = farm("rank", str(job), "--device", PHONE, "--db", str(store.path))
    assert r.returncode == 0, r.stderr
    shown = " ".join((r.stdout + r.stderr).split())
    assert "no calibration for this family (rnn)" in shown and "(—)" not in shown  # a short column ends blank
    data = farm("rank", str(job), "--device", PHONE, "--db", str(store.path), "--json").json()
    assert [c["name"] for c in data["groups"][0]["columns"]] == [f"sim (job {job})", f"{PHONE} (job {job})",
                                                                 f"{PHONE} (predicted)"]


def test_a_hostile_family_name_reaches_the_terminal_escaped(paired_job: tuple[Store, int], farm) -> None:
    store, job = paired_job
    _paired(store, job, "evil\x1b[2J", 0, 5.0, 5.0)
    r = farm("rank", str(job), "--device", PHONE, "--db", str(store.path))
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout + r.stderr and "no calibration for this family (evil\\x1b[2J)" in r.stdout
