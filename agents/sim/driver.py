"""The sim driver: runs a task's workload in a local sandbox with the target's budget.

Composes a sandbox backend (the budget), the harness (the measurement) and the
telemetry sampler (what the kernel saw), and turns their outcome into one RunResult
with a failure class a person can act on.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import math
import os
import signal
import re
import shutil
import stat
import socket
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from farm.agents.sim.contention import judge, judge_timed_loop, quietest_cores, snapshot, wait_until_quiet
from farm.agents.environment import host_facts, load_average
from farm.agents.harness.stats import latency_stats, startup_ms, summary_of_more, throughput_per_s
from farm.agents.harness.task import HarnessOutput, HarnessTask, benchmark_task, runtime_env, script_task
from farm.agents.sandbox import Budget, SandboxBackend, SandboxError, choose_backend, takes_images
from farm.agents.sandbox.base import ExitInfo, RunningSandbox, parse_cpuset, pids_limit, whole_cores
from farm.agents.sandbox.process import at_highest_priority
from farm.agents.sandbox.docker_build import BuildFailed, BuildPolicy, ImageBuilder
from farm.agents.sandbox.user_image import UserImageError, harness_argv
from farm.agents.sandbox.isolation import (
    INNER_RUN_DIR, RunAs, RunUids, RunUserError, bound_run_dir, hand_over, isolate_settings,
    isolation_env, keep_run_dir, mount_run_dir, namespaces_unavailable, resolve_run_as, run_dir_full, run_uid_range,
    seal_run_dir, strip_set_ids, unseal_run_dir,
)
from farm.agents.sandbox.warm import WarmLaunch, Zygotes, runtime_of, warm_enabled
from farm.agents.sim.script_env import ScriptEnvError, script_python
from farm.agents.sim.telemetry import TelemetrySampler
from farm.proto import op_profile
from farm.proto.accuracy import judge_accuracy
from farm.proto.names import safe_suffix
from farm.proto.results import (UNENFORCED_BUDGET, Contention, FailureClass, LatencyStats, Limits, RunResult,
                                RunStatus, Telemetry)
from farm.proto.script_archive import ScriptArchiveError, pack_dir, unpack
from farm.agents.sandbox.base import format_cpuset
from farm.proto.spec import DEFAULT_RUN_DISK, ScriptWorkload, cores_missing, default_cpus
from farm.proto.tasks import TaskSpec

MiB = 1 << 20
LOG_TAIL_CHARS = 4000
MAX_HARNESS_OUTPUT_BYTES = 256 << 20  # out.json is written by the sandboxed user: read it with a bound
COPY_CHUNK_BYTES = 1 << 20


class ModelChanged(Exception):
    """The model file's bytes are not the ones submitted (attack 15: replaced after submit)."""


# Files this process hashed and found as submitted, by inode, with their size, mtime and ctime then: the same
# file unchanged since (every write moves its ctime, and only root can set a clock back) is copied without
# hashing it again, so a job's 50 runs of one large model hash it once, not 50 times.
_HASHED: dict[tuple[int, int], tuple[int, int, int, str]] = {}
_HASHED_LOCK = threading.Lock()
MAX_HASHED = 4096


