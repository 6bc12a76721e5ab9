"""N7: errors stay bounded. A lab of 5,000 devices and a job naming one that does not exist: the refusal reaches the client as the reason, cut with "… and N more", not as
gRPC's "received metadata size exceeds hard limit". A controller on loopback, tokens on, on threads of this process
(farm.client.compose).
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from farm.proto.escape import MAX_ERROR_CHARS, bounded_message, cut_list
from farm.proto.generated import farm_pb2, farm_pb2_grpc
from grpc_processes import Cluster, wait_for
from raw_agent import RawAgent

pytestmark = pytest.mark.timeout(240)

CLIENT = "client-errors-0123456789abcdef"
AGENT = "agent-errors-0123456789abcdef"


@pytest.fixture
def lab(tmp_path: Path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"client {CLIENT}\nagent {AGENT} rack1\n")
    tokens.chmod(0o600)
    cluster = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(tmp_path / "none")})
    cluster.serve_in_process(tokens=tokens)
    yield cluster
    cluster.stop_all()


def _submit(cluster: Cluster, text: str) -> grpc.RpcError:
    with grpc.insecure_channel(cluster.address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            farm_pb2_grpc.FarmServiceStub(channel).SubmitJob(
                farm_pb2.SubmitJobRequest(job_yaml=text, base_dir="/", file_name="big.yaml"),
                metadata=[("authorization", f"Bearer {CLIENT}")], timeout=60)
    return refused.value


def test_an_error_listing_5000_devices_is_cut_and_arrives(lab: Cluster) -> None:
    names = [f"phone-{n:05d}-{'x' * 40}" for n in range(5000)]
    agent = RawAgent(lab.address, "rack1", AGENT, devices=names)
    try:
        agent.expect("welcome", timeout=120)
        wait_for(lambda: len(lab.db().execute("SELECT name FROM devices").fetchall()) >= 5000, 60, "the devices")
        refused = _submit(lab, "models: [m.onnx]\ntargets: [no-such-phone]\n")
        details = refused.details()
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, details
        assert "no device matches 'no-such-phone'" in details and "… and 4980 more" in details
        assert names[0] in details and len(details) < MAX_ERROR_CHARS
    finally:
        agent.close()
    with grpc.insecure_channel(lab.address) as channel:  # still serving
        farm_pb2_grpc.FarmServiceStub(channel).ListJobs(farm_pb2.ListJobsRequest(),
                                                       metadata=[("authorization", f"Bearer {CLIENT}")], timeout=30)
    with lab.db() as db:
        assert db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 0


def test_lists_and_messages_are_cut_where_they_say_so() -> None:
    assert cut_list(["a", "b"]) == "a, b"
    assert cut_list([str(n) for n in range(25)], 3) == "0, 1, 2 … and 22 more"
    assert bounded_message("short") == "short"
    cut = bounded_message("\n".join(f"line {n}" for n in range(10_000)), 200)
    assert len(cut) <= 200 and cut.startswith("line 0\n") and cut.endswith("more line(s)")
    assert len(bounded_message("x" * 10_000, 200)) <= 200
