"""The controller's artifact store and the only files it reads from its own disk.

Uploads land here content-addressed (`<sha256><suffix>`), written to a temporary name and
renamed only once size and hash are verified. FetchArtifact serves from here and nowhere else.
A job may name files on the controller's host only under the operator's `--models-root`
folders: regular files, symlinks resolved and checked again inside the root, bounded in size;
such a file is copied into the store at submit, so what agents fetch is what was inspected.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from farm.proto.names import SAFE_SUFFIX, SHA256_HEX
from farm.proto.script_archive import pack_dir

DEFAULT_MAX_MODEL_BYTES = 2 << 30
COPY_CHUNK_BYTES = 1 << 20


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
        return [h for h in dict.fromkeys(hashes) if self.path(h) is None]

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


class ModelRoots:
    """Folders on the controller's host that jobs may name files in (`--models-root`, repeatable)."""

    def __init__(self, roots: Iterable[Path], *, max_bytes: int = DEFAULT_MAX_MODEL_BYTES) -> None:
        self.roots = [Path(os.path.realpath(r)) for r in roots]
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
        """workload.dir under a root, packed into the store as the agents will get it; returns its sha256."""
        real = self.roots.resolve(name, base_dir)
        if not real.is_dir():
            raise ArtifactError(f"workload.dir {name!r}: {real} is not a folder")
        data = pack_dir(real, max_bytes)
        sha256 = hashlib.sha256(data).hexdigest()
        if self.store.path(sha256) is None:
            self.store.receive(sha256, len(data), "dir.tar", [data], max_bytes=max_bytes)
        return sha256
