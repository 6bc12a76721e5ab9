"""The lab dashboard as a lab engineer uses it: a real controller (`farm controller serve --web-listen`)
with a tokens file, a real agent running a job, and Debian's chromium driving the pages.

Device and model names in the store are hostile strings: they must show as text, never run.
"""

from __future__ import annotations

import http.client
import io
import json
import re
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from browser import module_chromium_fixture, shared_browser_fixture  # noqa: F401 (`browser`: one chromium per module)
from grpc_processes import Cluster, sleep_job, wait_for

pytestmark = pytest.mark.timeout(300)

ADMIN = "admin-token-for-the-dashboard-0001"
CLIENT = "client-token-for-the-dashboard-002"
AGENT = "agent-token-for-the-dashboard-0003"
HOSTILE_DEVICE = '<img src=x onerror="window.pwned=1">phone'
HOSTILE_MODEL = "<script>window.pwned=1</script>net"
QUARANTINED = "phone-7"


def _seed(db: Path) -> int:
    """Before the controller starts: a calibration fitted on hostile model names, two quarantined devices."""
    from farm.controller.analysis.calibration import Pair
    from farm.controller.analysis.calibrations import CalibrationSource, PairedRun, fit_and_store
    from farm.controller.scheduling.controller import Controller
    from farm.controller.store import SQLiteStore as Store

    store = Store(db)
    names = [HOSTILE_MODEL] + [f"net-{k}" for k in range(1, 8)]
    paired = [PairedRun(Pair(m, 4.0 + 3 * k, 2.0 * (4.0 + 3 * k) + 3 + (0.4 if k % 2 else -0.4)), 1, "litert", 0, 0)
              for k, m in enumerate(names)]
    stored, refused = fit_and_store(store, HOSTILE_DEVICE, "latency", paired, source=CalibrationSource(job=0))
    assert stored, refused
    controller = Controller(store)
    controller.quarantine(QUARANTINED, "3 infrastructure failures in a row; last: adb: device offline")
    controller.quarantine(HOSTILE_DEVICE, "<b>bold</b> reason")
    store.close()
    return stored[0].id


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("web-lab")
    # the controller and agents are processes; the `farm` client calls run in this process (issue 34), unless
    # pytest --farm-subprocess
    cluster = Cluster(root, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(root / "none.toml")},
                      cli_in_process=True)
    calibration_id = _seed(root / "controller.db")
    tokens = root / "tokens"
    tokens.write_text(f"admin {ADMIN}\nclient {CLIENT}\nagent {AGENT}\n")
    tokens.chmod(0o600)
    controller = cluster.start_controller("--tokens", str(tokens), "--web-listen", "127.0.0.1:0")
    url = wait_for(lambda: (m := re.search(r"dashboard on (http://127\.0\.0\.1:\d+/)", controller.output())) and m.group(1),
                   30, "the dashboard to listen")
    cluster.url = url
    cluster.calibration_id = calibration_id
    yield cluster
    cluster.stop_all()


def _request(url: str, path: str, *, method: str = "GET", headers: dict | None = None,
             body: str | None = None) -> http.client.HTTPResponse:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request(method, path, body=body, headers=headers or {})
    response = conn.getresponse()
    response.text = response.read().decode()
    conn.close()
    return response


def _login_cookie(url: str, token: str) -> str:
    origin = url.rstrip("/")
    r = _request(url, "/login", method="POST", body=urllib.parse.urlencode({"token": token, "next": "/lab"}),
                 headers={"Content-Type": "application/x-www-form-urlencoded", "Origin": origin})
    assert r.status == 303, r.text
    cookie = r.getheader("Set-Cookie")
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    return cookie.split(";")[0]


def _health(cluster: Cluster, device: str) -> str:
    return cluster.db().execute("SELECT health FROM device_health WHERE name = ?", [device]).fetchone()[0]


