"""M1 (issue 33): an agent given `--controller fake,real` goes round its list on any error. The first controller
(one that does not know the agent's token: an old, a wrong or a hostile address) answers UNAUTHENTICATED; the agent
says so in its log and connects to the next one, with backoff, instead of exiting. Only when every controller of
its list refused it does it stop, saying why. Real `farm controller serve` and `farm agent` processes."""

from __future__ import annotations

import json

import pytest

from grpc_processes import Cluster, wait_for

pytestmark = pytest.mark.timeout(240)

AGENT = "agent-m1-0123456789abcdef"
ADMIN = "admin-m1-0123456789abcdef"
STRANGER = "agent-stranger-0123456789abcdef"


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("m1")
    (root / "real.tokens").write_text(f"agent {AGENT} rack\nadmin {ADMIN}\n")
    (root / "fake.tokens").write_text(f"agent {STRANGER} rack\n")  # it does not know the agent's token
    for name in ("real.tokens", "fake.tokens"):
        (root / name).chmod(0o600)
    cluster = Cluster(root, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(root / "none")})
    cluster.start_controller("--tokens", str(root / "fake.tokens"), db=root / "fake.db", name="fake")
    fake = cluster.address
    cluster.start_controller("--tokens", str(root / "real.tokens"), db=root / "real.db", name="real")
    yield cluster, fake, cluster.address
    cluster.stop_all()


def _agent(cluster: Cluster, name: str, controllers: str, token: str):
    return cluster.spawn(f"agent-{name}", "agent", "--controller", controllers, "--name", "rack", "--token", token,
                         "--work-dir", str(cluster.root / f"work-{name}"))


def test_an_agent_refused_by_its_first_controller_connects_to_the_next(two) -> None:
    cluster, fake, real = two
    agent = _agent(cluster, "rounds", f"{fake},{real}", AGENT)
    try:
        def online() -> bool:
            listed = cluster.farm("agents", "--json", "--controller", real, "--token", ADMIN)
            return listed.returncode == 0 and any(a["name"] == "rack" and a["state"] == "online"
                                                  for a in json.loads(listed.stdout))
        wait_for(online, 90, "the agent to connect to the second controller", interval=0.5)
        assert agent.alive()
        log = agent.output()
        assert f"the controller at {fake} refused this agent" in log, log
        assert f"trying the next controller, {real}, in about" in log and "(1 of 2 refused this agent)" in log, log
        assert f"connected to controller {real}" in log, log
    finally:
        agent.stop()


def test_an_agent_every_controller_refuses_stops_and_says_so(two) -> None:
    cluster, fake, real = two
    agent = _agent(cluster, "nobody", f"{fake},{real}", "agent-unknown-0123456789abcdef")
    try:
        wait_for(lambda: not agent.alive(), 90, "the agent to stop")
        assert agent.process.returncode != 0
        log = agent.output()
        assert "every controller this agent was given refused it; the last:" in log, log
        assert f"trying the next controller, {real}" in log and f"the controller at {real} refused this agent" in log
    finally:
        agent.stop()
