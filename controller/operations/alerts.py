"""Alerts as a webhook: a JSON POST on quarantine and on calibration drift beyond threshold.

Any receiver that takes JSON works (a chat bridge, an incident tool, a small script). Delivery
is retried with exponential backoff on connection errors and 5xx answers; a 4xx means the
receiver refuses this event, so it is not sent again. A hook that stays down costs a log
line, never an exception in the controller. The controller only ever calls send_async: a
slow or hanging hook is a background thread's problem, never held under a lock that agent
streams wait on.
"""

from __future__ import annotations

import atexit
import collections
import datetime as dt
import http.client
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict

from farm.version import __version__

log = logging.getLogger("farm.controller.operations.alerts")

WEBHOOK_ENV = "FARM_WEBHOOK_URL"
USER_AGENT = f"farm/{__version__}"
# 408 and 429 ask the sender to come back later; every other 4xx is final.
RETRYABLE_CLIENT_STATUSES = frozenset({408, 429})
# Events waiting for a hook that is down: past this many, the oldest are dropped (counted, logged).
ASYNC_QUEUE_LIMIT = 1000
# How long a finishing process (a `farm refresh`) waits for alerts still queued.
EXIT_DRAIN_S = 15.0


def _iso_utc(at: float | None) -> str:
    moment = dt.datetime.fromtimestamp(time.time() if at is None else at, tz=dt.timezone.utc)
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


class QuarantineEvent(BaseModel):
    """The webhook's JSON for a device that gets no more tasks until `farm device release` (fields in sent order)."""

    model_config = ConfigDict(frozen=True)
    event: Literal["device_quarantined"] = "device_quarantined"
    device: str
    reason: str
    at: str  # ISO 8601, UTC


class DriftEvent(BaseModel):
    """The webhook's JSON for a new calibration that moved beyond its thresholds from the previous one."""

    model_config = ConfigDict(frozen=True)
    event: Literal["calibration_drift"] = "calibration_drift"
    device: str
    metric: str
    threads: int | None
    slope_change: float | None
    intercept_change: float | None
    r2_drop: float | None
    prediction_shift: float | None
    calibration_id: int | None
    previous_id: int | None
    reasons: list[str]
    at: str  # ISO 8601, UTC


AlertEvent = QuarantineEvent | DriftEvent


def quarantine_event(device: str, reason: str, *, at: float | None = None) -> QuarantineEvent:
    """The event for a device that gets no more tasks until `farm device release`."""
    return QuarantineEvent(device=device, reason=reason, at=_iso_utc(at))


def drift_event(*, device: str, metric: str, threads: int | None, slope_change: float | None,
                intercept_change: float | None, r2_drop: float | None, prediction_shift: float | None,
                calibration_id: int | None, previous_id: int | None, at: float | None = None,
                reasons: list[str] | None = None) -> DriftEvent:
    """The event for a new calibration that moved beyond its thresholds from the previous one; `reasons` say
    which threshold each figure passed, from what to what (refresh.drift_between)."""
    return DriftEvent(device=device, metric=metric, threads=threads, slope_change=slope_change,
                      intercept_change=intercept_change, r2_drop=r2_drop, prediction_shift=prediction_shift,
                      calibration_id=calibration_id, previous_id=previous_id, reasons=list(reasons or []),
                      at=_iso_utc(at))


def _redacted(url: str) -> str:
    # Hook URLs often carry their secret in the path or query: logs name only scheme and host.
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or '?'}{f':{parts.port}' if parts.port else ''}/…"


