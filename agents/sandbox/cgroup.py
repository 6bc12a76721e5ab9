"""Sandbox backend on Linux control groups, v1 and v2, written to directly through cgroupfs.

The kernel enforces the budget (CFS quota, cpuset, memory limit with swap off) and keeps
the exact high-water mark of memory, so the peak needs no sampling luck.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from farm.agents.sandbox.base import (
    CFS_PERIOD_US, Budget, Counters, CpuAccounting, ExitInfo, IoTotals, MountSpec, RunningSandbox, SandboxBackend,
    SandboxError, applied_cpus, cfs_quota_us, pids_limit,
)
from farm.agents.sandbox.cgroupfs import CgroupFiles, cgroup_mounts, process_cgroups, read_int
from farm.agents.sandbox.process_tree import ReapedProcess
from farm.agents.sandbox.warm import WarmLaunch

V1_CONTROLLERS = ("cpu", "cpuacct", "cpuset", "memory", "blkio", "pids")
V2_CONTROLLERS = ("cpu", "cpuset", "memory", "io", "pids")
# The shell joins the cgroups first, then becomes the command: nothing runs outside the budget.
JOIN_AND_EXEC = 'for f in $FARM_CGROUP_PROCS; do echo $$ > "$f" || exit 97; done; exec "$@"'
JOIN_FAILED_EXIT = 97
MIN_WARM_LIMIT_BYTES = 1 << 20  # a budget below what the zygote shares still gets a limit the kernel enforces


@dataclass
class CgroupLayout:
    """Where each controller lives: v1 has one directory per controller, v2 one for all."""

    version: int
    roots: dict[str, Path]  # controller -> directory under which farm makes its cgroups


def _read(path: Path) -> str:
    return path.read_text()


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def detect_layout() -> CgroupLayout | str:
    """The usable hierarchy, or a sentence saying why none is."""
    mounts = cgroup_mounts()
    own = process_cgroups()
    forced = os.environ.get("FARM_CGROUP_VERSION")
    v1 = {}
    for mount in mounts:
        if mount.is_v2:
            continue
        for c in V1_CONTROLLERS:
            if c in mount.controllers and c not in v1:
                v1[c] = mount.mount_point / own.get(c, "/").lstrip("/") / "farm"
    if forced != "2" and all(c in v1 for c in ("cpu", "cpuacct", "cpuset", "memory")):
        for c, root in v1.items():
            try:
                root.mkdir(exist_ok=True)
            except OSError as e:
                return f"cgroup v1 {c} hierarchy is not writable ({root}: {e.strerror}); run the agent as root or choose backend: docker or process"
        return CgroupLayout(1, v1)
    v2_mount = next((m.mount_point for m in mounts if m.is_v2), None)
    if v2_mount is None:
        return "no cgroup hierarchy with cpu, cpuset and memory controllers is mounted"
    available = set(_read(v2_mount / "cgroup.controllers").split())
    missing = [c for c in ("cpu", "cpuset", "memory") if c not in available]
    if missing:
        return f"cgroup v2 at {v2_mount} lacks the {', '.join(missing)} controller(s) (they may be bound to v1)"
    parent = Path(os.environ.get("FARM_CGROUP_PARENT", v2_mount / "farm"))
    try:
        parent.mkdir(exist_ok=True)
        _enable_v2_controllers(v2_mount, parent)
    except OSError as e:
        return f"cannot prepare cgroup v2 parent {parent}: {e.strerror}; run as root or set FARM_CGROUP_PARENT to a delegated cgroup"
    return CgroupLayout(2, {"": parent})


def _enable_v2_controllers(mount: Path, parent: Path) -> None:
    """Children of `parent` need cpu/cpuset/memory/io enabled in every ancestor's subtree_control."""
    chain = [parent]
    while chain[-1] != mount:
        chain.append(chain[-1].parent)
    for directory in reversed(chain):  # root first
        available = set(_read(directory / "cgroup.controllers").split())
        wanted = " ".join(f"+{c}" for c in V2_CONTROLLERS if c in available)
        _write(directory / "cgroup.subtree_control", wanted)


