"""The dashboard's HTML: one function per page or live part, every value escaped on its way in.

Device names, model names, reasons and messages come from agents, job files and people:
they reach the page only through `e()`. Numbers are formatted here, with their units.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
from html import escape
from typing import TYPE_CHECKING, Any, Iterable, Sequence
from urllib.parse import quote, urlencode

from farm.controller.scheduling.store_file import StoreFile
from farm.web import svg
from farm.controller.store.rows import DriftRow, EarlierAttempt
from farm.web.views import (MIN_LOO_MODELS, ACTIVITIES, CONNECTIONS, FAILURES_SHOWN, HEALTHS, LAB_ROWS_SHOWN, AverageRow,
                            CalibrationSummary, CalibrationView, CompareView, DeviceLine, Failure, JobLine, JobView,
                            LabFilter, LabPage, LabView, RecentFailure, Sweep, lab_page)
from farm.controller.analysis.results import RunPair, is_contended, json_number
from farm.proto.questions import RunRecord

if TYPE_CHECKING:
    from farm.controller.analysis.compare import VariantRow
    from farm.controller.analysis.pareto import ParetoGroup

CONTENDED_MARK = "!"


def e(value: Any) -> str:
    return escape("" if value is None else str(value), quote=True)


def num(v: float | None, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    return f"{v:.{digits}g}" if abs(v) < 10 ** digits else f"{v:.0f}"


def when(t: float | None) -> str:
    if not t:
        return "—"
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 86400 * 2:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def sort_key(v: Any) -> str:
    """The value a sortable column sorts by (numbers numerically, missing values last)."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return ""
    return e(v)


def table(table_id: str, headers: list[tuple[str, str]], rows: Iterable[list[tuple[Any, str]]],
          caption: str = "") -> str:
    """headers: (label, "num"|"text"); each cell: (sort value, HTML already escaped)."""
    head = "".join(f'<th data-type="{kind}" tabindex="0">{e(label)}</th>' for label, kind in headers)
    body = "".join("<tr>" + "".join(f'<td data-sort="{sort_key(value)}">{html}</td>' for value, html in row) + "</tr>"
                   for row in rows)
    cap = f"<caption>{e(caption)}</caption>" if caption else ""
    return (f'<div class="scroll"><table class="sortable" id="{e(table_id)}">{cap}<thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table></div>")


def layout(title: str, body: str, *, active: str, role: str | None, csrf: str, message: str = "",
           open_mode: bool = False) -> str:
    nav = "".join(f'<a href="{href}"{" aria-current=page" if name == active else ""}>{label}</a>'
                  for name, href, label in (("lab", "/lab", "Lab"), ("jobs", "/jobs", "Jobs"),
                                            ("calibrations", "/calibrations", "Calibrations")))
    who = ""
    if role:
        who = (f'<span class="who">{e(role)}{" (open: no tokens)" if open_mode else ""}</span>'
               + ("" if open_mode else f'<form method="post" action="/logout" class="inline">'
                  f'<input type="hidden" name="csrf" value="{e(csrf)}"><button>log out</button></form>'))
    flash = f'<p class="flash" role="status">{e(message)}</p>' if message else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>{e(title)} · farm</title><link rel="stylesheet" href="/static/dashboard.css">'
            f'<script src="/static/dashboard.js" defer></script></head><body>'
            f'<header><strong>farm</strong><nav>{nav}</nav>{who}</header><main>{flash}<h1>{e(title)}</h1>{body}</main>'
            f"</body></html>")


def login_page(message: str = "", next_path: str = "/lab") -> str:
    flash = f'<p class="flash error" role="alert">{e(message)}</p>' if message else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>log in · farm</title>'
            f'<link rel="stylesheet" href="/static/dashboard.css"></head><body><main class="login">'
            f"<h1>farm</h1>{flash}"
            f'<form method="post" action="/login"><label>Token (a client or admin line of the controller\'s tokens file)'
            f'<input type="password" name="token" id="token" autocomplete="current-password" required></label>'
            f'<input type="hidden" name="next" value="{e(next_path)}">'
            f'<button type="submit" id="login">Log in</button></form></main></body></html>')


def fingerprint(html: str) -> str:
    """What a live region holds, in 16 hex digits: the event stream sends a region only when this changes."""
    return hashlib.sha256(html.encode()).hexdigest()[:16]


def live(part: str, url: str, html: str, every_s: float = 2.0) -> str:
    """A region the server updates while the page is open: pushed over server-sent events (dashboard.js), with
    `url` (the region alone) for a reload by hand. aria-live: a screen reader hears the change."""
    return (f'<div id="{e(part)}" data-live="{e(url)}" data-every="{every_s:g}" data-etag="{fingerprint(html)}" '
            f'aria-live="polite">{html}</div>')


# --- lab ------------------------------------------------------------------------------------------
def _device_actions(d: DeviceLine, csrf: str) -> str:
    hidden = f'<input type="hidden" name="csrf" value="{e(csrf)}"><input type="hidden" name="device" value="{e(d.name)}">'
    if d.health in ("bad", "maintenance"):
        return (f'<form method="post" action="/actions/device" class="actions">{hidden}'
                '<button name="action" value="release" class="release">release</button></form>')
    # taking a device out of service fails its waiting tasks: a reason is required, and the browser asks first
    field = f"reason-{fingerprint(d.name)}"
    return (f'<form method="post" action="/actions/device" class="actions" data-confirm="Take {e(d.name)} out of service? '
            f'Its waiting tasks fail (infrastructure).">{hidden}<label for="{field}" class="visually-hidden">reason for '
            f'{e(d.name)}</label><input id="{field}" name="reason" placeholder="reason (required)" maxlength="500" required>'
            '<button name="action" value="quarantine">quarantine</button>'
            '<button name="action" value="maintenance">maintenance</button></form>')


