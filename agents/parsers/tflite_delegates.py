"""Which part of a model a TFLite delegate took, from what `benchmark_model` prints (issue 29), as a pure function.

Delegate success is not one line (shared/reference/accelerator_tools.md §3): "delegate created", the partition or
"nodes delegated" line, the benchmark's verdict ("completely / partially / will not be executed by the delegate"),
and no `Failed to apply` after them — "N nodes delegated" can come before a failure. Lines may carry `INFO: `,
`VERBOSE: `, `ERROR: ` or a logcat prefix; wording changed across releases, so each pattern is loose.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_CREATED = re.compile(r"(?:Created TensorFlow Lite delegate for (\w+)\.|\b(GPU|NNAPI|Hexagon|EXTERNAL) delegate created\.)")
_VERDICT = re.compile(r"(?:Explicitly )?[Aa]pplied (\w+) delegate, and the model graph will be (completely|partially) "
                      r"executed(?: by the delegate| w/ the delegate)?(?: w/ (\d+) delegate kernels)?")
_NOT_EXECUTED = re.compile(r"Though (\w+) delegate is explicitly applied, the model graph will not be executed")
_REPLACING = re.compile(r"Replacing (\d+)(?: out of (\d+))? node\(s\) with delegate \((\w+)\) node, yielding (\d+) partitions")
_DELEGATED = re.compile(r"(\w+) delegate: (\d+) nodes delegated out of (\d+) nodes with (\d+) partitions")
_GPU_SPLIT = re.compile(r"(\d+) operations will run on the GPU, and the remaining (\d+) operations? will run on the CPU")
_UNSUPPORTED = re.compile(r"^([A-Z0-9_]+): (.+)$")
_FAILED = re.compile(r"Failed to apply (\w+) delegate|Restored original execution plan after delegate application failure"
                     r"|Disallowed CPU fallback detected")
_PREFIX = re.compile(r"^(?:\d\d-\d\d \d\d:\d\d:\d\d\.\d+\s+\d+\s+\d+ [VDIWEF] [\w.]+\s*: |(?:INFO|VERBOSE|WARNING|ERROR): )")


@dataclass
class Delegation:
    delegate: str | None = None  # as the tool names it: GPU, NNAPI, Hexagon, EXTERNAL
    verdict: str | None = None  # "complete" | "partial" | "none" | "failed"; None when the tool said nothing
    delegated_nodes: int | None = None
    total_nodes: int | None = None
    partitions: int | None = None
    unsupported_ops: list[str] = field(default_factory=list)  # "UNPACK: Operation is not supported."

    @property
    def on_cpu_entirely(self) -> bool:
        """The run measured the CPU, whatever was asked: the delegate took nothing, or failed to apply."""
        return self.verdict in ("none", "failed") or (self.delegated_nodes == 0 and self.verdict != "complete")

    def note(self) -> str:
        share = (f"{self.delegated_nodes} of {self.total_nodes} nodes" if self.delegated_nodes is not None
                 and self.total_nodes else None)
        if self.verdict == "complete":
            return f"the {self.delegate} delegate ran the whole graph" + (f" ({share})" if share else "")
        if self.verdict == "partial":
            return (f"the {self.delegate} delegate ran part of the graph" + (f" ({share})" if share else "")
                    + "; the rest ran on the CPU" + (f" (not supported: {', '.join(self.unsupported_ops[:5])})"
                                                    if self.unsupported_ops else ""))
        if self.verdict == "failed":
            return f"the {self.delegate or 'requested'} delegate failed to apply; the graph ran on the CPU"
        if self.verdict == "none":
            return f"the {self.delegate} delegate took none of the graph" + (f" ({share})" if share else "")
        return "the tool said nothing of a delegate"

    def as_environment(self) -> dict:
        return {"delegate": self.delegate, "verdict": self.verdict, "delegated_nodes": self.delegated_nodes,
                "total_nodes": self.total_nodes, "partitions": self.partitions,
                "unsupported_ops": self.unsupported_ops[:20]}


def parse_delegation(text: str) -> Delegation:
    """What the output says of the (non-XNNPACK) delegate a run asked for."""
    d = Delegation()
    in_unsupported = False
    for raw in text.splitlines():
        line = _PREFIX.sub("", raw.strip())
        if in_unsupported:
            m = _UNSUPPORTED.match(line)
            if m and "operations will run on" not in line:
                d.unsupported_ops.append(line[:120])
                continue
            in_unsupported = False
        if "Following operations are not supported by" in line:
            in_unsupported = True
            continue
        if (m := _CREATED.search(line)) and (m.group(1) or m.group(2)) != "XNNPACK":
            d.delegate = d.delegate or m.group(1) or m.group(2)
        if m := _VERDICT.search(line):
            d.delegate = m.group(1)
            d.verdict = "complete" if m.group(2) == "completely" else "partial"
        elif m := _NOT_EXECUTED.search(line):
            d.delegate, d.verdict = m.group(1), "none"
        if (m := _DELEGATED.search(line)) and m.group(1) != "XNNPACK":
            d.delegated_nodes, d.total_nodes, d.partitions = int(m.group(2)), int(m.group(3)), int(m.group(4))
        elif (m := _REPLACING.search(line)) and "xnnpack" not in m.group(3).lower():
            d.delegated_nodes = int(m.group(1))
            d.total_nodes = int(m.group(2)) if m.group(2) else d.total_nodes
            d.partitions = int(m.group(4))
        if m := _GPU_SPLIT.search(line):
            gpu, cpu = int(m.group(1)), int(m.group(2))
            d.delegated_nodes, d.total_nodes = gpu, gpu + cpu
            d.verdict = d.verdict or ("partial" if cpu else "complete")
        if _FAILED.search(line):
            d.verdict = "failed"
    if d.verdict is None and d.unsupported_ops:  # the GPU delegate's rejections, without its closing verdict
        d.verdict = "partial"
    if d.verdict is None and d.delegated_nodes is not None and d.total_nodes:
        d.verdict = "none" if d.delegated_nodes == 0 else "complete" if d.delegated_nodes == d.total_nodes else "partial"
    return d
