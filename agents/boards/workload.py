"""A workload on a board over ssh: what goes there, the command that runs it, and the clean-up.

Everything a run needs is sent by content hash and checked on arrival: the board harness (one
file, the board's own python3, no farm install), the model, and a script's folder (the same
tar the sim unpacks). Each run gets its own directory on the board, removed afterwards with any
process the script left behind, also after a timeout. A script's pip requirements go into a venv
on the board, made once per interpreter and requirement set.
"""

from __future__ import annotations

import json
import re
import shlex
import tempfile
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from farm.agents.board_harness import HARNESS_FILE
from farm.agents.board_harness.board_harness import PROTOCOL
from farm.proto.accuracy import judge_accuracy
from farm.agents.harness.stats import latency_stats, startup_ms, throughput_per_s
from farm.agents.harness.task import HarnessTask, benchmark_task, script_task
from farm.agents.boards.harness_output import HarnessOutputError, parse_env_output, parse_harness_output
from farm.agents.sim.driver import format_script_args
from farm.agents.boards.ssh_transport import SshInfrastructureError, SshTransport, UploadResult, file_sha256
from farm.proto.results import FailureClass, RunResult, RunStatus
from farm.proto.script_archive import check_archive, pack_dir
from farm.proto.spec import BenchmarkWorkload, ScriptWorkload
from farm.proto.tasks import TaskSpec

LOG_TAIL_CHARS = 4000
MIN_PYTHON = (3, 6)
TIMEOUT_GRACE_S = 30  # the harness stops a script at the run's timeout itself; ssh waits this much longer
PY_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")


class BoardNotReady(Exception):
    """The board lacks what every job needs (python3, its venv module, a runtime): infrastructure."""


class BoardJobError(Exception):
    """The job's own fault, found while staging (its script folder, its requirements)."""

    def __init__(self, message: str, failure_class: str = "job") -> None:
        super().__init__(message)
        self.failure_class = failure_class


@dataclass
class BoardRunTask(HarnessTask):
    """What `board_harness.py run` reads: the sim's HarnessTask (built by the same functions) plus the
    board's own fields."""

    archive: str | None = None
    timeout_s: float | None = None
    sample_interval_ms: float = 100
    pgid_file: str | None = None
    protocol: int = PROTOCOL


@dataclass
class StagedRun:
    run_dir: str
    command: str  # runs the harness (after checking its hash); the telemetry sampler runs beside it
    ssh_timeout_s: float
    harness: UploadResult
    python_version: str
    venv: str | None = None  # the requirements' venv python, when the script has requirements


PYTHON_PROBE = "import sys; print('%d.%d.%d' % sys.version_info[:3])"
_HAVE = "@@farm-have"
_TASK_WRITTEN = "@@farm-task-written"


def python_version_from_probe(python: str, text: str) -> str:
    """The version PYTHON_PROBE printed; BoardNotReady when there is none or it is older than 3.6."""
    lines = text.strip().splitlines()
    version = lines[-1].strip() if lines else ""
    m = PY_VERSION.match(version)
    if not m:
        raise BoardNotReady(f"no usable python at {python!r} on the board ({text.strip()[-200:] or 'no output'}); "
                            "install python3 (3.6 or newer) there, or set `python:` in the device entry")
    if (int(m[1]), int(m[2])) < MIN_PYTHON:
        raise BoardNotReady(f"the board's {python} is Python {version}; farm's board harness needs 3.6 or newer "
                            "(set `python:` in the device entry to a newer one)")
    return version


def remote_name(remote_dir: str, local: Path, sha256: str) -> str:
    """Where upload_by_hash puts a file: its sha256 with its extension."""
    return f"{remote_dir.rstrip('/')}/{sha256}{local.suffix}"


