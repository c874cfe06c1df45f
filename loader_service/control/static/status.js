// The status page: polls /v1/status and renders it. Rates (img/s per client, busy % per worker,
// stall %) are differences between two snapshots over the service's own uptime clock.
// Everything from the service is written with textContent, never as HTML: client and job names
// and skip reasons come from outside.
"use strict";

const params = new URLSearchParams(location.search);
const REFRESH_MS = Math.max(250, Number(params.get("refresh") || 1000));
const HISTORY_S = 300;  // the chart's window
// a rate needs two snapshots: until the page has them it says so rather than show 0 img/s, 0% busy
const MEASURING = "measuring…";

const page = {
  last: null,        // the last snapshot rendered (tests compare it with the DOM)
  renders: 0,
  history: [],       // [uptime_s, samples_per_s]
  prev: null,        // the snapshot before `last`, for rates
};
window.statusPage = page;

const $ = (sel) => document.querySelector(sel);
const fmtInt = (n) => Math.round(n).toLocaleString("en-US");
const fmtNum = (n, d = 1) => Number(n).toLocaleString("en-US", { minimumFractionDigits: d, maximumFractionDigits: d });
function fmtBytes(b) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
  return `${fmtNum(b, i ? 1 : 0)} ${units[i]}`;
}
function fmtDuration(s) {
  s = Math.floor(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  return h ? `${h}h ${m}m` : m ? `${m}m ${sec}s` : `${sec}s`;
}
function get(obj, path) {
  return path.split(".").reduce((o, k) => (o == null ? undefined : o[k]), obj);
}
function fmtField(v) {
  if (typeof v === "number") return Number.isInteger(v) ? fmtInt(v) : fmtNum(v, 1);
  return v == null ? "–" : String(v);
}

// a rate between the previous and this snapshot: (value now - value before) / seconds between
function rate(now, before, dt) {
  return before === undefined || !(dt > 0) ? null : Math.max(0, (now - before) / dt);
}

function fillTable(id, rows) {
  const body = $(`#${id} tbody`);
  body.replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    for (const c of cells) {
      const td = document.createElement("td");
      if (c && typeof c === "object") {
        td.textContent = c.text;
        if (c.cls) td.className = c.cls;
        if (c.value !== undefined) td.dataset.value = c.value;
      } else {
        td.textContent = c;
      }
      tr.append(td);
    }
    return tr;
  }));
  if (!rows.length) {
    const tr = document.createElement("tr"), td = document.createElement("td");
    td.colSpan = $(`#${id} thead tr`).children.length;
    td.className = "empty";
    td.textContent = "none";
    tr.append(td);
    body.append(tr);
  }
}

