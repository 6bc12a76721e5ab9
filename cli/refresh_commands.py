"""`farm refresh` (the nightly reference suite and what follows it) and `farm drift`."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table
from rich.text import Text

from farm.cli.console import UserError, err, open_store, out, when
from farm.cli.render import empty_list
from farm.proto import strict_json
from farm.proto.spec import Priority


def suite_path(given: str | None = None) -> Path | None:
    """--suite, else $FARM_REFERENCE_SUITE, else None: the suite that ships with farm."""
    import os
    chosen = given or os.environ.get("FARM_REFERENCE_SUITE")
    return Path(chosen) if chosen else None


def run_reference_suite(args: argparse.Namespace, store, lab: list, suite: Path | None, *, priority: Priority = "low",
                        thresholds=None, k: float = 3.0):
    """Submit and run the suite on `lab` (each device with its sim twin), then refit and check.
    Returns the RefreshReport, or None when interrupted."""
    from farm.cli.main import _run_with_progress, lab_target
    from farm.controller.alerts import alerts_from_environment
    from farm.controller.controller import Controller
    from farm.controller.jobfile import JobFileError
    from farm.controller.reference_suite import SuiteError, submit_reference_suite
    from farm.controller.refresh import after_reference_run
    from farm.proto.spec import JobSpec

    try:
        job_id = submit_reference_suite(store, [lab_target(d) for d in lab], suite, priority=priority)
    except (JobFileError, SuiteError) as e:
        raise UserError(str(e)) from None
    timeout = JobSpec.model_validate_json(store.job(job_id)["spec_json"]).timeouts.job
    if not _run_with_progress(args, store, job_id, Controller(store).progress(job_id).total, timeout):
        return None
    webhook = alerts_from_environment()
    return after_reference_run(store, job_id, thresholds=thresholds, k=k, alert=webhook.send_async if webhook else None,
                               include_contended=getattr(args, "include_contended", False))


def cmd_refresh(args: argparse.Namespace) -> int:
    from farm.cli.main import _lab
    from farm.controller.refresh import DriftThresholds, report_json

    lab = _lab(args)
    if not lab:
        raise UserError("farm refresh needs devices to refresh: --devices lab.yaml or $FARM_DEVICES")
    thresholds = DriftThresholds(slope_change=args.max_slope_change, prediction_shift=args.max_prediction_shift,
                                 intercept_change=args.max_intercept_change, r2_drop=args.max_r2_drop)
    report = run_reference_suite(args, open_store(args), lab, suite_path(args.suite),
                                 thresholds=thresholds, k=args.k)
    if report is None:
        return 130
    if args.json:
        print(strict_json.dumps(report_json(report), indent=2))
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
    return 1 if report.quarantined else 0


def health_check_before(args: argparse.Namespace, store, lab: list, targets: list[str]) -> None:
    """Before user work on a device whose last check is older than FARM_HEALTH_MAX_AGE_H hours
    (default 24; 0 turns it off), run the reference suite on it first (LAVA's health checks)."""
    import os

    from farm.controller.refresh import stale_devices
    max_age_h = float(os.environ.get("FARM_HEALTH_MAX_AGE_H", "24"))
    if max_age_h <= 0:
        return
    stale = set(stale_devices(store, targets, max_age_h * 3600))
    if not stale:
        return
    if not args.json and not args.quiet:
        err.print(f"health check first: {', '.join(sorted(stale))} last checked over {max_age_h:g} h ago")
    run_reference_suite(args, store, [d for d in lab if d.name in stale], suite_path(), priority="interactive")


def cmd_drift(args: argparse.Namespace) -> int:
    from farm.controller.refresh import drift_history
    rows = drift_history(open_store(args), args.device)
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
        t.add_row(when(r["created_at"]), Text(r["device"]), r["metric"], str(r["threads"]),
                  f"#{r['previous_id']} → #{r['calibration_id']}", f"{100 * r['slope_change']:.1f} %",
                  f"{100 * r['intercept_change']:.1f} %", f"{r['r2_drop']:.3f}", f"{100 * r['prediction_shift']:.1f} %",
                  Text(r["reasons"] or "ok", "yellow" if r["exceeded"] else "green"))
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
    s.add_argument("--slots", type=int, default=1)
    s.add_argument("--include-contended", action="store_true",
                   help="also fit sim twins whose cores other work used (left out by default)")
    s.add_argument("--backend", choices=["auto", "cgroup", "docker", "process"], default=None)
    s.add_argument("--quiet", action="store_true")
    s.add_argument("--progress", action="store_true")
    s.set_defaults(func=cmd_refresh)

    s = sub.add_parser("drift", parents=[common], help="how each device's calibration moved between refreshes")
    s.add_argument("--device")
    s.set_defaults(func=cmd_drift)
