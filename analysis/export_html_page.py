"""The HTML report's own style and script (analysis/export_html.py builds the page around them): inline CSS and
vanilla JavaScript, nothing fetched, so the file opens offline from disk.

The script reads the run from the page's `<script type="application/json" id="peakledger-data">` and draws the
timeline as inline SVG: the bytes live after each event of the peak rank's device memory, stacked by category,
with the phase bands, the caching allocator's reserved memory and the device total (CUDA profiles), the budget and
the peak. Each pixel column draws the event of its range with the most bytes live (the earliest on ties), so the
peak is drawn exactly at every zoom. Wheel: zoom about the pointer; drag: zoom to the selection; double-click or
"whole run": back to the whole run. The pointer's moment lists the tensors live then, the largest first: each
tensor is an interval of event indices [allocated, freed), scanned when the pointer moves, so the page carries one
entry per tensor and never a list per moment.

Sizes are written as analysis/units.py `format_bytes` writes them (`formatBytes`: 4 significant digits, Python's
`g` format on the same double, rounded half to even on its exact value), so the page and the text report agree.
`window.peakledger` exposes formatBytes, liveAt(i), the peak's index and zoom(a, b) for tests.
"""

STYLE = """
:root { --ink: #1d2330; --muted: #5b6473; --line: #d8dde6; --bg: #f6f7f9; --ok: #0a7d55; --over: #b3261e; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
  color: var(--ink); background: var(--bg); }
main { max-width: 1360px; margin: 0 auto; padding: 18px 20px 40px; }
h1 { font-size: 22px; margin: 0 0 2px; }
h2 { font-size: 17px; margin: 0 0 8px; }
.sub { color: var(--muted); margin: 0 0 12px; }
section { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 14px 16px; margin: 14px 0; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin: 10px 0; }
.card { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 10px 14px; min-width: 210px; }
.card .k { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.card .v { font-size: 24px; font-weight: 650; }
.card .w { color: var(--muted); font-size: 12.5px; max-width: 420px; }
.card.fits { border-left: 5px solid var(--ok); } .card.over { border-left: 5px solid var(--over); }
.card.over .v { color: var(--over); } .card.fits .v { color: var(--ok); }
pre { margin: 6px 0; font: 12.5px/1.4 ui-monospace, "DejaVu Sans Mono", Menlo, monospace; white-space: pre-wrap; }
details summary { cursor: pointer; color: var(--muted); }
ul.notes { margin: 6px 0; padding-left: 20px; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { padding: 4px 8px; border-bottom: 1px solid #eceff3; text-align: left; vertical-align: top; }
th { background: #f1f3f6; font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.total td { font-weight: 650; border-top: 2px solid var(--line); }
td.yes { color: var(--ok); font-weight: 600; } td.no { color: var(--over); }
td.over { color: var(--over); font-weight: 600; }
.swatch { display: inline-block; width: 11px; height: 11px; border-radius: 2px; margin-right: 5px;
  vertical-align: -1px; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 14px; font-size: 12.5px; margin: 4px 0 6px; }
.legend .line { display: inline-block; width: 18px; height: 0; border-top: 2px solid #000; margin-right: 5px;
  vertical-align: 3px; }
.toolbar { display: flex; gap: 12px; align-items: center; font-size: 12.5px; color: var(--muted); margin-bottom: 4px; }
.toolbar button { font: inherit; padding: 2px 10px; border: 1px solid var(--line); border-radius: 5px;
  background: #fff; cursor: pointer; color: var(--ink); }
#chart { width: 100%; height: 440px; display: block; user-select: none; cursor: crosshair; }
#chart text { font: 11px system-ui, "DejaVu Sans", sans-serif; fill: #333; }
#chart .band-label { fill: #555; font-size: 10.5px; }
#chart .peak-label { font-weight: 700; font-size: 12px; fill: #000; stroke: #fff; stroke-width: 3px;
  paint-order: stroke; }
#tooltip { position: fixed; display: none; z-index: 10; background: rgba(255,255,255,.97); border: 1px solid #aab;
  border-radius: 6px; box-shadow: 0 4px 14px rgba(0,0,0,.15); padding: 8px 10px; font-size: 12px;
  max-width: 620px; pointer-events: none; }
#tooltip .head { font-weight: 600; } #tooltip .muted { color: var(--muted); }
#tooltip table { font-size: 11.5px; margin-top: 4px; width: auto; }
#tooltip td { padding: 1px 6px; border: 0; white-space: nowrap; }
#tooltip td.name { white-space: normal; word-break: break-all; max-width: 360px; }
footer { color: var(--muted); font-size: 12px; }
"""

