"""`make bench` (web streams): what open dashboard pages cost the server.

Each open page holds one server-sent event stream (`/events`). The dashboard runs in this process over a
seeded 200-device lab (benchmarks/web.py's seed, fewer jobs; --devices and --jobs make it smaller); --pages streams of the lab page are opened
from loopback, then measured:

- threads in the dashboard's process before and with the pages open;
- the process's CPU share while the pages sit idle for --idle-s seconds (each page's regions are
  re-rendered every check, 2 s; nothing changed, so nothing is sent);
- after one device is quarantined, the time until every page has the update.

Side by side in the same run: the same measurements with no page open (the baseline). Prints a markdown
table and writes benchmarks/results/<date>-web-streams.{md,json}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from farm.controller.auth import Identity, TokenTable
from farm.controller.scheduling.controller import Controller
from farm.controller.store import SQLiteStore as Store
from farm.model_generators.generate import write_tiny_onnx
from farm.web.server import Operator, start_dashboard
from results_file import write_results  # benchmarks/ is on sys.path when a benchmark runs
from web import TOKEN, seed


def _open_stream(port: int, etag: str, source: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=60, source_address=(source, 0))
    sock.sendall(f"GET /events?page=%2Flab&have=lab-live:{etag} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            raise RuntimeError(f"the stream closed before its headers: {head[:200]!r}")
        head += chunk
    if b" 200 " not in head.split(b"\r\n")[0]:
        raise RuntimeError(f"the stream was refused: {head[:200]!r}")
    return sock


def _until_update(sock: socket.socket, deadline: float, text: bytes) -> float:
    data = b""
    while text not in data:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        if not chunk:
            raise RuntimeError("a stream closed before its update")
        data += chunk
    return time.monotonic()


def _idle_cpu_share(seconds: float) -> float:
    start_cpu, start = time.process_time(), time.monotonic()
    time.sleep(seconds)
    return (time.process_time() - start_cpu) / (time.monotonic() - start)


def measure(pages: int, idle_s: float, shared: bool, devices: int = 200, jobs: int = 50) -> dict:
    """One dashboard over a lab of `devices` devices and `jobs` jobs, `pages` open lab pages; `shared=False` renders
    each page's regions on its own (as before renders were shared), for the side-by-side column."""
    from farm.web import server
    saved = server.DashboardApp.shared_live_parts
    if not shared:
        server.DashboardApp.shared_live_parts = server.DashboardApp.live_parts  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            store = Store(Path(tmp) / "farm.db")
            model = write_tiny_onnx(Path(tmp) / "tiny.onnx")
            seed(store, model, jobs=jobs, devices=devices, versions=5, completed_jobs=min(10, jobs))
            controller = Controller(store)
            tokens = TokenTable({TOKEN: Identity("admin", None, 1)})
            running = start_dashboard(store, "127.0.0.1:0", Operator.embedded(controller), tokens=tokens)
            try:
                request = urllib.request.Request(f"{running.url}lab", headers={"Authorization": f"Bearer {TOKEN}"})
                with urllib.request.urlopen(request, timeout=60) as response:
                    page = response.read().decode()
                etag = re.search(r'id="lab-live" data-live="[^"]*" data-every="\d+" data-etag="([0-9a-f]{16})"',
                                 page).group(1)
                threads_idle = threading.active_count()
                cpu_none = _idle_cpu_share(idle_s)
                # 50 pages an address (the dashboard takes 64 streams an address): loopback answers all of 127/8
                opened = [_open_stream(running.port, etag, f"127.0.0.{1 + k // 50}") for k in range(pages)]
                deadline = time.monotonic() + 60
                while running.server.streams.count() < pages and time.monotonic() < deadline:
                    time.sleep(0.1)
                time.sleep(1)  # the request threads that handed their streams over end
                threads_open = threading.active_count()
                cpu_open = _idle_cpu_share(idle_s)
                for sock in opened:  # what idle pages were sent (a region showing an age changes by itself)
                    sock.setblocking(False)
                    try:
                        while sock.recv(1 << 20):
                            pass
                    except BlockingIOError:
                        pass
                    sock.setblocking(True)
                changed = time.monotonic()
                controller.quarantine("phone-000", "benchmark change")
                arrived = sorted(_until_update(sock, time.monotonic() + 120, b"benchmark change") - changed
                                 for sock in opened)
                for sock in opened:
                    sock.close()
            finally:
                running.stop()
                store.close()
    finally:
        server.DashboardApp.shared_live_parts = saved  # type: ignore[method-assign]
    return {"threads_idle": threads_idle, "threads_open": threads_open, "cpu_none": cpu_none, "cpu_open": cpu_open,
            "arrived_s": arrived}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=200, help="event streams to open (each an open lab page)")
    parser.add_argument("--idle-s", type=float, default=20.0, help="how long the pages sit idle while CPU is measured")
    parser.add_argument("--devices", type=int, default=200, help="devices in the seeded lab (at least 2)")
    parser.add_argument("--jobs", type=int, default=50, help="jobs in the seeded lab")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    if args.devices < 2 or args.jobs < 1:
        parser.error("--devices needs at least 2 and --jobs at least 1: the seed quarantines phone-000 and "
                     "sweeps phone-001")
    each = measure(args.pages, args.idle_s, shared=False, devices=args.devices, jobs=args.jobs)
    shared = measure(args.pages, args.idle_s, shared=True, devices=args.devices, jobs=args.jobs)

    def cells(m: dict) -> list[str]:
        arrived = m["arrived_s"]
        return [f"{m['threads_idle']} → {m['threads_open']}", f"{100 * m['cpu_none']:.1f} % → {100 * m['cpu_open']:.1f} %",
                f"{arrived[len(arrived) // 2]:.2f} s / {arrived[-1]:.2f} s"]

    labels = ["threads in the process (none open → pages open)", "CPU share while idle (one core = 100 %)",
              "a change reaches every page: median / last"]
    load = os.getloadavg()[0]
    text = "\n".join([
        f"## Open dashboard pages ({dt.date.today()}, {platform.node()}, {os.cpu_count()} cores, load {load:.1f})",
        "",
        f"| {args.pages} open lab pages of one viewer ({args.devices} devices, {args.jobs} jobs), idle "
        f"{args.idle_s:g} s | each page rendered alone | "
        "one render per viewer and check |",
        "|---|---|---|",
        *[f"| {label} | {a} | {b} |" for label, a, b in zip(labels, cells(each), cells(shared))], ""])
    print(text)
    if not args.no_write:
        print(f"written to {write_results('web-streams', text, {'pages': args.pages, 'each': each, 'shared': shared})}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
