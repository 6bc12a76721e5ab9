"""A script's pip requirement with no aarch64 build, on the arm64 board (tests/arm_board.py, fixtures in
tests/board_aarch64.py): the run fails as the job's, naming the package and the platform. pip's resolution under
qemu-user takes minutes, so this is a file of its own that `make test`'s workers run beside the board's others."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest

from board_aarch64 import arm_fixture, board_config, board_task, script_workload  # noqa: F401 (the `arm` fixture)
from farm.agents.boards.driver import BoardDriver
from sshd_peer import SshdPeer

pytestmark = [pytest.mark.timeout(1800)]


def test_aarch64_a_wheel_without_an_aarch64_build_names_package_and_platform(arm: SshdPeer, mobilenet_models,
                                                                           tmp_path: Path) -> None:
    from arm_board import BOARD_WHEELHOUSE, cache_dir
    # a wheelhouse holding the package for x86_64 only, as many binary packages ship
    wheel = cache_dir() / "root" / BOARD_WHEELHOUSE.lstrip("/") / "farm_x86_only-1.0-py3-none-manylinux2014_x86_64.whl"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("farm_x86_only/__init__.py", "")
        z.writestr("farm_x86_only-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: farm-x86-only\nVersion: 1.0\n")
        z.writestr("farm_x86_only-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: false\n"
                   "Tag: py3-none-manylinux2014_x86_64\n")
        z.writestr("farm_x86_only-1.0.dist-info/RECORD", "")
    wheel.write_bytes(buffer.getvalue())
    try:
        workload = script_workload(tmp_path, "print('never')", ["farm-x86-only"])
        workload["dir"] = str(tmp_path / "job")
        result = BoardDriver(board_config(arm)).run(board_task(mobilenet_models["mobilenetv2_w0.35_r96.onnx"], workload),
                                               lambda: False)
    finally:
        wheel.unlink()
    assert result.failure_class == "job"
    assert "farm-x86-only" in result.message and "aarch64" in result.message, result.message
