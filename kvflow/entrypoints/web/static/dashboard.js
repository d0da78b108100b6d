// The live engine view. One source per fact, so that the page never contradicts itself:
// the snapshot stream (/dashboard/api/stream) alone draws the status line, the KV block
// pool, the last step's batch, the queues and the engine-state charts (requests, KV usage,
// prefix-cache hit rate, speculative acceptance), all from the same snapshot in one render;
// the latency charts (output tokens/s, TTFT, inter-token latency) come from the server's
// Prometheus registry as JSON (/dashboard/api/metrics), polled every second.

import { apiFetch, modelInfo, onKeyChange, setupKeyButton, sseEvents } from "./api.js";
import { StepChart, TimeChart } from "./charts.js";

const $ = (id) => document.getElementById(id);
const STREAM = "/dashboard/api/stream";
const STATE_NAMES = { f: "free", c: "cached (in the prefix index, ref count 0)", u: "in use", s: "shared" };

let snap = null; // the latest snapshot's data
let owners = new Map(); // block id -> [request ids] of the latest snapshot
let highlighted = null; // request id whose blocks are outlined
let grid = null; // the block grid's layout {cell, cols, n}
let streamController = null;
let paused = false;
let renderPending = false;

// A canvas sized to its CSS box at the device's pixel ratio; returns its 2D context and
// its size in CSS pixels.
function fitCanvas(canvas, cssHeight) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || canvas.parentElement.clientWidth;
  if (cssHeight !== undefined) canvas.style.height = `${cssHeight}px`;
  const height = canvas.clientHeight || cssHeight;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return { ctx, width, height };
}

const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
const shortId = (id) => (id.length > 14 ? `${id.slice(0, 8)}…${id.slice(-3)}` : id);
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);

