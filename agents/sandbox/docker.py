"""Sandbox backend that runs each command in its own Docker container.

Limits are the engine's own (NanoCpus, CpusetCpus, Memory with MemorySwap equal to it so
swap is off). Counters come from the container's cgroup files on this host, found through
/proc/<container pid>/cgroup, so the sampler costs a couple of file reads; the engine's
stats API is the fallback when those files cannot be read (e.g. a remote engine).

The kernel removes a container's cgroup the moment its last process exits, taking the
high-water mark with it. With the cgroupfs driver every container therefore gets a private
parent cgroup (cgroup_parent=/farm-sandbox/<token>) that outlives it: the parent's
hierarchical counters (peak memory, CPU, block I/O) are read after exit, then removed in
close(). Under the systemd driver the last values polled while the container ran are used.

Only the Docker Engine API is used (through the `docker` SDK), never the docker CLI.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import secrets
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from farm.agents.sandbox.base import (
    Budget,
    Counters,
    ExitInfo,
    IoTotals,
    MountSpec,
    RunningSandbox,
    SandboxBackend,
    SandboxError,
    CFS_PERIOD_US,
    CpuAccounting,
    applied_cpus,
    cfs_quota_us,
    parse_cpuset,
    pids_limit,
    private_tmp_bytes,
)
from farm.agents.sandbox.docker_image import ensure_default_image, host_runtime_mounts
from farm.agents.sandbox.user_image import mounts as user_image_mounts
from farm.agents.sandbox.cgroup import V1_MAX_SHARES, V2_MAX_WEIGHT
from farm.agents.sandbox.cgroupfs import CgroupFiles, cgroup_mounts, process_cgroups
from farm.agents.sandbox.isolation import INNER_RUN_DIR, RunAs

DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"
CONTAINER_LABEL = "farm.sandbox"  # every container we create carries it, for leak checks
PRIVATE_CGROUP_ROOT = "farm-sandbox"  # top of the per-run parent cgroups (cgroupfs driver)
POLL_INTERVAL_S = 0.1
ENGINE_TIMEOUT_S = 30  # for one Engine API request; stats may take ~2 s on a busy host
KILL_WAIT_S = 10.0
OOM_PEAK_SHARE = 0.9  # memory this close to the limit at a SIGKILL nobody sent: the OOM killer
NOBODY = "65534:65534"  # a root agent's containers run as this unless the sim driver names its run user
PRIVATE_TMP_DIRS = ("/tmp", "/var/tmp")  # writable tmpfs over a read-only root (/dev/shm is the engine's own)
NO_BUDGET_TMP_BYTES = 1 << 30  # a temp mount's size when the run has no memory budget to size it from


def default_run_user() -> str:
    """uid:gid a container starts as: never root; the agent's own user when the agent is not root."""
    return NOBODY if os.geteuid() == 0 else f"{os.geteuid()}:{os.getegid()}"


def hardening(budget: Budget, *, read_only_root: bool) -> dict[str, Any]:
    """The container options that keep a job's code unprivileged: no capabilities, no set-uid gains,
    a pids limit, a read-only root, and temp mounts that cannot hold set-uid or device files and
    are sized from the memory budget (their pages are charged to the container's memory cgroup)."""
    size = private_tmp_bytes(budget) or NO_BUDGET_TMP_BYTES
    return {
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "pids_limit": pids_limit(budget),
        "read_only": read_only_root,
        "tmpfs": {d: f"rw,exec,nosuid,nodev,mode=1777,size={size}" for d in PRIVATE_TMP_DIRS},
        "shm_size": size,
    }


def engine_address() -> str:
    """The address the SDK will talk to, for messages."""
    return os.environ.get("DOCKER_HOST") or DEFAULT_DOCKER_HOST


# ---------------------------------------------------------------------------------------
# cgroup files of one container on this host


