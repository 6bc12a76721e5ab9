"""Is the store file this process writes still the one on disk? `farm web` and the controller ask every few
seconds: a store deleted or replaced under a running process used to go unnoticed while it wrote into an
unlinked file."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class StoreFile:
    """The store file as the disk has it now, against the file this process opened."""

    path: str
    linked: bool  # the opened file still has a name (st_nlink > 0): not deleted under us
    replaced: bool  # the path now names another file (a restore, a copy over it)
    size_bytes: int | None  # the database and its write-ahead log
    last_write: float | None  # newest modification time of the two
    database: bool = False  # a database server's store (path: its address without the password): no file to watch

    @property
    def ok(self) -> bool:
        return self.linked and not self.replaced

    @property
    def problem(self) -> str:
        if not self.linked:
            return (f"the store file {self.path} was deleted while this process had it open: everything written now is "
                    "lost when the process stops. Stop it, restore the file from a backup, and start it again.")
        if self.replaced:
            return (f"the store file {self.path} was replaced by another file while this process had it open: this "
                    "process still writes to the old one. Restart it to use the new file.")
        return ""


class StoreFileWatch:
    """Holds its own descriptor on the store file, so a deletion shows as st_nlink == 0 and a replacement as
    another inode behind the path."""

    def __init__(self, path: Path, *, database: str | None = None) -> None:
        """path: the store file; database: a database server's address instead (the store's location), shown as
        the store's place, never the local folder a PostgreSQL store keeps beside it."""
        self.path = path
        self.database = database
        self._fd: int | None = None
        self._told = False
        if database is None and str(path) != ":memory:" and path.is_file():
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    @classmethod
    def for_store(cls, store: Any) -> "StoreFileWatch":
        """The watch of an open store (controller.store.Store): its file, or its database's address."""
        return cls(store.path, database=None if store.location == str(store.path) else store.location)

    def check(self) -> StoreFile:
        if self.database is not None:
            return StoreFile(self.database, True, False, None, None, database=True)
        if self._fd is None:
            return StoreFile(str(self.path), True, False, None, None)
        held = os.fstat(self._fd)
        try:
            now = os.stat(self.path)
            replaced = (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)
        except FileNotFoundError:
            replaced = False  # gone: the link count says so
        sizes, times = [held.st_size], [held.st_mtime]
        try:
            wal = os.stat(f"{self.path}-wal")
            sizes.append(wal.st_size)
            times.append(wal.st_mtime)
        except OSError:
            pass
        return StoreFile(str(self.path), held.st_nlink > 0, replaced, sum(sizes), max(times))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def check_and_log(self, log: logging.Logger) -> StoreFile:
        """check(), and one error line when the file goes missing or is replaced (not one every check)."""
        state = self.check()
        if not state.ok and not self._told:
            log.error("%s", state.problem)
        self._told = not state.ok
        return state
