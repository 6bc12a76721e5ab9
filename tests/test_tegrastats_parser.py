"""A Jetson's tegrastats line, of any JetPack generation, becomes a typed sample (real captured lines)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from farm.agents.parsers.tegrastats import (
    CpuCore, EngineReading, PowerRail, Temperature, parse_tegrastats_line, parse_tegrastats_output, summarize,
)

FIXTURES = Path(__file__).parent / "fixtures" / "tegrastats"


def fixture_lines(name: str) -> list[str]:
    return [line for line in (FIXTURES / name).read_text().splitlines() if line.strip() and not line.startswith("#")]


ALL_LINES = [(path.name, line) for path in sorted(FIXTURES.glob("*.txt")) for line in fixture_lines(path.name)]


@pytest.mark.parametrize("fixture,line", ALL_LINES, ids=[f"{n}:{i}" for i, (n, _) in enumerate(ALL_LINES)])
def test_every_real_line_parses_without_leftovers(fixture: str, line: str) -> None:
    sample = parse_tegrastats_line(line)
    assert sample.unknown == [], f"{fixture}: fields not understood: {sample.unknown}"


def test_jetpack6_orin_line() -> None:
    (line,) = fixture_lines("jetpack6_orin.txt")
    s = parse_tegrastats_line(line)
    assert s.timestamp == datetime(2025, 5, 15, 18, 30, 28)
    assert (s.ram_used_mb, s.ram_total_mb, s.ram_lfb_blocks, s.ram_lfb_block_mb) == (6982, 7620, 5, 1)
    assert (s.swap_used_mb, s.swap_total_mb, s.swap_cached_mb) == (2640, 16384, 202)
    assert s.cpus[0] == CpuCore(online=True, load_percent=97.0, freq_mhz=1984)
    assert s.cpus[5] == CpuCore(online=True, load_percent=93.0, freq_mhz=247)
    assert s.cpu_total_percent == 97 + 95 + 95 + 91 + 88 + 93
    assert s.emc == EngineReading("EMC_FREQ", True, 18.0, (3199,))
    assert s.gpu == EngineReading("GR3D_FREQ", True, 84.0, (713,))
    assert s.engines["NVDEC"] == EngineReading("NVDEC", True, 40.0, (115,))
    assert s.engines["NVJPG1"] == EngineReading("NVJPG1", online=False)
    assert s.engines["PVA0_FREQ"].online is False
    assert s.engines["APE"] == EngineReading("APE", True, None, (174,))
    assert s.temperatures["tj"] == Temperature("tj", 65.562)
    assert len(s.temperatures) == 9
    assert s.rails["VDD_IN"] == PowerRail("VDD_IN", 17946, 15710)
    assert (s.total_power_mw, s.total_power_source) == (17946, "VDD_IN")


def test_agx_orin_idle_line_missing_sensors_and_two_gpcs() -> None:
    (line,) = fixture_lines("agx_orin_idle.txt")
    s = parse_tegrastats_line(line)
    assert len(s.cpus) == 12 and s.cpu_total_percent == 0.0
    assert s.gpu == EngineReading("GR3D_FREQ", True, 0.0, (0, 0))
    assert s.engines["VIC_FREQ"].freq_mhz == (729,)
    assert s.temperatures["GPU"].celsius is None  # -256C = no sensor
    assert s.temperatures["CPU"].celsius == 44.562
    # No input rail on this module: the connected rails are added up, `NC` left out.
    assert s.total_power_mw == 2340 + 390 + 4025 + 301
    assert "NC" not in s.total_power_source


def test_l4t32_nano_lines_without_timestamp_or_unit() -> None:
    first = parse_tegrastats_line(fixture_lines("jetson_nano_l4t32.txt")[0])
    assert first.timestamp is None
    assert (first.iram_used_kb, first.iram_total_kb, first.iram_lfb_kb) == (0, 252, 252)
    assert [c.freq_mhz for c in first.cpus] == [102] * 4
    assert first.rails["POM_5V_IN"] == PowerRail("POM_5V_IN", 1057, 1057, unit_printed=False)
    assert first.gpu == EngineReading("GR3D_FREQ", True, 0.0, (76,))
    assert first.temperatures["PMIC"].celsius == 100.0

    fragment = parse_tegrastats_line(fixture_lines("l4t32_fragments.txt")[0])
    assert (fragment.ram_used_mb, fragment.ram_total_mb, fragment.ram_lfb_blocks) == (220, 38955, 847)
    assert fragment.cpus[1] == CpuCore(True, 5.0, 102)
    assert parse_tegrastats_line("POM_5V_IN 933/933").rails["POM_5V_IN"].average_mw == 933


def test_jetpack7_forms() -> None:
    gpu, temp, rail = (parse_tegrastats_line(line) for line in fixture_lines("jetpack7_fragments.txt"))
    assert gpu.gpu == EngineReading("GR3D_FREQ", True, 12.0, (1300, 1300))
    assert temp.temperatures["cpu"] == Temperature("cpu", 52.968, 52.968)
    assert rail.rails["VDD_GPU_SOC"] == PowerRail("VDD_GPU_SOC", 5139, 5139, 5139)

    thor_busy, thor_vin = (parse_tegrastats_line(line) for line in fixture_lines("jetpack7_thor.txt"))
    assert thor_busy.gpu == EngineReading("GR3D_FREQ", True, None, (0, 0, 0))
    assert thor_busy.engines["NVENC0_FREQ"] == EngineReading("NVENC0_FREQ", True, None, (0,))
    assert thor_busy.engines["VIC"].online is False
    assert thor_vin.swap_total_mb is None and thor_vin.gpu is None  # Thor may drop SWAP and GR3D
    assert (thor_vin.total_power_mw, thor_vin.total_power_source) == (16802, "VIN")


def test_oldest_shared_frequency_and_offline_cores() -> None:
    s = parse_tegrastats_line("CPU [2%,off,off,7%]@204")
    assert s.cpus == [CpuCore(True, 2.0, 204), CpuCore(False), CpuCore(False), CpuCore(True, 7.0, 204)]
    assert s.cpu_total_percent == 9.0


@pytest.mark.parametrize("garbage", ["", "   ", "MTS fg 0% bg 0%", "RAM lots", "CPU [x@y]", "@@@ / %% []", "\x00\xff"])
def test_unknown_text_is_kept_never_raised(garbage: str) -> None:
    s = parse_tegrastats_line(garbage)
    assert " ".join(s.unknown) == " ".join(garbage.split())


def test_new_field_between_known_ones_is_kept_and_the_rest_still_parses() -> None:
    s = parse_tegrastats_line("RAM 10/20MB NEWTHING [a,b] c CPU [1%@100] VDD_IN 5mW/6mW")
    assert s.unknown == ["NEWTHING", "[a,b]", "c"]
    assert s.ram_used_mb == 10 and s.cpus == [CpuCore(True, 1.0, 100)] and s.rails["VDD_IN"].current_mw == 5


def test_summary_of_a_run_gives_cpu_ram_power_and_energy() -> None:
    samples = parse_tegrastats_output("\n".join(fixture_lines("jetson_nano_l4t32.txt")))
    summary = summarize(samples, interval_ms=50)
    assert summary.samples == 3
    assert summary.cpu_avg_percent == pytest.approx((20 + 5 + 11) / 3)
    assert summary.cpu_peak_percent == 20
    assert (summary.ram_avg_mb, summary.ram_peak_mb) == (717, 717)
    assert summary.power_avg_mw == pytest.approx((1057 + 1015 + 1057) / 3)
    assert summary.power_peak_mw == 1057
    assert summary.energy_mj == pytest.approx((1057 + 1015 + 1057) * 0.050)  # mW × s = mJ
    assert summary.power_source == "POM_5V_IN"


def test_summary_of_nothing_is_empty_not_an_error() -> None:
    summary = summarize([], interval_ms=100)
    assert summary.samples == 0 and summary.energy_mj is None and summary.cpu_avg_percent is None
