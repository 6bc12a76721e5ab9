"""`farm ARGS` called in this process: `farm.cli.main.main(argv)` with its own working directory,
environment and captured streams, for tests where the process is not the point (issue 34). What a
process alone proves (exit by signal, start-up imports, --detach) keeps a subprocess: the `farm_process`
fixture, or every call with `pytest --farm-subprocess`.

It answers as the subprocess does (a FarmRun: exit code, stdout, stderr), so a test moves from one to
the other without changing an assertion. An exception main() does not turn into an exit code is
printed as Python prints it at exit (a "Traceback" on stderr, code 1), as the process would.

What a fresh process would start with is put back around each call, so nothing leaks from one call
(or from the test) into the next: the whole of os.environ, the working directory, sys.argv, stdin,
the umask, the signal handlers, the logging configuration, the rich consoles (built afresh, so
$COLUMNS / $NO_COLOR given to the call count), farm's functools caches (some answer from $PATH) and its
per-process webhooks; what the command registers with atexit runs when the call ends, as at exit."""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, Iterator

from conftest import FarmRun

# The handlers a command may install (client/runner.py: SIGINT/SIGTERM while a job runs; servers too).
_SIGNALS = [s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGPIPE,
                        signal.SIGALRM, signal.SIGUSR1, signal.SIGUSR2)]


def _farm_modules() -> list[Any]:
    return [m for name, m in list(sys.modules.items()) if m is not None and (name == "farm" or name.startswith("farm."))]


def _clear_farm_caches() -> None:
    """Every functools cache on a farm module's functions: a process starts without them."""
    for module in _farm_modules():
        for value in list(vars(module).values()):
            if isinstance(value, functools._lru_cache_wrapper) and getattr(value, "__module__", "") == module.__name__:
                value.cache_clear()


@contextlib.contextmanager
def _logging_restored() -> Iterator[None]:
    """basicConfig() and `farm controller`'s loggers change the root logger and farm.*: put them back."""
    manager = logging.Logger.manager
    root = logging.getLogger()
    saved_root = (root.level, list(root.handlers))
    saved = {name: (lg.level, list(lg.handlers), lg.propagate, lg.disabled)
             for name, lg in list(manager.loggerDict.items()) if isinstance(lg, logging.Logger)}
    try:
        yield
    finally:
        for handler in root.handlers:
            if handler not in saved_root[1]:
                handler.close()
        root.setLevel(saved_root[0])
        root.handlers[:] = saved_root[1]
        for name, lg in list(manager.loggerDict.items()):
            if not isinstance(lg, logging.Logger):
                continue
            if name in saved:
                lg.level, handlers, lg.propagate, lg.disabled = saved[name]
                lg.handlers[:] = handlers
            else:  # made by this call: as a new process would leave it to the next one, unconfigured
                lg.handlers.clear()
                lg.setLevel(logging.NOTSET)
        manager._clear_cache()


@contextlib.contextmanager
def _fresh_consoles() -> Iterator[None]:
    """farm.cli.console's `out`/`err` are made at import from the environment of that moment; each call gets
    new ones made from its own (the modules that imported them by name see the new ones too)."""
    import farm.cli.console as console
    from rich.console import Console

    old_out, old_err = console.out, console.err
    new_out = Console(width=None if os.environ.get("COLUMNS", "").isdigit() else 160)
    new_err = Console(stderr=True, soft_wrap=True)
    consoles = {"out": (old_out, new_out), "err": (old_err, new_err)}

    def swap(to_new: bool) -> None:
        # every farm module holding a console by name, also one first imported during the call (it took the new one)
        for module in _farm_modules():
            for attr, (old, new) in consoles.items():
                if isinstance(getattr(module, attr, None), Console):
                    setattr(module, attr, new if to_new else old)

    swap(True)
    try:
        yield
    finally:
        swap(False)


def _fresh_process_singletons() -> None:
    """farm's one-per-process objects start anew: the webhook per URL (alerts._HOOKS) registers its drain
    with atexit once, when it first sends; a reused one would not register again for this call."""
    alerts = sys.modules.get("farm.controller.operations.alerts")
    if alerts is not None:
        with alerts._HOOKS_LOCK:
            alerts._HOOKS.clear()


@contextlib.contextmanager
def _exit_handlers_run() -> Iterator[None]:
    """What the command registers with atexit runs when the call ends, as it would when its process exits
    (the webhook's drain: a short `farm refresh` still delivers what it queued), and is not left to pytest's."""
    registered: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
    real_register = atexit.register

    def register(func: Any, *args: Any, **kwargs: Any) -> Any:
        registered.append((func, args, kwargs))
        return func

    atexit.register = register  # type: ignore[assignment]
    try:
        yield
    finally:
        atexit.register = real_register  # type: ignore[assignment]
        for func, args, kwargs in reversed(registered):
            try:
                func(*args, **kwargs)
            except Exception:  # as the interpreter does at exit: printed, the others still run
                traceback.print_exc(file=sys.stderr)


def run_farm_inprocess(*args: str, cwd: Path, env: dict[str, str]) -> FarmRun:
    """One `farm` command: cwd and env (added to os.environ) hold for the call only; stdin is empty."""
    from farm.cli.main import main

    stdout, stderr = io.StringIO(), io.StringIO()
    saved_environ = dict(os.environ)
    saved_cwd = os.getcwd()
    saved_argv, saved_stdin = sys.argv, sys.stdin
    saved_signals = {s: signal.getsignal(s) for s in _SIGNALS}
    saved_umask = os.umask(0o022)
    os.umask(saved_umask)
    try:
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = ["farm", *args]
        sys.stdin = io.StringIO("")
        _clear_farm_caches()
        _fresh_process_singletons()
        with _logging_restored(), _fresh_consoles(), \
                contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), _exit_handlers_run():
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse's usage errors and --help
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
            except Exception:  # what the interpreter would print before exiting 1
                traceback.print_exc(file=sys.stderr)
                code = 1
    finally:
        os.environ.clear()
        os.environ.update(saved_environ)
        os.chdir(saved_cwd)
        sys.argv, sys.stdin = saved_argv, saved_stdin
        for s, handler in saved_signals.items():
            if handler is not None:
                signal.signal(s, handler)
        os.umask(saved_umask)
    return FarmRun(code if code is not None else 0, stdout.getvalue(), stderr.getvalue())
