"""`farm`: the command line. Every command that prints data has --json for scripts
(docs/reference/results-json.md: "`--json` and time").

Exit codes: 0 success, 1 the job ran but some runs failed, 2 bad input (job file,
arguments), 3 farm could not do it here (no backend, store error), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from farm.proto.names import BACKEND_CHOICES
from farm.version import __version__
from farm.cli import console
from farm.cli.console import job_progress, open_farm
from farm.client.errors import EXIT_BAD_INPUT, EXIT_ENVIRONMENT, EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNS_FAILED, FarmError
from farm.proto import strict_json
from farm.proto.escape import printable
from farm.proto.task_limits import DEFAULT_MAX_TASKS

if TYPE_CHECKING:  # the client API and its answer models (pydantic) load when a command asks something
    from farm.client.api import Farm, Problem
    from farm.proto.questions import RunRecord

UserError = console.UserError
_when = console.when


def _job_id(text: str) -> int:
    try:
        return int(str(text).removeprefix("job-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a job id (see `farm jobs`)") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


# --- submit / resume / watch ---------------------------------------------------------
def _finish(args: argparse.Namespace, farm: Farm, job_id: int, completed_normally: bool) -> int:
    from farm.cli.render import results_table, show, to_json

    records = farm.results(job_id)
    job = farm.job(job_id)
    if args.json:
        print(to_json({"job": job_id, "status": job.status, "results": [r.model_dump() for r in records],
                       **({"warnings": args.warnings} if getattr(args, "warnings", None) else {})}))
    else:
        show(console.out, results_table(records, title=f"job {job_id} · {job.name} · {job.status}", **_table_form(args)),
             wide=_table_form(args)["wide"])
        if any(r.approximate for r in records):
            console.out.print("* approximate: the process backend enforces limits best-effort and samples memory.")
        _print_failures(records)
        console.out.print(f"kept by the {farm.where} · `farm results {job_id} --format json` for every figure", highlight=False)
    if not completed_normally:
        return EXIT_INTERRUPTED
    return EXIT_OK if job.status == "completed" else EXIT_RUNS_FAILED


def _follow(args: argparse.Namespace, farm: Farm, job_id: int) -> int:
    """Run (embedded) or watch (a controller, a background run) the job to its end, then its results."""
    try:
        with job_progress(args, job_id) as update:
            ok = farm.wait(job_id, update)
    except KeyboardInterrupt:
        if farm.embedded:
            raise
        console.err.print(f"stopped watching; job {job_id} carries on at the {farm.where} (`farm cancel {job_id}` stops it)")
        return EXIT_INTERRUPTED
    return _finish(args, farm, job_id, ok)


def _check_slots(args: argparse.Namespace) -> None:
    """--slots the host cannot give is bad input, refused before any job is stored."""
    from farm.agents.agent import split_cores
    try:
        split_cores(args.slots)
    except ValueError as e:
        raise UserError(f"--slots {args.slots}: {e}; each sim slot gets cores of its own. Use --slots 1 to "
                        f"{len(os.sched_getaffinity(0))}.") from None


def _runner_options(args: argparse.Namespace, farm: Farm) -> None:
    """--slots, --backend and --devices shape a run in this process: checked here, refused for a controller."""
    if farm.embedded:
        _check_slots(args)
    elif args.slots != 1 or args.backend or args.devices:
        raise UserError(f"--slots, --backend and --devices shape a run in this process; the {farm.where} runs jobs on "
                        "its agents (`farm agent --sim-slots --backend --devices`): drop them, or run embedded")


def cmd_submit(args: argparse.Namespace) -> int:
    farm = open_farm(args)
    _runner_options(args, farm)

    def warn(kind: str, message: str) -> None:
        from rich.text import Text

        console.err.print(Text.assemble((f"{kind}: ", "yellow"), message), highlight=False)

    with job_progress(args, 0) as update:  # a health check may run first (embedded, devices not checked lately)
        submitted = farm.submit(Path(args.job_file), priority=args.priority, max_tasks=args.max_tasks,
                                skip_invalid=args.skip_invalid, detach=args.detach, on_warning=warn,
                                on_progress=update, overrides=args.set or ())
    args.warnings = [w.model_dump() for w in submitted.warnings]
    if not args.json and not args.quiet:
        each = submitted.tasks // max(1, submitted.models)
        console.err.print(f"job {submitted.job}: {submitted.models} model(s) × {each} run(s) each = {submitted.tasks} run(s), "
                  f"{farm.where}", highlight=False)
    if args.detach:
        if args.json:
            print(strict_json.dumps({"job": submitted.job, "status": "queued", "tasks": submitted.tasks,
                                     **({"log": str(submitted.log)} if submitted.log else {})}))
        elif not args.quiet:
            where = f"a background process runs it (output: {submitted.log})" if submitted.log else f"the {farm.where} runs it"
            console.err.print(f"job {submitted.job} queued; {where}. `farm watch {submitted.job}` follows it, "
                      f"`farm status {submitted.job}` tells where it is.", highlight=False)
        return EXIT_OK
    return _follow(args, farm, submitted.job)


def _table_form(args: argparse.Namespace) -> dict[str, bool]:
    return {"wide": getattr(args, "wide", False), "runs": getattr(args, "runs", False)}


def table_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--wide", action="store_true", help="every column (p90, avg memory, CPU, wall time, backend, budget)")
    sp.add_argument("--runs", action="store_true", help="one row per run instead of repeats averaged")


def cmd_resume(args: argparse.Namespace) -> int:
    farm = open_farm(args)
    if farm.embedded:
        _check_slots(args)
    farm.resume(args.job)  # a controller's finished job: its failed or lost tasks run again (farm retry --failed)
    return _follow(args, farm, args.job)


def cmd_retry(args: argparse.Namespace) -> int:
    farm = open_farm(args)
    _runner_options(args, farm)
    if not (args.failed or args.canceled):
        raise UserError(f"farm retry {args.job}: say which tasks run again: --failed (failed runs, lost ones among "
                        "them) and/or --canceled")
    answer = farm.retry(args.job, failed=args.failed, canceled=args.canceled)
    if not args.json and not args.quiet:
        console.err.print(f"job {args.job}: {answer.retried_tasks} of {answer.total} task(s) run again as new attempts; "
                  f"the earlier attempts stay stored ({farm.where})", highlight=False)
    return _follow(args, farm, args.job)


def cmd_watch(args: argparse.Namespace) -> int:
    """Follow a job (a controller's, or an embedded one a background run or another terminal runs) to its end."""
    return _follow(args, open_farm(args), args.job)


# --- reading results ----------------------------------------------------------------
def cmd_results(args: argparse.Namespace) -> int:
    from farm.cli.render import results_csv, results_table, show, to_json

    farm = open_farm(args)
    records = farm.results(args.job, ops=args.ops)
    fmt = "json" if args.json else args.format
    if args.pairs:
        from farm.cli.render import pairs_table
        from farm.controller.analysis.results import paired_records
        pairs = paired_records(records)
        if fmt == "json":
            print(to_json([p.model_dump() for p in pairs]))
        else:
            show(console.out, pairs_table(pairs, title=f"job {args.job} · sim and device side by side", wide=args.wide), wide=args.wide)
        return EXIT_OK
    if fmt == "json":
        print(to_json([r.model_dump() for r in records]))
    elif fmt == "csv":
        sys.stdout.write(results_csv(records))
    elif args.ops:
        from farm.cli.op_profile_view import op_profile_tables
        console.out.print(op_profile_tables(records))
    else:
        job = farm.job(args.job)
        show(console.out, results_table(records, title=f"job {args.job} · {job.name} · {job.status}", **_table_form(args)),
             wide=args.wide)
        _print_failures(records)
    return EXIT_OK


def _print_failures(records: list[RunRecord]) -> None:
    """Why each failed run failed, one paragraph each, under a results table (submit's, resume's and results')."""
    from rich.text import Text

    from farm.cli.render import failures

    for line in failures(records):
        console.err.print(Text.assemble(("failed ", "red"), line), highlight=False)


def cmd_jobs(args: argparse.Namespace) -> int:
    from farm.client.local_jobs import local_jobs

    # an up-to-date local store is read as it is; a controller, or a store to migrate or that fails, is the Farm's
    listed = local_jobs(getattr(args, "controller", None), args.db, args.limit)
    if listed is None:
        jobs: list[Any] = open_farm(args).jobs(args.limit)
    if args.json:
        from farm.controller.analysis.export import to_json  # the CLI's JSON (farm.cli.render's), without rich
        from farm.proto.job_summary import job_json

        print(to_json([j.to_json() for j in jobs] if listed is None else [job_json(j) for j in listed]))
        return EXIT_OK
    from types import SimpleNamespace

    from farm.cli.render import jobs_table, show

    if listed is not None:
        jobs = [SimpleNamespace(**j) for j in listed]  # the table reads a JobInfo's attributes
    show(console.out, jobs_table(jobs, _when, wide=args.wide), wide=args.wide)
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    from rich.text import Text

    from farm.cli.render import to_json

    job = open_farm(args).job(args.job)
    if args.json:
        print(to_json(job.to_json()))
        return EXIT_OK
    console.out.print(Text.assemble(f"job {args.job} (", printable(job.name), "): ", (job.status, "bold"),
                            f" — {job.done}/{job.total} done: {job.completed} ok, {job.failed} failed, "
                            f"{job.canceled} canceled, {job.running} running, {job.pending} pending"))
    if job.message:
        console.out.print(Text(printable(job.message, None, multiline=True)))
    if job.status == "interrupted" and not job.message:  # a stored interruption says so in its message
        console.out.print(f"the process that ran it ({job.owner_pid}) has died; `farm resume {args.job}` carries on, "
                  "keeping every run already stored.")
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    from farm.cli.render import to_json

    n = open_farm(args).cancel(args.job)
    if args.json:
        print(to_json({"job": args.job, "canceled_tasks": n}))
    else:
        console.out.print(f"job {args.job}: {n} unfinished run(s) canceled; runs already stored are kept.")
    return EXIT_OK


# --- tools ------------------------------------------------------------------------------
def cmd_schema(args: argparse.Namespace) -> int:
    from farm.proto.spec import job_json_schema
    print(json.dumps(job_json_schema(), indent=2))
    return EXIT_OK


def cmd_models_generate(args: argparse.Namespace) -> int:
    from farm.cli.render import to_json
    from farm.model_generators.generate import generate_examples
    from farm.model_generators.mobilenetv2 import INPUT_SIZES, WIDTHS

    dest = Path(args.dir).absolute()
    if dest.exists() and not dest.is_dir():
        raise UserError(f"{dest} is a file; `farm models generate` writes a folder of models. Give a folder "
                        "(new or existing) instead; the file was left as it is.")
    widths = [float(w) for w in args.widths.split(",")] if args.widths else None
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else None

    def progress(model, done: int, total: int) -> None:
        if not args.json and not args.quiet:
            console.err.print(f"[{done}/{total}] {model.path}{'' if model.written else ' (unchanged)'}", highlight=False)

    try:
        models = generate_examples(dest, progress=progress, formats=tuple(args.formats.split(",")), zoo=not args.no_zoo,
                                   published=args.published, widths=widths or WIDTHS, input_sizes=sizes or INPUT_SIZES)
    except OSError as e:
        raise UserError(f"cannot write the models into {dest}: {e.strerror or e}.") from None
    if args.json:
        print(to_json([{"path": str(m.path), "name": m.name, "family": m.family, "format": m.format} for m in models]))
    else:
        console.out.print(f"{len(models)} model(s) in {dest}")
    return EXIT_OK


def cmd_backends(args: argparse.Namespace) -> int:
    from farm.agents.sandbox import BACKEND_NAMES, backend_class
    from farm.cli.render import to_json

    rows = []
    for name in BACKEND_NAMES:
        reason = backend_class(name).unavailable_reason()
        rows.append({"backend": name, "available": reason is None, "reason": reason,
                     "approximate": backend_class(name).approximate})
    if args.json:
        print(to_json(rows))
    else:
        for r in rows:
            mark = "[green]available[/green]" if r["available"] else f"[yellow]unavailable[/yellow]: {r['reason']}"
            console.out.print(f"{r['backend']:8} {mark}{' (approximate)' if r['approximate'] else ''}")
    return EXIT_OK


# --- parser -------------------------------------------------------------------------------
def build_parser(named: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; given the command a run names, when it is one of OWN_COMMANDS, only this module's. Built
    part by part, in the order `farm --help` lists the commands: the job's run, its read side, the lab's (other
    modules), the local ones, the tools; then the options every leaf takes."""
    common, local = _parent_parsers()
    from farm.cli.environment import environment_help
    p = argparse.ArgumentParser(prog="farm", description="Profile ML models under a device's CPU and memory budget.",
                                epilog=environment_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"farm {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run_commands(sub, common)
    _add_read_commands(sub, common)
    if named not in OWN_COMMANDS:  # every command: `farm --help`, completion, the other modules' commands
        _add_lab_commands(sub, common)
    _add_local_commands(sub, local)
    if named not in OWN_COMMANDS:
        _add_tool_commands(sub, common, local, p)
    for command in _leaf_parsers(p):
        _log_options(command)
    for name in READ_ONLY_COMMANDS:  # a mistyped --db for these is an error, never a new empty store (issue 32)
        if name in sub.choices:
            sub.choices[name].set_defaults(read_only=True)
    return p


def _parent_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """(common, local): the store and controller flags most commands take, and local-only commands' --json."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", default=None, help="SQLite store file or postgresql:// URL (default: $FARM_DB or the "
                        "user data directory)")
    common.add_argument("--create", action="store_true", help="make the folder of --db (or $FARM_DB) when it is missing; without it a missing folder is an error")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    from farm.cli.remote import add_client_options
    add_client_options(common)

    # Local-only commands take --json but none of the store or controller flags.
    local = argparse.ArgumentParser(add_help=False)
    local.add_argument("--json", action="store_true", help="machine-readable output")
    return common, local


def _add_runner_options(sp: argparse.ArgumentParser) -> None:
    """What a command that runs a job's tasks here (submit, resume, retry) takes."""
    sp.add_argument("--slots", type=_positive_int, default=1, help="sim runs at once, each on its own cores (default 1)")
    sp.add_argument("--backend", choices=BACKEND_CHOICES, default=None,
                    help="override sim.backend of the job")
    sp.add_argument("--quiet", action="store_true", help="no progress output")
    sp.add_argument("--progress", action="store_true", help="show the progress bar even when not on a terminal")
    table_options(sp)
    sp.add_argument("--devices", help="the lab's device list (YAML) for device targets; default $FARM_DEVICES")


def _add_run_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """submit, resume, retry, watch: the commands that run a job (or follow it) to its end."""
    s = sub.add_parser("submit", parents=[common], help="validate a job file and run it")
    s.add_argument("job_file", help="the job file (YAML): models, matrix, workload, sim, targets")
    s.add_argument("--priority", choices=["interactive", "normal", "low"], default=None,
                   help="the job's place in the queue (default: the job file's, else normal)")
    s.add_argument("--detach", action="store_true",
                   help="return once the job is queued: a controller runs it, or (embedded) a background process "
                        "logging beside the store; `farm watch JOB` follows it")
    s.add_argument("--skip-invalid", action="store_true",
                   help="run the models that can run; record the others as `job` failures")
    s.add_argument("--max-tasks", type=_positive_int, default=DEFAULT_MAX_TASKS,
                   help=f"refuse a job that expands to more runs than this (default {DEFAULT_MAX_TASKS:,})")
    s.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="change one field of the job for this submission (repeatable; YAML value, dotted path), "
                        "e.g. --set workload.iterations=20 --set 'matrix.threads=[1]'; validated like the file "
                        "and stored with the job")
    _add_runner_options(s)
    s.set_defaults(func=cmd_submit)

    s = sub.add_parser("resume", parents=[common], help="carry on an interrupted job")
    s.add_argument("job", type=_job_id, help="the job id (42 or job-42; see `farm jobs`)")
    _add_runner_options(s)
    s.set_defaults(func=cmd_resume)

    s = sub.add_parser("retry", parents=[common], help="run a finished job's failed (or canceled) tasks again")
    s.add_argument("job", type=_job_id, help="the job id (42 or job-42; see `farm jobs`)")
    s.add_argument("--failed", action="store_true", help="the failed tasks, those whose attempts were lost among them")
    s.add_argument("--canceled", action="store_true", help="the tasks canceled before they finished (farm cancel, "
                   "timeouts.job)")
    _add_runner_options(s)
    s.set_defaults(func=cmd_retry)

    s = sub.add_parser("watch", parents=[common], help="follow a job to its end, then its results (exit code as submit's)")
    s.add_argument("job", type=_job_id, help="the job id (42 or job-42; see `farm jobs`)")
    s.add_argument("--quiet", action="store_true", help="no progress output")
    s.add_argument("--progress", action="store_true", help="show the progress bar even when not on a terminal")
    s.set_defaults(func=cmd_watch)


