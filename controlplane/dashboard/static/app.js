// sluice dashboard: the fleet page (/) and the service page (/service/NAME).
//
// Everything shown comes from Redis, and some of it (proxy ids, replica URLs, event
// fields, engine values) is written by parties sluice does not trust. So the DOM is
// built with createElement and textContent only (never innerHTML), links are made only
// from http(s) URLs, and the server's Content-Security-Policy forbids inline script.
// Live: one EventSource per page (the server pushes after each of its polls).
"use strict";

const HISTORY = 600;          // samples kept client-side (10 min at 1 s)
const WINDOW_MAX = 300;       // the charts show up to the last 5 minutes ...
const WINDOW_MIN = 60;        // ... and at least one (a fresh dashboard has less)
const STATE_CLASS = {
  READY: "ok", PENDING: "info", PROVISIONING: "info", STARTING: "info",
  NOT_READY: "warn", SHUTTING_DOWN: "warn", PREEMPTED: "warn",
  FAILED: "bad", FAILED_INITIAL_DELAY: "bad", FAILED_PROBING: "bad",
  FAILED_PROVISION: "bad", FAILED_CLEANUP: "bad",
  NO_REPLICA: "warn", CONTROLLER_INIT: "info", REPLICA_INIT: "info",
  CONTROLLER_FAILED: "bad",
};
const EVENT_CLASS = {
  failure: "bad", preempt: "warn", drain: "warn", terminate: "warn", not_ready: "warn",
  ready: "ok", launch: "info", update: "info", up: "info", down: "warn", autoscaler: "info",
};
const STATE_ORDER = ["READY", "STARTING", "PROVISIONING", "PENDING", "NOT_READY",
  "SHUTTING_DOWN", "PREEMPTED", "FAILED"];
const COLORS = ["--c3", "--c1", "--c5", "--c6", "--c2", "--c4"];

// -- DOM helpers: text only ----------------------------------------------------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "href") el.setAttribute("href", safeHref(v));
    else el.setAttribute(k, String(v));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

function svg(tag, attrs) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  return el;
}

// Only http(s) URLs and our own paths become links; anything else (javascript: ...) not.
function safeHref(value) {
  const s = String(value);
  if (s.startsWith("/") && !s.startsWith("//")) return s;
  try {
    const u = new URL(s);
    if (u.protocol === "http:" || u.protocol === "https:") return u.href;
  } catch (e) { /* not a URL */ }
  return "#";
}

function link(url) {
  if (!url) return h("span", { class: "muted" }, "—");
  const s = String(url);
  return /^https?:\/\//i.test(s) ? h("a", { href: s, class: "mono", rel: "noreferrer" }, s)
    : h("span", { class: "mono" }, s);
}

function badge(text, cls) {
  return h("span", { class: "badge " + (cls || "") }, text);
}

function stateBadge(state) {
  return badge(state, STATE_CLASS[state] || "");
}

function num(v, digits) {
  if (v === null || v === undefined || Number.isNaN(v)) return "—";
  if (typeof v !== "number") return String(v);
  return v.toFixed(digits === undefined ? (Number.isInteger(v) ? 0 : 1) : digits);
}

function ago(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  const s = Math.max(0, Math.round(seconds));
  if (s < 90) return s + " s";
  if (s < 5400) return Math.round(s / 60) + " min";
  if (s < 129600) return (s / 3600).toFixed(1) + " h";
  return (s / 86400).toFixed(1) + " d";
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
}

function setLive(state, text) {
  const el = document.getElementById("live");
  el.dataset.state = state;
  el.textContent = text;
}

function crumbs(name) {
  const nav = document.getElementById("crumbs");
  const parts = [h("a", { href: "/" }, "Fleet")];
  if (name) parts.push(h("span", { class: "sep" }, "/"), h("span", {}, name));
  nav.replaceChildren(...parts);
}

// -- the fleet page --------------------------------------------------------------------------

function versionsText(row) {
  const entries = Object.entries(row.versions || {});
  if (!entries.length) return "—";
  return entries.map(([v, n]) => "v" + v + " ×" + n).join(", ");
}

function rolloutCell(r) {
  if (!r) return h("span", { class: "muted" }, "—");
  return h("span", {}, badge("rolling out", "info"), " v" + r.version + ": " +
    r.new_ready + "/" + r.target + " ready");
}

