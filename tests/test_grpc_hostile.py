"""A hostile agent and a hostile client against a real controller on loopback, with tokens on.

Each test starts from what an attacker holding one token does with the generated stubs (forge a
result, hijack a heartbeat, take a device name, send a result too large or unreadable, print
escape codes, open streams without end) and checks three things: the attempt is refused or
contained with a message a person can act on, the controller keeps serving, and nothing already
stored has changed.

The tests that neither kill nor reconfigure the controller share one (`shared_lab`, module-scoped, issue 34), on
threads of this process (farm.client.compose): each test's `lab` cancels every job left unfinished, moves the
controller's clock past the lease TTL so the leases left running run out at once, and forgets the devices
registered, so the next test leases only its own tasks and may take any name; assertions on what is stored name
the test's own tasks. What the controller logs is read from its loggers (Cluster.server_output), and the `farm`
commands run in this process (tests/cli_inprocess.py). The two tests that fill a controller's streams or flood its
agent each start their own, on threads too; only the start-up refusals run `farm controller serve` as a process.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import stat
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from farm.controller.auth import is_loopback
from farm.controller.grpc_server import startup_warnings
from farm.controller.store import SQLiteStore as Store
from farm.controller.store.samples import unpack_iterations
from farm.proto.generated import agent_pb2, common_pb2, farm_pb2, farm_pb2_grpc
from farm.proto.results import LatencyStats, RunResult, RunStatus
from farm.proto.wire import MAX_RESULT_BYTES, MAX_SAMPLES, result_for_the_wire, result_to_message
from grpc_processes import Cluster, OffsetClock, in_process_cluster, wait_for
from raw_agent import RawAgent, bearer as _bearer

pytestmark = pytest.mark.timeout(240)

CLIENT = "client-0123456789abcdef"
CLIENT2 = "client2-0123456789abcdef"
ADMIN = "admin-0123456789abcdef"
A1 = "agent-a1-0123456789abcdef"
A2 = "agent-a2-0123456789abcdef"


def _ok(iterations: int = 3) -> RunResult:
    return RunResult(status=RunStatus.COMPLETED, iterations_ms=[1.0] * iterations,
                     latency=LatencyStats(None, None, None, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, iterations))


@pytest.fixture(scope="module")
def shared_lab(tmp_path_factory: pytest.TempPathFactory, tiny_models):
    root = tmp_path_factory.mktemp("hostile-lab")
    tokens = root / "tokens"
    tokens.write_text(f"client {CLIENT}\nclient {CLIENT2}\nadmin {ADMIN}\nagent {A1} a1\nagent {A2} a2\n")
    tokens.chmod(0o600)
    os.symlink(tiny_models["onnx"], root / "tiny.onnx")
    cluster = Cluster(root, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(root / "none")},
                      cli_in_process=True)
    clock = OffsetClock()
    cluster.serve_in_process(tokens=tokens, lease_ttl_s=3, max_watches=3, reflection=True, clock=clock)
    cluster.clock = clock  # type: ignore[attr-defined]  # the tests move it past the lease TTL
    yield cluster
    cluster.stop_all()


@pytest.fixture
def lab(shared_lab: Cluster):
    """The shared controller, left as a fresh one would be for the next test: no job open, no lease running,
    no device name held (whichever order the tests run in)."""
    yield shared_lab
    with grpc.insecure_channel(shared_lab.address) as channel:
        stub = farm_pb2_grpc.FarmServiceStub(channel)
        for job in stub.ListJobs(farm_pb2.ListJobsRequest(), metadata=_bearer(ADMIN), timeout=20).jobs:
            stub.CancelJob(farm_pb2.JobRequest(job_id=job.id), metadata=_bearer(ADMIN), timeout=20)

        shared_lab.clock.offset += 4  # past the TTL (3 s): a closed agent's leases run out at the next sweep
        shared_lab.servers[0].farm.wake()

        def settled() -> bool:  # its devices go offline as its stream closes
            with shared_lab.db() as db:
                running = db.execute("SELECT COUNT(*) FROM tasks WHERE status = 'running'").fetchone()[0]
            devices = stub.ListDevices(farm_pb2.ListDevicesRequest(), metadata=_bearer(ADMIN), timeout=20).devices
            return running == 0 and all(d.state == "offline" for d in devices)

        wait_for(settled, 60, "the test's closed agents to go offline and their leases to run out", interval=0.2)
        for device in stub.ListDevices(farm_pb2.ListDevicesRequest(), metadata=_bearer(ADMIN), timeout=20).devices:
            stub.ForgetDevice(farm_pb2.ForgetDeviceRequest(name=device.name), metadata=_bearer(ADMIN), timeout=20)


def _submit(cluster: Cluster, repeats: int = 2, name: str = "job.yaml") -> int:
    (cluster.root / name).write_text(f"models: [tiny.onnx]\nrepeats: {repeats}\nsim: {{backend: process}}\n")
    run = cluster.farm("submit", str(cluster.root / name), "--controller", cluster.address, "--token", CLIENT,
                       "--detach", "--json")
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)["job"]


def _stored(cluster: Cluster) -> tuple[list, list]:
    """Runs and tasks as stored: what no refused message may change."""
    with cluster.db() as db:
        return (db.execute("SELECT * FROM runs ORDER BY id").fetchall(),
                db.execute("SELECT id, status, attempts, leased_by, failure_class FROM tasks ORDER BY id").fetchall())


def _still_serving(cluster: Cluster) -> None:
    with grpc.insecure_channel(cluster.address) as channel:
        jobs = farm_pb2_grpc.FarmServiceStub(channel).ListJobs(farm_pb2.ListJobsRequest(), metadata=_bearer(CLIENT),
                                                                timeout=20)
    assert jobs.jobs is not None


# --- attacks 3 and 4: results and heartbeats count only from the lease holder ------------------
def test_a_forged_result_is_refused_and_the_real_agents_result_still_counts(lab: Cluster) -> None:
    job = _submit(lab, repeats=2)
    real = RawAgent(lab.address, "a1", A1)
    forger = RawAgent(lab.address, "a2", A2)
    try:
        real.expect("welcome"), forger.expect("welcome")
        task = real.lease()
        before = _stored(lab)
        stolen = forger.result(task.task_id, task.attempt, _ok())
        assert not stolen.applied and "is not leased to agent a2" in stolen.note and "Do not resend" in stolen.note
        never_leased = forger.result(task.task_id + 1, 1, _ok())
        assert not never_leased.applied and "pending" in never_leased.note
        assert "there is no task 999" in forger.result(999, 1, _ok()).note
        assert _stored(lab) == before  # nothing changed: no run, the lease still a1's
        # the real agent's result is applied after the forger tried
        ack = real.result(task.task_id, task.attempt, _ok())
        assert ack.applied and ack.run_id > 0
    finally:
        real.close(), forger.close()
    with lab.db() as db:  # the job's one run: the real agent's
        assert db.execute("SELECT agent, status FROM runs WHERE task_id IN (SELECT id FROM tasks WHERE job_id = ?)",
                          [job]).fetchall() == [("a1", "completed")]
    log = lab.server_output()
    assert f"agent a2: result for task {task.task_id} attempt {task.attempt} refused" in log
    _still_serving(lab)


def test_a_heartbeat_for_another_agents_task_does_not_keep_its_lease(lab: Cluster) -> None:
    _submit(lab, repeats=1)
    victim = RawAgent(lab.address, "a1", A1)
    victim.expect("welcome")
    task = victim.lease()
    victim.close()  # a1 dies with the task
    hijacker = RawAgent(lab.address, "a2", A2)
    try:
        hijacker.expect("welcome")
        ref = common_pb2.TaskRef(task_id=task.task_id, attempt=task.attempt)
        hijacker.send(heartbeat=agent_pb2.Heartbeat(running=[ref]))
        assert "holds no lease" in hijacker.expect("cancel").cancel.reason

        def lost() -> bool:
            hijacker.send(heartbeat=agent_pb2.Heartbeat(running=[ref]))  # on and on, faster than the TTL
            lab.clock.offset += 1  # the controller's time runs on; a heartbeat that renewed would keep up with it
            with lab.db() as db:
                return bool(db.execute("SELECT 1 FROM runs WHERE task_id = ?", [task.task_id]).fetchone())

        wait_for(lost, 60, "a1's lease to run out despite a2's heartbeats", interval=0.3)
    finally:
        hijacker.close()
    with lab.db() as db:
        run = db.execute("SELECT attempt, status, failure_class, message, agent FROM runs WHERE task_id = ?",
                         [task.task_id]).fetchone()
        assert run == (1, "failed", "infrastructure", "lease expired on agent a1: it stopped renewing the lease", "a1")
        assert db.execute("SELECT status, leased_by FROM tasks WHERE id = ?", [task.task_id]).fetchone() == ("pending", None)
    assert "agent a2 heartbeat for 1 task attempt(s) not leased to its session" in lab.server_output()


def test_an_agent_cannot_ask_for_the_tasks_of_another_agents_device(lab: Cluster) -> None:
    owner = RawAgent(lab.address, "a1", A1, devices=["phone1"])
    intruder = RawAgent(lab.address, "a2", A2)
    try:
        owner.expect("welcome"), intruder.expect("welcome")
        (lab.root / "phone.yaml").write_text("models: [tiny.onnx]\ntargets: [phone1]\n")
        run = lab.farm("submit", str(lab.root / "phone.yaml"), "--controller", lab.address, "--token", CLIENT,
                       "--detach")
        assert run.returncode == 0, run.stderr
        intruder.send(work_request=agent_pb2.WorkRequest(request_id=1, targets=["phone1"]))
        wait_for(lambda: "agent a2 asked for work on phone1, which it did not register; ignored"
                 in lab.server_output(), 30, "the refusal in the log")
        assert intruder.lease(request_id=2, target="sim").target == "sim"  # its own kind of work still comes
        assert owner.lease(request_id=1, target="phone1").target == "phone1"  # the phone's task waited for its owner
        assert intruder.inbox.empty()
    finally:
        owner.close(), intruder.close()


# --- attack 11: a device name belongs to its agent until an admin frees it ---------------------
def test_a_device_name_stays_with_its_agent_until_an_admin_forgets_it(lab: Cluster) -> None:
    first = RawAgent(lab.address, "a1", A1, devices=["phone1"])
    first.expect("welcome")
    taken = lab.farm("device", "forget", "phone1", "--controller", lab.address, "--token", ADMIN)
    assert taken.returncode == 2 and "which is connected" in taken.stderr, taken.stderr
    first.close()
    wait_for(lambda: '"state": "offline"' in lab.farm("devices", "--json", "--controller", lab.address,
                                                       "--token", CLIENT).stdout, 30, "a1 to be offline")
    thief = RawAgent(lab.address, "a2", A2, devices=["phone1"])
    thief.ended.wait(30)
    assert thief.error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "belongs to agent 'a1' (offline)" in thief.error.details()
    assert "farm device forget phone1 --controller" in thief.error.details()
    thief.close()

    not_admin = lab.farm("device", "forget", "phone1", "--controller", lab.address, "--token", CLIENT)
    assert not_admin.returncode == 2 and "needs an admin token" in not_admin.stderr, not_admin.stderr
    freed = lab.farm("device", "forget", "phone1", "--controller", lab.address, "--token", ADMIN)
    assert freed.returncode == 0 and "no longer belongs to agent a1" in freed.stdout, freed.stderr

    new_owner = RawAgent(lab.address, "a2", A2, devices=["phone1"])
    try:
        new_owner.expect("welcome")
        devices = json.loads(lab.farm("devices", "--json", "--controller", lab.address, "--token", CLIENT).stdout)
        assert [(d["name"], d["agent"]) for d in devices if d["name"] == "phone1"] == [("phone1", "a2")]
    finally:
        new_owner.close()


# --- attacks 5 and 9: results too large ----------------------------------------------------------
def test_an_oversized_result_fails_its_task_as_job_and_the_stream_goes_on(lab: Cluster) -> None:
    _submit(lab, repeats=2)
    agent = RawAgent(lab.address, "a1", A1)
    try:
        agent.expect("welcome")
        task = agent.lease()
        huge = _ok(iterations=MAX_RESULT_BYTES // 8 + 1000)  # over the per-result limit, under a gRPC message
        ack = agent.result(task.task_id, task.attempt, huge)
        assert ack.applied and "stored as a failure" in ack.note and "byte limit per result" in ack.note
        following = agent.lease(request_id=2)  # the same stream serves on
        assert following.task_id != task.task_id
    finally:
        agent.close()
    with lab.db() as db:
        status, failure, message = db.execute("SELECT status, failure_class, message FROM tasks WHERE id = ?",
                                              [task.task_id]).fetchone()
        assert db.execute("SELECT COUNT(*) FROM run_samples WHERE run_id IN (SELECT id FROM runs WHERE task_id = ?)",
                          [task.task_id]).fetchone()[0] == 0
    assert (status, failure) == ("failed", "job") and "over the 8388608 byte limit per result" in message


def test_a_reconnect_does_not_renew_the_lease_of_an_undeliverable_result(lab: Cluster) -> None:
    _submit(lab, repeats=1)
    agent = RawAgent(lab.address, "a1", A1)
    agent.expect("welcome")
    task = agent.lease()
    message = agent_pb2.TaskResult(task=common_pb2.TaskRef(task_id=task.task_id, attempt=task.attempt))
    result_to_message(_ok(iterations=(17 << 20) // 8), message.result)  # 17 MB: more than a gRPC message
    agent.send(result=message)
    agent.ended.wait(30)
    assert agent.error is not None and agent.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    agent.close()
    # reconnect again and again, saying the task still runs here, but never heartbeating it
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        again = RawAgent(lab.address, "a1", A1, running=[(task.task_id, task.attempt)])
        again.expect("welcome")
        again.close()
        with lab.db() as db:
            if db.execute("SELECT 1 FROM runs WHERE task_id = ?", [task.task_id]).fetchone():
                break
        time.sleep(0.5)
    with lab.db() as db:
        assert db.execute("SELECT message FROM runs WHERE task_id = ?", [task.task_id]).fetchone() == (
            "lease expired on agent a1: it stopped renewing the lease",)
    _still_serving(lab)


def test_an_agent_cuts_a_huge_result_to_fit_and_says_so() -> None:
    many = _ok(iterations=2_200_000)
    fitted = result_for_the_wire(many, common_pb2.RunResult())
    assert len(fitted.iterations_ms) == MAX_SAMPLES and fitted.latency.count == 2_200_000
    assert fitted.status == "completed" and f"kept the first {MAX_SAMPLES} of 2200000" in fitted.message
    assert fitted.ByteSize() < MAX_RESULT_BYTES
    chatty = RunResult(status=RunStatus.COMPLETED, log_tail="x" * (MAX_RESULT_BYTES + 1))
    failed = result_for_the_wire(chatty, common_pb2.RunResult())
    assert (failed.status, failed.failure_class) == ("failed", "job") and "byte limit per result" in failed.message


def test_a_script_printing_millions_of_timings_stalls_nothing(tmp_path: Path, tiny_models, monkeypatch) -> None:
    """The poison result of the report, end to end: an agent, a script printing 2.2 M timings, and a second job
    beside it. The harness keeps the first MAX_SAMPLES with the summary of all, the result arrives once, both jobs
    finish. (Controller, agent and CLI on threads here: the harness and the script are the processes that count.)"""
    cluster = in_process_cluster(tmp_path, monkeypatch)
    os.symlink(tiny_models["onnx"], tmp_path / "tiny.onnx")
    (tmp_path / "flood.py").write_text("import sys\nw = sys.stdout.write\nfor i in range(2_200_000):\n"
                                       "    w('{\"latency_ms\": 1.5}\\n')\n")
    (tmp_path / "flood.yaml").write_text("models: [tiny.onnx]\nworkload: {type: script, command: python, script: "
                                         "flood.py, dir: .}\nsim: {memory: 2g, backend: process, on_contention: flag}\n")
    # on_contention: flag: on a loaded host every run is contended, and the default policy measures it again
    (tmp_path / "small.yaml").write_text("models: [tiny.onnx]\nrepeats: 2\nsim: {backend: process, on_contention: flag}\n")
    try:
        cluster.serve_in_process()
        cluster.agent_in_process("rack1")
        jobs = []
        for name in ("flood.yaml", "small.yaml"):
            run = cluster.farm("submit", str(tmp_path / name), "--controller", cluster.address, "--detach", "--json")
            assert run.returncode == 0, run.stderr
            jobs.append(json.loads(run.stdout)["job"])

        def finished() -> bool:
            statuses = [json.loads(cluster.farm("status", str(j), "--json", "--controller", cluster.address).stdout)
                        ["status"] for j in jobs]
            return all(s in ("completed", "failed") for s in statuses) and statuses

        wait_for(finished, 200, "both jobs to finish", interval=1)
        assert cluster.server_output().count("connected to controller") == 1  # no reconnect loop
    finally:
        cluster.stop_all()
    with cluster.db() as db:
        run_id, status, message = db.execute("SELECT id, status, message FROM runs WHERE job_id = ?", [jobs[0]]).fetchone()
        assert status == "completed", message
        assert f"kept the first {MAX_SAMPLES} of 2200000 per-iteration timings" in message
        (packed,) = db.execute("SELECT iterations FROM run_samples WHERE run_id = ?", [run_id]).fetchone()
        assert len(unpack_iterations(packed)) == MAX_SAMPLES
        assert db.execute("SELECT latency_count FROM summaries WHERE run_id = ?", [run_id]).fetchone()[0] == 2_200_000
        assert db.execute("SELECT status FROM jobs ORDER BY id").fetchall() == [("completed",), ("completed",)]
    assert stat.S_IMODE((tmp_path / "controller.db").stat().st_mode) == 0o600  # hygiene: the store is private


def test_readers_do_not_wait_for_a_long_write(tmp_path: Path) -> None:
    store = Store(tmp_path / "farm.db")
    answered = threading.Event()
    with store.transaction():  # a write in progress (a large result, say)
        store.db.execute("INSERT INTO jobs (name, status) VALUES ('being written', 'queued')")
        reader = threading.Thread(target=lambda: (store.query("SELECT COUNT(*) AS n FROM jobs"), answered.set()))
        reader.start()
        assert answered.wait(20), "a query waited for the writer's transaction"
    assert store.query("SELECT COUNT(*) AS n FROM jobs")[0]["n"] == 1
    assert stat.S_IMODE((tmp_path / "farm.db").stat().st_mode) == 0o600


# --- attack 14: a result farm cannot read --------------------------------------------------------
def test_a_result_with_an_unknown_status_fails_the_task_and_the_stream_stays_open(lab: Cluster) -> None:
    _submit(lab, repeats=2)
    agent = RawAgent(lab.address, "a1", A1)
    try:
        agent.expect("welcome")
        task = agent.lease()
        ack = agent.result(task.task_id, task.attempt, common_pb2.RunResult(status="pwned"))
        assert "stored as a failure" in ack.note and "Do not resend" in ack.note and "pwned" in ack.note
        again = agent.result(task.task_id, task.attempt, common_pb2.RunResult(status="pwned"))
        assert not again.applied  # a resend changes nothing
        assert agent.lease(request_id=2).task_id != task.task_id  # the stream was not closed
    finally:
        agent.close()
    with lab.db() as db:
        assert db.execute("SELECT status, failure_class FROM tasks WHERE id = ?", [task.task_id]).fetchone() == (
            "failed", "bug")
    _still_serving(lab)


# --- attack 12: strings from the wire, escaped ----------------------------------------------------
def test_wire_strings_are_escaped_in_the_log_and_the_tables(lab: Cluster) -> None:
    forged_line = "2026-01-01 00:00:00,000 farm.controller INFO agent root connected"
    agent = RawAgent(lab.address, "a1", A1, farm_version=f"0.1\n{forged_line}", hostname="\x1b[2J[red]evil[/red]",
                     devices=["phone7"])
    try:
        agent.expect("welcome")
        table = lab.farm("agents", "--controller", lab.address, "--token", CLIENT)
        devices = lab.farm("devices", "--controller", lab.address, "--token", CLIENT)
    finally:
        agent.close()
    log = lab.server_output()
    assert not any(line.startswith(forged_line) for line in log.splitlines())
    assert "0.1\\n2026-01-01" in log and "\\x1b[2J" in log
    assert table.returncode == 0 and "\x1b" not in table.stdout
    assert "\\x1b[2J[red]evil[/red]" in table.stdout  # shown as text, not as an escape nor as markup
    assert devices.returncode == 0 and "phone7" in devices.stdout


# --- attack 6 and hygiene: streams, reflection, tokens ---------------------------------------------
def test_reflection_needs_a_token_and_one_token_cannot_hold_every_watch(lab: Cluster) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    job = _submit(lab, repeats=1)
    with grpc.insecure_channel(lab.address) as channel:
        def reflect(metadata) -> set[str]:
            replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=metadata, timeout=10)
            return {s.name for reply in replies for s in reply.list_services_response.service}

        with pytest.raises(grpc.RpcError) as anonymous:
            reflect(None)
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "farm.v1.FarmService" in reflect(_bearer(CLIENT))
        # 300 calls without a token hold nothing: each is refused at once
        for _ in range(300):
            with pytest.raises(grpc.RpcError):
                reflect(None)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # health stays open

        stub = farm_pb2_grpc.FarmServiceStub(channel)
        watches = [stub.WatchJob(farm_pb2.JobRequest(job_id=job), metadata=_bearer(CLIENT)) for _ in range(3)]
        for w in watches:
            next(w)  # each is open and has sent the job once
        with pytest.raises(grpc.RpcError) as capped:
            next(stub.WatchJob(farm_pb2.JobRequest(job_id=job), metadata=_bearer(CLIENT)))
        assert capped.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-watches" in capped.value.details()
        other = stub.WatchJob(farm_pb2.JobRequest(job_id=job), metadata=_bearer(CLIENT2))
        assert next(other).id == job  # another token still may
        for w in [*watches, other]:
            w.cancel()
    _still_serving(lab)


def test_a_token_must_be_a_bearer_token_and_is_never_echoed(lab: Cluster) -> None:
    with grpc.insecure_channel(lab.address) as channel:
        stub = farm_pb2_grpc.FarmServiceStub(channel)
        with pytest.raises(grpc.RpcError) as bare:
            stub.ListJobs(farm_pb2.ListJobsRequest(), metadata=[("authorization", CLIENT)], timeout=10)
        assert bare.value.code() == grpc.StatusCode.UNAUTHENTICATED and "Bearer <token>" in bare.value.details()
        wrong = "Zq7xWv3kPj9mRt2bNs5cYh4L"
        with pytest.raises(grpc.RpcError) as unknown:
            stub.ListJobs(farm_pb2.ListJobsRequest(), metadata=_bearer(wrong), timeout=10)
    details = unknown.value.details()
    assert "does not know the token" in details
    assert not any(wrong[i:i + 4] in details for i in range(len(wrong) - 3))  # no piece of it comes back


def test_start_up_refuses_an_expired_certificate_and_warns_about_exposure(tmp_path: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "old controller")])
    now = dt.datetime.now(dt.timezone.utc)
    expired = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
               .serial_number(1).not_valid_before(now - dt.timedelta(days=30)).not_valid_after(now - dt.timedelta(days=1))
               .sign(key, hashes.SHA256()))
    (tmp_path / "old.pem").write_bytes(expired.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "old.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    tokens = tmp_path / "tokens"
    tokens.write_text(f"client {CLIENT}\n")
    tokens.chmod(0o644)
    # processes: the tokens-file warning reaches stderr through logging's last resort, as in a fresh process only
    cluster = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": ""})
    refused = cluster.farm("controller", "serve", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "c.db"), "--tokens",
                           str(tokens), "--tls-cert", str(tmp_path / "old.pem"), "--tls-key", str(tmp_path / "old.key"),
                           timeout=60)
    assert refused.returncode == 2 and "expired on" in refused.stderr and "--tls-cert" in refused.stderr, refused.stderr
    assert f"chmod 600 {tokens}" in refused.stderr  # the readable tokens file was pointed out first

    sneaky = cluster.farm("controller", "serve", "--listen", "127.evil.example:0", "--no-auth", timeout=60)
    assert sneaky.returncode == 2 and "only allowed on a loopback address" in sneaky.stderr

    assert [is_loopback(a) for a in ("127.0.0.1:1", "[::1]:1", "localhost:1", "127.evil.example:1", "0.0.0.0:1",
                                     "[::]:1", "10.0.0.1:1")] == [True, True, True, False, False, False, False]
    warnings = startup_warnings("0.0.0.0:7443", tokens=True, tls=False, metrics_listen="0.0.0.0:9100")
    assert any("tokens travel in plain text" in w for w in warnings)
    assert any("metrics endpoint on 0.0.0.0:9100" in w for w in warnings)
    assert startup_warnings("127.0.0.1:7443", tokens=True, tls=False, metrics_listen="127.0.0.1:9100") == []


def test_printable_escapes_what_could_forge_a_line_or_drive_a_terminal() -> None:
    from farm.proto.escape import printable

    assert printable("rack\n2026 INFO forged") == "rack\\n2026 INFO forged"
    assert printable("\x1b[2Jx\x07\x9b\u202egnp.exe") == "\\x1b[2Jx\\x07\\x9b\\u202egnp.exe"
    assert printable("plain-name_1.0 ü") == "plain-name_1.0 ü"  # ordinary text is left alone
    assert printable("x" * 500, limit=10) == "xxxxxxxxxx… (500 characters)"
    assert printable("line one\nline \x1b two", limit=None, multiline=True) == "line one\nline \\x1b two"


def test_the_stream_cap_is_a_setting_and_refuses_clearly_when_reached(tmp_path: Path, tiny_models,
                                                                     monkeypatch) -> None:
    cluster = in_process_cluster(tmp_path, monkeypatch)  # its own controller: it fills every stream
    os.symlink(tiny_models["onnx"], tmp_path / "tiny.onnx")
    (tmp_path / "job.yaml").write_text("models: [tiny.onnx]\n")
    try:
        cluster.serve_in_process(max_streams=4)
        job = json.loads(cluster.farm("submit", str(tmp_path / "job.yaml"), "--controller", cluster.address,
                                      "--detach", "--json").stdout)["job"]
        with grpc.insecure_channel(cluster.address) as channel:
            stub = farm_pb2_grpc.FarmServiceStub(channel)
            watches = [stub.WatchJob(farm_pb2.JobRequest(job_id=job)) for _ in range(4)]
            for w in watches:
                next(w)
            with pytest.raises(grpc.RpcError) as full:
                stub.ListJobs(farm_pb2.ListJobsRequest(), timeout=10)
            assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for w in watches:
                w.cancel()
            wait_for(lambda: _answers(stub), 20, "the streams to close and the controller to answer again")
    finally:
        cluster.stop_all()


def _answers(stub: farm_pb2_grpc.FarmServiceStub) -> bool:
    try:
        stub.ListJobs(farm_pb2.ListJobsRequest(), timeout=10)
        return True
    except grpc.RpcError:
        return False


def test_a_priority_from_the_wire_outside_the_three_is_refused(lab: Cluster, tiny_models) -> None:
    """The type checker found it: SubmitJob's priority went into the job unchecked and failed the submit later."""
    data = tiny_models["onnx"].read_bytes()
    sha256 = hashlib.sha256(data).hexdigest()
    with grpc.insecure_channel(lab.address) as channel:
        stub = farm_pb2_grpc.FarmServiceStub(channel)
        stub.UploadArtifact(iter([farm_pb2.ArtifactUpload(sha256=sha256, size=len(data), name="tiny.onnx", data=data)]),
                            metadata=_bearer(CLIENT), timeout=30)
        request = farm_pb2.SubmitJobRequest(job_yaml="models: [tiny.onnx]\n", base_dir="/jobs", file_name="job.yaml",
                                            priority="urgent\x1b[2J",
                                            models=[farm_pb2.JobModel(entry=0, name="tiny", sha256=sha256)])
        with pytest.raises(grpc.RpcError) as refused:
            stub.SubmitJob(request, metadata=_bearer(CLIENT), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "is not one of interactive, normal, low" in refused.value.details()
        assert "\x1b" not in refused.value.details()
        request.priority = "interactive"
        assert stub.SubmitJob(request, metadata=_bearer(CLIENT), timeout=30).job_id > 0
    _still_serving(lab)
