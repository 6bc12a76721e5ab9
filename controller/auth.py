"""Who may call what: bearer tokens with roles, checked by a server interceptor; TLS credentials.

The tokens file has one token a line: `ROLE TOKEN [AGENT_NAME] [team=TEAM]`, `#` for comments. Roles:
`agent` (the agent stream and artifact downloads), `client` (jobs, results, listings) and
`admin` (both, plus the operator's calls such as freeing a device name). `client+script` is a
client that may also submit script workloads (which run its own code on the agents) on a
controller started with --scripts-need-permission. An agent token with a name may only connect
as that agent, so one rack host cannot take over another's session. A client's jobs belong to its
token and, with `team=TEAM`, to its team (controller/service.py: who may read and cancel them).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import inspect
import ipaddress
import logging
import queue
import stat
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Generator, Iterator, TypeVar

import grpc
from cryptography import x509

from farm.controller.async_calls import abort_handler, same_kind
from farm.proto.names import valid_agent_name as valid_agent_name  # re-exported: the CLI checks names with it
from farm.proto.questions import QUESTIONS
from farm.proto.tls import CredentialFileError, TlsFiles

T = TypeVar("T")

log = logging.getLogger("farm.controller")

ROLES = ("agent", "client", "admin")
# Extra permissions a role may carry in the tokens file, written `client+script`.
PERMISSIONS = ("script",)
METADATA_KEY = "authorization"
BEARER = "Bearer "
# A health check stays open (load balancers call it without a token); its Watch stream does not, since
# open streams are what a caller without a token could exhaust the server with.
OPEN_METHODS = ("/grpc.health.v1.Health/Check",)
# The first prefix that matches decides: a method before its service.
# The admin-only questions come from the question table (farm.proto.questions: each line's `role`);
# StartRefresh is not a table question (it submits the controller's own suite) and is named here.
SERVICE_ROLES = {
    **{f"/farm.v1.FarmService/{q.rpc}": {"admin"} for q in QUESTIONS if q.role == "admin"},
    # it changes what the lab's devices do (the reference suite on every device)
    "/farm.v1.FarmService/StartRefresh": {"admin"},
    "/farm.v1.AgentService/": {"agent", "admin"},
    "/farm.v1.FarmService/": {"client", "admin"},
    "/grpc.reflection.": {"agent", "client", "admin"},  # served only with --reflection
    "/grpc.health.v1.": {"agent", "client", "admin"},
}
ROLE_USE = {"agent": "`farm agent --token`", "client": "`farm --controller ... --token` (or FARM_TOKEN)",
            "admin": "`--token` (an `admin` line of the controller's tokens file)"}


TokenFileError = CredentialFileError  # a tokens file and a TLS file fail alike: the message names the file


@dataclass(frozen=True)
class Identity:
    role: str
    agent_name: str | None = None  # pinned agent name, when the tokens file gives one
    line: int = 0  # its line in the tokens file: tells two tokens of one role apart (limits, logs)
    permissions: frozenset[str] = frozenset()  # e.g. {"script"}: may submit script workloads
    owner: str | None = None  # a stable id of the token (a hash prefix, never the token): whose jobs are whose
    team: str | None = None  # `team=NAME` in the tokens file: jobs shared with the team's other tokens

    @property
    def may_run_scripts(self) -> bool:
        """Script workloads run the submitter's code on the agents: admins, and tokens given `script`."""
        return self.role == "admin" or "script" in self.permissions


def parse_role(word: str) -> tuple[str, frozenset[str]] | None:
    """`client` or `client+script` -> (role, permissions); None when it is neither."""
    role, *extra = word.split("+")
    if role not in ROLES or any(p not in PERMISSIONS for p in extra):
        return None
    return role, frozenset(extra)


