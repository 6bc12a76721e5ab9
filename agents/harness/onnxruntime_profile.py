"""Parse ONNX Runtime's profiling trace (SessionOptions.enable_profiling) into per-node and per-op-type times.

The trace is Chrome's trace-event JSON: a list of events; each executed node gives one event with
`cat: "Node"`, `name: "<node>_kernel_time"`, `dur` in microseconds and `args.op_name`; each
`session.run` gives one `cat: "Session"`, `name: "model_run"` event. Older releases add
`_fence_before`/`_fence_after` node events, which are bookkeeping and are skipped.

A control-flow node's event (`Loop`, `If`, `Scan`) lasts as long as its body, and every body node
has events of its own: the parent's row keeps only its own time (its span less its body nodes'), so
each microsecond is counted once. A trace file is read event by event (ORT writes one a line), so
its size on disk never becomes the parser's memory.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from farm.proto.op_profile import NODE, OpProfileRow, by_type

KERNEL_SUFFIX = "_kernel_time"


class OrtProfileError(ValueError):
    """The text is not an ONNX Runtime profiling trace."""


def parse_ort_profile(text: str, parents: dict[str, str] | None = None) -> list[OpProfileRow]:
    """Per-node rows (average per run, first run's time, share of the op time) followed by nothing else;
    op-type rows come from `by_type`. parents: body node -> its control-flow node (`control_flow_parents`).
    Raises OrtProfileError for text that is not a trace."""
    try:
        events: Any = json.loads(text)
    except ValueError as error:
        raise OrtProfileError(f"the profiling trace is not JSON: {error}") from None
    if isinstance(events, dict):  # the trace-event format also allows {"traceEvents": [...]}
        events = events.get("traceEvents")
    if not isinstance(events, list):
        raise OrtProfileError("the profiling trace is not a list of events")
    return rows_of_events(events, parents)


def trace_events(path: Path) -> Iterator[Any]:
    """The events of a trace file, one line at a time (ORT's layout: `[`, one event a line, `]`); a file
    in another layout (one long line) is parsed whole. Raises OrtProfileError for a file that is not a trace."""
    with open(path, encoding="utf-8", errors="replace") as f:
        first = f.readline()
        if first.strip() != "[":
            rest = first + f.read()
            events: Any = None
            try:
                events = json.loads(rest)
            except ValueError as error:
                raise OrtProfileError(f"the profiling trace is not JSON: {error}") from None
            if isinstance(events, dict):
                events = events.get("traceEvents")
            if not isinstance(events, list):
                raise OrtProfileError("the profiling trace is not a list of events")
            yield from events
            return
        for number, line in enumerate(f, start=2):
            line = line.strip().removesuffix(",")
            if not line or line == "]":
                continue
            try:
                yield json.loads(line)
            except ValueError as error:
                raise OrtProfileError(f"line {number} of the profiling trace is not an event: {error}") from None


def rows_of_events(events: Iterable[Any], parents: dict[str, str] | None = None) -> list[OpProfileRow]:
    """`parse_ort_profile`'s rows from events one at a time: memory grows with the graph's nodes, not the trace.
    The steps: each event tallied, control-flow nodes left with their own time, the tallies averaged per run."""
    tally = _Tally()
    for e in events:
        if isinstance(e, dict):
            tally.add(e)
    _own_time_of_control_flow(tally.nodes, parents or {})
    return tally.rows()


@dataclass
class _Tally:
    """Runs seen, when the first ended, and per node its summed time, its first run's time and its calls."""

    runs: int = 0
    first_end: float | None = None  # when the first run ended (trace µs), where the trace says
    nodes: dict[str, OpProfileRow] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, e: dict[str, Any]) -> None:
        if e.get("cat") == "Session" and e.get("name") == "model_run":
            self.runs += 1
            ts, span = e.get("ts"), e.get("dur")
            if self.runs == 1 and isinstance(ts, (int, float)) and isinstance(span, (int, float)):
                self.first_end = ts + span
        elif e.get("cat") == "Node":
            self.kernel(e)

    def kernel(self, e: dict[str, Any]) -> None:
        """A node's kernel event (a fence event, a negative or non-finite time is skipped)."""
        name, dur, args = e.get("name"), e.get("dur"), e.get("args") or {}
        if not isinstance(name, str) or not name.endswith(KERNEL_SUFFIX) or not isinstance(dur, (int, float)):
            return
        if not math.isfinite(dur) or dur < 0:
            return
        node = name.removesuffix(KERNEL_SUFFIX)
        row = self.nodes.get(node)
        if row is None:
            op = args.get("op_name") if isinstance(args, dict) else None
            row = self.nodes[node] = OpProfileRow(kind=NODE, node_type=str(op or "?"), name=node, first_ms=dur / 1000)
            row.avg_ms = 0.0
            self.calls[node] = 0
        elif self.runs == 0 or (self.first_end is not None and isinstance(e.get("ts"), (int, float))
                                and e["ts"] < self.first_end):
            # ORT logs a run after its nodes: a body node's first run is every call of it in that run
            row.first_ms = (row.first_ms or 0.0) + dur / 1000
        row.avg_ms += dur / 1000  # summed here, divided by the runs in rows()
        self.calls[node] += 1

    def rows(self) -> list[OpProfileRow]:
        """Per node: the average per run (the first, cold, run kept out where every run called it), calls per run,
        share of the whole op time."""
        runs, nodes = self.runs, self.nodes
        per_run = max(runs, 1)
        for node, row in nodes.items():
            # the first run is the cold one (allocations, caches): reported as first_ms, kept out of the average
            if runs > 1 and self.calls[node] >= runs:
                row.avg_ms = max(0.0, row.avg_ms - (row.first_ms or 0.0)) / (runs - 1)
            else:
                row.avg_ms /= per_run
            row.times_called = round(self.calls[node] / per_run) or 1
        whole = sum(r.avg_ms for r in nodes.values())
        for row in nodes.values():
            row.percent = 100.0 * row.avg_ms / whole if whole > 0 else None
        return list(nodes.values())


def _own_time_of_control_flow(nodes: dict[str, OpProfileRow], parents: dict[str, str]) -> None:
    """A Loop/If/Scan node's span holds its body nodes' time: take it out, so it is counted once."""
    inner: dict[str, tuple[float, float]] = {}
    for child, parent in parents.items():
        row = nodes.get(child)
        if row is not None and parent in nodes:
            total, first = inner.get(parent, (0.0, 0.0))
            inner[parent] = (total + row.avg_ms, first + (row.first_ms or 0.0))
    for parent, (total, first) in inner.items():
        row = nodes[parent]
        row.avg_ms = max(0.0, row.avg_ms - total)
        row.first_ms = max(0.0, (row.first_ms or 0.0) - first)


def control_flow_parents(model_path: Path) -> dict[str, str]:
    """Body node name -> the name of the control-flow node (Loop, If, Scan) whose body holds it, at every depth;
    empty for a model without one (or one onnx cannot read: the profile then counts spans as they are)."""
    import onnx

    try:
        graph = onnx.load(str(model_path), load_external_data=False).graph
    except Exception:  # the session loaded it; a parse failure here only costs the correction
        return {}
    parents: dict[str, str] = {}

    def walk(g: onnx.GraphProto, parent: str | None) -> None:
        for node in g.node:
            if parent is not None and node.name:
                parents[node.name] = parent
            for attribute in node.attribute:
                bodies = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
                for body in bodies:
                    walk(body, node.name or None)

    walk(graph, None)
    return parents


def ort_op_profile(text: str, parents: dict[str, str] | None = None) -> list[OpProfileRow]:
    """Operator-type rows (from every node) and node rows of one trace."""
    nodes = parse_ort_profile(text, parents)
    return by_type(nodes) + nodes


def ort_op_profile_file(path: Path, parents: dict[str, str] | None = None) -> list[OpProfileRow]:
    """`ort_op_profile` of a trace file, read event by event."""
    nodes = rows_of_events(trace_events(path), parents)
    return by_type(nodes) + nodes
