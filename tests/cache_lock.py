"""One builder at a time for a cache under /var/cache/farm-tests (issue 34): two test runs on one machine (two
people's `make test`, a rerun beside a run) would otherwise build the same arm64 root, VM kernel or wheel folder
over each other. The builder takes the folder's lock, looks again whether another run finished the cache while
it waited, and builds only when not."""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def cache_lock(folder: Path) -> Iterator[None]:
    """Hold `folder`/.lock (flock, released when the holder exits or dies). A folder this user cannot make or
    write is not locked: the builder then fails as it would have, saying why."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / ".lock", "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
