"""A lab whose PostgreSQL goes away mid-job (issue 32): the controller's backends killed with pg_terminate_backend
(what a server restart or a failover does to every session), or the server itself restarted. The controller
carries on and reconnects by itself, no result is lost, no task runs twice (the outages here are shorter than a
lease TTL: a longer one may run a task again, the store's at-least-once rule), and the user is told the truth.

The session's shared PostgreSQL peer is never restarted: the first test kills only its own database's backends;
the restart is done on a server of the test's own. In-process controller and agent (tests/grpc_processes.py):
what is under test is the controller's store connection, not a process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import fresh_postgres_url

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def pg_url(postgres_peer, request: pytest.FixtureRequest) -> str:
    return fresh_postgres_url(postgres_peer, request.node.name)


@pytest.fixture
def own_server():
    """A PostgreSQL server of this test's own, to restart."""
    from postgres_server import postgres_server_or_skip

    with postgres_server_or_skip() as server:
        yield server


@pytest.fixture
def cluster(tmp_path: Path):
    from grpc_processes import Cluster

    c = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(tmp_path / "none.toml"),
                               "XDG_DATA_HOME": str(tmp_path / "client-data")}, cli_in_process=True)
    yield c
    c.stop_all()


def _rows(url: str, sql: str, params: tuple = ()) -> list[tuple]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


def _completed(url: str) -> int:
    return int(_rows(url, "SELECT COUNT(*) FROM runs WHERE status = 'completed'")[0][0])


def _start_job(cluster, url: str, model: Path, tasks: int, *, seconds: float = 0.4, lease_ttl_s: float = 30.0) -> None:
    from grpc_processes import sleep_job

    job = sleep_job(cluster.root, model, tasks=tasks, seconds=seconds)
    # by default a lease TTL longer than any outage below: a task whose agent is alive is never taken from it
    cluster.serve_in_process(db=url, lease_ttl_s=lease_ttl_s, heartbeat_interval_s=0.5)
    cluster.agent_in_process("rack")
    submitted = cluster.farm("submit", str(job), "--controller", str(cluster.address), "--detach")
    assert submitted.returncode == 0, submitted.stderr


def _check_every_task_ran_once(cluster, url: str, tasks: int) -> None:
    """The job completed through the same controller: one completed run per task, no other run, no traceback."""
    from grpc_processes import wait_for

    def finished() -> object:
        status = _rows(url, "SELECT status FROM jobs WHERE id = 1")[0][0]
        return status in ("completed", "failed", "canceled") and status
    status = wait_for(finished, 180, "the job to finish", interval=0.3)
    log = cluster.server_output()
    assert status == "completed", log[-5000:]
    runs = _rows(url, "SELECT task_id, attempt, status FROM runs ORDER BY task_id, attempt")
    assert runs == [(task, 1, "completed") for task in range(1, tasks + 1)], "a result was lost or a task ran twice"
    assert "Traceback" not in log, log[-5000:]
    results = cluster.farm("results", "1", "--controller", str(cluster.address), "--format", "csv")
    assert results.returncode == 0 and results.stdout.count(",completed,") == tasks, results.stdout + results.stderr


def test_backends_killed_mid_job_are_replaced_and_the_job_completes(pg_url: str, cluster, tiny_models) -> None:
    from grpc_processes import wait_for

    tasks = 8
    _start_job(cluster, pg_url, tiny_models["onnx"], tasks)
    for done in (1, 4):  # twice: the writer, its readers and the wake-up listener each time
        wait_for(lambda: _completed(pg_url) >= done, 120, f"{done} run(s) to complete")
        killed = _rows(pg_url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = "
                               "current_database() AND pid <> pg_backend_pid()")
        assert killed, "the controller held no connection to kill"
    _check_every_task_ran_once(cluster, pg_url, tasks)
    # the connections the server dropped were replaced: the controller holds new ones
    assert _rows(pg_url, "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() AND "
                         "application_name LIKE 'farm%%'")[0][0] >= 1