function renderFleet(data) {
  const main = document.getElementById("main");
  const parts = [h("h1", {}, "Fleet")];
  if (data.error) parts.push(h("div", { class: "banner", role: "alert" },
    "Redis unreachable, showing the last data read: " + data.error));
  const services = data.services || [];
  if (!services.length) {
    parts.push(h("div", { class: "panel empty" }, "No service registered. Start one with ",
      h("span", { class: "mono" }, "sluice run examples/echo.yaml"), "."));
    main.replaceChildren(...parts);
    return;
  }
  const head = h("tr", {}, ["Service", "Status", "Ready", "Versions", "Endpoint", "Req/s",
    "Errors/s", "In flight", "Rollout"].map((t, i) =>
    h("th", { class: i === 2 || (i >= 5 && i <= 7) ? "num" : null }, t)));
  const rows = services.map((s) => h("tr", { "data-service": s.name },
    h("td", {}, h("a", { href: "/service/" + encodeURIComponent(s.name), class: "svc" }, s.name)),
    h("td", { "data-col": "status" }, stateBadge(s.status)),
    h("td", { "data-col": "ready", class: "num" }, s.ready + "/" + s.total),
    h("td", { "data-col": "versions" }, versionsText(s),
      s.last_failure ? h("span", { class: "reason" }, "last failure: " + s.last_failure) : null),
    h("td", {}, link(s.endpoint)),
    h("td", { class: "num", "data-col": "rps" }, num(s.rps)),
    h("td", { class: "num", "data-col": "errors",
      title: "5xx and cut responses per second, from the proxies' heartbeats (n/a: no proxy reports them)" },
      s.errors_per_s === null ? "n/a" : num(s.errors_per_s)),
    h("td", { class: "num" }, num(s.inflight)),
    h("td", { "data-col": "rollout" }, rolloutCell(s.rollout))));
  parts.push(h("div", { class: "panel tablewrap" },
    h("table", { id: "services" }, h("thead", {}, head), h("tbody", {}, rows))));
  main.replaceChildren(...parts);
}

function fleetPage() {
  crumbs(null);
  document.title = "sluice: fleet";
  fetch("/api/fleet").then((r) => r.json()).then((data) => {
    renderFleet(data);
    if (!data.error) setLive("live", "live · " + clock(data.at));
  }).catch(() => {});
  stream("/api/stream", (data) => {
    renderFleet(data);
    return !data.error;
  });
}

// -- charts ----------------------------------------------------------------------------------

// series: [{name, color, points: [[t, v], ...]}]; draws the last `windowS` seconds to `now`.
function chart(title, series, now, windowS, opts) {
  const W = 320, H = 120, L = 34, R = 6, T = 8, B = 18;
  const box = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img",
    "aria-label": title });
  const stacked = Boolean(opts && opts.stacked);
  if (stacked) series = stack(series);
  let max = 0;
  for (const s of series) for (const [, v] of s.points) if (v > max) max = v;
  if (opts && opts.integer) max = Math.max(2, Math.ceil(max * 1.15 / 2) * 2);  // halves whole
  else max = max <= 0 ? 1 : niceCeil(max * 1.15);
  const x = (t) => L + (W - L - R) * (1 - (now - t) / windowS);
  const y = (v) => T + (H - T - B) * (1 - v / max);
  for (const frac of [0, 0.5, 1]) {
    const yy = y(max * frac);
    box.append(svg("line", { class: "grid", x1: L, x2: W - R, y1: yy, y2: yy }));
    const label = svg("text", { x: L - 4, y: yy + 3, "text-anchor": "end" });
    const whole = (opts && opts.integer) || Number.isInteger(max * frac);
    label.textContent = num(max * frac, whole ? 0 : 1);
    box.append(label);
  }
  const span = "−" + Math.round(windowS / 60) + " min";
  for (const [t, anchor, text] of [[now - windowS, "start", span], [now, "end", "now"]]) {
    const label = svg("text", { x: x(t), y: H - 4, "text-anchor": anchor });
    label.textContent = text;
    box.append(label);
  }
  for (const s of series) {
    const pts = s.points.filter(([t]) => now - t <= windowS);
    if (!pts.length) continue;
    const line = (p, i) => (i ? "L" : "M") + x(p[0]).toFixed(1) + " " + y(p[1]).toFixed(1);
    const d = pts.map(line).join("");
    if (stacked) {  // the band between this series and the one below it
      const below = pts.map(([t], i) => [t, s.base[s.points.length - pts.length + i]]).reverse();
      const area = svg("path", { class: "band", d: d + below.map((p) => line(p, 1)).join("") + "Z" });
      area.style.fill = "var(" + s.color + ")";
      box.append(area);
    }
    const path = svg("path", { class: "series", d });
    path.style.stroke = "var(" + s.color + ")";  // CSSOM: follows the colour scheme live
    box.append(path);
  }
  const last = series.length === 1 && series[0].points.length
    ? series[0].points[series[0].points.length - 1][1] : null;
  const legend = series.length > 1 ? h("div", { class: "legend" }, series.map((s) => {
    const swatch = h("i", {});
    swatch.style.background = "var(" + s.color + ")";
    const own = s.own || s.points;
    const latest = own.length ? own[own.length - 1][1] : 0;
    return h("span", {}, swatch, s.name + " " + num(latest));
  })) : null;
  return h("div", { class: "panel chart", "data-chart": (opts && opts.id) || title },
    h("div", { class: "title" }, h("span", {}, title),
      h("span", { class: "now" }, last === null ? "" : num(last, (opts && opts.digits)))),
    box, legend);
}