# A device's cores belong to the model: the run's cgroup (and farm's parent, which competes with
# the host's other tasks) gets the largest CPU weight, so a stray task on its cores takes ~0.4 %
# of them instead of half (v1 cpu.shares 262144 vs 1024 each; v2 cpu.weight 10000 vs 100).
V1_MAX_SHARES = 262_144
V2_MAX_WEIGHT = 10_000


def claim_cpu_weight(layout: CgroupLayout, dirs: dict[str, Path]) -> None:
    run = dirs["cpu"] if layout.version == 1 else dirs[""]
    name, value = ("cpu.shares", str(V1_MAX_SHARES)) if layout.version == 1 else ("cpu.weight", str(V2_MAX_WEIGHT))
    try:  # the parent may be a delegated cgroup whose own weight only its owner sets: best effort
        _write(run.parent / name, value)
    except OSError:
        pass
    if (run / name).exists():
        _write(run / name, value)


def claim_exclusive_cores(layout: CgroupLayout, dirs: dict[str, Path], budget: Budget) -> str:
    """Ask for the run's cores alone; best effort. Returns what the kernel granted, in words."""
    if not budget.cpuset:
        return "not exclusive: the run has no cpuset"
    if layout.version == 2:
        d = dirs[""]
        try:
            _write(d / "cpuset.cpus.exclusive", budget.cpuset)
        except OSError:
            pass  # older kernels: the partition takes cpuset.cpus alone
        try:
            _write(d / "cpuset.cpus.partition", "root")
            state = _read(d / "cpuset.cpus.partition").strip()
        except OSError as e:
            return f"not exclusive: cpuset.cpus.partition=root refused ({e.strerror})"
        return "exclusive: cgroup v2 partition root" if state == "root" else f"not exclusive: partition is {state}"
    # v1's cpu_exclusive only keeps sibling cpusets off the cores, never the root's tasks, and
    # needs every ancestor exclusive too: say so rather than claim what it cannot give.
    try:
        _write(dirs["cpuset"] / "cpuset.cpu_exclusive", "1")
    except OSError as e:
        return f"not exclusive: cgroup v1 cpuset.cpu_exclusive refused ({e.strerror}; its parent is not exclusive)"
    return "partly exclusive: cgroup v1 cpu_exclusive keeps other cpusets off, not the root cgroup's tasks"


