"""The NVIDIA GPU telemetry parsers (agents/parsers/nvidia_smi.py) on real captured nvidia-smi rows
(tests/fixtures/nvidia_smi/, sources in each file) and on the NVML sampler's lines."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from farm.agents.parsers.nvidia_smi import (
    QUERY_FIELDS, GpuSample, integrated_energy_mj, parse_nvml_output, parse_query_line, parse_query_output,
    reason_names, summarize,
)

FIXTURES = Path(__file__).parent / "fixtures" / "nvidia_smi"


def farm_order(row: str) -> str:
    """A captured row (its query: timestamp, name, power, memory used, total, util, temp, sm, reasons) in farm's
    QUERY_FIELDS order (name last): the same cells, moved, never changed."""
    cells = row.split(", ")
    return ", ".join([cells[0], *cells[2:], cells[1]])


def captured(name: str) -> list[str]:
    return [line for line in (FIXTURES / name).read_text().splitlines()
            if line.strip() and not line.startswith(("#", "timestamp"))]


def test_h100_rows_with_units_idle_then_loaded() -> None:
    idle, loaded = (parse_query_line(farm_order(r)) for r in captured("query_rows_590.txt"))
    assert idle is not None and loaded is not None
    assert (idle.power_w, idle.memory_used_mib, idle.memory_total_mib, idle.utilization_percent) == (69.85, 0, 81559, 0)
    assert (idle.temperature_c, idle.sm_mhz, idle.event_reasons, idle.name) == (41, 345, 0x1, "NVIDIA H100 80GB HBM3")
    assert (loaded.power_w, loaded.memory_used_mib, loaded.utilization_percent, loaded.sm_mhz) == (631.95, 19818, 100, 1980)
    assert loaded.event_reasons == 0
    assert loaded.t_s - idle.t_s == pytest.approx(14.657)  # 08:12:38.696 -> 08:12:53.353


def test_mig_utilization_is_no_reading_not_zero() -> None:
    rows = [parse_query_line(farm_order(r)) for r in captured("query_rows_mig_590.txt")]
    assert all(r is not None and r.utilization_percent is None for r in rows)
    assert summarize([r for r in rows if r]).utilization_avg_percent is None
    assert rows[1] is not None and rows[1].power_w == 433.78


def test_other_cards_and_nounits() -> None:
    rows = captured("query_rows_other.txt")
    rtx = parse_query_line(farm_order(rows[1]))
    assert rtx is not None and rtx.name == "NVIDIA GeForce RTX 2080 SUPER" and rtx.utilization_percent == 7
    unitless = farm_order(rows[2]).replace(" W", "").replace(" MiB", "").replace(" %", "").replace(" MHz", "")
    l40s = parse_query_line(unitless)
    assert l40s is not None and (l40s.power_w, l40s.memory_used_mib, l40s.utilization_percent) == (144.97, 0, 100)


@pytest.mark.parametrize("marker", ["[N/A]", "[Not Supported]", "[Unknown Error]", "N/A"])
def test_every_missing_marker_is_none(marker: str) -> None:
    row = f"2026/07/14 08:12:38.696, {marker}, {marker}, 81559, {marker}, 41, {marker}, {marker}, NVIDIA H100"
    s = parse_query_line(row)
    assert s is not None
    assert (s.power_w, s.memory_used_mib, s.utilization_percent, s.sm_mhz, s.event_reasons) == (None,) * 5


@pytest.mark.parametrize("line", [
    "", "timestamp, power.draw [W], memory.used [MiB]",  # a header (csv without noheader)
    'Field "clocks_event_reasons.active" is not a valid field to query.',  # the tool refusing the query
    "2026/07/14 08:12:38.696, 69.85",  # cut short
    "not a time, 1, 2, 3, 4, 5, 6, 0x1, name",
])
def test_lines_that_are_not_rows(line: str) -> None:
    assert parse_query_line(line) is None


@pytest.mark.parametrize("value", ["nan", "inf", "-5", "1e400", "99999999"])
def test_hostile_numbers_are_no_reading(value: str) -> None:
    s = parse_query_line(f"2026/07/14 08:12:38.696, {value}, {value}, 1, {value}, {value}, {value}, 0x1, GPU")
    assert s is not None and s.power_w is None and s.utilization_percent is None and s.temperature_c is None


def test_a_name_with_commas_is_kept_whole() -> None:
    s = parse_query_line("2026/07/14 08:12:38.696, 69.85, 0, 81559, 0, 41, 345, 0x1, NVIDIA A, B, C")
    assert s is not None and s.name == "NVIDIA A, B, C"


def test_energy_is_power_integrated_over_the_rows_own_timestamps() -> None:
    """Checked by hand: trapezoids of (t, W) = (0, 100), (0.5, 300), (1.5, 300), then a row without power."""
    base = datetime(2026, 11, 28, 10, 0, 0).timestamp()
    rows = [GpuSample(base, power_w=100.0), GpuSample(base + 0.5, power_w=300.0), GpuSample(base + 1.5, power_w=300.0),
            GpuSample(base + 2.0, power_w=None)]
    # 0.5 s × (100+300)/2 W = 100 J; 1.0 s × 300 W = 300 J: 400 J = 400,000 mJ
    assert integrated_energy_mj(rows) == pytest.approx(400_000)
    summary = summarize(rows)
    assert summary.energy_mj == pytest.approx(400_000) and summary.energy_source == "integrated_power"
    assert summary.power_avg_w == pytest.approx(700 / 3) and summary.power_peak_w == 300
    assert integrated_energy_mj(rows[:1]) is None


def test_captured_rows_as_the_fake_tool_replays_them() -> None:
    """Energy of a replay of the H100's two rows at 100 ms: (69.85 + 631.95) / 2 W × 0.1 s per step."""
    idle, loaded = captured("query_rows_590.txt")
    stamps = ["2026/11/28 10:00:00.000", "2026/11/28 10:00:00.100", "2026/11/28 10:00:00.200"]
    cells = [farm_order(r).split(", ", 1)[1] for r in (idle, loaded, idle)]
    samples = parse_query_output("\n".join(f"{t}, {c}" for t, c in zip(stamps, cells)))
    assert len(samples) == 3
    assert summarize(samples).energy_mj == pytest.approx(2 * 0.1 * (69.85 + 631.95) / 2 * 1000)
    assert summarize(samples).memory_peak_mib == 19818


