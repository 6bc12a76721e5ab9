"""Per-iteration timings and telemetry are packed per run (issue 22): timings in whole nanoseconds (all their clock
measured, issue 35), telemetry exact, less room, every older format still read, and an older store converted in
place by a migration that resumes where it stopped."""

from __future__ import annotations

import json
import math
import random
import sqlite3
import struct
import time
import zlib
from pathlib import Path

import pytest

from farm.controller.store import SQLiteStore
from farm.controller.store.samples import (
    PackedSamplesError, pack_iterations, pack_telemetry, unpack_iterations, unpack_telemetry)
from farm.controller.store.schema import MIGRATIONS, PACKED_SAMPLES, SCHEMA_VERSION, sqlite_utils
from farm.controller.store.sqlite import pack_stored_samples


REAL_RUNS = json.loads((Path(__file__).resolve().parent / "data" / "mobilenetv2_sim_runs.json").read_text())["runs"]


def test_exact_timings_round_trip_bit_for_bit() -> None:
    rng = random.Random(7)
    values = [rng.uniform(0.001, 5000.0) for _ in range(1000)] + [0.0, -0.0, 5e-324, 1.7976931348623157e308, 1 / 3]
    back = unpack_iterations(pack_iterations(values, exact=True))
    assert [struct.pack("<d", v) for v in back] == [struct.pack("<d", v) for v in values]
    assert unpack_iterations(pack_iterations([])) == []


def test_exact_bytes_are_little_endian_float64_after_a_format_byte() -> None:
    packed = pack_iterations([1.0, 2.5], exact=True)
    assert packed == b"\x01" + struct.pack("<2d", 1.0, 2.5)


def test_timings_are_stored_in_whole_nanoseconds_by_frame_of_reference() -> None:
    # 2.0, 2.000001 and 2.065535 ms: base 2,000,000 ns, offsets 0, 1 and 65,535 ns: two bytes each, low byte plane first
    packed = pack_iterations([2.0, 2.000001, 2.065535])
    assert packed == b"\x03" + struct.pack("<IqB", 3, 2_000_000, 2) + bytes([0, 1, 0xFF]) + bytes([0, 0, 0xFF])
    assert unpack_iterations(packed) == [2.0, 2.000001, 2.065535]
    assert pack_iterations([5.0] * 4) == b"\x03" + struct.pack("<IqB", 4, 5_000_000, 0)  # all equal: no offsets
    assert unpack_iterations(pack_iterations([5.0] * 4)) == [5.0] * 4
    # nothing finer than a nanosecond is kept: 0.4 ns rounds away, the grid's values come back as they went in
    assert unpack_iterations(pack_iterations([1.0000004, 0.0000006])) == [1.0, 0.000001]


@pytest.mark.parametrize("run", REAL_RUNS, ids=lambda r: f"t{r['threads']}{'-contended' if r['contended'] else ''}")
def test_real_timings_lose_nothing_the_clock_measured_and_every_figure_stays(run: dict) -> None:
    """A real MobileNet v2 sim run's 100 timings (perf_counter differences, whose clock counts whole nanoseconds):
    stored in 314-414 bytes instead of 801, each within 0.01 ns of the float64 the harness computed, and the
    summary farm computes from them (avg, p50, p90, p99, std, min, max) the same to 9 significant digits, and
    as farm prints it, equal."""
    from farm.agents.harness.stats import latency_stats
    from farm.cli.render import _ms  # how a table prints a latency

    original = run["iterations_ms"]
    packed = pack_iterations(original)
    back = unpack_iterations(packed)
    assert packed[0] == 3 and len(packed) <= 414 and len(back) == len(original) == 100
    assert max(abs(a - b) for a, b in zip(original, back)) < 1e-8  # ms: 0.01 ns
    assert pack_iterations(back) == packed  # read and stored again: the same bytes
    before, after = latency_stats(original), latency_stats(back)
    for name in ("avg", "p50", "p90", "p99", "std", "min", "max"):
        a, b = getattr(before, name), getattr(after, name)
        assert b == pytest.approx(a, rel=1e-9, abs=1e-12), name
        assert _ms(a) == _ms(b), name
    stored = run["latency_ms"]  # what the agent computed from the same timings, stored apart from them
    assert after.avg == pytest.approx(stored["avg"], rel=1e-9) and after.p99 == pytest.approx(stored["p99"], rel=1e-9)


def test_timings_the_grid_cannot_hold_are_kept_exact() -> None:
    for values in ([1.0, math.nan], [1.0, math.inf], [1.0, 2.0 ** 53 / 1e6], [1.0, None]):
        packed = pack_iterations(values)
        assert packed[0] == 1, values
        back = unpack_iterations(packed)
        assert back[0] == 1.0 and (math.isnan(back[1]) if values[1] is None or values[1] != values[1] else
                                   back[1] == values[1])
    assert unpack_iterations(pack_iterations([-1.5, 3.25])) == [-1.5, 3.25]  # negative: whole ns too


