"""A Linux host with an NVIDIA GPU (issue 29: edge boxes, gateways, a lab's workstation), over ssh or this
host itself: its facts (the GPU's name, driver, memory) and a command run under GPU sampling.

Sampling uses NVML (nvidia-ml-py) on the host when its python has it — power, NVML's total-energy
counter, memory, utilization, SM clock, temperature, clock-event reasons — else the native
`nvidia-smi --query-gpu ... -lms N`. Both are parsed by agents/parsers/nvidia_smi.py.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any, Callable

from farm.agents.boards.linux_board import LINUX_PROBES, linux_facts_from_probes, run_probes
from farm.agents.boards.ssh_transport import CommandResult
from farm.agents.parsers.nvidia_smi import (
    QUERY_FIELDS, GpuSample, GpuSummary, parse_nvml_output, parse_query_output, summarize,
)
from farm.proto.results import Telemetry

# Runs on the host: one JSON line per period from NVML, nothing else (the parser reads these keys).
NVML_SAMPLER = r'''
import json, time, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex({gpu})
name = n.nvmlDeviceGetName(h)
name = name.decode() if isinstance(name, bytes) else name
def read(f, *a):
    try:
        return f(h, *a)
    except n.NVMLError:
        return None
while True:
    m, u = read(n.nvmlDeviceGetMemoryInfo), read(n.nvmlDeviceGetUtilizationRates)
    print(json.dumps({{"t": time.monotonic(), "name": name, "power_mw": read(n.nvmlDeviceGetPowerUsage),
                      "energy_mj": read(n.nvmlDeviceGetTotalEnergyConsumption),
                      "mem_used": m.used if m else None, "mem_total": m.total if m else None,
                      "util": u.gpu if u else None, "temp": read(n.nvmlDeviceGetTemperature, n.NVML_TEMPERATURE_GPU),
                      "sm_mhz": read(n.nvmlDeviceGetClockInfo, n.NVML_CLOCK_SM),
                      "reasons": read(n.nvmlDeviceGetCurrentClocksEventReasons)}}), flush=True)
    time.sleep({period_s})
'''
GPU_FACTS_QUERY = "name,driver_version,memory.total,compute_cap"


def nvidia_smi_sampler(gpu: int, interval_ms: int) -> str:
    return (f"nvidia-smi -i {int(gpu)} --query-gpu={','.join(QUERY_FIELDS)} --format=csv,noheader,nounits "
            f"-lms {max(1, int(interval_ms))}")


def nvml_sampler(python: str, gpu: int, interval_ms: int) -> str:
    return f"{shlex.quote(python)} -u -c {shlex.quote(NVML_SAMPLER.format(gpu=int(gpu), period_s=interval_ms / 1000))}"


def nvidia_probes(gpu: int) -> dict[str, str]:
    probes = dict(LINUX_PROBES)
    probes["gpu"] = f"nvidia-smi -i {int(gpu)} --query-gpu={GPU_FACTS_QUERY} --format=csv,noheader,nounits"
    return probes


def gpu_facts_from_probe(text: str) -> dict[str, Any]:
    """`name, driver, MiB, compute capability` (one line) -> facts; the probe's own words when it failed."""
    line = next((ln for ln in text.splitlines() if ln.count(", ") >= 3), "")
    if not line:
        return {"gpu_name": None, "gpu_probe": text.strip()[-300:] or "no output"}
    *name, driver, memory, capability = line.split(", ")
    def cell(v: str) -> str | None:
        return None if v.strip() in ("[N/A]", "N/A", "[Not Supported]") else v.strip()
    total = cell(memory)
    return {"gpu_name": ", ".join(name).strip(), "gpu_driver": cell(driver),
            "gpu_memory_total_mib": float(total) if total and total.replace(".", "", 1).isdigit() else None,
            "gpu_compute_capability": cell(capability)}


def read_nvidia_facts(ssh: Any, gpu: int) -> dict[str, Any]:
    """Linux facts plus the GPU's, in one round trip."""
    probes = run_probes(ssh, nvidia_probes(gpu))
    env = linux_facts_from_probes(probes).as_environment()
    env.update(gpu_facts_from_probe(probes["gpu"]))
    env["gpu_index"] = int(gpu)
    return env


def nvml_usable(ssh: Any, python: str, gpu: int) -> bool:
    probe = f"import pynvml as n; n.nvmlInit(); n.nvmlDeviceGetHandleByIndex({int(gpu)})"
    status, _, _ = ssh.run(f"{shlex.quote(python)} -c {shlex.quote(probe)}", 30)
    return status == 0


@dataclass
class GpuSampledRun:
    result: CommandResult
    samples: list[GpuSample]
    summary: GpuSummary
    interval_ms: float
    wall_s: float
    sampler_stderr: str = ""

    def telemetry(self) -> Telemetry | None:
        return None  # the GPU's figures go to the run's environment (gpu); the harness reports the process's memory


def run_with_gpu_sampling(ssh: Any, command: str, timeout_s: float, *, python: str, gpu: int, interval_ms: int,
                          telemetry: str = "auto", cancel_check: Callable[[], bool] | None = None
                          ) -> tuple[GpuSampledRun, str]:
    """Run `command` while NVML (or nvidia-smi) samples the GPU; the run and the telemetry source's name."""
    use_nvml = telemetry == "nvml" or (telemetry == "auto" and nvml_usable(ssh, python, gpu))
    sampler = nvml_sampler(python, gpu, interval_ms) if use_nvml else nvidia_smi_sampler(gpu, interval_ms)
    result, sampled, wall_s = ssh.run_sampled(sampler, command, timeout_s, cancel_check)
    samples = parse_nvml_output(sampled.stdout) if use_nvml else parse_query_output(sampled.stdout)
    source = "nvml" if use_nvml else "nvidia-smi"
    if not samples:
        why = (sampled.stderr.strip() or sampled.stdout.strip())[-200:] or "no output"
        source += f" (no samples: {why})"
    return GpuSampledRun(result, samples, summarize(samples), interval_ms, wall_s, sampled.stderr.strip()), source