# --- in the browser ---------------------------------------------------------------------------
def test_log_in_and_watch_a_running_jobs_progress_change(lab, browser, tiny_models) -> None:
    agent = lab.start_agent("rack1", token=AGENT)
    wait_for(lambda: "connected to controller" in agent.output(), 60, "the agent to connect")
    job = sleep_job(lab.root, tiny_models["onnx"], tasks=4, seconds=3)
    submitted = lab.farm("submit", str(job), "--controller", lab.address, "--token", CLIENT, "--detach", "--json")
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["job"]

    browser.log_in(lab.url, CLIENT)
    assert "Devices" in browser.text() and QUARANTINED in browser.text()
    browser.get(f"{lab.url}jobs/{job_id}")
    browser.find("#job-progress .progress-text")
    first = int(browser.attribute("#job-progress .progress-text", "data-done"))
    assert first < 4
    browser.driver.execute_script("window.notReloaded = true;")  # gone if the page were loaded again
    browser.wait(lambda d: int(browser.attribute("#job-progress .progress-text", "data-done") or 0) > first,
                 "the job's progress to change on the open page", timeout=150)
    assert browser.driver.execute_script("return window.notReloaded === true;"), "the page reloaded instead of updating"
    browser.wait(lambda d: "completed" in d.find_element("css selector", "#job-status").text, "the job to complete",
                 timeout=150)
    agent.stop()


LAB_CELL = """const table = document.querySelector('#' + arguments[0]);
if (!table) return null;
const th = Array.from(table.querySelectorAll('thead th')).find(h => h.textContent === arguments[2]);
const row = Array.from(table.querySelectorAll('tbody tr')).find(r => r.children[0].textContent.trim() === arguments[1]);
if (!th || !row) return null;
const cell = row.children[Array.from(th.parentNode.children).indexOf(th)];
return [cell.textContent, cell.getAttribute('data-sort')];"""


def test_the_lab_shows_a_busy_sim_device_busy_and_an_agents_last_seen_moving(lab, browser, tiny_models) -> None:
    """One source of truth: the device a task runs on reads busy while Running lists it, and an agent's last
    seen follows its heartbeats (the controller's sessions), not its connect time."""
    agent = lab.start_agent("rack2", token=AGENT)
    wait_for(lambda: "connected to controller" in agent.output(), 60, "the agent to connect")
    job = sleep_job(lab.root, tiny_models["onnx"], tasks=2, seconds=8, name="busy.yaml")
    submitted = lab.farm("submit", str(job), "--controller", lab.address, "--token", CLIENT, "--detach", "--json")
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["job"]
    try:
        browser.log_in(lab.url, CLIENT)
        busy = browser.wait(lambda d: (c := d.execute_script(LAB_CELL, "devices", "rack2/sim", "current task"))
                            and "busy" in c[0] and c, "the sim device to read busy", timeout=150)
        assert f"job {job_id}" in busy[0]
        running = browser.driver.execute_script(LAB_CELL, "running", busy[0].split("task ")[1].split()[0], "device")
        assert running is not None and running[0] == "rack2/sim"  # Running names the same device
        connected = float(browser.driver.execute_script(LAB_CELL, "agents", "rack2", "connected")[1])
        browser.wait(lambda d: float(d.execute_script(LAB_CELL, "agents", "rack2", "last seen")[1]) > connected + 2,
                     "the agent's last seen to move past its connect time", timeout=120)
        cli = lab.farm("agents", "--controller", lab.address, "--token", CLIENT, "--json")
        assert cli.returncode == 0, cli.stderr
        assert {a["name"]: a["state"] for a in json.loads(cli.stdout)}["rack2"] == "online"
    finally:
        lab.farm("cancel", str(job_id), "--controller", lab.address, "--token", CLIENT)
        agent.stop()
    browser.wait(lambda d: (c := d.execute_script(LAB_CELL, "agents", "rack2", "connection")) and "offline" in c[0],
                 "the stopped agent to read offline", timeout=90)
    idle = browser.driver.execute_script(LAB_CELL, "devices", "rack2/sim", "current task")
    assert "idle" in idle[0] or "busy" not in idle[0]


def test_calibration_page_draws_its_scatter_and_shows_hostile_names_as_text(lab, browser) -> None:
    browser.log_in(lab.url, CLIENT)
    browser.get(lab.url + "calibrations")
    browser.find(f'a[href="/calibrations/{lab.calibration_id}"]').click()
    figure = browser.find("#scatter svg")
    browser.wait(lambda d: figure.size["width"] > 200 and figure.size["height"] > 100, "the scatter to be laid out")
    assert len(browser.find_all("#scatter circle.point")) == 8
    assert browser.find_all("#scatter polygon.band") and browser.find_all("#scatter polyline.fit")
    png = figure.screenshot_as_png
    import matplotlib.image
    pixels = matplotlib.image.imread(io.BytesIO(png), format="png")[..., :3]
    non_white = (pixels.sum(axis=2) < 2.9).mean()
    assert non_white > 0.02, f"the plot's screenshot is blank ({non_white:.4f} of its pixels are not white)"
    red = ((pixels[..., 0] > 0.6) & (pixels[..., 1] < 0.4) & (pixels[..., 2] < 0.4)).sum()
    assert red > 50, "the fitted line was not drawn"
    text = browser.text()
    assert HOSTILE_MODEL in text and "R²" in text and "leave-one-out error" in text and "Kendall τ" in text
    assert "usable" in text or "unsafe" in text
    assert browser.driver.execute_script("return window.pwned === undefined;"), "a hostile name ran as code"


