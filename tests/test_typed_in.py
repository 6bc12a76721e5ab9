"""Typed all the way in (issue 35 item 2), kept so: the layers the issue names stay under mypy's strict flags, a
class name is defined once in the package, and the store's rows are read by attribute (only the two rows
controller/grpc_server.py still reads by name keep `row["field"]`). Counts come from tools/type_counts.py."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from farm.controller.store import rows

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("type_counts", ROOT / "tools" / "type_counts.py")
assert _spec is not None and _spec.loader is not None
counts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(counts)

# Class names two modules may both define, each with why. Keep it short: a new entry needs a reason this good.
DOUBLED_ALLOWED = {
    # farm.RunRecord (farm/api.py, the Python API's flat record) and farm.client.api.RunRecord (the typed answer,
    # proto/questions.py) are both public names; one of them goes when the Python API moves to the typed record.
    "RunRecord": ["farm.api", "farm.proto.questions"],
}
# Rows controller/grpc_server.py reads by name; it is carved in its own branch (issue #35). Only ever shrinks.
ITEM_ACCESS_ALLOWED = {"RunningAttempt", "DeviceRow"}


def test_a_class_name_is_defined_once_in_the_package() -> None:
    assert counts.doubled_class_names(counts.package_files()) == DOUBLED_ALLOWED


def test_the_layers_the_issue_names_are_checked_strictly() -> None:
    modules = counts.package_files()
    strict = set(counts.strict_modules(modules))
    wanted = {m for m in modules if m.startswith(("farm.controller.analysis", "farm.controller.store", "farm.web"))}
    wanted |= {"farm.controller.service", "farm.cli.render"}
    assert wanted - strict == set()


def test_store_rows_are_read_by_attribute() -> None:
    job = rows.JobRow(id=1, name="j", status="queued", priority="normal", created_at=0.0, started_at=None,
                      finished_at=None, spec_json=None, spec_yaml=None, source_path=None, base_dir=None, owner_pid=None,
                      owner_host=None, message=None, kind="user", submitted_by=None, team=None)
    assert job.status == "queued" and job.as_dict()["name"] == "j"
    with pytest.raises(TypeError):
        job["status"]  # type: ignore[index]
    assert not hasattr(job, "get") and not hasattr(job, "items")
    with_item_access = {name for name, cls in vars(rows).items()
                        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and issubclass(cls, rows.ItemAccess)}
    assert with_item_access == ITEM_ACCESS_ALLOWED


def test_the_counter_finds_a_doubled_name_and_a_shim_read(tmp_path: Path) -> None:
    # the counters themselves: a second `class Limits` is found, `row["` and `dict[str, Any]` are counted
    one, two = tmp_path / "one.py", tmp_path / "two.py"
    one.write_text("class Limits:\n    pass\n")
    two.write_text("from typing import Any\n\n\nclass Limits:\n    pass\n\n\ndef f(row: dict[str, Any]) -> Any:\n"
                   "    return row[\"a\"]\n")
    assert counts.doubled_class_names({"farm.one": one, "farm.two": two}) == {"Limits": ["farm.one", "farm.two"]}
    assert counts.count_files([one, two]) == {"files": 2, "string_keyed_reads": 1, "dict_str_any": 1, "row_shim": 1}
