"""Script mode: run the user's own command, time it as a whole, and collect the
per-inference timings it prints as JSON lines ({"latency_ms": 12.3}).

The whole-run time ends when the script's own process exits: anything it left running
(a child holding stdout open) is ended then and named in the run's message. A timing
line that is not a finite, non-negative number refuses the run with its line number,
since every figure computed from it would be wrong. Output is decoded as UTF-8 with
replacement characters: a stray byte never fails a run.
"""

from __future__ import annotations

import codecs
import ctypes
import dataclasses
import math
import os
import re
import resource
import subprocess
import sys
import threading
import time
from array import array

import psutil

# The timing-line rule lives in the board harness, so a board and the sim read a script's output alike.
from farm.agents.board_harness.board_harness import (  # noqa: F401
    PLAIN_TIMING_TEXT, TIMING_KEYS, BadTiming, parse_timing_line,
)
from farm.agents.harness.task import HarnessOutput, HarnessTask
from farm.agents.harness.tflite_runner import ModelRejected
from farm.agents.sandbox.process_tree import die_with_parent
from farm.proto.sample_limits import MAX_SAMPLES, kept_note, notes_message

OUTPUT_DRAIN_S = 2.0  # after the script exits: how long its output may take to arrive
OUTPUT_BLOCK_BYTES = 1 << 16  # a pipe's whole buffer on Linux
TAIL_LINES = 20  # the script's last lines kept for a failure's message
# A line that is one plain timing and nothing else but JSON's whitespace around it (parse_timing_line's fast case)
PLAIN_LINE = re.compile(r"[ \t\r]*" + PLAIN_TIMING_TEXT + r"[ \t\r]*\Z")


PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> None:
    """Make this process the subreaper of everything the script starts: what the script leaves
    behind is re-parented here (still inside the sandbox's process group, so a timeout kills it)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def end_leftovers() -> str:
    """Kill what the script left running; say what it was (empty when nothing)."""
    try:
        members = psutil.Process().children(recursive=True)
    except psutil.Error:
        return ""
    named = []
    for p in members:
        try:
            named.append(f"{p.name()} (pid {p.pid})")
            p.kill()
        except psutil.Error:
            pass
    for _ in members:  # reap them: they are our children now
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    if not named:
        return ""
    listed = ", ".join(named[:5]) + (" …" if len(named) > 5 else "")
    return (f"the script exited leaving {len(named)} process(es) running: {listed}; they were ended, "
            "and whole_run_s stops at the script's own exit")


class ScriptOutput:
    """What a script printed, read a block of lines at a time: every timing (8 bytes each, not a float object's 32),
    the lines no statistic can use, and the last lines for a failure's message."""

    def __init__(self) -> None:
        self.timings = array("d")
        self.bad: list[str] = []
        self.tail: list[str] = []
        self.lines = 0

    def take(self, lines: list[str]) -> None:
        first, self.lines = self.lines, self.lines + len(lines)
        numbers = [m.group(2) if (m := PLAIN_LINE.match(line)) else None for line in lines]
        if None not in numbers:  # the usual block: nothing but plain timings, read without a JSON parser each
            values = array("d", map(float, numbers))  # type: ignore[arg-type]  # no None, checked above
            if math.isfinite(max(values, default=0.0)):  # 1e400 is inf: the line-by-line path refuses it by name
                self.timings.extend(values)
                self.tail.extend(line.rstrip() for line in lines[-TAIL_LINES:])
                del self.tail[:-TAIL_LINES]
                return
        for number, line in enumerate(lines, start=first + 1):
            try:
                value = parse_timing_line(line)
            except BadTiming as e:
                self.bad.append(f"output line {number}: {e}")
                continue
            if value is not None:
                self.timings.append(value)
            self.tail.append(line.rstrip())
        del self.tail[:-TAIL_LINES]

    def fill(self, out: HarnessOutput) -> None:
        """The run's timings: the first MAX_SAMPLES as they came (what the wire carries of any run: proto/wire.py),
        with the summary of all of them where there were more, and the message that says so."""
        out.iterations_ms = self.timings[:MAX_SAMPLES].tolist()
        if len(self.timings) > MAX_SAMPLES:
            from farm.agents.harness.stats import latency_stats  # numpy: only for a run that printed this many

            out.latency = dataclasses.asdict(latency_stats(self.timings))
            out.message = notes_message(out.message, [kept_note(len(self.timings), "per-iteration timings")])


def run(task: HarnessTask, out: HarnessOutput, rss_now) -> None:
    out.runtime = "script"
    out.baseline_rss_bytes = rss_now()
    output = ScriptOutput()
    t0 = time.perf_counter()

    adopt_orphans()
    try:
        # `python` is farm's own interpreter: started as this harness was, so it works for the run user even
        # where the interpreter's real path lies in a folder that user cannot search.
        executable = "/proc/self/exe" if task.command[0] == sys.executable else None
        proc = subprocess.Popen(task.command, executable=executable, cwd=task.script_dir, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    except FileNotFoundError:
        raise ModelRejected(f"command {task.command[0]!r} was not found on the PATH of the sandbox") from None
    except PermissionError:
        raise ModelRejected(f"command {task.command[0]!r} is not executable") from None
    assert proc.stdout is not None
    stdout = proc.stdout

    def read_output() -> None:
        # A block at a time, not a line at a time: the harness's stdout is unbuffered (the run's log stays live),
        # so a write per line was a system call per line — 2.2 M of them for a script printing 2.2 M timings.
        decoder = codecs.getincrementaldecoder("utf-8")("replace")  # a character cut between blocks stays whole
        fd = stdout.fileno()
        pending: list[str] = []  # the line not yet ended, in pieces: a line with no newline for megabytes is joined once
        while block := os.read(fd, OUTPUT_BLOCK_BYTES):
            text = decoder.decode(block)
            sys.stdout.write(text)  # the user's output stays in the run's log
            if "\n" not in text:
                pending.append(text)
                continue
            lines = text.split("\n")
            lines[0] = "".join(pending) + lines[0]
            pending = [lines.pop()]
            output.take(lines)
        text = decoder.decode(b"", final=True)
        sys.stdout.write(text)
        if last := "".join(pending) + text:
            output.take([last])

    reader = threading.Thread(target=read_output, name="script-output", daemon=True)
    reader.start()
    status = proc.wait()
    out.whole_run_s = time.perf_counter() - t0
    leftovers = end_leftovers()
    reader.join(OUTPUT_DRAIN_S)  # whatever still holds the pipe is dead or not ours: never wait forever
    sys.stdout.flush()
    out.peak_rss_bytes = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    out.message = leftovers
    if status < 0 and status == -9:
        raise MemoryError("the script was killed (SIGKILL), most likely at the memory limit")
    if status != 0:
        last = "\n".join(output.tail[-5:])
        raise ModelRejected(f"the script exited with status {status}; its last output:\n{last}")
    if bad := output.bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise ModelRejected("the script printed timings no statistic can use: " + "; ".join(bad[:3]) + more)
    output.fill(out)
