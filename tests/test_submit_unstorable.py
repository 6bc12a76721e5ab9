"""M5 (issue 33): a NUL (or a lone surrogate) in any field of a job is refused at submit, naming the field, for
every store: before, PostgreSQL kept a script argument's NUL as `\\u0000` in spec_json and then every
`farm artifacts gc` of the lab failed. A real controller process on each store, the CLI and a raw SubmitJob."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import grpc
import pytest

from farm.proto.generated import farm_pb2, farm_pb2_grpc
from grpc_processes import Cluster

pytestmark = pytest.mark.timeout(240)

NUL_JOB = ('models: [tiny.onnx]\nworkload: {type: script, command: python, script: s.py, dir: scripts, '
           'args: ["ok", "a\\0b"]}\nname: "fine"\n')


@pytest.fixture(params=["sqlite", "postgresql"], scope="module")
def lab(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_models):
    root = tmp_path_factory.mktemp(f"m5-{request.param}")
    db = str(root / "controller.db")
    if request.param == "postgresql":
        from conftest import fresh_postgres_url
        db = fresh_postgres_url(request.getfixturevalue("postgres_peer"), "m5_unstorable")
    os.symlink(tiny_models["onnx"], root / "tiny.onnx")
    (root / "scripts").mkdir()
    (root / "scripts" / "s.py").write_text("print('{\"latency_ms\": 1.0}')\n")
    cluster = Cluster(root, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(root / "none")})
    cluster.start_controller("--no-auth", "--db", db)
    yield cluster, db
    cluster.stop_all()


def test_a_nul_in_a_script_argument_is_refused_naming_the_field_and_gc_still_runs(lab) -> None:
    cluster, db = lab
    (cluster.root / "nul.yaml").write_text(NUL_JOB)
    done = cluster.farm("submit", str(cluster.root / "nul.yaml"), "--controller", cluster.address, "--detach")
    assert done.returncode == 2, done.stderr
    assert "nul.yaml:2: workload.args[1]: this field holds a NUL character (U+0000)" in done.stderr, done.stderr
    assert "\x00" not in done.stderr and "Traceback" not in done.stderr

    # the controller refuses it too, whatever a client checked (a raw SubmitJob, the escape kept in the YAML)
    data = (cluster.root / "tiny.onnx").read_bytes()
    sha256 = hashlib.sha256(data).hexdigest()
    with grpc.insecure_channel(cluster.address) as channel:
        stub = farm_pb2_grpc.FarmServiceStub(channel)
        stub.UploadArtifact(iter([farm_pb2.ArtifactUpload(sha256=sha256, size=len(data), name="tiny.onnx", data=data)]),
                            timeout=30)
        models = [farm_pb2.JobModel(entry=0, name="tiny", sha256=sha256)]
        for job_yaml, file_name, says in (
                ('models: [tiny.onnx]\nname: "x\\0y"\n', "job.yaml", "job.yaml:2: name: this field holds a NUL"),
                ('models: [tiny.onnx]\nsim: {image: "farm\\ud800"}\n', "job.yaml",
                 "job.yaml:2: sim.image: this field holds a lone surrogate (U+D800)"),
                ('models: [tiny.onnx]\n', "job\x00.yaml", "the submitted job's file_name: it holds a NUL")):
            with pytest.raises(grpc.RpcError) as refused:
                stub.SubmitJob(farm_pb2.SubmitJobRequest(job_yaml=job_yaml, base_dir="/jobs", file_name=file_name,
                                                         models=models), timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert says in refused.value.details(), refused.value.details()
        ok = stub.SubmitJob(farm_pb2.SubmitJobRequest(job_yaml="models: [tiny.onnx]\n", base_dir="/jobs",
                                                      file_name="job.yaml", models=models), timeout=30)
        assert ok.job_id > 0
    jobs = json.loads(cluster.farm("jobs", "--json", "--controller", cluster.address).stdout)
    assert [j["id"] for j in jobs] == [ok.job_id]  # nothing of the refused ones was stored
    gc = cluster.farm("artifacts", "gc", "--db", db)
    assert gc.returncode == 0, gc.stderr


def test_embedded_submit_refuses_it_alike(lab, tmp_path: Path) -> None:
    cluster, _ = lab
    (cluster.root / "nul.yaml").write_text(NUL_JOB)
    done = cluster.farm("submit", str(cluster.root / "nul.yaml"), "--db", str(tmp_path / "own.db"), "--create",
                        "--detach")
    assert done.returncode == 2, done.stderr
    assert "workload.args[1]: this field holds a NUL character (U+0000)" in done.stderr, done.stderr