def test_older_formats_still_read_as_they_were_written() -> None:
    rng = random.Random(3)
    measured = [rng.uniform(1.0, 2.0) for _ in range(100)]
    plain = b"\x01" + struct.pack("<100d", *measured)  # as farm wrote timings from 2026-11-28 to 2026-11-29
    assert unpack_iterations(plain) == measured
    repeated = [1.0] * 1000
    older = b"\x02" + zlib.compress(struct.pack("<1000d", *repeated))  # as farm wrote them before 2026-11-28
    assert unpack_iterations(older) == repeated
    samples = [(i * 0.05 + 1e-9, 10.0 + i / 3, (1 << 40) + i) for i in range(30)]
    body = b"".join(struct.pack(f"<30{kind}", *column) for kind, column in zip("ddq", zip(*samples)))
    for framed in (b"\x01" + body, b"\x02" + zlib.compress(body)):
        assert [(s.t_s, s.cpu_percent, s.memory_bytes) for s in unpack_telemetry(framed)] == samples


def test_telemetry_round_trips_and_missing_figures_stay_missing() -> None:
    samples = [(i * 0.05, 10.0 + i, (1 << 40) + i) for i in range(300)] + [(15.0, None, None)]
    back = unpack_telemetry(pack_telemetry(samples))
    assert [(s.t_s, s.cpu_percent, s.memory_bytes) for s in back] == samples
    assert pack_telemetry(samples)[0] == 2  # regular times and close memory figures: zlib pays


@pytest.mark.parametrize("data", [
    b"\x03", b"\x03\x02\x00\x00\x00",  # no header
    b"\x03" + struct.pack("<IqB", 2, 0, 9) + bytes(18),  # wider than 8 bytes
    b"\x03" + struct.pack("<IqB", 2, 0, 1) + bytes(1),  # a plane cut short
    b"\x03" + struct.pack("<IqB", 2, 0, 1) + bytes(3),  # a byte too many
    b"\x03" + struct.pack("<IqB", 0xFFFFFFFF, 0, 0)])  # four billion equal timings claimed: refused, not allocated
def test_damaged_nanosecond_bytes_are_refused_with_a_reason(data: bytes) -> None:
    with pytest.raises(PackedSamplesError):
        unpack_iterations(data)


@pytest.mark.parametrize("data", [b"", b"\x01abc", b"\x02not zlib", b"\x09" + bytes(8)])
def test_damaged_or_unknown_bytes_are_refused_with_a_reason(data: bytes) -> None:
    with pytest.raises(PackedSamplesError):
        unpack_iterations(data)
    with pytest.raises(PackedSamplesError):
        unpack_telemetry(data)


def test_a_non_finite_timing_is_kept_as_nan() -> None:
    (value,) = unpack_iterations(pack_iterations([math.nan]))
    assert math.isnan(value)


def _old_store(path: Path, runs: int) -> None:
    """A store as farm wrote it at schema 14: a row per timing and per telemetry sample."""
    conn = sqlite3.connect(path, isolation_level=None)
    db = sqlite_utils.Database(conn)
    # one transaction: in autocommit every one of the ~22,000 rows of 200 runs was its own commit and fsync (48 s of
    # a loaded machine's disk, issue 34); the file holds the same rows either way
    conn.execute("BEGIN")
    db.table("schema_version").create({"version": int})
    db.table("schema_version").insert({"version": 0})
    for migration in MIGRATIONS[:14]:
        migration(db)
    db.execute("UPDATE schema_version SET version = 14")
    db.execute("INSERT INTO jobs (id, name, status, priority, created_at) VALUES (1, 'old', 'completed', 'normal', 0)")
    db.execute("INSERT INTO tasks (id, job_id, seq, target, model_name, status) VALUES (1, 1, 0, 'sim', 'm', 'completed')")
    for run_id in range(1, runs + 1):
        db.execute("INSERT INTO runs (id, task_id, job_id, attempt, status) VALUES (?, 1, 1, ?, 'completed')",
                   [run_id, run_id])
        conn.executemany("INSERT INTO iterations (run_id, idx, ms) VALUES (?, ?, ?)",
                         [(run_id, i, run_id + i / 7) for i in range(100)])
        if run_id % 2:  # some runs had no telemetry
            conn.executemany("INSERT INTO telemetry (run_id, idx, t_s, cpu_percent, memory_bytes) VALUES (?, ?, ?, ?, ?)",
                             [(run_id, i, i * 0.04, 90.0 + i, 1_000_000 * run_id + i) for i in range(25)])
    conn.execute("COMMIT")
    conn.close()


