"""Script mode: run the user's own command, time it as a whole, and collect the
per-inference timings it prints as JSON lines ({"latency_ms": 12.3})."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

from farm.agents.harness.task import HarnessOutput, HarnessTask
from farm.agents.harness.tflite_runner import ModelRejected
from farm.agents.sandbox.process_tree import die_with_parent

TIMING_KEYS = ("latency_ms", "inference_ms")


def parse_timing_line(line: str) -> float | None:
    """The per-inference time in ms a script printed on this line, if any."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    for key in TIMING_KEYS:
        value = data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            return float(value)
    return None


def run(task: HarnessTask, out: HarnessOutput, rss_now) -> None:
    out.runtime = "script"
    out.baseline_rss_bytes = rss_now()
    timings: list[float] = []
    tail: list[str] = []
    t0 = time.perf_counter()
    try:
        # `python` is farm's own interpreter: started as this harness was, so it works for the run user even
        # where the interpreter's real path lies in a folder that user cannot search.
        executable = "/proc/self/exe" if task.command[0] == sys.executable else None
        proc = subprocess.Popen(task.command, executable=executable, cwd=task.script_dir, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1, preexec_fn=die_with_parent)
    except FileNotFoundError:
        raise ModelRejected(f"command {task.command[0]!r} was not found on the PATH of the sandbox") from None
    except PermissionError:
        raise ModelRejected(f"command {task.command[0]!r} is not executable") from None
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)  # the user's output stays in the run's log
        value = parse_timing_line(line)
        if value is not None:
            timings.append(value)
        tail = (tail + [line.rstrip()])[-20:]
    status = proc.wait()
    out.whole_run_s = time.perf_counter() - t0
    out.peak_rss_bytes = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    if status < 0 and status == -9:
        raise MemoryError("the script was killed (SIGKILL), most likely at the memory limit")
    if status != 0:
        last = "\n".join(tail[-5:])
        raise ModelRejected(f"the script exited with status {status}; its last output:\n{last}")
    out.iterations_ms = timings
