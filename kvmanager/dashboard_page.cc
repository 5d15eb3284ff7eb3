// The dashboard page (dashboard.h): one HTML document with inline CSS and
// plain JS, polling the /api/ endpoints every 2 s (/api/plan every 10 s).
// Nothing is fetched from anywhere else: a cluster without internet access
// shows the same page. Kept as a raw string so the binary carries it and no
// build step runs; docs/dashboard.md describes the panels.
#include "kvmanager/dashboard.h"

namespace triax::manager {

const char kDashboardPage[] = R"html(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>triaxkv dashboard</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
:root { --bg:#f4f6f8; --panel:#fff; --ink:#1c2833; --mute:#6c7a89;
        --line:#dde3e8; --bad:#c0392b; --warn:#d68910; --ok:#1e8449; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
       font:13px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; }
header { display:flex; align-items:baseline; gap:16px; padding:10px 18px;
         background:#1c2833; color:#fff; }
header h1 { font-size:17px; margin:0; font-weight:600; }
header .sub { color:#aeb6bf; }
#status { margin-left:auto; font-variant-numeric:tabular-nums; }
#status.err { color:#f5b7b1; }
main { display:grid; grid-template-columns: 1fr 1fr; gap:12px; padding:12px; }
section { background:var(--panel); border:1px solid var(--line);
          border-radius:6px; padding:10px 12px; min-width:0; }
section.wide { grid-column: 1 / -1; }
.column { display:flex; flex-direction:column; gap:12px; min-width:0; }
h2 { font-size:13px; text-transform:uppercase; letter-spacing:.05em;
     color:var(--mute); margin:0 0 8px; display:flex; gap:10px;
     align-items:center; }
h2 .right { margin-left:auto; text-transform:none; letter-spacing:0; }
table { border-collapse:collapse; width:100%; font-variant-numeric:tabular-nums; }
th, td { text-align:left; padding:2px 6px; border-bottom:1px solid var(--line);
         white-space:nowrap; }
th { color:var(--mute); font-weight:500; }
td.num, th.num { text-align:right; }
.card { border:1px solid var(--line); border-radius:5px; padding:6px 8px;
        margin-bottom:8px; }
.card .title { display:flex; gap:10px; align-items:baseline; }
.card .title b { font-size:14px; }
.mute { color:var(--mute); }
.badge { padding:0 6px; border-radius:8px; font-size:11px; color:#fff; }
.badge.up { background:var(--ok); } .badge.suspect { background:var(--warn); }
.badge.down, .badge.unspecified { background:var(--bad); }
.bar { position:relative; height:14px; background:#eaeded; border-radius:3px;
       overflow:hidden; display:flex; margin:3px 0; }
.bar > span { height:100%; }
.bar .mark { position:absolute; top:0; bottom:0; width:2px; background:#17202a; }
.bar .mark.floor { background:#1e8449; }
.bar .mark.low { background:#2e86c1; }
.bar .mark.high { background:var(--bad); }
.row { display:grid; grid-template-columns: 80px 1fr minmax(250px, auto); gap:8px;
       align-items:center; }
.legend { display:flex; flex-wrap:wrap; gap:4px 12px; margin:4px 0; }
.legend i { display:inline-block; width:10px; height:10px; border-radius:2px;
            margin-right:4px; vertical-align:-1px; }
.hatch { background-image: repeating-linear-gradient(45deg,
         rgba(255,255,255,.55) 0 3px, transparent 3px 6px); }
#events-wrap { max-height:320px; overflow:auto; }
#events tr.new td { background:#fef9e7; }
.kpis { display:flex; gap:18px; flex-wrap:wrap; margin-bottom:6px; }
.kpis div b { font-size:15px; display:block; }
.map { margin:6px 0; }
.map .lane { display:grid; grid-template-columns: 80px 1fr; gap:6px;
             align-items:center; margin:2px 0; }
.map .strip { display:flex; height:22px; border:1px solid var(--line);
              background:#fff; }
.map .strip > div { background:#eef0f2; }
.map .strip > div { height:100%; border-right:1px solid rgba(255,255,255,.7);
                    min-width:1px; position:relative; }
.map .strip > div > span { display:block; height:100%; }
.map .strip > div.evicted > span { opacity:.25; }
.map .ruler { display:flex; justify-content:space-between; color:var(--mute);
              font-size:11px; margin-left:86px; }
.toggle button { border:1px solid var(--line); background:#fff; padding:2px 10px;
                 cursor:pointer; font:inherit; }
.toggle button.on { background:#1c2833; color:#fff; }
select { font:inherit; }
.err { color:var(--bad); }
</style>
</head>
<body>
<header>
  <h1>triaxkv</h1><span class="sub">kvmanager dashboard</span>
  <span id="status">loading…</span>
</header>
<main>
  <section id="workers-panel"><h2>Workers <span class="right mute" id="workers-sum"></span></h2>
    <div class="legend" id="format-legend"></div>
    <div id="workers"></div></section>
  <div class="column">
    <section id="tenants-panel"><h2>Tenants <span class="right mute">used vs floor and ceiling, per tier</span></h2>
    <div id="tenants"></div></section>
    <section id="pressure-panel"><h2>Pressure <span class="right mute" id="pressure-sum"></span></h2>
    <div id="pressure-kpis" class="kpis"></div>
    <div id="pressure-pools"></div>
    <table id="ranked"><thead><tr><th>#</th><th>action</th><th>target</th><th>sequence</th>
      <th>tenant</th><th class="num">lineage</th><th class="num">frees</th><th class="num">cost</th></tr></thead>
      <tbody></tbody></table></section>
  </div>
  <section id="plan-panel" class="wide"><h2>Capacity plan (live) <span class="right mute" id="plan-sum"></span></h2>
    <table id="plan"><thead><tr><th>policy</th><th>kind</th><th class="num">bits</th>
      <th class="num">KiB / token</th><th class="num">live tokens</th><th class="num">idealized tokens</th>
      <th class="num" id="plan-sessions-head">sessions</th></tr></thead><tbody></tbody></table>
    <div id="plan-tenants"></div>
    <div id="plan-notes" class="mute"></div></section>
  <section id="sequence-panel" class="wide"><h2>Sequence block map
    <span class="right">
      <select id="seq-pick"></select>
      <span class="toggle" id="seq-mode"><button data-mode="tag" class="on">by tag</button><button data-mode="format">by format</button></span>
    </span></h2>
    <div id="seq-head" class="kpis"></div>
    <div id="seq-map" class="map"></div>
    <div class="legend" id="seq-legend"></div></section>
  <section id="events-panel" class="wide"><h2>Live events <span class="right mute" id="events-sum"></span></h2>
    <div id="events-wrap"><table id="events"><thead><tr><th class="num">id</th><th>time</th><th>kind</th>
      <th>sequence</th><th class="num">lineage</th><th>tag</th><th>format</th><th>worker</th><th>detail</th></tr></thead>
      <tbody></tbody></table></div></section>
</main>
<script>
"use strict";
const POLL_MS = 2000;
const FORMAT_COLORS = { bf16:"#1b4f72", fp8:"#3498db", int8:"#16a085", int4:"#2ecc71",
  int2:"#f1c40f", tq4:"#9b59b6", tq3:"#e67e22", tq2:"#e74c3c" };
const AXIS_COLORS = {
  temporal: { sink:"#17202a", current_turn:"#e74c3c", recent_turns:"#f5b041", older:"#aab7b8" },
  modality: { text:"#5dade2", image:"#af7ac5", audio:"#48c9b0" },
  role: { system:"#34495e", tool_schema:"#7f8c8d", user:"#3498db", assistant:"#27ae60",
          reasoning:"#8e44ad", tool_call:"#e67e22", tool_result:"#d35400", delimiter:"#d5d8dc" },
  tier: { device:"#7b8a97", host:"#f39c12", disk:"#a04000", evicted:"#e5e7e9" },
};
const WINDOW_COLOR = "#85929e";

function h(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "style") e.style.cssText = v; else e.setAttribute(k, v);
  }
  for (const k of kids.flat()) {
    if (k === null || k === undefined) continue;
    e.append(k instanceof Node ? k : String(k));
  }
  return e;
}
function bytes(n) {
  if (n === null || n === undefined) return "–";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0, v = n;
  while (v >= 1024 && i < u.length - 1) { v /= 1024; ++i; }
  return (i === 0 ? v : v.toFixed(v < 10 ? 2 : 1)) + " " + u[i];
}
function pct(a, b) { return b > 0 ? Math.min(100, 100 * a / b) : 0; }
function seg(width, color, title, cls) {
  return h("span", { style: `width:${width}%;background:${color}`, title, class: cls });
}
function mark(at, cls, title) {
  return h("span", { class: "mark " + cls, style: `left:calc(${Math.min(at, 100)}% - 1px)`, title });
}
function legend(colors, extra) {
  return Object.entries(colors).map(([k, c]) => h("span", {}, h("i", { style: `background:${c}` }), k))
    .concat(extra || []);
}
// With kvmanager --auth=token the JSON needs an admin token: open the page
// as .../#token=<admin token> (a fragment never reaches the server's logs).
const token = new URLSearchParams(location.hash.slice(1)).get("token");
async function getJson(path) {
  const r = await fetch(path, {
    cache: "no-store",
    headers: token ? { Authorization: "Bearer " + token } : {},
  });
  const body = await r.json();
  if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
  return body;
}

// --- Workers ---------------------------------------------------------------
function renderWorkers(data) {
  const box = document.getElementById("workers");
  const cards = data.workers.map(w => {
    const used = w.formats.reduce((s, f) => s + f.bytes_used, 0);
    const segs = w.formats.filter(f => f.bytes_used > 0).map(f =>
      seg(pct(f.bytes_used, w.capacity_bytes), FORMAT_COLORS[f.format] || "#999",
          `${f.format}: ${bytes(f.bytes_used)} in ${f.pages_used} pages`));
    if (w.window_bytes > 0)
      segs.push(seg(pct(w.window_bytes, w.capacity_bytes), WINDOW_COLOR,
                    `BF16 window: ${bytes(w.window_bytes)}`, "hatch"));
    const bar = h("div", { class: "bar" }, segs,
      mark(pct(w.reserved_bytes, w.capacity_bytes), "", `reserved by the manager: ${bytes(w.reserved_bytes)}`));
    const pools = w.pools.length === 0 ? null : h("table", {},
      h("thead", {}, h("tr", {}, h("th", {}, "pool"), h("th", { class: "num" }, "page"),
        h("th", { class: "num" }, "frames"), h("th", { class: "num" }, "pages used"), h("th", {}, ""))),
      h("tbody", {}, w.pools.map(p => {
        const slots = p.frames * p.pages_per_frame;
        return h("tr", { "data-pool": p.encoding },
          h("td", {}, h("i", { style: `display:inline-block;width:9px;height:9px;margin-right:5px;background:${FORMAT_COLORS[p.format] || "#999"}` }), p.encoding),
          h("td", { class: "num" }, bytes(p.page_bytes)), h("td", { class: "num" }, p.frames),
          h("td", { class: "num" }, `${p.pages_used} / ${slots}`),
          h("td", { style: "width:40%" }, h("div", { class: "bar" },
            seg(pct(p.pages_used, slots), FORMAT_COLORS[p.format] || "#999", `${p.pages_used} of ${slots} pages`))));
      })));
    const tiers = w.tiers.filter(t => t.capacity_bytes > 0).map(t =>
      h("div", { class: "row" }, h("span", {}, t.tier + " tier"),
        h("div", { class: "bar" }, seg(pct(t.used_bytes, t.capacity_bytes), AXIS_COLORS.tier[t.tier] || "#999")),
        h("span", { class: "mute" }, `${bytes(t.used_bytes)} / ${bytes(t.capacity_bytes)} · ${t.blocks} blocks`)));
    return h("div", { class: "card worker", "data-worker-id": w.worker_id },
      h("div", { class: "title" }, h("b", {}, w.worker_id), h("span", { class: "badge " + w.state }, w.state),
        h("span", { class: "mute" }, `${w.backend} · ${w.address} · ${w.sequences} sequences`),
        w.device_error ? h("span", { class: "err" }, w.device_error) : null),
      h("div", { class: "row" }, h("span", {}, "device"), bar,
        h("span", { class: "mute", "data-used-bytes": w.used_bytes },
          `${bytes(w.used_bytes)} / ${bytes(w.capacity_bytes)} · reserved ${bytes(w.reserved_bytes)}`)),
      tiers,
      h("div", { class: "mute" }, `frames ${w.free_frames} free of ${w.frames} (${bytes(w.frame_bytes)} each) · ` +
        `fragmentation ${(100 * w.fragmentation).toFixed(1)}% · spills ${w.counters.spills} · ` +
        `restores ${w.counters.restores} · evictions ${w.counters.evictions}`),
      pools);
  });
  box.replaceChildren(...(cards.length ? cards : [h("div", { class: "mute" }, "no workers registered")]));
  const up = data.workers.filter(w => w.state === "up").length;
  document.getElementById("workers-sum").textContent = `${up} up of ${data.workers.length}`;
}

// --- Tenants ---------------------------------------------------------------
function renderTenants(data) {
  const rows = [];
  for (const t of data.tenants) {
    rows.push(h("div", { class: "title", style: "margin-top:6px" }, h("b", { "data-tenant-id": t.tenant_id }, t.tenant_id),
      h("span", { class: "mute" }, ` ${t.open_sequences} open · policy ${t.default_policy}`)));
    for (const r of t.tiers) {
      const ceil = r.ceiling_bytes, floor = r.floor_bytes;
      const scale = Math.max(ceil || 0, r.used_bytes, floor || 0, 1);
      const over = ceil !== null && r.used_bytes > ceil;
      const color = over ? "var(--bad)" : (ceil !== null && r.used_bytes > 0.9 * ceil ? "var(--warn)" : "#2e86c1");
      const marks = [];
      if (floor) marks.push(mark(pct(floor, scale), "floor", `floor ${bytes(floor)}`));
      if (ceil !== null) marks.push(mark(pct(ceil, scale), "", `ceiling ${bytes(ceil)}`));
      rows.push(h("div", { class: "row tenant-tier", "data-tenant": t.tenant_id, "data-tier": r.tier,
                          "data-used-bytes": r.used_bytes },
        h("span", {}, r.tier),
        h("div", { class: "bar" }, seg(pct(r.used_bytes, scale), color, `${r.used_bytes} bytes`), marks),
        h("span", { class: "mute" }, `${bytes(r.used_bytes)} / ${ceil === null ? "unlimited" : bytes(ceil)}` +
          (floor ? ` · floor ${bytes(floor)}` : ""))));
    }
  }
  document.getElementById("tenants").replaceChildren(
    ...(rows.length ? rows : [h("div", { class: "mute" }, "no tenants")]));
}

// --- Pressure --------------------------------------------------------------
function renderPressure(p) {
  const c = p.counters;
  document.getElementById("pressure-sum").textContent =
    `mode ${p.mode} · ranked ${p.snapshot_blocks} blocks` +
    (p.snapshot_blocks ? `, ${(p.snapshot_age_ms / 1000).toFixed(1)} s ago` : "");
  document.getElementById("pressure-kpis").replaceChildren(
    ...[["demotions", c.demotions], ["spills", c.spills], ["restores", c.restores],
        ["evictions", c.evictions], ["prefix hits", p.prefix.hits]].map(([k, v]) =>
      h("div", {}, h("b", {}, v), h("span", { class: "mute" }, k))));
  document.getElementById("pressure-pools").replaceChildren(...p.pools.map(pool =>
    h("div", { class: "row" }, h("span", {}, `${pool.worker_id} ${pool.tier}`),
      h("div", { class: "bar" },
        seg(pct(pool.used_bytes, pool.capacity_bytes),
            pool.used_bytes > pool.high_watermark_bytes ? "var(--bad)" : "#5d6d7e", `${pool.used_bytes} bytes`),
        mark(pct(pool.low_watermark_bytes, pool.capacity_bytes), "low", `low watermark ${bytes(pool.low_watermark_bytes)}`),
        mark(pct(pool.high_watermark_bytes, pool.capacity_bytes), "high", `high watermark ${bytes(pool.high_watermark_bytes)}`)),
      h("span", { class: "mute" }, `${bytes(pool.used_bytes)} / ${bytes(pool.capacity_bytes)}`))));
  const body = document.querySelector("#ranked tbody");
  body.replaceChildren(...(p.ranked.length ? p.ranked.map(a => h("tr", {},
    h("td", {}, a.rank), h("td", {}, a.action), h("td", {}, a.encoding || "–"),
    h("td", {}, a.sequence_id), h("td", {}, a.tenant_id), h("td", { class: "num" }, a.lineage_id),
    h("td", { class: "num" }, bytes(a.bytes_freed)), h("td", { class: "num" }, a.cost.toPrecision(3))))
    : [h("tr", {}, h("td", { colspan: 8, class: "mute" }, "no ranking yet (the pressure loop ranks when a pool fills, and every few rounds)"))]));
}

// --- Events ----------------------------------------------------------------
let lastEvent = null;
const MAX_EVENT_ROWS = 200;
function renderEvents(data) {
  const body = document.querySelector("#events tbody");
  for (const r of body.querySelectorAll("tr.new")) r.classList.remove("new");
  const fresh = data.events.map(e => h("tr", { class: lastEvent === null ? null : "new", "data-event-id": e.id },
    h("td", { class: "num" }, e.id), h("td", {}, new Date(e.unix_ms).toLocaleTimeString()),
    h("td", {}, e.kind), h("td", {}, e.sequence_id || ""), h("td", { class: "num" }, e.lineage_id || ""),
    h("td", {}, e.tag ? `${e.tag.temporal}/${e.tag.modality}/${e.tag.role}` : ""),
    h("td", {}, e.format ? h("span", {}, h("i", { style: `display:inline-block;width:9px;height:9px;margin-right:4px;background:${FORMAT_COLORS[e.format] || "#999"}` }), e.format) : ""),
    h("td", {}, e.worker_id || ""), h("td", { class: "mute" }, e.detail || "")));
  body.prepend(...fresh.reverse());
  while (body.rows.length > MAX_EVENT_ROWS) body.deleteRow(-1);
  if (data.events.length) lastEvent = data.events[data.events.length - 1].id;
  else if (lastEvent === null) lastEvent = data.next_id - 1;
  document.getElementById("events-sum").textContent = `next id ${data.next_id}`;
}

// --- Sequence block map ------------------------------------------------------
// ?seq=seq-N picks a sequence, ?color=format starts in the format view.
const urlParams = new URLSearchParams(location.search);
let seqMode = urlParams.get("color") === "format" ? "format" : "tag";
let seqPick = urlParams.get("seq");
function lane(label, blocks, total, colorOf, titleOf) {
  const strip = h("div", { class: "strip" }, blocks.map(b => {
    const cap = Math.max(b.capacity, b.num_tokens);
    return h("div", { class: b.evicted ? "evicted" : null, style: `flex:${cap} 0 0`, title: titleOf(b) },
      h("span", { style: `width:${100 * b.num_tokens / cap}%;background:${colorOf(b)}` }));
  }));
  return h("div", { class: "lane", "data-lane": label }, h("span", { class: "mute" }, label), strip);
}
function renderSequence(s) {
  const blocks = s.blocks;
  const formats = {};
  for (const b of blocks) formats[b.format] = (formats[b.format] || 0) + b.num_tokens;
  document.getElementById("seq-head").replaceChildren(
    ...[["sequence", h("span", { id: "seq-id" }, s.sequence_id)], ["tenant", s.tenant_id], ["worker", s.worker_id],
        ["state", s.state], ["tokens", s.num_tokens], ["blocks", h("span", { id: "seq-block-count" }, blocks.length)],
        ["block tokens", s.block_tokens], ["turns", s.turns], ["policy", s.policy], ["bytes", bytes(s.bytes)]]
      .map(([k, v]) => h("div", {}, h("b", {}, v), h("span", { class: "mute" }, k))));
  const title = b => `block ${b.index} · tokens ${b.first_token}–${b.first_token + b.num_tokens - 1}` +
    ` (${b.num_tokens}/${b.capacity}) · ${b.tag.temporal}/${b.tag.modality}/${b.tag.role}` +
    ` · ${b.encoding} · ${b.tier} · lineage ${b.lineage_id}` + (b.refcount > 1 ? ` · shared ×${b.refcount}` : "");
  const total = s.num_tokens;
  const lanes = [];
  let legends = [];
  if (seqMode === "tag") {
    for (const axis of ["temporal", "modality", "role"]) {
      lanes.push(lane(axis, blocks, total, b => AXIS_COLORS[axis][b.tag[axis]] || "#999", title));
      const used = new Set(blocks.map(b => b.tag[axis]));
      legends = legends.concat(h("b", {}, axis), legend(Object.fromEntries(Object.entries(AXIS_COLORS[axis]).filter(([k]) => used.has(k)))));
    }
    // What the policy made of the tags: the format under them.
    lanes.push(lane("format", blocks, total, b => FORMAT_COLORS[b.format] || "#999", title));
    const used = new Set(blocks.map(b => b.format));
    legends = legends.concat(h("b", {}, "format"), legend(Object.fromEntries(Object.entries(FORMAT_COLORS).filter(([k]) => used.has(k)))));
  } else {
    lanes.push(lane("K format", blocks, total, b => FORMAT_COLORS[b.format] || "#999", title));
    lanes.push(lane("V format", blocks, total, b => FORMAT_COLORS[b.format_v] || "#999", title));
    const used = new Set(blocks.flatMap(b => [b.format, b.format_v]));
    legends = legend(Object.fromEntries(Object.entries(FORMAT_COLORS).filter(([k]) => used.has(k))));
    legends.push(h("span", { class: "mute" }, " · tokens by K format: " +
      Object.entries(formats).map(([f, n]) => `${f} ${n}`).join(", ")));
  }
  lanes.push(lane("tier", blocks, total, b => AXIS_COLORS.tier[b.tier] || "#999", title));
  const ticks = [];
  for (let i = 0; i <= 4; ++i) ticks.push(h("span", {}, Math.round(total * i / 4)));
  const map = document.getElementById("seq-map");
  map.replaceChildren(...lanes, h("div", { class: "ruler" }, ticks));
  document.getElementById("seq-legend").replaceChildren(...legends,
    h("span", { class: "mute" }, " · a block's width is its capacity; the filled part its tokens"));
}
function renderSequenceList(data) {
  const sel = document.getElementById("seq-pick");
  const ids = data.sequences.map(s => s.sequence_id);
  if (seqPick === null && ids.length) seqPick = ids[0];
  if (seqPick !== null && !ids.includes(seqPick)) ids.unshift(seqPick);
  const have = Array.from(sel.options).map(o => o.value).join(",");
  if (have !== ids.join(",")) {
    sel.replaceChildren(...ids.map(id => {
      const s = data.sequences.find(x => x.sequence_id === id);
      return h("option", { value: id }, s ? `${id} · ${s.tenant_id} · ${s.num_tokens} tokens` : id);
    }));
  }
  if (seqPick !== null) sel.value = seqPick;
}
for (const x of document.querySelectorAll("#seq-mode button")) x.classList.toggle("on", x.dataset.mode === seqMode);
document.getElementById("seq-pick").addEventListener("change", e => { seqPick = e.target.value; refreshSequence(); });
for (const b of document.querySelectorAll("#seq-mode button")) {
  b.addEventListener("click", () => {
    seqMode = b.dataset.mode;
    for (const x of document.querySelectorAll("#seq-mode button")) x.classList.toggle("on", x === b);
    refreshSequence();
  });
}
async function refreshSequence() {
  const list = await getJson("/api/sequences?page_size=500");
  renderSequenceList(list);
  if (seqPick === null) {
    document.getElementById("seq-map").replaceChildren(h("div", { class: "mute" }, "no open sequences"));
    return;
  }
  try {
    renderSequence(await getJson("/api/sequence?id=" + encodeURIComponent(seqPick)));
  } catch (e) {
    document.getElementById("seq-map").replaceChildren(h("div", { class: "err" }, e.message));
  }
}

// --- Capacity plan -------------------------------------------------------------
// What the fleet as it stands holds per policy (PlanCapacity over the live
// tag mix and tenants; docs/capacity.md); heavier than the rest, so polled
// every PLAN_MS.
const PLAN_MS = 10000;
function num(n) { return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"); }
function renderPlan(p) {
  const body = document.querySelector("#plan tbody");
  const sum = document.getElementById("plan-sum");
  if (!p.rows.length) {
    sum.textContent = "";
    body.replaceChildren(h("tr", {}, h("td", { colspan: 7, class: "mute" }, "nothing to plan: " + p.reason)));
    document.getElementById("plan-tenants").replaceChildren();
    document.getElementById("plan-notes").replaceChildren();
    return;
  }
  sum.textContent = `${p.model.name} · ${p.gpus} GPU${p.gpus === 1 ? "" : "s"} of ${bytes(p.gpu_memory_bytes)} · ` +
    `${p.open_sequences} open sequences, ${num(p.open_tokens)} tokens · tag mix ${num(p.tag_mix_tokens)} tokens`;
  document.getElementById("plan-sessions-head").textContent = `sessions of ${num(p.context_tokens)} tokens`;
  body.replaceChildren(...p.rows.map(r => h("tr", { "data-plan-row": r.label, "data-page-tokens": r.page_tokens,
                                                    "data-sessions": r.sessions },
    h("td", {}, r.label), h("td", {}, r.kind), h("td", { class: "num" }, r.page_bits.toFixed(2)),
    h("td", { class: "num" }, (r.page_bytes_per_token / 1024).toFixed(2)),
    h("td", { class: "num" }, num(r.page_tokens)), h("td", { class: "num" }, num(r.ideal_tokens)),
    h("td", { class: "num" }, num(r.sessions)))));
  const labels = p.rows.map(r => r.label);
  document.getElementById("plan-tenants").replaceChildren(p.tenants.length === 0 ? h("span") :
    h("table", { style: "margin-top:8px" },
      h("thead", {}, h("tr", {}, h("th", {}, "tenant"), h("th", { class: "num" }, "share"),
        labels.map(l => h("th", { class: "num" }, `sessions · ${l}`)))),
      h("tbody", {}, p.tenants.map(t => h("tr", { "data-plan-tenant": t.tenant_id },
        h("td", {}, t.tenant_id), h("td", { class: "num" }, bytes(t.share_bytes)),
        labels.map(l => { const x = t.rows.find(y => y.label === l);
                          return h("td", { class: "num" }, x ? num(x.sessions) : "–"); }))))));
  const notes = p.notes.map(n => h("div", {}, n));
  if (p.floors_exceed_memory) notes.push(h("div", { class: "err" }, "the tenants' floors exceed the memory"));
  document.getElementById("plan-notes").replaceChildren(...notes);
}
async function refreshPlan() {
  try {
    renderPlan(await getJson("/api/plan"));
  } catch (err) {
    document.getElementById("plan-sum").textContent = "";
    document.querySelector("#plan tbody").replaceChildren(
      h("tr", {}, h("td", { colspan: 7, class: "err" }, "plan: " + err.message)));
  }
}

// --- Polling -----------------------------------------------------------------
document.getElementById("format-legend").replaceChildren(...legend(FORMAT_COLORS,
  [h("span", {}, h("i", { class: "hatch", style: `background-color:${WINDOW_COLOR}` }), "BF16 window")]));
async function refresh() {
  const status = document.getElementById("status");
  try {
    const after = lastEvent === null ? "" : `after=${lastEvent}&`;
    const [w, t, p, e] = await Promise.all([getJson("/api/workers"), getJson("/api/tenants"),
      getJson("/api/pressure?top=10"), getJson(`/api/events?${after}limit=200`)]);
    renderWorkers(w); renderTenants(t); renderPressure(p); renderEvents(e);
    await refreshSequence();
    status.className = "";
    status.textContent = "live · updated " + new Date().toLocaleTimeString();
  } catch (err) {
    status.className = "err";
    status.textContent = "cannot reach the manager: " + err.message;
  }
}
refresh();
setInterval(refresh, POLL_MS);
refreshPlan();
setInterval(refreshPlan, PLAN_MS);
</script>
</body>
</html>
)html";

}  // namespace triax::manager
