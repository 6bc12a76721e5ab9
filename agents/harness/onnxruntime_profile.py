"""Parse ONNX Runtime's profiling trace (SessionOptions.enable_profiling) into per-node and per-op-type times.

The trace is Chrome's trace-event JSON: a list of events; each executed node gives one event with
`cat: "Node"`, `name: "<node>_kernel_time"`, `dur` in microseconds and `args.op_name`; each
`session.run` gives one `cat: "Session"`, `name: "model_run"` event. Older releases add
`_fence_before`/`_fence_after` node events, which are bookkeeping and are skipped.
"""

from __future__ import annotations

import json
import math
from typing import Any

from farm.proto.op_profile import NODE, OpProfileRow, by_type

KERNEL_SUFFIX = "_kernel_time"


class OrtProfileError(ValueError):
    """The text is not an ONNX Runtime profiling trace."""


def parse_ort_profile(text: str) -> list[OpProfileRow]:
    """Per-node rows (average per run, first run's time, share of the op time) followed by nothing else;
    op-type rows come from `by_type`. Raises OrtProfileError for text that is not a trace."""
    try:
        events: Any = json.loads(text)
    except ValueError as error:
        raise OrtProfileError(f"the profiling trace is not JSON: {error}") from None
    if isinstance(events, dict):  # the trace-event format also allows {"traceEvents": [...]}
        events = events.get("traceEvents")
    if not isinstance(events, list):
        raise OrtProfileError("the profiling trace is not a list of events")
    runs = sum(1 for event in events
               if isinstance(event, dict) and event.get("cat") == "Session" and event.get("name") == "model_run")
    nodes: dict[str, OpProfileRow] = {}
    calls: dict[str, int] = {}
    for e in events:
        if not isinstance(e, dict) or e.get("cat") != "Node":
            continue
        name, dur, args = e.get("name"), e.get("dur"), e.get("args") or {}
        if not isinstance(name, str) or not name.endswith(KERNEL_SUFFIX) or not isinstance(dur, (int, float)):
            continue
        if not math.isfinite(dur) or dur < 0:
            continue
        node = name.removesuffix(KERNEL_SUFFIX)
        row = nodes.get(node)
        if row is None:
            op = args.get("op_name") if isinstance(args, dict) else None
            row = nodes[node] = OpProfileRow(kind=NODE, node_type=str(op or "?"), name=node, first_ms=dur / 1000)
        row.avg_ms += dur / 1000  # summed here, divided by the runs below
        calls[node] = calls.get(node, 0) + 1
    per_run = max(runs, 1)
    for node, row in nodes.items():
        # the first run is the cold one (allocations, caches): reported as first_ms, kept out of the average
        if runs > 1 and calls[node] >= runs:
            row.avg_ms = (row.avg_ms - (row.first_ms or 0.0)) / (runs - 1)
        else:
            row.avg_ms /= per_run
        row.times_called = round(calls[node] / per_run) or 1
    whole = sum(r.avg_ms for r in nodes.values())
    for row in nodes.values():
        row.percent = 100.0 * row.avg_ms / whole if whole > 0 else None
    return list(nodes.values())


def ort_op_profile(text: str) -> list[OpProfileRow]:
    """Operator-type rows (from every node) and node rows of one trace."""
    nodes = parse_ort_profile(text)
    return by_type(nodes) + nodes
