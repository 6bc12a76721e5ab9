"""Finding cgroups and reading their counters (CPU time, memory, peak, OOM kills, block I/O), v1 and v2.

The one place cgroup mounts and a process's cgroups are discovered; shared by the cgroup backend
(its own cgroups), the docker backend (a container's) and the test phone's budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CgroupMount:
    mount_point: Path
    root: str  # the hierarchy path mounted there ("/" unless we live in a cgroup namespace)
    controllers: frozenset[str]
    is_v2: bool

    def host_dir(self, cgroup_path: str) -> Path | None:
        """Where cgroup_path (as /proc/<pid>/cgroup names it) lives under this mount."""
        if self.root == "/":
            relative = cgroup_path
        elif cgroup_path == self.root or cgroup_path.startswith(self.root.rstrip("/") + "/"):
            relative = cgroup_path[len(self.root.rstrip("/")) :]
        else:
            return None
        return self.mount_point / relative.lstrip("/")


def cgroup_mounts() -> list[CgroupMount]:
    """cgroup v1 and v2 mounts of this host, from /proc/self/mountinfo."""
    mounts: list[CgroupMount] = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return mounts
    for line in lines:
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        root, mount_point = fields[3], fields[4].replace("\\040", " ")
        if tail[0] == "cgroup2":
            mounts.append(CgroupMount(Path(mount_point), root, frozenset(), is_v2=True))
        else:
            options = set(tail[2].split(","))
            mounts.append(CgroupMount(Path(mount_point), root, frozenset(options), is_v2=False))
    return mounts


def process_cgroups(pid: int | str = "self") -> dict[str, str]:
    """A process's cgroups from /proc/<pid>/cgroup: controller -> path ('' for the v2 hierarchy)."""
    own: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            own[c] = path
    return own


@dataclass(frozen=True)
class CgroupFiles:
    """One cgroup's directories: per controller on v1, a single directory on v2."""

    v1_dirs: dict[str, Path]  # "cpu" | "cpuacct" | "memory" | "blkio" -> directory
    v2_dir: Path | None

    def all_dirs(self) -> list[Path]:
        return list(self.v1_dirs.values()) + ([self.v2_dir] if self.v2_dir else [])

    def exists(self) -> bool:
        return any(d.is_dir() for d in self.all_dirs())

    def cpu_ns(self) -> int | None:
        if "cpuacct" in self.v1_dirs:
            return read_int(self.v1_dirs["cpuacct"] / "cpuacct.usage")
        if self.v2_dir:
            usage_usec = _read_keyed(self.v2_dir / "cpu.stat").get("usage_usec")
            return usage_usec * 1000 if usage_usec is not None else None
        return None

    def throttled_ns(self) -> int | None:
        """Time the CFS quota held the cgroup back (v1 cpu.stat throttled_time, v2 throttled_usec)."""
        if "cpu" in self.v1_dirs:
            return _read_keyed(self.v1_dirs["cpu"] / "cpu.stat").get("throttled_time")
        if self.v2_dir:
            usec = _read_keyed(self.v2_dir / "cpu.stat").get("throttled_usec")
            return usec * 1000 if usec is not None else None
        return None

    def pressure_some_us(self) -> int | None:
        """The cgroup's own CPU pressure ("some" stall total, µs): v2 only."""
        if self.v2_dir is None:
            return None
        try:
            text = (self.v2_dir / "cpu.pressure").read_text()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("some "):
                totals = [f.partition("=")[2] for f in line.split() if f.startswith("total=")]
                return int(totals[0]) if totals and totals[0].isdigit() else None
        return None

    def thread_ids(self) -> list[int]:
        """Every thread in the cgroup (v1 `tasks`, v2 `cgroup.threads`), for per-thread wait times."""
        files = [d / "tasks" for d in self.v1_dirs.values()][:1] or ([self.v2_dir / "cgroup.threads"] if self.v2_dir else [])
        for f in files:
            try:
                return [int(t) for t in f.read_text().split()]
            except (OSError, ValueError):
                return []
        return []

    def memory_bytes(self) -> int | None:
        if "memory" in self.v1_dirs:
            return read_int(self.v1_dirs["memory"] / "memory.usage_in_bytes")
        if self.v2_dir:
            return read_int(self.v2_dir / "memory.current")
        return None

    def peak_memory_bytes(self) -> int | None:
        if "memory" in self.v1_dirs:
            return read_int(self.v1_dirs["memory"] / "memory.max_usage_in_bytes")
        if self.v2_dir:
            return read_int(self.v2_dir / "memory.peak")  # kernel >= 5.19
        return None

    def oom_kills(self) -> int | None:
        # v1 counts only in the limited cgroup itself; v2 also propagates it to parents.
        if "memory" in self.v1_dirs:
            return _read_keyed(self.v1_dirs["memory"] / "memory.oom_control").get("oom_kill")
        if self.v2_dir:
            return _read_keyed(self.v2_dir / "memory.events").get("oom_kill")
        return None

    def block_io(self) -> tuple[int | None, int | None]:
        """(read bytes, written bytes) summed over devices."""
        if "blkio" in self.v1_dirs:
            blkio = self.v1_dirs["blkio"]
            for name in ("blkio.throttle.io_service_bytes_recursive", "blkio.throttle.io_service_bytes"):
                totals = _read_v1_blkio(blkio / name)
                if totals is not None:
                    return totals
            return None, None
        if self.v2_dir:
            return _read_v2_io_stat(self.v2_dir / "io.stat")
        return None, None


def read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _read_keyed(path: Path) -> dict[str, int]:
    """'key value' lines (cpu.stat, memory.events, memory.oom_control)."""
    values: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return values
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            values[parts[0]] = int(parts[1])
    return values


def _read_v1_blkio(path: Path) -> tuple[int, int] | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    read_bytes = write_bytes = 0
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] == "Read":
            read_bytes += int(parts[2])
        elif len(parts) == 3 and parts[1] == "Write":
            write_bytes += int(parts[2])
    return read_bytes, write_bytes


def _read_v2_io_stat(path: Path) -> tuple[int | None, int | None]:
    try:
        text = path.read_text()
    except OSError:
        return None, None
    read_bytes = write_bytes = 0
    for line in text.splitlines():
        for field in line.split()[1:]:
            key, _, value = field.partition("=")
            if key == "rbytes":
                read_bytes += int(value)
            elif key == "wbytes":
                write_bytes += int(value)
    return read_bytes, write_bytes
