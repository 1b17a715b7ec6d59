// pagoda's dashboard: polls GET /dashboard/api/state once a second and draws it.
// The API key (when the server has one) is asked for in a form, kept in this tab's session
// storage and sent as a bearer token on these requests only. Charts are drawn on plain canvas.
"use strict";

const STATE_URL = "/dashboard/api/state";
const POLL_MS = 1000;
const KEY_ITEM = "pagoda.dashboard.key";
const COLORS = { c1: "#2f6fdb", c2: "#e07b24", c3: "#2e9e5b", c4: "#9a4fd1", grid: "#e4e7ec", text: "#6b7483" };
const $ = (id) => document.getElementById(id);
let timer = null;
let updates = 0;
// Several models: the one shown (?model= in this page's address, kept when switching).
let selected = new URLSearchParams(location.search).get("model");
let generation = 0;  // bumped by a switch of model: an answer for the model before is dropped

// ---- formatting ---------------------------------------------------------------------------
function num(x, digits = 0) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  if (Math.abs(x) >= 1e6) return (x / 1e6).toFixed(1) + "M";
  if (Math.abs(x) >= 1e4) return (x / 1e3).toFixed(1) + "k";
  return x.toFixed(digits);
}
function ms(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  return seconds >= 10 ? seconds.toFixed(1) + " s" : (seconds * 1000).toFixed(seconds < 0.1 ? 1 : 0) + " ms";
}
function duration(s) {
  if (s < 60) return s.toFixed(1) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
}
function bytes(b) {
  if (b === null || b === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
  return b.toFixed(i ? 1 : 0) + " " + units[i];
}
function setText(id, text) {
  const el = $(id);
  el.textContent = text;
  return el;
}

// ---- tables (textContent only: prompts are untrusted text) --------------------------------
function fillTable(id, rows) {
  const body = $(id).tBodies[0];
  body.replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    for (const cell of cells) {
      const td = document.createElement("td");
      if (cell !== null && typeof cell === "object") {
        td.textContent = cell.text;
        if (cell.cls) td.className = cell.cls;
      } else {
        td.textContent = cell === null || cell === undefined ? "–" : String(cell);
      }
      tr.appendChild(td);
    }
    return tr;
  }));
}

