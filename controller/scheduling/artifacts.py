"""The controller's artifact store and the only files it reads from its own disk.

Uploads land here content-addressed (`<sha256><suffix>`), written to a temporary name and
renamed only once size and hash are verified. FetchArtifact serves from here and nowhere else.
A job may name files on the controller's host only under the operator's `--models-root`
folders: regular files, symlinks resolved and checked again inside the root, bounded in size;
such a file is copied into the store at submit, so what agents fetch is what was inspected.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
import time
from collections.abc import Iterable
from pathlib import Path

from farm.controller.store.artifacts_db import ArtifactChunks
from farm.proto.names import SAFE_SUFFIX, SHA256_HEX
from farm.proto.script_archive import MAX_ENTRIES

DEFAULT_MAX_MODEL_BYTES = 2 << 30
COPY_CHUNK_BYTES = 1 << 20
GC_GRACE_S = 24 * 3600.0  # gc keeps a file younger than this: an upload may still be waiting for its submit


class ArtifactError(ValueError):
    """An upload or a file that the store refuses; the message says why and what to do."""


def safe_suffix(name: str) -> str:
    """The file name's extension when it is a plain one (runtimes pick the format by it), else ''."""
    suffix = Path(name).suffix
    return suffix if SAFE_SUFFIX.match(suffix) else ""


class ArtifactStore:
    def __init__(self, root: Path, *, max_bytes: int = DEFAULT_MAX_MODEL_BYTES) -> None:
        self.root = root
        self.max_bytes = max_bytes
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(root, 0o700)  # uploads are other people's models: not for every local user

    def path(self, sha256: str) -> Path | None:
        """The stored file with this hash, or None (names from the wire never become paths unchecked)."""
        if not SHA256_HEX.match(sha256):
            return None
        for candidate in sorted(self.root.glob(f"{sha256}*")):
            if candidate.name == sha256 or (candidate.name.startswith(sha256) and SAFE_SUFFIX.match(candidate.name[64:])):
                if candidate.is_file() and not candidate.is_symlink():
                    return candidate
        return None

    def missing(self, hashes: Iterable[str]) -> list[str]:
        """The hashes not stored; the stored ones are touched, so gc leaves a file a client was just told is here."""
        absent = []
        for h in dict.fromkeys(hashes):
            stored = self.path(h)
            if stored is None:
                absent.append(h)
            else:
                try:
                    os.utime(stored)
                except OSError:
                    pass
        return absent

    def collect(self, keep: set[str], grace_s: float, *, dry_run: bool = False,
                now: float | None = None) -> list[tuple[str, int]]:
        """Remove stored files no job names (`keep`) and unchanged for grace_s (an upload waiting for its
        submit is young), and abandoned partial uploads; returns (name, bytes) of each removed."""
        now = time.time() if now is None else now
        removed = []
        for entry in sorted(self.root.iterdir()):
            try:
                info = entry.lstat()
            except OSError:
                continue
            if not stat.S_ISREG(info.st_mode) or now - info.st_mtime < grace_s:
                continue
            partial = entry.name.startswith(".upload-")
            if not partial and (not SHA256_HEX.match(entry.name[:64]) or entry.name[:64] in keep):
                continue
            if not dry_run:
                entry.unlink(missing_ok=True)
            removed.append((entry.name, info.st_size))
        return removed

    def receive(self, sha256: str, size: int, name: str, chunks: Iterable[bytes], *, max_bytes: int | None = None) -> Path:
        """Store an upload; raises ArtifactError when it is too big or its bytes do not hash to sha256."""
        limit = self.max_bytes if max_bytes is None else max_bytes
        if not SHA256_HEX.match(sha256):
            raise ArtifactError(f"{sha256[:80]!r} is not a sha256 (64 lowercase hex digits)")
        if size < 0 or size > limit:
            raise ArtifactError(f"{name or sha256}: {size} bytes is over this controller's {limit} byte limit "
                                "for one file (the operator sets it with --max-model-bytes)")
        return self._write(chunks, name, size, sha256)[1]

    def add_file(self, path: Path, *, max_bytes: int | None = None) -> tuple[str, Path]:
        """Copy a file (already admitted by ModelRoots) into the store; returns its sha256 and stored path."""
        limit = self.max_bytes if max_bytes is None else max_bytes
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ArtifactError(f"{path} is not a regular file")
            if info.st_size > limit:
                raise ArtifactError(f"{path} is {info.st_size} bytes, over the {limit} byte limit (--max-model-bytes)")
            chunks = iter(lambda: f.read(COPY_CHUNK_BYTES), b"")
            return self._write(chunks, path.name, limit, None)  # the copy and its hash are of the same bytes

    def _write(self, chunks: Iterable[bytes], name: str, size: int, sha256: str | None) -> tuple[str, Path]:
        """Write to a temporary name, check size (exact when sha256 is given, else at most) and hash, rename."""
        partial = self.root / f".upload-{os.getpid()}-{os.urandom(6).hex()}"
        digest, written = hashlib.sha256(), 0
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                for data in chunks:
                    written += len(data)
                    if written > size:
                        raise ArtifactError(f"{name or sha256}: more than {size} bytes (the file grew, or the upload "
                                            "sent more than it announced)")
                    digest.update(data)
                    f.write(data)
            if sha256 is not None and written != size:
                raise ArtifactError(f"{name or sha256}: {written} of {size} bytes arrived; upload it again")
            actual = digest.hexdigest()
            if sha256 is not None and actual != sha256:
                raise ArtifactError(f"{name or sha256}: the bytes received hash to {actual}, not {sha256} "
                                    "(did the file change while it was uploaded?)")
            final = self.root / f"{actual}{safe_suffix(name)}"
            os.replace(partial, final)
        finally:
            partial.unlink(missing_ok=True)
        return actual, final



