"""The jetson and linux drivers: one task on a board over ssh, with farm's own harness
(`python -m farm.agents.harness`) and the runtimes installed there, as a RunResult.

The two differ only in what samples the run — tegrastats on a Jetson (power rails, so energy
per inference), /proc on any other board — so they share this module and pick the sampler.
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from farm.agents.drivers import DeviceEntry, register
from farm.agents.harness.stats import latency_stats
from farm.agents.harness.task import HarnessOutput, benchmark_task, runtime_env
from farm.agents.jetson import (
    DEVICE_TREE_MODEL, NV_TEGRA_RELEASE, JtopRun, TegrastatsRun, jtop_usable, read_jetson_facts, run_with_jtop,
    run_with_tegrastats,
)
from farm.agents.linux_board import ProcSampledRun, read_linux_facts, run_with_proc_sampling
from farm.agents.ssh_transport import SshInfrastructureError, SshTarget, SshTimeoutError, SshTransport
from farm.proto.device_types import DeviceType
from farm.proto.results import FailureClass, Limits, RunResult, RunStatus
from farm.proto.spec import BenchmarkWorkload
from farm.proto.tasks import TaskSpec

LOG_TAIL_CHARS = 4000


@dataclass
class BoardDeviceConfig:
    """One board in the lab's device list."""

    name: str
    kind: Literal["jetson", "linux"]
    host: str
    username: str
    key_path: Path
    known_hosts: Path
    port: int = 22
    pinned_fingerprint: str | None = None
    trust_on_first_use: bool = False
    python: str = "python3"  # the board's interpreter that has farm and its runtimes installed
    remote_dir: str = "/tmp/farm"
    sample_interval_ms: int = 100
    # where the board says what it is (other paths only for test peers and unusual images)
    nv_tegra_release: str = NV_TEGRA_RELEASE
    device_tree_model: str = DEVICE_TREE_MODEL
    # jetson: "auto" samples with jtop when its service is active and usable, else tegrastats
    telemetry: Literal["auto", "jtop", "tegrastats"] = "auto"

    def target(self) -> SshTarget:
        return SshTarget(self.host, self.username, self.key_path, self.known_hosts, port=self.port,
                         pinned_fingerprint=self.pinned_fingerprint, trust_on_first_use=self.trust_on_first_use)


