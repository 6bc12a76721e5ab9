"""A Linux board's /proc and probe output (cpuinfo, meminfo, /proc/stat samples): pure parsers over text."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


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


@dataclass(frozen=True)
class ProcSample:
    t_s: float  # seconds since the first reading
    cpu_percent: float  # whole board, % of one core, over the period ending here
    memory_used_mb: float  # MemTotal − MemAvailable


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
