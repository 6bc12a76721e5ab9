"""Parse what TFLite's (and TensorFlow 1's) `benchmark_model` prints into a typed result.

Three generations of the summary are accepted:

- TF ≤ ~1.13: ``Average inference timings in us: Warmup: …, Init: …, Inference: …`` (TFLite) or
  ``… Warmup: …, no stats: …, with stats: …`` (TensorFlow's own tool, glog-prefixed lines);
- TF ≤ 2.4: ``Inference timings in us: Init: …, First inference: …, Warmup (avg): …, Inference (avg): …``
  with ``Peak memory footprint (MB): init=… overall=…``;
- newer: the same timing line, ``Memory footprint delta from the start of the tool (MB): init=… overall=…``,
  optionally ``Overall peak memory footprint (MB) via periodic monitoring: …``, ``INFO: `` prefixes,
  ``p5= median= p95=`` on stats lines.

All times the tool prints in microseconds are converted to milliseconds here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable

from farm.proto.results import LatencyStats

__all__ = [
    "BenchmarkModelOutput",
    "BenchmarkOutputError",
    "MemoryKind",
    "OpRow",
    "OpTypeRow",
    "RunStatsLine",
    "UnsupportedOperatorError",
    "parse_benchmark_model",
]


class BenchmarkOutputError(ValueError):
    """The text is not a complete benchmark_model report; the raw text is kept for the run's log."""

    def __init__(self, message: str, raw_text: str) -> None:
        super().__init__(message)
        self.raw_text = raw_text


class UnsupportedOperatorError(BenchmarkOutputError):
    """The runtime on the device lacks an operator the model uses (a `job` failure, never retried)."""

    def __init__(self, operator: str, raw_text: str) -> None:
        super().__init__(f"the device's TFLite runtime does not support operator {operator}", raw_text)
        self.operator = operator


class MemoryKind(StrEnum):
    PEAK = "peak"  # TF ≤ 2.4: "Peak memory footprint"
    DELTA = "delta"  # newer: "Memory footprint delta from the start of the tool"


@dataclass
class RunStatsLine:
    """One ``count=… first=… curr=… min=… max=… avg=… std=…`` line, converted to milliseconds."""

    count: int
    first_ms: float | None = None
    curr_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    avg_ms: float | None = None
    std_ms: float | None = None
    p5_ms: float | None = None
    median_ms: float | None = None
    p95_ms: float | None = None


@dataclass
class OpRow:
    """A row of the "Run Order" table: one node of the graph."""

    node_type: str
    start_ms: float | None  # only older tools print [start]
    first_ms: float | None
    avg_ms: float
    percent: float
    cdf_percent: float
    mem_kb: float | None
    times_called: int | None
    name: str


@dataclass
class OpTypeRow:
    """A row of the "Summary by node type" table."""

    node_type: str
    count: int | None  # nodes of this type in the graph
    avg_ms: float
    percent: float
    cdf_percent: float
    mem_kb: float | None
    times_called: int | None


@dataclass
class BenchmarkModelOutput:
    generation: str  # "average-timings" (TF ≤ 1.13) | "inference-timings"
    avg_ms: float
    init_ms: float | None = None
    first_ms: float | None = None
    warmup_avg_ms: float | None = None
    std_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    count: int | None = None
    p5_ms: float | None = None
    median_ms: float | None = None
    p95_ms: float | None = None
    memory_kind: MemoryKind | None = None
    memory_init_mb: float | None = None
    memory_overall_mb: float | None = None
    periodic_peak_mb: float | None = None  # "via periodic monitoring": a true peak, not a delta
    model_size_mb: float | None = None
    warmup: RunStatsLine | None = None
    inference: RunStatsLine | None = None
    op_types: list[OpTypeRow] = field(default_factory=list)  # regular benchmark runs
    run_order: list[OpRow] = field(default_factory=list)
    init_op_types: list[OpTypeRow] = field(default_factory=list)  # "Profiling Info for Benchmark Initialization"

    def to_latency_stats(self) -> LatencyStats:
        """Farm's latency summary. benchmark_model prints no p90/p99, so those are NaN (stored as NULL);
        p50 is the tool's own `median=` when it printed one, else NaN: a median cannot be derived from
        avg/std/min/max without assuming a distribution."""
        nan = math.nan
        return LatencyStats(
            init=self.init_ms,
            first=self.first_ms,
            warmup_avg=self.warmup_avg_ms,
            avg=self.avg_ms,
            p50=self.median_ms if self.median_ms is not None else nan,
            p90=nan,
            p99=nan,
            std=self.std_ms if self.std_ms is not None else nan,
            min=self.min_ms if self.min_ms is not None else nan,
            max=self.max_ms if self.max_ms is not None else nan,
            count=self.count or 0,
        )


