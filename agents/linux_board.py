"""Any Linux board over ssh (Raspberry Pi, TI, Rockchip…): its facts, and a command run under /proc sampling.

The driver that turns a farm task into a RunResult composes these: stage the run (board_workload.py),
`run_with_proc_sampling(ssh, "python3 board_harness.py run TASK.json", …)`, parse its result line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from farm.agents.ssh_transport import CommandResult, SshTransport
from farm.proto.results import Telemetry, TelemetrySample

_SECTION = "@@farm:"


def run_probes(ssh: SshTransport, probes: dict[str, str], timeout_s: float = 30) -> dict[str, str]:
    """Run several small shell probes in one round trip; each one's output (stdout+stderr) by name."""
    # The trailing echo ends a probe whose output lacks a newline (device-tree strings end in NUL).
    script = "; ".join(f"echo '{_SECTION}{name}'; ( {command} ) 2>&1; echo" for name, command in probes.items())
    _, out, _ = ssh.run(script, timeout_s)
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in out.splitlines():
        if line.startswith(_SECTION):
            current = sections.setdefault(line[len(_SECTION):], [])
        elif current is not None:
            current.append(line)
    return {name: "\n".join(sections.get(name, [])).strip() for name in probes}


LINUX_PROBES = {
    "board_model": "tr -d '\\000' < /proc/device-tree/model",
    "cpuinfo": "cat /proc/cpuinfo",
    "nproc": "nproc",
    "meminfo": "grep -E '^MemTotal:' /proc/meminfo",
    "governor": "cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor",
    "kernel": "uname -r",
    "arch": "uname -m",
    "os": ". /etc/os-release && echo \"$PRETTY_NAME\"",
}


@dataclass(frozen=True)
class LinuxBoardFacts:
    board_model: str | None  # /proc/device-tree/model: "Raspberry Pi 4 Model B Rev 1.4"
    cpu_model: str | None
    cpu_cores: int | None
    memory_total_mb: int | None
    governor: str | None  # cpu0's cpufreq governor; None where cpufreq is absent (VMs)
    kernel: str | None
    arch: str | None
    os: str | None

    def as_environment(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}


def _int_or_none(text: str) -> int | None:
    return int(text) if text.strip().isdigit() else None


