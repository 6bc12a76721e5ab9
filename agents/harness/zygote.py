"""The warm harness: `python -m farm.agents.harness.zygote onnx|tflite FD` imports the runtime once, then forks
one child per run on the agent's request (agents/sandbox/warm.py is the agent's end).

Each child is set up as the cold path sets up a fresh process, in the same order, before any of the run's own
code: a session of its own, its output on the run's log, the run's cgroups joined (the cgroup backend) or its
cores, priority and rlimits set (the process backend), then — as root with namespaces — fresh mount and PID
namespaces (it is PID 1 of its own), tmpfs over /tmp, /var/tmp and /dev/shm, closed folders covered and farm's
runtime bound back read-only, every other run's directory detached, the run directory bound at /tmp/run, and the
run's own uid and gid with no supplementary groups and no new privileges (harness/run_world.py, the cold path's
code too). Only then does it run the harness's main(), which writes its result to the descriptor the agent handed
down with the request (RESULT_FD), never to a path. The zygote reaps each child with wait4 and reports its exit
status, rusage and exit time.

What the zygote's imports opened is not the run's: the child closes every descriptor but its output and result,
and replaces each shared mapping of a file with private memory holding the same bytes (onnxruntime maps its
telemetry store, a writable SQLite -shm under the zygote's home, shared as it is imported; the zygote's home is
an empty folder of its own, warm.py).

The zygote holds nothing of the agent: it is a fresh interpreter (started with an allow-listed environment and
no descriptor but its socket) that imported the harness and one runtime, and it never creates a session, so a
child's memory is what a cold harness has after its imports. It exits when the agent's end of the socket
closes (the agent stopped, even by kill -9), killing any child still running.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import resource
import select
import signal
import socket
import sys
import time
import traceback
from typing import Any

from farm.agents.harness.__main__ import main as harness_main
from farm.agents.harness.run_world import RESULT_FD, SETUP_FAILED_EXIT, become, enter_mount_namespace

CLONE_NEWPID = 0x20000000
PR_SET_PDEATHSIG = 1
JOIN_FAILED_EXIT = 97  # the cgroup backend's: the run could not join its cgroup
MAX_MESSAGE_BYTES = 1 << 20
HIGHEST_PRIORITY = -20  # as the process backend's runs claim it (where allowed)
MAX_FD = 1 << 16

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def preload(runtime: str) -> None:
    """Import what a run of this runtime imports, so no child pays for it (the cold harness imports the same)."""
    import numpy  # noqa: F401
    import numpy.random  # noqa: F401  numpy loads it on first use: inputs are drawn from it

    import farm.agents.harness.inputs  # noqa: F401
    import farm.agents.harness.tflite_runner  # noqa: F401
    if runtime == "onnx":
        import onnxruntime  # noqa: F401

        import farm.agents.harness.onnx_runner  # noqa: F401
    elif runtime == "tflite":
        import ai_edge_litert.interpreter  # noqa: F401
    else:
        raise SystemExit(f"unknown runtime {runtime!r}: onnx or tflite")


MADV_POPULATE_READ = 22  # Linux 5.14: map pages already in memory, as if read
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_file_pages() -> list[tuple[int, int]]:
    """(address, length) runs of file pages (the interpreter's and the runtime's code and data) the zygote has
    mapped. A forked child shares them but has not mapped them yet: it maps them before the harness starts, so
    its RSS, its baseline and its high-water mark hold what a cold harness's hold after the same imports."""
    import numpy as np

    runs: list[tuple[int, int]] = []
    try:
        with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pagemap:
            for line in maps:
                fields = line.split()
                if fields[1][0] != "r" or (len(fields) > 5 and fields[5].startswith("[")):
                    continue
                low, high = (int(x, 16) for x in fields[0].split("-"))
                pagemap.seek(low // PAGE * 8)
                entries = np.frombuffer(pagemap.read((high - low) // PAGE * 8), dtype=np.uint64)
                # bit 63: present; bit 61: a file page (or shared anonymous)
                pages = np.flatnonzero(((entries >> np.uint64(63)) & np.uint64(1)).astype(bool)
                                       & ((entries >> np.uint64(61)) & np.uint64(1)).astype(bool))
                if pages.size == 0:
                    continue
                breaks = np.flatnonzero(np.diff(pages) != 1)
                starts = np.concatenate(([pages[0]], pages[breaks + 1]))
                ends = np.concatenate((pages[breaks], [pages[-1]]))
                runs += [(low + int(a) * PAGE, int(b - a + 1) * PAGE) for a, b in zip(starts, ends)]
    except (OSError, ValueError):
        return []  # no pagemap here: the child maps its pages as it touches them
    return runs


def map_like_the_zygote(runs: list[tuple[int, int]]) -> None:
    madvise = _libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for address, length in runs:
        if madvise(address, length, MADV_POPULATE_READ) != 0 and ctypes.get_errno() == 22:
            return  # EINVAL: a kernel before 5.14 has no populate; the child maps them as it touches them


def run_queue_wait_ns(pid: int) -> int | None:
    """The time a thread waited for a CPU (/proc/PID/schedstat, second field): read from the exited run's main
    thread before it is reaped, the part of its wait the agent's sampler (reading every interval) has not seen."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
PROT_READ, PROT_WRITE, PROT_EXEC = 0x1, 0x2, 0x4


def shared_file_mappings() -> list[tuple[int, int, str, str]]:
    """(address, length, permissions, file) of every shared mapping of a file this process has."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            path = fields[5].strip() if len(fields) == 6 else ""
            if fields[1][3] == "s" and path and not path.startswith("["):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                found.append((low, high - low, fields[1], path))
    return found


def unshare_file_mappings() -> list[str]:
    """Replace each shared mapping of a file the zygote's imports made with private memory holding the same bytes;
    the files replaced. onnxruntime maps its telemetry store (a root-owned, writable SQLite -shm under the zygote's
    home) shared as it is imported: a forked run would write into the host's file, and read what other runs wrote."""
    mmap, mprotect = _libc.mmap, _libc.mprotect
    mmap.restype, mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                                    ctypes.c_int, ctypes.c_long]
    mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    replaced = []
    for address, length, perms, path in shared_file_mappings():
        data = ctypes.string_at(address, length) if perms[0] == "r" else None
        prot = (PROT_READ if perms[0] == "r" else 0) | (PROT_WRITE if perms[1] == "w" else 0) | (
            PROT_EXEC if perms[2] == "x" else 0)
        if mmap(address, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != address:
            raise OSError(ctypes.get_errno(), f"cannot replace the shared mapping of {path}")
        if data is not None:
            ctypes.memmove(address, data, length)
        _check(mprotect(address, length, prot), f"protect the private copy of {path}")
        replaced.append(path)
    return replaced


def child(request: dict[str, Any], output_fd: int, result_fd: int, control: socket.socket,
          file_pages: list[tuple[int, int]]) -> int:
    """The run's process, from the fork to the harness's exit code."""
    signal.set_wakeup_fd(-1)  # the zygote's, not the run's
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    control.detach()  # closed below with every other descriptor but the run's output
    os.setsid()
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the zygote's death kills it
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    if result_fd != RESULT_FD:
        os.dup2(result_fd, RESULT_FD, inheritable=False)
    # nothing of the zygote's (its socket, its namespace handle, the runtime's files) reaches the run
    os.closerange(RESULT_FD + 1, MAX_FD)
    unshare_file_mappings()
    for path in request.get("procs") or []:  # JOIN_AND_EXEC: nothing of the run runs outside its cgroups
        try:
            with open(path, "w") as f:
                f.write("0")  # the writer itself (its pid may be 1 of its own namespace)
        except OSError as e:
            print(f"farm-sandbox: cannot join {path}: {e.strerror}", flush=True)
            return JOIN_FAILED_EXIT
    limits = request.get("limits") or {}
    if limits.get("cores") is not None:  # the process backend's limit_child()
        os.sched_setaffinity(0, limits["cores"])
        try:
            os.setpriority(os.PRIO_PROCESS, 0, HIGHEST_PRIORITY)  # process.claim_cpu_weight
        except PermissionError:
            pass
        if limits.get("address_space") is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limits["address_space"], limits["address_space"]))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"], limits["nproc"]))
    os.chdir(request["cwd"])
    try:
        if request.get("isolate"):
            enter_mount_namespace(request["isolate"])
        if request.get("user"):
            become(request["user"])
    except OSError as e:
        print(f"farm-isolate: {e}", flush=True)
        return SETUP_FAILED_EXIT
    os.environ.clear()
    os.environ.update(request["env"])
    map_like_the_zygote(file_pages)
    try:  # the child's own high-water mark from here (the kernel starts it at the RSS it forked with)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return harness_main(request["argv"])


class ForkServer:
    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.children: set[int] = set()
        self.wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY)
        self.file_pages = resident_file_pages()

    def send(self, message: dict[str, Any]) -> None:
        self.control.sendall(json.dumps(message).encode() + b"\n")

    def spawn(self, request: dict[str, Any], output_fd: int, result_fd: int) -> None:
        new_pid_ns = bool(request.get("isolate"))
        try:
            if new_pid_ns:  # the child is PID 1 of a namespace of its own, as under `unshare --pid --fork`
                _check(_libc.unshare(CLONE_NEWPID), "unshare the PID namespace")
            started_at = time.monotonic()
            pid = os.fork()
        except OSError as e:
            os.close(output_fd)
            os.close(result_fd)
            self.send({"error": str(e)})
            return
        if pid == 0:
            code = 1
            try:
                code = child(request, output_fd, result_fd, self.control, self.file_pages)
            except BaseException:  # noqa: BLE001 -- a child never returns into the zygote's loop
                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        if new_pid_ns:  # the next child is forked where the zygote itself lives again
            _check(_libc.setns(self.own_pid_ns, CLONE_NEWPID), "return to the zygote's PID namespace")
        os.close(output_fd)
        os.close(result_fd)
        self.children.add(pid)
        self.send({"pid": pid, "started_at": started_at})

    def reap(self) -> None:
        while self.children:
            try:  # seen, not reaped yet: the exited run's main thread still has its scheduler statistics
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None:
                return
            ended_at = time.monotonic()
            pid = info.si_pid
            wait_ns = run_queue_wait_ns(pid)
            _, status, rusage = os.wait4(pid, 0)
            self.children.discard(pid)
            self.send({"exit": pid, "status": os.waitstatus_to_exitcode(status), "max_rss_bytes": rusage.ru_maxrss * 1024,
                       "cpu_ns": int((rusage.ru_utime + rusage.ru_stime) * 1e9), "ended_at": ended_at,
                       "wait_ns": wait_ns})

    def serve(self) -> None:
        wake_read, wake_write = self.wake
        signal.set_wakeup_fd(wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the pipe
        self.send({"ready": os.getpid()})
        while True:
            readable, _, _ = select.select([self.control.fileno(), wake_read], [], [])
            if wake_read in readable:
                while True:
                    try:
                        if not os.read(wake_read, 512):
                            break
                    except BlockingIOError:
                        break
                self.reap()
            if self.control.fileno() in readable:
                data, fds, _, _ = socket.recv_fds(self.control, MAX_MESSAGE_BYTES, 4)
                if not data:  # the agent is gone: so are its runs
                    for pid in self.children:
                        try:
                            os.killpg(pid, signal.SIGKILL)
                        except OSError:
                            pass
                    return
                if len(fds) != 2:  # one packet is one request with the run's output file and its result's
                    for fd in fds:
                        os.close(fd)
                    self.send({"error": "a run request came without its output file and result descriptor"})
                    continue
                self.spawn(json.loads(data), fds[0], fds[1])


def run(argv: list[str]) -> int:
    runtime, fd = argv[0], int(argv[1])
    preload(runtime)
    gc.freeze()  # the collector never writes to what the zygote holds, so children copy fewer of its pages
    ForkServer(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=fd)).serve()
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
