"""Per-requirements virtual environments for script workloads (PIPREQUIREMENTS), cached by hash.

Built before the run and outside the sandbox, so installing packages is never measured.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
from pathlib import Path

_build_lock = threading.Lock()


class ScriptEnvError(Exception):
    """pip could not install the requirements: a job failure with pip's own words."""


def script_python(requirements: list[str], cache_dir: Path) -> str:
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
        # system-site-packages: the runtimes farm already has need not be downloaded again
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
        proc = subprocess.run([str(python), "-m", "pip", "install", "--quiet", *requirements],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise ScriptEnvError(f"pip could not install {requirements}: " + " ".join(tail))
        ready.write_text("\n".join(requirements))
    return str(python)
