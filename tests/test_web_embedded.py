"""`farm web --db`: the dashboard over a local store — open on loopback, HTTPS with a certificate,
a job page with its averages, sweeps and downloads — and the pieces it is drawn with."""

from __future__ import annotations

import json
import math
import re
import ssl
import time
from datetime import datetime
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from browser import browser_fixture  # noqa: F401 (the `browser` fixture)
from grpc_processes import Cluster, wait_for
from test_grpc_security import _write_certificates

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def cluster(tmp_path: Path):
    c = Cluster(tmp_path, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(tmp_path / "none.toml")})
    yield c
    c.stop_all()


def _dashboard_url(proc) -> str:
    def ready() -> str | None:
        if not proc.alive():
            raise AssertionError(f"farm web exited: {proc.output()}")
        m = re.search(r"dashboard on (https?://127\.0\.0\.1:\d+/)", proc.output())
        return m.group(1) if m else None
    return str(wait_for(ready, 60, "the dashboard to listen"))


def _get(url: str, headers: dict | None = None, context: ssl.SSLContext | None = None):
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60, context=context) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def _fake_result(avg: float, contended: bool = False):
    from farm.proto.results import Contention, LatencyStats, Limits, RunResult, RunStatus, Telemetry
    return RunResult(status=RunStatus.COMPLETED, backend="process", limits=Limits(cpus=1.0, memory_mb=512), wall_s=1.0,
                     latency=LatencyStats(None, avg, avg, avg, avg, avg, avg, 0.1, avg, avg, 10),
                     telemetry=Telemetry(interval_ms=100, memory_avg_bytes=30e6, memory_peak_bytes=int(50e6)),
                     environment={"runtime": "onnxruntime"}, contention=Contention(contended=contended))


def _run_matrix_job(db: Path, model: Path) -> int:
    """A job over threads 1, 2, 4 with two repeats, run through lease/complete as an agent would report it."""
    from farm.controller.scheduling.controller import Controller
    from farm.controller.scheduling.jobfile import load_job_text
    from farm.controller.store import SQLiteStore as Store

    store = Store(db)
    controller = Controller(store)
    job_id = controller.submit(load_job_text(f"name: sweep\nmodels: [{model}]\nmatrix: {{threads: [1, 2, 4]}}\n"
                                             "repeats: 2\n", "job.yaml", model.parent))
    while (spec := controller.lease("rack1", {"sim"}, job_id=job_id)) is not None:
        contended = spec.threads == 4 and spec.repeat == 1  # one contended run: marked, left out of the mean
        avg = 30.0 / spec.threads + spec.repeat + (100 if contended else 0)
        controller.complete(spec.task_id, spec.attempt, "rack1", time.time() - 1, _fake_result(avg, contended))
    store.close()
    return job_id


