"""A run's per-iteration timings and telemetry samples, packed into one value each (issue 22).

A row per sample cost 38 bytes of table and index for each 8-byte timing; packed, a run's 100 timings take
about 310 bytes. The first byte names the format, so a later one can be added, and every format farm ever
wrote still reads:
  1  the plain arrays, exact: IEEE 754 float64 timings and times, int64 memory, little-endian
  2  the same, zlib-compressed (telemetry when it is smaller; timings were compressed so before 2026-11-28)
  3  integers on each figure's grid (since 2026-11-29, what farm writes): timings in whole nanoseconds (the
     resolution of the clock that measures them), telemetry times in microseconds, CPU % in thousandths of
     a percent, memory in bytes; each column stored as its smallest value and the offsets from it in as
     many bytes as the largest needs, lowest byte of every offset first (docs/measurement.md, "How
     precisely a run is kept"); never compressed (zlib saved a fifth of telemetry's ~200 bytes for more CPU
     than the rest of packing)
Format 1 layout — timings: float64[n]; telemetry: t_s float64[n], cpu_percent float64[n], memory_bytes
int64[n]; a missing figure is NaN (a float) or the int64 minimum (memory). Format 3 layout: n as uint32,
then per column (one for timings; t_s, cpu_percent, memory_bytes for telemetry) its base as int64, its
width in bytes (0-8) as uint8 and `width` planes of n bytes. A figure format 3 cannot hold (missing, not
finite, beyond 2**53 units) keeps the run in format 1 (or 2), exact. The same bytes work in any database
(a PostgreSQL store keeps them in a bytea).
"""

from __future__ import annotations

import math
import struct
import sys
import zlib
from array import array
from typing import Any, Iterable, Sequence, cast

import numpy as np

from farm.controller.store.rows import TelemetrySampleRow

PLAIN, ZLIB, GRID = 1, 2, 3
NO_MEMORY = -(1 << 63)
NS_PER_MS = 1e6  # timings: milliseconds on the wire, whole nanoseconds stored
US_PER_S = 1e6  # telemetry times: seconds on the wire, whole microseconds stored
MILLI_PER_PERCENT = 1e3  # CPU %: thousandths of a percent stored
_GRID_LIMIT = float(1 << 53)  # beyond it a float's units are not whole numbers any more: format 1
_BIG_ENDIAN = sys.byteorder == "big"
_COUNT = struct.Struct("<I")
_COLUMN = struct.Struct("<qB")


class PackedSamplesError(ValueError):
    """Bytes that are not packed samples farm wrote (damaged, or from a newer farm)."""


def _little_endian(values: array[Any]) -> bytes:
    if _BIG_ENDIAN:
        values.byteswap()
    return values.tobytes()


def _from_little_endian(kind: str, data: bytes) -> array[Any]:
    values: array[Any] = array(kind)
    values.frombytes(data)
    if _BIG_ENDIAN:
        values.byteswap()
    return values


def _frame(body: bytes) -> bytes:
    squeezed = zlib.compress(body, 6)
    return bytes([ZLIB]) + squeezed if len(squeezed) < len(body) else bytes([PLAIN]) + body


def _body(data: bytes) -> tuple[int, bytes]:
    """(PLAIN or GRID, the uncompressed body)."""
    if not data:
        raise PackedSamplesError("empty packed samples")
    if data[0] in (PLAIN, GRID):
        return data[0], data[1:]
    if data[0] == ZLIB:
        try:
            return PLAIN, zlib.decompress(data[1:])
        except zlib.error as e:
            raise PackedSamplesError(f"damaged packed samples: {e}") from None
    raise PackedSamplesError(f"packed samples in format {data[0]}, which this farm does not know (a newer farm?)")


