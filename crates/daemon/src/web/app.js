// flexstack web view: renders the daemon's state (GET /api/state, then pushed by /api/events) and sends the
// control API's own requests (POST /api/call, the JSON of docs/control-api.md). No framework, no network but the
// daemon's own address. Every table is capped (the daemon sends at most so many rows; the page shows them all).
"use strict";

const SVGNS = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);
let token = "";
let canWrite = false;
let last = null; // the previous state, for rates
let current = null;
let updates = 0;
// When each link now drawn was first drawn (ms since the epoch, the page's clock): window.flexstackSeen.
let seenAt = new Map();

function esc(s) {
  return String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}
function fmt(n) {
  if (n === null || n === undefined) return "";
  if (typeof n !== "number") return esc(JSON.stringify(n));
  if (Math.abs(n) >= 1e9) return (n / 1e9).toFixed(2) + "G";
  if (Math.abs(n) >= 1e6) return (n / 1e6).toFixed(2) + "M";
  if (Math.abs(n) >= 1e4) return (n / 1e3).toFixed(1) + "k";
  return Number.isInteger(n) ? String(n) : n.toFixed(2);
}
function value(v) {
  // A registry value as the API encodes it: {"u64": 3}, {"bool": true}, or a bare JSON value.
  if (v && typeof v === "object") {
    const k = Object.keys(v);
    if (k.length === 1) return v[k[0]];
  }
  return v;
}
function table(head, rows) {
  const th = head.map((h) => `<th>${esc(h)}</th>`).join("");
  return `<table><thead><tr>${th}</tr></thead><tbody>${rows.join("")}</tbody></table>`;
}
function say(text, ok) {
  const m = $("msg");
  m.textContent = text;
  m.className = ok ? "ok" : "err";
}

// --- the control API -------------------------------------------------------------------------------------------

async function call(request) {
  const headers = { "Content-Type": "application/json" };
  if (token) headers["X-Flexstack-Token"] = token;
  const r = await fetch("/api/call", { method: "POST", headers, body: JSON.stringify(request) });
  if (r.status === 403) throw new Error("refused (403): this page is read-only without the token");
  if (!r.ok) throw new Error(`HTTP ${r.status}`);
  const answer = await r.json();
  if (!answer.ok) throw new Error(answer.error ? `${answer.error.code}: ${answer.error.message}` : "failed");
  return answer.result;
}

async function write(what, request) {
  try {
    const result = await call(request);
    const rev = result && result.revision !== undefined && result.revision !== null ? ` (revision ${result.revision})` : "";
    say(`${what}: done${rev}`, true);
    return result;
  } catch (e) {
    say(`${what}: ${e.message}`, false);
    return null;
  }
}

async function checkToken() {
  const headers = token ? { "X-Flexstack-Token": token } : {};
  try {
    const r = await fetch("/api/auth", { headers });
    canWrite = r.ok && (await r.json()).write === true;
  } catch (e) {
    canWrite = false;
  }
  $("mode").textContent = canWrite ? "read-write" : "read-only";
  $("mode").className = "badge " + (canWrite ? "rw" : "ro");
  document.body.classList.toggle("ro", !canWrite);
}

// --- the graph ---------------------------------------------------------------------------------------------------

// Frames per second of each module's output ports and drops per second of each module, from two states.
function rates(state, prev) {
  const dt = prev ? Math.max((state.time_ms - prev.time_ms) / 1000, 0.001) : 0;
  const old = new Map((prev ? prev.modules : []).map((m) => [m.name, m]));
  const ports = new Map();
  const mods = new Map();
  for (const m of state.modules) {
    const o = old.get(m.name);
    const r = (now, was) => (o && dt > 0 ? Math.max(0, (now - was) / dt) : 0);
    mods.set(m.name, {
      fps: r(m.frames_in + m.frames_out, o ? o.frames_in + o.frames_out : 0),
      drops: r(m.frames_dropped, o ? o.frames_dropped : 0),
    });
    for (const p of m.ports) {
      if (p.dir !== "out") continue;
      const op = o && o.ports.find((q) => q.port === p.port && q.dir === "out");
      ports.set(`${m.name}[${p.port}]`, op && dt > 0 ? Math.max(0, (p.frames - op.frames) / dt) : 0);
    }
  }
  return { ports, mods };
}