def probe_and_send(ssh: SshTransport, python: str, remote_dir: str, files: list[Path],
                   task_file: str | None = None, task_json: str | None = None) -> tuple[str, list[UploadResult]]:
    """One round trip for what every run asks first (the board's python version, which files it already has,
    and the run's task file), then the missing files by hash: each ssh command costs a fraction of a second."""
    local = [(f, file_sha256(f), f.stat().st_size) for f in files]
    remote = [remote_name(remote_dir, f, sha) for f, sha, _ in local]
    q = shlex.quote
    command = (f"( {q(python)} -c {q(PYTHON_PROBE)} ) </dev/null 2>&1; echo {_HAVE}; mkdir -p {q(remote_dir)} && "
               f"sha256sum -- {' '.join(map(q, remote))} </dev/null 2>/dev/null; true")
    if task_file and task_json is not None:
        command += (f"; mkdir -p {q(str(Path(task_file).parent))} && cat > {q(task_file)} && echo {_TASK_WRITTEN}")
    _, out, err = ssh.run(command, 60, stdin=(task_json or "").encode())
    probe, _, listing = out.partition(_HAVE + "\n")
    version = python_version_from_probe(python, probe)
    if task_file and task_json is not None and _TASK_WRITTEN not in listing:
        raise BoardNotReady(f"cannot write the run's task file {task_file} on the board: {err.strip()[-300:]}")
    have = {}
    for line in listing.splitlines():
        digest, _, path = line.partition("  ")
        have[path.strip()] = digest
    sent = [UploadResult(path, sha, size, uploaded=False) if have.get(path) == sha
            else ssh.upload_by_hash(f, remote_dir, known_missing=True) for (f, sha, size), path in zip(local, remote)]
    return version, sent


def harness_command(python: str, harness: UploadResult, *args: str, env: str = "") -> str:
    """Run the pushed harness only if the file on the board still has the hash it was pushed with."""
    check = f"echo {shlex.quote(harness.sha256 + '  ' + harness.remote_path)} | sha256sum -c --status"
    run = env + " ".join([shlex.quote(python), shlex.quote(harness.remote_path), *map(shlex.quote, args)])
    return (f"{{ {check} || {{ echo 'farm: the board harness on the board is not the file that was pushed "
            f"(sha256 differs)' >&2; exit 97; }}; }} && {run}")


def local_archive(task: TaskSpec, tmp: str) -> Path:
    """The script folder as the tar the sim unpacks (the uploaded one on remote agents, else packed here), checked."""
    w = task.plan.workload
    if not isinstance(w, ScriptWorkload):
        raise BoardJobError(f"task {task.task_id} has a {w.type} workload; only scripts have a folder")
    given = task.script_archive_path  # the uploaded folder on a remote agent; None: pack the job's own here
    archive = given or Path(tmp, "script.tar")
    try:
        if not given:
            archive.write_bytes(pack_dir(Path(task.plan.base_dir, w.dir)))
        check_archive(archive, script=w.script)
    except ValueError as e:  # ScriptArchiveError: links to folders, devices, a missing script
        raise BoardJobError(str(e)) from None
    return archive


def make_venv(ssh: SshTransport, python: str, harness: UploadResult, remote_dir: str, requirements: list[str],
              timeout_s: float) -> str:
    """The venv python with `requirements` installed on the board (made once, then reused)."""
    request = json.dumps({"requirements": requirements, "timeout_s": timeout_s}).encode()
    command = harness_command(python, harness, "env", f"{remote_dir}/venvs")
    status, out, err = ssh.run(command, timeout_s + TIMEOUT_GRACE_S, stdin=request)
    try:
        env = parse_env_output(out)
    except HarnessOutputError as e:
        raise BoardNotReady(f"the board harness could not make the requirements' venv (status {status}): {e}; "
                            f"{err.strip()[-300:]}") from None
    if env.ok and env.python:
        return env.python
    if env.failure_class == "infrastructure":
        raise BoardNotReady(env.message)
    raise BoardJobError(env.message, env.failure_class or "job")


