"""N1: nothing leaves a root. A client names a script folder under the controller's --models-root
instead of uploading it; the controller reads it with its own rights, so every link in it is refused
(a link to a stand-in for /etc/shadow above all), nothing is stored, and the controller keeps serving.
Real controller process on loopback, tokens on, the generated stubs as the hostile client.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
from pathlib import Path

import grpc
import pytest

from farm.proto.generated import farm_pb2, farm_pb2_grpc
from farm.proto.script_archive import pack_dir
from grpc_processes import Cluster

pytestmark = pytest.mark.timeout(240)

SCRIPTER = "scripter-roots-0123456789"
SECRET = "root:$6$not-really-a-shadow-line:19000:0:99999:7:::\n"


@pytest.fixture
def lab(tmp_path: Path, tiny_models):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"client+script {SCRIPTER}\n")
    tokens.chmod(0o600)
    root = tmp_path / "models-root"
    root.mkdir()
    shutil.copy(tiny_models["onnx"], root / "tiny.onnx")
    shadow = tmp_path / "outside" / "shadow"  # stands in for /etc/shadow: readable by the controller, not by clients
    shadow.parent.mkdir()
    shadow.write_text(SECRET)
    shadow.chmod(0o600)
    cluster = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_TLS_CA": ""})
    cluster.start_controller("--tokens", str(tokens), "--models-root", str(root))
    yield cluster, root, shadow
    cluster.stop_all()


def _submit(cluster: Cluster, folder: str, root: Path) -> farm_pb2.SubmitJobResponse:
    text = f"models: [tiny.onnx]\nworkload: {{type: script, script: run.py, dir: {folder}}}\nsim: {{backend: process}}\n"
    with grpc.insecure_channel(cluster.address) as channel:
        return farm_pb2_grpc.FarmServiceStub(channel).SubmitJob(
            farm_pb2.SubmitJobRequest(job_yaml=text, base_dir=str(root), file_name="hostile.yaml"),
            metadata=[("authorization", f"Bearer {SCRIPTER}")], timeout=60)


def _script_folder(root: Path, name: str) -> Path:
    folder = root / name
    (folder / "lib").mkdir(parents=True)
    (folder / "run.py").write_text("print('{\"latency_ms\": 1.0}')\n")
    (folder / "lib" / "data.txt").write_text("plain data\n")
    return folder


def _jobs(cluster: Cluster) -> int:
    with sqlite3.connect(cluster.root / "controller.db", timeout=30) as db:
        return db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]


def test_a_script_folder_under_a_root_with_a_link_out_is_refused_naming_the_link(lab) -> None:
    cluster, root, shadow = lab
    store = cluster.root / "controller-artifacts"
    hostile = {}
    folder = _script_folder(root, "to-shadow")
    os.symlink(shadow, folder / "lib" / "shadow.txt")  # the attack: the controller's own rights read it
    hostile["to-shadow"] = "lib/shadow.txt is a link"
    folder = _script_folder(root, "inner-link")
    os.symlink("run.py", folder / "again.py")  # even a link that stays inside: a link is never followed
    hostile["inner-link"] = "again.py is a link"
    folder = _script_folder(root, "to-folder")
    os.symlink(shadow.parent, folder / "lib" / "outside")
    hostile["to-folder"] = "lib/outside is a link"
    os.symlink(root / "to-shadow", root / "linked-folder")  # the folder itself a link, though inside the root
    hostile["linked-folder"] = "is a link"
    folder = _script_folder(root, "pipe")
    os.mkfifo(folder / "lib" / "endless")  # would hang a plain read
    hostile["pipe"] = "not a regular file or folder"
    hostile["../outside"] = "outside this controller's models roots"

    for name, reason in hostile.items():
        with pytest.raises(grpc.RpcError) as refused:
            _submit(cluster, name, root)
        details = refused.value.details()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, details
        assert "workload.dir" in details and reason in details, details
        assert SECRET.strip() not in details
    assert list(store.iterdir()) == [] if store.exists() else True  # nothing packed, nothing copied in
    assert _jobs(cluster) == 0

    # the controller still serves: a plain folder under the root is packed exactly as a client packs it
    clean = _script_folder(root, "clean")
    accepted = _submit(cluster, "clean", root)
    assert accepted.tasks == 1 and _jobs(cluster) == 1
    expected = hashlib.sha256(pack_dir(clean)).hexdigest()
    assert any(p.name.startswith(expected) for p in store.iterdir())
    for stored in store.iterdir():
        assert SECRET.encode() not in stored.read_bytes()


def test_the_walk_checks_sizes_before_reading(tmp_path: Path) -> None:
    from farm.controller.scheduling.artifacts import ArtifactError, pack_beneath

    folder = tmp_path / "s"
    folder.mkdir()
    (folder / "small.py").write_text("x = 1\n")
    assert pack_beneath(tmp_path, ["s"], 1 << 20) == pack_dir(folder)
    with open(folder / "huge.bin", "wb") as f:
        f.truncate(8 << 20)  # sparse: refused by its size, never read
    with pytest.raises(ArtifactError, match="huge.bin is 8388608 bytes"):
        pack_beneath(tmp_path, ["s"], 1 << 20)