class BoardEntry(DeviceEntry):
    """A Jetson or any Linux board in the lab's device list (ssh)."""

    driver: Literal["jetson", "linux"]
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
            python=entry.python, telemetry=entry.telemetry, **where), device_type)

    def type_probe(self, facts: dict) -> dict[str, Any]:
        return {"os": self.config.kind, "device_tree_model": facts.get("board_model") or ""}

    def facts(self) -> dict:
        with SshTransport(self.config.target()) as ssh:
            return self._facts(ssh)

    def _facts(self, ssh: SshTransport) -> dict:
        if self.config.kind == "jetson":
            return read_jetson_facts(ssh, self.config.nv_tegra_release, self.config.device_tree_model).as_environment()
        return read_linux_facts(ssh).as_environment()

    def run(self, task: TaskSpec, cancel_check: Callable[[], bool]) -> RunResult:
        base: dict[str, Any] = dict(backend=self.config.kind, limits=Limits())
        if not isinstance(task.workload, BenchmarkWorkload):
            return RunResult.failed(FailureClass.JOB, f"{self.config.name}: script workloads on boards are not "
                                    "supported yet; use type: benchmark", **base)
        c = self.config
        try:
            with SshTransport(c.target()) as ssh:
                facts = self._facts(ssh)
                ssh.run(f"mkdir -p {shlex.quote(c.remote_dir)}", 30)
                model = ssh.upload_by_hash(Path(task.model_path), c.remote_dir).remote_path  # cached by hash
                harness = benchmark_task(task, model)
                with tempfile.TemporaryDirectory() as d:
                    local_task = Path(d) / "task.json"
                    harness.write(local_task)
                    remote_task = ssh.upload_by_hash(local_task, c.remote_dir).remote_path
                out = f"{c.remote_dir}/out-{task.task_id}-{task.attempt}.json"
                env = " ".join(f"{k}={shlex.quote(v)}" for k, v in runtime_env(task.threads).items())
                command = (f"{env} {shlex.quote(c.python)} -m farm.agents.harness "
                           f"{shlex.quote(remote_task)} {shlex.quote(out)}")
                source = None
                sampled: JtopRun | TegrastatsRun | ProcSampledRun
                energy_mj: float | None
                if c.kind == "jetson":
                    want_jtop = c.telemetry == "jtop" or (c.telemetry == "auto" and facts.get("jtop_service") == "active")
                    if want_jtop and jtop_usable(ssh, c.python):
                        sampled = run_with_jtop(ssh, c.python, command, task.run_timeout_s, c.sample_interval_ms,
                                                facts.get("memory_total_mb"))
                        energy_mj, source = sampled.energy_mj, "jtop"
                        if not sampled.samples:  # the run stands; say why its telemetry is missing
                            source = f"jtop (no samples: {sampled.sampler_stderr[-200:] or 'no output'})"
                    else:
                        tegrastats = run_with_tegrastats(ssh, command, task.run_timeout_s, c.sample_interval_ms)
                        sampled, energy_mj = tegrastats, tegrastats.summary.energy_mj
                        source = "tegrastats" + (" (jtop unusable)" if want_jtop else "")
                else:
                    sampled = run_with_proc_sampling(ssh, command, task.run_timeout_s, c.sample_interval_ms)
                    energy_mj, source = None, "proc"
                status, text, _ = ssh.run(f"cat {shlex.quote(out)} && rm -f {shlex.quote(out)}", 30)
        except SshTimeoutError as e:
            return RunResult.failed(FailureClass.TIMEOUT, f"{c.name}: {e}", **base)
        except SshInfrastructureError as e:
            return RunResult.failed(FailureClass.INFRASTRUCTURE, f"{c.name}: {e}", **base)
        log = (sampled.result.stdout + sampled.result.stderr)[-LOG_TAIL_CHARS:]
        environment: dict[str, Any] = {"device": facts, "command": command, "telemetry_source": source}
        if status != 0:
            return RunResult.failed(FailureClass.BUG if sampled.result.status == 0 else FailureClass.JOB,
                                    f"the harness on {c.name} exited with status {sampled.result.status} without a "
                                    f"result: {log.strip()[-300:] or '(no output)'}", environment=environment,
                                    log_tail=log, **base)
        output = HarnessOutput(**json.loads(text))
        if not output.ok:
            return RunResult.failed(FailureClass(output.failure_class or "bug"),
                                    f"{Path(task.model_path).name} on {c.name}: {output.message}",
                                    environment=environment, log_tail=log, **base)
        telemetry = sampled.telemetry()
        if energy_mj is not None and output.iterations_ms and sampled.wall_s > 0 and output.measure_wall_s:
            # the sampled window also holds start-up: charge the timed loop its share of the energy
            environment["energy_per_inference_mj"] = energy_mj * (output.measure_wall_s / sampled.wall_s) / len(
                output.iterations_ms)
        return RunResult(
            status=RunStatus.COMPLETED, iterations_ms=output.iterations_ms,
            latency=latency_stats(output.iterations_ms, init_ms=output.init_ms, first_ms=output.first_ms,
                                  warmup_ms=output.warmup_ms),
            telemetry=telemetry, wall_s=sampled.wall_s, baseline_memory_bytes=output.baseline_rss_bytes,
            peak_rss_bytes=output.peak_rss_bytes, environment=environment, tool_versions=output.tool_versions,
            log_tail=log, **base)


register("jetson", BoardEntry, BoardDriver.from_entry)
register("linux", BoardEntry, BoardDriver.from_entry)
