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
