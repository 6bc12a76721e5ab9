"""Running in the user's own image (`sim.image`): the script gets the image's /usr, Python and packages.

farm's harness still runs inside the container (it starts the script and times it; limits, the
sampler and the peak stay on the host side, on the container's cgroup). Its interpreter, libraries
and tools come from the host, mounted read-only under /farm-host so they hide nothing of the image,
and are started through the host's own dynamic loader with the host's library folders, so they never
link against the image's libc. The script's `python` is found on the image's PATH.
"""

from __future__ import annotations

import os
import struct
import sys
import sysconfig
from pathlib import Path

from farm.agents.sandbox.docker_image import farm_source_dir, host_runtime_mounts

HOST_PREFIX = Path("/farm-host")
PT_INTERP = 3
# Added to sys.path (with their .pth files) before the harness is imported; the script never sees them.
_BOOT = ("import runpy, site, sys\n"
         "for d in sys.argv.pop(1).split('\\n'):\n"
         "    site.addsitedir(d)\n"
         "runpy.run_module('farm.agents.harness', run_name='__main__', alter_sys=True)\n")


class UserImageError(Exception):
    """This host's interpreter cannot be started inside another image (not a dynamically linked ELF)."""


def under_host(path: Path | str) -> str:
    return str(HOST_PREFIX / str(Path(path).absolute()).lstrip("/"))


def host_loader(executable: str | None = None) -> Path:
    """The dynamic loader the interpreter names in its ELF header (PT_INTERP), resolved on the host."""
    path = os.path.realpath(executable or sys.executable)
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise UserImageError(f"{path} is not a 64-bit little-endian ELF file")
        phoff, = struct.unpack_from("<Q", head, 32)
        phentsize, phnum = struct.unpack_from("<HH", head, 54)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        for i in range(phnum):
            kind, _flags, offset, _vaddr, _paddr, size = struct.unpack_from("<IIQQQQ", table, i * phentsize)
            if kind == PT_INTERP:
                f.seek(offset)
                return Path(os.path.realpath(f.read(size).rstrip(b"\0").decode()))
    raise UserImageError(f"{path} names no dynamic loader (statically linked)")


def library_dirs() -> list[str]:
    """The host folders the interpreter, its extension modules and setpriv load libraries from."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    candidates = [host_loader().parent, Path(sys.base_prefix) / "lib", Path("/usr/lib") / multiarch,
                  Path("/lib") / multiarch, Path("/usr/lib"), Path("/usr/local/lib")]
    seen: list[str] = []
    for c in candidates:
        real = os.path.realpath(c)
        if os.path.isdir(real) and real not in seen:
            seen.append(real)
    return seen


def mounts() -> list[tuple[str, str]]:
    """(host source, container target): the host runtime under /farm-host, farm's source at its own path
    (an editable install's finder names it so)."""
    out = [(str(spec.path), under_host(spec.path)) for spec in host_runtime_mounts()]
    source = farm_source_dir()
    if source is not None:
        out.append((str(source), str(source)))
    return out


def _host(argv0: str) -> list[str]:
    """argv0 (a host program) started by the host's loader from /farm-host."""
    return [under_host(host_loader(argv0)), "--library-path", ":".join(under_host(d) for d in library_dirs()),
            under_host(os.path.realpath(argv0))]


def harness_argv(task_file: str, out_file: str, run_as_argv: list[str] | None = None) -> list[str]:
    """The harness, started with the host's interpreter inside the user's image; run_as_argv: the setpriv
    options (without the program) that switch to the run user first."""
    site_dirs = [under_host(p) for p in sys.path
                 if p and Path(p).name in ("site-packages", "dist-packages") and os.path.isdir(p)]
    harness = [*_host(sys.executable), "-c", _BOOT, "\n".join(site_dirs), task_file, out_file]
    if run_as_argv is None:
        return harness
    setpriv = next((p for p in ("/usr/bin/setpriv", "/bin/setpriv") if os.path.exists(p)), None)
    if setpriv is None:
        raise UserImageError("setpriv (util-linux) is not installed on this host")
    return [*_host(setpriv), *run_as_argv, "--", *harness]
