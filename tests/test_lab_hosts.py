"""A lab on many hosts (issue 32): controllers on one PostgreSQL database, each with its own data folder, as
two hosts have. Artifacts live in the database (controller/store/artifacts_db.py), so any controller serves
what any other received, and their collection is lab-wide.

The server is the session's private PostgreSQL (tests/postgres_server.py via conftest's postgres_peer).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

import pytest

from conftest import fresh_postgres_url

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def pg_url(postgres_peer, request: pytest.FixtureRequest) -> str:
    return fresh_postgres_url(postgres_peer, request.node.name)


def _files(url: str, folder: Path):
    from farm.controller.grpc_server import controller_files
    from farm.controller.store.postgres import PostgresStore

    store = PostgresStore(url, files_dir=folder)
    return store, controller_files(store).store


def test_an_artifact_one_controller_received_is_served_by_another_from_the_database(pg_url: str,
                                                                                    tmp_path: Path) -> None:
    import psycopg

    from farm.controller.scheduling.artifacts import ArtifactError

    data = os.urandom((3 << 20) + 12345)  # four chunks, the last one short
    sha = hashlib.sha256(data).hexdigest()
    store_a, on_a = _files(pg_url, tmp_path / "host-a")
    store_b, on_b = _files(pg_url, tmp_path / "host-b")
    try:
        assert on_b.missing([sha]) == [sha] and on_b.path(sha) is None
        # an upload to a, sent in pieces that are not the chunk size
        on_a.receive(sha, len(data), "model.onnx", (data[i:i + 700_000] for i in range(0, len(data), 700_000)))
        assert on_b.missing([sha]) == [], "b does not see what a stored"
        served = on_b.path(sha)
        assert served is not None and served.name == f"{sha}.onnx"
        assert served.is_relative_to(tmp_path / "host-b"), "b served from somewhere other than its own folder"
        assert served.read_bytes() == data
        with psycopg.connect(pg_url) as conn:
            chunks = conn.execute("SELECT idx, length(data) FROM artifact_chunks WHERE sha256 = %s ORDER BY idx",
                                  [sha]).fetchall()
            assert chunks == [(0, 1 << 20), (1, 1 << 20), (2, 1 << 20), (3, 12345)]
            # bytes changed in the database never reach an agent: the copy is checked against its hash
            conn.execute("UPDATE artifact_chunks SET data = %s WHERE sha256 = %s AND idx = 1", [b"x" * (1 << 20), sha])
        _, on_c = _files(pg_url, tmp_path / "host-c")
        with pytest.raises(ArtifactError, match="hash to"):
            on_c.path(sha)
        assert not [p for p in (tmp_path / "host-c").rglob("*") if p.is_file()], "a bad copy was left behind"
        # the same bytes stored again by b: stored once
        assert on_b.chunks.put(sha, len(data), ".onnx", served) is False
        # collection is lab-wide: b collects what no job names, and a no longer has it to offer
        assert on_b.collect(set(), 3600.0) == [], "an artifact inside its grace period was collected"
        from farm.controller import service  # what `farm artifacts gc` and the nightly run

        answer = service.collect_artifacts(store_b, on_b, grace_s=0.0)
        assert answer.removed == [f"{sha}.onnx"] and answer.bytes == len(data)
        assert answer.store.startswith(store_b.location), "the lab-wide collection names the database"
        assert on_a.missing([sha]) == [sha]
        with psycopg.connect(pg_url) as conn:
            assert conn.execute("SELECT COUNT(*) FROM artifact_chunks").fetchone() == (0,)
    finally:
        store_a.close()
        store_b.close()


@pytest.fixture
def cluster(tmp_path: Path):
    from grpc_processes import Cluster

    c = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(tmp_path / "none.toml"),
                               "XDG_DATA_HOME": str(tmp_path / "client-data")})
    yield c
    c.stop_all()


def test_a_job_submitted_to_one_controller_runs_on_agents_of_another_host(pg_url: str, cluster,
                                                                         tiny_models) -> None:
    from grpc_processes import sleep_job, wait_for

    hosts = {name: cluster.root / f"{name}-data" for name in ("a", "b")}
    job = sleep_job(cluster.root, tiny_models["onnx"], tasks=3, seconds=0.1)  # a model and a script archive
    cluster.start_controller("--no-auth", db=pg_url, name="controller-a",  # type: ignore[arg-type]
                             env={"XDG_DATA_HOME": str(hosts["a"])})
    address_a = cluster.address
    b = cluster.start_controller("--no-auth", db=pg_url, name="controller-b",  # type: ignore[arg-type]
                                 env={"XDG_DATA_HOME": str(hosts["b"])})
    agent = cluster.start_agent("rack-b")  # on b only
    wait_for(lambda: "connected to controller" in agent.output(), 60, "the agent to connect to b")
    submitted = cluster.farm("submit", str(job), "--controller", address_a, "--json", timeout=240)
    assert submitted.returncode == 0, submitted.stderr + b.output()[-3000:] + agent.output()[-3000:]
    records = json.loads(submitted.stdout)["results"]
    assert len(records) == 3 and {r["status"] for r in records} == {"completed"}, records
    assert "NOT_FOUND" not in agent.output() + b.output()
    # b served the model from its own folder, streamed in from the database; a's folder is a's
    model_sha = hashlib.sha256(tiny_models["onnx"].read_bytes()).hexdigest()
    on_b = [p.name for p in hosts["b"].rglob(f"{model_sha}*")]
    on_a = [p.name for p in hosts["a"].rglob(f"{model_sha}*")]
    assert on_b == [f"{model_sha}.onnx"] and on_a == [f"{model_sha}.onnx"]


def test_both_controllers_show_an_agent_on_either_the_same_way(pg_url: str, tmp_path: Path) -> None:
    """Issue 32: each dashboard showed the other controller's agents offline while they worked."""
    from farm.controller import service
    from farm.controller.grpc_server import FarmServer
    from farm.controller.store.postgres import PostgresStore
    from farm.controller.store.presence import Presence
    from farm.proto.generated import agent_pb2, common_pb2
    from farm.web.views import agents_now, lab_view

    servers = []
    for host in ("a", "b"):
        server = FarmServer(PostgresStore(pg_url, files_dir=tmp_path / host), lease_ttl_s=30.0)
        server.agents.address, server.agents.presence = f"host-{host}:5005{len(servers)}", Presence(server.store)
        servers.append(server)
    a, b = servers
    try:
        hello = agent_pb2.Hello(agent_name="rack", farm_version="test", hostname="bench-1", devices=[
            common_pb2.Device(name="rack/pixel", driver="android", device_type="pixel-7", slots=1)])
        session, _ = b.agents.open(hello, "ipv4:127.0.0.1:40000")
        session.running.add((7, 1))  # one slot busy
        b.agents.keep_alive(30.0)

        def seen_from(server: FarmServer) -> tuple:
            view = lab_view(server.store, live=agents_now(server.agents))
            listed = service.agents(service.Scope(server.controller, agents=server.agents), service.NoAsk()).agents
            return ([(r.name, r.state, r.running, r.controller) for r in view.agents],
                    [(d.name, d.state) for d in view.devices],
                    [(x.name, x.state, x.running, x.controller) for x in listed])

        assert seen_from(a) == seen_from(b)
        assert seen_from(a)[0] == [("rack", "online", 1, "host-b:50051")]
        assert seen_from(a)[1] == [("rack/pixel", "online")]
        # the agent leaves b: both say so
        b.agents.close(session)
        assert seen_from(a) == seen_from(b)
        assert seen_from(a)[0] == [("rack", "offline", 0, "")]
    finally:
        for server in servers:
            server.store.close()


