"""The one interface every sandbox backend (cgroup, docker, process) implements.

A backend starts one command under a CPU and memory budget and lets the telemetry
sampler read its counters while it runs. Everything else (what runs, how results are
read back) is the sim driver's business, so a backend stays small.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from farm.agents.sandbox.isolation import RunAs, isolated_argv, user_argv


def parse_cpuset(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]."""
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cores.extend(range(int(lo), int(hi) + 1))
        else:
            cores.append(int(part))
    return sorted(set(cores))


def format_cpuset(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)


@dataclass
class Budget:
    """What the job asked for. None means no limit of that kind."""

    cpus: float | None = None  # CPU time quota in cores, e.g. 0.5
    cpuset: str | None = None  # e.g. "0" or "0-1": cores the run may use
    memory_bytes: int | None = None  # swap is always off when this is set
    exclusive: bool = False  # ask the kernel for the cpuset's cores alone (best effort)
    pids: int | None = None  # processes and threads at once; None: RUN_PIDS_LIMIT


# Processes + threads a run may hold at once, on every backend: ML runtimes start a few dozen
# threads; a fork bomb is stopped here instead of filling the host's process table.
RUN_PIDS_LIMIT = 1024


def pids_limit(budget: Budget) -> int:
    return budget.pids if budget.pids is not None else RUN_PIDS_LIMIT


def private_tmp_bytes(budget: Budget) -> int | None:
    """The size of each private temp mount: the run's memory budget (tmpfs pages are charged to it),
    so a run can never write more into memory than it may hold; None when no memory budget."""
    return budget.memory_bytes


# The CPU quota, for every backend. A 10 ms period (the kernel's default is 100 ms) throttles
# within one short inference: with 100 ms, a 0.5-CPU budget lets a 1 ms model run unthrottled
# for its first 50 ms.
CFS_PERIOD_US = 10_000
MIN_QUOTA_US = 1000


def whole_cores(cpus: float | None) -> int | None:
    """A budget of whole cores (1.0, 2.0) as an int; None for a fraction or no budget."""
    return int(cpus) if cpus is not None and cpus >= 1 and float(cpus).is_integer() else None


def cfs_quota_us(budget: Budget) -> int | None:
    """The CFS quota (µs per CFS_PERIOD_US) for a budget, or None when no quota applies.

    A whole number of cores given as a cpuset of that many cores needs no quota: the cpuset is
    the budget, as a device's own cores are, and a quota would only throttle the bursts of the
    process's other threads (issue 10). A fraction stays a quota.
    """
    if budget.cpus is None:
        return None
    n = whole_cores(budget.cpus)
    if n is not None and budget.cpuset and len(parse_cpuset(budget.cpuset)) <= n:
        return None
    return max(MIN_QUOTA_US, round(budget.cpus * CFS_PERIOD_US))


def applied_cpus(budget: Budget) -> float | None:
    """The CPU budget in cores as the quota applies it (rounded to whole µs), or as the cpuset gives it
    (no more cores than it has: 4 asked on a 2-core host are 2)."""
    quota = cfs_quota_us(budget)
    if quota is not None:
        return quota / CFS_PERIOD_US
    if budget.cpus is not None and budget.cpuset:
        return float(min(budget.cpus, len(parse_cpuset(budget.cpuset))))
    return budget.cpus


@dataclass
class CpuAccounting:
    """What the run's CPU did, read once after it exited (before its sandbox is released)."""

    cpu_ns: int | None  # CPU time of everything in the sandbox
    throttled_ns: int | None = None  # time its quota held it back
    pressure_some_us: int | None = None  # cgroup v2 cpu.pressure "some" total of the run's cgroup


@dataclass
class Counters:
    """One reading of the sandbox's counters, for the sampler."""

    cpu_ns: int | None  # cumulative CPU time of everything in the sandbox
    memory_bytes: int | None  # current memory charged to the sandbox


@dataclass
class IoTotals:
    block_read_bytes: int | None = None
    block_write_bytes: int | None = None
    net_rx_bytes: int | None = None
    net_tx_bytes: int | None = None


@dataclass
class ExitInfo:
    returncode: int | None  # None when killed by us (timeout, cancel)
    oom_killed: bool
    timed_out: bool
    canceled: bool
    output: str  # combined stdout+stderr, tail-trimmed by the caller
    wall_s: float
    peak_memory_bytes: int | None = None  # exact high-water mark where the backend has one
    peak_memory_source: str = "sampled"  # "kernel" | "rusage" | "sampled"
    io: IoTotals = field(default_factory=IoTotals)
    pids_limit_hit: bool = False  # the kernel refused a fork or a thread at the run's pids limit


@dataclass
class MountSpec:
    """A host path the sandboxed command must see (at `target`, or at the same path)."""

    path: Path
    read_only: bool = True
    target: Path | None = None  # where it appears inside, so a host path need not show in argv or ps


class SandboxError(Exception):
    """The backend could not set up the sandbox (an infrastructure problem, not the job's)."""