class CgroupSandbox(RunningSandbox):
    def __init__(self, layout: CgroupLayout, dirs: dict[str, Path], process: ReapedProcess,
                 inherited_bytes: int = 0) -> None:
        self.layout = layout
        self.dirs = dirs
        self.process = process
        # a warm run's memory it holds uncharged here (the zygote's, shared at the fork): counted in its figures
        self.inherited_bytes = inherited_bytes
        self.started_at = process.started_at
        self.files = (CgroupFiles({c: dirs[c] for c in ("cpu", "cpuacct", "memory", "blkio") if c in dirs}, None)
                      if layout.version == 1 else CgroupFiles({}, dirs[""]))
        self._closed = False

    # --- counters -------------------------------------------------------
    def _dir(self, controller: str) -> Path:
        return self.dirs[controller] if self.layout.version == 1 else self.dirs[""]

    def read_counters(self) -> Counters:
        memory = self.files.memory_bytes()
        return Counters(self.files.cpu_ns(), None if memory is None else memory + self.inherited_bytes)

    def thread_ids(self) -> list[int]:
        return self.files.thread_ids()

    def cpu_accounting(self) -> CpuAccounting:
        return CpuAccounting(self.files.cpu_ns(), self.files.throttled_ns(), self.files.pressure_some_us())

    def oom_kills(self) -> int:
        kills = self.files.oom_kills()
        if kills is not None:
            return kills
        # Older v1 kernels lack the oom_kill counter: a SIGKILL after hitting the limit is an OOM.
        failcnt = read_int(self._dir("memory") / "memory.failcnt") or 0
        return int(failcnt > 0 and self.process.status == -signal.SIGKILL)

    def io_totals(self) -> IoTotals:
        read, write = self.files.block_io()
        # The sandbox shares the host's network namespace: no per-run network counter exists.
        return IoTotals(block_read_bytes=read, block_write_bytes=write)

    # --- lifecycle ------------------------------------------------------
    def wait(self, timeout_s: float | None, cancel_check=None) -> ExitInfo:
        timed_out, canceled = self.process.wait_until(timeout_s, cancel_check)
        if timed_out or canceled:
            self.kill()
        status = self.process.status
        oom = self.oom_kills() > 0
        output = self.process.output_tail()
        if status == JOIN_FAILED_EXIT:
            raise SandboxError(f"the command could not join its cgroup: {output.strip()[-300:]}")
        return ExitInfo(
            returncode=None if (timed_out or canceled) else status,
            oom_killed=oom,
            timed_out=timed_out,
            canceled=canceled,
            output=output,
            wall_s=self.process.wall_s,
            peak_memory_bytes=self._peak(),
            peak_memory_source="kernel",
            io=self.io_totals(),
            pids_limit_hit=self.pids_refused() > 0,
        )

    def _peak(self) -> int | None:
        peak = self.files.peak_memory_bytes()
        return None if peak is None else peak + self.inherited_bytes

    def pids_refused(self) -> int:
        """Forks and threads the pids controller refused (pids.events `max`); 0 without the controller."""
        directory = self.dirs.get("pids") if self.layout.version == 1 else self.dirs[""]
        try:
            events = _read(directory / "pids.events") if directory is not None else ""
        except OSError:
            return 0
        return next((int(n) for key, _, n in (line.partition(" ") for line in events.splitlines()) if key == "max"), 0)

    def kill(self) -> None:
        self.process.kill()
        for pid in self._pids():  # anything that left the process group is still in the cgroup
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _pids(self) -> list[int]:
        procs = self._dir("memory" if self.layout.version == 1 else "") / "cgroup.procs"
        try:
            return [int(p) for p in _read(procs).split()]
        except OSError:
            return []

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.kill()
        self.process.close()
        for directory in self.dirs.values():
            for _ in range(50):  # a killed task takes a moment to leave the cgroup
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


