// The memory page's template: HTML, CSS and the script that draws the interactive chart from
// the embedded data (Note [Memory page data]); render_memory_page fills @TITLE@, @SVG@, @DATA@.
// Everything is inline: the page makes no request (no fonts, scripts or styles from outside).
#include "cli/memory_page.h"

namespace porter::cli {
namespace {

constexpr std::string_view kTemplate = R"page(<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>@TITLE@</title>
<style>
:root { --params: #4e79a7; --grads: #f28e2b; --optimizer: #e15759; --activations: #76b7b2;
  --checkpoints: #59a14f; --staging: #edc948; --workspace: #b07aa1; --comm: #ff9da7;
  --pinned: #9c755f; --baseline: #c7ccd6; --capacity: #d62728; --ink: #1f2328; }
body { font: 14px/1.4 system-ui, sans-serif; color: var(--ink); margin: 16px 24px;
  background: #fff; }
h1 { font-size: 18px; margin: 0 0 4px; } h2 { font-size: 15px; margin: 18px 0 6px; }
#summary { margin: 0 0 8px; color: #444; }
.chart { width: 100%; max-width: 1200px; display: block; }
.cat-params { fill: var(--params); } .cat-grads { fill: var(--grads); }
.cat-optimizer { fill: var(--optimizer); } .cat-activations { fill: var(--activations); }
.cat-checkpoints { fill: var(--checkpoints); } .cat-staging { fill: var(--staging); }
.cat-workspace { fill: var(--workspace); } .cat-comm { fill: var(--comm); }
.cat-pinned { fill: var(--pinned); } .cat-baseline { fill: var(--baseline); }
.area { stroke: none; opacity: 0.9; }
.band { opacity: 0.35; }
.phase-forward { fill: #bcd7f5; } .phase-recompute { fill: #f7d774; }
.phase-backward { fill: #d8c2f0; } .phase-optimizer { fill: #a8e6c1; }
.predicted { fill: none; stroke: #111; stroke-width: 2; stroke-dasharray: 6 3; }
.pred-area { fill: #76b7b2; opacity: 0.45; }
.capacity { stroke: var(--capacity); stroke-width: 2; stroke-dasharray: 9 4; }
.failure { stroke: var(--capacity); stroke-width: 2; }
.failed-request { fill: var(--capacity); opacity: 0.75; }
#failure-section { border-left: 4px solid var(--capacity); padding: 2px 12px; margin: 8px 0; }
table.failure { border-collapse: collapse; font-size: 13px; }
table.failure td { padding: 2px 14px 2px 0; text-align: left; vertical-align: top; }
#failure-section pre { white-space: pre-wrap; font-size: 12px; color: #444; }
.grid { stroke: #e3e5e8; stroke-width: 1; }
.tick, .label { font-size: 12px; fill: #555; } .label { fill: var(--capacity); }
.peak-mark { fill: none; stroke: #111; stroke-width: 2; }
.cross { stroke: #333; stroke-width: 1; stroke-dasharray: 2 2; pointer-events: none; }
.where-device { fill: var(--checkpoints); } .where-host { fill: var(--pinned); }
.where-partitioned { fill: #7b61c9; } .where-recomputed { fill: url(#hatch); }
.lane-name { font-size: 12px; fill: #333; }
#tooltip { position: fixed; pointer-events: none; background: #fffffff0;
  border: 1px solid #bbb; border-radius: 4px; padding: 6px 8px; font-size: 12px;
  box-shadow: 0 2px 6px #0002; white-space: nowrap; z-index: 2; }
#tooltip td { padding: 0 6px 0 0; } #tooltip .hot { font-weight: bold; }
#legend { display: flex; flex-wrap: wrap; gap: 4px 14px; margin: 6px 0; font-size: 12px; }
.sw { display: inline-block; width: 12px; height: 12px; vertical-align: -2px;
  margin-right: 4px; border-radius: 2px; }
table.peak { border-collapse: collapse; font-size: 13px; }
table.peak td, table.peak th { padding: 2px 10px 2px 0; text-align: right; }
table.peak td:first-child, table.peak th:first-child { text-align: left; }
.bar { height: 12px; display: inline-block; vertical-align: middle; }
.note { color: #666; font-size: 12px; }
</style>
</head>
<body data-status="static">
<h1>@TITLE@</h1>
<p id="summary">Memory of one step by allocator category, with the plan's prediction and the
device's capacity.</p>
<section id="failure-section" hidden><h2>Out of memory</h2><div id="failure"></div></section>
<div id="legend"></div>
<div id="chart">@SVG@</div>
<noscript><p class="note">Scripts are off: this is the static chart (stacked categories,
the predicted curve as a dashed line, the capacity in red, the phases as bands). With
scripts on, hovering names what is under the cursor.</p></noscript>
<section id="lanes-section" hidden><h2>Checkpoints</h2><div id="lanes"></div></section>
<section id="pinned-section" hidden><h2>Pinned host memory</h2><div id="pinned"></div></section>
<section id="peak-section" hidden><h2 id="peak-title">At the peak</h2><div id="peak"></div>
</section>
<div id="tooltip" hidden></div>
<script type="application/json" id="porter-data">@DATA@</script>
<script>
(function () {
  'use strict';
  var body = document.body;
  window.onerror = function (msg, src, line) {
    body.setAttribute('data-status', 'error: ' + msg + ' (line ' + line + ')');
  };
  var NS = 'http://www.w3.org/2000/svg';
  var data = JSON.parse(document.getElementById('porter-data').textContent);
  // The layout is the data's (Note [Chart scale]), shared with the static chart.
  var C = data.chart;
  var W = C.width, H = C.height, L = C.left, R = C.right, T = C.top, B = C.bottom;
  var dur = Math.max(1e-9, data.duration);
  var m = data.measured, cats = data.categories, pred = data.predicted, fail = data.failure;
  var tip = document.getElementById('tooltip');

  function el(name, attrs, parent, text) {
    var e = document.createElementNS(NS, name);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function h(name, attrs, parent, text) {
    var e = document.createElement(name);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function fmtBytes(b) {
    var u = ['B', 'KiB', 'MiB', 'GiB', 'TiB'], i = 0, v = b;
    while (Math.abs(v) >= 1024 && i < u.length - 1) { v /= 1024; ++i; }
    return (i === 0 ? v.toFixed(0) : v.toFixed(v < 10 ? 2 : 1)) + ' ' + u[i];
  }
  function fmtTime(t) {
    if (data.time_unit === 'op') return 'op ' + Math.floor(t);
    return t.toFixed(t < 10 ? 3 : 1) + ' ms';
  }
  function x(t) { return L + t / dur * (W - L - R); }
  // The last index i with a[i] <= v (0 when none).
  function at(a, v) {
    var lo = 0, hi = a.length - 1;
    if (hi < 0 || v < a[0]) return 0;
    while (lo < hi) { var mid = (lo + hi + 1) >> 1; if (a[mid] <= v) lo = mid; else hi = mid - 1; }
    return lo;
  }
  function stepPath(xs, ys, xEnd) {
    var d = 'M' + xs[0].toFixed(1) + ',' + ys[0].toFixed(1);
    for (var i = 1; i < xs.length; ++i) d += 'H' + xs[i].toFixed(1) + 'V' + ys[i].toFixed(1);
    return xEnd === undefined ? d : d + 'H' + xEnd.toFixed(1);
  }
  function areaPath(xs, top, below, xEnd) {
    var d = stepPath(xs, top, xEnd) + 'V' + below[below.length - 1].toFixed(1);
    for (var i = xs.length - 1; i >= 1; --i) {
      d += 'H' + xs[i].toFixed(1) + 'V' + below[i - 1].toFixed(1);
    }
    return d + 'H' + xs[0].toFixed(1) + 'Z';
  }
  function showTip(evt, rows) {
    tip.innerHTML = '';
    var tb = h('table', {}, tip);
    rows.forEach(function (r) {
      var tr = h('tr', r[2] ? { 'class': 'hot' } : {}, tb);
      h('td', {}, tr, r[0]);
      h('td', {}, tr, r[1]);
    });
    tip.hidden = false;
    var px = evt.clientX + 14, py = evt.clientY + 14;
    if (px + tip.offsetWidth > window.innerWidth) px = evt.clientX - tip.offsetWidth - 14;
    if (py + tip.offsetHeight > window.innerHeight) py = evt.clientY - tip.offsetHeight - 14;
    tip.style.left = px + 'px';
    tip.style.top = py + 'px';
  }
  function hideTip() { tip.hidden = true; }

  // The measured stack: tops[j][i] = sum of categories 0..j after event i.
  var tops = [], drawnPeak = 0, peakIndex = 0;
  if (m) {
    var n = m.times.length;
    cats.forEach(function () { tops.push(new Array(n)); });
    for (var i = 0; i < n; ++i) {
      var s = 0;
      for (var j = 0; j < cats.length; ++j) { s += m.bytes[cats[j]][i]; tops[j][i] = s; }
      if (s > drawnPeak) { drawnPeak = s; peakIndex = i; }
    }
  }
  // The predicted envelope (Note [Predicted envelope]): op k's peak over its span.
  var predS = pred.ops.map(function (o) { return o.start; });
  var predB = pred.ops.map(function (o) { return pred.baseline_bytes + o.peak_bytes; });
  var ymax = C.y_max_bytes;
  function y(b) { return T + (1 - b / ymax) * (H - T - B); }
  function envelopePath() {
    var d = '', lastEnd = null;
    pred.ops.forEach(function (o, i) {
      var yy = y(predB[i]).toFixed(1);
      d += (lastEnd === null || o.start !== lastEnd) ? 'M' + x(o.start).toFixed(1) + ',' + yy
        : 'V' + yy;
      d += 'H' + x(o.end).toFixed(1);
      lastEnd = o.end;
    });
    return d;
  }
  // The op whose span holds t, or -1.
  function opAt(t) {
    var k = at(predS, t);
    return pred.ops.length && t >= predS[0] && t <= pred.ops[k].end ? k : -1;
  }
  function phaseAt(t) {
    for (var i = 0; i < data.phases.length; ++i) {
      var p = data.phases[i];
      if (t >= p.start && t <= p.end) return p;
    }
    return null;
  }

  // Legend.
  var legend = document.getElementById('legend');
  function swatch(label, color, dashed) {
    var s = h('span', {}, legend);
    h('span', { 'class': 'sw', style: dashed ? 'border-top:2px dashed ' + color +
      ';height:0;margin-top:6px' : 'background:' + color }, s);
    s.appendChild(document.createTextNode(label));
  }
  var css = getComputedStyle(document.documentElement);
  function cv(name) { return css.getPropertyValue('--' + name).trim(); }
  var used = cats.filter(function (c) {
    return m && m.bytes[c].some(function (b) { return b > 0; });
  });
  used.forEach(function (c) { swatch(c, cv(c)); });
  if (!m) swatch('model states + batch', cv('baseline'));
  if (!m) swatch('each op\'s peak beyond them', '#76b7b2');
  swatch('predicted (each op\'s peak)', '#111', true);
  if (data.capacity_bytes) swatch('capacity', cv('capacity'), true);
  if (fail) swatch('failed request', cv('capacity'));
  ['forward', 'recompute', 'backward', 'optimizer'].forEach(function (p) {
    if (data.phases.some(function (q) { return q.phase === p; })) {
      swatch(p + ' phase', { forward: '#bcd7f5', recompute: '#f7d774', backward: '#d8c2f0',
        optimizer: '#a8e6c1' }[p]);
    }
  });

  // The main chart.
  var svg = el('svg', { 'class': 'chart', id: 'chart-live', viewBox: '0 0 ' + W + ' ' + H,
    role: 'img', 'aria-label': 'memory over the step' });
  C.y_ticks.forEach(function (gb) {
    el('line', { 'class': 'grid', x1: L, x2: W - R, y1: y(gb), y2: y(gb) }, svg);
    el('text', { 'class': 'tick', x: L - 6, y: y(gb) + 4, 'text-anchor': 'end' }, svg,
      fmtBytes(gb));
  });
  for (var gi = 0; gi <= 4; ++gi) {
    var gt = dur * gi / 4;
    el('text', { 'class': 'tick', x: x(gt), y: H - B + 18,
      'text-anchor': gi === 0 ? 'start' : gi === 4 ? 'end' : 'middle' }, svg, fmtTime(gt));
  }
  data.phases.forEach(function (p) {
    el('rect', { 'class': 'band phase-' + p.phase, x: x(p.start), y: T,
      width: Math.max(0.5, x(p.end) - x(p.start)), height: H - T - B }, svg);
  });
  if (m) {
    var xs = m.times.map(x), below = m.times.map(function () { return y(0); });
    cats.forEach(function (c, j) {
      if (used.indexOf(c) < 0) return;
      var top = tops[j].map(y);
      el('path', { 'class': 'area cat-' + c, d: areaPath(xs, top, below, x(dur)) }, svg);
      below = top;
    });
  } else if (pred.ops.length) {
    // Model states and the batch, and above them each op's peak, over each op's span.
    var by = y(pred.baseline_bytes), y0 = y(0);
    el('path', { 'class': 'area cat-baseline', d: 'M' + x(0).toFixed(1) + ',' + by.toFixed(1) +
      'H' + x(dur).toFixed(1) + 'V' + y0.toFixed(1) + 'H' + x(0).toFixed(1) + 'Z' }, svg);
    pred.ops.forEach(function (o, i) {
      el('rect', { 'class': 'pred-area', x: x(o.start), y: y(predB[i]),
        width: Math.max(0.5, x(o.end) - x(o.start)), height: Math.max(0, by - y(predB[i])) }, svg);
    });
  }
  if (pred.ops.length) el('path', { 'class': 'predicted', d: envelopePath() }, svg);
  if (data.capacity_bytes && C.capacity_on_chart) {
    el('line', { 'class': 'capacity', x1: L, x2: W - R, y1: y(data.capacity_bytes),
      y2: y(data.capacity_bytes) }, svg);
    el('text', { 'class': 'label', x: L + 6, y: y(data.capacity_bytes) - 5 }, svg,
      'capacity ' + fmtBytes(data.capacity_bytes));
  } else if (data.capacity_bytes) {
    el('text', { 'class': 'label capacity-off', x: W - R - 4, y: T - 8, 'text-anchor': 'end' },
      svg, '\u2191 capacity ' + fmtBytes(data.capacity_bytes) + ' (above the chart)');
  }
  if (fail) {
    var fx = x(fail.time), top = fail.live_bytes + fail.requested_bytes;
    el('rect', { 'class': 'failed-request', x: fx - 6, y: y(top), width: 12,
      height: Math.max(1, y(fail.live_bytes) - y(top)) }, svg);
    el('line', { 'class': 'failure', x1: fx, x2: fx, y1: T, y2: H - B }, svg);
    el('text', { 'class': 'label', x: fx - 10, y: T + 14, 'text-anchor': 'end' }, svg,
      'out of memory: ' + fmtBytes(fail.requested_bytes) + ' for ' +
      (fail.category || '?'));
  }
  var peakT = m ? m.times[peakIndex] : 0, peakB = m ? drawnPeak : 0;
  if (!m && predB.length) {
    var pi = predB.indexOf(Math.max.apply(null, predB));
    peakT = (pred.ops[pi].start + pred.ops[pi].end) / 2; peakB = predB[pi];
  }
  el('circle', { 'class': 'peak-mark', cx: x(peakT), cy: y(peakB), r: 6 }, svg);
  // The label goes left of a mark in the chart's right third, so that it stays inside.
  // Near the failure's mark the failure says it.
  var leftOf = x(peakT) > L + (W - L - R) * 2 / 3;
  if (!fail || Math.abs(x(peakT) - x(fail.time)) > 200) {
    el('text', { 'class': 'tick', x: x(peakT) + (leftOf ? -9 : 9), y: y(peakB) - 8,
      'text-anchor': leftOf ? 'end' : 'start' }, svg,
      (m ? 'measured peak ' : 'predicted peak ') + fmtBytes(peakB));
  }
  var cross = el('line', { 'class': 'cross', x1: 0, x2: 0, y1: T, y2: H - B,
    visibility: 'hidden' }, svg);
  function tAt(evt) {
    var r = svg.getBoundingClientRect();
    var vx = (evt.clientX - r.left) / r.width * W, vy = (evt.clientY - r.top) / r.height * H;
    return { t: (vx - L) / (W - L - R) * dur, vx: vx, b: (1 - (vy - T) / (H - T - B)) * ymax };
  }
  svg.addEventListener('mousemove', function (evt) {
    var p = tAt(evt);
    if (p.t < 0 || p.t > dur) { hideTip(); cross.setAttribute('visibility', 'hidden'); return; }
    cross.setAttribute('x1', p.vx); cross.setAttribute('x2', p.vx);
    cross.setAttribute('visibility', 'visible');
    var rows = [[fmtTime(p.t), '']];
    var ph = phaseAt(p.t);
    if (ph) rows.push(['phase', ph.phase + (data.micro_batches > 1 && ph.micro_batch !== null ?
      ' (micro-batch ' + ph.micro_batch + ')' : '')]);
    var k = opAt(p.t);
    if (k >= 0) rows.push(['op', pred.ops[k].phase + ' ' + pred.ops[k].name]);
    if (m) {
      var i = at(m.times, p.t), lo = 0;
      cats.forEach(function (c, j) {
        var v = m.bytes[c][i];
        if (v > 0) rows.push([c, fmtBytes(v), p.b >= lo && p.b < tops[j][i]]);
        lo = tops[j][i];
      });
      rows.push(['measured total', fmtBytes(tops[cats.length - 1][i])]);
    }
    if (k >= 0) rows.push(['predicted (op peak)', fmtBytes(predB[k])]);
    if (fail && Math.abs(x(p.t) - x(fail.time)) < 8) {
      rows.push(['failed request', fmtBytes(fail.requested_bytes) + ' for ' + (fail.category || '?'),
        true]);
    }
    if (data.capacity_bytes) rows.push(['capacity', fmtBytes(data.capacity_bytes)]);
    showTip(evt, rows);
  });
  svg.addEventListener('mouseleave', function () {
    hideTip(); cross.setAttribute('visibility', 'hidden');
  });
  var old = document.getElementById('chart-static');
  old.parentNode.replaceChild(svg, old);

  // Checkpoint lives: one lane each.
  var lives = data.checkpoints;
  if (lives.length) {
    document.getElementById('lanes-section').hidden = false;
    var LH = 18, lsvg = el('svg', { 'class': 'chart', id: 'lanes-svg', viewBox: '0 0 ' + W +
      ' ' + (lives.length * (LH + 4) + 30) }, document.getElementById('lanes'));
    var ldefs = el('defs', {}, lsvg);
    var lpat = el('pattern', { id: 'hatch', width: 6, height: 6, patternUnits: 'userSpaceOnUse',
      patternTransform: 'rotate(45)' }, ldefs);
    el('rect', { width: 6, height: 6, fill: '#f7d774' }, lpat);
    el('line', { x1: 0, y1: 0, x2: 0, y2: 6, stroke: '#b8860b', 'stroke-width': 3 }, lpat);
    lives.forEach(function (c, li) {
      var yy = li * (LH + 4) + 4;
      el('text', { 'class': 'lane-name', x: L - 6, y: yy + 13, 'text-anchor': 'end' }, lsvg,
        c.name + (data.micro_batches > 1 ? ' #' + c.micro_batch : ''));
      function seg(s, e, where, label) {
        var r = el('rect', { 'class': 'where-' + where, x: x(s), y: yy,
          width: Math.max(1, x(e) - x(s)), height: LH }, lsvg);
        r.addEventListener('mousemove', function (evt) {
          showTip(evt, [['checkpoint', c.name + ' input'], ['bytes', fmtBytes(c.bytes)],
            ['state', label], ['from', fmtTime(s)], ['to', fmtTime(e)]]);
        });
        r.addEventListener('mouseleave', hideTip);
      }
      seg(c.start, c.end, 'device',
        c.where === 'device' ? 'kept on the device' : 'on the device (staging)');
      c.host.forEach(function (hI) { seg(hI[0], hI[1], 'host', 'offloaded to pinned host'); });
      (c.partitioned || []).forEach(function (pI) {
        seg(pI[0], pI[1], 'partitioned', 'this rank\'s 1/t slice on the device');
      });
      c.recomputes.forEach(function (rI) {
        seg(rI[0], rI[1], 'recomputed', 'recomputed from it');
      });
    });
    var ly = lives.length * (LH + 4) + 20, lx = L;
    [['device', 'kept on device'], ['recomputed', 'recomputed'], ['host', 'offloaded to host'],
      ['partitioned', 'partitioned (1/t per tensor-parallel rank)']]
      .forEach(function (k) {
        el('rect', { 'class': 'where-' + k[0], x: lx, y: ly - 10, width: 12, height: 12 }, lsvg);
        el('text', { 'class': 'tick', x: lx + 16, y: ly }, lsvg, k[1]);
        lx += 40 + k[1].length * 6.5;
      });
  }

  // Pinned host memory: measured samples, or the plan's pinned bytes.
  var pinned = m ? m.pinned : null;
  if ((pinned && pinned.bytes.some(function (b) { return b > 0; })) || pred.pinned_bytes > 0) {
    document.getElementById('pinned-section').hidden = false;
    var PH = 120, pmax = 1;
    if (pinned) pinned.bytes.forEach(function (b) { pmax = Math.max(pmax, b); });
    pmax = Math.max(pmax, pred.pinned_bytes) * 1.15;
    var psvg = el('svg', { 'class': 'chart', id: 'pinned-svg', viewBox: '0 0 ' + W + ' ' + PH },
      document.getElementById('pinned'));
    function py(b) { return 8 + (1 - b / pmax) * (PH - 30); }
    if (pinned) {
      var pxs2 = pinned.times.map(x);
      el('path', { 'class': 'area cat-pinned', d: areaPath(pxs2, pinned.bytes.map(py),
        pinned.bytes.map(function () { return py(0); }), x(dur)) }, psvg);
    }
    if (pred.pinned_bytes > 0) {
      el('line', { 'class': 'predicted', x1: L, x2: W - R, y1: py(pred.pinned_bytes),
        y2: py(pred.pinned_bytes) }, psvg);
    }
    el('text', { 'class': 'tick', x: L - 6, y: py(pmax / 1.15) + 4, 'text-anchor': 'end' },
      psvg, fmtBytes(pmax / 1.15));
    el('text', { 'class': 'tick', x: L - 6, y: py(0) + 4, 'text-anchor': 'end' }, psvg, '0 B');
    h('p', { 'class': 'note' }, document.getElementById('pinned'),
      'Pinned pool in use' + (pinned ? ', sampled at every op boundary' : '') +
      '; dashed: the plan\'s pinned bytes (' + fmtBytes(pred.pinned_bytes) + ')' +
      (pinned && pinned.limit_bytes ? '; limit ' + fmtBytes(pinned.limit_bytes) : '') + '.');
  }

  // The peak's composition, accounted as the out-of-memory message does.
  document.getElementById('peak-section').hidden = false;
  var parts = [];
  if (fail) {
    cats.forEach(function (c) { parts.push([c, fail.live_by_category[c], cv(c)]); });
    peakB = fail.live_bytes;
    document.getElementById('peak-title').textContent = 'Live at the failure (' +
      fmtTime(fail.time) + ')';
  } else if (m) {
    cats.forEach(function (c) { parts.push([c, m.peak_by_category[c], cv(c)]); });
    document.getElementById('peak-title').textContent = 'At the measured peak (' +
      fmtTime(m.peak_time) + ')';
  } else {
    var ms = pred.model_state_bytes, bb = pred.batch_bytes;
    parts.push(['model states', ms, cv('params')], ['batch', bb, cv('workspace')],
      ['activations, checkpoints, staging, workspace', pred.peak_bytes - ms - bb,
        cv('activations')]);
    peakB = pred.peak_bytes;
    document.getElementById('peak-title').textContent = 'At the predicted peak';
  }
  var pt = h('table', { 'class': 'peak' }, document.getElementById('peak'));
  var hr = h('tr', {}, pt);
  ['', 'bytes', 'of the peak', 'of capacity', ''].forEach(function (s) { h('th', {}, hr, s); });
  var cap = data.capacity_bytes || 0;
  function pct(v, of) { return of > 0 ? (100 * v / of).toFixed(1) + '%' : '-'; }
  parts.filter(function (p) { return p[1] > 0; }).sort(function (a, b) { return b[1] - a[1]; })
    .forEach(function (p) {
      var tr = h('tr', {}, pt);
      h('td', {}, tr, p[0]); h('td', {}, tr, fmtBytes(p[1]));
      h('td', {}, tr, pct(p[1], peakB)); h('td', {}, tr, pct(p[1], cap));
      var td = h('td', {}, tr);
      h('span', { 'class': 'bar', style: 'background:' + p[2] + ';width:' +
        Math.max(1, 300 * p[1] / Math.max(cap, peakB)) + 'px' }, td);
    });
  function totalRow(label, v) {
    var tr = h('tr', {}, pt);
    h('th', {}, tr, label); h('th', {}, tr, fmtBytes(v)); h('th', {}, tr, '');
    h('th', {}, tr, pct(v, cap)); h('th', {}, tr, '');
  }
  if (fail) {
    totalRow('live (all categories)', peakB);
    totalRow('failed request', fail.requested_bytes);
    totalRow('live + request', peakB + fail.requested_bytes);
    if (cap > 0) totalRow('over capacity', Math.max(0, peakB + fail.requested_bytes - cap));
  } else {
    totalRow(m ? 'peak (all categories)' : 'predicted peak', peakB);
    if (cap > 0) totalRow(peakB <= cap ? 'headroom' : 'over capacity', Math.abs(cap - peakB));
  }
  if (m) totalRow('predicted peak', pred.peak_bytes);

  // The failure: what was asked for, where, and the allocator's message.
  if (fail) {
    document.getElementById('failure-section').hidden = false;
    var fd = document.getElementById('failure');
    var ft = h('table', { 'class': 'failure' }, fd);
    function frow(k, v) { var tr = h('tr', {}, ft); h('td', {}, tr, k); h('td', {}, tr, v); }
    frow('request', fmtBytes(fail.requested_bytes) + ' (' + fail.requested_bytes + ' bytes)');
    frow('category', fail.category || 'not named by the error');
    frow('in', fail.phase + ' ' + fail.name + (fail.op !== null ? ' (op ' + fail.op +
      (data.micro_batches > 1 ? ', micro-batch ' + fail.micro_batch : '') + ')' : ''));
    frow('at', fmtTime(fail.time) + ' into step ' + data.step + (data.device ? ' on ' +
      data.device : ''));
    frow('live then', fmtBytes(fail.live_bytes) + (fail.live_from === 'allocator' ?
      ' (the allocator\'s accounting)' : ' (after the step\'s last allocation)'));
    if (cap) frow('capacity', fmtBytes(cap));
    h('pre', {}, fd, fail.message);
  }

  var sum = document.getElementById('summary');
  sum.textContent = (fail ? 'Out of memory at ' + fmtTime(fail.time) + ': ' +
    fmtBytes(fail.requested_bytes) + ' for ' + (fail.category || '?') + ' in ' + fail.phase +
    ' ' + fail.name + ', with ' + fmtBytes(fail.live_bytes) + ' live. ' : '') +
    (m ? 'Measured peak ' + fmtBytes(drawnPeak) + ' at ' + fmtTime(peakT) +
    '; ' : '') + 'predicted peak ' + fmtBytes(pred.peak_bytes) +
    (cap ? ' of a ' + fmtBytes(cap) + ' device' : '') + '. ' + data.description + '.' +
    (data.device ? ' Device: ' + data.device + '.' : '') +
    (m && m.dropped_events ? ' ' + m.dropped_events + ' allocator events were dropped.' : '');
  // A check of hovering that needs no pointer: page.html#probe-peak hovers the drawn peak and
  // leaves the tooltip's text in data-probe.
  if (location.hash === '#probe-peak') {
    var r = svg.getBoundingClientRect();
    svg.dispatchEvent(new MouseEvent('mousemove', { bubbles: true,
      clientX: r.left + x(peakT) / W * r.width + 0.5,
      clientY: r.top + y(peakB) / H * r.height + 2 }));
    body.setAttribute('data-probe', tip.textContent);
  }
  body.setAttribute('data-drawn-peak-bytes', String(drawnPeak));
  // Every text of every chart inside its SVG's view box: the names of what is outside go in
  // data-clipped (tests read it).
  var clipped = [];
  Array.prototype.forEach.call(document.querySelectorAll('svg.chart'), function (s) {
    var vb = s.viewBox.baseVal;
    Array.prototype.forEach.call(s.querySelectorAll('text'), function (t) {
      var bb = t.getBBox();
      if (bb.x < vb.x - 0.5 || bb.x + bb.width > vb.x + vb.width + 0.5 || bb.y < vb.y - 0.5 ||
          bb.y + bb.height > vb.y + vb.height + 0.5) {
        clipped.push(t.textContent);
      }
    });
  });
  body.setAttribute('data-clipped', clipped.join('|'));
  body.setAttribute('data-y-max-bytes', String(ymax));
  body.setAttribute('data-status', 'ok');
})();
</script>
</body>
</html>
)page";

}  // namespace

std::string_view memory_page_template() { return kTemplate; }

}  // namespace porter::cli