def test_farm_web_serves_a_local_store_open_on_loopback(cluster: Cluster, tiny_models) -> None:
    db = cluster.root / "farm.db"
    job_id = _run_matrix_job(db, tiny_models["onnx"])
    proc = cluster.spawn("web", "web", "--db", str(db), "--listen", "127.0.0.1:0")
    url = _dashboard_url(proc)
    assert "open: no tokens" in proc.output()

    status, headers, page = _get(f"{url}jobs/{job_id}")
    assert status == 200
    assert "Averages over repeats" in page and 'class="contended"' in page
    # threads 4: repeat 0 (7.5 ms) counts, the contended repeat 1 (108.5 ms) is left out of the mean
    assert re.search(r'<td data-sort="4">4</td><td data-sort="1">1</td><td data-sort="">—</td>'
                     r'<td data-sort="1.0">1</td><td data-sort="1">1</td><td data-sort="1">1 !</td><td data-sort="7.5">7.5</td>', page)
    assert page.count('<svg class="chart"') == 1 and "latency by threads" in page
    status, headers, body = _get(f"{url}jobs/{job_id}/results.json")
    assert status == 200 and "attachment" in headers["Content-Disposition"]
    from farm.controller.analysis.results import run_records
    from farm.controller.store import SQLiteStore as Store
    # the download is `farm results --ops --json`: every record with its op profile (empty here: none asked)
    downloaded = json.loads(body)
    assert downloaded == json.loads(json.dumps([r.model_dump() for r in run_records(Store(db), job_id, ops=True)]))
    assert all("op_profile" in r for r in downloaded)
    status, headers, csv_text = _get(f"{url}jobs/{job_id}/results.csv")
    assert status == 200 and csv_text.count("\n") == 1 + 6 and csv_text.startswith("job,task,")

    # loopback only answers to localhost names: a page fetched through a rebinding DNS name gets nothing
    status, _, page = _get(f"{url}lab", headers={"Host": "evil.example"})
    assert status == 421 and "sweep" not in page
    # open, but still same-origin with a CSRF token for actions
    status, _, _ = _get(f"{url}lab")
    request = urllib.request.Request(f"{url}jobs/{job_id}/cancel", data=b"", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 403


COLUMN = """const th = Array.from(document.querySelectorAll('#results thead th')).find(h => h.textContent === arguments[0]);
const i = Array.from(th.parentNode.children).indexOf(th) + 1;
return Array.from(document.querySelectorAll(`#results tbody tr td:nth-child(${i})`)).map(td => td.getAttribute('data-sort'));"""


def test_results_sort_by_a_column_and_every_page_fits_a_phone(cluster: Cluster, tiny_models, browser) -> None:
    db = cluster.root / "farm.db"
    job_id = _run_matrix_job(db, tiny_models["onnx"])
    url = _dashboard_url(cluster.spawn("web", "web", "--db", str(db), "--listen", "127.0.0.1:0"))
    browser.get(f"{url}jobs/{job_id}")
    header = browser.wait(lambda d: d.find_element("xpath", '//table[@id="results"]//th[text()="latency avg ms"]'),
                          "the results table")
    before = [float(v) for v in browser.driver.execute_script(COLUMN, "latency avg ms")]
    assert before != sorted(before)  # listed by model and threads, not by latency
    header.click()
    browser.wait(lambda d: [float(v) for v in d.execute_script(COLUMN, "latency avg ms")] == sorted(before),
                 "the rows sorted by latency, fastest first")
    header.click()
    browser.wait(lambda d: [float(v) for v in d.execute_script(COLUMN, "latency avg ms")] == sorted(before, reverse=True),
                 "the rows sorted by latency, slowest first")
    threads = [int(v) for v in browser.driver.execute_script(COLUMN, "threads")]
    assert threads[:3] == [4, 1, 1]  # the contended 4-thread run (108.5 ms), then the 1-thread runs

    browser.driver.set_window_size(390, 844)  # a phone
    for path in ("lab", "jobs", f"jobs/{job_id}", "calibrations"):
        browser.get(url + path)
        browser.find("header nav")
        fits = browser.driver.execute_script(
            "return [document.documentElement.scrollWidth, window.innerWidth];")
        assert fits[0] <= fits[1] + 1, f"/{path} is wider than the phone's screen ({fits[0]} > {fits[1]} px)"
    browser.get(f"{url}jobs/{job_id}")
    assert 200 < browser.find("svg.chart").size["width"] <= 390  # the sweep plot shrinks to the screen


def test_farm_web_serves_https_with_a_certificate_and_tokens(cluster: Cluster) -> None:
    certs = _write_certificates(cluster.root)
    tokens = cluster.root / "tokens"
    tokens.write_text("client client-token-0123456789ab\n")
    tokens.chmod(0o600)
    proc = cluster.spawn("web", "web", "--db", str(cluster.root / "farm.db"), "--listen", "127.0.0.1:0",
                         "--tokens", str(tokens), "--tls-cert", str(certs["server"]), "--tls-key", str(certs["server_key"]))
    url = _dashboard_url(proc)
    assert url.startswith("https://")
    context = ssl.create_default_context(cafile=str(certs["ca"]))
    assert _get(f"{url}lab", context=context)[0] == 401
    status, _, page = _get(f"{url}lab", headers={"Authorization": "Bearer client-token-0123456789ab"}, context=context)
    assert status == 200 and "Devices" in page
    request = urllib.request.Request(f"{url}login", data=b"token=client-token-0123456789ab",
                                     headers={"Origin": url.rstrip("/"),
                                              "Content-Type": "application/x-www-form-urlencoded"})

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    opener = urllib.request.build_opener(NoRedirect, urllib.request.HTTPSHandler(context=context))
    with pytest.raises(urllib.error.HTTPError) as answer:
        opener.open(request, timeout=60)
    cookie = answer.value.headers["Set-Cookie"]
    assert answer.value.code == 303 and "; Secure" in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP on the TLS port gets no page
        urllib.request.urlopen(url.replace("https://", "http://") + "lab", timeout=30)

    # a live page over TLS: the stream hub writes to the TLS socket without blocking, and keeps it open
    import socket
    port = int(url.rsplit(":", 1)[1].strip("/"))
    with context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=30),
                             server_hostname="localhost") as tls:
        tls.sendall(b"GET /events?page=%2Flab HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Authorization: Bearer client-token-0123456789ab\r\n\r\n")
        received = b""
        while b"event: update" not in received:  # the page has no regions yet: they come in the opening
            chunk = tls.recv(65536)
            assert chunk, received[:300]
            received += chunk
        assert b"200 OK" in received.split(b"\r\n")[0] and b"text/event-stream" in received
        tls.settimeout(5)  # open past the hub's next check (2 s): nothing changed, so nothing more, and no close
        with pytest.raises(TimeoutError):
            tls.recv(65536)


