"""Alerts never hold the controller: a webhook that hangs (a real local HTTP server that reads
the request and never answers) does not delay a result's acknowledgement over gRPC, and a
hook that stays down loses the oldest queued events first, counting them."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

from farm.agents.link.remote_controller import AgentDevice, RemoteController
from farm.controller.operations.alerts import Webhook, alerts_from_environment, quarantine_event
from farm.controller.grpc_server import serve
from farm.controller.scheduling.jobfile import DeviceTarget, load_job_text
from farm.controller.scheduling.schedule import MAX_ATTEMPTS
from farm.controller.store import SQLiteStore as Store
from farm.proto.results import FailureClass, RunResult


class HangingHook:
    """Reads each POST, then answers only once `answer` is set (never, unless the test says so)."""

    def __init__(self) -> None:
        self.answer = threading.Event()
        self.received: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 — http.server's naming
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with hook.lock:
                    hook.received.append(body)
                hook.answer.wait()
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def count(self) -> int:
        with self.lock:
            return len(self.received)

    def close(self) -> None:
        self.answer.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hanging_hook() -> Iterator[HangingHook]:
    hook = HangingHook()
    yield hook
    hook.close()


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_hanging_webhook_does_not_delay_the_result_ack(tmp_path: Path, tiny_models: dict[str, Path],
                                                          hanging_hook: HangingHook,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FARM_WEBHOOK_URL", hanging_hook.url)
    store = Store(tmp_path / "farm.db")
    running = serve(store, "127.0.0.1:0", tokens=None, lease_ttl_s=30)
    agent = RemoteController(f"127.0.0.1:{running.port}", name="rack", token=None, artifact_dir=tmp_path / "cache",
                             devices=[AgentDevice("pixel-1", "android", "lg-g6")]).start()
    try:
        job = load_job_text(f"models: [{tiny_models['tflite']}]\ntargets: [pixel-1]\n", "job.yaml", tmp_path,
                            devices=[DeviceTarget("pixel-1")])
        running.farm.files.store.add_file(tiny_models["tflite"])  # agents fetch models from the controller's store
        running.farm.controller.submit(job)
        running.farm.wake(queue_changed=True)
        lost = RunResult.failed(FailureClass.INFRASTRUCTURE, "adb: device offline")
        for attempt in range(1, MAX_ATTEMPTS + 1):  # the last infrastructure failure quarantines the phone
            task = agent.lease("rack", {"pixel-1"})
            assert task is not None and task.attempt == attempt
            agent.complete(task.task_id, task.attempt, "rack", time.time(), lost)
            # A blocking send would hold apply_result for every attempt × 5 s timeout (25 s and more).
            assert agent.wait_for_acks(15), f"the result of attempt {attempt} was not acknowledged"
        assert store.query("SELECT health FROM device_health WHERE name = 'pixel-1'") == [{"health": "bad"}]
        # The alert did go out (off the lock), and the hook has still not answered it.
        _wait(lambda: hanging_hook.count() >= 1, 15, "the quarantine alert to reach the hook")
        assert not hanging_hook.answer.is_set()
        assert hanging_hook.count() < 5, "every retry happened before the ack: the send held the result"
        assert hanging_hook.received[0]["event"] == "device_quarantined"
        assert hanging_hook.received[0]["device"] == "pixel-1"
        hanging_hook.answer.set()
        webhook = alerts_from_environment()
        assert webhook is not None and webhook.drain(30)
    finally:
        agent.close()
        running.stop()


def test_a_full_queue_drops_the_oldest_events_and_counts_them(hanging_hook: HangingHook,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    webhook = Webhook(hanging_hook.url, queue_limit=2)
    webhook.send_async(quarantine_event("d0", "in flight"))
    _wait(lambda: hanging_hook.count() == 1, 15, "the first event to be in flight")
    for i in range(1, 5):  # d1..d4 wait; the queue holds 2, so d1 and d2 are dropped
        webhook.send_async(quarantine_event(f"d{i}", "waiting"))
    # every call returned while the hook still hangs on d0: a full queue never blocks the caller
    assert hanging_hook.count() == 1 and not hanging_hook.answer.is_set()
    assert webhook.dropped == 2
    assert "dropped the oldest" in caplog.text and "2 dropped so far" in caplog.text
    assert "/hook" not in caplog.text  # the URL's path (often its secret) is not logged
    hanging_hook.answer.set()
    assert webhook.drain(30)
    assert [e["device"] for e in hanging_hook.received] == ["d0", "d3", "d4"]