def container_cgroup(pid: int, container_id: str) -> CgroupFiles | None:
    """The cgroup of a container's init process, or None when it is not a local container.

    Reads /proc/<pid>/cgroup rather than guessing /docker/<id> or docker-<id>.scope, so it
    holds for any cgroup driver or cgroup_parent. The id check rejects a pid that belongs to
    another machine's engine or was reused after the container exited.
    """
    try:
        v1_paths = process_cgroups(pid)
    except OSError:
        return None
    mounts = cgroup_mounts()
    v2_path = v1_paths.pop("", None)
    if not any(container_id in p for p in [*v1_paths.values(), v2_path or ""]):
        return None
    v1_dirs: dict[str, Path] = {}
    for controller in ("cpu", "cpuacct", "memory", "blkio"):
        mount = next((m for m in mounts if not m.is_v2 and controller in m.controllers), None)
        if mount and controller in v1_paths:
            host_dir = mount.host_dir(v1_paths[controller])
            if host_dir is not None:
                v1_dirs[controller] = host_dir
    v2_dir = None
    if "memory" not in v1_dirs and v2_path is not None:
        # Pure v2 host; on a hybrid host the unified tree has no memory controller.
        mount = next((m for m in mounts if m.is_v2), None)
        if mount:
            v2_dir = mount.host_dir(v2_path)
    if not v1_dirs and v2_dir is None:
        return None
    return CgroupFiles(v1_dirs, v2_dir)


def _private_cgroup_dirs(cgroup_parent: str) -> list[Path]:
    """Every directory a private cgroup_parent occupies, across all hierarchies."""
    dirs = []
    for mount in cgroup_mounts():
        host_dir = mount.host_dir(cgroup_parent)
        if host_dir is not None:
            dirs.append(host_dir)
    return dirs


def _remove_private_cgroup(cgroup_parent: str) -> None:
    """rmdir the per-run parent cgroup in every hierarchy.

    The shared /farm-sandbox above it stays: removing it could race with a concurrent
    run whose engine is creating its own parent there.
    """
    for directory in _private_cgroup_dirs(cgroup_parent):
        try:
            directory.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                raise SandboxError(f"could not remove the run's cgroup {directory}: {exc}") from exc


# ---------------------------------------------------------------------------------------
# network counters of the container's namespace


def _read_net_dev(proc_dir_fd: int) -> tuple[int, int] | None:
    """(rx, tx) bytes over the container's interfaces except loopback.

    Read through a held /proc/<pid> directory fd: it stops working when that process
    exits, so a reused pid can never be read by mistake.
    """
    try:
        fd = os.open("net/dev", os.O_RDONLY, dir_fd=proc_dir_fd)
    except OSError:
        return None
    try:
        text = os.read(fd, 1 << 16).decode(errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)
    rx_total = tx_total = 0
    for line in text.splitlines()[2:]:
        name, _, data = line.partition(":")
        fields = data.split()
        if name.strip() == "lo" or len(fields) < 9 or not (fields[0].isdigit() and fields[8].isdigit()):
            continue
        rx_total += int(fields[0])
        tx_total += int(fields[8])
    return rx_total, tx_total


def _parse_engine_time(stamp: str) -> float | None:
    """Seconds since the epoch from the engine's RFC 3339 timestamps (nanosecond fractions)."""
    if not stamp or stamp.startswith("0001-"):
        return None  # the engine's zero time: never happened
    text = stamp[:-1] + "+00:00" if stamp.endswith("Z") else stamp
    fraction = 0.0
    if "." in text:
        # datetime keeps only microseconds: parse the fraction apart to keep nanoseconds.
        head, _, rest = text.partition(".")
        digits = rest[: len(rest) - len(rest.lstrip("0123456789"))]
        fraction = float("0." + digits) if digits else 0.0
        text = head + rest[len(digits) :]
    try:
        return datetime.fromisoformat(text).timestamp() + fraction
    except ValueError:
        return None


def _normalize_returncode(status_code: int) -> int:
    """Docker reports a signal death as 128+N; subprocess (the other backends) reports -N."""
    if 128 < status_code < 128 + 65:
        return -(status_code - 128)
    return status_code


# ---------------------------------------------------------------------------------------
# the running container


