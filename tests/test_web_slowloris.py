"""The dashboard stays up for everyone while someone holds connections open or guesses tokens
(issue 18, N4 + N12): the request head has a deadline however slowly it trickles in, one address
holds a bounded share of the connections, and failed log-ins from one address are refused with
429 while a good token from another address still logs in.

Real sockets against a real dashboard; the hostile side binds other loopback addresses
(127.0.0.2 and up) so it is a different peer from the user's 127.0.0.1."""

from __future__ import annotations

import http.client
import socket
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from farm.controller.auth import Identity, TokenTable
from farm.controller.scheduling.controller import Controller
from farm.controller.store import SQLiteStore as Store
from farm.web.server import HEADER_DEADLINE_S, MAX_CONNECTIONS_PER_ADDRESS, Operator, start_dashboard
from farm.web.session import LOGIN_BURST

GOOD = "client-token-0123456789abcdef"


@pytest.fixture
def dashboard(tmp_path: Path):
    store = Store(tmp_path / "farm.db")
    tokens = TokenTable({GOOD: Identity("client", None, 1)})
    running = start_dashboard(store, "127.0.0.1:0", Operator.embedded(Controller(store)), tokens=tokens)
    yield running
    running.stop()


def slow_connection(port: int, source: str) -> socket.socket:
    """A client that has started a request and sends its headers one line at a time."""
    s = socket.create_connection(("127.0.0.1", port), timeout=60, source_address=(source, 0))
    s.sendall(b"GET /lab HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    return s


def trickle(sockets: list[socket.socket], stop: threading.Event, every_s: float = 2.0) -> None:
    """One more header line on each, every few seconds: no single read ever waits long."""
    n = 0
    while not stop.wait(every_s):
        n += 1
        for s in sockets:
            try:
                s.sendall(f"X-Slow-{n}: still here\r\n".encode())
            except OSError:
                pass  # the server closed it: what the deadline is for


def closed_by_server(s: socket.socket) -> bool:
    try:
        return s.recv(1024) == b""  # the server sends nothing before the head is whole; EOF means it gave up
    except OSError:
        return True


def request(port: int, method: str, path: str, *, source: str = "127.0.0.1", body: str | None = None,
            headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=(source, 0))
    connection.request(method, path, body=body, headers=headers or {})
    response = connection.getresponse()
    response.read()
    connection.close()
    return response


def test_slow_connections_do_not_keep_a_user_off_and_are_cut_at_the_header_deadline(dashboard) -> None:
    port = dashboard.port
    # 40 from one address (only MAX_CONNECTIONS_PER_ADDRESS are kept) and 60 from 60 other addresses
    one_address = [slow_connection(port, "127.0.0.2") for _ in range(40)]
    many = [slow_connection(port, f"127.0.1.{i}") for i in range(1, 61)]
    stop = threading.Event()
    feeder = threading.Thread(target=trickle, args=(one_address + many, stop), daemon=True)
    feeder.start()
    try:
        time.sleep(0.5)
        served = request(port, "GET", "/lab")
        assert served.status == 401  # answered (the log-in page), not starved: this user has no session yet
        # the address over its share had the rest of its connections closed at once
        closed_at_once = sum(closed_by_server(s) for s in one_address[MAX_CONNECTIONS_PER_ADDRESS + 4:])
        assert closed_at_once == len(one_address) - MAX_CONNECTIONS_PER_ADDRESS - 4
        # and every slow one is cut once its head is past the deadline, though it never stopped sending
        kept = one_address[:MAX_CONNECTIONS_PER_ADDRESS] + many
        for s in kept:
            s.settimeout(HEADER_DEADLINE_S * 4)
        assert all(closed_by_server(s) for s in kept)
    finally:
        stop.set()
        for s in one_address + many:
            s.close()


def _login(port: int, token: str, source: str) -> http.client.HTTPResponse:
    return request(port, "POST", "/login", source=source, body=urllib.parse.urlencode({"token": token, "next": "/lab"}),
                   headers={"Content-Type": "application/x-www-form-urlencoded", "Origin": f"http://127.0.0.1:{port}"})


def test_repeated_bad_log_ins_are_refused_with_429_while_another_address_logs_in(dashboard) -> None:
    port = dashboard.port
    statuses = [_login(port, f"guess-{i:020d}", "127.0.0.2").status for i in range(LOGIN_BURST + 3)]
    assert statuses[:LOGIN_BURST] == [401] * LOGIN_BURST
    assert statuses[LOGIN_BURST:] == [429] * 3
    blocked = _login(port, GOOD, "127.0.0.2")  # even the right token: a guess must learn nothing once blocked
    assert blocked.status == 429 and int(blocked.getheader("Retry-After")) >= 1
    good = _login(port, GOOD, "127.0.0.1")
    assert good.status == 303 and "farm_session=" in (good.getheader("Set-Cookie") or "")
    # bearer tokens sent to the dashboard's pages are guesses too
    bearer = [request(port, "GET", "/lab", source="127.0.0.3", headers={"Authorization": f"Bearer wrong-{i:020d}"}).status
              for i in range(LOGIN_BURST + 1)]
    assert bearer == [401] * LOGIN_BURST + [429]
    assert request(port, "GET", "/lab", headers={"Authorization": f"Bearer {GOOD}"}).status == 200
