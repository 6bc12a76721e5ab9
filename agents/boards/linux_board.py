"""Any Linux board over ssh (Raspberry Pi, TI, Rockchip…): its facts, and a command run under /proc sampling.

The driver that turns a farm task into a RunResult composes these: stage the run (workload.py),
`run_with_proc_sampling(ssh, "python3 board_harness.py run TASK.json", …)`, parse its result line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from farm.agents.boards.ssh_transport import CommandResult, SshTransport
from farm.proto.results import Telemetry, TelemetrySample
from farm.agents.parsers.linux_proc import LinuxBoardFacts, ProcSample, _int_or_none, linux_facts_from_probes, parse_proc_samples

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


def read_linux_facts(ssh: SshTransport) -> LinuxBoardFacts:
    return linux_facts_from_probes(run_probes(ssh, LINUX_PROBES))


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