class SharedArtifactStore(ArtifactStore):
    """A PostgreSQL lab's artifacts: the database holds them (store/artifacts_db.py), `root` is this controller's
    cache of them. Whatever any controller on the database received, this one serves: a hash missing here is
    streamed in from the database, checked against its hash, then served from the cache like an upload."""

    def __init__(self, root: Path, chunks: ArtifactChunks, *, max_bytes: int = DEFAULT_MAX_MODEL_BYTES) -> None:
        super().__init__(root, max_bytes=max_bytes)
        self.chunks = chunks

    def path(self, sha256: str) -> Path | None:
        local = super().path(sha256)
        if local is not None or not SHA256_HEX.match(sha256):
            return local
        stored = self.chunks.stored(sha256)
        if stored is None:
            return None
        size, suffix = stored
        # the lab's limit, not this controller's --max-model-bytes: another controller admitted it
        return self._write(self.chunks.read(sha256), f"artifact{suffix}", size, sha256)[1]

    def missing(self, hashes: Iterable[str]) -> list[str]:
        """What the database lacks (this cache does not count: another controller could not serve it)."""
        wanted = list(dict.fromkeys(hashes))
        present = self.chunks.present(wanted)
        return [h for h in wanted if h not in present]

    def collect(self, keep: set[str], grace_s: float, *, dry_run: bool = False,
                now: float | None = None) -> list[tuple[str, int]]:
        """Lab-wide in the database, then this controller's cache; each artifact named once."""
        removed = dict(self.chunks.collect(keep, grace_s, dry_run=dry_run, now=now))
        for name, size in super().collect(keep, grace_s, dry_run=dry_run, now=now):
            if name.startswith(".") or not any(n.startswith(name[:64]) for n in removed):
                removed.setdefault(name, size)
        return sorted(removed.items())

    def receive(self, sha256: str, size: int, name: str, chunks: Iterable[bytes], *, max_bytes: int | None = None) -> Path:
        path = super().receive(sha256, size, name, chunks, max_bytes=max_bytes)
        self.chunks.put(sha256, size, path.name[64:], path)
        return path

    def add_file(self, path: Path, *, max_bytes: int | None = None) -> tuple[str, Path]:
        sha256, stored = super().add_file(path, max_bytes=max_bytes)
        self.chunks.put(sha256, stored.stat().st_size, stored.name[64:], stored)
        return sha256, stored