SCRIPT = r"""
(function () {
"use strict";
const D = JSON.parse(document.getElementById("peakledger-data").textContent);
const SVGNS = "http://www.w3.org/2000/svg";

// --- sizes as analysis/units.py format_bytes writes them -------------------------------------------------
function exactDecimal(v) {  // |v| exactly, as [digits, scale]: digits / 10^scale
  const view = new DataView(new ArrayBuffer(8));
  view.setFloat64(0, Math.abs(v));
  const hi = view.getUint32(0), lo = view.getUint32(4);
  let exp = (hi >>> 20) & 0x7ff;
  let mant = (BigInt(hi & 0xfffff) << 32n) | BigInt(lo);
  if (exp === 0) exp = 1; else mant |= 1n << 52n;
  const e = exp - 1075;
  return e >= 0 ? [mant << BigInt(e), 0] : [mant * 5n ** BigInt(-e), -e];
}
function shiftRound(digits, drop) {  // digits / 10^drop rounded half to even (drop may be negative)
  if (drop <= 0) return digits * 10n ** BigInt(-drop);
  const div = 10n ** BigInt(drop);
  let q = digits / div;
  const twice = 2n * (digits % div);
  if (twice > div || (twice === div && q % 2n === 1n)) q += 1n;
  return q;
}
function fixedText(v, f) {  // Python's f"{abs(v):.{f}f}"
  const [digits, scale] = exactDecimal(v);
  let q = shiftRound(digits, scale - f).toString();
  if (f > 0) { q = q.padStart(f + 1, "0"); q = q.slice(0, -f) + "." + q.slice(-f); }
  return q;
}
function sciParts(v, p) {  // abs(v) rounded to p + 1 significant digits: [mantissa digits, exponent]
  const [digits, scale] = exactDecimal(v);
  let x = digits.toString().length - 1 - scale;
  let m = shiftRound(digits, digits.toString().length - 1 - p);
  if (m.toString().length > p + 1) { m = m / 10n; x += 1; }
  return [m.toString(), x];
}
function significant(v, d) {  // analysis/units.py _significant: f"{v:.{d}g}", or f"{v:.{d-1}e}" past its range
  if (v === 0) return "0";
  const sign = v < 0 ? "-" : "";
  const [m, x] = sciParts(v, d - 1);
  if (x < -4 || x >= d) {
    const p = Math.max(d - 1, 0), [mm, xx] = sciParts(v, p);
    return sign + mm[0] + (p > 0 ? "." + mm.slice(1) : "") + "e" + (xx < 0 ? "-" : "+") +
      String(Math.abs(xx)).padStart(2, "0");
  }
  let t = fixedText(v, d - 1 - x);
  if (t.includes(".")) t = t.replace(/0+$/, "").replace(/\.$/, "");
  return sign + t;
}
function grouped(n) { return String(n).replace(/\B(?=(\d{3})+(?!\d))/g, ","); }
function formatBytes(n, unit) {
  unit = unit || D.unit;
  if (unit === "B") return grouped(n) + " B";
  const smaller = D.units.smaller[unit];
  if (smaller && n && Math.abs(n) < Math.floor(D.units.scale[unit] / 100)) return formatBytes(n, smaller);
  return significant(n / D.units.scale[unit], 4) + " " + unit;
}
function formatSeconds(s) {
  const [k, u] = s >= 1 ? [1, "s"] : s >= 1e-3 ? [1e3, "ms"] : [1e6, "\u00b5s"];
  return significant(s * k, 4) + " " + u;
}

// --- the run: every tensor an interval of event indices, every category's bytes after each event -----------
const n = D.n, B = D.blocks, nb = B.size.length;
const start = new Int32Array(nb), end = new Int32Array(nb);
for (let j = 0, s = 0; j < nb; j++) { s += B.start[j]; start[j] = s; end[j] = s + B.len[j]; }
const series = D.cats.map(() => new Float64Array(n));
(function () {
  const diff = D.cats.map(() => new Float64Array(n + 1));
  for (let j = 0; j < nb; j++) { diff[B.cat[j]][start[j]] += B.size[j]; diff[B.cat[j]][end[j]] -= B.size[j]; }
  diff.forEach((d, c) => { let run = 0; for (let i = 0; i < n; i++) { run += d[i]; series[c][i] = run; } });
})();
const total = new Float64Array(n);
series.forEach(s => { for (let i = 0; i < n; i++) total[i] += s[i]; });
const times = new Float64Array(n);
for (let i = 0, t = 0; i < n; i++) { t += D.t_ns[i]; times[i] = t * 1e-9; }
let reserved = null;
if (D.reserved) {
  reserved = new Float64Array(n);
  let k = 0, v = 0;
  for (let i = 0; i < n; i++) {
    while (k < D.reserved.length && D.reserved[k][0] <= i) { v = D.reserved[k][1]; k++; }
    reserved[i] = v;
  }
}
function bandAt(i) {
  let lo = 0, hi = D.bands.length - 1;
  while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (D.bands[mid][0] <= i) lo = mid; else hi = mid - 1; }
  return D.bands[lo];
}
function liveAt(i) {  // the tensors live right after event i, the largest first (ties: allocated first)
  const out = [];
  for (let j = 0; j < nb && start[j] <= i; j++) if (end[j] > i) out.push(j);
  out.sort((a, b) => B.size[b] - B.size[a]);
  return out.map(j => ({name: D.names[B.name[j]], category: D.cats[B.cat[j]].name, bytes: B.size[j]}));
}

// --- drawing ------------------------------------------------------------------------------------------------
const svg = document.getElementById("chart"), tip = document.getElementById("tooltip");
const status = document.getElementById("view-status");
const M = {left: 78, right: 18, top: 22, bottom: 46};
let v0 = 0, v1 = n, drawn = null, dragFrom = null;

function el(name, attrs, parent, text) {
  const e = document.createElementNS(SVGNS, name);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  (parent || svg).appendChild(e);
  return e;
}
function niceStep(span, count) {
  const raw = span / Math.max(count, 1), p = Math.pow(10, Math.floor(Math.log10(raw)));
  const f = raw / p;
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * p;
}
function axisUnit(top) {  // analysis/plot/style.py axis_unit: a smaller unit of the family under one unit
  let u = D.unit;
  while (top < D.units.scale[u] && D.units.smaller[u] && D.units.smaller[u] !== "B") u = D.units.smaller[u];
  return u;
}

function render() {
  const W = svg.clientWidth, H = svg.clientHeight;
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const pw = W - M.left - M.right, ph = H - M.top - M.bottom, len = v1 - v0;
  const nbk = Math.max(1, Math.min(Math.floor(pw), len));
  const idx = new Int32Array(nbk), rmax = new Float64Array(nbk), x0 = new Float64Array(nbk + 1);
  let top = 0;
  for (let b = 0; b < nbk; b++) {
    const a = v0 + Math.floor(b * len / nbk), z = v0 + Math.floor((b + 1) * len / nbk);
    let best = a, r = 0;
    for (let i = a; i < z; i++) {
      if (total[i] > total[best]) best = i;
      if (reserved && reserved[i] > r) r = reserved[i];
    }
    idx[b] = best; rmax[b] = r;
    top = Math.max(top, total[best], reserved ? r + D.outside : 0);
  }
  for (let b = 0; b <= nbk; b++) x0[b] = M.left + pw * Math.floor(b * len / nbk) / len;
  const budgetShown = D.budget !== null && D.budget <= 1.5 * Math.max(top, 1);
  if (budgetShown) top = Math.max(top, D.budget);
  const u = axisUnit(Math.max(top, 1)), scale = D.units.scale[u];  // ticks at round numbers of the unit
  const step = niceStep(Math.max(top, 1) / scale, 6) * scale, ymax = Math.ceil(top * 1.04 / step) * step || 1;
  const note = document.getElementById("budget-note");
  if (note) note.textContent = D.budget === null || budgetShown ? "" : " (above the chart)";
  const y = v => M.top + ph * (1 - v / ymax);
  const xOf = i => M.left + pw * (i - v0) / len;
  el("rect", {x: M.left, y: M.top, width: pw, height: ph, fill: "#fff"});
  for (const [a, z, phase, label, short] of D.bands) {  // phase bands
    if (z <= v0 || a >= v1) continue;
    const xa = xOf(Math.max(a, v0)), xz = xOf(Math.min(z, v1));
    el("rect", {x: xa, y: M.top, width: Math.max(xz - xa, 0.5), height: ph, fill: D.phase_colours[phase]});
    const text = (xz - xa) > label.length * 6.2 + 6 ? label : (xz - xa) > short.length * 6.2 + 4 ? short : "";
    if (text) el("text", {x: (xa + xz) / 2, y: M.top + 12, "text-anchor": "middle", class: "band-label"}, null, text);
  }
  for (let k = 0; k * step <= ymax + step / 2; k++) {  // y grid and ticks
    const v = k * step;
    el("line", {x1: M.left, x2: M.left + pw, y1: y(v), y2: y(v), stroke: "#000", "stroke-opacity": 0.08,
      class: "grid", "data-bytes": v});
    el("text", {x: M.left - 6, y: y(v) + 4, "text-anchor": "end"}, null, formatBytes(Math.round(v), u));
  }
  let base = new Float64Array(nbk);  // stacked categories, each pixel column the chosen event
  D.cats.forEach((cat, c) => {
    const s = series[c];
    let up = "", down = "";
    for (let b = 0; b < nbk; b++) {
      const t = base[b] + s[idx[b]];
      up += (b ? "L" : "M") + x0[b].toFixed(2) + " " + y(t).toFixed(2) + "L" + x0[b + 1].toFixed(2) + " " +
        y(t).toFixed(2);
    }
    for (let b = nbk - 1; b >= 0; b--) {
      down += "L" + x0[b + 1].toFixed(2) + " " + y(base[b]).toFixed(2) + "L" + x0[b].toFixed(2) + " " +
        y(base[b]).toFixed(2);
      base[b] += s[idx[b]];
    }
    el("path", {d: up + down + "Z", fill: cat.colour, "data-category": cat.name});
  });
  if (reserved) {  // the allocator's reserved bytes and the device total, each column's highest
    for (const [shift, attrs] of [[0, {stroke: "#000", "stroke-width": 1.4}],
        [D.outside, {stroke: "#000", "stroke-width": 1.2, "stroke-dasharray": "2 3"}]]) {
      let d = "";
      for (let b = 0; b < nbk; b++) d += (b ? "L" : "M") + x0[b].toFixed(2) + " " + y(rmax[b] + shift).toFixed(2) +
        "L" + x0[b + 1].toFixed(2) + " " + y(rmax[b] + shift).toFixed(2);
      el("path", Object.assign({d: d, fill: "none"}, attrs));
    }
  }
  if (budgetShown) {
    el("line", {x1: M.left, x2: M.left + pw, y1: y(D.budget), y2: y(D.budget), stroke: D.budget_colour,
      "stroke-width": 1.6, "stroke-dasharray": "7 4", id: "budget-line"});
  }
  el("rect", {x: M.left, y: M.top, width: pw, height: ph, fill: "none", stroke: "#888"});
  const xs = Math.max(1, niceStep(len, Math.max(2, Math.floor(pw / 110))));  // x ticks: event indices
  for (let i = Math.ceil(v0 / xs) * xs; i <= v1; i += xs) {
    el("line", {x1: xOf(i), x2: xOf(i), y1: M.top + ph, y2: M.top + ph + 4, stroke: "#666"});
    el("text", {x: xOf(i), y: M.top + ph + 16, "text-anchor": "middle"}, null, grouped(i));
  }
  el("text", {x: M.left + pw / 2, y: H - 8, "text-anchor": "middle"}, null,
    "event (an allocation or a free of rank " + D.rank + "'s device memory), in the run's order");
  const markAt = i => { const b = columnOf(i); return (x0[b] + x0[b + 1]) / 2; };
  if (D.oom !== null && D.oom >= v0 && D.oom < v1) {
    el("text", {x: markAt(D.oom), y: y(total[D.oom]) + 5, "text-anchor": "middle", fill: D.budget_colour,
      "font-size": 16, "font-weight": 700, id: "oom-marker"}, null, "\u2716");
  }
  if (D.peak.index >= v0 && D.peak.index < v1) {
    const px = markAt(D.peak.index), py = y(D.peak.bytes);
    el("circle", {cx: px, cy: py, r: 5, fill: "#000", stroke: "#fff", "stroke-width": 1.5, id: "peak-marker"});
    const right = px < M.left + pw - 190;
    el("text", {x: right ? px + 9 : px - 9, y: Math.max(py - 8, M.top + 26), "text-anchor": right ? "start" : "end",
      class: "peak-label"}, null, "peak " + formatBytes(D.peak.bytes));
  }
  drawn = {idx: idx, x0: x0, nbk: nbk, pw: pw, ph: ph, peakX: D.peak.index >= v0 && D.peak.index < v1 ?
    markAt(D.peak.index) : null};
  status.textContent = (len === n ? "all " + grouped(n) + " events" : "events " + grouped(v0) + " to " +
    grouped(v1 - 1) + " of " + grouped(n)) + " of rank " + D.rank + "'s device memory";
}

// --- the pointer --------------------------------------------------------------------------------------------
function columnOf(i) {  // the pixel column whose events [v0 + floor(b len / nbk), ...) hold event i
  const len = v1 - v0, nbk = Math.max(1, Math.min(Math.floor(svg.clientWidth - M.left - M.right), len));
  return Math.max(0, Math.min(nbk - 1, Math.ceil((i - v0 + 1) * nbk / len) - 1));
}
function columnAt(px) {  // the last column starting at or before px
  let lo = 0, hi = drawn.nbk - 1;
  while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (drawn.x0[mid] <= px) lo = mid; else hi = mid - 1; }
  return lo;
}
function eventAt(px) {
  return v0 + Math.floor((v1 - v0) * Math.max(0, Math.min(px - M.left, drawn.pw - 1e-9)) / drawn.pw);
}
function localX(ev) { return ev.clientX - svg.getBoundingClientRect().left; }
function row(table, cells) {
  const tr = document.createElement("tr");
  cells.forEach(([text, cls, colour]) => {
    const td = document.createElement("td");
    if (cls) td.className = cls;
    if (colour) { const sw = document.createElement("span"); sw.className = "swatch"; sw.style.background = colour;
      td.appendChild(sw); }
    td.appendChild(document.createTextNode(text));
    tr.appendChild(td);
  });
  table.appendChild(tr);
}
function line(text, cls) { const d = document.createElement("div"); if (cls) d.className = cls; d.textContent = text;
  tip.appendChild(d); }
function showMoment(i, ev) {
  const band = bandAt(i), live = liveAt(i), colours = {};
  D.cats.forEach(c => { colours[c.name] = c.colour; });
  tip.textContent = "";
  tip.dataset.event = String(i);
  line("event " + grouped(i) + " of " + grouped(n) + " \u00b7 t = " + formatSeconds(times[i]) + " \u00b7 " +
    band[3], "head");
  line("after " + D.names[D.ops[i]], "muted");
  line("allocated " + formatBytes(total[i]) + (reserved ? " \u00b7 reserved " + formatBytes(reserved[i]) +
    " \u00b7 device total " + formatBytes(reserved[i] + D.outside) : "") +
    (i === D.peak.index ? " \u00b7 the peak" : ""));
  const table = document.createElement("table");
  table.id = "tooltip-live";
  live.slice(0, D.top).forEach(t => row(table, [[formatBytes(t.bytes), "num"], [t.category, "", colours[t.category]],
    [t.name, "name"]]));
  tip.appendChild(table);
  if (live.length > D.top) {
    const rest = live.slice(D.top).reduce((s, t) => s + t.bytes, 0);
    line("+ " + grouped(live.length - D.top) + " more tensors, " + formatBytes(rest), "muted");
  }
  tip.style.display = "block";
  const r = tip.getBoundingClientRect(), pad = 14;
  let x = ev.clientX + 18, yy = ev.clientY + 14;
  if (x + r.width > window.innerWidth - pad) x = Math.max(pad, ev.clientX - 18 - r.width);
  if (yy + r.height > window.innerHeight - pad) yy = Math.max(pad, window.innerHeight - pad - r.height);
  tip.style.left = x + "px"; tip.style.top = yy + "px";
}
let cursor = null, selection = null;
svg.addEventListener("mousemove", ev => {
  const px = localX(ev);
  if (dragFrom !== null) {
    if (!selection) selection = el("rect", {y: M.top, height: drawn.ph, fill: "#3366cc", "fill-opacity": 0.15,
      stroke: "#3366cc"});
    selection.setAttribute("x", Math.min(px, dragFrom)); selection.setAttribute("width", Math.abs(px - dragFrom));
    tip.style.display = "none";
    return;
  }
  if (px < M.left || px > M.left + drawn.pw) { tip.style.display = "none"; if (cursor) cursor.remove(); cursor = null;
    return; }
  const near = drawn.peakX !== null && Math.abs(px - drawn.peakX) <= 4;  // the peak's dot holds the pointer
  const b = near ? columnOf(D.peak.index) : columnAt(px), i = near ? D.peak.index : drawn.idx[b];
  const cx = (drawn.x0[b] + drawn.x0[b + 1]) / 2;
  if (!cursor) cursor = el("line", {y1: M.top, stroke: "#000", "stroke-opacity": 0.55, "pointer-events": "none",
    id: "cursor"});
  cursor.setAttribute("x1", cx); cursor.setAttribute("x2", cx); cursor.setAttribute("y2", M.top + drawn.ph);
  showMoment(i, ev);
});
svg.addEventListener("mouseleave", () => { tip.style.display = "none"; });
svg.addEventListener("mousedown", ev => { if (ev.button === 0) { dragFrom = localX(ev); ev.preventDefault(); } });
window.addEventListener("mouseup", ev => {
  if (dragFrom === null) return;
  const a = Math.min(dragFrom, localX(ev)), z = Math.max(dragFrom, localX(ev));
  if (selection) selection.remove();  // (a click draws nothing: a double-click's two clicks keep their targets)
  dragFrom = null; selection = null;
  if (z - a > 4) zoom(eventAt(a), eventAt(z) + 1);
});
svg.addEventListener("wheel", ev => {
  ev.preventDefault();
  const c = eventAt(localX(ev)), len = v1 - v0;
  const next = Math.max(Math.min(10, n), Math.min(n, Math.round(len * (ev.deltaY > 0 ? 1.25 : 0.8))));
  const a = Math.round(c - (c - v0) * next / len);
  zoom(a, a + next);
}, {passive: false});
svg.addEventListener("dblclick", () => zoom(0, n));
document.getElementById("reset-zoom").addEventListener("click", () => zoom(0, n));
window.addEventListener("resize", render);
function zoom(a, z) {
  const len = Math.max(1, Math.min(n, z - a));
  v0 = Math.max(0, Math.min(n - len, a)); v1 = v0 + len;
  cursor = null; render();
}
window.peakledger = {formatBytes: formatBytes, liveAt: liveAt, peakIndex: D.peak.index, zoom: zoom,
  view: () => [v0, v1]};
render();
})();
"""
