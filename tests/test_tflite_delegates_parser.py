"""benchmark_model's delegate lines (agents/parsers/tflite_delegates.py) on real captured output
(tests/fixtures/benchmark_model/delegates/, each file names its source)."""

from __future__ import annotations

from pathlib import Path

import pytest

from farm.agents.parsers.tflite_delegates import parse_delegation

FIXTURES = Path(__file__).parent / "fixtures" / "benchmark_model" / "delegates"


def captured(name: str) -> str:
    return "\n".join(line for line in (FIXTURES / name).read_text().splitlines() if not line.startswith("#"))


@pytest.mark.parametrize("name, delegate, verdict, nodes, on_cpu", [
    ("gpu_complete.txt", "GPU", "complete", (None, None), False),
    ("gpu_partial_logcat.txt", "GPU", "partial", (None, None), False),
    ("nnapi_none.txt", "NNAPI", "none", (None, None), True),
    ("hexagon_partial.txt", "Hexagon", "partial", (34, 36), False),
    ("hexagon_failed.txt", None, "failed", (125, 125), True),  # "125 of 125 delegated", then the failure
    ("qnn_none.txt", "EXTERNAL", "none", (0, 31), True),
])
def test_captured_delegations(name: str, delegate: str | None, verdict: str, nodes: tuple, on_cpu: bool) -> None:
    d = parse_delegation(captured(name))
    assert (d.delegate, d.verdict, (d.delegated_nodes, d.total_nodes), d.on_cpu_entirely) == (delegate, verdict, nodes, on_cpu)


def test_the_gpu_delegates_rejected_ops_are_named() -> None:
    d = parse_delegation(captured("gpu_partial_logcat.txt"))
    assert d.unsupported_ops == ["UNPACK: Operation is not supported."]
    assert "rest ran on the CPU" in d.note() and "UNPACK" in d.note()


def test_xnnpack_alone_is_no_delegation() -> None:
    d = parse_delegation("INFO: Created TensorFlow Lite XNNPACK delegate for CPU.\n"
                         "VERBOSE: Replacing 60 out of 64 node(s) with delegate (TfLiteXNNPackDelegate) node, "
                         "yielding 3 partitions for the whole graph.")
    assert d.delegate is None and d.verdict is None


@pytest.mark.parametrize("line, verdict, nodes", [
    ("Applied GPU delegate, and the model graph will be completely executed w/ the delegate.", "complete", None),
    ("Explicitly applied GPU delegate, and the model graph will be partially executed by the delegate w/ 3 delegate "
     "kernels.", "partial", None),
    ("INFO: Replacing 12 out of 40 node(s) with delegate (TfLiteGpuDelegateV2) node, yielding 2 partitions for "
     "subgraph 0 (main).", "partial", 12),
    ("ERROR: 294 operations will run on the GPU, and the remaining 2 operations will run on the CPU.", "partial", 294),
    ("Disallowed CPU fallback detected.", "failed", None),
])
def test_wordings_of_every_release(line: str, verdict: str, nodes: int | None) -> None:
    d = parse_delegation(line)
    assert d.verdict == verdict and d.delegated_nodes == nodes
