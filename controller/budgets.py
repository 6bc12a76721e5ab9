"""Per-caller budgets on the gRPC server: one token, or one address, never takes the whole controller.

grpc's own cap (`--max-streams`) counts every call open at once, whoever makes it: a single client
token that opens thousands of streams and stalls them would hold every slot, and agents and other
clients would get "resource exhausted". Here each call is admitted, in its worker thread before the
servicer runs, against budgets of its caller:

- a client token: calls open at once, uploads open at once (which bounds its bytes in flight to
  uploads x the 16 MiB message limit), and a call rate (a token bucket);
- a client address (every client token from one host together): calls open at once and a call rate;
- all clients together: at most half of `--max-streams`, so agents and admins always keep the other half;
- a pinned agent token: calls open at once (one agent needs its stream and a few downloads).

Admins and unpinned agent tokens are bounded by grpc's cap only; without tokens (`--no-auth`, loopback
only) every caller is the operator and no per-caller budget applies.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

from farm.controller.auth import Identity

log = logging.getLogger("farm.controller")

UPLOAD_METHOD = "/farm.v1.FarmService/UploadArtifact"


@dataclass(frozen=True)
class BudgetSettings:
    max_streams: int = 2500  # grpc's cap on calls open at once (--max-streams)
    calls_per_token: int = 64  # one client token's calls open at once (--max-calls-per-token)
    calls_per_address: int = 256  # every client token from one address together
    uploads_per_token: int = 8  # UploadArtifact streams of one client token: bytes in flight <= 8 x 16 MiB
    rate_per_token: float = 200.0  # calls a second, sustained, of one client token ...
    burst_per_token: int = 1000  # ... and how many it may make at once after a quiet spell
    rate_per_address: float = 800.0
    burst_per_address: int = 4000
    calls_per_pinned_agent: int = 64  # one agent: its stream, downloads, a reconnect overlapping the old stream
    upload_idle_s: float = 60.0  # an upload that sends nothing for this long is cut (--upload-idle-timeout)

    @property
    def client_pool(self) -> int:
        """Calls all clients together may hold: the rest is the agents' and admins' reserved share."""
        return max(1, self.max_streams // 2)


@dataclass
class _Bucket:
    rate: float
    burst: float
    level: float
    at: float

    def take(self, now: float) -> bool:
        self.level = min(self.burst, self.level + (now - self.at) * self.rate)
        self.at = now
        if self.level < 1.0:
            return False
        self.level -= 1.0
        return True


@dataclass
class CallBudget:
    settings: BudgetSettings = field(default_factory=BudgetSettings)
    open_calls: dict[str, int] = field(default_factory=dict)  # by key: token:LINE, addr:HOST, uploads:LINE, clients
    buckets: dict[str, _Bucket] = field(default_factory=dict)
    refused: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self, identity: Identity, address: str, method: str) -> tuple[list[str], str | None]:
        """The keys this call is counted under (release them when it ends), or a refusal a person can act on."""
        s = self.settings
        limits: list[tuple[str, int, str]] = []
        if identity.role == "client":
            limits = [(f"token:{identity.line}", s.calls_per_token,
                       f"this token has {s.calls_per_token} calls open, the most one client token may "
                       "(--max-calls-per-token)"),
                      (f"addr:{address}", s.calls_per_address,
                       f"client tokens from {address} have {s.calls_per_address} calls open, the most one address may"),
                      ("clients", s.client_pool,
                       f"clients hold {s.client_pool} calls, their share of this controller's --max-streams "
                       "(the rest is kept for agents and admins)")]
            if method == UPLOAD_METHOD:
                limits.append((f"uploads:{identity.line}", s.uploads_per_token,
                               f"this token has {s.uploads_per_token} uploads open, the most one client token may"))
        elif identity.role == "agent" and identity.agent_name:
            limits = [(f"agent:{identity.line}", s.calls_per_pinned_agent,
                       f"agent {identity.agent_name} has {s.calls_per_pinned_agent} calls open, the most one agent may")]
        with self.lock:
            for key, limit, why in limits:
                if self.open_calls.get(key, 0) >= limit:
                    self.refused += 1
                    return [], f"{method}: {why}. Wait for some to finish, or ask the operator for more."
            if identity.role == "client":
                now = time.monotonic()
                token = self._bucket(f"rate:{identity.line}", s.rate_per_token, s.burst_per_token, now)
                if not token.take(now):  # the token's own excess is never charged to its address
                    self.refused += 1
                    return [], (f"{method}: this token makes calls faster than the {s.rate_per_token:g} a second one "
                                "client token may; slow down and try again")
                if not self._bucket(f"rate:{address}", s.rate_per_address, s.burst_per_address, now).take(now):
                    self.refused += 1
                    return [], (f"{method}: client tokens from {address} make calls faster than the "
                                f"{s.rate_per_address:g} a second one address may; slow down and try again")
            keys = [key for key, _, _ in limits]
            for key in keys:
                self.open_calls[key] = self.open_calls.get(key, 0) + 1
            return keys, None

    def release(self, keys: list[str]) -> None:
        with self.lock:
            for key in keys:
                self.open_calls[key] -= 1
                if not self.open_calls[key]:
                    del self.open_calls[key]

    def _bucket(self, key: str, rate: float, burst: float, now: float) -> _Bucket:
        bucket = self.buckets.get(key)
        if bucket is None:
            if len(self.buckets) > 100_000:  # addresses are many: forget the full (idle) buckets
                self.buckets = {k: b for k, b in self.buckets.items() if b.level + (now - b.at) * b.rate < b.burst}
            bucket = self.buckets[key] = _Bucket(rate, burst, burst, now)
        return bucket

    def wrap(self, handler: grpc.RpcMethodHandler, identity: Identity, method: str) -> grpc.RpcMethodHandler:
        """The same handler, admitted against the budgets when its call starts and released when it ends."""
        behavior = (handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream)

        def admitted(context: grpc.ServicerContext) -> Callable[[], None]:
            keys, refusal = self.admit(identity, peer_address(context), method)
            if refusal is not None:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
            once = threading.Lock()

            def release() -> None:
                if once.acquire(blocking=False):  # the callback and the finally: whichever comes first
                    self.release(keys)

            context.add_callback(release)
            return release

        if handler.response_streaming:
            def streaming(request: Any, context: grpc.ServicerContext) -> Any:
                release = admitted(context)
                try:
                    yield from behavior(request, context)
                finally:
                    release()
            run: Callable[..., Any] = streaming
        else:
            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                release = admitted(context)
                try:
                    return behavior(request, context)
                finally:
                    release()
            run = unary
        kind = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
        return kind[(handler.request_streaming, handler.response_streaming)](
            run, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


class IdleUploads:
    """Uploads that stopped sending: each is cut after `idle_s` without a chunk, so a stalled one frees its slot."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.open: dict[int, tuple[grpc.ServicerContext, float]] = {}
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.cut = 0
        self.thread = threading.Thread(target=self._sweep, name="idle-uploads", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def touch(self, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.open[id(context)] = (context, time.monotonic())

    def done(self, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.open.pop(id(context), None)

    def _sweep(self) -> None:
        while not self.stopped.wait(min(1.0, self.idle_s / 4)):
            now = time.monotonic()
            with self.lock:
                idle = [c for c, last in self.open.values() if now - last > self.idle_s]
                for context in idle:
                    self.open.pop(id(context), None)
            for context in idle:
                self.cut += 1
                log.warning("an upload sent nothing for %g s; cut (--upload-idle-timeout)", self.idle_s)
                context.cancel()


def peer_address(context: grpc.ServicerContext) -> str:
    """`ipv4:10.0.0.7:51234` -> `ipv4:10.0.0.7`: the host, whatever port it called from."""
    return str(context.peer()).rpartition(":")[0]