def cpu_model_from_cpuinfo(cpuinfo: str) -> str | None:
    """x86 and most ARM kernels print `model name`; the Pi prints `Model`, older ARM `Hardware`."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and value.strip():
            fields.setdefault(key.strip(), value.strip())
    for key in ("model name", "Model", "Hardware", "Processor", "cpu model"):
        if key in fields:
            return fields[key]
    return None


def linux_facts_from_probes(probes: dict[str, str]) -> LinuxBoardFacts:
    mem = re.search(r"MemTotal:\s+(\d+)\s*kB", probes.get("meminfo", ""))
    governor = probes.get("governor", "")
    model = probes.get("board_model", "")
    return LinuxBoardFacts(
        board_model=model if model and "No such file" not in model else None,
        cpu_model=cpu_model_from_cpuinfo(probes.get("cpuinfo", "")),
        cpu_cores=_int_or_none(probes.get("nproc", "")),
        memory_total_mb=int(mem[1]) // 1024 if mem else None,
        governor=governor if governor and " " not in governor else None,  # an error message has spaces
        kernel=probes.get("kernel") or None,
        arch=probes.get("arch") or None,
        os=probes.get("os") or None,
    )


def read_linux_facts(ssh: SshTransport) -> LinuxBoardFacts:
    return linux_facts_from_probes(run_probes(ssh, LINUX_PROBES))


@dataclass(frozen=True)
class ProcSample:
    t_s: float  # seconds since the first reading
    cpu_percent: float  # whole board, % of one core, over the period ending here
    memory_used_mb: float  # MemTotal − MemAvailable


@dataclass(frozen=True)
class ProcSummary:
    samples: int
    cpu_avg_percent: float | None
    cpu_peak_percent: float | None
    memory_avg_mb: float | None
    memory_peak_mb: float | None


@dataclass
class ProcSampledRun:
    result: CommandResult
    samples: list[ProcSample]
    summary: ProcSummary
    interval_ms: float
    wall_s: float
    sampler_stderr: str = ""
    environment: dict[str, Any] = field(default_factory=dict)

    def telemetry(self) -> Telemetry:
        return proc_telemetry(self.samples, self.interval_ms)


def proc_sampler_command(interval_ms: float) -> str:
    """A shell loop printing a timestamped /proc/stat total line and the memory lines every period."""
    period_s = f"{interval_ms / 1000:.3f}"
    return (
        "while :; do echo \"@@t $(date +%s.%N)\"; grep '^cpu ' /proc/stat; "
        f"grep -E '^(MemTotal|MemAvailable):' /proc/meminfo; sleep {period_s}; done"
    )


def parse_proc_samples(text: str, cpu_cores: int) -> list[ProcSample]:
    """The sampler loop's output → one sample per period (CPU % needs two readings, so n−1 samples)."""
    readings: list[tuple[float, int, int, int | None, int | None]] = []
    t = busy = total = mem_total = mem_available = None
    for line in text.splitlines() + ["@@t end"]:
        if line.startswith("@@t "):
            if t is not None and busy is not None and total is not None:
                readings.append((t, busy, total, mem_total, mem_available))
            try:
                t = float(line.split()[1])
            except (IndexError, ValueError):
                t = None
            busy = total = mem_total = mem_available = None
        elif line.startswith("cpu "):
            jiffies = [int(v) for v in line.split()[1:] if v.isdigit()]
            # user nice system idle iowait irq softirq steal (guest time is already inside user)
            counted = jiffies[:8]
            if len(counted) >= 4:  # fewer means a line cut short when the sampler was stopped
                idle = sum(counted[3:5])
                total, busy = sum(counted), sum(counted) - idle
        elif line.startswith("MemTotal:"):
            mem_total = _int_or_none(line.split()[1])
        elif line.startswith("MemAvailable:"):
            mem_available = _int_or_none(line.split()[1])
    samples: list[ProcSample] = []
    for previous, current in zip(readings, readings[1:]):
        d_total = current[2] - previous[2]
        if d_total <= 0:
            continue
        cpu = (current[1] - previous[1]) / d_total * cpu_cores * 100.0
        used_mb = (current[3] - current[4]) / 1024 if current[3] is not None and current[4] is not None else float("nan")
        samples.append(ProcSample(round(current[0] - readings[0][0], 3), cpu, used_mb))
    return samples


def summarize_proc(samples: list[ProcSample]) -> ProcSummary:
    cpu = [s.cpu_percent for s in samples]
    mem = [s.memory_used_mb for s in samples if s.memory_used_mb == s.memory_used_mb]  # drops NaN
    return ProcSummary(
        samples=len(samples),
        cpu_avg_percent=sum(cpu) / len(cpu) if cpu else None,
        cpu_peak_percent=max(cpu) if cpu else None,
        memory_avg_mb=sum(mem) / len(mem) if mem else None,
        memory_peak_mb=max(mem) if mem else None,
    )


def proc_telemetry(samples: list[ProcSample], interval_ms: float) -> Telemetry:
    """The board-wide figures in the sim's telemetry shape (memory is the whole board's, not one process's)."""
    summary = summarize_proc(samples)
    return Telemetry(
        interval_ms=interval_ms,
        cpu_avg_percent=summary.cpu_avg_percent,
        cpu_peak_percent=summary.cpu_peak_percent,
        memory_avg_bytes=summary.memory_avg_mb * 2**20 if summary.memory_avg_mb is not None else None,
        memory_peak_bytes=int(summary.memory_peak_mb * 2**20) if summary.memory_peak_mb is not None else None,
        memory_peak_source="sampled",
        samples=[TelemetrySample(s.t_s, s.cpu_percent, int(s.memory_used_mb * 2**20)) for s in samples
                 if s.memory_used_mb == s.memory_used_mb],
    )


def run_with_proc_sampling(ssh: SshTransport, command: str, timeout_s: float, interval_ms: float = 100,
                           cpu_cores: int | None = None, cancel_check: Callable[[], bool] | None = None) -> ProcSampledRun:
    """Run `command` on the board while sampling /proc; returns its result and the parsed samples."""
    if cpu_cores is None:
        cpu_cores = _int_or_none(ssh.run("nproc", 30).stdout) or 1
    result, sampled, wall_s = ssh.run_sampled(proc_sampler_command(interval_ms), command, timeout_s, cancel_check)
    samples = parse_proc_samples(sampled.stdout, cpu_cores)
    return ProcSampledRun(result, samples, summarize_proc(samples), interval_ms, wall_s, sampled.stderr.strip())