def test_controller_refuses_a_bad_or_open_web_listen(cluster: Cluster) -> None:
    bad = cluster.farm("controller", "serve", "--listen", "127.0.0.1:0", "--db", str(cluster.root / "c.db"),
                       "--no-auth", "--web-listen", "nonsense")
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr
    wide = cluster.farm("controller", "serve", "--listen", "127.0.0.1:0", "--db", str(cluster.root / "c.db"),
                        "--no-auth", "--web-listen", "0.0.0.0:0")
    assert wide.returncode == 2 and "loopback" in wide.stderr


def test_a_dashboard_others_can_reach_is_warned_about() -> None:
    from farm.web.server import listen_warnings
    assert listen_warnings("127.0.0.1:8080", tokens=False, tls=False) == []
    assert listen_warnings("[::1]:8080", tokens=False, tls=False) == []
    assert "no tokens" in listen_warnings("0.0.0.0:8080", tokens=False, tls=True)[0]
    assert "clear text" in listen_warnings("10.1.2.3:8080", tokens=True, tls=False)[0]
    assert listen_warnings("0.0.0.0:8080", tokens=True, tls=True) == []


# --- the pieces -------------------------------------------------------------------------------------
def test_a_session_cookie_cannot_be_forged_kept_past_expiry_or_reused_for_another_csrf() -> None:
    from farm.web.session import SessionSigner
    signer = SessionSigner()
    cookie, session = signer.issue("client", 3, now=1000.0)
    assert signer.verify(cookie, now=1001.0) == session
    assert signer.verify(cookie, now=1000.0 + signer.ttl_s + 1) is None
    payload, mac = cookie.split(".")
    import base64
    forged = base64.urlsafe_b64encode(json.dumps({"r": "admin", "l": 3, "s": session.sid, "e": 9e9}).encode()).decode()
    assert signer.verify(f"{forged.rstrip('=')}.{mac}", now=1001.0) is None
    assert SessionSigner().verify(cookie, now=1001.0) is None  # another process, another secret
    other_cookie, other = signer.issue("client", 3, now=1000.0)
    assert signer.csrf_ok(session, signer.csrf_token(session))
    assert not signer.csrf_ok(session, signer.csrf_token(other)) and not signer.csrf_ok(session, "")


def test_charts_drop_non_finite_values_and_escape_labels() -> None:
    from farm.web.svg import Band, Chart, render
    chart = Chart("<b>title</b>", "x & y", "y", points=[("<script>", 1.0, 2.0), ("nan", math.nan, 1.0), ("ok", 3.0, 4.0)],
                  band=Band([1.0, 2.0, math.inf], [2.0, 3.0, 4.0], [1.5, 2.5, 3.5], [2.5, 3.5, 4.5], "band"))
    text = render(chart)
    assert "<script>" not in text and "&lt;script&gt;" in text and "&lt;b&gt;title" in text
    assert text.count('class="point"') == 2 and "nan" not in text.replace("&lt;", "").lower().split("<title>")[0]
    assert "no finite values" in render(Chart("empty", "x", "y", points=[("a", math.nan, 1.0)]))


def test_operator_profiles_become_tables() -> None:
    from farm.web.views import _op_table
    assert _op_table([{"op": "CONV_2D", "ms": 1.5, "count": 3}, {"op": "ADD", "ms": 0.1}]) == (
        ["op", "ms", "count"], [["CONV_2D", 1.5, 3], ["ADD", 0.1, None]])
    # a record's op_profile is a list (RunRecord's type, checked where the record is read): no other shape reaches it
    assert _op_table([]) is None and _op_table(["junk", 3]) is None


