"""NVIDIA GPU telemetry as pure functions: `nvidia-smi --query-gpu=... --format=csv,noheader,nounits -lms N`
rows and the NVML sampler's JSON lines (agents/boards/nvidia.py) into samples, and samples into what a
run reports: energy, power, GPU memory peak, utilization, clocks, temperature and clock-event reasons.

Formats as the tools really print them (shared/reference/accelerator_tools.md §2, copied into
tests/fixtures/nvidia_smi/): cells separated by ", "; a missing reading is `[N/A]`, `[Not Supported]`,
`[Unknown Error]` or a bare `N/A`, never 0; power in W (NVML: mW), memory in MiB; the event-reason
bitmask as hex text; timestamps `YYYY/MM/DD HH:MM:SS.mmm` in local time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime

# The fields farm asks for, in this order: columns are taken by position (header names changed across drivers:
# clocks_throttle_reasons.* became clocks_event_reasons.* in 535).
QUERY_FIELDS = ("timestamp", "power.draw", "memory.used", "memory.total", "utilization.gpu", "temperature.gpu",
                "clocks.current.sm", "clocks_event_reasons.active", "name")
MISSING = {"[N/A]", "[Not Supported]", "[Unknown Error]", "N/A", "-", ""}
# nvml.h's clock-event bits (nvidia-ml-py's pynvml.py): why the SM clock was held down
EVENT_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                 0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
                 0x100: "display_clocks"}
# a reading above these is not a reading (a parser must never turn garbage into a figure)
MAX_POWER_W, MAX_MEMORY_MIB, MAX_MHZ, MAX_TEMP_C = 10_000.0, 16 * 2**20, 100_000.0, 300.0


@dataclass(frozen=True)
class GpuSample:
    t_s: float  # seconds, on the sampler's clock (only differences mean anything)
    power_w: float | None = None
    energy_mj: float | None = None  # NVML's counter since the driver loaded (monotonic), where the GPU has it
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    utilization_percent: float | None = None
    temperature_c: float | None = None
    sm_mhz: float | None = None
    event_reasons: int | None = None
    name: str | None = None


def _number(cell: str, maximum: float) -> float | None:
    text = cell.strip()
    if text in MISSING:
        return None
    for unit in (" W", " MiB", " %", " MHz", " C"):
        if text.endswith(unit):
            text = text[: -len(unit)].strip()
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and 0 <= value <= maximum else None


def _bitmask(cell: str) -> int | None:
    text = cell.strip()
    if text in MISSING:
        return None
    try:
        return int(text, 16) if text.lower().startswith("0x") else int(text)
    except ValueError:
        return None


_MIDNIGHTS: dict[str, float] = {}  # "YYYY/MM/DD" -> that local midnight's epoch (strptime per row cost 25 µs)


def _timestamp(cell: str) -> float | None:
    """`YYYY/MM/DD HH:MM:SS.mmm` (local time) as epoch seconds; only differences between rows are used."""
    text = cell.strip()
    if len(text) < 19 or text[4] != "/" or text[7] != "/" or text[10] != " " or text[13] != ":" or text[16] != ":":
        return None
    day = text[:10]
    midnight = _MIDNIGHTS.get(day)
    try:
        if midnight is None:
            midnight = datetime.strptime(day, "%Y/%m/%d").timestamp()
            if len(_MIDNIGHTS) < 1000:  # a hostile tool printing a new date every row does not grow it
                _MIDNIGHTS[day] = midnight
        hours, minutes, seconds = int(text[11:13]), int(text[14:16]), float(text[17:])
    except ValueError:
        return None
    if not (0 <= hours < 24 and 0 <= minutes < 60 and 0 <= seconds < 61):
        return None
    return midnight + hours * 3600 + minutes * 60 + seconds


def parse_query_line(line: str) -> GpuSample | None:
    """One row of farm's --query-gpu (QUERY_FIELDS order); None for a header, a blank or a broken line."""
    cells = line.rstrip("\r\n").split(", ")
    if len(cells) < len(QUERY_FIELDS):
        return None
    head, name = cells[: len(QUERY_FIELDS) - 1], ", ".join(cells[len(QUERY_FIELDS) - 1:])  # a name may hold ", "
    t = _timestamp(head[0])
    if t is None:
        return None
    return GpuSample(t_s=t, power_w=_number(head[1], MAX_POWER_W), memory_used_mib=_number(head[2], MAX_MEMORY_MIB),
                     memory_total_mib=_number(head[3], MAX_MEMORY_MIB), utilization_percent=_number(head[4], 100.0),
                     temperature_c=_number(head[5], MAX_TEMP_C), sm_mhz=_number(head[6], MAX_MHZ),
                     event_reasons=_bitmask(head[7]), name=name.strip() or None)


