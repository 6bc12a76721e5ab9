"""Clients that survive a controller (issue 32 item 1): with an address list (`--controller a,b`), a call whose
controller is unreachable is sent to the next one, and the CLI says which controller answered. Reads move on
always; a submit carries a key, so sent again through another controller it names the job the first one made
instead of making a second; a retry moves on only when nothing was sent.

Two controllers serve one PostgreSQL database in this process (controller/grpc_server.serve), as two hosts of a
lab do; the dead controller is a port nothing listens on (what a client meets once a controller was killed).
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from pathlib import Path

import pytest

from conftest import fresh_postgres_url, write_job

pytestmark = pytest.mark.timeout(300)


def _dead_address() -> str:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def lab(postgres_peer, request: pytest.FixtureRequest, tmp_path: Path):
    """(url, [address of controller a, of b]): two served controllers on one fresh database."""
    from farm.controller.grpc_server import serve
    from farm.controller.store.postgres import PostgresStore

    url = fresh_postgres_url(postgres_peer, request.node.name)
    running = [serve(PostgresStore(url, files_dir=tmp_path / f"host-{h}"), "127.0.0.1:0", tokens=None)
               for h in ("a", "b")]
    try:
        yield url, [f"127.0.0.1:{r.port}" for r in running]
    finally:
        for r in running:
            r.stop(grace_s=0.1)
            r.farm.store.close()


def _job(tmp_path: Path, tiny_models: dict[str, Path]) -> Path:
    model = tmp_path / "jobs" / tiny_models["onnx"].name
    model.parent.mkdir()
    model.write_bytes(tiny_models["onnx"].read_bytes())
    return write_job(model.parent, f"name: failover\nmodels: [{model.name}]\nrepeats: 2\n")


def _jobs_in(url: str) -> list[tuple]:
    import psycopg

    with psycopg.connect(url) as conn:
        return conn.execute("SELECT id, name, status FROM jobs ORDER BY id").fetchall()


def test_every_cli_call_moves_on_to_the_next_controller_and_says_which_answered(lab, farm, tmp_path: Path,
                                                                                tiny_models) -> None:
    url, (a, b) = lab
    dead = _dead_address()
    env = {"FARM_CONTROLLER": "", "FARM_TOKEN": ""}
    submitted = farm("submit", str(_job(tmp_path, tiny_models)), "--detach", "--json", "--controller", f"{dead},{a}",
                     env=env)
    assert submitted.returncode == 0, submitted.stderr
    job = json.loads(submitted.stdout)["job"]
    assert f"cannot reach the controller at {dead}" in submitted.stderr
    assert f"Asking the next controller of the list, {a}" in submitted.stderr
    assert f"answered by the controller at {a}" in submitted.stderr
    assert _jobs_in(url) == [(job, "failover", "queued")], "the job was not made exactly once"
    # the job is the lab's: any controller of the list answers about it, the dead one first in the list or not
    listed = farm("jobs", "--json", "--controller", f"{dead},{b}", env=env)
    assert listed.returncode == 0, listed.stderr
    assert [j["id"] for j in json.loads(listed.stdout)] == [job]
    assert f"answered by the controller at {b}" in listed.stderr
    status = farm("status", str(job), "--controller", f"{dead},{b}", env=env)
    assert status.returncode == 0 and "queued" in status.stdout, status.stdout + status.stderr
    canceled = farm("cancel", str(job), "--controller", f"{dead},{b}", env=env)
    assert canceled.returncode == 0, canceled.stderr
    assert _jobs_in(url) == [(job, "failover", "canceled")]
    # with no controller left the user is told each was tried, and nothing claims the call was done
    gone = farm("jobs", "--controller", f"{dead},{_dead_address()}", env=env)
    assert gone.returncode != 0 and "Asking the next controller of the list" in gone.stderr
    assert "Traceback" not in gone.stderr


def test_a_submit_sent_again_through_another_controller_names_the_job_the_first_one_made(lab, tmp_path: Path,
                                                                                        tiny_models) -> None:
    """Controller a makes the job and dies before its answer reaches the client; the client sends the same submit
    (same key) to b: b answers with a's job, and the lab holds one job, not two."""
    import grpc

    from farm.client.config import Credentials
    from farm.client.remote import RemoteFarm
    from farm.proto.generated import farm_pb2, farm_pb2_grpc

    url, (a, b) = lab
    job_file = _job(tmp_path, tiny_models)
    client = RemoteFarm(a, Credentials())  # uploads the model and builds the request as `farm submit` does
    try:
        job_models, archive, _ = client._upload_job_files(job_file, job_file.read_text())
    finally:
        client.close()
    key = uuid.uuid4().hex
    request = farm_pb2.SubmitJobRequest(job_yaml=job_file.read_text(), base_dir=str(job_file.parent),
                                        file_name=str(job_file), models=job_models, script_archive_sha256=archive,
                                        submit_key=key)
    answers = []
    for address in (a, b, a):
        with grpc.insecure_channel(address) as channel:
            answers.append(farm_pb2_grpc.FarmServiceStub(channel).SubmitJob(request, timeout=60))
    assert [(r.job_id, r.repeated) for r in answers] == [(1, False), (1, True), (1, True)]
    assert answers[1].tasks == answers[0].tasks == 2
    assert _jobs_in(url) == [(1, "failover", "queued")], "a submit sent again made a second job"
    # another key is another submit; a key that is not one is refused, naming the field
    request.submit_key = uuid.uuid4().hex
    with grpc.insecure_channel(b) as channel:
        assert farm_pb2_grpc.FarmServiceStub(channel).SubmitJob(request, timeout=60).job_id == 2
        request.submit_key = "x" * 32
        with pytest.raises(grpc.RpcError) as refused:
            farm_pb2_grpc.FarmServiceStub(channel).SubmitJob(request, timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "submit_key" in refused.value.details()
    assert len(_jobs_in(url)) == 2


def test_retry_and_resume_of_a_controller_job_go_through_any_controller_of_the_list(lab, tmp_path: Path) -> None:
    from farm.client.api import FarmError
    from farm.client.config import Credentials
    from farm.client.remote import RemoteFarm
    from farm.controller.store.postgres import PostgresStore

    url, (a, b) = lab
    store = PostgresStore(url, files_dir=tmp_path / "setup")
    try:  # a finished job with one failed and one completed task, as the lab's store keeps it
        job = store.jobs.insert({"name": "done", "status": "failed", "priority": "normal", "created_at": time.time(),
                                 "finished_at": time.time(), "spec_json": "{}"},
                                [{"seq": i, "target": "sim", "model_name": "m", "status": status, "attempts": 1,
                                  "max_attempts": 3, "priority": 1, "spec_json": "{}"}
                                 for i, status in enumerate(("failed", "completed"))])
    finally:
        store.close()
    farm = RemoteFarm(_dead_address(), Credentials(), others=[b])
    try:
        answer = farm.retry(job, failed=True)
        assert answer.retried_tasks == 1 and farm.client.address == b
        assert [t[2] for t in _jobs_in(url)] == ["queued"]
        with pytest.raises(FarmError, match=f"job {job} is queued"):  # resume: for a finished job only
            farm.resume(job)
    finally:
        farm.close()
