"""`farm artifacts gc`: remove the controller's stored artifacts that no job names.

Run on the controller's host against its store (`--db`, as `farm controller serve` was given); the
controller's nightly (`--refresh-cron`) does the same after it submits the reference suite. A file
younger than `--grace-hours` stays: an upload may still be waiting for its submit.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

from farm.cli.console import UserError, out
from farm.proto import strict_json


def cmd_artifacts_gc(args: argparse.Namespace) -> int:
    from farm.controller import service
    from farm.controller.grpc_server import controller_files
    from farm.controller.store import StoreError, db_location, is_url, open_store

    if not math.isfinite(args.grace_hours) or not 0 <= args.grace_hours <= 87600:
        raise UserError(f"--grace-hours {args.grace_hours}: give a number of hours between 0 and 87600")
    path = db_location(args.db)
    if not is_url(path) and not Path(path).exists():
        raise UserError(f"no store at {path}: give the controller's --db")
    try:
        store = open_store(path)
    except StoreError as e:
        raise UserError(str(e)) from None
    files = controller_files(store)  # the store's own artifact folder, next to the SQLite file
    answer = service.collect_artifacts(store, files.store, grace_s=args.grace_hours * 3600.0, dry_run=args.dry_run)
    if args.json:
        print(strict_json.dumps(dataclasses.asdict(answer), indent=2))
    else:
        verb = "would remove" if args.dry_run else "removed"
        out.print(f"{verb} {answer.files} artifact(s) no job names ({answer.bytes:,} bytes) from {answer.store}")
    return 0


def add_commands(sub, common: argparse.ArgumentParser) -> None:
    a = sub.add_parser("artifacts", help="the controller's artifact store")
    asub = a.add_subparsers(dest="artifacts_command", required=True, metavar="ACTION")
    # no --controller: it runs where the store is, as the controller's operator
    g = asub.add_parser("gc", help="remove stored artifacts no job names (run on the controller's host)")
    g.add_argument("--db", default=None, help="the controller's store: SQLite file or postgresql:// URL (default: $FARM_DB or the user data directory)")
    g.add_argument("--json", action="store_true", help="machine-readable output")
    g.add_argument("--grace-hours", type=float, default=24.0,
                   help="keep files younger than this: an upload may be waiting for its submit (default 24)")
    g.add_argument("--dry-run", action="store_true", help="list what would go, remove nothing")
    g.set_defaults(func=cmd_artifacts_gc)