def test_one_nightly_per_cron_tick_with_two_controllers_and_the_lease_moves_when_its_holder_dies(
        pg_url: str, tmp_path: Path) -> None:
    import datetime as dt

    import psycopg

    from farm.controller.operations.nightly import Cron, NightlyRefresh
    from farm.controller.operations.reference_suite import HEALTH_CHECK, bundled_suite_text
    from farm.controller.scheduling.jobfile import DeviceTarget
    from farm.controller.store.leader import LabDuties
    from farm.controller.store.postgres import PostgresStore

    suite = tmp_path / "suite" / "reference-suite.yaml"
    suite.parent.mkdir()
    suite.write_text(bundled_suite_text().replace("threads: [1, 2]", "threads: [1]"))
    now = [dt.datetime(2026, 11, 22, 2, 29)]
    stores = [PostgresStore(pg_url, files_dir=tmp_path / host) for host in ("a", "b")]
    try:
        nightlies = [NightlyRefresh(store, suite, Cron.parse("30 2 * * *"), lambda: [DeviceTarget("g6-1")],
                                    clock=lambda: now[0], duties=LabDuties(store), holder=f"ctl-{i}")
                     for i, store in enumerate(stores)]
        assert [n.tick() for n in nightlies] == [None, None]  # 02:29: not yet
        now[0] = dt.datetime(2026, 11, 22, 2, 30)
        submitted = [n.tick() for n in nightlies]
        assert submitted[0] is not None and submitted[1] is None, "the tick was submitted twice, or never"
        now[0] = dt.datetime(2026, 11, 23, 2, 30, 5)  # the next night: b's turn comes first this time
        submitted = [nightlies[1].tick(), nightlies[0].tick()]
        assert submitted[0] is not None and submitted[1] is None
        with psycopg.connect(pg_url) as conn:
            kinds = conn.execute("SELECT COUNT(*) FROM jobs WHERE kind = %s", [HEALTH_CHECK]).fetchone()
            assert kinds == (2,), "one suite job per cron tick, lab-wide"
    finally:
        for store in stores:
            store.close()
    # the lease: one holder at a time, taken over once it runs out
    store = PostgresStore(pg_url, files_dir=tmp_path / "c")
    try:
        duties = LabDuties(store)
        assert duties.hold("sweep", "a", 60.0, now=1000.0)
        assert not duties.hold("sweep", "b", 60.0, now=1030.0)  # a's lease is live
        assert duties.hold("sweep", "a", 60.0, now=1050.0)  # a renews
        assert not duties.hold("sweep", "b", 60.0, now=1100.0)
        assert duties.hold("sweep", "b", 60.0, now=1111.0), "a died (no renewal for a TTL): b takes over"
        assert duties.holder("sweep", now=1112.0) == "b"
        assert not duties.hold("sweep", "a", 60.0, now=1120.0)  # a, back, waits its turn
    finally:
        store.close()


