"""Heartbeats are renewed many per transaction by one thread (controller/scheduling/lease_renewer.py): agents
that connected together beat together, and a lease renewed in a commit of its own per heartbeat queued a
lab's results behind a thousand commits. Each heartbeat still gets its own answer: the attempts to stop."""

from __future__ import annotations

import time
from pathlib import Path

from farm.controller.scheduling.controller import Controller
from farm.controller.scheduling.jobfile import load_job_text
from farm.controller.scheduling.lease_renewer import LeaseRenewer, QueuedHeartbeat
from farm.controller.store import SQLiteStore as Store


def _expiry(store: Store, task_id: int) -> float:
    return store.query("SELECT lease_expires_at FROM tasks WHERE id = ?", [task_id])[0]["lease_expires_at"]


def test_heartbeats_queued_together_are_renewed_in_one_transaction(tmp_path: Path, tiny_models) -> None:
    store = Store(tmp_path / "farm.db")
    controller = Controller(store, lease_ttl_s=30)
    controller.submit(load_job_text(f"models: [{tiny_models['onnx']}]\nrepeats: 4\n", "job.yaml", tmp_path))
    mine = [controller.lease("a", {"sim"}) for _ in range(2)]
    theirs = controller.lease("b", {"sim"})
    assert all(mine) and theirs
    before = {t.task_id: _expiry(store, t.task_id) for t in [*mine, theirs]}
    time.sleep(0.05)  # a renewed lease ends later than the one it replaces

    batches: list[int] = []
    stopped: dict[str, list[tuple[int, int]]] = {}
    renewer = LeaseRenewer(controller, timed=lambda step, started, count: batches.append(count))
    for task in mine:  # two heartbeats of agent a, and one of a's naming b's lease
        renewer.put(QueuedHeartbeat("a", [(task.task_id, task.attempt)], stopped.setdefault(f"a{task.task_id}", []).extend))
    renewer.put(QueuedHeartbeat("a", [(theirs.task_id, theirs.attempt)], stopped.setdefault("forged", []).extend))
    renewer.start()  # all three queued before the thread looks: one batch
    deadline = time.monotonic() + 10
    while not batches and time.monotonic() < deadline:
        time.sleep(0.01)
    renewer.stop()

    assert batches == [3]  # three renewals, one transaction
    assert stopped["forged"] == [(theirs.task_id, theirs.attempt)]  # not a's lease: a is told to stop it
    assert all(stopped[f"a{t.task_id}"] == [] for t in mine)
    assert all(_expiry(store, t.task_id) > before[t.task_id] for t in mine)
    assert _expiry(store, theirs.task_id) == before[theirs.task_id]  # b's lease untouched
    store.close()


def test_a_canceled_job_stops_its_attempts_through_the_renewer(tmp_path: Path, tiny_models) -> None:
    store = Store(tmp_path / "farm.db")
    controller = Controller(store, lease_ttl_s=30)
    job = controller.submit(load_job_text(f"models: [{tiny_models['onnx']}]\nrepeats: 2\n", "job.yaml", tmp_path))
    task = controller.lease("a", {"sim"})
    assert task is not None
    controller.cancel_job(job)
    stopped: list[tuple[int, int]] = []
    renewer = LeaseRenewer(controller)
    renewer.start()
    renewer.put(QueuedHeartbeat("a", [(task.task_id, task.attempt)], stopped.extend))
    deadline = time.monotonic() + 10
    while not stopped and time.monotonic() < deadline:
        time.sleep(0.01)
    renewer.stop()
    assert stopped == [(task.task_id, task.attempt)]
    store.close()