class TokenTable:
    def __init__(self, tokens: dict[str, Identity]) -> None:
        # Digests of equal length, so the comparison takes the same time whatever was sent.
        self._tokens = {_digest(token): replace(identity, owner=identity.owner or _digest(token).hex()[:16])
                        for token, identity in tokens.items()}

    @classmethod
    def from_file(cls, path: Path) -> "TokenTable":
        tokens: dict[str, Identity] = {}
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise TokenFileError(f"cannot read the tokens file {path}: {e}") from None
        for number, line in enumerate(lines, 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            role = parse_role(words[0])
            teams = [w[len("team="):] for w in words[2:] if w.startswith("team=")]
            rest = [w for w in words[2:] if not w.startswith("team=")]
            if len(words) < 2 or len(rest) > 1 or len(teams) > 1 or role is None:
                raise TokenFileError(f"{path}:{number}: expected `ROLE TOKEN [AGENT_NAME] [team=TEAM]` with ROLE one of "
                                     f"{', '.join(ROLES)}, optionally with +{' +'.join(PERMISSIONS)} (e.g. client+script)")
            if len(words[1]) < 16:
                raise TokenFileError(f"{path}:{number}: a token must have at least 16 characters (e.g. `openssl rand -hex 24`)")
            if teams and not valid_agent_name(teams[0]):
                raise TokenFileError(f"{path}:{number}: team {teams[0][:40]!r}: use letters, digits, '.', '_' and '-' "
                                     "(at most 64)")
            tokens[words[1]] = Identity(role[0], rest[0] if rest else None, number, role[1],
                                        owner=_digest(words[1]).hex()[:16], team=teams[0] if teams else None)
        if not tokens:
            raise TokenFileError(f"{path}: no tokens; add lines like `client <token>` and `agent <token> <agent-name>`")
        return cls(tokens)

    def pinned_names(self) -> frozenset[str]:
        """Agent names some token is pinned to: no other agent token may connect under them."""
        return frozenset(i.agent_name for i in self._tokens.values() if i.role == "agent" and i.agent_name)

    def by_line(self, line: int) -> Identity | None:
        """The identity on this line of the tokens file (a dashboard session remembers the line, never the token)."""
        return next((i for i in self._tokens.values() if i.line == line), None)

    def lookup(self, token: str) -> Identity | None:
        sent, found = _digest(token), None
        for known, identity in self._tokens.items():
            if hmac.compare_digest(known, sent):  # constant time: no timing oracle
                found = identity
        return found


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def authorization(metadata: Any) -> str | None:
    """The authorization header as sent (`Bearer <token>` when well formed)."""
    for key, value in metadata or ():
        if key == METADATA_KEY and isinstance(value, str):
            return value
    return None


def bearer_token(header: str | None) -> str | None:
    """The token of a `Bearer <token>` header; None for anything else (a bare token is not accepted)."""
    if not header or not header.startswith(BEARER):
        return None
    return header[len(BEARER):].strip() or None


def identity_of(context: grpc.ServicerContext, tokens: TokenTable | None) -> Identity:
    """The caller's identity inside a handler (the interceptor has already let it in)."""
    if tokens is None:
        return Identity("admin")
    return tokens.lookup(bearer_token(authorization(context.invocation_metadata())) or "") or Identity("none")


def check_access(method: str, header: str | None, tokens: TokenTable) -> tuple[grpc.StatusCode, str] | None:
    """None when the call may proceed, else the status and a message a person can act on.

    The message never repeats any part of what was sent: a log or a screen it lands on must not leak it."""
    if method in OPEN_METHODS:
        return None
    needed = next((roles for prefix, roles in SERVICE_ROLES.items() if method.startswith(prefix)), {"admin"})
    if not header:
        return (grpc.StatusCode.UNAUTHENTICATED,
                f"{method}: no token was sent. Pass --token (or set FARM_TOKEN) with a token from the "
                "controller's tokens file.")
    token = bearer_token(header)
    if token is None:
        return (grpc.StatusCode.UNAUTHENTICATED,
                f"{method}: the authorization metadata must read `Bearer <token>`; farm's own clients send it so "
                "when given --token.")
    identity = tokens.lookup(token)
    if identity is None:
        return (grpc.StatusCode.UNAUTHENTICATED,
                f"{method}: this controller does not know the token that was sent. "
                "Check for a typo or an old token; the controller's operator lists valid ones in its tokens file.")
    if identity.role not in needed:
        wanted = sorted(needed - {"admin"} or {"admin"})[0]
        return (grpc.StatusCode.PERMISSION_DENIED,
                f"{method}: this is {_article(identity.role)} {identity.role} token, and this call needs {_article(wanted)} "
                f"{wanted} token. "
                f"Use {_article(wanted)} {wanted} token with {ROLE_USE[wanted]}.")
    return None


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


class TokenGuard:
    """Refuses a call its token may not make; `budget` (CallBudget, below) then counts what it may.

    Called with each call's handler (a coroutine of the server's loop, controller/async_calls.py)."""

    def __init__(self, tokens: TokenTable, budget: "CallBudget | None" = None) -> None:
        self.tokens = tokens
        self.budget = budget

    def __call__(self, handler: grpc.RpcMethodHandler, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        header = authorization(handler_call_details.invocation_metadata)
        refusal = check_access(handler_call_details.method, header, self.tokens)
        if refusal is not None:
            return abort_handler(handler, *refusal)
        if self.budget is None or handler_call_details.method in OPEN_METHODS:
            return handler
        identity = self.tokens.lookup(bearer_token(header) or "")
        return self.budget.wrap(handler, identity, handler_call_details.method) if identity else handler


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    if not (tls.cert and tls.key):
        raise TokenFileError("TLS needs both --tls-cert and --tls-key")
    client_ca = tls.read("ca")
    # With a client CA, agents and clients must present a certificate it signed (mutual TLS).
    return grpc.ssl_server_credentials([(tls.read("key"), tls.read("cert"))], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def is_loopback(listen: str) -> bool:
    """Whether HOST:PORT (or [V6]:PORT) names this machine only; parsed, never matched as a prefix."""
    host = listen.rpartition(":")[0] if ":" in listen else listen
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def check_tokens_file(path: Path) -> None:
    """Warn when others on the host can read the tokens (they would be any role they like)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return  # reading it fails next, with the reason
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(f"the tokens file {path} can be read by its group or by others (mode {stat.S_IMODE(mode):04o}); "
             f"anyone who reads it holds every role. Run `chmod 600 {path}`.")


def check_server_certificate(tls: TlsFiles, now: dt.datetime | None = None) -> None:
    """Refuse a server certificate that has expired or is not valid yet: clients would fail later, obscurely."""
    data = tls.read("cert")
    if data is None:
        return
    try:
        certificate = x509.load_pem_x509_certificate(data)
    except ValueError as e:
        raise TokenFileError(f"the TLS certificate {tls.cert} is not a PEM certificate: {e}") from None
    now = now or dt.datetime.now(dt.timezone.utc)
    if certificate.not_valid_after_utc < now:
        raise TokenFileError(f"the TLS certificate {tls.cert} expired on {certificate.not_valid_after_utc:%Y-%m-%d %H:%M} "
                             "UTC; issue a new one and pass it with --tls-cert")
    if certificate.not_valid_before_utc > now:
        raise TokenFileError(f"the TLS certificate {tls.cert} is valid only from "
                             f"{certificate.not_valid_before_utc:%Y-%m-%d %H:%M} UTC; check this host's clock")


# --- budgets: one token, or one address, never takes the whole controller (issue 18, N2) ---------------
# grpc's own cap (`--max-streams`) counts every call open at once, whoever makes it: a single client token
# that opens thousands of streams and stalls them would hold every slot, and agents and other clients would
# get "resource exhausted". Each call is admitted, in its worker thread before the servicer runs, against
# budgets of its caller: a client token's calls and uploads open at once (uploads x the 16 MiB message limit
# bound its bytes in flight) and its call rate (a token bucket); an address's (every client token from one
# host together) and a team's (every client token of one `team=`, from anywhere: issue 33, M4) calls and
# rate; all clients together at most half of --max-streams, so agents and admins always keep the other half;
# a pinned agent token's calls; all unpinned agent tokens together what is left less a twentieth, which stays
# for admins and pinned agents, and their streams still waiting for a hello, per address and together
# (issue 33, H2: the deadlines themselves are the agent servicer's). Admins are bounded by grpc's cap only;
# without tokens (`--no-auth`, loopback only) every caller is the operator.

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
    # every client token of one team (`team=NAME` in the tokens file) together, from wherever (issue 33, M4)
    calls_per_team: int = 256
    rate_per_team: float = 800.0
    burst_per_team: int = 4000
    calls_per_pinned_agent: int = 64  # one agent: its stream, downloads, a reconnect overlapping the old stream
    upload_idle_s: float = 60.0  # an upload that sends nothing for this long is cut (--upload-idle-timeout)
    # Agent streams (issue 33, H2): a Connect stream's first message must be its hello, within hello_timeout_s
    # (--agent-hello-timeout); after it, a stream that sends nothing (agents heartbeat on a clock) for
    # agent_idle_s is cut (--agent-idle-timeout; None: 60 s, or 4 heartbeat intervals when that is longer).
    hello_timeout_s: float = 10.0
    agent_idle_s: float | None = None
    hello_less: int = 64  # unpinned agent tokens' streams still waiting for their hello, all together ...
    hello_less_per_address: int = 16  # ... and from one address

    @property
    def client_pool(self) -> int:
        """Calls all clients together may hold: the rest is the agents' and admins' share."""
        return max(1, self.max_streams // 2)

    @property
    def reserved(self) -> int:
        """Calls neither clients nor unpinned agent tokens may take: admins' and pinned agents' alone."""
        return max(2, self.max_streams // 20)

    @property
    def unpinned_pool(self) -> int:
        """Calls all unpinned agent tokens together may hold (streams and downloads)."""
        return max(1, self.max_streams - self.client_pool - self.reserved)

    def idle_s(self, heartbeat_interval_s: float) -> float:
        """How long an agent stream may send nothing before it is cut."""
        return self.agent_idle_s if self.agent_idle_s is not None else max(60.0, 4 * heartbeat_interval_s)


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
                      *([(f"team:{identity.team}", s.calls_per_team,
                          f"the tokens of team {identity.team} have {s.calls_per_team} calls open, the most one team "
                          "may")] if identity.team else []),
                      ("clients", s.client_pool,
                       f"clients hold {s.client_pool} calls, their share of this controller's --max-streams "
                       "(the rest is kept for agents and admins)")]
            if method == UPLOAD_METHOD:
                limits.append((f"uploads:{identity.line}", s.uploads_per_token,
                               f"this token has {s.uploads_per_token} uploads open, the most one client token may"))
        elif identity.role == "agent" and identity.agent_name:
            limits = [(f"agent:{identity.line}", s.calls_per_pinned_agent,
                       f"agent {identity.agent_name} has {s.calls_per_pinned_agent} calls open, the most one agent may")]
        elif identity.role == "agent":  # an unpinned token (any name): all of them together, never the reserve
            limits = [("agents", s.unpinned_pool,
                       f"agent tokens without a pinned name hold {s.unpinned_pool} calls, their share of this "
                       "controller's --max-streams (the rest is kept for clients, admins and pinned agents)")]
        with self.lock:
            refusal = self._over(limits)
            if refusal is not None:
                return [], f"{method}: {refusal}. Wait for some to finish, or ask the operator for more."
            if identity.role == "client":
                now = time.monotonic()
                token = self._bucket(f"rate:{identity.line}", s.rate_per_token, s.burst_per_token, now)
                if not token.take(now):  # the token's own excess is never charged to its address
                    self.refused += 1
                    return [], (f"{method}: this token makes calls faster than the {s.rate_per_token:g} a second one "
                                "client token may; slow down and try again")
                if identity.team and not self._bucket(f"rate-team:{identity.team}", s.rate_per_team, s.burst_per_team,
                                                      now).take(now):
                    self.refused += 1
                    return [], (f"{method}: the tokens of team {identity.team} make calls faster than the "
                                f"{s.rate_per_team:g} a second one team may; slow down and try again")
                if not self._bucket(f"rate:{address}", s.rate_per_address, s.burst_per_address, now).take(now):
                    self.refused += 1
                    return [], (f"{method}: client tokens from {address} make calls faster than the "
                                f"{s.rate_per_address:g} a second one address may; slow down and try again")
            keys = [key for key, _, _ in limits]
            for key in keys:
                self.open_calls[key] = self.open_calls.get(key, 0) + 1
            return keys, None

    def await_hello(self, identity: Identity, address: str) -> tuple[list[str], str | None]:
        """An agent stream waiting for its hello: the keys it is counted under until the hello arrives (release
        them then), or why it is refused. Unpinned agent tokens only: a pinned agent has its own share, an admin
        is the operator."""
        s = self.settings
        if identity.role != "agent" or identity.agent_name:
            return [], None
        limits = [(f"hello:{address}", s.hello_less_per_address,
                   f"agent streams from {address} that have not sent their hello number {s.hello_less_per_address}, "
                   "the most one address may"),
                  ("hello", s.hello_less, f"agent streams that have not sent their hello number {s.hello_less}, the "
                   "most unpinned agent tokens may have together")]
        with self.lock:
            refusal = self._over(limits)
            if refusal is not None:
                return [], (f"{refusal}; an agent sends its hello first (a token pinned to the agent's name in the "
                            "tokens file has its own share)")
            keys = [key for key, _, _ in limits]
            for key in keys:
                self.open_calls[key] = self.open_calls.get(key, 0) + 1
            return keys, None

    def _over(self, limits: list[tuple[str, int, str]]) -> str | None:
        """The first of these limits already reached (its reason), counted as a refusal; under the lock."""
        for key, limit, why in limits:
            if self.open_calls.get(key, 0) >= limit:
                self.refused += 1
                return why
        return None

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
        """The same (loop) handler, admitted against the budgets when its call starts and released when it ends
        (a call cut by its client too: the cancellation reaches the `finally`)."""
        behavior = (handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream)

        async def admitted(context: grpc.aio.ServicerContext) -> list[str]:
            keys, refusal = self.admit(identity, peer_address(context), method)
            if refusal is not None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
            return keys

        if handler.response_streaming:
            async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                keys = await admitted(context)
                try:
                    answer = behavior(request, context)
                    if inspect.isawaitable(answer):  # a handler that writes with context.write()
                        await answer
                        return
                    async for response in answer:
                        yield response
                finally:
                    self.release(keys)
            run: Callable[..., Any] = streaming
        else:
            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                keys = await admitted(context)
                try:
                    return await behavior(request, context)
                finally:
                    self.release(keys)
            run = unary
        return same_kind(handler, run)


class UploadIdle(Exception):
    """An upload sent nothing for --upload-idle-timeout seconds; the message says so, for the client."""


_END = object()


class IdleUploads:
    """Uploads that stopped sending: each is cut after `idle_s` without a chunk, so a stalled one frees its slot.

    The stream is read by a thread of its own and handed over through a small queue, so the handler waits with
    a timeout and, when nothing came, ends the call itself with a status and a message saying why (a call
    cancelled from another thread reaches the client as a bare CANCELLED)."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.lock = threading.Lock()
        self.cut = 0

    def paced(self, messages: Iterator[T]) -> Generator[T, None, None]:
        """messages as they arrive; raises UploadIdle when none came for idle_s. At most two wait read, so
        the bytes in flight stay bounded."""
        box: queue.Queue[tuple[Any, BaseException | None]] = queue.Queue(maxsize=2)
        gone = threading.Event()

        def hand_over(item: tuple[Any, BaseException | None]) -> bool:
            while not gone.is_set():
                try:
                    box.put(item, timeout=1.0)
                    return True
                except queue.Full:
                    continue
            return False

        def read() -> None:
            try:
                for message in messages:  # ends (or raises) once the call has ended, whoever ended it
                    if not hand_over((message, None)):
                        return
                hand_over((_END, None))
            except BaseException as e:  # the client went away: the handler raises it as before
                hand_over((_END, e))

        threading.Thread(target=read, name="upload-reader", daemon=True).start()
        try:
            while True:
                try:
                    message, error = box.get(timeout=self.idle_s)
                except queue.Empty:
                    with self.lock:
                        self.cut += 1
                    raise UploadIdle(f"the upload sent nothing for {self.idle_s:g} s and was cut "
                                     "(--upload-idle-timeout); send the file again") from None
                if message is _END:
                    if error is not None:
                        raise error
                    return
                yield message
        finally:
            gone.set()


def peer_address(context: grpc.ServicerContext) -> str:
    """`ipv4:10.0.0.7:51234` -> `ipv4:10.0.0.7`: the host, whatever port it called from."""
    return str(context.peer()).rpartition(":")[0]