def store_facts(store: StoreFile) -> str:
    """Where this dashboard reads from, and whether that file is still the one on disk (a database: its address)."""
    if store.database:
        return (f'<h2>Store</h2><dl class="facts store" id="store-health"><dt>database</dt><dd>{e(store.path)}</dd>'
                f'<dt>last write</dt><dd>{e(when(store.last_write))}</dd></dl>')
    size = "—" if store.size_bytes is None else f"{store.size_bytes / 1e6:.1f} MB"
    state = ('<span class="health good">linked</span>' if store.ok else
             f'<span class="health bad">{"deleted" if not store.linked else "replaced"}</span>')
    return (f'<h2>Store</h2><dl class="facts store" id="store-health"><dt>path</dt><dd>{e(store.path)}</dd>'
            f'<dt>size</dt><dd>{e(size)}</dd><dt>last write</dt><dd>{e(when(store.last_write))}</dd>'
            f'<dt>file</dt><dd>{state}</dd></dl>')


def _lab_href(f: LabFilter, **change: Any) -> str:
    fields = f.query(**change)
    return "/lab" + ("?" + urlencode(fields) if fields else "")


def lab_filter_form(f: LabFilter) -> str:
    """Filters as a plain GET form (bookmarkable; works without script), every input with its label."""
    def select(name: str, label: str, words: tuple[str, ...], current: str | None) -> str:
        options = '<option value="">any</option>' + "".join(
            f'<option value="{e(w)}"{" selected" if w == current else ""}>{e(w)}</option>' for w in words)
        return f'<label for="filter-{name}">{e(label)}</label><select id="filter-{name}" name="{name}">{options}</select>'
    return ('<form method="get" action="/lab" class="filters" role="search" aria-label="filter devices">'
            + select("health", "health", HEALTHS, f.health) + select("state", "connection", CONNECTIONS, f.state)
            + select("activity", "activity", ACTIVITIES, f.activity)
            + f'<label for="filter-name">name contains</label><input id="filter-name" name="name" value="{e(f.name)}" '
              'maxlength="100" type="search"><button type="submit">filter</button>'
            + (' <a href="/lab">clear</a>' if f.query(page=None) else "") + "</form>")


def lab_summary(p: LabPage, f: LabFilter, total: int) -> str:
    """The lab in one line per question: how healthy, how connected, how busy; each count filters the list."""
    def counts(field: str, values: dict[str, int]) -> str:
        return " · ".join(f'<a href="{e(_lab_href(f, **{field: k, "page": None}))}" class="count {e(k)}" '
                          f'data-{field}="{e(k)}"><strong>{n}</strong> {e(k)}</a>' for k, n in values.items() if n)
    return (f'<section class="summary" aria-label="lab summary"><p><strong>{total}</strong> device(s)</p>'
            f'<p>health: {counts("health", p.health) or "—"}</p>'
            f'<p>connection: {counts("state", p.connection) or "—"}</p>'
            f'<p>activity: <a href="{e(_lab_href(f, activity="busy", page=None))}" class="count busy" data-activity="busy">'
            f'<strong>{p.busy}</strong> busy</a> · <a href="{e(_lab_href(f, activity="idle", page=None))}" class="count idle" '
            f'data-activity="idle"><strong>{total - p.busy}</strong> idle</a></p></section>')


def pagination(p: LabPage, f: LabFilter) -> str:
    if p.pages <= 1:
        return ""
    prev = (f'<a href="{e(_lab_href(f, page=p.page - 1 if p.page > 2 else None))}" rel="prev">previous</a>'
            if p.page > 1 else "<span>previous</span>")
    nxt = f'<a href="{e(_lab_href(f, page=p.page + 1))}" rel="next">next</a>' if p.page < p.pages else "<span>next</span>"
    return f'<nav class="pages" aria-label="device pages">{prev} <span>page {p.page} of {p.pages}</span> {nxt}</nav>'


def failures_panel(rows: list[RecentFailure]) -> str:
    if not rows:
        return "<p>No failed runs.</p>"
    items = "".join(
        f'<li><a href="/jobs/{r.job_id}#failure-{r.task_id}">job {r.job_id} task {r.task_id}</a> '
        f'<span class="status failed">{e(r.failure_class)}</span> {e(r.model_name)} @ {e(r.target)} '
        f'· {e(when(r.finished_at))}{_attempts(r.failed_attempts)}<br>'
        f'<span class="why">{e(_first_line(r.message)[:200])}</span></li>' for r in rows)
    return f'<ul class="panel">{items}</ul>'


def drift_panel(rows: list[DriftRow]) -> str:
    if not rows:
        return "<p>No drift alerts: no refresh moved a calibration past its thresholds.</p>"
    items = "".join(
        f'<li><a href="/calibrations/{r.calibration_id}">{e(r.device)} · {e(r.metric)} · {e(r.threads)} '
        f'thread(s)</a> · {e(when(r.created_at))}<br><span class="why">{e((r.reasons or "")[:200])}</span></li>'
        for r in rows)
    return f'<ul class="panel">{items}</ul>'


def _attempts(failed: int | None) -> str:
    """A task retried and failed again is one line of the panel, saying how many of its attempts failed."""
    return f" · {int(failed)} failed attempts" if failed and failed > 1 else ""


