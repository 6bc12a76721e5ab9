"""`farm manpage`: the farm(1) manual page in roff, generated from the same argparse tree as `--help` and the
shell completion, so a new command or option is documented with nothing to edit. Install:
`farm manpage > /usr/local/share/man/man1/farm.1` (then `man farm`), or read it at once with
`farm manpage | man -l -`."""

from __future__ import annotations

import argparse
import datetime as dt
import sys

from farm.cli.completion import _walk

# What each exit code means (README.md: "Exit codes"; the values are client.api's EXIT_* set).
EXIT_STATUS = (
    ("0", "the command did what it was asked; for a job, every run completed"),
    ("1", "the job ran but some runs failed (each with its failure class and message)"),
    ("2", "bad input: the job file, an option, a model, or a store that is corrupt, locked or read-only; "
          "the message names the file, line and field, and nothing is stored"),
    ("3", "the environment: a controller that does not answer, an address that cannot be listened on, a missing "
          "extra; the message names it"),
    ("130", "interrupted (Ctrl-C); runs already stored stay stored"),
)


def roff_text(text: str) -> str:
    """Text as roff reads it literally: backslashes, hyphens and a line that would start a request escaped."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    # non-ASCII (≈, ², →) as roff's named Unicode escapes: man pipes a page through troff, which reads bytes
    text = "".join(c if ord(c) < 128 else f"\\[u{ord(c):04X}]" for c in text)
    lines = []
    for line in text.splitlines() or [""]:
        # a control character at a line's start would make the line a request; the zero-width \& stops that
        lines.append("\\&" + line if line[:1] in (".", "'") else line)
    return "\n".join(lines)


def _bold(text: str) -> str:
    return "\\fB" + roff_text(text) + "\\fR"


def _option_label(action: argparse.Action) -> str:
    names = ", ".join(_bold(o) for o in action.option_strings)
    if action.nargs == 0:
        return names
    if action.choices:
        return f"{names} {{{roff_text(','.join(map(str, action.choices)))}}}"
    metavar = action.metavar or action.dest.upper()
    return f"{names} \\fI{roff_text(str(metavar))}\\fR"


def _positional_label(action: argparse.Action) -> str:
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        return "{" + roff_text(",".join(map(str, action.choices))) + "}"
    return "\\fI" + roff_text(str(action.metavar or action.dest)) + "\\fR"


def manpage(parser: argparse.ArgumentParser, version: str, today: dt.date | None = None) -> str:
    """farm(1) for `parser` (the whole `farm` parser)."""
    date = (today or dt.date.today()).isoformat()
    out = [f'.TH FARM 1 "{date}" "farm {roff_text(version)}" "User Commands"',
           ".nh",  # no hyphenation: an option name split across lines could not be searched for or pasted
           ".SH NAME", "farm \\- " + roff_text(parser.description or "profile ML models"),
           ".SH SYNOPSIS", _bold("farm") + " [\\fB\\-\\-version\\fR] \\fICOMMAND\\fR [\\fIoptions\\fR]",
           ".SH DESCRIPTION",
           roff_text("farm runs the same profiling job on a local sandbox with a target device's CPU and memory budget "
                     "(the sim) and on real phones and boards, stores the paired results, fits a per-device "
                     "calibration and predicts on-device numbers from the sim alone. Every command below also takes "
                     "-h for its own help; commands that print data take --json."),
           ".SH COMMANDS"]
    for path, command, subs in _walk(parser, ("farm",)):
        if len(path) == 1:
            continue
        out.append(".SS " + roff_text(" ".join(path)))
        summary = command.description or _help_of(parser, path) or ""
        if summary:
            out += [".PP", roff_text(summary)]
        if subs:
            out += [".PP", "Commands: " + ", ".join(_bold(" ".join((*path, name))) for name in subs) + "."]
            continue
        for action in command._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            label = _option_label(action) if action.option_strings else _positional_label(action)
            out += [".TP", label, roff_text(_help_text(action))]
    out += [".SH ENVIRONMENT"]
    from farm.cli.environment import ENVIRONMENT
    for name, text in ENVIRONMENT.items():
        out += [".TP", _bold(name), roff_text(text)]
    out += [".SH EXIT STATUS"]
    for code, text in EXIT_STATUS:
        out += [".TP", _bold(code), roff_text(text)]
    out += [".SH FILES", ".TP", _bold("farm.db"),
            roff_text("the SQLite store, in the user data directory unless --db or FARM_DB says otherwise; "
                      "`sqlite-utils tables farm.db` reads it (docs/reference/store.md)"),
            ".SH SEE ALSO", roff_text("farm COMMAND -h; the README and docs/ in farm's source; "
                                      "farm completion bash|zsh|fish for shell completion."), ""]
    return "\n".join(out)


def _help_of(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> str:
    """The one-line help a command was registered with (its parent's subcommand list has it)."""
    node = parser
    text = ""
    for name in path[1:]:
        for action in node._actions:
            if isinstance(action, argparse._SubParsersAction) and name in action.choices:
                text = next((c.help or "" for c in action._choices_actions if c.dest == name), "")
                node = action.choices[name]
                break
    return text


def _help_text(action: argparse.Action) -> str:
    text = action.help or ""
    if "%(default)" in text or "%(" in text:
        try:
            text = text % {**vars(action), "prog": "farm"}
        except (KeyError, TypeError, ValueError):
            pass
    return text


def cmd_manpage(args: argparse.Namespace) -> int:
    from farm.version import __version__
    sys.stdout.write(manpage(args.manpage_of, __version__))
    return 0


def add_parser(sub: argparse._SubParsersAction, root: argparse.ArgumentParser) -> None:
    """`farm manpage`; root is the whole `farm` parser, complete by the time the command runs."""
    s = sub.add_parser("manpage", help="print the farm(1) manual page (roff): `farm manpage | man -l -`")
    s.set_defaults(func=cmd_manpage, manpage_of=root)
