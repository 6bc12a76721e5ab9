"""Shell-script workloads on a phone over adb: what a phone can run without Python.

A phone has /system/bin/sh and toybox, not python3, so the script workloads that make sense there
are shell scripts (`command: sh`), e.g. ones that drive a native tool the script folder carries.
The folder goes as the same checked tar the sim unpacks, pushed by hash; the script runs in its
own directory under a timeout, its output goes to a file on the phone, and only its timing lines
(the sim's rule: `{"latency_ms": …}`) and a short tail cross the link. The directory is removed
afterwards, also after a timeout.
"""

from __future__ import annotations

import re
import shlex
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from farm.agents.android.adb import DEFAULT_REMOTE_DIR, AndroidDevice
from farm.agents.board_harness.board_harness import MAX_TIMINGS, BadTiming, parse_timing_line
from farm.agents.harness.stats import latency_stats
from farm.agents.sim.driver import format_script_args
from farm.proto.results import FailureClass, RunResult, RunStatus
from farm.proto.script_archive import ScriptArchiveError, check_archive, pack_dir
from farm.proto.spec import ScriptWorkload
from farm.proto.tasks import TaskSpec

SHELLS = ("sh", "/system/bin/sh")
TAIL_BYTES = 3000
_END = "@@farm-phone-end"
_TAIL = "@@farm-phone-tail"
_END_LINE = re.compile(rf"^{_END} rc=(\d+) t0=(\S*) t1=(\S*) bytes=(\d*)$", re.MULTILINE)


def phone_script_problem(workload: ScriptWorkload, phone: str) -> str | None:
    """Why this script workload cannot run on a phone (None: it can), saying what does run there."""
    what_runs = (f"{phone} is an Android phone: it runs type: benchmark (.tflite with benchmark_model) and shell "
                 "scripts (command: sh); Python scripts run on Linux and Jetson boards (driver: linux or jetson) "
                 "and in the sim")
    if workload.command not in SHELLS:
        return f"command {workload.command!r} does not run on a phone. {what_runs}"
    if workload.pip_requirements:
        return f"pip_requirements need Python. {what_runs}"
    return None


def _archive(task: TaskSpec, workload: ScriptWorkload, tmp: str) -> Path:
    given = task.script_archive_path  # the uploaded folder on a remote agent; None: pack the job's own here
    archive = given or Path(tmp, "script.tar")
    if not given:
        archive.write_bytes(pack_dir(Path(task.plan.base_dir, workload.dir)))
    check_archive(archive, script=workload.script)
    return archive


def phone_script_command(run_dir: str, archive: str, argv: list[str], timeout_s: float) -> str:
    """Unpack, run under a timeout with its output in a file, report status, times and what to read back."""
    d = shlex.quote(run_dir)
    script = " ".join(shlex.quote(a) for a in argv)
    return (f"mkdir -p {d}/script && cd {d}/script && tar -xf {shlex.quote(archive)} && "
            f"{{ t0=$(date +%s%N); timeout -s KILL {max(1, int(timeout_s))} {script} > {d}/out.log 2>&1 </dev/null; "
            f"rc=$?; t1=$(date +%s%N); echo; echo \"{_END} rc=$rc t0=$t0 t1=$t1 bytes=$(wc -c < {d}/out.log)\"; "
            f"grep -E '^[[:space:]]*[{{]' {d}/out.log | head -n {MAX_TIMINGS}; echo {_TAIL}; "
            f"tail -c {TAIL_BYTES} {d}/out.log; }}")


def run_script_on_phone(device: AndroidDevice, task: TaskSpec, w: ScriptWorkload, phone: str) -> RunResult:
    """One shell-script task on the phone (the caller holds the connection and maps its errors)."""
    base: dict[str, Any] = dict(backend="android")
    with tempfile.TemporaryDirectory(prefix="farm-phone-") as tmp:
        try:
            archive = _archive(task, w, tmp)
        except ScriptArchiveError as e:
            return RunResult.failed(FailureClass.JOB, str(e), **base)
        pushed_archive = device.push_by_hash(archive).remote_path
    model = device.push_by_hash(Path(task.model_path)).remote_path
    run_dir = f"{DEFAULT_REMOTE_DIR}/runs/t{task.task_id}-a{task.attempt}-{uuid.uuid4().hex[:12]}"
    try:
        argv = [w.command] + ([f"{run_dir}/script/{w.script}"] if w.script else [])
        argv += format_script_args(w.args, task, model)
    except ValueError as e:
        return RunResult.failed(FailureClass.JOB, str(e), **base)
    command = phone_script_command(run_dir, pushed_archive, argv, task.plan.run_timeout_s)
    started = time.monotonic()
    try:
        shell = device.shell(command, timeout_s=task.plan.run_timeout_s + 60)
    finally:
        device.shell(f"rm -rf {shlex.quote(run_dir)}", 60, idempotent=True)
    wall_s = time.monotonic() - started
    environment: dict[str, Any] = {"command": " ".join(argv)}
    end = _END_LINE.search(shell.output)
    if end is None:
        return RunResult.failed(FailureClass.JOB, f"the script could not start on {phone} (status "
                                f"{shell.exit_status}): {shell.output.strip()[-300:]}", environment=environment,
                                log_tail=shell.output[-4000:], runtime="script", **base)
    rc, t0, t1, size = int(end[1]), end[2], end[3], end[4]
    body, _, tail = shell.output[end.end():].partition(f"\n{_TAIL}\n")
    # toybox's date has %N on current Android; where it prints a literal N, the agent's clock stands in
    whole_run_s = (int(t1) - int(t0)) / 1e9 if t0.isdigit() and t1.isdigit() else wall_s
    environment.update({"script_output_bytes": int(size) if size else None,
                        "whole_run_source": "phone" if t0.isdigit() else "agent (the phone's date has no %N)"})
    common = dict(environment=environment, log_tail=tail[-4000:], whole_run_s=whole_run_s, wall_s=wall_s,
                  runtime="script", **base)
    if rc == 137:
        return RunResult.failed(FailureClass.TIMEOUT, f"the script ran longer than timeouts.run = "
                                f"{task.plan.run_timeout_s:g} s on {phone} and was stopped", **common)
    if rc != 0:
        last = "\n".join(tail.strip().splitlines()[-5:])
        return RunResult.failed(FailureClass.JOB, f"the script exited with status {rc} on {phone}; its last output:\n"
                                f"{last}", **common)
    timings, bad = [], []
    for number, line in enumerate(body.splitlines(), start=1):
        try:
            value = parse_timing_line(line)
        except BadTiming as e:
            bad.append(f"timing line {number}: {e}")
            continue
        if value is not None:
            timings.append(value)
    if bad:
        return RunResult.failed(FailureClass.JOB, "the script printed timings no statistic can use: "
                                + "; ".join(bad[:3]), **common)
    return RunResult(status=RunStatus.COMPLETED, iterations_ms=timings,
                     latency=latency_stats(timings) if timings else None, **common)
