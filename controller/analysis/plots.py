"""Figures from run records: pure functions from records (and telemetry samples) to PNG bytes.

The report embeds them; anything else that shows results (a dashboard) can call them too.
Text from a job (model names, device names) reaches matplotlib only through `plain`, so a name
with `$` cannot start mathtext and a control character cannot reach the picture.

Families: a sweep figure groups the models of one family, the job's own `family:` for a model
when it gave one, else the model name without its input-size suffix (`mobilenetv2_w0.5_r160` →
`mobilenetv2_w0.5`). Within a figure each line is one model under one setting of the other swept
parameters; on an input-size axis the line is the model name without that suffix, so
`…_r128` and `…_r224` become two points of one line.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: render to memory
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from farm.proto.escape import printable  # noqa: E402

DPI = 100
PLOT_TEXT_LIMIT = 60  # characters of a name in a figure; tables beside it carry the whole name
MAX_LINES = 10  # lines per panel; more would be unreadable (the table has them all)
MAX_BARS = 60  # rows of the overview chart
_INPUT_SUFFIX = re.compile(r"_r(\d+)(?=$|[._])")


@dataclass
class Figure:
    name: str  # file name when written out: safe characters only
    png: bytes
    title: str = ""


def plain(text: object, limit: int | None = PLOT_TEXT_LIMIT) -> str:
    """A string as matplotlib should draw it: control characters escaped, `$` literal, long names cut."""
    return printable(text, limit=limit).replace("$", r"\$")


def safe_file_name(text: str, limit: int = 80) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._")[:limit] or "figure"


def png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    return buf.getvalue()


def _finite(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


# --- what a record is, for a plot ------------------------------------------------------------
def input_size_of(record: dict[str, Any]) -> int | None:
    """The input size a run had: the matrix's, else the size in the model's name (`_r160`)."""
    if record.get("input_size"):
        return int(record["input_size"])
    m = _INPUT_SUFFIX.search(record["model"]["name"])
    return int(m.group(1)) if m else None


def model_stem(name: str) -> str:
    return _INPUT_SUFFIX.sub("", name)


def family_of(record: dict[str, Any]) -> str:
    return record["model"].get("family") or model_stem(record["model"]["name"])


def latency_of(r: dict[str, Any]) -> float | None:
    return _finite((r.get("latency_ms") or {}).get("avg"))


def latency_sd_of(r: dict[str, Any]) -> float | None:
    return _finite((r.get("latency_ms") or {}).get("std"))


def throughput_of(r: dict[str, Any]) -> float | None:
    """Inferences per second: the record's own figure, else from the average latency."""
    own = _finite(r.get("throughput_per_s"))
    if own is not None:
        return own
    lat = latency_of(r)
    return 1000.0 / lat if lat else None


@dataclass(frozen=True)
class Param:
    key: str
    label: str
    value: Callable[[dict[str, Any]], Any]


PARAMS: tuple[Param, ...] = (
    Param("threads", "threads", lambda r: r["threads"]),
    Param("cpus", "CPU budget (cores)", lambda r: (r.get("limits") or {}).get("cpus")),
    Param("batch_size", "batch size", lambda r: r["batch_size"]),
    Param("input_size", "input size (px)", input_size_of),
)
METRICS: tuple[tuple[str, str, Callable[[dict[str, Any]], float | None]], ...] = (
    ("latency", "latency, avg (ms)", latency_of),
    ("throughput", "throughput (inferences/s)", throughput_of),
    ("memory", "peak memory (MB)", lambda r: _finite(r.get("peak_memory_mb"))),
)


def _follows(records: list[dict[str, Any]], dependent: Param, on: Param) -> bool:
    """True when `dependent` is a function of `on` in these records (cpus = threads by default)."""
    seen: dict[Any, Any] = {}
    for r in records:
        a, b = on.value(r), dependent.value(r)
        if seen.setdefault(a, b) != b:
            return False
    return True


def swept_params(records: list[dict[str, Any]]) -> list[Param]:
    """Parameters with two or more values; the CPU budget only where it moves apart from threads."""
    swept = [p for p in PARAMS if len({p.value(r) for r in records if p.value(r) is not None}) >= 2]
    threads = PARAMS[0]
    if threads in swept:
        swept = [p for p in swept if not (p.key == "cpus" and _follows(records, p, threads))]
    return swept


def _series_label(r: dict[str, Any], x: Param, others: list[Param]) -> str:
    name = model_stem(r["model"]["name"]) if x.key == "input_size" else r["model"]["name"]
    parts = [plain(name, 40)]
    short = {"threads": "t", "cpus": "cpu ", "batch_size": "b", "input_size": "r"}
    for p in others:
        if p.key == "input_size" and not r.get("input_size"):
            continue  # the model's own size, already in its name
        v = p.value(r)
        parts.append(f"{short[p.key]}{v:g}" if isinstance(v, (int, float)) else f"{short[p.key]}—")
    if r["target"] != "sim":
        parts.append(f"on {plain(r['target'], 30)}")
    return " ".join(parts)


