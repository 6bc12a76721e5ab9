"""The controller's own CPU per task, without gRPC: lease, offer, decode the result, apply it, acknowledge.

    python benchmarks/result_path.py [--tasks 2000] [--rounds 3] [--postgresql] [--profile] [--statements]

What the gRPC controller's dispatcher and result writer do for each task, in this one thread: lease
tasks for 16 idle slots per transaction (Controller.lease_batch), encode each offer as the wire's
TaskSpec, decode a realistic result from its wire bytes (100 timings, 25 telemetry samples: the
scheduling benchmark's), apply results 64 per transaction as the result writer does
(result_writer.ResultWriter._apply) and build their acks. Process CPU time per task, the fastest of
--rounds (a fresh store each), so other load on the machine weighs less. --postgresql runs the same on a
private PostgreSQL server (tests/postgres_server.py) beside SQLite; --profile prints where the time goes
(cProfile, one round); --statements counts the statements sent to SQLite's connection per task (one round,
leasing and result writing together; an executemany is one). benchmarks/scheduling.py measures the whole controller over gRPC beside an echo.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scheduling import _fresh_database, _postgres_server, realistic_result  # type: ignore[import-not-found]  # noqa: E402

SLOTS = 16  # slots per lease transaction, as the dispatcher's round
BATCH = 64  # results per transaction, as result_writer.RESULT_BATCH


def _submit(controller: Any, folder: Path, tasks: int) -> None:
    from farm.controller.scheduling.jobfile import load_job_text
    from farm.model_generators.generate import write_tiny_onnx

    write_tiny_onnx(folder / "tiny.onnx")
    cells = -(-tasks // 1000)
    job = f"models: [tiny.onnx]\nmatrix: {{threads: {list(range(1, cells + 1))}}}\nrepeats: {tasks // cells}\n"
    controller.submit(load_job_text(job, "job.yaml", folder))


class _Counted:
    """An SQLite connection whose execute and executemany calls are counted (--statements)."""

    def __init__(self, conn: Any) -> None:
        self._conn, self.calls = conn, 0

    def execute(self, *args: Any) -> Any:
        self.calls += 1
        return self._conn.execute(*args)

    def executemany(self, *args: Any) -> Any:
        self.calls += 1
        return self._conn.executemany(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def _one_round(location: Any, folder: Path, tasks: int, profile: cProfile.Profile | None,
               counted: list[_Counted] | None = None) -> float:
    """CPU ms per task for leasing, offering, decoding and applying `tasks` tasks' results."""
    from farm.controller.scheduling.controller import Controller
    from farm.controller.scheduling.result_writer import QueuedResult, ResultWriter
    from farm.controller.store import open_store
    from farm.proto.generated import agent_pb2
    from farm.proto.wire import result_to_message, task_to_message

    store = open_store(location)
    if hasattr(store, "sync_normal"):
        store.sync_normal()  # as the gRPC controller sets an SQLite store
    try:
        controller = Controller(store, lease_ttl_s=600)
        _submit(controller, folder, tasks)
        writer = ResultWriter(controller)
        wire = result_to_message(realistic_result(), agent_pb2.AgentMessage().result.result).SerializeToString()
        acks: list[agent_pb2.ResultAck] = []
        if counted is not None:
            store.conn = _Counted(store.conn)  # type: ignore[attr-defined]
            counted.append(store.conn)  # type: ignore[attr-defined]
        slots = [(f"agent-{k}", frozenset({"sim"})) for k in range(SLOTS)]
        done = 0
        started = time.process_time()
        if profile:
            profile.enable()
        while done < tasks:
            queued = []
            while len(queued) < BATCH and done + len(queued) < tasks:
                leased, _ = controller.lease_batch(slots)
                for (agent, _), task in zip(slots, leased):
                    if task is None:
                        continue
                    task_to_message(task, agent_pb2.TaskOffer().task).SerializeToString()  # the offer
                    message = agent_pb2.TaskResult()
                    message.task.task_id, message.task.attempt, message.agent = task.task_id, task.attempt, agent
                    message.started_at = time.time()
                    message.result.ParseFromString(wire)  # as the stream reader parses it
                    queued.append(QueuedResult(agent, message, lambda ack, _requeued: acks.append(ack)))
            writer.write(queued)
            done += len(queued)
        if profile:
            profile.disable()
        cpu = time.process_time() - started
        counts = store.jobs.task_counts(1)
        if counts.get("completed") != tasks:
            raise RuntimeError(f"not every task completed: {counts}")
        return cpu * 1000 / tasks
    finally:
        store.close()


def _rounds(tasks: int, rounds: int, postgres_url: str | None) -> list[float]:
    figures = []
    for k in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            location: Any = _fresh_database(postgres_url, f"resultpath{k}") if postgres_url else Path(tmp) / "farm.db"
            figures.append(_one_round(location, Path(tmp), tasks, None))
    return figures


@contextlib.contextmanager
def _maybe_postgres(wanted: bool) -> Iterator[str | None]:
    if not wanted:
        yield None
        return
    with _postgres_server() as url:
        yield url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--postgresql", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--statements", action="store_true")
    args = parser.parse_args()
    if args.statements:
        counted: list[_Counted] = []
        with tempfile.TemporaryDirectory() as tmp:
            _one_round(Path(tmp) / "farm.db", Path(tmp), args.tasks, None, counted)
        print(f"SQLite: {counted[0].calls / args.tasks:.2f} statements sent per task (leasing and results)")
        return
    if args.profile:
        profile = cProfile.Profile()
        with tempfile.TemporaryDirectory() as tmp:
            print(f"SQLite, profiled: {_one_round(Path(tmp) / 'farm.db', Path(tmp), args.tasks, profile):.3f} CPU ms/task")
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
        return
    sqlite = _rounds(args.tasks, args.rounds, None)
    print(f"SQLite: {min(sqlite):.3f} CPU ms per task (rounds: {', '.join(f'{r:.3f}' for r in sqlite)})")
    with _maybe_postgres(args.postgresql) as url:
        if url:
            pg = _rounds(args.tasks, args.rounds, url)
            print(f"PostgreSQL: {min(pg):.3f} CPU ms per task at the controller (rounds: "
                  f"{', '.join(f'{r:.3f}' for r in pg)}); the server's own CPU is not counted")


if __name__ == "__main__":
    main()