class RunningSandbox(abc.ABC):
    """A started command under a budget."""

    started_at: float  # time.monotonic() at spawn
    exclusive: str | None = None  # what a request for the cores alone was granted, in words

    @abc.abstractmethod
    def read_counters(self) -> Counters: ...

    @abc.abstractmethod
    def wait(self, timeout_s: float | None, cancel_check=None) -> ExitInfo:
        """Wait for exit; kill on timeout or when cancel_check() returns True."""

    @abc.abstractmethod
    def kill(self) -> None: ...

    def thread_ids(self) -> list[int]:
        """The run's threads now (for their scheduler wait times); [] where the backend cannot tell."""
        return []

    def cpu_accounting(self) -> CpuAccounting:
        """The run's CPU time (and throttling, pressure where the backend has them), after wait()."""
        return CpuAccounting(self.read_counters().cpu_ns)

    def exit_waits(self) -> dict[int, int]:
        """Run-queue waits (thread -> ns) read as the run exited, which a sampler's last interval misses; {} when
        the backend cannot read them (a warm run's main thread is read before it is reaped)."""
        process = getattr(self, "process", None)
        return dict(getattr(process, "exit_waits", {}) or {})

    @abc.abstractmethod
    def close(self) -> None:
        """Release every resource (cgroup dirs, containers). Safe to call twice."""


class SandboxBackend(abc.ABC):
    """One way to run a command under a budget. What the sim driver asks of it is its capabilities, never its name:
    approximate  limits and peaks are best-effort;
    own_root     the command runs in a root file system of its own (a container): the run directory is mounted
                 at a fixed path inside, no descriptor can be handed down, and the sandbox starts it as the run's
                 user itself (start(user=...));
    takes_images it runs a job in an image (sim.image, sim.build);
    warm_capable a built-in benchmark may start forked from a kept harness."""

    name: str
    approximate: bool = False  # True when limits and peaks are best-effort
    own_root: bool = False
    takes_images: bool = False

    @classmethod
    def create(cls, *, image: str | None = None, user_image: bool = False,
               writable_root: bool = False) -> "SandboxBackend":
        """The backend, ready to start runs; only a backend that takes images uses `image`, and only one with a root
        of its own `writable_root` (sim.writable_root: the job's own root file system writable)."""
        return cls()

    @classmethod
    def unenforced_cpus(cls, cpus: float | None) -> str | None:
        """Why this backend cannot hold each inference to `cpus` CPUs, or None when it can."""
        return None

    @classmethod
    @abc.abstractmethod
    def unavailable_reason(cls) -> str | None:
        """None when this backend can run here, else a sentence saying why not."""

    @abc.abstractmethod
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
        """Spawn argv inside a fresh sandbox. Raises SandboxError on setup failure. pass_fds: descriptors the
        command inherits (the result's channel; a container can be handed none). user "uid:gid": who a container's
        first process is (the run's own uid); the other backends switch user in argv itself."""

    def effective_limits(self, budget: Budget) -> Budget:
        """The budget as really applied (a backend may round or drop parts)."""
        return budget

    # What a run's set-up asks the backend, one method per way the backends differ (agents/sim/driver.py asks
    # these, never the name). The defaults are a command on the host's own file system; a container (own_root)
    # overrides each.
    def own_isolation(self, run_user: str | None) -> tuple[Path, str] | None:
        """Where the run directory appears in the backend's own root and how the run is isolated, in words (the
        run's user named, or None: the agent's own); None: on the host's file system, where the sim driver's user
        and namespaces isolate it."""
        return None

    def result_channel(self) -> int | None:
        """A descriptor the run's harness writes its result to, opened here before any of the run's code starts
        (no path a run can write); None: the harness writes out.json in its own run directory."""
        return os.memfd_create("farm-result", os.MFD_CLOEXEC)

    def run_dir_mount(self, run_dir: Path, inner: Path | None) -> MountSpec:
        """How the run directory (the model and the script folder, staged) is given to the run."""
        return MountSpec(run_dir, read_only=False)

    def run_cwd(self, run_dir: Path, inner: Path | None) -> Path:
        """The run's working directory as start() takes it."""
        return run_dir

    def open_run_dir_mode(self, agent_is_root: bool) -> int:
        """The run directory's mode when the run is the agent's own user (no uid of its own)."""
        return 0o700

    def command_as(self, argv: list[str], env: dict[str, str], run_as: RunAs,
                   isolated_env: dict[str, str] | None) -> tuple[list[str], dict[str, str]]:
        """argv and env that start the command as `run_as`: in namespaces of its own when
        isolated_env is given (the run_world settings), else by switching user only."""
        if isolated_env is not None:
            return isolated_argv(argv, run_as), {**env, **isolated_env}
        return user_argv(argv, run_as), env

    def image_path_env(self) -> str | None:
        """The PATH the backend's image sets, for a run in the user's image; None: no image of its own."""
        return None

    # A backend whose isolation a run forked by a kept harness can enter (agents/sandbox/warm.py) says so; the
    # others (docker: the run lives in a container) start every run cold.
    warm_capable: bool = False

    def start_warm(self, warm: Any, budget: Budget, *, env: dict[str, str], cwd: Path) -> RunningSandbox:  # warm: a warm.WarmLaunch (warm.py builds on this module)
        """The run forked by warm's zygote inside a fresh sandbox, held exactly as start() holds a process."""
        raise SandboxError(f"the {self.name} backend starts every run cold")
