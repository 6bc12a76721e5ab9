"""Device types are data: the built-in profiles load, devices are recognised from their facts,
and a lab adds a type by dropping a YAML file in a folder — bad ones named with their field."""

from __future__ import annotations

from pathlib import Path

import pytest

from farm.proto.device_types import DeviceTypeError, load_device_types, match_device_type

BUILTIN = {"lg-g6", "samsung-s8", "pixel-4", "jetson-nano", "jetson-orin-nano", "raspberry-pi-4"}


def test_builtin_profiles_load_with_sim_budgets() -> None:
    types = load_device_types()
    assert BUILTIN <= set(types)
    g6 = types["lg-g6"]
    assert g6.os == "android" and g6.cores == 4 and g6.memory_mb == 4096
    # the published experiment's budget: 1/2/4 CPUs and 2 GB for 1/2/4 threads
    assert [(t, b.cpus, b.memory) for t, b in sorted(g6.sim_budget.items())] == [
        (1, 1, 2 << 30), (2, 2, 2 << 30), (4, 4, 2 << 30)]
    assert types["jetson-nano"].calibration_keys == ["threads", "runtime", "power_mode"]
    assert types["pixel-4"].native_tool.taskset_mask_by_threads[1] == "80"
    # a thread count the profile does not list gets cpus = threads, capped at the device's cores
    assert types["raspberry-pi-4"].budget_for(8).cpus == 4


@pytest.mark.parametrize("facts, expected", [
    ({"os": "android", "getprop": {"ro.product.model": "LG-H870"}}, "lg-g6"),
    ({"os": "android", "getprop": {"ro.product.model": "Pixel 4"}}, "pixel-4"),
    ({"os": "jetson", "device_tree_model": "NVIDIA Jetson Nano Developer Kit\x00"}, "jetson-nano"),
    ({"os": "linux", "device_tree_model": "Raspberry Pi 4 Model B Rev 1.4"}, "raspberry-pi-4"),
    ({"os": "android", "getprop": {"ro.product.model": "Nokia 3310"}}, None),
])
def test_devices_are_matched_to_their_type(facts: dict, expected: str | None) -> None:
    t = match_device_type(facts)
    assert (t.name if t else None) == expected


def test_a_lab_adds_a_type_without_code(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "mi11.yaml").write_text("""
name: xiaomi-mi11
os: android
abi: arm64-v8a
memory_mb: 8192
clusters: [{kind: prime, count: 1, max_mhz: 2840}, {kind: big, count: 3, max_mhz: 2420}, {kind: little, count: 4, max_mhz: 1800}]
native_tool: {name: benchmark_model}
sim_budget: {"1": {cpus: 1, memory: 4g}}
match: {getprop: {ro.product.model: ["M2011K2G"]}}
""")
    monkeypatch.setenv("FARM_DEVICE_TYPES", str(tmp_path))
    assert match_device_type({"getprop": {"ro.product.model": "M2011K2G"}}).name == "xiaomi-mi11"


def test_a_bad_profile_names_its_file_and_field(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "broken.yaml").write_text("name: x\nos: windows\nabi: x86\nmemory_mb: 1\nclusters: []\n"
                                          "native_tool: {name: benchmark_model}\nsim_budget: {}\n")
    monkeypatch.setenv("FARM_DEVICE_TYPES", str(tmp_path))
    with pytest.raises(DeviceTypeError, match=r"broken\.yaml: .*os"):
        load_device_types()
