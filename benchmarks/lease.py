"""`make bench-lease`: how long one lease takes with 1k, 10k and 100k tasks pending.

A real store (WAL, synchronous=NORMAL as the controller runs it) is filled through
Controller.submit with jobs of 1,000 tasks each, all for a phone that has no agent (pixel-9):
half are its device tasks, half their sim twins. Then, call by call: Controller.lease for a
sim slot, Controller.lease_batch (16 sim slots, the gRPC dispatcher's round), and
Controller.lease for an idle device with nothing pending (pixel-1), which must not walk the
other phone's backlog. Each depth is measured with the index that matches the lease query
(migration 7: status, target, priority, job_id, seq) and with the index it replaced (status,
priority, id), which makes SQLite sort every pending row. Where the time goes: the lease's
SELECT alone (its query plan printed), expire_leases (every lease() runs it first), and the
rest, which is the UPDATE and the commit.

Prints a markdown report and writes it to benchmarks/results/<date>-lease.{md,json}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
from pathlib import Path

from farm.controller.scheduling.controller import Controller
from farm.controller.scheduling.jobfile import DeviceTarget, load_job_text
from farm.controller.store import SQLiteStore as Store
from farm.controller.store.sqlite import HEALTHY_TARGET
from farm.model_generators.generate import write_tiny_onnx
from results_file import write_results  # benchmarks/ is on sys.path when a benchmark runs
from timing import ms_summary, timed

ROOT = Path(__file__).resolve().parent
TASKS_PER_JOB = 1000
# The SELECT of Controller.lease for one target (kept in step with Store.next_pending).
LEASE_SELECT = ("SELECT t.* FROM tasks t JOIN jobs j ON j.id = t.job_id WHERE t.status = 'pending' AND t.target = ? "
                f"AND j.status IN ('queued', 'running') {HEALTHY_TARGET} ORDER BY t.priority, t.job_id, t.seq LIMIT ?")
OLD_INDEX = "CREATE INDEX idx_tasks_status_priority_id ON tasks (status, priority, id)"


def fill(store: Store, model: Path, pending: int) -> None:
    controller = Controller(store)
    job = load_job_text(f"models: [{model}]\nrepeats: {TASKS_PER_JOB // 2}\ntargets: [pixel-9]\n", "bench.yaml",
                        model.parent, devices=[DeviceTarget("pixel-9")])
    for _ in range(pending // TASKS_PER_JOB):
        controller.submit(job)


def measure(tmp: Path, model: Path, pending: int, index: str, leases: int) -> dict:
    store = Store(tmp / f"lease-{pending}-{index}.db")
    store.db.execute("PRAGMA synchronous = NORMAL")
    fill(store, model, pending)
    if index == "old":
        store.db.execute("DROP INDEX idx_tasks_lease_order")
        store.db.execute(OLD_INDEX)
    plan = " / ".join(r[3] for r in store.db.execute(f"EXPLAIN QUERY PLAN {LEASE_SELECT}", ["sim", 1]).fetchall())
    controller = Controller(store, lease_ttl_s=3600)
    leases = min(leases, pending // 8)  # half the tasks are sim twins: never run out while timing
    select = timed(lambda: store.db.execute(LEASE_SELECT, ["sim", 1]).fetchone(), leases)
    idle = timed(lambda: controller.lease("bench", {"pixel-1"}), leases // 4)
    lease = timed(lambda: controller.lease("bench", {"sim"}), leases)
    batch = timed(lambda: controller.lease_batch([(f"bench{i}", frozenset({"sim"})) for i in range(16)]), leases // 16)
    running = store.query("SELECT COUNT(*) AS n FROM tasks WHERE status = 'running'")[0]["n"]
    expire = timed(controller.expire_leases, leases)  # walks the running tasks: their count, not the queue's
    store.close()
    return {"pending": pending, "index": index, "plan": plan, "leases": leases, "select_ms": ms_summary(select),
            "expire_ms": ms_summary(expire), "running": running, "lease_ms": ms_summary(lease), "lease_batch16_ms": ms_summary(batch),
            "idle_device_lease_ms": ms_summary(idle)}


def report(rows: list[dict]) -> str:
    lines = [
        f"# Lease benchmark, {dt.date.today()} ({os.cpu_count()} cores; up to {max(r['leases'] for r in rows)} leases per depth)",
        "",
        "| pending | index | lease() sim, median / p99 ms | lease_batch(16) sim, median / p99 ms | "
        "lease() idle device, median / p99 ms | SELECT alone, median ms | expire_leases (running tasks), median ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['pending']:,} | {r['index']} | {r['lease_ms']['median']} / {r['lease_ms']['p99']} | "
                     f"{r['lease_batch16_ms']['median']} / {r['lease_batch16_ms']['p99']} | "
                     f"{r['idle_device_lease_ms']['median']} / {r['idle_device_lease_ms']['p99']} | {r['select_ms']['median']} | "
                     f"{r['expire_ms']['median']} ({r['running']}) |")
    lines += ["", "Query plans of the lease SELECT:", ""]
    for r in rows:
        if r["pending"] == rows[-1]["pending"]:
            lines.append(f"- {r['index']} index: `{r['plan']}`")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="1000,10000,100000", help="pending tasks, comma-separated (multiples of 1000)")
    parser.add_argument("--leases", type=int, default=200, help="lease() calls timed per depth")
    parser.add_argument("--no-old", action="store_true", help="skip the comparison with the replaced index")
    parser.add_argument("--quick-old", action="store_true", help="compare with the old index only up to 10k pending")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_onnx(Path(tmp) / "tiny.onnx")
        for pending in (int(d) for d in args.depths.split(",")):
            for index in ("lease-order",) if args.no_old or pending > 10_000 and args.quick_old else ("lease-order", "old"):
                rows.append(measure(Path(tmp), model, pending, index, args.leases))
                print(json.dumps(rows[-1]), file=sys.stderr)
    text = report(rows)
    print(text)
    if not args.no_write:
        write_results("lease", text, rows)


if __name__ == "__main__":
    sys.exit(main())
