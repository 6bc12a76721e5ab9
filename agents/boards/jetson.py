"""NVIDIA Jetson over ssh: its facts (power mode, clocks, L4T), and a command run under tegrastats.

A Jetson is a Linux board plus NVIDIA's tools, so its facts extend the Linux ones. The power
mode is part of the device's identity for calibration: the same board at 5 W and at MAXN is
two different devices as far as `device ≈ a·sim + b` goes.

The driver that turns a farm task into a RunResult composes these: stage the run (workload.py),
`run_with_tegrastats(ssh, "python3 board_harness.py run TASK.json", …)`, parse its result line,
and attach `.telemetry()` and `.summary.energy_mj`.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any, Callable

from farm.agents.boards.linux_board import LINUX_PROBES, LinuxBoardFacts, linux_facts_from_probes, run_probes
from farm.agents.parsers.tegrastats import (
    TegrastatsSample, TegrastatsSummary, parse_tegrastats_output, summarize,
)
from farm.agents.boards.ssh_transport import CommandResult, SshTransport
from farm.proto.results import Telemetry, TelemetrySample
from farm.agents.parsers.jetson_tools import JtopSample, jetson_clocks_active_from_show, l4t_release_from_file, nvpmodel_from_query, parse_jtop_line

NV_TEGRA_RELEASE = "/etc/nv_tegra_release"
DEVICE_TREE_MODEL = "/proc/device-tree/model"


@dataclass(frozen=True)
class JetsonFacts:
    board: LinuxBoardFacts
    l4t_release: str | None  # "32.7.4", from /etc/nv_tegra_release
    nvpmodel_mode: str | None  # "MAXN", "15W", … (`nvpmodel -q`)
    nvpmodel_id: int | None
    jetson_clocks_active: bool | None  # None when `jetson_clocks --show` could not tell (not root, missing)
    jtop_service: str | None  # `systemctl is-active jtop`: "active" means jtop telemetry can be used
    raw: dict[str, str] = field(default_factory=dict)  # each probe as printed, for the run's record

    @property
    def power_identity(self) -> str:
        """What separates calibrations of one board: its power mode and whether clocks are pinned."""
        clocks = {True: "clocks-pinned", False: "clocks-dynamic", None: "clocks-unknown"}[self.jetson_clocks_active]
        return f"nvpmodel={self.nvpmodel_mode or 'unknown'};{clocks}"

    def as_environment(self) -> dict[str, Any]:
        env = self.board.as_environment()
        env.update({
            "l4t_release": self.l4t_release,
            "nvpmodel_mode": self.nvpmodel_mode,
            "nvpmodel_id": self.nvpmodel_id,
            "jetson_clocks": self.jetson_clocks_active,
            "jtop_service": self.jtop_service,
            "power_identity": self.power_identity,
        })
        return env


def jetson_probes(nv_tegra_release: str = NV_TEGRA_RELEASE, device_tree_model: str = DEVICE_TREE_MODEL) -> dict[str, str]:
    probes = dict(LINUX_PROBES)
    probes["board_model"] = f"tr -d '\\000' < {device_tree_model}"
    probes.update({
        "nv_tegra_release": f"cat {nv_tegra_release}",
        "nvpmodel": "nvpmodel -q",
        "jetson_clocks": "jetson_clocks --show",
        "jtop_service": "systemctl is-active jtop",
    })
    return probes


def read_jetson_facts(ssh: SshTransport, nv_tegra_release: str = NV_TEGRA_RELEASE,
                      device_tree_model: str = DEVICE_TREE_MODEL) -> JetsonFacts:
    """One round trip: Linux facts plus nvpmodel, jetson_clocks, L4T release and the jtop service state."""
    probes = run_probes(ssh, jetson_probes(nv_tegra_release, device_tree_model))
    mode, mode_id = nvpmodel_from_query(probes["nvpmodel"])
    jtop = probes["jtop_service"].splitlines()[-1].strip() if probes["jtop_service"] else None
    return JetsonFacts(
        board=linux_facts_from_probes(probes),
        l4t_release=l4t_release_from_file(probes["nv_tegra_release"]),
        nvpmodel_mode=mode,
        nvpmodel_id=mode_id,
        jetson_clocks_active=jetson_clocks_active_from_show(probes["jetson_clocks"]),
        jtop_service=jtop if jtop and " " not in jtop else None,  # "sh: systemctl: not found" is no state
        raw={k: probes[k] for k in ("nv_tegra_release", "nvpmodel", "jetson_clocks")},
    )


@dataclass
class TegrastatsRun:
    result: CommandResult
    samples: list[TegrastatsSample]
    summary: TegrastatsSummary
    interval_ms: float
    wall_s: float
    sampler_stderr: str = ""  # e.g. "tegrastats: not found", kept so a missing sampler is visible

    def telemetry(self) -> Telemetry:
        return tegrastats_telemetry(self.samples, self.interval_ms)


def tegrastats_telemetry(samples: list[TegrastatsSample], interval_ms: float) -> Telemetry:
    """Board-wide tegrastats figures in the sim's telemetry shape (RAM is the whole board's)."""
    summary = summarize(samples, interval_ms)
    period_s = interval_ms / 1000
    points = [
        TelemetrySample(round((i + 1) * period_s, 3), s.cpu_total_percent, s.ram_used_mb * 2**20)
        for i, s in enumerate(samples) if s.cpu_total_percent is not None and s.ram_used_mb is not None
    ]
    return Telemetry(
        interval_ms=interval_ms,
        cpu_avg_percent=summary.cpu_avg_percent,
        cpu_peak_percent=summary.cpu_peak_percent,
        memory_avg_bytes=summary.ram_avg_mb * 2**20 if summary.ram_avg_mb is not None else None,
        memory_peak_bytes=summary.ram_peak_mb * 2**20 if summary.ram_peak_mb is not None else None,
        memory_peak_source="sampled",
        samples=points,
    )


def run_with_tegrastats(ssh: SshTransport, command: str, timeout_s: float, interval_ms: int = 100,
                        cancel_check: Callable[[], bool] | None = None) -> TegrastatsRun:
    """Run `command` on the Jetson while `tegrastats --interval` samples; returns its result and the samples."""
    result, sampled, wall_s = ssh.run_sampled(f"tegrastats --interval {int(interval_ms)}", command, timeout_s,
                                              cancel_check)
    samples = parse_tegrastats_output(sampled.stdout)
    return TegrastatsRun(result, samples, summarize(samples, interval_ms), interval_ms, wall_s, sampled.stderr.strip())


# Runs on the board with jetson-stats installed: one JSON line per jtop update, nothing else.
JTOP_SAMPLER = r'''
import json
from jtop import jtop
with jtop(interval={interval_s}) as j:
    while j.ok():
        s = j.stats
        print(json.dumps({{k: (v if isinstance(v, (int, float, str)) or v is None else str(v)) for k, v in s.items()}}),
              flush=True)
'''


@dataclass
class JtopRun:
    result: CommandResult
    samples: list[JtopSample]
    interval_ms: float
    wall_s: float
    memory_total_mb: float | None
    sampler_stderr: str = ""

    @property
    def energy_mj(self) -> float | None:
        power = [s.power_total_mw for s in self.samples if s.power_total_mw is not None]
        return sum(p * self.interval_ms / 1000 for p in power) if power else None

    def telemetry(self) -> Telemetry:
        period_s = self.interval_ms / 1000
        cpu = [s.cpu_total_percent for s in self.samples if s.cpu_total_percent is not None]
        mem = [s.ram_fraction * self.memory_total_mb * 2**20 for s in self.samples
               if s.ram_fraction is not None and self.memory_total_mb]
        return Telemetry(
            interval_ms=self.interval_ms,
            cpu_avg_percent=sum(cpu) / len(cpu) if cpu else None, cpu_peak_percent=max(cpu) if cpu else None,
            memory_avg_bytes=sum(mem) / len(mem) if mem else None, memory_peak_bytes=int(max(mem)) if mem else None,
            memory_peak_source="sampled",
            samples=[TelemetrySample(round((i + 1) * period_s, 3), s.cpu_total_percent or 0.0,
                                     int((s.ram_fraction or 0) * (self.memory_total_mb or 0) * 2**20))
                     for i, s in enumerate(self.samples)])


def jtop_usable(ssh: SshTransport, python: str) -> bool:
    """The board's Python has jetson-stats and its service answers (checked before a run, since a
    sampler that fails afterwards cannot be replaced by tegrastats for that run)."""
    probe = "from jtop import jtop\nwith jtop() as j:\n    assert j.ok()"
    status, _, _ = ssh.run(f"{shlex.quote(python)} -c {shlex.quote(probe)}", 30)
    return status == 0


def run_with_jtop(ssh: SshTransport, python: str, command: str, timeout_s: float, interval_ms: int,
                  memory_total_mb: float | None, cancel_check: Callable[[], bool] | None = None) -> JtopRun:
    sampler = f"{shlex.quote(python)} -u -c {shlex.quote(JTOP_SAMPLER.format(interval_s=interval_ms / 1000))}"
    result, sampled, wall_s = ssh.run_sampled(sampler, command, timeout_s, cancel_check)
    samples = [s for s in (parse_jtop_line(line) for line in sampled.stdout.splitlines()) if s is not None]
    return JtopRun(result, samples, interval_ms, wall_s, memory_total_mb, sampled.stderr.strip())