def _float(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _on_grid(values: array[float], units: tuple[float, ...]) -> bytes | None:
    """`values`, len(units) columns one after the other, each in whole units of its own (rounded half to even) as
    format 3's columns: by frame of reference, its smallest value, then each value's offset from it in the fewest
    whole bytes that hold the largest offset, lowest byte first. None where a value is not finite or beyond 2**53
    units (no longer a whole number in a float64)."""
    if not values:
        return _COLUMN.pack(0, 0) * len(units)
    scaled = np.frombuffer(values, dtype=np.float64).reshape(len(units), -1) * _scales(units)
    np.rint(scaled, out=scaled)  # half to even, as round()
    lows, highs = scaled.min(axis=1), scaled.max(axis=1)  # a NaN comes out of both
    low_list, high_list = lows.tolist(), highs.tolist()
    if not all(-_GRID_LIMIT < v < _GRID_LIMIT for v in low_list + high_list):
        return None
    planes = (scaled - lows[:, None]).astype("<u8").view(np.uint8).reshape(*scaled.shape, 8)  # exact: < 2**54
    out = []
    for low, high, column in zip(low_list, high_list, planes):
        width = (int(high - low).bit_length() + 7) // 8
        out += [_COLUMN.pack(int(low), width), column[:, :width].T.tobytes()]
    return b"".join(out)


_SCALES: dict[tuple[float, ...], np.ndarray] = {}


def _scales(units: tuple[float, ...]) -> np.ndarray:
    if units not in _SCALES:
        _SCALES[units] = np.array(units)[:, None]
    return _SCALES[units]


def _read_column(body: bytes, at: int, n: int) -> tuple[np.ndarray, int]:
    """The column at offset `at` of a format 3 body (int64), and the offset after it."""
    if len(body) < at + _COLUMN.size:
        raise PackedSamplesError(f"packed samples end inside a column's header (byte {at} of {len(body)})")
    base, width = _COLUMN.unpack_from(body, at)
    at += _COLUMN.size
    if width > 8 or len(body) < at + width * n:
        raise PackedSamplesError(f"a packed column of {n} values, {width} bytes each, does not fit the "
                                 f"{len(body) - at} bytes left")
    raw = np.zeros((n, 8), dtype=np.uint8)
    raw[:, :width] = np.frombuffer(body, dtype=np.uint8, count=width * n, offset=at).reshape(width, n).T
    offsets = raw.view("<u8").reshape(n).astype(np.uint64)
    return (offsets + np.uint64(base % (1 << 64))).view(np.int64), at + width * n


def _grid_columns(body: bytes, columns: int) -> list[np.ndarray]:
    if len(body) < _COUNT.size:
        raise PackedSamplesError("packed samples too short for their count")
    (n,), at, out = _COUNT.unpack_from(body), _COUNT.size, []
    for _ in range(columns):
        values, at = _read_column(body, at, n)
        out.append(values)
    if at != len(body):
        raise PackedSamplesError(f"{len(body) - at} bytes after the packed samples' last column")
    return out


def pack_iterations(values: Sequence[float | None], *, exact: bool = False) -> bytes:
    """Timings in ms: whole nanoseconds (format 3), or float64 as given (format 1) where `exact` or where one
    is missing, not finite or beyond 2**53 ns."""
    timings: array[float]
    try:
        timings = array("d", cast("Sequence[float]", values))  # a None is refused here, and mapped below
    except TypeError:
        timings = array("d", (_float(v) for v in values))
        exact = True  # a missing timing stays NaN
    ns = None if exact else _on_grid(timings, (NS_PER_MS,))
    if ns is None:
        return bytes([PLAIN]) + _little_endian(timings)
    return bytes([GRID]) + _COUNT.pack(len(timings)) + ns


def unpack_iterations(data: bytes) -> list[float]:
    kind, body = _body(data)
    if kind == GRID:
        (ns,) = _grid_columns(body, 1)
        return cast("list[float]", (ns / NS_PER_MS).tolist())
    if len(body) % 8:
        raise PackedSamplesError(f"packed timings of {len(body)} bytes: not whole float64 values")
    return list(_from_little_endian("d", body))


def _telemetry_on_grid(rows: list[tuple[float | None, float | None, int | None]]) -> bytes | None:
    """Format 3's body, or None where a figure is missing or beyond the grid (format 1 keeps it)."""
    try:
        times = array("d", cast("list[float]", [r[0] for r in rows]))
        cpu = array("d", cast("list[float]", [r[1] for r in rows]))
        memory = array("d", array("q", cast("list[int]", [r[2] for r in rows])))  # whole numbers: exact below 2**53
    except (TypeError, OverflowError):  # a missing figure (None), memory given as a float or beyond int64
        return None
    columns = _on_grid(times + cpu + memory, (US_PER_S, MILLI_PER_PERCENT, 1.0))
    return None if columns is None else _COUNT.pack(len(rows)) + columns


def pack_telemetry(samples: Iterable[tuple[float | None, float | None, int | None]], *, exact: bool = False) -> bytes:
    """(t_s, cpu_percent, memory_bytes) of each sample, in order: on their grids (format 3), or float64/int64 as
    given (format 1, or 2 when zlib makes it smaller) where `exact` or where a figure is missing."""
    rows = list(samples)
    grid = None if exact else _telemetry_on_grid(rows)
    if grid is not None:
        return bytes([GRID]) + grid
    times = array("d", (_float(t) for t, _, _ in rows))
    cpu = array("d", (_float(c) for _, c, _ in rows))
    memory = array("q", (NO_MEMORY if m is None else int(m) for _, _, m in rows))
    return _frame(_little_endian(times) + _little_endian(cpu) + _little_endian(memory))


def unpack_telemetry(data: bytes) -> list[TelemetrySampleRow]:
    kind, body = _body(data)
    if kind == GRID:
        return _telemetry_from_grid(body)
    if len(body) % 24:
        raise PackedSamplesError(f"packed telemetry of {len(body)} bytes: not whole samples of 24 bytes")
    n = len(body) // 24
    times = _from_little_endian("d", body[:8 * n])
    cpu = _from_little_endian("d", body[8 * n:16 * n])
    memory = _from_little_endian("q", body[16 * n:])
    return [TelemetrySampleRow(times[i], None if math.isnan(cpu[i]) else cpu[i],
                            None if memory[i] == NO_MEMORY else memory[i]) for i in range(n)]


def _telemetry_from_grid(body: bytes) -> list[TelemetrySampleRow]:
    us, milli, memory = _grid_columns(body, 3)
    return [TelemetrySampleRow(t, c, m) for t, c, m in
            zip((us / US_PER_S).tolist(), (milli / MILLI_PER_PERCENT).tolist(), memory.tolist())]


assert struct.calcsize("<d") == array("d").itemsize == 8 and array("q").itemsize == array("Q").itemsize == 8
