"""An Android phone as the adb wire protocol sees it, over TCP on 127.0.0.1 — a test peer, not a product.

It speaks what adbd speaks to a host: 24-byte message headers, CNXN, AUTH (a random TOKEN, the
host's SIGNATURE checked against the phone's authorized keys, RSAPUBLICKEY for a new key),
OPEN/OKAY/WRTE/CLSE streams with one-write-in-flight flow control, `shell:`/`exec:` (legacy, no
shell_v2: the host gets no exit status, as with many real phones) and `sync:` (STAT, LIST, SEND,
RECV, DATA, DONE, OKAY, FAIL, QUIT).

The "device filesystem" is a sandbox directory: device paths under /data, /sdcard, /sys, /system
and /proc/{meminfo,cpuinfo} are mapped into it, commands run with the host's /bin/sh there, and the
sandbox's system/bin (getprop, dumpsys, taskset, benchmark_model stand-ins) comes first on PATH.
`kill()` drops every connection at once, like a cable pulled mid-run.
"""

from __future__ import annotations

import base64
import json
import os
import contextlib
import re
import secrets
import shlex
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, Queue
from typing import Sequence

from farm.agents.sandbox.base import Budget

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa, utils

A_CNXN, A_AUTH, A_OPEN, A_OKAY, A_WRTE, A_CLSE = (
    int.from_bytes(name, "little") for name in (b"CNXN", b"AUTH", b"OPEN", b"OKAY", b"WRTE", b"CLSE"))
AUTH_TOKEN, AUTH_SIGNATURE, AUTH_RSAPUBLICKEY = 1, 2, 3
VERSION_SKIP_CHECKSUM = 0x01000001  # from this version on, peers may send 0 as the data checksum
DEVICE_MAX_PAYLOAD = 256 * 1024
SYNC_DATA_MAX = 64 * 1024
HEADER = struct.Struct("<6I")
TOKEN_SIZE = 20  # adbd's token is the size of a SHA-1 digest: the host signs it as if it were one
_ANDROID_PUBKEY = struct.Struct("<II256s256sI")  # words, n0inv, modulus (LE), R^2 mod N (LE), exponent


def android_public_key(line: str | bytes) -> rsa.RSAPublicKey:
    """Decode one adb_keys line (base64 of Android's RSAPublicKey struct, then " user@host")."""
    if isinstance(line, str):
        line = line.encode()
    blob = base64.b64decode(line.strip(b"\0").split()[0])
    words, _n0inv, modulus, _rr, exponent = _ANDROID_PUBKEY.unpack(blob[:_ANDROID_PUBKEY.size])
    if words != 64:
        raise ValueError("not a 2048-bit adb key")
    return rsa.RSAPublicNumbers(exponent, int.from_bytes(modulus, "little")).public_key()


@dataclass
class EmulatedPhone:
    """What the phone reports: properties, CPU, memory, thermal zones, battery, benchmark timings."""

    properties: dict[str, str] = field(default_factory=lambda: {
        "ro.product.model": "LG-H870",
        "ro.product.name": "lucye_global_com",
        "ro.product.device": "lucye",
        "ro.product.manufacturer": "LGE",
        "ro.build.fingerprint": "lge/lucye_global_com/lucye:9/PKQ1.190414.001/1923211453c8f:user/release-keys",
        "ro.build.version.release": "9",
        "ro.build.version.sdk": "28",
        "ro.product.cpu.abi": "arm64-v8a",
        "ro.product.cpu.abilist": "arm64-v8a,armeabi-v7a,armeabi",
        "ro.soc.model": "MSM8996pro",
        "ro.board.platform": "msm8996",
        "ro.serialno": "LGH870f00dcafe",
    })
    cpu_max_khz: list[int] = field(default_factory=lambda: [1593600, 1593600, 2150400, 2150400])
    governor: str = "schedutil"
    mem_total_kb: int = 3844524
    mem_available_kb: int = 1872340
    thermal_zones: dict[str, int] = field(default_factory=lambda: {"tsens_tz_sensor0": 36000, "battery": 29000,
                                                                   "xo_therm": 33000})
    battery_level: int = 87
    battery_temperature_tenths_c: int = 291
    # benchmark_model stand-in: timings in µs per model file name or sha256 ("*" = any other model)
    benchmark_us: dict[str, dict[str, float]] = field(default_factory=lambda: {"*": {
        "init": 18777, "first": 64791, "warmup_avg": 57758.2, "avg": 55043.2, "std": 1562, "min": 53077,
        "max": 60727, "median": 54811, "p5": 53390, "p95": 57712, "memory_init_mb": 8.97656,
        "memory_overall_mb": 18.7227}})
    # Keyed by model file name or model sha256: the op the runtime lacks / what to print instead of a report.
    unsupported_ops: dict[str, str] = field(default_factory=dict)
    garbage_output: dict[str, str] = field(default_factory=dict)
    benchmark_seconds: float = 0.0  # how long one benchmark_model run takes
    # What --enable_op_profiling=true adds after the summary: real captured tables (an Arm TC2 run of a
    # delegate-partitioned model, tests/fixtures/benchmark_model/g_*), from the initialization section on.
    op_profiling_output: str = field(default_factory=lambda: _captured_op_profiling_tables())
    # What a delegate flag makes the tool print (real captured lines, tests/fixtures/benchmark_model/delegates/):
    # by flag (use_gpu, use_nnapi, use_hexagon, external_delegate_path), or by model file name or sha256 first.
    benchmark_apk: bool = True  # TensorFlow's benchmark app installed (am start; its lines in logcat)
    delegate_output: dict[str, str] = field(default_factory=lambda: {
        "use_gpu": "gpu_complete.txt", "use_nnapi": "nnapi_none.txt", "use_hexagon": "hexagon_partial.txt",
        "external_delegate_path": "qnn_none.txt"})