def _file_identity(info: os.stat_result) -> tuple[tuple[int, int], tuple[int, int, int]]:
    return (info.st_dev, info.st_ino), (info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def stage_model(source: Path, destination: Path | None, sha256: str) -> None:
    """Copy the model into the run directory, hashing as it goes (what runs is what was checked); with
    no destination, only hash it (drivers that send the file on themselves: phones, boards). A file this
    process already hashed, unchanged before and after the copy, is copied without hashing it again.

    Raises ModelChanged naming both hashes when it differs from the submitted sha256.
    """
    fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f, (open(destination, "xb") if destination else open(os.devnull, "wb")) as out:
        before = os.fstat(f.fileno())
        if not stat.S_ISREG(before.st_mode):
            raise ModelChanged(f"{source} is no longer a regular file (submitted sha256 {sha256})")
        inode, version = _file_identity(before)
        with _HASHED_LOCK:
            known = _HASHED.get(inode) == (*version, sha256)
        digest = None if known and destination else hashlib.sha256()
        while data := f.read(COPY_CHUNK_BYTES):
            if digest is not None:
                digest.update(data)
            if destination:
                out.write(data)
        after = _file_identity(os.fstat(f.fileno()))
    if digest is None:
        if after == (inode, version):
            return  # the bytes hashed before, unchanged throughout the copy
        digest = hashlib.sha256(destination.read_bytes()) if destination else hashlib.sha256()
    elif digest.hexdigest() == sha256 and after == (inode, version):
        with _HASHED_LOCK:
            if len(_HASHED) >= MAX_HASHED:
                _HASHED.clear()
            _HASHED[inode] = (*version, sha256)
    if digest.hexdigest() != sha256:
        raise ModelChanged(f"{source} changed since it was submitted: submitted sha256 {sha256}, the file now has "
                           f"sha256 {digest.hexdigest()}. Submit the job again to measure the new file.")


def verify_model(path: Path, sha256: str) -> None:
    """The file hashed where it is, right before a device driver sends it on."""
    stage_model(path, None, sha256)


# What a process sees when the kernel refuses it more processes or threads, or more temp space.
PIDS_REFUSED = ("can't start new thread", "Resource temporarily unavailable", "fork: retry", "fork: Interrupted")
SPACE_REFUSED = ("No space left on device", "Disk quota exceeded")


def budget_limit_hit(budget: Budget, exit_info: ExitInfo, output: HarnessOutput | None) -> str | None:
    """The message for a failed run that ran into its pids limit or its temp space, or None."""
    if output is not None and output.ok:
        return None
    said = exit_info.output + (output.message or "" if output is not None else "")
    if exit_info.pids_limit_hit or any(text in said for text in PIDS_REFUSED):
        return (f"the run reached its pids limit ({pids_limit(budget)} processes and threads at once) and the kernel "
                "refused it more; a model or script needs far fewer: look for a loop that starts processes or threads")
    if any(text in said for text in SPACE_REFUSED):
        memory = f"{_mib(budget.memory_bytes):g} MiB" if budget.memory_bytes is not None else "half the host's memory"
        return (f"the run filled its temp space: /tmp, /var/tmp and /dev/shm are kept in memory and sized from sim.memory "
                f"({memory}); write large files into the run directory ($HOME) or raise sim.memory")
    return None


def disk_limit_message(task: TaskSpec) -> str:
    """The failure of a run that filled its run directory's quota, naming the limit and the field it came from."""
    sim = task.plan.sim
    field = "sim.disk" if sim.disk else "sim.disk, which defaults to sim.memory" if sim.memory else \
        f"sim.disk, which defaults to {DEFAULT_RUN_DISK >> 30} GiB without sim.memory"
    return (f"the run filled its run directory: the files a run writes there are bounded at "
            f"{_mib(sim.disk_quota()):g} MiB ({field}); write less, or raise sim.disk (what is written there is "
            "held in memory, so it counts within sim.memory too)")


def _timed_loop(output: HarnessOutput | None) -> tuple[float, float, float] | None:
    """(wall, CPU, run-queue wait) of the timed loop in s, as the harness measured them; None unless all three
    are finite, non-negative numbers (written in the sandbox: a figure of another kind is not believed)."""
    if output is None or not output.ok:
        return None
    figures = (output.measure_wall_s, output.loop_cpu_s, output.loop_wait_s)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
               for v in figures):
        return None
    wall, cpu, wait = (float(v) for v in figures)  # type: ignore[arg-type]
    return (wall, cpu, wait) if wall > 0 else None


def read_harness_output(path: Path, run_as: RunAs | None) -> HarnessOutput | None:
    """out.json as the sandboxed user left it: a regular file of theirs, not a link to one of ours."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:  # a symlink (ELOOP) or worse: not a harness result
        raise ValueError(f"the run's result file cannot be read safely: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or (run_as is not None and info.st_uid not in (run_as.uid, 0)):
            raise ValueError("the run's result file is not a regular file written by the run")
        data = f.read(MAX_HARNESS_OUTPUT_BYTES + 1)
    if len(data) > MAX_HARNESS_OUTPUT_BYTES:
        raise ValueError(f"the run's result file is over {MAX_HARNESS_OUTPUT_BYTES >> 20} MiB")
    return HarnessOutput(**json.loads(data))


def read_harness_result(fd: int) -> HarnessOutput | None:
    """The result the harness wrote into the anonymous file the agent opened before the run started (never a path
    the run could write); None when it wrote none. Bounded, and hostile until parsed."""
    size = os.fstat(fd).st_size
    if size == 0:
        return None
    if size > MAX_HARNESS_OUTPUT_BYTES:
        raise ValueError(f"the run's result is over {MAX_HARNESS_OUTPUT_BYTES >> 20} MiB")
    chunks, offset = [], 0
    while offset < size:
        chunk = os.pread(fd, min(size - offset, 16 << 20), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    try:
        fields = json.loads(b"".join(chunks))
    except ValueError as e:
        raise ValueError(f"the run's result is not the harness's JSON: {e}") from None
    if not isinstance(fields, dict):
        raise ValueError("the run's result is not the harness's JSON object")
    return HarnessOutput(**fields)


def run_summary(output: HarnessOutput | None) -> LatencyStats | None:
    """The latency summary of a run that completed with timings: the harness's own, of all of them, where it kept
    only the first MAX_SAMPLES (script mode), else that of iterations_ms. ValueError: a summary that is not one."""
    if output is None or not output.ok or not output.iterations_ms:
        return None
    if output.latency is not None:
        return summary_of_more(output.latency, len(output.iterations_ms))
    return latency_stats(output.iterations_ms, init_ms=output.init_ms, first_ms=output.first_ms,
                         warmup_ms=output.warmup_ms)


@dataclass
class SimSlot:
    """One place a sim run can happen; slots on one host get disjoint cpusets."""

    index: int
    cpuset: str | None = None


def _mib(n: int | None) -> float | None:
    return None if n is None else round(n / MiB, 1)


def _model_file_name(path: str) -> str:
    """The staged model's name: the submitted file's own when it is plain (scripts may look at it), else
    `model` with its extension (runtimes pick the format by it). The name came over the wire."""
    name = Path(path).name
    if re.match(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,99}$", name):
        return name
    suffix = Path(path).suffix
    return "model" + safe_suffix(suffix)


def format_script_args(args: list[str], task: TaskSpec, model_path: str) -> list[str]:
    values = {"model": model_path, "threads": task.threads, "batch_size": task.batch_size,
              "input_size": task.input_size if task.input_size is not None else "",
              "accelerator": task.plan.accelerator, "precision": task.plan.precision}
    out = []
    for a in args:
        try:
            out.append(a.format(**values))
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"workload.args: cannot fill {a!r}: unknown placeholder {e}; use {{model}}, {{threads}}, {{batch_size}}, {{input_size}}, {{accelerator}} or {{precision}}") from None
    return out


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


def cpuset_problem(cpuset: str | None) -> str | None:
    """Why this host cannot run a job's sim.cpuset, or None: cores it lacks, or a cpuset that does not parse."""
    if not cpuset:
        return None
    usable = sorted(os.sched_getaffinity(0))
    try:
        missing = cores_missing(cpuset, usable)
    except ValueError as e:
        return f"sim.cpuset: {e}"
    if not missing:
        return None
    return (f"sim.cpuset {cpuset!r} names core(s) {format_cpuset(missing)}, which {socket.gethostname()} cannot use "
            f"(it has {format_cpuset(usable)}); change sim.cpuset or run the job where those cores exist.")


