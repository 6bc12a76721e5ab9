"""The docs' way (docs/reference/store.md) to open a store for ad-hoc questions: sqlite-utils' own command line, on a store a
real `farm submit` wrote (the sim driver, the process backend)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sqlite_utils() -> list[str]:
    """The `sqlite-utils` script the controller extra installs; its module when the script is elsewhere."""
    script = Path(sys.executable).parent / "sqlite-utils"
    if script.exists():
        return [str(script)]
    return [shutil.which("sqlite-utils") or sys.executable, *([] if shutil.which("sqlite-utils") else ["-m", "sqlite_utils"])]


def test_the_readme_sqlite_utils_commands_read_a_real_store(tmp_path: Path, tiny_models) -> None:
    db = tmp_path / "farm.db"
    job = tmp_path / "job.yaml"
    job.write_text(f"name: cli-probe\nmodels: [{tiny_models['onnx']}]\nworkload: {{iterations: 3, warmup: 1}}\n"
                   "sim: {backend: process, on_contention: flag}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_DB=str(db), HOME=str(tmp_path / "home"))
    submit = subprocess.run([sys.executable, "-m", "farm.cli.main", "submit", str(job), "--quiet"], capture_output=True,
                            text=True, timeout=300, env=env, cwd=tmp_path)
    assert submit.returncode == 0, submit.stdout[-2000:] + submit.stderr[-2000:]

    readme = (ROOT / "docs" / "reference" / "store.md").read_text()
    assert "sqlite-utils tables ~/.local/share/farm/farm.db --counts" in readme
    query = "select id, name, status from jobs order by id desc limit 5"
    assert f'sqlite-utils query ~/.local/share/farm/farm.db "{query}" --table' in readme

    tables = subprocess.run([*_sqlite_utils(), "tables", str(db), "--counts"], capture_output=True, text=True,
                            timeout=60)
    assert tables.returncode == 0, tables.stderr
    counts = {t["table"]: t["count"] for t in json.loads(tables.stdout)}
    assert counts["jobs"] == 1 and counts["tasks"] >= 1, counts
    rows = subprocess.run([*_sqlite_utils(), "query", str(db), query], capture_output=True, text=True, timeout=60)
    assert rows.returncode == 0, rows.stderr
    assert json.loads(rows.stdout) == [{"id": 1, "name": "cli-probe", "status": "completed"}]


def test_read_only_commands_never_make_a_store(farm_inprocess, tmp_path: Path) -> None:
    """Issue 32: a mistyped store file name given to a command that only reads made an empty store there; now it is
    read as empty, nothing is made, and the command says where it looked."""
    typo = tmp_path / "farn.db"
    for argv in (["jobs"], ["jobs", "--json"], ["calibrations"], ["results", "1"], ["status", "1"]):
        run = farm_inprocess(*argv, "--db", str(typo))
        assert f"there is no store at {typo}" in run.stderr and "none was made" in run.stderr, argv
        assert not typo.exists() and not Path(f"{typo}-wal").exists(), argv
    assert farm_inprocess("jobs", "--json", "--db", str(typo)).json() == []
    assert farm_inprocess("results", "1", "--db", str(typo)).returncode == 2  # no job 1: said as for any store


def test_a_postgresql_url_with_a_bad_port_is_a_usage_error(farm_inprocess) -> None:
    run = farm_inprocess("jobs", "--db", "postgresql://farm:secret@db.lab:abc/farm")
    assert run.returncode == 2 and "port after the host must be a number" in run.stderr
    assert "secret" not in run.stderr and "Traceback" not in run.stderr
