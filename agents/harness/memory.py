"""The harness's own memory, as the kernel counts it (/proc/self/status)."""

from __future__ import annotations

from pathlib import Path


def status_kib(field: str) -> int | None:
    """A /proc/self/status field (VmRSS, VmHWM) in bytes; None where there is no /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
