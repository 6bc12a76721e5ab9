"""Low (issue 33): with --scripts-need-permission, a script job from a token without the `script` permission is
refused before the controller reads anything for it: before, a script folder under a models root was packed (and
its problems reported, a link's name included) and only then was the permission checked. A real controller."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from farm.proto.generated import farm_pb2, farm_pb2_grpc
from grpc_processes import Cluster

pytestmark = pytest.mark.timeout(240)

CLIENT = "client-perm-0123456789abcdef"
SCRIPTER = "client-perm-script-0123456789abcdef"
JOB = "models: [good.onnx]\nworkload: {type: script, command: python, script: s.py, dir: scripts}\n"


def test_a_script_job_without_the_permission_is_refused_before_its_folder_is_read(tmp_path: Path, tiny_models) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"client {CLIENT}\nclient+script {SCRIPTER}\n")
    tokens.chmod(0o600)
    root = tmp_path / "models-root"
    (root / "scripts").mkdir(parents=True)
    os.symlink(tiny_models["onnx"], tmp_path / "good.onnx")
    (root / "good.onnx").write_bytes(tiny_models["onnx"].read_bytes())
    (root / "scripts" / "s.py").write_text("print('{\"latency_ms\": 1.0}')\n")
    os.symlink(tokens, root / "scripts" / "secret-link")  # packing the folder would meet (and name) it
    cluster = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(tmp_path / "none")})
    cluster.start_controller("--tokens", str(tokens), "--models-root", str(root), "--scripts-need-permission")
    try:
        with grpc.insecure_channel(cluster.address) as channel:
            stub = farm_pb2_grpc.FarmServiceStub(channel)
            request = farm_pb2.SubmitJobRequest(job_yaml=JOB, base_dir=str(root), file_name="job.yaml")
            with pytest.raises(grpc.RpcError) as refused:
                stub.SubmitJob(request, metadata=[("authorization", f"Bearer {CLIENT}")], timeout=30)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value.details()
            assert "only for tokens with the `script` permission" in refused.value.details()
            assert "secret-link" not in refused.value.details()
            with pytest.raises(grpc.RpcError) as packed:  # a token that may run scripts gets its folder read
                stub.SubmitJob(request, metadata=[("authorization", f"Bearer {SCRIPTER}")], timeout=30)
            assert packed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "secret-link" in packed.value.details(), packed.value.details()
            benchmark = farm_pb2.SubmitJobRequest(job_yaml="models: [good.onnx]\n", base_dir=str(root),
                                                  file_name="job.yaml")
            assert stub.SubmitJob(benchmark, metadata=[("authorization", f"Bearer {CLIENT}")], timeout=30).job_id > 0
    finally:
        cluster.stop_all()