def _add_read_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """results, jobs, status, cancel: a job's read side (and its cancel)."""
    s = sub.add_parser("results", parents=[common], help="a job's results")
    s.add_argument("job", type=_job_id, help="the job id (42 or job-42; see `farm jobs`)")
    s.add_argument("--format", choices=["table", "csv", "json"], default="table",
                   help="a table for reading (default), CSV for spreadsheets, or JSON")
    s.add_argument("--pairs", action="store_true", help="device runs beside their sim twins (completed pairs only)")
    s.add_argument("--ops", action="store_true", help="each run's slowest operator types and nodes (workload.op_profiling)")
    table_options(s)
    s.set_defaults(func=cmd_results)

    s = sub.add_parser("jobs", parents=[common], help="list jobs")
    s.add_argument("--limit", type=int, default=50, help="the newest N jobs (default 50)")
    s.add_argument("--wide", action="store_true", help="also when each job finished")
    s.set_defaults(func=cmd_jobs)

    s = sub.add_parser("status", parents=[common], help="one job's progress")
    s.add_argument("job", type=_job_id, help="the job id (42 or job-42; see `farm jobs`)")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("cancel", parents=[common], help="cancel a job's unfinished runs")
    s.add_argument("job", type=_job_id, help="the job id (42 or job-42; see `farm jobs`)")
    s.set_defaults(func=cmd_cancel)


