"""The lab page of a 200-device lab, as a lab manager uses it: counts by health and connection, filters,
short pages, panels for recent failures and drift alerts, updates pushed by server-sent events (an idle
page fetches nothing), and a confirmation plus a required reason before a device leaves service.

The store is filled as agents and a refresh would fill it; the dashboard runs in this process.
"""

from __future__ import annotations

import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from browser import browser_fixture  # noqa: F401 (the `browser` fixture)
from test_web_why import seed_failed_job

pytestmark = pytest.mark.timeout(240)

HOSTILE = '<img src=x onerror="window.pwned=1">dev'


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _post(url: str, fields: dict[str, str]) -> tuple[int, str]:
    origin = url.split("/actions")[0]
    request = urllib.request.Request(url, data=urllib.parse.urlencode(fields).encode(), method="POST",
                                     headers={"Content-Type": "application/x-www-form-urlencoded", "Origin": origin})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _seed_lab(store, controller) -> None:
    """200 devices on 10 agents (half of them offline), 15 quarantined, 5 in maintenance, one hostile name."""
    now = time.time()
    for a in range(10):
        agent = f"rack{a}"
        state = "online" if a < 5 else "offline"
        names = [f"phone-{a * 20 + k:03d}" for k in range(20)]
        if a == 0:
            names[0] = HOSTILE
        store.devices.record_agent({"name": agent, "session_id": f"s{a}", "state": state, "farm_version": "0.1.0",
                            "capabilities_json": "[]", "hostname": f"host{a}", "peer": "127.0.0.1", "connected_at": now,
                            "last_seen": now},
                           [(n, agent, "android", "pixel-7", "[]", "{}", 1, state, now) for n in names])
    for k in range(15):
        controller.quarantine(f"phone-{100 + k:03d}", f"3 infrastructure failures in a row ({k})")
    for k in range(5):
        controller.quarantine(f"phone-{150 + k:03d}", "new USB hub", health="maintenance")


def _drift(store) -> int:
    from farm.controller.analysis.calibration import Pair
    from farm.controller.analysis.calibrations import CalibrationSource, PairedRun, fit_and_store
    from farm.controller.operations.refresh import DriftThresholds, drift_between, record_drift
    versions = []
    for slope in (2.0, 3.0):  # the second refresh moved past the slope threshold: an alert
        paired = [PairedRun(Pair(f"net-{k}", 4.0 + 3 * k, slope * (4.0 + 3 * k) + 1 + (0.3 if k % 2 else -0.3)), 2,
                            "litert", 0, 0) for k in range(6)]
        stored, refused = fit_and_store(store, "phone-001", "latency", paired, source=CalibrationSource(job=0))
        assert stored, refused
        versions.append(stored[0])
    record_drift(store, drift_between(versions[0], versions[1], DriftThresholds()))
    return versions[1].id


@pytest.fixture
def lab(tmp_path: Path, tiny_models):
    from farm.controller.scheduling.controller import Controller
    from farm.controller.store import SQLiteStore as Store
    from farm.web.server import Operator, start_dashboard

    db = tmp_path / "farm.db"
    job_id = seed_failed_job(db, tiny_models["onnx"])
    store = Store(db)
    controller = Controller(store)
    _seed_lab(store, controller)
    drifted = _drift(store)
    running = start_dashboard(store, "127.0.0.1:0", Operator.embedded(controller), tokens=None)
    try:
        yield running.url, store, controller, job_id, drifted
    finally:
        running.stop()
        store.close()


def _rows(page: str) -> int:
    table = page[page.index('id="devices"'):]
    return table[:table.index("</table>")].count("<tr>") - 1


def test_a_200_device_lab_is_counted_filtered_and_paged(lab) -> None:
    url, _, _, job_id, drifted = lab
    status, page = _get(f"{url}lab")
    assert status == 200
    assert len(page) < 120_000, f"the lab page is {len(page)} bytes"  # was 385 kB for 200 devices
    assert _rows(page) == 50 and "page 1 of 4" in page
    summary = page[page.index('class="summary"'):page.index("</section>")]
    assert "<strong>200</strong> device(s)" in summary
    assert re.search(r'data-health="bad"><strong>15</strong> bad', summary)
    assert re.search(r'data-health="maintenance"><strong>5</strong> maintenance', summary)
    assert re.search(r'data-state="online"><strong>100</strong> online', summary)
    assert re.search(r'data-state="offline"><strong>100</strong> offline', summary)
    # panels: the failed runs of the seeded job, and the drift alert, each linking to its page
    assert f'href="/jobs/{job_id}#failure-' in page and "out of memory at the 256 MiB limit" in page
    assert f'href="/calibrations/{drifted}"' in page and "phone-001 · latency" in page

    bad = _get(f"{url}lab?health=bad")[1]
    assert _rows(bad) == 15 and "15 of 200 device(s) match" in bad and "page 1 of" not in bad
    both = _get(f"{url}lab?health=bad&name=phone-11")[1]
    assert _rows(both) == 5  # phone-110 … phone-114
    last = _get(f"{url}lab?page=4")[1]
    assert _rows(last) == 50 and "page 4 of 4" in last and 'rel="next"' not in last
    beyond = _get(f"{url}lab?page=99")[1]
    assert "page 4 of 4" in beyond
    hostile = _get(f"{url}lab?health=%3Cscript%3E&page=-1&name=%3Cimg%20src%3Dx%3E")[1]
    assert "<img src=x>" not in hostile and "&lt;img src=x&gt;" in hostile  # the fragment is shown back as text
    assert "<img src=x onerror" not in _get(f"{url}lab")[1]


