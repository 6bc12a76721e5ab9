"""A run's own world, entered as root and left as the run's own user: the one implementation of the steps both the
cold path (`unshare --pid --fork -- python -I -S run_world.py ARGV...`, which then execs ARGV) and the warm path
(the zygote's child, agents/harness/zygote.py) take before any of the run's code runs.

Standard library only, and nothing imported from farm: the cold path runs this file by its path with `-I -S`, before
the run's namespaces exist, so it costs an interpreter start and no more.

In order, already PID 1 of a new PID namespace:
1. a new mount namespace, every mount private (nothing the run mounts reaches the host, nothing the host mounts
   later reaches the run), a fresh /proc that shows only the run's own processes;
2. every other run's directory taken out of the run's mount table: the tmpfs run directories of every farm agent
   on the host (source `farm-run`) and every mount under the agent's runs root (`hide`) are detached, so no other
   run's path is in /proc/self/mountinfo, and the runs root itself is covered by an empty tmpfs;
3. tmpfs on /tmp, /var/tmp and /dev/shm, closed folders covered and farm's runtime bound back read-only;
4. the run's own directory bound at /tmp/run (nosuid, nodev), the working directory;
5. the run's own uid and gid (a uid no other run holds at the same time), no supplementary groups, no new
   privileges.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import sys
from typing import Any

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    0x1, 0x2, 0x4, 0x8, 0x20, 0x1000, 0x4000, 0x40000)
MNT_DETACH = 0x2
PR_SET_NO_NEW_PRIVS = 38
RUN_DIR_SOURCE = "farm-run"  # the tmpfs every agent mounts over a run directory (isolation.mount_run_dir)
INNER_RUN_DIR = "/tmp/run"
ISOLATE_ENV = "FARM_ISOLATE"  # the cold path's settings: JSON {"isolate": ..., "user": ...}
SETUP_FAILED_EXIT = 98
RESULT_FD = 3  # where a warm run holds the descriptor its result goes to (the agent's anonymous file)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(source.encode() if source else None, os.fsencode(target), fstype.encode() if fstype else None,
                       flags, data.encode() if data else None), f"mount {target}")


def _unescape(field: str) -> str:
    """A mountinfo path: space, tab, newline and backslash are written as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_table() -> list[tuple[str, str]]:
    """(mount point, source) of every mount this process sees, in the order the kernel lists them."""
    table = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            before, _, after = line.partition(" - ")
            fields, tail = before.split(), after.split()
            if len(fields) >= 5 and len(tail) >= 2:
                table.append((_unescape(fields[4]), _unescape(tail[1])))
    return table


def _under(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


# how an agent names a run directory (agents/sim/driver.py): runs/task<id>-a<attempt>-<uuid hex>[.kept]
RUN_DIR_NAME = re.compile(r"task\d+-a\d+-[0-9a-f]{32}(\.kept)?")


def is_run_dir(point: str) -> bool:
    parent, _, name = point.rpartition("/")
    return parent.endswith("/runs") and RUN_DIR_NAME.fullmatch(name) is not None


def other_runs(hide: list[str]) -> list[str]:
    """Mount points of run directories: every agent's (its tmpfs, or a bind of its own where no tmpfs could be made),
    and every mount under the runs roots in `hide` (this agent's)."""
    return [point for point, source in mount_table()
            if source == RUN_DIR_SOURCE or is_run_dir(point) or _under(point, hide)]


def enter_mount_namespace(isolate: dict[str, Any]) -> None:
    """Steps 1–4 above, in a process that is PID 1 of a new PID namespace with the run directory as its cwd."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare the mount namespace")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    hide = [p for p in isolate.get("hide") or [] if p]
    # held by descriptor before anything is covered: a covered mount is still listed, and can only be reached so
    detach = []
    for point in sorted(set(other_runs(hide)), key=lambda p: -p.count("/")):  # the deepest first
        try:
            detach.append(os.open(point, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW))
        except OSError:
            pass  # gone since the table was read: a run that ended
    # opened in the new namespace (a mount of another namespace cannot be bound), before /tmp is covered
    keep = [os.open(path, os.O_PATH | os.O_DIRECTORY) for path in isolate["keep"]]
    _mount("farm-tmp", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={isolate['tmp_size']}")
    for folder in ("/var/tmp", "/dev/shm"):
        _mount("farm-tmp", folder, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={isolate['small_tmp_size']}")
    for folder in isolate["cover"]:
        _mount("farm-cover", folder, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    os.mkdir(INNER_RUN_DIR)
    _mount("/proc/self/cwd", INNER_RUN_DIR, None, MS_BIND)
    _mount(None, INNER_RUN_DIR, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)
    for fd, path in zip(keep, isolate["keep"]):
        os.makedirs(path, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND)
        _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
        os.close(fd)
    os.chdir(INNER_RUN_DIR)  # off the run directory's own mount, which goes next with the others
    for fd in detach:
        # through the descriptor: the mount may be covered by now (a run directory under /tmp)
        if _libc.umount2(f"/proc/self/fd/{fd}".encode(), MNT_DETACH) != 0 and ctypes.get_errno() != 22:
            errno = ctypes.get_errno()  # EINVAL: not a mount point any more (its parent went first)
            raise OSError(errno, f"detach another run's directory from the run's mount table: {os.strerror(errno)}")
        os.close(fd)
    for root in hide:
        if os.path.isdir(root) and not _under(root, ["/tmp", "/var/tmp", "/dev/shm", *isolate["cover"]]):
            _mount("farm-runs", root, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755,size=4k")
    leftover = [point for point in other_runs(hide) if point != INNER_RUN_DIR and point not in hide]
    if leftover:  # a run directory mounted between the read and the detach: never run beside it
        raise OSError(17, f"other runs' directories are still mounted: {', '.join(leftover[:3])}")


def become(user: dict[str, int]) -> None:
    """setpriv --reuid --regid --clear-groups --no-new-privs."""
    os.setgroups([])
    os.setresgid(user["gid"], user["gid"], user["gid"])
    os.setresuid(user["uid"], user["uid"], user["uid"])
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no new privileges")


def main(argv: list[str]) -> int:
    """The cold path: enter the run's world, then exec argv as the run's user (descriptors kept: the result's)."""
    try:
        settings = json.loads(os.environ.pop(ISOLATE_ENV))
        enter_mount_namespace(settings["isolate"])
        become(settings["user"])
    except (OSError, KeyError, ValueError) as e:
        print(f"farm-isolate: {e}", flush=True)
        return SETUP_FAILED_EXIT
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        print(f"farm-isolate: cannot start {argv[0]}: {e.strerror}", flush=True)
        return 127
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