function render(st) {
  const prev = page.last && page.last.instance === st.instance ? page.last : null;
  const dt = prev ? st.uptime_s - prev.uptime_s : 0;
  page.prev = prev;

  for (const el of document.querySelectorAll("[data-field]")) {
    const v = get(st, el.dataset.field);
    el.textContent = el.dataset.format === "raw" ? String(v) : fmtField(v);
    el.dataset.value = v;
  }
  if (!prev) {
    for (const el of document.querySelectorAll('[data-field="throughput.samples_per_s"]')) {
      el.textContent = MEASURING;
      el.classList.add("measuring");
    }
  } else {
    for (const el of document.querySelectorAll(".measuring")) el.classList.remove("measuring");
  }
  const health = $("#health");
  health.textContent = st.healthy ? "healthy" : "failing";
  health.className = "pill " + (st.healthy ? "ok" : "bad");
  $("#problem").hidden = !st.problem;
  $("#problem").textContent = st.problem ? `problem: ${st.problem}` : "";
  $("#uptime").textContent = fmtDuration(st.uptime_s);
  $("#delivered-bytes").textContent = fmtBytes(st.totals.bytes);
  $("#shm-used").textContent = fmtBytes(st.shm_bytes);
  $("#shm-limit").textContent = st.shm_limit_bytes ? fmtBytes(st.shm_limit_bytes) : "?";
  $("#shm-bar").style.width = st.shm_limit_bytes ? `${Math.min(100, 100 * st.shm_bytes / st.shm_limit_bytes)}%` : "0";

  // workers
  const w = st.workers;
  $("#worker-counts").textContent = Object.entries(w.counts).sort().map(([k, n]) => `${k} ${n}`).join(", ") || "none";
  $("#broken").hidden = !w.broken;
  $("#broken").textContent = w.broken ? `workers cannot start: ${w.broken.split("\n")[0]}` : "";
  const prevWorkers = new Map((prev ? prev.workers.list : []).map((x) => [x.id, x]));
  fillTable("workers", w.list.map((x) => {
    const busy = rate(x.busy_s, prevWorkers.has(x.id) ? prevWorkers.get(x.id).busy_s : undefined, dt);
    return [x.id, x.pid, { text: x.state, cls: `state-${x.state}` }, fmtInt(x.tasks_done),
      busy === null ? MEASURING : `${fmtNum(Math.min(100, 100 * busy), 0)}%`,
      x.task_s == null ? "" : `${fmtNum(x.task_s, 1)} s`, fmtDuration(x.uptime_s)];
  }));

  // clients
  const prevClients = new Map((prev ? prev.clients : []).map((c) => [c.client, c]));
  $("#client-count").textContent = st.clients_total > st.clients.length
    ? `${st.clients_total} (the ${st.clients.length} busiest listed)` : st.clients.length;
  fillTable("clients", st.clients.map((c) => {
    const p = prevClients.get(c.client), s = c.stream;
    const imgs = rate(c.samples, p ? p.samples : undefined, dt);
    const stall = s && p && p.stream && p.stream.id === s.id ? rate(s.wait_s, p.stream.wait_s, dt) : null;
    return [c.client, c.job || "–", s ? s.dataset : "idle", s ? `${s.rank}/${s.world_size}` : "–",
      s ? s.epoch : "–", s ? `${s.sent}/${s.num_batches}` : "–", c.delivery || "–",
      imgs === null ? MEASURING : fmtNum(imgs, 1),
      !s ? "–" : stall === null ? MEASURING : `${fmtNum(Math.min(100, 100 * stall), 1)}%`,
      c.slots ? `${c.slots} ${fmtBytes(c.slot_bytes)}` : "–",
      { text: fmtInt(c.samples), value: c.samples }];
  }));

  // autoscaler
  const a = st.autoscaler || {};
  $("#autoscaler-state").textContent = a.enabled ? `on, ${a.min}:${a.max} every ${a.interval_s} s` : "off";
  fillTable("decisions", (a.decisions || []).slice(-10).reverse().map((d) =>
    [d.action, `${d.from} → ${d.to}`, d.reason || ""]));

  fillTable("skipped", (st.skipped_recent || []).map((s) => [s.dataset, s.index, s.reason]));
  fillTable("datasets", Object.entries(st.datasets).map(([name, d]) => [name, fmtInt(d.length), d.num_classes]));

  // chart
  if (!prev) page.history = [];
  page.history.push([st.uptime_s, st.throughput.samples_per_s]);
  while (page.history.length && page.history[0][0] < st.uptime_s - HISTORY_S) page.history.shift();
  drawChart(st.uptime_s);

  page.last = st;
  page.renders += 1;
  $("#refreshed").textContent = new Date().toLocaleTimeString();
  $("#offline").hidden = true;
}

function drawChart(now) {
  const svg = $("#chart"), H = 180, pad = 4;
  const W = Math.max(200, Math.round(svg.getBoundingClientRect().width) || 800);  // 1 unit = 1 px: labels unstretched
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const max = Math.max(1, ...page.history.map((p) => p[1]));
  const top = niceCeil(max);
  // the window grows to HISTORY_S: a fresh page's line spans the chart instead of a sliver at its right
  const span = Math.max(10, Math.min(HISTORY_S, now - (page.history.length ? page.history[0][0] : now)));
  const x = (t) => W - ((now - t) / span) * W;
  const y = (v) => H - pad - (v / top) * (H - 2 * pad);
  $("#chart-line").setAttribute("points", page.history.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" "));
  const grid = $("#chart-grid");
  grid.replaceChildren();
  for (const f of [0.25, 0.5, 0.75, 1]) {
    const line = document.createElementNS("http://www.w3.org/2000/svg", "line");
    line.setAttribute("x1", 0); line.setAttribute("x2", W);
    line.setAttribute("y1", y(top * f)); line.setAttribute("y2", y(top * f));
    const label = document.createElementNS("http://www.w3.org/2000/svg", "text");
    label.setAttribute("x", 4); label.setAttribute("y", y(top * f) + 12);
    label.textContent = fmtInt(top * f);
    grid.append(line, label);
  }
  $("#chart-left").textContent = span >= 120 ? `-${fmtNum(span / 60, 0)} min` : `-${fmtNum(span, 0)} s`;
  $("#chart-max").textContent = `max ${fmtNum(Math.max(...page.history.map((p) => p[1]), 0), 1)} img/s`;
}

function niceCeil(v) {
  const p = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 5, 10].map((m) => m * p).find((c) => c >= v);
}

async function refresh() {
  // every request has a deadline: a hung service shows as offline instead of a frozen page
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), Math.max(2000, 2 * REFRESH_MS));
  try {
    const r = await fetch("v1/status", { cache: "no-store", signal: ctl.signal });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    render(await r.json());
  } catch (err) {
    page.error = String(err);
    $("#offline").hidden = false;
    $("#offline").textContent = `cannot read /v1/status: ${err}; retrying`;
    $("#health").textContent = "unreachable";
    $("#health").className = "pill bad";
  } finally {
    clearTimeout(timer);
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
