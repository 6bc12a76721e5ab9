"""A phone's facts script output (getprop, cpufreq, meminfo, thermal zones, battery) as AndroidFacts: pure, over text."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable


@dataclass
class AndroidFacts:
    """What the phone says about itself; goes into every run's environment."""

    serial: str
    model: str = ""
    manufacturer: str = ""
    fingerprint: str = ""
    abi: str = ""
    abi_list: list[str] = field(default_factory=list)
    soc: str = ""  # ro.soc.model (Android 12+), else ro.board.platform
    android_release: str = ""
    sdk: int | None = None
    cpu_max_khz: dict[int, int] = field(default_factory=dict)  # core → cpuinfo_max_freq
    cpu_cur_khz: dict[int, int] = field(default_factory=dict)
    governors: dict[int, str] = field(default_factory=dict)
    mem_total_mb: float | None = None
    mem_available_mb: float | None = None
    thermal_c: dict[str, float] = field(default_factory=dict)  # zone type → °C
    battery_level: int | None = None
    battery_temp_c: float | None = None
    battery_plugged: str | None = None  # "ac" | "usb" | "wireless" | "none"

    @property
    def cores(self) -> int:
        return len(self.cpu_max_khz)

    def to_environment(self) -> dict[str, Any]:
        return asdict(self)


def parse_facts(text: str, *, serial: str) -> AndroidFacts:
    """Pure: the facts script's output → AndroidFacts (tolerant of missing files and properties). Each line is read
    by the reader of its first word (_READERS); the properties are mapped onto the facts at the end."""
    read = _FactsRead(AndroidFacts(serial=serial))
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        reader = _READERS.get(kind)
        if reader is not None:
            reader(read, rest)
    facts = read.facts
    _apply_props(facts, read.props)
    if any(line.startswith("battery ") for line in text.splitlines()):
        facts.battery_plugged = read.plugged[0] if read.plugged else "none"
    return facts


@dataclass
class _FactsRead:
    """The facts as they are read, the properties (mapped at the end) and the power sources seen plugged."""

    facts: AndroidFacts
    props: dict[str, str] = field(default_factory=dict)
    plugged: list[str] = field(default_factory=list)


def _prop(read: _FactsRead, rest: str) -> None:
    key, _, value = rest.partition("=")
    read.props[key] = value.strip()


def _cpu(read: _FactsRead, rest: str) -> None:
    """`cpu N max=… cur=… governor=…`: one core's frequencies (kHz) and governor."""
    words = rest.split()
    if not words or not words[0].isdigit():
        return  # a line without its core's number (a cut line) says nothing of any core
    core = words[0]
    values = dict(f.split("=", 1) for f in words[1:] if "=" in f)
    facts = read.facts
    if values.get("max", "").isdigit():
        facts.cpu_max_khz[int(core)] = int(values["max"])
    if values.get("cur", "").isdigit():
        facts.cpu_cur_khz[int(core)] = int(values["cur"])
    if values.get("governor"):
        facts.governors[int(core)] = values["governor"]


def _mem(read: _FactsRead, rest: str) -> None:
    match = re.match(r"(\w+):\s*(\d+)\s*kB", rest)
    if match:
        mb = int(match.group(2)) / 1024
        if match.group(1) == "MemTotal":
            read.facts.mem_total_mb = round(mb, 1)
        else:
            read.facts.mem_available_mb = round(mb, 1)


def _thermal(read: _FactsRead, rest: str) -> None:
    zone, _, value = rest.rpartition("=")
    if zone and re.fullmatch(r"-?\d+", value.strip()):
        raw = int(value)
        # Most zones report millidegrees; a few old kernels report whole degrees.
        read.facts.thermal_c[zone] = raw / 1000 if abs(raw) >= 1000 else float(raw)


def _battery(read: _FactsRead, rest: str) -> None:
    """A `dumpsys battery` line: the level, the temperature (tenths of a degree), a power source plugged."""
    key, _, value = rest.partition(":")
    value = value.strip()
    if key == "level" and value.isdigit():
        read.facts.battery_level = int(value)
    elif key == "temperature" and re.fullmatch(r"-?\d+", value):
        read.facts.battery_temp_c = int(value) / 10  # dumpsys reports tenths of a degree
    elif key.endswith("powered") and value == "true":
        read.plugged.append(key.split()[0].lower())


# The facts script's line kinds (its first word) and their readers; any other line is ignored.
_READERS: dict[str, Callable[[_FactsRead, str], None]] = {
    "prop": _prop, "cpu": _cpu, "mem": _mem, "thermal": _thermal, "battery": _battery}


def _apply_props(facts: AndroidFacts, props: dict[str, str]) -> None:
    """getprop's properties as the facts (the SoC: ro.soc.model on Android 12+, else ro.board.platform)."""
    facts.model = props.get("ro.product.model", "")
    facts.manufacturer = props.get("ro.product.manufacturer", "")
    facts.fingerprint = props.get("ro.build.fingerprint", "")
    facts.abi = props.get("ro.product.cpu.abi", "")
    facts.abi_list = [a for a in props.get("ro.product.cpu.abilist", "").split(",") if a]
    facts.soc = props.get("ro.soc.model") or props.get("ro.board.platform", "")
    facts.android_release = props.get("ro.build.version.release", "")
    sdk = props.get("ro.build.version.sdk", "")
    facts.sdk = int(sdk) if sdk.isdigit() else None
