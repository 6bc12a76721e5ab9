"""`farm web --db PATH`: the lab dashboard over a local store (the controller serves the same with --web-listen).

Without --tokens it is open to whoever can reach it: fine on loopback (the default), warned about
anywhere else. Actions (release, quarantine, maintenance, cancel) write the store as the CLI does.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from farm.cli.console import UserError, err

DEFAULT_WEB_LISTEN = "127.0.0.1:8765"


def cmd_web(args: argparse.Namespace) -> int:
    from farm.controller.auth import TlsFiles, TokenFileError, TokenTable, check_tokens_file
    from farm.client.api import FarmError
    from farm.client.embedded import EmbeddedFarm
    from farm.web.server import Operator, WebListenError, listen_warnings, start_dashboard

    try:
        tokens = None
        if args.tokens:
            check_tokens_file(Path(args.tokens))
            tokens = TokenTable.from_file(Path(args.tokens))
        tls = None
        if args.tls_cert or args.tls_key:
            if not (args.tls_cert and args.tls_key):
                raise UserError("TLS needs both --tls-cert and --tls-key")
            tls = TlsFiles(cert=Path(args.tls_cert), key=Path(args.tls_key))
        warnings = listen_warnings(args.listen, tokens=tokens is not None, tls=tls is not None)
    except (TokenFileError, WebListenError) as e:
        raise UserError(str(e)) from None
    try:  # the dashboard reads this store itself: `farm web` is the embedded twin of --web-listen
        farm = EmbeddedFarm(args.db, create=args.create)
    except FarmError as e:
        raise UserError(str(e)) from None
    store = farm.store
    try:
        running = start_dashboard(store, args.listen, Operator.embedded(farm.controller), tokens=tokens, tls=tls)
    except WebListenError as e:
        raise UserError(str(e)) from None
    for warning in warnings:
        err.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)
    print(f"farm dashboard on {running.url} (store {store.location}; "
          f"{'tokens from ' + args.tokens if tokens else 'open: no tokens'})", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    while not stop.wait(1.0):
        pass
    running.stop()
    store.close()
    return 0


def add_parser(sub, common: argparse.ArgumentParser) -> None:
    # not `common`: its --tls-cert is a client's certificate, here it is the server's
    s = sub.add_parser("web", help="serve the lab dashboard (devices, jobs, calibrations) over a local store")
    s.add_argument("--db", default=None, help="SQLite store (default: $FARM_DB or the user data directory)")
    s.add_argument("--create", action="store_true", help="make the folder of --db (or $FARM_DB) when it is missing; without it a missing folder is an error")
    s.add_argument("--listen", default=DEFAULT_WEB_LISTEN, metavar="HOST:PORT",
                   help=f"where to serve it (default {DEFAULT_WEB_LISTEN}; :0 picks a port)")
    s.add_argument("--tokens", default=None, help="a tokens file (`ROLE TOKEN` a line): pages need a client or admin "
                                                  "token, device actions an admin one (default: open, loopback only)")
    s.add_argument("--tls-cert", default=None, help="serve HTTPS with this certificate (PEM)")
    s.add_argument("--tls-key", default=None, help="its private key (PEM)")
    s.set_defaults(func=cmd_web)
