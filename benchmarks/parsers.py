"""Parser throughput on large accelerator-tool outputs (issue 29): trtexec with a long --dumpProfile table, hours of
nvidia-smi rows, and benchmark_model delegate lines, each beside a bare loop over the same lines (the ceiling: split
the text and touch each line) in the same run.

The outputs are real captured lines (tests/fixtures/trtexec, tests/fixtures/nvidia_smi, tests/fixtures/benchmark_model),
repeated to size. Run: python benchmarks/parsers.py [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from farm.agents.parsers.nvidia_smi import parse_query_output
from farm.agents.parsers.tflite_delegates import parse_delegation
from farm.agents.parsers.trtexec import parse_trtexec

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"


def captured(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines()
            if not line.startswith("#") and line.strip() not in ("…", "") and not line.startswith("timestamp")]


def best_of(fn, text: str, rounds: int = 5) -> float:
    times = []
    for _ in range(rounds):
        start = time.process_time()
        fn(text)
        times.append(time.process_time() - start)
    return min(times)


def bare(text: str) -> int:
    return sum(1 for line in text.splitlines() if line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    profile_rows = [line for line in captured(FIXTURES / "trtexec" / "p1_profile_xavier_nx_8502.txt")
                    if "   " in line and "Total" not in line and "Layer" not in line]
    summary = captured(FIXTURES / "trtexec" / "t1_orin_nano_8502.txt")
    trtexec = "\n".join(summary[:-1] + ["[10/21/2025-15:16:16] [I] === Profile (309 iterations ) ==="]
                        + profile_rows * (20_000 // len(profile_rows)) + ["", summary[-1]])
    rows = [line.split(", ") for line in captured(FIXTURES / "nvidia_smi" / "query_rows_590.txt")]
    smi_rows = [", ".join([r[0], *r[2:], r[1]]) for r in rows]
    smi = "\n".join(smi_rows * 50_000)  # 100,000 rows: 10,000 s of 100 ms samples
    delegates = "\n".join(captured(FIXTURES / "benchmark_model" / "delegates" / "gpu_partial_logcat.txt") * 25_000)
    results = []
    for name, fn, text in (("trtexec, 20k-layer profile", parse_trtexec, trtexec),
                           ("nvidia-smi, 100k rows", parse_query_output, smi),
                           ("delegate lines, 100k", parse_delegation, delegates)):
        lines = text.count("\n") + 1
        cpu_s, ceiling_s = best_of(fn, text), best_of(bare, text)
        results.append({"output": name, "lines": lines, "mb": round(len(text) / 1e6, 2),
                        "cpu_s": round(cpu_s, 4), "lines_per_s": round(lines / cpu_s),
                        "mb_per_s": round(len(text) / 1e6 / cpu_s, 1), "bare_loop_cpu_s": round(ceiling_s, 4),
                        "x_bare_loop": round(cpu_s / ceiling_s, 1)})
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{'output':30} {'lines':>8} {'MB':>6} {'CPU s':>8} {'lines/s':>10} {'MB/s':>7} {'bare s':>8} {'x bare':>7}")
    for r in results:
        print(f"{r['output']:30} {r['lines']:>8} {r['mb']:>6} {r['cpu_s']:>8} {r['lines_per_s']:>10} {r['mb_per_s']:>7} "
              f"{r['bare_loop_cpu_s']:>8} {r['x_bare_loop']:>7}")


if __name__ == "__main__":
    main()
