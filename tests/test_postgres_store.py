"""The PostgreSQL store beyond the contract (tests/store_contract.py runs that against it): how `--db` opens it,
that a password never reaches a message, several processes leasing from one job, and real controllers on it.

The server is the session's private PostgreSQL (tests/postgres_server.py, via conftest's postgres_peer): skipped
with the reason when Debian's postgresql cannot run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import fresh_postgres_url
from farm.controller.store import StoreError, db_location, open_store, redact_url

pytestmark = pytest.mark.timeout(300)


def test_a_url_is_kept_whole_and_a_file_path_stays_a_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FARM_DB", raising=False)
    assert db_location("postgresql://farm@db.lab:5432/farm") == "postgresql://farm@db.lab:5432/farm"  # no Path: // kept
    assert db_location("lab/farm.db") == Path("lab/farm.db")
    monkeypatch.setenv("FARM_DB", "postgres://farm@db.lab/farm")
    assert db_location(None) == "postgres://farm@db.lab/farm"


def test_the_password_is_taken_out_of_what_is_shown() -> None:
    assert redact_url("postgresql://farm:s3cret@db.lab:5432/farm") == "postgresql://farm:***@db.lab:5432/farm"
    assert redact_url("postgresql://farm@db.lab/farm") == "postgresql://farm@db.lab/farm"
    assert "s3cret" not in redact_url("postgresql://farm:s3cret@db.lab:99999999/farm")  # a port urllib refuses


def test_other_schemes_are_refused_with_what_farm_takes() -> None:
    with pytest.raises(StoreError, match="SQLite file .* or in PostgreSQL") as caught:
        open_store("mysql://root:hunter2@db.lab/farm")
    assert "hunter2" not in str(caught.value)


def test_a_missing_psycopg_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)  # import psycopg fails, as in an install without the extra
    with pytest.raises(StoreError, match=r"farm\[postgresql\]"):
        open_store("postgresql://farm@127.0.0.1:1/farm")


def test_a_server_that_refuses_gets_a_message_without_the_password() -> None:
    pytest.importorskip("psycopg")
    with pytest.raises(StoreError) as caught:
        open_store("postgresql://farm:s3cret-word@127.0.0.1:1/farm?connect_timeout=5")
    message = str(caught.value)
    assert "s3cret-word" not in message and "farm:***@127.0.0.1:1" in message
    assert "Check that the server runs" in message


@pytest.fixture
def pg_url(postgres_peer, request: pytest.FixtureRequest) -> str:
    return fresh_postgres_url(postgres_peer, request.node.name)


def test_two_processes_lease_every_task_of_one_job_exactly_once(pg_url: str, tmp_path: Path) -> None:
    from farm.controller.store.postgres import PostgresStore

    store = PostgresStore(pg_url, files_dir=tmp_path / "files")
    tasks = [{"seq": i, "target": "sim", "model_name": "m", "status": "pending", "attempts": 0, "max_attempts": 3,
              "priority": 1, "spec_json": "{}"} for i in range(200)]
    job_id = store.jobs.insert({"name": "shared", "status": "queued", "priority": "normal", "created_at": time.time(),
                                "spec_json": "{}"}, tasks)
    # Each process: two threads leasing a few tasks per transaction, as a controller's dispatcher does.
    worker = textwrap.dedent(f"""
        import json, sys, threading, time
        from pathlib import Path
        from farm.controller.store.postgres import PostgresStore
        store = PostgresStore({pg_url!r}, files_dir=Path({str(tmp_path / "files")!r}))
        leased, lock = [], threading.Lock()
        def agent(name):
            while True:
                with store.transaction():
                    got = store.leases.next_pending({{"sim"}}, 3)
                    for t in got:
                        store.leases.lease(t.id, t.attempts + 1, name, time.time() + 60)
                        store.leases.start_job(t.job_id, time.time())
                    time.sleep(0.002)  # hold the row locks a moment: the other process must skip them
                if not got:
                    return
                with lock:
                    leased.extend(t.id for t in got)
        threads = [threading.Thread(target=agent, args=(f"{{sys.argv[1]}}-{{i}}",)) for i in range(2)]
        for t in threads: t.start()
        for t in threads: t.join()
        print(json.dumps(leased))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", worker, name], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for name in ("ctl-a", "ctl-b")]
    outputs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outputs]
    by_process = [json.loads(out) for out, _ in outputs]
    every = [task for leased in by_process for task in leased]
    assert sorted(every) == sorted(t.id for t in store.jobs.tasks(job_id)), "a task leased twice or never"
    assert all(by_process), f"one process leased nothing: {[len(x) for x in by_process]}"
    assert store.jobs.task_counts(job_id) == {"running": 200}
    owners = {t.leased_by.split("-")[1] for t in store.jobs.tasks(job_id) if t.leased_by}
    assert owners == {"a", "b"}
    store.close()