class ModelRoots:
    """Folders on the controller's host that jobs may name files in (`--models-root`, repeatable)."""

    def __init__(self, roots: Iterable[Path], *, max_bytes: int = DEFAULT_MAX_MODEL_BYTES) -> None:
        given = list(roots)
        self.roots = [Path(os.path.realpath(r)) for r in given]
        # as the operator wrote them too: a folder is named lexically beneath one of these, then walked without links
        self.named = list(dict.fromkeys([*self.roots, *(Path(os.path.abspath(r)) for r in given)]))
        self.max_bytes = max_bytes

    def describe(self) -> str:
        return ", ".join(str(r) for r in self.roots) or "none"

    def _inside(self, path: Path) -> bool:
        return any(path == r or path.is_relative_to(r) for r in self.roots)

    def resolve(self, name: str, base_dir: Path) -> Path:
        """A name from a job file -> the real path under a root; raises ArtifactError otherwise.

        No `~` expansion; relative names resolve from base_dir, which must itself lie under a root.
        """
        if not self.roots:
            raise ArtifactError(
                f"{name!r}: this controller reads no model files from its own disk. `farm submit` uploads the "
                "models from your machine; to name files on the controller's host, its operator must start it with "
                "--models-root DIR")
        if name.startswith("~"):
            raise ArtifactError(f"{name!r}: `~` is not expanded on the controller; give a path under a models root "
                                f"({self.describe()})")
        real = Path(os.path.realpath(base_dir / name))  # every link resolved: what would really be opened
        if not self._inside(real):
            raise ArtifactError(f"{name!r} resolves to {real}, which is outside this controller's models roots "
                                f"({self.describe()}). `farm submit` uploads models from your machine instead.")
        return real

    def admit(self, name: str, base_dir: Path) -> Path:
        """resolve(), then: a regular file, not over the size limit (never read an endless file)."""
        real = self.resolve(name, base_dir)
        try:
            info = os.stat(real)
        except OSError as e:
            raise ArtifactError(f"{name!r}: {real} cannot be read on the controller ({e.strerror})") from None
        if not stat.S_ISREG(info.st_mode):
            raise ArtifactError(f"{name!r}: {real} is not a regular file (a folder, device or pipe)")
        if info.st_size > self.max_bytes:
            raise ArtifactError(f"{name!r}: {real} is {info.st_size} bytes, over the {self.max_bytes} byte limit "
                                "(--max-model-bytes)")
        return real


class ControllerFiles:
    """What SubmitJob may read on the controller's host: files under the models roots, copied into the store."""

    def __init__(self, store: ArtifactStore, roots: ModelRoots) -> None:
        self.store = store
        self.roots = roots

    def check_pattern(self, pattern: str, base_dir: Path) -> None:
        """The part of a path or glob before its first wildcard must already lie under a root."""
        parts = Path(pattern).parts
        fixed = []
        for part in parts:
            if any(c in part for c in "*?["):
                break
            fixed.append(part)
        self.roots.resolve(str(Path(*fixed)) if fixed else ".", base_dir)

    def admit(self, name: str, base_dir: Path) -> Path:
        """The stored copy of a file under a root (inspected and served from the store, never from its path)."""
        real = self.roots.admit(name, base_dir)
        try:
            return self.store.add_file(real, max_bytes=self.roots.max_bytes)[1]
        except OSError as e:
            raise ArtifactError(f"{name!r}: {real} cannot be read on the controller ({e.strerror})") from None

    def pack_script_dir(self, name: str, base_dir: Path, max_bytes: int) -> str:
        """workload.dir under a root, packed into the store as the agents will get it; returns its sha256.

        Read beneath the root without following a single link (openat with O_NOFOLLOW at every step, the
        RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS of openat2): the controller reads with its own rights, so a link
        in a client's folder must never reach /etc/shadow or the tokens file. A client's own links are packed
        by `farm submit` on the client's machine, with the client's rights."""
        self.roots.resolve(name, base_dir)  # outside every root: refused with the usual message first
        root, parts = self._beneath(name, base_dir)
        data = pack_beneath(root, parts, max_bytes)
        sha256 = hashlib.sha256(data).hexdigest()
        if self.store.path(sha256) is None:
            self.store.receive(sha256, len(data), "dir.tar", [data], max_bytes=max_bytes)
        return sha256

    def _beneath(self, name: str, base_dir: Path) -> tuple[Path, list[str]]:
        """The root a folder name lies in, lexically (no link resolved), and the names below it."""
        path = Path(os.path.normpath(base_dir / name))
        for root in sorted(self.roots.named, key=lambda r: len(r.parts), reverse=True):
            if path == root or path.is_relative_to(root):
                return root, list(path.relative_to(root).parts)
        raise ArtifactError(f"workload.dir {name!r}: {path} is reached through a link; on the controller a script "
                            f"folder must be named by its own path under a models root ({self.roots.describe()}), "
                            "or uploaded by `farm submit`")


