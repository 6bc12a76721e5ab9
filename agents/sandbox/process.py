"""Unprivileged fallback: CPU affinity, an address-space cap and a watchdog, no kernel accounting.

Everything here is best-effort, so results from this backend are marked approximate:
fractional CPU budgets are enforced by stopping and continuing the process group
(the way `cpulimit` does), and memory by a watchdog that kills above the limit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import resource
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import psutil

from farm.agents.sandbox.base import (
    Budget, format_cpuset, parse_cpuset, Counters, CpuAccounting, ExitInfo, IoTotals, MountSpec,
    RunningSandbox, SandboxBackend, applied_cpus, cfs_quota_us, pids_limit,
)
from farm.agents.sandbox.process_tree import ReapedProcess
from farm.agents.sandbox.warm import WarmLaunch

DUTY_PERIOD_S = 0.1
WATCHDOG_INTERVAL_S = 0.01
# Finding the run's process tree reads every process's /proc/N/stat (psutil's ppid map): 7 CPU-ms per scan with
# 190 processes on the host, which the watcher did twice a tick, every 10 ms — half a core beside the run it measures.
# The tree is found again at this period; between scans the known members are read directly (memory every tick).
TREE_RESCAN_S = 0.2
# Runtimes reserve far more address space than they touch: the cap only stops runaways.
ADDRESS_SPACE_HEADROOM_BYTES = 8 << 30


def keep_off_cores(cores: list[int]) -> None:
    """Pin the calling thread to cores the run does not use, if there are any: the watchdog's
    scans must not count as other work on the run's cores."""
    others = os.sched_getaffinity(0) - set(cores)
    if others:
        os.sched_setaffinity(0, others)


# What the cgroup backend's full CPU weight is without cgroups: the highest priority, where allowed
# (root or CAP_SYS_NICE): nice -20 weighs 88761 against a nice-0 task's 1024.
HIGHEST_PRIORITY = -20


def claim_cpu_weight() -> None:
    """The calling thread (Linux's nice value is per thread; in a child before exec, the run) at HIGHEST_PRIORITY.
    The threads that enforce and measure a run claim it too (the watchdog here, the telemetry sampler): they are
    pinned off the run's cores, where another run of this or another agent may be running at this weight, which
    left a nice-0 thread ~1 % of its core: the duty cycle went unenforced and a 3 s run got no telemetry sample at
    all (issue 34: cpu_percent None beside the emulated boards' sim twins)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, HIGHEST_PRIORITY)
    except PermissionError:
        pass  # unprivileged: the run competes at its default weight, and contention says when that hurt


@contextlib.contextmanager
def at_highest_priority() -> Iterator[None]:
    """The calling thread at HIGHEST_PRIORITY while a run is watched, its own priority back after. The thread that
    waits for the run wakes to poll it: starved while it holds Python's lock, it stalls the sampler and the watchdog
    with it (measured: 11 and 21 of ~52 readings in a 2.6 s run beside a nice -20 loop, 46 and 71 of ~53 and ~74
    with this thread raised too)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    claim_cpu_weight()
    try:
        yield
    finally:
        if os.getpriority(os.PRIO_PROCESS, 0) != before:
            os.setpriority(os.PRIO_PROCESS, 0, before)  # lowering it is always allowed


