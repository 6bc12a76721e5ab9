"""Metrics and alerts over real sockets: the webhook is received by a ThreadingHTTPServer on
127.0.0.1 (retried on 503, not on 400), and the Prometheus endpoint is scraped with urllib and
parsed with prometheus_client's own text parser. Real SQLite store, real Controller."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from farm import __version__
from farm.controller.operations.alerts import Webhook, alerts_from_environment, drift_event, quarantine_event
from farm.controller.scheduling.controller import Controller
from farm.controller.scheduling.jobfile import load_job_text
from farm.controller.operations.metrics import lease_expiries_total, parse_listen, start_metrics_server
from farm.controller.store import SQLiteStore as Store


# --- a webhook receiver ------------------------------------------------------------------------
@dataclass
class ReceivedRequest:
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class HookReceiver:
    """Answers POSTs with the scripted statuses in order (then 200), recording each request."""

    url: str
    statuses: list[int]
    delay_s: float = 0.0
    requests: list[ReceivedRequest] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


@pytest.fixture
def hook() -> Iterator[HookReceiver]:
    receiver = HookReceiver(url="", statuses=[])

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 — http.server's naming
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with receiver.lock:
                receiver.requests.append(ReceivedRequest(self.path, dict(self.headers), body))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
            time.sleep(receiver.delay_s)
            self.send_response(status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, format: str, *args: Any) -> None:
            pass  # keep pytest's output to the assertions

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    receiver.url = f"http://127.0.0.1:{server.server_port}/hooks/farm?token=s3cret"
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- webhook -----------------------------------------------------------------------------------
def test_webhook_retries_503_with_backoff_then_delivers(hook: HookReceiver) -> None:
    hook.statuses = [503, 503]
    slept: list[float] = []
    webhook = Webhook(hook.url, attempts=5, backoff_s=0.01, sleep=lambda s: (slept.append(s), time.sleep(s)))
    event = quarantine_event("pixel-1", "golden latency 4.1σ above its history", at=1_700_000_000)
    assert webhook.send(event) is True
    assert len(hook.requests) == 3  # two 503s, then the 200
    assert slept == [0.01, 0.02]  # exponential backoff between attempts, none after the success
    for request in hook.requests:
        assert request.path == "/hooks/farm?token=s3cret"
        assert request.headers["Content-Type"] == "application/json"
        assert request.headers["User-Agent"] == f"farm/{__version__}"
        assert request.body == {"event": "device_quarantined", "device": "pixel-1",
                                "reason": "golden latency 4.1σ above its history", "at": "2023-11-14T22:13:20Z"}


def test_webhook_does_not_retry_a_400(hook: HookReceiver, caplog: pytest.LogCaptureFixture) -> None:
    hook.statuses = [400]
    webhook = Webhook(hook.url, attempts=5, backoff_s=0.01)
    with caplog.at_level(logging.WARNING, logger="farm.controller.operations.alerts"):
        assert webhook.send(quarantine_event("pixel-1", "x")) is False
    assert len(hook.requests) == 1
    assert "HTTP 400" in caplog.text and "not retried" in caplog.text
    assert "s3cret" not in caplog.text  # the hook's secret stays out of the logs


def test_webhook_gives_up_after_all_attempts_without_raising(hook: HookReceiver,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    hook.statuses = [500, 502, 503]
    webhook = Webhook(hook.url, attempts=3, backoff_s=0.001)
    with caplog.at_level(logging.WARNING, logger="farm.controller.operations.alerts"):
        assert webhook.send(quarantine_event("pixel-1", "x")) is False
    assert len(hook.requests) == 3
    assert "not delivered after 3 attempts" in caplog.text and "HTTP 503" in caplog.text


def test_webhook_retries_connection_errors_and_returns_false() -> None:
    slept: list[float] = []
    webhook = Webhook(f"http://127.0.0.1:{_closed_port()}/hook", attempts=4, backoff_s=0.001, timeout_s=2,
                      sleep=slept.append)
    assert webhook.send(quarantine_event("pixel-1", "x")) is False
    assert slept == [0.001, 0.002, 0.004]  # four attempts: refused each time


def test_send_async_does_not_wait_for_a_slow_hook_and_keeps_order(hook: HookReceiver) -> None:
    hook.delay_s = 0.4
    webhook = Webhook(hook.url, backoff_s=0.01)
    started = time.monotonic()
    webhook.send_async(quarantine_event("pixel-1", "first"))
    webhook.send_async(quarantine_event("pixel-2", "second"))
    assert time.monotonic() - started < 0.2  # the scheduler's thread is not held by the hook
    assert webhook.drain(10)
    assert [r.body["reason"] for r in hook.requests] == ["first", "second"]


def test_drift_event_carries_the_comparison(hook: HookReceiver) -> None:
    event = drift_event(device="pixel-1", metric="latency_avg_ms", threads=2, slope_change=0.95,
                        intercept_change=0.1, r2_drop=0.02, prediction_shift=0.97, calibration_id=8, previous_id=5,
                        at=1_700_000_000.5)
    assert Webhook(hook.url).send(event)
    assert hook.requests[0].body == {
        "event": "calibration_drift", "device": "pixel-1", "metric": "latency_avg_ms", "threads": 2,
        "slope_change": 0.95, "intercept_change": 0.1, "r2_drop": 0.02, "prediction_shift": 0.97,
        "calibration_id": 8, "previous_id": 5, "reasons": [], "at": "2023-11-14T22:13:20Z"}


def test_alerts_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FARM_WEBHOOK_URL", raising=False)
    assert alerts_from_environment() is None
    monkeypatch.setenv("FARM_WEBHOOK_URL", "https://hooks.example/abc")
    webhook = alerts_from_environment()
    assert webhook is not None and webhook.url == "https://hooks.example/abc"
    assert "abc" not in repr(webhook)
    monkeypatch.setenv("FARM_WEBHOOK_URL", "ftp://nope")
    with pytest.raises(ValueError, match="http"):
        alerts_from_environment()


# --- metrics -----------------------------------------------------------------------------------
def _scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """GET /metrics like Prometheus does; {sample name: [(labels, value)]}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def _value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    matches = [v for got, v in samples.get(name, []) if all(got.get(k) == want for k, want in labels.items())]
    assert len(matches) == 1, f"{name}{labels}: {samples.get(name)}"
    return matches[0]


