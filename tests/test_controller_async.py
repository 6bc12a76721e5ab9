"""The controller's gRPC server on one asyncio loop (controller/async_calls.py): a waiting agent stream holds no
thread, and a call its client cuts still gives back what it held (a watch slot, a token's share of calls),
which grpc.aio's own thread hand-over does not do for a plain handler. A real controller on loopback."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest

from farm.controller.auth import BudgetSettings, TokenTable
from farm.controller.grpc_server import AGENT_MESSAGE_THREADS, serve
from farm.controller.store import SQLiteStore as Store
from farm.proto.generated import agent_pb2, farm_pb2, farm_pb2_grpc
from raw_agent import RawAgent, bearer

pytestmark = pytest.mark.timeout(240)


def _server_threads(before: set[int]) -> list[str]:
    # the sync server named a stream's thread rpc_N and its reader agent-NAME; the loop's workers are agent-msg_N
    return [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith(("rpc", "agent-"))]


def _submit(port: int, model: Path, token: str = "") -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return farm_pb2_grpc.FarmServiceStub(channel).SubmitJob(farm_pb2.SubmitJobRequest(
            job_yaml=f"models: [{model}]\n", base_dir="/"), metadata=bearer(token) if token else None, timeout=60).job_id


def _eventually(check, timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def test_waiting_agent_streams_hold_no_threads(tmp_path: Path, tiny_models) -> None:
    before = {t.ident for t in threading.enumerate() if t.ident is not None}  # other tests' threads are not counted
    running = serve(Store(tmp_path / "farm.db"), "127.0.0.1:0", tokens=None, models_roots=[tiny_models["onnx"].parent])
    agents: list[RawAgent] = []
    try:
        for n in range(40):
            agent = RawAgent(f"127.0.0.1:{running.port}", f"rack{n}", "")
            agent.expect("welcome")
            agent.send(work_request=agent_pb2.WorkRequest(request_id=1, targets=["sim"]))  # a slot waits for work
            agent.send(heartbeat=agent_pb2.Heartbeat())
            agents.append(agent)
        assert _eventually(lambda: len(running.farm.agents.by_name) == 40 and all(
            running.farm.agents.by_name[a].requests for a in running.farm.agents.by_name))
        # 40 open streams, each with a slot waiting: only the fixed pool that applies their messages has threads
        # (the thread-per-stream server had two apiece: 80 and more)
        threads = _server_threads(before)
        assert len(threads) <= AGENT_MESSAGE_THREADS + 2, threads
        # and every stream still works: a job's task reaches one of the waiting slots
        _submit(running.port, tiny_models["onnx"])
        assert _eventually(lambda: any(not a.inbox.empty() for a in agents))
    finally:
        for agent in agents:
            agent.close()
        running.stop()


def test_a_cut_watcher_gives_back_its_watch_slot(tmp_path: Path, tiny_models) -> None:
    running = serve(Store(tmp_path / "farm.db"), "127.0.0.1:0", tokens=None, max_watches=2,
                    models_roots=[tiny_models["onnx"].parent])
    try:
        job = _submit(running.port, tiny_models["onnx"])  # no agent: it stays pending, so a watch stays open
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = farm_pb2_grpc.FarmServiceStub(channel)
            for _ in range(3):  # three rounds of two: each round's slots come back when its watchers are cut
                watches = [stub.WatchJob(farm_pb2.JobRequest(job_id=job)) for _ in range(2)]
                for watch in watches:
                    assert next(watch).id == job
                with pytest.raises(grpc.RpcError) as full:
                    next(stub.WatchJob(farm_pb2.JobRequest(job_id=job)))
                assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                for watch in watches:
                    watch.cancel()
                assert _eventually(lambda: not running.farm.watches), "the cut watchers kept their slots"
    finally:
        running.stop()


def test_a_cut_call_gives_back_its_tokens_share(tmp_path: Path, tiny_models) -> None:
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("client client-token-0123456789\n")
    tokens_file.chmod(0o600)
    running = serve(Store(tmp_path / "farm.db"), "127.0.0.1:0", tokens=TokenTable.from_file(tokens_file),
                    budget=BudgetSettings(calls_per_token=2), models_roots=[tiny_models["onnx"].parent])
    try:
        job = _submit(running.port, tiny_models["onnx"], "client-token-0123456789")
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = farm_pb2_grpc.FarmServiceStub(channel)
            for _ in range(3):
                watches = [stub.WatchJob(farm_pb2.JobRequest(job_id=job), metadata=bearer("client-token-0123456789")) for _ in range(2)]
                for watch in watches:
                    assert next(watch).id == job
                with pytest.raises(grpc.RpcError) as full:
                    stub.ListJobs(farm_pb2.ListJobsRequest(), metadata=bearer("client-token-0123456789"), timeout=10)
                assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "calls open" in full.value.details()
                for watch in watches:
                    watch.cancel()
                assert _eventually(lambda: _answers(stub)), "the cut calls kept the token's share"
    finally:
        running.stop()


def _answers(stub: farm_pb2_grpc.FarmServiceStub) -> bool:
    try:
        stub.ListJobs(farm_pb2.ListJobsRequest(), metadata=bearer("client-token-0123456789"), timeout=10)
        return True
    except grpc.RpcError:
        return False