def sweep_figure(family: str, records: list[dict[str, Any]], x: Param, others: list[Param]) -> Figure | None:
    """Latency, throughput and peak memory against one swept parameter, a line per model and setting.

    records: averaged over repeats (one per cell), completed only."""
    series: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if x.value(r) is not None:
            series.setdefault(_series_label(r, x, others), []).append(r)
    series = {k: v for k, v in series.items() if len({x.value(r) for r in v}) >= 2}
    if not series:
        return None
    dropped = max(0, len(series) - MAX_LINES)
    shown = dict(sorted(series.items())[:MAX_LINES])
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    for ax, (_, ylabel, value) in zip(axes, METRICS):
        for label, runs in shown.items():
            runs = sorted(runs, key=x.value)
            xs = [x.value(r) for r in runs]
            ys = [value(r) for r in runs]
            if ylabel.startswith("latency"):
                ax.errorbar(xs, [math.nan if y is None else y for y in ys],
                            yerr=[latency_sd_of(r) or 0.0 for r in runs], marker="o", ms=4, capsize=3, label=label)
            else:
                ax.plot(xs, [math.nan if y is None else y for y in ys], marker="o", ms=4, label=label)
        ax.set_xlabel(x.label)
        ax.set_ylabel(ylabel)
        ax.set_xticks(sorted({x.value(r) for runs in shown.values() for r in runs}))
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    title = f"{plain(family)} · against {x.label}"
    if dropped:
        title += f" · first {MAX_LINES} of {len(series)} lines (the table has all)"
    fig.suptitle(title, fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=7, frameon=False)
    rows = math.ceil(len(labels) / 3)
    fig.tight_layout(rect=(0, min(0.45, 0.06 * rows + 0.02), 1, 0.95))
    return Figure(safe_file_name(f"sweep-{family}-{x.key}") + ".png", png_bytes(fig), f"{family} against {x.label}")


def overview_figure(records: list[dict[str, Any]]) -> Figure | None:
    """Every cell side by side (horizontal bars, names readable): latency and peak memory."""
    rows = [r for r in records if latency_of(r) is not None or r.get("peak_memory_mb") is not None]
    if not rows:
        return None
    total = len(rows)
    rows = rows[:MAX_BARS]
    labels = []
    for r in rows:
        bits = [plain(r["model"]["name"], 48), f"t{r['threads']}"]
        if r["batch_size"] != 1:
            bits.append(f"b{r['batch_size']}")
        if r.get("input_size"):
            bits.append(f"r{r['input_size']}")
        if r["target"] != "sim":
            bits.append(f"on {plain(r['target'], 24)}")
        labels.append(" ".join(bits))
    height = max(2.6, 0.28 * len(rows) + 1.2)
    fig, (lat, mem) = plt.subplots(1, 2, figsize=(12, height), sharey=True)
    ys = list(range(len(rows)))
    lat.barh(ys, [latency_of(r) or 0.0 for r in rows], xerr=[latency_sd_of(r) or 0.0 for r in rows],
             color="tab:blue", capsize=2)
    mem.barh(ys, [_finite(r.get("peak_memory_mb")) or 0.0 for r in rows], color="tab:green")
    lat.set_yticks(ys, labels, fontsize=7)
    lat.invert_yaxis()
    lat.set_xlabel("latency, avg ± sd (ms)")
    mem.set_xlabel("peak memory (MB)")
    for ax in (lat, mem):
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle("every model and setting (averaged over repeats)" if total == len(rows) else
                 f"the first {len(rows)} of {total} models and settings (the table has all)", fontsize=10)
    fig.tight_layout()
    return Figure("overview.png", png_bytes(fig), "every model and setting")


def telemetry_figure(model: str, runs: list[tuple[str, list[dict[str, Any]]]]) -> Figure | None:
    """Memory and CPU over time, one line per run (label, samples with t_s, memory_bytes, cpu_percent)."""
    runs = [(label, s) for label, s in runs if s][:MAX_LINES]
    if not runs:
        return None
    fig, (mem, cpu) = plt.subplots(1, 2, figsize=(12, 3.6))
    for label, samples in runs:
        ts = [_finite(s["t_s"]) for s in samples]
        mem.plot(ts, [(_finite(s["memory_bytes"]) or math.nan) / (1 << 20) for s in samples], marker=".", label=label)
        cpu.plot(ts, [_finite(s["cpu_percent"]) if _finite(s["cpu_percent"]) is not None else math.nan for s in samples],
                 marker=".", label=label)
    mem.set_ylabel("memory (MB)")
    cpu.set_ylabel("CPU (% of one core)")
    for ax in (mem, cpu):
        ax.set_xlabel("time since start (s)")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    cpu.legend(fontsize=7, loc="best")
    fig.suptitle(f"{plain(model)} · telemetry samples", fontsize=10)
    fig.tight_layout()
    return Figure(safe_file_name(f"telemetry-{model}") + ".png", png_bytes(fig), f"{model} telemetry")


# --- labels that do not overlap ------------------------------------------------------------
def place_labels(ax: Axes, points: Iterable[tuple[float, float]], labels: Iterable[str], fontsize: float = 7) -> list:
    """Annotate points so no two labels overlap: each label tries a few positions around its point
    and is left out when none is free (the table beside the figure names every point)."""
    fig = ax.figure
    fig.canvas.draw()  # limits and layout settle first: label boxes are measured where they will be drawn
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]  # the Agg canvas farm draws on has one
    frame = ax.get_window_extent(renderer)
    placed: list = [t.get_window_extent(renderer) for t in ax.texts]  # the formula box, and any other text
    legend = ax.get_legend()
    if legend is not None:
        placed.append(legend.get_window_extent(renderer))
    texts = []
    offsets = [(4, 4), (4, -10), (-4, 4), (-4, -10), (4, 14), (4, -20), (-4, 14), (-4, -20)]
    for (x, y), label in zip(points, labels):
        for dx, dy in offsets:
            t = ax.annotate(plain(label), (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                            ha="left" if dx > 0 else "right")
            box = t.get_window_extent(renderer).expanded(1.05, 1.1)
            inside = frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1)
            if inside and not any(box.overlaps(b) for b in placed):
                placed.append(box)
                texts.append(t)
                break
            t.remove()
    return texts