def shaped_cores(cpus: float, cpuset: str | None, looked: dict[int, float] | None = None) -> list[int]:
    """The cores a budget runs on, shaped like a device: `cpus` whole cores are that many cores of the
    slot's (or the job's) cpuset, the quietest now; a fraction gets ceil(cpus) cores and keeps its quota
    (base.cfs_quota_us decides the quota)."""
    allowed = parse_cpuset(cpuset) if cpuset else sorted(os.sched_getaffinity(0))
    wanted = whole_cores(cpus) or math.ceil(cpus)
    return quietest_cores(allowed, wanted, looked)


class _RunFailed(Exception):
    """A step of SimDriver._run that ends the run, carrying the result to store."""

    def __init__(self, result: RunResult) -> None:
        super().__init__(result.message)
        self.result = result


@dataclass
class _Run:
    """One run's set-up as SimDriver._run's steps hand it on."""

    task: TaskSpec
    run_user: RunAs | None
    backend: SandboxBackend
    build: dict | None  # the image build's record (None: no build)
    budget: Budget  # as the backend applies it
    looked: dict[int, float]  # the look that chose the cores: the quiet check's first look
    limits: Limits
    inner: Path | None  # where the run directory appears to the run (None: at its own path)
    isolation: str  # how the run is isolated, in words
    run_dir: Path
    disk: int  # sim.disk in bytes
    bounded: bool  # the run directory is a tmpfs bounded by sim.disk
    result_fd: int | None = None  # the result's descriptor (None: out.json in the run directory)

    @property
    def own_python(self) -> bool:
        """The script runs with the Python of the user's image (sim.image)."""
        return self.task.plan.sim.image is not None

    @property
    def seen(self) -> Path:
        """The run directory as the run sees it."""
        return self.inner or self.run_dir

    def failed(self, failure_class: FailureClass, message: str) -> _RunFailed:
        return _RunFailed(RunResult.failed(failure_class, message, backend=self.backend.name, limits=self.limits,
                                           approximate=self.backend.approximate))


def _take_output(result: RunResult, environment: dict[str, Any], output: HarnessOutput, task: TaskSpec) -> None:
    """What the harness reported beside the timings, onto the result (bounded: it was written in the sandbox)."""
    result.tool_versions = output.tool_versions
    result.baseline_memory_bytes = output.baseline_rss_bytes
    result.peak_rss_bytes = output.peak_rss_bytes
    result.whole_run_s = output.whole_run_s
    environment["input_shapes"] = output.input_shapes
    # written in the sandbox: bounded, whatever it holds
    environment["input_values"] = {str(k)[:200]: str(v)[:200] for k, v in list(output.input_values.items())[:64]}
    result.runtime = output.runtime
    if output.op_profile_note:  # written in the sandbox: a bounded string, whatever it was
        environment["op_profile_note"] = str(output.op_profile_note)[:500]
    judge_accuracy(result, output.accuracy, task)


