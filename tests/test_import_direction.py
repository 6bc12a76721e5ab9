"""Data flows one way through the roles: proto/ is the vocabulary every role uses and imports
no role; agents/ and controller/ never import each other; only the CLI wires them together
(cli/embedded.py runs a controller and an agent in one process).

Read from the source with ast, so an import inside a function counts as much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# folder -> farm packages it must never import
FORBIDDEN = {
    "proto": ("farm.agents", "farm.controller", "farm.cli"),
    "models": ("farm.agents", "farm.controller", "farm.cli"),
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
             for folder in ("farm", "proto", "models", "agents", "controller", "cli")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for line, module in imported_modules(path)
             if module.split(".")[0] in ("model_fixtures", "conftest", "tests")]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from farm.controller.scheduling.store import Store\n    return Store\n")
    assert imported_modules(source) == [(2, "farm.controller.scheduling.store")]