def test_a_restarted_server_mid_job_is_said_once_and_the_job_completes(own_server, cluster, tiny_models) -> None:
    from grpc_processes import wait_for

    import threading

    from farm.client.config import Credentials
    from farm.client.remote import RemoteFarm

    url, tasks = own_server.url, 6
    _start_job(cluster, url, tiny_models["onnx"], tasks)
    wait_for(lambda: _completed(url) >= 2, 120, "two runs to complete")
    # a client following the job (what `farm submit` and `farm watch` do) rides the outage out
    watcher, followed = RemoteFarm(str(cluster.address), Credentials()), []
    follow = threading.Thread(target=lambda: followed.append(watcher.wait(1)), daemon=True)
    follow.start()
    own_server.stop()  # every session ends and the server refuses connections until it is back
    # what a user asking meanwhile sees: the controller answers, its database does not, and nothing is lost
    status = cluster.farm("status", "1", "--controller", str(cluster.address))
    assert status.returncode == 3, status.stdout + status.stderr
    said = " ".join(status.stderr.split())
    assert f"the controller at {cluster.address} answered, but the lab's store {url} cannot be reached" in said, said
    assert "nothing stored is lost: try again shortly" in said and "Traceback" not in said
    wait_for(lambda: "cannot be reached" in cluster.server_output(), 60, "the controller to notice")
    own_server.start()
    _check_every_task_ran_once(cluster, url, tasks)
    follow.join(60)
    assert followed == [True], "the watch did not follow the job through the outage to its end"
    watcher.close()
    log = cluster.server_output()
    assert log.count(f"the lab's store {url} cannot be reached") == 1, "the outage was not said once"
    assert log.count(f"the lab's store {url} answers again after") == 1


def test_an_outage_longer_than_a_lease_runs_the_running_task_again_and_loses_nothing(own_server, cluster,
                                                                                    tiny_models) -> None:
    """The store away for longer than --lease-ttl: the running task's lease cannot be renewed meanwhile, so when
    the store is back the task runs again (at least once: the sweep returns it to the queue, or, if the agent's
    heartbeat comes first, the agent is told to stop), its first attempt stored as infrastructure saying why;
    the job completes, no task is canceled or counted twice."""
    import time

    from grpc_processes import wait_for

    url, tasks = own_server.url, 2
    _start_job(cluster, url, tiny_models["onnx"], tasks, seconds=6.0, lease_ttl_s=3.0)  # a run outlives the outage
    wait_for(lambda: _rows(url, "SELECT COUNT(*) FROM tasks WHERE status = 'running'")[0][0] >= 1, 120,
             "a task to run")
    own_server.stop()
    time.sleep(4.0)  # past the lease TTL (3 s): no renewal could be stored meanwhile
    own_server.start()

    def finished() -> object:
        status = _rows(url, "SELECT status FROM jobs WHERE id = 1")[0][0]
        return status in ("completed", "failed", "canceled") and status
    assert wait_for(finished, 180, "the job to finish", interval=0.3) == "completed", cluster.server_output()[-5000:]
    runs = _rows(url, "SELECT task_id, status, failure_class, message FROM runs ORDER BY task_id, attempt")
    for task in range(1, tasks + 1):
        of_task = [r for r in runs if r[0] == task]
        assert [r[1] for r in of_task].count("completed") == 1, of_task
        assert all(r[2] == "infrastructure" for r in of_task if r[1] != "completed"), of_task
    again = [r for r in runs if r[1] != "completed"]
    assert again and all("lease expired on agent rack" in r[3] or "stopped the run because its lease ran out" in r[3]
                         for r in again), runs  # the running task ran again, and its first attempt says why
    assert _rows(url, "SELECT status, COUNT(*) FROM tasks GROUP BY status") == [("completed", tasks)]
    assert "Traceback" not in cluster.server_output()