def _read_event(sock: socket.socket, deadline: float) -> str:
    data = b""
    while b"event: update" not in data or not data.endswith(b"\n\n"):
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data.decode()


def test_events_send_a_region_only_when_it_changed(lab) -> None:
    url, _, controller, _, _ = lab
    page = _get(f"{url}lab")[1]
    etag = re.search(r'id="lab-live" data-live="[^"]*" data-every="3" data-etag="([0-9a-f]{16})"', page).group(1)
    port = int(url.rsplit(":", 1)[1].strip("/"))
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"GET /events?page=%2Flab&have=lab-live:{etag} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        sock.settimeout(30)
        head = sock.recv(65536).decode()
        assert "200 OK" in head and "text/event-stream" in head
        sock.settimeout(5)  # the page is current: nothing is sent while nothing changes
        quiet = b""
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                quiet += chunk
        except TimeoutError:
            pass
        assert b"event: update" not in quiet
        controller.quarantine("phone-000", "cracked screen")
        event = _read_event(sock, time.monotonic() + 30)
        assert '"region": "lab-live"' in event and "cracked screen" in event
    assert _get(f"{url}events?page=%2Fnowhere")[0] == 404
    assert _get(f"{url}events?page=http%3A%2F%2Fevil.example%2Flab")[0] == 400


def test_quarantine_needs_a_reason_on_the_server_too(lab) -> None:
    url, store, _, _, _ = lab
    status, text = _post(f"{url}actions/device", {"device": "phone-001", "action": "quarantine", "reason": "  "})
    assert status == 403  # no CSRF token from a script without a bearer token: refused before anything else
    from farm.web.server import DashboardApp, Operator
    from farm.controller.scheduling.controller import Controller
    dashboard = DashboardApp(store, Operator.embedded(Controller(store)), tokens=None, tls=False, loopback=True)
    headers = {"Host": "127.0.0.1", "Origin": "http://127.0.0.1", "Content-Type": "application/x-www-form-urlencoded"}
    csrf = dashboard.csrf(dashboard._open_session)
    for action in ("quarantine", "maintenance"):
        refused = dashboard.handle("POST", "/actions/device", headers, urllib.parse.urlencode(
            {"device": "phone-001", "action": action, "reason": " ", "csrf": csrf}).encode())
        assert refused.status == 400 and b"reason" in refused.body
    assert store.devices.health_by_name().get("phone-001") is None
    done = dashboard.handle("POST", "/actions/device", headers, urllib.parse.urlencode(
        {"device": "phone-001", "action": "quarantine", "reason": "cracked screen", "csrf": csrf}).encode())
    assert done.status == 303 and store.devices.health_by_name()["phone-001"].reason == "cracked screen"


# --- in the browser -------------------------------------------------------------------------------
def test_summary_counts_filter_and_a_short_page_in_the_browser(lab, browser) -> None:
    url = lab[0]
    browser.get(f"{url}lab")
    bad = browser.find('.summary a[data-health="bad"]')
    assert bad.text == "15 bad"
    height = browser.driver.execute_script("return document.documentElement.scrollHeight;")
    assert height < 12_000, f"the lab page is {height} px tall"  # 69,000 px before
    bad.click()
    browser.wait(lambda d: "health=bad" in d.current_url and len(browser.find_all("#devices tbody tr")) == 15,
                 "the list filtered to the 15 bad devices")
    assert browser.find("#filter-health").get_attribute("value") == "bad"
    # every input has a label a screen reader reads out
    unlabeled = browser.driver.execute_script(
        "return Array.from(document.querySelectorAll('input:not([type=hidden]), select')).filter(i => "
        "!(i.labels && i.labels.length) && !i.getAttribute('aria-label')).map(i => i.outerHTML);")
    assert unlabeled == []
    assert browser.driver.execute_script("return window.pwned === undefined;")


