"""What every `farm` command shares: the consoles, the store, and the bad-input error."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from pathlib import Path

from rich.console import Console

# Piped output keeps the full table width instead of rich's 80-column guess; $COLUMNS wins when set.
out = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit() else 160)
err = Console(stderr=True, soft_wrap=True)


class UserError(Exception):
    """Bad input; printed as one paragraph, exit code 2 (with --json also as JSON on stdout)."""

    def __init__(self, message: str, problems: list[dict] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or []  # file / line / field / message, for scripts


def open_store(args: argparse.Namespace):
    from farm.controller.store import Store, StoreError, default_db_path
    path = Path(args.db) if getattr(args, "db", None) else default_db_path()
    try:
        return Store(path)
    except StoreError as e:
        raise UserError(str(e)) from None


def output_file(text: str, option: str = "-o") -> Path:
    """A file the command will write: its folder must exist, checked before any work is done."""
    path = Path(text).expanduser().absolute()
    if path.is_dir():
        raise UserError(f"{option} {text}: {path} is a folder; give a file name inside it.")
    if not path.parent.is_dir():
        raise UserError(f"{option} {text}: the folder {path.parent} does not exist; create it first "
                        f"(mkdir -p {path.parent}) or write somewhere else. Nothing was written.")
    return path


def when(ts: float | None) -> str:
    return "—" if ts is None else dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")
