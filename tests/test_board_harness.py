"""The board harness is one file a Jetson's own Python 3.6 can run, and what it prints is checked
before the agent believes it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from farm.agents.board_harness import HARNESS_FILE
from farm.agents.board_harness import board_harness
from farm.agents.harness import script_runner
from farm.agents.boards.harness_output import HarnessOutputError, parse_env_output, parse_harness_output
from farm.models.runtimes import InputShapeError, resolve_shape


def test_the_harness_file_runs_on_python_36() -> None:
    vermin = shutil.which("vermin") or str(Path(sys.executable).with_name("vermin"))
    run = subprocess.run([vermin, "--target=3.6-", "--no-tips", "--violations", "--eval-annotations",
                          str(HARNESS_FILE)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_harness_imports_nothing_but_the_standard_library_at_its_top() -> None:
    # the runtimes (numpy, tflite_runtime, onnxruntime) are imported only by the benchmark that needs them
    code = (f"import sys; sys.path.insert(0, {str(HARNESS_FILE.parent)!r}); import board_harness; "
            "bad = [m for m in ('numpy', 'onnxruntime', 'farm', 'psutil', 'ai_edge_litert') if m in sys.modules]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_the_sim_and_the_board_read_timing_lines_by_one_rule() -> None:
    assert script_runner.parse_timing_line is board_harness.parse_timing_line
    assert script_runner.BadTiming is board_harness.BadTiming


@pytest.mark.parametrize("declared, layout, batch, size, overrides", [
    ([1, 224, 224, 3], "nhwc", 1, None, {}),
    ([-1, 224, 224, 3], "nhwc", 4, 160, {}),
    ([None, 3, None, None], "nchw", 2, 96, {}),
    ([None, 3, None, None], "nchw", 2, None, {"x": [3, 3, 64, 64]}),
    (["N", 3, None, None], "nchw", 4, None, {"x": [1, 3, 64, 64]}),
    ([2, 1, 128], "nchw", 1, None, {"x": [2, 1, 128]}),
    ([None, 128], "nchw", 8, 32, {}),
    ([None, None], "nchw", 1, None, {}),
    ([1, 2, 3], "nhwc", 1, None, {"x": [1, 2]}),
])
def test_the_board_fills_input_shapes_as_the_sim_does(declared, layout, batch, size, overrides) -> None:
    def outcome(fn, error):
        try:
            return fn("x", declared, layout=layout, batch_size=batch, input_size=size, overrides=overrides)
        except error as e:
            return ("refused", str(e))

    def board(name, declared, **kw):
        return board_harness.resolve_shape(name, declared, kw["layout"], kw["batch_size"], kw["input_size"],
                                           kw["overrides"])
    assert outcome(board, board_harness.JobError) == outcome(resolve_shape, InputShapeError)


def _line(**fields) -> str:
    data = {"protocol": board_harness.PROTOCOL, "ok": True, "iterations_ms": [1.0, 2.0]}
    data.update(fields)
    return "runtime chatter\n" + board_harness.RESULT_MARK + json.dumps(data) + "\n"


def test_the_result_line_is_found_after_anything_else_printed() -> None:
    out = parse_harness_output(_line(whole_run_s=3.5, peak_rss_bytes=1 << 20))
    assert out.ok and out.iterations_ms == [1.0, 2.0] and out.whole_run_s == 3.5 and out.peak_rss_bytes == 1 << 20


@pytest.mark.parametrize("text, words", [
    ("Traceback (most recent call last):\n  ...\n", "no result line"),
    (_line(iterations_ms=[1.0, float("nan")]), "finite"),
    (_line(iterations_ms=[1.0, -3]), "finite"),
    (_line(whole_run_s="soon"), "whole_run_s"),
    (_line(peak_rss_bytes=True), "peak_rss_bytes"),
    (_line(ok=False, failure_class="pwned"), "unknown failure class"),
    (_line(ok="yes"), "ok: true/false"),
    (_line(protocol=99), "protocol 99"),
    (_line(input_shapes={"x": ["a"]}), "input_shapes"),
    (_line(iterations_ms=[1.0] * 200_001), "at most"),
    (board_harness.RESULT_MARK + "{not json\n", "not JSON"),
    (board_harness.RESULT_MARK + "[1, 2]\n", "not a JSON object"),
])
def test_a_broken_or_lying_result_line_is_refused(text: str, words: str) -> None:
    with pytest.raises(HarnessOutputError, match=words):
        parse_harness_output(text)


def test_a_long_message_from_the_board_is_cut() -> None:
    out = parse_harness_output(_line(ok=False, failure_class="job", message="x" * 100_000))
    assert not out.ok and out.failure_class == "job" and len(out.message) == 8000


def test_the_env_result_must_name_an_absolute_interpreter() -> None:
    good = board_harness.RESULT_MARK + json.dumps({"protocol": 1, "ok": True, "python": "/tmp/v/bin/python"})
    assert parse_env_output(good).python == "/tmp/v/bin/python"
    with pytest.raises(HarnessOutputError, match="interpreter"):
        parse_env_output(board_harness.RESULT_MARK + json.dumps({"protocol": 1, "ok": True, "python": "rm -rf /"}))


def test_the_harness_refuses_an_archive_that_links_out(tmp_path: Path) -> None:
    import tarfile
    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tar:
        link = tarfile.TarInfo("data")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    task = {"protocol": 1, "kind": "script", "model_path": "m.tflite", "threads": 1, "command": ["true"],
            "script_dir": str(tmp_path / "run" / "script"), "archive": str(archive)}
    (tmp_path / "task.json").write_text(json.dumps(task))
    run = subprocess.run([sys.executable, str(HARNESS_FILE), "run", str(tmp_path / "task.json")],
                         capture_output=True, text=True)
    out = parse_harness_output(run.stdout)
    assert out.failure_class == "job" and "'data' is a link" in out.message
    assert not (tmp_path / "run" / "script" / "data").exists()


def _run_script_locally(tmp_path: Path, script: str) -> object:
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "w.py").write_text(script)
    task = {"protocol": 1, "kind": "script", "model_path": "m.tflite", "threads": 1,
            "command": [sys.executable, str(tmp_path / "s" / "w.py")], "script_dir": str(tmp_path / "s"),
            "timeout_s": 60, "sample_interval_ms": 20}
    (tmp_path / "task.json").write_text(json.dumps(task))
    run = subprocess.run([sys.executable, str(HARNESS_FILE), "run", str(tmp_path / "task.json")],
                         capture_output=True, text=True)
    return parse_harness_output(run.stdout)


def test_a_last_timing_line_without_its_newline_counts(tmp_path: Path) -> None:
    out = _run_script_locally(tmp_path, "import sys\nsys.stdout.write('{\"latency_ms\": 1}\\n{\"latency_ms\": 2}')\n")
    assert out.ok and out.iterations_ms == [1.0, 2.0]


def test_bad_timings_refuse_the_run_naming_the_line_as_the_sim_does(tmp_path: Path) -> None:
    out = _run_script_locally(tmp_path, "print('warming up')\nprint('{\"latency_ms\": 3}')\nprint('{\"latency_ms\": NaN}')\n")
    assert out.failure_class == "job" and "output line 3: latency_ms is nan" in out.message


def test_a_child_that_leaves_the_scripts_group_is_still_ended_and_named(tmp_path: Path) -> None:
    import psutil
    marker = f"farm-escapee-{tmp_path.name}"
    out = _run_script_locally(tmp_path, "import json, subprocess, sys\n"
                                        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', "
                                        f"'{marker}'], start_new_session=True)\n"
                                        "print(json.dumps({'latency_ms': 1}))\n")
    assert out.ok and out.iterations_ms == [1.0]
    assert "leaving 1 process(es) running" in out.message and "were ended" in out.message
    assert not [p for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]


# --- a hostile board (issue 18, N9): bounded, strict, escaped -----------------------------------

def test_a_result_nested_100000_deep_is_refused_without_recursion() -> None:
    deep = board_harness.RESULT_MARK + '{"protocol": 1, "ok": true, "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    with pytest.raises(HarnessOutputError, match="nests deeper than"):
        parse_harness_output(deep)
    # brackets inside strings are text, not nesting
    assert parse_harness_output(_line(message="[" * 10_000)).message == "[" * 8000


def test_a_forged_result_line_after_the_real_one_is_refused() -> None:
    forged = _line(iterations_ms=[1.0, 2.0]) + board_harness.RESULT_MARK + json.dumps(
        {"protocol": 1, "ok": True, "iterations_ms": [0.001]}) + "\n"
    with pytest.raises(HarnessOutputError, match="2 result lines.*forged"):
        parse_harness_output(forged)
    with pytest.raises(HarnessOutputError, match="2 result lines"):  # before it, too
        parse_harness_output(board_harness.RESULT_MARK + "{}\n" + _line())


def test_a_key_given_twice_is_refused() -> None:
    line = _line().rstrip("\n")[:-1] + ', "ok": false, "failure_class": "job"}\n'
    with pytest.raises(HarnessOutputError, match="names ok twice"):
        parse_harness_output(line)


@pytest.mark.parametrize("fields, words", [
    ({"iterations_ms": [1.0, 1e300]}, "finite numbers from 0"),
    ({"peak_rss_bytes": 10 ** 300}, "peak_rss_bytes"),
    ({"whole_run_s": 1e12}, "whole_run_s"),
    ({"input_shapes": {"x": [10 ** 30]}}, "input_shapes"),
])
def test_numbers_out_of_range_are_refused(fields: dict, words: str) -> None:
    with pytest.raises(HarnessOutputError, match=words):
        parse_harness_output(_line(**fields))


def test_control_characters_from_the_board_are_escaped() -> None:
    out = parse_harness_output(_line(ok=False, failure_class="job", message="bad\x1b[2J\x07 model\nline two\u202e",
                                     tool_versions={"rt\x1b": "1.0\r\n"}, leftovers=["sleep\x1b[31m"]))
    assert out.message == "bad\\x1b[2J\\x07 model\nline two\\u202e"  # line breaks kept, the rest shown
    assert out.tool_versions == {"rt\\x1b": "1.0\\r\\n"} and out.leftovers == ["sleep\\x1b[31m"]
    with pytest.raises(HarnessOutputError, match="interpreter"):
        parse_env_output(board_harness.RESULT_MARK + json.dumps({"protocol": 1, "ok": True, "python": "/bin/py\nrm"}))
