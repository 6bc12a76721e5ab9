"""Device drivers by name: each device family's `agents/<family>/driver.py` registers its driver name(s),
the schema of its entry in the lab's device list, and how to build the driver from one. Adding a
kind of hardware is adding that one package; lab.py and the agent look drivers up here."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from pydantic import Field

import farm.agents
from farm.proto.device_types import DeviceType
from farm.proto.results import RunResult
from farm.proto.spec import Strict
from farm.proto.tasks import TaskSpec


class DeviceEntry(Strict):
    """What every device entry has; a driver's own entry adds how to reach the device."""

    name: str
    driver: str
    type: str | None = None
    tags: list[str] = Field(default_factory=list)


class Driver(Protocol):
    """What the agent calls: every driver, the sim's included, runs a task the same way."""

    name: str

    def run(self, task: TaskSpec, cancel_check: Callable[[], bool]) -> RunResult: ...


class DeviceDriver(Driver, Protocol):
    device_type: DeviceType | None

    def facts(self) -> Any: ...

    def type_probe(self, facts: Any) -> dict[str, Any]:
        """The facts a device type's match rules look at (proto/device_types)."""
        ...


@dataclass(frozen=True)
class DriverKind:
    name: str
    entry: type[DeviceEntry]
    build: Callable[[Any, DeviceType | None], DeviceDriver]


DRIVERS: dict[str, DriverKind] = {}


def register(name: str, entry: type[DeviceEntry], build: Callable[[Any, DeviceType | None], DeviceDriver]) -> None:
    if name in DRIVERS and DRIVERS[name].entry is not entry:
        raise ValueError(f"two driver modules register the driver name {name!r}")
    DRIVERS[name] = DriverKind(name, entry, build)


def load_drivers() -> dict[str, DriverKind]:
    """Every device family's driver module (farm.agents.<family>.driver), imported once (each registers itself)."""
    for family in pkgutil.iter_modules(farm.agents.__path__):
        if family.ispkg and importlib.util.find_spec(f"farm.agents.{family.name}.driver") is not None:
            importlib.import_module(f"farm.agents.{family.name}.driver")
    return DRIVERS