// ---------------------------------------------------------------- the stream
async function stream() {
  while (!paused) {
    streamController = new AbortController();
    try {
      setLive("connecting…", null);
      const response = await apiFetch(STREAM, { signal: streamController.signal });
      setLive("live", true);
      for await (const { event, data } of sseEvents(response)) {
        if (event !== "snapshot") continue;
        snap = JSON.parse(data);
        if (snap.steps.length) steps.push(snap.steps, snap.config.max_num_batched_tokens);
        pushEngineCharts(snap);
        scheduleRender();
      }
      setLive("stream ended", false);
    } catch (error) {
      if (error.name === "AbortError") return;
      setLive(error.status === 401 ? "API key needed" : `disconnected (${error.message})`, false);
      if (error.status === 401) return; // restarted by onKeyChange
    }
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

function setLive(text, on) {
  $("live").textContent = text;
  $("live-dot").className = `live-dot ${on === true ? "on" : on === false ? "off" : ""}`;
}

$("pause").addEventListener("click", () => {
  paused = !paused;
  $("pause").textContent = paused ? "Resume" : "Pause";
  if (paused) {
    streamController?.abort();
    setLive("paused (the last snapshot stays; hover still works)", null);
  } else stream();
});

function scheduleRender() {
  if (renderPending) return;
  renderPending = true;
  requestAnimationFrame(() => {
    renderPending = false;
    render();
  });
}

function render() {
  if (!snap) return;
  owners = new Map();
  for (const r of [...snap.running, ...snap.waiting]) {
    for (const b of r.block_ids) {
      if (!owners.has(b)) owners.set(b, []);
      owners.get(b).push(r.id);
    }
  }
  document.body.dataset.seq = snap.seq;
  renderStatus();
  renderPool();
  renderBatch();
  renderQueues();
  renderEngineCharts();
}

// ---------------------------------------------------------------- status
function renderStatus() {
  const c = snap.config;
  $("step").textContent = snap.step;
  $("num-running").textContent = snap.running.length;
  $("num-waiting").textContent = snap.waiting.length;
  $("kv-usage").textContent = `${(100 * snap.stats.kv_cache_usage).toFixed(1)}%`;
  $("as-of").textContent = new Date(snap.time * 1000).toLocaleTimeString();
  $("config").textContent =
    `${c.num_blocks} blocks × ${c.block_size} tokens · budget ${c.max_num_batched_tokens} tokens/step · ` +
    `max ${c.max_num_seqs} seqs · prefix caching ${c.enable_prefix_caching ? "on" : "off"}` +
    (c.num_speculative_tokens ? ` · speculation k=${c.num_speculative_tokens}` : "") +
    (c.num_cpu_blocks ? ` · ${c.num_cpu_blocks} host blocks` : "");
}

// ---------------------------------------------------------------- the block pool
function layout(canvas, n, maxHeight) {
  const width = canvas.parentElement.clientWidth;
  let cell = Math.floor(Math.sqrt((width * maxHeight) / Math.max(n, 1)));
  cell = Math.max(3, Math.min(cell, 18));
  const cols = Math.max(1, Math.floor(width / cell));
  const rows = Math.ceil(n / cols);
  return { cell, cols, n, height: rows * cell };
}

function drawBlocks(canvas, states, shared, look, colors, outline) {
  const { ctx, width } = fitCanvas(canvas, look.height);
  ctx.clearRect(0, 0, width, look.height);
  const gap = look.cell >= 6 ? 1 : 0;
  const size = look.cell - gap;
  ctx.font = `${Math.max(7, Math.floor(look.cell * 0.55))}px system-ui, sans-serif`;
  ctx.textAlign = "center";
  ctx.textBaseline = "middle";
  for (let i = 0; i < look.n; i++) {
    const x = (i % look.cols) * look.cell;
    const y = Math.floor(i / look.cols) * look.cell;
    ctx.fillStyle = colors[states[i]];
    ctx.fillRect(x, y, size, size);
    if (states[i] === "s" && look.cell >= 12) {
      ctx.fillStyle = "#000";
      ctx.fillText(String(shared[i]), x + size / 2, y + size / 2 + 0.5);
    }
  }
  if (outline && outline.size) {
    ctx.strokeStyle = css("--text");
    ctx.lineWidth = Math.max(1.5, look.cell / 6);
    for (const i of outline) {
      if (i >= look.n) continue;
      ctx.strokeRect((i % look.cols) * look.cell + 0.75, Math.floor(i / look.cols) * look.cell + 0.75, size - 1.5, size - 1.5);
    }
  }
}

function renderPool() {
  const blocks = snap.blocks;
  const counts = { f: 0, c: 0, u: 0, s: 0 };
  for (const ch of blocks.states) counts[ch]++;
  $("count-free").textContent = counts.f;
  $("count-cached").textContent = counts.c;
  $("count-used").textContent = counts.u;
  $("count-shared").textContent = counts.s;
  const refs = Object.values(blocks.shared);
  $("pool-sub").textContent =
    `${blocks.num_blocks} blocks of ${blocks.block_size} tokens` +
    (refs.length ? ` · the most shared block is held by ${Math.max(...refs)} requests` : "");
  const colors = { f: css("--blk-free"), c: css("--blk-cached"), u: css("--blk-used"), s: css("--blk-shared") };
  const outline = new Set();
  if (highlighted) {
    for (const r of [...snap.running, ...snap.waiting]) if (r.id === highlighted) r.block_ids.forEach((b) => outline.add(b));
  }
  const canvas = $("block-grid");
  grid = layout(canvas, blocks.num_blocks, 300);
  drawBlocks(canvas, blocks.states, blocks.shared, grid, colors, outline);
  const cpu = snap.cpu_blocks;
  $("cpu-pool").hidden = !cpu;
  let swapped = 0;
  if (cpu) {
    for (const ch of cpu.states) if (ch !== "f") swapped++;
    $("cpu-sub").textContent = `${cpu.num_blocks} blocks · ${swapped} hold swapped-out requests' K/V`;
    const hostOutline = new Set();
    if (highlighted) {
      for (const r of snap.waiting) if (r.id === highlighted) r.cpu_block_ids.forEach((b) => hostOutline.add(b));
    }
    const swappedColors = { f: colors.f, c: colors.f, u: css("--blk-swapped"), s: css("--blk-swapped") };
    drawBlocks($("cpu-grid"), cpu.states, cpu.shared, layout($("cpu-grid"), cpu.num_blocks, 60), swappedColors, hostOutline);
  }
  $("count-swapped").textContent = swapped;
}

// hover: owners at once, the tokens' text from /dashboard/api/blocks/{id} (lazily)
const textCache = new Map();
let hoverTimer = null;
let hovered = null;

$("block-grid").addEventListener("mousemove", (event) => {
  if (!snap || !grid) return;
  const rect = event.target.getBoundingClientRect();
  const col = Math.floor((event.clientX - rect.left) / grid.cell);
  const row = Math.floor((event.clientY - rect.top) / grid.cell);
  const id = row * grid.cols + col;
  if (col >= grid.cols || id < 0 || id >= grid.n) return hideTooltip();
  showBlock(id, event.clientX, event.clientY);
});
$("block-grid").addEventListener("mouseleave", hideTooltip);

function hideTooltip() {
  hovered = null;
  $("tooltip").style.display = "none";
  if (highlighted !== null) {
    highlighted = null;
    renderPool();
    renderQueues();
  }
}

function showBlock(id, x, y) {
  const tip = $("tooltip");
  const state = snap.blocks.states[id];
  const who = owners.get(id) || [];
  const ref = state === "s" ? snap.blocks.shared[id] : state === "u" ? 1 : 0;
  const key = `${id}:${snap.seq}`;
  if (hovered !== key) {
    hovered = key;
    let html = `<b>block ${id}</b> · ${esc(STATE_NAMES[state])} · ref count ${ref}`;
    if (who.length) {
      const list = who.slice(0, 12).map((r) => `<span class="mono">${esc(shortId(r))}</span>`).join(", ");
      html += `<div>held by ${who.length} request${who.length > 1 ? "s" : ""}: ${list}${who.length > 12 ? ", …" : ""}</div>`;
    }
    html += `<div class="text" id="tip-text">${state === "f" ? "(no content)" : "…"}</div>`;
    tip.innerHTML = html;
    if (state !== "f") {
      clearTimeout(hoverTimer);
      hoverTimer = setTimeout(() => loadText(id, key), 120);
    }
    if (who.length === 1 && highlighted !== who[0]) {
      highlighted = who[0];
      renderQueues();
    }
  }
  tip.style.display = "block";
  const w = tip.offsetWidth;
  tip.style.left = `${Math.min(x + 14, window.innerWidth - w - 8)}px`;
  tip.style.top = `${y + 14}px`;
}

async function loadText(id, key) {
  let info = textCache.get(key);
  if (!info) {
    try {
      info = await (await apiFetch(`/dashboard/api/blocks/${id}`)).json();
    } catch (error) {
      info = { error: error.message };
    }
    textCache.set(key, info);
    if (textCache.size > 500) textCache.delete(textCache.keys().next().value);
  }
  if (hovered !== key) return;
  const el = $("tip-text");
  if (!el) return;
  if (info.error) el.textContent = `(${info.error})`;
  else if (info.tokens && info.tokens.length) {
    el.innerHTML =
      info.tokens.map((t) => `<span class="tok">${esc(t)}</span>`).join("") +
      `<div class="muted">${info.token_ids.length} / ${info.block_size} tokens${info.source === "cache" ? " · text of the last request that held it" : ""}</div>`;
  } else if (info.token_ids && info.token_ids.length) el.textContent = `token ids ${info.token_ids.join(" ")}`;
  else el.textContent = info.state === "c" ? "(content not seen in a snapshot)" : "(no computed token yet)";
}

// ---------------------------------------------------------------- the batch
function renderBatch() {
  const b = snap.batch;
  steps.draw();
  const bar = $("budget");
  const tbody = $("batch-table").querySelector("tbody");
  if (!b) {
    $("batch-sub").textContent = "idle (no step since the last snapshot)";
    bar.innerHTML = "";
    tbody.innerHTML = "";
    return;
  }
  const byKind = { prefill: 0, decode: 0, verify: 0 };
  for (const r of b.requests) byKind[r.kind] += r.num_tokens;
  const parts = [
    `step ${b.step}`,
    `${b.num_scheduled_tokens} / ${b.max_num_batched_tokens} tokens (${((100 * b.num_scheduled_tokens) / b.max_num_batched_tokens).toFixed(0)}%)`,
    `${b.requests.length} requests`,
    `prefill ${byKind.prefill} · decode ${byKind.decode}` + (byKind.verify ? ` · verify ${byKind.verify}` : ""),
    `${b.preempted.length} preempted`,
    `${(1000 * b.duration_s).toFixed(0)} ms`,
  ];
  $("batch-sub").textContent = parts.join(" · ");
  bar.innerHTML = b.requests
    .map((r) => {
      const w = (100 * r.num_tokens) / b.max_num_batched_tokens;
      return `<div style="width:${w}%; background:var(--k-${r.kind})" title="${esc(r.id)}: ${r.kind} ${r.num_tokens} tokens"></div>`;
    })
    .join("");
  const rows = b.requests.map(
    (r) =>
      `<tr data-id="${esc(r.id)}"><td class="mono" title="${esc(r.id)}">${esc(shortId(r.id))}</td>` +
      `<td><span class="kind ${r.kind}">${r.kind}${r.kind === "prefill" && !r.last_chunk ? " chunk" : ""}</span></td>` +
      `<td>${r.num_tokens}${r.num_spec ? ` (${r.num_spec} drafts)` : ""}</td><td>${r.num_computed_tokens}</td></tr>`,
  );
  for (const f of b.forked) rows.push(`<tr><td class="mono">${esc(shortId(f.id))}</td><td><span class="kind fork">fork</span></td><td>0</td><td>of ${esc(shortId(f.parent))}</td></tr>`);
  for (const id of b.preempted) rows.push(`<tr><td class="mono">${esc(shortId(id))}</td><td><span class="kind" style="background:var(--danger)">preempted</span></td><td>–</td><td></td></tr>`);
  tbody.innerHTML = rows.join("");
}

// ---------------------------------------------------------------- the queues
function progress(r) {
  const p = r.num_tokens ? (100 * r.num_computed_tokens) / r.num_tokens : 0;
  return `<span class="progress"><div style="width:${p}%"></div></span> ${r.num_computed_tokens} / ${r.num_tokens}`;
}

function renderQueues() {
  $("running-sub").textContent = `${snap.running.length} / ${snap.config.max_num_seqs}`;
  $("waiting-sub").textContent = `${snap.waiting.length}`;
  const row = (r, cells) =>
    `<tr data-id="${esc(r.id)}" class="${r.id === highlighted ? "hl" : ""}"><td class="mono" title="${esc(r.id)}">${esc(shortId(r.id))}</td>${cells}</tr>`;
  $("running").querySelector("tbody").innerHTML = snap.running
    .map((r) =>
      row(r, `<td>${progress(r)}</td><td>${r.num_prompt_tokens}</td><td>${r.num_tokens - r.num_prompt_tokens} / ${r.max_tokens}</td><td>${r.block_ids.length}</td><td>${r.num_preemptions}</td>`),
    )
    .join("");
  $("waiting").querySelector("tbody").innerHTML = snap.waiting
    .map((r) =>
      row(r, `<td>${esc(r.status)}</td><td>${progress(r)}</td><td>${r.num_prompt_tokens}</td><td>${r.block_ids.length || (r.cpu_block_ids.length ? `${r.cpu_block_ids.length} on host` : 0)}</td><td>${r.num_preemptions}</td>`),
    )
    .join("");
}

for (const id of ["running", "waiting", "batch-table"]) {
  const table = $(id);
  table.addEventListener("mouseover", (event) => {
    const tr = event.target.closest("tr[data-id]");
    if (!tr || tr.dataset.id === highlighted) return;
    highlighted = tr.dataset.id;
    renderPool();
  });
  table.addEventListener("mouseleave", () => {
    highlighted = null;
    if (snap) renderPool();
  });
}

// ---------------------------------------------------------------- charts
const COLORS = ["#2563eb", "#f59e0b", "#dc2626"];
const pct = (v) => `${v.toFixed(0)}%`;
const three = (format) => ({ series: ["p50", "p90", "p99"].map((name, i) => ({ name, color: COLORS[i] })), format });
const charts = {
  // from the snapshots (the same data as the status line, the grid and the tables)
  reqs: new TimeChart($("chart-reqs"), { series: [{ name: "running", color: COLORS[0] }, { name: "waiting", color: COLORS[1] }], integer: true, format: (v) => v.toFixed(0) }),
  kv: new TimeChart($("chart-kv"), { series: [{ name: "usage %", color: COLORS[0] }], max: 100, format: pct }),
  hit: new TimeChart($("chart-hit"), { series: [{ name: "hit %", color: COLORS[0] }], max: 100, format: pct }),
  acc: new TimeChart($("chart-acc"), { series: [{ name: "accepted %", color: COLORS[0] }], max: 100, format: pct }),
  // from the Prometheus registry (/dashboard/api/metrics)
  toks: new TimeChart($("chart-toks"), { series: [{ name: "tok/s", color: COLORS[0] }], format: (v) => v.toFixed(0) }),
  ttft: new TimeChart($("chart-ttft"), three((v) => `${v.toFixed(2)} s`)),
  itl: new TimeChart($("chart-itl"), three((v) => `${v.toFixed(0)} ms`)),
};
const steps = new StepChart($("steps"));
const ratio = (a, b) => (b > 0 ? (100 * a) / b : null);
const fmt = (v, f) => (v === null || v === undefined ? "–" : f(v));

// The oldest of ``list`` ({t, ...}, oldest first) within ``seconds`` before t (or the oldest kept).
function ago(list, t, seconds) {
  for (const x of list) if (x.t >= t - seconds - 0.5) return x;
  return list[0];
}

const snapStats = []; // {t, stats} of the last 65 s of snapshots
function pushEngineCharts(s) {
  const t = s.time;
  snapStats.push({ t, stats: s.stats });
  while (snapStats.length && snapStats[0].t < t - 65) snapStats.shift();
  const w10 = ago(snapStats, t, 10).stats;
  const d = (key) => (s.stats[key] || 0) - (w10[key] || 0);
  charts.reqs.push(t, [s.running.length, s.waiting.length]);
  charts.kv.push(t, [100 * s.stats.kv_cache_usage]);
  charts.hit.push(t, [ratio(d("prefix_cache_hits"), d("prefix_cache_queries"))]);
  charts.acc.push(t, [ratio(d("spec_num_accepted_tokens"), d("spec_num_draft_tokens"))]);
}

function renderEngineCharts() {
  const [running, waiting] = charts.reqs.latest();
  $("now-reqs").textContent = `${running} running · ${waiting} waiting`;
  $("chart-reqs").dataset.latest = JSON.stringify([running, waiting]);
  $("now-kv").textContent = `${charts.kv.latest()[0].toFixed(1)}%`;
  $("now-hit").textContent = fmt(charts.hit.latest()[0], (v) => `${v.toFixed(1)}%`);
  $("now-acc").textContent = !snap.config.num_speculative_tokens ? "no speculation" : fmt(charts.acc.latest()[0], (v) => `${v.toFixed(1)}%`);
  for (const name of ["reqs", "kv", "hit", "acc"]) charts[name].draw();
}

// ---------------------------------------------------------------- metrics (latencies)
// {name: [{labels, value}]} of the server's registry, as /dashboard/api/metrics sends it.
const P = "kvflow:";
const total = (m, name) => (m[name] || []).reduce((sum, x) => sum + x.value, 0);

// [[upper bound, cumulative count]] of a histogram, by ascending bound.
function buckets(m, name) {
  const byLe = new Map();
  for (const s of m[`${name}_bucket`] || []) {
    const le = s.labels.le === "+Inf" ? Infinity : parseFloat(s.labels.le);
    byLe.set(le, (byLe.get(le) || 0) + s.value);
  }
  return [...byLe.entries()].sort((a, b) => a[0] - b[0]);
}

// The q-quantile of the observations between two readings of one histogram (buckets() of
// each), by linear interpolation inside the bucket as Prometheus' histogram_quantile();
// null when nothing was observed in between; in the +Inf bucket, the highest finite bound.
function quantileBetween(older, newer, q) {
  const old = new Map(older);
  const counts = newer.map(([le, c]) => [le, c - (old.get(le) || 0)]);
  const n = counts.length ? counts[counts.length - 1][1] : 0;
  if (!(n > 0)) return null;
  const rank = q * n;
  let prevLe = 0;
  let prevCount = 0;
  for (const [le, c] of counts) {
    if (c >= rank) {
      if (le === Infinity) return prevLe;
      if (c === prevCount) return le;
      return prevLe + ((le - prevLe) * (rank - prevCount)) / (c - prevCount);
    }
    prevLe = le;
    prevCount = c;
  }
  return prevLe;
}

const readings = []; // {t, m}
async function poll() {
  let body;
  try {
    body = await (await apiFetch("/dashboard/api/metrics")).json();
  } catch {
    return;
  }
  const t = body.time;
  const m = body.metrics;
  const prev = readings[readings.length - 1];
  readings.push({ t, m });
  while (readings.length && readings[0].t < t - 65) readings.shift();
  const gen = `${P}generation_tokens_total`;
  const toks = prev && t > prev.t ? Math.max(0, total(m, gen) - total(prev.m, gen)) / (t - prev.t) : null;
  const w30 = ago(readings, t, 30).m;
  const q = (name, scale) => [0.5, 0.9, 0.99].map((p) => {
    const v = quantileBetween(buckets(w30, `${P}${name}`), buckets(m, `${P}${name}`), p);
    return v === null ? null : v * scale;
  });
  const ttft = q("time_to_first_token_seconds", 1);
  const itl = q("inter_token_latency_seconds", 1000);
  charts.toks.push(t, [toks]);
  charts.ttft.push(t, ttft);
  charts.itl.push(t, itl);
  $("now-toks").textContent = fmt(toks, (v) => `${v.toFixed(1)} tok/s`);
  $("now-ttft").textContent = ttft[0] === null ? "no first token in 30 s" : ttft.map((v) => `${v.toFixed(2)} s`).join(" / ");
  $("now-itl").textContent = itl[0] === null ? "no token in 30 s" : itl.map((v) => `${v.toFixed(0)} ms`).join(" / ");
  for (const name of ["toks", "ttft", "itl"]) charts[name].draw();
}

// ---------------------------------------------------------------- start
async function showModel() {
  try {
    const model = await modelInfo();
    $("model-name").textContent = model ? model.id : "";
  } catch (error) {
    $("model-name").textContent = error.status === 401 ? "(API key needed)" : "";
  }
}

setupKeyButton($("key-button"));
onKeyChange(() => {
  showModel();
  streamController?.abort();
  paused = false;
  stream();
});
window.addEventListener("resize", () => {
  render();
  for (const chart of Object.values(charts)) chart.draw();
  steps.draw();
});
showModel();
stream();
poll();
setInterval(poll, 1000);