_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
# glog prefix of TensorFlow's own tool: "2017-11-27 08:56:25.158104: I tensorflow/…/benchmark_model.cc:291] "
_GLOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] \S+:\d+\] ?")
_LEVEL_PREFIX = re.compile(r"^(?:INFO|WARNING|ERROR|VERBOSE): ")
# The benchmark app logs through logcat: `05-31 10:38:42.589 22206 22206 I tflite  : <the tool's line>`
_LOGCAT_PREFIX = re.compile(r"^\d\d-\d\d \d\d:\d\d:\d\d\.\d+\s+\d+\s+\d+ [VDIWEF] [\w.]+\s*: ?")
_KEY_VALUE = re.compile(rf"(\w+)=({_NUMBER})")
_TIMINGS_LINE = re.compile(r"(Average inference timings|Inference timings) in us:\s*(.*)$")
_TIMING_ITEM = re.compile(rf"([A-Za-z][A-Za-z ()]*?):\s*({_NUMBER})")
_MEMORY_LINE = re.compile(
    rf"(Peak memory footprint|Memory footprint delta from the start of the tool) \(MB\):\s*"
    rf"init=({_NUMBER})\s+overall=({_NUMBER})")
_PERIODIC_PEAK = re.compile(rf"Overall peak memory footprint \(MB\) via periodic monitoring:\s*({_NUMBER})")
_INIT_SESSION = re.compile(rf"Initialized session in ({_NUMBER})\s*ms")
_MODEL_SIZE = re.compile(rf"The input model file size \(MB\):\s*({_NUMBER})")
_TABLE_TITLE = re.compile(r"^=+\s*(Run Order|Top by Computation Time|Summary by node type)\s*=+$")
_UNSUPPORTED = [
    re.compile(r"Encountered unresolved custom op:\s*([^\s.]+(?:\.[^\s.]+)*?)\.?(?:\s|$)"),
    re.compile(r"Didn't find op for builtin opcode '([^']+)'"),
    re.compile(r"Didn't find custom op for name '([^']+)'"),
    re.compile(r"Op builtin_code out of range: (\d+)"),
]


def _clean_lines(text: str) -> list[str]:
    lines = []
    for raw in text.splitlines():
        line = _GLOG_PREFIX.sub("", _LOGCAT_PREFIX.sub("", raw)).strip()
        line = _LEVEL_PREFIX.sub("", line)
        lines.append(line)
    return lines


def _stats_line(line: str) -> RunStatsLine:
    values = {k: float(v) for k, v in _KEY_VALUE.findall(line)}

    def ms(key: str) -> float | None:
        return values[key] / 1000.0 if key in values else None

    return RunStatsLine(count=int(values["count"]), first_ms=ms("first"), curr_ms=ms("curr"), min_ms=ms("min"),
                        max_ms=ms("max"), avg_ms=ms("avg"), std_ms=ms("std"), p5_ms=ms("p5"),
                        median_ms=ms("median"), p95_ms=ms("p95"))


def _number(cell: str) -> float:
    return float(cell.rstrip("%"))


def _split_row(line: str, numeric_columns: int) -> tuple[str, list[str], str] | None:
    """Node type (may contain spaces), then `numeric_columns` numbers (some with %), then an optional name."""
    pattern = r"^(.+?)" + rf"\s+({_NUMBER}%?)" * numeric_columns + r"(?:\s+(.*))?$"
    match = re.match(pattern, line)
    if match is None:
        return None
    groups = match.groups()
    return groups[0].strip(), list(groups[1:1 + numeric_columns]), (groups[-1] or "").strip()


