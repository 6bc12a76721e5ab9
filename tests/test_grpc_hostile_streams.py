"""H2 (issue 33): agent streams cannot hold the controller. An unpinned agent token opens Connect streams that
never send their hello, or say hello under many names and then fall silent: the streams waiting for a hello are
capped (per address, and all unpinned tokens together) and cut after --agent-hello-timeout, unpinned agent tokens
together hold at most their share of --max-streams, a silent stream is cut after --agent-idle-timeout, and
meanwhile a client, an admin and a pinned agent are served. A real controller process on loopback with short
deadlines injected by flag; grpc.aio clients (one thread for all the streams).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from farm.agents.link.remote_controller import AgentDevice, RemoteController
from farm.proto.generated import agent_pb2, agent_pb2_grpc, farm_pb2, farm_pb2_grpc
from grpc_processes import Cluster, wait_for

pytestmark = pytest.mark.timeout(300)

CLIENT = "client-h2-0123456789abcdef"
ADMIN = "admin-h2-0123456789abcdef"
UNPINNED = "agent-unpinned-0123456789abcdef"
PINNED = "agent-pinned-0123456789abcdef"
PINNED2 = "agent-pinned2-0123456789abcdef"
MAX_STREAMS = 200  # clients 100, unpinned agent tokens 90, 10 reserved for admins and pinned agents
UNPINNED_POOL = 90
HELLO_LESS_PER_ADDRESS = 16
DEADLINE_S = 3  # --agent-hello-timeout and --agent-idle-timeout, short so the test waits little
PROMPT_S = 20.0  # generous: a busy 2-core machine


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("h2")
    tokens = root / "tokens"
    tokens.write_text(f"client {CLIENT}\nadmin {ADMIN}\nagent {UNPINNED}\nagent {PINNED} rack1\nagent {PINNED2} rack2\n")
    tokens.chmod(0o600)
    cluster = Cluster(root, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(root / "none")})
    cluster.start_controller("--tokens", str(tokens), "--max-streams", str(MAX_STREAMS), "--lease-ttl", "2",
                             "--agent-hello-timeout", str(DEADLINE_S), "--agent-idle-timeout", str(DEADLINE_S))
    yield cluster
    cluster.stop_all()


async def _stream(stub: agent_pb2_grpc.AgentServiceStub, hello: agent_pb2.Hello | None, release: asyncio.Event,
                  welcomed: asyncio.Event | None = None,
                  quiet: asyncio.Event | None = None) -> tuple[bool, grpc.StatusCode, str]:
    """A Connect stream that sends `hello` (or nothing), heartbeats until `quiet` is set (when given), then
    nothing more: (welcomed, status, details)."""
    async def messages():
        if hello is not None:
            yield agent_pb2.AgentMessage(hello=hello)
        while quiet is not None and not quiet.is_set():
            yield agent_pb2.AgentMessage(heartbeat=agent_pb2.Heartbeat())
            await asyncio.sleep(0.5)
        await release.wait()

    call = stub.Connect(messages(), metadata=_bearer(UNPINNED))
    welcome = False
    try:
        async for message in call:
            if message.WhichOneof("kind") == "welcome":
                welcome = True
                if welcomed is not None:
                    welcomed.set()
        return welcome, grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as e:
        return welcome, e.code(), e.details() or ""


def _hello(name: str) -> agent_pb2.Hello:
    return agent_pb2.Hello(agent_name=name, farm_version="0.1.0", protocol_version=1, hostname="flood")


async def _others_are_served(channel: grpc.aio.Channel) -> None:
    """A client's and an admin's call, and a pinned agent's connect, each answered."""
    stub = farm_pb2_grpc.FarmServiceStub(channel)
    for token in (CLIENT, ADMIN):
        await stub.ListJobs(farm_pb2.ListJobsRequest(), metadata=_bearer(token), timeout=PROMPT_S)
    stop = asyncio.Event()

    async def messages():
        yield agent_pb2.AgentMessage(hello=_hello("rack2"))
        await stop.wait()

    call = agent_pb2_grpc.AgentServiceStub(channel).Connect(messages(), metadata=_bearer(PINNED2))
    first = await asyncio.wait_for(call.read(), PROMPT_S)
    assert first.WhichOneof("kind") == "welcome"
    stop.set()
    call.cancel()


def test_streams_that_never_say_hello_are_capped_and_cut_and_others_are_served(lab: Cluster) -> None:
    async def run() -> None:
        release = asyncio.Event()
        async with grpc.aio.insecure_channel(lab.address) as flood_channel, \
                grpc.aio.insecure_channel(lab.address) as channel:
            stub = agent_pb2_grpc.AgentServiceStub(flood_channel)
            streams = [asyncio.create_task(_stream(stub, None, release)) for _ in range(120)]
            while sum(s.done() for s in streams) < 120 - HELLO_LESS_PER_ADDRESS:
                await asyncio.sleep(0.1)
            refused = [s.result() for s in streams if s.done()]
            assert {code for _, code, _ in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}, refused[:3]
            assert all("have not sent their hello number 16, the most one address may" in why
                       for _, _, why in refused), refused[:3]
            await _others_are_served(channel)  # while the 16 are held
            held = await asyncio.wait_for(asyncio.gather(*[s for s in streams if not s.done()]), 60)
            assert len(held) == HELLO_LESS_PER_ADDRESS
            assert {code for _, code, _ in held} == {grpc.StatusCode.DEADLINE_EXCEEDED}, held[:3]
            assert all(f"no hello within {DEADLINE_S} s of opening the agent stream" in why and
                       "--agent-hello-timeout" in why for _, _, why in held), held[:3]
            release.set()
            # cut, they no longer count: the token may open a stream again
            again = asyncio.create_task(_stream(stub, None, asyncio.Event()))
            welcome, code, why = await asyncio.wait_for(again, 60)
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED, why

    asyncio.run(run())
    assert lab.processes[0].alive()
    assert "sent no hello within 3 s; cut (--agent-hello-timeout)" in lab.processes[0].output()


