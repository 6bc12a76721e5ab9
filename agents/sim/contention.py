"""Was a sim run's CPU its own? Host counters read around the run, and the verdict.

"Quiet" means the run's own cores: other work on other cores does not flag a run, so a
busy machine can still give clean measurements. The figures:

- others' CPU on the run's cores: the cores' busy time (wall minus idle, /proc/stat; the
  kernel keeps idle exactly and prints it in 10 ms ticks) minus the run's own CPU time
  (its cgroup's counter) minus steal; and of that, what the run lost: CPU it was entitled
  to and did not get while others ran (the verdict's figure);
- steal on those cores (/proc/stat), the host's CPU pressure (/proc/pressure/cpu) and the
  run's own cgroup v2 cpu.pressure where they exist;
- the CPU the run got against its budget, and the time its quota throttled it;
- clock and governor of the run's cores at start and end.

Parsers are pure functions over the files' text; the verdict is one function with the
thresholds in BENCHMARKS.md ("Contention").
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from farm.agents.sandbox.base import format_cpuset
from farm.proto.results import Contention

USER_HZ = 100  # /proc/stat's unit on every Linux architecture farm runs on
# Thresholds, from benchmarks/contention.py on the project's 2-core VM (BENCHMARKS.md, "Contention").
# LOST_MAX: the run got less than its entitlement by this share while other tasks ran on its cores.
LOST_MAX = 0.10
STEAL_MAX = 0.05  # the hypervisor took the vCPU this share of the time
CLOCK_DROP_MAX = 0.05  # the cores' clock fell by more than this between start and end
QUIET_MAX = 0.05  # before a run: the cores count as quiet below this share of others' CPU
QUIET_PROBE_S = 0.1  # one look at the cores before a run


# --- parsers (pure) ---------------------------------------------------------------------------
@dataclass(frozen=True)
class CoreTicks:
    busy: int  # user nice system irq softirq (ticks)
    idle: int  # idle + iowait
    steal: int


def parse_proc_stat(text: str) -> dict[int, CoreTicks]:
    """Per-core lines of /proc/stat ("cpu3 user nice system idle iowait irq softirq steal ...")."""
    cores: dict[int, CoreTicks] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit():
            continue
        v = [int(x) for x in rest.split()] + [0] * 8
        cores[int(name[3:])] = CoreTicks(busy=v[0] + v[1] + v[2] + v[5] + v[6], idle=v[3] + v[4], steal=v[7])
    return cores


def parse_pressure_some_us(text: str) -> int | None:
    """The cumulative "some" stall time (µs) of a PSI file (/proc/pressure/cpu, cgroup v2 cpu.pressure)."""
    for line in text.splitlines():
        if line.startswith("some "):
            for field in line.split()[1:]:
                key, _, value = field.partition("=")
                if key == "total" and value.isdigit():
                    return int(value)
    return None


def parse_cpuinfo_mhz(text: str) -> dict[int, float]:
    """processor -> "cpu MHz" from /proc/cpuinfo (the fallback where cpufreq is not exposed, e.g. VMs)."""
    out: dict[int, float] = {}
    current: int | None = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor" and value.strip().isdigit():
            current = int(value)
        elif key == "cpu MHz" and current is not None:
            try:
                out[current] = float(value)
            except ValueError:
                pass
    return out


def parse_schedstat_wait_ns(text: str) -> int | None:
    """The run-queue wait (ns) of /proc/<tid>/schedstat ("exec_ns wait_ns timeslices"): time the
    thread was runnable but another task had its CPU (or its quota held it back)."""
    fields = text.split()
    return int(fields[1]) if len(fields) >= 2 and fields[1].isdigit() else None


def thread_wait_ns(tid: int) -> int | None:
    text = _read(f"/proc/{tid}/schedstat")
    return parse_schedstat_wait_ns(text) if text else None


# --- readings ---------------------------------------------------------------------------------
def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


@dataclass
class CoreClock:
    mhz: float | None
    governor: str | None


def core_clock(cores: list[int]) -> CoreClock:
    """Mean current clock of `cores` (cpufreq, else /proc/cpuinfo) and the first core's governor."""
    mhz = []
    for c in cores:
        khz = _read(f"/sys/devices/system/cpu/cpu{c}/cpufreq/scaling_cur_freq")
        if khz and khz.strip().isdigit():
            mhz.append(int(khz) / 1000)
    if not mhz:
        by_core = parse_cpuinfo_mhz(_read("/proc/cpuinfo") or "")
        mhz = [by_core[c] for c in cores if c in by_core]
    governor = _read(f"/sys/devices/system/cpu/cpu{cores[0]}/cpufreq/scaling_governor") if cores else None
    return CoreClock(round(sum(mhz) / len(mhz), 1) if mhz else None, governor.strip() if governor else None)


