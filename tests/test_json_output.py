"""`--json` for scripts (issue 23 item 4): every command that prints data takes it (those that do not say
why in docs/reference/results-json.md),
and every moment in what it prints is an ISO 8601 UTC string, never epoch seconds:
a user walks every command with --json over a store with jobs, calibrations, drift and device health."""

from __future__ import annotations

import argparse
import json
import re
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from conftest import write_job
from farm.cli.main import build_parser
from farm.controller.store import SQLiteStore as Store
from test_ranking import FAMILIES, PHONE, PHONE_RATIO, _job, _paired

ROOT = Path(__file__).resolve().parents[1]
# Commands that print no data of their own, so no --json; docs/reference/results-json.md says the same.
WITHOUT_JSON = {
    "web": "serves the dashboard until stopped",
    "controller serve": "serves gRPC until stopped; its log is for people",
    "agent": "runs tasks until stopped; its log is for people",
    "completion": "prints a shell script",
    "manpage": "prints the manual page (roff)",
}
# A field named like a moment: created_at, last_seen, last_check, last_write, started, time, ...
TIME_FIELD = re.compile(r"(_at|^last_(seen|check|write|used)|^(started|finished|created|changed|time|timestamp|when|date)"
                        r"|_time)$")


def time_fields(doc: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every (path, value) in a JSON document whose key is named like a moment."""
    found: list[tuple[str, Any]] = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            where = f"{path}.{key}" if path else str(key)
            if TIME_FIELD.search(str(key)):
                found.append((where, value))
            found.extend(time_fields(value, where))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            found.extend(time_fields(value, f"{path}[{i}]"))
    return found


def assert_iso_times(doc: Any, what: str = "") -> int:
    """Each moment is null or an ISO 8601 string in UTC (no epoch number); returns how many were set."""
    set_ = 0
    for where, value in time_fields(doc):
        if value is None:
            continue
        assert isinstance(value, str), f"{what}: {where} is {value!r}, not an ISO 8601 string"
        moment = datetime.fromisoformat(value)
        assert moment.utcoffset() == timedelta(0), f"{what}: {where} = {value!r} is not UTC"
        assert value.endswith("Z"), f"{what}: {where} = {value!r}: farm writes UTC as Z"
        set_ += 1
    return set_


def test_the_time_check_sees_an_epoch_number_and_a_local_time() -> None:
    assert assert_iso_times({"jobs": [{"created_at": "2026-11-24T19:40:00.123Z", "wall_s": 3.5}]}) == 1
    for bad in ({"created_at": 1764013200.5}, {"x": [{"last_seen": 0}]}, {"started": "2026-11-24T19:40:00+01:00"}):
        with pytest.raises(AssertionError):
            assert_iso_times(bad)
    with pytest.raises(ValueError):
        assert_iso_times({"finished_at": "yesterday"})


def _leaves(parser: argparse.ArgumentParser, path: str = "") -> dict[str, argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return {path: parser}
    return {k: v for a in subs for name, child in a.choices.items() for k, v in _leaves(child, f"{path} {name}".strip()).items()}


def _has_json(parser: argparse.ArgumentParser) -> bool:
    return "--json" in {o for a in parser._actions for o in a.option_strings}


def test_every_command_that_prints_data_takes_json_and_the_readme_names_the_others() -> None:
    leaves = _leaves(build_parser())
    lacking = sorted(path for path, parser in leaves.items() if not _has_json(parser))
    assert lacking == sorted(WITHOUT_JSON), ("a new command prints data: give it --json (or say why not here and in "
                                             "docs/reference/results-json.md)")
    page = (ROOT / "docs" / "reference" / "results-json.md").read_text()
    section = page[page.index("## `--json` and time"):]
    section = section.split("\n## ", 1)[0]
    for command in WITHOUT_JSON:
        assert f"`farm {command}`" in section, command
    assert sorted(leaves) == sorted(set(COMMANDS) | set(WITHOUT_JSON)), "walk the new command's --json below"


# Each command with --json, run as a user would (embedded, a store with data); "{...}" are filled in.
COMMANDS: dict[str, list[list[str]]] = {
    "submit": [["submit", "{job_file}", "--backend", "process"]],
    "resume": [["resume", "1"]],  # a completed job: refused, as JSON
    "retry": [["retry", "1", "--failed"]],  # nothing failed: refused, as JSON
    "watch": [["watch", "2"]],
    "results": [["results", "2"], ["results", "2", "--pairs"]],
    "jobs": [["jobs"]],
    "status": [["status", "2"]],
    "cancel": [["cancel", "2"]],
    "calibrate": [["calibrate", "--job", "1", "--device", PHONE], ["calibrate", "--pairs", "{pairs}", "-o", "{fit}"]],
    "calibrations": [["calibrations"]],
    "predict": [["predict", "--calibration", "{fit}", "--input", "{pairs}"]],
    "rank": [["rank", "2", "--device", PHONE]],
    "report": [["report", "2", "-o", "{report}"]],
    "device": [["device", "quarantine", PHONE, "--reason", "fan noise"], ["device", "health"],
               ["device", "release", PHONE], ["device", "forget", PHONE]],
    "refresh": [["refresh"]],  # no device to refresh: refused, as JSON
    "drift": [["drift"]],
    "import auptimizer": [["import", "auptimizer", "{auptimizer}", "-o", "{imported}"]],
    "artifacts gc": [["artifacts", "gc", "--dry-run"]],
    "backends": [["backends"]],
    "models generate": [["models", "generate", "{models}", "--widths", "0.35", "--sizes", "96", "--formats", "tflite",
                         "--no-zoo", "--quiet"]],
    "devices": [["devices", "--devices", "{lab}"]],
    "agents": [["agents"]],  # embedded has no agents: refused, as JSON
    "inspect": [["inspect", "{tflite}"]],
    "quantize": [["quantize", "{onnx}", "-o", "{quantized}"]],
    "compare": [["compare", "1", "2"]],
    "schema": [["schema"]],  # JSON with or without --json
    # moving to PostgreSQL is walked in tests/test_postgres_store.py; here a refusal, as JSON
    "store migrate": [["store", "migrate", "--from", "{missing}", "--to", "postgresql://farm@127.0.0.1:1/lab"]],
}
# Commands whose output must carry at least one moment (so the walk cannot pass by printing none).
WITH_MOMENTS = {("jobs",), ("status", "2"), ("calibrations",), ("device", "health"), ("drift",)}


@pytest.fixture
def store_with_everything(farm_db: Path) -> Path:
    """Job 1 calibrated phone-1; job 2 is paired again; one drift record; as test_ranking builds them."""
    store = Store(farm_db)
    first = _job(store)
    for family in ("cnn", "vit"):
        for i, ms in enumerate(FAMILIES[family]):
            _paired(store, first, family, i, ms, PHONE_RATIO[family] * ms)
    second = _job(store)
    for family, values in FAMILIES.items():
        for i, ms in enumerate(values):
            _paired(store, second, family, i, ms, PHONE_RATIO[family] * ms)
    store.calibrations.add_drift({"device": PHONE, "metric": "latency", "threads": 1, "calibration_id": 2,
                                  "previous_id": 1, "slope_change": 0.4, "intercept_change": 0.0, "r2_drop": 0.0,
                                  "prediction_shift": 0.1, "exceeded": 1, "reasons": "slope moved 40%",
                                  "created_at": time.time()})
    store.close()
    return farm_db


def test_every_json_command_prints_json_with_iso_8601_times(farm, store_with_everything: Path, tmp_path: Path,
                                                           tiny_models) -> None:
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("model,x,y\n" + "".join(f"m{i},{x},{3 * x + 1}\n" for i, x in enumerate((1, 2, 4, 5, 8))))
    lab = tmp_path / "lab.yaml"
    lab.write_text("devices:\n  - name: pi4-1\n    driver: linux\n    host: 127.0.0.1\n")
    auptimizer = ROOT / "tests" / "fixtures" / "auptimizer" / "mnist" / "env.template"
    job_file = write_job(tmp_path, f"models: [{tiny_models['tflite']}]\nworkload: {{type: benchmark, iterations: 2, "
                                   "warmup: 0}\nsim: {cpus: 1.0, on_contention: flag}\n")
    fill = {"job_file": str(job_file), "pairs": str(pairs), "fit": str(tmp_path / "fit.json"),
            "report": str(tmp_path / "report.html"), "auptimizer": str(auptimizer),
            "imported": str(tmp_path / "imported.yaml"), "models": str(tmp_path / "models"), "lab": str(lab),
            "tflite": str(tiny_models["tflite"]), "missing": str(tmp_path / "no-such.db"),
            "onnx": str(tiny_models["onnx"]), "quantized": str(tmp_path / "tiny.int8.onnx")}
    moments = 0
    for command, runs in COMMANDS.items():
        for argv in runs:
            args = [a.format(**fill) for a in argv]
            r = farm(*args, "--json")
            assert r.returncode in (0, 1, 2), (args, r.stderr)
            doc = json.loads(r.stdout)  # refusals too: {"error": ..., "exit_code": 2}
            assert r.returncode != 2 or doc["error"], (args, r.stdout)
            n = assert_iso_times(doc, " ".join(args))
            if tuple(argv) in WITH_MOMENTS:
                assert n > 0, (args, r.stdout[:400])
            moments += n
    assert moments >= 10
    for argv in sorted(WITH_MOMENTS - {("status", "2")}):  # the tables show the same moments, in local time
        r = farm(*argv, "--wide") if argv[0] in ("jobs", "calibrations") else farm(*argv)
        assert r.returncode == 0 and re.search(r"20\d\d-\d\d-\d\d \d\d:\d\d:\d\d", r.stdout), (argv, r.stdout, r.stderr)


def _agent(**moments: Any) -> Any:
    from farm.proto.questions import AgentInfo
    return AgentInfo(name="rack1", state="online", farm_version="1", hostname="h", peer="p", capabilities=[], running=0,
                     **moments)


def test_a_moment_is_a_utc_datetime_in_python_and_the_same_iso_string_on_every_path() -> None:
    from test_client_types import _round_trip

    from farm.proto import strict_json
    from farm.proto.questions import AgentsAnswer, DeviceHealth, DeviceHealthAnswer
    agent = _agent(connected_at=1764013200.1236, last_seen="2026-11-24T20:40:00.5+01:00")
    assert agent.connected_at.utcoffset() == timedelta(0) and agent.last_seen.hour == 19
    doc = json.loads(strict_json.dumps(agent))
    assert (doc["connected_at"], doc["last_seen"]) == ("2025-11-24T19:40:00.124Z", "2026-11-24T19:40:00.500Z")
    # field for field (a double on the wire) and as one JSON document: the same JSON comes out
    listed = AgentsAnswer(agents=[agent])
    assert strict_json.dumps(_round_trip(listed, "ListAgents")) == strict_json.dumps(listed)
    health = DeviceHealthAnswer(devices=[DeviceHealth(name="d", health="bad", reason="r", changed_at=1764013200.9996)])
    assert json.loads(strict_json.dumps(_round_trip(health, "DeviceHealth")))["devices"][0]["changed_at"] == \
        "2025-11-24T19:40:01.000Z"
    # the wire's 0 (a double has no None) is "never", as ids and names
    assert DeviceHealth(name="d", health="good", reason=None, changed_at=0.0).changed_at is None


@pytest.mark.parametrize("moment", [float("inf"), float("nan"), 1e300, "yesterday", "2026-11-24T19:40:00", [1]])
def test_a_hostile_moment_from_the_wire_is_refused_naming_its_field(moment: Any) -> None:
    from pydantic import ValidationError

    from farm.proto.questions import explain
    with pytest.raises(ValidationError) as refused:
        _agent(connected_at=moment, last_seen=1.0)
    assert explain(refused.value).startswith("connected_at: ")
