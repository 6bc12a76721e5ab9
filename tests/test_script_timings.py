"""Script workloads report what the script did: its own run time (not a child's), only
timings a statistic can use, and its output whatever bytes it prints."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from conftest import write_job
from farm.agents.harness.script_runner import BadTiming, parse_timing_line


def _job(tmp_path: Path, tiny_models, script: str, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    os.symlink(tiny_models["tflite"], d / "tiny.tflite")
    (d / "work.py").write_text(script)
    return write_job(d, "models: [tiny.tflite]\nworkload: {type: script, script: work.py}\nsim: {backend: auto}\n")


def test_a_child_that_keeps_stdout_open_does_not_stretch_the_run(tmp_path: Path, tiny_models, farm) -> None:
    script = ("import json, subprocess\n"
              "subprocess.Popen(['sleep', '120'])  # inherits stdout and outlives the script\n"
              "print(json.dumps({'latency_ms': 2.5}))\n")
    run = farm("submit", str(_job(tmp_path, tiny_models, script, "child")), "--json", timeout=60)
    assert run.returncode == 0, run.stderr
    r = run.json()["results"][0]
    assert r["status"] == "completed" and r["latency_ms"]["avg"] == 2.5
    assert r["whole_run_s"] < 5  # the script's own life, not the sleeping child's 120 s
    assert "leaving 1 process(es) running: sleep (pid" in r["message"] and "were ended" in r["message"]


@pytest.mark.parametrize("bad, shown", [("NaN", "nan"), ("1e400", "inf"), ("-5", "-5")])
def test_a_non_finite_or_negative_timing_refuses_the_run_naming_its_line(
        bad: str, shown: str, tmp_path: Path, tiny_models, farm) -> None:
    script = f"print('warming up')\nprint('{{\"latency_ms\": 3.0}}')\nprint('{{\"latency_ms\": {bad}}}')\n"
    run = farm("submit", str(_job(tmp_path, tiny_models, script, f"bad{shown}")), "--json")
    assert run.returncode == 1, run.stderr
    r = run.json()["results"][0]
    assert r["failure_class"] == "job" and r["attempts"] == 1  # the script's output, not bad luck: no retry
    assert "output line 3: latency_ms is" in r["message"] and shown in r["message"]
    assert r["latency_ms"] is None
    assert "Infinity" not in run.stdout and "NaN" not in run.stdout  # the JSON stays JSON


def test_a_0xff_byte_in_the_output_is_replaced_not_a_bug(tmp_path: Path, tiny_models, farm) -> None:
    script = ("import sys\nsys.stdout.buffer.write(b'caf\\xe9 \\xff\\n{\"latency_ms\": 1.25}\\n')\n")
    run = farm("submit", str(_job(tmp_path, tiny_models, script, "byte")), "--json")
    assert run.returncode == 0, run.stderr
    r = run.json()["results"][0]
    assert r["status"] == "completed" and r["failure_class"] is None and r["latency_ms"]["avg"] == 1.25


def test_output_read_in_blocks_keeps_every_line_whole_and_counted(tmp_path: Path, tiny_models, farm,
                                                                  farm_db: Path) -> None:
    """The harness reads a script's output a pipe block at a time: a character and a timing line cut between two
    blocks stay whole, every line is counted, and a last line without its newline still counts."""
    script = ("import sys, time\nout = sys.stdout.buffer\n"
              "def pause(): out.flush(); time.sleep(0.3)\n"
              "out.write(b'{\"latency_ms\": 1.0}\\n' * 30000); pause()\n"
              "out.write(b'x' * 65535 + b'\\xc3'); pause(); out.write(b'\\xa9\\n')\n"  # é cut at a full pipe's end
              "out.write(b'{\"latency_'); pause(); out.write(b'ms\": 2.5}\\n')\n"
              "out.write(b'{\"latency_ms\": -1}')\n")  # line 30,003, no newline: refused, naming it
    run = farm("submit", str(_job(tmp_path, tiny_models, script, "blocks")), "--json")
    assert run.returncode == 1, run.stderr
    r = run.json()["results"][0]
    assert r["failure_class"] == "job" and "output line 30003: latency_ms is -1" in r["message"], r["message"]
    with sqlite3.connect(farm_db) as db:  # the failed run's output tail, as stored
        (tail,) = db.execute("SELECT log_tail FROM runs WHERE status = 'failed'").fetchone()
    assert "xé" in tail and "\ufffd" not in tail and '{"latency_ms": 2.5}' in tail
    run = farm("submit", str(_job(tmp_path, tiny_models, script.replace("-1}", "4.0}"), "blocks-ok")), "--json")
    assert run.returncode == 0, run.stderr
    r = run.json()["results"][0]
    assert r["status"] == "completed" and r["latency_ms"]["count"] == 30002
    assert r["latency_ms"]["max"] == 4.0 and r["latency_ms"]["p50"] == 1.0


def test_a_line_of_megabytes_without_a_newline_is_one_line(tmp_path: Path, tiny_models, farm) -> None:
    """A script writing 8 MB with no newline (128 pipe blocks) and then a timing: one output line, then the timing on
    line 2 — the unended line is kept in pieces and joined once, never re-joined per block."""
    script = ("import sys\nout = sys.stdout.buffer\nfor _ in range(128): out.write(b'y' * 65536); out.flush()\n"
              "out.write(b'\\n{\"latency_ms\": -2}\\n')\n")
    run = farm("submit", str(_job(tmp_path, tiny_models, script, "long")), "--json")
    assert run.returncode == 1, run.stderr
    r = run.json()["results"][0]
    assert "output line 2: latency_ms is -2" in r["message"], r["message"]


def test_timing_lines_parse_as_documented() -> None:
    assert parse_timing_line('{"latency_ms": 12.3}') == 12.3
    assert parse_timing_line('{"inference_ms": 0}') == 0.0
    assert parse_timing_line("latency 12 ms") is None and parse_timing_line('{"latency_ms": true}') is None
    for bad in ('{"latency_ms": NaN}', '{"latency_ms": Infinity}', '{"latency_ms": 1e400}', '{"latency_ms": -0.5}'):
        with pytest.raises(BadTiming):
            parse_timing_line(bad)



@pytest.mark.parametrize("returncode, how", [(-9, "by signal 9 (SIGKILL)"), (None, "with no exit status")])
def test_a_harness_ended_from_outside_is_infrastructure(tmp_path: Path, returncode, how: str) -> None:
    """Issues 32/33: a harness ended from outside before it wrote a result (a host's OOM killer, a zygote killed
    mid-run) is infrastructure, so the run is tried again; only a harness that exited by itself without a result is
    farm's bug. (A run's own script cannot do this: the harness is its PID namespace's init, which ignores SIGKILL.)"""
    from farm.agents.sandbox.base import Budget, ExitInfo, IoTotals
    from farm.agents.sim.driver import SimDriver
    from farm.proto.tasks import TaskPlan, TaskSpec

    task = TaskSpec(task_id=1, job_id=1, attempt=1, target="sim", model_name="m", model_path="/m.onnx",
                    model_sha256="0" * 64, model_family=None, threads=1, batch_size=1, input_size=None, repeat=0,
                    plan=TaskPlan(workload={"type": "benchmark"}, sim={}, run_timeout_s=60, base_dir="/"))

    def classify(code):
        exit_info = ExitInfo(returncode=code, oom_killed=False, timed_out=False, canceled=False, output="last words",
                             wall_s=1.0, peak_memory_bytes=None, peak_memory_source=None, io=IoTotals())
        return SimDriver(tmp_path)._classify(task, Budget(), exit_info, None)
    killed = classify(returncode)
    assert killed.failure_class == "infrastructure" and how in killed.message and "tried again" in killed.message
    assert classify(1).failure_class == "bug"  # it ended by itself without a result: farm's own bug


