"""The jetson and linux drivers: one task on a board over ssh, with the board harness (one file
pushed by hash, run by the board's own python3 ≥ 3.6; see agents/boards/workload.py) and the
runtimes installed there, as a RunResult. Benchmarks and script workloads alike.

The two differ only in what samples the run — tegrastats on a Jetson (power rails, so energy
per inference), /proc on any other board — so they share this module and pick the sampler.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import Field, model_validator

from farm.agents.boards.workload import BoardJobError, BoardNotReady, board_result, clean_up, stage_run
from farm.agents.drivers import DeviceEntry, register
from farm.agents.boards.jetson import (
    DEVICE_TREE_MODEL, NV_TEGRA_RELEASE, JtopRun, TegrastatsRun, jtop_usable, read_jetson_facts, run_with_jtop,
    run_with_tegrastats,
)
from farm.agents.boards.linux_board import ProcSampledRun, read_linux_facts, run_with_proc_sampling
from farm.agents.boards.local_transport import LocalTransport
from farm.agents.boards.nvidia import GpuSampledRun, read_nvidia_facts, run_with_gpu_sampling
from farm.agents.boards.tensorrt import forget_engine, read_times, runs_with_trtexec, stage_trtexec, trtexec_result
from farm.agents.boards.ssh_transport import SshCanceled, SshInfrastructureError, SshTarget, SshTimeoutError, SshTransport
from farm.proto.copying import replaced
from farm.proto.device_types import DeviceType
from farm.proto.results import FailureClass, Limits, RunResult
from farm.proto.tasks import TaskSpec


@dataclass
class BoardDeviceConfig:
    """One board in the lab's device list."""

    name: str
    kind: Literal["jetson", "linux", "nvidia"]
    host: str  # "local": this host itself, without ssh (agents/boards/local_transport.py)
    username: str
    key_path: Path
    known_hosts: Path
    port: int = 22
    pinned_fingerprint: str | None = None
    trust_on_first_use: bool = False
    python: str = "python3"  # the board's interpreter (3.6 or newer) that has the runtimes (numpy, tflite/onnx)
    remote_dir: str = "/tmp/farm"
    sample_interval_ms: int = 100
    # where the board says what it is (other paths only for test peers and unusual images)
    nv_tegra_release: str = NV_TEGRA_RELEASE
    device_tree_model: str = DEVICE_TREE_MODEL
    # jetson: "auto" samples with jtop when its service is active and usable, else tegrastats
    telemetry: Literal["auto", "jtop", "tegrastats", "nvml", "nvidia-smi"] = "auto"
    env_timeout_s: float = 1800  # making a script's venv with its pip requirements (once per set)
    gpu: int = 0  # nvidia: which GPU (nvidia-smi -i, NVML's index)

    def target(self) -> SshTarget:
        return SshTarget(self.host, self.username, self.key_path, self.known_hosts, port=self.port,
                         pinned_fingerprint=self.pinned_fingerprint, trust_on_first_use=self.trust_on_first_use)


class BoardEntry(DeviceEntry):
    """A Jetson, any Linux board or a Linux host with an NVIDIA GPU in the lab's device list (ssh, or `host: local`
    for the agent's own host)."""

    driver: Literal["jetson", "linux", "nvidia"]
    host: str
    port: int = 22
    username: str = ""
    ssh_key: str = ""
    known_hosts: str = "~/.ssh/known_hosts"
    host_key: str | None = None
    trust_on_first_use: bool = False
    python: str = "python3"
    nv_tegra_release: str | None = None
    device_tree_model: str | None = None
    # jetson: jtop when its service is usable, else tegrastats; nvidia: NVML when the host's python has it, else nvidia-smi
    telemetry: Literal["auto", "jtop", "tegrastats", "nvml", "nvidia-smi"] = "auto"
    env_timeout_s: float = Field(1800, gt=0, allow_inf_nan=False)  # making a script's venv with its pip requirements (once per set)
    gpu: int = Field(0, ge=0, le=63)  # nvidia: which GPU of the host
    # where runs, the harness, models and TensorRT engines are kept on the board
    remote_dir: str = Field("/tmp/farm", min_length=2, max_length=500, pattern=r"^/[A-Za-z0-9._/-]+$")

    @model_validator(mode="after")
    def _how_to_reach(self) -> "BoardEntry":
        if self.host != "local" and not (self.username and self.ssh_key):
            raise ValueError(f"device {self.name!r}: username and ssh_key are needed to reach {self.host!r} over ssh "
                             "(or write host: local for the agent's own host)")
        telemetry = {"jetson": ("auto", "jtop", "tegrastats"), "nvidia": ("auto", "nvml", "nvidia-smi"), "linux": ("auto",)}
        if self.telemetry not in telemetry[self.driver]:
            raise ValueError(f"device {self.name!r}: telemetry {self.telemetry!r} is not one of the {self.driver} "
                             f"driver's: {', '.join(telemetry[self.driver])}")
        return self


