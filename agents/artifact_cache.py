"""The agent's content-addressed cache of models and script folders, safe when several slots want one file.

Each artifact is fetched under a lock of its own digest (a thread lock for this agent's slots, an flock for
other agents sharing the folder), into a partial file no other fetch writes, checked against its sha256 and
renamed into place. A second slot asking for the same digest waits for the first and then uses its file: no
slot ever reads a file another is still writing (which used to fail the run as "changed since it was
submitted", blaming the user for the agent's own race).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import threading
from pathlib import Path
from typing import Callable

CHUNK_BYTES = 1 << 20


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while data := f.read(CHUNK_BYTES):
            digest.update(data)
    return digest.hexdigest()


class ArtifactCache:
    """Files named by sha256 under `folder`; `get` returns one, fetching it with `fetch(partial_file)`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self.fetches = 0  # downloads this cache made (tests and benchmarks read it)

    def _lock(self, sha256: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(sha256, threading.Lock())

    def get(self, sha256: str, name: str, fetch: Callable[[Path], None]) -> Path:
        """The verified file `name` (its digest and suffix) for sha256; `fetch` writes the bytes to the path given."""
        destination = self.folder / name
        with self._lock(sha256):
            if self._trusted(destination, sha256):
                return destination
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            with open(self.folder / f".{sha256}.lock", "a") as lock_file:
                fcntl.flock(lock_file, fcntl.LOCK_EX)  # another agent process on the same folder
                if self._trusted(destination, sha256):
                    return destination
                fd, partial_name = tempfile.mkstemp(dir=self.folder, prefix=f".{name}.", suffix=".part")
                os.close(fd)
                partial = Path(partial_name)
                try:
                    fetch(partial)
                    got = file_sha256(partial)
                    if got != sha256:
                        raise ValueError(f"artifact {sha256}: the received bytes hash to {got}")
                    os.replace(partial, destination)  # atomic: a reader sees no file or the whole, checked file
                    self.fetches += 1
                finally:
                    partial.unlink(missing_ok=True)
        return destination

    def _trusted(self, path: Path, sha256: str) -> bool:
        """The cached file is there: only a whole, checked file is ever renamed into place. Its bytes are not
        hashed again here: the sim driver hashes the copy it runs, so a file changed under the agent still
        fails that run naming both hashes."""
        return path.exists()