def test_a_calibrations_history_and_drift_over_refreshes(tmp_path: Path) -> None:
    from farm.controller.analysis.calibration import Pair
    from farm.controller.analysis.calibrations import CalibrationSource, PairedRun, fit_and_store
    from farm.controller.scheduling.controller import Controller
    from farm.controller.operations.refresh import DriftThresholds, drift_between, record_drift
    from farm.controller.store import SQLiteStore as Store
    from farm.web.server import Operator, start_dashboard

    store = Store(tmp_path / "farm.db")
    versions = []
    for slope in (2.0, 2.1, 3.0):  # the third refresh moved: its slope change exceeds the threshold
        paired = [PairedRun(Pair(f"net-{k}", 4.0 + 3 * k, slope * (4.0 + 3 * k) + 1 + (0.3 if k % 2 else -0.3)), 2,
                            "litert", 0, 0) for k in range(6)]
        stored, refused = fit_and_store(store, "pixel-7", "latency", paired, source=CalibrationSource(job=0))
        assert stored, refused
        versions.append(stored[0])
    for old, new in zip(versions, versions[1:]):
        record_drift(store, drift_between(old, new, DriftThresholds()))
    running = start_dashboard(store, "127.0.0.1:0", Operator.embedded(Controller(store)), tokens=None)
    try:
        status, _, page = _get(f"{running.url}calibrations/{versions[-1].id}")
        listing = _get(f"{running.url}calibrations")[2]
    finally:
        running.stop()
    assert status == 200
    assert page.count('href="/calibrations/') >= 3 and ">v3</a>" in page  # every version of the key
    assert 'id="history"' in page and 'id="drift-chart"' in page
    # by date, R² and the leave-one-out error each on its own chart (own y axis), not one 0–1 axis
    history = page[page.index('id="history"'):page.index("<h2>", page.index('id="history"'))]
    assert history.count('<svg class="chart"') == 2 and "R² by date" in history and "mean absolute error (%)" in history
    assert re.search(r'class="tick">\d\d-\d\d \d\d:\d\d<', history)  # ticks are dates (minutes apart here)
    drift_rows = page[page.index('id="drift"'):]
    assert drift_rows.count("<tr>") == 1 + 2 and "slope_change" in drift_rows and ">yes<" in drift_rows
    assert ">v3</a> of 3" in listing and "pixel-7" in listing


@pytest.mark.parametrize("cap", ["in all", "per address"])
def test_idle_connections_cannot_take_every_thread(tmp_path: Path, monkeypatch, cap: str) -> None:
    import socket

    from farm.controller.scheduling.controller import Controller
    from farm.controller.store import SQLiteStore as Store
    from farm.web import server
    from farm.web.server import Operator, start_dashboard

    # Small caps, so the idle sockets open in a moment even on a loaded host: opening 256 once took longer than
    # the 30 s read timeout, which freed the first slots by that rule, not this one. The idle sockets must stay
    # idle while they are counted, so neither the header deadline nor the read timeout may end them.
    monkeypatch.setattr(server, "HEADER_DEADLINE_S", 300.0)
    monkeypatch.setattr(server._Handler, "timeout", 300)
    if cap == "in all":
        monkeypatch.setattr(server, "MAX_CONNECTIONS", 6)
        monkeypatch.setattr(server, "MAX_CONNECTIONS_PER_ADDRESS", 1000)
    else:
        monkeypatch.setattr(server, "MAX_CONNECTIONS_PER_ADDRESS", 6)
    store = Store(tmp_path / "farm.db")
    running = start_dashboard(store, "127.0.0.1:0", Operator.embedded(Controller(store)), tokens=None)
    idle = [socket.create_connection(("127.0.0.1", running.port), timeout=30) for _ in range(6)]
    try:
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # one more is closed, not queued
            urllib.request.urlopen(f"{running.url}lab", timeout=30)
        for s in idle:
            s.close()

        def serves() -> bool:
            try:
                return _get(f"{running.url}lab")[0] == 200
            except (urllib.error.URLError, ConnectionError):
                return False  # the closed connections' threads have not all ended yet

        wait_for(serves, 30, "the dashboard to serve again", interval=0.5)
    finally:
        for s in idle:
            s.close()
        running.stop()


def test_farm_web_and_the_controller_notice_their_store_deleted_under_them(cluster: Cluster) -> None:
    db = cluster.root / "farm.db"
    proc = cluster.spawn("web", "web", "--db", str(db), "--listen", "127.0.0.1:0")
    url = _dashboard_url(proc)
    status, _, body = _get(f"{url}healthz")
    health = json.loads(body)
    assert status == 200 and health["ok"] and health["store"]["path"] == str(db) and health["store"]["linked"]
    assert health["store"]["size_bytes"] > 0 and datetime.fromisoformat(health["store"]["last_write"]).year >= 2024
    page = _get(f"{url}lab")[2]
    assert 'id="store-health"' in page and str(db) in page and ">linked<" in page

    controller_db = cluster.root / "controller.db"
    controller = cluster.spawn("controller", "controller", "serve", "--listen", "127.0.0.1:0", "--db", str(controller_db),
                               "--no-auth")
    wait_for(lambda: "listening on" in controller.output(), 60, "the controller to listen")
    for f in (db, controller_db):
        f.unlink()
    status, _, body = _get(f"{url}healthz")
    assert status == 503 and not json.loads(body)["ok"] and "was deleted" in json.loads(body)["store"]["problem"]
    page = _get(f"{url}lab")[2]
    assert 'role="alert"' in page and "was deleted while this process had it open" in page and ">deleted<" in page
    wait_for(lambda: "was deleted" in proc.output(), 30, "farm web to log the deleted store")
    assert proc.output().count("was deleted") == 1  # said once, not every few seconds
    wait_for(lambda: f"the store file {controller_db} was deleted" in controller.output(), 30,
             "the controller to log its deleted store")


