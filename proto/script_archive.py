"""A script workload's folder on the wire: a plain tar of regular files and directories.

The client packs `workload.dir` (deterministically, so the same folder has the same sha256 and
is uploaded once), the controller checks it before accepting the job, and the agent checks it
again as it unpacks into the run's own directory. Nothing in it can name a path outside that
directory: no absolute names, no `..`, no links, no devices. Links in the folder are packed as
the files they point to, read with the rights of whoever packs (the user, on their machine).
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path, PurePosixPath

MAX_SCRIPT_ARCHIVE_BYTES = 256 << 20
MAX_ENTRIES = 10_000


class ScriptArchiveError(ValueError):
    """A folder that cannot be packed, or an archive that is not a safe script folder."""


def pack_dir(directory: Path, max_bytes: int = MAX_SCRIPT_ARCHIVE_BYTES, skip: tuple[Path, ...] = ()) -> bytes:
    """The folder as a tar: sorted, owner and times zeroed. A link to a file is packed as the file it
    points to (read with the packer's own rights); `skip` leaves out folders and files (farm's own work
    folder, a live store: closing a file SQLite has open in this process drops its locks)."""
    directory = directory.resolve()
    skipped = {p.resolve() for p in skip}
    buffer = io.BytesIO()
    entries = 0
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for current, dirs, files in os.walk(directory, followlinks=False):
            dirs[:] = sorted(d for d in dirs if Path(current, d).resolve() not in skipped)
            here = Path(current)
            for name in dirs + sorted(f for f in files if Path(current, f).resolve() not in skipped):
                path = here / name
                try:
                    info = path.stat()  # follows a link
                except OSError as e:
                    raise ScriptArchiveError(f"{path} cannot be read: {e.strerror}") from None
                entries += 1
                if entries > MAX_ENTRIES:
                    raise ScriptArchiveError(f"{directory} holds more than {MAX_ENTRIES} entries; give the script a "
                                             "folder of its own (workload.dir)")
                member = tarfile.TarInfo(path.relative_to(directory).as_posix())
                member.mode = stat.S_IMODE(info.st_mode) & 0o755
                if stat.S_ISDIR(info.st_mode):
                    if path.is_symlink():
                        raise ScriptArchiveError(f"{path} is a link to a folder; workload.dir must hold the folder "
                                                 "itself (links to files are fine)")
                    member.type = tarfile.DIRTYPE
                    tar.addfile(member)
                elif stat.S_ISREG(info.st_mode):
                    with open(path, "rb") as f:  # one read: a file that changes meanwhile is still packed whole
                        data = f.read(max(0, max_bytes - buffer.tell()) + 1)
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
                else:
                    raise ScriptArchiveError(f"{path} is not a regular file or folder (a device, socket or pipe); "
                                             "workload.dir may hold files and folders only")
                if buffer.tell() > max_bytes:
                    raise ScriptArchiveError(
                        f"{directory} is over {max_bytes >> 20} MiB packed; workload.dir goes with every run, "
                        "so give the script a folder of its own (models are sent separately)")
    return buffer.getvalue()


def check_members(tar: tarfile.TarFile, *, script: str | None = None) -> list[tarfile.TarInfo]:
    """Every member, when each is a plain file or folder with a relative name inside the archive."""
    members: list[tarfile.TarInfo] = []
    for member in tar:
        if len(members) >= MAX_ENTRIES:
            raise ScriptArchiveError(f"the script archive has more than {MAX_ENTRIES} entries")
        name = PurePosixPath(member.name)
        if name.is_absolute() or ".." in name.parts or member.name.startswith("/"):
            raise ScriptArchiveError(f"the script archive names {member.name!r}, outside its own folder")
        if not (member.isreg() or member.isdir()):
            raise ScriptArchiveError(f"the script archive's {member.name!r} is a link, device or pipe; "
                                     "only files and folders are accepted")
        members.append(member)
    if script is not None:
        wanted = PurePosixPath(script)
        if wanted.is_absolute() or ".." in wanted.parts:
            raise ScriptArchiveError(f"workload.script {script!r} must be a path inside workload.dir")
        if not any(m.isreg() and PurePosixPath(m.name) == wanted for m in members):
            raise ScriptArchiveError(f"workload.script {script!r} is not a file in workload.dir")
    return members


def check_archive(path: Path, *, script: str | None = None) -> None:
    """Raise ScriptArchiveError unless the stored archive is a safe script folder holding `script`."""
    try:
        with tarfile.open(path, mode="r:") as tar:
            check_members(tar, script=script)
    except tarfile.TarError as e:
        raise ScriptArchiveError(f"not a tar archive: {e}") from None


def unpack(path: Path, destination: Path) -> None:
    """Check, then unpack into destination (which must exist); the stdlib's data filter checks again."""
    try:
        with tarfile.open(path, mode="r:") as tar:
            members = check_members(tar)
            tar.extractall(destination, members=members, filter="data")
    except tarfile.TarError as e:
        raise ScriptArchiveError(f"the script archive cannot be unpacked: {e}") from None