class SimDriver:
    name = "sim"

    def __init__(self, work_root: Path, *, backend_override: str | None = None, keep_run_dirs: bool = False,
                 run_as: RunAs | None | str = "default", keep_out: tuple[Path, ...] = (),
                 build_policy: BuildPolicy = BuildPolicy()) -> None:
        self.work_root = work_root
        self.build_policy = build_policy  # what a job's sim.build may use: network, base images
        # Files a job's folder is never packed with: the store an embedded farm has open in this process
        # (reading and closing them here would drop SQLite's locks and lose writes).
        self.keep_out = keep_out
        # Jobs run other people's code: as root, in an unprivileged user (`nobody` unless --run-as says).
        self.run_as: RunAs | None = resolve_run_as(None) if isinstance(run_as, str) else run_as
        self.backend_override = backend_override
        self.keep_run_dirs = keep_run_dirs
        self._backends: dict[tuple[str, str | None, bool, bool], SandboxBackend] = {}
        self._builder: ImageBuilder | None = None
        # each run's own uid and gid (root only): the run range, shared by every slot and every agent on the host
        self.run_uids = RunUids(*run_uid_range()) if self.run_as is not None else None
        self.slot = SimSlot(0)  # where run() runs; in_slot gives each agent slot its own
        # kept harnesses with the runtime imported, forking each run (FARM_WARM_HARNESS=0: every run cold)
        self.zygotes: Zygotes | None = Zygotes() if warm_enabled() else None

    @property
    def runs_root(self) -> Path:
        """Where the run directories are (each run's mount namespace holds only its own)."""
        return self.work_root / "runs"

    def in_slot(self, slot: SimSlot) -> "SimDriver":
        """This driver for one slot's cores; the probed backends and the image builder are shared."""
        driver = copy.copy(self)
        driver.slot = slot
        return driver

    def backend_for(self, task: TaskSpec, image: str | None = None) -> SandboxBackend:
        name = self.backend_override or task.plan.sim.backend
        own = task.plan.sim.image is not None  # the user's image (or a venv built in it): its own Python runs the script
        image = image or task.plan.sim.image
        key = (name, image, own, task.plan.sim.writable_root)
        if key not in self._backends:  # probing a backend (docker ping, cgroup mkdir) once is enough
            # sim.writable_root: the job may ask for a writable root of its own (still as the run user)
            self._backends[key] = choose_backend(name, image=image, user_image=own,
                                                 writable_root=task.plan.sim.writable_root)
        return self._backends[key]

    def built_image(self, task: TaskSpec) -> tuple[str | None, dict | None]:
        """The image sim.build asks for (built now, or from the cache) and what to record of it; (None, None)
        when the job builds nothing. Raises BuildFailed (the job's fault) or SandboxError (the engine's)."""
        build = task.plan.sim.build
        if build is None:
            if task.plan.sim.image is not None and self.build_policy.bases is not None:
                self.image_builder().check_image(task.plan.sim.image)  # no build, but the same list of images
            return None, None
        name = self.backend_override or task.plan.sim.backend
        if not takes_images(name):
            raise BuildFailed(f"sim.build makes a Docker image, but this run uses the {name} backend "
                              "(--backend overrides the job's sim.backend: docker); drop --backend", "")
        try:
            context = self._script_folder(task) if isinstance(task.plan.workload, ScriptWorkload) else None
        except (ValueError, OSError) as e:
            raise BuildFailed(f"sim.build: {e}", "") from None
        built = self.image_builder().build(build, context, in_image=task.plan.sim.image)
        log = str(built.log_path) if built.log_path.exists() else None  # an image another work folder built
        return built.tag, {"image": built.tag, "cached": built.cached, "log": log,
                           "seconds": round(built.seconds, 3)}

    def image_builder(self) -> ImageBuilder:
        if self._builder is None:
            self._builder = ImageBuilder(self.work_root, policy=self.build_policy)
        return self._builder

    def _script_folder(self, task: TaskSpec) -> bytes:
        """workload.dir packed, as the run gets it: the controller's archive, or (embedded) the job's own folder."""
        if task.script_archive_path is not None:
            return task.script_archive_path.read_bytes()
        folder = task.plan.workload.dir if isinstance(task.plan.workload, ScriptWorkload) else "."
        return pack_dir(Path(task.plan.base_dir, folder), skip=(self.work_root, *self.keep_out))

    def budget_for(self, task: TaskSpec, slot: SimSlot, looked: dict[int, float] | None = None) -> Budget:
        sim = task.plan.sim
        cpus = default_cpus(sim.cpus, task.threads)
        cores = shaped_cores(cpus, sim.cpuset or slot.cpuset, looked)
        return Budget(cpus=cpus, cpuset=format_cpuset(cores), memory_bytes=sim.memory, exclusive=sim.exclusive)

    def harness_task(self, task: TaskSpec, inner: Path | None = None, own_python: bool = False) -> HarnessTask:
        """What the harness runs; `inner` is the run directory as the sandbox sees it (the model and the
        script folder are staged there), None to use the task's paths as they are. own_python: the user's
        image runs the script, so `python` is the image's (found on its PATH)."""
        w = task.plan.workload
        model_path = str(inner / "model" / _model_file_name(task.model_path)) if inner else task.model_path
        if isinstance(w, ScriptWorkload):
            if own_python and w.pip_requirements:
                raise ValueError("workload.pip_requirements installs into farm's own Python; with sim.image the "
                                 "image's Python runs the script: install the packages into the image")
            python = w.command if own_python else script_python(w.pip_requirements, self.work_root / "script-envs",
                                                                  self.run_as)
            command = python if w.command in ("python", "python3") else w.command
            script_dir = str(inner / "script") if inner else str(Path(task.plan.base_dir, w.dir).resolve())
            argv = [command]
            if w.script:
                argv.append(str(Path(script_dir, w.script)))
            argv += format_script_args(w.args, task, model_path)
            return script_task(task, model_path, argv, script_dir)
        return benchmark_task(task, model_path)

    def stage(self, task: TaskSpec, run_dir: Path) -> None:
        """The run's own copies: the model (hash-checked) and, for a script, its folder unpacked."""
        (run_dir / "model").mkdir()
        stage_model(Path(task.model_path), run_dir / "model" / _model_file_name(task.model_path), task.model_sha256)
        if not isinstance(task.plan.workload, ScriptWorkload):
            return
        (run_dir / "script").mkdir()
        archive = task.script_archive_path
        if archive is None:  # embedded: the job's own folder on this host, packed the way a client packs it
            archive = run_dir / "script.tar"
            archive.write_bytes(pack_dir(Path(task.plan.base_dir, task.plan.workload.dir), skip=(self.work_root, *self.keep_out)))
        unpack(archive, run_dir / "script")

    def isolation(self, backend: SandboxBackend, run_user: RunAs | None = None) -> tuple[Path | None, str]:
        """Where the run directory appears inside the sandbox (None: at its own path) and how the run is isolated."""
        own = backend.own_isolation(run_user.name if run_user else None)
        if own is not None:  # at a fixed path inside: the host's run path is in no argv or process list
            return own
        if run_user is None:
            return None, "none (the agent is not root: runs are as the agent's own user)"
        reason = namespaces_unavailable()
        if reason:
            return None, f"user {run_user.name} (a uid of its own) only ({reason})"
        return INNER_RUN_DIR, (f"user {run_user.name} (a uid of its own), mount + PID namespaces, no other run's "
                               "directory mounted")

    def run(self, task: TaskSpec, cancel_check: Callable[[], bool]) -> RunResult:
        """The task run once. As root, the run holds a uid and gid of the agent's run range that no other run holds
        meanwhile (isolation.RunUids), given back once its directory is gone and anything left of it killed."""
        if self.run_uids is None:
            return self._run(task, cancel_check, None)
        try:
            run_uid = self.run_uids.acquire()
        except (RunUserError, OSError) as e:
            return RunResult.failed(FailureClass.INFRASTRUCTURE, f"no uid for the run: {e}")
        try:
            return self._run(task, cancel_check, run_uid.run_as)
        finally:  # without namespaces, what the run left running under its uid is ended before the uid is reused
            run_uid.release(sweep=namespaces_unavailable() is not None)

    def _run(self, task: TaskSpec, cancel_check: Callable[[], bool], run_user: RunAs | None) -> RunResult:
        """One run as a pipeline of named steps: the backend (and image), the run directory, staging, the command,
        the environment, the quiet wait, the start, the watch, the harness's output, the verdict. A step that ends
        the run raises _RunFailed with the result to store; once the run directory exists it is cleaned up
        whatever happens. Where backends differ the steps ask the backend (SandboxBackend's methods), never its
        name."""
        try:
            backend, build = self._backend_of(task)
            run = self._new_run(task, run_user, backend, build)
        except _RunFailed as e:
            return e.result
        try:
            harness_task = self._stage_run(run)
            # The result comes back through an anonymous file opened here before any of the run's code starts,
            # handed down as a descriptor: no path a run (this one or another) can write. A container cannot be
            # handed one: its harness writes out.json in its own run directory, which only its own container sees.
            run.result_fd = backend.result_channel()
            argv, env, warm = self._command(run, harness_task)
            environment = self._environment(run, harness_task, warm)
            cores = parse_cpuset(run.budget.cpuset) if run.budget.cpuset else sorted(os.sched_getaffinity(0))
            quiet = wait_until_quiet(cores, task.plan.sim.quiet_wait, cancel_check, run.looked)
            sandbox = self._start(run, argv, env, warm)
            exit_info, contention, telemetry = self._watch(run, sandbox, cores, cancel_check)
            contention.quiet_wait_s, contention.quiet_before = quiet
            environment["load_after"] = load_average()
            output, summary = self._read_output(run)
            return self._verdict(run, exit_info, output, summary, contention, telemetry, environment)
        except _RunFailed as e:
            return e.result
        finally:
            if run.result_fd is not None:
                os.close(run.result_fd)
            self._cleanup(run.run_dir)

    def _backend_of(self, task: TaskSpec) -> tuple[SandboxBackend, dict | None]:
        """The backend the run uses and the image build's record (None: no build), or _RunFailed."""
        problem = cpuset_problem(task.plan.sim.cpuset)
        if problem:  # the same on every attempt here: a job failure, not an infrastructure retry
            raise _RunFailed(RunResult.failed(FailureClass.JOB, problem))
        try:
            image, build = self.built_image(task)
            backend = self.backend_for(task, image)
        except BuildFailed as e:
            failed = RunResult.failed(FailureClass.JOB, f"{e}{' — last lines of the build log: ' + e.log_tail.strip()[-600:] if e.log_tail.strip() else ''}")
            failed.log_tail = e.log_tail
            raise _RunFailed(failed) from None
        except SandboxError as e:
            raise _RunFailed(RunResult.failed(FailureClass.INFRASTRUCTURE, str(e))) from None
        if task.plan.sim.image is not None and not backend.takes_images:
            raise _RunFailed(RunResult.failed(
                FailureClass.JOB, f"sim.image {task.plan.sim.image!r} runs in a Docker image, but this run uses the "
                f"{backend.name} backend (--backend overrides the job's sim.backend: docker); drop --backend"))
        return backend, build

    def _new_run(self, task: TaskSpec, run_user: RunAs | None, backend: SandboxBackend, build: dict | None) -> _Run:
        """The run's budget as the backend applies it, its isolation, and its own run directory (a tmpfs where
        one can be mounted: the run's files are bounded by sim.disk once staged)."""
        looked: dict[int, float] = {}  # the look that chose the cores is the quiet check's first look
        budget = backend.effective_limits(self.budget_for(task, self.slot, looked))
        inner, isolation = self.isolation(backend, run_user)
        runs = self.runs_root
        runs.mkdir(parents=True, exist_ok=True)
        os.chmod(runs, 0o711)  # the run user may pass through to its own directory, not list the others
        run_dir = runs / f"task{task.task_id}-a{task.attempt}-{uuid.uuid4().hex}"
        run_dir.mkdir()
        disk = task.plan.sim.disk_quota()
        return _Run(task=task, run_user=run_user, backend=backend, build=build, budget=budget, looked=looked,
                    limits=Limits(cpus=budget.cpus, cpuset=budget.cpuset, memory_mb=_mib(budget.memory_bytes)),
                    inner=inner, isolation=isolation, run_dir=run_dir, disk=disk, bounded=mount_run_dir(run_dir))

    def _stage_run(self, run: _Run) -> HarnessTask:
        """The model and the script folder staged into the run directory, and the harness's task.json beside."""
        task = run.task
        try:
            self.stage(task, run.run_dir)
            harness_task = self.harness_task(task, run.seen, run.own_python)
            if run.bounded:
                bound_run_dir(run.run_dir, run.disk)
        except (ModelChanged, ScriptEnvError, ScriptArchiveError, ValueError) as e:
            raise run.failed(FailureClass.JOB, str(e)) from None
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise run.failed(FailureClass.RESOURCE, "the model and script folder do not fit in the run "
                                 f"directory's tmpfs: {e}") from None
            raise run.failed(FailureClass.JOB, f"{Path(task.model_path).name}: cannot be read on agent: "
                             f"{e.strerror}") from None
        harness_task.write(run.run_dir / "task.json")
        return harness_task

    def _command(self, run: _Run, harness_task: HarnessTask) -> tuple[list[str], dict[str, str], WarmLaunch | None]:
        """The harness's command line and environment as the run's user, and the kept harness it forks from (None:
        it starts cold)."""
        seen, backend = run.seen, run.backend
        out = f"fd:{run.result_fd}" if run.result_fd is not None else str(seen / "out.json")
        argv = [sys.executable, "-m", "farm.agents.harness", str(seen / "task.json"), out]
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(seen), "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
            **runtime_env(run.task.threads),
        }
        warm = None if run.own_python or run.result_fd is None else self.warm_launch(
            harness_task, backend, seen, run.inner, run.budget.memory_bytes, run.run_user, run.result_fd)
        try:
            if run.own_python:  # farm's harness from the host, the script's Python from the image (user_image.py)
                argv, env = self.launch_in_user_image(seen / "task.json", seen / "out.json", env, run.run_dir,
                                                      backend, run.run_user)
            elif warm is not None:  # the zygote's child sets up what launch()'s command line would
                self.launch(argv, env, run.run_dir, run.inner, backend, run.run_user, run.budget.memory_bytes)
            else:
                argv, env = self.launch(argv, env, run.run_dir, run.inner, backend, run.run_user,
                                        run.budget.memory_bytes)
        except (SandboxError, UserImageError) as e:
            raise run.failed(FailureClass.INFRASTRUCTURE, f"{backend.name} sandbox: {e}") from None
        return argv, env, warm

    def _environment(self, run: _Run, harness_task: HarnessTask, warm: WarmLaunch | None) -> dict[str, Any]:
        """What the run's environment record says before it starts (the run directory sealed on the way)."""
        # nosuid,nodev (the tmpfs already is): no set-uid file the run writes works, here or on the host
        sealed = run.bounded or seal_run_dir(run.run_dir)
        environment = {**host_facts(), "load_before": load_average(),
                       "isolation": run.isolation + ("" if sealed or run.run_user is None else
                                                     ", run directory not nosuid"),
                       "disk": (f"{_mib(run.disk):g} MiB (sim.disk), a tmpfs counted within the run's memory"
                                if run.bounded else "not bounded (mounting a tmpfs over the run directory needs root)"),
                       "harness": self.harness_mode(harness_task, run.backend, warm)}
        if run.build is not None:
            environment["build"] = run.build
        return environment

    def _start(self, run: _Run, argv: list[str], env: dict[str, str], warm: WarmLaunch | None) -> RunningSandbox:
        """The run started in its sandbox: forked from a kept harness, or cold with the run directory given to it
        as the backend takes it."""
        backend, run_user = run.backend, run.run_user
        try:
            if warm is not None:
                return backend.start_warm(warm, run.budget, env=env, cwd=run.run_dir)
            return backend.start(argv, run.budget, env=env, cwd=backend.run_cwd(run.run_dir, run.inner),
                                 mounts=[backend.run_dir_mount(run.run_dir, run.inner)],
                                 pass_fds=() if run.result_fd is None else (run.result_fd,),
                                 user=None if run_user is None else f"{run_user.uid}:{run_user.gid}")
        except SandboxError as e:
            raise run.failed(FailureClass.INFRASTRUCTURE, f"{backend.name} sandbox: {e}") from None

    def _watch(self, run: _Run, sandbox: RunningSandbox, cores: list[int],
               cancel_check: Callable[[], bool]) -> tuple[ExitInfo, Contention, Telemetry]:
        """The run waited for, sampled meanwhile, and judged for contention on its cores."""
        task, budget = run.task, run.budget
        # the window starts once the sandbox exists: setting it up (an engine creating a container)
        # is farm's own work, not other tasks' on the run's cores
        before = snapshot(cores)
        cpu_ns_at_start = sandbox.read_counters().cpu_ns or 0
        sampler = TelemetrySampler(sandbox, task.plan.sim.sample_interval_ms, avoid_cpuset=budget.cpuset,
                                   start_cpu_ns=cpu_ns_at_start, max_cores=len(cores) if cores else None).start()
        try:
            with at_highest_priority():
                exit_info = sandbox.wait(task.plan.run_timeout_s, cancel_check)
            after = snapshot(cores)
            accounting = sandbox.cpu_accounting()
        except SandboxError as e:
            raise run.failed(FailureClass.INFRASTRUCTURE, f"{run.backend.name} sandbox: {e}") from None
        finally:
            sampler.stop()
            sandbox.close()
        sampler.add_exit_waits(sandbox.exit_waits())
        contention = judge(
            before, after, budget_cpus=budget.cpus, demand_cpus=float(task.threads),
            run_cpu_s=None if accounting.cpu_ns is None else max(0, accounting.cpu_ns - cpu_ns_at_start) / 1e9,
            throttled_s=None if accounting.throttled_ns is None else round(accounting.throttled_ns / 1e9, 4),
            run_wait_s=sampler.run_wait_s,
            cgroup_pressure_us=accounting.pressure_some_us)
        contention.exclusive = sandbox.exclusive or (
            f"not exclusive: the {run.backend.name} backend cannot ask for it" if budget.exclusive else None)
        return exit_info, contention, sampler.summary(exit_info)

    def _read_output(self, run: _Run) -> tuple[HarnessOutput | None, LatencyStats | None]:
        """The harness's result, read with a bound from its descriptor (or, in a container, its out.json)."""
        try:
            # whatever else the run left in its directory (an out.json, an out.tmp) is never read
            if run.result_fd is None:
                output = read_harness_output(run.run_dir / "out.json", run.run_user)
            else:
                output = read_harness_result(run.result_fd)
            return output, run_summary(output)
        except (ValueError, TypeError) as e:
            raise run.failed(FailureClass.JOB, f"{Path(run.task.model_path).name}: {e}") from None

    def _verdict(self, run: _Run, exit_info: ExitInfo, output: HarnessOutput | None, summary: LatencyStats | None,
                 contention: Contention, telemetry: Telemetry, environment: dict[str, Any]) -> RunResult:
        """The run's RunResult: its failure class or figures, with what the kernel and the harness saw."""
        task, backend, limits = run.task, run.backend, run.limits
        if run.bounded and not (output is not None and output.ok) and run_dir_full(run.run_dir):
            result = RunResult.failed(FailureClass.RESOURCE, disk_limit_message(task))
        else:
            result = self._classify(task, run.budget, exit_info, output, summary)
        result.backend, result.limits, result.approximate = backend.name, limits, backend.approximate
        unenforced = backend.unenforced_cpus(limits.cpus)
        if unenforced and result.ok and not result.message:
            result.message = UNENFORCED_BUDGET + unenforced  # flagged in the run, so calibrations can say so
        result.telemetry = telemetry
        loop = _timed_loop(output)
        if loop is not None:  # the timings come from the timed loop: judge the CPU it lost, not the whole run's
            environment["timed_loop"] = judge_timed_loop(contention, loop_s=loop[0], loop_cpu_s=loop[1],
                                                         loop_wait_s=loop[2], demand_cpus=float(task.threads))
        result.contention = contention
        result.wall_s = exit_info.wall_s
        result.environment = environment
        result.log_tail = exit_info.output[-LOG_TAIL_CHARS:]
        if output is not None:
            _take_output(result, environment, output, task)
        return result

    def warm_launch(self, harness_task: HarnessTask, backend: SandboxBackend, seen: Path, inner: Path | None,
                    memory_bytes: int | None, run_user: RunAs | None, result_fd: int) -> WarmLaunch | None:
        """How a built-in benchmark starts forked from a kept harness, or None when it starts cold (scripts run
        their own command; docker runs in a container of its own; FARM_WARM_HARNESS=0)."""
        runtime = runtime_of(harness_task.model_path)
        if self.zygotes is None or not backend.warm_capable or harness_task.kind != "benchmark" or runtime is None:
            return None
        user = None if run_user is None else {"uid": run_user.uid, "gid": run_user.gid}
        isolate = None
        if user is not None and inner is not None:  # the namespaces launch() would make with unshare + run_world
            isolate = isolate_settings(memory_bytes, [str(self.runs_root)])
        return WarmLaunch(self.zygotes.get(runtime), str(seen / "task.json"), result_fd, isolate=isolate, user=user)

    def harness_mode(self, harness_task: HarnessTask, backend: SandboxBackend, warm: WarmLaunch | None) -> str:
        """How the run's process started, in words (the run's environment keeps it)."""
        if warm is not None:
            return f"warm: forked from a kept {warm.zygote.runtime} harness"
        if harness_task.kind != "benchmark":
            return "cold: a script runs its own command"
        if self.zygotes is None:
            return "cold: FARM_WARM_HARNESS=0"
        if not backend.warm_capable:
            return f"cold: the {backend.name} backend starts each run in its own container"
        return "cold"

    def launch(self, argv: list[str], env: dict[str, str], run_dir: Path, inner: Path | None,
               backend: SandboxBackend, run_user: RunAs | None,
               memory_bytes: int | None = None) -> tuple[list[str], dict[str, str]]:
        """The command line and environment that start argv as the run's user (namespaces when `inner`)."""
        if run_user is None:  # the run is us, in the run directory's mode the backend needs
            os.chmod(run_dir, backend.open_run_dir_mode(os.geteuid() == 0))
            return argv, env
        hand_over(run_dir, run_user)
        isolated = None if inner is None else isolation_env(run_user, memory_bytes, [str(self.runs_root)])
        return backend.command_as(argv, env, run_user, isolated)

    def launch_in_user_image(self, task_file: Path, out_file: Path, env: dict[str, str], run_dir: Path,
                             backend: SandboxBackend, run_user: RunAs | None) -> tuple[list[str], dict[str, str]]:
        """The harness started by the host's loader inside the user's image; the container itself starts as
        the run user (DockerBackend.run_user), so nothing is dropped here. PATH is the image's own, so the
        script's `python` is the image's."""
        if run_user is None:
            os.chmod(run_dir, backend.open_run_dir_mode(os.geteuid() == 0))
        else:
            hand_over(run_dir, run_user)
        path = backend.image_path_env()  # sim.image runs only on a backend that takes images
        return (harness_argv(str(task_file), str(out_file)),
                {**env, "PATH": path or "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"})

    def _classify(self, task: TaskSpec, budget: Budget, exit_info: ExitInfo, output: HarnessOutput | None,
                  summary: LatencyStats | None = None) -> RunResult:
        peak = exit_info.peak_memory_bytes
        if exit_info.canceled:
            return RunResult.failed(FailureClass.CANCELED, "canceled while running")
        if exit_info.timed_out:
            return RunResult.failed(FailureClass.TIMEOUT, f"the run exceeded timeouts.run = {task.plan.run_timeout_s:g} s and was stopped")
        memory_hit = budget.memory_bytes is not None and (
            exit_info.oom_killed or (output is not None and output.failure_class == "resource"))
        if memory_hit:
            return RunResult.failed(
                FailureClass.RESOURCE,
                f"out of memory at the {_mib(budget.memory_bytes):g} MiB limit (sim.memory); peak reached "
                f"{_mib(peak) if peak is not None else 'unknown'} MiB. Raise sim.memory or use a smaller model/batch.")
        limit = budget_limit_hit(budget, exit_info, output)
        if limit is not None:
            return RunResult.failed(FailureClass.RESOURCE, limit)
        if output is None and (exit_info.returncode is None or exit_info.returncode < 0):
            # killed from outside (a zygote or harness killed mid-run, the OOM killer of the host, a signal): the
            # model's run never ended, so it is retried elsewhere as infrastructure, not stored as farm's bug
            how = "with no exit status (its zygote ended)" if exit_info.returncode is None else \
                f"by signal {-exit_info.returncode} ({_signal_name(-exit_info.returncode)})"
            return RunResult.failed(
                FailureClass.INFRASTRUCTURE,
                f"the harness was ended {how} before it wrote a result; the run is tried again. Its last output: "
                f"{exit_info.output.strip()[-300:] or '(none)'}")
        if output is None:
            return RunResult.failed(
                FailureClass.BUG,
                f"the harness exited with status {exit_info.returncode} without writing a result; its last output: "
                f"{exit_info.output.strip()[-500:] or '(none)'}")
        if not output.ok:
            return RunResult.failed(FailureClass(output.failure_class or "bug"), f"{Path(task.model_path).name}: {output.message}")
        # a completed run's message says what farm had to do about it (e.g. a script's leftover children)
        result = RunResult(status=RunStatus.COMPLETED, iterations_ms=output.iterations_ms, message=output.message)
        if summary is not None:
            result.latency = summary
            result.throughput_per_s = throughput_per_s(result.latency, output.measure_wall_s)
            result.startup_ms = startup_ms(result.latency)
        result.op_profile = op_profile.from_dicts(output.op_profile)
        return result

    def _cleanup(self, run_dir: Path) -> None:
        if self.keep_run_dirs and os.path.ismount(run_dir):
            keep_run_dir(run_dir)  # a tmpfs (sim.disk): its files go onto the disk beneath before it is unmounted
        unseal_run_dir(run_dir)
        if self.keep_run_dirs:
            strip_set_ids(run_dir)  # kept for a person to look at: no set-uid file of the run's stays usable
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