@pytest.fixture
def lab(tmp_path: Path, tiny_models: dict[str, Path]) -> Controller:
    """A store with a normal job (2 sim tasks), a low-priority one (1 task), a registered device
    that was never judged, a quarantined phone and a calibration fitted two minutes ago."""
    controller = Controller(Store(tmp_path / "farm.db"), lease_ttl_s=0.05)
    model = tiny_models["tflite"]
    controller.submit(load_job_text(f"models: [{model}]\nmatrix: {{threads: [1, 2]}}\n", "job.yaml", tmp_path))
    controller.submit(load_job_text(f"models: [{model}]\npriority: low\n", "nightly.yaml", tmp_path))
    store = controller.store
    with store.transaction():
        store.db["devices"].insert({"name": "rack1/sim", "agent": "rack1", "driver": "sim", "state": "online"})
        store.db["devices"].insert({"name": "pixel-1", "agent": "rack1", "driver": "android", "state": "online"})
        store.db["calibrations"].insert({
            "device": "pixel-1", "metric": "latency_avg_ms", "threads": 1, "runtime": "tflite", "family": "",
            "version": 1, "created_at": time.time() - 120, "kind": "linear", "n": 5, "a": 2.0, "b": 0.5})
    controller.quarantine("pixel-1", "golden latency 4.1σ above its history")
    return controller


def test_metrics_endpoint_serves_the_store(lab: Controller) -> None:
    store = lab.store
    # One lease is lost (the agent went silent), one task is running, the rest wait.
    expiries_before = lease_expiries_total()
    lost = lab.lease("gone-agent", {"sim"})
    time.sleep(0.1)
    assert lab.expire_leases() == 1
    assert lease_expiries_total() == expiries_before + 1
    assert lab.lease("rack1", {"sim"}).task_id == lost.task_id
    if "calibration_drift" not in store.db.table_names():  # until the drift check's migration lands
        store.db["calibration_drift"].create({
            "id": int, "device": str, "metric": str, "threads": int, "calibration_id": int, "previous_id": int,
            "slope_change": float, "intercept_change": float, "r2_drop": float, "prediction_shift": float,
            "exceeded": int, "created_at": float}, pk="id")
    now = time.time()
    with store.transaction():
        store.db["calibration_drift"].insert_all([
            {"device": "pixel-1", "metric": "latency_avg_ms", "threads": 1, "prediction_shift": 0.02, "exceeded": 0,
             "created_at": now - 86400},
            {"device": "pixel-1", "metric": "latency_avg_ms", "threads": 1, "prediction_shift": 0.95, "exceeded": 1,
             "created_at": now}])

    server, port = start_metrics_server(store, "127.0.0.1", 0)
    try:
        assert port > 0 and server.port == port
        samples = _scrape(port)
    finally:
        server.shutdown()

    assert _value(samples, "farm_queue_depth", priority="normal") == 1  # 2 tasks, 1 of them running
    assert _value(samples, "farm_queue_depth", priority="low") == 1
    assert _value(samples, "farm_queue_depth", priority="interactive") == 0
    assert _value(samples, "farm_tasks", state="pending") == 2
    assert _value(samples, "farm_tasks", state="running") == 1
    assert _value(samples, "farm_tasks", state="failed") == 0
    assert _value(samples, "farm_lease_expiries_total") >= 1
    assert _value(samples, "farm_device_health", device="pixel-1", health="bad") == 1
    assert _value(samples, "farm_device_health", device="pixel-1", health="good") == 0
    assert _value(samples, "farm_device_health", device="rack1/sim", health="unknown") == 1
    assert 119 < _value(samples, "farm_calibration_age_seconds", device="pixel-1", metric="latency_avg_ms") < 600
    # The newest drift check is the one shown.
    assert _value(samples, "farm_calibration_drift_prediction_shift", device="pixel-1", metric="latency_avg_ms",
                  threads="1") == pytest.approx(0.95)
    assert _value(samples, "farm_calibration_drift_exceeded", device="pixel-1", metric="latency_avg_ms") == 1

    # Stopped means stopped: the port no longer answers.
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_release_shows_at_the_next_scrape_and_no_drift_table_means_no_drift_metrics(lab: Controller) -> None:
    store = lab.store
    with store.transaction():
        store.db.execute("DROP TABLE IF EXISTS calibration_drift")
    server, port = start_metrics_server(store, "127.0.0.1", 0)
    try:
        assert _value(_scrape(port), "farm_device_health", device="pixel-1", health="bad") == 1
        lab.release("pixel-1")
        samples = _scrape(port)
    finally:
        server.shutdown()
    assert _value(samples, "farm_device_health", device="pixel-1", health="good") == 1
    assert _value(samples, "farm_device_health", device="pixel-1", health="bad") == 0
    assert not any(name.startswith("farm_calibration_drift") for name in samples)


