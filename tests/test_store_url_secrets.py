"""Low (issue 33): a PostgreSQL password given in the URL's query (`?password=`, libpq's own parameter) is never
printed, as the `user:pass@` form never was: the controller's refusal, a command's error and an unknown scheme's
message all show `password=***`. Real `farm` processes against a port where no server listens."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from farm.controller.store import redact_url
from grpc_processes import FARM

pytestmark = pytest.mark.timeout(240)

SECRET = "s3cret-in-the-query"


def _farm(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FARM, *args], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "FARM_CONFIG": str(tmp_path / "none"), "FARM_CONTROLLER": "",
                               "FARM_TOKEN": "", "FARM_DB": ""})


@pytest.mark.parametrize("url", [f"postgresql://farm@127.0.0.1:1/farm?password={SECRET}&connect_timeout=2",
                                 f"postgresql://farm@127.0.0.1:1/farm?connect_timeout=2&sslpassword=k&PASSWORD={SECRET}",
                                 f"mysql://farm@db.lab/farm?password={SECRET}"])
def test_a_password_in_the_query_is_never_printed(tmp_path: Path, url: str) -> None:
    pytest.importorskip("psycopg")
    for args in (["controller", "serve", "--no-auth", "--listen", "127.0.0.1:0", "--db", url],
                 ["jobs", "--db", url], ["artifacts", "gc", "--db", url]):
        done = _farm(tmp_path, *args)
        assert done.returncode != 0, done.stdout
        said = done.stdout + done.stderr
        assert SECRET not in said, said
        assert "***" in said and "Traceback" not in said, said


def test_redact_url_masks_every_secret_parameter() -> None:
    assert redact_url("postgresql://u@h/db?password=x&sslmode=verify-full") == \
        "postgresql://u@h/db?password=***&sslmode=verify-full"
    assert redact_url("postgresql://u:p@h/db?sslpassword=k") == "postgresql://u:***@h/db?sslpassword=***"
    assert redact_url("postgresql://u@h/db?sslmode=require") == "postgresql://u@h/db?sslmode=require"
