"""The controller's modules import one another without a cycle: data flows one way (store → scheduling →
operations), and no import inside a function hides a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import farm.controller.scheduling.controller

CONTROLLER = Path(farm.controller.scheduling.controller.__file__).resolve().parent
PACKAGE = "farm.controller."


def module_imports(path: Path) -> set[str]:
    """The farm.controller modules `path` imports, inside functions too: a late import hides a cycle,
    it does not remove it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
            found.add(node.module.removeprefix(PACKAGE))
        elif isinstance(node, ast.ImportFrom) and node.module == "farm.controller":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix(PACKAGE) for a in node.names if a.name.startswith(PACKAGE)}
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_no_import_cycle_between_controller_modules() -> None:
    graph = {p.stem: module_imports(p) for p in CONTROLLER.glob("*.py") if p.stem != "__init__"}
    assert graph["controller"] and "metrics" not in graph["controller"]  # scheduling does not import operations
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_check_finds_a_cycle() -> None:
    assert find_cycle({"controller": {"metrics"}, "metrics": {"refresh"}, "refresh": {"controller"}}) == [
        "controller", "metrics", "refresh", "controller"]
    assert find_cycle({"controller": {"counters"}, "metrics": {"counters", "refresh"}, "refresh": {"controller"}}) is None
