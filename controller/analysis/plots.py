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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")  # no display: render to memory
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure as MplFigure  # noqa: E402
from matplotlib.text import Annotation  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from farm.proto.escape import printable  # noqa: E402

if TYPE_CHECKING:
    from farm.controller.analysis.pareto import ParetoGroup
    from farm.controller.store.rows import TelemetrySampleRow
    from farm.proto.questions import RunRecord

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


def png_bytes(fig: MplFigure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    return buf.getvalue()


def _finite(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


# --- what a record is, for a plot ------------------------------------------------------------
def input_size_of(record: RunRecord) -> int | None:
    """The input size a run had: the matrix's, else the size in the model's name (`_r160`)."""
    if record.input_size:
        return int(record.input_size)
    m = _INPUT_SUFFIX.search(record.model.name)
    return int(m.group(1)) if m else None


def model_stem(name: str) -> str:
    return _INPUT_SUFFIX.sub("", name)


def family_of(record: RunRecord) -> str:
    return record.model.family or model_stem(record.model.name)


def latency_of(r: RunRecord) -> float | None:
    return _finite(r.latency_ms.avg) if r.latency_ms else None


def latency_sd_of(r: RunRecord) -> float | None:
    return _finite(r.latency_ms.std) if r.latency_ms else None


def throughput_of(r: RunRecord) -> float | None:
    """Inferences per second: the record's own figure, else from the average latency."""
    own = _finite(r.throughput_per_s)
    if own is not None:
        return own
    lat = latency_of(r)
    return 1000.0 / lat if lat else None


@dataclass(frozen=True)
class Param:
    key: str
    label: str
    value: Callable[[RunRecord], float | None]


PARAMS: tuple[Param, ...] = (
    Param("threads", "threads", lambda r: r.threads),
    Param("cpus", "CPU budget (cores)", lambda r: r.limits.cpus),
    Param("batch_size", "batch size", lambda r: r.batch_size),
    Param("input_size", "input size (px)", input_size_of),
)
METRICS: tuple[tuple[str, str, Callable[[RunRecord], float | None]], ...] = (
    ("latency", "latency, avg (ms)", latency_of),
    ("throughput", "throughput (inferences/s)", throughput_of),
    ("memory", "peak memory (MB)", lambda r: _finite(r.peak_memory_mb)),
)


def _follows(records: Sequence[RunRecord], dependent: Param, on: Param) -> bool:
    """True when `dependent` is a function of `on` in these records (cpus = threads by default)."""
    seen: dict[float | None, float] = {}
    for r in records:
        a, b = on.value(r), dependent.value(r)
        if b is None:  # a device run has no budget imposed: it neither follows nor breaks the rule
            continue
        if seen.setdefault(a, b) != b:
            return False
    return True


def swept_params(records: Sequence[RunRecord]) -> list[Param]:
    """Parameters with two or more values; the CPU budget only where it moves apart from threads."""
    swept = [p for p in PARAMS if len({p.value(r) for r in records if p.value(r) is not None}) >= 2]
    threads = PARAMS[0]
    if threads in swept:
        swept = [p for p in swept if not (p.key == "cpus" and _follows(records, p, threads))]
    return swept


def _series_label(r: RunRecord, x: Param, others: list[Param]) -> str:
    name = model_stem(r.model.name) if x.key == "input_size" else r.model.name
    parts = [plain(name, 40)]
    short = {"threads": "t", "cpus": "cpu ", "batch_size": "b", "input_size": "r"}
    for p in others:
        if p.key == "input_size" and not r.input_size:
            continue  # the model's own size, already in its name
        v = p.value(r)
        parts.append(f"{short[p.key]}{v:g}" if isinstance(v, (int, float)) else f"{short[p.key]}—")
    if r.target != "sim":
        parts.append(f"on {plain(r.target, 30)}")
    return " ".join(parts)


def single_point_series(records: Sequence[RunRecord], x: Param, others: list[Param]) -> list[str]:
    """The lines sweep_figure leaves out: a model and setting with fewer than two values of `x` (no line to draw)."""
    series: dict[str, set[float]] = {}
    for r in records:
        if x.value(r) is not None:
            series.setdefault(_series_label(r, x, others), set()).add(x.value(r) or 0.0)
    return sorted(label for label, xs in series.items() if len(xs) < 2)


def sweep_figure(family: str, records: Sequence[RunRecord], x: Param, others: list[Param]) -> Figure | None:
    """Latency, throughput and peak memory against one swept parameter, a line per model and setting.

    records: averaged over repeats (one per cell), completed only."""
    series: dict[str, list[RunRecord]] = {}
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
            runs = sorted(runs, key=lambda r: x.value(r) or 0.0)
            xs = [x.value(r) for r in runs]
            ys = [value(r) for r in runs]
            if ylabel.startswith("latency"):
                ax.errorbar(xs, [math.nan if y is None else y for y in ys],
                            yerr=[latency_sd_of(r) or 0.0 for r in runs], marker="o", ms=4, capsize=3, label=label)
            else:
                ax.plot(xs, [math.nan if y is None else y for y in ys], marker="o", ms=4, label=label)
        ax.set_xlabel(x.label)
        ax.set_ylabel(ylabel)
        ax.set_xticks(sorted({x.value(r) or 0.0 for runs in shown.values() for r in runs}))
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


def overview_figure(records: Sequence[RunRecord]) -> Figure | None:
    """Every cell side by side (horizontal bars, names readable): latency and peak memory."""
    rows = [r for r in records if latency_of(r) is not None or r.peak_memory_mb is not None]
    if not rows:
        return None
    total = len(rows)
    rows = rows[:MAX_BARS]
    labels = []
    for r in rows:
        bits = [plain(r.model.name, 48), f"t{r.threads}"]
        if r.batch_size != 1:
            bits.append(f"b{r.batch_size}")
        if r.input_size:
            bits.append(f"r{r.input_size}")
        if r.target != "sim":
            bits.append(f"on {plain(r.target, 24)}")
        labels.append(" ".join(bits))
    height = max(2.6, 0.28 * len(rows) + 1.2)
    fig, (lat, mem) = plt.subplots(1, 2, figsize=(12, height), sharey=True)
    ys = list(range(len(rows)))
    lat.barh(ys, [latency_of(r) or 0.0 for r in rows], xerr=[latency_sd_of(r) or 0.0 for r in rows],
             color="tab:blue", capsize=2)
    mem.barh(ys, [_finite(r.peak_memory_mb) or 0.0 for r in rows], color="tab:green")
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


GAP_FACTOR = 3.0  # a step between samples this many times the usual one is a gap: no line is drawn across it


def break_gaps(ts: list[float | None], values: list[float]) -> tuple[list[float], list[float]]:
    """The samples with a NaN point inserted inside each gap (a step over GAP_FACTOR × the median step,
    or time going backwards), so a plotted line stops there instead of inventing values across it."""
    points = [(t, v) for t, v in zip(ts, values) if t is not None]
    steps = sorted(b[0] - a[0] for a, b in zip(points, points[1:]) if b[0] > a[0])
    usual = steps[len(steps) // 2] if steps else 0.0
    xs: list[float] = []
    ys: list[float] = []
    for i, (t, v) in enumerate(points):
        if i and (t <= points[i - 1][0] or (usual > 0 and t - points[i - 1][0] > GAP_FACTOR * usual)):
            xs.append((t + points[i - 1][0]) / 2)
            ys.append(math.nan)
        xs.append(t)
        ys.append(v)
    return xs, ys


def telemetry_figure(model: str, runs: Sequence[tuple[str, Sequence[TelemetrySampleRow]]]) -> Figure | None:
    """Memory and CPU over time, one line per run (label, samples with t_s, memory_bytes, cpu_percent);
    a line stops at a gap in the samples (break_gaps) rather than joining the samples on either side."""
    kept = [(label, s) for label, s in runs if s][:MAX_LINES]
    if not kept:
        return None
    fig, (mem, cpu) = plt.subplots(1, 2, figsize=(12, 3.6))
    for label, samples in kept:
        ts = [_finite(s.t_s) for s in samples]
        line = mem.plot(*break_gaps(ts, [(_finite(s.memory_bytes) or math.nan) / (1 << 20) for s in samples]),
                        marker=".", label=label)[0]
        cpu_values = [_finite(s.cpu_percent) for s in samples]
        cpu.plot(*break_gaps(ts, [math.nan if v is None else v for v in cpu_values]), marker=".", label=label,
                 color=line.get_color())
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


# --- one figure per question: a family on every target and thread count --------------------
def _whole_run_of(r: RunRecord) -> float | None:
    return _finite(r.whole_run_s) if _finite(r.whole_run_s) is not None else _finite(r.wall_s)


FAMILY_PANELS: tuple[tuple[str, str, Callable[[RunRecord], float | None]], ...] = (
    ("latency", "latency, avg (ms)", latency_of),
    ("whole_run", "whole run (s)", _whole_run_of),
    ("peak_memory", "peak memory (MB)", lambda r: _finite(r.peak_memory_mb)),
    ("avg_memory", "average memory (MB)", lambda r: _finite(r.avg_memory_mb)),
)
_TARGET_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
                   "tab:olive", "tab:cyan", "tab:grey")
_THREAD_STYLES = (("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."), ("v", "-"), ("P", "--"))


def family_panels(records: Sequence[RunRecord]) -> list[tuple[str, str, Callable[[RunRecord], float | None]]]:
    """What a family figure plots: latency and peak memory for a benchmark; for scripts (no per-inference
    latency) whole-run time, peak and average memory, the figures the published Jetson experiment shows."""
    has = {key: any(value(r) is not None for r in records) for key, _, value in FAMILY_PANELS}
    wanted = ("latency", "peak_memory") if has["latency"] else ("whole_run", "peak_memory", "avg_memory")
    return [p for p in FAMILY_PANELS if p[0] in wanted and has[p[0]]]


def _setting(r: RunRecord) -> str:
    bits = [f"t{r.threads}"]
    if r.batch_size != 1:
        bits.append(f"b{r.batch_size}")
    if r.input_size:
        bits.append(f"r{r.input_size}")
    return " ".join(bits)


def family_figure(family: str, records: Sequence[RunRecord]) -> Figure | None:
    """Every target (the sim and each device) and thread count of one family on one chart per metric:
    x the family's models (fastest in the sim first), a line per target and setting — colour the
    target, marker and dash the thread count. records: averaged over repeats, completed only."""
    panels = family_panels(records)
    if not panels:
        return None
    targets = sorted({r.target for r in records}, key=lambda t: (t != "sim", t))
    settings = sorted({_setting(r) for r in records}, key=lambda s: [int(p[1:]) if p[1:].isdigit() else 0 for p in s.split()])
    first = panels[0][2]
    order: dict[str, tuple[int, float]] = {}  # fastest in the sim first; models without a sim run after
    for r in records:
        v = first(r)
        if v is not None:
            order[r.model.name] = min(order.get(r.model.name, (2, math.inf)), (int(r.target != "sim"), v))
    models = sorted({r.model.name for r in records}, key=lambda m: (*order.get(m, (2, math.inf)), m))
    if len(models) > MAX_BARS:
        models = models[:MAX_BARS]
    position = {m: i for i, m in enumerate(models)}
    series: dict[tuple[str, str], list[RunRecord]] = {}
    for r in records:
        if r.model.name in position:
            series.setdefault((r.target, _setting(r)), []).append(r)
    keys = sorted(series, key=lambda k: (targets.index(k[0]), settings.index(k[1])))
    dropped = max(0, len(keys) - 2 * MAX_LINES)
    keys = keys[:2 * MAX_LINES]
    width = max(6.0, min(18.0, 4.2 * len(panels) + 0.25 * len(models)))
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 4.6), squeeze=False)
    for ax, (_, ylabel, value) in zip(axes[0], panels):
        shown: list[float] = []
        for target, setting in keys:
            runs = sorted(series[(target, setting)], key=lambda r: position[r.model.name])
            xs = [position[r.model.name] for r in runs]
            ys = [value(r) for r in runs]
            shown += [y for y in ys if y is not None and y > 0]
            marker, dash = _THREAD_STYLES[settings.index(setting) % len(_THREAD_STYLES)]
            label = f"{'sim' if target == 'sim' else plain(target, 24)} {setting}"
            ax.plot(xs, [math.nan if y is None else y for y in ys], marker=marker, linestyle=dash, ms=4,
                    color=_TARGET_COLOURS[targets.index(target) % len(_TARGET_COLOURS)], label=label)
        ax.set_xticks(range(len(models)), [plain(m, 28) for m in models], rotation=35, ha="right", fontsize=7)
        ax.set_ylabel(ylabel)
        if shown and max(shown) / min(shown) > 20:
            ax.set_yscale("log")  # a phone and its twin, or a small and a large model, differ tenfold and more
            for axis_format in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
                axis_format(FuncFormatter(lambda v, _: f"{v:g}"))  # 60, not 6×10¹
        ax.grid(alpha=0.3)
    title = f"{plain(family)} · every target and thread count (averaged over repeats)"
    if dropped:
        title += f" · first {len(keys)} of {len(keys) + dropped} lines (the table has all)"
    fig.suptitle(title, fontsize=10)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7, frameon=False)
    longest = max((len(label) for label in labels), default=10)
    fig.tight_layout(rect=(0, 0, 1 - min(0.35, (0.6 + 0.06 * longest) / width), 0.95))
    return Figure(safe_file_name(f"family-{family}") + ".png", png_bytes(fig), f"{family}: every target and thread count")


