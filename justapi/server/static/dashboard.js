// JustAPI's live dashboard: reads /dashboard/events (Server-Sent Events, one message every quarter second) and
// draws the schedule, the KV pool, the prefix cache and the latency window on plain canvases. No library, no build.
"use strict";

const COLUMNS = 200;        // engine steps drawn (the pool chart shares the timeline's columns)
const MAX_LANES = 64;       // timeline rows at most
const HIT_WINDOW = 64;      // steps with lookups in the hit ratio's window
const THROUGHPUT_POINTS = 480;  // two minutes of ticks
const REQUEST_ROWS = 40;    // recent requests listed
const SEEN = 4096;          // request ids remembered as seen (the browser test reads them)
const COLORS = { prefill: "#4c78a8", decode: "#54a24b", spec: "#2d6a27", specDrafted: "#b5dcb0",
                 preempted: "#e45756", held: "#4c78a8", cached: "#f58518", free: "#e4e4e4" };

// state kept for drawing, and read by the browser test (window.justapiDashboard)
const state = {
  columns: [],          // {seq, seconds, cells: [{lane, rid, kind, start, tokens, accepted}], marks: [{lane, kind}], kv, hits, misses}
  lanes: new Map(),     // rid -> its row while it runs
  requests: new Map(),  // rid -> what the server said of it (prompt, output, arrival, first_token / finished figures)
  seen: new Set(),      // every request id a step showed
  throughput: [],       // [time, tokens a second]
  lastOutput: null,     // [time, output tokens delivered so far]
  messages: 0,
  errors: [],
  now: 0,
};
window.justapiDashboard = state;

function $(id) { return document.getElementById(id); }
function fmt(x, digits = 0) { return x === null || x === undefined ? "–" : Number(x).toFixed(digits); }
function pcts(p) { return p ? `${fmt(p.p50)} / ${fmt(p.p90)} / ${fmt(p.p99)}` : "–"; }

function freeLane() {
  const used = new Set(state.lanes.values());
  for (let i = 0; i < MAX_LANES; i++) if (!used.has(i)) return i;
  return MAX_LANES - 1;  // more requests than rows: the last row is shared
}

function release(rid) { state.lanes.delete(rid); }

function addStep(step) {
  const col = { seq: step.seq, seconds: step.seconds, cells: [], marks: [], kv: step.kv || null,
                hits: step.hits, misses: step.misses, waiting: step.waiting };
  for (const [rid, kind, start, tokens, accepted] of step.cells || []) {
    let lane = state.lanes.get(rid);
    if (lane === undefined) { lane = freeLane(); state.lanes.set(rid, lane); }
    state.seen.add(rid);
    if (state.seen.size > SEEN) state.seen.delete(state.seen.values().next().value);
    col.cells.push({ lane, rid, kind, start, tokens, accepted });
  }
  for (const [ids, kind] of [[step.preempted, "preempted"], [step.finished, "finished"]]) {
    for (const rid of ids || []) {
      const lane = state.lanes.get(rid);
      if (lane !== undefined) { col.marks.push({ lane, rid, kind }); release(rid); }
    }
  }
  state.columns.push(col);
  if (state.columns.length > COLUMNS) state.columns.shift();
}

function onMessage(msg) {
  state.messages++;
  state.now = msg.now;
  for (const step of msg.steps) addStep(step);
  // requests that ended without a step saying so (aborted while the engine idles): their rows are given back one
  // message later, once the steps that ran before they ended have come in
  for (const rid of state.ended || []) release(rid);
  state.ended = (msg.finished || []).map(f => f.rid);
  for (const [rid, info] of Object.entries(msg.running || {})) {
    state.requests.set(rid, Object.assign(state.requests.get(rid) || {}, info));
  }
  for (const f of msg.finished || []) {
    state.requests.set(f.rid, Object.assign(state.requests.get(f.rid) || {}, f, { done: true }));
    addRequestRow(f);
  }
  trimRequests();
  const w = msg.window;
  $("f-running").textContent = msg.num_running;
  $("f-waiting").textContent = msg.waiting;
  $("f-throughput").textContent = fmt(w.output_throughput, 1);
  $("f-ttft").textContent = pcts(w.ttft_ms);
  $("f-tpot").textContent = pcts(w.tpot_ms);
  $("f-requests").textContent = w.requests;
  showApis(w.by_api || {});
  if (msg.output_tokens !== undefined) {
    if (state.lastOutput) {
      const [t0, n0] = state.lastOutput;
      if (msg.now > t0) state.throughput.push([msg.now, (msg.output_tokens - n0) / (msg.now - t0)]);
      if (state.throughput.length > THROUGHPUT_POINTS) state.throughput.shift();
    }
    state.lastOutput = [msg.now, msg.output_tokens];
  }
  if (msg.cache) showCache(msg.cache, msg.kv_blocks_total);
  if (msg.spec && msg.spec.proposed_at.length) { $("spec-panel").hidden = false; drawSpec(msg.spec); }
  if (msg.pools) showPools(msg.pools, msg.transfers);
  if (msg.states) showStates(msg.states);
  state.kvTotal = msg.kv_blocks_total || state.kvTotal;
  draw();
}