@dataclass
class HostSnapshot:
    """The host's counters for a set of cores at one moment."""

    at: float  # time.monotonic()
    ticks: dict[int, CoreTicks]
    host_pressure_us: int | None
    clock: CoreClock


def snapshot(cores: list[int], *, with_clock: bool = True) -> HostSnapshot:
    ticks = parse_proc_stat(_read("/proc/stat") or "")
    pressure = _read("/proc/pressure/cpu")
    return HostSnapshot(time.monotonic(), {c: ticks[c] for c in cores if c in ticks},
                        parse_pressure_some_us(pressure) if pressure else None,
                        core_clock(cores) if with_clock else CoreClock(None, None))


def busy_share(before: HostSnapshot, after: HostSnapshot, own_cpu_s: float = 0.0) -> tuple[float, float]:
    """(others' CPU, steal) on the snapshot's cores as shares of cores × wall; own_cpu_s is taken out."""
    wall = after.at - before.at
    cores = [c for c in before.ticks if c in after.ticks]
    if wall <= 0 or not cores:
        return 0.0, 0.0
    # busy = wall minus idle: idle is kept exactly by the kernel (NOHZ), only printed in ticks
    idle = sum(after.ticks[c].idle - before.ticks[c].idle for c in cores) / USER_HZ
    steal = sum(after.ticks[c].steal - before.ticks[c].steal for c in cores) / USER_HZ
    capacity = wall * len(cores)
    busy = max(0.0, capacity - idle)
    others = max(0.0, busy - own_cpu_s - steal)
    return others / capacity, steal / capacity


def core_busy_shares(cores: list[int], window_s: float = QUIET_PROBE_S) -> dict[int, float]:
    """Each core's busy share (others' CPU: nothing of the run exists yet) over one short look."""
    before = snapshot(cores, with_clock=False)
    time.sleep(window_s)
    after = snapshot(cores, with_clock=False)
    return {c: busy_share(_only(before, c), _only(after, c))[0] for c in cores}


def _only(s: HostSnapshot, core: int) -> HostSnapshot:
    return HostSnapshot(s.at, {core: s.ticks[core]} if core in s.ticks else {}, s.host_pressure_us, s.clock)


def quietest_cores(candidates: list[int], n: int, looked: dict[int, float] | None = None) -> list[int]:
    """The n least busy of `candidates` now (ties: the highest numbers, away from core 0's interrupts).
    `looked` gets each core's busy share from the look, when one was taken (wait_until_quiet's first look)."""
    if n >= len(candidates):
        return sorted(candidates)
    shares = core_busy_shares(candidates)
    if looked is not None:
        looked.update(shares)
    return sorted(sorted(candidates, key=lambda c: (round(shares[c], 2), -c))[:n])


def wait_until_quiet(cores: list[int], max_wait_s: float, cancel_check=None,
                     first_look: dict[int, float] | None = None) -> tuple[float, bool]:
    """Look at the cores until others use less than QUIET_MAX of them, at most max_wait_s. first_look: the
    shares of a look quietest_cores just took of these cores, used as the first look instead of taking another.

    Returns (seconds waited, quiet when it stopped)."""
    start = time.monotonic()
    while True:
        if first_look is not None and all(c in first_look for c in cores):
            shares, first_look = {c: first_look[c] for c in cores}, None
        else:
            shares = core_busy_shares(cores)
        quiet = sum(shares.values()) / max(1, len(shares)) < QUIET_MAX
        waited = time.monotonic() - start
        if quiet or waited >= max_wait_s or (cancel_check is not None and cancel_check()):
            return round(waited, 3), quiet


# --- the verdict ------------------------------------------------------------------------------
def _share(value: float) -> float:
    return round(value, 4)


