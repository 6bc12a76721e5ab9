"""The agent's artifact cache when two slots want one model at once: one download, both slots get the whole,
checked file (the race used to fail a run as "changed since it was submitted", blaming the user)."""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from farm.agents.artifact_cache import ArtifactCache
from farm.agents.link.remote_controller import RemoteController
from farm.agents.sim.driver import verify_model
from farm.proto.generated import agent_pb2_grpc, common_pb2
from farm.proto.tasks import TaskPlan, TaskSpec

PAYLOAD = os.urandom(3 << 20)
SHA = hashlib.sha256(PAYLOAD).hexdigest()
CHUNK = 64 << 10


class SlowArtifacts(agent_pb2_grpc.AgentServiceServicer):
    """Serves PAYLOAD in chunks; after the first chunk each stream waits (briefly) for a second stream, so two
    concurrent fetches really overlap."""

    def __init__(self) -> None:
        self.streams = 0
        self.lock = threading.Lock()
        self.both = threading.Barrier(2)

    def FetchArtifact(self, request, context):
        with self.lock:
            self.streams += 1
        for offset in range(0, len(PAYLOAD), CHUNK):
            yield common_pb2.ArtifactChunk(sha256=request.sha256, size=len(PAYLOAD), offset=offset,
                                           data=PAYLOAD[offset:offset + CHUNK])
            if offset == 0:
                try:
                    self.both.wait(timeout=2)  # the other slot's fetch is under way too (or never comes)
                except threading.BrokenBarrierError:
                    pass


@pytest.fixture
def server():
    servicer = SlowArtifacts()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield servicer, f"127.0.0.1:{port}"
    grpc_server.stop(None)


def _task(task_id: int) -> TaskSpec:
    return TaskSpec(task_id=task_id, job_id=1, attempt=1, target="sim", model_name="m", model_path="/elsewhere/m.onnx",
                    model_sha256=SHA, model_family=None, threads=1, batch_size=1, input_size=None, repeat=0,
                    plan=TaskPlan(workload={"type": "benchmark"}, sim={}, run_timeout_s=60, base_dir="/elsewhere"))


def test_two_slots_fetching_one_model_at_once_get_the_whole_checked_file(server, tmp_path: Path) -> None:
    servicer, address = server
    agent = RemoteController(address, name="rack", token=None, devices=[], artifact_dir=tmp_path / "cache")
    got: dict[int, str] = {}
    errors: list[BaseException] = []

    def slot(n: int) -> None:
        try:
            path = agent.local_model_path(_task(n))
            verify_model(Path(path), SHA)  # what the sim driver does before the run: raises ModelChanged if torn
            got[n] = path
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=slot, args=(n,)) for n in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, f"a slot's fetch failed: {errors[0]!r}"
    assert got[1] == got[2] == str(tmp_path / "cache" / f"{SHA}.onnx")
    assert Path(got[1]).read_bytes() == PAYLOAD
    assert servicer.streams == 1, "the second slot waited for the first slot's download instead of fetching again"
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.endswith(".part")], "a partial file was left"


def test_a_wrong_download_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    calls = []

    def fetch(partial: Path) -> None:
        calls.append(partial)
        partial.write_bytes(PAYLOAD)

    path = cache.get(SHA, f"{SHA}.onnx", fetch)
    assert path.read_bytes() == PAYLOAD and len(calls) == 1
    assert cache.get(SHA, f"{SHA}.onnx", fetch) == path and len(calls) == 1  # there now: no second fetch

    other = hashlib.sha256(b"other").hexdigest()
    with pytest.raises(ValueError, match="hash to"):
        cache.get(other, f"{other}.onnx", lambda partial: partial.write_bytes(b"not it"))
    assert not (tmp_path / "cache" / f"{other}.onnx").exists()
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.endswith(".part")]
