"""Reading a file a user named (a job file, a model): regular files only, refused by type before
any read and by size before reading, so a FIFO never blocks and /dev/zero is never read to the end.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

MAX_JOB_FILE_BYTES = 1 << 20  # a job file is a page of YAML; the controller's limit too
MAX_MODEL_FILE_BYTES = 2 << 30  # one model file, as the controller's default --max-model-bytes


class FileRefused(ValueError):
    """The path names something farm will not read: not a regular file, or over the size limit."""


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words a user knows."""
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


def _refuse_kind(path: Path, what: str, mode: int) -> FileRefused:
    return FileRefused(f"{path}: the {what} is {file_kind(mode)}, not a regular file; farm reads only regular "
                       "files (a pipe or a device may block forever or never end). Give the file itself.")


def _refuse_size(path: Path, what: str, size: int, limit: int) -> FileRefused:
    return FileRefused(f"{path}: the {what} is {size:,} bytes, over the limit of {limit:,} bytes for a {what}.")


def check_regular_file(path: Path, what: str, limit: int) -> int:
    """The file's size, after checking it is a regular file within `limit` bytes (stat only: nothing is opened)."""
    info = os.stat(path)  # FileNotFoundError and friends go to the caller, who knows how to word them
    if not stat.S_ISREG(info.st_mode):
        raise _refuse_kind(Path(path), what, info.st_mode)
    if info.st_size > limit:
        raise _refuse_size(Path(path), what, info.st_size, limit)
    return info.st_size


def _read_at_most(stream: BinaryIO, size: int) -> bytes:
    """Up to `size` bytes in 1 MiB reads: `read(size)` would allocate all of `size` at once (a model's 4 GiB
    limit is a MemoryError on a small VM), whatever the file's length."""
    chunks: list[bytes] = []
    left = size
    while left > 0:
        chunk = stream.read(min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_regular_file(path: Path, what: str, limit: int) -> bytes:
    """The whole file, refused unless it is a regular file of at most `limit` bytes."""
    check_regular_file(path, what, limit)
    # O_NONBLOCK: had the path been swapped for a FIFO since the stat, the open still returns at once
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as stream:
        info = os.fstat(stream.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise _refuse_kind(Path(path), what, info.st_mode)
        data = _read_at_most(stream, limit + 1)  # bounded even if the file grows while it is read
    if len(data) > limit:
        raise _refuse_size(Path(path), what, len(data), limit)
    return data
