"""The default image of the docker backend, and the host paths every container needs.

Images cannot be pulled on a farm agent (it may have no registry access), so the default
image is imported from a tiny root filesystem built here: empty directories, a minimal
/etc/passwd and /etc/group, and the merged-usr symlinks. Everything executable comes from
the host at run time through read-only bind mounts of /usr, the Python prefixes and the
farm source tree, so the sandboxed command runs the very interpreter and farm code that
started it.
"""

from __future__ import annotations

import importlib.util
import io
import os
import sys
import tarfile
from pathlib import Path
from typing import Any

from farm.agents.sandbox.base import MountSpec, SandboxError

IMAGE_REPOSITORY = "farm-sim-base"
# Bump when the root filesystem below changes, so agents import the new layout.
IMAGE_LAYOUT_VERSION = "2"
DEFAULT_IMAGE = f"{IMAGE_REPOSITORY}:{IMAGE_LAYOUT_VERSION}"

# PATH of the image, so argv[0] resolves even when the caller's env has no PATH.
IMAGE_PATH_ENV = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_EMPTY_DIRS: dict[str, int] = {
    "tmp": 0o1777,
    "proc": 0o555,
    "sys": 0o555,
    "dev": 0o755,
    "etc": 0o755,
    "work": 0o755,
    "usr": 0o755,
    "root": 0o755,  # empty; traversable, as containers run unprivileged and a host runtime may live under /root
    "var": 0o755,
    "var/tmp": 0o1777,
}

# The host is merged-usr (Debian 12 and most current distros), so these point into the /usr mount.
_MERGED_USR_LINKS: dict[str, str] = {
    "bin": "usr/bin",
    "lib": "usr/lib",
    "lib64": "usr/lib64",
    "sbin": "usr/sbin",
}

_ETC_FILES: dict[str, bytes] = {
    "etc/passwd": b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "etc/group": b"root:x:0:\nnogroup:x:65534:\n",
}


def build_rootfs_tar() -> bytes:
    """The default image's root filesystem as an uncompressed tar, byte-for-byte reproducible."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, mode in _EMPTY_DIRS.items():
            tar.addfile(_tar_entry(name, tarfile.DIRTYPE, mode))
        for name, target in _MERGED_USR_LINKS.items():
            entry = _tar_entry(name, tarfile.SYMTYPE, 0o777)
            entry.linkname = target
            tar.addfile(entry)
        for name, content in _ETC_FILES.items():
            entry = _tar_entry(name, tarfile.REGTYPE, 0o644)
            entry.size = len(content)
            tar.addfile(entry, io.BytesIO(content))
    return buffer.getvalue()


def _tar_entry(name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
    entry = tarfile.TarInfo(name)
    entry.type = kind
    entry.mode = mode
    entry.uid = entry.gid = 0
    entry.mtime = 0  # fixed so the same layout always yields the same bytes
    return entry


def ensure_default_image(client: Any) -> str:
    """Import the default image into the engine unless it is there already; return its tag.

    `client` is a docker.DockerClient. Safe to call concurrently: two imports of the same
    layout just retag identical content.
    """
    import docker.errors

    try:
        client.images.get(DEFAULT_IMAGE)
        return DEFAULT_IMAGE
    except docker.errors.ImageNotFound:
        pass
    try:
        client.api.import_image_from_data(
            build_rootfs_tar(),
            repository=IMAGE_REPOSITORY,
            tag=IMAGE_LAYOUT_VERSION,
            changes=[f"ENV PATH={IMAGE_PATH_ENV}", "WORKDIR /work"],
        )
        client.images.get(DEFAULT_IMAGE)  # the import API reports some failures only in its stream
    except docker.errors.DockerException as exc:
        raise SandboxError(f"could not import the default image {DEFAULT_IMAGE} into the Docker engine: {exc}") from exc
    return DEFAULT_IMAGE


def host_runtime_mounts() -> list[MountSpec]:
    """Read-only host paths a container needs to run this interpreter and the farm code.

    Taken from the running interpreter, never hard-coded: /usr (libc, loader, tools), the
    base Python prefix, the venv prefix and the directory holding the farm source (an
    editable install keeps it outside site-packages). Paths inside another listed path
    are dropped since the outer mount already shows them.
    """
    candidates = [Path("/usr"), Path(sys.base_prefix), Path(sys.prefix)]
    farm_source = farm_source_dir()
    if farm_source is not None:
        candidates.append(farm_source)
    resolved = []
    for path in candidates:
        real = Path(os.path.realpath(path))
        if real.is_dir() and real not in resolved:
            resolved.append(real)
    # A symlinked prefix must be visible under the name the interpreter uses too.
    for path in candidates:
        if path.is_dir() and path.absolute() not in resolved and _is_symlinked(path):
            resolved.append(path.absolute())
    kept = [p for p in resolved if not any(p != other and p.is_relative_to(other) for other in resolved)]
    return [MountSpec(path=p, read_only=True) for p in kept]


def _is_symlinked(path: Path) -> bool:
    return Path(os.path.realpath(path)) != path.absolute()


def farm_source_dir() -> Path | None:
    """The smallest directory holding every farm package (the repo root for an editable install)."""
    spec = importlib.util.find_spec("farm")
    if spec is None or not spec.submodule_search_locations:
        return None
    package_dirs = [Path(p).resolve() for p in spec.submodule_search_locations]
    # This file lives in farm.agents.sandbox, which an editable install may map elsewhere.
    package_dirs.append(Path(__file__).resolve().parent)
    common = Path(os.path.commonpath([str(p) for p in package_dirs]))
    if common == Path(common.anchor):
        return None  # packages scattered over the whole filesystem: mounting / would defeat the sandbox
    return common
