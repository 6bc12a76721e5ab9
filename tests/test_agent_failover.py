"""An agent given several controllers (`farm agent --controller a:1,b:2`): every entry is checked and a bad one
names itself, and the agent connects to the first controller that answers. The kill -9 of the controller an
agent works through, with the agent moving to the other one, is in tests/test_postgres_store.py (two
controllers need one PostgreSQL). The controller here runs on threads of pytest's process and the CLI in-process
(issue 34; a real process per call with `pytest --farm-subprocess`)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from farm.agents.link.remote_controller import MAX_CONTROLLERS, AgentDevice, RemoteController, controller_addresses
from grpc_processes import Cluster, wait_for


def test_a_list_of_controllers_is_read_in_order_and_a_host_alone_gets_the_default_port() -> None:
    assert controller_addresses("a.lab:1, b-2:65535,[::1]:7,c", 50051) == ["a.lab:1", "b-2:65535", "[::1]:7", "c:50051"]
    assert controller_addresses("only:9", 50051) == ["only:9"]


@pytest.mark.parametrize(("given", "named"), [
    ("a:1,,b:2", "controller address 2 is empty"),
    ("a:1,b:0", "controller address 2 ('b:0'): the port must be a number from 1 to 65535"),
    ("a:99999", "controller address 1 ('a:99999'): the port"),
    ("a:1,b:x1", "controller address 2 ('b:x1'): the port"),
    ("a:1,b:١٢", "controller address 2"),  # Arabic-Indic digits pass isdigit() and int()
    ("a:1,b\x1b[31m:2", "controller address 2 ('b\\x1b[31m:2'): 'b\\x1b[31m' is not a host name"),
    ("a:1,/etc/passwd:3", "'/etc/passwd' is not a host name"),
    ("unix:/tmp/s", "('unix:/tmp/s'): the port must be"),
    ("a:1,:2", "controller address 2 (':2'): '' is not a host name"),
    ("[::1:5", "is not a host name"),
    ("a:1,a:1", "controller address 2 ('a:1'): named twice"),
    ("x" * 300 + ":1", "is not a host name"),
    (",".join(f"h{i}:1" for i in range(MAX_CONTROLLERS + 1)), f"at most {MAX_CONTROLLERS}"),
])
def test_a_bad_controller_entry_names_itself(given: str, named: str) -> None:
    with pytest.raises(ValueError) as refused:
        controller_addresses(given, 50051)
    assert named in str(refused.value)
    assert "\x1b" not in str(refused.value)


def test_farm_agent_refuses_a_bad_entry_from_the_flag_and_from_farm_controller(tmp_path: Path, farm) -> None:
    env = {"FARM_CONFIG": str(tmp_path / "none.toml"), "FARM_TOKEN": "", "FARM_CONTROLLER": ""}
    for args, extra in ((["--controller", "127.0.0.1:1,bad host:2"], {}), ([], {"FARM_CONTROLLER": "127.0.0.1:1,h:0"})):
        done = farm("agent", "--name", "rack", "--work-dir", str(tmp_path / "w"), *args, timeout=60, env={**env, **extra})
        assert done.returncode != 0
        assert "controller address 2" in done.stderr and "Traceback" not in done.stderr, done.stderr


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_agent_connects_to_the_first_controller_that_answers(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": ""}, cli_in_process=True)
    cluster.serve_in_process(no_auth=True)
    dead = f"127.0.0.1:{_unused_port()}"  # nothing listens there
    agent = RemoteController([dead, cluster.address], name="rack", token=None,
                             devices=[AgentDevice("rack/sim", "sim", "sim")]).start()
    try:
        wait_for(agent.connected.is_set, 60, "the agent to reach the second controller")
        assert agent.address == cluster.address and agent.reconnects >= 1 and agent.fatal is None
        listed = cluster.farm("agents", "--json", "--controller", cluster.address)
        assert '"name": "rack"' in listed.stdout and '"state": "online"' in listed.stdout
    finally:
        agent.close()
        cluster.stop_all()


def test_a_client_command_given_the_agents_list_talks_to_its_first_controller(tmp_path: Path, farm) -> None:
    done = farm("jobs", "--json", timeout=120, env={"FARM_CONFIG": str(tmp_path / "none.toml"), "FARM_TOKEN": "",
                                                    "FARM_CONTROLLER": "127.0.0.1:1,127.0.0.1:2"})
    assert done.returncode != 0
    assert "cannot reach the controller at 127.0.0.1:1:" in done.stderr, done.stderr
