"""farm's wheel for the install tests, built once per tree (issue 34): each xdist worker that ran an install test
built its own (pip wheel: ~5 CPU-s and a fresh build environment each), and every run built it again for an
unchanged tree. The wheel is kept in /var/cache/farm-tests/farm-wheel/<key>/, the key being the sha256 of what goes
into it: the build files and every file under the role folders pyproject.toml maps (so any change to the package,
its data or its metadata builds a new one), with the Python version; it is built from a copy of exactly those files.
One builder at a time (cache_lock); a cache
this user cannot write is skipped and the wheel built into the session's temporary folder, as before."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from cache_lock import cache_lock

CACHE = Path(os.environ.get("FARM_TEST_CACHE", "/var/cache/farm-tests")) / "farm-wheel"
BUILD_FILES = ("pyproject.toml", "setup.py", "setup.cfg", "MANIFEST.in", "README.md", "LICENSE")
KEEP = 8  # trees' wheels kept (worktrees side by side on one machine); the least recently used go first


def wheel_inputs(root: Path) -> list[Path]:
    """Every file that can go into the wheel or decide what does, in a fixed order."""
    package_dir = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    files = [root / name for name in BUILD_FILES if (root / name).is_file()]
    for folder in sorted(set(package_dir.values())):
        for path in sorted((root / folder).rglob("*")):
            parts = path.relative_to(root).parts
            if path.is_file() and "__pycache__" not in parts and path.suffix != ".pyc":
                files.append(path)
    return files


def inputs_key(root: Path) -> str:
    digest = hashlib.sha256(f"python {sys.version_info.major}.{sys.version_info.minor}\0".encode())
    for path in wheel_inputs(root):
        mode = "x" if os.access(path, os.X_OK) else "-"
        digest.update(f"{path.relative_to(root).as_posix()}\0{mode}\0".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:20]


def build_wheel(root: Path, dest: Path) -> Path:
    """pip wheel of a copy of exactly wheel_inputs(root): the wheel is a function of what the key hashes (built in the
    tree itself, setuptools also shipped what an earlier build left in its build/ folder)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="farm-wheel-src-") as tmp:
        for path in wheel_inputs(root):
            copy = Path(tmp, path.relative_to(root))
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, copy)
        p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", tmp, "-w", str(dest)],
                           capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"pip wheel of {root} exited {p.returncode}: {p.stderr[-3000:]}")
    (wheel,) = dest.glob("farm-*.whl")
    return wheel


def _ready(entry: Path) -> Path | None:
    wheels = list(entry.glob("farm-*.whl")) if entry.is_dir() else []
    return wheels[0] if len(wheels) == 1 else None


def _prune(keep: Path) -> None:
    entries = sorted((p for p in CACHE.iterdir() if p.is_dir() and not p.name.startswith(".")),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    for old in [p for p in entries if p != keep][KEEP - 1:]:
        shutil.rmtree(old, ignore_errors=True)


def cached_wheel(root: Path, scratch: Path) -> Path:
    """The wheel of the tree at `root`: from the cache when this tree's inputs were built before, else built
    (into the cache when it can be written, else into `scratch`)."""
    key = inputs_key(root)
    entry = CACHE / key
    wheel = _ready(entry)
    if wheel is None:
        try:
            CACHE.mkdir(parents=True, exist_ok=True)
        except OSError:
            return build_wheel(root, scratch)
        if not os.access(CACHE, os.W_OK):
            return build_wheel(root, scratch)
        with cache_lock(CACHE):  # another worker or run building the same tree: wait, then find it ready
            wheel = _ready(entry)
            if wheel is None:
                partial = CACHE / f".{key}.partial"
                shutil.rmtree(partial, ignore_errors=True)  # one a builder that died left
                build_wheel(root, partial)
                shutil.rmtree(entry, ignore_errors=True)
                partial.rename(entry)
                wheel = _ready(entry)
                _prune(entry)
    assert wheel is not None
    os.utime(entry)  # recently used: kept by _prune
    return wheel
