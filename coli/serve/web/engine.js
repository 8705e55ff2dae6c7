// The engine page: polls /api/stats (the run's stage stats, as `coli stats --json` shows them) twice a
// second and draws each figure over the last minute. Rates (read rate, tokens/s, fallbacks/s) are the
// counters' differences over the stage's own timestamps, as `coli stats` computes them.
"use strict";

const SAMPLES = 120;  // one minute at two samples a second
const FIGURES = [
  // key, title, unit, value(now, prev) or null when the run does not report it
  ["nvme_mb_s", "NVMe read rate", "MB/s", (n, p) => rate(n, p, "reader", "bytes") / 1e6],
  ["ram_hit", "RAM tier hit rate", "%", (n) => pct(n, "ramtier", "hit_rate")],
  ["vram_hit", "VRAM hit rate", "%", (n) => pct(n, "executor", "vram_hit_rate")],
  ["copy_busy", "PCIe copy lanes busy", "%", (n) => pct(n, "executor", "copy_busy")],
  ["sm_busy", "SMs busy", "%", (n) => pct(n, "executor", "sm_busy")],
  ["spec_busy", "speculative lane busy", "%", (n) => pct(n, "executor", "spec_busy")],
  ["fallbacks_s", "CPU fallbacks", "experts/s", (n, p) => rate(n, p, "executor", "cpu_fallbacks")],
  ["tokens_s", "tokens/s", "tok/s", (n, p) => rate(n, p, "executor", "tokens")],
  // every request at the run, from every client (an older run counted the running one as queued)
  ["batch", "requests at the run (running + queued)", "requests",
   (n, p, snap) => (snap.running || 0) + (snap.queued || 0)],
  // the executor's batch, as `coli stats` shows it: tokens fed per model step and the prompt (prefill) share
  ["step_tokens", "tokens per step", "tokens", (n, p) => perStep(n, p, ["prefill_tokens_fed", "decode_tokens_fed"])],
  ["prefill_share", "prefill share of tokens fed", "%", (n, p) => prefillShare(n, p)],
];
const history = Object.fromEntries(FIGURES.map((f) => [f[0], []]));
let prev = null;

function field(snap, stage, key) {
  const s = snap.stats && snap.stats[stage];
  return s && typeof s[key] === "number" ? s[key] : null;
}
function pct(snap, stage, key) {
  const v = field(snap, stage, key);
  return v === null ? null : 100 * v;
}
function rate(snap, prevSnap, stage, key) {
  const now = snap.stats && snap.stats[stage];
  const before = prevSnap && prevSnap.stats && prevSnap.stats[stage];
  if (!now || typeof now[key] !== "number") return null;
  if (!before || typeof before[key] !== "number" || !(now.t > before.t)) return 0;
  return Math.max(0, (now[key] - before[key]) / (now.t - before.t));
}

function delta(snap, prevSnap, key) {
  const now = field(snap, "executor", key);
  if (now === null) return null;
  const before = prevSnap ? field(prevSnap, "executor", key) : null;
  return before === null || before > now ? now : now - before;
}
function perStep(snap, prevSnap, keys) {
  const steps = delta(snap, prevSnap, "steps");
  if (steps === null) return null;
  const fed = keys.reduce((a, k) => a + (delta(snap, prevSnap, k) || 0), 0);
  return steps > 0 ? fed / steps : 0;
}
function prefillShare(snap, prevSnap) {
  const pre = delta(snap, prevSnap, "prefill_tokens_fed"), dec = delta(snap, prevSnap, "decode_tokens_fed");
  if (pre === null || dec === null) return null;
  return pre + dec > 0 ? 100 * pre / (pre + dec) : 0;
}

function card(key, title, unit) {
  let c = document.getElementById("card-" + key);
  if (c) return c;
  c = document.createElement("div");
  c.className = "card";
  c.id = "card-" + key;
  c.innerHTML = '<div class="name"></div><div class="value"><span class="num">–</span> <small></small></div>' +
    '<canvas width="320" height="48"></canvas>';
  c.querySelector(".name").textContent = title;
  c.querySelector("small").textContent = unit;
  document.getElementById("cards").appendChild(c);
  return c;
}

function draw(canvas, values) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  const max = Math.max(1e-9, ...values);
  ctx.strokeStyle = "#2a6df4"; ctx.lineWidth = 1.5; ctx.beginPath();
  values.forEach((v, i) => {
    const x = w - (values.length - 1 - i) * (w / (SAMPLES - 1));
    const y = h - 2 - (v / max) * (h - 4);
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
}

async function poll() {
  try {
    const r = await fetch("/api/stats", { headers: authHeaders() });
    const snap = await r.json();
    if (!r.ok) throw new Error(snap.error ? snap.error.message : r.statusText);
    for (const [key, title, unit, fn] of FIGURES) {
      const v = fn(snap, prev, snap);
      if (v === null || v === undefined) continue;  // not reported by this run (e.g. VRAM on the CPU path)
      const c = card(key, title, unit);
      const hist = history[key];
      hist.push(v);
      if (hist.length > SAMPLES) hist.shift();
      const num = c.querySelector(".num");
      num.textContent = v >= 100 ? v.toFixed(0) : v.toFixed(v >= 10 ? 1 : 2);
      c.dataset.value = String(v);
      c.dataset.samples = String(hist.length);
      c.dataset.max = String(Math.max(...hist));
      draw(c.querySelector("canvas"), hist);
    }
    document.getElementById("status").textContent =
      "run " + snap.run + " · " + new Date(snap.t * 1000).toLocaleTimeString() + " · updated twice a second";
    prev = snap;
  } catch (e) {
    document.getElementById("status").textContent = "no stats: " + e.message;
  }
  setTimeout(poll, 500);
}
poll();
