// farm dashboard: sortable tables and live regions the server pushes (server-sent events; no library, no eval).
"use strict";
(function () {
  const sorted = {};  // table id -> [column index, direction]

  function cellValue(row, index, numeric) {
    const cell = row.children[index];
    const text = cell ? cell.getAttribute("data-sort") : "";
    if (text === "" || text === null) return null;
    if (numeric) { const n = parseFloat(text); return isNaN(n) ? null : n; }
    return text.toLowerCase();
  }

  function sortTable(table, index, direction) {
    const th = table.tHead.rows[0].children[index];
    if (!th) return;
    const numeric = th.getAttribute("data-type") === "num";
    const body = table.tBodies[0];
    const rows = Array.from(body.rows);
    rows.sort(function (a, b) {
      const x = cellValue(a, index, numeric), y = cellValue(b, index, numeric);
      if (x === null && y === null) return 0;
      if (x === null) return 1;  // missing values last, whichever the direction
      if (y === null) return -1;
      return (x < y ? -1 : x > y ? 1 : 0) * direction;
    });
    rows.forEach(function (r) { body.appendChild(r); });
    Array.from(th.parentNode.children).forEach(function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", direction > 0 ? "ascending" : "descending");
    sorted[table.id] = [index, direction];
  }

  function wire(root) {
    root.querySelectorAll("table.sortable").forEach(function (table) {
      Array.from(table.tHead.rows[0].children).forEach(function (th, index) {
        function go() {
          const now = sorted[table.id];
          sortTable(table, index, now && now[0] === index ? -now[1] : 1);
        }
        th.addEventListener("click", go);
        th.addEventListener("keydown", function (ev) { if (ev.key === "Enter") go(); });
      });
      const again = sorted[table.id];
      if (again) sortTable(table, again[0], again[1]);
    });
  }

  // Live regions: one server-sent event stream per page (not one per region: browsers allow six connections
  // to a host). The server renders the regions and sends one only when it changed; an idle page gets nothing.
  function subscribe(regions) {
    if (!regions.length || !window.EventSource) return;
    const have = regions.map(function (r) { return r.id + ":" + (r.getAttribute("data-etag") || ""); }).join(",");
    const url = "/events?page=" + encodeURIComponent(location.pathname + location.search) +
      "&have=" + encodeURIComponent(have);
    const pending = {};  // region id -> html held back while the person is typing or clicking inside it
    function apply(region, html, etag) {
      // the server escaped every value in this fragment; it is the same HTML the page was built with
      region.innerHTML = html;
      region.setAttribute("data-etag", etag);
      wire(region);
    }
    regions.forEach(function (region) {
      region.addEventListener("focusout", function () {
        setTimeout(function () {
          const held = pending[region.id];
          if (held && !region.contains(document.activeElement)) { delete pending[region.id]; apply(region, held[0], held[1]); }
        }, 0);
      });
    });
    const source = new EventSource(url, {withCredentials: true});
    source.addEventListener("open", function () {
      regions.forEach(function (r) { r.setAttribute("data-stream", "open"); });
    });
    source.addEventListener("update", function (ev) {
      let message;
      try { message = JSON.parse(ev.data); } catch (e) { return; }
      const region = document.getElementById(message.region);
      if (!region || !region.hasAttribute("data-live")) return;
      if (region.contains(document.activeElement)) { pending[region.id] = [message.html, message.etag]; return; }
      apply(region, message.html, message.etag);
    });
    source.addEventListener("error", function () {
      regions.forEach(function (r) { r.setAttribute("data-stream", "closed"); });
      // refused (logged out, the job gone): the page itself says why; a dropped connection reconnects by itself
      if (source.readyState === EventSource.CLOSED) setTimeout(function () { window.location.reload(); }, 5000);
    });
  }

  // A destructive form (cancel, quarantine) says what it will do and waits for a yes; delegated, so forms
  // a live region brings in later are covered too.
  document.addEventListener("submit", function (ev) {
    const form = ev.target;
    const question = form && form.getAttribute && form.getAttribute("data-confirm");
    const button = ev.submitter;
    if (question && !(button && button.value === "release") && !window.confirm(question)) ev.preventDefault();
  });

  document.addEventListener("DOMContentLoaded", function () {
    wire(document);
    subscribe(Array.from(document.querySelectorAll("[data-live]")));
  });
})();
