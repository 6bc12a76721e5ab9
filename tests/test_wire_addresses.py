"""M7 (issue 33): a controller address whose port is outside 1..65535 is a usage error naming the flag and the
value, for `farm` commands, the Python API and `farm agent` alike (one parser, farm.proto.addresses), and nothing
is dialled: before, `:99999` dialled 99999 - 65536 and `:-5` dialled 65531, with the FARM_TOKEN bearer token."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from farm.client.api import EXIT_BAD_INPUT, FarmError
from grpc_processes import FARM

TOKEN = "client-m7-0123456789abcdef"


@pytest.fixture
def listener():
    """A listener on a free port P: `P + 65536` is what grpc dialled for a port over 65535."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        s.settimeout(0.5)
        yield s


def _connections(s: socket.socket) -> int:
    got = 0
    while True:
        try:
            conn, _ = s.accept()
        except (TimeoutError, socket.timeout):
            return got
        conn.close()
        got += 1


def test_a_port_out_of_range_is_refused_by_every_command_and_never_dialled(tmp_path: Path, listener) -> None:
    port = listener.getsockname()[1]
    env = {**os.environ, "FARM_CONFIG": str(tmp_path / "none.toml"), "FARM_TOKEN": TOKEN, "FARM_CONTROLLER": ""}
    for value in (f"127.0.0.1:{port + 65536}", "127.0.0.1:-5", f"127.0.0.1:{port},127.0.0.1:0"):
        for args, extra in ((["jobs", "--controller", value], {}), (["status", "1"], {"FARM_CONTROLLER": value}),
                            (["agent", "--controller", value, "--name", "rack", "--work-dir", str(tmp_path / "w")], {})):
            done = subprocess.run([*FARM, *args], capture_output=True, text=True, timeout=120, env={**env, **extra})
            assert done.returncode == EXIT_BAD_INPUT, (args, done.stderr)
            assert "--controller (or FARM_CONTROLLER" in done.stderr, done.stderr
            assert "the port must be a number from 1 to 65535" in done.stderr, done.stderr
            assert value.split(",")[-1] in done.stderr and "Traceback" not in done.stderr, done.stderr
            assert TOKEN not in done.stderr
    assert _connections(listener) == 0  # the token went nowhere


def test_the_python_api_refuses_the_same_addresses(listener, monkeypatch, tmp_path: Path) -> None:
    import farm.api
    from farm.client.remote import RemoteFarm

    monkeypatch.setenv("FARM_CONFIG", str(tmp_path / "none.toml"))
    monkeypatch.setenv("FARM_TOKEN", TOKEN)
    port = listener.getsockname()[1]
    for value in (f"127.0.0.1:{port + 65536}", "127.0.0.1:-5", "127.0.0.1:0", "127.0.0.1:1x"):
        with pytest.raises(FarmError) as refused:
            farm.api.connect(value)
        assert "the port must be a number from 1 to 65535" in str(refused.value) and value in str(refused.value)
        assert refused.value.exit_code == EXIT_BAD_INPUT
        with pytest.raises(FarmError) as direct:
            RemoteFarm(value)
        assert "the port must be a number from 1 to 65535" in str(direct.value)
    assert _connections(listener) == 0


def test_agents_and_clients_share_one_parser() -> None:
    from farm.agents.link import remote_controller
    from farm.client.config import checked_addresses
    from farm.proto import addresses

    assert remote_controller.controller_addresses is addresses.controller_addresses
    assert checked_addresses("a:1, b") == ["a:1", "b:7443"]
    assert addresses.controller_address("[::1]:65535", 1) == "[::1]:65535"
    with pytest.raises(ValueError, match="several controllers"):
        addresses.controller_address("a:1,b:2", 1)


def test_an_agent_built_from_python_refuses_the_same_addresses(listener) -> None:
    from farm.agents.link.remote_controller import AgentDevice, RemoteController

    port = listener.getsockname()[1]
    for value in (f"127.0.0.1:{port + 65536}", ["127.0.0.1:1", "127.0.0.1:-5"]):
        with pytest.raises(ValueError, match="the port must be a number from 1 to 65535"):
            RemoteController(value, name="rack", token=TOKEN, devices=[AgentDevice("rack/sim", "sim", "sim")])
    assert _connections(listener) == 0


def test_an_agent_refuses_plain_tcp_to_another_host(tmp_path) -> None:
    """Issue 33 item 3: off loopback the agent's token goes only over TLS (--tls-ca), or by an explicit waiver."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "FARM_TOKEN": "agent-0123456789abcdef"}
    run = subprocess.run([sys.executable, "-m", "farm.cli.main", "agent", "--controller", "127.0.0.1:7443,10.9.9.9:7443",
                          "--name", "rack", "--work-dir", str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 2, run.stderr
    assert "--controller 10.9.9.9:7443" in run.stderr and "--tls-ca" in run.stderr and "--insecure-plaintext" in run.stderr
