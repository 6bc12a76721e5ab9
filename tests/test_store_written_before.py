"""A store written by an earlier release reads back the same: tests/fixtures/store_v17 holds an SQLite store a
real `farm submit` wrote (the sim driver, the process backend, two tasks) with the store code of schema 17,
dumped as SQL text, and what `farm results 1 --format json` and the store's sample readers answered then.

The store code may change how it writes (one table definition for both databases, a cheaper result path);
whatever it does, a store already written must open in place and answer byte for byte the same, on SQLite
and after `farm store migrate` onto PostgreSQL.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from farm.controller.store import SQLiteStore, open_store
from farm.proto.results import FIGURES

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "store_v17"


def _written_before(folder: Path) -> Path:
    db = folder / "farm.db"
    conn = sqlite3.connect(db)
    conn.executescript((FIXTURE / "farm.sql").read_text())
    conn.close()
    return db


def _samples(location: str) -> dict[str, object]:
    store = open_store(location)
    try:
        return {str(r.run_id): {"iterations": store.runs.iterations(r.run_id),
                                "telemetry": [dataclasses.asdict(t) for t in store.runs.telemetry(r.run_id)]}
                for r in store.runs.results(1)}
    finally:
        store.close()


def test_a_store_of_schema_17_reads_back_byte_identical(farm_inprocess, tmp_path: Path) -> None:
    db = _written_before(tmp_path)
    plans_before = [r[0] for r in sqlite3.connect(db).execute("SELECT spec_json FROM tasks ORDER BY id")]
    facts_before = [r[0] for r in sqlite3.connect(db).execute("SELECT model_facts_json FROM tasks ORDER BY id")]
    shown = farm_inprocess("results", "1", "--format", "json", env={"FARM_DB": str(db)})
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == (FIXTURE / "results.json").read_text()
    assert _samples(str(db)) == json.loads((FIXTURE / "samples.json").read_text())
    store = SQLiteStore(db)
    try:
        assert len(store.jobs.tasks(1)) == 2 and store.jobs.get(1) is not None
        # schema 18: each distinct plan of the job moved to task_plans once; every task reads back its own
        assert [t.spec_json for t in store.jobs.tasks(1)] == plans_before and None not in plans_before
        # schema 20: the same for each model's facts (model_facts)
        assert [t.model_facts_json for t in store.jobs.tasks(1)] == facts_before and None not in facts_before
    finally:
        store.close()
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT COUNT(*) FROM tasks WHERE spec_json IS NOT NULL OR plan_id IS NULL").fetchone() == (0,)
    assert sorted(r[0] for r in conn.execute("SELECT plan_json FROM task_plans WHERE job_id = 1")) == sorted(
        set(plans_before))
    assert conn.execute("SELECT COUNT(*) FROM tasks WHERE model_facts_json IS NOT NULL OR facts_id IS NULL").fetchone() == (0,)
    assert sorted(r[0] for r in conn.execute("SELECT facts_json FROM model_facts WHERE job_id = 1")) == sorted(
        set(facts_before))
    # every declared run figure has its column, added from the declaration on opening (schema.figure_columns_to_add)
    assert {f.name for f in FIGURES} <= {r[1] for r in conn.execute("PRAGMA table_info(summaries)")}
    conn.close()
    # sqlite-utils' own command line still opens it
    tables = subprocess.run([sys.executable, "-m", "sqlite_utils", "tables", str(db), "--counts"], capture_output=True,
                            text=True, timeout=120)
    assert tables.returncode == 0, tables.stderr
    counts = {t["table"]: t["count"] for t in json.loads(tables.stdout)}
    assert counts["jobs"] == 1 and counts["tasks"] == 2 and counts["runs"] == 2, counts


def test_the_same_store_moved_to_postgresql_reads_back_byte_identical(farm_inprocess, tmp_path: Path,
                                                                       request: pytest.FixtureRequest) -> None:
    from conftest import fresh_postgres_url

    peer = request.getfixturevalue("postgres_peer")
    url = fresh_postgres_url(peer, request.node.name)
    db = _written_before(tmp_path)
    moved = farm_inprocess("store", "migrate", "--from", str(db), "--to", url)
    assert moved.returncode == 0, moved.stdout + moved.stderr
    shown = farm_inprocess("results", "1", "--format", "json", env={"FARM_DB": url})
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == (FIXTURE / "results.json").read_text()
    assert _samples(url) == json.loads((FIXTURE / "samples.json").read_text())
    import psycopg
    with psycopg.connect(url) as conn:  # the figures' columns, as on SQLite
        columns = {r[0] for r in conn.execute("SELECT column_name FROM information_schema.columns "
                                              "WHERE table_name = 'summaries'")}
    assert {f.name for f in FIGURES} <= columns


def test_a_store_at_schema_19_moves_each_jobs_model_facts_in_place_and_the_step_holds_when_replayed(
        farm_inprocess, tmp_path: Path) -> None:
    """Schema 20 (issue 35): tasks written before it carry their model's facts; opening the store moves each job's
    distinct facts to model_facts once and `farm results` answers byte for byte the same. Replayed on a store set
    back to 19 (as a test or a downgrade-and-upgrade does), the step changes nothing it already did."""
    db = _written_before(tmp_path)
    SQLiteStore(db).close()  # 17 -> 20
    conn = sqlite3.connect(db)  # back to 19: the facts in the tasks again, model_facts and facts_id dropped
    conn.execute("UPDATE tasks SET model_facts_json = (SELECT facts_json FROM model_facts f WHERE f.id = tasks.facts_id)")
    conn.execute("ALTER TABLE tasks DROP COLUMN facts_id")
    conn.execute("DROP TABLE model_facts")
    conn.execute("UPDATE schema_version SET version = 19")
    conn.commit()
    facts = [r[0] for r in conn.execute("SELECT model_facts_json FROM tasks ORDER BY id")]
    conn.close()
    for replayed in (False, True):
        if replayed:  # set back to 19 again with the new table and column still there
            with sqlite3.connect(db) as again:
                again.execute("UPDATE schema_version SET version = 19")
        shown = farm_inprocess("results", "1", "--format", "json", env={"FARM_DB": str(db)})
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout == (FIXTURE / "results.json").read_text()
        store = SQLiteStore(db)
        try:
            assert [t.model_facts_json for t in store.jobs.tasks(1)] == facts
        finally:
            store.close()
        with sqlite3.connect(db) as check:
            assert check.execute("SELECT version FROM schema_version").fetchone() == (20,)
            assert check.execute("SELECT COUNT(*) FROM tasks WHERE model_facts_json IS NOT NULL").fetchone() == (0,)
            assert sorted(r[0] for r in check.execute("SELECT facts_json FROM model_facts")) == sorted(set(facts))