def test_nvml_lines_prefer_the_energy_counter() -> None:
    lines = [json.dumps({"t": 10.0 + i * 0.1, "power_mw": 500_000, "energy_mj": 1_000_000 + i * 40_000,
                         "mem_used": 2**30, "mem_total": 80 * 2**30, "util": 90, "temp": 50, "sm_mhz": 1980,
                         "reasons": 0x4 if i == 2 else 0, "name": "NVIDIA H200"}) for i in range(4)]
    samples = parse_nvml_output("\n".join(["garbage", *lines, "[1, 2]", '{"t": "x"}']))
    assert len(samples) == 4
    s = summarize(samples)
    assert s.energy_source == "nvml_counter" and s.energy_mj == pytest.approx(120_000)
    assert s.memory_peak_mib == 1024 and s.memory_total_mib == 80 * 1024 and s.power_avg_w == 500
    assert s.event_reasons == ["sw_power_cap"] and s.name == "NVIDIA H200"


def test_a_counter_that_went_backwards_falls_back_to_power() -> None:
    samples = [GpuSample(0.0, power_w=100.0, energy_mj=5000.0), GpuSample(1.0, power_w=100.0, energy_mj=10.0)]
    s = summarize(samples)
    assert s.energy_source == "integrated_power" and s.energy_mj == pytest.approx(100_000)


def test_reason_bits() -> None:
    assert reason_names(0x1 | 0x4 | 0x40) == ["gpu_idle", "sw_power_cap", "hw_thermal"]
    assert reason_names(0x800) == ["0x800"]
    assert QUERY_FIELDS[-1] == "name"  # the one cell that may hold ", " comes last
