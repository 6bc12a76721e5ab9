"""`farm ARGS` called in this process: `farm.cli.main.main(argv)` with its own working directory,
environment and captured streams, for tests where the process is not the point (issue 34). What a
process alone proves (exit by signal, start-up imports, --detach) keeps the `farm` fixture's subprocess.

It answers as the `farm` fixture does (a FarmRun: exit code, stdout, stderr), so a test moves from one
to the other without changing an assertion. An exception main() does not turn into an exit code is
printed as Python prints it at exit (a "Traceback" on stderr, code 1), as the process would."""

from __future__ import annotations

import contextlib
import io
import sys
import traceback
from pathlib import Path

import pytest

from conftest import FarmRun


def run_farm_inprocess(*args: str, cwd: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> FarmRun:
    """One `farm` command: cwd and env (added to os.environ) hold for the call only; stdin is empty."""
    from farm.cli.main import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with monkeypatch.context() as m:
        m.chdir(cwd)
        for key, value in env.items():
            m.setenv(key, value)
        m.setattr(sys, "stdin", io.StringIO(""))
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse's usage errors and --help
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
            except Exception:  # what the interpreter would print before exiting 1
                traceback.print_exc(file=sys.stderr)
                code = 1
    return FarmRun(code, stdout.getvalue(), stderr.getvalue())
