"""Who the sandboxed command runs as, and what it can see: a uid and gid of its own in its own mount and PID
namespaces, with a private /tmp and its run directory, and nothing of the agent's or of any other run.

A job's harness or script is other people's code. As root, farm starts it through `unshare --pid --fork` and then
harness/run_world.py (stdlib only, run by its path): a new mount namespace with private propagation, a fresh
/proc, every other run's directory detached from the run's mount table (so /proc/self/mountinfo names none), tmpfs
over /tmp, /var/tmp and /dev/shm, the run directory bound at /tmp/run, and then the run's own uid and gid (no
supplementary groups, no new privileges). The warm path's zygote child runs the same code (zygote.py).

Each concurrent run's uid and gid come from a range the agent owns (RunUids, FARM_RUN_UIDS, as systemd's
DynamicUser): one lock file per uid under /run/farm/run-uids, held for the run's life, so no two runs of any agent
on the host share one, and a run's files are no other run's. The backends are unchanged: the cgroup backend's
shell joins its cgroups as root and then execs this prefix. The docker backend has its own namespaces already:
there the container itself starts as the run's uid (docker.py), with nothing of root to drop. Not root: nothing
to drop, the run is as the agent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import functools
import importlib.util
import json
import os
import random
import pwd
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from farm.agents.harness.run_world import ISOLATE_ENV

DEFAULT_RUN_AS = "nobody"
# Where the run directory appears inside the namespaces: short, and traversable whatever the host path.
INNER_RUN_DIR = Path("/tmp/run")
# The folders the run gets fresh (tmpfs); anything farm itself runs from inside them is bound back.
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
MAX_KEPT = 6  # runtime folders bound back, at most
# The cold path's first step in the namespaces: stdlib only, run by its path (the warm path imports it)
RUN_WORLD = Path(__file__).resolve().parent.parent / "harness" / "run_world.py"
# Each concurrent run's own uid and gid, from a range the agent owns (as systemd's DynamicUser): FIRST:COUNT.
RUN_UIDS_ENV = "FARM_RUN_UIDS"
DEFAULT_RUN_UIDS = (0x7A000000, 1 << 16)  # 2046820352 up: above systemd's container ranges, below 2^31
# One lock file per uid in use, shared by every agent on the host (two agents never give a run the same uid).
RUN_UID_LOCKS = Path("/run/farm/run-uids")
UID_WINDOW = 1024


class RunUserError(ValueError):
    """--run-as names no user on this host, or one farm cannot switch to."""


@dataclass(frozen=True)
class RunAs:
    name: str
    uid: int
    gid: int


def run_uid_range() -> tuple[int, int]:
    """(first uid, how many) of the agent's run range: FARM_RUN_UIDS=FIRST:COUNT, else DEFAULT_RUN_UIDS."""
    text = os.environ.get(RUN_UIDS_ENV, "").strip()
    if not text:
        return DEFAULT_RUN_UIDS
    try:
        first, count = (int(part) for part in text.split(":"))
    except ValueError:
        raise RunUserError(f"{RUN_UIDS_ENV}={text!r}: write FIRST:COUNT, two whole numbers (the default is "
                           f"{DEFAULT_RUN_UIDS[0]}:{DEFAULT_RUN_UIDS[1]})") from None
    if first < 1000 or count < 1 or first + count > 1 << 31:
        raise RunUserError(f"{RUN_UIDS_ENV}={text!r}: the range must lie between 1000 and 2^31 and hold at least one "
                           "uid, none of them a user of this host's")
    return first, count


class RunUid:
    """One run's own uid and gid while it holds them: a lock file no other run of any agent on the host can take."""

    def __init__(self, run_as: RunAs, lock_fd: int) -> None:
        self.run_as, self._lock_fd = run_as, lock_fd

    def release(self, sweep: bool = True) -> None:
        """Give the uid back. sweep: anything still running under it (a run that escaped its process group where
        there are no namespaces) is killed first, so the next run given this uid meets nothing of this one; a run
        in a PID namespace of its own (or a container) needs none, the kernel ended all of it with it."""
        if self._lock_fd < 0:
            return
        if sweep:
            kill_user_processes(self.run_as.uid)
        os.close(self._lock_fd)  # closing drops the lock
        self._lock_fd = -1