def _parse_table(lines: list[str], start: int, title: str) -> tuple[list[OpRow] | list[OpTypeRow], int]:
    """Rows of one profiling table beginning after its title line; returns the rows and the next index."""
    i = start
    while i < len(lines) and not lines[i].startswith("["):
        if _TABLE_TITLE.match(lines[i]) or (lines[i] and not lines[i].startswith("[")):
            return [], i
        i += 1
    if i >= len(lines):
        return [], i
    columns = [c.strip().lower() for c in re.findall(r"\[([^\]]+)\]", lines[i])]
    has_name = columns[-1] == "name"
    numeric = columns[1:-1] if has_name else columns[1:]
    rows: list = []
    i += 1
    while i < len(lines) and lines[i] and not lines[i].startswith("="):
        parts = _split_row(lines[i], len(numeric))
        i += 1
        if parts is None:
            continue
        node_type, cells, name = parts
        value = dict(zip(numeric, cells, strict=True))

        def get(*keys: str, value: dict[str, str] = value) -> float | None:
            return next((_number(value[k]) for k in keys if k in value), None)

        times = get("times called")
        if title == "Summary by node type":
            count = get("count")
            rows.append(OpTypeRow(node_type=node_type, count=None if count is None else int(count),
                                  avg_ms=get("avg ms") or 0.0, percent=get("avg %", "%") or 0.0,
                                  cdf_percent=get("cdf %", "cdf%") or 0.0, mem_kb=get("mem kb"),
                                  times_called=None if times is None else int(times)))
        else:
            rows.append(OpRow(node_type=node_type, start_ms=get("start"), first_ms=get("first"),
                              avg_ms=get("avg ms") or 0.0, percent=get("%", "avg %") or 0.0,
                              cdf_percent=get("cdf%", "cdf %") or 0.0, mem_kb=get("mem kb"),
                              times_called=None if times is None else int(times), name=name.strip("[]")))
    return rows, i


def _raise_if_unsupported(text: str) -> None:
    for pattern in _UNSUPPORTED:
        match = pattern.search(text)
        if match:
            op = match.group(1)
            # An out-of-range code is a number only: say so, so the message still names something useful.
            if pattern.pattern.startswith("Op builtin_code"):
                op = f"builtin opcode {op}"
            raise UnsupportedOperatorError(op, text)


@dataclass
class _Scan:
    """What one pass over the cleaned lines found, before the summary is put together."""

    stats_lines: list[RunStatsLine] = field(default_factory=list)
    profiler_timings: RunStatsLine | None = None
    timings: dict[str, float] = field(default_factory=dict)
    generation: str | None = None
    memory: tuple[MemoryKind, float, float] | None = None
    periodic_peak: float | None = None
    init_session: float | None = None
    model_size: float | None = None
    op_types: list[OpTypeRow] = field(default_factory=list)
    init_op_types: list[OpTypeRow] = field(default_factory=list)
    run_order: list[OpRow] = field(default_factory=list)
    section: str = "regular"  # older tools print only the regular runs' tables, without a section title

    def stats(self, match: re.Match[str]) -> None:
        self.stats_lines.append(_stats_line(match.string))

    def profiler(self, match: re.Match[str]) -> None:
        self.profiler_timings = _stats_line(match.string)

    def timing_summary(self, match: re.Match[str]) -> None:
        self.generation = "average-timings" if match.group(1).startswith("Average") else "inference-timings"
        self.timings = {k.strip().lower(): float(v) for k, v in _TIMING_ITEM.findall(match.group(2))}

    def memory_line(self, match: re.Match[str]) -> None:
        kind = MemoryKind.PEAK if match.group(1).startswith("Peak") else MemoryKind.DELTA
        self.memory = (kind, float(match.group(2)), float(match.group(3)))

    def periodic(self, match: re.Match[str]) -> None:
        self.periodic_peak = float(match.group(1))

    def session(self, match: re.Match[str]) -> None:
        self.init_session = float(match.group(1))

    def size(self, match: re.Match[str]) -> None:
        self.model_size = float(match.group(1))

    def init_section(self, match: re.Match[str]) -> None:
        self.section = "init"

    def regular_section(self, match: re.Match[str]) -> None:
        self.section = "regular"

    def table(self, lines: list[str], i: int, title: str) -> int:
        """The profiling table whose title is lines[i], kept where its section says; the index after it."""
        rows, after = _parse_table(lines, i + 1, title)
        if title == "Summary by node type":
            if self.section == "init":
                self.init_op_types = rows  # type: ignore[assignment]
            else:
                self.op_types = rows  # type: ignore[assignment]
        elif title == "Run Order" and self.section == "regular":
            self.run_order = rows  # type: ignore[assignment]
        return after

    def read(self, lines: list[str], i: int) -> int:
        """Line i read by the first rule that matches it (_LINE_RULES); the index of the next line to read."""
        line = lines[i]
        for pattern, step in _LINE_RULES:
            if match := pattern.search(line):
                step(self, match)
                return i + 1
        if match := _TABLE_TITLE.match(line):
            return self.table(lines, i, match.group(1))
        return i + 1


