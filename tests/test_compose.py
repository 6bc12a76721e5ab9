"""farm.client.compose: controllers and agents built from settings run in this process, several at once, each with
its own hooks and clock; leases expire when the injected clock passes their TTL, not after real seconds."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from farm.client import open_farm
from farm.client.compose import (
    AgentSettings, ControllerSettings, EmbeddedSettings, build_agent, build_controller, build_embedded,
)
from farm.client.config import Credentials
from farm.client.errors import FarmError
from grpc_processes import sleep_job

pytestmark = pytest.mark.timeout(240)


class Clock:
    """The time a controller judges leases and deadlines by; a test moves it."""

    def __init__(self, now: float = 1_000_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _remote(server) -> object:
    return open_farm(server.address, credentials=Credentials())


def test_two_controllers_and_an_agent_run_in_one_process(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    job = sleep_job(tmp_path, tiny_models["onnx"], tasks=2, seconds=0.05)
    with build_controller(ControllerSettings(db=tmp_path / "a.db", no_auth=True)) as a, \
            build_controller(ControllerSettings(db=tmp_path / "b.db", no_auth=True)) as b:
        assert a.port != b.port and a.hooks is not b.hooks
        with build_agent(AgentSettings(controller=a.address, name="here", work_dir=tmp_path / "work",
                                       backend="process")):
            with _remote(a) as farm:
                submitted = farm.submit(job)
                assert farm.wait(submitted.job)
                assert farm.job(submitted.job).status == "completed"
                assert len(farm.results(submitted.job)) == 2
                assert [agent.name for agent in farm.agents()] == ["here"]
        with _remote(b) as other:
            assert other.jobs() == [] and other.agents() == []  # b shares nothing with a


def test_a_lease_expires_when_the_injected_clock_passes_its_ttl(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    clock = Clock()
    job = sleep_job(tmp_path, tiny_models["onnx"], tasks=1, seconds=0.05)
    with build_controller(ControllerSettings(db=tmp_path / "c.db", no_auth=True, lease_ttl_s=30), clock=clock) as c:
        with _remote(c) as farm:
            job_id = farm.submit(job).job
        (target,) = sqlite3.connect(tmp_path / "c.db").execute("SELECT target FROM tasks").fetchone()
        controller = c.farm.controller
        assert controller.lease("gone", {target}) is not None  # an agent that leases, then never speaks again
        clock.now += 29
        assert controller.expire_leases() == 0  # within its TTL on the controller's clock
        clock.now += 2
        assert controller.expire_leases() == 1  # past it: lost, queued again as attempt 2
        row = sqlite3.connect(tmp_path / "c.db").execute(
            "SELECT status, attempts FROM tasks WHERE job_id = ?", (job_id,)).fetchone()
        assert row == ("pending", 1)


def test_each_controller_calls_only_its_own_quarantine_hooks(tmp_path: Path) -> None:
    heard: dict[str, list[str]] = {"a": [], "b": []}
    with build_controller(ControllerSettings(db=tmp_path / "a.db", no_auth=True)) as a, \
            build_controller(ControllerSettings(db=tmp_path / "b.db", no_auth=True)) as b:
        a.hooks.on_quarantine(lambda device, reason: heard["a"].append(device))
        b.hooks.on_quarantine(lambda device, reason: heard["b"].append(device))
        a.farm.controller.quarantine("phone-1", "too hot")
    assert heard == {"a": ["phone-1"], "b": []}


def test_bad_settings_are_refused_before_anything_listens(tmp_path: Path) -> None:
    with pytest.raises(FarmError, match="needs a tokens file"):
        build_controller(ControllerSettings(db=tmp_path / "x.db"))
    with pytest.raises(FarmError, match="only allowed on a loopback address"):
        build_controller(ControllerSettings(db=tmp_path / "x.db", listen="0.0.0.0:0", no_auth=True))
    with pytest.raises(FarmError, match="--models-root relative: give an absolute path"):
        build_controller(ControllerSettings(db=tmp_path / "x.db", no_auth=True, models_roots=[Path("relative")]))
    with pytest.raises(FarmError, match="--name 'no spaces'"):
        build_agent(AgentSettings(controller="127.0.0.1:1", name="no spaces"))
    with pytest.raises(FarmError, match="--sim-slots 0"):
        build_agent(AgentSettings(controller="127.0.0.1:1", name="a", sim_slots=0))
    with pytest.raises(FarmError, match="without --tls-ca"):
        build_agent(AgentSettings(controller="192.0.2.1:50051", name="a"))
    assert not (tmp_path / "x.db").exists()  # refused before any store was opened


def test_an_embedded_farm_from_settings_runs_a_job_here(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    job = sleep_job(tmp_path, tiny_models["onnx"], tasks=1, seconds=0.05)
    with build_embedded(EmbeddedSettings(db=tmp_path / "e.db", backend="process")) as farm:
        job_id = farm.submit(job).job
        assert farm.wait(job_id)
        assert farm.job(job_id).status == "completed"


def test_an_agents_heartbeats_fall_due_on_its_injected_clock(tmp_path: Path) -> None:
    """RemoteController's outgoing stream: a heartbeat leaves when the injected clock says one is due, never on
    real seconds (an interval of 1000 s is never reached in real time here)."""
    import queue

    from farm.agents.link.remote_controller import RemoteController
    from farm.proto.generated import agent_pb2

    clock = Clock()
    runner = build_agent(AgentSettings(controller="127.0.0.1:1", name="beats", work_dir=tmp_path / "w"), clock=clock)
    assert runner.clock is clock  # what start() hands to the agent's link
    link = RemoteController("127.0.0.1:1", name="beats", token=None, devices=[], clock=clock)
    link._heartbeat_interval_s = 1000.0
    outbox: queue.Queue = queue.Queue()
    stream = link._outgoing(outbox)
    assert next(stream).HasField("hello")
    outbox.put(agent_pb2.AgentMessage(drain=agent_pb2.Drain()))
    assert next(stream).HasField("heartbeat")  # the first follows the hello at once
    assert next(stream).HasField("drain")
    outbox.put(agent_pb2.AgentMessage(drain=agent_pb2.Drain()))
    clock.now += 999
    assert next(stream).HasField("drain")  # not due yet on the injected clock
    outbox.put(agent_pb2.AgentMessage(drain=agent_pb2.Drain()))
    clock.now += 1
    assert next(stream).HasField("heartbeat")  # due: it leaves before what was queued
    assert next(stream).HasField("drain")


def test_an_agent_whose_heartbeat_clock_stands_still_loses_its_lease(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    """Two agents on threads here against one controller whose clock the test moves: the one whose heartbeat
    clock runs renews its lease past the controller's next move; the one whose clock stands still stops renewing
    with its stream open (a hung agent, without killing a process) and its task is lost at the next sweep."""
    from grpc_processes import wait_for

    def lease(db: Path) -> tuple[str, int, float | None]:
        with sqlite3.connect(db) as c:
            return c.execute("SELECT status, attempts, lease_expires_at FROM tasks").fetchone()

    for name, agent_clock in (("live", None), ("stuck", Clock())):
        clock = Clock()
        db = tmp_path / f"{name}.db"
        job = sleep_job(tmp_path, tiny_models["onnx"], tasks=1, seconds=120, name=f"{name}.yaml")
        settings = ControllerSettings(db=db, no_auth=True, lease_ttl_s=30, heartbeat_interval_s=0.1)
        with build_controller(settings, clock=clock) as c:
            agent = build_agent(AgentSettings(controller=c.address, name=name, work_dir=tmp_path / name,
                                              backend="process"), **({"clock": agent_clock} if agent_clock else {}))
            with agent:
                with _remote(c) as farm:
                    farm.submit(job)
                wait_for(lambda: lease(db)[0] == "running", 60, f"{name} to lease the task")
                clock.now += 20
                if agent_clock is None:
                    # a heartbeat on the agent's real clock renews the lease from the controller's new time
                    wait_for(lambda: (lease(db)[2] or 0) >= clock.now + 30, 60, "a heartbeat to renew the lease")
                clock.now += 20  # 40 s after the lease on the controller's clock: past the lease unless renewed
                c.farm.controller.expire_leases()
                status, attempts, _ = lease(db)
                if agent_clock is None:
                    assert (status, attempts) == ("running", 1)
                else:
                    assert status == "pending" or attempts >= 2, (status, attempts)
                agent.stop_runs()
