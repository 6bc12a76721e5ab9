"""SQL lives in the store's implementations only (controller/store/sql.py, the queries both databases share,
controller/store/sqlite.py with SQLite's migrations in schema.py, and controller/store/postgres.py): every other controller module asks a repository by a method's name.

Checked on the source itself (string literals and calls), so a statement pasted back into a
controller module fails here, whichever test exercises that module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import farm.controller.store

CONTROLLER = Path(farm.controller.store.__file__).resolve().parents[1]  # controller/, every role
STORE = CONTROLLER / "store"
# A statement's opening words, as SQL writes them (upper case), anywhere in a string literal.
STATEMENT = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE|REPLACE|CREATE|DROP|ALTER|PRAGMA)\s|\bBEGIN IMMEDIATE\b|\bSAVEPOINT\b")
# Calls that reach SQLite directly, bypassing the Store's methods.
DIRECT_CALLS = {"execute", "executemany", "executescript"}


def sql_outside_store(path: Path) -> list[str]:
    """`file:line: what` for each SQL statement or direct SQLite call in `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and STATEMENT.search(node.value):
            found.append(f"{path.name}:{node.lineno}: SQL in a string: {node.value.strip()[:60]!r}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in DIRECT_CALLS:
            found.append(f"{path.name}:{node.lineno}: a direct .{node.func.attr}() call")
        elif isinstance(node, ast.Attribute) and node.attr == "db" and isinstance(node.value, (ast.Name, ast.Attribute)):
            found.append(f"{path.name}:{node.lineno}: the store's sqlite_utils handle (.db) used directly")
    return found


def test_no_sql_in_controller_modules_but_the_store() -> None:
    modules = sorted(p for p in CONTROLLER.rglob("*.py") if STORE not in p.parents)
    assert len(modules) > 10  # the scan looks where the modules are
    found = [hit for module in modules for hit in sql_outside_store(module)]
    assert not found, "SQL belongs in a named repository method (controller/store/sqlite.py):\n" + "\n".join(found)


# The store's modules that speak a database's language; the interface, rows, metrics and samples do not.
# the lab-wide parts a PostgreSQL lab shares between controllers (issue 32) are store implementations too: each
# owns its table (artifact chunks, agent presence, the leader lease) and is reached only through the store
# job_listing.py is the SQLite store's listing read with sqlite3 alone, its statements shared with sql.py (issue 34)
STORE_SQL_MODULES = {"sql.py", "sqlite.py", "schema.py", "postgres.py", "artifacts_db.py", "presence.py", "leader.py",
                     "job_listing.py"}


def test_inside_the_store_only_the_implementations_hold_sql() -> None:
    modules = sorted(p for p in STORE.glob("*.py") if p.name not in STORE_SQL_MODULES)
    assert {"interface.py", "rows.py", "__init__.py"} <= {p.name for p in modules}
    found = [hit for module in modules for hit in sql_outside_store(module)]
    assert not found, "SQL belongs in sql.py, sqlite.py or postgres.py, behind controller/store/interface.py:\n" + "\n".join(found)


def test_the_check_finds_each_kind_of_sql(tmp_path: Path) -> None:
    module = tmp_path / "sneaky.py"
    module.write_text(
        'rows = store.query("SELECT id FROM jobs")\n'
        'store.db.conn.executemany("insert into runs values (?)", rows)\n'
        'sql = f"UPDATE tasks SET status = {status!r}"\n'
        'note = "select a device; update the lab when it is back"\n')
    found = sql_outside_store(module)
    assert sorted(hit.split(": ")[0] for hit in found) == ["sneaky.py:1", "sneaky.py:2", "sneaky.py:2", "sneaky.py:3"], found
    assert not any("sneaky.py:4" in hit for hit in found)  # lower-case prose is not a statement