class DockerSandbox(RunningSandbox):
    """One started container. Thread-safe for one sampler calling read_counters while another thread waits."""

    def __init__(self, container: Any, *, private_cgroup_parent: str | None, memory_limit: int | None) -> None:
        self.container = container
        self.container_id: str = container.id
        self._private_cgroup_parent = private_cgroup_parent
        self._memory_limit = memory_limit
        self.started_at = time.monotonic()
        self._lock = threading.Lock()
        self._cgroup: CgroupFiles | None = None
        self._proc_dir_fd: int | None = None
        self._last_net: tuple[int, int] | None = None
        self._last_peak: int | None = None  # kernel high-water mark last seen while running
        self._last_block_io: tuple[int | None, int | None] = (None, None)
        self._max_sampled_memory: int | None = None
        self._last_cpu_ns: int | None = None  # the container's own CPU counter, last seen
        self._last_throttled_ns: int | None = None
        self._oom_kills_seen = 0
        self._killed_by_us = False
        self._closed = False
        self._exit_info: ExitInfo | None = None
        self._saw_pid = False  # once a pid was examined, a missing cgroup means "not local": stop retrying

    def _attach(self) -> None:
        """Find the container's cgroup and hold its /proc dir, once it has a pid."""
        try:
            self.container.reload()
        except Exception:
            return
        pid = int(self.container.attrs.get("State", {}).get("Pid") or 0)
        if pid <= 0:
            return
        self._saw_pid = True
        cgroup = container_cgroup(pid, self.container_id)
        proc_fd: int | None = None
        if cgroup is not None:
            try:
                proc_fd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                proc_fd = None
            # The pid may have been reused between the two reads: check it still is ours.
            if proc_fd is not None and container_cgroup(pid, self.container_id) is None:
                os.close(proc_fd)
                proc_fd = None
        with self._lock:
            self._cgroup = cgroup
            self._proc_dir_fd = proc_fd

    def _final_cgroup(self) -> CgroupFiles | None:
        """The cgroup whose counters survive the container's exit (its private parent)."""
        if self._private_cgroup_parent is None:
            return None
        return _private_parent_files(self._private_cgroup_parent)

    def _poll_kernel(self) -> Counters:
        """Read the container's cgroup and netns; remember what vanishes at exit."""
        with self._lock:
            cgroup, proc_fd = self._cgroup, self._proc_dir_fd
        if cgroup is None:
            return Counters(cpu_ns=None, memory_bytes=None)
        counters = Counters(cpu_ns=cgroup.cpu_ns(), memory_bytes=cgroup.memory_bytes())
        peak = cgroup.peak_memory_bytes()
        oom_kills = cgroup.oom_kills()
        block_io = cgroup.block_io()
        net = _read_net_dev(proc_fd) if proc_fd is not None else None
        throttled = cgroup.throttled_ns()
        with self._lock:
            if counters.cpu_ns is not None:
                self._last_cpu_ns = counters.cpu_ns
            if throttled is not None:
                self._last_throttled_ns = throttled
            if peak is not None:
                self._last_peak = max(peak, self._last_peak or 0)
            if oom_kills:
                self._oom_kills_seen = max(self._oom_kills_seen, oom_kills)
            if block_io != (None, None):
                self._last_block_io = block_io
            if net is not None:
                self._last_net = net
            if counters.memory_bytes is not None:
                self._max_sampled_memory = max(counters.memory_bytes, self._max_sampled_memory or 0)
        return counters

    def read_counters(self) -> Counters:
        if not self._saw_pid and self._exit_info is None:
            self._attach()
        counters = self._poll_kernel()
        if counters.cpu_ns is not None and counters.memory_bytes is not None:
            return counters
        if self._exit_info is not None:
            return counters
        return self._counters_from_engine(counters)

    def _counters_from_engine(self, partial: Counters) -> Counters:
        """The stats API, for when this host cannot read the container's cgroup files."""
        try:
            stats = self.container.stats(stream=False, one_shot=True)
        except Exception:
            return partial
        cpu_ns = (stats.get("cpu_stats") or {}).get("cpu_usage", {}).get("total_usage")
        memory = (stats.get("memory_stats") or {}).get("usage")
        networks = stats.get("networks") or {}
        with self._lock:
            if networks:
                self._last_net = (
                    sum(n.get("rx_bytes", 0) for n in networks.values()),
                    sum(n.get("tx_bytes", 0) for n in networks.values()),
                )
            if memory is not None:
                self._max_sampled_memory = max(int(memory), self._max_sampled_memory or 0)
            max_usage = (stats.get("memory_stats") or {}).get("max_usage")
            if max_usage:
                self._last_peak = max(int(max_usage), self._last_peak or 0)
        return Counters(
            cpu_ns=partial.cpu_ns if partial.cpu_ns is not None else (int(cpu_ns) if cpu_ns is not None else None),
            memory_bytes=partial.memory_bytes if partial.memory_bytes is not None else (int(memory) if memory is not None else None),
        )

    def thread_ids(self) -> list[int]:
        with self._lock:
            cgroup = self._cgroup
        return cgroup.thread_ids() if cgroup is not None else []

    def cpu_accounting(self) -> CpuAccounting:
        """The private parent's counter survives the container (exact); else the last one polled."""
        final = self._final_cgroup()
        cpu_ns = final.cpu_ns() if final is not None and final.exists() else None
        with self._lock:
            return CpuAccounting(cpu_ns if cpu_ns is not None else self._last_cpu_ns, self._last_throttled_ns,
                                 final.pressure_some_us() if final is not None else None)

    def _is_running(self) -> bool:
        self.container.reload()
        return bool(self.container.attrs["State"].get("Running"))

    def wait(self, timeout_s: float | None, cancel_check: Callable[[], bool] | None = None) -> ExitInfo:
        if self._exit_info is not None:
            return self._exit_info
        deadline = None if timeout_s is None else self.started_at + timeout_s
        timed_out = canceled = False
        if not self._saw_pid:
            self._attach()
        try:
            while self._is_running():
                self._poll_kernel()  # keeps peak, I/O and net readings fresh up to the exit
                if cancel_check is not None and cancel_check():
                    canceled = True
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    timed_out = True
                    break
                time.sleep(POLL_INTERVAL_S)
            if timed_out or canceled:
                self.kill()
            self._wait_for_exit()
        except SandboxError:
            raise
        except Exception as exc:
            raise SandboxError(f"lost track of container {self.container_id[:12]}: {exc}") from exc
        self._exit_info = self._collect_exit(timed_out=timed_out, canceled=canceled)
        return self._exit_info

    def _wait_for_exit(self) -> None:
        result = self.container.wait(timeout=KILL_WAIT_S if self._killed_by_us else None)
        if result.get("Error"):
            raise SandboxError(f"the Docker engine could not wait for container {self.container_id[:12]}: {result['Error']}")
        self.container.reload()

    def _collect_exit(self, *, timed_out: bool, canceled: bool) -> ExitInfo:
        state = self.container.attrs["State"]
        final = self._final_cgroup()
        peak, peak_source = None, "sampled"
        block_read, block_write = self._last_block_io
        oom_kills = self._oom_kills_seen
        if final is not None and final.exists():
            peak = final.peak_memory_bytes()
            final_read, final_write = final.block_io()
            block_read = final_read if final_read is not None else block_read
            block_write = final_write if final_write is not None else block_write
            oom_kills = max(oom_kills, final.oom_kills() or 0)
        if peak is not None:
            peak_source = "kernel"
        elif self._last_peak is not None:
            peak, peak_source = self._last_peak, "kernel"  # last watermark seen before exit: a lower bound
        else:
            peak = self._max_sampled_memory
        if peak is not None and self._memory_limit is not None:
            # A parent cgroup's mark may carry a few KiB of kernel memory over the child's limit.
            peak = min(peak, self._memory_limit)
        oom_killed = bool(state.get("OOMKilled")) or oom_kills > 0
        if (not oom_killed and not self._killed_by_us and int(state.get("ExitCode", -1)) == 128 + signal.SIGKILL
                and peak is not None and self._memory_limit and peak >= OOM_PEAK_SHARE * self._memory_limit):
            # the kernel's oom_kill count left with the container's cgroup and the engine missed the event:
            # a SIGKILL nobody sent, with memory at the limit, is the OOM killer (as the cgroup backend judges)
            oom_killed = True
        started = _parse_engine_time(state.get("StartedAt", ""))
        finished = _parse_engine_time(state.get("FinishedAt", ""))
        if started is not None and finished is not None and finished >= started:
            wall_s = finished - started  # the engine's own stamps: no API or polling delay
        else:
            wall_s = time.monotonic() - self.started_at
        killed_by_us = self._killed_by_us and not oom_killed
        returncode = None if killed_by_us else _normalize_returncode(int(state.get("ExitCode", -1)))
        net_rx, net_tx = self._last_net if self._last_net is not None else (None, None)
        return ExitInfo(
            returncode=returncode,
            oom_killed=oom_killed,
            timed_out=timed_out,
            canceled=canceled,
            output=self._logs(),
            wall_s=wall_s,
            peak_memory_bytes=peak,
            peak_memory_source=peak_source,
            io=IoTotals(block_read_bytes=block_read, block_write_bytes=block_write, net_rx_bytes=net_rx, net_tx_bytes=net_tx),
        )

    def _logs(self) -> str:
        try:
            raw = self.container.logs(stdout=True, stderr=True)
        except Exception as exc:
            return f"[farm: could not read the container's output: {exc}]"
        return raw.decode("utf-8", errors="replace")

    def kill(self) -> None:
        import docker.errors

        self._killed_by_us = True
        try:
            self.container.kill()
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # 409: not running any more, which is what we wanted
                raise SandboxError(f"could not kill container {self.container_id[:12]}: {exc}") from exc

    def applied_limits(self) -> Budget:
        """The limits the engine recorded for this container."""
        return _budget_from_host_config(self.container.attrs.get("HostConfig") or {})

    def close(self) -> None:
        import docker.errors

        if self._closed:
            return
        self._closed = True
        with self._lock:
            proc_fd, self._proc_dir_fd = self._proc_dir_fd, None
        if proc_fd is not None:
            os.close(proc_fd)
        try:
            self.container.remove(force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            raise SandboxError(f"could not remove container {self.container_id[:12]}: {exc}") from exc
        finally:
            if self._private_cgroup_parent is not None:
                _remove_private_cgroup(self._private_cgroup_parent)


def _claim_parent_weight(cgroup_parent: str) -> None:
    """Give the per-run parent (and /farm-sandbox above it) farm's full CPU weight, as the cgroup backend
    does, so a container competes with the host's tasks as one heavy group; best effort."""
    for mount in cgroup_mounts():
        if not (mount.is_v2 or "cpu" in mount.controllers):
            continue
        top = mount.host_dir("/" + PRIVATE_CGROUP_ROOT)
        run = mount.host_dir(cgroup_parent)
        for directory, (name, value) in ((top, _WEIGHT[mount.is_v2]), (run, _WEIGHT[mount.is_v2])):
            if directory is None:
                continue
            try:
                directory.mkdir(exist_ok=True)
                (directory / name).write_text(value)
            except OSError:
                pass  # no cpu controller there (v2 without +cpu): the engine's default weight stays


_WEIGHT = {False: ("cpu.shares", str(V1_MAX_SHARES)), True: ("cpu.weight", str(V2_MAX_WEIGHT))}


def _private_parent_files(cgroup_parent: str) -> CgroupFiles | None:
    mounts = cgroup_mounts()
    v1_dirs: dict[str, Path] = {}
    for controller in ("cpuacct", "memory", "blkio"):
        mount = next((m for m in mounts if not m.is_v2 and controller in m.controllers), None)
        host_dir = mount.host_dir(cgroup_parent) if mount else None
        if host_dir is not None:
            v1_dirs[controller] = host_dir
    v2_dir = None
    if "memory" not in v1_dirs:
        mount = next((m for m in mounts if m.is_v2), None)
        v2_dir = mount.host_dir(cgroup_parent) if mount else None
    if not v1_dirs and v2_dir is None:
        return None
    return CgroupFiles(v1_dirs, v2_dir)


def _budget_from_host_config(host_config: dict[str, Any]) -> Budget:
    nano_cpus = int(host_config.get("NanoCpus") or 0)
    cpu_quota, cpu_period = int(host_config.get("CpuQuota") or 0), int(host_config.get("CpuPeriod") or 0)
    if nano_cpus > 0:
        cpus: float | None = nano_cpus / 1e9
    elif cpu_quota > 0:
        cpus = cpu_quota / (cpu_period or 100_000)
    elif host_config.get("CpusetCpus"):
        cpus = float(len(parse_cpuset(host_config["CpusetCpus"])))  # whole cores: the cpuset is the budget
    else:
        cpus = None
    memory = int(host_config.get("Memory") or 0)
    return Budget(cpus=cpus, cpuset=host_config.get("CpusetCpus") or None, memory_bytes=memory or None)


def _budget_key(budget: Budget) -> tuple[float | None, str | None, int | None]:
    return (budget.cpus, budget.cpuset, budget.memory_bytes)


# ---------------------------------------------------------------------------------------
# the backend


class DockerBackend(SandboxBackend):
    """Runs each command in a fresh container of `image` (the farm default image if None)."""

    name = "docker"
    approximate = False
    own_root = True  # a container: its own root, the run directory at a fixed path inside, its own user
    takes_images = True

    @classmethod
    def create(cls, *, image: str | None = None, user_image: bool = False,
               writable_root: bool = False) -> "DockerBackend":
        return cls(image=image, user_image=user_image, read_only_root=not writable_root)

    def __init__(
        self,
        image: str | None = None,
        *,
        network_mode: str = "none",
        mount_host_runtime: bool = True,
        client: Any = None,
        user_image: bool = False,
        run_user: str | None = None,
        read_only_root: bool = True,
    ) -> None:
        # network_mode "none": models are profiled offline; pass "bridge" for a job that needs the network.
        # mount_host_runtime=False suits a self-contained user image whose own /usr must not be hidden.
        # run_user "uid:gid": the container's first process already is it (no root step an image could use).
        self.image = image
        self.run_user = run_user or default_run_user()
        self.read_only_root = read_only_root
        self.network_mode = network_mode
        self.mount_host_runtime = mount_host_runtime
        # user_image: the image's own /usr and Python stay visible; farm's runtime is under /farm-host (user_image.py)
        self.user_image = user_image
        self._client = client
        self._image_ready: str | None = None
        self._cgroup_driver: str | None = None
        self._applied: dict[tuple[float | None, str | None, int | None], Budget] = {}

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            import docker
            import docker.errors
        except ImportError:
            return ("the `docker` Python package is not installed: pip install 'docker>=7' (farm[docker]) "
                    "or choose backend: cgroup")
        address = engine_address()
        try:
            client = docker.from_env(timeout=10)
        except docker.errors.DockerException as exc:
            return f"no Docker engine answers at {address} ({_first_line(exc)}): start dockerd or choose backend: cgroup"
        try:
            client.ping()
        except PermissionError:
            return f"permission denied on the Docker engine at {address}: run as root or join the docker group, or choose backend: cgroup"
        except Exception as exc:
            if "Permission denied" in str(exc):
                return f"permission denied on the Docker engine at {address}: run as root or join the docker group, or choose backend: cgroup"
            return f"no Docker engine answers at {address}: start dockerd or choose backend: cgroup"
        finally:
            client.close()
        return None

    @property
    def client(self) -> Any:
        if self._client is None:
            import docker

            try:
                self._client = docker.from_env(timeout=ENGINE_TIMEOUT_S)
            except docker.errors.DockerException as exc:
                raise SandboxError(f"no Docker engine answers at {engine_address()}: {_first_line(exc)}") from exc
        return self._client

    def _image(self) -> str:
        if self._image_ready is None:
            self._image_ready = self.image if self.image else ensure_default_image(self.client)
        return self._image_ready

    def _uses_cgroupfs_driver(self) -> bool:
        if self._cgroup_driver is None:
            try:
                self._cgroup_driver = str(self.client.info().get("CgroupDriver", ""))
            except Exception:
                self._cgroup_driver = ""
        return self._cgroup_driver == "cgroupfs"

    def _mounts(self, mounts: list[MountSpec]) -> list[Any]:
        from docker.types import Mount

        by_target: dict[str, tuple[str, bool]] = {}  # target -> (source, read-only)
        if self.user_image:
            for source, target in user_image_mounts():
                by_target[target] = (source, True)
        elif self.mount_host_runtime:
            for spec in host_runtime_mounts():
                by_target[str(spec.path)] = (str(spec.path), True)
        for spec in mounts:
            # the caller's choice (e.g. read-write) wins; a spec with a target appears there, not at its own path
            by_target[str(Path(spec.target or spec.path).absolute())] = (str(Path(spec.path).absolute()), spec.read_only)
        return [
            Mount(target=target, source=source, type="bind", read_only=read_only)
            for target, (source, read_only) in sorted(by_target.items())
        ]

    # A container: the run directory at a fixed path inside, no descriptor handed down, the container started as
    # the run's user itself (start(user=...)).
    def own_isolation(self, run_user: str | None) -> tuple[Path, str] | None:
        user = f"{run_user} (a uid of its own)" if run_user else "the agent's own"
        return INNER_RUN_DIR, f"container, user {user}"

    def result_channel(self) -> int | None:
        return None  # a container cannot be handed a descriptor: its harness writes out.json, seen by it alone

    def run_dir_mount(self, run_dir: Path, inner: Path | None) -> MountSpec:
        return MountSpec(run_dir, read_only=False, target=inner)

    def run_cwd(self, run_dir: Path, inner: Path | None) -> Path:
        return inner or run_dir

    def open_run_dir_mode(self, agent_is_root: bool) -> int:
        return 0o777 if agent_is_root else 0o700  # a root agent's containers run as nobody, who writes the result

    def command_as(self, argv: list[str], env: dict[str, str], run_as: RunAs,
                   isolated_env: dict[str, str] | None) -> tuple[list[str], dict[str, str]]:
        return argv, env  # the container starts as the run's user (start(user=...)): nothing to drop

    def image_path_env(self) -> str | None:
        """The PATH the image itself sets (its venv first, say), for a run in the user's image."""
        import docker.errors

        try:
            env = self.client.images.get(self._image()).attrs.get("Config", {}).get("Env") or []
        except docker.errors.DockerException as exc:
            raise SandboxError(f"image {self._image()} is not on the Docker engine: load or build it there first "
                               f"({_first_line(exc)})") from exc
        return next((e.split("=", 1)[1] for e in env if e.startswith("PATH=")), None)

    def start(
        self,
        argv: list[str],
        budget: Budget,
        *,
        env: dict[str, str],
        cwd: Path,
        mounts: list[MountSpec],
        pass_fds: tuple[int, ...] = (),
        user: str | None = None,
    ) -> RunningSandbox:
        import docker.errors

        if not argv:
            raise SandboxError("nothing to run: argv is empty")
        if pass_fds:
            raise SandboxError("a container cannot be handed descriptors: its result comes back as a file")
        image = self._image()
        token = secrets.token_hex(6)
        # A per-run parent cgroup keeps the kernel's peak after the container's own cgroup is gone.
        private_parent = f"/{PRIVATE_CGROUP_ROOT}/{token}" if self._uses_cgroupfs_driver() else None
        limits: dict[str, Any] = {}
        quota = cfs_quota_us(budget)
        if quota is not None:
            # the same short CFS period as the cgroup backend, so both throttle alike
            limits["cpu_period"] = CFS_PERIOD_US
            limits["cpu_quota"] = quota
        if budget.cpuset:
            limits["cpuset_cpus"] = budget.cpuset
        limits["cpu_shares"] = V1_MAX_SHARES  # the engine maps it to cpu.weight on cgroup v2
        if private_parent is not None:
            _claim_parent_weight(private_parent)
        if budget.memory_bytes is not None:
            limits["mem_limit"] = int(budget.memory_bytes)
            limits["memswap_limit"] = int(budget.memory_bytes)  # equal to memory: no swap
        try:
            container = self.client.containers.create(
                image,
                # farm's command is the entrypoint: an image's ENTRYPOINT never runs, before it or instead
                entrypoint=[argv[0]],
                command=list(argv[1:]),
                name=f"farm-{token}",
                environment=dict(env),
                working_dir=str(cwd),
                user=user or self.run_user,
                mounts=self._mounts(mounts),
                **hardening(budget, read_only_root=self.read_only_root),
                network_mode=self.network_mode,
                auto_remove=False,  # we read the exit status and OOMKilled after exit
                labels={CONTAINER_LABEL: "1"},
                cgroup_parent=private_parent,
                detach=True,
                **limits,
            )
        except docker.errors.DockerException as exc:
            if private_parent is not None:
                _remove_private_cgroup(private_parent)  # the weighted parent made for it above
            if isinstance(exc, docker.errors.ImageNotFound):
                raise SandboxError(f"image {image} is not on the Docker engine: load or build it there first") from exc
            raise SandboxError(f"the Docker engine refused the container: {_first_line(exc)}") from exc
        sandbox = DockerSandbox(container, private_cgroup_parent=private_parent, memory_limit=budget.memory_bytes)
        try:
            sandbox.started_at = time.monotonic()
            container.start()
        except docker.errors.DockerException as exc:
            sandbox.close()
            raise SandboxError(f"the Docker engine could not start {argv[0]}: {_first_line(exc)}") from exc
        sandbox._attach()
        self._applied[_budget_key(budget)] = sandbox.applied_limits()
        return sandbox

    def effective_limits(self, budget: Budget) -> Budget:
        """What the engine recorded for the last container started with this budget.

        Before any such container, the rounding predicted: whole microseconds of quota, whole bytes.
        """
        applied = self._applied.get(_budget_key(budget))
        if applied is not None:
            return dataclasses.replace(applied, exclusive=budget.exclusive)
        return Budget(
            cpus=applied_cpus(budget),
            cpuset=budget.cpuset or None,
            memory_bytes=int(budget.memory_bytes) if budget.memory_bytes is not None else None,
            exclusive=budget.exclusive,
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