def _add_local_commands(sub: argparse._SubParsersAction, local: argparse.ArgumentParser) -> None:
    """schema, backends, models: what needs neither a store nor a controller."""
    # --json is accepted (the schema is JSON either way), so a script that passes it to every command works
    s = sub.add_parser("schema", parents=[local], help="print the job file's JSON Schema (for editors)")
    s.set_defaults(func=cmd_schema)

    s = sub.add_parser("backends", parents=[local], help="which sandbox backends can run here")
    s.set_defaults(func=cmd_backends)

    m = sub.add_parser("models", help="example models")
    msub = m.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    g = msub.add_parser("generate", parents=[local], help="write the MobileNetV2 family, the ONNX zoo models and "
                        "SqueezeNet 1.1 / GoogLeNet as .tflite")
    g.add_argument("dir", help="the folder to write the models into (made when missing)")
    g.add_argument("--widths", help="comma-separated width multipliers, e.g. 0.25,0.5,1.0")
    g.add_argument("--sizes", help="comma-separated input sizes, e.g. 96,160,224")
    g.add_argument("--formats", default="tflite,onnx", help="comma-separated formats to write (default tflite,onnx)")
    g.add_argument("--no-zoo", action="store_true", help="skip the model-zoo architectures")
    g.add_argument("--published", action="store_true", help="also write the published Jetson experiment's models "
                   "as ONNX: ShuffleNetV2-0.5x, SqueezeNet 1.1, ResNet18, InceptionV3 and 11 3D-CNN video models")
    g.add_argument("--quiet", action="store_true", help="no line per model written")
    g.set_defaults(func=cmd_models_generate)