def _first_line(text: str | None) -> str:
    text = (text or "").strip()
    return text.splitlines()[0] if text else ""


def lab_devices(view: LabView, *, csrf: str, may_operate: bool, f: LabFilter = LabFilter()) -> str:
    p = lab_page(view.devices, f)
    # health and its buttons first: what a person walking past the rack looks for, also on a phone
    headers = [("device", "text"), ("health", "text"), *([("actions", "text")] if may_operate else []),
               ("reason", "text"), ("connection", "text"), ("current task", "text"), ("last health check", "num"),
               ("calibration age", "num"), ("since", "num"), ("type", "text"), ("agent", "text")]
    rows = []
    for d in p.shown:
        current = ('<span class="busy">busy</span>: ' + ", ".join(
            "another team's task" if t.hidden else
            f'<a href="/jobs/{t.job_id}">job {t.job_id}</a> task {t.id} {e(t.task.model_name)}' for t in d.current)
            if d.current else '<span class="idle">idle</span>')
        rows.append([(d.name, f'<span class="device-name">{e(d.name)}</span>'),
                     (d.health, f'<span class="health {e(d.health)}">{e(d.health)}</span>'),
                     *([("", _device_actions(d, csrf))] if may_operate else []), (d.reason, e(d.reason or "")),
                     (d.state, f'<span class="state {e(d.state)}">{e(d.state)}</span>'), (len(d.current), current),
                     (d.last_check, e(when(d.last_check))), (None if d.calibration_age_s is None else int(d.calibration_age_s // 60),  # stable between renders
                      e(age(d.calibration_age_s))),
                     (d.changed_at, e(when(d.changed_at))), (d.device_type, e(d.device_type or "—")),
                     (d.agent, e(d.agent or "—"))])
    if rows:
        caption = (f"{p.matched} of {len(view.devices)} device(s) match" if p.matched != len(view.devices) else "")
        devices = table("devices", headers, rows, caption) + pagination(p, f)
    elif view.devices:
        devices = '<p>No device matches these filters. <a href="/lab">Show all</a>.</p>'
    else:
        devices = "<p>No devices yet: agents register theirs when they connect.</p>"
    agents = table("agents", [("agent", "text"), ("connection", "text"), ("host", "text"), ("peer", "text"),
                              ("farm", "text"), ("connected", "num"), ("last seen", "num"), ("running", "num"),
                              ("controller", "text")],
                   [[(a.name, e(a.name)), (a.state, f'<span class="state {e(a.state)}">{e(a.state)}</span>'),
                     (a.hostname, e(a.hostname)), (a.peer, e(a.peer)), (a.farm_version, e(a.farm_version)),
                     (a.connected_at, e(when(a.connected_at))), (a.last_seen, e(when(a.last_seen))),
                     (a.running, e("—" if a.running is None else a.running)),
                     (a.controller or "", e(a.controller or "—"))]
                    for a in view.agents]) if view.agents else "<p>No agent has connected (embedded runs use none).</p>"
    shown_running = view.running[:LAB_ROWS_SHOWN]
    running = table("running", [("task", "num"), ("job", "num"), ("device", "text"), ("model", "text"),
                                ("attempt", "num"), ("agent", "text")],
                    [[(t.id, e(t.id)), (t.job_id, f'<a href="/jobs/{t.job_id}">{t.job_id}</a>'),
                      (t.device, e(t.device)), (t.task.model_name, e(t.task.model_name)),
                      (t.task.attempts, e(t.task.attempts)),
                      (t.task.leased_by, e(t.task.leased_by or "—") + (
                          ' <span class="stale">(lease held; the agent is not running it now)</span>'
                          if t.in_session is False else ""))] for t in shown_running],
                    f"the first {len(shown_running)} of {len(view.running)}" if len(view.running) > len(shown_running)
                    else "") if view.running else "<p>Nothing running.</p>"
    shown_queue = view.queue[:LAB_ROWS_SHOWN]
    queue = table("queue", [("job", "num"), ("target", "text"), ("priority", "num"), ("pending", "num")],
                  [[(q.job_id, f'<a href="/jobs/{q.job_id}">{q.job_id}</a>'), (q.target, e(q.target)),
                    (q.priority, e(q.priority)), (q.pending, e(q.pending))] for q in shown_queue],
                  f"the first {len(shown_queue)} of {len(view.queue)} rows" if len(view.queue) > len(shown_queue) else ""
                  ) if view.queue else "<p>The queue is empty.</p>"
    return (lab_summary(p, f, len(view.devices))
            + f'<div class="panels"><section aria-labelledby="recent-failures-h"><h2 id="recent-failures-h">Recent failures'
              f'</h2>{failures_panel(view.recent_failures)}</section><section aria-labelledby="drift-h">'
              f'<h2 id="drift-h">Drift alerts</h2>{drift_panel(view.drift_alerts)}</section></div>'
            + f"<h2>Devices ({p.matched})</h2>{devices}<h2>Agents ({len(view.agents)})</h2>{agents}"
            f"<h2>Running ({len(view.running)})</h2>{running}<h2>Queue ({view.pending} pending)</h2>{queue}")


# --- jobs -----------------------------------------------------------------------------------------
def progress_bar(p: dict[str, int]) -> str:
    """Drawn as SVG: widths are attributes, so the page needs no inline style (the CSP allows none)."""
    total = max(p["total"], 1)
    x, bars = 0.0, []
    for state in ("completed", "failed", "canceled", "running"):
        width = 100 * p[state] / total
        if width:
            bars.append(f'<rect class="{state}" x="{x:.2f}" y="0" width="{width:.2f}" height="6"/>')
            x += width
    text = (f'{p["done"]}/{p["total"]} done · {p["completed"]} completed · {p["failed"]} failed · '
            f'{p["running"]} running · {p["pending"]} pending')
    return (f'<svg class="progress" role="progressbar" aria-valuemin="0" aria-valuemax="{p["total"]}" '
            f'aria-valuenow="{p["done"]}" viewBox="0 0 100 6" preserveAspectRatio="none">'
            f'<rect class="track" x="0" y="0" width="100" height="6"/>{"".join(bars)}</svg>'
            f'<span class="progress-text" data-done="{p["done"]}" data-total="{p["total"]}">{e(text)}</span>')


def status_words(status: str, p: dict[str, int]) -> tuple[str, str]:
    """(css class, words) for a job: a job with some runs done and some failed says so, not only "failed"."""
    if p["failed"] and p["completed"]:
        words = f'{p["completed"]}/{p["total"]} done, {p["failed"]} failed'
        if status in ("running", "queued"):
            words += f" ({status})"
        return "partial", words
    return status, status


def status_span(status: str, p: dict[str, int], element_id: str = "") -> str:
    css, words = status_words(status, p)
    ident = f' id="{e(element_id)}"' if element_id else ""
    return f'<span class="status {e(css)}"{ident} data-status="{e(status)}">{e(words)}</span>'


def attempt_note(attempts: int | None, earlier: Sequence[EarlierAttempt]) -> str:
    """`attempt N` with why the earlier ones were run again (contention retries, lost or failed attempts)."""
    if not attempts or attempts < 2:
        return ""
    contended = sum(1 for x in earlier if x.contended)
    lost = [x for x in earlier if not x.contended]
    why = []
    if contended:
        why.append(f"{contended} contention retr{'y' if contended == 1 else 'ies'} (other work used the run's cores, "
                   "so the sim run was measured again)")
    if lost:
        classes = sorted({str(x.failure_class or x.status or "lost") for x in lost})
        why.append(f"{len(lost)} earlier attempt(s) ended {', '.join(classes)} and were retried")
    if not why:
        why.append(f"{attempts - 1} earlier attempt(s) were retried")
    text = "; ".join(why)
    return f' <abbr class="attempt" title="{e(text)}">attempt {attempts}</abbr><span class="visually-hidden"> ({e(text)})</span>'


def jobs_list(jobs: list[JobLine], total: int) -> str:
    if not jobs:
        return "<p>No jobs yet: <code>farm submit job.yaml</code>.</p>"
    rows = [[(j.id, f'<a href="/jobs/{j.id}">{j.id}</a>'), (j.name, e(j.name)), (j.kind, e(j.kind)),
             (j.status, status_span(j.status, line.progress)),
             (j.priority, e(j.priority)), (j.created_at, e(when(j.created_at))),
             (line.progress["done"], progress_bar(line.progress))] for line in jobs for j in (line.job,)]
    caption = f"newest {len(jobs)} of {total} jobs" if total > len(jobs) else ""
    return table("jobs", [("job", "num"), ("name", "text"), ("kind", "text"), ("status", "text"), ("priority", "text"),
                          ("created", "num"), ("progress", "num")], rows, caption)


def job_progress_part(status: str, progress: dict[str, int]) -> str:
    return (f'<p>status {status_span(status, progress, "job-status")}</p>'
            f'<div id="job-progress-bar">{progress_bar(progress)}</div>')


def _budget(r: RunRecord) -> str:
    lim = r.limits
    text = f"{lim.cpus:g} cpu" if lim.cpus else "no cpu cap"
    if lim.memory_mb:
        text += f", {lim.memory_mb:g} MB"
    return text


def _result_row(r: RunRecord, earlier: Sequence[EarlierAttempt]) -> list[tuple[Any, str]]:
    """One run's row of the results table: each cell's sort value and its HTML."""
    avg, p50, p90, std = ((getattr(r.latency_ms, k) if r.latency_ms else None) for k in ("avg", "p50", "p90", "std"))
    status = r.status if not r.failure_class else f"{r.status} ({r.failure_class})"
    why = ""
    if r.status == "failed" and r.failure_class and r.message:
        first = r.message.strip().splitlines()[0] if r.message.strip() else ""
        why = f'<a href="#failure-{e(r.task)}" class="why">{e(first[:160])}</a>'
    mark = attempt_note(r.attempts, earlier)
    if r.status == "completed" and is_contended(r):
        mark += (f' <abbr class="contended" title="contended: other work used the run\'s cores; calibrate, predict '
                 f'and rank leave it out">{CONTENDED_MARK}</abbr>')
    return [(r.model.name, e(r.model.name)), (r.target, e(r.target)), (r.threads, e(r.threads)),
            (r.batch_size, e(r.batch_size)), (r.input_size, e(r.input_size or "—")),
            (r.accelerator, e(r.accelerator)), (r.repeat, e(r.repeat)),
            (status, f'<span class="status {e(r.status)}">{e(status)}</span>{mark}'),
            (avg, num(avg)), (p50, num(p50)), (p90, num(p90)), (std, num(std)),
            (r.peak_memory_mb, num(r.peak_memory_mb)), (r.avg_memory_mb, num(r.avg_memory_mb)),
            (r.cpu_percent.avg, num(r.cpu_percent.avg)), (r.wall_s, num(r.wall_s)), (_budget(r), e(_budget(r))),
            (r.backend, e(r.backend or "—")), (r.message if why else "", why)]


def results_part(view: JobView) -> str:
    records = view.records
    rows = [_result_row(r, view.earlier.get(r.task, [])) for r in records]
    contended = sum(is_contended(r) for r in records)
    caption = (f"{CONTENDED_MARK} contended ({contended} run(s)): other work used the run's cores, its figures are not "
               "the budget's" if contended else "")
    return table("results", [("model", "text"), ("target", "text"), ("threads", "num"), ("batch", "num"), ("input", "num"),
                             ("unit", "text"), ("repeat", "num"), ("status", "text"), ("latency avg ms", "num"), ("p50 ms", "num"),
                             ("p90 ms", "num"), ("std ms", "num"), ("peak MB", "num"), ("avg MB", "num"),
                             ("CPU % avg", "num"), ("wall s", "num"), ("budget", "text"), ("backend", "text"),
                             ("why it failed", "text")],
                 rows, caption) if records else "<p>No tasks.</p>"


def _mib(v: float | None) -> str:
    return "unknown" if v is None else f"{num(v, 4)} MiB"


def failure_section(f: Failure, anchor: str) -> str:
    """One failed run: its class, its whole message, and the evidence the store kept."""
    evidence = []
    if f.failure_class == "resource":
        evidence.append(("memory", f"limit {_mib(f.memory_limit_mb)} · peak {_mib(f.memory_peak_mb)}"))
    if f.operators:
        evidence.append(("unsupported operator" + ("s" if len(f.operators) > 1 else ""), ", ".join(f.operators)))
    dl = "".join(f"<dt>{e(k)}</dt><dd class=\"evidence\">{e(v)}</dd>" for k, v in evidence)
    log_tail = ""
    if f.log_lines:
        log_tail = (f'<details open><summary>last {len(f.log_lines)} line(s) of its output</summary>'
                    f'<pre class="log">{e(chr(10).join(f.log_lines))}</pre></details>')
    return (f'<section class="failure" id="{e(anchor)}"><h3>{e(f.title)}</h3>'
            f'<p><span class="status failed">failed ({e(f.failure_class)})</span> '
            f'<span class="failure-help">{e(FAILURE_HELP.get(f.failure_class, ""))}</span></p>'
            f'<pre class="message">{e(f.message or "(no message)")}</pre>'
            + (f'<dl class="facts">{dl}</dl>' if dl else "") + f"{log_tail}</section>")


FAILURE_HELP = {
    "resource": "the run hit its memory, disk or CPU budget",
    "job": "the job itself is at fault (the model, the script or the spec): retrying will not help",
    "timeout": "the run exceeded its time limit",
    "infrastructure": "the agent, the transport or the device failed; farm retries these elsewhere",
    "bug": "farm itself failed; the controller's log has the details",
    "accuracy": "the outputs mismatch the reference or the labels beyond the job's workload.dataset.thresholds",
}


def averages_table(rows: list[AverageRow]) -> str:
    return table("averages", [("model", "text"), ("target", "text"), ("threads", "num"), ("batch", "num"),
                              ("input", "num"), ("CPU budget", "num"), ("runs", "num"), ("contended (left out)", "num"),
                              ("latency ms (mean)", "num"), ("± ms (sd over repeats)", "num"), ("peak MB", "num"),
                              ("avg MB", "num")],
                 [[(a.model, e(a.model)), (a.target, e(a.target)), (a.threads, e(a.threads)), (a.batch_size, e(a.batch_size)),
                   (a.input_size, e(a.input_size or "—")), (a.cpus, e("—" if a.cpus is None else f"{a.cpus:g}")),
                   (a.runs, e(a.runs)),
                   (a.contended, e(a.contended) + (f" {CONTENDED_MARK}" if a.contended else "")),
                   (a.latency_ms, num(a.latency_ms)), (a.latency_spread_ms, num(a.latency_spread_ms)),
                   (a.peak_memory_mb, num(a.peak_memory_mb)), (a.avg_memory_mb, num(a.avg_memory_mb))] for a in rows])


def pairs_table(pairs: list[RunPair]) -> str:
    rows = []
    for p in pairs:
        s_lat = _avg(p.sim)
        d_lat = _avg(p.device_run)
        ratio = d_lat / s_lat if s_lat and d_lat else None
        mark = f" {CONTENDED_MARK}" if is_contended(p.sim) else ""
        rows.append([(p.model.name, e(p.model.name)), (p.device, e(p.device)), (p.threads, e(p.threads)),
                     (p.repeat, e(p.repeat)), (s_lat, num(s_lat) + mark), (d_lat, num(d_lat)), (ratio, num(ratio)),
                     (p.sim.peak_memory_mb, num(p.sim.peak_memory_mb)),
                     (p.device_run.peak_memory_mb, num(p.device_run.peak_memory_mb))])
    return table("pairs", [("model", "text"), ("device", "text"), ("threads", "num"), ("repeat", "num"),
                           ("sim latency ms", "num"), ("device latency ms", "num"), ("device / sim", "num"),
                           ("sim peak MB", "num"), ("device peak MB", "num")], rows)


def predictions_table(records: list[RunRecord]) -> str:
    """Each completed run with each device's calibrated latency estimate and its interval."""
    rows = []
    for r in records:
        for device, entry in sorted((r.predictions or {}).items()):
            lat = entry.get("latency") if isinstance(entry, dict) else None
            if not isinstance(lat, dict):
                lat = {}
            low, high, estimate = (json_number(lat, k) for k in ("low", "high", "estimate"))
            version = lat.get("version")
            interval = (f"{num(low)} – {num(high)}" if lat else "no calibration")
            note = "" if not lat or lat.get("same_sim_budget") else " (calibrated under another sim budget)"
            rows.append([(r.model.name, e(r.model.name)), (r.threads, e(r.threads)),
                         (r.repeat, e(r.repeat)), (_avg(r), num(_avg(r))), (device, e(device)),
                         (estimate, num(estimate)), (low, e(interval + note)),
                         (version, e("—" if version is None else version))])
    return table("predictions", [("model", "text"), ("threads", "num"), ("repeat", "num"), ("sim latency ms", "num"),
                                 ("device", "text"), ("predicted ms", "num"), ("interval", "num"),
                                 ("calibration version", "num")], rows)


def _avg(r: RunRecord) -> float | None:
    return r.latency_ms.avg if r.latency_ms else None


def sweep_part(sweep: Sweep, index: int) -> str:
    """The lines that vary along the dimension, then the series measured at one value of it, as table rows."""
    html = f'<figure>{svg.render(sweep.chart)}</figure>' if sweep.chart else ""
    if sweep.single:
        html += table(f"sweep-single-{index}", [("series", "text"), (sweep.label, "num"), ("latency avg (ms)", "num")],
                      [[(name, e(name)), (x, e(num(x))), (y, e(num(y)))] for name, x, y in sweep.single],
                      f"measured at one {sweep.label} only (a point, not a line)")
    return html


VARIANT_FIGURES = (("energy_per_inference_mj", "mJ/inference"), ("agreement_cosine", "cosine with the reference"),
                   ("agreement_top1", "top-1 agreement"), ("accuracy_top1", "accuracy top-1"))


def variants_table(variants: list[VariantRow], names: tuple[str, str] = ("source", "variant"),
                   table_id: str = "variants") -> str:
    """A job's quantized variants beside their sources (`farm compare JOB`'s figures), noise judged over repeats;
    energy and the dataset's agreement/accuracy where both sides measured them."""
    def arrow(a: float | None, b: float | None, scale: float = 1.0) -> tuple[float | None, str]:
        if a is None or b is None:
            return (None, "—")
        return (b / scale, e(f"{num(a / scale)} → {num(b / scale)}"))

    extra = [(key, header) for key, header in VARIANT_FIGURES if any(v.figures.get(key) for v in variants)]
    rows = [[(v.source, e(v.source)), (v.variant, e(v.variant)), (v.method, e(v.method or "—")),
             (v.target, e(v.target)), (v.accelerator, e(v.accelerator)), (v.threads, e(v.threads)),
             arrow(v.size_a, v.size_b, 1e6), arrow(v.latency_a, v.latency_b),
             (v.latency_change, e(f"{v.latency_change:+.0%}") if v.latency_change is not None else "—"),
             arrow(v.memory_a, v.memory_b), *[arrow(*v.sides(key)) for key, _ in extra],
             (v.verdict, e(v.verdict or "—"))] for v in variants]
    return table(table_id, [(names[0], "text"), (names[1], "text"), ("method", "text"), ("on", "text"),
                              ("unit", "text"), ("threads", "num"), ("size MB", "num"), ("latency avg ms", "num"),
                              ("Δ latency", "num"), ("peak MB", "num"), *[(h, "num") for _, h in extra],
                              ("latency vs noise", "text")], rows,
                 "before → after; noise: Welch's t at 95 % over the repeats (farm compare JOB has every figure)")


def pareto_part(pareto: list[tuple[ParetoGroup, svg.Chart]]) -> str:
    """Accuracy against latency per setting: the chart, then every model with the front marked."""
    parts = []
    for i, (group, chart) in enumerate(pareto):
        rows = [[(p.label, e(p.label)), (p.latency_avg_ms, e(num(p.latency_avg_ms))),
                 (p.quality, e(num(p.quality))),
                 (p.runs, e(f"{p.runs}{' (contended)' if p.contended else ''}")),
                 (0 if p.on_front else 1, e("on the front" if p.on_front else
                                            "dominated by " + ", ".join(p.dominated_by)))]
                for p in group.points]
        parts.append(f'<figure class="pareto" id="pareto-chart-{i}">{svg.render(chart)}</figure>' + table(
            f"pareto-{i}", [("model", "text"), ("latency avg ms", "num"), (group.quality_label, "num"),
                            ("runs", "num"), ("Pareto", "text")], rows,
            "dominated: another model is at least as fast and as accurate, and better in one (means over the runs)"))
    return "".join(parts)


def compare_form(job_id: int) -> str:
    """On a job's page: open the comparison of this job (before) with another (after)."""
    return (f'<form method="get" action="/compare" class="inline compare-form"><input type="hidden" name="a" '
            f'value="{e(job_id)}"><label>compare with job <input name="b" inputmode="numeric" pattern="[0-9]{{1,18}}" '
            f'size="6" required></label> <button>compare</button></form>')


def compare_page(view: CompareView) -> str:
    """`farm compare A B` on the dashboard: before → after per model pair and setting, then accuracy against latency
    of both jobs' models with the Pareto front; downloads as CSV (one row per pair and setting) and JSON."""
    a, b = view.job_a.id, view.job_b.id
    report = view.report
    parts = [f'<p class="meta">before: <a href="/jobs/{e(a)}">job {e(a)}</a> {e(view.job_a.name or "")} · after: '
             f'<a href="/jobs/{e(b)}">job {e(b)}</a> {e(view.job_b.name or "")}</p>',
             f'<p class="downloads">download <a href="/compare/{e(a)}/{e(b)}.csv" download>CSV</a> · '
             f'<a href="/compare/{e(a)}/{e(b)}.json" download>JSON</a></p>']
    if view.rows:
        matched = "; ".join(f"{p.model_b.name}: {p.matched_by}" for p in report.pairs)
        parts.append('<h2 id="before-after">Before → after</h2>'
                     + variants_table(view.rows, ("A", "B"), "compare") + f'<p class="note">paired by {e(matched)}</p>')
    else:
        parts.append('<p class="message">No model pair with a run condition in common: '
                     + e(" ".join(report.notes) or "the jobs share no model name, no `farm quantize` lineage, and "
                         "are not one model each") + "</p>")
    if report.unmatched_a or report.unmatched_b:
        parts.append(f'<p class="note">not paired: A {e(", ".join(report.unmatched_a) or "—")}; B '
                     f'{e(", ".join(report.unmatched_b) or "—")}</p>')
    if view.pareto:
        parts.append('<h2 id="pareto">Accuracy against latency (Pareto)</h2>' + pareto_part(view.pareto))
    parts += [f'<p class="note">{e(note)}</p>' for note in [*report.notes, *view.pareto_notes]]
    return "".join(parts)


def job_page(view: JobView, *, csrf: str, may_cancel: bool) -> str:
    job = view.job
    job_id = job.id
    cancel = ""
    if may_cancel and job.status in ("queued", "running"):
        cancel = (f'<form method="post" action="/jobs/{job_id}/cancel" class="inline" data-confirm="Cancel job {job_id}? '
                  f'Its unfinished tasks stop and are not run again."><input type="hidden" name="csrf" '
                  f'value="{e(csrf)}"><button class="danger" id="cancel">cancel job</button></form>')
    parts = [f'<p class="meta">{e(job.name)} · {e(job.kind)} · priority {e(job.priority)} · created '
             f'{e(when(job.created_at))} {cancel}</p>',
             f'<p class="downloads">download <a href="/jobs/{job_id}/results.csv" download>CSV</a> · '
             f'<a href="/jobs/{job_id}/results.json" download>JSON</a></p>', compare_form(job_id)]
    if job.message:
        parts.append(f'<p class="message">{e(job.message)}</p>')
    if view.failures:
        shown = view.failures[:FAILURES_SHOWN]
        more = (f"<p>The first {len(shown)} are shown; the JSON download has all {len(view.failures)}.</p>"
                if len(view.failures) > len(shown) else "")
        parts.append(f'<h2 id="failures">Why {len(view.failures)} run(s) failed</h2>{more}' + "".join(
            failure_section(f, f"failure-{f.task}") for f in shown))
    parts.append(live("job-progress", f"/jobs/{job_id}?part=progress", job_progress_part(job.status, view.progress)))
    parts.append("<h2>Results</h2>" + live("job-results", f"/jobs/{job_id}?part=results", results_part(view), 5))
    if view.averages and any(a.runs > 1 or a.contended for a in view.averages):
        parts.append("<h2>Averages over repeats</h2>" + averages_table(view.averages))
    if view.pairs:
        parts.append("<h2>Sim / device pairs</h2>" + "".join(
            f'<figure class="pair-scatter" id="pair-scatter-{i}">{svg.render(c)}</figure>'
            for i, c in enumerate(view.pair_charts)) + pairs_table(view.pairs))
    if view.variants:
        parts.append("<h2>Variants beside their source (farm quantize)</h2>" + variants_table(view.variants))
    if view.pareto:
        parts.append('<h2 id="pareto">Accuracy against latency (Pareto)</h2>' + pareto_part(view.pareto))
    predicted = [r for r in view.records if r.predictions]
    if predicted:
        parts.append("<h2>Predictions beside the runs (predict_for)</h2>" + predictions_table(predicted))
    if view.sweeps:
        parts.append("<h2>Sweeps</h2>" + "".join(sweep_part(s, i) for i, s in enumerate(view.sweeps)))
    for i, (title, columns, rows) in enumerate(view.op_tables):
        if i == 0:
            parts.append("<h2>Per-operator profiles</h2>")
        parts.append(table(f"ops-{i}", [(c, "text") for c in columns],
                           [[(v, e(num(v) if isinstance(v, float) else v)) for v in row] for row in rows], title))
    return "".join(parts)


# --- calibrations -------------------------------------------------------------------------------
def verdict(unsafe: bool) -> str:
    return '<span class="verdict unsafe">unsafe</span>' if unsafe else '<span class="verdict ok">usable</span>'


def loo_text(loo: float | None, n: int | None) -> str:
    """A leave-one-out error in percent; "—" (not "0 %") when too few models were fitted for it to mean anything."""
    if loo is None or (n or 0) < MIN_LOO_MODELS:
        return f"— (too few models: {n})" if n is not None and n < MIN_LOO_MODELS else "—"
    return f"{num(100 * loo)} %"


def calibrations_list(items: list[CalibrationSummary]) -> str:
    if not items:
        return "<p>No calibrations yet: <code>farm calibrate</code> or a refresh stores them.</p>"
    rows = [[(c.row.device, e(c.row.device)), (c.row.metric, e(c.row.metric)), (c.row.threads, e(c.row.threads)),
             (c.row.runtime, e(c.row.runtime)), (c.row.batch_size, e(c.row.batch_size)),
             (c.row.family, e(c.row.family or "all")),
             (c.row.version, f'<a href="/calibrations/{c.row.id}">v{c.row.version}</a> of {c.row.versions}'),
             (c.row.n, e(c.row.n)), (c.row.r2, num(c.row.r2)),
             (c.row.loo_mape, loo_text(c.row.loo_mape, c.row.n)),
             (c.row.kendall_tau, num(c.row.kendall_tau)), (int(c.unsafe), verdict(c.unsafe)),
             (c.row.created_at, e(when(c.row.created_at)))] for c in items]
    return table("calibrations", [("device", "text"), ("metric", "text"), ("threads", "num"), ("runtime", "text"),
                                  ("batch", "num"), ("family", "text"), ("version", "num"), ("models", "num"),
                                  ("R²", "num"), ("LOO error", "num"), ("Kendall τ", "num"), ("verdict", "num"),
                                  ("stored", "num")], rows)


def calibration_page(v: CalibrationView) -> str:
    fit = v.fit
    facts = [("fit", v.chosen), ("formula", v.formula), ("R²", num(fit.r2)),
             ("leave-one-out error", f"{loo_text(fit.loo_mape, fit.n)} (mean absolute, each model predicted without itself)"),
             ("within 10 %", f"{num(100 * fit.loo_within_10)} % of models"),
             ("rank agreement", f"Kendall τ {num(fit.kendall_tau)} · Spearman ρ {num(fit.spearman_rho)}"),
             ("models", str(fit.n)), ("interval", f"{v.confidence:.0%} prediction interval"),
             ("stored", when(v.row.created_at)), ("unit", v.unit)]
    dl = "".join(f"<dt>{e(k)}</dt><dd>{e(val)}</dd>" for k, val in facts)
    reasons = "".join(f"<li>{e(r)}</li>" for r in v.unsafe_reasons)
    warnings = "".join(f"<li>{e(w)}</li>" for w in v.warnings)
    parts = [f'<p>{verdict(bool(v.unsafe_reasons))}</p>' + (f'<ul class="reasons">{reasons}</ul>' if reasons else ""),
             f'<div class="two"><figure id="scatter">{svg.render(v.chart)}</figure><dl class="facts">{dl}</dl></div>']
    if warnings:
        parts.append(f'<h2>Warnings</h2><ul>{warnings}</ul>')
    parts.append("<h2>Models</h2>" + table("models", [("model", "text"), ("family", "text"), (f"sim {v.unit}", "num"),
                                                      (f"device {v.unit}", "num"), ("fitted", "num"), ("low", "num"),
                                                      ("high", "num")],
                                           [[(m.model, e(m.model)), (m.family, e(m.family or "—")),
                                             (m.sim, num(m.sim)), (m.device, num(m.device)),
                                             (m.fitted, num(m.fitted)), (m.low, num(m.low)),
                                             (m.high, num(m.high))] for m in v.models]))
    parts.append("<h2>History</h2>")
    if len(v.versions) > 1:
        parts.append('<div class="two" id="history">' + "".join(
            f'<figure class="history-chart">{svg.render(c)}</figure>' for c in v.history_charts) + "</div>")
    parts.append(table("versions", [("version", "num"), ("stored", "num"), ("fit", "text"), ("models", "num"), ("R²", "num"),
                                    ("LOO error %", "num"), ("Kendall τ", "num"), ("verdict", "num"), ("formula", "text")],
                       [[(x.version, f'<a href="/calibrations/{x.id}">v{x.version}</a>'),
                         (x.created_at, e(when(x.created_at))), (x.kind, e(x.kind)), (x.n, e(x.n)),
                         (x.r2, num(x.r2)), (x.loo_mape, loo_text(x.loo_mape, x.n)),
                         (x.kendall_tau, num(x.kendall_tau)), (int(line.unsafe), verdict(line.unsafe)),
                         (line.formula, e(line.formula))] for line in v.versions for x in (line.row,)]))
    parts.append("<h2>Drift between refreshes</h2>")
    if v.drift:
        parts.append(f'<figure id="drift-chart">{svg.render(v.drift_chart)}</figure>')
        parts.append(table("drift", [("stored", "num"), ("calibration", "num"), ("previous", "num"), ("slope change", "num"),
                                     ("intercept change", "num"), ("R² drop", "num"), ("prediction shift", "num"),
                                     ("exceeded", "num"), ("reasons", "text")],
                           [[(d.created_at, e(when(d.created_at))),
                             (d.calibration_id, f'<a href="/calibrations/{d.calibration_id}">{d.calibration_id}</a>'),
                             (d.previous_id, f'<a href="/calibrations/{d.previous_id}">{d.previous_id}</a>'),
                             (d.slope_change, num(d.slope_change)), (d.intercept_change, num(d.intercept_change)),
                             (d.r2_drop, num(d.r2_drop)), (d.prediction_shift, num(d.prediction_shift)),
                             (d.exceeded, "yes" if d.exceeded else "no"), (d.reasons, e(d.reasons or ""))]
                            for d in v.drift]))
    else:
        parts.append("<p>No refresh has compared this calibration with an earlier one yet.</p>")
    return "".join(parts)


def error_page(status: int, message: str) -> str:
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{status} · farm</title>'
            f'<link rel="stylesheet" href="/static/dashboard.css"></head><body><main><h1>{status}</h1>'
            f'<p>{e(message)}</p><p><a href="/lab">back to the lab</a></p></main></body></html>')


def flash_url(path: str, message: str) -> str:
    return f"{path}?msg={quote(message[:300])}"

