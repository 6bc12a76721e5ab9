"""N8: an agent name pinned to a token in the tokens file cannot be taken by an unpinned agent token,
so a hostile rack host cannot end another agent's session. Real controller and agent processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from grpc_processes import Cluster, wait_for

pytestmark = pytest.mark.timeout(240)

PINNED = "agent-pinned-0123456789abcdef"
UNPINNED = "agent-unpinned-0123456789abcdef"


def test_an_unpinned_agent_token_cannot_take_a_pinned_agents_name(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"agent {PINNED} rack1\nagent {UNPINNED}\n")
    tokens.chmod(0o600)
    cluster = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(tmp_path / "none")})
    try:
        cluster.start_controller("--tokens", str(tokens))
        rightful = cluster.start_agent("rack1", token=PINNED)
        wait_for(lambda: "connected to controller" in rightful.output(), 60, "rack1 to connect")
        impostor = cluster.start_agent("rack1", token=UNPINNED)
        impostor.process.wait(60)
        assert impostor.process.returncode == 2
        assert "agent name 'rack1' belongs to a token pinned to it" in impostor.output(), impostor.output()
        other = cluster.start_agent("rack9", token=UNPINNED)  # any name no token is pinned to is still its to use
        wait_for(lambda: "connected to controller" in other.output(), 60, "rack9 to connect")
        assert rightful.alive() and "ended this agent's session" not in rightful.output()
        assert rightful.output().count("connected to controller") == 1  # its session was never taken
    finally:
        cluster.stop_all()
