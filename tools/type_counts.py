"""How typed is the farm package? The figures issue #35 item 2 counts, read from the source:

- string-keyed reads: lines holding `["` (as `grep -c '\\["'` counts them), per file, summed;
- `dict[str, Any]`: its occurrences;
- `row["…"]`: the typed rows' string-keyed shim, its uses;
- doubled class names: class names defined (at any depth) in more than one place in the package (an `ast` scan);
- modules under strict mypy: the package's modules that a `[[tool.mypy.overrides]]` with
  `disallow_untyped_defs = true` names (protoc's generated modules, exempted again, not counted).

Each figure is given for the whole package and for the aim's scope (`controller/analysis`,
`controller/service.py`, `cli/`, `web/`).

    python tools/type_counts.py [--json]
"""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import sys
import tomllib
from collections import defaultdict
from pathlib import Path
from typing import TypedDict

ROOT = Path(__file__).resolve().parents[1]
AIM_SCOPE = ("controller/analysis/", "controller/service.py", "cli/", "web/")


class Counts(TypedDict):
    files: int
    string_keyed_reads: int
    dict_str_any: int
    row_shim: int


def package_files() -> dict[str, Path]:
    """farm module name -> its source file, as pyproject's package-dir maps the role folders."""
    package_dir: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    modules: dict[str, Path] = {}
    for package, folder in package_dir.items():
        base = ROOT / folder
        if package == "farm":
            files = [p for p in base.glob("*.py")]
        else:
            files = sorted(base.rglob("*.py"))
        for path in files:
            relative = path.relative_to(base).with_suffix("")
            parts = [p for p in relative.parts if p != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def count_files(paths: list[Path]) -> Counts:
    counts = Counts(files=len(paths), string_keyed_reads=0, dict_str_any=0, row_shim=0)
    for path in paths:
        text = path.read_text()
        counts["string_keyed_reads"] += sum(1 for line in text.splitlines() if '["' in line)
        counts["dict_str_any"] += text.count("dict[str, Any]")
        counts["row_shim"] += len(re.findall(r'\brow\["', text))
    return counts


def doubled_class_names(modules: dict[str, Path]) -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(name)
    return {cls: sorted(places) for cls, places in sorted(where.items()) if len(places) > 1}


def strict_modules(modules: dict[str, Path]) -> list[str]:
    overrides = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"].get("overrides", [])
    strict: set[str] = set()
    for override in overrides:  # later overrides win, as in mypy
        patterns = override["module"] if isinstance(override["module"], list) else [override["module"]]
        if "disallow_untyped_defs" not in override:
            continue
        for module in modules:
            if any(fnmatch.fnmatchcase(module, p) for p in patterns):
                if override["disallow_untyped_defs"]:
                    strict.add(module)
                else:
                    strict.discard(module)
    return sorted(strict)


def in_scope(path: Path) -> bool:
    relative = path.relative_to(ROOT).as_posix()
    return any(relative == s or (s.endswith("/") and relative.startswith(s)) for s in AIM_SCOPE)


def main(argv: list[str]) -> int:
    modules = package_files()
    paths = list(modules.values())
    doubled = doubled_class_names(modules)
    strict = strict_modules(modules)
    report = {
        "package": count_files(paths),
        "aim_scope": count_files([p for p in paths if in_scope(p)]),
        "doubled_class_names": doubled,
        "modules": len(modules),
        "strict_modules": len(strict),
    }
    if "--json" in argv:
        print(json.dumps(report, indent=1))
        return 0
    for key in ("package", "aim_scope"):
        c = report[key]
        assert isinstance(c, dict)
        print(f"{key:10} files {c['files']:4}  string-keyed reads {c['string_keyed_reads']:5}  "
              f"dict[str, Any] {c['dict_str_any']:4}  row[\"…\"] {c['row_shim']:4}")
    print(f"doubled class names {len(doubled)}: " + ", ".join(f"{k} ({len(v)})" for k, v in doubled.items()))
    for cls, places in doubled.items():
        print(f"  {cls}: {', '.join(places)}")
    print(f"modules under strict mypy: {len(strict)} of {len(modules)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