# The commands this module defines. A run that names one of them (`farm jobs ...`) gets a parser with only this
# module's commands: the other modules' (calibration, devices, the controller, inspect, ...) are neither imported
# nor built (issue 34 item 5: `farm jobs --json`, sources compiled each run, 0.37 -> 0.19 CPU-s). Its parse, help
# and errors are the same: a command's own parser never depends on the others (tests/test_cli_startup.py compares them).
OWN_COMMANDS = ("submit", "resume", "retry", "watch", "results", "jobs", "status", "cancel", "schema", "backends",
                "models")


def _add_lab_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """The other modules' commands listed between `farm cancel` and `farm schema` in `farm --help`."""
    from farm.cli.calibrate_commands import add_commands as add_calibration_commands
    add_calibration_commands(sub, common)
    from farm.cli.device_commands import add_commands as add_device_commands
    add_device_commands(sub, common)
    from farm.cli.refresh_commands import add_commands as add_refresh_commands
    add_refresh_commands(sub, common)
    from farm.cli.web_commands import add_parser as add_web_parser; add_web_parser(sub, common)  # noqa: E702
    from farm.cli.import_commands import add_commands as add_import_commands; add_import_commands(sub, common)
    from farm.cli.artifact_commands import add_commands as add_artifact_commands; add_artifact_commands(sub, common)
    from farm.cli.store_commands import add_commands as add_store_commands; add_store_commands(sub, common)


