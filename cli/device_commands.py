"""`farm device release|quarantine|maintenance|health|forget`: the lab's judgement of a device, kept by the farm.

A device whose tasks keep failing for infrastructure reasons is quarantined by the controller
itself; a person looks at it and releases it. With a controller configured these change the
controller's devices (an admin token), never a local store.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from farm.cli.console import UserError, open_farm, out, when
from farm.cli.render import empty_list
from farm.proto.escape import printable
from farm.proto import strict_json

if TYPE_CHECKING:  # answer models (pydantic): loaded by the command that asks
    from farm.client.api import ForgetDeviceAnswer, SetDeviceHealthAnswer


def cmd_device(args: argparse.Namespace) -> int:
    if args.action != "health" and not args.device:
        raise UserError(f"farm device {args.action} needs a device name (`farm device health` lists them)")
    farm = open_farm(args)
    if args.action == "health":
        rows = farm.device_health()
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
            t.add_row(Text(r.name), r.health, when(r.changed_at), Text(printable(r.reason or "", limit=None)))
        out.print(t)
        return 0
    answer: ForgetDeviceAnswer | SetDeviceHealthAnswer
    if args.action == "forget":
        forgotten = answer = farm.forget_device(args.device)
        message = (f"device {forgotten.device} forgotten: it no longer belongs to agent {forgotten.agent}; the next "
                   "agent that registers it owns it")
    else:
        changed = answer = farm.set_device_health(args.device, args.action, args.reason)
        n = changed.failed_tasks
        message = {"release": f"{args.device} released: it takes tasks again",
                   "quarantine": f"{args.device} quarantined; {n} waiting task(s) failed (infrastructure)",
                   "maintenance": f"{args.device} in maintenance; {n} waiting task(s) failed (infrastructure)",
                   }[args.action]
    if args.json:
        print(strict_json.dumps(answer))
    else:
        out.print(Text(f"{message} ({farm.where})"))
    return 0


def add_commands(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("device", parents=[common],
                       help="a device's health: release, quarantine, list; forget: free its name on a controller (admin)")
    s.add_argument("action", choices=["release", "quarantine", "maintenance", "health", "forget"],
                   help="release: back in service; quarantine / maintenance: out of service; health: list; "
                        "forget: free the name")
    s.add_argument("device", nargs="?", default=None, help="the device's name (health: all devices when omitted)")
    s.add_argument("--reason", help="quarantine: why (shown to whoever looks next)")
    s.set_defaults(func=cmd_device)
