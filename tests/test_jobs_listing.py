"""`farm jobs` on a local store reads it without the controller and the answer models (client/local_jobs.py,
issue 34 item 5): what it prints must be what the Farm's answer (JobInfo) prints, byte for byte, and anything
it cannot vouch for must go to the Farm. In-process: the start-up itself is tests/test_cli_startup.py's."""

from __future__ import annotations

import io
import json
import os
import random
import socket
import sqlite3
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from farm.cli.console import when
from farm.cli.main import main
from farm.cli.render import jobs_table, show, to_json
from farm.client.embedded import EmbeddedFarm
from farm.client.local_jobs import local_jobs
from farm.controller.scheduling.job_state import INTERRUPTED, TERMINAL_JOB
from farm.controller.store import SQLiteStore
from farm.proto.job_summary import job_json, plain_job
from farm.proto.questions import JobInfo
from farm.proto.results import JobStatus

DEAD_PID = 4_194_304 + 4321  # above Linux's largest pid_max: no process has it
NOW = 1_795_000_000.1234995  # a moment whose milliseconds sit on the rounding edge


@pytest.fixture(autouse=True)
def _no_controller(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("FARM_CONTROLLER", "FARM_DB", "FARM_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FARM_CONFIG", str(tmp_path / "no-config.toml"))


def _job(store: SQLiteStore, statuses: list[str], **job: Any) -> int:
    row = {"name": "job", "kind": "user", "status": "queued", "priority": "normal", "created_at": NOW,
           "spec_json": "{}", "spec_yaml": "", "base_dir": "/tmp", **job}
    return store.jobs.insert(row, [{"seq": i, "target": "sim", "model_name": "m", "status": s, "attempts": 1,
                                    "max_attempts": 3, "priority": 1, "spec_json": "{}"}
                                   for i, s in enumerate(statuses)])


def _lab(folder: Path) -> Path:
    """Jobs in every state a listing shows, with names and messages a job file or a process could give."""
    db = folder / "farm.db"
    store = SQLiteStore(db)
    try:
        here = {"owner_pid": os.getpid(), "owner_host": socket.gethostname()}
        _job(store, ["completed", "failed", "completed"], status="failed", started_at=NOW + 1, finished_at=NOW + 9.9996,
             **here)
        _job(store, ["running", "pending"], status="running", started_at=NOW + 2, name="läuft 実行", **here)
        _job(store, ["running"], status="running", owner_pid=DEAD_PID, owner_host=socket.gethostname())  # interrupted
        _job(store, ["canceled", "completed"], status="canceled", message="canceled by the user", finished_at=NOW + 3)
        _job(store, [], name="\x1b[31mred\x1b[0m\nsecond [bold]line[/bold]", message="", priority="interactive",
             owner_pid=DEAD_PID, owner_host="another-host")  # another host's process: taken as alive
        _job(store, ["pending"], status="queued", created_at=NOW + 0.0004999, started_at=0.0, priority="low")
    finally:
        store.close()
    return db


def _model_answer(db: Path, limit: int = 50) -> list[JobInfo]:
    with EmbeddedFarm(db) as farm:
        return farm.jobs(limit)


def _table(jobs: list[Any], wide: bool) -> str:
    console = Console(file=io.StringIO(), width=160)
    show(console, jobs_table(jobs, when, wide=wide), wide=wide)
    return console.file.getvalue()  # type: ignore[attr-defined, no-any-return]


def test_the_listing_prints_what_the_answer_model_prints(tmp_path: Path) -> None:
    db = _lab(tmp_path)
    listed = local_jobs(None, str(db), 50)
    model = _model_answer(db)
    assert listed is not None and len(listed) == len(model) == 6
    assert [j["status"] for j in listed] == ["queued", "queued", "canceled", INTERRUPTED, "running", "failed"]
    assert to_json([job_json(j) for j in listed]) == to_json([j.to_json() for j in model])
    for wide in (False, True):
        assert _table([SimpleNamespace(**j) for j in listed], wide) == _table(model, wide)
    assert local_jobs(None, str(db), 2) == listed[:2] and local_jobs(None, str(db), 0) == listed  # 0: the default


def test_the_command_prints_the_models_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = _lab(tmp_path)
    assert main(["jobs", "--db", str(db), "--json", "--limit", "3"]) == 0
    assert capsys.readouterr().out == to_json([j.to_json() for j in _model_answer(db, 3)]) + "\n"


def test_every_moment_reads_as_the_model_reads_it() -> None:
    rng = random.Random(34)
    moments = [rng.uniform(0, 9_999_999_999) for _ in range(3000)] + [rng.randrange(1, 10**10) for _ in range(300)]
    moments += [round(rng.uniform(1e9, 2e9), 3) + edge for edge in (0.0004995, 0.0005, 0.0004999999, 0.9999996)
                for _ in range(200)]
    for moment in [*moments, 0, 0.0, None]:
        fields = {"total": 1, "pending": 0, "running": 0, "completed": 1, "failed": 0, "canceled": 0, "job": 7,
                  "name": "n", "status": "completed", "priority": "normal", "created_at": moment, "started_at": moment,
                  "finished_at": None, "message": None, "owner_pid": None, "owner_host": None}
        plain = plain_job(fields)
        assert plain is not None, moment
        assert job_json(plain) == JobInfo(**fields).to_json(), moment
        assert when(plain["created_at"]) == when(JobInfo(**fields).created_at), moment


@pytest.mark.parametrize("field, value", [
    ("created_at", 3e10),  # pydantic reads it as milliseconds
    ("created_at", float("nan")), ("started_at", -5.0), ("name", 5), ("name", b"raw"), ("priority", None),
    ("owner_pid", 1.5), ("owner_host", 3), ("message", 2), ("total", True), ("job", "7"),
])
def test_a_value_the_model_would_change_is_left_to_it(field: str, value: Any) -> None:
    fields = {"total": 1, "pending": 0, "running": 0, "completed": 1, "failed": 0, "canceled": 0, "job": 7,
              "name": "n", "status": "completed", "priority": "normal", "created_at": NOW, "started_at": None,
              "finished_at": None, "message": None, "owner_pid": None, "owner_host": None, field: value}
    assert plain_job(fields) is None


def _older_schema(db: Path) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE schema_version SET version = version - 1")


def _rollback_journal(db: Path) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA journal_mode = delete")


def _hand_edited(db: Path) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE jobs SET name = x'00ff' WHERE id = 1")  # a BLOB: TEXT affinity keeps it one


@pytest.mark.parametrize("spoil", [_older_schema, _rollback_journal, _hand_edited])
def test_a_store_this_reader_cannot_vouch_for_goes_to_the_farm(spoil: Any, tmp_path: Path) -> None:
    db = _lab(tmp_path)
    spoil(db)
    assert local_jobs(None, str(db), 50) is None


def test_what_only_the_farm_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = _lab(tmp_path)
    assert local_jobs(None, str(db), 50) is not None
    for limit in (-1, 100_001):  # the request model refuses it, naming the field
        assert local_jobs(None, str(db), limit) is None
    assert local_jobs("127.0.0.1:1", str(db), 50) is None  # a controller named
    assert local_jobs(None, "postgresql://u@h:5432/farm", 50) is None
    assert local_jobs(None, str(tmp_path / "missing.db"), 50) is None  # the Farm says it is not there
    (tmp_path / "text.db").write_text("not a database\n")
    assert local_jobs(None, str(tmp_path / "text.db"), 50) is None
    assert local_jobs(None, str(tmp_path), 50) is None  # a folder
    monkeypatch.setenv("FARM_CONTROLLER", "127.0.0.1:1")
    assert local_jobs(None, str(db), 50) is None
    (tmp_path / "bad.toml").write_text("controller = [\n")
    monkeypatch.delenv("FARM_CONTROLLER")
    monkeypatch.setenv("FARM_CONFIG", str(tmp_path / "bad.toml"))
    assert local_jobs(None, str(db), 50) is None  # opening the Farm names the file that cannot be read


def test_the_command_says_what_the_farm_says_when_it_cannot_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "text.db").write_text("not a database\n")
    assert main(["jobs", "--db", str(tmp_path / "text.db")]) == 2
    assert "is not a farm store that can be read" in capsys.readouterr().err
    assert main(["jobs", "--db", str(tmp_path / "farm.db"), "--limit", "-1", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"].startswith("limit:")


def test_an_older_store_is_migrated_and_listed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = _lab(tmp_path)
    _rollback_journal(db)  # as a store farm did not make: opening it as a store turns WAL on
    assert main(["jobs", "--db", str(db), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 6
    assert local_jobs(None, str(db), 50) is not None  # now it is one this reader reads


def test_the_job_states_are_the_results_models() -> None:
    assert TERMINAL_JOB == {JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELED}
    assert INTERRUPTED == JobStatus.INTERRUPTED


def test_a_long_listing_counts_every_job(tmp_path: Path) -> None:
    db = tmp_path / "farm.db"
    store = SQLiteStore(db)
    try:
        for i in range(1203):  # more job ids than one statement takes
            _job(store, ["completed"] * (i % 3), status="completed", created_at=NOW + i)
    finally:
        store.close()
    listed = local_jobs(None, str(db), 100_000)
    assert listed is not None and len(listed) == 1203
    assert [j["total"] for j in listed] == [j.total for j in _model_answer(db, 100_000)]


def test_strict_json_of_plain_data_needs_no_pydantic_core() -> None:
    from pydantic_core import to_jsonable_python

    from farm.proto import strict_json

    documents: list[Any] = [[], {}, [{"a": 1, "b": [1.5, float("nan"), None, True, "x"], "c": {"d": float("inf")}}],
                            {"job": 1, "results": [{"x": float("-inf")}], "nonfinite": ["y"]}, 3, "text", None]
    for document in documents:
        assert strict_json._plain(document)
        before = json.dumps(strict_json.clean(to_jsonable_python(document, fallback=str)), allow_nan=False, indent=2)
        assert strict_json.dumps(document, indent=2) == before
    for other in ({1: "a"}, [(1, 2)], {"when": JobStatus.COMPLETED}, [b"x"]):  # these go through pydantic_core
        assert not strict_json._plain(other)


def test_the_store_is_where_the_farm_would_look(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = _lab(tmp_path)
    monkeypatch.setenv("FARM_DB", str(db))  # no --db: $FARM_DB, as EmbeddedFarm reads it
    listed = local_jobs(None, None, 50)
    assert listed is not None and [j["job"] for j in listed] == [j.job for j in _model_answer(db)]
    monkeypatch.chdir(tmp_path)
    assert local_jobs(None, "farm.db", 1) == listed[:1]  # a relative --db, from the working folder
