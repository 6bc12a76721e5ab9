"""The agent: takes tasks from a controller, runs them with its drivers, reports results.

It talks to the controller only through lease / heartbeat / complete, so whether the
controller is in this process (embedded mode) or across gRPC changes nothing here.
One thread per sim slot; each slot has its own cpuset so sim runs never share cores.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Protocol

from farm.agents.sandbox.base import format_cpuset
from farm.agents.drivers import Driver
from farm.agents.lab import LabDevice
from farm.agents.sim.driver import ModelChanged, SimDriver, SimSlot, verify_model
from farm.proto.escape import printable
from farm.proto.results import FailureClass, ResultRefused, RunResult
from farm.proto.tasks import TaskSpec

HEARTBEAT_INTERVAL_S = 1.0
log = logging.getLogger("farm.agent")


class ControllerApi(Protocol):
    def lease(self, agent: str, targets: set[str], *, job_id: int | None = None) -> TaskSpec | None: ...
    def heartbeat(self, task_id: int, attempt: int) -> bool: ...
    def complete(self, task_id: int, attempt: int, agent: str, started_at: float, result: RunResult) -> int | None: ...


def split_cores(slots: int, cores: list[int] | None = None) -> list[str | None]:
    """Disjoint cpusets for `slots` sim slots; one slot keeps the whole machine."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if slots <= 1:
        return [None]
    if slots > len(cores):
        raise ValueError(f"{slots} sim slots need {slots} cores, this host has {len(cores)}")
    per = len(cores) // slots
    return [format_cpuset(cores[i * per:(i + 1) * per]) for i in range(slots)]


class Agent:
    def __init__(self, controller: ControllerApi, sim: SimDriver, *, name: str | None = None,
                 slots: int = 1, on_result: Callable[[TaskSpec, RunResult], None] | None = None,
                 devices: list[LabDevice] | None = None) -> None:
        self.controller = controller
        self.sim = sim
        self.devices = {d.name: d for d in devices or []}
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.slots = [SimSlot(i, cpuset) for i, cpuset in enumerate(split_cores(slots))]
        self.on_result = on_result
        self.stopping = threading.Event()  # set on Ctrl+C / SIGTERM: stop current runs
        self.failure: Exception | None = None  # what stopped a slot (its store failed): run_job raises it
        self._threads: list[threading.Thread] = []

    def run_job(self, job_id: int | None) -> None:
        """Run the job's tasks until none is left (embedded mode)."""
        self._threads = [threading.Thread(target=self._slot_loop, args=(slot, job_id), name=f"slot-{slot.index}",
                                          daemon=True) for slot in self.slots]
        # one thread per device: a phone or board runs one task at a time
        self._threads += [threading.Thread(target=self._device_loop, args=(name, job_id), name=f"device-{name}",
                                           daemon=True) for name in self.devices]
        for t in self._threads:
            t.start()
        self.join()
        if self.failure is not None:  # in the caller's thread, once: a clean error there, not a thread traceback
            raise self.failure

    def join(self) -> None:
        for t in self._threads:
            while t.is_alive():
                t.join(0.2)  # short joins keep the main thread responsive to Ctrl+C

    def stop(self) -> None:
        """Stop current runs (they are recorded as canceled) and take no new tasks."""
        self.stopping.set()

    def _slot_loop(self, slot: SimSlot, job_id: int | None) -> None:
        self._drive(self.sim.name, self.sim.in_slot(slot), job_id)  # the sim checks the model copy it runs

    def _device_loop(self, device: str, job_id: int | None) -> None:
        self._drive(device, _ModelChecked(self.devices[device].driver, self.name), job_id)

    def _drive(self, target: str, driver: Driver, job_id: int | None) -> None:
        """Lease `target`'s tasks and run each with `driver` until none is left or the agent stops.

        A failure of the controller's side (the store: a full disk, a lost database) stops every slot: the first
        one is kept for run_job to raise, and what was stored stays stored for `farm resume`."""
        try:
            while not self.stopping.is_set():
                task = self.controller.lease(self.name, {target}, job_id=job_id)
                if task is None:
                    return
                self.run_task(task, driver)
        except Exception as e:
            if self.failure is None:
                self.failure = e
            self.stopping.set()

    def run_task(self, task: TaskSpec, driver: Driver) -> RunResult:
        started_at = time.time()
        done = threading.Event()
        keep_going = [True]

        def beat() -> None:
            # Renew the lease while the driver works; device drivers block for whole runs.
            while not done.wait(HEARTBEAT_INTERVAL_S):
                try:
                    alive = self.controller.heartbeat(task.task_id, task.attempt)
                except Exception as e:  # e.g. a local store locked by another process: a line, never a traceback
                    log.warning("run of task %d (attempt %d): could not renew its lease (%s: %s); the run goes on "
                                "and farm tries again in %g s", task.task_id, task.attempt, type(e).__name__,
                                printable(e), HEARTBEAT_INTERVAL_S)
                    continue
                if not alive:
                    keep_going[0] = False
                    return

        def cancel_check() -> bool:
            return self.stopping.is_set() or not keep_going[0]

        threading.Thread(target=beat, name=f"beat-{task.task_id}", daemon=True).start()
        try:
            result = driver.run(task, cancel_check)
        except Exception:
            result = RunResult.failed(FailureClass.BUG, f"the {task.target} driver failed:\n" + traceback.format_exc(limit=8))
        finally:
            done.set()
        try:
            self.controller.complete(task.task_id, task.attempt, self.name, started_at, result)
        except ResultRefused as e:  # the lease ran out meanwhile: the task already went back to the queue
            log.warning("task %d attempt %d: result not stored: %s", task.task_id, task.attempt, e)
            return result
        if self.on_result:
            self.on_result(task, result)
        return result


class _ModelChecked:
    """A device's driver, with the model hashed right before the driver sends it on: not the submitted bytes ->
    job failure (the sim checks the copy it runs itself)."""

    def __init__(self, driver: Driver, agent_name: str) -> None:
        self.driver = driver
        self.name = driver.name
        self.agent_name = agent_name

    def run(self, task: TaskSpec, cancel_check: Callable[[], bool]) -> RunResult:
        try:
            verify_model(Path(task.model_path), task.model_sha256)
        except ModelChanged as e:
            return RunResult.failed(FailureClass.JOB, str(e))
        except OSError as e:
            return RunResult.failed(FailureClass.JOB, f"{task.model_path}: cannot be read on agent {self.agent_name}: "
                                                      f"{e.strerror}")
        return self.driver.run(task, cancel_check)
