"""Entry point inside the sandbox: `python -m farm.agents.harness TASK.json OUT`.

OUT is `fd:N` where the agent opened the result's channel before the run started (an anonymous file it handed
down as descriptor N; the sim's process and cgroup backends, cold and warm), else a file path (a container, a
board), which the agent reads as hostile.

Keeps its own imports light until the task says which runtime to load, so the memory
baseline is the runtime, not farm.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
import traceback
from pathlib import Path

from farm.agents.harness.memory import status_kib as _status_kib
from farm.agents.harness.task import HarnessOutput, HarnessTask


def rss_now() -> int | None:
    return _status_kib("VmRSS")


def main(argv: list[str]) -> int:
    task_path, destination = Path(argv[0]), argv[1]
    result_fd = int(destination[3:]) if destination.startswith("fd:") else None
    if result_fd is not None:
        os.set_inheritable(result_fd, False)  # the harness's alone: a script it starts never holds it
    task = HarnessTask.read(task_path)
    out = HarnessOutput(ok=False)
    out.tool_versions["python"] = platform.python_version()
    from farm.agents.harness.tflite_runner import ModelRejected
    from farm.agents.harness.inputs import InputShapeError

    try:
        # only the runtime the task needs is imported: each is slow to load
        if task.kind == "script":
            runner = importlib.import_module("farm.agents.harness.script_runner")
        elif task.model_path.lower().endswith(".tflite"):
            runner = importlib.import_module("farm.agents.harness.tflite_runner")
        elif task.model_path.lower().endswith(".onnx"):
            runner = importlib.import_module("farm.agents.harness.onnx_runner")
        else:
            raise ModelRejected(f"{task.model_path}: the built-in benchmark runs .tflite and .onnx files only")
        runner.run(task, out, rss_now)
        out.ok = True
    except MemoryError as e:
        out.failure_class, out.message = "resource", f"out of memory: {e}" if str(e) else "out of memory (MemoryError)"
    except (ModelRejected, InputShapeError) as e:
        out.failure_class, out.message = "job", str(e)
    except Exception:
        out.failure_class, out.message = "bug", "the harness failed:\n" + traceback.format_exc(limit=8)
    if task.kind != "script" and out.peak_rss_bytes is None:  # a runner that profiles ops took it before that pass
        out.peak_rss_bytes = _status_kib("VmHWM")
    if result_fd is not None:
        out.write_fd(result_fd)
    else:
        out.write(Path(destination))
    return 0 if out.ok else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
