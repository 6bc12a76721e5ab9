"""Turning run records into what a person (table) or a script (csv, json) reads."""

from __future__ import annotations

import csv
import io
from typing import Any

from rich.table import Table

from farm.proto import strict_json
from rich.text import Text

from farm.proto.escape import printable


def _fmt(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _ms(v: float | None) -> str:
    """Three significant figures: 0.0123 ms and 1234 ms both stay readable."""
    if v is None:
        return "—"
    return f"{v:.3g}" if v < 1000 else f"{v:.0f}"


def results_table(records: list[dict[str, Any]], title: str | None = None) -> Table:
    show_repeat = any(r["repeat"] for r in records)
    show_size = any(r["input_size"] for r in records)
    show_energy = any(r.get("energy_per_inference_mj") is not None for r in records)  # boards with power rails
    t = Table(title=title, header_style="bold", show_lines=False)
    t.add_column("model")
    t.add_column("thr", justify="right")
    if any(r["batch_size"] != 1 for r in records):
        t.add_column("batch", justify="right")
    if show_size:
        t.add_column("size", justify="right")
    if show_repeat:
        t.add_column("rep", justify="right")
    t.add_column("budget")
    t.add_column("status")
    t.add_column("latency ms\navg ± std", justify="right")
    t.add_column("p90 ms", justify="right")
    t.add_column("inf/s", justify="right")  # throughput_per_s: inferences (batches) per second
    t.add_column("peak MB", justify="right")
    t.add_column("avg MB", justify="right")
    if show_energy:
        t.add_column("mJ per\ninference", justify="right")
    t.add_column("CPU %\navg/peak", justify="right")
    t.add_column("wall s", justify="right")
    t.add_column("backend")
    for r in records:
        lat = r["latency_ms"] or {}
        lim = r["limits"]
        budget = f"{_fmt(lim['cpus'], 2).rstrip('0').rstrip('.')} cpu" if lim["cpus"] else "no cpu cap"
        if lim["memory_mb"]:
            budget += f", {lim['memory_mb']:g} MB"
        if lim["cpuset"]:
            budget += f" @{lim['cpuset']}"
        status = r["status"] if not r["failure_class"] else f"[red]{r['failure_class']}[/red]"
        if r["status"] == "completed":
            status = "[green]ok[/green]"
            if is_contended(r):
                status = f"[yellow]ok {CONTENDED_MARK}[/yellow]"
        cpu = r["cpu_percent"]
        row: list[str | Text] = [Text(r["model"]["name"]), str(r["threads"])]
        if any(x["batch_size"] != 1 for x in records):
            row.append(str(r["batch_size"]))
        if show_size:
            row.append(str(r["input_size"] or "—"))
        if show_repeat:
            row.append(str(r["repeat"]))
        backend = (r["backend"] or "—") + ("*" if r.get("approximate") else "")
        row += [budget, status,
                f"{_ms(lat.get('avg'))} ± {_ms(lat.get('std'))}" if lat else "—",
                _ms(lat.get("p90")) if lat else "—", _ms(r.get("throughput_per_s")),
                _fmt(r["peak_memory_mb"], 1), _fmt(r["avg_memory_mb"], 1),
                *([_fmt(r.get("energy_per_inference_mj"))] if show_energy else []),
                f"{_fmt(cpu['avg'], 0)}/{_fmt(cpu['peak'], 0)}", _fmt(r["wall_s"]), backend]
        t.add_row(*row)
    contended = sum(is_contended(r) for r in records)
    if contended:
        t.caption = (f"{CONTENDED_MARK} contended ({contended} run(s)): other work used the run's cores, its figures "
                     "are not the budget's; calibrate, predict and rank leave it out (--include-contended keeps it)")
    return t


CONTENDED_MARK = "!"


def is_contended(record: dict[str, Any]) -> bool:
    return bool((record.get("contention") or {}).get("contended"))


def pairs_table(pairs: list[dict[str, Any]], title: str | None = None) -> Table:
    t = Table(title=title, header_style="bold")
    for c in ("model", "thr", "rep", "device", "sim latency ms", "device latency ms", "device / sim",
              "sim peak MB", "device peak MB"):
        t.add_column(c)
    for p in pairs:
        s_lat = (p["sim"]["latency_ms"] or {}).get("avg")
        d_lat = (p["device_run"]["latency_ms"] or {}).get("avg")
        ratio = d_lat / s_lat if s_lat and d_lat else None
        mark = f" {CONTENDED_MARK}" if is_contended(p["sim"]) else ""
        t.add_row(Text(p["model"]["name"]), str(p["threads"]), str(p["repeat"]), Text(p["device"]), _ms(s_lat) + mark,
                  _ms(d_lat), _fmt(ratio), _fmt(p["sim"]["peak_memory_mb"], 1), _fmt(p["device_run"]["peak_memory_mb"], 1))
    return t


def failures(records: list[dict[str, Any]]) -> list[str]:
    # a message may quote an agent or a script: escaped, but its lines kept
    return [f"{r['model']['name']} (threads {r['threads']}, repeat {r['repeat']}): {r['failure_class']}: "
            f"{printable(r['message'], limit=None, multiline=True)}" for r in records if r["failure_class"] and r["status"] not in ("completed", "canceled")]


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else k, v, out)
    else:
        out[prefix] = value


def results_csv(records: list[dict[str, Any]]) -> str:
    rows = []
    for r in records:
        flat: dict[str, Any] = {}
        _flatten("", {k: v for k, v in r.items() if k != "tool_versions"}, flat)
        rows.append(flat)
    fields: list[str] = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def to_json(data: Any) -> str:
    return strict_json.dumps(data, indent=2)