# --- labels that do not overlap ------------------------------------------------------------
def place_labels(ax: Axes, points: Iterable[tuple[float, float]], labels: Iterable[str], fontsize: float = 7) -> list[Annotation]:
    """Annotate points so no two labels overlap: each label tries a few positions around its point
    and is left out when none is free (the table beside the figure names every point)."""
    fig = ax.figure
    # limits settle first (reading viewLim applies a pending autoscale): label boxes are measured where they will
    # be drawn. No draw of the whole figure: one per labelled panel made a 13-panel figure cost 13 figure draws.
    ax.viewLim  # noqa: B018 (the read is the point)
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]  # the Agg canvas farm draws on has one
    frame = ax.get_window_extent(renderer)
    placed: list[Bbox] = [t.get_window_extent(renderer) for t in ax.texts]  # the formula box, and any other text
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


def pareto_figure(title: str, group: ParetoGroup) -> Figure | None:
    """Accuracy (or agreement) against latency for one setting's models (controller/analysis/pareto.py): the front
    as a step line through its points, dominated models hollow and grey, each point labelled where room allows."""
    points = [p for p in group.points if _finite(p.latency_avg_ms) is not None and _finite(p.quality) is not None]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    front = sorted((p for p in points if p.on_front), key=lambda p: p.latency_avg_ms)
    dominated = [p for p in points if not p.on_front]
    ax.plot([p.latency_avg_ms for p in front], [p.quality for p in front], drawstyle="steps-post",
            color="#1f77b4", marker="o", ms=7, label="Pareto front")
    if dominated:
        ax.scatter([p.latency_avg_ms for p in dominated], [p.quality for p in dominated], s=40,
                   facecolors="none", edgecolors="#888888", label="dominated")
    ax.set_xlabel("latency avg (ms) · lower is better")
    ax.set_ylabel(f"{group.quality_label} · higher is better")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(plain(title, limit=90), fontsize=9)
    fig.tight_layout()
    place_labels(ax, [(p.latency_avg_ms, p.quality) for p in [*front, *dominated]],
                 [p.label for p in [*front, *dominated]])
    return Figure(safe_file_name(f"pareto-{title}") + ".png", png_bytes(fig), f"Pareto: {title}")