def test_an_sse_update_arrives_without_polling(lab, browser) -> None:
    url, _, controller, _, _ = lab
    browser.get(f"{url}lab?name=phone-00")
    browser.wait(lambda d: browser.attribute("#lab-live", "data-stream") == "open", "the event stream to open")
    assert browser.attribute("#lab-live", "aria-live") == "polite"
    browser.driver.execute_script("""
        window.notReloaded = true; window.fetches = 0;
        const fetch0 = window.fetch; window.fetch = function () { window.fetches++; return fetch0.apply(this, arguments); };
        const open0 = XMLHttpRequest.prototype.open;
        XMLHttpRequest.prototype.open = function () { window.fetches++; return open0.apply(this, arguments); };
        window.resourcesBefore = performance.getEntriesByType('resource').length;""")
    time.sleep(4)  # longer than the old 3 s poll: an idle page asks for nothing
    controller.quarantine("phone-003", "battery swelling")
    row = '//table[@id="devices"]//tr[td[1][normalize-space()="phone-003"]]'
    browser.wait(lambda d: "battery swelling" in d.find_element("xpath", row).text, "the pushed update", timeout=60)
    counts = browser.driver.execute_script(
        "return [window.notReloaded === true, window.fetches, performance.getEntriesByType('resource').length - "
        "window.resourcesBefore];")
    assert counts == [True, 0, 0], f"(not reloaded, fetches, new resource requests) = {counts}"


def test_quarantine_asks_for_confirmation_and_a_reason(lab, browser) -> None:
    url, store, _, _, _ = lab
    browser.get(f"{url}lab?name=phone-01")
    row = '//table[@id="devices"]//tr[td[1][normalize-space()="phone-010"]]'
    button = browser.wait(lambda d: d.find_element("xpath", row + '//button[@value="quarantine"]'), "the button")
    button.click()  # no reason: the browser's own check stops the form; nothing is asked, nothing sent
    time.sleep(1)
    assert browser.driver.execute_script("return document.querySelector('input:invalid') !== null;")
    assert store.devices.health_by_name().get("phone-010") is None
    browser.driver.find_element("xpath", row + '//input[@name="reason"]').send_keys("loose cable")
    browser.driver.find_element("xpath", row + '//button[@value="quarantine"]').click()
    alert = browser.wait(lambda d: d.switch_to.alert, "the confirmation dialog")
    assert "phone-010" in alert.text and "out of service" in alert.text
    alert.dismiss()  # "no": nothing happens
    time.sleep(1)
    assert store.devices.health_by_name().get("phone-010") is None
    browser.driver.find_element("xpath", row + '//button[@value="quarantine"]').click()
    browser.wait(lambda d: d.switch_to.alert, "the confirmation dialog").accept()
    browser.wait(lambda d: "quarantined" in d.find_element("css selector", ".flash").text, "the flash message")
    assert store.devices.health_by_name()["phone-010"].reason == "loose cable"


def test_cancel_asks_for_confirmation(tmp_path: Path, tiny_models, browser) -> None:
    from farm.controller.scheduling.controller import Controller
    from farm.controller.scheduling.jobfile import load_job_text
    from farm.controller.store import SQLiteStore as Store
    from farm.web.server import Operator, start_dashboard
    model = tiny_models["onnx"]
    store = Store(tmp_path / "farm.db")
    controller = Controller(store)
    job_id = controller.submit(load_job_text(f"name: waits\nmodels: [{model}]\nrepeats: 2\n", "job.yaml", model.parent))
    running = start_dashboard(store, "127.0.0.1:0", Operator.embedded(controller), tokens=None)
    try:
        browser.get(f"{running.url}jobs/{job_id}")
        browser.find("#cancel").click()
        alert = browser.wait(lambda d: d.switch_to.alert, "the confirmation dialog")
        assert f"Cancel job {job_id}?" in alert.text
        alert.dismiss()
        time.sleep(1)
        assert store.jobs.get(job_id).status == "queued"
        browser.find("#cancel").click()
        browser.wait(lambda d: d.switch_to.alert, "the confirmation dialog").accept()
        browser.wait(lambda d: "canceled" in d.find_element("css selector", ".flash").text, "the flash message")
        assert store.jobs.get(job_id).status == "canceled"
    finally:
        running.stop()
        store.close()