def _open_beneath(parent: int, name: str, shown: str, *, folder: bool) -> int:
    """openat(parent, name) refusing a link, with O_NONBLOCK so a pipe cannot hang the controller."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_DIRECTORY if folder else 0)
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError as e:
        raise ArtifactError(f"{shown} cannot be read on the controller ({e.strerror})") from None
    if stat.S_ISLNK(info.st_mode):
        raise ArtifactError(f"{shown} is a link; the controller follows no link in a folder it reads on a client's "
                            "behalf. Upload the folder with `farm submit` (links are packed there with your rights), "
                            "or replace the link with the file")
    if folder and not stat.S_ISDIR(info.st_mode):
        raise ArtifactError(f"{shown} is not a folder")
    try:
        return os.open(name, flags, dir_fd=parent)
    except OSError as e:  # ELOOP: it became a link since the stat
        raise ArtifactError(f"{shown} cannot be opened on the controller without following a link ({e.strerror})") from None


def pack_beneath(root: Path, parts: list[str], max_bytes: int) -> bytes:
    """The folder root/parts as the same deterministic tar `pack_dir` makes, read without following links:
    every entry a folder or a regular file, each file's size checked against what is left before it is read."""
    shown = "workload.dir " + "/".join(parts or ["."])
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            child = _open_beneath(fd, part, f"{shown}: {root.joinpath(*parts[:i + 1])}", folder=True)
            os.close(fd)
            fd = child
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
            _pack_folder(tar, buffer, fd, root.joinpath(*parts), "", max_bytes, [0])
        return buffer.getvalue()
    finally:
        os.close(fd)


def _pack_folder(tar: tarfile.TarFile, buffer: io.BytesIO, fd: int, where: Path, prefix: str, max_bytes: int,
                 entries: list[int]) -> None:
    """One folder in os.walk's top-down order (its folders and files sorted, then each folder below)."""
    kinds = {}
    try:
        for entry in os.scandir(fd):
            kinds[entry.name] = os.stat(entry.name, dir_fd=fd, follow_symlinks=False)
    except OSError as e:
        raise ArtifactError(f"workload.dir: {where} cannot be read on the controller ({e.strerror})") from None
    folders = sorted(n for n, info in kinds.items() if stat.S_ISDIR(info.st_mode))
    files = sorted(n for n in kinds if n not in folders)
    for name in folders + files:
        info, path = kinds[name], where / name
        entries[0] += 1
        if entries[0] > MAX_ENTRIES:
            raise ArtifactError(f"workload.dir holds more than {MAX_ENTRIES} entries; give the script a folder of its own")
        if stat.S_ISLNK(info.st_mode):
            raise ArtifactError(f"workload.dir: {path} is a link; the controller follows no link in a folder it reads "
                                "on a client's behalf. Upload the folder with `farm submit` (links are packed there with "
                                "your rights), or replace the link with the file")
        if not (stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)):
            raise ArtifactError(f"workload.dir: {path} is not a regular file or folder (a device, socket or pipe); "
                                "workload.dir may hold files and folders only")
        member = tarfile.TarInfo(prefix + name)
        member.mode = stat.S_IMODE(info.st_mode) & 0o755
        if stat.S_ISDIR(info.st_mode):
            member.type = tarfile.DIRTYPE
            tar.addfile(member)
            continue
        left = max_bytes - buffer.tell()
        if info.st_size > left:  # checked before a byte is read
            raise ArtifactError(f"workload.dir: {path} is {info.st_size} bytes, and the packed folder may be at most "
                                f"{max_bytes >> 20} MiB")
        child = _open_beneath(fd, name, f"workload.dir: {path}", folder=False)
        with os.fdopen(child, "rb") as f:
            opened = os.fstat(f.fileno())
            if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
                raise ArtifactError(f"workload.dir: {path} changed while it was read; submit again")
            data = f.read(left + 1)
        if len(data) > left:
            raise ArtifactError(f"workload.dir: {path} grew past the {max_bytes >> 20} MiB the packed folder may take")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
        if buffer.tell() > max_bytes:
            raise ArtifactError(f"workload.dir is over {max_bytes >> 20} MiB packed; give the script a folder of its own")
    for name in folders:
        child = _open_beneath(fd, name, f"workload.dir: {where / name}", folder=True)
        try:
            _pack_folder(tar, buffer, child, where / name, f"{prefix}{name}/", max_bytes, entries)
        finally:
            os.close(child)