def run_task_spec(task: TaskSpec, run_dir: str, model: str, archive: str | None, python: str,
                  sample_interval_ms: float) -> BoardRunTask:
    """What the harness is asked to run; `python` runs a script whose command is python."""
    w = task.plan.workload
    if isinstance(w, BenchmarkWorkload):
        return BoardRunTask(**asdict(benchmark_task(task, model)))
    script_dir = f"{run_dir}/script"
    command = python if w.command in ("python", "python3") else w.command
    argv = [command] + ([f"{script_dir}/{w.script}"] if w.script else [])
    try:
        argv += format_script_args(w.args, task, model)
    except ValueError as e:
        raise BoardJobError(str(e)) from None
    return BoardRunTask(**asdict(script_task(task, model, argv, script_dir)), archive=archive,
                        timeout_s=task.plan.run_timeout_s, sample_interval_ms=sample_interval_ms,
                        pgid_file=f"{run_dir}/script.pgid")


def stage_run(ssh: SshTransport, task: TaskSpec, *, python: str, remote_dir: str, sample_interval_ms: float,
              env_timeout_s: float) -> StagedRun:
    """Send what the run needs and write its task file; returns the command that runs it."""
    w = task.plan.workload
    script = isinstance(w, ScriptWorkload)
    requirements = list(w.pip_requirements) if isinstance(w, ScriptWorkload) else []
    run_dir = f"{remote_dir}/runs/t{task.task_id}-a{task.attempt}-{uuid.uuid4().hex[:12]}"
    task_file = f"{run_dir}/task.json"
    with tempfile.TemporaryDirectory(prefix="farm-board-") as tmp:
        files = [HARNESS_FILE, Path(task.model_path)] + ([local_archive(task, tmp)] if script else [])
        shas = [file_sha256(f) for f in files]
        model = remote_name(remote_dir, files[1], shas[1])
        archive = remote_name(remote_dir, files[2], shas[2]) if script else None
        # the task file goes with the first round trip, unless a venv must be made first (it names its python)
        spec = None if requirements else run_task_spec(task, run_dir, model, archive, python, sample_interval_ms)
        try:
            version, sent = probe_and_send(ssh, python, remote_dir, files, task_file,
                                           json.dumps(asdict(spec)) if spec else None)
        except (BoardNotReady, SshInfrastructureError):
            clean_up_quietly(ssh, run_dir)  # the task file may be there already
            raise
    harness = sent[0]  # cached by hash, like benchmark_model on phones
    venv = None
    if requirements:
        venv = make_venv(ssh, python, harness, remote_dir, requirements, env_timeout_s)
        spec = run_task_spec(task, run_dir, model, archive, venv, sample_interval_ms)
        status, _, err = ssh.run(f"mkdir -p {shlex.quote(run_dir)} && cat > {shlex.quote(task_file)}", 30,
                                 stdin=json.dumps(asdict(spec)).encode())
        if status != 0:
            clean_up_quietly(ssh, run_dir)
            raise BoardNotReady(f"cannot write the run's directory {run_dir} on the board: {err.strip()[-300:]}")
    command = f"cd {shlex.quote(run_dir)} && " + harness_command(python, harness, "run", task_file,
                                                                 env=f"OMP_NUM_THREADS={int(task.threads)} ")
    return StagedRun(run_dir, command, task.plan.run_timeout_s + TIMEOUT_GRACE_S, harness, version, venv)


def clean_up(ssh: SshTransport, run_dir: str) -> None:
    """Kill whatever the run's script left behind (its process group) and remove the run's directory."""
    quoted = shlex.quote(run_dir)
    ssh.run(f"PG=$(cat {quoted}/script.pgid 2>/dev/null); case \"$PG\" in ''|*[!0-9]*) ;; "
            f"*) [ \"$PG\" -gt 1 ] && kill -KILL -- -\"$PG\" 2>/dev/null;; esac; rm -rf -- {quoted}", 60)


def clean_up_quietly(ssh: SshTransport, run_dir: str) -> None:
    """Clean up after a failure whose own error is the one to report."""
    try:
        clean_up(ssh, run_dir)
    except SshInfrastructureError:
        pass


