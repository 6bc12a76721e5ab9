"""The lease query at scale: the store's index matches the query, so a lease costs the same
with 500 or 5,000 tasks pending (counted in SQLite VM steps, not in time, so a busy machine
cannot make it flaky), tasks still go out in priority/job/seq order across targets, and an
older store gains the index and the job kind when it is opened."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import sqlite_utils

from farm.controller.scheduling.controller import Controller
from farm.controller.scheduling.jobfile import DeviceTarget, load_job_text
from farm.controller.store import SQLiteStore as Store
from farm.controller.store.schema import MIGRATIONS


def _submit(controller: Controller, model: Path, repeats: int, *, priority: str = "normal", target: str = "pixel-9") -> int:
    return controller.submit(load_job_text(
        f"models: [{model}]\nrepeats: {repeats}\npriority: {priority}\ntargets: [{target}]\n", "job.yaml", model.parent,
        devices=[DeviceTarget(target)]))


def _vm_steps(store: Store, call) -> int:
    """SQLite virtual-machine instructions spent in `call`, in units of 100."""
    steps = [0]

    def count() -> int:
        steps[0] += 1
        return 0

    store.db.conn.set_progress_handler(count, 100)
    try:
        call()
    finally:
        store.db.conn.set_progress_handler(None, 0)
    return steps[0]


@pytest.mark.parametrize("target", ["sim", "pixel-1"])  # a sim slot; an idle phone with nothing pending
def test_a_lease_costs_the_same_with_ten_times_the_queue(tmp_path: Path, tiny_models: dict[str, Path], target: str) -> None:
    costs = []
    for pending in (500, 5000):  # all of another phone's backlog (and its sim twins) is ahead
        controller = Controller(Store(tmp_path / f"{pending}.db"))
        for _ in range(pending // 500):
            _submit(controller, tiny_models["onnx"], 250)
        controller.lease("warm-up", {"sim"})
        costs.append(_vm_steps(controller.store, lambda: controller.lease("agent", {target})))
    assert costs[1] <= costs[0] * 1.5 + 20, f"VM steps (x100) for one lease: {costs}"


def test_leases_follow_priority_then_job_then_seq_across_targets(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    controller = Controller(Store(tmp_path / "farm.db"))
    normal = _submit(controller, tiny_models["onnx"], 2, target="pixel-1")
    low = _submit(controller, tiny_models["onnx"], 2, priority="low", target="pixel-2")
    urgent = _submit(controller, tiny_models["onnx"], 1, priority="interactive", target="pixel-2")
    slots = [("a", frozenset({"pixel-1"})), ("b", frozenset({"pixel-2"})), ("c", frozenset({"sim"})),
             ("d", frozenset({"sim"}))]
    leased, exhausted = controller.lease_batch(slots)
    assert [(t.job_id, t.target) if t else None for t in leased] == [
        (normal, "pixel-1"), (urgent, "pixel-2"), (urgent, "sim"), (normal, "sim")]
    assert not exhausted
    order = [(t.job_id, t.target) for t in iter(lambda: controller.lease("e", {"pixel-1", "pixel-2", "sim"}), None)]
    assert order == [(normal, "pixel-1"), (normal, "sim"), (low, "pixel-2"), (low, "sim"), (low, "pixel-2"), (low, "sim")]


def test_an_older_store_gains_the_lease_index_and_job_kinds(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    db = sqlite_utils.Database(sqlite3.connect(path))
    for migration in MIGRATIONS[:6]:  # the store as farm wrote it before this change
        migration(db)
    db["schema_version"].insert({"version": 6})
    db["jobs"].insert({"name": "reference-suite", "status": "completed"})
    db.conn.commit()
    db.conn.close()
    store = Store(path)
    assert store.schema_version() == len(MIGRATIONS)
    indexes = {i.name: i.columns for i in store.db["tasks"].indexes}
    assert indexes["idx_tasks_lease_order"] == ["status", "target", "priority", "job_id", "seq"]
    assert "idx_tasks_status_priority_id" not in indexes
    # an old job is never taken for a health check by its name
    assert store.query("SELECT name, kind FROM jobs") == [{"name": "reference-suite", "kind": "user"}]
