"""The in-process runner: a controller and a local agent in this process, for one job.

This is what `farm submit` does when no controller is configured (client/embedded.py calls it); the gRPC mode runs
the very same Controller and Agent, with the wire in between.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Callable

from farm.agents.agent import Agent
from farm.agents.lab import LabDevice
from farm.agents.sim.driver import SimDriver
from farm.controller.scheduling.controller import Controller
from farm.controller.store import Store
from farm.proto.results import RunResult
from farm.proto.tasks import TaskSpec


def work_root_for(store: Store) -> Path:
    return store.path.parent / "work"


def store_files(store: Store) -> tuple[Path, ...]:
    """The store and the files SQLite keeps beside it (WAL, shared memory, rollback journal)."""
    return (store.path, *(store.path.with_name(store.path.name + suffix) for suffix in ("-wal", "-shm", "-journal")))


def run_job_embedded(store: Store, job_id: int, *, slots: int = 1, backend: str | None = None,
                     job_timeout_s: float | None = None, devices: list[LabDevice] | None = None,
                     on_result: Callable[[TaskSpec, RunResult], None] | None = None,
                     controller: Controller | None = None) -> bool:
    """Run every task of the job here. Returns False when it was interrupted by Ctrl+C.

    `controller`: the embedded farm's own (its hooks, its clock); else one over `store` with the process defaults."""
    controller = controller or Controller(store)
    agent = Agent(controller, SimDriver(work_root_for(store), backend_override=backend, keep_out=store_files(store)), slots=slots,
                  on_result=on_result, devices=devices)
    # timeouts.job is a deadline stored at submit (or at `farm retry`): a resume carries on the same clock
    row = store.jobs.get(job_id)
    deadline = row.deadline_at if row is not None else None
    if deadline is None and job_timeout_s:  # a job stored before deadlines were: its clock starts now, once
        deadline = time.time() + job_timeout_s
        store.jobs.update(job_id, deadline_at=deadline)
    timer = None
    if deadline is not None:
        controller.enforce_deadlines()  # already past it: the job ends here, its tasks canceled
        timer = threading.Timer(max(0.0, deadline - time.time()) + 0.05, controller.enforce_deadlines)
        timer.daemon = True
        timer.start()
    interrupted: list[float] = []

    def on_signal(signum: int, frame: object) -> None:
        # Only flag here: the main thread may be inside a store transaction.
        interrupted.append(time.time())
        agent.stop()

    # Ctrl+C and SIGTERM stop the sandboxed runs too (the original tool left containers behind).
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        agent.run_job(job_id)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if timer:
            timer.cancel()
    if interrupted:
        controller.interrupt_job(job_id, since=interrupted[0])  # resumable, not canceled
        return False
    return True