CONTRAST = """
function rgb(s) { const m = s.match(/rgba?\\(([^)]+)\\)/); if (!m) return null;
  const p = m[1].split(',').map(Number); return {r: p[0], g: p[1], b: p[2], a: p.length > 3 ? p[3] : 1}; }
function lum(c) { return [c.r, c.g, c.b].map(v => { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); })
  .reduce((s, v, i) => s + v * [0.2126, 0.7152, 0.0722][i], 0); }
function background(el) { for (; el; el = el.parentElement) { const c = rgb(getComputedStyle(el).backgroundColor);
  if (c && c.a > 0.5) return c; } return {r: 255, g: 255, b: 255, a: 1}; }
const low = [];
document.querySelectorAll('body *').forEach(el => {
  if (el.closest('svg') || !Array.from(el.childNodes).some(n => n.nodeType === 3 && n.textContent.trim())) return;
  const style = getComputedStyle(el); if (style.visibility === 'hidden' || el.offsetParent === null) return;
  const fg = rgb(style.color), bg = background(el); const a = lum(fg), b = lum(bg);
  const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
  const size = parseFloat(style.fontSize), bold = parseInt(style.fontWeight) >= 700;
  const need = size >= 24 || (bold && size >= 18.66) ? 3 : 4.5;
  if (ratio < need) low.push(el.tagName + '.' + el.className + ' "' + el.textContent.trim().slice(0, 30) + '" ' + ratio.toFixed(2));
});
return low;"""


def test_every_page_meets_wcag_aa_contrast_and_live_regions_are_announced(lab, browser) -> None:
    url, _, _, job_id, drifted = lab
    for path in ("lab", "lab?health=bad", "jobs", f"jobs/{job_id}", "calibrations", f"calibrations/{drifted}"):
        browser.get(url + path)
        browser.find("header nav")
        low = browser.driver.execute_script(CONTRAST)
        assert low == [], f"/{path}: text below WCAG AA contrast: {low[:10]}"
        regions = browser.driver.execute_script(
            "return Array.from(document.querySelectorAll('[data-live]')).map(r => r.getAttribute('aria-live'));")
        assert all(r == "polite" for r in regions), f"/{path}: a live region without aria-live"


def test_open_pages_hold_neither_a_thread_nor_a_connection_slot(tmp_path: Path, monkeypatch) -> None:
    import threading

    from grpc_processes import wait_for

    from farm.controller.scheduling.controller import Controller
    from farm.controller.store import SQLiteStore as Store
    from farm.web import server, streams
    from farm.web.server import MAX_CONNECTIONS_PER_ADDRESS, Operator, start_dashboard

    monkeypatch.setattr(server, "STREAM_CHECK_S", 0.5)  # the hub looks for changes this often
    store = Store(tmp_path / "farm.db")
    controller = Controller(store)
    _seed_lab(store, controller)
    running = start_dashboard(store, "127.0.0.1:0", Operator.embedded(controller), tokens=None)
    opened: list[socket.socket] = []
    try:
        etag = re.search(r'id="lab-live" data-live="[^"]*" data-every="3" data-etag="([0-9a-f]{16})"',
                         _get(f"{running.url}lab")[1]).group(1)
        threads_before = threading.active_count()

        def open_stream() -> tuple[socket.socket, bytes]:
            sock = socket.create_connection(("127.0.0.1", running.port), timeout=30)
            sock.sendall(f"GET /events?page=%2Flab&have=lab-live:{etag} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                head += chunk
            return sock, head

        # more open pages from one address than it may hold connections: each one's thread and slot came back
        count = MAX_CONNECTIONS_PER_ADDRESS + 8
        for _ in range(count):
            sock, head = open_stream()
            opened.append(sock)
            assert b"200 OK" in head and b"text/event-stream" in head, head[:200]
        wait_for(lambda: running.server.streams.count() == count, 30, "the hub to hold every stream")
        wait_for(lambda: threading.active_count() <= threads_before + 1, 30, "the request threads to end")
        assert _get(f"{running.url}lab")[0] == 200  # the address's connection slots are free for pages

        controller.quarantine("phone-000", "dropped on the floor")  # every open page hears of it
        for sock in opened:
            event = _read_event(sock, time.monotonic() + 30)
            assert '"region": "lab-live"' in event and "dropped on the floor" in event

        monkeypatch.setattr(streams, "MAX_STREAMS_PER_ADDRESS", count)  # a script opening streams meets a cap
        sock, head = open_stream()
        sock.close()
        assert b"503" in head.split(b"\r\n")[0] and b"Retry-After: 30" in head

        for sock in opened:  # closed tabs are noticed by the hub, and their sockets closed
            sock.close()
        wait_for(lambda: running.server.streams.count() == 0, 30, "the hub to let closed pages go")
    finally:
        for sock in opened:
            sock.close()
        running.stop()
        store.close()