def test_release_a_quarantined_device_and_see_it_back_in_service(lab, browser) -> None:
    assert _health(lab, QUARANTINED) == "bad"
    browser.log_in(lab.url, ADMIN)
    row_xpath = f'//table[@id="devices"]//tr[td[1][normalize-space()="{QUARANTINED}"]]'
    row = browser.wait(lambda d: d.find_element("xpath", row_xpath), "the quarantined device's row")
    assert "bad" in row.text
    row.find_element("css selector", "button.release").click()
    browser.wait(lambda d: "released" in d.find_element("css selector", ".flash").text, "the confirmation")
    browser.wait(lambda d: "good" in d.find_element("xpath", row_xpath).text, "the device to show as good")
    assert _health(lab, QUARANTINED) == "good"
    cli = lab.farm("device", "health", "--json", "--db", str(lab.root / "controller.db"))
    assert {r["name"]: r["health"] for r in json.loads(cli.stdout)}[QUARANTINED] == "good"
    assert browser.driver.execute_script("return window.pwned === undefined;"), "a hostile device name ran as code"
    assert HOSTILE_DEVICE in browser.text()
    # put it back for the cross-site test
    row = browser.driver.find_element("xpath", row_xpath)
    row.find_element("css selector", 'input[name="reason"]').send_keys("back on the bench")  # required
    row.find_element("css selector", 'button[value="quarantine"]').click()
    browser.wait(lambda d: d.switch_to.alert, "the confirmation dialog").accept()
    browser.wait(lambda d: "bad" in d.find_element("xpath", row_xpath).text, "the device quarantined again")


def test_a_browser_without_a_session_sees_only_the_login_form(lab, browser) -> None:
    browser.get(lab.url + "lab")
    browser.find("#token")
    assert QUARANTINED not in browser.driver.page_source and "Devices" not in browser.text()
    browser.get(f"{lab.url}jobs/1/results.json")
    assert "log in first" in browser.text()


def test_an_action_posted_from_another_origin_is_refused(lab, browser) -> None:
    assert _health(lab, QUARANTINED) == "bad"
    target = lab.url + "actions/device"

    class Attacker(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            page = (f'<html><body><form id="f" method="post" action="{target}">'
                    f'<input name="device" value="{QUARANTINED}"><input name="action" value="release"></form>'
                    '<script>document.getElementById("f").submit()</script></body></html>').encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args) -> None:
            pass

    attacker = ThreadingHTTPServer(("127.0.0.1", 0), Attacker)  # another origin: another port
    threading.Thread(target=attacker.serve_forever, daemon=True).start()
    try:
        browser.log_in(lab.url, ADMIN)
        browser.get(f"http://127.0.0.1:{attacker.server_address[1]}/")
        browser.wait(lambda d: d.current_url.startswith(target) and "refused" in browser.text(),
                     "the dashboard's refusal")
    finally:
        attacker.shutdown()
        attacker.server_close()
    assert _health(lab, QUARANTINED) == "bad"


# --- over plain HTTP: the same rules, each on its own ------------------------------------------
def test_no_page_without_a_token(lab) -> None:
    for path in ("/lab", "/jobs", "/jobs/1", "/jobs/1/results.csv", "/calibrations", f"/calibrations/{lab.calibration_id}",
                 "/api/jobs/1", "/lab?part=devices"):
        r = _request(lab.url, path)
        assert r.status == 401, path
        assert QUARANTINED not in r.text and "net-1" not in r.text
    forged = _request(lab.url, "/lab", headers={"Cookie": "farm_session=eyJyIjoiYWRtaW4ifQ.AAAA"})
    assert forged.status == 401
    wrong = _request(lab.url, "/lab", headers={"Authorization": "Bearer not-a-known-token-at-all"})
    assert wrong.status == 401
    agent = _request(lab.url, "/lab", headers={"Authorization": f"Bearer {AGENT}"})
    assert agent.status == 403
    bad_login = _request(lab.url, "/login", method="POST", body="token=wrong-token-0000000000",
                         headers={"Content-Type": "application/x-www-form-urlencoded", "Origin": lab.url.rstrip("/")})
    assert bad_login.status == 401 and "Set-Cookie" not in dict(bad_login.getheaders())
    assert _request(lab.url, "/lab", headers={"Authorization": f"Bearer {CLIENT}"}).status == 200


