"""The docker sandbox backend against a real engine (started by the tests when none runs).

The sandboxed commands are `python -c` run with the host's interpreter, which the container
sees through the backend's read-only runtime mounts.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from farm.agents.sandbox.base import Budget, ExitInfo, MountSpec
from farm.agents.sandbox.docker import CONTAINER_LABEL, CgroupFiles, DockerBackend, DockerSandbox
from farm.agents.sandbox.docker_image import ensure_default_image

try:
    from tests.docker_engine import ensure_engine
except ImportError:  # tests/ is not a package: pytest put it on sys.path itself
    from docker_engine import ensure_engine

MIB = 2**20


@pytest.fixture(scope="module")
def engine() -> None:
    reason = ensure_engine()
    if reason is not None:
        pytest.skip(reason)
    backend_reason = DockerBackend.unavailable_reason()
    if backend_reason is not None:
        pytest.skip(backend_reason)


@pytest.fixture
def backend(engine: None) -> Iterator[DockerBackend]:
    backend = DockerBackend()
    yield backend
    backend.client.close()


def run_python(
    backend: DockerBackend,
    code: str,
    budget: Budget,
    *,
    timeout_s: float | None = 60,
    mounts: list[MountSpec] | None = None,
    env: dict[str, str] | None = None,
) -> ExitInfo:
    sandbox = backend.start(
        [sys.executable, "-c", code], budget, env=env or {}, cwd=Path("/tmp"), mounts=mounts or []
    )
    try:
        return sandbox.wait(timeout_s)
    finally:
        sandbox.close()


@pytest.mark.docker
def test_allocating_past_the_limit_is_oom_killed_with_peak_at_the_limit(backend: DockerBackend) -> None:
    limit = 128 * MIB
    touch_300_mib = (
        "b = bytearray(300 * 2**20)\n"
        "for i in range(0, len(b), 4096):\n"
        "    b[i] = 1\n"
        "print('survived')"
    )
    info = run_python(backend, touch_300_mib, Budget(memory_bytes=limit))
    assert info.oom_killed, info
    assert info.returncode not in (0, None)
    assert "survived" not in info.output
    assert info.peak_memory_source == "kernel"
    assert info.peak_memory_bytes is not None
    assert 0.9 * limit <= info.peak_memory_bytes <= limit


# The 0.5 vs 1 CPU wall-time ratio is shown end to end, for every backend, in test_sim_budget.py.


@pytest.mark.docker
def test_counters_are_read_while_it_runs(backend: DockerBackend) -> None:
    code = "import time\nheld = bytearray(32 * 2**20)\nend = time.time() + 1.5\nwhile time.time() < end:\n    pass"
    sandbox = backend.start([sys.executable, "-c", code], Budget(cpus=1.0, memory_bytes=256 * MIB), env={}, cwd=Path("/tmp"), mounts=[])
    try:
        time.sleep(0.4)
        first = sandbox.read_counters()
        time.sleep(0.4)
        second = sandbox.read_counters()
        info = sandbox.wait(30)
    finally:
        sandbox.close()
    assert first.cpu_ns is not None and second.cpu_ns is not None
    assert second.cpu_ns > first.cpu_ns > 0
    assert first.memory_bytes is not None and first.memory_bytes > 0
    assert second.memory_bytes is not None and second.memory_bytes >= 32 * MIB
    assert info.returncode == 0
    assert info.peak_memory_bytes is not None and info.peak_memory_bytes >= 32 * MIB
    assert info.io.net_rx_bytes == 0 and info.io.net_tx_bytes == 0  # network_mode none: loopback only


@pytest.mark.docker
def test_a_user_image_is_used_as_given(engine: None) -> None:
    probe = DockerBackend()
    user_image = ensure_default_image(probe.client)  # stands in for an image the user built
    backend = DockerBackend(image=user_image)
    sandbox = backend.start([sys.executable, "-c", "print('from the user image')"], Budget(), env={}, cwd=Path("/tmp"), mounts=[])
    try:
        assert sandbox.container.attrs["Config"]["Image"] == user_image
        info = sandbox.wait(30)
    finally:
        sandbox.close()
    assert info.returncode == 0, info
    assert "from the user image" in info.output


@pytest.mark.docker
def test_a_missing_user_image_is_a_sandbox_error(engine: None) -> None:
    from farm.agents.sandbox.base import SandboxError

    backend = DockerBackend(image="farm-no-such-image:never")
    with pytest.raises(SandboxError, match="not on the Docker engine"):
        backend.start(["/bin/true"], Budget(), env={}, cwd=Path("/tmp"), mounts=[])


@pytest.mark.docker
def test_close_leaves_no_container_and_no_cgroup(backend: DockerBackend) -> None:
    import docker.errors

    sandbox = backend.start([sys.executable, "-c", "print(1)"], Budget(memory_bytes=64 * MIB), env={}, cwd=Path("/tmp"), mounts=[])
    assert isinstance(sandbox, DockerSandbox)
    container_id = sandbox.container_id
    private_parent = sandbox._private_cgroup_parent
    sandbox.wait(30)
    sandbox.close()
    sandbox.close()  # twice is fine
    with pytest.raises(docker.errors.NotFound):
        backend.client.containers.get(container_id)
    leftovers = backend.client.containers.list(all=True, filters={"label": CONTAINER_LABEL, "id": container_id})
    assert leftovers == []
    if private_parent is not None:
        assert not any(Path(mount, private_parent.lstrip("/")).exists() for mount in Path("/sys/fs/cgroup").iterdir())


@pytest.mark.docker
def test_env_cwd_mounts_and_exit_status_reach_the_container(backend: DockerBackend, tmp_path: Path) -> None:
    code = (
        "import os, sys\n"
        "open(os.path.join(os.environ['OUT_DIR'], 'seen.txt'), 'w').write(os.getcwd())\n"
        "sys.exit(3)"
    )
    uid, gid = (int(n) for n in backend.run_user.split(":"))
    os.chown(tmp_path, uid, gid)  # the container runs as the run user, never root: give it the folder, as farm does
    sandbox = backend.start(
        [sys.executable, "-c", code],
        Budget(),
        env={"OUT_DIR": str(tmp_path)},
        cwd=tmp_path,
        mounts=[MountSpec(tmp_path, read_only=False)],
    )
    try:
        info = sandbox.wait(30)
    finally:
        sandbox.close()
    assert info.returncode == 3, info
    assert not info.oom_killed
    assert (tmp_path / "seen.txt").read_text() == str(tmp_path)


@pytest.mark.docker
def test_timeout_and_cancel_kill_the_container(backend: DockerBackend) -> None:
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    sandbox = backend.start(sleeper, Budget(), env={}, cwd=Path("/tmp"), mounts=[])
    try:
        timed = sandbox.wait(1.0)
    finally:
        sandbox.close()
    assert timed.timed_out and not timed.canceled and timed.returncode is None
    assert timed.wall_s < 10

    sandbox = backend.start(sleeper, Budget(), env={}, cwd=Path("/tmp"), mounts=[])
    cancel_at = time.monotonic() + 0.5
    try:
        canceled = sandbox.wait(None, cancel_check=lambda: time.monotonic() >= cancel_at)
    finally:
        sandbox.close()
    assert canceled.canceled and not canceled.timed_out and canceled.returncode is None


@pytest.mark.docker
def test_effective_limits_are_read_back_from_the_engine(backend: DockerBackend) -> None:
    budget = Budget(cpus=0.5, cpuset="0", memory_bytes=96 * MIB)
    sandbox = backend.start([sys.executable, "-c", "pass"], budget, env={}, cwd=Path("/tmp"), mounts=[])
    try:
        host_config = sandbox.container.attrs["HostConfig"]
        assert host_config["MemorySwap"] == host_config["Memory"]  # swap off
        sandbox.wait(30)
    finally:
        sandbox.close()
    assert backend.effective_limits(budget) == Budget(cpus=0.5, cpuset="0", memory_bytes=96 * MIB)


@pytest.mark.docker
def test_unavailable_reason_names_the_address_and_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("docker")
    address = f"unix://{tmp_path}/no-engine.sock"
    monkeypatch.setenv("DOCKER_HOST", address)
    reason = DockerBackend.unavailable_reason()
    assert reason is not None
    assert address in reason and "start dockerd" in reason


def test_cgroup_v2_files_are_read(tmp_path: Path) -> None:
    # This host may be cgroup v1 only: the v2 readers are checked on files shaped like the kernel's.
    (tmp_path / "cpu.stat").write_text("usage_usec 1500\nuser_usec 1000\nsystem_usec 500\n")
    (tmp_path / "memory.current").write_text("4096\n")
    (tmp_path / "memory.peak").write_text("8192\n")
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    (tmp_path / "io.stat").write_text("8:0 rbytes=100 wbytes=20 rios=1 wios=1 dbytes=0 dios=0\n8:16 rbytes=5 wbytes=7\n")
    files = CgroupFiles({}, tmp_path)
    assert files.cpu_ns() == 1_500_000
    assert files.memory_bytes() == 4096
    assert files.peak_memory_bytes() == 8192
    assert files.oom_kills() == 1
    assert files.block_io() == (105, 27)


def test_cgroup_v1_files_are_read(tmp_path: Path) -> None:
    for controller in ("cpuacct", "memory", "blkio"):
        (tmp_path / controller).mkdir()
    (tmp_path / "cpuacct" / "cpuacct.usage").write_text("123456\n")
    (tmp_path / "memory" / "memory.usage_in_bytes").write_text("4096\n")
    (tmp_path / "memory" / "memory.max_usage_in_bytes").write_text("8192\n")
    (tmp_path / "memory" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    (tmp_path / "blkio" / "blkio.throttle.io_service_bytes_recursive").write_text(
        "8:0 Read 100\n8:0 Write 20\n8:0 Sync 120\n8:0 Total 120\nTotal 120\n"
    )
    files = CgroupFiles({c: tmp_path / c for c in ("cpuacct", "memory", "blkio")}, None)
    assert files.cpu_ns() == 123456
    assert files.memory_bytes() == 4096
    assert files.peak_memory_bytes() == 8192
    assert files.oom_kills() == 2
    assert files.block_io() == (100, 20)