def judge(before: HostSnapshot, after: HostSnapshot, *, run_cpu_s: float | None, budget_cpus: float | None,
          demand_cpus: float | None = None, throttled_s: float | None = None, run_wait_s: float | None = None,
          cgroup_pressure_us: int | None = None) -> Contention:
    """The evidence of one run and whether it was contended (with every reason, in words).

    Other tasks on the run's cores spoil it only by taking CPU the run wanted and was entitled
    to. The CPU it lost is the least of three: what it fell short of its entitlement (budget,
    cores, threads), what others used on its cores, and — where the threads' run-queue waits
    are known — how long it waited for a CPU beyond its own quota's throttling. Others in a
    quota's gaps, on a core the run leaves idle, or the run's threads queueing behind each
    other are not contention.
    """
    cores = sorted(before.ticks)
    wall = after.at - before.at
    others, steal = busy_share(before, after, run_cpu_s or 0.0)
    c = Contention(cores=format_cpuset(cores) if cores else None, window_s=round(wall, 4),
                   run_cpu_s=None if run_cpu_s is None else round(run_cpu_s, 4),
                   others_cpu_share=_share(others) if run_cpu_s is not None else None,
                   steal_share=_share(steal), throttled_s=throttled_s,
                   freq_mhz_start=before.clock.mhz, freq_mhz_end=after.clock.mhz,
                   governor_start=before.clock.governor, governor_end=after.clock.governor)
    allowed = min(budget_cpus, len(cores)) if budget_cpus and cores else (budget_cpus or len(cores) or None)
    c.budget_cpus = allowed
    if run_cpu_s is not None and allowed and wall > 0:
        c.cpu_of_budget = _share(run_cpu_s / (allowed * wall))
        entitled = min(allowed, demand_cpus or allowed) * wall
        others_s = others * len(cores) * wall
        lost = min(max(0.0, entitled - run_cpu_s), others_s)
        if run_wait_s is not None:
            # a throttled group's runnable threads all wait out the throttle: that is the budget, not others
            lost = min(lost, max(0.0, run_wait_s - (throttled_s or 0.0) * (demand_cpus or 1.0)))
        c.lost_share = _share(lost / entitled)
    c.run_wait_s = None if run_wait_s is None else round(run_wait_s, 4)
    if before.host_pressure_us is not None and after.host_pressure_us is not None and wall > 0:
        c.host_pressure_share = _share((after.host_pressure_us - before.host_pressure_us) / 1e6 / wall)
    if cgroup_pressure_us is not None and wall > 0:
        c.cgroup_pressure_share = _share(cgroup_pressure_us / 1e6 / wall)
    if c.lost_share is not None and c.lost_share > LOST_MAX:
        c.reasons.append(f"other tasks used {100 * (c.others_cpu_share or 0):.0f} % of the run's core(s) {c.cores} "
                         f"and the run got {100 * c.lost_share:.0f} % less CPU than its budget allowed "
                         f"(limit {100 * LOST_MAX:.0f} %)")
    if c.steal_share is not None and c.steal_share > STEAL_MAX:
        c.reasons.append(f"the hypervisor took {100 * c.steal_share:.0f} % of the run's core(s) as steal time "
                         f"(limit {100 * STEAL_MAX:.0f} %)")
    if c.freq_mhz_start and c.freq_mhz_end and c.freq_mhz_end < c.freq_mhz_start * (1 - CLOCK_DROP_MAX):
        c.reasons.append(f"the cores' clock fell from {c.freq_mhz_start:g} to {c.freq_mhz_end:g} MHz during the run")
    if c.governor_start != c.governor_end:
        c.reasons.append(f"the cpufreq governor changed from {c.governor_start} to {c.governor_end} during the run")
    c.contended = bool(c.reasons)
    return c


LOST_REASON = "other tasks used "  # how the whole run's lost-CPU reason begins (judge)


def judge_timed_loop(c: Contention, *, loop_s: float, loop_cpu_s: float, loop_wait_s: float,
                     demand_cpus: float) -> dict[str, float | None]:
    """Judge the lost CPU over the timed loop instead of the whole run, in place; returns the loop's figures.

    The timings come from the loop alone, and a run of a microsecond model is mostly start-up: one
    10 ms tick of someone else's work in a ~46 ms run reads as 20 % lost. Over the loop the evidence is
    exact: its threads' run-queue wait (ns, schedstat), less what the run's own quota held it back
    (the run's throttled time, spread over its window), and never more than the CPU the loop did not get
    of its entitlement. Steal, clock and governor stay judged over the whole run."""
    entitled = min(c.budget_cpus or demand_cpus, demand_cpus) * loop_s
    throttled = (c.throttled_s or 0.0) * (loop_s / c.window_s) if c.window_s else 0.0
    lost = max(0.0, loop_wait_s - throttled * demand_cpus)
    lost = min(lost, max(0.0, entitled - loop_cpu_s))
    share = _share(lost / entitled) if entitled > 0 else 0.0
    figures: dict[str, float | None] = {"wall_s": round(loop_s, 6), "cpu_s": round(loop_cpu_s, 6), "wait_s": round(loop_wait_s, 6),
               "lost_share": share, "whole_run_lost_share": c.lost_share}
    c.lost_share = share
    c.reasons = [r for r in c.reasons if not r.startswith(LOST_REASON)]
    if share > LOST_MAX:
        c.reasons.insert(0, f"the timed loop waited {1e3 * loop_wait_s:.3g} ms for a CPU while other tasks ran and "
                            f"got {100 * share:.0f} % less CPU than its budget allowed (limit {100 * LOST_MAX:.0f} %)")
    c.contended = bool(c.reasons)
    return figures