def test_an_integer_too_large_for_a_float_is_a_bad_timing_not_a_dead_reader() -> None:
    """A 400-digit integer overflowed float() inside the check (OverflowError, not BadTiming): it ended the thread
    reading the script's output, so the run hung on a full pipe until its timeout."""
    with pytest.raises(BadTiming, match="latency_ms is inf"):
        parse_timing_line('{"latency_ms": ' + "9" * 400 + "}")
    assert parse_timing_line('{"latency_ms": 1' + "0" * 299 + "}") == 1e299


def test_a_flood_of_timings_keeps_the_first_hundred_thousand_and_summarises_all() -> None:
    """Script mode keeps no more timings than the wire carries (proto/sample_limits.MAX_SAMPLES) from the lines it
    reads, with the summary of all of them and the message the wire gave before; plain lines, lines json.loads reads
    and a bad line past the cut are each read by the same rule."""
    import dataclasses

    from farm.agents.harness.script_runner import ScriptOutput
    from farm.agents.harness.stats import latency_stats
    from farm.agents.harness.task import HarnessOutput
    from farm.agents.sim.driver import run_summary
    from farm.proto.sample_limits import MAX_SAMPLES

    values = [float(i % 997) for i in range(MAX_SAMPLES + 50_000)]  # past the cut the figures differ from the first
    lines = [f'{{"latency_ms": {v}}}' for v in values]
    lines[7] = f' {{"latency_ms": {values[7]}, "step": 7}}\r'  # json.loads's path, in the middle of plain ones
    lines.insert(3, "warming up")
    output = ScriptOutput()
    for start in range(0, len(lines), 3000):
        output.take(lines[start:start + 3000])
    assert output.bad == [] and output.lines == len(values) + 1 and output.tail[-1] == lines[-1]
    out = HarnessOutput(ok=True, message="the script exited leaving 1 process(es) running")
    output.fill(out)
    assert out.iterations_ms == values[:MAX_SAMPLES]
    assert out.message == (f"the script exited leaving 1 process(es) running; kept the first {MAX_SAMPLES} of "
                           f"{len(values)} per-iteration timings (the summary covers them all)")
    assert run_summary(out) == latency_stats(values) and run_summary(out).count == len(values)

    output.take(['{"latency_ms": 1.0}', '{"latency_ms": 1e400}'])  # a bad line past the cut still refuses the run
    assert output.bad == [f"output line {len(values) + 3}: latency_ms is inf; a timing must be a finite number of "
                          "milliseconds >= 0"]
    few = ScriptOutput()
    few.take(['{"latency_ms": 2.0}', '{"latency_ms": 4.0}'])
    fewer = HarnessOutput(ok=True)
    few.fill(fewer)
    assert (fewer.iterations_ms, fewer.latency, fewer.message) == ([2.0, 4.0], None, "")
    assert run_summary(fewer) == latency_stats([2.0, 4.0])

    lying = dataclasses.asdict(latency_stats(values))
    for field, value, words in [("count", MAX_SAMPLES, "not more than the 100000 timings it kept"),
                                ("p99", float("nan"), "p99 is nan"), ("avg", "1.0", "avg is '1.0'"),
                                ("max", -1.0, "max is -1.0"), ("extra", 1.0, "not an object of exactly")]:
        with pytest.raises(ValueError, match=words):
            run_summary(dataclasses.replace(out, latency={**lying, field: value}))