def _add_tool_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser,
                       local: argparse.ArgumentParser, p: argparse.ArgumentParser) -> None:
    """The other modules' commands listed after `farm models` in `farm --help`."""
    from farm.cli.remote import add_remote_commands

    add_remote_commands(sub, common)
    from farm.cli.inspect_commands import add_parser as add_inspect_command
    add_inspect_command(sub)
    from farm.cli.quantize_commands import add_parser as add_quantize_command
    add_quantize_command(sub, local)
    from farm.cli.compare_commands import add_parser as add_compare_command
    add_compare_command(sub, common)

    from farm.cli.completion import add_parser as add_completion_command
    add_completion_command(sub, p)
    from farm.cli.manpage import add_parser as add_manpage_command
    add_manpage_command(sub, p)


# Commands that only read a store: given a --db (or FARM_DB) that does not exist, they say so instead of making one
READ_ONLY_COMMANDS = ("results", "jobs", "status", "watch", "calibrations", "rank", "report", "drift", "compare")


LOG_LEVELS = ("debug", "info", "warning", "error")


def _leaf_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every parser that runs a command (`farm jobs`, `farm controller serve`, ...), depth first."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [parser]
    return [leaf for a in subs for child in dict.fromkeys(a.choices.values()) for leaf in _leaf_parsers(child)]


