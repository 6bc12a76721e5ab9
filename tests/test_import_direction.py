"""Data flows one way through the roles: proto/ is the vocabulary every role uses and imports
no role; agents/ and controller/ never import each other; the client wires them together
(client/runner.py runs a controller and an agent in one process), and the CLI, the dashboard and the
Python API stand on the client.

The whole house stacks: version ← proto ← models (inspection) ← model_generators ← agents, controller
← client ← web, the Python API ← cli. A module imports only its own role or roles below it; parsers
import only proto; the harness and the parsers never import each other; and no import cycle exists
anywhere in the package. Read from the source with ast, so an import inside a function counts as
much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# folder -> farm packages it must never import
FORBIDDEN = {
    "proto": ("farm.agents", "farm.controller", "farm.cli"),
    "models": ("farm.agents", "farm.controller", "farm.cli", "farm.model_generators"),
    "model_generators": ("farm.agents", "farm.controller", "farm.cli"),
    "agents": ("farm.controller", "farm.cli"),
    "controller": ("farm.agents", "farm.cli"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def test_no_role_imports_against_the_flow() -> None:
    wrong = []
    for folder, banned in FORBIDDEN.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, module in imported_modules(path):
                if any(module == b or module.startswith(b + ".") for b in banned):
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: imports {module}")
    assert not wrong, "imports that run against the data flow:\n" + "\n".join(wrong)


def test_the_shipped_package_never_imports_test_fixtures() -> None:
    """Broken-model generators (tests/model_fixtures.py) are for tests; the package writes only models that work."""
    wrong = [f"{path.relative_to(ROOT)}:{line}: imports {module}"
             for folder in ("farm", "proto", "models", "model_generators", "agents", "controller", "client", "cli", "web")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for line, module in imported_modules(path)
             if module.split(".")[0] in ("model_fixtures", "conftest", "tests")]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from farm.controller.scheduling.store import Store\n    return Store\n")
    assert imported_modules(source) == [(2, "farm.controller.scheduling.store")]


# --- the whole house ---------------------------------------------------------------------------
# Folder on disk -> import name (pyproject's package-dir): the roles are folders, the names are farm.*.
FOLDERS = {"farm": "farm", "proto": "farm.proto", "models": "farm.models", "model_generators": "farm.model_generators",
           "agents": "farm.agents", "controller": "farm.controller", "client": "farm.client", "web": "farm.web",
           "cli": "farm.cli"}
# A role imports only its own role and the roles ranked below it; equal ranks never import each other.
RANK = {"version": 0, "proto": 1, "models": 2, "model_generators": 3, "agents": 4, "controller": 4, "client": 5,
        "web": 6, "api": 6, "cli": 7, "farm": 8}
# (importer, imported) pairs allowed against the rules above, each with its reason. Keep it empty.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def house_modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "generated" in path.relative_to(ROOT).parts:  # protoc's stubs import only each other
                continue
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def house_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the farm modules it imports (relative imports resolved; `from pkg import mod` names mod)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        wanted: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                wanted.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                for alias in node.names:
                    wanted.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        deps = set()
        for module in wanted:
            while module and module not in modules:  # farm.proto.spec.JobSpec -> farm.proto.spec
                module = module.rpartition(".")[0]
            if module and module != name:
                deps.add(module)
        graph[name] = deps
    return graph


def role(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "farm"
    return parts[1] if parts[1] in RANK else "farm"


def test_every_role_imports_only_roles_below_it() -> None:
    wrong = [f"{a} ({role(a)}) imports {b} ({role(b)})"
             for a, deps in house_graph(house_modules()).items() for b in sorted(deps)
             if role(a) != role(b) and RANK[role(b)] >= RANK[role(a)] and (a, b) not in EXCEPTIONS]
    assert wrong == [], "imports against the stack:\n" + "\n".join(sorted(wrong))


def test_parsers_import_only_proto_and_the_harness_and_parsers_never_each_other() -> None:
    graph = house_graph(house_modules())
    parsers, harness = "farm.agents.parsers", "farm.agents.harness"
    wrong = [f"{a} imports {b}" for a, deps in graph.items() if a.startswith(parsers + ".") for b in sorted(deps)
             if not b.startswith(("farm.proto", parsers))]
    wrong += [f"{a} imports {b}" for a, deps in graph.items() for b in sorted(deps)
              if (a.startswith(harness) and b.startswith(parsers)) or (a.startswith(parsers) and b.startswith(harness))]
    assert wrong == [], "\n".join(wrong)


def test_scheduling_reaches_the_roles_above_it_only_through_its_hooks() -> None:
    graph = house_graph(house_modules())
    wrong = [f"{a} imports {b}" for a, deps in graph.items() if a.startswith("farm.controller.scheduling")
             for b in sorted(deps) if b.startswith(("farm.model_generators", "farm.controller.operations",
                                                    "farm.controller.analysis"))]
    assert wrong == [], "\n".join(wrong)


def find_cycles(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, str] = {}
    cycles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if (node, dep) in EXCEPTIONS:
                continue
            if state.get(dep) == "open":
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_no_import_cycle_anywhere_in_farm() -> None:
    cycles = find_cycles(house_graph(house_modules()))
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def test_the_house_checks_see_what_they_must(tmp_path: Path) -> None:
    """The graph names a module imported as `from package import module`, and a cycle is found."""
    graph = house_graph(house_modules())
    assert "farm.controller.service" in graph["farm.client.embedded"]  # `from farm.controller import service`
    assert "farm.controller.scheduling.hooks" in graph["farm.controller"]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a -> b -> c -> a"]
    assert role("farm") == "farm" and role("farm.version") == "version" and role("farm.agents.sim.driver") == "agents"