def board_result(task: TaskSpec, board: str, staged: StagedRun, sampled, energy_mj: float | None, facts: dict,
                 source: str, base: dict) -> RunResult:
    """The harness's result line and the board's telemetry as one RunResult."""
    status = sampled.result.status
    log = (sampled.result.stdout + sampled.result.stderr)[-LOG_TAIL_CHARS:]
    environment: dict[str, Any] = {"device": facts, "command": staged.command, "telemetry_source": source,
                                   # the unit the run was given (a script is told it through {accelerator})
                                   "accelerator": {"unit": task.plan.accelerator, "precision": task.plan.precision}}
    name = Path(task.model_path).name
    try:
        output = parse_harness_output(sampled.result.stdout)
    except HarnessOutputError as e:
        if status in (97, 126, 127):  # the harness changed on the board, or its python cannot be run
            return RunResult.failed(FailureClass.INFRASTRUCTURE, f"{board}: the board harness could not start "
                                    f"(status {status}): {sampled.result.stderr.strip()[-300:]}",
                                    environment=environment, log_tail=log, **base)
        return RunResult.failed(FailureClass.BUG if status == 0 else FailureClass.JOB,
                                f"the harness on {board} exited with status {status} without a result ({e}): "
                                f"{log.strip()[-300:] or '(no output)'}", environment=environment, log_tail=log, **base)
    if output.output_tail:
        log = (output.output_tail + "\n" + sampled.result.stderr)[-LOG_TAIL_CHARS:]
    if output.accelerator:
        environment["accelerator"] = output.accelerator
    environment.update({"input_shapes": output.input_shapes,
                        "input_values": {str(k)[:200]: str(v)[:200] for k, v in list(output.input_values.items())[:64]},
                        "board_harness_sha256": staged.harness.sha256})
    if isinstance(task.plan.workload, ScriptWorkload):
        environment.update({
            "script_output_bytes": output.output_bytes,
            # the script's own process group, beside the board-wide figures of the telemetry
            "process_memory": {"avg_bytes": output.process_memory_avg_bytes,
                               "peak_bytes": output.process_memory_peak_bytes,
                               "samples": output.process_memory_samples},
        })
        if staged.venv:
            environment["venv_python"] = staged.venv
    if not output.ok:
        return RunResult.failed(FailureClass(output.failure_class or "bug"), f"{name} on {board}: {output.message}",
                                environment=environment, log_tail=log, whole_run_s=output.whole_run_s,
                                runtime=output.runtime, **base)
    if energy_mj is not None and sampled.wall_s > 0:
        environment["energy_mj"] = energy_mj  # the sampled window: the harness's whole life on the board
        n = len(output.iterations_ms)
        # charge the inferences their share of the window (it also holds start-up and, for scripts, the rest)
        busy_s = output.measure_wall_s if output.measure_wall_s else sum(output.iterations_ms) / 1000
        if n and busy_s:
            environment["energy_per_inference_mj"] = energy_mj * min(1.0, busy_s / sampled.wall_s) / n
    latency = latency_stats(output.iterations_ms, init_ms=output.init_ms, first_ms=output.first_ms,
                            warmup_ms=output.warmup_ms) if output.iterations_ms else None
    result = RunResult(
        status=RunStatus.COMPLETED, message=output.message, iterations_ms=output.iterations_ms, latency=latency,
        throughput_per_s=throughput_per_s(latency, output.measure_wall_s) if latency else None,
        startup_ms=startup_ms(latency) if latency else None,
        telemetry=sampled.telemetry(), wall_s=sampled.wall_s, whole_run_s=output.whole_run_s,
        baseline_memory_bytes=output.baseline_rss_bytes, peak_rss_bytes=output.peak_rss_bytes,
        environment=environment, tool_versions=output.tool_versions, log_tail=log, runtime=output.runtime, **base)
    judge_accuracy(result, output.accuracy, task)  # workload.dataset: the block bounded, the thresholds judged here
    return result
