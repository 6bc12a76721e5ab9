"""The lab dashboard over HTTP(S): the standard library's ThreadingHTTPServer, nothing fetched at run time.

Who may see what is the controller's rule (controller/auth.py): a client or admin token reads
every page; cancelling a job takes a client or admin token, a device's health (release,
quarantine, maintenance) an admin token. A browser logs in once with its token and gets a signed
session cookie (web/session.py); scripts send `Authorization: Bearer <token>`. Every request that
changes something must come from the dashboard's own origin (Origin, else Referer) and, from a
browser session, carry the form's CSRF token.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import math
import re
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from email.message import Message
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Callable
from urllib.parse import parse_qs, quote, urlencode, urlsplit

from farm.controller.analysis.export import results_csv, rows_csv, to_json
from farm.controller.auth import Identity, TlsFiles, TokenTable, bearer_token, is_loopback
from farm.controller.scheduling.controller import Controller
from farm.controller.analysis.results import run_records
from farm.controller import service as answers
from farm.controller.scheduling.store_file import StoreFile, StoreFileWatch
from farm.controller.store import Store
from farm.controller.store.rows import JobRow
from farm.proto.questions import iso_utc
from farm.web import pages, views
from farm.web.session import COOKIE, LoginThrottle, Session, SessionSigner
from farm.web.streams import StreamHub

log = logging.getLogger("farm.web")

VIEW_ROLES = frozenset({"client", "admin"})  # the roles that may read results and list devices over gRPC
CANCEL_ROLES = frozenset({"client", "admin"})  # CancelJob is a client call
DEVICE_ROLES = frozenset({"admin"})  # a device's health is the operator's call
MAX_FORM_BYTES = 64 * 1024
REQUEST_TIMEOUT_S = 30  # a client that stops sending mid-request loses its thread after this
MAX_CONNECTIONS = 256  # open at once (browsers keep ~6 per tab alive); a thread each, mostly waiting
MAX_CONNECTIONS_PER_ADDRESS = 16  # one address (a slowloris) holds a sixteenth of them, never all
HEADER_DEADLINE_S = 10.0  # the request line and headers, whole, from the first byte waited for (keep-alive idle too)
BODY_DEADLINE_S = 10.0  # a form body of at most MAX_FORM_BYTES
SEND_DEADLINE_S = 30.0  # the response, to a client that reads it slowly
DEADLINE_TICK_S = 0.5
FULL_LOG_EVERY_S = 10.0
STATIC = {"dashboard.css": "text/css; charset=utf-8", "dashboard.js": "text/javascript; charset=utf-8"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
DEVICE_ACTIONS = ("release", "quarantine", "maintenance")


@dataclass
class Operator:
    """What the dashboard's buttons call: the same controller functions as the CLI."""

    cancel_job: Callable[[int], int]
    quarantine: Callable[[str, str, str], int]  # (device, reason, health) -> waiting tasks failed
    release: Callable[[str], None]

    @classmethod
    def embedded(cls, controller: Controller) -> "Operator":
        return cls(controller.cancel_job, lambda device, reason, health: controller.quarantine(device, reason, health=health),
                   controller.release)


@dataclass
class Response:
    status: int
    body: bytes = b""
    content_type: str = "text/html; charset=utf-8"
    headers: dict[str, str] | None = None
    stream: "EventStream | None" = None  # server-sent events: the request's thread sends the opening, the hub the rest


@dataclass(frozen=True)
class StoreHealth:
    """The store file as /healthz shows it to a client or admin token (its fields in this order)."""

    path: str
    linked: bool
    replaced: bool
    size_bytes: int | None
    problem: str
    last_write: str | None  # ISO 8601


@dataclass(frozen=True)
class EventStream:
    opening: bytes  # sent with the headers: the retry interval and any region the page does not have yet
    step: Callable[[], bytes | None]  # each check's bytes (b"" for none), None when the stream ends


# Which live regions each page has, and the `part` that renders each alone (the region's own URL).
LIVE_REGIONS = {"lab": {"lab-live": "devices"}, "jobs": {"jobs-live": "list"},
                "job": {"job-progress": "progress", "job-results": "results"}}
STREAM_CHECK_S = 2.0  # how often an open page's regions are rendered again, server-side, to look for a change
STREAM_KEEPALIVE_S = 20.0  # a comment line when nothing changed: finds a closed tab, keeps proxies from timing out
STREAM_LIFETIME_S = 600.0  # then the stream ends and the browser reconnects: the session is checked again


class HttpRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class DashboardApp:
    """The pages and actions, apart from the socket: a request in, a Response out."""

    def __init__(self, store: Store, operator: Operator, *, tokens: TokenTable | None, tls: bool,
                 loopback: bool, signer: SessionSigner | None = None, job_sharing: str = "shared",
                 live: Callable[[], dict[str, views.AgentNow]] | None = None) -> None:
        self.store = store
        self.live = live  # the controller's agent sessions (None for `farm web` over a store: no agents connect)
        self.job_sharing = job_sharing  # as the controller's --job-sharing: who reads whose jobs
        self.operator = operator
        self.tokens = tokens
        self.tls = tls
        self.loopback = loopback  # bound to a loopback address: Host must name this machine (DNS rebinding)
        self.signer = signer or SessionSigner()
        self.throttle = LoginThrottle()  # failed log-ins and bearer tokens per address
        self.closing = threading.Event()  # set when the server stops: open event streams end
        self._live_cache: dict[tuple[str, Identity, Session | None], tuple[float, dict[str, str]]] = {}
        self.store_watch = StoreFileWatch.for_store(store)  # opened now: a later deletion or replacement shows
        self._open_session = Session("admin", 0, "open", float("inf"))  # no tokens: everyone is admin (as over gRPC)

    @property
    def open_mode(self) -> bool:
        return self.tokens is None

    # --- who is asking ------------------------------------------------------------------------
    def identify(self, headers: Any) -> tuple[Identity | None, Session | None, bool]:
        """(identity, browser session, sent a bearer token); identity None when nobody valid is asking."""
        if self.tokens is None:
            return Identity("admin"), self._open_session, False
        header = headers.get("Authorization")
        if header:
            identity = self.tokens.lookup(bearer_token(header) or "")
            return identity, None, True
        session = self.signer.verify(_cookie(headers.get("Cookie")))
        if session is None:
            return None, None, False
        known = self.tokens.by_line(session.line)  # its owner id and team, for whose jobs are whose
        return (known if known and known.role == session.role else Identity(session.role, None, session.line)), session, False

    def viewer(self, identity: Identity) -> answers.Viewer:
        """Whose jobs this caller may read and cancel: the same rule as over gRPC (service.Viewer)."""
        if self.tokens is None or identity.role == "admin":
            return answers.EVERYONE
        return answers.Viewer(identity.owner or f"line-{identity.line}", identity.team)

    def readable_job(self, job_id: int, identity: Identity) -> JobRow:
        job = self.store.jobs.get(job_id)
        if job is None or not self.viewer(identity).may_read(job, self.job_sharing):
            raise HttpRefused(HTTPStatus.NOT_FOUND, f"no job {job_id}")
        return job

    def origin_ok(self, headers: Message) -> bool | None:
        """True: sent from this dashboard; False: from elsewhere; None: the request names no origin."""
        expected = f"{'https' if self.tls else 'http'}://{headers.get('Host', '')}"
        origin: str | None = headers.get("Origin")
        if origin is not None:
            return origin == expected
        referer: str | None = headers.get("Referer")
        if referer is not None:
            return referer == expected or referer.startswith(expected + "/")
        return None

    def host_ok(self, headers: Message) -> bool:
        if not self.loopback:
            return True
        host = headers.get("Host") or ""
        name = host[1:host.find("]")] if host.startswith("[") else host.rpartition(":")[0] if ":" in host else host
        if name == "localhost":
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False

    # --- requests -----------------------------------------------------------------------------
    def handle(self, method: str, target: str, headers: Any, body: bytes, peer: str = "") -> Response:
        try:
            if self.tokens is not None and (headers.get("Authorization") or (method == "POST" and target.startswith("/login"))):
                wait = self.throttle.retry_after(peer)
                if wait > 0:  # refused before the token is looked at: a guess learns nothing
                    return Response(HTTPStatus.TOO_MANY_REQUESTS, pages.error_page(
                        429, f"too many failed log-ins from {peer or 'this address'}; try again in {math.ceil(wait)} s")
                        .encode(), headers={"Retry-After": str(math.ceil(wait))})
            if not self.host_ok(headers):
                raise HttpRefused(HTTPStatus.MISDIRECTED_REQUEST,
                              "this dashboard listens on a loopback address and answers only to localhost names")
            url = urlsplit(target)
            query = {k: v[-1] for k, v in parse_qs(url.query, max_num_fields=20).items()}
            path = url.path
            if path == "/healthz" and method == "GET":
                return self.healthz(headers)
            if path == "/favicon.ico":
                return Response(HTTPStatus.NO_CONTENT)  # browsers ask for it on every page; there is none
            if method == "GET" and path.startswith("/static/"):
                return self.static(path[len("/static/"):])
            if path == "/login":
                response = self.login(method, headers, body, query)
                if method == "POST" and response.status == HTTPStatus.UNAUTHORIZED:
                    self.throttle.failed(peer)
                return response
            identity, session, bearer = self.identify(headers)
            if identity is None and bearer:
                self.throttle.failed(peer)
            if identity is None or identity.role not in VIEW_ROLES:
                return self.refuse_unauthenticated(method, path, identity, bearer)
            if method == "POST":
                return self.post(path, headers, body, identity, session, bearer)
            if method != "GET":
                raise HttpRefused(HTTPStatus.METHOD_NOT_ALLOWED, f"{method} is not served here")
            return self.get(path, query, identity, session)
        except HttpRefused as r:
            return Response(r.status, pages.error_page(r.status, str(r)).encode())

    def store_health(self) -> StoreFile:
        return self.store_watch.check_and_log(log)

    def healthz(self, headers: Any) -> Response:
        """200 while the store file is the one this process opened, else 503 saying why. Anyone may ask whether
        it is healthy; the path, size and last write are for a client or admin token (or an open dashboard)."""
        state = self.store_health()
        identity = self.identify(headers)[0]
        store = StoreHealth(state.path, state.linked, state.replaced, state.size_bytes, state.problem,
                            None if state.last_write is None  # ISO 8601, as every JSON farm prints
                            else iso_utc(datetime.fromtimestamp(state.last_write, UTC)))
        shown = identity is not None and identity.role in VIEW_ROLES
        body = json.dumps({"ok": state.ok, "store": dataclasses.asdict(store)} if shown else {"ok": state.ok})
        return Response(HTTPStatus.OK if state.ok else HTTPStatus.SERVICE_UNAVAILABLE, body.encode(), "application/json")

    def refuse_unauthenticated(self, method: str, path: str, identity: Identity | None, bearer: bool) -> Response:
        if identity is not None:  # a valid token of a role that may not read results (an agent's)
            return Response(HTTPStatus.FORBIDDEN, pages.error_page(
                403, f"the token is for the {identity.role} role; the dashboard needs a client or admin token").encode())
        if bearer:
            return Response(HTTPStatus.UNAUTHORIZED, b"this controller does not know the token that was sent\n",
                            "text/plain; charset=utf-8", {"WWW-Authenticate": 'Bearer realm="farm"'})
        if method == "GET" and (path in ("/", "/lab", "/jobs", "/calibrations")
                                or re.fullmatch(r"/(jobs|calibrations)/\d{1,18}", path)):
            return Response(HTTPStatus.UNAUTHORIZED, pages.login_page("log in to see this page", path).encode(),
                            headers={"WWW-Authenticate": 'Bearer realm="farm"'})
        return Response(HTTPStatus.UNAUTHORIZED, b"log in first (or send Authorization: Bearer <token>)\n",
                        "text/plain; charset=utf-8", {"WWW-Authenticate": 'Bearer realm="farm"'})

    def static(self, name: str) -> Response:
        if name not in STATIC:
            raise HttpRefused(HTTPStatus.NOT_FOUND, "no such file")
        return Response(HTTPStatus.OK, resources.files("farm.web").joinpath("static", name).read_bytes(), STATIC[name])

    def login(self, method: str, headers: Any, body: bytes, query: dict[str, str]) -> Response:
        if self.open_mode:
            return _redirect("/lab")
        if method == "GET":
            return Response(HTTPStatus.OK, pages.login_page(next_path=_safe_next(query.get("next"))).encode())
        if method != "POST":
            raise HttpRefused(HTTPStatus.METHOD_NOT_ALLOWED, "log in with the form")
        if self.origin_ok(headers) is not True:  # login CSRF: another site must not log a browser in as itself
            raise HttpRefused(HTTPStatus.FORBIDDEN, "a log-in must come from this dashboard's own page")
        form = _form(headers, body)
        identity = self.tokens.lookup(form.get("token", "").strip()) if self.tokens is not None else None
        if identity is None:
            return Response(HTTPStatus.UNAUTHORIZED, pages.login_page(
                "this controller does not know that token; check for a typo or an old token").encode())
        if identity.role not in VIEW_ROLES:
            return Response(HTTPStatus.FORBIDDEN, pages.login_page(
                f"that token is for the {identity.role} role; the dashboard needs a client or admin token").encode())
        cookie, _ = self.signer.issue(identity.role, identity.line)
        attributes = f"Path=/; HttpOnly; SameSite=Strict; Max-Age={int(self.signer.ttl_s)}" + ("; Secure" if self.tls else "")
        log.info("dashboard log-in: %s token (line %d)", identity.role, identity.line)
        return _redirect(_safe_next(form.get("next")), {"Set-Cookie": f"{COOKIE}={cookie}; {attributes}"})

    def lab(self, identity: Identity | None = None) -> views.LabView:
        """The lab as `identity` may see it: in a `team` lab, other teams' tasks are not named (views.lab_view)."""
        viewer = self.viewer(identity) if identity is not None else answers.EVERYONE
        may_read = None if viewer.sees_all or self.job_sharing == "shared" else \
            (lambda job: viewer.may_read(job, self.job_sharing))
        return views.lab_view(self.store, live=self.live() if self.live else None, may_read=may_read)

    def csrf(self, session: Session | None) -> str:
        return self.signer.csrf_token(session) if session else ""

    def post(self, path: str, headers: Any, body: bytes, identity: Identity, session: Session | None,
             bearer: bool) -> Response:
        origin = self.origin_ok(headers)
        if origin is False or (origin is None and not bearer):
            raise HttpRefused(HTTPStatus.FORBIDDEN, "refused: this request did not come from the dashboard's own pages "
                                                "(its Origin or Referer names another site, or none)")
        form = _form(headers, body)
        if not bearer and (session is None or not self.signer.csrf_ok(session, form.get("csrf"))):
            raise HttpRefused(HTTPStatus.FORBIDDEN, "refused: the form's CSRF token is missing or stale; reload the page "
                                                "and try again")
        if path == "/logout":
            return _redirect("/login", {"Set-Cookie": f"{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"})
        if path == "/actions/device":
            return self.device_action(form, identity)
        match = re.fullmatch(r"/jobs/(\d{1,18})/cancel", path)
        if match:
            return self.cancel(int(match.group(1)), identity)
        raise HttpRefused(HTTPStatus.NOT_FOUND, "no such action")

    def device_action(self, form: dict[str, str], identity: Identity) -> Response:
        if identity.role not in DEVICE_ROLES:
            raise HttpRefused(HTTPStatus.FORBIDDEN, f"a device's health needs an admin token; this one is for the {identity.role} role")
        device, action = form.get("device", ""), form.get("action", "")
        if action not in DEVICE_ACTIONS:
            raise HttpRefused(HTTPStatus.BAD_REQUEST, f"unknown action; choose one of {', '.join(DEVICE_ACTIONS)}")
        if not device or len(device) > 256 or device not in {d.name for d in self.lab().devices}:
            raise HttpRefused(HTTPStatus.NOT_FOUND, "no such device in this lab")
        reason = form.get("reason", "").strip()[:500]
        if action != "release" and not reason:  # the page requires one too; a script must give one as well
            raise HttpRefused(HTTPStatus.BAD_REQUEST, f"{action} takes {device} out of service and fails its waiting tasks: "
                                                  "say why in the form's reason field (it is shown on the lab page)")
        if action == "release":
            self.operator.release(device)
            message = f"{device} released: it takes tasks again"
        elif action == "quarantine":
            n = self.operator.quarantine(device, reason, "bad")
            message = f"{device} quarantined; {n} waiting task(s) failed (infrastructure)"
        else:
            n = self.operator.quarantine(device, reason, "maintenance")
            message = f"{device} in maintenance; {n} waiting task(s) failed (infrastructure)"
        log.info("dashboard: %s token (line %d) %s %r", identity.role, identity.line, action, device)
        return _redirect(self.flash("/lab", message))

    def cancel(self, job_id: int, identity: Identity) -> Response:
        if identity.role not in CANCEL_ROLES:
            raise HttpRefused(HTTPStatus.FORBIDDEN, f"cancelling a job needs a client or admin token; this one is for the {identity.role} role")
        if not self.viewer(identity).owns(self.readable_job(job_id, identity)):  # reading may be shared; cancelling never
            raise HttpRefused(HTTPStatus.FORBIDDEN, f"job {job_id} belongs to another token; only its owner, its owner's team "
                                                "or an admin may cancel it")
        n = self.operator.cancel_job(job_id)
        log.info("dashboard: %s token (line %d) canceled job %d", identity.role, identity.line, job_id)
        return _redirect(self.flash(f"/jobs/{job_id}", f"job {job_id} canceled ({n} unfinished task(s))"))

    def flash(self, path: str, message: str) -> str:
        message = message[:300]
        return f"{path}?msg={quote(message)}&sig={self.signer.sign_text(message)}"

    # --- pages ---------------------------------------------------------------------------------
    def get(self, path: str, query: dict[str, str], identity: Identity, session: Session | None) -> Response:
        csrf = self.csrf(session)
        message = query.get("msg", "") if self.signer.text_ok(query.get("msg", ""), query.get("sig")) else ""

        store = self.store_health()

        def page(title: str, body: str, active: str) -> Response:
            if not store.ok:  # on every page: what is shown may already be lost
                body = f'<p class="flash error" role="alert">{pages.e(store.problem)}</p>{body}'
            return Response(HTTPStatus.OK, pages.layout(title, body, active=active, role=identity.role, csrf=csrf,
                                                        message=message, open_mode=self.open_mode).encode())

        if path == "/":
            return _redirect("/lab")
        if path == "/events":
            return self.events(query.get("page", ""), query.get("have", ""), identity, session)
        if path == "/lab":
            f = views.LabFilter.from_query(query)
            html = pages.lab_devices(self.lab(identity), csrf=csrf, may_operate=identity.role in DEVICE_ROLES, f=f)
            if query.get("part") == "devices":
                return Response(HTTPStatus.OK, html.encode())
            return page("Lab", pages.lab_filter_form(f) + pages.live(
                "lab-live", "/lab?" + urlencode({**f.query(), "part": "devices"}), html, 3) + pages.store_facts(store),
                "lab")
        if path == "/jobs":
            jobs, total = views.jobs_view(self.store, _limit(query.get("limit")),
                                          self.viewer(identity).visible(self.job_sharing))
            html = pages.jobs_list(jobs, total)
            if query.get("part") == "list":
                return Response(HTTPStatus.OK, html.encode())
            url = "/jobs?part=list" + (f"&limit={_limit(query.get('limit'))}" if query.get("limit") else "")
            return page("Jobs", pages.live("jobs-live", url, html, 3), "jobs")
        match = re.fullmatch(r"/jobs/(\d{1,18})(/results\.(csv|json))?", path)
        if match:
            return self.job(int(match.group(1)), match.group(3), query, identity, csrf, page)
        match = re.fullmatch(r"/api/jobs/(\d{1,18})", path)
        if match:
            self.readable_job(int(match.group(1)), identity)
            summary = views.job_summary(self.store, int(match.group(1)))
            if summary is None:
                raise HttpRefused(HTTPStatus.NOT_FOUND, "no such job")
            return Response(HTTPStatus.OK, summary.to_json().encode(), "application/json")
        if path == "/compare" or path.startswith("/compare/"):
            return self.compare(path, query, identity, page)
        if path == "/calibrations":
            return page("Calibrations", pages.calibrations_list(views.calibrations_view(self.store)), "calibrations")
        match = re.fullmatch(r"/calibrations/(\d{1,18})", path)
        if match:
            view = views.calibration_view(self.store, int(match.group(1)))
            if view is None:
                raise HttpRefused(HTTPStatus.NOT_FOUND, "no such calibration")
            return page(f"Calibration {view.row.id}: {views.key_label(view.row)} v{view.row.version}",
                        pages.calibration_page(view), "calibrations")
        raise HttpRefused(HTTPStatus.NOT_FOUND, "no such page")

    # --- live regions over server-sent events -------------------------------------------------
    def live_parts(self, page: str, identity: Identity, session: Session | None) -> dict[str, str]:
        """The live regions of `page` (a path and query on this dashboard), each rendered as its part URL renders it."""
        url = urlsplit(page)
        query = {k: v[-1] for k, v in parse_qs(url.query, max_num_fields=20).items() if k not in ("part", "msg", "sig")}
        match = re.fullmatch(r"/jobs/(\d{1,18})", url.path)
        kind = "job" if match else url.path.strip("/")
        if kind not in LIVE_REGIONS:
            raise HttpRefused(HTTPStatus.NOT_FOUND, "that page has no live regions")
        parts = {}
        for region, part in LIVE_REGIONS[kind].items():
            response = self.get(url.path, {**query, "part": part}, identity, session)
            if response.status != HTTPStatus.OK:
                raise HttpRefused(response.status, "that page cannot be shown")
            parts[region] = response.body.decode()
        return parts

    def shared_live_parts(self, page: str, identity: Identity, session: Session | None) -> dict[str, str]:
        """live_parts, rendered once per check for every open copy of one page by one viewer (the stream hub's
        thread is the only caller): a lab manager's six tabs, or a wall screen per rack, cost one render."""
        now = time.monotonic()
        key = (page, identity, session)
        cached = self._live_cache.get(key)
        if cached is not None and now - cached[0] < STREAM_CHECK_S / 2:
            return cached[1]
        if len(self._live_cache) > 4096:  # old keys of closed pages
            self._live_cache = {k: v for k, v in self._live_cache.items() if now - v[0] < STREAM_CHECK_S}
        parts = self.live_parts(page, identity, session)
        self._live_cache[key] = (now, parts)
        return parts

    def events(self, page: str, have: str, identity: Identity, session: Session | None) -> Response:
        """A page's live regions as server-sent events: one event when a region changes, nothing when none does."""
        if not page.startswith("/") or page.startswith("//") or len(page) > 2000:
            raise HttpRefused(HTTPStatus.BAD_REQUEST, "events?page= takes a path on this dashboard")
        known = dict(item.split(":", 1) for item in have.split(",")[:10] if ":" in item)  # region -> fingerprint
        first = self.live_parts(page, identity, session)  # refused here, before the stream starts, if not allowed
        sent = {region: known.get(region, "") for region in first}
        started = time.monotonic()
        quiet_since = [started]

        def changed(parts: dict[str, str]) -> bytes:
            out = b""
            for region, html in parts.items():
                mark = pages.fingerprint(html)
                if sent.get(region) != mark:
                    sent[region] = mark
                    data = json.dumps({"region": region, "etag": mark, "html": html})
                    out += f"event: update\ndata: {data}\n\n".encode()
            return out

        def step() -> bytes | None:  # called by the stream hub every STREAM_CHECK_S
            now = time.monotonic()
            if self.closing.is_set() or now - started >= STREAM_LIFETIME_S:
                return None
            try:
                chunk = changed(self.shared_live_parts(page, identity, session))
            except HttpRefused:  # the job was removed: the stream ends, the page keeps what it shows
                return None
            if chunk or now - quiet_since[0] >= STREAM_KEEPALIVE_S:
                quiet_since[0] = now
            return chunk or (b": still here\n\n" if quiet_since[0] == now else b"")

        return Response(HTTPStatus.OK, b"", "text/event-stream; charset=utf-8", {"X-Accel-Buffering": "no"},
                        stream=EventStream(b"retry: 3000\n\n" + changed(first), step))

    def job(self, job_id: int, download: str | None, query: dict[str, str], identity: Identity, csrf: str,
            page: Callable[[str, str, str], Response]) -> Response:
        job_row = self.readable_job(job_id, identity)
        if download:
            # the JSON carries each run's op profile (as `farm results --ops`); the CSV stays one row a run
            records = run_records(self.store, job_id, ops=download == "json")
            data = results_csv(records) if download == "csv" else to_json([r.model_dump() for r in records])
            kind = "text/csv; charset=utf-8" if download == "csv" else "application/json"
            return Response(HTTPStatus.OK, data.encode(), kind,
                            {"Content-Disposition": f'attachment; filename="farm-job-{job_id}.{download}"'})
        if query.get("part") == "progress":
            job, summary = self.store.jobs.get(job_id), views.job_summary(self.store, job_id)
            if job is None or summary is None:  # removed since the check above
                raise HttpRefused(HTTPStatus.NOT_FOUND, f"no job {job_id}")
            return Response(HTTPStatus.OK, pages.job_progress_part(job.status, summary.progress).encode())
        view = views.job_view(self.store, job_id)
        if view is None:
            raise HttpRefused(HTTPStatus.NOT_FOUND, f"no job {job_id}")
        if query.get("part") == "results":
            return Response(HTTPStatus.OK, pages.results_part(view).encode())
        return page(f"Job {job_id}", pages.job_page(view, csrf=csrf, may_cancel=identity.role in CANCEL_ROLES
                                                                  and self.viewer(identity).owns(job_row)), "jobs")


    def compare(self, path: str, query: dict[str, str], identity: Identity,
                page: Callable[[str, str, str], Response]) -> Response:
        """/compare/A/B (and .csv, .json): two jobs the caller may read, side by side; /compare?a=A&b=B (the job
        page's form) redirects there. A job the caller may not read is "no job N", as on its own page."""
        if path == "/compare":
            a, b = query.get("a", ""), query.get("b", "") or query.get("a", "")
            if not re.fullmatch(r"\d{1,18}", a) or not re.fullmatch(r"\d{1,18}", b):
                raise HttpRefused(HTTPStatus.BAD_REQUEST, "compare needs two job ids: a (before) and b (after)")
            return _redirect(f"/compare/{int(a)}/{int(b)}")
        match = re.fullmatch(r"/compare/(\d{1,18})/(\d{1,18})(\.(csv|json))?", path)
        if not match:
            raise HttpRefused(HTTPStatus.NOT_FOUND, "no such page")
        job_a, job_b = (self.readable_job(int(match.group(i)), identity) for i in (1, 2))
        view = views.compare_view(self.store, job_a, job_b)
        download = match.group(4)
        if download:
            from farm.controller.analysis.compare import flat_rows
            name = f"farm-compare-{job_a.id}-{job_b.id}.{download}"
            if download == "csv":
                rows = flat_rows(view.report)
                data = rows_csv(rows) if rows else "job_a,job_b,model_a,model_b\n"
                kind = "text/csv; charset=utf-8"
            else:
                data = to_json({**view.report.model_dump(), "pareto": view.pareto_data.model_dump()})
                kind = "application/json"
            return Response(HTTPStatus.OK, data.encode(), kind, {"Content-Disposition": f'attachment; filename="{name}"'})
        return page(f"Compare job {job_a.id} → job {job_b.id}", pages.compare_page(view), "jobs")


