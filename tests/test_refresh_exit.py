"""`farm refresh` says when it did not do its job, and exits 1 (issue 32): runs failed, nothing was fitted, every
device was quarantined. And `farm calibrate --suggest -o FILE` keeps an existing FILE unless --force."""

from __future__ import annotations

import socket
from pathlib import Path

from farm.controller.operations.reference_suite import bundled_suite_text


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_refresh_whose_device_is_gone_exits_1_and_says_why(tmp_path: Path, farm_inprocess) -> None:
    suite_dir = tmp_path / "suite"
    suite_dir.mkdir()
    suite = suite_dir / "reference-suite.yaml"
    text = bundled_suite_text().replace("threads: [1, 2]", "threads: [1]").replace("iterations: 50", "iterations: 5")
    suite.write_text(text + "sim: {on_contention: flag}\n" if "\nsim:" not in text else text)
    lab = tmp_path / "lab.yaml"  # a phone whose adb server is not there: every device run fails (infrastructure)
    lab.write_text(f"devices:\n  - {{name: g6-1, driver: android, type: lg-g6, host: 127.0.0.1, port: {_closed_port()}, "
                   f"adb_key: {tmp_path / 'adbkey'}}}\n")
    refresh = farm_inprocess("refresh", "--suite", str(suite), "--devices", str(lab), "--quiet")
    assert refresh.returncode == 1, (refresh.stdout, refresh.stderr)
    said = refresh.stderr
    assert "refresh failed:" in said
    assert "reference run(s) failed" in said and "nothing was fitted" in said, said
    assert "every device was quarantined: g6-1" in said, said


def test_calibrate_suggest_keeps_an_existing_job_file_unless_forced(tmp_path: Path, farm_inprocess) -> None:
    kept = tmp_path / "next.yaml"
    kept.write_text("my own job\n")
    refused = farm_inprocess("calibrate", "--suggest", "2", "--device", "g6-1", "-o", str(kept))
    assert refused.returncode == 2
    assert f"-o {kept}: the file is already there" in refused.stderr and "--force" in refused.stderr
    assert kept.read_text() == "my own job\n"
    forced = farm_inprocess("calibrate", "--suggest", "2", "--device", "g6-1", "-o", str(kept), "--force")
    assert "already there" not in forced.stderr  # past the check: this empty store has nothing to suggest
    assert forced.returncode == 2 and kept.read_text() == "my own job\n"
