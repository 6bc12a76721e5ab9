"""Which folders the namespaces cover and bind back (agents/sandbox/isolation.py), on real folders.

A closed folder (0700, like Debian's /root holding pyenv's Python) above farm's runtime is covered with
an empty tmpfs and the runtime bound back inside; a closed folder inside a private dir (pytest's own
/tmp/pytest-of-root) is not there to cover once /tmp is a fresh tmpfs, and covering it failed every run
("mount point does not exist")."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from farm.agents.sandbox.isolation import closed_folders


def test_a_closed_folder_above_the_runtime_is_covered(tmp_path: Path) -> None:
    outside = Path(os.environ.get("FARM_TEST_OUTSIDE_TMP", "/var/lib")) / f"farm-test-closed-{os.getpid()}"
    runtime = outside / "pyenv" / "lib"
    runtime.mkdir(parents=True)
    try:
        outside.chmod(0o700)
        assert closed_folders({runtime}) == [outside]
        outside.chmod(0o755)
        assert closed_folders({runtime}) == []
    finally:
        outside.chmod(0o755)
        for folder in (runtime, runtime.parent, outside):
            folder.rmdir()


def test_a_closed_folder_inside_a_private_dir_is_left_to_the_fresh_tmpfs(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    runtime = closed / "venv" / "lib"
    runtime.mkdir(parents=True)
    closed.chmod(0o700)
    try:
        if not str(tmp_path).startswith("/tmp/"):
            pytest.skip(f"pytest's folders are not under /tmp here ({tmp_path})")
        assert closed_folders({runtime}) == []
    finally:
        closed.chmod(0o755)