def test_a_fit_kind_change_is_marked_on_the_history_chart() -> None:
    from farm.web.svg import Chart, render
    chart = Chart("R² by date", "stored (UTC)", "R²", dates_x=True, markers=[(1_700_000_600.0, "→ <power>")],
                  series={"R²": [(1_700_000_000.0, 0.9), (1_700_000_600.0, 0.95), (1_700_001_200.0, 0.97)]})
    text = render(chart)
    assert text.count('class="marker"') == 1 and "→ &lt;power&gt;" in text and "11-14 22:" in text


def test_sweep_legends_sit_under_the_plot_and_never_say_none() -> None:
    from farm.web.svg import HEIGHT, render
    from farm.web.views import AverageRow, sweep_charts
    rows = [AverageRow(f"net<{m}>", f"phone-{p}", t, b, None, None, 1, 0, 10.0 * m + t + b, None, None, None)
            for m in range(3) for p in range(7) for t in (1, 2, 4) for b in (1, 8)]
    charts = [s.chart for s in sweep_charts(rows) if s.chart]
    assert [c.title for c in charts] == ["latency by threads", "latency by batch size"]  # one per varying dimension
    assert len(charts[0].series) == 42 and all("None" not in name for name in charts[0].series)
    assert "net<0> @ phone-0 · batch 8" in charts[0].series
    text = render(charts[0])
    legend_y = [float(y) for y in re.findall(r'<text x="[\d.]+" y="([\d.]+)" class="legend">', text)]
    assert len(legend_y) == 41  # 40 entries and "… and 2 more"
    assert min(legend_y) > HEIGHT - 48  # under the plot area and its x label, not over the lines
    assert "&lt;0&gt;" in text and "<0>" not in text
    assert 'stroke-dasharray="6 3"' in text  # the ninth line on is dashed: 8 colours do not name 42 lines


def test_a_series_measured_at_one_value_is_a_table_row_not_a_dot() -> None:
    """The phones job: the sim sweeps threads 1, 2, 4 with a budget of as many cores, each phone ran 4 threads."""
    from farm.web import pages
    from farm.web.svg import render
    from farm.web.views import AverageRow, sweep_charts
    rows = [AverageRow(f"net{m}", "sim", t, 1, None, float(t), 1, 0, 10.0 * m / t, None, None, None)
            for m in range(2) for t in (1, 2, 4)]
    rows += [AverageRow(f"net{m}", f"phone-{p}", 4, 1, None, None, 1, 0, 30.0 * m + p, None, None, None)
             for m in range(2) for p in range(2)]
    [threads] = sweep_charts(rows)  # the budget moves with the threads: no second, identical chart
    assert threads.label == "threads" and threads.chart is not None
    assert sorted(threads.chart.series) == ["net0 @ sim", "net1 @ sim"]  # no "cpus 2" splitting a line into dots
    assert [(name, x) for name, x, _ in threads.single] == [("net0 @ phone-0", 4.0), ("net0 @ phone-1", 4.0),
                                                            ("net1 @ phone-0", 4.0), ("net1 @ phone-1", 4.0)]
    drawn = render(threads.chart)
    assert drawn.count('class="series"') == 2 and "phone" not in drawn and "None" not in drawn
    html = pages.sweep_part(threads, 0)
    assert 'id="sweep-single-0"' in html and "measured at one threads only" in html
    assert html.count("<tr>") == 1 + 4 and "net1 @ phone-1" in html and "None" not in html
    # nothing varies along threads for any series: no chart at all, only the rows
    other = AverageRow("x", "phone-9", 1, 1, None, None, 1, 0, 5.0, None, None, None)  # threads 1, the phones 4
    [alone] = sweep_charts([r for r in rows if r.target != "sim"] + [other])
    assert alone.chart is None and len(alone.single) == 5
    assert "<figure>" not in pages.sweep_part(alone, 1)