def test_an_older_store_is_converted_in_place_and_a_stopped_conversion_resumes(tmp_path: Path) -> None:
    path = tmp_path / "farm.db"
    _old_store(path, runs=9)
    # the first steps as a newer farm takes them, then it stops (killed) after one batch of four runs
    conn = sqlite3.connect(path, isolation_level=None)
    db = sqlite_utils.Database(conn)
    conn.execute("BEGIN IMMEDIATE")
    for migration in MIGRATIONS[14:PACKED_SAMPLES]:
        migration(db)
    conn.execute("UPDATE schema_version SET version = ?", [PACKED_SAMPLES])
    conn.execute("COMMIT")
    conn.execute("BEGIN IMMEDIATE")
    assert pack_stored_samples(db, 4) == 4
    conn.execute("COMMIT")
    # each run's samples are in one place: packed, or still a row each, never both and never lost
    packed = {r for (r,) in conn.execute("SELECT run_id FROM run_samples")}
    unpacked = {r for (r,) in conn.execute("SELECT DISTINCT run_id FROM iterations")}
    assert packed == {1, 2, 3, 4} and unpacked == {5, 6, 7, 8, 9}
    conn.close()

    store = SQLiteStore(path)  # opening finishes the conversion
    try:
        assert store.schema_version() == SCHEMA_VERSION
        assert not store.has_table("iterations") and not store.has_table("telemetry")
        for run_id in range(1, 10):
            assert store.runs.iterations(run_id) == [run_id + i / 7 for i in range(100)]
            telemetry = [(s.t_s, s.cpu_percent, s.memory_bytes) for s in store.runs.telemetry(run_id)]
            assert telemetry == ([(i * 0.04, 90.0 + i, 1_000_000 * run_id + i) for i in range(25)] if run_id % 2 else [])
    finally:
        store.close()


def test_a_run_takes_a_fraction_of_the_room(tmp_path: Path) -> None:
    """100 timings and 25 telemetry samples: the packed row against the rows and index entries before. The room
    the runs take: each store less the same store with no run (a newer schema's empty tables are not runs' room)."""
    def converted(source: Path, name: str) -> int:
        path = tmp_path / name
        path.write_bytes(source.read_bytes())
        SQLiteStore(path).close()
        conn = sqlite3.connect(path)
        conn.execute("VACUUM")  # the conversion frees pages inside the file; VACUUM gives them back
        conn.close()
        return path.stat().st_size

    old, empty = tmp_path / "old.db", tmp_path / "empty.db"
    _old_store(old, runs=200)
    _old_store(empty, runs=0)
    before = old.stat().st_size - empty.stat().st_size
    after = converted(old, "new.db") - converted(empty, "new-empty.db")
    assert 0 < after < before / 2.5, (before, after)


def test_the_controller_stores_packed_samples(tmp_path: Path) -> None:
    from farm.proto.results import LatencyStats, RunResult, RunStatus, Telemetry, TelemetrySample
    store = SQLiteStore(tmp_path / "farm.db")
    try:
        job = store.jobs.insert({"name": "j", "kind": "user", "status": "queued", "priority": "normal",
                                 "created_at": time.time()},
                                [{"seq": 0, "target": "sim", "model_name": "m", "threads": 1, "repeat": 0,
                                  "status": "pending", "attempts": 0, "max_attempts": 1, "priority": 1}])
        with store.transaction():
            (task,) = store.leases.next_pending({"sim"}, 1)
            store.leases.lease(task.id, 1, "a", time.time() + 60)
        timings = [(1_250_000 + 1000 * i) / 1e6 for i in range(100)]  # whole nanoseconds: stored as they are
        result = RunResult(status=RunStatus.COMPLETED, latency=LatencyStats(1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 100),
                           iterations_ms=timings,
                           telemetry=Telemetry(interval_ms=40, samples=[TelemetrySample(i * 0.04, 50.0, 1 << 30)
                                                                         for i in range(25)]))
        run_id = store.runs.record(task, 1, "a", time.time(), result, {"status": "completed"})
        assert run_id is not None and store.runs.iterations(run_id) == timings
        assert [s.memory_bytes for s in store.runs.telemetry(run_id)] == [1 << 30] * 25
        (size,) = store.query("SELECT LENGTH(iterations) + LENGTH(telemetry) AS n FROM run_samples")[0].values()
        # timings: 99,000 ns of range, 3 bytes each after a 13-byte header; telemetry: float64, zlib'd when smaller
        assert size <= (1 + 13 + 3 * 100) + (1 + 600) and store.jobs.get(job) is not None
    finally:
        store.close()