def _captured_delegate_lines(name: str) -> str:
    path = Path(__file__).parent / "fixtures" / "benchmark_model" / "delegates" / name
    return "\n".join(line for line in path.read_text().splitlines() if not line.startswith("#")) + "\n"


def _captured_op_profiling_tables() -> str:
    text = (Path(__file__).parent / "fixtures" / "benchmark_model" / "g_arm_tc2_op_profiling_abridged.txt").read_text()
    return text[text.index("INFO: Profiling Info for Benchmark Initialization:"):]


class _Stream:
    """One OPENed service: the host's id for it, data the host wrote, and whether our last WRTE was acked."""

    def __init__(self, device_id: int, host_id: int) -> None:
        self.device_id = device_id
        self.host_id = host_id
        self.inbox: Queue[bytes | None] = Queue()
        self.write_acked = threading.Event()
        self.write_acked.set()
        self.closed = threading.Event()
        self.process: subprocess.Popen[bytes] | None = None


class AdbDeviceEmulator:
    """Start with `with AdbDeviceEmulator(tmp_path, authorized_keys=[pub]) as phone:`; `phone.port`."""

    def __init__(self, root: Path, *, phone: EmulatedPhone | None = None, authorized_keys: Sequence[str] = (),
                 accept_new_keys: bool = False, budget: Budget | None = None) -> None:
        self.root = Path(root).resolve()
        # The phone's CPU and memory: every shell command runs in one cgroup with this budget.
        self.budget = budget
        self.cgroup_dirs: dict[str, Path] = {}
        self.phone = phone or EmulatedPhone()
        self.authorized_keys = [android_public_key(k) for k in authorized_keys]
        self.accept_new_keys = accept_new_keys  # True: someone taps "Allow" as soon as a new key shows up
        self.offered_keys: list[str] = []  # RSAPUBLICKEY lines the "user" was asked about
        self.services_opened: list[str] = []
        self.unplug_after_sync_bytes: int | None = None  # kill() once a push has delivered this many bytes
        self.refuse_pushes: str | None = None  # answer every SEND with FAIL and this message ("disk full")
        self._listener: socket.socket | None = None
        self._connections: list[socket.socket] = []
        self._processes: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.port = 0
        self._build_filesystem()

    # ---- lifecycle -------------------------------------------------------------------------------
    @property
    def serial(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> "AdbDeviceEmulator":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def start(self) -> None:
        if self.budget is not None:
            self._make_cgroup()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="adb-emulator-accept", daemon=True).start()

    def kill(self) -> None:
        """Everything goes at once: listener, connections (reset), running commands — a phone unplugged."""
        self._stopping.set()
        if self._listener is not None:
            try:  # wakes the blocked accept(): close() alone leaves it accepting one more connection
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        self.drop_connections()
        self._remove_cgroup()

    def _make_cgroup(self) -> None:
        from farm.agents.sandbox.cgroup import CgroupBackend
        backend = CgroupBackend()  # raises SandboxError with the reason when no cgroup can be made
        name = f"emulated-phone-{os.getpid()}-{id(self)}"
        for controller, root in backend.layout.roots.items():
            d = root / name
            d.mkdir()
            self.cgroup_dirs[controller] = d
        backend._apply(self.cgroup_dirs, self.budget)

    def _remove_cgroup(self) -> None:
        for d in self.cgroup_dirs.values():
            procs = d / "cgroup.procs"
            for pid in (procs.read_text().split() if procs.exists() else []):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
        self.cgroup_dirs = {}

    def shell_argv(self, command: str) -> tuple[list[str], dict[str, str]]:
        """The argv that runs a shell command as the phone would: inside its cgroup when it has a budget."""
        argv = ["/bin/sh", "-c", self._to_sandbox(command or "true")]
        if not self.cgroup_dirs:
            return argv, {}
        from farm.agents.sandbox.cgroup import JOIN_AND_EXEC
        procs = " ".join(str(d / "cgroup.procs") for d in self.cgroup_dirs.values())
        return ["/bin/sh", "-c", JOIN_AND_EXEC, "emulated-phone", *argv], {"FARM_CGROUP_PROCS": procs}

    def drop_connections(self) -> None:
        """Reset every open connection but keep listening, like adbd restarting or a Wi-Fi blip."""
        with self._lock:
            connections, self._connections = self._connections, []
            processes, self._processes = self._processes, []
        for conn in connections:
            try:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        for proc in processes:
            _kill_group(proc)

    # ---- the device's filesystem -------------------------------------------------------------------
    def device_path(self, path: str) -> Path:
        """Where a device path lives in the sandbox; refuses anything that would leave it."""
        local = (self.root / path.lstrip("/")).resolve()
        if local != self.root and self.root not in local.parents:
            raise PermissionError(path)
        return local

    def _build_filesystem(self) -> None:
        p = self.phone
        for d in ("data/local/tmp", "sdcard", "system/bin", "proc"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        props = self.root / "system" / "build.prop"
        props.write_text("".join(f"{k}={v}\n" for k, v in p.properties.items()))
        cpu_dir = self.root / "sys/devices/system/cpu"
        for n, khz in enumerate(p.cpu_max_khz):
            freq = cpu_dir / f"cpu{n}" / "cpufreq"
            freq.mkdir(parents=True, exist_ok=True)
            (freq / "cpuinfo_max_freq").write_text(f"{khz}\n")
            (freq / "scaling_cur_freq").write_text(f"{khz // 2}\n")
            (freq / "scaling_governor").write_text(f"{p.governor}\n")
        (cpu_dir / "possible").write_text(f"0-{len(p.cpu_max_khz) - 1}\n")
        (cpu_dir / "present").write_text(f"0-{len(p.cpu_max_khz) - 1}\n")
        for n, (kind, millic) in enumerate(p.thermal_zones.items()):
            zone = self.root / f"sys/class/thermal/thermal_zone{n}"
            zone.mkdir(parents=True, exist_ok=True)
            (zone / "type").write_text(f"{kind}\n")
            (zone / "temp").write_text(f"{millic}\n")
        (self.root / "proc/meminfo").write_text(
            f"MemTotal:        {p.mem_total_kb} kB\nMemFree:          {p.mem_available_kb // 3} kB\n"
            f"MemAvailable:    {p.mem_available_kb} kB\nBuffers:           52344 kB\nCached:          901232 kB\n")
        (self.root / "proc/cpuinfo").write_text(
            "".join(f"processor\t: {n}\nBogoMIPS\t: 38.40\n\n" for n in range(len(p.cpu_max_khz)))
            + f"Hardware\t: Qualcomm Technologies, Inc {p.properties.get('ro.soc.model', '')}\n")
        bench_config = self.root / "system" / "benchmark_model.json"
        bench_config.write_text(json.dumps({"timings": p.benchmark_us, "unsupported": p.unsupported_ops,
                                            "garbage": p.garbage_output, "seconds": p.benchmark_seconds,
                                            "op_profiling": p.op_profiling_output,
                                            "delegates": {k: _captured_delegate_lines(v) for k, v in p.delegate_output.items()}}))
        bin_dir = self.root / "system" / "bin"
        _script(bin_dir / "getprop", f"""#!/bin/sh
if [ $# -eq 0 ]; then sed 's/^\\([^=]*\\)=\\(.*\\)$/[\\1]: [\\2]/' {shlex.quote(str(props))}; exit 0; fi
grep -m1 "^$1=" {shlex.quote(str(props))} | cut -d= -f2-
exit 0
""")
        _script(bin_dir / "dumpsys", f"""#!/bin/sh
if [ "$1" = battery ]; then
  printf 'Current Battery Service state:\\n  AC powered: false\\n  USB powered: true\\n  Wireless powered: false\\n'
  printf '  status: 2\\n  health: 2\\n  present: true\\n  level: {p.battery_level}\\n  scale: 100\\n'
  printf '  voltage: 4155\\n  temperature: {p.battery_temperature_tenths_c}\\n  technology: Li-ion\\n'
  exit 0
fi
echo "Can't find service: $1"; exit 0
""")
        # The host has fewer cores than a phone: the mask is accepted and ignored, as far as the run goes.
        _script(bin_dir / "taskset", "#!/bin/sh\nshift\nexec \"$@\"\n")
        _script(bin_dir / "benchmark_model", f"#!{sys.executable}\n" + _BENCHMARK_MODEL_STAND_IN.replace(
            "@CONFIG@", repr(str(bench_config))))
        # TensorFlow's benchmark app: `am start` runs the same benchmark inside an "app process" (a session of its
        # own) that logs each line through logcat under tag tflite; `logcat -d` prints that buffer, `-c` clears it
        logcat = self.root / "data" / "logcat.txt"
        _script(bin_dir / "am", f"#!{sys.executable}\n" + _AM_STAND_IN.replace("@LOGCAT@", repr(str(logcat))).replace(
            "@BENCH@", repr(str(bin_dir / "benchmark_model"))).replace("@INSTALLED@", repr(p.benchmark_apk)))
        _script(bin_dir / "logcat", f"#!/bin/sh\nLOG={shlex.quote(str(logcat))}\n"
                                    "case \"$1\" in -c) : > \"$LOG\";; *) cat \"$LOG\" 2>/dev/null;; esac\nexit 0\n")
        installed = "echo package:org.tensorflow.lite.benchmark" if p.benchmark_apk else ":"
        _script(bin_dir / "pm", f"#!/bin/sh\n[ \"$1 $2\" = \"list packages\" ] && {installed}\nexit 0\n")

    def _to_sandbox(self, command: str) -> str:
        root = str(self.root)
        return _DEVICE_PATH.sub(lambda m: root + m.group(0), command)

    def _from_sandbox(self, data: bytes) -> bytes:
        return data.replace(str(self.root).encode(), b"")

    # ---- wire protocol ---------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if self._stopping.is_set():  # unplugged while this connection was being made
                conn.close()
                return
            with self._lock:
                self._connections.append(conn)
            threading.Thread(target=_Connection(self, conn).serve, name="adb-emulator-conn", daemon=True).start()

    def _register(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._processes.append(proc)


class _Connection:
    def __init__(self, device: AdbDeviceEmulator, sock: socket.socket) -> None:
        self.device = device
        self.sock = sock
        self.send_lock = threading.Lock()
        self.version = VERSION_SKIP_CHECKSUM
        self.max_payload = 4096
        self.token = b""
        self.authorized = False
        self.streams: dict[int, _Stream] = {}
        self.next_id = 1

    def send(self, command: int, arg0: int, arg1: int, data: bytes = b"") -> None:
        # Checksums are always filled in: a host that skips checking them does not mind.
        header = HEADER.pack(command, arg0, arg1, len(data), sum(data) & 0xFFFFFFFF, command ^ 0xFFFFFFFF)
        with self.send_lock:
            self.sock.sendall(header + data)

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("host went away")
            buf += chunk
        return bytes(buf)

    def serve(self) -> None:
        try:
            while True:
                command, arg0, arg1, length, checksum, magic = HEADER.unpack(self._recv_exact(HEADER.size))
                if magic != command ^ 0xFFFFFFFF:
                    raise ConnectionError("bad magic")
                data = self._recv_exact(length) if length else b""
                if self.version < VERSION_SKIP_CHECKSUM and checksum != sum(data) & 0xFFFFFFFF:
                    raise ConnectionError("bad checksum")
                self.handle(command, arg0, arg1, data)
        except (OSError, ConnectionError):
            pass
        finally:
            for stream in list(self.streams.values()):
                self._end_stream(stream)
            try:
                self.sock.close()
            except OSError:
                pass

    def _new_token(self) -> None:
        self.token = secrets.token_bytes(TOKEN_SIZE)
        self.send(A_AUTH, AUTH_TOKEN, 0, self.token)

    def _connected(self) -> None:
        self.authorized = True
        props = self.device.phone.properties
        banner = "device::" + "".join(
            f"{k}={props.get(k, '')};" for k in ("ro.product.name", "ro.product.model", "ro.product.device"))
        self.send(A_CNXN, self.version, DEVICE_MAX_PAYLOAD, banner.encode())

    def handle(self, command: int, arg0: int, arg1: int, data: bytes) -> None:
        if command == A_CNXN:
            self.version = min(arg0, VERSION_SKIP_CHECKSUM)
            self.max_payload = min(arg1, DEVICE_MAX_PAYLOAD)
            self.authorized = False
            self._new_token()
        elif command == A_AUTH and arg0 == AUTH_SIGNATURE:
            for key in self.device.authorized_keys:
                try:
                    key.verify(data, self.token, padding.PKCS1v15(), utils.Prehashed(hashes.SHA1()))
                except InvalidSignature:
                    continue
                self._connected()
                return
            self._new_token()  # as adbd does: a fresh challenge for the host's next key
        elif command == A_AUTH and arg0 == AUTH_RSAPUBLICKEY:
            line = data.rstrip(b"\0").decode(errors="replace")
            self.device.offered_keys.append(line)
            if self.device.accept_new_keys:
                self.device.authorized_keys.append(android_public_key(line))
                self._connected()
            # Otherwise stay silent: the phone shows its "Allow USB debugging?" dialog, the host waits.
        elif not self.authorized:
            return  # nothing but the handshake before the user has allowed this host
        elif command == A_OPEN:
            self._open(arg0, data.rstrip(b"\0").decode(errors="replace"))
        elif command == A_OKAY:
            stream = self.streams.get(arg1)
            if stream is not None:
                stream.host_id = arg0
                stream.write_acked.set()
        elif command == A_WRTE:
            stream = self.streams.get(arg1)
            if stream is not None:
                stream.inbox.put(data)
                self.send(A_OKAY, stream.device_id, stream.host_id)
        elif command == A_CLSE:
            stream = self.streams.get(arg1)
            if stream is not None:
                self._end_stream(stream)
                self.send(A_CLSE, stream.device_id, stream.host_id)  # adbd confirms a close it did not start

    def _open(self, host_id: int, service: str) -> None:
        self.device.services_opened.append(service)
        if service.startswith(("shell:", "exec:")):
            handler = self._run_shell
            argument = service.split(":", 1)[1]
        elif service == "sync:":
            handler, argument = self._run_sync, ""
        else:
            self.send(A_CLSE, 0, host_id)  # adbd's answer to a service it does not offer
            return
        stream = _Stream(self.next_id, host_id)
        self.next_id += 1
        self.streams[stream.device_id] = stream
        self.send(A_OKAY, stream.device_id, host_id)
        threading.Thread(target=self._guard, args=(handler, stream, argument), daemon=True).start()

    def _guard(self, handler, stream: _Stream, argument: str) -> None:
        try:
            handler(stream, argument)
        except (OSError, ConnectionError):
            pass
        finally:
            if not stream.closed.is_set():
                stream.closed.set()
                self.streams.pop(stream.device_id, None)
                try:
                    self.send(A_CLSE, stream.device_id, stream.host_id)
                except OSError:
                    pass

    def _end_stream(self, stream: _Stream) -> None:
        stream.closed.set()
        stream.write_acked.set()
        stream.inbox.put(None)
        self.streams.pop(stream.device_id, None)
        if stream.process is not None:
            _kill_group(stream.process)

    def write(self, stream: _Stream, data: bytes) -> None:
        """WRTE in chunks the host accepts, each waiting for the host's OKAY (one write in flight)."""
        for start in range(0, len(data), self.max_payload):
            while not stream.write_acked.wait(0.5):
                if stream.closed.is_set() or self.device._stopping.is_set():
                    raise ConnectionError("stream closed")
            if stream.closed.is_set():
                raise ConnectionError("stream closed")
            stream.write_acked.clear()
            self.send(A_WRTE, stream.device_id, stream.host_id, data[start:start + self.max_payload])

    # ---- services --------------------------------------------------------------------------------
    def _run_shell(self, stream: _Stream, command: str) -> None:
        device = self.device
        env = {"PATH": f"{device.root}/system/bin:/usr/bin:/bin", "HOME": f"{device.root}/data/local/tmp",
               "TMPDIR": f"{device.root}/data/local/tmp", "LANG": "C"}
        argv, extra_env = device.shell_argv(command)
        proc = subprocess.Popen(argv, cwd=device.root,
                                env={**env, **extra_env}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        stream.process = proc
        device._register(proc)
        assert proc.stdout is not None
        while chunk := os.read(proc.stdout.fileno(), 65536):
            self.write(stream, device._from_sandbox(chunk))
        proc.wait()

    def _run_sync(self, stream: _Stream, _: str) -> None:
        buffer = bytearray()

        def read(n: int) -> bytes:
            while len(buffer) < n:
                try:
                    chunk = stream.inbox.get(timeout=0.5)
                except Empty:
                    if self.device._stopping.is_set():
                        raise ConnectionError("stopped") from None
                    continue
                if chunk is None:
                    raise ConnectionError("stream closed")
                buffer.extend(chunk)
            out = bytes(buffer[:n])
            del buffer[:n]
            return out

        def request() -> tuple[bytes, int]:
            head = read(8)
            return head[:4], struct.unpack("<I", head[4:])[0]

        while True:
            ident, length = request()
            if ident == b"QUIT":
                return
            path = read(length).decode(errors="replace")
            if ident == b"STAT":
                self.write(stream, b"STAT" + self._stat(path))
            elif ident == b"LIST":
                self._list(stream, path)
            elif ident == b"RECV":
                self._recv(stream, path)
            elif ident == b"SEND":
                self._send(stream, path, request, read)
            else:
                self._fail(stream, f"unknown sync command {ident!r}")
                return

    def _stat(self, path: str) -> bytes:
        try:
            st = os.lstat(self.device.device_path(path))
        except (OSError, PermissionError):
            return struct.pack("<III", 0, 0, 0)  # v1 STAT says "absent" with all zeros
        return struct.pack("<III", st.st_mode, st.st_size & 0xFFFFFFFF, int(st.st_mtime))

    def _list(self, stream: _Stream, path: str) -> None:
        try:
            directory = self.device.device_path(path)
            entries = sorted(os.listdir(directory)) if directory.is_dir() else []
        except PermissionError:
            entries = []
        out = bytearray()
        for name in entries:
            st = os.lstat(directory / name)
            raw = name.encode()
            out += b"DENT" + struct.pack("<IIII", st.st_mode, st.st_size & 0xFFFFFFFF, int(st.st_mtime), len(raw))
            out += raw
        out += b"DONE" + struct.pack("<IIII", 0, 0, 0, 0)
        self.write(stream, bytes(out))

    def _fail(self, stream: _Stream, message: str) -> None:
        raw = message.encode()
        self.write(stream, b"FAIL" + struct.pack("<I", len(raw)) + raw)

    def _recv(self, stream: _Stream, path: str) -> None:
        try:
            local = self.device.device_path(path)
            data = local.read_bytes()
        except (OSError, PermissionError) as exc:
            self._fail(stream, f"remote object '{path}' does not exist" if isinstance(exc, FileNotFoundError)
                       else f"{path}: {exc.strerror or exc}")
            return
        out = bytearray()
        for start in range(0, len(data), SYNC_DATA_MAX):
            piece = data[start:start + SYNC_DATA_MAX]
            out += b"DATA" + struct.pack("<I", len(piece)) + piece
        out += b"DONE" + struct.pack("<I", 0)
        self.write(stream, bytes(out))

    def _send(self, stream: _Stream, spec: str, request, read) -> None:
        path, _, mode_text = spec.rpartition(",")
        mode = int(mode_text) if mode_text.isdigit() else 0o644
        content = bytearray()
        while True:
            ident, value = request()
            if ident == b"DATA":
                content += read(value)
                limit = self.device.unplug_after_sync_bytes
                if limit is not None and len(content) >= limit:
                    self.device.kill()
                    raise ConnectionError("unplugged mid-push")
            elif ident == b"DONE":
                mtime = value
                break
            else:
                self._fail(stream, f"unexpected {ident!r} during SEND")
                return
        if self.device.refuse_pushes is not None:
            self._fail(stream, self.device.refuse_pushes)
            return
        try:
            local = self.device.device_path(path)
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(bytes(content))
            os.chmod(local, stat.S_IMODE(mode) or 0o644)
            os.utime(local, (mtime, mtime))
        except (OSError, PermissionError) as exc:
            self._fail(stream, f"couldn't create file: {exc}")
            return
        self.write(stream, b"OKAY" + struct.pack("<I", 0))


# Device paths that live in the sandbox; anything else (/bin/sh, /usr/bin/…) is the host's.
_DEVICE_PATH = re.compile(r"(?<![\w./-])/(?:data|sdcard|sys|system|proc/meminfo|proc/cpuinfo)(?=[/\s'\";|&)<>]|$)")


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# `am start -S -n org.tensorflow.lite.benchmark/.BenchmarkModelActivity --es args "FLAGS"` and `am force-stop`: the
# activity's process runs the benchmark with FLAGS and writes its lines to logcat (logcat's own line shape, tag tflite,
# as the app's README and the captured runs in shared/reference/accelerator_tools.md show); `am start` returns at once.
_AM_STAND_IN = r'''
import datetime, os, subprocess, sys
LOG, BENCH, INSTALLED = @LOGCAT@, @BENCH@, @INSTALLED@
APP = "org.tensorflow.lite.benchmark"
argv = sys.argv[1:]
if argv[:1] == ["force-stop"]:
    sys.exit(0)
if argv[:1] != ["start"] or "-n" not in argv:
    print("Error: unknown command"); sys.exit(1)
component = argv[argv.index("-n") + 1]
if not INSTALLED or not component.startswith(APP + "/"):
    print("Starting: Intent { cmp=%s }" % component)
    print("Error type 3")
    print("Error: Activity class {%s} does not exist." % component)
    sys.exit(0)
flags = argv[argv.index("--es") + 2] if "--es" in argv and argv[argv.index("--es") + 1] == "args" else ""
print("Starting: Intent { cmp=%s (has extras) }" % component)
sys.stdout.flush()
if os.fork() == 0:
    os.setsid()
    def log(tag, level, text):
        stamp = datetime.datetime.now().strftime("%m-%d %H:%M:%S.%f")[:-3]
        with open(LOG, "a") as f:
            f.write("%s %5d %5d %s %-8s: %s\n" % (stamp, os.getpid(), os.getpid(), level, tag, text))
    log("tflite_BenchmarkModelActivity", "I", "Running TensorFlow Lite benchmark with args: " + flags)
    run = subprocess.run([BENCH] + flags.split(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    for line in run.stdout.decode(errors="replace").splitlines():
        level = "E" if line.startswith("ERROR") else "I"
        log("tflite", level, line[len("INFO: "):] if line.startswith("INFO: ") else line)
    os._exit(0)
'''


# Prints the newer benchmark_model format (INFO: prefixes, percentiles, memory delta) from a table.
_BENCHMARK_MODEL_STAND_IN = r'''
import json, os, sys, time
config = json.load(open(@CONFIG@))
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
graph = args.get("graph", "")
name = os.path.basename(graph)
print("INFO: STARTING!")
print(f"INFO: Num threads: [{args.get('num_threads', '-1')}]")
print(f"INFO: Graph: [{graph}]")
if not graph or not os.path.exists(graph):
    print(f"ERROR: Could not open '{graph}'.")
    print(f"ERROR: Failed to mmap model {graph}")
    sys.exit(1)
import hashlib
digest = hashlib.sha256(open(graph, "rb").read()).hexdigest()
# Tables are keyed by the model's file name or by its sha256 (the driver pushes content-addressed names).
def lookup(table):
    return next((table[k] for k in (name, digest) if k in table), None)
if lookup(config["garbage"]) is not None:
    print(lookup(config["garbage"]))
    sys.exit(0)
if lookup(config["unsupported"]) is not None:
    op = lookup(config["unsupported"])
    print(f"INFO: Loaded model {graph}")
    print(f"ERROR: Encountered unresolved custom op: {op}.")
    print("ERROR: Node number 0 (" + op + ") failed to prepare.")
    print("ERROR: Failed to allocate tensors!")
    print("ERROR: Benchmarking failed.")
    sys.exit(1)
t = lookup(config["timings"]) or config["timings"]["*"]
time.sleep(config["seconds"])
runs = int(args.get("num_runs", "50"))
warmups = int(args.get("warmup_runs", "1"))
print(f"INFO: Loaded model {graph}")
flag = next((f for f in ("use_gpu", "use_nnapi", "use_hexagon") if args.get(f) in ("true", "1")),
            "external_delegate_path" if args.get("external_delegate_path") else None)
if flag:  # the delegate's own lines, as a real run printed them
    text = lookup(config["delegates"]) or config["delegates"][flag]
    print(text, end="")
    if "Benchmarking failed." in text:
        sys.exit(1)
print(f"INFO: The input model file size (MB): {os.path.getsize(graph) / 1e6:g}")
print(f"INFO: Initialized session in {t['init'] / 1000:g}ms.")
print("INFO: Running benchmark for at least %d iterations and at least 0.5 seconds but terminate if exceeding 150 seconds." % warmups)
print(f"INFO: count={warmups} first={t['first']:g} curr={t['warmup_avg']:g} min={t['warmup_avg']:g} max={t['first']:g} avg={t['warmup_avg']:g} std=0")
print()
print("INFO: Running benchmark for at least %d iterations and at least 1 seconds but terminate if exceeding 150 seconds." % runs)
print(f"INFO: count={runs} first={t['avg']:g} curr={t['avg']:g} min={t['min']:g} max={t['max']:g} avg={t['avg']:g} std={t['std']:g} p5={t['p5']:g} median={t['median']:g} p95={t['p95']:g}")
print()
print(f"INFO: Inference timings in us: Init: {t['init']:g}, First inference: {t['first']:g}, Warmup (avg): {t['warmup_avg']:g}, Inference (avg): {t['avg']:g}")
print("INFO: Note: as the benchmark tool itself affects memory footprint, the following is only APPROXIMATE to the actual memory footprint of the model at runtime. Take the information at your discretion.")
print(f"INFO: Memory footprint delta from the start of the tool (MB): init={t['memory_init_mb']:g} overall={t['memory_overall_mb']:g}")
if args.get("enable_op_profiling") in ("true", "1"):
    print(config["op_profiling"], end="")
if args.get("output_filepath"):
    # --input_layer_value_files and --output_filepath as TensorFlow's benchmark_tflite_model.cc has them: each named
    # input's values from a raw file of exactly the tensor's bytes, every output tensor's bytes written in output
    # order when the benchmark ends. The phone's CPU is LiteRT's interpreter, run on the model that was pushed.
    import numpy as np
    from ai_edge_litert.interpreter import Interpreter
    interp = Interpreter(model_path=graph, num_threads=max(1, int(args.get("num_threads", "1"))))
    names = [n for n in args.get("input_layer", "").split(",") if n]
    shapes = [[int(d) for d in part.split(",")] for part in args.get("input_layer_shape", "").split(":") if part]
    files = {}
    for item in (i for i in args.get("input_layer_value_files", "").split(",") if i):
        name, path = item.replace("::", "\0").split(":", 1)
        files[name.replace("\0", ":")] = path.replace("\0", ":")
    details = interp.get_input_details()
    for d, shape in zip(details, shapes):
        interp.resize_tensor_input(d["index"], shape)
    interp.allocate_tensors()
    for d in interp.get_input_details():
        path = files.get(d["name"])
        want = int(np.prod(d["shape"])) * np.dtype(d["dtype"]).itemsize
        if path is None:
            interp.set_tensor(d["index"], np.zeros(d["shape"], d["dtype"]))
            continue
        data = open(path, "rb").read()
        if len(data) != want:
            print(f"ERROR: The size of {path} is {len(data)} bytes. It should be {want} bytes.")
            sys.exit(1)
        interp.set_tensor(d["index"], np.frombuffer(data, dtype=d["dtype"]).reshape(d["shape"]))
    interp.invoke()
    with open(args["output_filepath"], "wb") as out:
        for d in interp.get_output_details():
            out.write(interp.get_tensor(d["index"]).tobytes())
'''