// Layers: each module one column right of the modules that send to it (longest path, cycles cut).
function layout(modules, edges) {
  const names = modules.map((m) => m.name);
  const incoming = new Map(names.map((n) => [n, []]));
  for (const e of edges) if (incoming.has(e.to) && e.from !== e.to) incoming.get(e.to).push(e.from);
  const layer = new Map();
  const visiting = new Set();
  const depth = (n) => {
    if (layer.has(n)) return layer.get(n);
    if (visiting.has(n)) return 0;
    visiting.add(n);
    let d = 0;
    for (const f of incoming.get(n) || []) if (layer.has(f) || !visiting.has(f)) d = Math.max(d, depth(f) + 1);
    visiting.delete(n);
    layer.set(n, d);
    return d;
  };
  names.forEach(depth);
  const columns = [];
  for (const n of names) {
    const l = layer.get(n);
    (columns[l] = columns[l] || []).push(n);
  }
  // Many modules in few columns: wrap a tall column into several.
  const maxRows = Math.max(8, Math.ceil(Math.sqrt(names.length) * 1.5));
  const pos = new Map();
  let x = 0;
  for (const col of columns) {
    if (!col) continue;
    for (let i = 0; i < col.length; i += maxRows) {
      col.slice(i, i + maxRows).forEach((n, row) => pos.set(n, { x, y: row }));
      x += 1;
    }
  }
  return { pos, width: x, height: Math.min(maxRows, Math.max(1, ...columns.map((c) => (c ? c.length : 0)))) };
}

const BOX_W = 150, BOX_H = 40, GAP_X = 70, GAP_Y = 18, PAD = 14;

