"""Per-iteration timings and telemetry are packed per run (issue 22): exact figures, less room, and an older
store converted in place by a migration that resumes where it stopped."""

from __future__ import annotations

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


def test_timings_round_trip_bit_for_bit() -> None:
    rng = random.Random(7)
    values = [rng.uniform(0.001, 5000.0) for _ in range(1000)] + [0.0, -0.0, 5e-324, 1.7976931348623157e308, 1 / 3]
    back = unpack_iterations(pack_iterations(values))
    assert [struct.pack("<d", v) for v in back] == [struct.pack("<d", v) for v in values]
    assert unpack_iterations(pack_iterations([])) == []


def test_the_bytes_are_little_endian_float64_after_a_format_byte() -> None:
    packed = pack_iterations([1.0, 2.5])
    assert packed == b"\x01" + struct.pack("<2d", 1.0, 2.5)  # too short to gain from zlib: plain


def test_timings_are_never_compressed_and_older_compressed_timings_still_read() -> None:
    rng = random.Random(3)
    measured = [rng.uniform(1.0, 2.0) for _ in range(100)]
    assert len(pack_iterations(measured)) == 801 and pack_iterations(measured)[0] == 1
    repeated = [1.0] * 1000  # would compress, but timings are written plain (zlib never pays on measured ones)
    assert pack_iterations(repeated) == b"\x01" + struct.pack("<1000d", *repeated)
    assert pack_iterations([1.0, None]) == b"\x01" + struct.pack("<2d", 1.0, math.nan)
    older = b"\x02" + zlib.compress(struct.pack("<1000d", *repeated))  # as farm wrote them before 2026-11-28
    assert unpack_iterations(older) == repeated


def test_telemetry_round_trips_and_missing_figures_stay_missing() -> None:
    samples = [(i * 0.05, 10.0 + i, (1 << 40) + i) for i in range(300)] + [(15.0, None, None)]
    back = unpack_telemetry(pack_telemetry(samples))
    assert [(s.t_s, s.cpu_percent, s.memory_bytes) for s in back] == samples
    assert pack_telemetry(samples)[0] == 2  # regular times and close memory figures: zlib pays


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
        timings = [1.25 + i / 1000 for i in range(100)]
        result = RunResult(status=RunStatus.COMPLETED, latency=LatencyStats(1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 100),
                           iterations_ms=timings,
                           telemetry=Telemetry(interval_ms=40, samples=[TelemetrySample(i * 0.04, 50.0, 1 << 30)
                                                                         for i in range(25)]))
        run_id = store.runs.record(task, 1, "a", time.time(), result, {"status": "completed"})
        assert run_id is not None and store.runs.iterations(run_id) == timings
        assert [s.memory_bytes for s in store.runs.telemetry(run_id)] == [1 << 30] * 25
        (size,) = store.query("SELECT LENGTH(iterations) + LENGTH(telemetry) AS n FROM run_samples")[0].values()
        assert size <= 1 + 800 + 1 + 600 and store.jobs.get(job) is not None
    finally:
        store.close()
