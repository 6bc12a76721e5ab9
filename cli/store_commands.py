"""`farm store migrate --from farm.db --to postgresql://...`: move a lab from its SQLite file to PostgreSQL.

Run on the controller's host with the controller stopped (what it writes meanwhile would not be copied).
The copy is one transaction into an empty database, ids kept (controller/store/transfer.py); the SQLite
file is only read. The uploaded artifacts beside the file are copied to the folder a controller on the
database uses on this host.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from farm.cli.console import UserError, out
from farm.proto import strict_json


def cmd_store_migrate(args: argparse.Namespace) -> int:
    from farm.controller.store import StoreError, is_url, open_store, redact_url
    from farm.controller.store.postgres import PostgresStore
    from farm.controller.store.sqlite import SQLiteStore
    from farm.controller.store.transfer import copy_artifacts, copy_lab

    if is_url(args.source):
        raise UserError(f"--from {redact_url(args.source)[:80]!r}: give the SQLite file to move (a path such as "
                        "~/.local/share/farm/farm.db)")
    source_path = Path(args.source).expanduser()
    if not source_path.is_file():
        raise UserError(f"--from {args.source}: no such file; give the SQLite store the lab is in now")
    if not is_url(args.target) or not args.target.lower().startswith(("postgresql://", "postgres://")):
        raise UserError(f"--to {redact_url(args.target)[:80]!r}: give the PostgreSQL database to move the lab into, "
                        "as postgresql://user@host:5432/database (created empty with createdb)")
    try:
        source = open_store(source_path)
        target = open_store(args.target)
    except StoreError as e:
        raise UserError(str(e)) from None
    assert isinstance(source, SQLiteStore) and isinstance(target, PostgresStore)
    try:
        copied = copy_lab(source, target)
        files = copy_artifacts(source, target)
    except StoreError as e:
        raise UserError(str(e)) from None
    finally:
        source.close()
        target.close()
    answer = {"from": str(source.path), "to": target.location, "rows": copied, "artifact_files": files}
    if args.json:
        print(strict_json.dumps(answer, indent=2))
    else:
        out.print(f"moved the lab from {source.path} to {target.location}: "
                  + ", ".join(f"{n} {table}" for table, n in copied.items() if n)
                  + f"; {files} artifact file(s). Start the controller with --db {target.location}.")
    return 0


def add_commands(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("store", help="the lab's store (move it to PostgreSQL)")
    ssub = s.add_subparsers(dest="store_command", required=True, metavar="ACTION")
    m = ssub.add_parser("migrate", help="copy a lab from its SQLite file into an empty PostgreSQL database")
    m.add_argument("--from", dest="source", required=True, metavar="FILE", help="the SQLite store (farm.db)")
    m.add_argument("--to", dest="target", required=True, metavar="URL",
                   help="an empty PostgreSQL database: postgresql://user@host:5432/db (password: ~/.pgpass)")
    m.add_argument("--json", action="store_true", help="machine-readable output")
    m.set_defaults(func=cmd_store_migrate)