class BoardDriver:
    def __init__(self, config: BoardDeviceConfig, device_type: DeviceType | None = None) -> None:
        self.config = config
        self.name: str = config.kind
        self.device_type = device_type

    @classmethod
    def from_entry(cls, entry: BoardEntry, device_type: DeviceType | None) -> "BoardDriver":
        where: dict[str, Any] = {k: v for k, v in (("nv_tegra_release", entry.nv_tegra_release),
                                                  ("device_tree_model", entry.device_tree_model)) if v}
        return cls(BoardDeviceConfig(
            name=entry.name, kind=entry.driver, host=entry.host, port=entry.port, username=entry.username,
            key_path=Path(os.path.expanduser(entry.ssh_key)), known_hosts=Path(os.path.expanduser(entry.known_hosts)),
            pinned_fingerprint=entry.host_key, trust_on_first_use=entry.trust_on_first_use,
            python=entry.python, telemetry=entry.telemetry, env_timeout_s=entry.env_timeout_s, gpu=entry.gpu,
            remote_dir=entry.remote_dir,
            **where), device_type)

    def type_probe(self, facts: dict) -> dict[str, Any]:
        return {"os": self.config.kind, "device_tree_model": facts.get("board_model") or "",
                "gpu_name": facts.get("gpu_name") or ""}

    def _connect(self) -> Any:  # SshTransport or LocalTransport: the same verbs
        return LocalTransport() if self.config.host == "local" else SshTransport(self.config.target())

    def facts(self) -> dict:
        with self._connect() as ssh:
            return self._facts(ssh)

    def _facts(self, ssh: Any) -> dict:
        if self.config.kind == "nvidia":
            return read_nvidia_facts(ssh, self.config.gpu)
        if self.config.kind == "jetson":
            return read_jetson_facts(ssh, self.config.nv_tegra_release, self.config.device_tree_model).as_environment()
        return read_linux_facts(ssh).as_environment()

    def board_timeout_s(self, task: TaskSpec) -> float:
        """The job's run timeout (written for the sim) on this board: scaled by its type's declared speed."""
        speed = self.device_type.relative_speed if self.device_type is not None else 1.0
        return task.plan.run_timeout_s / speed

    def run(self, task: TaskSpec, cancel_check: Callable[[], bool]) -> RunResult:
        base: dict[str, Any] = dict(backend=self.config.kind, limits=Limits())
        timeout_s = self.board_timeout_s(task)
        if timeout_s != task.plan.run_timeout_s:
            task = replaced(task, plan=replaced(task.plan, run_timeout_s=timeout_s))
        try:
            result = (self._run_trtexec(task, cancel_check, base) if runs_with_trtexec(task)
                      else self._run(task, cancel_check, base))
        except (BoardJobError, BoardNotReady, SshInfrastructureError) as e:
            result = self._failed(e, base)
        result.environment["run_timeout_s"] = timeout_s  # what this board was given, after its speed
        return result

    def _failed(self, e: Exception, base: dict[str, Any]) -> RunResult:
        """What stopped a run before it had a result, as its failure class (the board's words kept)."""
        name = self.config.name
        if isinstance(e, BoardJobError):
            return RunResult.failed(FailureClass(e.failure_class), f"{name}: {e}", **base)
        if isinstance(e, SshCanceled):
            return RunResult.failed(FailureClass.CANCELED, f"{name}: canceled while running; the run's processes "
                                    "on the board were ended", **base)
        if isinstance(e, SshTimeoutError):
            return RunResult.failed(FailureClass.TIMEOUT, f"{name}: {e}", **base)
        return RunResult.failed(FailureClass.INFRASTRUCTURE, f"{name}: {e}", **base)  # not ready, unreachable

    def _run(self, task: TaskSpec, cancel_check: Callable[[], bool], base: dict[str, Any]) -> RunResult:
        """The board harness (benchmark or script) under the board's telemetry."""
        c = self.config
        staged = None
        with self._connect() as ssh:
            facts = self._facts(ssh)
            try:
                staged = stage_run(ssh, task, python=c.python, remote_dir=c.remote_dir,
                                   sample_interval_ms=c.sample_interval_ms, env_timeout_s=c.env_timeout_s)
                facts["python"] = staged.python_version
                sampled, energy_mj, source = self._sampled(ssh, staged.command, staged.ssh_timeout_s, facts,
                                                           cancel_check)
            finally:
                if staged is not None:
                    clean_up(ssh, staged.run_dir)  # also after a timeout: the board is left as it was
        return with_gpu(board_result(task, c.name, staged, sampled, energy_mj, facts, source, base), sampled)

    def _run_trtexec(self, task: TaskSpec, cancel_check: Callable[[], bool], base: dict[str, Any]) -> RunResult:
        """The tensorrt and dla units of an .onnx benchmark: NVIDIA's trtexec under the board's telemetry."""
        c = self.config
        with self._connect() as ssh:
            facts = self._facts(ssh)
            staged = stage_trtexec(ssh, task, c.remote_dir)
            try:
                sampled, energy_mj, source = self._sampled(ssh, staged.command, staged.ssh_timeout_s, facts,
                                                           cancel_check)
                times = read_times(ssh, staged)
                result = trtexec_result(task, c.name, staged, sampled, times, energy_mj, facts, source, base)
                if not result.ok and staged.cached and "not compatible" in result.log_tail:
                    forget_engine(ssh, staged)  # built by another TensorRT: the retry builds it again
                    result.failure_class = FailureClass.INFRASTRUCTURE
            finally:
                clean_up(ssh, staged.run_dir)
        return with_gpu(result, sampled)

    def _sampled(self, ssh: Any, command: str, timeout_s: float, facts: dict, cancel_check: Callable[[], bool]
                 ) -> tuple[JtopRun | TegrastatsRun | ProcSampledRun | GpuSampledRun, float | None, str]:
        """The staged command under the board's telemetry: jtop or tegrastats on a Jetson, NVML or nvidia-smi on
        an NVIDIA host, /proc elsewhere."""
        c = self.config
        if c.kind == "nvidia":
            gpu_run, source = run_with_gpu_sampling(ssh, command, timeout_s, python=c.python, gpu=c.gpu,
                                                    interval_ms=c.sample_interval_ms, telemetry=c.telemetry,
                                                    cancel_check=cancel_check)
            return gpu_run, gpu_run.summary.energy_mj, source
        if c.kind == "jetson":
            want_jtop = c.telemetry == "jtop" or (c.telemetry == "auto" and facts.get("jtop_service") == "active")
            if want_jtop and jtop_usable(ssh, c.python):
                jtop = run_with_jtop(ssh, c.python, command, timeout_s, c.sample_interval_ms,
                                     facts.get("memory_total_mb"), cancel_check)
                source = "jtop"
                if not jtop.samples:  # the run stands; say why its telemetry is missing
                    source = f"jtop (no samples: {jtop.sampler_stderr[-200:] or 'no output'})"
                return jtop, jtop.energy_mj, source
            tegrastats = run_with_tegrastats(ssh, command, timeout_s, c.sample_interval_ms, cancel_check)
            return tegrastats, tegrastats.summary.energy_mj, "tegrastats" + (" (jtop unusable)" if want_jtop else "")
        return run_with_proc_sampling(ssh, command, timeout_s, c.sample_interval_ms,
                                      cancel_check=cancel_check), None, "proc"


def with_gpu(result: RunResult, sampled: object) -> RunResult:
    """An NVIDIA host's run carries the GPU's own figures: power, memory, clocks, throttling."""
    if isinstance(sampled, GpuSampledRun):
        result.environment["gpu"] = sampled.summary.as_environment()
        peak = sampled.summary.memory_peak_mib  # nvidia-smi's and NVML's memory.used, in MiB
        result.gpu_memory_peak_bytes = None if peak is None else round(peak * (1 << 20))
    return result


register("jetson", BoardEntry, BoardDriver.from_entry)
register("linux", BoardEntry, BoardDriver.from_entry)
register("nvidia", BoardEntry, BoardDriver.from_entry)
