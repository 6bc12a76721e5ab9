"""`farm --version`, `farm --help` and `farm jobs` load no numerical, model or gRPC library: every
command imports what it needs inside its handler, so start-up stays cheap (issue 22; the times are
in BENCHMARKS.md). `farm --version` and `farm --help` load no pydantic and not the question table
either (issue 34): they only build the parser. Each command runs in a fresh interpreter, which then
names what it loaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("numpy", "scipy", "matplotlib", "onnx", "onnxruntime", "grpc")
# what only a command that reads or asks something needs: the job and answer models
MODELS = ("pydantic", "farm.proto.questions", "farm.proto.spec")

# runs `farm ARGS` as the console script does, then says which of HEAVY this process loaded
RUN_AND_LIST = """
import json, sys
from farm.cli.main import main
sys.argv = ["farm", *json.loads(sys.argv[1])]
try:
    code = main()
except SystemExit as e:
    code = e.code
sys.stdout.flush()
print("LOADED=" + json.dumps(sorted(m for m in HEAVY if m in sys.modules)), file=sys.stderr)
sys.exit(code)
"""


def _loaded(args: list[str], tmp_path: Path,
            banned: tuple[str, ...] = HEAVY) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    proc = subprocess.run([sys.executable, "-c", f"HEAVY = {banned!r}\n{RUN_AND_LIST}", json.dumps(args)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "FARM_DB": str(tmp_path / "env.db")})
    marker = [line for line in proc.stderr.splitlines() if line.startswith("LOADED=")]
    assert marker, proc.stderr
    return proc, json.loads(marker[-1].removeprefix("LOADED="))


@pytest.mark.parametrize("args, says", [
    (["--version"], "farm "),
    (["--help"], "usage: farm"),
    (["jobs", "--db", "{tmp}/store/farm.db", "--create"], "jobs in this store yet"),
    (["jobs", "--db", "{tmp}/store/farm.db", "--create", "--json"], "[]"),
])
def test_cheap_commands_load_no_heavy_library(args: list[str], says: str, tmp_path: Path) -> None:
    proc, loaded = _loaded([a.format(tmp=tmp_path) for a in args], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert says in proc.stdout
    assert loaded == [], f"`farm {' '.join(args)}` imported {loaded}; import them inside the command that needs them"


@pytest.mark.parametrize("args, says", [(["--version"], "farm "), (["--help"], "usage: farm")])
def test_version_and_help_load_no_models(args: list[str], says: str, tmp_path: Path) -> None:
    # they build the parser and print: no pydantic model, no question table (issue 34: 0.38 CPU-s with them, 0.17 without)
    proc, loaded = _loaded(args, tmp_path, HEAVY + MODELS)
    assert proc.returncode == 0, proc.stderr
    assert says in proc.stdout
    assert loaded == [], f"`farm {' '.join(args)}` imported {loaded}; import them inside the command that needs them"


def test_the_model_check_sees_pydantic(tmp_path: Path) -> None:
    # the same probe on a command that reads a job file must report pydantic and the job model, or the test above proves nothing
    (tmp_path / "job.yaml").write_text("name: x\n")
    proc, loaded = _loaded(["submit", str(tmp_path / "job.yaml"), "--db", str(tmp_path / "store/farm.db"), "--create"],
                           tmp_path, HEAVY + MODELS)
    assert proc.returncode != 0 and {"pydantic", "farm.proto.spec"} <= set(loaded), (proc.stderr, loaded)


def test_the_check_sees_a_heavy_import(tmp_path: Path) -> None:
    # the same probe on a command that reads a model: it must report numpy, or the test above proves nothing
    proc, loaded = _loaded(["inspect", str(tmp_path / "missing.onnx")], tmp_path)
    assert proc.returncode != 0 and "numpy" in loaded


def test_version_builds_no_parser_and_no_console(tmp_path: Path) -> None:
    # `farm --version` answers before the parser, the command modules and rich's consoles load (issue 34: 0.23 CPU-s
    # with them, 0.10 without); `farm --help` needs the parser and loads them, which shows the probe sees them
    proc, loaded = _loaded(["--version"], tmp_path, ("rich", "farm.cli.remote", "farm.cli.calibrate_commands"))
    assert proc.returncode == 0 and proc.stdout.startswith("farm "), proc.stderr
    assert loaded == [], f"`farm --version` imported {loaded}"
    proc, loaded = _loaded(["--help"], tmp_path, ("rich", "farm.cli.remote", "farm.cli.calibrate_commands"))
    assert proc.returncode == 0 and set(loaded) == {"rich", "farm.cli.remote", "farm.cli.calibrate_commands"}, loaded


# what a read-only command on an up-to-date store never needs (issue 34 item 5): sqlite_utils and what it brings
# (click, dateutil) serve only migrations; the job file's models (spec, jobfile with yaml, tasks) only a new job
NOT_FOR_READING = ("sqlite_utils", "click", "dateutil", "yaml", "farm.proto.spec", "farm.controller.scheduling.jobfile",
                   "farm.proto.tasks", "farm.controller.scheduling.schedule", "farm.agents.sandbox")


def test_jobs_on_an_existing_store_loads_no_migration_and_no_job_model(tmp_path: Path) -> None:
    db = str(tmp_path / "store" / "farm.db")
    # the first call makes the store: its migrations need sqlite_utils, which shows the probe sees it
    proc, loaded = _loaded(["jobs", "--db", db, "--create"], tmp_path, NOT_FOR_READING)
    assert proc.returncode == 0 and "sqlite_utils" in loaded, (proc.stderr, loaded)
    for args in (["jobs", "--db", db], ["jobs", "--db", db, "--json"]):
        proc, loaded = _loaded(args, tmp_path, NOT_FOR_READING)
        assert proc.returncode == 0, proc.stderr
        assert "jobs in this store yet" in proc.stdout or proc.stdout.strip() == "[]", proc.stdout
        assert loaded == [], f"`farm {' '.join(args)}` imported {loaded}; import them where a store migrates or a job is made"


# what `farm jobs` on an up-to-date local store never needs (issue 34 item 5: 0.60 CPU-s with them, 0.26 without):
# the controller, the store's classes and rows, the answer and result models (pydantic); client/local_jobs.py
# reads the store with sqlite3 and prints the same bytes (tests/test_jobs_listing.py)
NOT_FOR_LISTING = ("pydantic", "pydantic_core", "farm.proto.questions", "farm.proto.results", "farm.client.api",
                   "farm.client.embedded", "farm.controller.service", "farm.controller.scheduling.controller",
                   "farm.controller.store.sqlite", "farm.controller.store.rows", "farm.controller.store.sql")


def test_jobs_on_an_up_to_date_store_loads_no_controller_and_no_model(tmp_path: Path) -> None:
    db = str(tmp_path / "store" / "farm.db")
    # the first call makes the store through the Farm, which loads all of them: the probe sees them
    proc, loaded = _loaded(["jobs", "--db", db, "--create"], tmp_path, NOT_FOR_LISTING)
    assert proc.returncode == 0 and set(loaded) == set(NOT_FOR_LISTING), (proc.stderr, loaded)
    from farm.controller.store import SQLiteStore
    store = SQLiteStore(db)
    try:
        for status in ("completed", "running"):
            store.jobs.insert({"name": f"a {status} job", "kind": "user", "status": status, "priority": "normal",
                               "created_at": 1_795_000_000.5, "spec_json": "{}", "owner_pid": 1, "owner_host": "x"},
                              [{"seq": 0, "target": "sim", "model_name": "m", "status": status, "attempts": 1,
                                "max_attempts": 3, "priority": 1, "spec_json": "{}"}])
    finally:
        store.close()
    for args, says in ((["jobs", "--db", db], "a running job"), (["jobs", "--db", db, "--json", "--wide"], '"job": 2')):
        proc, loaded = _loaded(args, tmp_path, NOT_FOR_LISTING)
        assert proc.returncode == 0 and says in proc.stdout, (proc.stdout, proc.stderr)
        assert loaded == [], f"`farm {' '.join(args)}` imported {loaded}; import them where the Farm answers"


# the other modules' commands: a run that names one of cli/main.py's own commands neither imports nor builds them
OTHER_COMMAND_MODULES = ("farm.cli.calibrate_commands", "farm.cli.device_commands", "farm.cli.refresh_commands",
                         "farm.cli.inspect_commands", "farm.cli.compare_commands", "farm.cli.completion",
                         "farm.cli.manpage")


def test_jobs_builds_only_its_own_modules_parser(tmp_path: Path) -> None:
    proc, loaded = _loaded(["--help"], tmp_path, OTHER_COMMAND_MODULES)  # the whole parser: the probe sees them
    assert proc.returncode == 0 and set(loaded) == set(OTHER_COMMAND_MODULES), loaded
    for args in (["jobs", "--db", str(tmp_path / "farm.db"), "--create"], ["jobs", "--help"]):
        proc, loaded = _loaded(args, tmp_path, OTHER_COMMAND_MODULES)
        assert proc.returncode == 0 and loaded == [], (args, loaded, proc.stderr)


def test_a_commands_own_parser_is_the_whole_parsers() -> None:
    import argparse

    from farm.cli.main import OWN_COMMANDS, _leaf_parsers, build_parser

    def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices

    whole = build_parser()
    assert set(OWN_COMMANDS) < set(commands(whole))
    for name in OWN_COMMANDS:
        own = build_parser(name)
        assert set(commands(own)) == set(OWN_COMMANDS) and own.format_usage() == whole.format_usage()
        assert ([leaf.format_help() for leaf in _leaf_parsers(commands(own)[name])]
                == [leaf.format_help() for leaf in _leaf_parsers(commands(whole)[name])]), name
    argv = ["jobs", "--db", "x.db", "--limit", "3", "--wide", "--json", "-v", "--controller", "h:1"]
    assert build_parser("jobs").parse_args(argv) == whole.parse_args(argv)