# --- real processes: `farm controller serve --db postgresql://...` ------------------------------------------------

@pytest.fixture
def cluster(tmp_path: Path):
    from grpc_processes import Cluster

    c = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(tmp_path / "none.toml"),
                               "XDG_DATA_HOME": str(tmp_path / "data")}, cli_in_process=True)
    yield c
    c.stop_all()


@pytest.fixture
def threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Controllers, agents and `farm` calls on threads of this process, for the tests that kill none of them."""
    from grpc_processes import in_process_cluster

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    c = in_process_cluster(tmp_path, monkeypatch)
    c.env["XDG_DATA_HOME"] = str(tmp_path / "data")
    yield c
    c.stop_all()


def _querier(pg_url: str):
    """rows(sql): a query's rows on a connection of its own (the test's view of the database, not a store's)."""
    import psycopg

    def rows(sql: str) -> list[tuple]:
        with psycopg.connect(pg_url) as conn:
            return conn.execute(sql).fetchall()  # type: ignore[arg-type]
    return rows


def _comparable(records: list[dict]) -> list[tuple]:
    return sorted((r["model"]["name"], r["threads"], r["repeat"], r["target"], r["status"], r["attempts"],
                   r["latency_ms"]["count"]) for r in records)


def test_a_controller_on_postgresql_runs_a_job_and_the_cli_reads_it_back(pg_url: str, cluster, tiny_models) -> None:
    from grpc_processes import wait_for

    os.symlink(tiny_models["onnx"], cluster.root / "tiny.onnx")
    job = cluster.root / "job.yaml"
    job.write_text("name: on-pg\nmodels: [tiny.onnx]\nworkload: {type: benchmark, iterations: 5, warmup: 1}\n"
                   "matrix: {threads: [1, 2]}\nsim: {memory: 512m, on_contention: flag}\n")
    # the peer trusts loopback, so a password in the URL is accepted and must show nowhere
    with_password = pg_url.replace("postgresql://farm@", "postgresql://farm:s3cret-word@")
    controller = cluster.start_controller("--no-auth", db=with_password)  # type: ignore[arg-type]
    assert f"store {pg_url.replace('farm@', 'farm:***@')}" in controller.output()
    agent = cluster.start_agent("rack1")
    wait_for(lambda: "connected to controller" in agent.output(), 60, "the agent to connect")
    remote = cluster.farm("submit", str(job), "--controller", cluster.address, "--json", timeout=240)
    assert remote.returncode == 0, remote.stderr + controller.output()[-3000:]
    records = json.loads(remote.stdout)["results"]
    assert len(records) == 2 and {r["status"] for r in records} == {"completed"}
    # the same database read in embedded mode, as `farm results --db postgresql://...` does
    local = cluster.farm("results", "1", "--format", "json", "--db", pg_url)
    assert local.returncode == 0, local.stderr
    assert _comparable(json.loads(local.stdout)) == _comparable(records)
    jobs = json.loads(cluster.farm("jobs", "--json", "--db", pg_url).stdout)
    assert [(j["id"], j["status"]) for j in jobs] == [(1, "completed")]
    assert "s3cret-word" not in controller.output() + agent.output()


def test_a_cli_command_on_an_unreachable_database_says_so_without_the_password(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("psycopg")
    farm = _farm_without_settings(tmp_path, monkeypatch)

    done = farm("jobs", "--json", "--db", "postgresql://lab:s3cret-word@127.0.0.1:1/farm")
    assert done.returncode != 0
    assert "s3cret-word" not in done.stdout + done.stderr
    assert "postgresql://lab:***@127.0.0.1:1/farm" in done.stdout + done.stderr


def test_two_controllers_on_one_database_share_a_job_and_run_each_task_once(pg_url: str, threads,
                                                                            tiny_models) -> None:
    import psycopg
    from grpc_processes import sleep_job

    job = sleep_job(threads.root, tiny_models["onnx"], tasks=6, seconds=1.0)
    address_a = threads.serve_in_process(db=pg_url).address
    address_b = threads.serve_in_process(db=pg_url).address
    assert address_a != address_b
    threads.address = address_a
    threads.agent_in_process("rack-a")
    threads.address = address_b
    threads.agent_in_process("rack-b")
    submitted = threads.farm("submit", str(job), "--controller", address_a, "--json")
    assert submitted.returncode == 0, submitted.stderr + threads.server_output()[-3000:]
    records = json.loads(submitted.stdout)["results"]
    assert len(records) == 6 and {r["status"] for r in records} == {"completed"}
    with psycopg.connect(pg_url) as conn:
        runs = conn.execute("SELECT task_id, attempt, status, agent FROM runs ORDER BY task_id, attempt").fetchall()
    assert sorted(task for task, *_ in runs) == sorted({task for task, *_ in runs}), f"a task ran twice: {runs}"
    assert len(runs) == 6 and {status for _, _, status, _ in runs} == {"completed"}
    assert {agent for *_, agent in runs} == {"rack-a", "rack-b"}, "the second controller's agent got no task"


# --- `farm store migrate` ------------------------------------------------------------------------------------------

def _farm_without_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **env: str):
    """`farm ARGS` in this process (tests/cli_inprocess.py), in tmp_path, with none of the user's FARM_ settings."""
    from cli_inprocess import run_farm_inprocess

    for key in [k for k in os.environ if k.startswith("FARM_")]:
        monkeypatch.delenv(key)
    return lambda *args: run_farm_inprocess(*args, cwd=tmp_path, env={"FARM_CONFIG": str(tmp_path / "none"), **env})


