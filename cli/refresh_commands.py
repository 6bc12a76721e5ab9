"""`farm refresh` (the nightly reference suite and what follows it) and `farm drift`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from farm.proto.names import BACKEND_CHOICES
from farm.cli.console import UserError, err, job_progress, open_farm, out, when
from farm.cli.render import empty_list
from farm.proto import strict_json

if TYPE_CHECKING:
    from farm.client.api import Farm, RefreshAnswer


def cmd_refresh(args: argparse.Namespace) -> int:
    from farm.client.api import RefreshAsk

    farm = open_farm(args)
    if not farm.embedded and (args.devices or args.backend or args.slots != 1):
        raise UserError(f"--devices, --backend and --slots shape a refresh run in this process; the {farm.where} "
                        "refreshes the devices its agents registered, with their own sandboxes: drop them")
    suite = args.suite or os.environ.get("FARM_REFERENCE_SUITE")
    ask = RefreshAsk(k=args.k, max_slope_change=args.max_slope_change, max_prediction_shift=args.max_prediction_shift,
                     max_intercept_change=args.max_intercept_change, max_r2_drop=args.max_r2_drop,
                     include_contended=args.include_contended,
                     suite=Path(suite) if suite and (farm.embedded or args.suite) else None)
    with job_progress(args, 0) as update:
        report = farm.refresh(ask, update)
    if report is None:
        return 130
    if args.json:
        print(strict_json.dumps(report, indent=2))
    else:
        out.print(f"reference suite: job {report.job}; {len(report.calibrations)} calibration version(s) written")
        for d in report.drift:
            verdict = Text(f"drift: {'; '.join(d.reasons)}", "yellow") if d.exceeded else Text("no drift", "green")
            out.print(Text.assemble(f"{d.device} latency threads={d.threads}: ", verdict))
        for device, why in report.quarantined.items():
            err.print(Text.assemble(("quarantined ", "red"), f"{device}: " + "; ".join(why)))
        for line in report.refused:
            err.print(Text.assemble(("not fitted ", "yellow"), line))
        if report.contended_left_out:
            err.print(Text.assemble(("left out ", "yellow"), f"{report.contended_left_out} contended sim run(s): "
                                    "other work used their cores"))
    failures = refresh_failures(farm, report)
    if failures:
        err.print(Text.assemble(("refresh failed: ", "red"), "; ".join(failures)), highlight=False)
    return 1 if failures else 0


def refresh_failures(farm: Farm, report: RefreshAnswer) -> list[str]:
    """Why a refresh did not do its job, each said once: runs failed, nothing fitted, devices quarantined.
    None of them: exit 0; any: exit 1, so a cron job or a CI step sees a refresh that went wrong."""
    failures = []
    job = farm.job(report.job)
    if job.failed or job.canceled or job.status != "completed":
        failures.append(f"{job.failed + job.canceled} of {job.total} reference run(s) failed or were canceled "
                        f"(job {report.job} is {job.status}; `farm results {report.job}` says why)")
    if not report.calibrations:
        failures.append("nothing was fitted" + (f" ({len(report.refused)} key(s) refused: see `not fitted` above)"
                                               if report.refused else " (no device run paired with its sim twin)"))
    since = job.created_at.timestamp() if job.created_at is not None else 0.0
    quarantined = set(report.quarantined) | {d.name for d in farm.device_health() if d.health == "bad" and (
        d.changed_at is not None and d.changed_at.timestamp() >= since)}
    if quarantined:
        devices = {r.target for r in farm.results(report.job) if r.target != "sim"}  # the devices it refreshed
        every = bool(devices) and devices <= quarantined
        failures.append(f"{'every device was' if every else f'{len(quarantined)} device(s)'} quarantined: "
                        f"{', '.join(sorted(quarantined))} (`farm device health` says why; "
                        "`farm device release NAME` once fixed)")
    return failures


def cmd_drift(args: argparse.Namespace) -> int:
    rows = open_farm(args).drift(args.device)
    if args.json:
        print(strict_json.dumps(rows, indent=2))
        return 0
    if not rows:
        out.print(empty_list("drift records", "drift compares a device's calibration with its previous version; "
                             "each `farm refresh --devices lab.yaml` after the first makes one."))
        return 0
    t = Table(header_style="bold")
    for c in ("when", "device", "metric", "threads", "calibration", "slope Δ", "intercept Δ", "R² drop",
              "prediction shift", "verdict"):
        t.add_column(c)
    for r in rows:
        t.add_row(when(r.created_at), Text(r.device), r.metric, str(r.threads),
                  f"#{r.previous_id} → #{r.calibration_id}", f"{100 * r.slope_change:.1f} %",
                  f"{100 * r.intercept_change:.1f} %", f"{r.r2_drop:.3f}", f"{100 * r.prediction_shift:.1f} %",
                  Text(r.reasons or "ok", "yellow" if r.exceeded else "green"))
    out.print(t)
    return 0


def add_commands(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("refresh", parents=[common], help="run the reference suite on every device, refit, check drift")
    s.add_argument("--suite", help="the reference suite job file (default: the one farm ships; $FARM_REFERENCE_SUITE)")
    s.add_argument("--devices", help="the lab's device list (default $FARM_DEVICES)")
    s.add_argument("--k", type=float, default=3.0, help="quarantine when a golden result leaves its history by k·σ")
    s.add_argument("--max-slope-change", type=float, default=0.30, help="drift threshold (relative, default 0.30)")
    s.add_argument("--max-prediction-shift", type=float, default=0.25, help="drift threshold (relative, default 0.25)")
    s.add_argument("--max-intercept-change", type=float, default=0.30,
                   help="drift threshold (relative to the mean device value, default 0.30)")
    s.add_argument("--max-r2-drop", type=float, default=0.05, help="drift threshold (default 0.05)")
    s.add_argument("--slots", type=int, default=1, help="embedded: sim runs at once, each on its own cores")
    s.add_argument("--include-contended", action="store_true",
                   help="also fit sim twins whose cores other work used (left out by default)")
    s.add_argument("--backend", choices=BACKEND_CHOICES, default=None,
                   help="override sim.backend of the reference suite")
    s.add_argument("--quiet", action="store_true", help="no progress output")
    s.add_argument("--progress", action="store_true", help="show the progress bar even when not on a terminal")
    s.set_defaults(func=cmd_refresh)

    s = sub.add_parser("drift", parents=[common], help="how each device's calibration moved between refreshes")
    s.add_argument("--device", help="only this device")
    s.set_defaults(func=cmd_drift)
