"""`farm device release|quarantine|health`: the lab's judgement of a device, kept in the store.

A device whose tasks keep failing for infrastructure reasons is quarantined by the controller
itself; a person looks at it and releases it.
"""

from __future__ import annotations

import argparse
import json

from rich.table import Table
from rich.text import Text

from farm.cli.console import open_store, out, when
from farm.cli.render import empty_list
from farm.cli.remote import RemoteError, controller_address, remote_forget_device
from farm.proto.escape import printable
from farm.proto import strict_json


def cmd_device(args: argparse.Namespace) -> int:
    from farm.controller.controller import Controller

    controller = Controller(open_store(args))
    if args.action == "release":
        controller.release(args.device)
        message = f"{args.device} released: it takes tasks again"
    elif args.action == "quarantine":
        n = controller.quarantine(args.device, args.reason or "quarantined by a person")
        message = f"{args.device} quarantined; {n} waiting task(s) failed (infrastructure)"
    elif args.action == "maintenance":
        n = controller.quarantine(args.device, args.reason or "in maintenance", health="maintenance")
        message = f"{args.device} in maintenance; {n} waiting task(s) failed (infrastructure)"
    else:
        rows = controller.device_health()
        if args.json:
            print(strict_json.dumps(rows, indent=2))
            return 0
        if not rows:
            out.print(empty_list("device health records", "a device gets one at its first `farm refresh` or health check "
                                 "(`farm refresh --devices lab.yaml`; examples/lab.yaml shows the file)."))
            return 0
        t = Table(header_style="bold")
        for c in ("device", "health", "since", "reason"):
            t.add_column(c)
        for r in rows:
            t.add_row(Text(r["name"]), r["health"], when(r["changed_at"]), Text(printable(r["reason"] or "", limit=None)))
        out.print(t)
        return 0
    if args.json:
        print(json.dumps({"device": args.device, "action": args.action}))
    else:
        out.print(message)
    return 0


def add_commands(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("device", parents=[common],
                       help="a device's health: release, quarantine, list; forget: free its name on a controller (admin)")
    s.add_argument("action", choices=["release", "quarantine", "maintenance", "health", "forget"])
    s.add_argument("device", nargs="?", default=None)
    s.add_argument("--reason", help="quarantine: why (shown to whoever looks next)")
    s.set_defaults(func=_checked)


def _checked(args: argparse.Namespace) -> int:
    from farm.cli.console import UserError
    if args.action != "health" and not args.device:
        raise UserError(f"farm device {args.action} needs a device name (`farm device health` lists them)")
    if args.action == "forget":
        if not controller_address(args):
            raise RemoteError("`farm device forget NAME` frees a name on a controller: pass --controller HOST:PORT "
                              "and an admin --token")
        return remote_forget_device(args)
    return cmd_device(args)


def cmd_lab_devices(args: argparse.Namespace) -> int:
    """`farm devices` without a controller: the lab's device list, each with health, its last
    reference-suite check and the age of its newest calibration."""
    import time

    from farm.cli.main import _lab
    from farm.controller.refresh import last_reference_checks
    store = open_store(args)
    health = {r["name"]: r for r in store.query("SELECT * FROM device_health")}
    checks = last_reference_checks(store)
    rows = []
    for d in _lab(args):
        last_check = checks.get(d.name)
        newest = store.query("SELECT MAX(created_at) AS at FROM calibrations WHERE device = ?", [d.name])[0]["at"]
        h = health.get(d.name)
        rows.append({"name": d.name, "driver": d.entry.driver, "device_type": d.device_type.name if d.device_type else None,
                     "tags": d.tags, "health": h["health"] if h else "unknown", "reason": h["reason"] if h else None,
                     "last_check": last_check, "calibration_age_s": time.time() - newest if newest else None})
    if args.json:
        print(strict_json.dumps(rows, indent=2))
        return 0
    if not rows:
        out.print(empty_list("devices", "list your phones and boards in a YAML file and pass it with --devices FILE "
                             "or $FARM_DEVICES (examples/lab.yaml shows every driver)."))
        return 0
    t = Table(header_style="bold")
    for c in ("device", "type", "driver", "tags", "health", "last check", "calibration age", "reason"):
        t.add_column(c)
    for r in rows:
        age = r["calibration_age_s"]
        t.add_row(Text(r["name"]), r["device_type"] or "—", r["driver"], ",".join(r["tags"]), r["health"],
                  when(r["last_check"]), "—" if age is None else f"{age / 3600:.1f} h", Text(r["reason"] or ""))
    out.print(t)
    return 0
