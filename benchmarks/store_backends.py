"""The two stores side by side: leases, results and listings through the store's own repositories.

    python benchmarks/store_backends.py [--tasks 600] [--url postgresql://...]

Without --url it starts a private PostgreSQL (tests/postgres_server.py: Debian's postgresql on a temp
data folder, fsync off; skipped with the reason when it cannot run). Each step runs on SQLite (a file,
WAL, synchronous=NORMAL as the controller sets it) and on PostgreSQL one after the other, with the same
rows: leasing one task per transaction as `Controller.lease` does, leasing in rounds of 16 (the
dispatcher's batch), recording a realistic result per task (100 timings, 25 telemetry samples), and
listing the jobs. Prints each figure and the PostgreSQL/SQLite ratio. Then the reason for PostgreSQL: one
process against two (each its own store, as two controllers) leasing and recording every task of one job
on the same database, in tasks/s (BENCHMARKS.md, "PostgreSQL store").
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

from farm.controller.store import SQLiteStore, Store
from farm.proto.results import LatencyStats, RunResult, RunStatus, Telemetry, TelemetrySample


@contextlib.contextmanager
def _postgres(url: str | None) -> Iterator[str | None]:
    if url:
        yield url
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from postgres_server import PostgresUnavailable, postgres_server  # type: ignore[import-not-found]
    try:
        with postgres_server() as peer:
            yield peer.url
    except PostgresUnavailable as e:
        print(f"PostgreSQL skipped: {e}")
        yield None


def _fill(store: Store, tasks: int) -> None:
    store.jobs.insert({"name": "bench", "kind": "user", "status": "queued", "priority": "normal", "created_at": 0.0},
                      [{"seq": i, "target": "sim", "model_name": "m", "threads": 1, "repeat": i, "status": "pending",
                        "attempts": 0, "max_attempts": 1, "priority": 1} for i in range(tasks)])


def _result(rng: random.Random) -> RunResult:
    return RunResult(
        status=RunStatus.COMPLETED, backend="cgroup", wall_s=1.3,
        latency=LatencyStats(5.1, 3.2, 2.4, 2.0, 2.0, 2.1, 2.2, 0.05, 1.9, 2.3, 100),
        iterations_ms=[2.0 + rng.gauss(0, 0.05) for _ in range(100)],
        telemetry=Telemetry(interval_ms=40, cpu_avg_percent=95.0, memory_peak_bytes=60_000_000, memory_avg_bytes=55e6,
                            samples=[TelemetrySample(i * 0.04, rng.uniform(80, 100), 50_000_000 + rng.randint(0, 1 << 20))
                                     for i in range(25)]),
        environment={"runtime": "onnxruntime", "python": "3.11.2"})


def _steps(store: Store, tasks: int) -> dict[str, float]:
    """Per-operation times in ms."""
    rng = random.Random(3)
    _fill(store, tasks)
    half = tasks // 2
    leased = []
    started = time.perf_counter()
    for _ in range(half):  # one task per transaction, as Controller.lease
        with store.transaction():
            (task,) = store.leases.next_pending({"sim"}, 1)
            store.leases.lease(task.id, 1, "agent", time.time() + 600)
            store.leases.start_job(task.job_id, time.time())
        leased.append(task)
    one = (time.perf_counter() - started) / half * 1000
    started = time.perf_counter()
    while True:  # rounds of 16, as the dispatcher's lease_batch
        with store.transaction():
            batch = store.leases.next_pending({"sim"}, 16)
            for task in batch:
                store.leases.lease(task.id, 1, "agent", time.time() + 600)
        leased += batch
        if len(batch) < 16:
            break
    batched = (time.perf_counter() - started) / (tasks - half) * 1000
    started = time.perf_counter()
    for task in leased:
        store.runs.record(task, 1, "agent", time.time(), _result(rng), {"status": "completed"})
    record = (time.perf_counter() - started) / len(leased) * 1000
    started = time.perf_counter()
    for _ in range(50):
        store.jobs.listing(50)
    listing = (time.perf_counter() - started) / 50 * 1000
    assert store.jobs.task_counts(1) == {"completed": tasks}
    return {"lease (1 per transaction)": one, "lease (rounds of 16), per task": batched,
            "record a result": record, "list jobs": listing}


def _drain(url: str, folder: str, seed: int, start_at: float) -> tuple[int, float]:
    """One controller's work: lease a task, store its result, until the job has none left; how many, and when
    it ended. Every process starts at `start_at` (their start-up is not counted)."""
    from farm.controller.store.postgres import PostgresStore

    rng, done = random.Random(seed), 0
    store = PostgresStore(url, files_dir=Path(folder) / f"pg-{seed}")
    time.sleep(max(0.0, start_at - time.time()))
    while True:
        with store.transaction():
            tasks = store.leases.next_pending({"sim"}, 1)
            for task in tasks:
                store.leases.lease(task.id, 1, f"agent-{seed}", time.time() + 600)
        if not tasks:
            break
        store.runs.record(tasks[0], 1, f"agent-{seed}", time.time(), _result(rng), {"status": "completed"})
        done += 1
    ended = time.time()
    store.close()
    return done, ended


def _processes(url: str, folder: str, tasks: int) -> dict[int, float]:
    """tasks/s with 1 and with 2 processes sharing the database (a fresh job each time)."""
    import multiprocessing

    from farm.controller.store.postgres import PostgresStore

    rates = {}
    for count in (1, 2):
        store = PostgresStore(url, files_dir=Path(folder) / "pg")
        _fill(store, tasks)
        store.close()
        context = multiprocessing.get_context("spawn")
        start_at = time.time() + 4  # after every process has imported farm and connected
        with context.Pool(count) as pool:
            ended = pool.starmap(_drain, [(url, folder, seed, start_at) for seed in range(count)])
        assert sum(n for n, _ in ended) == tasks, f"{ended} of {tasks} tasks stored"
        rates[count] = tasks / (max(at for _, at in ended) - start_at)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=600)
    parser.add_argument("--url", help="an empty PostgreSQL database (default: a private server started here)")
    args = parser.parse_args()
    figures: dict[str, dict[str, float]] = {}
    rates: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        sqlite = SQLiteStore(Path(folder) / "farm.db")
        sqlite.sync_normal()
        figures["sqlite"] = _steps(sqlite, args.tasks)
        sqlite.close()
        with _postgres(args.url) as url:
            if url:
                from farm.controller.store.postgres import PostgresStore
                opener: Callable[[], Store] = lambda: PostgresStore(url, files_dir=Path(folder) / "pg")  # noqa: E731
                pg = opener()
                figures["postgresql"] = _steps(pg, args.tasks)
                pg.close()
                rates = _processes(url, folder, args.tasks)
    print(f"{args.tasks} tasks; ms per operation")
    for step in figures["sqlite"]:
        line = f"  {step:32s} sqlite {figures['sqlite'][step]:7.3f}"
        if "postgresql" in figures:
            pg_ms = figures["postgresql"][step]
            line += f"   postgresql {pg_ms:7.3f}   ratio {pg_ms / figures['sqlite'][step]:5.2f}"
        print(line)
    if "postgresql" in figures:
        print(f"PostgreSQL, lease + record per task: 1 process {rates[1]:.0f} tasks/s, 2 processes {rates[2]:.0f} "
              f"tasks/s ({rates[2] / rates[1]:.2f}x)")


if __name__ == "__main__":
    main()
