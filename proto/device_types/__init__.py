"""Device types: YAML profiles of phones and boards (cores, memory, ABI, native tool, the sim
budget per thread count, how to recognise one, what a calibration is keyed by).

The built-in profiles sit beside this file; a lab adds or overrides types by dropping YAML
files into a folder named in FARM_DEVICE_TYPES (colon-separated) or ~/.config/farm/device_types,
without touching code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator

from farm.proto.accelerators import UNIT_CLASS
from farm.proto.copying import replaced
from farm.proto.spec import Strict, default_cpus, parse_memory

BUILTIN_DIR = Path(__file__).parent
USER_DIR = Path(os.path.expanduser("~/.config/farm/device_types"))


CalibrationKeyName = Literal["threads", "runtime", "power_mode", "precision"]


class DeviceTypeError(ValueError):
    """A profile that cannot be used; the message names the file and field."""


class Cluster(Strict):
    kind: Literal["prime", "big", "little"]
    count: int = Field(gt=0)
    max_mhz: int = Field(gt=0)
    core: str | None = None


class NativeTool(Strict):
    name: Literal["benchmark_model", "harness"]
    flags: list[str] = Field(default_factory=list)
    taskset_mask_by_threads: dict[int, str] = Field(default_factory=dict, description="hex CPU mask per thread count")
    telemetry: list[Literal["jtop", "tegrastats", "proc"]] = Field(default_factory=list)


class SimBudgetEntry(Strict):
    cpus: float = Field(gt=0)
    memory: int

    @field_validator("memory", mode="before")
    @classmethod
    def _memory(cls, v: Any) -> int:
        return parse_memory(v)


class Match(Strict):
    getprop: dict[str, list[str]] = Field(default_factory=dict, description="Android: property -> accepted values")
    device_tree_model: list[str] = Field(default_factory=list, description="Linux/Jetson: prefixes of /proc/device-tree/model")
    gpu_name: list[str] = Field(default_factory=list, description="NVIDIA hosts: prefixes of nvidia-smi's GPU name")


class DeviceType(Strict):
    name: str
    os: Literal["android", "jetson", "linux", "nvidia"]
    abi: str
    soc: str | None = None
    memory_mb: int = Field(gt=0)
    clusters: list[Cluster]
    native_tool: NativeTool
    sim_budget: dict[int, SimBudgetEntry] = Field(description="thread count -> sim budget")
    match: Match = Field(default_factory=Match)
    calibration_keys: list[CalibrationKeyName] = Field(default_factory=lambda: list[CalibrationKeyName](["threads", "runtime"]))
    # the compute units a job may ask of this device, in order of preference (a class such as gpu takes the first
    # of its kind): proto/accelerators.py
    accelerators: list[str] = Field(default_factory=lambda: ["cpu"])
    # how fast the board does the sim host's work (0.1: ten times slower): a job's timeouts are written for
    # the sim, so on this board they are divided by it
    relative_speed: float = Field(1.0, gt=0, le=100, allow_inf_nan=False)
    source: str = ""  # the file it came from, filled by the loader

    @field_validator("accelerators")
    @classmethod
    def _known_units(cls, v: list[str]) -> list[str]:
        unknown = [u for u in v if u not in UNIT_CLASS]
        if unknown or not v:
            raise ValueError(f"unknown compute unit(s) {unknown}; use {', '.join(UNIT_CLASS)}" if unknown
                             else "list at least one compute unit, e.g. [cpu]")
        return v

    @property
    def cores(self) -> int:
        return sum(c.count for c in self.clusters)

    def budget_for(self, threads: int) -> SimBudgetEntry:
        """The sim budget for a thread count: the profile's own, else the nearest smaller one scaled."""
        if threads in self.sim_budget:
            return self.sim_budget[threads]
        known = sorted(self.sim_budget)
        base = max((t for t in known if t <= threads), default=known[0])
        entry = self.sim_budget[base]
        return replaced(entry, cpus=default_cpus(None, threads, self.cores))

    def matches(self, facts: dict[str, Any]) -> bool:
        props = facts.get("getprop") or {}
        for prop, accepted in self.match.getprop.items():
            if props.get(prop) in accepted:
                return True
        model = (facts.get("device_tree_model") or "").strip("\x00 \n")
        gpu = str(facts.get("gpu_name") or "")
        return (any(model.startswith(prefix) for prefix in self.match.device_tree_model)
                or bool(gpu) and any(gpu.startswith(prefix) for prefix in self.match.gpu_name))


def _search_dirs() -> list[Path]:
    extra = [Path(p) for p in os.environ.get("FARM_DEVICE_TYPES", "").split(":") if p]
    return [BUILTIN_DIR, USER_DIR, *extra]  # later folders override earlier ones by name


def load_device_type(path: Path) -> DeviceType:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise DeviceTypeError(f"{path}: cannot read the device type: {e}") from None
    if not isinstance(data, dict):
        raise DeviceTypeError(f"{path}: a device type is a mapping of fields (name:, os:, clusters:, ...)")
    try:
        return DeviceType.model_validate({**data, "source": str(path)})
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
        raise DeviceTypeError(f"{path}: {problems}") from None


def load_device_types() -> dict[str, DeviceType]:
    types: dict[str, DeviceType] = {}
    for directory in _search_dirs():
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob("*.yaml")):
            t = load_device_type(path)
            types[t.name] = t
    return types


def match_device_type(facts: dict[str, Any], types: dict[str, DeviceType] | None = None) -> DeviceType | None:
    """The type whose match rules the device's facts satisfy (first by name), or None."""
    for t in sorted((types or load_device_types()).values(), key=lambda t: t.name):
        if (facts.get("os") in (None, t.os)) and t.matches(facts):
            return t
    return None
