"""Where every benchmark writes what it measured: results/<date>-<name>.md (the table) and .json (the figures)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, text: str, data: Any) -> Path:
    """Write today's table and figures for one benchmark; returns the .md path."""
    out = RESULTS / f"{dt.date.today()}-{name}"
    out.parent.mkdir(exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps(data, indent=2))
    return out.with_suffix(".md")
