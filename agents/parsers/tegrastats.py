"""tegrastats lines → typed samples, and samples → the figures a run keeps.

The format drifts across JetPack releases (see the reference's real lines), so the parser
reads the line field by field and keeps anything it does not know as a raw token instead
of failing: a new field on a new board must never cost a run its telemetry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Iterable

# Sensors that are absent print this value instead of being left out.
NO_SENSOR_CELSIUS = -256.0

# Rails that measure the whole module's input; without one, the rails are summed.
TOTAL_INPUT_RAILS = ("VDD_IN", "VIN", "POM_5V_IN")
# `NC` rails are not connected and always read 0.
UNCONNECTED_RAILS = ("NC",)


@dataclass(frozen=True)
class CpuCore:
    online: bool
    load_percent: float | None = None  # relative to freq_mhz, as tegrastats reports it
    freq_mhz: int | None = None


@dataclass(frozen=True)
class EngineReading:
    """EMC, GR3D (the iGPU) and the fixed-function engines: `off`, `12%@115`, `@[713,713]`, `174`."""

    name: str
    online: bool
    load_percent: float | None = None
    freq_mhz: tuple[int, ...] = ()  # one per GPC for GR3D on multi-GPC parts, else one value


@dataclass(frozen=True)
class Temperature:
    name: str
    celsius: float | None  # None when the board prints -256C (no sensor)
    # JetPack 7 prints `cpu@52.968C/52.968C`; the second value is undocumented, kept as printed
    second_celsius: float | None = None


@dataclass(frozen=True)
class PowerRail:
    name: str
    current_mw: int
    average_mw: int
    third_mw: int | None = None  # JetPack 7 prints a third value (`a/b/c`); kept, not interpreted
    unit_printed: bool = True  # L4T 32 prints `POM_5V_IN 933/933` with no unit (still mW)


@dataclass
class TegrastatsSample:
    timestamp: datetime | None = None  # JetPack 5+ prefixes `MM-DD-YYYY HH:MM:SS`
    ram_used_mb: int | None = None
    ram_total_mb: int | None = None
    ram_lfb_blocks: int | None = None  # largest free block: count × size
    ram_lfb_block_mb: int | None = None
    swap_used_mb: int | None = None
    swap_total_mb: int | None = None
    swap_cached_mb: int | None = None
    iram_used_kb: int | None = None
    iram_total_kb: int | None = None
    iram_lfb_kb: int | None = None
    cpus: list[CpuCore] = field(default_factory=list)
    emc: EngineReading | None = None
    gpu: EngineReading | None = None  # GR3D_FREQ
    engines: dict[str, EngineReading] = field(default_factory=dict)  # NVENC, NVDEC, VIC, APE…
    temperatures: dict[str, Temperature] = field(default_factory=dict)
    rails: dict[str, PowerRail] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)  # tokens this parser does not understand

    @property
    def cpu_total_percent(self) -> float | None:
        """Load of all online cores added up, in % of one core (like the sim's telemetry)."""
        loads = [c.load_percent for c in self.cpus if c.online and c.load_percent is not None]
        return float(sum(loads)) if loads else None

    @property
    def total_power_mw(self) -> int | None:
        """The module's input power now: its input rail, else the sum of the connected rails."""
        for name in TOTAL_INPUT_RAILS:
            if name in self.rails:
                return self.rails[name].current_mw
        connected = [r.current_mw for name, r in self.rails.items() if name not in UNCONNECTED_RAILS]
        return sum(connected) if connected else None

    @property
    def total_power_source(self) -> str | None:
        for name in TOTAL_INPUT_RAILS:
            if name in self.rails:
                return name
        connected = [name for name in self.rails if name not in UNCONNECTED_RAILS]
        return "sum of " + "+".join(connected) if connected else None


_NUM = r"-?\d+(?:\.\d+)?"
_END = r"(?=\s|$)"

_TIMESTAMP = re.compile(r"(\d{2}-\d{2}-\d{4} \d{2}:\d{2}:\d{2})" + _END)
_RAM = re.compile(r"RAM (\d+)/(\d+)MB(?:\s*\(lfb (\d+)x(\d+)MB\))?" + _END)
_SWAP = re.compile(r"SWAP (\d+)/(\d+)MB(?:\s*\(cached (\d+)MB\))?" + _END)
_IRAM = re.compile(r"IRAM (\d+)/(\d+)kB\s*(?:\(lfb (\d+)kB\))?" + _END)
# `CPU [1%@102,off,...]`, or the oldest form with one shared frequency: `CPU [2%,0%]@102`
_CPU = re.compile(r"CPU \[([^\]]*)\](?:@(\d+))?" + _END)
_CPU_CORE = re.compile(r"(\d+(?:\.\d+)?)%(?:@(\d+))?")
_TEMPERATURE = re.compile(rf"([A-Za-z][\w]*)@({_NUM})C(?:/({_NUM})C)?" + _END)
_RAIL = re.compile(r"([A-Za-z][\w]*) (\d+)(mW)?/(\d+)(?:mW)?(?:/(\d+)(?:mW)?)?" + _END)
_ENGINE = re.compile(
    r"([A-Z][A-Z0-9_]*) "
    r"(?:(off|OFF)|(?:(\d+(?:\.\d+)?)%)?@\[([\d,]+)\]|(?:(\d+(?:\.\d+)?)%)?@(\d+)|(\d+(?:\.\d+)?)%|(\d+))" + _END
)


def parse_tegrastats_line(line: str) -> TegrastatsSample:
    """One line of `tegrastats` output → a sample. Never raises; unknown text lands in `.unknown`."""
    sample = TegrastatsSample()
    text = line.strip()
    pos = 0
    if m := _TIMESTAMP.match(text):
        try:
            sample.timestamp = datetime.strptime(m.group(1), "%m-%d-%Y %H:%M:%S")
        except ValueError:
            sample.unknown.append(m.group(1))
        pos = m.end()
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            return sample
        end = _read_field(text, pos, sample)
        if end is None:
            # Not a field we know: keep the token as printed and carry on with the next one.
            end = pos
            while end < len(text) and not text[end].isspace():
                end += 1
            sample.unknown.append(text[pos:end])
        pos = end


def _read_field(text: str, pos: int, sample: TegrastatsSample) -> int | None:
    """Parse the field starting at `pos` into `sample`; return where it ends, or None."""
    if m := _RAM.match(text, pos):
        sample.ram_used_mb, sample.ram_total_mb = int(m[1]), int(m[2])
        sample.ram_lfb_blocks, sample.ram_lfb_block_mb = _int_or_none(m[3]), _int_or_none(m[4])
        return m.end()
    if m := _SWAP.match(text, pos):
        sample.swap_used_mb, sample.swap_total_mb = int(m[1]), int(m[2])
        sample.swap_cached_mb = _int_or_none(m[3])
        return m.end()
    if m := _IRAM.match(text, pos):
        sample.iram_used_kb, sample.iram_total_kb = int(m[1]), int(m[2])
        sample.iram_lfb_kb = _int_or_none(m[3])
        return m.end()
    if m := _CPU.match(text, pos):
        cores = _parse_cores(m[1], _int_or_none(m[2]))
        if cores is None:
            return None
        sample.cpus = cores
        return m.end()
    if m := _TEMPERATURE.match(text, pos):
        sample.temperatures[m[1]] = Temperature(m[1], _celsius(m[2]), _celsius(m[3]) if m[3] else None)
        return m.end()
    if m := _RAIL.match(text, pos):
        sample.rails[m[1]] = PowerRail(
            m[1], int(m[2]), int(m[4]), _int_or_none(m[5]), unit_printed=m[3] is not None
        )
        return m.end()
    if m := _ENGINE.match(text, pos):
        engine = _engine(m)
        if engine.name == "EMC_FREQ":
            sample.emc = engine
        elif engine.name == "GR3D_FREQ":
            sample.gpu = engine
        else:
            sample.engines[engine.name] = engine
        return m.end()
    return None


def _parse_cores(body: str, shared_freq_mhz: int | None) -> list[CpuCore] | None:
    cores: list[CpuCore] = []
    for entry in body.split(","):
        entry = entry.strip()
        if entry.lower() == "off":
            cores.append(CpuCore(online=False))
            continue
        m = _CPU_CORE.fullmatch(entry)
        if m is None:
            return None
        freq = int(m[2]) if m[2] else shared_freq_mhz
        cores.append(CpuCore(online=True, load_percent=float(m[1]), freq_mhz=freq))
    return cores


def _engine(m: re.Match[str]) -> EngineReading:
    name, off, array_load, array, load, freq, load_only, plain = m.groups()
    if off:
        return EngineReading(name, online=False)
    if array is not None:
        freqs = tuple(int(v) for v in array.split(",") if v)
        return EngineReading(name, True, _float_or_none(array_load), freqs)
    if freq is not None:
        return EngineReading(name, True, _float_or_none(load), (int(freq),))
    if load_only is not None:
        return EngineReading(name, True, float(load_only))
    return EngineReading(name, True, None, (int(plain),))  # `APE 174`: a frequency only


def _celsius(value: str) -> float | None:
    celsius = float(value)
    return None if celsius == NO_SENSOR_CELSIUS else celsius


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value is not None else None


def _float_or_none(value: str | None) -> float | None:
    return float(value) if value is not None else None


@dataclass(frozen=True)
class TegrastatsSummary:
    samples: int
    interval_ms: float
    cpu_avg_percent: float | None  # all cores added up, % of one core
    cpu_peak_percent: float | None
    ram_avg_mb: float | None
    ram_peak_mb: int | None
    power_avg_mw: float | None  # module input power (see power_source)
    power_peak_mw: int | None
    energy_mj: float | None  # power integrated over samples × interval
    power_source: str | None  # which rail(s) the power figures come from


def summarize(samples: Iterable[TegrastatsSample], interval_ms: float) -> TegrastatsSummary:
    """Average and peak figures over a run; each sample stands for one sampling interval."""
    taken = list(samples)
    cpu = [s.cpu_total_percent for s in taken if s.cpu_total_percent is not None]
    ram = [s.ram_used_mb for s in taken if s.ram_used_mb is not None]
    power = [s.total_power_mw for s in taken if s.total_power_mw is not None]
    sources = {s.total_power_source for s in taken if s.total_power_source is not None}
    interval_s = interval_ms / 1000.0
    return TegrastatsSummary(
        samples=len(taken),
        interval_ms=interval_ms,
        cpu_avg_percent=sum(cpu) / len(cpu) if cpu else None,
        cpu_peak_percent=max(cpu) if cpu else None,
        ram_avg_mb=sum(ram) / len(ram) if ram else None,
        ram_peak_mb=max(ram) if ram else None,
        power_avg_mw=sum(power) / len(power) if power else None,
        power_peak_mw=max(power) if power else None,
        energy_mj=sum(p * interval_s for p in power) if power else None,
        power_source=", ".join(sorted(sources)) if sources else None,
    )


def parse_tegrastats_output(text: str) -> list[TegrastatsSample]:
    """Every non-empty line of a captured tegrastats stream, in order."""
    return [parse_tegrastats_line(line) for line in text.splitlines() if line.strip()]