def _cookie(header: str | None) -> str | None:
    if not header:
        return None
    try:
        jar = SimpleCookie(header)
    except CookieError:
        return None
    morsel = jar.get(COOKIE)
    return morsel.value if morsel else None


def _form(headers: Any, body: bytes) -> dict[str, str]:
    kind = (headers.get("Content-Type") or "").split(";")[0].strip()
    if body and kind != "application/x-www-form-urlencoded":
        raise HttpRefused(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "send the form as application/x-www-form-urlencoded")
    try:
        fields = parse_qs(body.decode("utf-8"), max_num_fields=20, strict_parsing=False)
    except (UnicodeDecodeError, ValueError):
        raise HttpRefused(HTTPStatus.BAD_REQUEST, "the form is not UTF-8 url-encoded fields") from None
    return {k: v[-1] for k, v in fields.items()}


def _safe_next(path: str | None) -> str:
    """Only a path on this dashboard: never another site (an open redirect after log-in)."""
    if path and re.fullmatch(r"/[A-Za-z0-9/_.\-]*", path) and not path.startswith("//"):
        return path
    return "/lab"


def _limit(text: str | None) -> int:
    try:
        return max(1, min(int(text or views.JOBS_SHOWN), 5000))
    except ValueError:
        return views.JOBS_SHOWN


