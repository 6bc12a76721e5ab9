// farm dashboard: sortable tables and live regions refreshed from the server (no library, no eval).
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

  function poll(region) {
    const url = region.getAttribute("data-live");
    const every = Math.max(1, parseFloat(region.getAttribute("data-every") || "2")) * 1000;
    function tick() {
      if (document.hidden || region.contains(document.activeElement)) { setTimeout(tick, every); return; }
      fetch(url, {credentials: "same-origin", headers: {"Accept": "text/html"}}).then(function (r) {
        if (r.status === 401) { window.location.reload(); return null; }
        return r.ok ? r.text() : null;
      }).then(function (html) {
        // the server escaped every value in this fragment; it is the same HTML the page was built with
        if (html !== null && html !== undefined && !region.contains(document.activeElement)) {
          region.innerHTML = html;
          wire(region);
        }
      }).catch(function () {}).finally(function () { setTimeout(tick, every); });
    }
    setTimeout(tick, every);
  }

  document.addEventListener("DOMContentLoaded", function () {
    wire(document);
    document.querySelectorAll("[data-live]").forEach(poll);
  });
})();