function el(name, attrs, text) {
  const e = document.createElementNS(SVGNS, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function drawGraph(state, r) {
  const svg = $("graph");
  const edges = state.links.edges;
  const { pos, width, height } = layout(state.modules, edges);
  const W = PAD * 2 + width * BOX_W + Math.max(0, width - 1) * GAP_X;
  const H = PAD * 2 + height * BOX_H + Math.max(0, height - 1) * GAP_Y;
  svg.setAttribute("width", W);
  svg.setAttribute("height", H);
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const xy = (n) => {
    const p = pos.get(n);
    return { x: PAD + p.x * (BOX_W + GAP_X), y: PAD + p.y * (BOX_H + GAP_Y) };
  };
  const frag = document.createDocumentFragment();
  const defs = el("defs", {});
  const marker = el("marker", { id: "arrow", viewBox: "0 0 10 10", refX: "10", refY: "5", markerUnits: "userSpaceOnUse", markerWidth: "12", markerHeight: "12", orient: "auto-start-reverse" });
  marker.appendChild(el("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "#7f8c99" }));
  defs.appendChild(marker);
  frag.appendChild(defs);
  const maxFps = Math.max(1, ...r.ports.values());
  for (const e of edges) {
    if (!pos.has(e.from) || !pos.has(e.to)) continue;
    const a = xy(e.from), b = xy(e.to);
    const x1 = a.x + BOX_W, y1 = a.y + BOX_H / 2, x2 = b.x, y2 = b.y + BOX_H / 2;
    const back = x2 <= x1;
    const d = back
      ? `M ${x1} ${y1} C ${x1 + 60} ${y1 - 50}, ${x2 - 60} ${y2 - 50}, ${x2} ${y2}`
      : `M ${x1} ${y1} C ${(x1 + x2) / 2} ${y1}, ${(x1 + x2) / 2} ${y2}, ${x2} ${y2}`;
    const fps = r.ports.get(`${e.from}[${e.from_port}]`) || 0;
    const dropping = (r.mods.get(e.to) || {}).drops > 0;
    const text = `${e.from}[${e.from_port}] -> ${e.to}[${e.to_port}]`;
    const path = el("path", {
      d, class: "edge" + (dropping ? " dropping" : ""), "marker-end": "url(#arrow)",
      "stroke-width": (1 + 5 * Math.sqrt(fps / maxFps)).toFixed(2), "data-link": text,
    });
    path.appendChild(el("title", {}, `${text}: ${fmt(fps)} frames/s`));
    frag.appendChild(path);
  }
  for (const m of state.modules) {
    const p = xy(m.name);
    const mr = r.mods.get(m.name) || { fps: 0, drops: 0 };
    const busy = mr.fps <= 0 ? "idle" : mr.fps < 1e3 ? "busy1" : mr.fps < 1e5 ? "busy2" : "busy3";
    const cls = ["mod", busy];
    if (mr.drops > 0) cls.push("dropping");
    if (m.state !== "running") cls.push("paused");
    const g = el("g", { class: cls.join(" "), transform: `translate(${p.x},${p.y})`, "data-module": m.name, "data-kind": m.kind, "data-state": m.state });
    g.appendChild(el("rect", { width: BOX_W, height: BOX_H, rx: 5 }));
    g.appendChild(el("text", { x: 7, y: 16 }, m.name.length > 22 ? m.name.slice(0, 21) + "…" : m.name));
    g.appendChild(el("text", { x: 7, y: 31, class: "kind" }, `${m.kind} · ${m.state} · ${fmt(mr.fps)}/s`));
    g.appendChild(el("title", {}, `${m.name} (${m.kind}, ${m.state})\nin ${m.frames_in}, out ${m.frames_out}, dropped ${m.frames_dropped}\n${fmt(mr.fps)} frames/s, ${fmt(mr.drops)} drops/s`));
    frag.appendChild(g);
  }
  svg.replaceChildren(frag);
  $("graph-facts").textContent = `${state.modules.length} modules, ${edges.length} links`;
}

// --- the tables ----------------------------------------------------------------------------------------------

function drawTables(state, r) {
  const s = state.status;
  $("status").textContent = `v${s.version} · pid ${s.pid} · up ${Math.round(s.uptime_s)} s · revision ${s.revision} · ${s.modules} modules · ${s.links} links · ${s.paused ? "PAUSED" : "running"} · data plane ${s.dataplane_scheduling}`;
  $("runtime").innerHTML = table(
    ["module", "kind", "calls", "frames", "frames/call", "ns/frame", "frames/s"],
    state.runtime.map((x) => `<tr><td>${esc(x.module)}</td><td>${esc(x.kind)}</td><td class="n">${fmt(x.calls)}</td><td class="n">${fmt(x.frames)}</td><td class="n">${fmt(x.frames_per_call)}</td><td class="n">${fmt(x.ns_per_frame)}</td><td class="n">${fmt((r.mods.get(x.module) || {}).fps || 0)}</td></tr>`)
  );
  $("drops").innerHTML = state.drops.length
    ? table(["module", "reason", "frames"], state.drops.map((d) => `<tr><td>${esc(d.module)}</td><td>${esc(d.reason)}</td><td class="n">${fmt(d.frames)}</td></tr>`))
    : `<p class="muted">no drops</p>`;
  $("flow-facts").textContent = `${state.flow_count} in all; the ${state.flows.length} with most bytes`;
  $("flows").innerHTML = table(
    ["flow", "app", "module", "handling", "tuple", "bytes down", "bytes up", "packets", "srtt µs", "cwnd", "retrans"],
    state.flows.map((f) => {
      const t = f.tcp || {};
      return `<tr data-flow="${esc(f.id)}"><td>${esc(f.id)}</td><td>${esc(f.app)}</td><td>${esc(f.module)}</td><td>${esc(typeof f.handling === "string" ? f.handling : JSON.stringify(f.handling))}</td><td>${esc(f.tuple)}</td><td class="n">${fmt(f.bytes_down)}</td><td class="n">${fmt(f.bytes_up)}</td><td class="n">${fmt(f.packets)}</td><td class="n">${fmt(t.srtt_us)}</td><td class="n">${fmt(t.cwnd)}</td><td class="n">${fmt(t.retrans_total)}</td></tr>`;
    })
  );
  $("rev-facts").textContent = `${state.revision_count} in all; the latest ${state.revisions.length}`;
  $("revisions").innerHTML = table(
    ["rev", "time", "user", "change", ""],
    state.revisions.map((v) => `<tr data-rev="${v.revision}"><td class="n">${v.revision}</td><td>${esc(new Date(v.time_ms).toLocaleTimeString())}</td><td>${esc(v.user)}</td><td class="wrap">${esc(v.change)}</td><td><button type="button" class="diff" data-rev="${v.revision}">diff</button> <button type="button" class="rollback write" data-rev="${v.revision}">rollback</button></td></tr>`)
  );
  if (state.rules && state.rules.Err !== undefined) {
    $("rules").innerHTML = `<p class="muted">${esc(state.rules.Err)}</p>`;
    $("rule-facts").textContent = "";
  } else {
    const rules = (state.rules && state.rules.Ok) || [];
    $("rule-facts").textContent = `${state.rule_count} loaded`;
    $("rules").innerHTML = rules.length
      ? rules.map((rule) => {
          const units = rule.instances.flatMap((i) => i.units).slice(0, 30);
          return `<div class="rule" data-rule="${esc(rule.name)}"><b>${esc(rule.name)}</b> <span class="muted">${esc(JSON.stringify(rule.section))} · ${esc(rule.source)}</span>` +
            table(["unit", "kind", "value"], units.map((u) => `<tr><td><code>${esc(u.key)}</code></td><td>${esc(u.kind)}</td><td class="n">${esc(JSON.stringify(value(u.value)))}</td></tr>`)) + `</div>`;
        }).join("")
      : `<p class="muted">no rules</p>`;
  }
  $("apps").innerHTML = state.apps.length
    ? table(["app", "uid", "namespace", "app device", "host device", "modules"], state.apps.map((a) => `<tr><td>${esc(a.name)}</td><td class="n">${a.uid}</td><td>${esc(a.netns)}</td><td>${esc(a.app_dev)}</td><td>${esc(a.host_dev)}</td><td>${esc(a.modules.join(", "))}</td></tr>`))
    : `<p class="muted">no apps</p>`;
  $("taps").innerHTML = state.taps.length
    ? table(["tap", "records", "frames", "file", ""], state.taps.map((t) => `<tr data-tap="${esc(t.name)}"><td>${esc(t.name)}</td><td>${esc(t.taps.join(", "))}</td><td class="n">${fmt(t.frames)}</td><td>${esc(t.file)}</td><td><button type="button" class="download write" data-tap="${esc(t.name)}">pcapng</button></td></tr>`))
    : `<p class="muted">no taps</p>`;
  const sel = $("tap-link");
  const chosen = sel.value;
  const options = state.links.links.map((l) => `<option${l === chosen ? " selected" : ""}>${esc(l)}</option>`);
  const html = options.join("");
  if (sel.dataset.html !== html) {
    sel.innerHTML = html;
    sel.dataset.html = html;
  }
}

function render(state) {
  if (state.error) {
    say(`the daemon answered: ${state.error}`, false);
    return;
  }
  const r = rates(state, last && last.time_ms < state.time_ms ? last : null);
  drawGraph(state, r);
  drawTables(state, r);
  last = state;
  current = state;
  updates += 1;
  const now = Date.now();
  seenAt = new Map(state.links.edges.map((e) => {
    const text = `${e.from}[${e.from_port}] -> ${e.to}[${e.to_port}]`;
    return [text, seenAt.get(text) || now];
  }));
  window.flexstackSeen = Object.fromEntries(seenAt);
  document.body.dataset.updates = updates;
  document.body.dataset.revision = state.status.revision;
}

// --- revisions: diff and rollback ------------------------------------------------------------------------------

// A line diff (longest common subsequence); stack files are small.
function diffLines(a, b) {
  const n = a.length, m = b.length;
  if (n * m > 4e6) return [["-", `(too long to compare: ${n} and ${m} lines)`]];
  const L = Array.from({ length: n + 1 }, () => new Uint32Array(m + 1));
  for (let i = n - 1; i >= 0; i--) for (let j = m - 1; j >= 0; j--) L[i][j] = a[i] === b[j] ? L[i + 1][j + 1] + 1 : Math.max(L[i + 1][j], L[i][j + 1]);
  const out = [];
  let i = 0, j = 0;
  while (i < n && j < m) {
    if (a[i] === b[j]) { out.push([" ", a[i]]); i++; j++; }
    else if (L[i + 1][j] >= L[i][j + 1]) out.push(["-", a[i++]]);
    else out.push(["+", b[j++]]);
  }
  while (i < n) out.push(["-", a[i++]]);
  while (j < m) out.push(["+", b[j++]]);
  return out;
}

async function showDiff(rev) {
  const pre = $("diff");
  try {
    const now = await call({ op: "config_show", rev });
    const before = rev > 1 ? await call({ op: "config_show", rev: rev - 1 }).catch(() => ({ stack: "" })) : { stack: "" };
    const lines = diffLines(before.stack.split("\n"), now.stack.split("\n")).filter((x) => x[0] !== " ");
    pre.innerHTML = `<b>revision ${rev - 1} → ${rev}</b>\n` + (lines.length
      ? lines.slice(0, 400).map(([t, l]) => `<span class="${t === "+" ? "add" : "del"}">${t} ${esc(l)}</span>`).join("")
      : "(no change to the stack description)");
    pre.hidden = false;
  } catch (e) {
    say(`diff: ${e.message}`, false);
  }
}

document.addEventListener("click", async (ev) => {
  const b = ev.target.closest("button");
  if (!b) return;
  if (b.classList.contains("diff")) return showDiff(Number(b.dataset.rev));
  if (b.classList.contains("rollback")) return write(`rollback to ${b.dataset.rev}`, { op: "config_rollback", rev: Number(b.dataset.rev) });
  if (b.classList.contains("download")) return download(b.dataset.tap);
  if (b.id === "link-add") return write("link add", { op: "link_add", link: $("link-text").value.trim() });
  if (b.id === "link-del") return write("link del", { op: "link_del", link: $("link-text").value.trim() });
  if (b.id === "knob-set") {
    let v = $("knob-value").value.trim();
    try { v = JSON.parse(v); } catch (e) { /* a bare word is a string */ }
    return write("set", { op: "set", name: $("knob-name").value.trim(), value: v });
  }
  if (b.id === "tap-add") {
    const link = $("tap-link").value;
    if (!link || !current) return say("tap add: choose a link", false);
    const file = `${current.tap_dir}/${link.replace(/[^A-Za-z0-9_-]+/g, "_")}-${Date.now()}.pcapng`;
    return write("tap add", { op: "tap_add", link, file });
  }
});

async function download(name) {
  try {
    const r = await fetch(`/api/tap?name=${encodeURIComponent(name)}`, { headers: token ? { "X-Flexstack-Token": token } : {} });
    if (!r.ok) throw new Error(r.status === 403 ? "refused (403): the token is needed" : `HTTP ${r.status}`);
    const url = URL.createObjectURL(await r.blob());
    const a = document.createElement("a");
    a.href = url;
    a.download = `${name}.pcapng`;
    a.click();
    setTimeout(() => URL.revokeObjectURL(url), 5000);
  } catch (e) {
    say(`download ${name}: ${e.message}`, false);
  }
}

// --- start ---------------------------------------------------------------------------------------------------

function connect() {
  const es = new EventSource("/api/events");
  es.addEventListener("state", (ev) => {
    $("live").textContent = "live";
    $("live").className = "badge on";
    try { render(JSON.parse(ev.data)); } catch (e) { say(`render: ${e.message}`, false); }
  });
  es.onerror = () => {
    $("live").textContent = "reconnecting";
    $("live").className = "badge off";
  };
}

$("auth").addEventListener("submit", (ev) => {
  ev.preventDefault();
  token = $("token").value.trim();
  sessionStorage.setItem("flexstack-token", token);
  checkToken();
});

(async function start() {
  const m = /(?:^#|&)token=([0-9a-f]+)/.exec(location.hash);
  if (m) {
    token = m[1];
    sessionStorage.setItem("flexstack-token", token);
    history.replaceState(null, "", location.pathname);
  } else {
    token = sessionStorage.getItem("flexstack-token") || "";
  }
  await checkToken();
  try {
    const r = await fetch("/api/state");
    render(await r.json());
  } catch (e) {
    say(`state: ${e.message}`, false);
  }
  connect();
})();
