"""`farm results JOB --ops`: each run's slowest operator types and nodes, as tables."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from farm.proto.escape import printable

if TYPE_CHECKING:
    from farm.proto.questions import RunRecord

DEFAULT_ROWS = 10  # per run and kind on a terminal; --json carries every stored row


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.3g}" if v < 1000 else f"{v:.0f}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"


class OpProfileEntry(BaseModel):
    """One row of a run's op profile (an op type's or a node's), as the record's `op_profile` carries it."""

    model_config = ConfigDict(extra="ignore")
    kind: str
    node_type: str | None = None
    name: str | None = None
    avg_ms: float | None = None
    percent: float | None = None
    first_ms: float | None = None
    count: int | None = None


def _run_label(r: RunRecord) -> str:
    parts = [r.model.name, r.target, f"threads {r.threads}"]
    if r.batch_size != 1:
        parts.append(f"batch {r.batch_size}")
    if r.input_size:
        parts.append(f"input {r.input_size}")
    parts.append(f"repeat {r.repeat}")
    return " · ".join(parts)


def op_profile_tables(records: list[RunRecord], rows: int = DEFAULT_ROWS) -> Group:
    """Per run with a profile: op types (time, share, nodes) and the slowest nodes; a line for the others."""
    parts: list[RenderableType] = []
    for r in records:
        profile = [OpProfileEntry.model_validate(o) for o in r.op_profile]
        label = Text(_run_label(r), style="bold")  # Text: a model name is never read as markup
        if not profile:
            why = r.op_profile_note or ("the run did not complete" if r.status != "completed" else
                                        "no op profile: set workload.op_profiling: true")
            parts.append(Text.assemble(label, (f": {printable(why)}", "dim")))
            continue
        types = [o for o in profile if o.kind == "op_type"][:rows]
        nodes = [o for o in profile if o.kind == "node"][:rows]
        t = Table(title=label, title_justify="left", header_style="bold")
        for column, justify in (("op type", "left"), ("ms per inference", "right"), ("% of op time", "right"),
                                ("nodes", "right")):
            t.add_column(column, justify=justify)  # type: ignore[arg-type]
        for o in types:
            t.add_row(Text(o.node_type or ""), _ms(o.avg_ms), _pct(o.percent), "—" if o.count is None else str(o.count))
        n = Table(header_style="bold")
        for column, justify in (("node", "left"), ("op type", "left"), ("ms per inference", "right"),
                                ("first ms", "right"), ("% of op time", "right")):
            n.add_column(column, justify=justify)  # type: ignore[arg-type]
        for o in nodes:
            n.add_row(Text(o.name or ""), Text(o.node_type or ""), _ms(o.avg_ms), _ms(o.first_ms), _pct(o.percent))
        parts += [t, n] if nodes else [t]
        if r.op_profile_note:  # a bounded profile says what it left out
            parts.append(Text(printable(r.op_profile_note), style="dim"))
    if not parts:
        parts.append(Text("no runs in this job"))
    return Group(*parts)