def test_a_migrated_lab_answers_results_and_calibrations_the_same(pg_url: str, tmp_path: Path, tiny_models,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from farm.controller.store.sqlite import SQLiteStore

    farm = _farm_without_settings(tmp_path, monkeypatch, XDG_DATA_HOME=str(tmp_path / "data"))

    db = tmp_path / "lab" / "farm.db"
    job = tmp_path / "job.yaml"
    job.write_text(f"name: to-move\nmodels: [{tiny_models['onnx']}]\nworkload: {{iterations: 4, warmup: 1}}\n"
                   "matrix: {threads: [1, 2]}\nsim: {backend: process, on_contention: flag}\n")
    submitted = farm("submit", str(job), "--db", str(db), "--create", "--json")
    assert submitted.returncode == 0, submitted.stderr
    # what a lab holds beside its jobs: calibration versions with drift, device health, an upload
    from farm.controller.analysis.calibration import Pair, calibrate

    fitted = calibrate([Pair(f"m{i}", float(i), 3.0 * i + 1.0 + 0.01 * (i % 2)) for i in range(1, 7)])
    lab = SQLiteStore(db)
    run_ids = [r.run_id for r in lab.runs.results(1)]
    calibration = {"device": "phone-1", "metric": "latency", "threads": 1, "runtime": "litert", "precision": "fp32",
                   "batch_size": 1, "input_size": None, "family": "", "created_at": 1.0e9, "kind": "linear", "n": 2,
                   "a": 10.0, "b": 0.5, "r2": 0.99, "loo_mape": 0.05, "within_10": 1.0, "kendall_tau": 1.0,
                   "spearman_rho": 1.0, "warnings_json": "[]", "fit_json": json.dumps(fitted.to_json()), "source": "{}"}
    lab.calibrations.add(calibration, [{"model": "tiny", "sim_run_id": run_ids[0], "device_run_id": run_ids[1]}])
    lab.calibrations.add({**calibration, "r2": 0.9, "created_at": 1.1e9}, [])
    lab.calibrations.add_drift({"device": "phone-1", "metric": "latency", "threads": 1, "calibration_id": 2,
                                "previous_id": 1, "prediction_shift": 0.2, "exceeded": 1, "reasons": "moved",
                                "created_at": 1.1e9})
    lab.devices.set_health("phone-1", "bad", "too hot", 5.0)
    lab.artifacts.record_upload("a" * 64, "tok", 123, 1.0)
    lab.close()

    moved = farm("store", "migrate", "--from", str(db), "--to", pg_url, "--json")
    assert moved.returncode == 0, moved.stderr
    answer = json.loads(moved.stdout)
    assert answer["rows"]["jobs"] == 1 and answer["rows"]["tasks"] == 2 and answer["rows"]["runs"] == 2
    assert answer["rows"]["calibrations"] == 2 and answer["rows"]["calibration_drift"] == 1
    assert answer["rows"]["run_samples"] == 2 and answer["rows"]["artifact_uploads"] == 1

    for command in (["results", "1", "--format", "json"], ["results", "1", "--format", "csv"], ["jobs", "--json"],
                    ["calibrations", "--json"], ["status", "1", "--json"]):
        before, after = farm(*command, "--db", str(db)), farm(*command, "--db", pg_url)
        assert before.returncode == 0 and after.returncode == 0, before.stderr + after.stderr
        assert after.stdout == before.stdout, f"`farm {' '.join(command)}` answers differently after the move"
        assert "phone-1" in after.stdout if command[0] == "calibrations" else "to-move" in after.stdout or \
            command[0] == "results" and "completed" in after.stdout
    from farm.controller.store.postgres import PostgresStore
    moved_store = PostgresStore(pg_url, files_dir=tmp_path / "files")
    assert moved_store.runs.iterations(run_ids[0]) and moved_store.jobs.task_counts(1) == {"completed": 2}
    assert moved_store.artifacts.upload_usage("tok") == 123 and moved_store.devices.health()[0].health == "bad"
    moved_store.close()

    # the moved lab goes on: the next job is job 2, not a clash with the ids copied
    again = farm("submit", str(job), "--db", pg_url, "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["job"] == 2

    # into a database that holds a lab: refused, nothing overwritten
    refused = farm("store", "migrate", "--from", str(db), "--to", pg_url)
    assert refused.returncode == 2 and "already holds a lab" in refused.stderr


def test_migrate_refuses_what_it_cannot_move(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cli = _farm_without_settings(tmp_path, monkeypatch)

    def farm(*args: str):
        return cli("store", "migrate", *args)

    (tmp_path / "farm.db").write_bytes(b"")
    for args, why in ((["--from", "nope.db", "--to", "postgresql://x@127.0.0.1:1/y"], "no such file"),
                      (["--from", "farm.db", "--to", "sqlite:///other.db"], "give the PostgreSQL database"),
                      (["--from", "postgresql://u:pw-secret@h/d", "--to", "postgresql://x@h/y"], "give the SQLite file"),
                      (["--from", "farm.db", "--to", "mysql://u:pw-secret@h/d"], "give the PostgreSQL database")):
        done = farm(*args)
        assert done.returncode == 2 and why in done.stderr, done.stderr
        assert "pw-secret" not in done.stderr


def test_a_connection_the_server_dropped_is_replaced_and_the_next_call_works(pg_url: str, tmp_path: Path) -> None:
    import psycopg

    from farm.controller.store.postgres import PostgresStore

    store = PostgresStore(pg_url, files_dir=tmp_path)
    job = {"name": "j", "status": "queued", "priority": "normal", "created_at": 1.0, "spec_json": "{}"}
    store.jobs.insert(job, [])
    assert store.reads.job_count() == 1  # a reader connection is pooled

    def kill_all(admin: psycopg.Connection) -> None:  # what a server restart does to every session, then gone
        pids = [r[0] for r in admin.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                                            "AND pid <> pg_backend_pid()")]
        admin.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", [pids])
        deadline = time.monotonic() + 30
        while admin.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE pid = ANY(%s)", [pids]).fetchone()[0]:
            assert time.monotonic() < deadline, "the killed backends did not end"
            time.sleep(0.05)

    with psycopg.connect(pg_url, autocommit=True) as admin:
        kill_all(admin)
        # idle connections the server dropped are seen before use (its goodbye waits on the socket): both work
        assert store.jobs.insert(job, []) == 2
        assert store.reads.job_count() == 2
        # a connection dropped under a transaction fails that call, writing nothing; the next call works
        with pytest.raises(psycopg.OperationalError):
            with store.transaction():
                store.execute("SELECT 1")
                kill_all(admin)
                store.execute("SELECT 1")
    assert store.jobs.insert(job, []) == 3
    assert [j.id for j in store.jobs.listing(10)] == [3, 2, 1]
    store.close()


def test_one_of_two_controllers_killed_mid_job_loses_nothing_and_runs_nothing_twice(pg_url: str, cluster,
                                                                                    tiny_models) -> None:
    from grpc_processes import sleep_job, wait_for

    rows = _querier(pg_url)

    job = sleep_job(cluster.root, tiny_models["onnx"], tasks=6, seconds=1.5)
    timing = ("--lease-ttl", "3", "--heartbeat-interval", "0.5")
    cluster.start_controller("--no-auth", *timing, db=pg_url, name="controller-a")  # type: ignore[arg-type]
    address_a = cluster.address
    victim = cluster.start_controller("--no-auth", *timing, db=pg_url, name="controller-b")  # type: ignore[arg-type]
    left = cluster.start_agent("left")  # on controller b: cluster.address is the last one started
    cluster.address = address_a
    right = cluster.start_agent("right")
    for agent in (left, right):
        wait_for(lambda: "connected to controller" in agent.output(), 60, f"{agent.name} to connect")
    assert cluster.farm("submit", str(job), "--controller", address_a, "--detach").returncode == 0

    wait_for(lambda: rows("SELECT id FROM tasks WHERE status = 'running' AND leased_by = 'left'"), 60,
             "a task running through the controller that dies")
    victim.kill9()  # its agent keeps its task and knocks on a dead door; the lease runs out on the survivor

    def finished() -> object:
        status = json.loads(cluster.farm("status", "1", "--json", "--controller", address_a).stdout)
        return status["status"] in ("completed", "failed") and status
    status = wait_for(finished, 120, "the job to finish through the surviving controller", interval=0.5)
    assert status["status"] == "completed" and status["completed"] == 6  # type: ignore[index]
    runs: dict[int, list[tuple]] = {}
    for task_id, attempt, run_status, agent, failure in rows(
            "SELECT task_id, attempt, status, agent, failure_class FROM runs ORDER BY task_id, attempt"):
        runs.setdefault(task_id, []).append((attempt, run_status, agent, failure))
    assert len(runs) == 6
    for task_runs in runs.values():
        completed = [r for r in task_runs if r[1] == "completed"]
        assert len(completed) == 1, f"a task counted twice or never: {task_runs}"
        assert all(r[3] == "infrastructure" and r[2] == "left" for r in task_runs if r[1] != "completed")
    assert any(len(r) > 1 for r in runs.values()), "the dead controller's task was never taken over"
    assert rows("SELECT status, COUNT(*) FROM tasks GROUP BY status") == [("completed", 6)]
    left.kill9()


def test_a_database_holding_someone_elses_tables_is_refused_untouched(pg_url: str, tmp_path: Path) -> None:
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE jobs (id int, payroll text)")
    with pytest.raises(StoreError, match=r"not empty and not a farm store \(it has tables such as jobs\)"):
        open_store(pg_url)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        tables = [r[0] for r in conn.execute("SELECT table_name FROM information_schema.tables "
                                             "WHERE table_schema = 'public'")]
    assert tables == ["jobs"]


def test_a_hostile_database_name_stays_one_folder_under_the_data_folder(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from farm.controller.store.postgres import default_files_dir

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    for url in ("postgresql://u@h/../../../etc", "postgresql://u@h/%2e%2e", "postgresql://u@h/" + "x" * 5000,
                "postgresql://u@[::1]:5/a/b\n\x1b[31m"):
        folder = default_files_dir(url)
        assert folder.parent == tmp_path / "farm" / "postgresql" and "/" not in folder.name and len(folder.name) <= 120
        assert folder.name not in (".", "..") and "\n" not in folder.name and "\x1b" not in folder.name


def test_work_queued_through_one_store_wakes_the_others(pg_url: str, tmp_path: Path) -> None:
    import threading

    from farm.controller.store.postgres import PostgresStore

    submitter = PostgresStore(pg_url, files_dir=tmp_path / "a")
    listener = PostgresStore(pg_url, files_dir=tmp_path / "b")
    woken = threading.Event()
    listener.on_queue_change(woken.set)
    assert woken.wait(30)  # the first wake-up says: look, something may have queued before I listened
    woken.clear()
    job = {"name": "j", "status": "queued", "priority": "normal", "created_at": 1.0, "spec_json": "{}"}
    task = {"seq": 0, "target": "sim", "status": "pending", "attempts": 0, "max_attempts": 1, "priority": 1}
    submitter.jobs.insert(job, [])  # no task: nothing to lease, no wake-up
    submitter.devices.record_agent({"name": "agent-1"}, [])
    assert not woken.wait(2)
    job_id = submitter.jobs.insert(job, [task])
    assert woken.wait(30), "a job with a pending task woke nobody"
    woken.clear()
    with submitter.transaction():  # leasing it makes nothing leasable
        (leased,) = submitter.leases.next_pending({"sim"}, 1)
        submitter.leases.lease(leased.id, 1, "agent-1", time.time() + 60)
    assert not woken.wait(2)
    submitter.devices.set_health("phone-1", "good", "released", time.time())  # a released device may take work
    assert woken.wait(30)
    woken.clear()
    submitter.jobs.update_task(leased.id, status="pending")  # back in the queue
    assert woken.wait(30)
    assert submitter.jobs.task_counts(job_id) == {"pending": 1}
    listener.close()  # the listener ends with its store
    assert not any(t.name == "farm-pg-listen" and t.is_alive() for t in threading.enumerate())
    submitter.close()


def test_many_reading_threads_share_a_few_connections(pg_url: str, tmp_path: Path) -> None:
    import threading

    import psycopg

    from farm.controller.store.postgres import MAX_READERS, PostgresStore

    store = PostgresStore(pg_url, files_dir=tmp_path)
    store.jobs.insert({"name": "j", "status": "queued", "priority": "normal", "created_at": 1.0}, [])
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            for _ in range(5):
                assert store.reads.job_count() == 1
        except BaseException as e:  # noqa: BLE001  reported below
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(60)]  # a controller's agent threads
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    with psycopg.connect(pg_url) as conn:
        (count,) = conn.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = 'farm' "
                                "AND datname = current_database()").fetchone() or (0,)
    assert count <= MAX_READERS + 1  # the readers and the writing connection
    store.close()


def test_a_controller_on_postgresql_killed_mid_job_comes_back_and_the_agents_finish(pg_url: str, cluster,
                                                                                   tiny_models) -> None:
    from grpc_processes import sleep_job, wait_for

    rows = _querier(pg_url)

    job = sleep_job(cluster.root, tiny_models["onnx"], tasks=6, seconds=1.0)
    timing = ("--lease-ttl", "20", "--heartbeat-interval", "0.5")
    controller = cluster.start_controller("--no-auth", *timing, db=pg_url)  # type: ignore[arg-type]
    port = int(str(cluster.address).rsplit(":", 1)[1])
    agents = [cluster.start_agent(name) for name in ("left", "right")]
    for agent in agents:
        wait_for(lambda: "connected to controller" in agent.output(), 60, f"{agent.name} to connect")
    assert cluster.farm("submit", str(job), "--controller", cluster.address, "--detach").returncode == 0
    wait_for(lambda: rows("SELECT COUNT(*) FROM runs")[0][0] >= 1
             and rows("SELECT COUNT(*) FROM tasks WHERE status = 'running'")[0][0] >= 1, 60,
             "one finished and one running task")
    controller.kill9()  # its open transactions die with its connections; the server rolls them back
    cluster.start_controller("--no-auth", *timing, port=port, db=pg_url, name="controller-again")  # type: ignore[arg-type]

    def finished() -> object:
        status = json.loads(cluster.farm("status", "1", "--json", "--controller", cluster.address).stdout)
        return status["status"] in ("completed", "failed") and status
    status = wait_for(finished, 120, "the job to finish", interval=0.5)
    assert status["status"] == "completed" and status["completed"] == 6  # type: ignore[index]
    runs = rows("SELECT task_id, attempt, status FROM runs ORDER BY task_id, attempt")
    # nothing lost, nothing twice: one completed run per task (runs in flight were delivered after the restart)
    assert len(runs) == 6 and {status for *_, status in runs} == {"completed"}
    assert len({task for task, *_ in runs}) == 6
    for agent in agents:
        assert "reconnecting" in agent.output() and agent.output().count("connected to controller") >= 2
        assert agent.stop() == 0


def test_an_agent_given_two_controllers_moves_to_the_other_when_its_own_is_killed(pg_url: str, cluster,
                                                                                  tiny_models) -> None:
    import psutil
    from grpc_processes import sleep_job, wait_for

    rows = _querier(pg_url)

    job = sleep_job(cluster.root, tiny_models["onnx"], tasks=6, seconds=1.5)
    timing = ("--lease-ttl", "20", "--heartbeat-interval", "0.5")  # long enough for the agent to move in time
    victim = cluster.start_controller("--no-auth", *timing, db=pg_url, name="controller-a")  # type: ignore[arg-type]
    address_a = cluster.address
    cluster.start_controller("--no-auth", *timing, db=pg_url, name="controller-b")  # type: ignore[arg-type]
    address_b = cluster.address
    cluster.address = f"{address_a},{address_b}"  # `farm agent --controller a,b`: it connects to a, the first
    agent = cluster.start_agent("rack", "--sim-slots", "2")
    wait_for(lambda: f"connected to controller {address_a}" in agent.output(), 60, "the agent to connect to a")
    assert cluster.farm("submit", str(job), "--controller", address_b, "--detach").returncode == 0

    def running_in_the_agent() -> object:
        """The tasks leased through a, once the agent runs one of them: a lease alone may still be an offer on its
        way, which a's death loses (recorded as a lost attempt, rightly never delivered to b)."""
        leased = rows("SELECT id, attempts FROM tasks WHERE status = 'running'")
        try:
            started = any("slow.py" in " ".join(p.cmdline()) for p in psutil.Process(agent.process.pid).children(True))
        except psutil.Error:
            started = False
        return started and leased
    in_flight = wait_for(running_in_the_agent, 60, "a task running in the agent through controller a")
    victim.kill9()
    wait_for(lambda: f"connected to controller {address_b}" in agent.output(), 60, "the agent to move to b")

    def finished() -> object:
        status = json.loads(cluster.farm("status", "1", "--json", "--controller", address_b).stdout)
        return status["status"] in ("completed", "failed") and status
    status = wait_for(finished, 120, "the job to finish through controller b", interval=0.5)
    assert status["status"] == "completed" and status["completed"] == 6, agent.output()[-3000:]  # type: ignore[index]
    runs: dict[int, list[tuple]] = {}
    for task_id, attempt, run_status, failure in rows(
            "SELECT task_id, attempt, status, failure_class FROM runs ORDER BY task_id, attempt"):
        runs.setdefault(task_id, []).append((attempt, run_status, failure))
    assert len(runs) == 6
    for task_runs in runs.values():
        assert len([r for r in task_runs if r[1] == "completed"]) == 1, f"a task counted twice or never: {task_runs}"
        # an offer lost with a's stream is recorded as a lost attempt, never run twice
        assert all(r[2] == "infrastructure" for r in task_runs if r[1] != "completed")
    # what ran when a died was delivered to b under its first lease: the agent kept running it
    delivered = [(task, attempt) for task, attempt in in_flight  # type: ignore[union-attr]
                 if (attempt, "completed", None) in runs[task]]
    assert delivered, f"no task in flight at the kill was delivered to b: {in_flight} {runs}"
    assert rows("SELECT status, COUNT(*) FROM tasks GROUP BY status") == [("completed", 6)]
    assert agent.stop() == 0


def test_a_controller_starting_beside_another_leaves_its_agents_online(pg_url: str, threads) -> None:
    import psycopg
    from farm.agents.link.remote_controller import AgentDevice, RemoteController
    from grpc_processes import wait_for

    def states() -> dict[str, str]:
        with psycopg.connect(pg_url) as conn:
            return dict(conn.execute("SELECT name, state FROM agents UNION ALL SELECT name, state FROM devices"
                                     ).fetchall())  # type: ignore[arg-type]

    threads.serve_in_process(db=pg_url)
    agent = RemoteController(threads.address, name="rack-a", token=None,
                             devices=[AgentDevice("rack-a/sim", "sim", "sim")]).start()
    try:
        wait_for(agent.connected.is_set, 60, "rack-a to connect to controller a")
        assert states() == {"rack-a": "online", "rack-a/sim": "online"}
        threads.serve_in_process(db=pg_url)  # controller b
        assert states() == {"rack-a": "online", "rack-a/sim": "online"}, "b marked a's connected agent offline"
        time.sleep(1.0)  # and a's keep-alive holds it there (b's sweep only takes what no controller sees)
        assert states() == {"rack-a": "online", "rack-a/sim": "online"}
    finally:
        agent.close()


def test_a_device_registered_through_one_controller_is_refused_as_taken_by_the_other(pg_url: str, threads) -> None:
    from farm.agents.link.remote_controller import AgentDevice, RemoteController
    from grpc_processes import wait_for

    address_a = threads.serve_in_process(db=pg_url).address
    threads.serve_in_process(db=pg_url)  # controller b, started before the phone is known
    phone = AgentDevice("phone-1", "android", "pixel")
    owner = RemoteController(address_a, name="rack-a", token=None, devices=[phone]).start()
    thief = None
    try:
        wait_for(owner.connected.is_set, 60, "rack-a to register phone-1 through controller a")
        thief = RemoteController(threads.address, name="rack-b", token=None, devices=[phone]).start()
        wait_for(lambda: thief.fatal is not None or thief.connected.is_set(), 60, "controller b to answer rack-b")
        assert thief.fatal is not None, "controller b let a second agent register phone-1"
        assert "device 'phone-1' belongs to agent 'rack-a'" in str(thief.fatal)
    finally:
        owner.close()
        if thief is not None:
            thief.close()


def test_a_database_at_schema_17_moves_each_jobs_plans_to_task_plans_in_place(pg_url: str, tmp_path: Path) -> None:
    """Schema 18 (issue 35): a PostgreSQL store written before it keeps every task's plan, now stored once per job."""
    import psycopg

    from farm.controller.store.postgres import PostgresStore
    from farm.controller.store.schema import SCHEMA_VERSION

    store = PostgresStore(pg_url, files_dir=tmp_path / "files")
    store.close()
    own, twin = '{"sim": {"cpus": 1.0}}', '{"sim": {"cpus": 0.5}}'
    with psycopg.connect(pg_url, autocommit=True) as conn:  # back to schema 17's tables, tasks carrying their plans
        conn.execute("DROP TABLE task_plans")
        conn.execute("ALTER TABLE tasks DROP COLUMN plan_id")
        conn.execute("UPDATE schema_version SET version = 17")
        found = conn.execute("INSERT INTO jobs (name, status, priority, created_at) VALUES ('old', 'queued', 'normal', 1) "
                             "RETURNING id").fetchone()
        assert found is not None
        old = int(found[0])
        for seq, plan in enumerate([own, twin, own]):
            conn.execute("INSERT INTO tasks (job_id, seq, target, model_name, status, attempts, max_attempts, priority, "
                         "spec_json) VALUES (%s, %s, 'sim', 'm', 'pending', 0, 3, 1, %s)", [old, seq, plan])
    store = PostgresStore(pg_url, files_dir=tmp_path / "files")
    try:
        assert store.schema_version() == SCHEMA_VERSION  # 17 -> 18 (plans) -> 19 (lab-wide tables)
        tasks = store.jobs.tasks(old)
        assert [t.spec_json for t in tasks] == [own, twin, own]
        assert tasks[0].plan_id == tasks[2].plan_id != tasks[1].plan_id
        assert store.query("SELECT COUNT(*) AS n FROM tasks WHERE spec_json IS NOT NULL")[0]["n"] == 0
        assert store.query("SELECT COUNT(*) AS n FROM task_plans")[0]["n"] == 2
        # a new job after the upgrade numbers its plans past the moved ones
        second = store.jobs.insert({"name": "new", "status": "queued", "priority": "normal", "created_at": 2.0},
                                   [{"seq": 0, "target": "sim", "model_name": "m", "status": "pending", "attempts": 0,
                                     "max_attempts": 3, "priority": 1, "spec_json": twin}])
        assert [t.spec_json for t in store.jobs.tasks(second)] == [twin]
    finally:
        store.close()


def test_a_database_at_schema_19_moves_each_jobs_model_facts_in_place(pg_url: str, tmp_path: Path) -> None:
    """Schema 20 (issue 35): a PostgreSQL store written before it keeps every task's model facts, now stored once per
    job; the upgrade holds when replayed on a database set back to 19."""
    import psycopg

    from farm.controller.store.postgres import PostgresStore
    from farm.controller.store.schema import SCHEMA_VERSION

    store = PostgresStore(pg_url, files_dir=tmp_path / "files")
    store.close()
    big, small = '{"macs": 300774272, "op_types": {"Conv": 52}}', '{"macs": 1000}'
    with psycopg.connect(pg_url, autocommit=True) as conn:  # back to schema 19's tables, tasks carrying their facts
        conn.execute("DROP TABLE model_facts")
        conn.execute("ALTER TABLE tasks DROP COLUMN facts_id")
        conn.execute("UPDATE schema_version SET version = 19")
        found = conn.execute("INSERT INTO jobs (name, status, priority, created_at) VALUES ('old', 'queued', 'normal', 1) "
                             "RETURNING id").fetchone()
        assert found is not None
        old = int(found[0])
        for seq, facts in enumerate([big, small, big]):
            conn.execute("INSERT INTO tasks (job_id, seq, target, model_name, status, attempts, max_attempts, priority, "
                         "model_facts_json) VALUES (%s, %s, 'sim', 'm', 'pending', 0, 3, 1, %s)", [old, seq, facts])
    for replayed in (False, True):
        if replayed:
            with psycopg.connect(pg_url, autocommit=True) as conn:
                conn.execute("UPDATE schema_version SET version = 19")
        store = PostgresStore(pg_url, files_dir=tmp_path / "files")
        try:
            assert store.schema_version() == SCHEMA_VERSION  # 19 -> 20
            tasks = store.jobs.tasks(old)
            assert [t.model_facts_json for t in tasks] == [big, small, big]
            assert tasks[0].facts_id == tasks[2].facts_id != tasks[1].facts_id
            assert store.query("SELECT COUNT(*) AS n FROM tasks WHERE model_facts_json IS NOT NULL")[0]["n"] == 0
            assert store.query("SELECT COUNT(*) AS n FROM model_facts WHERE job_id = %s", [old])[0]["n"] == 2
            if not replayed:  # a new job after the upgrade numbers its facts past the moved ones
                second = store.jobs.insert(
                    {"name": "new", "status": "queued", "priority": "normal", "created_at": 2.0},
                    [{"seq": 0, "target": "sim", "model_name": "m", "status": "pending", "attempts": 0,
                      "max_attempts": 3, "priority": 1, "model_facts_json": small}])
                assert [t.model_facts_json for t in store.jobs.tasks(second)] == [small]
        finally:
            store.close()


def test_a_database_without_a_declared_figures_column_gains_it_on_opening(pg_url: str, tmp_path: Path) -> None:
    """A run figure declared after a database was written (proto/results.py, `figure(...)`) becomes its summaries
    column when a controller opens it, with no schema version of its own; the runs already stored read it as None."""
    import psycopg

    from farm.controller.store.postgres import PostgresStore
    from farm.controller.store.schema import SCHEMA_VERSION
    from farm.proto.results import FIGURES

    PostgresStore(pg_url, files_dir=tmp_path / "files").close()
    with psycopg.connect(pg_url, autocommit=True) as conn:  # as a farm before the figures wrote it
        for f in FIGURES:
            conn.execute(f"ALTER TABLE summaries DROP COLUMN {f.name}")
        conn.execute("INSERT INTO runs (id) VALUES (1)")
        conn.execute("INSERT INTO summaries (run_id, latency_avg_ms) VALUES (1, 2.5)")
    store = PostgresStore(pg_url, files_dir=tmp_path / "files")
    try:
        assert store.schema_version() == SCHEMA_VERSION
        columns = {r["column_name"] for r in store.query(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'summaries'")}
        assert {f.name for f in FIGURES} <= columns
        row = store.query("SELECT * FROM summaries WHERE run_id = 1")[0]
        assert row["latency_avg_ms"] == 2.5 and all(row[f.name] is None for f in FIGURES)
    finally:
        store.close()
