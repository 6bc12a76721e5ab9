"""The dashboard answers "why": a job whose runs failed for three reasons (out of memory at its limit, a
crashing script, an operator the runtime lacks) shows each class, message and its evidence; per-operator
tables render and the JSON download carries them; a partly failed job says how much got done.

A store is filled as agents would fill it (lease, then complete with the agent's own result), then
served by the dashboard in this process; Debian's chromium reads the page.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from browser import browser_fixture  # noqa: F401 (the `browser` fixture)

pytestmark = pytest.mark.timeout(180)

HOSTILE = "<script>window.pwned=1</script>"
TRACEBACK = "\n".join([f"warming up {k}" for k in range(40)] + [
    "Traceback (most recent call last):",
    '  File "train.py", line 12, in <module>',
    f"    raise ValueError('bad input {HOSTILE}')",
    f"ValueError: bad input {HOSTILE}"])


def _get(url: str) -> tuple[int, dict, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def _completed(avg: float):
    from farm.proto.op_profile import OpProfileRow
    from farm.proto.results import LatencyStats, Limits, RunResult, RunStatus, Telemetry
    return RunResult(status=RunStatus.COMPLETED, backend="process", limits=Limits(cpus=1.0, memory_mb=512), wall_s=1.0,
                     latency=LatencyStats(None, avg, avg, avg, avg, avg, avg, 0.1, avg, avg, 10),
                     telemetry=Telemetry(interval_ms=100, memory_avg_bytes=30e6, memory_peak_bytes=int(50e6)),
                     environment={"runtime": "onnxruntime"},
                     op_profile=[OpProfileRow("op_type", "Conv", avg_ms=0.7, percent=70.0, count=2),
                                 OpProfileRow("op_type", f"Relu{HOSTILE}", avg_ms=0.3, percent=30.0, count=1)])


def _failures():
    from farm.proto.results import FailureClass, Limits, RunResult
    return [
        RunResult.failed(FailureClass.RESOURCE, "out of memory at the 256 MiB limit (sim.memory); peak reached 301 MiB. "
                         "Raise sim.memory or use a smaller model/batch.", limits=Limits(cpus=1.0, memory_mb=256)),
        RunResult.failed(FailureClass.JOB, f"the script exited with status 1: ValueError: bad input {HOSTILE}",
                         limits=Limits(cpus=1.0, memory_mb=512), log_tail=TRACEBACK),
        RunResult.failed(FailureClass.JOB, "custom_op.onnx: unsupported operator FancyOp: ONNX Runtime has no kernel for "
                         "it (Could not find an implementation for FancyOp(1) node with name 'n0')",
                         limits=Limits(cpus=1.0, memory_mb=512)),
    ]


def seed_failed_job(db: Path, model: Path) -> int:
    """Four repeats of one model: one completed with an op profile, then three failures of three kinds."""
    from farm.controller.scheduling.controller import Controller
    from farm.controller.scheduling.jobfile import load_job_text
    from farm.controller.store import SQLiteStore as Store

    store = Store(db)
    controller = Controller(store)
    job_id = controller.submit(load_job_text(f"name: why\nmodels: [{model}]\nrepeats: 4\n", "job.yaml", model.parent))
    results = [_completed(5.0), *_failures()]
    while (spec := controller.lease("rack1", {"sim"}, job_id=job_id)) is not None:
        controller.complete(spec.task_id, spec.attempt, "rack1", time.time() - 1, results[spec.repeat])
    store.close()
    return job_id


@pytest.fixture
def served(tmp_path: Path, tiny_models):
    from farm.controller.scheduling.controller import Controller
    from farm.controller.store import SQLiteStore as Store
    from farm.web.server import Operator, start_dashboard

    db = tmp_path / "farm.db"
    job_id = seed_failed_job(db, tiny_models["onnx"])
    store = Store(db)
    running = start_dashboard(store, "127.0.0.1:0", Operator.embedded(Controller(store)), tokens=None)
    try:
        yield running.url, job_id, store
    finally:
        running.stop()
        store.close()


def test_the_job_page_says_why_each_run_failed_with_its_evidence(served) -> None:
    url, job_id, _ = served
    status, _, page = _get(f"{url}jobs/{job_id}")
    assert status == 200
    assert "Why 3 run(s) failed" in page
    assert "failed (resource)" in page and "limit 256 MiB · peak 301 MiB" in page
    assert "failed (job)" in page and "ValueError: bad input &lt;script&gt;" in page  # the traceback's last line
    assert "warming up 39" in page and "warming up 5\n" not in page  # the last lines of the output, not all of it
    assert "unsupported operator</dt><dd class=\"evidence\">FancyOp</dd>" in page
    assert HOSTILE not in page  # every string from an agent is text
    # a job with runs done and runs failed says both, not just "failed"
    assert "1/4 done, 3 failed" in page and 'class="status partial"' in page
    listing = _get(f"{url}jobs")[2]
    assert "1/4 done, 3 failed" in listing


def test_op_tables_render_and_the_json_download_carries_them(served) -> None:
    url, job_id, store = served
    page = _get(f"{url}jobs/{job_id}")[2]
    assert "Per-operator profiles" in page and 'id="ops-0"' in page and ">Conv<" in page
    status, headers, body = _get(f"{url}jobs/{job_id}/results.json")
    assert status == 200
    records = json.loads(body)
    completed = [r for r in records if r["status"] == "completed"]
    assert [op["node_type"] for op in completed[0]["op_profile"]] == ["Conv", f"Relu{HOSTILE}"]
    failed = {r["failure_class"] for r in records if r["status"] == "failed"}
    assert failed == {"resource", "job"}


def test_failure_reason_and_op_table_in_the_browser(served, browser) -> None:
    url, job_id, _ = served
    browser.get(f"{url}jobs/{job_id}")
    section = browser.find("section.failure")
    assert section.is_displayed()
    text = browser.text()
    assert "failed (resource)" in text and "limit 256 MiB · peak 301 MiB" in text
    assert f"ValueError: bad input {HOSTILE}" in text  # shown as text
    assert "FancyOp" in text and "1/4 done, 3 failed" in text
    rows = browser.find_all("#ops-0 tbody tr")
    assert len(rows) == 2 and "Conv" in rows[0].text
    # the results table links each failed run to its explanation
    browser.find("#results a.why").click()
    browser.wait(lambda d: "#failure-" in d.current_url, "the jump to the reason")
    assert browser.driver.execute_script("return window.pwned === undefined;"), "a message ran as code"


def test_a_retried_run_says_its_attempt_was_a_contention_retry(tmp_path: Path, tiny_models) -> None:
    from farm.controller.scheduling.controller import Controller
    from farm.controller.scheduling.jobfile import load_job_text
    from farm.controller.store import SQLiteStore as Store
    from farm.proto.results import Contention
    from farm.web.server import Operator, start_dashboard

    model = tiny_models["onnx"]
    store = Store(tmp_path / "farm.db")
    controller = Controller(store)
    job_id = controller.submit(load_job_text(f"name: busy-host\nmodels: [{model}]\nsim: {{on_contention: retry}}\n",
                                             "job.yaml", model.parent))
    attempts = 0
    while (spec := controller.lease("rack1", {"sim"}, job_id=job_id)) is not None:
        attempts += 1
        result = _completed(5.0)
        if spec.attempt < 3:  # the first two were contended: measured again
            result.contention = Contention(contended=True, reasons=["steal 30 % of the run's wall time"])
        controller.complete(spec.task_id, spec.attempt, "rack1", time.time() - 1, result)
    assert attempts == 3
    running = start_dashboard(store, "127.0.0.1:0", Operator.embedded(controller), tokens=None)
    try:
        page = _get(f"{running.url}jobs/{job_id}")[2]
    finally:
        running.stop()
        store.close()
    assert ">attempt 3</abbr>" in page and "2 contention retries (other work used the run&#x27;s cores" in page


def test_pairs_get_a_scatter_with_the_devices_calibration_band_and_predictions_sit_beside_runs(tmp_path: Path) -> None:
    from farm.controller.analysis.calibration import Pair
    from farm.controller.analysis.calibrations import CalibrationSource, PairedRun, fit_and_store
    from farm.controller.store import SQLiteStore as Store
    from farm.web import pages, svg
    from farm.web.views import pair_charts

    store = Store(tmp_path / "farm.db")
    paired = [PairedRun(Pair(f"net-{k}", 4.0 + 3 * k, 2.0 * (4.0 + 3 * k) + 1 + (0.3 if k % 2 else -0.3)), 2,
                        "litert", 0, 0) for k in range(6)]
    stored, refused = fit_and_store(store, "pixel-7", "latency", paired, source=CalibrationSource(job=0))
    assert stored, refused

    from farm.controller.analysis.results import RunPair
    from farm.proto.questions import RunModel, RunRecord
    from run_records import run_record

    def run(target: str, avg: float) -> RunRecord:
        return run_record(target=target, latency_ms={"avg": avg}, runtime="litert", peak_memory_mb=10.0,
                          contention=None)
    pairs = [RunPair(pair_key=f"p{k}", model=RunModel(name=f"m<{k}>", sha256="", family=None, path=None,
                                                      size_bytes=None, param_count=None),
                     device="pixel-7", threads=2, batch_size=1, input_size=None, repeat=0, sim=run("sim", 5.0 + k),
                     device_run=run("pixel-7", 11.0 + 2 * k)) for k in range(3)]
    pairs.append(pairs[0].model_copy(update={"device": "uncalibrated-phone"}))
    charts = pair_charts(store, pairs)
    assert [c.title for c in charts] == ["pixel-7 · 2 thread(s): device vs sim latency",
                                         "uncalibrated-phone · 2 thread(s): device vs sim latency"]
    calibrated = svg.render(charts[0])
    assert calibrated.count('class="point"') == 3 and 'class="band"' in calibrated and "calibration v1" in calibrated
    assert "&lt;0&gt;" in calibrated and "<0>" not in calibrated.replace("<title>", "")
    assert 'class="band"' not in svg.render(charts[1]) and "no latency calibration" in charts[1].note

    record = run_record(model={"name": "net-9"}, threads=2, repeat=0, latency_ms={"avg": 7.0},
                        predictions={"pixel-7": {"latency": {"estimate": 15.2, "low": 14.1, "high": 16.3, "version": 1,
                                                             "same_sim_budget": False}}, "<phone>": None})
    html = pages.predictions_table([record])
    assert "15.2" in html and "14.1 – 16.3 (calibrated under another sim budget)" in html
    assert "no calibration" in html and "&lt;phone&gt;" in html
    store.close()
