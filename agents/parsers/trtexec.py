"""NVIDIA `trtexec` (TensorRT) output as pure functions (issue 29): the performance summary, the engine's build or
load, the version, DLA placement and fallbacks, the warnings that change what a figure means, and the per-layer
`--dumpProfile` table in both layouts; `--exportTimes` JSON for per-inference times.

Formats from real captured runs of TensorRT 7.x to 10.x (shared/reference/accelerator_tools.md §1, copied into
tests/fixtures/trtexec/): every line carries `[MM/DD/YYYY-HH:MM:SS] [S] ` and maybe `[TRT] `; `&&&& PASSED` /
`&&&& FAILED` is the only authoritative status; percentiles are parsed generically; 0 ms transfers are readings.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

_PREFIX = re.compile(r"^\s*(?:\[\d\d/\d\d/\d{4}-\d\d:\d\d:\d\d\]\s*)?(?:\[[IWEV]\]\s*)?(?:\[TRT\]\s*)?(?:\[[IWEV]\]\s*)?")
_STATUS = re.compile(r"^&&&& (RUNNING|PASSED|FAILED) TensorRT\.trtexec(?: \[TensorRT v(\d+)\])?")
_STAT = re.compile(r"^(Latency|End-to-End Host Latency|Enqueue Time|H2D Latency|GPU Compute Time|D2H Latency): (.*)$")
_PAIR = re.compile(r"(min|max|mean|median|percentile\((\d+(?:\.\d+)?)%\)) = ([-+0-9.eE]+) ms")
_NUMBER = r"([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"
_THROUGHPUT = re.compile(rf"^Throughput: {_NUMBER} qps")
_WALLTIME = re.compile(rf"^Total Host Walltime: {_NUMBER} s")
_GPU_TOTAL = re.compile(rf"^Total GPU Compute Time: {_NUMBER} s")
_BUILT = re.compile(rf"^Engine built in {_NUMBER} sec")
_LOADED = re.compile(rf"^Engine (?:loaded|deserialized) in {_NUMBER} sec")
_ENGINE_SIZE = re.compile(rf"^(?:Created engine with size|Loaded engine size): {_NUMBER} MiB")
_VERSION = re.compile(r"^TensorRT version: (\d+(?:\.\d+)*)")
_DEVICE = re.compile(r"^Selected Device: (.+)$")
_QUERIES = re.compile(rf"^Timing trace has (\d+) queries over {_NUMBER} s")
_PROFILE_HEAD = re.compile(r"^=== Profile \((\d+) iterations ?\) ===")
_NAME_FIRST_ROW = re.compile(rf"^(.*?)\s+{_NUMBER}\s+{_NUMBER}(?:\s+{_NUMBER})?\s+{_NUMBER}$")
_NAME_LAST_ROW = re.compile(rf"^{_NUMBER}\s+{_NUMBER}\s+{_NUMBER}\s+{_NUMBER}\s+(.+)$")
_DLA_FALLBACK = re.compile(r"(?:Layer '(.+?)' \((\w+)\): Unsupported on DLA\. Switching this layer's device type to GPU"
                           r"|layer (.+?) is not (?:supported|running) on DLA, falling back to GPU"
                           r"|Switching (.+?) device type to GPU)")
_NOT_NATIVE = re.compile(r"(FP16|Half2|Int8) support requested on hardware without native")
MAX_PROFILE_ROWS = 2000
MAX_TIMES = 100_000


class TrtexecOutputError(ValueError):
    """trtexec printed no summary farm can read (a crash mid-build, a cut output); the message says what was seen."""


@dataclass
class Stat:
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    median: float | None = None
    percentiles: dict[str, float] = field(default_factory=dict)  # "90" -> ms


@dataclass
class ProfileRow:
    layer: str
    total_ms: float
    avg_ms: float
    median_ms: float | None
    percent: float


@dataclass
class TrtexecOutput:
    status: str | None = None  # PASSED | FAILED | None (the tool never said: killed, cut)
    version: str | None = None  # "8.5.2", "10.9.0"
    device: str | None = None
    throughput_qps: float | None = None
    stats: dict[str, Stat] = field(default_factory=dict)  # "Latency", "GPU Compute Time", "H2D Latency", ...
    host_walltime_s: float | None = None
    gpu_compute_total_s: float | None = None
    queries: int | None = None
    engine_build_s: float | None = None
    engine_load_s: float | None = None
    engine_size_mib: float | None = None
    profile_iterations: int | None = None
    profile: list[ProfileRow] = field(default_factory=list)
    profile_total_ms: float | None = None  # the table's Total row: all layers of one inference, on average
    legacy_summary: bool = False  # TensorRT 7.x's multi-line layout (`Host Latency` / `min: …`), not read
    summary_skipped_for_profile: bool = False  # --dumpProfile without --separateProfileRun: no summary exists
    dla_fallbacks: list[str] = field(default_factory=list)  # layers moved from DLA to the GPU
    layers_on_dla: int = 0
    layers_on_gpu: int = 0
    precision_not_native: list[str] = field(default_factory=list)  # "FP16": asked for, silently not used
    warnings: list[str] = field(default_factory=list)  # unstable GPU time, enqueue-bound throughput
    errors: list[str] = field(default_factory=list)  # [E] lines

    @property
    def has_summary(self) -> bool:
        return "Latency" in self.stats or "GPU Compute Time" in self.stats


def version_from_code(code: str) -> str:
    """The banner's version code: 8502 -> 8.5.2 (8.x: M*1000+m*100+p), 100900 -> 10.9.0 (10.x: M*10000+m*100+p)."""
    n = int(code)
    if n >= 100000:
        return f"{n // 10000}.{n // 100 % 100}.{n % 100}"
    return f"{n // 1000}.{n // 100 % 10}.{n % 100}"


