"""Facts about the machine a run happened on, stored with every run."""

from __future__ import annotations

import functools
import os
import platform
import socket
from pathlib import Path
from typing import Any


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


@functools.cache
def host_facts() -> dict[str, Any]:
    cpu_model = None
    cpuinfo = _read("/proc/cpuinfo") or ""
    for line in cpuinfo.splitlines():
        if line.lower().startswith(("model name", "hardware", "processor\t: arm")):
            cpu_model = line.split(":", 1)[1].strip()
            break
    mem_total = None
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            mem_total = int(line.split()[1]) * 1024
    return {
        "hostname": socket.gethostname(),
        "os": platform.platform(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "memory_total_bytes": mem_total,
        "governor": _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"),
        "python": platform.python_version(),
    }


def load_average() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None