class ProcessSandbox(RunningSandbox):
    def __init__(self, process: ReapedProcess, budget: Budget, cores: list[int]) -> None:
        self.process = process
        self.started_at = process.started_at
        self.budget = budget
        self.cores = cores
        quota_cpus = applied_cpus(budget) if cfs_quota_us(budget) is not None else None
        self.duty = 1.0 if quota_cpus is None else min(1.0, quota_cpus / len(cores))
        self.oom_killed = False
        self.peak_sampled = 0
        self._known: tuple[float, list[psutil.Process]] = (-math.inf, [])
        self._io_start = self._io_now()
        self._io_last = self._io_start
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="process-watchdog", daemon=True)
        self._watchdog.start()

    def _tree(self) -> list[psutil.Process]:
        """The run's processes as last found, found again once TREE_RESCAN_S has passed (a member that exited since
        raises psutil.NoSuchProcess where it is read, which every reader already skips)."""
        found_at, members = self._known
        now = time.monotonic()
        if now - found_at < TREE_RESCAN_S:
            return members
        try:
            root = psutil.Process(self.process.pid)
            members = [root, *root.children(recursive=True)]
        except psutil.Error:
            members = []
        self._known = (now, members)
        return members

    def _rss(self) -> int:
        total = 0
        for p in self._tree():
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _io_now(self) -> tuple[int, int]:
        read = write = 0
        for p in self._tree():
            try:
                io = p.io_counters()
                read += io.read_bytes
                write += io.write_bytes
            except (psutil.Error, AttributeError):
                pass
        return read, write

    def _watch(self) -> None:
        """Memory watchdog and CPU duty cycle, in one loop so they never disagree."""
        keep_off_cores(self.cores)
        claim_cpu_weight()  # at the run's own weight: a starved watchdog leaves the run stopped or running
        limit = self.budget.memory_bytes
        stopped = False
        period_start = time.monotonic()
        while not self._stop.is_set() and not self.process.exited.is_set():
            rss = self._rss()
            self.peak_sampled = max(self.peak_sampled, rss)
            if limit is not None and rss > limit:
                self.oom_killed = True
                self.process.kill()
                return
            io = self._io_now()
            if io != (0, 0):
                self._io_last = io
            if self.duty < 0.999:
                phase = (time.monotonic() - period_start) % DUTY_PERIOD_S
                should_stop = phase >= self.duty * DUTY_PERIOD_S
                if should_stop != stopped:
                    self.process.signal_group(signal.SIGSTOP if should_stop else signal.SIGCONT)
                    stopped = should_stop
            time.sleep(WATCHDOG_INTERVAL_S)
        if stopped:
            self.process.signal_group(signal.SIGCONT)

    def read_counters(self) -> Counters:
        cpu_ns = 0
        procs = self._tree()
        if not procs:
            return Counters(None, None)
        mem = 0
        for p in procs:
            try:
                t = p.cpu_times()
                cpu_ns += int((t.user + t.system + t.children_user + t.children_system) * 1e9)
                mem += p.memory_info().rss
            except psutil.Error:
                pass
        return Counters(cpu_ns, mem)

    def wait(self, timeout_s: float | None, cancel_check=None) -> ExitInfo:
        timed_out, canceled = self.process.wait_until(timeout_s, cancel_check)
        self._stop.set()
        self.process.signal_group(signal.SIGCONT)  # a stopped group cannot die
        peak = max(self.process.max_rss_bytes or 0, self.peak_sampled) or None
        read = self._io_last[0] - self._io_start[0]
        write = self._io_last[1] - self._io_start[1]
        return ExitInfo(
            returncode=None if (timed_out or canceled) else self.process.status,
            oom_killed=self.oom_killed,
            timed_out=timed_out,
            canceled=canceled,
            output=self.process.output_tail(),
            wall_s=self.process.wall_s,
            peak_memory_bytes=peak,
            peak_memory_source="rusage",
            io=IoTotals(block_read_bytes=max(0, read), block_write_bytes=max(0, write)),
        )

    def thread_ids(self) -> list[int]:
        tids = []
        for p in self._tree():
            try:
                tids += [t.id for t in p.threads()]
            except psutil.Error:
                pass
        return tids

    def cpu_accounting(self) -> CpuAccounting:
        if self.process.cpu_ns is not None:  # wait4's rusage: the whole reaped tree
            return CpuAccounting(self.process.cpu_ns)
        return super().cpu_accounting()

    def kill(self) -> None:
        self.process.signal_group(signal.SIGCONT)
        self.process.kill()

    def close(self) -> None:
        self._stop.set()
        self.kill()
        self.process.close()


class ProcessBackend(SandboxBackend):
    name = "process"
    approximate = True

    @classmethod
    def unenforced_cpus(cls, cpus: float | None) -> str | None:
        if cpus is None or float(cpus).is_integer():
            return None  # whole CPUs are cores it pins the run to: enforced
        return (f"the process backend cannot hold each inference to {cpus:g} CPU: it pauses the whole run for part "
                f"of every {DUTY_PERIOD_S * 1000:.0f} ms, so a shorter inference is timed at a whole core's speed "
                "(the run gets slower, its latencies hardly). The cgroup or docker backend enforces it "
                "(`farm backends` says which run here).")

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None  # runs anywhere

    def _cores(self, budget: Budget) -> list[int]:
        allowed = sorted(os.sched_getaffinity(0))
        if budget.cpuset:
            return parse_cpuset(budget.cpuset)
        if budget.cpus is not None:
            return allowed[: max(1, min(len(allowed), math.ceil(budget.cpus)))]
        return allowed

    def start(self, argv: list[str], budget: Budget, *, env: dict[str, str], cwd: Path,
              mounts: list[MountSpec], pass_fds: tuple[int, ...] = (), user: str | None = None) -> RunningSandbox:
        cores = self._cores(budget)
        cap = None if budget.memory_bytes is None else budget.memory_bytes + ADDRESS_SPACE_HEADROOM_BYTES
        nproc = pids_limit(budget)

        def limit_child() -> None:  # runs in the child between fork and exec
            os.sched_setaffinity(0, cores)
            claim_cpu_weight()
            if cap is not None:
                resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
            # no pids controller here: the run user's process count (per user, so a bound, not an exact budget)
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

        process = ReapedProcess(argv, env=env, cwd=cwd, output_path=cwd / "sandbox-output.log",
                                preexec_fn=limit_child, pass_fds=pass_fds)
        return ProcessSandbox(process, budget, cores)

    warm_capable = True

    def start_warm(self, warm: WarmLaunch, budget: Budget, *, env: dict[str, str], cwd: Path) -> RunningSandbox:
        """The run forked by the zygote sets its cores, priority and rlimits itself, as limit_child() does; its
        RSS (what the watchdog and the peak read) counts the pages it shares with the zygote, as a cold run's."""
        cores = self._cores(budget)
        cap = None if budget.memory_bytes is None else budget.memory_bytes + ADDRESS_SPACE_HEADROOM_BYTES
        process = warm.start(env=env, cwd=cwd, output_path=cwd / "sandbox-output.log",
                             limits={"cores": cores, "address_space": cap, "nproc": pids_limit(budget)})
        return ProcessSandbox(process, budget, cores)

    def effective_limits(self, budget: Budget) -> Budget:
        return dataclasses.replace(budget, cpus=applied_cpus(budget), cpuset=format_cpuset(self._cores(budget)))
