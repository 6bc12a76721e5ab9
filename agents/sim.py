"""The sim driver: runs a task's workload in a local sandbox with the target's budget.

Composes a sandbox backend (the budget), the harness (the measurement) and the
telemetry sampler (what the kernel saw), and turns their outcome into one RunResult
with a failure class a person can act on.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from farm.agents.contention import judge, quietest_cores, snapshot, wait_until_quiet
from farm.agents.environment import host_facts, load_average
from farm.agents.harness.stats import latency_stats
from farm.agents.harness.task import HarnessOutput, HarnessTask
from farm.agents.sandbox import Budget, SandboxBackend, SandboxError, choose_backend
from farm.agents.sandbox.base import ExitInfo, MountSpec, format_cpuset, parse_cpuset, whole_cores
from farm.agents.script_env import ScriptEnvError, script_python
from farm.agents.telemetry import TelemetrySampler
from farm.proto.results import FailureClass, Limits, RunResult, RunStatus
from farm.proto.tasks import TaskSpec

MiB = 1 << 20
LOG_TAIL_CHARS = 4000


@dataclass
class SimSlot:
    """One place a sim run can happen; slots on one host get disjoint cpusets."""

    index: int
    cpuset: str | None = None


def _mib(n: int | None) -> float | None:
    return None if n is None else round(n / MiB, 1)


def _format_args(args: list[str], task: TaskSpec) -> list[str]:
    values = {"model": task.model_path, "threads": task.threads, "batch_size": task.batch_size,
              "input_size": task.input_size if task.input_size is not None else ""}
    out = []
    for a in args:
        try:
            out.append(a.format(**values))
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"workload.args: cannot fill {a!r}: unknown placeholder {e}; use {{model}}, {{threads}}, {{batch_size}} or {{input_size}}") from None
    return out


def shaped_cores(cpus: float, cpuset: str | None) -> list[int]:
    """The cores a budget runs on, shaped like a device: `cpus` whole cores are that many cores of the
    slot's (or the job's) cpuset, the quietest now; a fraction gets ceil(cpus) cores and keeps its quota
    (base.cfs_quota_us decides the quota)."""
    allowed = parse_cpuset(cpuset) if cpuset else sorted(os.sched_getaffinity(0))
    wanted = whole_cores(cpus) or math.ceil(cpus)
    return quietest_cores(allowed, wanted)


class SimDriver:
    name = "sim"

    def __init__(self, work_root: Path, *, backend_override: str | None = None, keep_run_dirs: bool = False) -> None:
        self.work_root = work_root
        self.backend_override = backend_override
        self.keep_run_dirs = keep_run_dirs
        self._backends: dict[tuple[str, str | None], SandboxBackend] = {}

    def backend_for(self, task: TaskSpec) -> SandboxBackend:
        name = self.backend_override or task.sim.get("backend", "auto")
        key = (name, task.sim.get("image"))
        if key not in self._backends:  # probing a backend (docker ping, cgroup mkdir) once is enough
            self._backends[key] = choose_backend(name, image=task.sim.get("image"))
        return self._backends[key]

    def budget_for(self, task: TaskSpec, slot: SimSlot) -> Budget:
        sim = task.sim
        cpus = sim.get("cpus") or float(task.threads)  # default: one core per runtime thread
        cores = shaped_cores(cpus, sim.get("cpuset") or slot.cpuset)
        return Budget(cpus=cpus, cpuset=format_cpuset(cores), memory_bytes=sim.get("memory"),
                      exclusive=bool(sim.get("exclusive")))

    def harness_task(self, task: TaskSpec) -> HarnessTask:
        w = task.workload
        if w["type"] == "script":
            python = script_python(w.get("pip_requirements") or [], self.work_root / "script-envs")
            command = python if w["command"] in ("python", "python3") else w["command"]
            script_dir = str(Path(task.base_dir, w.get("dir") or ".").resolve())
            argv = [command]
            if w.get("script"):
                argv.append(str(Path(script_dir, w["script"])))
            argv += _format_args(w.get("args") or [], task)
            return HarnessTask(kind="script", model_path=task.model_path, threads=task.threads,
                               batch_size=task.batch_size, input_size=task.input_size,
                               command=argv, script_dir=script_dir)
        return HarnessTask(kind="benchmark", model_path=task.model_path, threads=task.threads,
                           batch_size=task.batch_size, input_size=task.input_size,
                           iterations=w["iterations"], warmup=w["warmup"],
                           input_shapes=w.get("input_shapes") or {}, use_xnnpack=w.get("use_xnnpack", True),
                           seed=task.repeat)

    def run(self, task: TaskSpec, slot: SimSlot, cancel_check: Callable[[], bool]) -> RunResult:
        try:
            backend = self.backend_for(task)
        except SandboxError as e:
            return RunResult.failed(FailureClass.INFRASTRUCTURE, str(e))
        budget = backend.effective_limits(self.budget_for(task, slot))
        limits = Limits(cpus=budget.cpus, cpuset=budget.cpuset, memory_mb=_mib(budget.memory_bytes))
        base = dict(backend=backend.name, limits=limits, approximate=backend.approximate)
        try:
            harness_task = self.harness_task(task)
        except (ScriptEnvError, ValueError) as e:
            return RunResult.failed(FailureClass.JOB, str(e), **base)

        run_dir = self.work_root / "runs" / f"task{task.task_id}-a{task.attempt}-{uuid.uuid4().hex[:6]}"
        run_dir.mkdir(parents=True)
        os.chmod(run_dir, 0o777)  # a container's user must be able to write its result here
        task_file, out_file = run_dir / "task.json", run_dir / "out.json"
        harness_task.write(task_file)
        argv = [sys.executable, "-m", "farm.agents.harness", str(task_file), str(out_file)]
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(run_dir), "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
            # Runtimes must not size their pools from the host's core count.
            "OMP_NUM_THREADS": str(task.threads),
        }
        mounts = [MountSpec(run_dir, read_only=False), MountSpec(Path(task.model_path))]
        if harness_task.script_dir:
            mounts.append(MountSpec(Path(harness_task.script_dir), read_only=False))
        environment = {**host_facts(), "load_before": load_average()}
        cores = parse_cpuset(budget.cpuset) if budget.cpuset else sorted(os.sched_getaffinity(0))
        quiet_wait_s, quiet_before = wait_until_quiet(cores, float(task.sim.get("quiet_wait") or 0), cancel_check)
        try:
            sandbox = backend.start(argv, budget, env=env, cwd=run_dir, mounts=mounts)
        except SandboxError as e:
            self._cleanup(run_dir)
            return RunResult.failed(FailureClass.INFRASTRUCTURE, f"{backend.name} sandbox: {e}", **base)
        # the window starts once the sandbox exists: setting it up (an engine creating a container)
        # is farm's own work, not other tasks' on the run's cores
        before = snapshot(cores)
        cpu_ns_at_start = sandbox.read_counters().cpu_ns or 0
        sampler = TelemetrySampler(sandbox, task.sim.get("sample_interval_ms", 50.0), avoid_cpuset=budget.cpuset).start()
        try:
            exit_info = sandbox.wait(task.run_timeout_s, cancel_check)
            after = snapshot(cores)
            accounting = sandbox.cpu_accounting()
        except SandboxError as e:
            self._cleanup(run_dir)
            return RunResult.failed(FailureClass.INFRASTRUCTURE, f"{backend.name} sandbox: {e}", **base)
        finally:
            sampler.stop()
            sandbox.close()
        contention = judge(
            before, after, budget_cpus=budget.cpus, demand_cpus=float(task.threads),
            run_cpu_s=None if accounting.cpu_ns is None else max(0, accounting.cpu_ns - cpu_ns_at_start) / 1e9,
            throttled_s=None if accounting.throttled_ns is None else round(accounting.throttled_ns / 1e9, 4),
            run_wait_s=sampler.run_wait_s,
            cgroup_pressure_us=accounting.pressure_some_us)
        contention.quiet_wait_s, contention.quiet_before = quiet_wait_s, quiet_before
        contention.exclusive = sandbox.exclusive or (
            f"not exclusive: the {backend.name} backend cannot ask for it" if budget.exclusive else None)
        telemetry = sampler.summary(exit_info)
        environment["load_after"] = load_average()
        output = HarnessOutput.read(out_file) if out_file.exists() else None
        result = self._classify(task, budget, exit_info, output)
        result.backend, result.limits, result.approximate = backend.name, limits, backend.approximate
        result.telemetry = telemetry
        result.contention = contention
        result.wall_s = exit_info.wall_s
        result.environment = environment
        result.log_tail = exit_info.output[-LOG_TAIL_CHARS:]
        if output is not None:
            result.tool_versions = output.tool_versions
            result.baseline_memory_bytes = output.baseline_rss_bytes
            result.peak_rss_bytes = output.peak_rss_bytes
            result.whole_run_s = output.whole_run_s
            environment["input_shapes"] = output.input_shapes
            environment["runtime"] = output.runtime
        self._cleanup(run_dir)
        return result

    def _classify(self, task: TaskSpec, budget: Budget, exit_info: ExitInfo, output: HarnessOutput | None) -> RunResult:
        peak = exit_info.peak_memory_bytes
        if exit_info.canceled:
            return RunResult.failed(FailureClass.CANCELED, "canceled while running")
        if exit_info.timed_out:
            return RunResult.failed(FailureClass.TIMEOUT, f"the run exceeded timeouts.run = {task.run_timeout_s:g} s and was stopped")
        memory_hit = budget.memory_bytes is not None and (
            exit_info.oom_killed or (output is not None and output.failure_class == "resource"))
        if memory_hit:
            return RunResult.failed(
                FailureClass.RESOURCE,
                f"out of memory at the {_mib(budget.memory_bytes):g} MiB limit (sim.memory); peak reached "
                f"{_mib(peak) if peak is not None else 'unknown'} MiB. Raise sim.memory or use a smaller model/batch.")
        if output is None:
            return RunResult.failed(
                FailureClass.BUG,
                f"the harness exited with status {exit_info.returncode} without writing a result; its last output: "
                f"{exit_info.output.strip()[-500:] or '(none)'}")
        if not output.ok:
            return RunResult.failed(FailureClass(output.failure_class or "bug"), f"{Path(task.model_path).name}: {output.message}")
        # a completed run's message says what farm had to do about it (e.g. a script's leftover children)
        result = RunResult(status=RunStatus.COMPLETED, iterations_ms=output.iterations_ms, message=output.message)
        if output.iterations_ms:
            result.latency = latency_stats(output.iterations_ms, init_ms=output.init_ms,
                                           first_ms=output.first_ms, warmup_ms=output.warmup_ms)
        return result

    def _cleanup(self, run_dir: Path) -> None:
        if not self.keep_run_dirs:
            shutil.rmtree(run_dir, ignore_errors=True)