class CgroupBackend(SandboxBackend):
    name = "cgroup"

    def __init__(self) -> None:
        layout = detect_layout()
        if isinstance(layout, str):
            raise SandboxError(layout)
        self.layout = layout

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if os.geteuid() != 0 and "FARM_CGROUP_PARENT" not in os.environ:
            return "the cgroup backend needs root (or a delegated cgroup in FARM_CGROUP_PARENT)"
        layout = detect_layout()
        return layout if isinstance(layout, str) else None

    def start(self, argv: list[str], budget: Budget, *, env: dict[str, str], cwd: Path,
              mounts: list[MountSpec], pass_fds: tuple[int, ...] = (), user: str | None = None) -> RunningSandbox:
        dirs, exclusive = self._make_cgroups(budget)
        procs = " ".join(str(d / "cgroup.procs") for d in dirs.values())
        wrapped = ["/bin/sh", "-c", JOIN_AND_EXEC, "farm-sandbox", *argv]
        output_path = cwd / "sandbox-output.log"
        try:
            process = ReapedProcess(wrapped, env={**env, "FARM_CGROUP_PROCS": procs}, cwd=cwd, output_path=output_path,
                                    pass_fds=pass_fds)
        except OSError as e:
            self._remove(dirs)
            raise SandboxError(f"cannot start the run: {e}") from e
        sandbox = CgroupSandbox(self.layout, dirs, process)
        sandbox.exclusive = exclusive
        return sandbox

    warm_capable = True

    def start_warm(self, warm: WarmLaunch, budget: Budget, *, env: dict[str, str], cwd: Path) -> RunningSandbox:
        """The run forked by the zygote joins its cgroups itself before any of its code runs. The zygote's private
        memory the child starts with is charged to the zygote, not here: the limit is lowered by it and the
        figures raised by it, so sim.memory bounds all the run holds, as for a cold run (warm.py)."""
        inherited = warm.zygote.inherited_bytes()
        if budget.memory_bytes is not None:
            budget = dataclasses.replace(budget, memory_bytes=max(MIN_WARM_LIMIT_BYTES, budget.memory_bytes - inherited))
        dirs, exclusive = self._make_cgroups(budget)
        try:
            process = warm.start(env=env, cwd=cwd, output_path=cwd / "sandbox-output.log",
                                 procs=[str(d / "cgroup.procs") for d in dirs.values()])
        except (SandboxError, OSError) as e:
            self._remove(dirs)
            raise SandboxError(str(e)) from e
        sandbox = CgroupSandbox(self.layout, dirs, process, inherited_bytes=inherited)
        sandbox.exclusive = exclusive
        return sandbox

    @staticmethod
    def _remove(dirs: dict[str, Path]) -> None:
        for d in dirs.values():
            try:
                d.rmdir()
            except OSError:
                pass

    def _make_cgroups(self, budget: Budget) -> tuple[dict[str, Path], str | None]:
        run_name = f"run-{uuid.uuid4().hex[:12]}"
        dirs: dict[str, Path] = {}
        try:
            for controller, root in self.layout.roots.items():
                d = root / run_name
                d.mkdir()
                dirs[controller] = d
            self._apply(dirs, budget)
            claim_cpu_weight(self.layout, dirs)
            exclusive = claim_exclusive_cores(self.layout, dirs, budget) if budget.exclusive else None
        except OSError as e:
            self._remove(dirs)
            raise SandboxError(f"cannot set up cgroup {run_name}: {e}") from e
        return dirs, exclusive

    def _apply(self, dirs: dict[str, Path], budget: Budget) -> None:
        if self.layout.version == 1:
            cpuset_dir = dirs["cpuset"]
            parent = cpuset_dir.parent
            for name in ("cpuset.cpus", "cpuset.mems"):
                if not _read(parent / name).strip():  # v1 needs the farm/ parent populated first
                    _write(parent / name, _read(parent.parent / name).strip())
            _write(cpuset_dir / "cpuset.mems", _read(parent / "cpuset.mems").strip())
            _write(cpuset_dir / "cpuset.cpus", budget.cpuset or _read(parent / "cpuset.cpus").strip())
            quota = cfs_quota_us(budget)
            if quota is not None:
                _write(dirs["cpu"] / "cpu.cfs_period_us", str(CFS_PERIOD_US))
                _write(dirs["cpu"] / "cpu.cfs_quota_us", str(quota))
            if "pids" in dirs:
                _write(dirs["pids"] / "pids.max", str(pids_limit(budget)))
            mem = dirs["memory"]
            if budget.memory_bytes is not None:
                _write(mem / "memory.limit_in_bytes", str(budget.memory_bytes))
                if (mem / "memory.memsw.limit_in_bytes").exists():
                    _write(mem / "memory.memsw.limit_in_bytes", str(budget.memory_bytes))
                try:
                    _write(mem / "memory.swappiness", "0")
                except OSError:
                    pass  # not settable under some parents; swap is capped by memsw anyway
        else:
            d = dirs[""]
            if budget.cpuset:
                _write(d / "cpuset.cpus", budget.cpuset)
            quota = cfs_quota_us(budget)
            if quota is not None:
                _write(d / "cpu.max", f"{quota} {CFS_PERIOD_US}")
            if (d / "pids.max").exists():
                _write(d / "pids.max", str(pids_limit(budget)))
            if budget.memory_bytes is not None:
                _write(d / "memory.max", str(budget.memory_bytes))
                if (d / "memory.swap.max").exists():
                    _write(d / "memory.swap.max", "0")

    def effective_limits(self, budget: Budget) -> Budget:
        return dataclasses.replace(budget, cpus=applied_cpus(budget))