def test_an_unpinned_token_saying_hello_under_many_names_holds_only_its_share_and_silence_is_cut(
        lab: Cluster) -> None:
    pinned = RemoteController(lab.address, name="rack1", token=PINNED, devices=[AgentDevice("rack1/sim", "sim", "sim")])

    async def run() -> None:
        release, quiet = asyncio.Event(), asyncio.Event()
        async with grpc.aio.insecure_channel(lab.address) as flood_channel, \
                grpc.aio.insecure_channel(lab.address) as channel:
            stub = agent_pb2_grpc.AgentServiceStub(flood_channel)
            streams: list[asyncio.Task] = []
            for wave in range(12):  # waves of 10: each says hello at once, so none waits in the hello-less cap
                for n in range(10):
                    welcomed = asyncio.Event()
                    stream = asyncio.create_task(_stream(stub, _hello(f"flood-{wave}-{n}"), release, welcomed, quiet))
                    streams.append(stream)
                    await asyncio.wait([stream, asyncio.create_task(welcomed.wait())], timeout=PROMPT_S,
                                       return_when=asyncio.FIRST_COMPLETED)  # welcomed, or refused
            held = [s for s in streams if not s.done()]
            refused = [s.result() for s in streams if s.done()]
            assert len(held) == UNPINNED_POOL, (len(held), refused[:3])
            # Refused at once; the aio client's request writer races the refusal, and a part of them end with the
            # client's own "Internal error from Core" instead of the status the controller sent (as CANCELLED does
            # for uploads in tests/test_grpc_flood.py); the rest say why.
            codes = [code for _, code, _ in refused]
            assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL}, refused[:3]
            assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 5, refused
            assert all(f"agent tokens without a pinned name hold {UNPINNED_POOL} calls" in why
                       for _, code, why in refused if code == grpc.StatusCode.RESOURCE_EXHAUSTED), refused[:3]
            await _others_are_served(channel)
            quiet.set()  # the flood falls silent, not even a heartbeat: cut after --agent-idle-timeout
            ended = await asyncio.wait_for(asyncio.gather(*held), 60)
            assert all(welcome for welcome, _, _ in ended)
            assert {code for _, code, _ in ended} == {grpc.StatusCode.DEADLINE_EXCEEDED}, ended[:3]
            assert all(f"sent nothing for {DEADLINE_S} s (not even a heartbeat)" in why for _, _, why in ended), ended[:3]
            release.set()

    pinned.start()
    try:
        wait_for(pinned.connected.is_set, 60, "the pinned agent to connect")
        asyncio.run(run())
        # a real agent heartbeats on a clock: idle for longer than the idle deadline, it kept its stream
        assert pinned.connected.is_set() and pinned.reconnects == 0 and pinned.fatal is None
    finally:
        pinned.close()
    assert lab.processes[0].alive()
    assert "its stream is cut (--agent-idle-timeout)" in lab.processes[0].output()


def test_the_caps_keep_a_share_for_admins_and_pinned_agents() -> None:
    from farm.controller.auth import BudgetSettings, CallBudget, Identity

    settings = BudgetSettings(max_streams=100, hello_less=3, hello_less_per_address=2)
    assert (settings.client_pool, settings.unpinned_pool, settings.reserved) == (50, 45, 5)
    assert BudgetSettings().unpinned_pool == 1125  # the default: 1,000 agents on one token, and their downloads
    budget = CallBudget(settings)
    unpinned, pinned, admin = Identity("agent", line=1), Identity("agent", "rack1", line=2), Identity("admin", line=3)
    held = [budget.admit(unpinned, f"ipv4:10.0.0.{n}", "/c")[0] for n in range(45)]
    assert all(held) and "without a pinned name hold 45 calls" in (budget.admit(unpinned, "ipv4:10.0.1.1", "/c")[1] or "")
    assert budget.admit(pinned, "ipv4:10.0.0.1", "/c")[1] is None and budget.admit(admin, "ipv4:10.0.0.1", "/c")[1] is None
    waiting = [budget.await_hello(unpinned, "ipv4:10.0.0.1")[0] for _ in range(2)]
    assert "one address may" in (budget.await_hello(unpinned, "ipv4:10.0.0.1")[1] or "")
    assert budget.await_hello(unpinned, "ipv4:10.0.0.2")[0]
    assert "unpinned agent tokens may have together" in (budget.await_hello(unpinned, "ipv4:10.0.0.3")[1] or "")
    assert budget.await_hello(pinned, "ipv4:10.0.0.1") == ([], None)  # a pinned agent has its own share
    budget.release(waiting[0])
    assert budget.await_hello(unpinned, "ipv4:10.0.0.1")[1] is None
    assert settings.idle_s(7.5) == 60.0 and settings.idle_s(30.0) == 120.0


def test_an_idle_deadline_shorter_than_the_heartbeat_is_refused_at_start(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(tmp_path / "none")})
    done = cluster.farm("controller", "serve", "--no-auth", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "c.db"),
                        "--agent-idle-timeout", "5", "--lease-ttl", "40")
    assert done.returncode == 2, done.stderr
    assert "--agent-idle-timeout 5 s must be longer than the agents' heartbeat interval (10 s" in done.stderr
    bad = cluster.farm("controller", "serve", "--no-auth", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "c.db"),
                       "--agent-hello-timeout", "nan")
    assert bad.returncode == 2 and "--agent-hello-timeout must be a positive number" in bad.stderr, bad.stderr
