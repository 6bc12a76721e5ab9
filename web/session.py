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
