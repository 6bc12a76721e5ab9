"""A fresh venv holding farm's wheel, its dependencies from a cached base (issue 34): installing `farm[all]` into an
empty venv resolved and unpacked scipy, pandas, matplotlib, grpc and the runtimes every run (~80 CPU-s, the whole
cost of tests/test_wheel_install.py). The dependencies depend only on the wheel's declared requirements, so they are
installed once per requirement list into /var/cache/farm-tests/farm-deps/<key>/ (the key: the sha256 of the
wheel's Requires-Dist lines, the extras asked for, the Python version and pip's, so a dependency added or
changed builds a new base), under the cache's lock, by installing the wheel with its extras there and
uninstalling farm again, so the base is exactly what pip resolves for the wheel and nothing of farm.

Each test venv is then made fresh (no system site packages) with one .pth line that adds the base's site-packages
as a site directory (its own .pth files processed, after the venv's own site-packages), and farm's wheel installed
with --no-deps: what the test imports as `farm` is the wheel in that venv, never the base or this checkout, and
`pip check` in it says whether the dependencies the wheel declares are there. A cache this user cannot write is
skipped: everything is installed into the test's venv, as before."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from cache_lock import cache_lock

CACHE = Path(os.environ.get("FARM_TEST_CACHE", "/var/cache/farm-tests")) / "farm-deps"
KEEP = 2  # bases kept (each is the scientific stack, ~1 GB); the least recently used go first
BASE_PTH = "_farm_test_deps.pth"


def _pip(python: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """This interpreter's pip acting on `python`'s environment (--python: no pip of its own in the venv)."""
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), *args], capture_output=True, text=True,
                       timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"pip {' '.join(args)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def _venv(where: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, capture_output=True)
    return where / "bin" / "python"


def site_packages(venv: Path) -> Path:
    (found,) = (venv / "lib").glob("python3*/site-packages")
    return found


def requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines, as its METADATA declares them."""
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        text = z.read(name).decode()
    return sorted(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:"))


def deps_key(wheel: Path, extras: str) -> str:
    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True).stdout.split()[1]
    text = "\n".join([f"python {sys.version_info.major}.{sys.version_info.minor}", f"pip {pip}", f"extras {extras}",
                      *requirements(wheel)])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _build_base(wheel: Path, extras: str, entry: Path) -> None:
    partial = entry.with_name(f".{entry.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # one a builder that died left
    python = _venv(partial / "venv")
    _pip(python, "install", "--quiet", "--no-compile", f"{wheel}[{extras}]")
    _pip(python, "uninstall", "--quiet", "--yes", "farm")
    shutil.rmtree(entry, ignore_errors=True)
    partial.rename(entry)
    # the venv's paths name the partial folder; only its site-packages is used, by path, from here on
    (entry / "ready").write_text(str(site_packages(entry / "venv")))


def _prune(keep: Path) -> None:
    entries = sorted((p for p in CACHE.iterdir() if p.is_dir() and not p.name.startswith(".")),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    for old in [p for p in entries if p != keep][KEEP - 1:]:
        shutil.rmtree(old, ignore_errors=True)


def cached_base(wheel: Path, extras: str) -> Path | None:
    """The site-packages of the wheel's dependencies (with `extras`), built when missing; None when the cache
    cannot be written here."""
    entry = CACHE / deps_key(wheel, extras)
    if not (entry / "ready").exists():
        try:
            CACHE.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
        if not os.access(CACHE, os.W_OK):
            return None
        with cache_lock(CACHE):  # another worker or run building the same base: wait, then find it ready
            if not (entry / "ready").exists():
                _build_base(wheel, extras, entry)
                _prune(entry)
    os.utime(entry)  # recently used: kept by _prune
    return site_packages(entry / "venv")


def install_wheel(wheel: Path, extras: str, venv: Path) -> Path:
    """A fresh venv at `venv` with farm's wheel installed and its dependencies (with `extras`) importable; returns
    its bin/."""
    python = _venv(venv)
    base = cached_base(wheel, extras)
    if base is None:
        _pip(python, "install", "--quiet", "--no-compile", f"{wheel}[{extras}]")
    else:
        (site_packages(venv) / BASE_PTH).write_text(f"import site; site.addsitedir({str(base)!r})\n")
        _pip(python, "install", "--quiet", "--no-compile", "--no-deps", str(wheel))
    return venv / "bin"
