"""What Jetson tools print (nv_tegra_release, nvpmodel -q, jetson_clocks --show, farm's jtop sampler): pure parsers over text."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


def l4t_release_from_file(text: str) -> str | None:
    """`# R32 (release), REVISION: 7.4, GCID: …` → "32.7.4"."""
    m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*(\d+)\.(\d+)", text)
    return f"{m[1]}.{m[2]}.{m[3]}" if m else None


def nvpmodel_from_query(text: str) -> tuple[str | None, int | None]:
    """`nvpmodel -q` → ("MAXN", 0); warnings before the mode line are ignored."""
    m = re.search(r"NV Power Mode:\s*(\S[^\n]*?)\s*\n\s*(\d+)?", text + "\n")
    if not m:
        return None, None
    return m[1], int(m[2]) if m[2] else None


def jetson_clocks_active_from_show(text: str) -> bool | None:
    """Pinned clocks show MinFreq == MaxFreq on every online CPU and on the GPU."""
    ranges: list[tuple[int, int]] = []
    for line in text.splitlines():
        if re.match(r"cpu\d+:", line) and "Online=0" in line:
            continue
        if re.match(r"(cpu\d+:|GPU\b)", line):
            m = re.search(r"MinFreq=(\d+)\s+MaxFreq=(\d+)", line)
            if m:
                ranges.append((int(m[1]), int(m[2])))
    if not ranges:
        return None
    return all(low == high for low, high in ranges)


@dataclass
class JtopSample:
    cpu_total_percent: float | None
    ram_fraction: float | None
    power_total_mw: float | None


def parse_jtop_line(line: str) -> JtopSample | None:
    """One line of the sampler above -> the figures farm uses (CPUn % or 'OFF', RAM, Power TOT)."""
    try:
        stats = json.loads(line)
    except ValueError:
        return None
    if not isinstance(stats, dict):
        return None
    cpus = [v for k, v in stats.items() if k.startswith("CPU") and k[3:].isdigit() and isinstance(v, (int, float))]
    ram = stats.get("RAM")
    ram = ram / 100 if isinstance(ram, (int, float)) and ram > 1 else ram  # newer jtop: fraction; older: %
    power = stats.get("Power TOT")
    return JtopSample(float(sum(cpus)) if cpus else None, float(ram) if isinstance(ram, (int, float)) else None,
                      float(power) if isinstance(power, (int, float)) else None)
