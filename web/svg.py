"""Charts as SVG text, drawn on the server: no script library, nothing fetched at run time.

Every label is HTML-escaped here (model and device names come from users); non-finite values
are dropped before scaling, so one NaN cannot blank a chart.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field
from html import escape
from typing import Callable

WIDTH, HEIGHT = 640, 400
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 28, 48
LEGEND_ROW = 16  # px per legend entry, drawn under the plot (never over the lines)
LEGEND_MAX = 40  # entries listed; more are counted
DASHES = ("", "6 3", "2 3", "8 3 2 3")  # a second, third... pass over the palette changes the line's dash
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")


@dataclass
class Band:
    """A fitted line with its prediction interval, sampled along x."""

    xs: list[float]
    estimate: list[float]
    low: list[float]
    high: list[float]
    label: str


@dataclass
class Chart:
    title: str
    x_label: str
    y_label: str
    points: list[tuple[str, float, float]] = field(default_factory=list)  # (label, x, y)
    band: Band | None = None
    # fitted value with its interval per point, for a fit that is no single line in x
    error_bars: list[tuple[float, float, float, float]] = field(default_factory=list)  # (x, estimate, low, high)
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # name -> line through (x, y)
    note: str = ""  # shown in the top-left corner (formula, R²)
    integer_x: bool = False  # x counts something (versions, refreshes): no ticks between whole numbers
    dates_x: bool = False  # x is a Unix time: ticks read as dates (UTC)
    markers: list[tuple[float, str]] = field(default_factory=list)  # (x, label): a dashed vertical line, labelled
    point_axes: tuple[str, str] = ("sim", "device")  # how a point's hover text names its x and y


def _finite(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    step = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * step:
            step *= m
            break
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _label(v: float) -> str:
    return f"{v:.4g}"


def _date_label(t: float, span_s: float) -> str:
    moment = dt.datetime.fromtimestamp(t, dt.timezone.utc)
    return moment.strftime("%m-%d %H:%M" if span_s < 3 * 86400 else "%Y-%m-%d")


@dataclass
class _Finite:
    """The chart's finite values only (one NaN cannot blank a chart), and every x and y to scale the axes to."""

    points: list[tuple[str, float, float]]
    bars: list[tuple[float, float, float, float]]
    band: Band | None
    series: dict[str, list[tuple[float, float]]]
    xs: list[float]
    ys: list[float]


def _finite_values(chart: Chart) -> _Finite:
    xs: list[float] = []
    ys: list[float] = []
    points = [(n, x, y) for n, x, y in chart.points if _finite(x, y)]
    for _, x, y in points:
        xs.append(x)
        ys.append(y)
    bars = [b for b in chart.error_bars if _finite(*b)]
    for x, e, lo, hi in bars:
        xs.append(x)
        ys += [lo, hi]
    band = chart.band
    if band:
        keep = [i for i in range(len(band.xs)) if _finite(band.xs[i], band.estimate[i], band.low[i], band.high[i])]
        band = Band([band.xs[i] for i in keep], [band.estimate[i] for i in keep], [band.low[i] for i in keep],
                    [band.high[i] for i in keep], band.label)
        xs += band.xs
        ys += band.low + band.high
    series = {name: [(x, y) for x, y in line if _finite(x, y)] for name, line in chart.series.items()}
    for line in series.values():
        xs += [x for x, _ in line]
        ys += [y for _, y in line]
    return _Finite(points, bars, band, series, xs, ys)


@dataclass
class _Frame:
    """The plot's value ranges (5 % padding, a flat range widened by 1 each way) and the mapping to pixels."""

    x_lo: float
    x_hi: float
    y_lo: float
    y_hi: float
    plot_w: int = WIDTH - LEFT - RIGHT
    plot_h: int = HEIGHT - TOP - BOTTOM

    @classmethod
    def around(cls, xs: list[float], ys: list[float]) -> _Frame:
        x_lo, x_hi = min(xs), max(xs)
        y_lo, y_hi = min(ys), max(ys)
        if x_hi == x_lo:
            x_lo, x_hi = x_lo - 1, x_hi + 1
        if y_hi == y_lo:
            y_lo, y_hi = y_lo - 1, y_hi + 1
        pad_x, pad_y = (x_hi - x_lo) * 0.05, (y_hi - y_lo) * 0.05
        return cls(x_lo - pad_x, x_hi + pad_x, y_lo - pad_y, y_hi + pad_y)

    def px(self, x: float) -> float:
        return round(LEFT + (x - self.x_lo) / (self.x_hi - self.x_lo) * self.plot_w, 2)

    def py(self, y: float) -> float:
        return round(TOP + self.plot_h - (y - self.y_lo) / (self.y_hi - self.y_lo) * self.plot_h, 2)


