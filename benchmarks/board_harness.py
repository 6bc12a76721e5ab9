"""The one-file board harness against farm's own harness, and what a board run costs around the script.

    .venv/bin/python benchmarks/board_harness.py [--rounds 5] [--iterations 200]

1. Fidelity: the same model's per-inference p50 through the board harness (what boards run now)
   and through `python -m farm.agents.harness` (what they ran before), interleaved rounds, one
   thread, bare processes on this machine. A ratio near 1 means the switch keeps a board's
   calibration history comparable.
2. Overhead: a script that does nothing but print one timing line, run through the jetson driver
   on the ssh test peer (Debian sshd on loopback, fake tegrastats): wall time of the whole driver
   run minus the script's own whole_run_s, on the first run (harness and folder uploaded) and on
   later ones (everything cached by hash).

Needs root (the test sshd); uses tests/sshd_peer.py, the peer the tests use.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from farm.agents.boards.driver import BoardDeviceConfig, BoardDriver  # noqa: E402
from farm.agents.board_harness import HARNESS_FILE  # noqa: E402
from farm.agents.harness.task import HarnessTask  # noqa: E402
from farm.agents.boards.harness_output import parse_harness_output  # noqa: E402
from farm.model_generators.generate import generate_examples  # noqa: E402
from farm.proto.tasks import TaskPlan, TaskSpec  # noqa: E402
from sshd_peer import sshd_peer  # noqa: E402


def p50_board(model: Path, iterations: int, work: Path) -> float:
    task = {"protocol": 1, "kind": "benchmark", "model_path": str(model), "threads": 1, "batch_size": 1,
            "input_size": None, "iterations": iterations, "warmup": 5, "input_shapes": {}, "use_xnnpack": True,
            "seed": 0}
    (work / "board-task.json").write_text(json.dumps(task))
    out = subprocess.run([sys.executable, str(HARNESS_FILE), "run", str(work / "board-task.json")],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return statistics.median(parse_harness_output(out.stdout).iterations_ms)


def p50_farm(model: Path, iterations: int, work: Path) -> float:
    HarnessTask(kind="benchmark", model_path=str(model), threads=1, iterations=iterations, warmup=5).write(
        work / "farm-task.json")
    subprocess.run([sys.executable, "-m", "farm.agents.harness", str(work / "farm-task.json"),
                    str(work / "farm-out.json")], check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return statistics.median(json.loads((work / "farm-out.json").read_text())["iterations_ms"])


def overhead(peer, work: Path, runs: int) -> list[float]:
    script_dir = work / "noop"
    script_dir.mkdir(exist_ok=True)
    (script_dir / "noop.py").write_text("print('{\"latency_ms\": 1.0}')\n")
    model = next(work.glob("models/*.tflite"))
    config = BoardDeviceConfig(name="peer", kind="jetson", host=peer.host, port=peer.port, username=peer.username,
                               key_path=peer.client_key, known_hosts=peer.known_hosts, python=sys.executable,
                               remote_dir=str(work / "board"), sample_interval_ms=100,
                               nv_tegra_release=str(peer.fake_bin / "nv_tegra_release"),
                               device_tree_model=str(peer.fake_bin / "device_tree_model"))
    driver = BoardDriver(config)
    costs = []
    for i in range(runs):
        task = TaskSpec(task_id=i, job_id=1, attempt=1, target="peer", model_name="m", model_path=str(model),
                        model_sha256=hashlib.sha256(Path(model).read_bytes()).hexdigest(), model_family=None, threads=1, batch_size=1, input_size=None, repeat=0,
                        plan=TaskPlan(workload={"type": "script", "command": "python", "script": "noop.py", "args": [],
                                  "dir": "noop", "pip_requirements": []},
                        sim={}, run_timeout_s=60, base_dir=str(work)))
        t0 = time.monotonic()
        result = driver.run(task, lambda: False)
        total = time.monotonic() - t0
        assert result.ok, result.message
        costs.append(total - result.whole_run_s)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--overhead-runs", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="farm-bench-board-") as tmp:
        work = Path(tmp)
        models = generate_examples(work / "models", widths=[1.0], input_sizes=[96], zoo=False)
        print(f"# board harness vs farm harness — {platform.node()}, {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores, Python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M')}")
        print(f"\n{args.rounds} interleaved rounds, {args.iterations} iterations, 1 thread\n")
        print("| model | board harness p50 ms | farm harness p50 ms | board / farm |\n|---|---|---|---|")
        for m in models:
            board, farm = [], []
            for _ in range(args.rounds):
                board.append(p50_board(m.path, args.iterations, work))
                farm.append(p50_farm(m.path, args.iterations, work))
            b, f = statistics.median(board), statistics.median(farm)
            print(f"| {m.path.name} | {b:.3f} | {f:.3f} | {b / f:.3f} |")
        with sshd_peer() as peer:
            costs = overhead(peer, work, args.overhead_runs)
        print("\nper-run cost around a no-op script on the ssh peer (driver wall − whole_run_s), s: "
              f"first {costs[0]:.2f}; later runs median {statistics.median(costs[1:]):.2f} "
              f"(min {min(costs[1:]):.2f}, max {max(costs[1:]):.2f})")


if __name__ == "__main__":
    main()
