"""The lab's device list: which phones and boards an agent drives, and how to reach them.

A YAML file (`farm agent --devices lab.yaml`, or FARM_DEVICES for embedded mode):

    devices:
      - name: g6-1
        driver: android            # a registered driver (agents/<family>/driver.py): android, jetson, linux
        type: lg-g6                # a device type (proto/device_types); optional: matched from facts
        tags: [rack-a]
        host: 10.0.0.21            # adb over TCP
        port: 5555
        adb_key: ~/.config/farm/adbkey
        benchmark_model: {arm64-v8a: ~/lab/bin/benchmark_model-arm64}
      - name: nano-1
        driver: jetson
        host: nano-1.lab
        username: farm
        ssh_key: ~/.ssh/farm_ed25519
        known_hosts: ~/.ssh/known_hosts
        host_key: SHA256:...       # optional pin; else the key must be in known_hosts
        python: /usr/bin/python3  # the board's own (3.6+), with numpy and the runtimes; no farm there
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError

from farm.agents.drivers import DeviceDriver, DeviceEntry, load_drivers
from farm.proto.device_types import DeviceType, load_device_types, match_device_type

DEVICES_ENV = "FARM_DEVICES"


class LabConfigError(ValueError):
    """The device list cannot be used; the message names the file and the entry."""


class LabConfig(BaseModel):
    devices: list[dict[str, Any]] = Field(default_factory=list)  # each checked by its driver's own entry schema


class LabDevice:
    """A configured device: its entry, its type, and the driver that runs tasks on it."""

    def __init__(self, entry: DeviceEntry, device_type: DeviceType | None) -> None:
        self.entry = entry
        self.name = entry.name
        self.device_type = device_type
        self.tags = list(entry.tags)
        self.driver: DeviceDriver = load_drivers()[entry.driver].build(entry, device_type)


def _entry(raw: Any, index: int) -> DeviceEntry:
    """One device entry, validated by the schema of the driver it names."""
    drivers = load_drivers()
    name = raw.get("driver") if isinstance(raw, dict) else None
    if name not in drivers:
        raise ValueError(f"devices.{index}.driver: {name!r} is not a driver; use one of {', '.join(sorted(drivers))}")
    try:
        return drivers[name].entry.model_validate(raw)
    except ValidationError as e:
        raise ValueError("; ".join(f"devices.{index}.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
                                   for err in e.errors())) from None


def load_lab(path: Path) -> list[LabDevice]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise LabConfigError(f"{path}: cannot read the device list: {e}") from None
    try:
        config = LabConfig.model_validate(data)
        entries = [_entry(raw, i) for i, raw in enumerate(config.devices)]
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
        raise LabConfigError(f"{path}: {problems}") from None
    except ValueError as e:
        raise LabConfigError(f"{path}: {e}") from None
    types = load_device_types()
    devices, seen = [], set()
    for entry in entries:
        if entry.name in seen:
            raise LabConfigError(f"{path}: two devices are named {entry.name!r}")
        seen.add(entry.name)
        if entry.name == "sim" or entry.name.startswith(("type:", "tag:")):
            raise LabConfigError(f"{path}: {entry.name!r} is reserved; choose another device name")
        if entry.type is not None and entry.type not in types:
            raise LabConfigError(f"{path}: device {entry.name!r} has type {entry.type!r}, which is not a known "
                                 f"device type ({', '.join(sorted(types))})")
        devices.append(LabDevice(entry, types.get(entry.type) if entry.type else None))
    return devices


def lab_from_environment() -> list[LabDevice]:
    path = os.environ.get(DEVICES_ENV)
    return load_lab(Path(path)) if path else []


def discover_types(devices: list[LabDevice]) -> list[str]:
    """Give each untyped device the type its own facts match (getprop model on a phone, the
    device-tree model on a board). Returns what could not be reached or matched, for the log."""
    types = load_device_types()
    problems = []
    for device in devices:
        if device.device_type is not None:
            continue
        try:
            facts = device.driver.facts()
        except Exception as e:  # an unreachable device keeps no type; its runs will say why
            problems.append(f"{device.name}: facts unavailable ({e})")
            continue
        device.device_type = match_device_type(device.driver.type_probe(facts), types)
        if device.device_type is None:
            problems.append(f"{device.name}: no device type matches its facts; add one (see proto/device_types)")
        else:
            device.driver.device_type = device.device_type
    return problems
