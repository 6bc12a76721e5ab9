"""Results as files: CSV for a spreadsheet and farm's strict JSON, the same for the CLI
(`farm results --csv/--json`) and the dashboard's downloads."""

from __future__ import annotations

import csv
import io
from typing import Any

from farm.proto import strict_json


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else k, v, out)
    else:
        out[prefix] = value


# A spreadsheet runs a cell that starts like a formula: a model or device name from a job file
# must stay text when the CSV is opened (OWASP's "CSV injection").
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _csv_cell(value: Any) -> Any:
    return "'" + value if isinstance(value, str) and value.startswith(FORMULA_START) else value


def results_csv(records: list[dict[str, Any]]) -> str:
    rows = []
    for r in records:
        flat: dict[str, Any] = {}
        _flatten("", {k: v for k, v in r.items() if k != "tool_versions"}, flat)
        rows.append({k: _csv_cell(v) for k, v in flat.items()})
    fields: list[str] = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def to_json(data: Any) -> str:
    return strict_json.dumps(data, indent=2)
