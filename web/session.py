"""Dashboard sessions: a signed cookie naming the token's role, and the CSRF token of its forms.

The cookie never holds the token itself, only the role and tokens-file line it was issued for,
an expiry and a random id, signed with HMAC-SHA256 under a secret that lives only in this
process (a restart logs everyone out). A form's CSRF token is the HMAC of the session id.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass

COOKIE = "farm_session"
SESSION_TTL_S = 12 * 3600


@dataclass(frozen=True)
class Session:
    role: str
    line: int
    sid: str
    expires: float


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class SessionSigner:
    def __init__(self, secret: bytes | None = None, ttl_s: float = SESSION_TTL_S) -> None:
        self._secret = secret or secrets.token_bytes(32)
        self.ttl_s = ttl_s

    def _mac(self, purpose: str, payload: str) -> str:
        return _b64(hmac.new(self._secret, f"{purpose}:{payload}".encode(), hashlib.sha256).digest())

    def issue(self, role: str, line: int, now: float | None = None) -> tuple[str, Session]:
        session = Session(role, line, secrets.token_urlsafe(16), (now or time.time()) + self.ttl_s)
        payload = _b64(json.dumps({"r": session.role, "l": session.line, "s": session.sid, "e": session.expires}).encode())
        return f"{payload}.{self._mac('session', payload)}", session

    def verify(self, cookie: str | None, now: float | None = None) -> Session | None:
        """The session a cookie value names; None when it is missing, forged, malformed or expired."""
        if not cookie or cookie.count(".") != 1 or len(cookie) > 4096:
            return None
        payload, mac = cookie.split(".")
        if not hmac.compare_digest(mac, self._mac("session", payload)):
            return None
        try:
            data = json.loads(_unb64(payload))
            session = Session(str(data["r"]), int(data["l"]), str(data["s"]), float(data["e"]))
        except (ValueError, KeyError, TypeError):
            return None
        if session.expires < (now or time.time()):
            return None
        return session

    def csrf_token(self, session: Session) -> str:
        return self._mac("csrf", session.sid)

    def csrf_ok(self, session: Session, sent: str | None) -> bool:
        return sent is not None and sent != "" and hmac.compare_digest(sent, self.csrf_token(session))

    def sign_text(self, text: str) -> str:
        """A MAC for a message the dashboard shows after a redirect: a link from elsewhere cannot put words on it."""
        return self._mac("text", text)

    def text_ok(self, text: str, mac: str | None) -> bool:
        return bool(text) and mac is not None and mac != "" and hmac.compare_digest(mac, self.sign_text(text))


# Log-in guesses per address: a burst for typos, then one a refill interval; over it, 429 without looking.
LOGIN_BURST = 5
LOGIN_REFILL_S = 6.0  # ten guesses a minute at most, once the burst is spent
MAX_TRACKED_ADDRESSES = 10_000  # bounded memory under a spray from many addresses


class LoginThrottle:
    """Failed log-ins per peer address, as a token bucket; a success leaves the bucket as it is."""

    def __init__(self, burst: int = LOGIN_BURST, refill_s: float = LOGIN_REFILL_S) -> None:
        self.burst, self.refill_s = burst, refill_s
        self._buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, when counted)
        self._lock = threading.Lock()

    def _tokens(self, address: str, now: float) -> float:
        tokens, when = self._buckets.get(address, (float(self.burst), now))
        return min(float(self.burst), tokens + (now - when) / self.refill_s)

    def retry_after(self, address: str, now: float | None = None) -> float:
        """Seconds until this address may guess again; 0 when it may now."""
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens = self._tokens(address, now)
        return 0.0 if tokens >= 1 else (1 - tokens) * self.refill_s

    def failed(self, address: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            if address not in self._buckets and len(self._buckets) >= MAX_TRACKED_ADDRESSES:
                # forget the addresses whose buckets have refilled; if none has, the oldest entry
                full = [a for a in self._buckets if self._tokens(a, now) >= self.burst]
                for old in full or [next(iter(self._buckets))]:
                    del self._buckets[old]
            self._buckets[address] = (max(0.0, self._tokens(address, now) - 1), now)
