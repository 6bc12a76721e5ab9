"""Per-requirements virtual environments for script workloads (PIPREQUIREMENTS), cached by hash.

Built before the run and outside the sandbox, so installing packages is never measured; built
as the run user (a requirement's install code is the job's code too), with a clean environment.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

from farm.agents.sandbox.isolation import RunAs

_build_lock = threading.Lock()


class ScriptEnvError(Exception):
    """pip could not install the requirements: a job failure with pip's own words."""


def script_python(requirements: list[str], cache_dir: Path, run_as: RunAs | None = None) -> str:
    """The interpreter that has `requirements` installed (farm's own when there are none)."""
    if not requirements:
        return sys.executable
    key = hashlib.sha256("\n".join(sorted(requirements)).encode()).hexdigest()[:16]
    venv = cache_dir / f"venv-{key}"
    python = venv / "bin" / "python"
    ready = venv / ".farm-ready"
    with _build_lock:
        if ready.exists():
            return str(python)
        cache_dir.mkdir(parents=True, exist_ok=True)
        if run_as is not None:
            os.chown(cache_dir, run_as.uid, run_as.gid)
            os.chmod(cache_dir, 0o755)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cache_dir), "LANG": "C.UTF-8"}
        as_user = _become(run_as) if run_as is not None else None
        # system-site-packages: the runtimes farm already has need not be downloaded again
        try:
            made = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], env=env,
                                  capture_output=True, text=True, preexec_fn=as_user)
        except OSError as e:  # e.g. the run user cannot reach farm's interpreter
            raise ScriptEnvError(f"cannot make a virtual environment for {requirements}"
                                 f"{' as ' + run_as.name if run_as else ''}: {e}") from None
        if made.returncode != 0:
            raise ScriptEnvError(f"cannot make a virtual environment for {requirements}"
                                 f"{' as ' + run_as.name if run_as else ''}: {(made.stderr or made.stdout).strip()[-300:]}")
        proc = subprocess.run([str(python), "-m", "pip", "install", "--quiet", *requirements],
                              capture_output=True, text=True, env=env, preexec_fn=as_user)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise ScriptEnvError(f"pip could not install {requirements}: " + " ".join(tail))
        ready.write_text("\n".join(requirements))
    return str(python)


def _become(run_as: RunAs):
    def switch() -> None:  # in the child, before exec
        os.setgroups([])
        os.setgid(run_as.gid)
        os.setuid(run_as.uid)
    return switch
