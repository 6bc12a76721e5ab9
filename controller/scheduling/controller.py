"""The controller: owns the store, expands jobs, leases tasks to agents, applies results.

Its public methods are exactly what crosses the wire (submit, lease, heartbeat, complete,
cancel): the embedded mode calls them in-process (client/runner.py), the gRPC servicer
(controller/grpc_server.py) puts them behind the wire without changing what they do. All
state is in SQLite.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from farm.controller.scheduling.counters import record_lease_expiries
from farm.controller.scheduling.hooks import Hooks, default_hooks
from farm.controller.scheduling.job_state import TERMINAL_JOB as TERMINAL_JOB, status_of as status_of
from farm.controller.scheduling.outage import StoreOutage
from farm.controller.store import Store
from farm.controller.store.rows import RunningAttempt, TaskRow, plain_rows
from farm.proto.questions import TaskCounts
from farm.proto.results import (
    FailureClass,
    JobStatus,
    ResultRefused,
    RunResult,
    TaskStatus,
)

if TYPE_CHECKING:  # the job and task models (pydantic over the job file's) load when a job is made or a task leased
    from farm.controller.scheduling.jobfile import ResolvedJob
    from farm.proto.tasks import TaskPlan, TaskSpec

LEASE_TTL_S = 60.0
PLANS_KEPT = 4096  # validated task plans the controller keeps (a job has one per sim budget and model entry)
TERMINAL_TASK = {TaskStatus.COMPLETED.value, TaskStatus.FAILED.value, TaskStatus.CANCELED.value}


CONTENDED_RETRIES = 2  # sim.on_contention: retry — then the run is kept, flagged


def contention_outcome(policy: str, contended_before: int) -> str:
    """What a completed but contended sim run becomes: 'retry', 'fail' or 'keep' (flagged)."""
    if policy == "fail":
        return "fail"
    if policy == "retry" and contended_before < CONTENDED_RETRIES:
        return "retry"
    return "keep"


def _utc(timestamp: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(timestamp))


def should_retry(failure: FailureClass | None, attempt: int, max_attempts: int) -> bool:
    """infrastructure: retry up to max; timeout: once; everything else never (LAVA's rule)."""
    if failure == FailureClass.INFRASTRUCTURE:
        return attempt < max_attempts
    if failure == FailureClass.TIMEOUT:
        return attempt < 2
    return False


JobProgress = TaskCounts  # a job's tasks by state: the same record `farm status` answers with (JobInfo extends it)


@dataclass(frozen=True)
class Delivery:
    """A result as an agent delivered it for one attempt."""

    task_id: int
    attempt: int
    agent: str
    started_at: float
    result: RunResult


@dataclass(frozen=True)
class Applied:
    """What applying a result did: its run id (None: delivered before) and the task's new status."""

    run_id: int | None
    task_status: str


def _parts_by_task(deliveries: Sequence[Delivery]) -> list[list[Delivery]]:
    """`deliveries` in order, cut where a task comes again: each part names a task once."""
    parts: list[list[Delivery]] = [[]]
    seen: set[int] = set()
    for d in deliveries:
        if d.task_id in seen:
            parts.append([])
            seen.clear()
        seen.add(d.task_id)
        parts[-1].append(d)
    return [p for p in parts if p]


def progress_of(counts: dict[str, int]) -> JobProgress:
    """A job's progress from its tasks by status (Store.task_counts, or a listing's `counts`)."""
    return JobProgress(
        total=sum(counts.values()), pending=counts.get("pending", 0), running=counts.get("running", 0),
        completed=counts.get("completed", 0), failed=counts.get("failed", 0), canceled=counts.get("canceled", 0))


class RetryRefused(ValueError):
    """`farm retry` cannot re-run this job now: the message says why and what to do."""


def job_timeout_s(spec_json: str | None) -> float | None:
    """A stored job's timeouts.job (seconds), or None."""
    if not spec_json:
        return None
    value = (json.loads(spec_json).get("timeouts") or {}).get("job")
    return float(value) if value else None


def deadline_message(timeout_s: float | None) -> str:
    return (f"canceled: the job passed its deadline, timeouts.job = {timeout_s or 0:g} s after it was submitted "
            "(or last retried); runs already stored are kept")


class Controller:
    def __init__(self, store: Store, *, lease_ttl_s: float = LEASE_TTL_S,
                 clock: Callable[[], float] = time.time, hooks: Hooks | None = None) -> None:
        self.store = store
        self.lease_ttl_s = lease_ttl_s
        # the time leases, heartbeats and deadlines are judged by (tests move it instead of sleeping)
        self.clock = clock
        self.hooks = hooks or default_hooks()  # what scheduling tells the roles above it (hooks.py)
        # told of each job the deadline sweep canceled (a gRPC controller stops its agents' runs at once)
        self.on_deadline: Callable[[int], None] | None = None
        # each stored plan (task_plans: a row never changes) validated once, not at every lease (issue 35)
        self._plans: dict[int, TaskPlan] = {}
        # whether this process runs the lab-wide sweeps now (store/leader.SweepLeader: one controller of those on
        # one store); None: always (embedded, or the only controller)
        self.sweeps: Callable[[], bool] | None = None
        # the store out of reach, said once per outage by whichever thread meets it first (outage.py)
        self.outage = StoreOutage(store.location)

    # --- clients -----------------------------------------------------------------
    def submit(self, job: ResolvedJob, *, name: str | None = None, kind: str = "user", owner: str | None = None,
               team: str | None = None) -> int:
        spec = job.spec
        from farm.controller.scheduling.schedule import expand_tasks

        tasks = expand_tasks(job)
        job_id = self.store.jobs.insert({
            "name": name or spec.name or (job.source_path.stem if job.source_path else "job"), "kind": kind,
            "status": JobStatus.QUEUED.value, "priority": spec.priority, "created_at": self.clock(),
            "spec_json": spec.model_dump_json(), "spec_yaml": job.source,
            "source_path": str(job.source_path) if job.source_path else None,
            "base_dir": str(job.base_dir), "owner_pid": os.getpid(), "owner_host": socket.gethostname(),
            "submitted_by": owner, "team": team,  # whose job it is (service.Viewer); None: the lab's own
            # timeouts.job counts from submission, whoever runs the job and however often it is resumed
            "deadline_at": self.clock() + spec.timeouts.job if spec.timeouts.job else None,
        }, tasks)
        # a quarantined device takes no work: its runs in this job fail now, saying why, instead of waiting
        for row in self.store.devices.quarantined_targets(job_id):
            self._fail_waiting_tasks(row.name, row.reason, job_id=job_id)
        self._finish_job_if_done(job_id)
        return job_id

    def submit_once(self, job: ResolvedJob, submit_key: str, *, owner: str | None = None,
                    team: str | None = None) -> tuple[int, bool]:
        """submit(), once per client submit key lab-wide: (job id, whether an earlier submit with the key made it).
        The key is taken in the transaction that makes the job, so a submit sent again through another controller
        after the first one's answer was lost (it died after committing) finds that job instead of making another."""
        with self.store.transaction():
            made = self.store.jobs.claim_submit_key(owner or "", submit_key, self.clock())
            if made is not None:
                return made, True
            job_id = self.submit(job, owner=owner, team=team)
            self.store.jobs.bind_submit_key(owner or "", submit_key, job_id)
        return job_id, False

    def job_of_submit_key(self, submit_key: str, owner: str | None) -> int | None:
        return self.store.jobs.job_of_submit_key(owner or "", submit_key)

    def _fail_waiting_tasks(self, device: str, reason: str | None, *, job_id: int | None = None) -> list[int]:
        """Fail the device's pending tasks; returns the jobs they belonged to (once each)."""
        return self.store.jobs.fail_waiting_tasks(
            device, f"device {device} is quarantined ({reason}); check it, then `farm device release {device}`",
            self.clock(), job_id=job_id)

    def cancel_job(self, job_id: int) -> int:
        """Cancel what has not finished. Running tasks stop at their next heartbeat."""
        with self.store.transaction():
            job = self.store.jobs.get(job_id)
            if job is None or job.status in TERMINAL_JOB:
                return 0
            n = self.store.jobs.cancel_pending_tasks(job_id, "canceled before it ran", self.clock())
            running = self.store.jobs.task_counts(job_id).get(TaskStatus.RUNNING.value, 0)
            self.store.jobs.update(job_id, status=JobStatus.CANCELED.value, message="canceled by the user")
            if not running:
                self.store.jobs.update(job_id, finished_at=self.clock())
        return n + running

    def interrupt_job(self, job_id: int, since: float) -> int:
        """Ctrl+C: the job stops here but is not given up. Runs stopped by it (canceled since `since`)
        and unstarted ones wait for `farm resume`; their stopped attempts stay stored as runs."""
        with self.store.transaction():
            job = self.store.jobs.get(job_id)
            if job is None or job.status in (JobStatus.COMPLETED.value, JobStatus.FAILED.value) or (
                    job.status == JobStatus.CANCELED.value and job.message):  # `farm cancel` or timeouts.job
                return 0
            n = self.store.jobs.requeue_interrupted_tasks(job_id, since, "interrupted before it finished; `farm resume` runs it")
            self.store.jobs.update(job_id, **{
                "status": JobStatus.INTERRUPTED.value, "finished_at": None,
                "message": f"interrupted (Ctrl+C or SIGTERM); `farm resume {job_id}` runs what is left"})
        return n

    def progress(self, job_id: int) -> JobProgress:
        return progress_of(self.store.jobs.task_counts(job_id))

    def job_status(self, job_id: int) -> str:
        """The stored status, or 'interrupted' when the process running it has died."""
        job = self.store.jobs.get(job_id)
        if job is None:
            raise KeyError(job_id)
        return status_of(job)

    def resume(self, job_id: int) -> int:
        """Take over an interrupted job: its unfinished tasks go back to the queue (each lost attempt a run)."""
        self.store.jobs.update(job_id, owner_pid=os.getpid(), owner_host=socket.gethostname(),
                              status=JobStatus.QUEUED.value, finished_at=None, message=None)
        return self.lose_attempts(self.store.leases.running_attempts(job_id=job_id),
                                  "interrupted: the farm process running it on agent {agent} stopped")

    def retry(self, job_id: int, statuses: Sequence[str] = (TaskStatus.FAILED.value,)) -> int:
        """`farm retry JOB --failed`: the finished job's tasks in `statuses` (failed, lost) run again as new
        attempts of the same tasks; every earlier attempt stays stored as a run. Returns how many wait again.

        Raises RetryRefused while the job still runs, or when none of its tasks is in `statuses`."""
        with self.store.transaction():
            job = self.store.jobs.get(job_id)
            if job is None:
                raise RetryRefused(f"no job {job_id} in {self.store.location}; `farm jobs` lists the jobs there")
            status = status_of(job)
            if status not in TERMINAL_JOB:
                hint = (f"`farm resume {job_id}` carries it on first" if status == JobStatus.INTERRUPTED.value
                        else f"wait for it (`farm watch {job_id}`) or `farm cancel {job_id}` first")
                raise RetryRefused(f"job {job_id} is {status}: only a finished job's tasks can be retried; {hint}")
            counts = self.store.jobs.task_counts(job_id)
            wanted = sum(counts.get(s, 0) for s in statuses)
            if not wanted:
                said = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no tasks"
                raise RetryRefused(f"job {job_id} has no {' or '.join(statuses)} task to retry ({said})")
            from farm.controller.scheduling.schedule import MAX_ATTEMPTS

            now = self.clock()
            n = self.store.jobs.requeue_tasks(job_id, statuses, "retried (`farm retry`); its earlier attempts stay stored",
                                              MAX_ATTEMPTS)
            timeout = job_timeout_s(job.spec_json)
            self.store.jobs.update(job_id, status=JobStatus.QUEUED.value, finished_at=None,
                                   owner_pid=os.getpid(), owner_host=socket.gethostname(),
                                   deadline_at=now + timeout if timeout else None,
                                   message=f"{n} {' or '.join(statuses)} task(s) of {sum(counts.values())} run again by "
                                           "`farm retry`; their earlier attempts stay stored")
            for row in self.store.devices.quarantined_targets(job_id):  # as at submit: no work for such a device
                self._fail_waiting_tasks(row.name, row.reason, job_id=job_id)
        self._finish_job_if_done(job_id)
        return n

    def enforce_deadlines(self) -> list[int]:
        """Cancel the unfinished tasks of every job past its deadline (timeouts.job); returns those jobs."""
        ended = []
        for job_id in self.store.jobs.past_deadline(self.clock()):
            with self.store.transaction():
                job = self.store.jobs.get(job_id)
                if job is None or job.status in TERMINAL_JOB:
                    continue
                self.cancel_job(job_id)
                self.store.jobs.update(job_id, message=deadline_message(job_timeout_s(job.spec_json)))
            ended.append(job_id)
            if self.on_deadline is not None:
                self.on_deadline(job_id)
        return ended

    # --- agents ------------------------------------------------------------------
    def lease(self, agent: str, targets: set[str], *, job_id: int | None = None) -> TaskSpec | None:
        """Hand the next pending task for one of `targets` to `agent`, or None."""
        self.expire_leases()
        now = self.clock()
        with self.store.transaction():
            first = self.store.leases.next_pending(targets, 1, job_id=job_id)
            if not first:
                return None
            task = first[0]
            attempt = task.attempts + 1
            self.store.leases.lease(task.id, attempt, agent, now + self.lease_ttl_s)
            self.store.leases.start_job(task.job_id, now)
        return _task_spec(task, attempt, self._plan(task))

    def _plan(self, task: TaskRow) -> TaskPlan:
        """The task's plan: its job's stored plan, validated at its first lease only (a job has a few)."""
        plan = self._plans.get(task.plan_id) if task.plan_id is not None else None
        if plan is None:
            from farm.proto.tasks import TaskPlan

            plan = TaskPlan.model_validate_json(task.spec_json or "")
            if task.plan_id is not None:
                if len(self._plans) >= PLANS_KEPT:  # the open jobs' plans come back at their next lease
                    self._plans.clear()
                self._plans[task.plan_id] = plan
        return plan

    def lease_batch(self, slots: list[tuple[str, frozenset[str]]]) -> tuple[list[TaskSpec | None], bool]:
        """Lease for many idle slots (agent, targets) in one transaction: the gRPC dispatcher's round.

        Same order as lease() (priority, job, seq); each task goes to the first free slot that
        serves its target. Returns the tasks by slot and whether every pending task for these
        targets was looked at (if not, a slot left empty may still find work with lease()).
        The caller expires leases first.
        """
        leased: list[TaskSpec | None] = [None] * len(slots)
        wanted = set().union(*(targets for _, targets in slots)) if slots else set()
        if not wanted:
            return leased, True
        now = self.clock()
        with self.store.transaction():
            free = list(range(len(slots)))
            started_jobs: set[int] = set()
            fetched = self.store.leases.next_pending(wanted, len(slots))
            leases: list[tuple[int, int, str, float]] = []
            for task in fetched:
                slot = next((i for i in free if task.target in slots[i][1]), None)
                if slot is None:
                    continue  # no free slot serves this target this round
                free.remove(slot)
                attempt = task.attempts + 1
                leases.append((task.id, attempt, slots[slot][0], now + self.lease_ttl_s))
                started_jobs.add(task.job_id)
                leased[slot] = _task_spec(task, attempt, self._plan(task))
            self.store.leases.lease_many(leases)  # one statement for the round's leases
            for job_id in started_jobs:
                self.store.leases.start_job(job_id, now)
        return leased, len(fetched) < len(slots)

    def heartbeat(self, task_id: int, attempt: int, agent: str | None = None) -> bool:
        """Renew the lease. False means stop: the task was canceled or its lease lost.

        With `agent`, only that agent's own lease is renewed (the gRPC side: agents are not trusted)."""
        return self.heartbeat_batch([(task_id, attempt, agent)])[0]

    def heartbeat_batch(self, renewals: Sequence[tuple[int, int, str | None]]) -> list[bool]:
        """Renew many leases, (task, attempt, agent) each, in one transaction; each answer as heartbeat()'s."""
        alive = []
        with self.store.transaction():
            for task_id, attempt, agent in renewals:
                alive.append(self._renew(task_id, attempt, agent))
        return alive

    def _renew(self, task_id: int, attempt: int, agent: str | None) -> bool:
        row = self.store.leases.state(task_id)
        if row is None:
            return False
        status, attempts, expires_at, job_status, leased_by = (row.task_status, row.attempts, row.lease_expires_at,
                                                               row.job_status, row.leased_by)
        if status != TaskStatus.RUNNING.value or attempts != attempt or job_status == JobStatus.CANCELED.value:
            return False
        if agent is not None and leased_by != agent:
            return False
        if expires_at is not None and expires_at < self.clock():
            return False  # too late: the task may already be another agent's
        self.store.leases.renew(task_id, self.clock() + self.lease_ttl_s)
        return True

    def complete(self, task_id: int, attempt: int, agent: str, started_at: float, result: RunResult) -> int | None:
        """Apply a run's result once; decide the task's next state. Returns the run id (None: a duplicate).

        Raises ResultRefused unless the attempt is running and leased to `agent`."""
        outcome = self.complete_batch([Delivery(task_id, attempt, agent, started_at, result)])[0]
        if isinstance(outcome, ResultRefused):
            raise outcome
        return outcome.run_id

    def complete_batch(self, deliveries: list["Delivery"]) -> list["Applied | ResultRefused"]:
        """Apply many results in one transaction (one commit), each as complete() would: a refused one stores
        nothing and leaves the others be. The batch is read and written a statement per table, not per result
        (its tasks, their jobs' status and earlier deliveries, then runs, summaries, samples and task changes);
        a task delivered twice in one batch is applied in a later part, after the first delivery is written."""
        outcomes: list[Applied | ResultRefused] = []
        jobs: set[int] = set()
        with self.store.transaction():
            for part in _parts_by_task(deliveries):
                outcomes += self._complete_part(part, jobs)
            for job_id in sorted(jobs):  # once per job and batch, not per result
                self._finish_job_if_done(job_id)
        return outcomes

    def _complete_part(self, part: list["Delivery"], touched_jobs: set[int]) -> list["Applied | ResultRefused"]:
        """complete_batch's deliveries of distinct tasks, inside its transaction; the caller finishes `touched_jobs`."""
        from farm.controller.store.interface import RunWrite
        from farm.controller.store.sql import check_lease

        tasks = self.store.runs.leased([d.task_id for d in part])  # locked until the batch commits
        job_status = self.store.jobs.statuses({t.job_id for t in tasks.values()})
        stored = self.store.runs.delivered([(d.task_id, d.attempt) for d in part])
        outcomes: list[Applied | ResultRefused | RunWrite] = []
        quarantines: list[tuple[TaskRow, int, RunResult, str]] = []
        for d in part:
            task = tasks.get(d.task_id)
            if task is None:
                outcomes.append(ResultRefused(f"there is no task {d.task_id}"))
                continue
            result = self._stopped_for_a_lost_lease(task, job_status.get(task.job_id), d.agent, d.result)
            fields = self._result_fields(task, d.attempt, result, job_status.get(task.job_id))
            existing = stored.get((d.task_id, d.attempt))
            try:
                if existing and existing != (d.agent, result.status.value, result.message):
                    raise ResultRefused(f"attempt {d.attempt} of task {d.task_id} is already stored: {existing[2]}")
                if not existing:
                    check_lease((task.status, task.attempts, task.leased_by), task.id, d.attempt, d.agent)
            except ResultRefused as e:
                outcomes.append(e)
                continue
            # delivered twice (the first ack was lost): applied once, answered again
            outcomes.append(Applied(None, fields["status"]) if existing else
                            RunWrite(task, d.attempt, d.agent, d.started_at, result, fields))
            quarantines.append((task, d.attempt, result, fields["status"]))
            touched_jobs.add(task.job_id)
        run_ids = iter(self.store.runs.write([o for o in outcomes if isinstance(o, RunWrite)]))
        for task, attempt, result, status in quarantines:
            if (task.target != "sim" and status == TaskStatus.FAILED.value
                    and result.failure_class == FailureClass.INFRASTRUCTURE):
                self.quarantine(task.target, f"{attempt} infrastructure failures in a row; last: {result.message}")
        return [Applied(next(run_ids), str(o.task_fields["status"])) if isinstance(o, RunWrite) else o
                for o in outcomes]

    def _result_fields(self, task: TaskRow, attempt: int, result: RunResult, job_status: str | None) -> dict[str, Any]:
        """The task's new fields once this result of `attempt` is stored: done, retried or failed."""
        reasons = "; ".join(result.contention.reasons) if result.contention is not None else ""
        contended = result.ok and result.contention is not None and result.contention.contended
        outcome = self._contention_outcome(task) if contended else "keep"
        if contended and outcome == "retry" and job_status != JobStatus.CANCELED.value:
            # a measurement spoiled by other work is not the model's figure: measure it again;
            # the retry does not use up the attempts kept for infrastructure failures
            fields: dict[str, str | int | float | None] = {  # the task row's columns to set
                      "status": TaskStatus.PENDING.value, "failure_class": None,
                      "max_attempts": task.max_attempts + 1,
                      "message": f"attempt {attempt} was contended ({reasons}); retrying"}
        elif contended and outcome == "fail":
            fields = {"status": TaskStatus.FAILED.value, "failure_class": FailureClass.INFRASTRUCTURE.value,
                      "message": f"the run was contended ({reasons}) and "
                                 "sim.on_contention is fail"}
        elif result.ok:
            notes = [result.message] if result.message else []
            if contended:
                notes.append(f"contended, kept flagged: {reasons}")
            fields = {"status": TaskStatus.COMPLETED.value, "failure_class": None, "message": "; ".join(notes)}
        elif job_status == JobStatus.CANCELED.value or result.failure_class == FailureClass.CANCELED:
            fields = {"status": TaskStatus.CANCELED.value, "failure_class": FailureClass.CANCELED.value,
                      "message": result.message}
        elif should_retry(result.failure_class, attempt, task.max_attempts):
            failure = (result.failure_class or FailureClass.BUG).value  # a failed result always has its class
            fields = {"status": TaskStatus.PENDING.value, "failure_class": failure,
                      "message": f"attempt {attempt} failed ({failure}): {result.message}; retrying"}
        else:
            fields = self._failed_or_kept(task, attempt, result)
        if fields["status"] in TERMINAL_TASK:
            fields["finished_at"] = self.clock()
        fields["leased_by"] = None
        return fields

    def _stopped_for_a_lost_lease(self, task: TaskRow, job_status: str | None, agent: str,
                                  result: RunResult) -> RunResult:
        """A run its agent stopped (canceled) though its job was not canceled, after its lease ran out: the agent
        was told to stop because the lease could not be renewed in time (its controller lost, or the agent cut
        off from every controller), not by a user. That is infrastructure, retried, and the message says so;
        stored as canceled, the task would end there at its first attempt, never run again."""
        expires_at = task.lease_expires_at
        if (result.failure_class != FailureClass.CANCELED or job_status == JobStatus.CANCELED.value
                or expires_at is None or expires_at >= self.clock()):
            return result
        return dataclasses.replace(result, failure_class=FailureClass.INFRASTRUCTURE, message=(
            f"agent {agent} stopped the run because its lease ran out at {_utc(expires_at)} before it finished "
            f"(its controller went away, or the agent lost every controller): {result.message}"))

    def _failed_or_kept(self, task: TaskRow, attempt: int, result: RunResult) -> dict[str, Any]:
        """A task's last attempt failed: it fails, unless an earlier attempt finished a measurement that was set
        aside only because it was contended. That one is the task's result, kept and flagged (as the policy
        keeps one after its retries): a retry never throws a finished measurement away."""
        failure = result.failure_class.value if result.failure_class else FailureClass.BUG.value
        kept = self.store.runs.last_contended_measurement(task.id) if task.target == "sim" else None
        if kept is None:
            return {"status": TaskStatus.FAILED.value, "failure_class": failure, "message": result.message}
        run_id, kept_attempt = kept
        return {"status": TaskStatus.COMPLETED.value, "failure_class": None, "last_run_id": run_id,
                "message": f"attempt {kept_attempt}'s measurement kept, contended and flagged: the attempt measuring it "
                           f"again failed ({failure}: {result.message})"}

    def _contention_outcome(self, task: TaskRow) -> str:
        policy = self._plan(task).sim.on_contention
        return contention_outcome(policy, self.store.runs.contended_runs(task.id))

    # --- device health -------------------------------------------------------------
    def quarantine(self, device: str, reason: str, *, health: str = "bad") -> int:
        """No more tasks for `device` until it is released; its waiting tasks fail (infrastructure).

        health "maintenance" is the same, but chosen by a person rather than found by farm."""
        self.store.devices.set_health(device, health, reason, self.clock())
        jobs = self._fail_waiting_tasks(device, reason)
        for job_id in set(jobs):  # only the jobs that just lost tasks can have finished
            self._finish_job_if_done(job_id)
        self.hooks.quarantined(device, reason)  # operations' alert (controller/__init__.py): queued, never holds this lock
        return len(jobs)  # tasks failed (one entry per task)

    def passed_health_check(self, device: str, reason: str) -> bool:
        """A device that passed a health check is good (its health was unknown, or good from an earlier check).
        One that is quarantined or in maintenance stays so: only a person releases it. Returns whether it is good."""
        with self.store.transaction():
            current = self.store.devices.health_by_name().get(device)
            if current is not None and current.health != "good":
                return False
            self.store.devices.set_health(device, "good", reason, self.clock())
        return True

    def release(self, device: str) -> None:
        self.store.devices.set_health(device, "good", "released by a person", self.clock())

    def device_health(self) -> list[dict[str, Any]]:
        return plain_rows(self.store.devices.health())

    def expire_leases(self) -> int:
        """Tasks whose agent stopped renewing go back to the queue (the next lease is attempt + 1).

        The lost attempt is stored as a run of its own (infrastructure), so `runs` has every attempt.
        With several controllers on one store only the sweeps' leader runs it (the others answer 0)."""
        if self.sweeps is not None and not self.sweeps():
            return 0
        self.enforce_deadlines()  # the same sweep ends jobs past timeouts.job (their tasks canceled, not lost)
        # read on a reader connection first: the common round finds nothing and so takes no write lock
        lost = self.store.leases.running_attempts(expired_before=self.clock())
        expired = self.lose_attempts(lost, "lease expired on agent {agent}: it stopped renewing the lease") if lost else 0
        record_lease_expiries(expired)  # farm_lease_expiries_total: agents that went silent mid-task
        return expired

    def lose_attempts(self, running: list[RunningAttempt], reason: str) -> int:
        """Running attempts (Store.running_attempts rows) that will not report: each is stored as a failed run
        (infrastructure, `reason` with {agent}) and retried while attempts are left. Returns how many.

        Each is checked again inside the transaction: one that reported or moved on meanwhile is left be."""
        now = self.clock()
        with self.store.transaction():
            lost = self.store.leases.running_attempts(task_ids=[t.id for t in running]) if running else []
            current = {(t.id, t.attempts, t.leased_by) for t in running}
            lost = [t for t in lost if (t.id, t.attempts, t.leased_by) in current]
            if not lost:
                return 0
            failed_jobs = self.store.leases.record_lost_attempts(
                lost, reason, now=now, retry=lambda attempt, most: should_retry(FailureClass.INFRASTRUCTURE, attempt, most))
        for job_id in set(failed_jobs):
            self._finish_job_if_done(job_id)
        return len(lost)

    def _finish_job_if_done(self, job_id: int) -> None:
        if self.store.jobs.has_open_tasks(job_id):
            return  # the common case
        p = self.progress(job_id)
        if p.pending or p.running:
            return
        job = self.store.jobs.get(job_id)
        assert job is not None  # it has tasks
        if job.status == JobStatus.CANCELED.value or p.canceled:
            status = JobStatus.CANCELED
        elif p.completed == p.total:
            status = JobStatus.COMPLETED
        else:
            status = JobStatus.FAILED
        self.store.jobs.update(job_id, status=status.value, finished_at=self.clock())

    def jobs(self, limit: int = 50, visible_to: tuple[str, str | None] | None = None) -> list[dict[str, Any]]:
        return plain_rows(self.store.jobs.listing(limit, visible_to))


def _task_spec(task: TaskRow, attempt: int, plan: TaskPlan) -> TaskSpec:
    from farm.proto.tasks import TaskSpec

    return TaskSpec(
        task_id=task.id, job_id=task.job_id, attempt=attempt, target=task.target,
        model_name=task.model_name, model_path=task.model_path,
        model_sha256=task.model_sha256, model_family=task.model_family,
        threads=task.threads, batch_size=task.batch_size, input_size=task.input_size,
        repeat=task.repeat, plan=plan)


__all__ = ["Controller", "JobProgress", "RetryRefused", "deadline_message", "job_timeout_s", "progress_of", "should_retry", "status_of"]