def test_farm_submit_follows_its_job_through_the_other_controller_when_its_own_is_killed(
        pg_url: str, cluster, tiny_models) -> None:
    import subprocess

    import psycopg

    from grpc_processes import FARM, sleep_job, wait_for

    job = sleep_job(cluster.root, tiny_models["onnx"], tasks=4, seconds=1.5)
    victim = cluster.start_controller("--no-auth", db=pg_url, name="controller-a",  # type: ignore[arg-type]
                                      env={"XDG_DATA_HOME": str(cluster.root / "a-data")})
    address_a = cluster.address
    cluster.start_controller("--no-auth", db=pg_url, name="controller-b",  # type: ignore[arg-type]
                             env={"XDG_DATA_HOME": str(cluster.root / "b-data")})
    address_b = cluster.address
    agent = cluster.start_agent("rack-b")
    wait_for(lambda: "connected to controller" in agent.output(), 60, "the agent to connect to b")
    submit = subprocess.Popen([*FARM, "submit", str(job), "--controller", f"{address_a},{address_b}", "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cluster.root,
                              env={**os.environ, **cluster.env})

    def running() -> object:
        with psycopg.connect(pg_url) as conn:
            return conn.execute("SELECT COUNT(*) FROM tasks WHERE status IN ('running', 'completed')").fetchone()[0]
    wait_for(running, 120, "a task of the job to run")
    victim.kill9()
    out, err = submit.communicate(timeout=240)
    assert submit.returncode == 0, err[-3000:]
    assert f"the controller {address_a} went away; job 1 carries on: following it through {address_b}" in err
    records = json.loads(out)["results"]
    assert len(records) == 4 and {r["status"] for r in records} == {"completed"}, records


def test_a_watch_whose_only_controller_is_gone_says_the_job_carries_on() -> None:
    from farm.client.api import FarmError
    from farm.client.config import Credentials
    from farm.client.remote import RemoteFarm

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    farm = RemoteFarm(f"127.0.0.1:{port}", Credentials())
    with pytest.raises(FarmError) as gone:
        farm.wait(12)
    assert f"cannot reach the controller at 127.0.0.1:{port}" in str(gone.value)
    assert "Job 12 is kept in the lab's store and carries on without this client" in str(gone.value)
    farm.close()


def test_migrate_refuses_a_lab_still_being_written_and_moves_artifacts_into_the_database(
        pg_url: str, tmp_path: Path) -> None:
    import time

    from farm.controller.store import SQLiteStore, StoreError
    from farm.controller.store.artifacts_db import ArtifactChunks
    from farm.controller.store.postgres import PostgresStore
    from farm.controller.store.transfer import artifacts_folder, copy_artifacts, copy_lab

    source = SQLiteStore(tmp_path / "farm.db")
    job = source.jobs.insert({"name": "live", "status": "queued", "priority": "normal", "created_at": time.time(),
                              "spec_json": "{}"}, [{"seq": 0, "target": "sim", "model_name": "m", "status": "pending",
                                                    "attempts": 0, "max_attempts": 3, "priority": 1, "spec_json": "{}"}])
    task = source.jobs.tasks(job)[0]
    with source.transaction():
        source.leases.lease(task.id, 1, "rack", time.time() + 600)  # a runner holds it: the lab is being written
    target = PostgresStore(pg_url, files_dir=tmp_path / "pg")
    try:
        with pytest.raises(StoreError, match=f"job\\(s\\) {job} still run"):
            copy_lab(source, target)
        assert target.tables_with_rows(["jobs"]) == [], "something was copied"
        with source.transaction():  # its runner died: the lease ran out
            source.leases.lease(task.id, 1, "rack", time.time() - 1)
        assert copy_lab(source, target)["tasks"] == 1
        data = b"weights" * 1000
        sha = hashlib.sha256(data).hexdigest()
        artifacts_folder(source.path).mkdir()
        (artifacts_folder(source.path) / f"{sha}.tflite").write_bytes(data)
        assert copy_artifacts(source, target) == 1
        assert ArtifactChunks(target).stored(sha) == (len(data), ".tflite"), "the lab's other controllers lack it"
    finally:
        source.close()
        target.close()


def _job_with_leases(store, leases: list[float], *, deadline_at: float | None = None) -> tuple[int, list[int]]:
    """A job whose tasks are leased to agent `rack` until each of `leases` (a time on the tests' clock)."""
    job = store.jobs.insert({"name": "swept", "status": "running", "priority": "normal", "created_at": 0.0,
                             "spec_json": "{}", "deadline_at": deadline_at},
                            [{"seq": i, "target": "sim", "model_name": "m", "status": "pending", "attempts": 0,
                              "max_attempts": 3, "priority": 1, "spec_json": "{}"} for i in range(len(leases))])
    tasks = [t.id for t in store.jobs.tasks(job)]
    with store.transaction():
        for task, until in zip(tasks, leases):
            store.leases.lease(task, 1, "rack", until)
    return job, tasks


def test_lab_wide_sweeps_run_on_the_leader_only_and_pass_on_when_it_dies(pg_url: str, tmp_path: Path) -> None:
    """Issue 32: lease expiry and job deadlines ran on every controller of one store; now on the sweeps' leader
    only, and the lease row passes on to another controller once the leader stops renewing it."""
    from farm.controller.scheduling.controller import Controller
    from farm.controller.store.leader import LabDuties, SweepLeader
    from farm.controller.store.postgres import PostgresStore

    now = [1000.0]
    stores = [PostgresStore(pg_url, files_dir=tmp_path / host) for host in ("a", "b")]
    try:
        a, b = (Controller(store, lease_ttl_s=40.0, clock=lambda: now[0]) for store in stores)
        a.sweeps = SweepLeader(LabDuties(stores[0]), "host-a:50051/1", 40.0, clock=lambda: now[0])
        b.sweeps = SweepLeader(LabDuties(stores[1]), "host-b:50051/2", 40.0, clock=lambda: now[0])
        first, _ = _job_with_leases(stores[0], [990.0, 995.0])  # both leases ran out already
        assert a.expire_leases() == 2, "a, the first to ask, leads and returns both lost leases to the queue"
        assert a.sweeps.leading
        second, _ = _job_with_leases(stores[0], [1001.0])
        now[0] = 1005.0
        assert b.expire_leases() == 0 and not b.sweeps.leading, "b swept while a held the sweeps' lease"
        assert [t.status for t in stores[1].jobs.tasks(second)] == ["running"]
        now[0] = 1015.0  # a renews (every quarter TTL) and sweeps
        assert a.expire_leases() == 1 and a.sweeps.leading
        assert LabDuties(stores[1]).holder("sweeps", now=now[0]) == "host-a:50051/1"
        # a dies (kill -9: no hand-over); while its lease lives nobody sweeps, then b takes the lease row over
        stores[0].close()
        third, _ = _job_with_leases(stores[1], [1020.0])
        late, _ = _job_with_leases(stores[1], [10_000.0], deadline_at=1030.0)
        now[0] = 1050.0  # a's lease (until 1055) is still live
        assert b.expire_leases() == 0 and not b.sweeps.leading
        now[0] = 1056.0  # past it; b asked last at 1050, so it asks again after a quarter TTL
        assert b.expire_leases() == 0, "b asked before its quarter TTL was over"
        now[0] = 1061.0
        assert b.expire_leases() == 1 and b.sweeps.leading, "b did not take the sweeps over from the dead leader"
        assert LabDuties(stores[1]).holder("sweeps", now=now[0]) == "host-b:50051/2"
        assert [t.status for t in stores[1].jobs.tasks(third)] == ["pending"]
        assert stores[1].jobs.get(late).status == "canceled", "the new leader did not end a job past its deadline"
        # a controller stopping on purpose hands on at once
        b.sweeps.release()
        assert LabDuties(stores[1]).holder("sweeps", now=now[0]) is None
    finally:
        for store in stores:
            store.close()


def test_migrate_carries_a_labs_presence_leader_and_claims_and_both_schemas_hold_them(pg_url: str,
                                                                                     tmp_path: Path) -> None:
    """Issue 32 item 3: the lab-wide tables are schema migration 19 in both databases and in `farm store migrate`'s
    list, so an SQLite lab moved to PostgreSQL keeps which controller leads and which nightly ticks were done."""
    import sqlite3

    from farm.controller.store import SQLiteStore
    from farm.controller.store.leader import LabDuties
    from farm.controller.store.postgres import PostgresStore
    from farm.controller.store.presence import Presence, Seen
    from farm.controller.store.schema import SCHEMA_VERSION
    from farm.cli.main import main

    path = tmp_path / "farm.db"
    source = SQLiteStore(path)
    Presence(source).publish("host-a:50051", [Seen("rack", "host-a:50051", "online", 1000.0, 990.0, 1, 2)],
                             complete=True)
    duties = LabDuties(source)
    assert duties.hold("sweeps", "host-a:50051/7", 60.0, now=1000.0)
    assert duties.claim("nightly", "2026-11-22T02:30", "host-a:50051/7")
    source.close()
    target_url = pg_url
    assert main(["store", "migrate", "--from", str(path), "--to", target_url]) == 0
    target = PostgresStore(target_url, files_dir=tmp_path / "pg")
    try:
        assert target.schema_version() == SCHEMA_VERSION
        assert Presence(target).fresh(0.0) == [Seen("rack", "host-a:50051", "online", 1000.0, 990.0, 1, 2)]
        moved = LabDuties(target)
        assert moved.holder("sweeps", now=1010.0) == "host-a:50051/7"
        assert not moved.hold("sweeps", "host-b:50051/8", 60.0, now=1010.0), "the leader's lease did not move over"
        assert not moved.claim("nightly", "2026-11-22T02:30", "host-b:50051/8"), "a done nightly tick would run again"
    finally:
        target.close()
    # an SQLite store a controller of the release before gave the tables (CREATE TABLE IF NOT EXISTS) keeps its rows
    older = tmp_path / "older.db"
    SQLiteStore(older).close()
    with sqlite3.connect(older) as conn:
        conn.execute("DROP TABLE lab_leader")
        conn.execute("CREATE TABLE lab_leader (duty TEXT PRIMARY KEY, holder TEXT NOT NULL, "
                     "expires_at DOUBLE PRECISION NOT NULL)")
        conn.execute("INSERT INTO lab_leader VALUES ('sweeps', 'old', 5000.0)")
        conn.execute("UPDATE schema_version SET version = 17")
    upgraded = SQLiteStore(older)
    try:
        assert upgraded.schema_version() == SCHEMA_VERSION
        assert LabDuties(upgraded).holder("sweeps", now=4000.0) == "old"
    finally:
        upgraded.close()


def test_a_postgresql_lab_at_schema_17_keeps_the_lab_wide_rows_a_controller_created_for_itself(
        pg_url: str, tmp_path: Path) -> None:
    """Before migration 19 each controller created the lab-wide and artifact tables itself (IF NOT EXISTS) on a
    database at 17: the upgrade takes them as they are, rows and all."""
    from farm.controller.store.artifacts_db import ArtifactChunks
    from farm.controller.store.leader import LabDuties
    from farm.controller.store.postgres import PostgresStore
    from farm.controller.store.schema import SCHEMA_VERSION

    store = PostgresStore(pg_url, files_dir=tmp_path)
    try:
        assert LabDuties(store).hold("nightly", "old-controller", 60.0, now=100.0)
        data = b"model" * 300
        model = tmp_path / "m.onnx"
        model.write_bytes(data)
        assert ArtifactChunks(store).put(hashlib.sha256(data).hexdigest(), len(data), ".onnx", model)
        # back to a release-17 database (before task_plans, migration 18), which had the lab-wide tables already
        store.execute("DROP TABLE task_plans")
        store.execute("ALTER TABLE tasks DROP COLUMN plan_id")
        store.execute("UPDATE schema_version SET version = 17")
    finally:
        store.close()
    store = PostgresStore(pg_url, files_dir=tmp_path)
    try:
        assert store.schema_version() == SCHEMA_VERSION
        assert LabDuties(store).holder("nightly", now=120.0) == "old-controller"
        assert ArtifactChunks(store).stored(hashlib.sha256(data).hexdigest()) == (len(data), ".onnx")
    finally:
        store.close()


def test_kill_9_of_the_sweep_leader_hands_its_sweeps_to_the_other_controller(pg_url: str, cluster) -> None:
    """Two `farm controller serve` on one database: the one holding the `sweeps` lease is killed with -9 (no
    hand-over), and the other takes lease expiry and job deadlines over once that lease runs out (one --lease-ttl),
    not before. Real processes: what is under test is a process dying."""
    import time

    import psycopg

    from farm.controller.store.postgres import PostgresStore
    from grpc_processes import wait_for

    def rows(sql: str, params: tuple = ()) -> list[tuple]:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            return conn.execute(sql, params).fetchall()

    def leader() -> str | None:
        found = rows("SELECT holder FROM lab_leader WHERE duty = 'sweeps' AND expires_at >= %s", (time.time(),))
        return found[0][0] if found else None

    timing = ("--no-auth", "--lease-ttl", "3", "--heartbeat-interval", "0.5")
    controllers = {}
    for name in ("a", "b"):
        process = cluster.start_controller(*timing, db=pg_url, name=f"controller-{name}",  # type: ignore[arg-type]
                                           env={"XDG_DATA_HOME": str(cluster.root / f"{name}-data")})
        controllers[f"{cluster.address}/{process.process.pid}"] = process
    holder = str(wait_for(leader, 60, "a controller to take the sweeps"))
    victim = controllers.pop(holder)
    (survivor_holder, survivor), = controllers.items()
    victim.kill9()
    (lease_end,), = rows("SELECT expires_at FROM lab_leader WHERE duty = 'sweeps'")
    # work for the sweeps, left by the dead: a lease that ran out, and a job past its deadline
    store = PostgresStore(pg_url, files_dir=cluster.root / "test-data")
    try:
        lost_job, (lost_task,) = _job_with_leases(store, [time.time() - 1.0])
        late_job, _ = _job_with_leases(store, [time.time() + 600.0], deadline_at=time.time() - 1.0)
        wait_for(lambda: store.jobs.get(late_job).status == "canceled", 60, "the survivor to end the late job")
        wait_for(lambda: store.jobs.task(lost_task).status == "pending", 60, "the lost lease to be swept")
        assert leader() == survivor_holder
        assert f"{survivor_holder} takes over the lab-wide sweeps" in survivor.output(), survivor.output()[-3000:]
        [(finished_at, agent, failure, message)] = rows(
            "SELECT finished_at, agent, failure_class, message FROM runs WHERE task_id = %s", (lost_task,))
        assert agent == "rack" and failure == "infrastructure" and "lease expired" in message
        assert finished_at >= lease_end, "the survivor swept while the dead leader's lease was still live"
        assert survivor.alive()
    finally:
        store.close()


def test_a_run_stopped_because_its_lease_ran_out_is_retried_not_canceled(tmp_path: Path, tiny_models) -> None:
    """A path by which a lost controller ended a task at its first attempt, never retried (a candidate for the
    failover benchmark's run-1 task, whose cause was not captured): a controller gone longer than the lease
    leaves it expired but not yet swept; the next controller refuses the late renewal and tells the agent to
    stop, and the agent reports the run canceled. The job was not canceled, so that is infrastructure: retried,
    the cause in the message, not a task ended as canceled."""
    import time

    from farm.controller.scheduling.controller import Controller
    from farm.controller.scheduling.jobfile import load_job_text
    from farm.controller.store import SQLiteStore
    from farm.proto.results import FailureClass, LatencyStats, RunResult, RunStatus

    now = [1000.0]
    job = load_job_text(f"models: [{tiny_models['tflite']}]\nsim: {{on_contention: flag}}\n", "job.yaml", tmp_path)
    controller = Controller(SQLiteStore(tmp_path / "farm.db"), lease_ttl_s=30.0, clock=lambda: now[0])
    job_id = controller.submit(job)
    first = controller.lease("rack", {"sim"}, job_id=job_id)
    assert first is not None and controller.heartbeat(first.task_id, first.attempt)
    now[0] += 31.0  # no renewal for a lease TTL (the agent's controller died; it reached the next one late)
    assert controller.heartbeat(first.task_id, first.attempt) is False  # too late: the agent is told to stop
    controller.complete(first.task_id, first.attempt, "rack", now[0],
                        RunResult.failed(FailureClass.CANCELED, "canceled while running"))
    task = controller.store.jobs.task(first.task_id)
    assert task.status == "pending", "a run stopped for a lost lease ended its task"
    [run] = controller.store.query("SELECT attempt, status, failure_class, message FROM runs")
    assert (run["attempt"], run["status"], run["failure_class"]) == (1, "failed", "infrastructure")
    assert "stopped the run because its lease ran out at" in run["message"] and "canceled while running" in run["message"]
    again = controller.lease("rack", {"sim"}, job_id=job_id)
    assert again is not None and (again.task_id, again.attempt) == (first.task_id, 2)
    latency = LatencyStats(None, None, None, 2.5, 2.5, 2.6, 2.7, 0.1, 2.4, 2.8, 20)
    controller.complete(again.task_id, again.attempt, "rack", time.time(),
                        RunResult(status=RunStatus.COMPLETED, latency=latency, iterations_ms=[2.5] * 20))
    assert controller.store.jobs.get(job_id).status == "completed"
    # a run canceled while its lease is live (Ctrl+C of an embedded run, a canceled job) stays canceled
    second = controller.submit(job)
    live = controller.lease("rack", {"sim"}, job_id=second)
    controller.complete(live.task_id, live.attempt, "rack", now[0], RunResult.failed(FailureClass.CANCELED, "stopped"))
    assert controller.store.jobs.task(live.task_id).status == "canceled"