def _log_options(command: argparse.ArgumentParser) -> None:
    """-v/--log-level on every command, so a client command's retries and a server's sessions can be seen alike."""
    g = command.add_argument_group("logging")
    g.add_argument("-v", "--verbose", action="store_true", help="log everything (the same as --log-level debug)")
    g.add_argument("--log-level", choices=LOG_LEVELS, default=None,
                   help="what farm logs to stderr (default: warning; info for `controller serve` and `agent`)")


def _configure_logging(args: argparse.Namespace) -> None:
    """Only when asked: a server command's own default (info) stays in place otherwise."""
    level = "debug" if getattr(args, "verbose", False) else getattr(args, "log_level", None)
    if level:
        import logging
        logging.basicConfig(level=level.upper(), stream=sys.stderr,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _report_error(args: argparse.Namespace, message: str, code: int, problems: list[Problem] | None = None) -> int:
    """One paragraph on stderr; with --json the same as JSON on stdout, for scripts."""
    from rich.text import Text

    console.err.print(Text.assemble(("error: ", "red"), message), highlight=False)
    if getattr(args, "json", False):
        print(strict_json.dumps({"error": message, "exit_code": code, "problems": problems or []}, indent=2))
    return code


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv) == ["--version"]:  # the commonest probe builds no parser
        print(f"farm {__version__}")
        return EXIT_OK
    console.rebind()  # this run prints to the streams of this moment (an in-process run may have swapped them)
    given = sys.argv[1:] if argv is None else argv
    parser = build_parser(given[0] if given else None)
    args = parser.parse_args(argv)
    _configure_logging(args)
    try:
        # Each command asks open_farm(args): the controller when one is configured, else the local store.
        return args.func(args)
    except FarmError as e:
        return _report_error(args, str(e), e.exit_code, e.problems)
    except sqlite3.Error as e:  # the store failed after it opened (locked by another writer, disk full)
        from farm.controller.store import default_db_path, store_error_message
        return _report_error(args, store_error_message(Path(getattr(args, "db", None) or default_db_path()), e),
                             EXIT_ENVIRONMENT if "is full" in str(e) else EXIT_BAD_INPUT)  # a full disk: not the input
    except ModuleNotFoundError as e:
        from farm.cli.extras import extra_for, missing_extra_message
        if extra_for(e.name) is None:  # not an extra's module: a broken install or a bug, with its traceback
            raise
        return _report_error(args, missing_extra_message(args.command, e.name), EXIT_ENVIRONMENT)
    except KeyboardInterrupt:
        console.err.print("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as e:  # last: every narrower handler above comes first
        from farm.controller.store import is_store_error
        if not is_store_error(e):
            raise
        # the PostgreSQL store failed after it opened (the server went away); the message never shows a password
        from farm.controller.store import db_location
        from farm.controller.store.postgres import error_message
        return _report_error(args, error_message(e, str(db_location(getattr(args, "db", None)))), EXIT_ENVIRONMENT)


if __name__ == "__main__":
    sys.exit(main())
