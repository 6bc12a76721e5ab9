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


def _upload(cluster: Cluster, token: str, data: bytes) -> grpc.StatusCode:
    with grpc.insecure_channel(cluster.address) as channel:
        try:
            farm_pb2_grpc.FarmServiceStub(channel).UploadArtifact(iter([farm_pb2.ArtifactUpload(
                sha256=hashlib.sha256(data).hexdigest(), size=len(data), name="m.onnx", data=data)]),
                metadata=_bearer(token), timeout=30)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            assert "quota" in (e.details() or "") and "farm artifacts gc" in (e.details() or "")
            return e.code()


def test_an_upload_quota_per_token_is_freed_by_gc(tmp_path: Path) -> None:
    other = "client-gc-other-0123456789abcdef"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"client {CLIENT}\nclient {other}\n")
    tokens.chmod(0o600)
    cluster = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(tmp_path / "none")})
    try:
        cluster.start_controller("--tokens", str(tokens), "--upload-quota", "100")
        assert _upload(cluster, CLIENT, b"a" * 60) == grpc.StatusCode.OK
        assert _upload(cluster, CLIENT, b"b" * 60) == grpc.StatusCode.RESOURCE_EXHAUSTED  # 120 > 100
        assert _upload(cluster, CLIENT, b"a" * 60) == grpc.StatusCode.OK  # already stored: no new bytes, nothing counted
        assert _upload(cluster, other, b"c" * 60) == grpc.StatusCode.OK  # another token's quota is its own
        assert len(list((tmp_path / "controller-artifacts").iterdir())) == 2  # the refused one was not stored
        gc = cluster.farm("artifacts", "gc", "--db", str(tmp_path / "controller.db"), "--grace-hours", "0", "--json")
        assert gc.returncode == 0 and json.loads(gc.stdout)["files"] == 2, gc.stdout + gc.stderr
        assert _upload(cluster, CLIENT, b"b" * 60) == grpc.StatusCode.OK  # freed
        bad = cluster.farm("controller", "serve", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "x.db"), "--tokens",
                           str(tokens), "--upload-quota", "-5", timeout=60)
        assert bad.returncode != 0 and "--upload-quota" in bad.stderr
    finally:
        cluster.stop_all()