def test_metrics_registry_is_not_the_global_one(lab: Controller) -> None:
    from prometheus_client import REGISTRY
    server, _ = start_metrics_server(lab.store, "127.0.0.1", 0)
    server.shutdown()
    assert REGISTRY.get_sample_value("farm_tasks", {"state": "pending"}) is None
    assert server.registry.get_sample_value("farm_tasks", {"state": "pending"}) == 3


def test_last_health_check_is_exported_once_a_reference_suite_ran(lab: Controller) -> None:
    from farm.controller.operations.metrics import metrics_registry
    registry = metrics_registry(lab.store)
    assert registry.get_sample_value("farm_device_last_health_check_timestamp_seconds", {"device": "pixel-1"}) is None
    with lab.store.transaction():  # a completed reference-suite run on the phone is its health check
        job = lab.store.db["jobs"].insert({"name": "reference-suite", "kind": "health_check",
                                           "status": "completed"}).last_pk
        lab.store.db["tasks"].insert({"job_id": job, "seq": 0, "target": "pixel-1", "status": "completed",
                                      "finished_at": 1_700_000_000})
    value = registry.get_sample_value("farm_device_last_health_check_timestamp_seconds", {"device": "pixel-1"})
    assert value == 1_700_000_000


@pytest.mark.parametrize("listen, expected", [
    ("127.0.0.1:9464", ("127.0.0.1", 9464)), ("[::1]:0", ("::1", 0)), (":7444", ("127.0.0.1", 7444)),
    ("0.0.0.0:7444", ("0.0.0.0", 7444))])
def test_parse_listen(listen: str, expected: tuple[str, int]) -> None:
    assert parse_listen(listen) == expected


@pytest.mark.parametrize("listen", ["localhost", "host:http", "1.2.3.4:70000"])
def test_parse_listen_refuses(listen: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_listen(listen)


def test_grpc_serve_starts_and_stops_the_metrics_endpoint(lab: Controller) -> None:
    from farm.controller.grpc_server import serve
    running = serve(lab.store, "127.0.0.1:0", tokens=None, metrics_listen="127.0.0.1:0")
    try:
        assert running.metrics_port and running.metrics_port != running.port
        assert _value(_scrape(running.metrics_port), "farm_device_health", device="pixel-1", health="bad") == 1
    finally:
        running.stop(grace_s=0.5)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{running.metrics_port}/metrics", timeout=2)


def test_farm_controller_serve_metrics_listen(tmp_path: Path) -> None:
    """`farm controller serve --metrics-listen` as an operator runs it; SIGTERM stops both ports."""
    process = subprocess.Popen(
        [sys.executable, "-m", "farm.cli.main", "controller", "serve", "--no-auth", "--listen", "127.0.0.1:0",
         "--metrics-listen", "127.0.0.1:0", "--db", str(tmp_path / "farm.db")],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env={**os.environ, "FARM_DB": ""})
    try:
        metrics_port = None
        deadline = time.monotonic() + 60
        while metrics_port is None and time.monotonic() < deadline:
            line = process.stderr.readline()
            if not line:
                pytest.fail(f"the controller exited ({process.wait()})")
            found = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", line)
            metrics_port = int(found.group(1)) if found else None
        assert metrics_port, "the controller never printed its metrics address"
        assert _value(_scrape(metrics_port), "farm_tasks", state="pending") == 0
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def test_farm_controller_serve_refuses_a_bad_metrics_address(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "farm.cli.main", "controller", "serve", "--no-auth", "--listen", "127.0.0.1:0",
         "--metrics-listen", "nonsense", "--db", str(tmp_path / "farm.db")],
        capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "HOST:PORT" in result.stderr
