"""`make bench` (web, slowloris): the dashboard's response time while 200 slow connections trickle headers.

Issue 18 N4: 64 connections sending one header line every 10 s kept every user off the dashboard. Here
the hostile side holds 200 connections, each sending one header line every 2 s and reconnecting as soon
as the server cuts it (the header deadline), from 200 loopback addresses (127.0.1.x: many peers, each
under the per-address cap) or from one (127.0.0.2: the cap closes all but 16). A user on 127.0.0.1
fetches /lab with a bearer token, one request after the other; the time to the last byte is taken.
Side by side: the same fetches with no slow connections, in the same process, just before.

Prints a markdown report and writes it to benchmarks/results/<date>-web-slowloris.{md,json}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from farm.controller.auth import Identity, TokenTable
from farm.controller.scheduling.controller import Controller
from farm.controller.store import SQLiteStore as Store
from farm.web.server import Operator, start_dashboard
from results_file import write_results  # benchmarks/ is on sys.path when a benchmark runs

TOKEN = "bench-client-token-0123456789"


def slow_clients(port: int, sources: list[str], stop: threading.Event, every_s: float) -> list[threading.Thread]:
    """One thread per slow connection: a request head sent a line at a time, reopened when cut."""

    def hold(source: str) -> None:
        n = 0
        s: socket.socket | None = None
        while not stop.is_set():
            try:
                if s is None:
                    s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
                    s.sendall(b"GET /lab HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                n += 1
                s.sendall(f"X-Slow-{n}: still here\r\n".encode())
            except OSError:
                if s is not None:
                    s.close()
                s = None
            stop.wait(every_s)
        if s is not None:
            s.close()

    threads = [threading.Thread(target=hold, args=(source,), daemon=True) for source in sources]
    for t in threads:
        t.start()
    return threads


def fetch_times(url: str, count: int) -> tuple[list[float], int]:
    """Seconds per fetch of /lab, and how many failed (refused or cut)."""
    times, failed = [], 0
    for _ in range(count):
        request = urllib.request.Request(url + "lab", headers={"Authorization": f"Bearer {TOKEN}"})
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                response.read()
            times.append(time.perf_counter() - started)
        except OSError:
            failed += 1
    return times, failed


def p(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--connections", type=int, default=200)
    parser.add_argument("--fetches", type=int, default=200)
    parser.add_argument("--every", type=float, default=2.0, help="seconds between a slow connection's header lines")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "farm.db")
        running = start_dashboard(store, "127.0.0.1:0", Operator.embedded(Controller(store)),
                                  tokens=TokenTable({TOKEN: Identity("client", None, 1)}))
        rows = []
        scenarios = [("none", []),
                     (f"{args.connections} from {args.connections} addresses",
                      [f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(args.connections)]),
                     (f"{args.connections} from one address", ["127.0.0.2"] * args.connections)]
        baseline = None
        for name, sources in scenarios:
            stop = threading.Event()
            threads = slow_clients(running.port, sources, stop, args.every)
            time.sleep(2.0 if sources else 0)  # all connected and trickling before the user's fetches
            fetch_times(running.url, 5)  # warm-up
            times, failed = fetch_times(running.url, args.fetches)
            stop.set()
            for t in threads:
                t.join(timeout=15)
            row = {"slow connections": name, "fetches": args.fetches, "failed": failed,
                   "median ms": round(statistics.median(times) * 1000, 2), "p99 ms": round(p(times, 0.99) * 1000, 2)}
            baseline = baseline or row
            row["p99 / no slow"] = round(row["p99 ms"] / baseline["p99 ms"], 2)
            rows.append(row)
        running.stop()
    header = list(rows[0])
    lines = [f"machine: {platform.node()} ({os.cpu_count()} CPUs, {platform.python_implementation()} "
             f"{platform.python_version()}), {dt.date.today()}; one header line every {args.every:g} s per slow connection",
             "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(r[h]) for h in header) + " |" for r in rows]
    report = "\n".join(lines)
    print(report)
    write_results("web-slowloris", report, rows)


if __name__ == "__main__":
    sys.exit(main())
