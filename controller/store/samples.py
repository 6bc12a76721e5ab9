"""A run's per-iteration timings and telemetry samples, packed into one value each (issue 22).

A row per sample cost 38 bytes of table and index for each 8-byte timing; packed, a run's 100 timings take
about 310 bytes. The first byte names the format, so a later one can be added, and every format farm ever
wrote still reads:
  1  the plain arrays, exact: IEEE 754 float64 timings and times, int64 memory, little-endian
  2  the same, zlib-compressed (telemetry when it is smaller; timings were compressed so before 2026-11-28)
  3  timings only (since 2026-11-29, what farm writes for them): whole nanoseconds, the resolution of the
     clock that measures them, by frame of reference — n as uint32, the smallest value as int64, the width
     in bytes (0-8) of the largest offset from it as uint8, then `width` planes of n bytes, the lowest byte
     of every offset first (docs/measurement.md, "How precisely a run is kept")
Format 1 layout — timings: float64[n]; telemetry: t_s float64[n], cpu_percent float64[n], memory_bytes
int64[n]; a missing figure is NaN (a float) or the int64 minimum (memory). Timings format 3 cannot hold
(one missing, not finite, or beyond 2**53 ns) are kept exact in format 1, as is the schema-15 conversion of
older stores. Telemetry stays format 1 or 2: on a grid it took ~100 bytes less a run for twice zlib's CPU.
Neither is compressed past that: measured timings are noise in their low bytes. The same bytes work in any
database (a PostgreSQL store keeps them in a bytea).
"""

from __future__ import annotations

import math
import struct
import sys
import zlib
from array import array
from typing import Any, Iterable, Sequence, cast

from farm.controller.store.rows import TelemetrySampleRow

PLAIN, ZLIB, NANOSECONDS = 1, 2, 3
NO_MEMORY = -(1 << 63)
NS_PER_MS = 1e6  # timings: milliseconds on the wire, whole nanoseconds stored
_GRID_LIMIT = float(1 << 53)  # beyond it a float64's nanoseconds are not whole numbers any more: format 1
_BIG_ENDIAN = sys.byteorder == "big"
_HEADER = struct.Struct("<IqB")  # count, base, width
_MOST = 1 << 24  # timings a packed value may claim (a run keeps MAX_SAMPLES): a damaged count is refused, not allocated


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


def _body(data: bytes) -> bytes:
    if not data:
        raise PackedSamplesError("empty packed samples")
    if data[0] == PLAIN:
        return data[1:]
    if data[0] == ZLIB:
        try:
            return zlib.decompress(data[1:])
        except zlib.error as e:
            raise PackedSamplesError(f"damaged packed samples: {e}") from None
    raise PackedSamplesError(f"packed samples in format {data[0]}, which this farm does not know (a newer farm?)")


def _float(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _nanoseconds(timings: array[float]) -> bytes | None:
    """Format 3: each timing in whole nanoseconds (rounded half to even), as its smallest value and each one's
    offset from it in the fewest whole bytes that hold the largest; None where one is not finite or beyond
    2**53 ns. A few vectorised steps: a loop per timing cost ten times as much."""
    import numpy as np  # here, not at module load: `farm jobs` opens the store and must not load numpy

    if not timings:
        return _HEADER.pack(0, 0, 0)
    ns = np.frombuffer(timings, dtype=np.float64) * NS_PER_MS
    np.rint(ns, out=ns)
    low, high = float(ns.min()), float(ns.max())  # a NaN comes out of both
    if not -_GRID_LIMIT < low <= high < _GRID_LIMIT:
        return None
    width = (int(high - low).bit_length() + 7) // 8
    ns -= low  # whole numbers below 2**54: exact
    planes = ns.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :width].T  # lowest byte of every offset first
    return _HEADER.pack(len(timings), int(low), width) + planes.tobytes()


def _from_nanoseconds(body: bytes) -> list[float]:
    import numpy as np

    if len(body) < _HEADER.size:
        raise PackedSamplesError(f"packed timings of {len(body)} bytes: shorter than their header")
    n, base, width = _HEADER.unpack_from(body)
    if width > 8 or len(body) != _HEADER.size + width * n or n > _MOST:
        raise PackedSamplesError(f"packed timings of {len(body)} bytes: not {n} offsets of {width} bytes after "
                                 "their header")
    raw = np.zeros((n, 8), dtype=np.uint8)
    raw[:, :width] = np.frombuffer(body, dtype=np.uint8, offset=_HEADER.size).reshape(width, n).T
    offsets = raw.view("<u8").reshape(n).astype(np.uint64)
    ns = (offsets + np.uint64(base % (1 << 64))).view(np.int64)  # wraps as the int64 difference did
    return cast("list[float]", (ns / NS_PER_MS).tolist())


def pack_iterations(values: Sequence[float | None], *, exact: bool = False) -> bytes:
    """Timings in ms: whole nanoseconds (format 3), or float64 as given (format 1) where `exact` or where one is
    missing, not finite or beyond 2**53 ns."""
    timings: array[float]
    try:
        timings = array("d", cast("Sequence[float]", values))  # a None is refused here, and mapped below
    except TypeError:
        timings = array("d", (_float(v) for v in values))
        exact = True  # a missing timing stays NaN
    packed = None if exact else _nanoseconds(timings)
    return bytes([PLAIN]) + _little_endian(timings) if packed is None else bytes([NANOSECONDS]) + packed


def unpack_iterations(data: bytes) -> list[float]:
    if data[:1] == bytes([NANOSECONDS]):
        return _from_nanoseconds(data[1:])
    body = _body(data)
    if len(body) % 8:
        raise PackedSamplesError(f"packed timings of {len(body)} bytes: not whole float64 values")
    return list(_from_little_endian("d", body))


def pack_telemetry(samples: Iterable[tuple[float | None, float | None, int | None]]) -> bytes:
    """(t_s, cpu_percent, memory_bytes) of each sample, in order."""
    rows = list(samples)
    times: array[float]
    cpu: array[float]
    memory: array[int]
    try:  # every figure present and typed (a result off the wire): the columns as they are (a None is refused here)
        times = array("d", cast("list[float]", [r[0] for r in rows]))
        cpu = array("d", cast("list[float]", [r[1] for r in rows]))
        memory = array("q", cast("list[int]", [r[2] for r in rows]))
    except TypeError:  # a missing figure (None), or memory given as a float
        times = array("d", (_float(t) for t, _, _ in rows))
        cpu = array("d", (_float(c) for _, c, _ in rows))
        memory = array("q", (NO_MEMORY if m is None else int(m) for _, _, m in rows))
    return _frame(_little_endian(times) + _little_endian(cpu) + _little_endian(memory))


def unpack_telemetry(data: bytes) -> list[TelemetrySampleRow]:
    body = _body(data)
    if len(body) % 24:
        raise PackedSamplesError(f"packed telemetry of {len(body)} bytes: not whole samples of 24 bytes")
    n = len(body) // 24
    times = _from_little_endian("d", body[:8 * n])
    cpu = _from_little_endian("d", body[8 * n:16 * n])
    memory = _from_little_endian("q", body[16 * n:])
    return [TelemetrySampleRow(times[i], None if math.isnan(cpu[i]) else cpu[i],
                            None if memory[i] == NO_MEMORY else memory[i]) for i in range(n)]


assert struct.calcsize("<d") == array("d").itemsize == 8 and array("q").itemsize == 8  # the format's sizes