# What a line is, first match wins; a table title (it spans the lines after it) is read apart, after these.
_LINE_RULES: tuple[tuple[re.Pattern[str], Callable[[_Scan, re.Match[str]], None]], ...] = (
    (re.compile(r"^count="), _Scan.stats),
    (re.compile(r"^Timings \(microseconds\): count="), _Scan.profiler),
    (_TIMINGS_LINE, _Scan.timing_summary),
    (_MEMORY_LINE, _Scan.memory_line),
    (_PERIODIC_PEAK, _Scan.periodic),
    (_INIT_SESSION, _Scan.session),
    (_MODEL_SIZE, _Scan.size),
    (re.compile(r"^Profiling Info for Benchmark Initialization"), _Scan.init_section),
    (re.compile(r"^Operator-wise Profiling Info for Regular Benchmark Runs"), _Scan.regular_section),
)


def parse_benchmark_model(text: str) -> BenchmarkModelOutput:
    """Parse the whole stdout+stderr of one benchmark_model run.

    Raises UnsupportedOperatorError when the model uses an operator the runtime lacks, and
    BenchmarkOutputError (with the raw text) when no timing summary or run statistics can be found.
    """
    _raise_if_unsupported(text)
    lines = _clean_lines(text)
    scan = _Scan()
    i = 0
    while i < len(lines):
        i = scan.read(lines, i)
    return _summary(scan, text)


def _summary(scan: _Scan, text: str) -> BenchmarkModelOutput:
    """The scan as the tool's result: its phases (warmup, timed runs), the headline timings, memory, tables."""
    # The first stats line is the warmup phase, the next one the timed runs (TF1 adds a third, profiled, one).
    stats_lines = scan.stats_lines
    warmup = stats_lines[0] if len(stats_lines) >= 2 else None
    inference = stats_lines[1] if len(stats_lines) >= 2 else (stats_lines[0] if stats_lines and scan.timings else None)
    spread = inference or scan.profiler_timings
    avg_ms, init_ms, first_ms, warmup_avg_ms = _headline(scan, warmup, inference, text)
    memory = scan.memory
    return BenchmarkModelOutput(
        generation=scan.generation or "inference-timings",
        avg_ms=avg_ms,
        init_ms=init_ms,
        first_ms=first_ms,
        warmup_avg_ms=warmup_avg_ms,
        std_ms=spread.std_ms if spread else None,
        min_ms=spread.min_ms if spread else None,
        max_ms=spread.max_ms if spread else None,
        count=spread.count if spread else None,
        p5_ms=inference.p5_ms if inference else None,
        median_ms=inference.median_ms if inference else None,
        p95_ms=inference.p95_ms if inference else None,
        memory_kind=memory[0] if memory else None,
        memory_init_mb=memory[1] if memory else None,
        memory_overall_mb=memory[2] if memory else None,
        periodic_peak_mb=scan.periodic_peak,
        model_size_mb=scan.model_size,
        warmup=warmup,
        inference=inference,
        op_types=scan.op_types,
        run_order=scan.run_order,
        init_op_types=scan.init_op_types,
    )


def _headline(scan: _Scan, warmup: RunStatsLine | None, inference: RunStatsLine | None,
              text: str) -> tuple[float, float | None, float | None, float | None]:
    """(avg, init, first, warmup avg) in ms: the timings line's figures, else the stats lines' (init: the session's
    start); BenchmarkOutputError when there is no average at all."""
    timings = scan.timings

    def us(*keys: str) -> float | None:
        for key in keys:
            if key in timings:
                return timings[key] / 1000.0
        return None

    avg_ms = us("inference (avg)", "inference", "no stats")
    if avg_ms is None and inference is not None:
        avg_ms = inference.avg_ms
    if avg_ms is None:
        raise BenchmarkOutputError(
            "benchmark_model printed no inference timings (no 'Inference timings in us' summary and no run "
            "statistics): the tool probably failed; its output is kept", text)

    init_ms = us("init")
    if init_ms is None and scan.init_session is not None:
        init_ms = scan.init_session
    first_ms = us("first inference")
    if first_ms is None and warmup is not None:
        first_ms = warmup.first_ms
    warmup_avg_ms = us("warmup (avg)", "warmup")
    if warmup_avg_ms is None and warmup is not None:
        warmup_avg_ms = warmup.avg_ms
    return avg_ms, init_ms, first_ms, warmup_avg_ms
