"""The house's size gate: no function of the farm package runs over 80 lines (decorators not counted, its
docstring and comments counted: what a reader has to hold). `make test` runs it through
tests/test_function_length.py; ruff's C901 (pyproject's mccabe max-complexity 30) is its twin for branches.

    python tools/function_length.py        (lists every function over the limit that the allow-list does not name)

A function over the limit is carved (a pipeline of named steps, a table per part), not allow-listed; the
allow-list is for functions another engineer is carving in the same session, each with its reason, and an entry
that no longer matches a long function is itself an error (so the list only ever shrinks).
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80

# "farm.module:Qualified.name" -> why it may stay long for now. Keep it short and say whose it is.
# Empty since issue #35 item 5 carved the last seven: the gate stays, and a new entry needs its reason and owner.
ALLOWED: dict[str, str] = {}


def package_folders() -> dict[str, Path]:
    """farm.X -> its folder on disk, as pyproject's package-dir maps them."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {package: ROOT / folder for package, folder in package_dir.items()}


def _module_of(path: Path, folders: dict[str, Path]) -> str:
    for package, folder in sorted(folders.items(), key=lambda kv: -len(kv[0])):
        if path.is_relative_to(folder):
            parts = path.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            return ".".join((package, *parts))
    raise ValueError(f"{path}: not in the farm package")


def long_functions(source: str, module: str) -> list[tuple[str, int, int]]:
    """(module:qualified name, first line, lines) of every function in source over MAX_LINES lines."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                if lines > MAX_LINES:
                    found.append((f"{module}:{prefix}{child.name}", child.lineno, lines))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def problems() -> list[str]:
    """What the gate refuses: a long function not allow-listed, and an allow-list entry that no longer holds."""
    folders = package_folders()
    seen: dict[str, tuple[Path, int, int]] = {}
    for folder in sorted(set(folders.values())):
        for path in sorted(folder.rglob("*.py")):
            if "generated" in path.relative_to(folder).parts:
                continue  # protoc's output
            module = _module_of(path, folders)
            for name, line, lines in long_functions(path.read_text(encoding="utf-8"), module):
                seen[name] = (path, line, lines)
    found = [f"{path.relative_to(ROOT)}:{line}: {name.split(':')[1]} is {lines} lines (at most {MAX_LINES}); carve "
             "it into named steps" for name, (path, line, lines) in sorted(seen.items()) if name not in ALLOWED]
    found += [f"tools/function_length.py: the allow-list names {name}, which is no longer over {MAX_LINES} lines "
              "(or no longer there): take it off the list" for name in ALLOWED if name not in seen]
    return found


def main() -> int:
    found = problems()
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
