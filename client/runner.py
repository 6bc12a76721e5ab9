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
                     on_result: Callable[[TaskSpec, RunResult], None] | None = None) -> bool:
    """Run every task of the job here. Returns False when it was interrupted by Ctrl+C."""
    controller = Controller(store)
    agent = Agent(controller, SimDriver(work_root_for(store), backend_override=backend, keep_out=store_files(store)), slots=slots,
                  on_result=on_result, devices=devices)
    timer = None
    if job_timeout_s:
        def job_timed_out() -> None:
            controller.cancel_job(job_id)
            store.jobs.update(job_id, message=f"canceled: the job exceeded timeouts.job = {job_timeout_s:g} s")
        timer = threading.Timer(job_timeout_s, job_timed_out)
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
