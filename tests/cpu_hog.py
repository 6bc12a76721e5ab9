"""A real CPU hog for contention tests and benchmarks: a busy-loop process pinned to one core.

farm's cgroup sandboxes run with the largest CPU weight (a stray task on their core gets
~0.4 % of it), so a hog that is meant to take half of a run's core must weigh as much: it
runs in a cgroup of its own beside farm's runs, with the same weight. Without cgroups (the
process backend) a plain pinned process is that hog already.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from farm.agents.sandbox.cgroup import V1_MAX_SHARES, V2_MAX_WEIGHT, CgroupLayout, detect_layout

BUSY_LOOP = "while True: pass"


def _weighted_cgroup() -> Path | None:
    """A cgroup with farm's weight, beside farm's runs; None when cgroups cannot be written."""
    if os.geteuid() != 0:
        return None
    layout = detect_layout()
    if not isinstance(layout, CgroupLayout):
        return None
    parent = layout.roots["cpu"] if layout.version == 1 else layout.roots[""]
    d = parent / f"hog-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    if layout.version == 1:
        (parent / "cpu.shares").write_text(str(V1_MAX_SHARES))
        (d / "cpu.shares").write_text(str(V1_MAX_SHARES))
    else:
        (d / "cpu.weight").write_text(str(V2_MAX_WEIGHT))
    return d


@contextmanager
def cpu_hog(core: int, *, weighted: bool = True) -> Iterator[subprocess.Popen]:
    """Keep `core` busy for the duration of the block."""
    cgroup = _weighted_cgroup() if weighted else None

    def setup() -> None:  # in the child, before exec
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))
        os.sched_setaffinity(0, {core})

    proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP], preexec_fn=setup)
    try:
        time.sleep(0.2)  # it is spinning before the block starts
        yield proc
    finally:
        proc.kill()
        proc.wait()
        if cgroup is not None:
            for _ in range(50):
                try:
                    cgroup.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)
