"""Drift compares like with like (issue 32): a calibration fitted by hand is no baseline for a refresh, so the
first refresh after it raises nothing (4 of 4 false alerts before); two refreshes of an unchanged device raise
nothing; when drift fires, each reason says what moved, from what to what, against which version."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from adb_emulator import AdbDeviceEmulator, EmulatedPhone
from grpc_processes import wait_for
from farm.agents.android.adb import load_or_create_lab_key
from farm.controller.operations.reference_suite import bundled_suite_text
from farm.model_generators.generate import generate_examples
from farm.models.facts import inspect_model

WIDTHS = (0.35, 0.5, 0.75, 1.0, 1.4)


def _timings(us: float) -> dict[str, float]:
    return {"init": 20000, "first": us * 1.3, "warmup_avg": us * 1.05, "avg": us, "std": us * 0.01, "min": us * 0.97,
            "max": us * 1.05, "median": us, "p5": us * 0.98, "p95": us * 1.03, "memory_init_mb": 5.0,
            "memory_overall_mb": 20.0}


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[dict]]]:
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
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", received
    server.shutdown()


def test_a_hand_made_calibration_is_no_baseline_and_an_unchanged_device_raises_nothing(
        tmp_path: Path, farm_inprocess, webhook) -> None:
    url, received = webhook
    suite_dir = tmp_path / "suite"
    suite_dir.mkdir()
    suite = suite_dir / "reference-suite.yaml"
    # the drift rules are the point, not the sim's precision: 10 timed iterations, not 50 (three refreshes of 5 models)
    text = bundled_suite_text().replace("threads: [1, 2]", "threads: [1]")
    assert "iterations: 50, warmup: 5" in text
    suite.write_text(text.replace("iterations: 50, warmup: 5", "iterations: 10, warmup: 2") + "sim: {on_contention: flag}\n")
    models = generate_examples(suite_dir / "models", widths=list(WIDTHS), input_sizes=[160], formats=("tflite",),
                               zoo=False)
    facts = [inspect_model(m.path) for m in models]  # one parse of each file
    table = {f.sha256: _timings(f.macs / 60) for f in facts}
    key = tmp_path / "adbkey"
    load_or_create_lab_key(key)
    env = {"FARM_WEBHOOK_URL": url, "FARM_HEALTH_MAX_AGE_H": "0"}
    loose = ["--include-contended", "--max-slope-change", "0.5", "--max-prediction-shift", "0.5", "--max-intercept-change", "0.5",
             "--max-r2-drop", "0.2"]
    with AdbDeviceEmulator(tmp_path / "phone", phone=EmulatedPhone(benchmark_us=table),
                           authorized_keys=[Path(f"{key}.pub").read_text()]) as phone:
        lab = tmp_path / "lab.yaml"
        lab.write_text(f"devices:\n  - {{name: g6-1, driver: android, type: lg-g6, host: 127.0.0.1, "
                       f"port: {phone.port}, adb_key: {key}}}\n")
        # a person's own calibration first: their job, at another workload, fitted by hand
        mine = tmp_path / "mine.yaml"
        mine.write_text(f"name: mine\nmodels: [{', '.join(str(m.path) for m in models)}]\n"
                        "workload: {type: benchmark, iterations: 4, warmup: 1}\ntargets: [g6-1]\n"
                        "sim: {on_contention: flag}\n")
        assert farm_inprocess("submit", str(mine), "--devices", str(lab), "--quiet", env=env).returncode == 0
        fitted = farm_inprocess("calibrate", "--job", "1", "--device", "g6-1", "--json", "--include-contended", env=env)
        assert fitted.returncode == 0, fitted.stderr

        first = farm_inprocess("refresh", "--suite", str(suite), "--devices", str(lab), "--json", *loose, env=env)
        assert first.returncode == 0, first.stderr
        assert [c["version"] for c in first.json()["calibrations"] if c["family"] is None] == [2]  # v1: by hand
        assert first.json()["drift"] == []  # the hand-made version is no baseline: nothing compared, nothing raised
        second = farm_inprocess("refresh", "--suite", str(suite), "--devices", str(lab), "--json", *loose, env=env)
        assert second.returncode == 0, second.stderr
        (drift,) = second.json()["drift"]  # an earlier refresh of the same models, the same kind of fit
        assert not drift["exceeded"], drift["reasons"]

        config = phone.device_path("/system/benchmark_model.json")
        slowed = json.loads(config.read_text())
        slowed["timings"] = {sha: _timings(t["avg"] * 2) for sha, t in table.items()}
        config.write_text(json.dumps(slowed))  # the phone now runs at half speed
        third = farm_inprocess("refresh", "--suite", str(suite), "--devices", str(lab), "--json", *loose, env=env)
    (drift,) = third.json()["drift"]
    assert drift["exceeded"]
    slope = next(r for r in drift["reasons"] if r.startswith("slope_change"))
    assert "slope " in slope and " → " in slope and "5 model(s) both measured" in slope and "v3 → v4" in slope, slope
    wait_for(lambda: any(e.get("event") == "calibration_drift" for e in received), 30, "the drift alert")
    alerts = [e for e in received if e.get("event") == "calibration_drift"]
    assert len(alerts) == 1 and alerts[0]["reasons"] == drift["reasons"]  # the alert says why it fired
