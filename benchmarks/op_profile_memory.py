"""The memory of an op profile on a SLANet-class model (an ONNX Loop whose body runs thousands of times
a run), before and after issue 30 item 5: "before" traces 20 runs and parses the whole trace text at
once (what the sim did), "after" is the harness's bounded pass (agents/harness/onnx_runner.profile_ops),
"none" is the same 20 runs unprofiled. Each mode runs in its own process; peak RSS is ru_maxrss.

Usage: python benchmarks/op_profile_memory.py [--trips 5000]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from farm.model_generators.control_flow import write_loop_onnx

SIZE = 16


def loop_model(path: Path, trips: int) -> Path:
    return write_loop_onnx(path, trips, SIZE)


def one(mode: str, model: Path) -> None:
    from farm.agents.harness.onnx_runner import profile_ops
    from farm.agents.harness.onnxruntime_profile import ort_op_profile
    from farm.agents.harness.task import HarnessOutput, HarnessTask
    from farm.models.runtimes import onnx_session

    feeds = {"x": np.ones((1, SIZE), np.float32)}
    t0 = time.perf_counter()
    note = ""
    if mode == "none":
        session = onnx_session(str(model), threads=1)
        for _ in range(20):
            session.run(None, feeds)
    elif mode == "before":
        with tempfile.TemporaryDirectory() as folder:
            session = onnx_session(str(model), threads=1, profile_prefix=folder + "/ops")
            for _ in range(20):
                session.run(None, feeds)
            trace = Path(session.end_profiling())
            note = f"trace of 20 runs {trace.stat().st_size / 2**20:.1f} MiB"
            ort_op_profile(trace.read_text())
    else:
        out = HarnessOutput(ok=True)
        profile_ops(HarnessTask(kind="benchmark", model_path=str(model), iterations=20, op_profiling=True), feeds, out)
        note = out.op_profile_note
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"| {mode} | {peak:.0f} | {time.perf_counter() - t0:.1f} | {note} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trips", type=int, default=5000)
    parser.add_argument("--mode", choices=("none", "before", "after"))
    parser.add_argument("--model")
    args = parser.parse_args()
    if args.mode:
        one(args.mode, Path(args.model))
        return
    with tempfile.TemporaryDirectory() as work:
        model = loop_model(Path(work) / "loop.onnx", args.trips)
        print(f"Loop model, {args.trips} trips a run\n\n| mode | peak RSS MiB | s | note |\n|---|---|---|---|")
        for mode in ("none", "before", "after"):
            subprocess.run([sys.executable, __file__, "--mode", mode, "--model", str(model)], check=True)


if __name__ == "__main__":
    main()