def _redirect(location: str, headers: dict[str, str] | None = None) -> Response:
    return Response(HTTPStatus.SEE_OTHER, b"", "text/plain; charset=utf-8", {"Location": location, **(headers or {})})


class _Handler(BaseHTTPRequestHandler):
    server: "DashboardServer"
    protocol_version = "HTTP/1.1"
    timeout = REQUEST_TIMEOUT_S
    server_version = "farm-dashboard"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        if isinstance(self.request, ssl.SSLSocket):
            self.server.deadlines.arm(self.request, HEADER_DEADLINE_S)  # the handshake is part of the head
            self.request.do_handshake()  # here, in this request's thread: a slow client holds no one else up

    def handle_one_request(self) -> None:
        # the whole head within a deadline: a header line every few seconds never trips the per-read timeout
        self.server.deadlines.arm(self.request, HEADER_DEADLINE_S)
        try:
            super().handle_one_request()
        finally:
            self.server.deadlines.disarm(self.request)

    def _serve(self, method: str) -> None:
        length = self.headers.get("Content-Length")
        body = b""
        if length:
            if not length.isdigit() or int(length) > MAX_FORM_BYTES:
                self._send(Response(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, b"request body too large\n", "text/plain"))
                self.close_connection = True
                return
            self.server.deadlines.arm(self.request, BODY_DEADLINE_S)
            body = self.rfile.read(int(length))
        self.server.deadlines.disarm(self.request)  # the page's own work is not the client's to stall
        try:
            response = self.server.dashboard.handle(method, self.path, self.headers, body, self.client_address[0])
        except Exception:  # a bug in one page must not take the server down; the log has the trace
            log.exception("dashboard request %s %s failed", method, self.path[:200])
            response = Response(HTTPStatus.INTERNAL_SERVER_ERROR,
                                pages.error_page(500, "this page failed; the controller's log has the details").encode())
        self._send(response)

    def _send(self, response: Response) -> None:
        if response.stream is not None and self.command != "HEAD":
            self._send_stream(response, response.stream)
            return
        self.server.deadlines.arm(self.request, SEND_DEADLINE_S)
        self.send_response(response.status)
        self._send_headers(response)
        if response.stream is not None:  # HEAD of an event stream: the headers only
            self.close_connection = True
            self.send_header("Connection", "close")
            self.end_headers()
            return
        self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response.body)

    def _send_headers(self, response: Response) -> None:
        for name, value in {**SECURITY_HEADERS, **(response.headers or {})}.items():
            self.send_header(name, value)
        self.send_header("Content-Type", response.content_type)

    def _send_stream(self, response: Response, stream: EventStream) -> None:
        """The headers and the opening here; then the socket goes to the stream hub, and this thread (with its
        connection slot) is free: an open page costs a socket, not a thread."""
        address = self.client_address[0]
        hub = self.server.streams
        if not hub.reserve(address):
            self._send(Response(HTTPStatus.SERVICE_UNAVAILABLE, b"too many live pages are open; reload later\n",
                                "text/plain; charset=utf-8", {"Retry-After": "30"}))
            return
        self.close_connection = True  # the stream has no length: it ends when the connection does
        try:
            self.server.deadlines.arm(self.request, SEND_DEADLINE_S)
            self.send_response(response.status)
            self._send_headers(response)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(stream.opening)
            self.wfile.flush()
            self.server.deadlines.disarm(self.request)
        except OSError:  # the tab was closed, or a slow reader ran out its deadline
            hub.release(address)
            return
        hub.adopt(self.request, address, stream.step)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._serve("GET")

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("dashboard %s %s", self.address_string(), format % args)


class DashboardServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], dashboard: DashboardApp) -> None:
        self.dashboard = dashboard
        # a thread per connection, so a cap: a client opening connections and sending nothing holds no more
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._per_address: dict[str, int] = {}
        self._count_lock = threading.Lock()
        self.deadlines = Deadlines()
        self.streams = StreamHub(STREAM_CHECK_S, SEND_DEADLINE_S)  # every open page's event stream, one thread
        self._last_full_log, self._closed_since_log = float("-inf"), 0
        try:
            super().__init__(address, _Handler)
        except OSError:
            self.streams.stop()
            self.deadlines.stop()
            raise

    def process_request(self, request: Any, client_address: Any) -> None:
        address = str(client_address[0])
        with self._count_lock:
            held = self._per_address.get(address, 0)
            if held >= MAX_CONNECTIONS_PER_ADDRESS:
                full = f"{MAX_CONNECTIONS_PER_ADDRESS} from {address}"
            elif not self._slots.acquire(blocking=False):
                full = f"{MAX_CONNECTIONS} in all"
            else:
                full = ""
                self._per_address[address] = held + 1
        if full:
            self.shutdown_request(request)  # full: closed at once rather than queued behind the others
            self._closed_since_log += 1
            if time.monotonic() - self._last_full_log >= FULL_LOG_EVERY_S:  # a flood must not flood the log too
                log.warning("dashboard: %s connections open; %d more closed at once (last from %s)", full,
                            self._closed_since_log, address)
                self._last_full_log, self._closed_since_log = time.monotonic(), 0
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._release(address)
            raise

    def _release(self, address: str) -> None:
        with self._count_lock:
            left = self._per_address.pop(address, 1) - 1
            if left > 0:
                self._per_address[address] = left
        self._slots.release()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.deadlines.disarm(request)
            self._release(str(client_address[0]))

    def shutdown_request(self, request: Any) -> None:
        if self.streams.owns(request):
            return  # an event stream: the hub writes to it now, and closes it when the stream ends
        super().shutdown_request(request)

    def server_close(self) -> None:
        self.deadlines.stop()
        self.streams.stop()
        super().server_close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("dashboard connection from %s failed", client_address, exc_info=True)


