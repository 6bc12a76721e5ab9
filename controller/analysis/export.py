"""Results as files: CSV for a spreadsheet and farm's strict JSON, the same for the CLI
(`farm results --csv/--json`) and the dashboard's downloads."""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from farm.proto import strict_json

if TYPE_CHECKING:  # the CLI's --json loads no pydantic until a command has answers to print
    from pydantic import JsonValue

    from farm.proto.questions import RunRecord


def _flatten(prefix: str, value: JsonValue, out: dict[str, JsonValue]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else k, v, out)
    else:
        out[prefix] = value


# A spreadsheet runs a cell that starts like a formula: a model or device name from a job file
# must stay text when the CSV is opened (OWASP's "CSV injection").
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _csv_cell(value: JsonValue) -> JsonValue:
    return "'" + value if isinstance(value, str) and value.startswith(FORMULA_START) else value


def results_csv(records: list[RunRecord]) -> str:
    """One row per run, its nested figures as dotted columns (latency_ms.avg); tool versions left out."""
    return rows_csv([r.model_dump(exclude={"tool_versions"}) for r in records])


def rows_csv(data: Sequence[Mapping[str, JsonValue]]) -> str:
    """Rows of JSON values as CSV: nested objects as dotted columns, the columns in the order first met."""
    rows = []
    for r in data:
        flat: dict[str, JsonValue] = {}
        _flatten("", dict(r), flat)
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
