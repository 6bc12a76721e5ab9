"""N13: `farm artifacts gc` removes what no job names from a real controller's artifact store, keeps what
a job names and what is younger than the grace period, and refuses a hostile grace."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import grpc
import pytest

from farm.proto.generated import agent_pb2_grpc, common_pb2, farm_pb2, farm_pb2_grpc
from grpc_processes import Cluster

pytestmark = pytest.mark.timeout(240)

CLIENT = "client-gc-0123456789abcdef"
AGENT = "agent-gc-0123456789abcdef"


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def _fetch(cluster: Cluster, sha256: str) -> grpc.StatusCode:
    with grpc.insecure_channel(cluster.address) as channel:
        try:
            b"".join(c.data for c in agent_pb2_grpc.AgentServiceStub(channel).FetchArtifact(
                common_pb2.ArtifactRequest(sha256=sha256), metadata=_bearer(AGENT), timeout=30))
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


def test_gc_removes_only_what_no_job_names(tmp_path: Path, tiny_models) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"client {CLIENT}\nagent {AGENT}\n")
    tokens.chmod(0o600)
    os.symlink(tiny_models["onnx"], tmp_path / "tiny.onnx")
    (tmp_path / "job.yaml").write_text("models: [tiny.onnx]\nsim: {backend: process}\n")
    cluster = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(tmp_path / "none")})
    try:
        cluster.start_controller("--tokens", str(tokens))
        run = cluster.farm("submit", str(tmp_path / "job.yaml"), "--controller", cluster.address, "--token", CLIENT,
                           "--detach", "--json")
        assert run.returncode == 0, run.stderr
        used = hashlib.sha256(tiny_models["onnx"].read_bytes()).hexdigest()
        orphan_bytes = b"an upload no job ever named"
        orphan = hashlib.sha256(orphan_bytes).hexdigest()
        with grpc.insecure_channel(cluster.address) as channel:
            farm_pb2_grpc.FarmServiceStub(channel).UploadArtifact(iter([farm_pb2.ArtifactUpload(
                sha256=orphan, size=len(orphan_bytes), name="orphan.onnx", data=orphan_bytes)]),
                metadata=_bearer(CLIENT), timeout=30)
        store = tmp_path / "controller-artifacts"
        partial = store / ".upload-1-abandoned"
        partial.write_bytes(b"half")
        old = time.time() - 7200
        for f in store.iterdir():
            os.utime(f, (old, old))

        kept = cluster.farm("artifacts", "gc", "--db", str(tmp_path / "controller.db"), "--json")  # grace 24 h
        assert kept.returncode == 0 and json.loads(kept.stdout)["files"] == 0, kept.stdout + kept.stderr
        dry = cluster.farm("artifacts", "gc", "--db", str(tmp_path / "controller.db"), "--grace-hours", "1",
                           "--dry-run", "--json")
        assert dry.returncode == 0 and json.loads(dry.stdout)["files"] == 2 and partial.exists()
        gc = cluster.farm("artifacts", "gc", "--db", str(tmp_path / "controller.db"), "--grace-hours", "1", "--json")
        answer = json.loads(gc.stdout)
        assert gc.returncode == 0 and sorted(answer["removed"]) == sorted([".upload-1-abandoned", "orphan.onnx".replace(
            "orphan", orphan)]), answer
        assert _fetch(cluster, used) == grpc.StatusCode.OK  # the job's model stays
        assert _fetch(cluster, orphan) == grpc.StatusCode.NOT_FOUND

        for bad in ("nan", "-1", "inf"):
            refused = cluster.farm("artifacts", "gc", "--db", str(tmp_path / "controller.db"), "--grace-hours", bad)
            assert refused.returncode != 0 and "--grace-hours" in refused.stderr
    finally:
        cluster.stop_all()
