// Small SVG charts for the report pages (no library, nothing fetched): every <figure class="chart">
// names a JSON data block {kind: "bars"|"lines", x: [labels], unit, title, series: [{name, values}]}.
// null values are gaps. Drawn at the box's real width and redrawn when it changes, so text stays
// readable on a phone. The page's tables hold the same figures for screen readers and copying.
"use strict";
(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const HEIGHT = 220;
  const PAD = { top: 12, right: 12, bottom: 28, left: 56 };

  function el(name, attrs, parent) {
    const node = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (parent) parent.appendChild(node);
    return node;
  }

  // The top of the y axis: a round number; for counts, one whose quarters (the grid lines) are whole.
  function niceMax(v, unit) {
    if (!(v > 0)) return unit === "ms" ? 1 : 4;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    let top = 10 * p;
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) { top = m * p; break; }
    return unit === "ms" || top % 4 === 0 ? top : Math.ceil(top / 4) * 4;
  }

  function fmt(v, unit) {
    if (v === null || v === undefined) return "no data";
    if (unit === "ms") return v >= 1000 ? (v / 1000).toFixed(2) + " s" : (v >= 10 ? v.toFixed(0) : v.toFixed(1)) + " ms";
    if (v >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (v >= 1e4) return (v / 1e3).toFixed(0) + "k";
    return Number.isInteger(v) ? String(v) : v.toFixed(1);
  }

  function draw(area, data, captionId) {
    area.textContent = "";
    const width = Math.max(260, area.clientWidth || 600);
    const svg = el("svg", { viewBox: `0 0 ${width} ${HEIGHT}`, width: width, height: HEIGHT, role: "img",
                            "aria-labelledby": captionId }, area);
    // Points worth drawing: zero counts (empty buckets) and gaps (null) are not.
    const values = data.series.flatMap((s) => s.values).filter((v) => v !== null && v !== undefined && v !== 0);
    const top = Math.max(0, ...values);
    const max = niceMax(top, data.unit);
    svg.dataset.points = String(values.length);
    svg.dataset.max = String(top);
    el("desc", {}, svg).textContent = values.length
      ? `${data.x.length} ${data.x.length === 1 ? "bucket" : "buckets"}, highest ${fmt(top, data.unit)}; the table below lists every value.`
      : "No data in this range.";
    const w = width - PAD.left - PAD.right, h = HEIGHT - PAD.top - PAD.bottom;
    const y = (v) => PAD.top + h - (v / max) * h;
    for (let i = 0; i <= 4; i++) {
      const v = (max * i) / 4, yy = y(v);
      el("line", { x1: PAD.left, x2: PAD.left + w, y1: yy, y2: yy, class: i ? "grid" : "axis" }, svg);
      el("text", { x: PAD.left - 6, y: yy + 4, "text-anchor": "end" }, svg).textContent = fmt(v, data.unit);
    }
    const n = data.x.length, step = n ? w / n : w;
    const every = Math.max(1, Math.ceil(n / Math.max(1, Math.floor(w / 80))));
    data.x.forEach((label, i) => {
      if (i % every) return;
      el("text", { x: PAD.left + step * (i + 0.5), y: HEIGHT - 8, "text-anchor": "middle" }, svg).textContent = label;
    });
    if (!values.length) {
      el("text", { x: PAD.left + w / 2, y: PAD.top + h / 2, "text-anchor": "middle", class: "empty" }, svg)
        .textContent = "No requests in this range";
    } else if (data.kind === "bars") {
      const k = data.series.length, bw = Math.max(1, (step * 0.8) / k);
      data.series.forEach((s, j) => s.values.forEach((v, i) => {
        if (!v) return;
        const bar = el("rect", { x: PAD.left + step * i + step * 0.1 + j * bw, y: y(v), width: bw,
                                 height: Math.max(1, PAD.top + h - y(v)), class: `bar series-${j}` }, svg);
        el("title", {}, bar).textContent = `${data.x[i]} — ${s.name}: ${fmt(v, data.unit)}`;
      }));
    } else {
      data.series.forEach((s, j) => {
        let d = "", pen = false;
        s.values.forEach((v, i) => {
          if (v === null || v === undefined) { pen = false; return; }
          d += `${pen ? "L" : "M"}${(PAD.left + step * (i + 0.5)).toFixed(1)},${y(v).toFixed(1)}`;
          pen = true;
        });
        el("path", { d: d, class: `line series-${j}` }, svg);
        s.values.forEach((v, i) => {
          if (v === null || v === undefined) return;
          const dot = el("circle", { cx: PAD.left + step * (i + 0.5), cy: y(v), r: 3, class: `series-${j}` }, svg);
          el("title", {}, dot).textContent = `${data.x[i]} — ${s.name}: ${fmt(v, data.unit)}`;
        });
      });
    }
  }

  function legend(figure, data) {
    const list = document.createElement("ul");
    list.className = "legend";
    data.series.forEach((s, j) => {
      const item = document.createElement("li");
      const swatch = document.createElement("span");
      swatch.className = `swatch series-${j}`;
      swatch.setAttribute("aria-hidden", "true");
      item.append(swatch, s.name);
      list.appendChild(item);
    });
    figure.appendChild(list);
  }

  document.querySelectorAll("figure.chart[data-chart]").forEach((figure) => {
    const block = document.getElementById(figure.dataset.chart);
    const area = figure.querySelector(".chart-area");
    const caption = figure.querySelector("figcaption");
    if (!block || !area || !caption) return;
    const data = JSON.parse(block.textContent);
    legend(figure, data);
    let width = 0;
    const redraw = () => {
      if (area.clientWidth === width) return;
      width = area.clientWidth;
      draw(area, data, caption.id);
    };
    redraw();
    if (window.ResizeObserver) new ResizeObserver(redraw).observe(area);
  });
})();
