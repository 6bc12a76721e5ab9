"""What every `farm` command shares: the consoles, the store, and the bad-input error."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from pathlib import Path

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

from farm.client.errors import FarmError
from farm.client.errors import Progress as FarmProgress
from farm.proto.escape import printable

if TYPE_CHECKING:
    from rich.console import Console


def _make_out() -> Console:
    from rich.console import Console

    # Piped output keeps the full table width instead of rich's 80-column guess; $COLUMNS wins when set.
    return Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit() else 160)


def _make_err() -> Console:
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True)


_MAKERS = {"out": _make_out, "err": _make_err}


def __getattr__(name: str) -> Any:
    """`out` and `err`, the rich consoles, made on first use (PEP 562): rich loads only then, so `farm --version`
    never loads it, and each is bound to the streams of that moment."""
    if name in _MAKERS:
        made = _MAKERS[name]()
        globals()[name] = made
        return made
    raise AttributeError(f"module 'farm.cli.console' has no attribute {name!r}")


def _console(name: str) -> Console:
    return globals().get(name) or __getattr__(name)  # type: ignore[no-any-return]


def rebind() -> None:
    """The next use of `out` and `err` through this module makes them anew, bound to the streams of that moment
    (a `farm` run in a process that swapped sys.stdout; modules that imported them by name keep theirs)."""
    for name in _MAKERS:
        globals().pop(name, None)


if TYPE_CHECKING:
    out: Console
    err: Console


class UserError(FarmError):
    """Bad input; printed as one paragraph, exit code 2 (with --json also as JSON on stdout)."""

    def __init__(self, message: str, problems: list[dict] | None = None) -> None:
        if problems:  # the answer model (pydantic) only when there are problems to carry: start-up stays light
            from farm.proto.questions import Problem
            super().__init__(message, problems=[Problem.model_validate(p) for p in problems])
        else:
            super().__init__(message)


def lab_devices(args: argparse.Namespace) -> list:
    """The devices embedded mode drives: --devices FILE, else $FARM_DEVICES, else none (read once per command)."""
    if getattr(args, "_lab_devices", None) is not None:
        return args._lab_devices
    from farm.agents.lab import LabConfigError, discover_types, lab_from_environment, load_lab
    try:
        lab = load_lab(Path(args.devices)) if getattr(args, "devices", None) else lab_from_environment()
    except LabConfigError as e:
        raise UserError(str(e)) from None
    from rich.text import Text

    for problem in discover_types(lab):  # untyped entries get the type their facts match
        _console("err").print(Text.assemble(("device ", "yellow"), problem))
    args._lab_devices = lab
    return lab


def open_farm(args: argparse.Namespace):
    """farm.client.open_farm with this command's flags: --controller (else $FARM_CONTROLLER or the config
    file; never a local store then, reachable or not), its credentials, else the embedded store (--db, $FARM_DB)."""
    from farm.client import open_farm as open_client
    from farm.client.config import Credentials

    credentials = Credentials.resolve(getattr(args, "token", None), getattr(args, "tls_ca", None),
                                      getattr(args, "tls_cert", None), getattr(args, "tls_key", None))
    farm = open_client(getattr(args, "controller", None), db=getattr(args, "db", None), credentials=credentials,
                       slots=getattr(args, "slots", None) or 1, backend=getattr(args, "backend", None),
                       lab=lambda: lab_devices(args), devices_file=getattr(args, "devices", None),
                       create=getattr(args, "create", False), read_only=getattr(args, "read_only", False))
    missing = getattr(farm, "store_missing", None)
    if missing is not None:
        from rich.text import Text

        _console("err").print(Text(f"note: there is no store at {missing} (this command only reads one, so none was made); "
                       "check --db or FARM_DB", style="yellow"))
    return farm


def output_file(text: str, option: str = "-o") -> Path:
    """A file the command will write: its folder must exist, checked before any work is done."""
    path = Path(text).expanduser().absolute()
    if path.is_dir():
        raise UserError(f"{option} {text}: {path} is a folder; give a file name inside it.")
    if not path.parent.is_dir():
        raise UserError(f"{option} {text}: the folder {path.parent} does not exist; create it first "
                        f"(mkdir -p {path.parent}) or write somewhere else. Nothing was written.")
    return path


def when(ts: dt.datetime | float | None) -> str:
    """A moment (an answer's UTC datetime, or Unix seconds) in this machine's local time, for a table."""
    if ts is None:
        return "—"
    moment = ts.astimezone() if isinstance(ts, dt.datetime) else dt.datetime.fromtimestamp(ts)
    return moment.strftime("%Y-%m-%d %H:%M:%S")


@contextmanager
def job_progress(args: argparse.Namespace, job_id: int) -> Iterator[Callable[[FarmProgress], None]]:
    """A bar on a terminal (or with --progress), else a line per finished run; nothing with --json/--quiet."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.text import Text

    err = _console("err")
    quiet = args.json or getattr(args, "quiet", False)
    show = not quiet and err.is_terminal or getattr(args, "progress", False)
    progress = Progress(TextColumn("[bold]job {task.fields[job]}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[last]}", markup=False), TimeElapsedColumn(), console=err,
                        disable=not show, transient=False)
    bar = progress.add_task("runs", total=None, job=job_id, last="")
    printed = [-1]

    def update(p: FarmProgress) -> None:
        # the run's model name is the job file's (hostile): escaped, and never read as rich markup
        summary = printable(p.last, 400) if p.last else f"{p.completed} ok, {p.failed} failed, {p.running} running"
        progress.update(bar, total=p.total, completed=p.done, last=summary, job=p.job)
        if not show and not quiet and (p.last or p.done != printed[0]):
            err.print(Text(f"[{p.done}/{p.total}] {summary}"), highlight=False)
            printed[0] = p.done

    with progress:
        yield update