class Webhook:
    def __init__(self, url: str, *, attempts: int = 5, backoff_s: float = 0.5, timeout_s: float = 5,
                 sleep: Callable[[float], None] = time.sleep, queue_limit: int = ASYNC_QUEUE_LIMIT) -> None:
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise ValueError(f"webhook URL must be http:// or https://, got {_redacted(url)}")
        self.url = url
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self._sleep = sleep
        self.queue_limit = queue_limit
        self.dropped = 0  # events dropped because queue_limit were already waiting
        self._pending: collections.deque[AlertEvent] = collections.deque()
        self._sending = 0  # 1 while the sender thread holds an event it took off the queue
        self._pending_changed = threading.Condition()
        self._worker: threading.Thread | None = None
        self._drains_at_exit = False

    def __repr__(self) -> str:
        return f"Webhook({_redacted(self.url)}, attempts={self.attempts})"

    def send(self, event: AlertEvent) -> bool:
        """POST the event; True once the receiver answers 2xx. Never raises."""
        try:
            body = json.dumps(event.model_dump()).encode()  # json's own spacing, as a receiver has had it
        except (TypeError, ValueError) as e:
            log.error("webhook: event %r is not JSON (%s); not sent", event.event, e)
            return False
        last_error = ""
        for attempt in range(1, self.attempts + 1):
            retryable, last_error = self._post_once(body)
            if retryable is None:
                return True
            if not retryable:
                log.warning("webhook %s refused %s: %s; not retried", _redacted(self.url), event.event, last_error)
                return False
            if attempt < self.attempts:
                self._sleep(self.backoff_s * 2 ** (attempt - 1))
        log.warning("webhook %s: %s not delivered after %d attempts; last: %s",
                    _redacted(self.url), event.event, self.attempts, last_error)
        return False

    def _post_once(self, body: bytes) -> tuple[bool | None, str]:
        """(None, '') on success, else (whether to retry, what went wrong)."""
        request = urllib.request.Request(self.url, data=body, method="POST", headers={
            "Content-Type": "application/json", "User-Agent": USER_AGENT})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
                return None, ""
        except urllib.error.HTTPError as e:
            e.close()
            retry = e.code >= 500 or e.code in RETRYABLE_CLIENT_STATUSES
            return retry, f"HTTP {e.code} {e.reason}"
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # refused, reset, DNS, TLS, timeout, garbled
            return True, f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        except Exception as e:  # noqa: BLE001 — an alert must never take the controller down
            log.exception("webhook: unexpected error")
            return False, f"{type(e).__name__}: {e}"

    # --- background delivery -------------------------------------------------------------------
    def send_async(self, event: AlertEvent) -> None:
        """Queue the event for this hook's background thread (delivered in order); returns at once.

        Past queue_limit waiting events the oldest is dropped, counted in `dropped` and logged: the
        newest say most about the lab now."""
        with self._pending_changed:
            if len(self._pending) >= self.queue_limit:
                oldest = self._pending.popleft()
                self.dropped += 1
                log.warning("webhook %s: %d events waiting; dropped the oldest (%s), %d dropped so far",
                            _redacted(self.url), self.queue_limit, oldest.event, self.dropped)
            self._pending.append(event)
            self._pending_changed.notify_all()
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._deliver_forever, name="farm-webhook", daemon=True)
                self._worker.start()
                if not self._drains_at_exit:  # a short-lived `farm refresh` still delivers what it queued
                    atexit.register(self._drain_at_exit)
                    self._drains_at_exit = True

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued event was delivered or given up; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._pending_changed:
            while self._pending or self._sending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._pending_changed.wait(left)
        return True

    def _drain_at_exit(self) -> None:
        if not self.drain(EXIT_DRAIN_S):
            log.warning("webhook %s: %d event(s) not delivered before exit", _redacted(self.url),
                        len(self._pending) + self._sending)

    def _deliver_forever(self) -> None:
        while True:
            with self._pending_changed:
                while not self._pending:
                    self._pending_changed.wait()
                event = self._pending.popleft()
                self._sending = 1
            try:
                self.send(event)
            finally:
                with self._pending_changed:
                    self._sending = 0
                    self._pending_changed.notify_all()


_HOOKS: dict[str, Webhook] = {}
_HOOKS_LOCK = threading.Lock()


def alerts_from_environment() -> Webhook | None:
    """The webhook named by $FARM_WEBHOOK_URL, or None when it is unset or empty.

    One Webhook per URL in a process, so every alert waits in one queue for one sender thread."""
    url = os.environ.get(WEBHOOK_ENV, "").strip()
    if not url:
        return None
    with _HOOKS_LOCK:
        if url not in _HOOKS:
            _HOOKS[url] = Webhook(url)
        return _HOOKS[url]


def alert_quarantine(device: str, reason: str) -> None:
    """Scheduling's quarantine hook: queued, so a hook that is down never holds the caller (apply_result holds a lock)."""
    hook = alerts_from_environment()
    if hook is not None:
        hook.send_async(quarantine_event(device, reason))


__all__ = ["AlertEvent", "DriftEvent", "QuarantineEvent", "Webhook", "alert_quarantine", "alerts_from_environment", "drift_event", "quarantine_event", "WEBHOOK_ENV"]