function trimRequests() {
  if (state.requests.size <= 4 * MAX_LANES + REQUEST_ROWS) return;
  const shown = new Set(state.columns.flatMap(c => c.cells.map(x => x.rid)));
  for (const rid of state.requests.keys()) {
    if (state.requests.size <= 4 * MAX_LANES) break;
    if (!shown.has(rid)) state.requests.delete(rid);
  }
}

function addRequestRow(f) {
  const body = $("requests").tBodies[0];
  const tr = document.createElement("tr");
  tr.dataset.rid = f.rid;
  const ms = s => (s === null ? "–" : (s * 1000).toFixed(0));
  for (const v of [f.rid, f.api, f.prompt, f.cached, f.output, ms(f.ttft), ms(f.tpot), ms(f.latency),
                   f.reason || "–"]) {
    const td = document.createElement("td");
    td.textContent = v;
    tr.appendChild(td);
  }
  body.insertBefore(tr, body.firstChild);
  while (body.rows.length > REQUEST_ROWS) body.deleteRow(body.rows.length - 1);
}

// the window's requests and latencies per API family (OpenAI, Responses, Anthropic, Ollama, scoring)
function showApis(byApi) {
  const body = $("apis").tBodies[0];
  body.replaceChildren();
  for (const [api, w] of Object.entries(byApi)) {
    const tr = document.createElement("tr");
    tr.dataset.api = api;
    for (const v of [api, w.requests, pcts(w.ttft_ms), pcts(w.tpot_ms)]) {
      const td = document.createElement("td");
      td.textContent = v;
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
}

// a hybrid model's recurrent states: one slot per running sequence, beside the KV pool
function showStates(states) {
  $("states-panel").hidden = false;
  $("state-figures").textContent = `${states.used} of ${states.slots} slots held by running requests; ` +
    `${(states.bytes / 2 ** 20).toFixed(1)} MiB`;
}

function mib(bytes) { return `${(bytes / 2 ** 20).toFixed(1)} MiB`; }

// --prefix-cache-dir: hits by tier, what the disk tier moved and refused, the time it saved
function showDiskTier(cache) {
  const d = cache.disk;
  $("disk-tier").hidden = !d;
  if (!d) return;
  const rejected = Object.entries(d.rejected).map(([why, n]) => `${n} ${why}`).join(", ") || "none";
  $("disk-figures").textContent =
    `hits: ${cache.hits - cache.disk_hits} in memory, ${cache.disk_hits} on disk; ` +
    `read ${mib(d.read_bytes)} (${d.loaded_blocks} blocks, ${d.read_seconds.toFixed(2)} s), ` +
    `written ${mib(d.written_bytes)} (${d.written_blocks} blocks); prefill saved ${d.saved_seconds.toFixed(1)} s; ` +
    `${mib(d.disk_bytes)} of ${mib(d.max_bytes)} on disk; refused: ${rejected}; write errors ${d.write_errors}`;
}

function showCache(cache, total) {
  const lookups = cache.hits + cache.misses;
  $("cache-figures").textContent = `${cache.blocks} of ${total} blocks held; ` +
    `hit ratio since start ${lookups ? (cache.hits / lookups).toFixed(3) : "–"}`;
  showDiskTier(cache);
  const body = $("shared").tBodies[0];
  body.replaceChildren(...cache.shared.map(s => {
    const tr = document.createElement("tr");
    const text = document.createElement("td");
    text.className = "text";
    text.textContent = s.text === null ? "(text not shown: --dashboard-prompt-text)" : s.text;
    const tokens = document.createElement("td");
    tokens.textContent = s.tokens;
    const reqs = document.createElement("td");
    reqs.textContent = s.requests;
    tr.append(text, tokens, reqs);
    return tr;
  }));
}

function showPools(pools, transfers) {
  $("pools-panel").hidden = false;
  $("pools").tBodies[0].replaceChildren(...pools.map(w => {
    const tr = document.createElement("tr");
    const free = w.num_blocks ? `${w.free_blocks} / ${w.num_blocks}` : "–";
    for (const v of [w.rank, w.role + (w.alive ? "" : " (dead)"), w.running, w.waiting,
                     `${(100 * w.busy_fraction).toFixed(0)}%`, free, w.cached_blocks, w.routed]) {
      const td = document.createElement("td");
      td.textContent = v;
      tr.appendChild(td);
    }
    return tr;
  }));
  if (transfers) {
    $("transfers").textContent = `KV transfers ${transfers.kv_transfers}, ` +
      `${(transfers.kv_bytes / 2 ** 20).toFixed(1)} MiB in ${transfers.kv_seconds.toFixed(2)} s, ` +
      `${transfers.retried} retried, ${transfers.failed} failed`;
  }
}

// --- drawing ---------------------------------------------------------------------------------------------------------
function canvas2d(id, height) {
  const c = $(id);
  const width = Math.max(200, Math.floor(c.clientWidth || c.width));
  if (c.width !== width) c.width = width;
  if (height && c.height !== height) c.height = height;
  const g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  return [c, g];
}

function laneCount() {
  let n = 1;
  for (const col of state.columns) for (const x of col.cells.concat(col.marks)) n = Math.max(n, x.lane + 1);
  return n;
}

const LEFT = 36;  // pixels for axis labels

function columnWidth(c) { return (c.width - LEFT) / COLUMNS; }

function drawTimeline() {
  const lanes = laneCount();
  const rowH = Math.max(4, Math.min(14, Math.floor(320 / lanes)));
  const [c, g] = canvas2d("timeline", lanes * rowH + 16);
  const w = columnWidth(c);
  const offset = COLUMNS - state.columns.length;
  g.fillStyle = "#666";
  g.font = "10px sans-serif";
  g.fillText("rows", 2, 10);
  state.columns.forEach((col, i) => {
    const x = LEFT + (offset + i) * w;
    for (const cell of col.cells) {
      const y = cell.lane * rowH;
      if (cell.kind === "spec") {
        g.fillStyle = COLORS.specDrafted;
        g.fillRect(x, y, Math.max(1, w - 1), rowH - 1);
        const share = cell.accepted / Math.max(1, cell.tokens - 1);
        g.fillStyle = COLORS.spec;
        if (share > 0) g.fillRect(x, y + (rowH - 1) * (1 - share), Math.max(1, w - 1), (rowH - 1) * share);
      } else {
        g.fillStyle = COLORS[cell.kind] || "#000";
        g.fillRect(x, y, Math.max(1, w - 1), rowH - 1);
      }
    }
    for (const m of col.marks) {
      const y = m.lane * rowH;
      g.fillStyle = m.kind === "preempted" ? COLORS.preempted : "#222";
      if (m.kind === "preempted") g.fillRect(x, y, Math.max(2, w - 1), rowH - 1);
      else g.fillRect(x + w - 2, y, 2, rowH - 1);
    }
    if (col.seq % 50 === 0) { g.fillStyle = "#888"; g.fillText(String(col.seq), x, lanes * rowH + 12); }
  });
  c.dataset.rowHeight = rowH;
}

function drawPool() {
  const [c, g] = canvas2d("pool");
  const w = columnWidth(c);
  const h = c.height - 4;
  const offset = COLUMNS - state.columns.length;
  state.columns.forEach((col, i) => {
    if (!col.kv) return;
    const [held, cached, free] = col.kv;
    const total = held + cached + free;
    const x = LEFT + (offset + i) * w;
    let y = h;
    for (const [n, color] of [[held, COLORS.held], [cached, COLORS.cached], [free, COLORS.free]]) {
      const bar = (h * n) / total;
      g.fillStyle = color;
      g.fillRect(x, y - bar, Math.max(1, w), bar);
      y -= bar;
    }
    if (col.marks.some(m => m.kind === "preempted")) {
      g.fillStyle = COLORS.preempted;
      g.fillRect(x, 0, Math.max(2, w), 6);
    }
  });
  g.fillStyle = "#666";
  g.font = "10px sans-serif";
  g.fillText("KV", 2, 10);
}

function drawLine(id, points, yMax, color, label) {
  const [c, g] = canvas2d(id);
  const h = c.height - 14;
  g.strokeStyle = "#ddd";
  g.beginPath(); g.moveTo(LEFT, h); g.lineTo(c.width, h); g.stroke();
  g.fillStyle = "#666";
  g.font = "10px sans-serif";
  g.fillText(label, 2, 10);
  g.fillText(fmt(yMax, yMax < 10 ? 1 : 0), 2, 22);
  if (!points.length) return;
  const x0 = points[0][0], x1 = points[points.length - 1][0];
  g.strokeStyle = color;
  g.lineWidth = 1.5;
  g.beginPath();
  points.forEach(([x, y], i) => {
    const px = LEFT + (x1 > x0 ? ((x - x0) / (x1 - x0)) * (c.width - LEFT - 2) : 0);
    const py = h - (h - 4) * Math.min(1, y / yMax);
    if (i === 0) g.moveTo(px, py); else g.lineTo(px, py);
  });
  g.stroke();
}

function hitRatioPoints() {
  const points = [];
  const withLookups = state.columns.filter(c => c.hits !== undefined);
  for (let i = 1; i < withLookups.length; i++) {
    const a = withLookups[Math.max(0, i - HIT_WINDOW)], b = withLookups[i];
    const lookups = b.hits + b.misses - a.hits - a.misses;
    if (lookups > 0) points.push([b.seq, (b.hits - a.hits) / lookups]);
  }
  return points;
}

function drawSpec(spec) {
  const [c, g] = canvas2d("spec");
  const n = spec.proposed_at.length;
  const bw = Math.min(60, (c.width - LEFT) / n);
  g.font = "10px sans-serif";
  spec.proposed_at.forEach((p, k) => {
    const rate = p ? spec.accepted_at[k] / p : 0;
    const bh = (c.height - 24) * rate;
    g.fillStyle = COLORS.spec;
    g.fillRect(LEFT + k * bw + 4, c.height - 14 - bh, bw - 8, bh);
    g.fillStyle = "#444";
    g.fillText(`${k + 1}: ${(100 * rate).toFixed(0)}%`, LEFT + k * bw + 4, c.height - 2);
  });
}

function draw() {
  drawTimeline();
  drawPool();
  drawLine("hits", hitRatioPoints(), 1, COLORS.cached, "hits");
  const peak = Math.max(1, ...state.throughput.map(p => p[1]));
  drawLine("throughput", state.throughput, peak, COLORS.decode, "tok/s");
}

// --- hover -----------------------------------------------------------------------------------------------------------
function cellAt(event) {
  const c = $("timeline");
  const rect = c.getBoundingClientRect();
  const x = ((event.clientX - rect.left) * c.width) / rect.width;
  const y = ((event.clientY - rect.top) * c.height) / rect.height;
  const i = Math.floor((x - LEFT) / columnWidth(c)) - (COLUMNS - state.columns.length);
  const col = state.columns[i];
  if (!col) return null;
  const lane = Math.floor(y / Number(c.dataset.rowHeight || 14));
  const cell = col.cells.find(x => x.lane === lane) || col.marks.find(x => x.lane === lane);
  return cell ? [col, cell] : null;
}

function describe(col, cell) {
  const r = state.requests.get(cell.rid) || {};
  const lines = [`${cell.rid}`, `step ${col.seq} (${(col.seconds * 1000).toFixed(1)} ms)`];
  if (cell.tokens !== undefined) {
    const what = cell.kind === "spec" ? `decode + ${cell.tokens - 1} drafts, ${cell.accepted} accepted` : cell.kind;
    lines.push(`${what}: positions ${cell.start}..${cell.start + cell.tokens - 1} (${cell.tokens} tokens)`);
  } else {
    lines.push(cell.kind);
  }
  if (r.prompt !== undefined) lines.push(`prompt ${r.prompt} tokens${r.cached ? ` (${r.cached} cached)` : ""}, output ${r.output}`);
  if (r.done) {
    const ttft = r.ttft === null ? "no token" : `TTFT ${fmt(r.ttft * 1000)} ms`;
    lines.push(`${ttft}, latency ${fmt(r.latency * 1000)} ms, ${r.reason}`);
  } else if (r.arrival !== undefined) {
    const ttft = r.first_token ? `TTFT ${fmt((r.first_token - r.arrival) * 1000)} ms` : "no token yet";
    lines.push(`${ttft}, running for ${fmt((state.now - r.arrival) * 1000)} ms`);
  }
  return lines.join("\n");
}

$("timeline").addEventListener("mousemove", event => {
  const tip = $("tip");
  const hit = cellAt(event);
  if (!hit) { tip.hidden = true; return; }
  tip.textContent = describe(...hit);
  tip.style.left = `${event.clientX + 12}px`;
  tip.style.top = `${event.clientY + 12}px`;
  tip.hidden = false;
});
$("timeline").addEventListener("mouseleave", () => { $("tip").hidden = true; });

// --- the stream ------------------------------------------------------------------------------------------------------
function connect() {
  // the page's own query (a several-model server's ?model=NAME) goes with it: the events are that model's
  const source = new EventSource("/dashboard/events" + location.search);
  source.onopen = () => { $("status").textContent = "live"; $("status").className = "status on"; };
  source.onerror = () => {
    $("status").textContent = "reconnecting";
    $("status").className = "status off";
    // EventSource retries a dropped connection itself, but not an HTTP error (503 while loading, 429, 401)
    if (source.readyState === EventSource.CLOSED) setTimeout(connect, 2000);
  };
  source.onmessage = event => {
    try {
      onMessage(JSON.parse(event.data));
    } catch (e) {
      state.errors.push(String(e));
      console.error(e);
    }
  };
}
connect();
