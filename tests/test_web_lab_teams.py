"""Low (issue 33): in a `team` lab (--job-sharing team) the dashboard's /lab page names no other team's job: its
running task shows as a busy device ("another team's task"), its queue rows only as a count, its failures not at
all, while the team's own and an admin's view are whole. A real controller with its dashboard (on threads of the test's
process, composed as `farm controller serve --web-listen` composes them), a raw agent holding a lease on the other
team's task."""

from __future__ import annotations

import json
import os
import re
import urllib.request
from pathlib import Path

import pytest

from grpc_processes import in_process_cluster
from raw_agent import RawAgent

pytestmark = pytest.mark.timeout(300)

VISION = "client-vision-lab-0123456789abcdef"
SPEECH = "client-speech-lab-0123456789abcdef"
ADMIN = "admin-lab-0123456789abcdef"
AGENT = "agent-lab-0123456789abcdef"


def _web(base: str, path: str, token: str) -> str:
    request = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return answer.read().decode()


def test_the_lab_page_names_no_other_teams_job(tmp_path: Path, tiny_models, monkeypatch: pytest.MonkeyPatch) -> None:
    from farm.web.compose import DashboardSettings, build_dashboard

    tokens = tmp_path / "tokens"
    tokens.write_text(f"client {VISION} team=vision\nclient {SPEECH} team=speech\nadmin {ADMIN}\nagent {AGENT} rack\n")
    tokens.chmod(0o600)
    os.symlink(tiny_models["onnx"], tmp_path / "tiny.onnx")
    (tmp_path / "vision.yaml").write_text("name: secret-vision\nmodels: [tiny.onnx]\nrepeats: 3\ntargets: [phone1]\n")
    (tmp_path / "speech.yaml").write_text("name: speech-job\nmodels: [tiny.onnx]\n")
    cluster = in_process_cluster(tmp_path, monkeypatch)
    agent = dashboard = None
    try:
        server = cluster.serve_in_process(tokens=tokens, job_sharing="team")
        dashboard = build_dashboard(DashboardSettings("127.0.0.1:0"), server).start()
        agent = RawAgent(cluster.address, "rack", AGENT, devices=["phone1"])
        agent.expect("welcome")
        jobs = {}
        for team, token in (("vision", VISION), ("speech", SPEECH)):
            run = cluster.farm("submit", str(tmp_path / f"{team}.yaml"), "--controller", cluster.address, "--token",
                               token, "--detach", "--json")
            assert run.returncode == 0, run.stderr
            jobs[team] = json.loads(run.stdout)["job"]
        task = agent.lease(target="phone1")  # a vision task, running on phone1
        assert task.job_id == jobs["vision"]
        web = dashboard.url.rstrip("/")
        speech = _web(web, "/lab", SPEECH)
        assert f"/jobs/{jobs['vision']}" not in speech and "secret-vision" not in speech
        assert "another team&#x27;s task" in speech or "another team's task" in speech, speech[:2000]
        pending = re.search(r"Queue \((\d+) pending\)", speech).group(1)  # the vision job's counted, not named
        assert f"/jobs/{jobs['speech']}" in speech
        for whole in (_web(web, "/lab", VISION), _web(web, "/lab", ADMIN)):
            assert f'<a href="/jobs/{jobs["vision"]}">job {jobs["vision"]}</a> task {task.task_id}' in whole
            assert "another team" not in whole and f"Queue ({pending} pending)" in whole
    finally:
        if agent is not None:
            agent.close()
        if dashboard is not None:
            dashboard.stop()
        cluster.stop_all()
