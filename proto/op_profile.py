"""Per-operator profiles: where an inference spends its time, node by node and by operator type.

One shape for every source (benchmark_model's op-profiling tables on phones, ONNX Runtime's
node trace in the sim) and one bound on its size, applied by the driver that makes it and again
by the store that keeps it (what arrives over the wire is not trusted to be small or clean).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from farm.proto.escape import printable

# Rows kept per run and kind: the slowest nodes and the slowest operator types. A graph's long tail
# of microsecond nodes says nothing a person acts on, and a 10 000-node graph must not fill the store.
MAX_NODES = 50
MAX_OP_TYPES = 50
MAX_NAME_CHARS = 200
NODE, OP_TYPE = "node", "op_type"


@dataclass
class OpProfileRow:
    """One node of the graph (kind "node") or every node of one operator type (kind "op_type")."""

    kind: str  # "node" | "op_type"
    node_type: str
    name: str = ""  # the node's name; empty for an op_type row
    avg_ms: float = 0.0  # per inference
    percent: float | None = None  # of the op time of one inference
    first_ms: float | None = None
    count: int | None = None  # op_type: nodes of that type in the graph
    times_called: int | None = None  # per inference
    mem_kb: float | None = None


def _finite(value: float | None) -> float | None:
    return None if value is None or not isinstance(value, (int, float)) or not math.isfinite(value) else float(value)


def _count(value: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62 else None


def _clean(row: OpProfileRow) -> OpProfileRow | None:
    avg = _finite(row.avg_ms)
    if row.kind not in (NODE, OP_TYPE) or avg is None or avg < 0:
        return None  # a row no table can show honestly
    return OpProfileRow(kind=row.kind, node_type=printable(row.node_type, MAX_NAME_CHARS),
                        name=printable(row.name, MAX_NAME_CHARS), avg_ms=avg, percent=_finite(row.percent),
                        first_ms=_finite(row.first_ms), count=_count(row.count),
                        times_called=_count(row.times_called), mem_kb=_finite(row.mem_kb))


def from_dicts(items: object) -> list[OpProfileRow]:
    """Rows from JSON a sandboxed run wrote (hostile until checked): anything that is not a row of the
    right shape is dropped, never raised on; `bounded` then cleans and cuts what is left."""
    if not isinstance(items, list):
        return []
    rows = []
    names = {f.name for f in dataclasses.fields(OpProfileRow)}
    for item in items[:100_000]:
        if not isinstance(item, dict) or not set(item) <= names:
            continue
        if not isinstance(item.get("kind"), str) or not isinstance(item.get("node_type"), str) \
                or not isinstance(item.get("name", ""), str) or not isinstance(item.get("avg_ms"), (int, float)):
            continue
        rows.append(OpProfileRow(**item))
    return bounded(rows)


def bounded(rows: list[OpProfileRow]) -> list[OpProfileRow]:
    """The rows worth keeping: cleaned (finite numbers, printable and short names), the MAX_NODES slowest
    nodes and the MAX_OP_TYPES slowest operator types, each slowest first."""
    clean = [c for c in (_clean(r) for r in rows) if c is not None]
    nodes = sorted((r for r in clean if r.kind == NODE), key=lambda r: -r.avg_ms)[:MAX_NODES]
    types = sorted((r for r in clean if r.kind == OP_TYPE), key=lambda r: -r.avg_ms)[:MAX_OP_TYPES]
    return types + nodes


def by_type(nodes: list[OpProfileRow]) -> list[OpProfileRow]:
    """Operator-type rows summed from every node row (before any is cut), with each type's share."""
    totals: dict[str, OpProfileRow] = {}
    for n in nodes:
        t = totals.setdefault(n.node_type, OpProfileRow(kind=OP_TYPE, node_type=n.node_type, count=0))
        t.avg_ms += n.avg_ms
        t.count = (t.count or 0) + 1
    whole = sum(t.avg_ms for t in totals.values())
    for t in totals.values():
        t.percent = 100.0 * t.avg_ms / whole if whole > 0 else None
    return list(totals.values())