def parse_query_output(text: str) -> list[GpuSample]:
    return [s for s in (parse_query_line(line) for line in text.splitlines()) if s is not None]


def _json_number(data: dict, key: str, maximum: float, scale: float = 1.0) -> float | None:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value) * scale
    return value if math.isfinite(value) and 0 <= value <= maximum else None


def parse_nvml_line(line: str) -> GpuSample | None:
    """One line of the NVML sampler (JSON; power in mW, energy in mJ as NVML gives them)."""
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    t = _json_number(data, "t", 1e12)
    if t is None:
        return None
    reasons = data.get("reasons")
    name = data.get("name")
    return GpuSample(t_s=t, power_w=_json_number(data, "power_mw", MAX_POWER_W * 1000, 0.001),
                     energy_mj=_json_number(data, "energy_mj", 1e18),
                     memory_used_mib=_json_number(data, "mem_used", MAX_MEMORY_MIB * 2**20, 1 / 2**20),
                     memory_total_mib=_json_number(data, "mem_total", MAX_MEMORY_MIB * 2**20, 1 / 2**20),
                     utilization_percent=_json_number(data, "util", 100.0),
                     temperature_c=_json_number(data, "temp", MAX_TEMP_C), sm_mhz=_json_number(data, "sm_mhz", MAX_MHZ),
                     event_reasons=reasons if isinstance(reasons, int) and not isinstance(reasons, bool) and reasons >= 0 else None,
                     name=name[:200] if isinstance(name, str) else None)


def parse_nvml_output(text: str) -> list[GpuSample]:
    return [s for s in (parse_nvml_line(line) for line in text.splitlines()) if s is not None]


def integrated_energy_mj(samples: list[GpuSample]) -> float | None:
    """Power integrated over the samples' own timestamps (trapezoids; a gap without a reading is skipped):
    W × s = J, in mJ. None with fewer than two timed power readings."""
    points = [(s.t_s, s.power_w) for s in samples if s.power_w is not None]
    if len(points) < 2:
        return None
    joules = sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in zip(points, points[1:]) if t1 > t0)
    return joules * 1000


def counter_energy_mj(samples: list[GpuSample]) -> float | None:
    """NVML's energy counter, last read minus first (monotonic since the driver loaded); None without two reads
    or when it went backwards (a driver reload between them)."""
    reads = [s.energy_mj for s in samples if s.energy_mj is not None]
    if len(reads) < 2 or reads[-1] < reads[0]:
        return None
    return reads[-1] - reads[0]


def reason_names(mask: int) -> list[str]:
    return [name for bit, name in EVENT_REASONS.items() if mask & bit] + ([f"0x{mask & ~0x1FF:x}"] if mask & ~0x1FF else [])


@dataclass
class GpuSummary:
    samples: int
    window_s: float | None  # first to last sample
    energy_mj: float | None
    energy_source: str | None  # "nvml_counter" | "integrated_power"
    power_avg_w: float | None
    power_peak_w: float | None
    memory_peak_mib: float | None
    memory_total_mib: float | None
    utilization_avg_percent: float | None
    utilization_peak_percent: float | None
    sm_mhz_avg: float | None
    sm_mhz_max: float | None
    temperature_max_c: float | None
    event_reasons: list[str] = field(default_factory=list)  # every reason seen in any sample, gpu_idle aside
    name: str | None = None

    def as_environment(self) -> dict:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def _avg(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(samples: list[GpuSample]) -> GpuSummary:
    """What a run reports from its GPU samples. Energy: NVML's counter where it read, else power integrated."""
    def vals(attr: str) -> list[float]:
        return [v for v in (getattr(s, attr) for s in samples) if v is not None]
    power, memory, util, sm = vals("power_w"), vals("memory_used_mib"), vals("utilization_percent"), vals("sm_mhz")
    energy, source = counter_energy_mj(samples), "nvml_counter"
    if energy is None:
        energy, source = integrated_energy_mj(samples), "integrated_power"
    reasons = 0
    for s in samples:
        reasons |= s.event_reasons or 0
    totals, temps = vals("memory_total_mib"), vals("temperature_c")
    return GpuSummary(
        samples=len(samples), window_s=samples[-1].t_s - samples[0].t_s if len(samples) > 1 else None,
        energy_mj=energy, energy_source=source if energy is not None else None,
        power_avg_w=_avg(power), power_peak_w=max(power, default=None), memory_peak_mib=max(memory, default=None),
        memory_total_mib=totals[-1] if totals else None, utilization_avg_percent=_avg(util),
        utilization_peak_percent=max(util, default=None), sm_mhz_avg=_avg(sm), sm_mhz_max=max(sm, default=None),
        temperature_max_c=max(temps, default=None), event_reasons=reason_names(reasons & ~0x1),
        name=next((s.name for s in samples if s.name), None))
