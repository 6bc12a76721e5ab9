"""The lab's device list: which phones and boards an agent drives, and how to reach them.

A YAML file (`farm agent --devices lab.yaml`, or FARM_DEVICES for embedded mode):

    devices:
      - name: g6-1
        driver: android            # android | jetson | linux
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
        python: /opt/farm/bin/python
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import Field, ValidationError

from farm.agents.android_driver import AndroidDeviceConfig, AndroidDriver
from farm.agents.board_driver import BoardDeviceConfig, BoardDriver
from farm.proto.device_types import DeviceType, load_device_types
from farm.proto.spec import Strict

DEVICES_ENV = "FARM_DEVICES"


class LabConfigError(ValueError):
    """The device list cannot be used; the message names the file and the entry."""


def _path(p: str) -> Path:
    return Path(os.path.expanduser(p))


class AndroidEntry(Strict):
    name: str
    driver: Literal["android"]
    type: str | None = None
    tags: list[str] = Field(default_factory=list)
    host: str
    port: int = 5555
    adb_key: str = "~/.config/farm/adbkey"
    benchmark_model: dict[str, str] = Field(default_factory=dict)
    thermal_limit_c: float = 45.0


class BoardEntry(Strict):
    name: str
    driver: Literal["jetson", "linux"]
    type: str | None = None
    tags: list[str] = Field(default_factory=list)
    host: str
    port: int = 22
    username: str
    ssh_key: str
    known_hosts: str = "~/.ssh/known_hosts"
    host_key: str | None = None
    trust_on_first_use: bool = False
    python: str = "python3"
    nv_tegra_release: str | None = None
    device_tree_model: str | None = None
    telemetry: Literal["auto", "jtop", "tegrastats"] = "auto"  # jetson: jtop when its service is usable


class LabConfig(Strict):
    devices: list[Union[AndroidEntry, BoardEntry]] = Field(default_factory=list)


class LabDevice:
    """A configured device: its entry, its type, and the driver that runs tasks on it."""

    def __init__(self, entry: AndroidEntry | BoardEntry, device_type: DeviceType | None) -> None:
        self.entry = entry
        self.name = entry.name
        self.device_type = device_type
        self.tags = list(entry.tags)
        if isinstance(entry, AndroidEntry):
            self.driver: AndroidDriver | BoardDriver = AndroidDriver(AndroidDeviceConfig(
                name=entry.name, host=entry.host, port=entry.port, key_path=_path(entry.adb_key),
                benchmark_model={abi: _path(p) for abi, p in entry.benchmark_model.items()},
                thermal_limit_c=entry.thermal_limit_c), device_type)
        else:
            extra: dict[str, Any] = {k: v for k, v in (("nv_tegra_release", entry.nv_tegra_release),
                                                      ("device_tree_model", entry.device_tree_model)) if v}
            self.driver = BoardDriver(BoardDeviceConfig(
                name=entry.name, kind=entry.driver, host=entry.host, port=entry.port, username=entry.username,
                key_path=_path(entry.ssh_key), known_hosts=_path(entry.known_hosts),
                pinned_fingerprint=entry.host_key, trust_on_first_use=entry.trust_on_first_use,
                python=entry.python, telemetry=entry.telemetry, **extra))


def load_lab(path: Path) -> list[LabDevice]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise LabConfigError(f"{path}: cannot read the device list: {e}") from None
    try:
        config = LabConfig.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
        raise LabConfigError(f"{path}: {problems}") from None
    types = load_device_types()
    devices, seen = [], set()
    for entry in config.devices:
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
    from farm.proto.device_types import load_device_types, match_device_type

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
        if isinstance(device.entry, AndroidEntry):
            probe = {"os": "android", "getprop": {"ro.product.model": facts.model}}
        else:
            probe = {"os": device.entry.driver, "device_tree_model": facts.get("board_model") or ""}
        device.device_type = match_device_type(probe, types)
        if device.device_type is None:
            problems.append(f"{device.name}: no device type matches its facts; add one (see proto/device_types)")
        elif isinstance(device.driver, AndroidDriver):
            device.driver.device_type = device.device_type
    return problems
