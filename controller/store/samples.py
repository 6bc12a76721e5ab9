"""A run's per-iteration timings and telemetry samples, packed into one value each (issue 22).

A row per sample cost 38 bytes of table and index for each 8-byte timing; packed, a timing is its
8 bytes. The figures stay exact: timings and times are IEEE 754 float64, memory int64, all little-
endian, whatever the machine. The first byte names the format, so a later one can be added:
  1  the plain arrays
  2  the same, zlib-compressed (telemetry only, when it is smaller; timings were compressed so before
     2026-11-28 and still read)
Timings are written plain without trying zlib: measured float64 timings are noise in their low bits and
never compress (100 timings: 801 bytes either way), and trying cost most of packing's time.
Timings: float64[n]. Telemetry: t_s float64[n], then cpu_percent float64[n], then memory_bytes
int64[n]. A missing figure is NaN (a float) or the int64 minimum (memory); the same bytes work in
any database (a PostgreSQL store keeps them in a bytea).
"""

from __future__ import annotations

import math
import struct
import sys
import zlib
from array import array
from typing import Any, Iterable, Sequence, cast

from farm.controller.store.rows import TelemetrySampleRow

PLAIN, ZLIB = 1, 2
NO_MEMORY = -(1 << 63)
_BIG_ENDIAN = sys.byteorder == "big"


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


def pack_iterations(values: Sequence[float | None]) -> bytes:
    timings: array[float]
    try:
        timings = array("d", cast("Sequence[float]", values))  # a None is refused here, and mapped below
    except TypeError:
        timings = array("d", (_float(v) for v in values))
    return bytes([PLAIN]) + _little_endian(timings)


def unpack_iterations(data: bytes) -> list[float]:
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