class Deadlines:
    """When each connection's current phase (head, body, response) must be done; one thread shuts down the
    sockets past theirs, which ends the blocked read or write in that connection's own thread."""

    def __init__(self) -> None:
        self._due: dict[Any, float] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        threading.Thread(target=self._reap, name="dashboard-deadlines", daemon=True).start()

    def arm(self, sock: Any, seconds: float) -> None:
        with self._lock:
            self._due[sock] = time.monotonic() + seconds

    def disarm(self, sock: Any) -> None:
        with self._lock:
            self._due.pop(sock, None)

    def stop(self) -> None:
        self._stopped.set()

    def _reap(self) -> None:
        while not self._stopped.wait(DEADLINE_TICK_S):
            now = time.monotonic()
            with self._lock:
                late = [sock for sock, due in self._due.items() if due <= now]
                for sock in late:
                    del self._due[sock]
            for sock in late:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # closed meanwhile


STORE_CHECK_S = 5.0


def _watch_store(dashboard: DashboardApp) -> None:
    """Look at the store file every few seconds, pages or not: a deleted store is logged when it happens."""
    while not dashboard.closing.wait(STORE_CHECK_S):
        try:
            dashboard.store_health()
        except OSError:
            log.exception("dashboard: cannot look at the store file")


class WebListenError(Exception):
    pass