def test_actions_need_same_origin_csrf_and_the_right_role(lab) -> None:
    origin = lab.url.rstrip("/")
    cookie = _login_cookie(lab.url, ADMIN)
    page = _request(lab.url, "/lab", headers={"Cookie": cookie})
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    release = urllib.parse.urlencode({"device": QUARANTINED, "action": "release", "csrf": csrf})

    cross = _request(lab.url, "/actions/device", method="POST", body=release,
                     headers={**form, "Cookie": cookie, "Origin": "http://evil.example"})
    assert cross.status == 403
    no_origin = _request(lab.url, "/actions/device", method="POST", body=release, headers={**form, "Cookie": cookie})
    assert no_origin.status == 403
    no_csrf = _request(lab.url, "/actions/device", method="POST", headers={**form, "Cookie": cookie, "Origin": origin},
                       body=urllib.parse.urlencode({"device": QUARANTINED, "action": "release"}))
    assert no_csrf.status == 403
    assert _health(lab, QUARANTINED) == "bad"

    client = _request(lab.url, "/actions/device", method="POST", body=urllib.parse.urlencode(
        {"device": QUARANTINED, "action": "release"}), headers={**form, "Authorization": f"Bearer {CLIENT}"})
    assert client.status == 403 and "admin" in client.text
    assert _health(lab, QUARANTINED) == "bad"

    ok = _request(lab.url, "/actions/device", method="POST", body=release,
                  headers={**form, "Cookie": cookie, "Origin": origin})
    assert ok.status == 303
    assert _health(lab, QUARANTINED) == "good"
    again = _request(lab.url, "/actions/device", method="POST", body=urllib.parse.urlencode(
        {"device": QUARANTINED, "action": "quarantine", "reason": "back to the bench"}),
        headers={**form, "Authorization": f"Bearer {ADMIN}"})
    assert again.status == 303 and _health(lab, QUARANTINED) == "bad"


def test_hostile_names_are_escaped_in_every_page(lab) -> None:
    auth = {"Authorization": f"Bearer {CLIENT}"}
    for path in ("/lab", "/calibrations", f"/calibrations/{lab.calibration_id}"):
        text = _request(lab.url, path, headers=auth).text
        assert "<script>window.pwned" not in text and "<img src=x" not in text and "<b>bold" not in text, path
    assert "&lt;img src=x onerror=&quot;window.pwned=1&quot;&gt;phone" in _request(lab.url, "/lab", headers=auth).text
    headers = dict(_request(lab.url, "/lab", headers=auth).getheaders())
    assert "script-src 'self'" in headers["Content-Security-Policy"] and headers["X-Frame-Options"] == "DENY"


def test_a_client_cancels_a_queued_job_from_its_page(lab, tiny_models) -> None:
    job = sleep_job(lab.root, tiny_models["onnx"], tasks=2, seconds=1, name="cancel-me.yaml")
    submitted = lab.farm("submit", str(job), "--controller", lab.address, "--token", CLIENT, "--detach", "--json")
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["job"]  # no agent is connected now: it waits in the queue
    cookie = _login_cookie(lab.url, CLIENT)
    page = _request(lab.url, f"/jobs/{job_id}", headers={"Cookie": cookie})
    assert page.status == 200 and 'id="cancel"' in page.text
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
    r = _request(lab.url, f"/jobs/{job_id}/cancel", method="POST", body=urllib.parse.urlencode({"csrf": csrf}),
                 headers={"Content-Type": "application/x-www-form-urlencoded", "Cookie": cookie,
                          "Origin": lab.url.rstrip("/")})
    assert r.status == 303 and r.getheader("Location").startswith(f"/jobs/{job_id}?msg=")
    status = lab.farm("status", str(job_id), "--controller", lab.address, "--token", CLIENT, "--json")
    assert json.loads(status.stdout)["status"] == "canceled", status.stdout
    shown = _request(lab.url, r.getheader("Location"), headers={"Cookie": cookie})
    assert f"job {job_id} canceled" in shown.text and 'id="cancel"' not in shown.text