def render(chart: Chart) -> str:
    """The chart as one <svg>: its frame and title, then each layer of _LAYERS in order over the plot."""
    data = _finite_values(chart)
    legend = min(len(data.series), LEGEND_MAX) + (1 if len(data.series) > LEGEND_MAX else 0)
    total_h = HEIGHT + (LEGEND_ROW * legend + 8 if legend else 0)
    parts = [f'<svg class="chart" role="img" viewBox="0 0 {WIDTH} {total_h}" xmlns="http://www.w3.org/2000/svg" '
             f'preserveAspectRatio="xMidYMid meet"><title>{escape(chart.title)}</title>',
             f'<rect x="0" y="0" width="{WIDTH}" height="{total_h}" fill="#fff"/>',
             f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" class="chart-title">{escape(chart.title)}</text>']
    if not data.xs:
        parts.append(f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">no finite values to plot</text></svg>')
        return "".join(parts)
    frame = _Frame.around(data.xs, data.ys)
    for layer in _LAYERS:
        parts += layer(chart, data, frame)
    parts.append("</svg>")
    return "".join(parts)


def _axes(chart: Chart, data: _Finite, f: _Frame) -> list[str]:
    """The plot's box, the grid with its tick labels (whole numbers only, or dates, where the chart says), the
    axis labels."""
    parts = [f'<rect x="{LEFT}" y="{TOP}" width="{f.plot_w}" height="{f.plot_h}" fill="none" stroke="#999"/>']
    for t in _ticks(f.x_lo, f.x_hi):
        if chart.integer_x and t != int(t):
            continue
        tick = _date_label(t, f.x_hi - f.x_lo) if chart.dates_x else _label(t)
        parts.append(f'<line x1="{f.px(t)}" y1="{TOP}" x2="{f.px(t)}" y2="{TOP + f.plot_h}" stroke="#eee"/>'
                     f'<text x="{f.px(t)}" y="{TOP + f.plot_h + 16}" text-anchor="middle" class="tick">{tick}</text>')
    for t in _ticks(f.y_lo, f.y_hi):
        parts.append(f'<line x1="{LEFT}" y1="{f.py(t)}" x2="{LEFT + f.plot_w}" y2="{f.py(t)}" stroke="#eee"/>'
                     f'<text x="{LEFT - 6}" y="{f.py(t) + 4}" text-anchor="end" class="tick">{_label(t)}</text>')
    parts.append(f'<text x="{LEFT + f.plot_w / 2}" y="{HEIGHT - 8}" text-anchor="middle">{escape(chart.x_label)}</text>'
                 f'<text transform="translate(14 {TOP + f.plot_h / 2}) rotate(-90)" text-anchor="middle">'
                 f'{escape(chart.y_label)}</text>')
    return parts


def _band(chart: Chart, data: _Finite, f: _Frame) -> list[str]:
    """The fitted line over its shaded prediction interval."""
    band = data.band
    if not (band and band.xs):
        return []
    outline = [f"{f.px(x)},{f.py(h)}" for x, h in zip(band.xs, band.high)]
    outline += [f"{f.px(x)},{f.py(lo)}" for x, lo in reversed(list(zip(band.xs, band.low)))]
    fit_points = " ".join(f"{f.px(x)},{f.py(e)}" for x, e in zip(band.xs, band.estimate))
    return [f'<polygon class="band" points="{" ".join(outline)}" fill="#d62728" fill-opacity="0.15" '
            f'stroke="none"><title>{escape(band.label)}</title></polygon>',
            f'<polyline class="fit" points="{fit_points}" fill="none" stroke="#d62728" stroke-width="2"/>']


def _markers(chart: Chart, data: _Finite, f: _Frame) -> list[str]:
    """A dashed vertical line per marker inside the x range, its label staggered over three rows."""
    inside = (m for m in chart.markers if _finite(m[0]) and f.x_lo <= m[0] <= f.x_hi)
    return [f'<line class="marker" x1="{f.px(x)}" y1="{TOP}" x2="{f.px(x)}" y2="{TOP + f.plot_h}" stroke="#555" '
            f'stroke-dasharray="4 3"/><text x="{f.px(x) + 3}" y="{TOP + 12 + 12 * (k % 3)}" class="marker-label">'
            f'{escape(text[:40])}</text>' for k, (x, text) in enumerate(inside)]


def _error_bars(chart: Chart, data: _Finite, f: _Frame) -> list[str]:
    """Each fitted value as a cross on its interval's bar."""
    return [f'<line class="fit" x1="{f.px(x)}" y1="{f.py(lo)}" x2="{f.px(x)}" y2="{f.py(hi)}" stroke="#d62728"/>'
            f'<path d="M{f.px(x) - 4},{f.py(e) - 4}l8,8m0,-8l-8,8" stroke="#d62728" stroke-width="2"/>'
            for x, e, lo, hi in data.bars]


def _series(chart: Chart, data: _Finite, f: _Frame) -> list[str]:
    """Each named line with its points, a colour per name (a dash per pass over the palette), and the legend under
    the plot: LEGEND_MAX names, the rest counted."""
    parts: list[str] = []
    for i, (name, line) in enumerate(sorted(data.series.items())):
        color = PALETTE[i % len(PALETTE)]
        pattern = DASHES[(i // len(PALETTE)) % len(DASHES)]
        dash = f' stroke-dasharray="{pattern}"' if pattern else ""
        pts = sorted(line)
        parts.append(f'<polyline class="series" points="{" ".join(f"{f.px(x)},{f.py(y)}" for x, y in pts)}" '
                     f'fill="none" stroke="{color}" stroke-width="2"{dash}><title>{escape(name)}</title></polyline>')
        parts += [f'<circle cx="{f.px(x)}" cy="{f.py(y)}" r="3" fill="{color}"><title>{escape(name)}: {_label(x)}, '
                  f'{_label(y)}</title></circle>' for x, y in pts]
        if i < LEGEND_MAX:  # under the plot, a swatch of the line's colour and dash before each name
            y = HEIGHT + 4 + LEGEND_ROW * i + LEGEND_ROW / 2
            parts.append(f'<line class="legend-swatch" x1="{LEFT}" y1="{y}" x2="{LEFT + 24}" y2="{y}" stroke="{color}" '
                         f'stroke-width="2"{dash}/><text x="{LEFT + 30}" y="{y + 4}" class="legend">{escape(name[:90])}</text>')
    if len(data.series) > LEGEND_MAX:
        parts.append(f'<text x="{LEFT}" y="{HEIGHT + 4 + LEGEND_ROW * LEGEND_MAX + 12}" class="legend">… and '
                     f'{len(data.series) - LEGEND_MAX} more (hover a line for its name)</text>')
    return parts


def _points(chart: Chart, data: _Finite, f: _Frame) -> list[str]:
    """Each labelled point, its hover text naming the axes as the chart does (sim, device)."""
    return [f'<circle class="point" cx="{f.px(x)}" cy="{f.py(y)}" r="4" fill="#1f77b4">'
            f'<title>{escape(name)}: {escape(chart.point_axes[0])} {_label(x)}, {escape(chart.point_axes[1])} '
            f'{_label(y)}</title></circle>'
            f'<text x="{f.px(x) + 5}" y="{f.py(y) - 5}" class="point-label">{escape(name[:40])}</text>'
            for name, x, y in data.points]


def _note(chart: Chart, data: _Finite, f: _Frame) -> list[str]:
    """The note (formula, R²) in the top-left corner, a row per line."""
    return [f'<text x="{LEFT + 8}" y="{TOP + 16 + 14 * i}" class="note">{escape(text)}</text>'
            for i, text in enumerate(chart.note.splitlines())]


# The plot's layers, back to front: what render draws over the frame, in this order.
_LAYERS: tuple[Callable[[Chart, _Finite, _Frame], list[str]], ...] = (
    _axes, _band, _markers, _error_bars, _series, _points, _note)