class RunUids:
    """The run range (run_uid_range) an agent hands out: each concurrent run a uid and gid nobody else holds, so
    the files one run makes are no other run's, whoever wrote the other job."""

    def __init__(self, first: int, count: int, locks: Path = RUN_UID_LOCKS) -> None:
        self.first, self.count, self.locks = first, count, locks

    def acquire(self) -> RunUid:
        self.locks.mkdir(parents=True, exist_ok=True, mode=0o700)
        # from anywhere in the first UID_WINDOW uids (a uid just given back seldom comes next; the lock files stay
        # few), then on through the range while they are all taken
        start = random.randrange(min(self.count, UID_WINDOW))
        for step in range(self.count):
            uid = self.first + (start + step) % self.count
            fd = os.open(self.locks / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return RunUid(RunAs(f"farm-run-{uid}", uid, uid), fd)
        raise RunUserError(f"every uid of the run range ({RUN_UIDS_ENV}={self.first}:{self.count}) is held by a "
                           f"run; widen the range")


def kill_user_processes(uid: int) -> None:
    """SIGKILL every process of `uid`: kill(-1) sent as that uid reaches exactly the processes whose real or saved uid
    it is (one short process, not a read of every process's status)."""
    try:
        subprocess.run(["/bin/sh", "-c", "kill -KILL -1"], user=uid, group=uid, extra_groups=[], env={"PATH": "/usr/bin:/bin"},
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30,
                       cwd="/", check=False)
    except (OSError, subprocess.SubprocessError):
        pass


def resolve_run_as(name: str | None) -> RunAs | None:
    """The user sandboxed commands run as: `name`, else `nobody` when farm runs as root, else None (as itself)."""
    if os.geteuid() != 0:
        if name and name != pwd.getpwuid(os.geteuid()).pw_name:
            raise RunUserError(f"--run-as {name}: switching users needs root; this agent runs as "
                               f"{pwd.getpwuid(os.geteuid()).pw_name}, and its runs do too")
        return None
    name = name or DEFAULT_RUN_AS
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise RunUserError(f"--run-as {name}: no such user on this host; create one (`useradd --system "
                           f"--no-create-home farm-run`) or use the default, {DEFAULT_RUN_AS}") from None
    if entry.pw_uid == 0:
        raise RunUserError(f"--run-as {name}: that is root; jobs run other people's code, give them a user of their own")
    return RunAs(name, entry.pw_uid, entry.pw_gid)


@functools.cache
def namespaces_unavailable() -> str | None:
    """None when unshare + setpriv can isolate a run here, else why not (checked once)."""
    for tool in ("unshare", "setpriv", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} (util-linux) is not installed"
    probe = subprocess.run(["unshare", "--mount", "--pid", "--fork", "--mount-proc", "--propagation", "private",
                            "--", "/bin/sh", "-c", "mount -t tmpfs farm-probe /tmp"],
                           capture_output=True, text=True, timeout=30, cwd="/")
    if probe.returncode != 0:
        return f"unshare could not make mount and PID namespaces: {probe.stderr.strip()[-200:]}"
    return None


def isolated_argv(argv: list[str], run_as: RunAs) -> list[str]:
    """argv run as run_as inside fresh mount + PID namespaces (harness/run_world.py makes the mount namespace and
    switches user, isolation_env says how); cwd must be the run directory."""
    return ["unshare", "--pid", "--fork", "--", sys.executable, "-I", "-S", str(RUN_WORLD), *argv]


def user_argv(argv: list[str], run_as: RunAs) -> list[str]:
    """argv run as run_as, without namespaces of its own (a container's, or none where unshare cannot)."""
    return ["setpriv", f"--reuid={run_as.uid}", f"--regid={run_as.gid}", "--clear-groups", "--no-new-privs", "--",
            *argv]


def tmp_sizes(memory_bytes: int | None) -> tuple[str, str]:
    """tmpfs sizes of /tmp and of /var/tmp and /dev/shm each: together the run's memory budget, so what a
    run keeps in its temp folders is bounded by sim.memory (without one, half the host's RAM as before)."""
    if memory_bytes is None:
        return "50%", "50%"
    return str(max(memory_bytes // 2, 1 << 20)), str(max(memory_bytes // 4, 1 << 20))


def isolate_settings(memory_bytes: int | None, hide: list[str]) -> dict[str, Any]:
    """What harness/run_world.py sets up, cold and warm alike: the runtime bound back, closed folders covered, the
    temp mounts' sizes, and the runs roots whose directories are taken out of the run's mount table."""
    keep, cover = runtime_binds()
    tmp, small_tmp = tmp_sizes(memory_bytes)
    return {"keep": list(keep), "cover": list(cover), "tmp_size": tmp, "small_tmp_size": small_tmp, "hide": hide}


def isolation_env(run_as: RunAs, memory_bytes: int | None = None, hide: list[str] | None = None) -> dict[str, str]:
    """What the cold path's run_world.py reads (and takes out of the environment before the command starts)."""
    settings = {"isolate": isolate_settings(memory_bytes, hide or []), "user": {"uid": run_as.uid, "gid": run_as.gid}}
    return {ISOLATE_ENV: json.dumps(settings)}


@functools.cache
def runtime_binds() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(folders bound back read-only, closed folders covered): where farm's interpreter and code live does not
    change while the agent runs, so it is worked out once, not per run."""
    return (tuple(str(p) for p in runtime_paths_to_keep()),
            tuple(str(p) for p in closed_folders(runtime_candidates())))


def farm_code_folders() -> set[Path]:
    """Where farm's packages are on disk: site-packages/farm/..., or a checkout's role folders."""
    code: set[Path] = set()
    for name in ("farm", "farm.agents", "farm.proto", "farm.models", "farm.controller", "farm.cli"):
        spec = importlib.util.find_spec(name)  # found, not imported: the harness imports more than the agent has
        folders = (spec.submodule_search_locations or []) if spec else []
        code.update(Path(folder).resolve() for folder in folders)
    return code


def closed_folders(paths: set[Path]) -> list[Path]:
    """The first folder above each path that other users cannot pass through (a 0700 /root holding pyenv's
    Python): the run user could reach nothing under it, so the namespaces cover it with an empty tmpfs
    and bind the runtime inside back, read-only."""
    closed = set()
    for path in paths:
        for ancestor in reversed(path.parents[:-1]):  # from the top down, / itself excluded
            try:
                mode = ancestor.stat().st_mode
            except OSError:
                break
            if not mode & stat.S_IXOTH:
                closed.add(ancestor)
                break
    # a private dir is a fresh tmpfs already (a closed folder inside it, /tmp/pytest-of-root, is not there to
    # cover), and one above a private dir would hide it
    return sorted(p for p in closed if "\n" not in str(p)
                  and not any(Path(d).is_relative_to(p) or p.is_relative_to(d) for d in PRIVATE_DIRS))


def runtime_paths_to_keep() -> list[Path]:
    """The folders farm's interpreter and farm's own code live in that a private /tmp (or a covered closed
    folder) would hide: the harness must still start, so they are bound back, read-only."""
    candidates = runtime_candidates()
    covered = [*(Path(d) for d in PRIVATE_DIRS), *closed_folders(candidates)]
    inside = sorted(p for p in candidates if any(p.is_relative_to(d) and p != d for d in covered))
    # the outermost folders only: a venv's own subfolders come with it
    outermost = [p for p in inside if not any(p != q and p.is_relative_to(q) for q in inside) and "\n" not in str(p)]
    return outermost[:MAX_KEPT]


def runtime_candidates() -> set[Path]:
    """Where farm's interpreter, its libraries and farm's own code are."""
    candidates = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix),
                  Path(os.path.realpath(sys.executable)).parent.parent}
    code = farm_code_folders()
    parents = {folder.parent for folder in code}
    # A checkout holds every role folder side by side: its root is one bind, where the role folders
    # one each would pass MAX_KEPT (and the harness then could not import farm.proto).
    candidates.update(parents if len(parents) == 1 else code)
    # libraries a .pth file adds from elsewhere (another venv's site-packages) are imported by the harness too
    candidates.update(Path(entry).resolve() for entry in sys.path
                      if Path(entry).name in ("site-packages", "dist-packages") and Path(entry).is_dir())
    return candidates


def hand_over(run_dir: Path, run_as: RunAs) -> None:
    """Give the run directory and everything in it to the run user; only it (and root) can enter."""
    for current, dirs, files in os.walk(run_dir):
        for name in dirs + files:
            os.lchown(os.path.join(current, name), run_as.uid, run_as.gid)
    os.chown(run_dir, run_as.uid, run_as.gid)
    os.chmod(run_dir, 0o700)


# mount(2) flags (linux/fs.h): Python has no os.mount
MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 0x2, 0x4, 0x20, 0x1000
MNT_DETACH = 0x2


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def seal_run_dir(run_dir: Path) -> bool:
    """Make the run directory a nosuid,nodev mount of itself (root only), so no set-uid binary or device
    node a run writes there works, on the host or in any bind of it (a container's, the namespaces').
    False when it could not be done (not root, or no mount rights): the run still is unprivileged."""
    if os.geteuid() != 0:
        return False
    libc, target = _libc(), os.fsencode(run_dir)
    if libc.mount(target, target, None, MS_BIND, None) != 0:
        return False
    if libc.mount(None, target, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV, None) != 0:
        libc.umount2(target, MNT_DETACH)
        return False
    return True


def unseal_run_dir(run_dir: Path) -> None:
    """Undo seal_run_dir or mount_run_dir (detached: a process still holding a file there cannot keep it busy); a
    directory that was never sealed is left as it is."""
    if _libc().umount2(os.fsencode(run_dir), MNT_DETACH) != 0 and ctypes.get_errno() not in (
            errno.EINVAL, errno.ENOENT, errno.EPERM):
        raise OSError(ctypes.get_errno(), f"could not unmount the run directory {run_dir}")


def mount_run_dir(run_dir: Path) -> bool:
    """A fresh tmpfs over the (empty) run directory, nosuid,nodev (root only), so the run's files can be
    bounded: bound_run_dir sizes it once the model and script are staged. Its pages are charged to the
    memory cgroup of whoever writes them, so what the run writes there counts within sim.memory too.
    False when it could not be done (not root, or no mount rights): the run directory is then unbounded."""
    if os.geteuid() != 0:
        return False
    target = os.fsencode(run_dir)
    # as large as staging needs (a size is a limit, not a reservation; tmpfs's default is half the RAM)
    return _libc().mount(b"farm-run", target, b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0700,size=16t") == 0


def run_dir_used(run_dir: Path) -> int:
    """Bytes in use on the run directory's file system (the tmpfs of mount_run_dir)."""
    info = os.statvfs(run_dir)
    return (info.f_blocks - info.f_bfree) * info.f_frsize


def bound_run_dir(run_dir: Path, disk_bytes: int) -> None:
    """Resize the run directory's tmpfs to what is staged in it plus disk_bytes: what the run may add."""
    size = run_dir_used(run_dir) + disk_bytes
    if _libc().mount(None, os.fsencode(run_dir), None, MS_REMOUNT | MS_NOSUID | MS_NODEV,
                     f"size={size}".encode()) != 0:
        raise OSError(ctypes.get_errno(), f"could not size the run directory's tmpfs to {size} bytes")


def run_dir_full(run_dir: Path) -> bool:
    """The run directory's tmpfs has no room left (less than 1 MiB, or no inode): the run hit sim.disk."""
    info = os.statvfs(run_dir)
    return info.f_bavail * info.f_frsize < (1 << 20) or (info.f_files > 0 and info.f_ffree == 0)


def keep_run_dir(run_dir: Path) -> None:
    """Copy a run directory that is a tmpfs onto the disk beneath it, before it is unmounted (--keep-run-dirs):
    directories, regular files and links as links; fifos, devices and sockets the run made are left out."""
    kept = run_dir.with_name(run_dir.name + ".kept")

    def copy_regular(src: str, dst: str) -> None:
        if stat.S_ISREG(os.lstat(src).st_mode):
            shutil.copyfile(src, dst, follow_symlinks=False)

    shutil.copytree(run_dir, kept, symlinks=True, copy_function=copy_regular)
    for current, dirs, files in os.walk(kept):  # owned as they were (the run user's), not by root who copied them
        for name in [".", *dirs, *files]:
            copy = os.path.join(current, name)
            if os.path.lexists(copy):
                info = os.lstat(os.path.join(run_dir, os.path.relpath(copy, kept)))
                os.lchown(copy, info.st_uid, info.st_gid)
    unseal_run_dir(run_dir)
    os.rmdir(run_dir)
    os.rename(kept, run_dir)


def strip_set_ids(run_dir: Path) -> int:
    """Clear set-uid/set-gid bits a run left in its directory (kept for inspection); how many files had one."""
    stripped = 0
    for current, _dirs, files in os.walk(run_dir):
        for name in files:
            path = os.path.join(current, name)
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and info.st_mode & (stat.S_ISUID | stat.S_ISGID):
                os.chmod(path, stat.S_IMODE(info.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
                stripped += 1
    return stripped
