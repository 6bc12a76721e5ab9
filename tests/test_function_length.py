"""The size gate (tools/function_length.py): no farm function over 80 lines unless the allow-list names it,
and no allow-list entry that no longer holds. ruff's C901 (pyproject) is the same gate for branches."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("function_length", ROOT / "tools" / "function_length.py")
assert _spec is not None and _spec.loader is not None
gate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gate)


def test_the_package_has_no_function_over_the_limit():
    assert gate.problems() == []


def test_a_long_function_is_found_with_its_qualified_name():
    body = "\n".join(f"    x{i} = {i}" for i in range(gate.MAX_LINES))
    source = f"class Driver:\n    def run(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n\ndef short():\n    return 1\n"
    found = gate.long_functions(source, "farm.agents.example")
    assert [(name, line) for name, line, _ in found] == [("farm.agents.example:Driver.run", 2)]
    assert found[0][2] == gate.MAX_LINES + 1


def test_a_stale_allow_list_entry_is_refused(monkeypatch):
    monkeypatch.setitem(gate.ALLOWED, "farm.cli.main:no_such_function", "test")
    assert any("no_such_function" in line and "take it off the list" in line for line in gate.problems())