// ---- a line chart on a canvas ---------------------------------------------------------------
// series: [{label, color, values: [number|null]}], times: [seconds], all of one length.
function lineChart(canvas, times, series, format = (v) => num(v, 1)) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * ratio) || canvas.height !== Math.round(h * ratio)) {
    canvas.width = Math.round(w * ratio);
    canvas.height = Math.round(h * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const pad = { left: 46, right: 8, top: 18, bottom: 18 };
  const pw = w - pad.left - pad.right, ph = h - pad.top - pad.bottom;
  let max = 0;
  for (const s of series) for (const v of s.values) if (v !== null && v > max) max = v;
  max = niceMax(max);
  ctx.font = "11px system-ui, sans-serif";
  ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {  // horizontal grid and the value axis
    const y = pad.top + ph - (ph * i) / 4;
    ctx.strokeStyle = COLORS.grid;
    ctx.beginPath(); ctx.moveTo(pad.left, y); ctx.lineTo(pad.left + pw, y); ctx.stroke();
    ctx.fillStyle = COLORS.text;
    ctx.textAlign = "right";
    ctx.fillText(format((max * i) / 4), pad.left - 6, y);
  }
  if (times.length > 1) {
    const t0 = times[0], span = Math.max(times[times.length - 1] - t0, 1);
    const x = (t) => pad.left + (pw * (t - t0)) / span;
    const y = (v) => pad.top + ph - (ph * v) / (max || 1);
    ctx.textAlign = "left";
    ctx.fillText("-" + duration(span), pad.left, h - 8);
    ctx.textAlign = "right";
    ctx.fillText("now", pad.left + pw, h - 8);
    for (const s of series) {
      ctx.strokeStyle = s.color;
      ctx.lineWidth = 1.6;
      ctx.beginPath();
      let pen = false;
      s.values.forEach((v, i) => {
        if (v === null || v === undefined) { pen = false; return; }
        if (pen) ctx.lineTo(x(times[i]), y(v)); else ctx.moveTo(x(times[i]), y(v));
        pen = true;
      });
      ctx.stroke();
    }
  }
  let lx = pad.left;  // legend
  ctx.textAlign = "left";
  for (const s of series) {
    ctx.fillStyle = s.color;
    ctx.fillRect(lx, 4, 10, 10);
    ctx.fillStyle = COLORS.text;
    ctx.fillText(s.label, lx + 14, 9);
    lx += ctx.measureText(s.label).width + 22;
  }
}
function niceMax(v) {
  if (v <= 0) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

// ---- rendering ------------------------------------------------------------------------------
function lastMinute(history, key) {  // mean over the samples of the last minute that have one
  const cut = history.length ? history[history.length - 1].t - 60 : 0;
  const vals = history.filter((s) => s.t >= cut && s[key] !== null).map((s) => s[key]);
  return vals.length ? vals.reduce((a, b) => a + b, 0) / vals.length : null;
}

// ---- several models: the selector and every model's state ------------------------------------
function renderModels(state) {
  const models = state.models || [];
  $("models-panel").hidden = !models.length;
  const select = $("model-select");
  select.hidden = models.length < 2;
  if (!models.length) return;
  const names = models.map((m) => m.name).join("\n");
  if (select.dataset.names !== names) {  // rebuilt only when the served models change
    select.replaceChildren(...models.map((m) => new Option(m.name, m.name)));
    select.dataset.names = names;
  }
  for (const opt of select.options) {
    const m = models.find((x) => x.name === opt.value);
    opt.textContent = `${m.name} (${m.status}${m.sleeping ? ", asleep" : ""})`;
  }
  select.value = state.server.model;
  fillTable("models", models.map((m) => [
    { text: m.name, cls: m.name === state.server.model ? "current" : "" }, { text: m.status, cls: "status-" + m.status },
    m.in_flight, m.loads, m.sleeping ? `level ${m.sleeping}` : "no", m.engine_pid, bytes(m.footprint_bytes),
    m.adapters.join(", ")]));
  const unloaded = $("unloaded");
  unloaded.hidden = !!state.engine;
  unloaded.textContent = state.engine ? "" :
    `The model ${state.server.model} is ${state.server.status}: it loads at its first request (or POST /models/load).`;
}

function render(state) {
  renderModels(state);
  setText("model", state.server.model);
  if (!state.engine) {  // a model that is not loaded has no engine to show
    updates += 1;
    document.body.dataset.updates = String(updates);
    return;
  }
  const e = state.engine, hist = state.history, c = state.counters;
  setText("device", e.device_name ? `${e.device} · ${e.device_name}` : e.device);
  setText("kernel", `kernels: ${e.kernel.level || "?"}` + (e.kernel.gemm ? ` · gemm ${e.kernel.gemm}` : ""))
    .title = e.kernel.reason || "";
  setText("uptime", `up ${duration(state.server.uptime_s)} · v${state.server.version}` +
    (e.sleeping ? ` · asleep (level ${e.sleeping})` : ""));
  const last = hist.length > 1 ? hist[hist.length - 2] : hist[hist.length - 1];  // the last whole interval
  const cards = { running: e.num_running, waiting: e.num_waiting, finished: c.finished };
  for (const [id, v] of Object.entries(cards)) setText(id, num(v)).dataset.value = v;
  setText("gen-tps", num(last ? last.generation_tps : null, 1));
  setText("prompt-tps", num(last ? last.prompt_tps : null, 1));
  setText("ttft", ms(lastMinute(hist, "ttft_mean")));
  setText("itl", ms(lastMinute(hist, "itl_mean")));
  setText("kv-usage", (100 * e.kv_cache_usage).toFixed(1) + " %").dataset.value = e.num_used_blocks;

  const times = hist.map((s) => s.t);
  const col = (k, scale = 1) => hist.map((s) => (s[k] === null ? null : s[k] * scale));
  lineChart($("chart-tps"), times, [
    { label: "generation", color: COLORS.c1, values: col("generation_tps") },
    { label: "prompt", color: COLORS.c2, values: col("prompt_tps") }]);
  lineChart($("chart-latency"), times, [
    { label: "TTFT", color: COLORS.c4, values: col("ttft_mean", 1000) },
    { label: "p90", color: COLORS.c2, values: col("ttft_p90", 1000) },
    { label: "ITL", color: COLORS.c1, values: col("itl_mean", 1000) },
    { label: "p90", color: COLORS.c3, values: col("itl_p90", 1000) }], (v) => num(v, 0));
  lineChart($("chart-requests"), times, [
    { label: "running", color: COLORS.c3, values: col("running") },
    { label: "waiting", color: COLORS.c2, values: col("waiting") }]);
  lineChart($("chart-kv"), times, [{ label: "used", color: COLORS.c1, values: col("kv_usage", 100) }]);

  renderKV(e, c);
  renderRequests(e);
  renderClasses("by-priority", e.by_priority, state.finished_by_priority, (k) => k);
  renderClasses("by-adapter", e.by_adapter, state.finished_by_adapter, (k) => k || "(base model)");
  renderPrefixes(e, state.server.text_hidden);
  updates += 1;
  document.body.dataset.updates = String(updates);
}

function renderKV(e, c) {
  const parts = [["used by requests", e.num_used_blocks, COLORS.c1],
                 ["cached, evictable", e.num_cached_blocks, COLORS.c3],
                 ["free", e.num_free_blocks, "#e9edf2"]];
  $("kv-bar").replaceChildren(...parts.map(([label, n, color]) => {
    const d = document.createElement("div");
    d.style.width = (100 * n / Math.max(e.num_blocks, 1)) + "%";
    d.style.background = color;
    d.title = `${label}: ${n} blocks`;
    return d;
  }));
  $("kv-legend").replaceChildren(...parts.map(([label, n, color]) => {
    const span = document.createElement("span");
    const i = document.createElement("i");
    i.style.background = color;
    span.append(i, `${label} ${num(n)}`);
    return span;
  }));
  setText("kv-caption", `${e.num_blocks} blocks of ${e.block_size} tokens · ` +
    `${e.num_prefix_cache_blocks} in the prefix cache · hit rate ` +
    (c.prefix_cache_queries ? (100 * c.prefix_cache_hits / c.prefix_cache_queries).toFixed(1) + " %" : "–"));
  const tiers = $("tiers");
  tiers.hidden = !e.tiers.length;
  fillTable("tiers", e.tiers.map((t) => [t.name, num(t.num_blocks), bytes(t.used_bytes), bytes(t.capacity_bytes),
    c.kv_offload[`${t.name}/hit`] ?? "–", c.kv_offload[`${t.name}/saved`] ?? "–"]));
}

function renderRequests(e) {
  const total = e.num_running + e.num_waiting;
  setText("requests-caption", total > e.requests.length ? `(first ${e.requests.length} of ${total})` : "");
  fillTable("requests", e.requests.map((r) => [r.request_id, { text: r.state, cls: "state-" + r.state },
    duration(r.age_s), r.priority, r.adapter || "", r.num_prompt_tokens, r.num_computed_tokens,
    r.num_output_tokens, r.num_cached_tokens, r.num_preemptions]));
}

function renderClasses(id, live, finished, name) {
  const keys = new Set([...Object.keys(live.running || {}), ...Object.keys(live.waiting || {}),
                        ...Object.keys(finished || {})]);
  fillTable(id, [...keys].sort((a, b) => a.localeCompare(b, undefined, { numeric: true })).map((k) => {
    const f = (finished || {})[k] || {};
    return [name(k), (live.running || {})[k] || 0, (live.waiting || {})[k] || 0, f.finished ?? 0,
      f.prompt_tokens ?? 0, f.output_tokens ?? 0, ms(f.ttft_mean ?? null)];
  }));
}

function renderPrefixes(e, hidden) {
  setText("prefix-caption", hidden ? "(tenant isolation: text hidden)" : "");
  fillTable("prefixes", e.prefixes.map((p) => [p.hash, p.num_tokens, p.hits, p.referenced ? "yes" : "no",
    p.adapter || "", { text: p.preview === null ? "(private: salted)" : p.preview, cls: "text" }]));
}

// ---- polling and the key ----------------------------------------------------------------------
function showLogin(message) {
  clearTimeout(timer);
  $("main").hidden = true;
  $("models-panel").hidden = true;
  $("login").hidden = false;
  $("logout").hidden = true;
  setText("login-error", message || "");
  setText("status", "API key needed").className = "status bad";
  $("key").focus();
}

async function poll() {
  const gen = generation;
  const key = sessionStorage.getItem(KEY_ITEM);
  const headers = key ? { Authorization: "Bearer " + key } : {};
  try {
    const url = selected ? STATE_URL + "?model=" + encodeURIComponent(selected) : STATE_URL;
    const resp = await fetch(url, { headers, cache: "no-store" });
    if (resp.status === 401) {
      if (key) sessionStorage.removeItem(KEY_ITEM);
      showLogin(key ? "That key was refused." : "");
      return;
    }
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    const state = await resp.json();
    if (gen !== generation) return;  // the model was switched meanwhile: that poll goes on
    $("login").hidden = true;
    $("main").hidden = !state.engine;
    $("logout").hidden = !key;
    render(state);
    setText("status", "live").className = "status ok";
  } catch (err) {
    setText("status", "no answer: " + err.message).className = "status bad";
  }
  if (gen === generation) timer = setTimeout(poll, POLL_MS);
}

$("login").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY_ITEM, $("key").value);
  $("key").value = "";
  poll();
});
$("model-select").addEventListener("change", (ev) => {
  selected = ev.target.value;
  generation += 1;
  history.replaceState(null, "", "?model=" + encodeURIComponent(selected));
  clearTimeout(timer);
  poll();
});
$("logout").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_ITEM);
  showLogin("");
});
poll();
