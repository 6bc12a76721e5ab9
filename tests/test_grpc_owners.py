"""N11: jobs have owners. Two client tokens of different teams against a real controller: in a `team` lab
one cannot see, read or cancel the other's jobs (they are as good as absent); in a `shared` lab (the
default) it may read them and still not cancel them; a teammate may; an admin sees and cancels all.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from farm.proto.generated import farm_pb2, farm_pb2_grpc
from grpc_processes import Cluster

pytestmark = pytest.mark.timeout(300)

VISION = "client-vision-0123456789abcdef"
VISION2 = "client-vision2-0123456789abcdef"
SPEECH = "client-speech-0123456789abcdef"
ADMIN = "admin-owners-0123456789abcdef"


def _lab(tmp_path: Path, tiny_models, *extra: str) -> Cluster:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"client {VISION} team=vision\nclient+script {VISION2} team=vision\nclient {SPEECH} team=speech\n"
                      f"admin {ADMIN}\n")
    tokens.chmod(0o600)
    if not (tmp_path / "tiny.onnx").exists():
        os.symlink(tiny_models["onnx"], tmp_path / "tiny.onnx")
    (tmp_path / "job.yaml").write_text("models: [tiny.onnx]\nsim: {backend: process}\n")
    cluster = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(tmp_path / "none")})
    cluster.start_controller("--tokens", str(tokens), *extra)
    return cluster


def _submit(cluster: Cluster, token: str) -> int:
    run = cluster.farm("submit", str(cluster.root / "job.yaml"), "--controller", cluster.address, "--token", token,
                       "--detach", "--json")
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)["job"]


def _call(cluster: Cluster, method: str, token: str, request) -> object:
    with grpc.insecure_channel(cluster.address) as channel:
        return getattr(farm_pb2_grpc.FarmServiceStub(channel), method)(
            request, metadata=[("authorization", f"Bearer {token}")], timeout=30)


def _code(cluster: Cluster, method: str, token: str, request) -> grpc.StatusCode:
    try:
        _call(cluster, method, token, request)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def _web(base: str, path: str, token: str, post: bool = False) -> tuple[int, str]:
    request = urllib.request.Request(base + path, data=b"" if post else None,
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _listed(cluster: Cluster, token: str) -> set[int]:
    return {j.id for j in _call(cluster, "ListJobs", token, farm_pb2.ListJobsRequest()).jobs}


def test_in_a_team_lab_another_teams_jobs_are_invisible(tmp_path: Path, tiny_models) -> None:
    cluster = _lab(tmp_path, tiny_models, "--job-sharing", "team", "--web-listen", "127.0.0.1:0")
    try:
        vision, speech = _submit(cluster, VISION), _submit(cluster, SPEECH)
        with cluster.db() as db:
            owners = db.execute("SELECT id, submitted_by, team FROM jobs ORDER BY id").fetchall()
        assert [(i, t) for i, _, t in owners] == [(vision, "vision"), (speech, "speech")]
        assert all(len(o) == 16 and o not in (VISION, SPEECH) for _, o, _ in owners)  # an id, never the token

        job = farm_pb2.JobRequest(job_id=vision)
        for method, request in (("GetJob", job), ("GetResults", job), ("CancelJob", job)):
            assert _code(cluster, method, SPEECH, request) == grpc.StatusCode.NOT_FOUND, method
        for method, request in (("Report", farm_pb2.ReportRequest(job=vision, html=True)),
                                ("Rank", farm_pb2.RankRequest(job=vision)),
                                ("Calibrate", farm_pb2.CalibrateRequest(job=vision))):
            with pytest.raises(grpc.RpcError) as hidden:  # as a job that does not exist: no more is said
                _call(cluster, method, SPEECH, request)
            assert hidden.value.details() == f"no job {vision} in this farm; `farm jobs` lists them", method
        with grpc.insecure_channel(cluster.address) as channel:
            stub = farm_pb2_grpc.FarmServiceStub(channel)
            mine = stub.WatchJob(job, metadata=[("authorization", f"Bearer {VISION}")], timeout=30)
            assert next(mine).id == vision
            mine.cancel()
            with pytest.raises(grpc.RpcError) as watched:
                next(stub.WatchJob(job, metadata=[("authorization", f"Bearer {SPEECH}")], timeout=30))
        assert watched.value.code() == grpc.StatusCode.NOT_FOUND
        assert _listed(cluster, SPEECH) == {speech}
        assert _listed(cluster, VISION2) == {vision}  # the teammate's
        assert _listed(cluster, ADMIN) == {vision, speech}
        # the real CLI (the Python API against a controller) follows the same rule
        shown = cluster.farm("jobs", "--json", "--controller", cluster.address, "--token", SPEECH)
        assert shown.returncode == 0 and [j["job"] for j in json.loads(shown.stdout)] == [speech], shown.stdout
        status = cluster.farm("status", str(vision), "--json", "--controller", cluster.address, "--token", SPEECH)
        assert status.returncode != 0 and f"no job {vision}" in status.stderr
        # nothing changed: the speech token's refused cancel left the vision job queued
        assert _call(cluster, "GetJob", VISION, job).status == "queued"
        # the dashboard too: the list, the page, the download and the cancel button
        web = re.search(r"dashboard on (http://\S+)/", cluster.processes[0].output()).group(1)
        assert _web(web, "/jobs?part=list", SPEECH)[0] == 200
        assert f"/jobs/{vision}" not in _web(web, "/jobs?part=list", SPEECH)[1]
        assert f"/jobs/{vision}" in _web(web, "/jobs?part=list", VISION2)[1]
        for path in (f"/jobs/{vision}", f"/jobs/{vision}/results.json", f"/api/jobs/{vision}"):
            assert _web(web, path, SPEECH)[0] == 404, path
            assert _web(web, path, ADMIN)[0] == 200, path
        assert _web(web, f"/jobs/{vision}/cancel", SPEECH, post=True)[0] == 404
        assert _call(cluster, "GetJob", VISION, job).status == "queued"
        assert _call(cluster, "CancelJob", VISION2, job).job_id == vision  # a teammate may cancel it
    finally:
        cluster.stop_all()


def test_in_a_shared_lab_others_read_but_only_the_team_or_an_admin_cancels(tmp_path: Path, tiny_models) -> None:
    cluster = _lab(tmp_path, tiny_models, "--web-listen", "127.0.0.1:0")  # --job-sharing shared, the default
    try:
        vision, speech = _submit(cluster, VISION), _submit(cluster, SPEECH)
        job = farm_pb2.JobRequest(job_id=vision)
        assert _call(cluster, "GetJob", SPEECH, job).id == vision
        assert _code(cluster, "GetResults", SPEECH, job) == grpc.StatusCode.OK
        assert _listed(cluster, SPEECH) == {vision, speech}
        with pytest.raises(grpc.RpcError) as refused:
            _call(cluster, "CancelJob", SPEECH, job)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "team vision" in refused.value.details() and "an admin" in refused.value.details()
        cancel = cluster.farm("cancel", str(vision), "--controller", cluster.address, "--token", SPEECH)
        assert cancel.returncode != 0 and "only its owner" in cancel.stderr, cancel.stderr
        web = re.search(r"dashboard on (http://\S+)/", cluster.processes[0].output()).group(1)
        assert _web(web, f"/jobs/{vision}", SPEECH)[0] == 200  # read: shared
        assert _web(web, f"/jobs/{vision}/cancel", SPEECH, post=True)[0] == 403  # cancel: never
        assert _call(cluster, "GetJob", VISION, job).status == "queued"  # nothing changed
        lab_job = _submit(cluster, ADMIN)  # an admin's job is the lab's own: read by all, cancelled by admins only
        assert _call(cluster, "GetJob", SPEECH, farm_pb2.JobRequest(job_id=lab_job)).id == lab_job
        with pytest.raises(grpc.RpcError) as lab_refused:
            _call(cluster, "CancelJob", SPEECH, farm_pb2.JobRequest(job_id=lab_job))
        assert "the lab's own" in lab_refused.value.details()
        assert _call(cluster, "CancelJob", ADMIN, farm_pb2.JobRequest(job_id=speech)).job_id == speech
        assert _call(cluster, "GetJob", SPEECH, farm_pb2.JobRequest(job_id=speech)).status == "canceled"
    finally:
        cluster.stop_all()


def test_a_team_in_the_tokens_file_is_checked(tmp_path: Path) -> None:
    from farm.controller.auth import TokenFileError, TokenTable

    good = tmp_path / "good"
    good.write_text(f"client {VISION} team=vision\nagent {ADMIN}x rack1\n")
    table = TokenTable.from_file(good)
    assert table.lookup(VISION).team == "vision" and table.lookup(f"{ADMIN}x").agent_name == "rack1"
    for bad in (f"client {VISION} team=a/b\n", f"client {VISION} team=a team=b\n", f"client {VISION} x y\n"):
        (tmp_path / "bad").write_text(bad)
        with pytest.raises(TokenFileError):
            TokenTable.from_file(tmp_path / "bad")