def _finite(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _stat(text: str) -> Stat:
    s = Stat()
    for name, p, value in _PAIR.findall(text):
        v = _finite(value)
        if v is None:
            continue
        if p:
            s.percentiles[p.rstrip("0").rstrip(".") if "." in p else p] = v
        else:
            setattr(s, name, v)
    return s


def _strip(line: str) -> tuple[str, str]:
    """(severity letter or "", the text without the time, severity and [TRT] tags)."""
    m = re.search(r"\[([IWEV])\]", line[:40])
    return (m.group(1) if m else ""), _PREFIX.sub("", line).rstrip()


def parse_trtexec(text: str) -> TrtexecOutput:
    """trtexec's whole output, a line at a time: the status banner, then a --dumpProfile table's rows while one is
    open, else the first of the summary's and the build's lines (_read_line) that the line is."""
    out = TrtexecOutput()
    in_profile = False
    for raw in text.splitlines():
        if _read_status(out, raw):
            continue
        severity, line = _strip(raw)
        in_profile = _read_profile_line(out, line) if in_profile else _read_line(out, severity, line)
    return out


def _read_status(out: TrtexecOutput, raw: str) -> bool:
    """The `&&&& PASSED/FAILED` banner (the only authoritative status) and its version code; False: not one."""
    m = _STATUS.match(raw.strip())
    if m is None:
        return False
    if m.group(1) != "RUNNING":
        out.status = m.group(1)
    if m.group(2):
        out.version = out.version or version_from_code(m.group(2))
    return True


def _read_profile_line(out: TrtexecOutput, line: str) -> bool:
    """A row of the open --dumpProfile table (its Total row apart, at most MAX_PROFILE_ROWS); False: the blank line
    that ends the table."""
    if not line:
        return False
    row = _profile_row(line)
    if row is not None:
        if row.layer == "Total":
            out.profile_total_ms = row.avg_ms
        elif len(out.profile) < MAX_PROFILE_ROWS:
            out.profile.append(row)
    return True


# A figure of one line: (its pattern, the field set from the pattern's first group, the conversion, whether the first
# such line stays). In the order they are tried, after the statistics lines and before the profile head.
_FIGURES: tuple[tuple[re.Pattern[str], str, Callable[[str], Any], bool], ...] = (
    (_THROUGHPUT, "throughput_qps", _finite, False),
    (_WALLTIME, "host_walltime_s", _finite, False),
    (_GPU_TOTAL, "gpu_compute_total_s", _finite, False),
    (_BUILT, "engine_build_s", _finite, False),
    (_LOADED, "engine_load_s", _finite, True),
    (_ENGINE_SIZE, "engine_size_mib", _finite, True),  # the built engine's own size first (its reload rounds it)
    (_VERSION, "version", str, False),
    (_DEVICE, "device", lambda text: text[:200], False),
    (_QUERIES, "queries", int, False),
)


def _read_line(out: TrtexecOutput, severity: str, line: str) -> bool:
    """A line outside a profile table: a statistics line, a figure (_FIGURES), the profile's head, or a note;
    True: a profile table starts."""
    if m := _STAT.match(line):
        out.stats[m.group(1)] = _stat(m.group(2))
        return False
    for pattern, name, convert, first_stays in _FIGURES:
        if m := pattern.match(line):
            if not (first_stays and getattr(out, name) is not None):
                setattr(out, name, convert(m.group(1)))
            return False
    if m := _PROFILE_HEAD.match(line):
        out.profile_iterations = int(m.group(1))
        return True
    _read_note(out, severity, line)
    return False


def _read_note(out: TrtexecOutput, severity: str, line: str) -> None:
    """What changes what a figure means: the legacy layout, a skipped summary, DLA placement and fallbacks, a
    precision the hardware lacks, [W] bullet warnings, [E] errors (bounded)."""
    if line in ("Host Latency", "GPU Compute") or line.startswith("throughput: "):
        out.legacy_summary = True
    elif "e2e network timing is not reported" in line:
        out.summary_skipped_for_profile = True
    elif line.startswith("[DlaLayer]"):
        out.layers_on_dla += 1
    elif line.startswith("[GpuLayer]"):
        out.layers_on_gpu += 1
    elif m := _DLA_FALLBACK.search(line):
        if len(out.dla_fallbacks) < 200:
            out.dla_fallbacks.append((m.group(1) or m.group(3) or m.group(4) or "")[:200])
    elif m := _NOT_NATIVE.search(line):
        out.precision_not_native.append({"Half2": "FP16"}.get(m.group(1), m.group(1).upper()))
    elif severity == "W" and line.startswith("* "):
        out.warnings.append(line[2:][:300])
    elif severity == "E" and len(out.errors) < 20:
        out.errors.append(line[:300])


def _profile_row(line: str) -> ProfileRow | None:
    """A --dumpProfile row: name last (8.6+: four numbers first) or name first (≤ 8.5: numbers from the right)."""
    if line.split()[0:1] in (["Layer"], ["Time(ms)"]):
        return None  # the header
    if m := _NAME_LAST_ROW.match(line):
        total, avg, median, percent = (float(m.group(i)) for i in range(1, 5))
        return ProfileRow(m.group(5).strip()[:300], total, avg, median, percent)
    if m := _NAME_FIRST_ROW.match(line):
        middle = float(m.group(4)) if m.group(4) is not None else None  # the median column (8.4, 8.5)
        return ProfileRow(m.group(1).strip()[:300], float(m.group(2)), float(m.group(3)), middle, float(m.group(5)))
    return None


def parse_export_times(text: str) -> list[float]:
    """--exportTimes JSON: each timed inference's latencyMs (H2D + compute + D2H), in order; [] if unreadable."""
    try:
        records = json.loads(text)
    except ValueError:
        return []
    if not isinstance(records, list):
        return []
    out = []
    for r in records[:MAX_TIMES]:
        value = r.get("latencyMs") if isinstance(r, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
            out.append(float(value))
    return out


def summary_problem(out: TrtexecOutput) -> str | None:
    """Why the output cannot be a measurement; None when it can."""
    if out.status == "FAILED":
        return "trtexec failed" + (f": {out.errors[-1]}" if out.errors else "")
    if out.summary_skipped_for_profile and not out.has_summary:
        return None if out.profile else "trtexec printed a profile run only and no layer table"
    if not out.has_summary and out.legacy_summary:
        return "this is TensorRT 7.x's summary layout, which farm does not read; TensorRT 8.0 or newer is"
    if not out.has_summary:
        seen = "an engine build" if out.engine_build_s is not None else "no engine"
        return (f"trtexec printed no performance summary (it stopped after {seen}"
                + ("; cut short or killed)" if out.status is None else ")"))
    if out.status is None:
        return "trtexec's output ends without its PASSED line (cut short or killed)"
    return None
