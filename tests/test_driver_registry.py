"""Drivers are looked up by name: each device family's `agents/<family>/driver.py` registers its names and the schema of its
device entry, and every driver (the sim's too) runs a task the same way."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from farm.agents.drivers import DeviceEntry, load_drivers
from farm.agents.lab import LabConfigError, load_lab
from farm.agents.sim.driver import SimDriver


def test_every_driver_registers_its_entry_schema_and_runs_tasks_alike() -> None:
    drivers = load_drivers()
    assert {"android", "jetson", "linux"} <= set(drivers)
    sim_params = list(inspect.signature(SimDriver.run).parameters)
    for kind in drivers.values():
        assert issubclass(kind.entry, DeviceEntry)
        driver_class = kind.build.__self__  # type: ignore[attr-defined]  # the driver's from_entry classmethod
        assert list(inspect.signature(driver_class.run).parameters) == sim_params == ["self", "task", "cancel_check"]


def test_a_lab_entry_is_checked_by_its_own_drivers_schema(tmp_path: Path) -> None:
    lab = tmp_path / "lab.yaml"
    lab.write_text("devices:\n  - {name: g6-1, driver: android, host: 10.0.0.2, username: farm}\n")
    with pytest.raises(LabConfigError, match=r"devices\.0\.username: Extra inputs are not permitted"):
        load_lab(lab)  # username is a board's field, not a phone's
    lab.write_text("devices:\n  - {name: x, driver: fastboot, host: h}\n")
    with pytest.raises(LabConfigError, match=r"devices\.0\.driver: 'fastboot' is not a driver; use one of android, jetson, linux"):
        load_lab(lab)
    lab.write_text("devices:\n  - {name: nano-1, driver: jetson, host: nano.lab, username: farm, ssh_key: /k}\n"
                   "  - {name: g6-1, driver: android, host: 10.0.0.2, type: lg-g6}\n")
    nano, g6 = load_lab(lab)
    assert (nano.driver.name, g6.driver.name, g6.device_type and g6.device_type.name) == ("jetson", "android", "lg-g6")


def test_a_non_finite_board_install_timeout_is_refused_naming_the_field(tmp_path: Path) -> None:
    lab = tmp_path / "lab.yaml"
    lab.write_text("devices:\n  - {name: b1, driver: linux, host: 127.0.0.1, username: u, ssh_key: k, env_timeout_s: .inf}\n")
    with pytest.raises(LabConfigError, match=r"devices\.0\.env_timeout_s: .*finite"):
        load_lab(lab)
