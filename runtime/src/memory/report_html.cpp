// memory_report.html: one page, drawn in the browser from the JSON it embeds (docs/memory.md,
// "Reports"). The page is a fixed template; all the work is done by its script, so the C++ only
// has to embed the JSON where the script can read it and the HTML parser cannot misread it.
#include "memory/report_html.h"

#include <cstring>

namespace memrt {
namespace {

constexpr const char kPlaceholder[] = "@MEMRT_REPORT_JSON@";

// Stable hooks for tests and scripts: <g class="bar" data-kind="estimate|measured" data-rank>,
// holding one <rect class="segment" data-category data-placement> per non-zero cell;
// <g class="timeline" data-rank> with <path class="series" data-series>; <table class="cmp"
// data-rank>; <section id="leaks"> with one <li class="leak" data-rank data-category> per leak;
// <section id="resident"> with one <li class="resident" data-rank> per rank whose RSS passed its estimate;
// body[data-rendered] is "ok" or "error: <message>".
constexpr const char kTemplate[] = R"html(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>memrt memory report</title>
<style>
  :root {
    --ink: #1f2328; --muted: #656d76; --faint: #8c959f; --line: #d8dee4; --panel: #ffffff;
    --bg: #f6f8fa; --over: #b42318; --under: #1a7f37;
  }
  * { box-sizing: border-box; }
  body {
    margin: 0; padding: 24px 32px 40px; background: var(--bg); color: var(--ink);
    font: 14px/1.45 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif;
  }
  header { display: flex; align-items: baseline; gap: 16px; flex-wrap: wrap; margin-bottom: 16px; }
  h1 { font-size: 22px; font-weight: 600; margin: 0; }
  h2 { font-size: 16px; font-weight: 600; margin: 0 0 12px; }
  h3 { font-size: 14px; font-weight: 600; margin: 0 0 8px; }
  .sub { color: var(--muted); }
  .card {
    background: var(--panel); border: 1px solid var(--line); border-radius: 8px;
    padding: 16px 20px; margin-bottom: 16px;
  }
  .grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: 20px; }
  /* A lone table keeps a readable width instead of spreading over the page. */
  .grid.narrow { grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); }
  body.failed .card { display: none; }
  .warning {
    background: #fff8e6; border: 1px solid #e3b341; border-left: 6px solid #d4a72c;
    border-radius: 8px; padding: 12px 20px; margin-bottom: 16px;
  }
  .warning h2 { color: #7d4e00; margin-bottom: 6px; }
  .warning ul { margin: 0 0 6px; padding-left: 20px; }
  .warning p { margin: 0; color: #6b4a00; }
  .error {
    background: #ffebe9; border: 1px solid #ff8182; border-radius: 8px; padding: 12px 20px;
    margin-bottom: 16px; white-space: pre-wrap; font-family: ui-monospace, monospace;
  }
  .legend { display: flex; flex-wrap: wrap; gap: 6px 18px; margin-bottom: 10px; font-size: 13px; }
  .legend .item { display: inline-flex; align-items: center; gap: 6px; }
  .legend .item.absent { color: var(--faint); }
  .legend .item.absent .swatch { opacity: 0.35; }
  .legend .break { flex-basis: 100%; height: 0; }
  .swatch.tick { width: 2px; height: 16px; border-radius: 0; background: #1f2328; margin: 0 6px; }
  .swatch { width: 14px; height: 14px; border-radius: 3px; display: inline-block; }
  .swatch.device { background: #6e7781; }
  .swatch.host {
    background: repeating-linear-gradient(45deg, #6e7781 0 2px, #d0d7de 2px 5px);
  }
  .swatch.line { height: 3px; border-radius: 2px; width: 18px; }
  .swatch.dashed { background: none; border-top: 2px dashed #8c959f; height: 0; }
  .note { color: var(--muted); font-size: 12.5px; margin: 6px 0 0; }
  .empty { color: var(--muted); font-style: italic; margin: 24px 0; }
  svg { display: block; overflow: visible; }
  svg text { font-family: inherit; }
  /* Labels on hatched (host) cells get a light halo so the stripes do not cross the digits. */
  svg text.on-hatch { paint-order: stroke; stroke: rgba(255, 255, 255, 0.9); stroke-width: 3px;
                      stroke-linejoin: round; }
  table.cmp { border-collapse: collapse; width: 100%; font-size: 13px; }
  table.cmp th, table.cmp td { padding: 4px 8px; text-align: right; white-space: nowrap; }
  table.cmp th:first-child, table.cmp td:first-child { text-align: left; }
  table.cmp thead th {
    color: var(--muted); font-weight: 600; border-bottom: 1px solid var(--line);
  }
  table.cmp thead tr:first-child th { border-bottom: none; padding-bottom: 0; }
  table.cmp thead th.group { text-align: center; border-bottom: 1px solid var(--line); }
  table.cmp tbody tr:nth-child(even) { background: #f6f8fa; }
  table.cmp tfoot td { border-top: 1px solid var(--line); font-weight: 600; }
  table.cmp td { font-variant-numeric: tabular-nums; }
  table.cmp .zero { color: var(--faint); }
  table.cmp .over { color: var(--over); }
  table.cmp .under { color: var(--under); }
  table.cmp .cat { display: inline-flex; align-items: center; gap: 6px; }
  .stats { display: flex; flex-wrap: wrap; gap: 4px 18px; color: var(--muted); font-size: 12.5px;
           margin: 8px 0 0; }
  .stats b { color: var(--ink); font-weight: 600; font-variant-numeric: tabular-nums; }
  details { margin-top: 8px; font-size: 12.5px; color: var(--muted); }
  details ul { margin: 4px 0 0; padding-left: 20px; }
  .chart-legend {
    display: flex; gap: 16px; font-size: 12.5px; color: var(--muted); margin-bottom: 4px;
  }
  .chart-legend span { display: inline-flex; align-items: center; gap: 6px; }
</style>
</head>
<body>
<header>
  <h1 id="title">Memory report</h1>
  <span class="sub" id="subtitle"></span>
</header>
<noscript><div class="error">This report is drawn by its own script; enable JavaScript to see
it. The data is in the page source (memory_report.json).</div></noscript>
<div id="render-error" class="error" hidden></div>
<div id="leaks-slot"></div>
<section class="card" id="bars-card">
  <h2>Peak memory by category</h2>
  <div class="legend" id="legend"></div>
  <div id="bars"></div>
  <p class="note" id="bars-note"></p>
</section>
<section class="card">
  <h2>Memory over the steps</h2>
  <div class="grid" id="timelines"></div>
</section>
<section class="card">
  <h2>Estimate against measurement</h2>
  <div class="grid narrow" id="tables"></div>
</section>
<script type="application/json" id="memrt-report-data">@MEMRT_REPORT_JSON@</script>
<script>
(function () {
  "use strict";
  var SVGNS = "http://www.w3.org/2000/svg";
  var DEFAULT_CATEGORIES = ["weights", "master_weights", "gradients", "optimizer_state",
    "quant_state", "adapters", "activations", "comm_buffers", "other", "unattributed"];
  // One fixed colour per category so that reports of different runs read alike.
  var COLORS = {
    weights: "#4e79a7", master_weights: "#76b7b2", gradients: "#f28e2b",
    optimizer_state: "#e15759", quant_state: "#9c755f", adapters: "#edc948",
    activations: "#59a14f", comm_buffers: "#b07aa1", other: "#ff9da7", unattributed: "#bab0ac"
  };
  var EXTRA_COLORS = ["#86bcb6", "#d37295", "#8cd17d", "#f1ce63", "#a0cbe8", "#d4a6c8"];
  var PLACEMENTS = ["device", "host"];
  var SERIES = [
    {key: "peak_bytes", label: "peak during the step", color: "#24292f", width: 2.5},
    {key: "live_bytes", label: "live at the end of the step", color: "#4e79a7", width: 2},
    {key: "activations_peak_bytes", label: "activations peak", color: "#59a14f", width: 2},
    {key: "comm_buffers_peak_bytes", label: "comm_buffers peak (staging, gathered weights)", color: "#b07aa1", width: 1.5}
  ];

  function num(v) { return typeof v === "number" && isFinite(v) ? v : 0; }
  function arr(v) { return Array.isArray(v) ? v : []; }
  function obj(v) { return v && typeof v === "object" && !Array.isArray(v) ? v : {}; }

  // MB = 10^6 bytes, as on the console.
  function mb(bytes, unit) {
    var v = bytes / 1e6, a = Math.abs(v);
    var digits = a === 0 ? 0 : a >= 10 ? 1 : a >= 0.1 ? 2 : 3;
    var t = v.toLocaleString("en-US", {minimumFractionDigits: digits,
                                       maximumFractionDigits: digits});
    return unit === false ? t : t + " MB";
  }
  function signedMb(bytes) {
    return (bytes > 0 ? "+" : bytes < 0 ? "\u2212" : "") + mb(Math.abs(bytes));
  }
  function count(v) { return num(v).toLocaleString("en-US"); }
  // Axis ticks in MB, without decimals the step does not need.
  function tick(bytes, step) {
    if (bytes === 0) return "0";
    var digits = Math.max(0, -Math.floor(Math.log10(step / 1e6) + 1e-9));
    return (bytes / 1e6).toLocaleString("en-US", {minimumFractionDigits: digits,
                                                  maximumFractionDigits: digits});
  }

  function h(tag, attrs, text) {
    var e = document.createElement(tag);
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function s(tag, attrs, text) {
    var e = document.createElementNS(SVGNS, tag);
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function tip(e, text) { e.appendChild(s("title", {}, text)); return e; }

  // Round axis steps: 1, 2 or 5 times a power of ten.
  function niceStep(max, ticks) {
    if (!(max > 0)) return 1;
    var raw = max / ticks, p = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / p;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * p;
  }
  function darkText(hex) {
    var c = parseInt(hex.slice(1), 16);
    var l = 0.299 * (c >> 16) + 0.587 * ((c >> 8) & 255) + 0.114 * (c & 255);
    return l > 150;
  }

  function rankOf(r, i) { return "rank" in r ? r.rank : i; }
  function noRank(host, ranks) {
    if (!ranks.length) host.appendChild(h("p", {"class": "empty"}, "The report has no rank."));
    return !ranks.length;
  }
  function cell(cats, name, placement) { return num(obj(obj(cats)[name])[placement]); }
  function total(cats, names) {
    var t = 0;
    names.forEach(function (n) { PLACEMENTS.forEach(function (p) { t += cell(cats, n, p); }); });
    return t;
  }

  function render(report) {
    report = obj(report);
    var ranks = arr(report.ranks).map(obj);
    var names = arr(report.categories).filter(function (c) { return typeof c === "string"; });
    if (!names.length) names = DEFAULT_CATEGORIES.slice();
    // Categories a rank reports that the list lacks are still drawn, after the listed ones.
    ranks.forEach(function (r) {
      [obj(r.estimate).categories, obj(r.measured).categories].forEach(function (cats) {
        Object.keys(obj(cats)).forEach(function (n) { if (names.indexOf(n) < 0) names.push(n); });
      });
    });
    var colors = {};
    names.forEach(function (n, i) {
      colors[n] = COLORS[n] || EXTRA_COLORS[i % EXTRA_COLORS.length];
    });

    var world = num(report.world_size) || ranks.length;
    document.getElementById("title").textContent = "Memory report \u00b7 world size " + world;
    document.title = "memrt memory report (world size " + world + ")";
    document.getElementById("subtitle").textContent =
        ranks.length + (ranks.length === 1 ? " rank" : " ranks") +
        " in this report \u00b7 MB = 10\u2076 bytes \u00b7 measured at each rank's peak";

    defs(names, colors);
    leaks(ranks);
    residentGrowth(ranks);
    legend(names, colors, ranks);
    bars(names, colors, ranks);
    timelines(ranks);
    tables(names, colors, ranks);
  }

  // Host (offloaded) cells are the category's colour, hatched.
  function defs(names, colors) {
    var svg = s("svg", {width: 0, height: 0, style: "position:absolute", "aria-hidden": "true"});
    var d = s("defs");
    names.forEach(function (n, i) {
      var p = s("pattern", {id: "hatch-" + i, patternUnits: "userSpaceOnUse", width: 6, height: 6,
                            patternTransform: "rotate(45)"});
      p.appendChild(s("rect", {width: 6, height: 6, fill: colors[n], "fill-opacity": 0.3}));
      p.appendChild(s("rect", {width: 3, height: 6, fill: colors[n]}));
      d.appendChild(p);
    });
    svg.appendChild(d);
    document.body.insertBefore(svg, document.body.firstChild);
  }
  function fillOf(names, colors, name, placement) {
    return placement === "host" ? "url(#hatch-" + names.indexOf(name) + ")" : colors[name];
  }

  function leaks(ranks) {
    var found = [];
    ranks.forEach(function (r, i) {
      arr(r.leaks).forEach(function (l) { found.push({rank: rankOf(r, i), leak: obj(l)}); });
    });
    if (!found.length) return;
    var box = h("section", {id: "leaks", "class": "warning", role: "alert"});
    box.appendChild(h("h2", {}, "\u26a0 Memory grows from step to step"));
    var ul = h("ul");
    found.forEach(function (f) {
      var l = f.leak, cat = String(l.category);
      ul.appendChild(h("li", {"class": "leak", "data-rank": f.rank, "data-category": cat},
          "Rank " + f.rank + ": '" + cat + "' grows by " + mb(num(l.bytes_per_step)) +
          " per step (steps " + num(l.first_step) + ".." + num(l.last_step) +
          ", live bytes at the end of each step)."));
    });
    box.appendChild(ul);
    box.appendChild(h("p", {}, "Something keeps tensors alive across steps \u2014 e.g. a loss " +
                                "kept with its graph."));
    document.getElementById("leaks-slot").appendChild(box);
  }

  function residentGrowth(ranks) {
    var found = [];
    ranks.forEach(function (r, i) {
      if (r.resident_growth) found.push({rank: rankOf(r, i), g: obj(r.resident_growth)});
    });
    if (!found.length) return;
    var box = h("section", {id: "resident", "class": "warning", role: "alert"});
    box.appendChild(h("h2", {}, "\u26a0 Resident memory past the estimate"));
    var ul = h("ul");
    found.forEach(function (f) {
      var g = f.g, cats = arr(g.categories).map(function (c) { return "'" + String(c) + "'"; });
      ul.appendChild(h("li", {"class": "resident", "data-rank": f.rank},
          "Rank " + f.rank + ": resident memory reached " + mb(num(g.resident_bytes)) + " by step " +
          num(g.step) + ", past the " + mb(num(g.expected_bytes)) + " expected by more than the margin (" +
          mb(num(g.allowed_bytes)) + " allowed), since step " + num(g.since_step) + "; " +
          (cats.length ? "grown since step " + (g.from_step === undefined ? 1 : num(g.from_step)) + ": " + cats.join(", ") + "."
                       : "no category of memrt's tensors grew: the growth is outside them.")));
    });
    box.appendChild(ul);
    document.getElementById("leaks-slot").appendChild(box);
  }

  function legend(names, colors, ranks) {
    var box = document.getElementById("legend");
    names.forEach(function (n) {
      var used = ranks.some(function (r) {
        return total(obj(r.estimate).categories, [n]) > 0 ||
               total(obj(r.measured).categories, [n]) > 0;
      });
      var item = h("span", {"class": "item" + (used ? "" : " absent"), "data-category": n});
      item.appendChild(h("span", {"class": "swatch", style: "background:" + colors[n]}));
      item.appendChild(document.createTextNode(n));
      box.appendChild(item);
    });
    box.appendChild(h("span", {"class": "break"}));
    [["device", "device"], ["host", "host (offloaded)"], ["tick", "peak"]].forEach(function (p) {
      var item = h("span", {"class": "item"});
      item.appendChild(h("span", {"class": "swatch " + p[0]}));
      item.appendChild(document.createTextNode(p[1]));
      box.appendChild(item);
    });
  }

  function bars(names, colors, ranks) {
    var host = document.getElementById("bars");
    if (noRank(host, ranks)) return;
    var rows = [];
    ranks.forEach(function (r, i) {
      var rank = rankOf(r, i);
      ["estimate", "measured"].forEach(function (kind) {
        var part = obj(r[kind]);
        rows.push({rank: rank, kind: kind, cats: part.categories, peak: num(part.peak_bytes),
                   step: part.peak_step, sum: total(part.categories, names)});
      });
    });
    var max = 0;
    rows.forEach(function (b) { max = Math.max(max, b.sum, b.peak); });
    max = max || 1e6;  // an all-zero report still gets a readable axis
    var W = Math.max(640, host.clientWidth || 1100), left = 150, right = 200;
    var plotW = W - left - right, barH = 28, pairGap = 6, rankGap = 22, top = 4;
    var step = niceStep(max, 6), axisMax = Math.ceil(max / step) * step;
    var x = function (b) { return left + plotW * b / axisMax; };
    var H = top + ranks.length * (2 * barH + pairGap) + (ranks.length - 1) * rankGap + 30;
    var svg = s("svg", {width: W, height: H, id: "bars-svg", role: "img",
                        "aria-label": "Stacked bars of estimated and measured peak memory"});
    var grid = s("g", {"class": "grid"});
    for (var t = 0; t <= axisMax + step / 2; t += step) {
      grid.appendChild(s("line", {x1: x(t), x2: x(t), y1: 0, y2: H - 24, stroke: "#eaeef2"}));
      grid.appendChild(s("text", {x: x(t), y: H - 8, "text-anchor": "middle", "font-size": 11,
                                  fill: "#656d76"}, tick(t, step)));
    }
    grid.appendChild(s("text", {x: left - 24, y: H - 8, "text-anchor": "end", "font-size": 11,
                                fill: "#656d76"}, "MB"));
    svg.appendChild(grid);
    var cellsExceedPeak = false;
    rows.forEach(function (b, i) {
      var pair = Math.floor(i / 2);
      var y = top + pair * (2 * barH + pairGap + rankGap) + (i % 2) * (barH + pairGap);
      svg.appendChild(s("text", {x: 0, y: y + barH / 2 + 4, "font-size": 13,
                                 "font-weight": i % 2 ? 400 : 600, fill: "#1f2328"},
                        i % 2 ? "" : "Rank " + b.rank));
      svg.appendChild(s("text", {x: left - 10, y: y + barH / 2 + 4, "text-anchor": "end",
                                 "font-size": 12.5, fill: "#656d76"}, b.kind));
      var g = s("g", {"class": "bar", "data-kind": b.kind, "data-rank": b.rank});
      var labels = s("g", {"class": "labels"});
      var at = 0;
      names.forEach(function (n) {
        PLACEMENTS.forEach(function (p) {
          var v = cell(b.cats, n, p);
          if (!(v > 0)) return;
          var x0 = x(at), w = Math.max(x(at + v) - x0, 0.5);
          g.appendChild(tip(s("rect", {"class": "segment", "data-category": n, "data-placement": p,
                                       "data-bytes": v, x: x0, y: y, width: w, height: barH,
                                       fill: fillOf(names, colors, n, p), stroke: "#ffffff",
                                       "stroke-width": 1}),
                            n + " (" + p + "): " + mb(v) + " \u2014 " + count(v) + " bytes"));
          var text = w >= 76 ? mb(v) : w >= 44 ? mb(v, false) : "";
          if (text) {
            var light = p === "device" && !darkText(colors[n]);
            labels.appendChild(s("text", {x: x0 + w / 2, y: y + barH / 2 + 4,
                                          "text-anchor": "middle", "font-size": 11.5,
                                          "pointer-events": "none",
                                          "class": p === "host" ? "on-hatch" : "",
                                          fill: light ? "#ffffff" : "#1f2328"}, text));
          }
          at += v;
        });
      });
      svg.appendChild(g);
      svg.appendChild(labels);
      if (b.peak > 0) {
        svg.appendChild(tip(s("line", {"class": "peak-marker", x1: x(b.peak), x2: x(b.peak),
                                       y1: y - 3, y2: y + barH + 3, stroke: "#1f2328",
                                       "stroke-width": 2}), "peak " + mb(b.peak)));
      }
      var end = x(Math.max(at, b.peak)) + 10;
      var label = s("text", {x: end, y: y + barH / 2 + 4, "font-size": 12.5, fill: "#1f2328"});
      label.appendChild(s("tspan", {"font-weight": 600}, "peak " + mb(b.peak)));
      if (b.kind === "measured" && b.step !== undefined)
        label.appendChild(s("tspan", {fill: "#656d76"}, " at step " + num(b.step)));
      if (Math.abs(at - b.peak) >= 0.5e5) {
        label.appendChild(s("tspan", {fill: "#656d76"}, " \u00b7 cells " + mb(at)));
        if (at > b.peak) cellsExceedPeak = true;
      }
      svg.appendChild(label);
    });
    host.appendChild(svg);
    document.getElementById("bars-note").textContent =
        (cellsExceedPeak
          ? "An estimate's cells can add up to more than its peak: not all of them are alive at " +
            "the same time (gradients and activations peak at different moments of the step). "
          : "") + "Hover a segment for its exact bytes.";
  }

  function timelines(ranks) {
    var host = document.getElementById("timelines");
    if (noRank(host, ranks)) return;
    // Every box is in the grid before any is measured, so each chart gets its column's width.
    var boxes = ranks.map(function (r, i) {
      var box = h("div", {"class": "timeline-box", "data-rank": rankOf(r, i)});
      box.appendChild(h("h3", {}, "Rank " + rankOf(r, i)));
      host.appendChild(box);
      return box;
    });
    ranks.forEach(function (r, i) {
      var rank = rankOf(r, i), box = boxes[i];
      var points = arr(r.timeline).map(obj).filter(function (p) {
        return typeof p.step === "number";
      });
      if (!points.length) {
        box.appendChild(h("p", {"class": "empty"}, "No optimizer step was recorded."));
        return;
      }
      var estPeak = num(obj(r.estimate).peak_bytes);
      var lg = h("div", {"class": "chart-legend"});
      SERIES.forEach(function (se) {
        var it = h("span");
        it.appendChild(h("span", {"class": "swatch line", style: "background:" + se.color}));
        it.appendChild(document.createTextNode(se.label));
        lg.appendChild(it);
      });
      if (estPeak > 0) {
        var it = h("span");
        it.appendChild(h("span", {"class": "swatch line dashed"}));
        it.appendChild(document.createTextNode("estimated peak"));
        lg.appendChild(it);
      }
      box.appendChild(lg);

      var W = Math.max(420, box.clientWidth || 600), H = 250, L = 70, R = 16, T = 12, B = 34;
      var s0 = points[0].step, s1 = points[0].step, vmax = estPeak;
      points.forEach(function (p) {
        s0 = Math.min(s0, p.step); s1 = Math.max(s1, p.step);
        SERIES.forEach(function (se) { vmax = Math.max(vmax, num(p[se.key])); });
      });
      if (s0 === s1) { s0 -= 1; s1 += 1; }
      vmax = vmax || 1e6;
      var yStep = niceStep(vmax, 5), yMax = Math.ceil(vmax * 1.04 / yStep) * yStep;
      var x = function (st) { return L + (W - L - R) * (st - s0) / (s1 - s0); };
      var y = function (v) { return T + (H - T - B) * (1 - v / yMax); };
      var svg = s("svg", {width: W, height: H, role: "img",
                          "aria-label": "Memory over the steps, rank " + rank});
      var g = s("g", {"class": "timeline", "data-rank": rank});
      for (var v = 0; v <= yMax + yStep / 2; v += yStep) {
        g.appendChild(s("line", {x1: L, x2: W - R, y1: y(v), y2: y(v),
                                 stroke: v ? "#eaeef2" : "#8c959f"}));
        g.appendChild(s("text", {x: L - 8, y: y(v) + 4, "text-anchor": "end", "font-size": 11,
                                 fill: "#656d76"}, tick(v, yStep)));
      }
      g.appendChild(s("text", {x: 12, y: T + (H - T - B) / 2, "font-size": 11, fill: "#656d76",
                               "text-anchor": "middle",
                               transform: "rotate(-90 12 " + (T + (H - T - B) / 2) + ")"}, "MB"));
      var xStep = Math.max(1, Math.round(niceStep(s1 - s0, 8)));
      for (var st = Math.ceil(s0 / xStep) * xStep; st <= s1; st += xStep) {
        g.appendChild(s("line", {x1: x(st), x2: x(st), y1: H - B, y2: H - B + 4,
                                 stroke: "#8c959f"}));
        g.appendChild(s("text", {x: x(st), y: H - B + 16, "text-anchor": "middle", "font-size": 11,
                                 fill: "#656d76"}, String(st)));
      }
      g.appendChild(s("text", {x: L + (W - L - R) / 2, y: H - 2, "text-anchor": "middle",
                               "font-size": 11, fill: "#656d76"}, "optimizer step"));
      if (estPeak > 0) {
        g.appendChild(tip(s("line", {"class": "estimate-peak", x1: L, x2: W - R, y1: y(estPeak),
                                     y2: y(estPeak), stroke: "#8c959f", "stroke-dasharray": "6 4",
                                     "stroke-width": 1.5}), "estimated peak " + mb(estPeak)));
      }
      SERIES.forEach(function (se) {
        var d = points.map(function (p, k) {
          return (k ? "L" : "M") + x(p.step).toFixed(1) + "," + y(num(p[se.key])).toFixed(1);
        }).join("");
        g.appendChild(s("path", {"class": "series", "data-series": se.key, d: d, fill: "none",
                                 stroke: se.color, "stroke-width": se.width,
                                 "stroke-linejoin": "round"}));
        if (points.length <= 60) {
          points.forEach(function (p) {
            g.appendChild(tip(s("circle", {cx: x(p.step), cy: y(num(p[se.key])), r: 3,
                                           fill: se.color}),
                              "step " + p.step + ", " + se.label + ": " + mb(num(p[se.key]))));
          });
        }
      });
      svg.appendChild(g);
      box.appendChild(svg);
    });
  }

  function tables(names, colors, ranks) {
    var host = document.getElementById("tables");
    if (noRank(host, ranks)) return;
    ranks.forEach(function (r, i) {
      var rank = rankOf(r, i), est = obj(r.estimate), mea = obj(r.measured);
      var box = h("div");
      box.appendChild(h("h3", {}, "Rank " + rank));
      var t = h("table", {"class": "cmp", "data-rank": rank});
      var head = h("thead");
      var r1 = h("tr");
      r1.appendChild(h("th"));
      r1.appendChild(h("th", {colspan: 2, "class": "group"}, "estimate"));
      r1.appendChild(h("th", {colspan: 2, "class": "group"}, "measured at the peak"));
      r1.appendChild(h("th"));
      var r2 = h("tr");
      ["category", "device", "host", "device", "host", "measured \u2212 estimate"].forEach(
          function (c) { r2.appendChild(h("th", {}, c)); });
      head.appendChild(r1);
      head.appendChild(r2);
      t.appendChild(head);
      var body = h("tbody");
      function num_td(v) {
        return h("td", {"class": v ? "" : "zero", title: count(v) + " bytes"},
                 v ? mb(v, false) : "\u00b7");
      }
      function diff_td(d) {
        return h("td", {"class": Math.abs(d) < 0.5e3 ? "zero" : d > 0 ? "over" : "under",
                        title: count(d) + " bytes"},
                 Math.abs(d) < 0.5e3 ? "\u00b7" : signedMb(d));
      }
      names.forEach(function (n) {
        var tr = h("tr", {"data-category": n});
        var c = h("td");
        var lab = h("span", {"class": "cat"});
        lab.appendChild(h("span", {"class": "swatch", style: "background:" + colors[n]}));
        lab.appendChild(document.createTextNode(n));
        c.appendChild(lab);
        tr.appendChild(c);
        [est, mea].forEach(function (part) {
          PLACEMENTS.forEach(function (p) { tr.appendChild(num_td(cell(part.categories, n, p))); });
        });
        tr.appendChild(diff_td(total(mea.categories, [n]) - total(est.categories, [n])));
        body.appendChild(tr);
      });
      t.appendChild(body);
      var foot = h("tfoot");
      var sums = h("tr");
      sums.appendChild(h("td", {}, "all cells"));
      [est, mea].forEach(function (part) {
        PLACEMENTS.forEach(function (p) {
          var v = 0;
          names.forEach(function (n) { v += cell(part.categories, n, p); });
          sums.appendChild(num_td(v));
        });
      });
      sums.appendChild(diff_td(total(mea.categories, names) - total(est.categories, names)));
      foot.appendChild(sums);
      var peak = h("tr");
      peak.appendChild(h("td", {}, "peak"));
      var ep = num(est.peak_bytes), mp = num(mea.peak_bytes);
      var epc = h("td", {colspan: 2, title: count(ep) + " bytes"}, mb(ep));
      var mpc = h("td", {colspan: 2, title: count(mp) + " bytes"}, mb(mp));
      peak.appendChild(epc);
      peak.appendChild(mpc);
      peak.appendChild(diff_td(mp - ep));
      foot.appendChild(peak);
      t.appendChild(foot);
      box.appendChild(t);
      box.appendChild(h("p", {"class": "note"}, "MB; hover a number for its exact bytes. " +
                                                 "\u00b7 is zero."));

      var stats = h("div", {"class": "stats"});
      [["peak at step", mea.peak_step === undefined ? "\u2014" : mea.peak_step === 0 ? "set-up" : count(mea.peak_step)],
       ["live at the end", mb(num(mea.current_bytes))],
       ["activations kept", mb(num(mea.activations_kept_bytes))],
       ["activations peak", mb(num(mea.activations_peak_bytes))],
       ["allocations", count(mea.allocations)], ["frees", count(mea.frees)]]
      .concat(mea.resident ? [["RSS before the model", mb(num(obj(mea.resident).idle_bytes))],
                              ["RSS peak", mb(num(obj(mea.resident).peak_bytes))]] : [])
      .forEach(function (kv) {
        var sp = h("span", {}, kv[0] + " ");
        sp.appendChild(h("b", {}, kv[1]));
        stats.appendChild(sp);
      });
      box.appendChild(stats);

      var terms = arr(est.terms).map(obj);
      if (terms.length) {
        var det = h("details");
        det.appendChild(h("summary", {}, "How the estimate was made (" + terms.length +
                                          (terms.length === 1 ? " term)" : " terms)")));
        var ul = h("ul", {"class": "terms"});
        terms.forEach(function (term) {
          var parts = [];
          Object.keys(obj(term.categories)).forEach(function (n) {
            PLACEMENTS.forEach(function (p) {
              var v = cell(term.categories, n, p);
              if (v) parts.push(n + (p === "host" ? " (host) " : " ") + signedMb(v));
            });
          });
          ul.appendChild(h("li", {"class": "term"}, String(term.source) + ": " +
                           (parts.length ? parts.join(", ") : "no change")));
        });
        det.appendChild(ul);
        box.appendChild(det);
      }
      host.appendChild(box);
    });
  }

  try {
    render(JSON.parse(document.getElementById("memrt-report-data").textContent));
    document.body.dataset.rendered = "ok";
  } catch (e) {
    var box = document.getElementById("render-error");
    box.hidden = false;
    document.body.classList.add("failed");
    box.textContent = "The report could not be drawn: " + (e && e.stack ? e.stack : String(e));
    document.body.dataset.rendered = "error: " + (e && e.message ? e.message : String(e));
  }
})();
</script>
</body>
</html>
)html";

}  // namespace

std::string render_memory_report_html(const std::string& report_json) {
  // In JSON a '<' can only stand inside a string, where \u003c means the same character. Escaping
  // every one keeps both "</script>" and "<!--" (which would make the parser look for a second
  // "</script>") out of the script element, so no report text can end it early.
  std::string escaped;
  escaped.reserve(report_json.size() + 64);
  for (char c : report_json) {
    if (c == '<')
      escaped += "\\u003c";
    else
      escaped += c;
  }
  std::string page(kTemplate);
  page.replace(page.find(kPlaceholder), std::strlen(kPlaceholder), escaped);
  return page;
}

}  // namespace memrt
