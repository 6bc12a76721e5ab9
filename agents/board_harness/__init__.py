"""The board harness: one file the agent pushes to a board by content hash and runs with the
board's own python3 (3.6 or newer), so a board needs no farm install (see board_harness.py)."""

from __future__ import annotations

from pathlib import Path

HARNESS_FILE = Path(__file__).resolve().parent / "board_harness.py"
