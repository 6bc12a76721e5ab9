"""Open pages' server-sent event streams, all served by one thread.

A page's stream used to hold a server thread (and a connection slot) for as long as the tab stayed open. Now
the request's thread sends the headers and hands the socket here: one hub thread re-renders each stream's
live regions every few seconds, writes what changed without blocking (a slow reader keeps its bytes queued,
and is dropped when it stops reading), and notices a closed tab by the connection's end of file. An idle
page costs a socket and a render every check, not a thread.
"""

from __future__ import annotations

import logging
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("farm.web")

MAX_STREAMS = 1024  # open pages at once, across every address
MAX_STREAMS_PER_ADDRESS = 64  # one address (a script opening streams) holds a sixteenth of them
MAX_QUEUED_BYTES = 4 * 1024 * 1024  # a reader this far behind is dropped; its page reconnects and starts fresh
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


@dataclass(eq=False)
class _Stream:
    sock: socket.socket
    address: str
    step: Callable[[], bytes | None]  # what to send at this check (b"" for nothing); None when the stream ends
    check_every_s: float
    send_deadline_s: float
    next_check: float = 0.0
    queued: bytearray = field(default_factory=bytearray)
    behind_since: float | None = None  # when the reader last had bytes waiting that it did not take


class StreamHub:
    """Every open event stream, stepped and written by one thread."""

    def __init__(self, check_every_s: float, send_deadline_s: float) -> None:
        self.check_every_s, self.send_deadline_s = check_every_s, send_deadline_s
        self._streams: dict[socket.socket, _Stream] = {}
        self._reserved: dict[str, int] = {}  # per address: streams open or being opened
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._added: list[_Stream] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dashboard-streams", daemon=True)
        self._thread.start()

    # --- the request threads' side ----------------------------------------------------------
    def reserve(self, address: str) -> bool:
        """Room for one more stream from `address`? Reserved if so (`adopt` or `release` it)."""
        with self._lock:
            total = sum(self._reserved.values())
            if total >= MAX_STREAMS or self._reserved.get(address, 0) >= MAX_STREAMS_PER_ADDRESS:
                return False
            self._reserved[address] = self._reserved.get(address, 0) + 1
            return True

    def release(self, address: str) -> None:
        with self._lock:
            left = self._reserved.get(address, 0) - 1
            if left > 0:
                self._reserved[address] = left
            else:
                self._reserved.pop(address, None)

    def adopt(self, sock: socket.socket, address: str, step: Callable[[], bytes | None]) -> None:
        """Take over a reserved stream whose headers are sent; the hub closes the socket when the stream ends."""
        stream = _Stream(sock, address, step, self.check_every_s, self.send_deadline_s,
                         next_check=time.monotonic() + self.check_every_s)
        with self._lock:
            stopped = self._stopped.is_set()
            if not stopped:
                self._streams[sock] = stream
                self._added.append(stream)
        if stopped:
            self._close_now(stream)
            self.release(address)
            return
        self._wake()

    def owns(self, sock: object) -> bool:
        with self._lock:
            return sock in self._streams

    def count(self) -> int:
        with self._lock:
            return len(self._streams)

    def stop(self) -> None:
        self._stopped.set()
        self._wake()
        self._thread.join(timeout=10)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # already woken (the pair's buffer is full) or closed at stop

    # --- the hub thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._register_added()
                now = time.monotonic()
                with self._lock:
                    streams = list(self._streams.values())
                due = min((s.next_check for s in streams), default=now + 60.0)
                for key, events in self._selector.select(timeout=max(0.0, due - now)):
                    if key.fileobj is self._wake_r:
                        self._drain_wake()
                        continue
                    stream = key.data
                    if events & selectors.EVENT_READ and self._peer_closed(stream):
                        self._end(stream)
                    elif events & selectors.EVENT_WRITE:
                        self._flush(stream)
                now = time.monotonic()
                for stream in streams:
                    if stream.sock in self._streams and stream.next_check <= now:
                        stream.next_check = now + stream.check_every_s
                        self._step(stream)
        finally:
            with self._lock:
                streams = list(self._streams.values())
            for stream in streams:
                self._end(stream)
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _register_added(self) -> None:
        with self._lock:
            added, self._added = self._added, []
        for stream in added:
            try:
                stream.sock.setblocking(False)
                self._selector.register(stream.sock, selectors.EVENT_READ, stream)
            except (OSError, ValueError):  # closed between the hand-over and now
                self._end(stream)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except _WOULD_BLOCK:
            pass

    def _peer_closed(self, stream: _Stream) -> bool:
        """A page's browser sends nothing on its stream: readable means it closed (or sent junk, dropped too)."""
        try:
            stream.sock.recv(1024)  # b"" at the end of file; anything else is not a browser's and ends it too
            return True
        except _WOULD_BLOCK:
            return False  # TLS: a record's bytes without a whole record yet
        except OSError:
            return True

    def _step(self, stream: _Stream) -> None:
        try:
            chunk = stream.step()
        except Exception:  # a bug in one page's rendering ends that stream, never the hub
            log.exception("dashboard: a live page's update failed; its stream ends")
            chunk = None
        if chunk is None:
            self._end(stream)
            return
        if chunk:
            stream.queued += chunk
        self._flush(stream)

    def _flush(self, stream: _Stream) -> None:
        now = time.monotonic()
        while stream.queued:
            try:
                sent = stream.sock.send(stream.queued)
            except _WOULD_BLOCK:
                break
            except OSError:  # the tab was closed
                self._end(stream)
                return
            del stream.queued[:sent]
            stream.behind_since = None
        if stream.queued:
            stream.behind_since = stream.behind_since or now
            if len(stream.queued) > MAX_QUEUED_BYTES or now - stream.behind_since > stream.send_deadline_s:
                self._end(stream)  # a reader that stopped reading
                return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if stream.queued else 0)
        try:
            self._selector.modify(stream.sock, events, stream)
        except (KeyError, ValueError, OSError):
            pass  # not registered yet: _register_added does it

    def _end(self, stream: _Stream) -> None:
        with self._lock:
            if self._streams.pop(stream.sock, None) is None:
                return
        try:
            self._selector.unregister(stream.sock)
        except (KeyError, ValueError, OSError):
            pass
        self._close_now(stream)
        self.release(stream.address)

    @staticmethod
    def _close_now(stream: _Stream) -> None:
        try:
            stream.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        stream.sock.close()
