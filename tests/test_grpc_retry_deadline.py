"""A controller's job (issue 32, items 3 and 4): `farm retry JOB --failed` (and `farm resume`) runs only its failed
tasks again, and the controller's sweep ends a job past timeouts.job, its running task stopped at once.

The controller and the agent run on threads of this process (farm.client.compose); the client is the real `farm`
command. The deadline is judged by the controller's injected clock, which the test moves past it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from grpc_processes import Cluster, sleep_job, wait_for

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cluster(tmp_path: Path):
    c = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(tmp_path / "none.toml")})
    yield c
    c.stop_all()


def _status(cluster: Cluster, job: int) -> dict:
    answer = cluster.farm("status", str(job), "--json", "--controller", str(cluster.address))
    assert answer.returncode == 0, answer.stderr
    return json.loads(answer.stdout)


def _fail_as_a_lost_agent(db: Path, job: int, n: int) -> list[int]:
    """Lease n of the job's tasks to an agent that is not there and deliver an infrastructure failure with no
    attempt left for each, through the controller's own code on the controller's store (as a dying agent's
    last results are applied)."""
    from farm.controller.scheduling.controller import Controller
    from farm.controller.store import open_store
    from farm.proto.results import FailureClass, RunResult

    store = open_store(db)
    try:
        controller = Controller(store)
        failed = []
        for _ in range(n):
            task = controller.lease("gone", {"sim"}, job_id=job)
            assert task is not None
            store.jobs.update_task(task.task_id, max_attempts=1)  # its last attempt: the task fails for good
            controller.complete(task.task_id, task.attempt, "gone", time.time(),
                                RunResult.failed(FailureClass.INFRASTRUCTURE, "no artifact on this controller (test)"))
            failed.append(task.task_id)
        return failed
    finally:
        store.close()


def test_retry_failed_runs_only_the_failed_tasks_of_a_controller_job(cluster: Cluster, tiny_models) -> None:
    os.symlink(tiny_models["onnx"], cluster.root / "tiny.onnx")
    job = cluster.root / "job.yaml"
    job.write_text("name: retry\nmodels: [tiny.onnx]\nworkload: {iterations: 3, warmup: 1}\nrepeats: 5\n"
                   "sim: {memory: 512m, backend: process, on_contention: flag}\n")
    cluster.serve_in_process()
    submitted = cluster.farm("submit", str(job), "--controller", str(cluster.address), "--detach", "--json")
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["job"]
    failed = _fail_as_a_lost_agent(cluster.root / "controller.db", job_id, 2)

    early = cluster.farm("retry", str(job_id), "--failed", "--controller", str(cluster.address))
    assert early.returncode != 0 and f"job {job_id} is running" in early.stderr, early.stderr

    agent = cluster.agent_in_process("rack1")
    wait_for(lambda: _status(cluster, job_id)["status"] == "failed", 120, "the job to finish with 2 failed")
    assert (_status(cluster, job_id)["completed"], _status(cluster, job_id)["failed"]) == (3, 2)

    retried = cluster.farm("retry", str(job_id), "--failed", "--controller", str(cluster.address), "--progress",
                           timeout=180)
    assert retried.returncode == 0, retried.stdout + retried.stderr
    assert f"job {job_id}: 2 of 5 task(s) run again" in retried.stderr
    status = _status(cluster, job_id)
    assert (status["status"], status["completed"], status["failed"], status["total"]) == ("completed", 5, 0, 5)
    runs = cluster.db().execute("SELECT task_id, attempt, status, agent FROM runs WHERE job_id = ? "
                                "ORDER BY task_id, attempt", [job_id]).fetchall()
    assert len(runs) == 7  # 3 tasks once, the 2 failed ones twice: nothing else ran again
    for task_id in failed:
        assert [(a, s, who) for t, a, s, who in runs if t == task_id] == [(1, "failed", "gone"), (2, "completed", "rack1")]

    # `farm resume` of a controller's finished job is the same request: here there is nothing failed left
    resumed = cluster.farm("resume", str(job_id), "--controller", str(cluster.address))
    assert resumed.returncode != 0 and "no failed task to retry" in resumed.stderr and "5 completed" in resumed.stderr
    assert agent.wait(0) is False  # still leasing


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def test_the_controller_ends_a_job_past_its_deadline(cluster: Cluster, tiny_models) -> None:
    job = sleep_job(cluster.root, tiny_models["onnx"], tasks=4, seconds=30)
    job.write_text(job.read_text() + "timeouts: {job: 4s}\n")
    clock = Clock()
    server = cluster.serve_in_process(clock=clock)
    cluster.agent_in_process("rack1")
    submitted = cluster.farm("submit", str(job), "--controller", str(cluster.address), "--json", "--detach")
    assert submitted.returncode == 0, submitted.stderr
    from farm.client import open_farm
    from farm.client.config import Credentials

    with open_farm(str(cluster.address), credentials=Credentials()) as client:  # polled in-process: no CLI per look
        wait_for(lambda: client.job(1).running == 1, 60, "the agent to start a run")
        assert client.job(1).status == "running"  # within its 4 s on the controller's clock
    clock.now += 5
    server.farm.wake()  # the dispatcher's sweep ends it now (it would within its idle wait anyway)
    watched = cluster.farm("watch", "1", "--controller", str(cluster.address), "--json", timeout=120)
    status = _status(cluster, 1)
    assert status["status"] == "canceled", (status, watched.stderr)
    assert "timeouts.job = 4 s" in status["message"]
    assert status["completed"] == 0 and status["canceled"] == 4
    runs = cluster.db().execute("SELECT status, failure_class FROM runs WHERE job_id = 1").fetchall()
    assert runs and all(r == ("failed", "canceled") for r in runs), runs  # the running one was stopped, not finished
    assert watched.returncode == 1
