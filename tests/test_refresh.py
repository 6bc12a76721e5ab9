"""Two quiet refreshes, then the phone gets twice as slow (its timings double): the third
refresh writes a new calibration version, reports drift, quarantines the phone because its
golden results left their history, and tells a real webhook; a user job then gets no run on it."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from adb_emulator import AdbDeviceEmulator, EmulatedPhone
from conftest import write_job
from farm.agents.android.adb import load_or_create_lab_key
from farm.models.facts import inspect_model
from farm.controller.operations.reference_suite import bundled_suite_text
from farm.model_generators.generate import generate_examples

WIDTHS = (0.35, 0.5, 0.75, 1.0, 1.4)


def _timings(us: float) -> dict[str, float]:
    return {"init": 20000, "first": us * 1.3, "warmup_avg": us * 1.05, "avg": us, "std": us * 0.01, "min": us * 0.97,
            "max": us * 1.05, "median": us, "p5": us * 0.98, "p95": us * 1.03, "memory_init_mb": 5.0,
            "memory_overall_mb": 20.0}


@pytest.fixture
def webhook() -> Iterator[list[dict]]:
    received: list[dict] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    received.append({"url": f"http://127.0.0.1:{server.server_address[1]}/hook"})
    yield received
    server.shutdown()


def test_a_slower_phone_drifts_and_is_quarantined(tmp_path: Path, farm, webhook: list[dict]) -> None:
    suite_dir = tmp_path / "suite"
    suite_dir.mkdir()
    suite = suite_dir / "reference-suite.yaml"
    # the drift rules are the point, not the sim's precision: 10 timed iterations, not 50 (three refreshes of 5
    # models), and a contended sim twin kept (flagged, --include-contended) instead of measured up to 3 times
    text = bundled_suite_text().replace("threads: [1, 2]", "threads: [1]")
    assert "iterations: 50, warmup: 5" in text
    suite.write_text(text.replace("iterations: 50, warmup: 5", "iterations: 10, warmup: 2") + "sim: {on_contention: flag}\n")
    models = generate_examples(suite_dir / "models", widths=list(WIDTHS), input_sizes=[160], formats=("tflite",), zoo=False)
    # the phone's speed: proportional to each model's MACs, like a real device's
    facts = [inspect_model(m.path) for m in models]  # one parse of each file
    table = {f.sha256: _timings(f.macs / 60) for f in facts}

    key = tmp_path / "adbkey"
    load_or_create_lab_key(key)
    with AdbDeviceEmulator(tmp_path / "phone", phone=EmulatedPhone(benchmark_us=table),
                           authorized_keys=[Path(f"{key}.pub").read_text()]) as phone:
        lab = tmp_path / "lab.yaml"
        lab.write_text(f"devices:\n  - {{name: g6-1, driver: android, type: lg-g6, host: 127.0.0.1, "
                       f"port: {phone.port}, adb_key: {key}}}\n")
        env = {"FARM_WEBHOOK_URL": webhook[0]["url"]}
        # Thresholds well above this VM's quiet-night noise (the sim side moves up to ~20 %) and
        # well below what a halved device does (about +100 %).
        loose = ["--include-contended", "--max-slope-change", "0.5", "--max-prediction-shift", "0.5", "--max-intercept-change", "0.5",
                 "--max-r2-drop", "0.2"]
        for _ in range(2):
            quiet = farm("refresh", "--suite", str(suite), "--devices", str(lab), "--json", *loose, env=env)
            assert quiet.returncode == 0, quiet.stderr
        assert not any(d["exceeded"] for d in quiet.json()["drift"]), [d["reasons"] for d in quiet.json()["drift"]]
        passed = {d["name"]: d for d in farm("devices", "--devices", str(lab), "--json").json()}["g6-1"]
        assert passed["health"] == "good", passed  # passing refreshes leave it good, not "health unknown"

        config = phone.device_path("/system/benchmark_model.json")
        slowed = json.loads(config.read_text())
        slowed["timings"] = {sha: _timings(t["avg"] * 2) for sha, t in table.items()}
        config.write_text(json.dumps(slowed))  # the phone now runs at half speed
        third = farm("refresh", "--suite", str(suite), "--devices", str(lab), "--json", *loose, env=env)

    assert third.returncode == 1, third.stderr
    report = third.json()
    assert [c["version"] for c in report["calibrations"] if c["family"] is None] == [3]
    drift = report["drift"][0]
    assert drift["exceeded"] and drift["slope_change"] > 0.5
    assert "g6-1" in report["quarantined"]
    events = {e.get("event"): e for e in webhook[1:]}
    assert events["calibration_drift"]["device"] == "g6-1"
    assert events["device_quarantined"]["device"] == "g6-1" and "history" in events["device_quarantined"]["reason"]

    listed = {d["name"]: d for d in farm("devices", "--devices", str(lab), "--json").json()}
    assert listed["g6-1"]["health"] == "bad" and listed["g6-1"]["last_check"] is not None
    assert 0 <= listed["g6-1"]["calibration_age_s"] < 600

    # the controller's metrics endpoint, scraped by a real HTTP client, shows the same
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from farm.controller.operations.metrics import start_metrics_server
    from farm.controller.store import SQLiteStore as Store
    server, port = start_metrics_server(Store(tmp_path / "farm.db"), "127.0.0.1", 0)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("farm_device_health", (("device", "g6-1"), ("health", "bad")))] == 1
    assert samples[("farm_calibration_drift_exceeded", (("device", "g6-1"), ("metric", "latency"), ("threads", "1")))] == 1

    history = farm("drift", "--device", "g6-1", "--json").json()
    assert [bool(r["exceeded"]) for r in history] == [False, True]

    # a user job is not scheduled on the quarantined phone (its sim twin still runs)
    job = write_job(tmp_path, f"models: [{models[0].path}]\nworkload: {{type: benchmark, iterations: 5}}\n"
                              "targets: [g6-1]\n", "user.yaml")
    user = farm("submit", str(job), "--devices", str(lab), "--json")
    device_run = next(r for r in user.json()["results"] if r["target"] == "g6-1")
    assert device_run["attempts"] == 0 and "quarantined" in device_run["message"]


def test_a_stale_device_gets_a_health_check_before_user_work(tmp_path: Path, farm) -> None:
    suite_dir = tmp_path / "suite"
    suite_dir.mkdir()
    suite = suite_dir / "reference-suite.yaml"
    suite.write_text(bundled_suite_text().replace("threads: [1, 2]", "threads: [1]").replace("iterations: 50", "iterations: 10")
                     + "sim: {on_contention: flag}\n")  # a contended sim twin kept, not measured again: the check is the point
    key = tmp_path / "adbkey"
    load_or_create_lab_key(key)
    with AdbDeviceEmulator(tmp_path / "phone", authorized_keys=[Path(f"{key}.pub").read_text()]) as phone:
        lab = tmp_path / "lab.yaml"
        lab.write_text(f"devices:\n  - {{name: g6-1, driver: android, type: lg-g6, host: 127.0.0.1, "
                       f"port: {phone.port}, adb_key: {key}}}\n")
        env = {"FARM_REFERENCE_SUITE": str(suite)}
        assert farm("refresh", "--devices", str(lab), "--quiet", "--include-contended", env=env).returncode == 0
        model = suite_dir / "models" / "mobilenetv2_w0.5_r160.tflite"
        job = write_job(tmp_path, f"models: [{model}]\nworkload: {{type: benchmark, iterations: 5}}\ntargets: [g6-1]\n",
                        "user.yaml")
        fresh = farm("submit", str(job), "--devices", str(lab), "--json", env=env)  # checked seconds ago: no check
        assert fresh.returncode == 0, fresh.stderr
        stale = farm("submit", str(job), "--devices", str(lab), "--json", env={**env, "FARM_HEALTH_MAX_AGE_H": "0.0001"})
        assert stale.returncode == 0, stale.stderr
    names = [j["name"] for j in reversed(farm("jobs", "--json").json())]
    assert names == ["reference-suite", "user", "reference-suite", "user"]