@dataclass
class RunningDashboard:
    server: DashboardServer
    thread: threading.Thread
    url: str

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def stop(self) -> None:
        self.server.dashboard.closing.set()  # open event streams end (server_close stops their hub)
        self.server.shutdown()
        self.server.server_close()
        self.server.dashboard.store_watch.close()


def parse_web_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise WebListenError(f"--web-listen {listen}: expected HOST:PORT, e.g. 127.0.0.1:8080 (:0 picks a port)")
    return host.strip("[]") or "127.0.0.1", int(port)


def start_dashboard(store: Store, listen: str, operator: Operator, *, tokens: TokenTable | None,
                    tls: TlsFiles | None = None, job_sharing: str = "shared",
                    live: Callable[[], dict[str, views.AgentNow]] | None = None) -> RunningDashboard:
    """Serve the dashboard on HOST:PORT in a background thread (not blocking); TLS with the controller's
    certificate and key when given (browsers bring no client certificate: the token is the check). `live` reads
    the controller's agent sessions, so the lab page shows what the scheduler sees."""
    host, port = parse_web_listen(listen)
    loopback = is_loopback(f"[{host}]:{port}")
    dashboard = DashboardApp(store, operator, tokens=tokens, tls=bool(tls and tls.cert), loopback=loopback,
                          job_sharing=job_sharing, live=live)
    try:
        server = DashboardServer((host, port), dashboard)
    except OSError as e:
        raise WebListenError(f"cannot serve the dashboard on {listen}: {e.strerror or e}") from None
    if tls and tls.cert:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(str(tls.cert), str(tls.key))
        except (OSError, ssl.SSLError) as e:
            server.server_close()
            raise WebListenError(f"cannot load the TLS certificate {tls.cert} and key {tls.key}: {e}") from None
        server.socket = context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    thread = threading.Thread(target=server.serve_forever, name="dashboard", daemon=True)
    thread.start()
    threading.Thread(target=_watch_store, args=(dashboard,), name="dashboard-store-watch", daemon=True).start()
    shown = f"[{host}]" if ":" in host else host
    return RunningDashboard(server, thread, f"{'https' if dashboard.tls else 'http'}://{shown}:{server.server_address[1]}/")


def listen_warnings(listen: str, *, tokens: bool, tls: bool) -> list[str]:
    """What an operator should hear about a dashboard bound where others can reach it."""
    host, port = parse_web_listen(listen)
    if is_loopback(f"[{host}]:{port}"):
        return []
    if not tokens:
        return [f"the dashboard on {listen} has no tokens: anyone who can reach it may read every result and release, "
                "quarantine or cancel. Pass --tokens, or listen on a loopback address."]
    if not tls:
        return [f"the dashboard on {listen} is plain HTTP: a token typed into its log-in form, and the session cookie, "
                "cross the network in clear text. Serve TLS (--tls-cert, --tls-key) or listen on a loopback address."]
    return []