// Each series on top of the ones before it: points are running totals, `base` the
// total below, `own` the series' own values (for the legend).
function stack(series) {
  let base = series.length ? series[0].points.map(() => 0) : [];
  return series.map((s) => {
    const points = s.points.map(([t, v], i) => [t, base[i] + v]);
    const out = { ...s, points, base, own: s.points };
    base = points.map(([, v]) => v);
    return out;
  });
}

function niceCeil(v) {
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

// The charts' span: what the history covers, in whole minutes, within [1, 5] min.
function chartWindow(history, now) {
  const covered = history.length ? now - history[0].t : 0;
  return Math.min(WINDOW_MAX, Math.max(WINDOW_MIN, Math.ceil(covered / 60) * 60));
}

function charts(history, now, windowS) {
  const pick = (key) => history.filter((p) => p[key] !== null && p[key] !== undefined)
    .map((p) => [p.t, p[key]]);
  const states = new Set();
  for (const p of history) for (const k of Object.keys(p.states || {})) states.add(k);
  const order = [...states].sort((a, b) => rank(a) - rank(b));
  const stateSeries = order.map((state, i) => ({
    name: state, color: COLORS[i % COLORS.length],
    points: history.map((p) => [p.t, (p.states || {})[state] || 0]),
  }));
  const out = [
    chart("Requests/s", [{ name: "req/s", color: "--c1", points: pick("rps") }], now, windowS,
      { id: "rps" }),
    chart("In flight", [{ name: "in flight", color: "--c2", points: pick("inflight") }], now,
      windowS, { id: "inflight" }),
    chart("Replicas by state", stateSeries, now, windowS,
      { id: "states", stacked: true, integer: true }),
  ];
  const errors = pick("errors");
  if (errors.length) out.push(chart("Errors/s (5xx and cut)", [{ name: "errors/s",
    color: "--c4", points: errors }], now, windowS, { id: "errors" }));
  // Routing reasons (the prefix policy's affinity/spill/fallback), when proxies count them.
  const reasons = new Set();
  for (const p of history) for (const k of Object.keys(p.routed || {})) reasons.add(k);
  if (reasons.size) out.push(chart("Routing reasons (req/s)", [...reasons].sort().map((r, i) => ({
    name: r, color: COLORS[i % COLORS.length],
    points: history.filter((p) => p.routed).map((p) => [p.t, p.routed[r] || 0]),
  })), now, windowS, { id: "routing" }));
  const ttft = pick("ttft");
  if (ttft.length) out.push(chart("TTFT (s, mean of replicas)", [{ name: "ttft", color: "--c5",
    points: ttft }], now, windowS, { id: "ttft", digits: 3 }));
  return h("div", { class: "charts" }, out);
}

function rank(state) {
  const i = STATE_ORDER.indexOf(state);
  return i < 0 ? STATE_ORDER.length : i;
}

// -- the service page ------------------------------------------------------------------------

function card(k, v, cls) {
  return h("div", { class: "panel card " + (cls || "") }, h("div", { class: "k" }, k),
    h("div", { class: "v" }, v instanceof Node ? v : String(v)));
}

function rolloutPanel(r) {
  if (!r) return null;
  const span = Math.max(r.target, r.new_total, 1) + r.old_total;
  const seg = (cls, n) => {
    const el = h("span", { class: cls });
    el.style.width = (100 * n / span) + "%";
    return el;
  };
  return h("div", { class: "panel rollout", id: "rollout" },
    h("strong", {}, "Rollout to v" + r.version + " in progress"),
    h("div", { class: "bar", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": r.target,
      "aria-valuenow": r.new_ready },
    seg("new", r.new_ready), seg("newpending", Math.max(0, r.new_total - r.new_ready)),
    seg("old", r.old_total)),
    h("div", { class: "muted", "data-col": "rollout-text" },
      "new v" + r.version + ": " + r.new_ready + " ready of " + r.target + " wanted (" +
      r.new_total + " launched) · old v" + r.old_versions.join(", v") + ": " + r.old_ready +
      " ready of " + r.old_total + " · routed to v" + (r.active_versions.join(", v") || "none")));
}

function engineCell(e) {
  if (!e) return h("span", { class: "muted" }, "—");
  const known = [["waiting", "queue"], ["running", "running"], ["kv_usage", "KV"]];
  const parts = [];
  if (typeof e.engine === "string" && e.engine !== "unknown") parts.push(e.engine);
  for (const [k, label] of known) {
    if (e[k] === undefined) continue;
    const v = k === "kv_usage" && typeof e[k] === "number" ? Math.round(e[k] * 100) + "%" : num(e[k]);
    parts.push(label + " " + v);
  }
  const skip = ["engine", "url", "at"];  // the URL has its column; `at` is a timestamp
  const rest = Object.entries(e).filter(([k]) => !skip.includes(k) && !known.some(([n]) => n === k))
    .map(([k, v]) => k + "=" + v).join(" ");
  return h("span", { class: "engine", title: rest }, parts.join(" · ") || rest);
}

function replicasTable(doc) {
  const hasEngine = doc.replicas.some((r) => r.engine);
  const cols = ["ID", "Version", "Status", "URL", "Backend", "Infra", "Age", "In flight"];
  if (hasEngine) cols.push("Engine");
  const head = h("tr", {}, cols.map((c) => h("th", { class: c === "In flight" ? "num" : null }, c)));
  const rows = doc.replicas.map((r) => h("tr", { "data-replica-id": r.id },
    h("td", { "data-col": "id", class: "mono" }, String(r.id)),
    h("td", { "data-col": "version" }, "v" + r.version),
    h("td", { "data-col": "status" }, stateBadge(r.status),
      r.reason && r.status !== "READY" ? h("span", { class: "reason" }, r.reason) : null),
    h("td", { "data-col": "url" }, link(r.url)),
    h("td", {}, r.backend),
    h("td", {}, r.resources ? r.infra + " · " + r.resources : (r.infra || "—")),
    h("td", {}, ago(r.age)),
    h("td", { class: "num" }, num(r.inflight)),
    hasEngine ? h("td", { "data-col": "engine" }, engineCell(r.engine)) : null));
  const body = rows.length ? rows
    : [h("tr", {}, h("td", { colspan: cols.length, class: "muted" }, "No replica."))];
  return h("div", { class: "panel tablewrap" },
    h("table", { id: "replicas" }, h("thead", {}, head), h("tbody", {}, body)));
}

function proxiesTable(doc) {
  if (!doc.proxies.length) return h("div", { class: "panel empty" }, "No proxy heartbeat.");
  const head = h("tr", {}, ["Proxy", "Generation", "Lag", "Connected", "Seen"].map((c) => h("th", {}, c)));
  const rows = doc.proxies.map((p) => h("tr", { "data-proxy": p.id },
    h("td", { class: "mono", "data-col": "id" }, p.id),
    h("td", {}, String(p.generation) + " / " + doc.generation),
    h("td", { class: "nowrap" }, p.lagging ? badge("LAGGING", "bad") : null,
      " " + p.lag_generations + " gen, " + num(p.lag_seconds, 1) + " s"),
    h("td", {}, p.connected ? badge("yes", "ok") : badge("no", "warn")),
    h("td", {}, ago(doc.now - p.seen_at) + " ago")));
  return h("div", { class: "panel tablewrap" },
    h("table", { id: "proxies" }, h("thead", {}, head), h("tbody", {}, rows)));
}

function timeline(doc) {
  const items = doc.events.map((e) => ({ at: e.at, kind: e.kind, fields: e.fields }));
  for (const d of doc.decisions || []) {
    items.push({ at: d.at, kind: "autoscaler",
      fields: { target: d.target, reason: d.reason, qps: d.qps, inflight: d.inflight } });
  }
  items.sort((a, b) => b.at - a.at);
  if (!items.length) return h("div", { class: "panel empty" }, "No event yet.");
  return h("ul", { class: "panel timeline", id: "events" }, items.slice(0, 150).map((e) =>
    h("li", { "data-kind": e.kind },
      h("time", { title: new Date(e.at * 1000).toISOString() }, clock(e.at)),
      h("span", {}, badge(e.kind, EVENT_CLASS[e.kind] || "")),
      h("span", { class: "fields" }, Object.entries(e.fields || {})
        .filter(([, v]) => v !== null && v !== undefined)
        .map(([k, v]) => k + ": " + v).join(" · ")))));
}

function renderService(doc, history) {
  const main = document.getElementById("main");
  const parts = [h("h1", {}, doc.name, stateBadge(doc.status))];
  if (doc.launch_blocked) parts.push(h("div", { class: "banner", role: "alert" }, doc.launch_blocked));
  const autoscaler = doc.autoscaler
    ? "target " + doc.autoscaler.target + " (" + doc.autoscaler.reason + ")" : (doc.autoscaling || "—");
  parts.push(h("div", { class: "cards" },
    card("Ready", doc.ready + "/" + doc.total),
    card("Version", "v" + doc.version),
    card("Routed to", doc.active_versions.length ? "v" + doc.active_versions.join(", v") : "none"),
    card("Req/s", num(doc.rps)),
    card("In flight", num(doc.inflight)),
    card("Generation", String(doc.generation)),
    card("Policy", doc.policy + " · " + doc.update_mode),
    card("Endpoint", link(doc.endpoint), "wide"),
    card("Autoscaling", autoscaler, "wide"),
    card("Uptime", ago(doc.uptime))));
  const windowS = chartWindow(history, doc.now);
  parts.push(h("h2", {}, "Last " + Math.round(windowS / 60) + " min"), rolloutPanel(doc.rollout),
    charts(history, doc.now, windowS));
  parts.push(h("h2", {}, "Replicas"), replicasTable(doc));
  parts.push(h("div", { class: "grid2" },
    h("section", {}, h("h2", {}, "Events"), timeline(doc)),
    h("section", {}, h("h2", {}, "Proxies"), proxiesTable(doc))));
  main.replaceChildren(...parts.filter(Boolean));
}

function servicePage(name) {
  crumbs(name);
  document.title = "sluice: " + name;
  let history = [];
  let doc = null;
  const missing = () => document.getElementById("main").replaceChildren(
    h("h1", {}, name), h("div", { class: "panel empty" }, "No such service (yet)."));
  fetch("/api/services/" + encodeURIComponent(name)).then((r) => {
    if (r.status === 404) { missing(); return null; }
    return r.json();
  }).then((data) => {
    if (!data) return;
    history = data.history || [];
    if (!doc) { doc = data; renderService(doc, history); setLive("live", "live · " + clock(data.now)); }
  }).catch(() => {});
  stream("/api/stream?service=" + encodeURIComponent(name), (data) => {
    if (data.gone) { missing(); return true; }
    if (data.error) return false;
    doc = data.doc;
    const last = history.length ? history[history.length - 1].t : -1;
    if (data.sample.t > last) history.push(data.sample);
    if (history.length > HISTORY) history = history.slice(-HISTORY);
    renderService(doc, history);
    return true;
  });
}

// -- live updates ----------------------------------------------------------------------------

function stream(url, onData) {
  const source = new EventSource(url);
  source.onmessage = (msg) => {
    let data;
    try { data = JSON.parse(msg.data); } catch (e) { return; }
    const fresh = onData(data);
    setLive(fresh ? "live" : "stale", (fresh ? "live · " : "Redis down · ") + clock(Date.now() / 1000));
  };
  source.onerror = () => setLive("error", "reconnecting…");
}

function route() {
  const m = location.pathname.match(/^\/service\/([^/]+)\/?$/);
  if (m) servicePage(decodeURIComponent(m[1]));
  else fleetPage();
}

route();
