// shardviz numerics report: where a parallel run of a training step leaves the reference run.
// The module tree, one line per module and per captured tensor, coloured by the largest error in
// units of the tolerance; click a row for its tensor: the layout (drawn by the layout view's code)
// with a per-element error heat-map, the description, and the trace events just before it.
// Hand-written ESM, no bundler; Python prepends common.js. It reads the synced traits (summary,
// selected, title) and asks the kernel for a row's detail through the `detail` command
// ({row: i} -> description, geometry payload, events, and the error as one binary buffer).
//
// DOM contract: the root has data-shardviz-view="numerics"; every tensor row carries
// data-row="<index>", data-status="<status>" and data-module="<module>", the first difference
// data-first="true"; the detail's events carry data-event-id; the inline layout has
// data-shardviz-view="layout" and its shard regions data-rank="<rank>". Every tree line carries
// data-error-bin="<k>" (the colour class of ERR_BINS; the key's swatches data-legend-bin="<k>");
// the agreement matrix is [data-agreement] with cells data-agree="<rank>,<rank>" and
// data-fraction, its groups [data-agreement-group]="<ranks>"; the heat-map's colour bar is
// [data-heat-legend]; the layout's group selector select[data-control=layout-group].

const STATUS_TEXT = {
  ok: "ok",
  differs: "DIFFERS",
  replicas: "REPLICAS DISAGREE",
  shape: "SHAPE DIFFERS",
  unassembled: "not assembled",
  missing: "in one run only",
};
// The tree's colour scale (numerics_mpl.BINS): neutral within tolerance, then how far beyond.
const ERR_BINS = [
  ["within tolerance", "#e6e6e6"],
  ["1-10x tolerance", "#fdd0a2"],
  ["10-1000x", "#fd8d3c"],
  [">1000x, inf or NaN", "#d94801"],
  ["replicas disagree", "#8073ac"],
  ["shape differs", "#542788"],
  ["not compared", "#ffffff"],
];

function errBin(units, status) {
  if (status === "replicas") return 4;
  if (status === "shape") return 5;
  if (status === "unassembled" || status === "missing" || units === null || units === undefined) return 6;
  if (units > 1e3) return 3;
  if (units > 10) return 2;
  return units > 1 ? 1 : 0;
}

function fmtErr(v) {
  if (v === null || v === undefined) return "–";
  if (v === 0) return "0";
  if (v >= 1e300) return "inf";
  return Math.abs(v) >= 1e-3 && Math.abs(v) < 1e4 ? Number(v.toPrecision(2)).toString() : v.toExponential(1);
}

function errColor(units, status) {
  return ERR_BINS[errBin(units, status)][1];
}

// Position on the heat scale [lo, hi] (log10 of error / tolerance, the row's own range).
function heatT(v, lo, hi) {
  if (Number.isNaN(v) || v >= 1e30) return 1;
  const l = Math.log10(Math.max(v, 10 ** lo));
  return Math.max(0, Math.min(1, (l - lo) / (hi - lo)));
}

// "0-3,6" for [0, 1, 2, 3, 6].
function rankRanges(ranks) {
  const out = [];
  let a = null;
  let b = null;
  for (const r of [...ranks].sort((x, y) => x - y)) {
    if (a !== null && r === b + 1) b = r;
    else {
      if (a !== null) out.push(a === b ? `${a}` : `${a}-${b}`);
      a = r;
      b = r;
    }
  }
  if (a !== null) out.push(a === b ? `${a}` : `${a}-${b}`);
  return out.join(",");
}

function render({ model, el, experimental }) {
  const invoke = makeInvoke(model, experimental);
  const root = html("div", { class: "shardviz sv-numerics", "data-shardviz-view": "numerics" }, el);
  const uid = `sv${Math.random().toString(36).slice(2, 9)}`;
  const cache = new Map(); // row -> Promise<[reply, buffers]>
  const head = html("div", { class: "sv-head" }, root);
  const tableBox = html("div", { class: "sv-table-box" }, root);
  const detailBox = html("div", { class: "sv-detail", "aria-live": "polite" }, root);
  const S = () => model.get("summary");

  function setTrait(name, value) {
    model.set(name, value);
    model.save_changes();
  }

  function drawHead() {
    head.replaceChildren();
    const s = S();
    html("div", { class: "sv-title" }, head, model.get("title") || `numerics: ${s.parallel} against ${s.reference}`);
    const pre = html("pre", { class: "sv-summary" }, head);
    pre.textContent = s.head.join("\n");
    const key = html("div", { class: "sv-key" }, head);
    const swatch = (color, text) => {
      const item = html("span", { class: "sv-key-item" }, key);
      html("span", { class: "sv-key-swatch", style: `background:${color}` }, item);
      item.appendChild(document.createTextNode(` ${text}`));
    };
    html("span", { class: "sv-key-title" }, key, "largest error / tolerance:");
    ERR_BINS.forEach(([text, color], k) => {
      swatch(color, text);
      key.lastChild.dataset.legendBin = String(k);
    });
  }

  function drawTable() {
    tableBox.replaceChildren();
    const s = S();
    const L = s.lines;
    const R = s.rows;
    const sel = model.get("selected");
    const table = html("table", { class: "sv-numerics-table" }, tableBox);
    const hr = html("tr", {}, html("thead", {}, table));
    for (const c of ["module / tensor", "phase", "shape", "dtype", "max abs", "max rel", "error / tol", "status"]) html("th", {}, hr, c);
    const body = html("tbody", {}, table);
    for (let k = 0; k < L.depth.length; k++) {
      const i = L.row[k];
      const pad = `${8 + 14 * L.depth[k]}px`;
      if (i < 0) {
        const bin = errBin(L.worst[k], L.status[k]);
        const tr = html("tr", { class: "sv-module-row", "data-status": L.status[k], "data-error-bin": bin, style: `--sv-err:${ERR_BINS[bin][1]}` }, body);
        const td = html("td", { colspan: 6, style: `padding-left:${pad}` }, tr, L.name[k]);
        td.title = L.name[k];
        html("td", { class: "sv-num", style: `background:${errColor(L.worst[k], L.status[k])}` }, tr, fmtErr(L.worst[k]));
        html("td", {}, tr, L.status[k] === "ok" ? "" : STATUS_TEXT[L.status[k]]);
        continue;
      }
      const attrs = {
        class: `sv-row sv-status-${R.status[i]}${i === sel ? " sv-selected" : ""}`,
        "data-row": i,
        "data-status": R.status[i],
        "data-module": R.module[i],
        "data-error-bin": errBin(R.worst[i], R.status[i]),
        style: `--sv-err:${errColor(R.worst[i], R.status[i])}`,
        tabindex: 0,
      };
      if (i === s.first) attrs["data-first"] = "true";
      const tr = html("tr", attrs, body);
      const call = R.call[i] ? ` #${R.call[i]}` : "";
      html("td", { style: `padding-left:${pad}` }, tr, `${R.what[i]}${call}`);
      html("td", {}, tr, R.phase[i]);
      html("td", {}, tr, R.shape[i] === null ? "–" : fmtShape(R.shape[i]));
      html("td", {}, tr, R.dtype[i]);
      html("td", { class: "sv-num" }, tr, fmtErr(R.max_abs[i]));
      html("td", { class: "sv-num" }, tr, fmtErr(R.max_rel[i]));
      html("td", { class: "sv-num", style: `background:${errColor(R.worst[i], R.status[i])}`, title: `tolerance: ${R.tolerance[i]}` }, tr, fmtErr(R.worst[i]));
      html("td", { class: i === s.first ? "sv-first" : "" }, tr, (i === s.first ? "first: " : "") + STATUS_TEXT[R.status[i]]);
    }
  }

  function fetchDetail(i) {
    if (!cache.has(i)) {
      const p = invoke("detail", { row: i }).then(([reply, buffers]) => {
        if (!reply || reply.error) throw new Error(reply ? reply.error : "no reply");
        return [reply, buffers];
      });
      p.catch(() => cache.delete(i));
      cache.set(i, p);
    }
    return cache.get(i);
  }

  async function drawDetail() {
    detailBox.replaceChildren();
    const s = S();
    const i = model.get("selected");
    if (!(i >= 0 && i < s.rows.what.length)) {
      html("div", { class: "sv-note" }, detailBox, "click a row to see its tensor: layout, error per element, and the collectives before it");
      return;
    }
    const wait = html("div", { class: "sv-note" }, detailBox, "loading…");
    let reply;
    let buffers;
    try {
      [reply, buffers] = await fetchDetail(i);
    } catch (err) {
      wait.textContent = `detail unavailable: ${err.message}`;
      return;
    }
    if (model.get("selected") !== i) return;
    wait.remove();
    const box = html("div", { class: "sv-row-detail", "data-detail-row": i }, detailBox);
    const pre = html("pre", { class: "sv-lines" }, box);
    pre.textContent = reply.lines.join("\n");
    if (reply.agreement) drawAgreement(box, reply.agreement);
    if (reply.geometry) drawLayout(html("div", { class: "sv-layout-slot" }, box), reply, buffers, 0);
    else html("div", { class: "sv-note" }, box, "no layout: this tensor was not assembled from shards");
    const ev = html("div", { class: "sv-events" }, box);
    html(
      "div",
      { class: "sv-panel-title" },
      ev,
      reply.events_during ? "collectives and redistributes while it ran" : "collectives and redistributes just before it",
    );
    if (!reply.events.length) html("div", { class: "sv-note" }, ev, "none recorded");
    const ul = html("ul", {}, ev);
    for (const e of reply.events)
      html("li", { "data-event-id": e.id, class: `sv-event sv-event-${e.kind}`, title: `#${e.id} ${e.text}` }, ul, `#${e.id} ${e.text}`);
  }

  // Which ranks agree with which: one cell per pair of copies, shaded by the fraction of elements
  // they share, each group of agreeing ranks outlined and named.
  function drawAgreement(box, a) {
    const wrap = html("div", { class: "sv-agreement", "data-agreement": "true" }, box);
    html("div", { class: "sv-panel-title" }, wrap, `which ranks agree (${a.scope})`);
    const n = a.ranks.length;
    const cell = Math.max(6, Math.min(22, Math.floor(220 / Math.max(n, 1))));
    const groupOf = new Map();
    a.groups.forEach((g, k) => {
      for (const r of g) groupOf.set(r, k);
    });
    const grid = html("div", { class: "sv-agree-grid", style: `grid-template-columns:auto repeat(${n}, ${cell}px)` }, wrap);
    html("span", {}, grid, "");
    for (const r of a.ranks) html("span", { class: "sv-agree-tick" }, grid, n <= 16 ? String(r) : "");
    a.ranks.forEach((r, i) => {
      html("span", { class: "sv-agree-tick" }, grid, n <= 16 ? String(r) : "");
      a.ranks.forEach((c, j) => {
        const f = a.matrix[i][j];
        const [cr, cg, cb] = lerpColor("#f7fcf5", "#00441b", f);
        const same = groupOf.get(r) === groupOf.get(c);
        html(
          "span",
          {
            class: `sv-agree-cell${same ? " sv-agree-same" : ""}`,
            "data-agree": `${r},${c}`,
            "data-fraction": String(f),
            style: `width:${cell}px;height:${cell}px;background:rgb(${cr},${cg},${cb})`,
            title: `ranks ${r} and ${c}: ${Math.round(f * 100)}% of elements agree`,
          },
          grid,
        );
      });
    });
    const key = html("div", { class: "sv-agree-groups" }, wrap);
    a.groups.forEach((g, k) => {
      html("span", { class: "sv-agree-group", "data-agreement-group": g.join(",") }, key, `${k === 0 ? "agree" : "differ"}: ranks ${rankRanges(g)}`);
    });
    html("div", { class: "sv-note" }, wrap, "dark: the two ranks' copies agree on every element; pale: on none");
  }

  function drawLayout(box, reply, buffers, group) {
    const geo = prepare(reply.geometry);
    const inst = geo.instances[group];
    const lay = html("div", { class: "sv-layout sv-inline-layout", "data-shardviz-view": "layout", "data-layout-group": group }, box);
    const controls = html("div", { class: "sv-controls" }, lay);
    const main = html("div", { class: "sv-main" }, lay);
    const tensorBox = html("div", { class: "sv-tensor" }, main);
    const meshBox = html("div", { class: "sv-mesh" }, main);
    const fillFor = (rank, defs, used) => makeFill(uid, geo.palette)(rank, defs, used);
    const nd = geo.global_shape.length;
    const rd = nd >= 2 ? nd - 2 : null;
    const cd = nd >= 1 ? nd - 1 : null;
    const idx = (reply.index || new Array(nd).fill(0)).slice();
    const vals = reply.heat && buffers.length ? decodeValues(reply.heat, buffers[0]) : null;
    const title = reply.inferred ? "layout inferred from shapes" : "layout";
    const panelTitle = html(
      "div",
      { class: "sv-panel-title" },
      tensorBox,
      `${title} · ${fmtShape(geo.global_shape)}${nd > 2 ? ` at [${idx.slice(0, nd - 2).join(", ")}, :, :]` : ""}`,
    );
    if (geo.instances.length > 1) {
      // Each group of the mesh holds its own copy: choose which one the layout draws.
      const lab = html("label", { class: "sv-group-pick" }, panelTitle, " · group ");
      const pick = html("select", { "data-control": "layout-group" }, lab);
      geo.instances.forEach((_, k) => {
        const o = html("option", { value: String(k) }, pick, `${k} of ${geo.instances.length}`);
        if (k === group) o.selected = true;
      });
      pick.addEventListener("change", () => {
        box.replaceChildren();
        drawLayout(box, reply, buffers, Number(pick.value));
      });
    }
    if (geo.global_shape.includes(0)) {
      html("div", { class: "sv-empty-tensor" }, tensorBox, `empty tensor ${fmtShape(geo.global_shape)}`);
      drawMeshGrids(inst, meshBox, { uid, fillFor, px: 220 });
      return;
    }
    const st = drawTensorGrid(inst, tensorBox, { rd, cd, idx, uid, fillFor, px: 300 });
    drawMeshGrids(inst, meshBox, { uid, fillFor, px: 220 });
    if (geo.partial) html("div", { class: "sv-note" }, lay, "hatched: a Partial value, each rank holds a summand of every element");
    const legend = html("div", { class: "sv-heat-legend", "data-heat-legend": "true" }, lay);
    if (!vals) {
      legend.textContent = "no per-element error for this row";
      return;
    }
    const lab = html("label", { class: "sv-toggle" }, controls);
    const toggle = html("input", { type: "checkbox", "data-control": "error-heatmap" }, lab);
    toggle.checked = true;
    lab.appendChild(
      document.createTextNode(" error heat-map (off: the ranks that hold each element; diagonal stripes: held by several ranks, one stripe colour per rank)"),
    );
    toggle.addEventListener("change", () => {
      lay.classList.toggle("sv-heat-on", toggle.checked);
      legend.hidden = !toggle.checked;
    });
    const [lo, hi] = reply.heat_range || [-6, 2];
    drawHeat(st, vals, idx, lo, hi);
    lay.classList.add("sv-heat-on");
    html("span", {}, legend, `where it differs: error / tolerance per element, log scale 1e${lo} `);
    html("span", { class: "sv-colorbar", style: `background:linear-gradient(to right, ${VIRIDIS.join(",")})` }, legend);
    const tolAt = lo >= 0 ? "every element beyond the tolerance" : `the tolerance at ${Math.round(((0 - lo) / (hi - lo)) * 100)}%`;
    html("span", {}, legend, ` 1e${hi}+ (${tolAt}; scaled to this row's errors)`);
    if (reply.nonfinite) html("span", { class: "sv-note" }, legend, ` · ${reply.nonfinite} inf/NaN drawn at the top`);
    if (vals.step.some((x) => x > 1)) html("span", { class: "sv-note" }, legend, ` · sampled every ${vals.step.join("×")} elements`);
  }

  function drawHeat(st, vals, idx, lo, hi) {
    const { rd, cd } = st;
    const step = vals.step;
    const rows = rd === null ? 1 : vals.shape[rd];
    const cols = cd === null ? 1 : vals.shape[cd];
    let base = 0;
    for (let d = 0; d < vals.shape.length; d++) if (d !== rd && d !== cd) base += Math.floor(idx[d] / step[d]) * vals.strides[d];
    const rs = rd === null ? 0 : vals.strides[rd];
    const cs = cd === null ? 0 : vals.strides[cd];
    const canvas = st.canvas;
    canvas.width = cols;
    canvas.height = rows;
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(cols, rows);
    for (let i = 0; i < rows; i++)
      for (let j = 0; j < cols; j++) {
        const rgb = heatRGB(heatT(vals.heat(base + i * rs + j * cs), lo, hi));
        const o = 4 * (i * cols + j);
        img.data[o] = rgb[0];
        img.data[o + 1] = rgb[1];
        img.data[o + 2] = rgb[2];
        img.data[o + 3] = 255;
      }
    ctx.putImageData(img, 0, 0);
  }

  const markSelected = selectableRows(root, tableBox, model, setTrait);
  const onSelected = () => {
    markSelected();
    drawDetail();
  };
  const onSummary = () => {
    cache.clear();
    drawHead();
    drawTable();
    drawDetail();
  };
  const unlisten = listen(model, [
    ["change:summary", onSummary],
    ["change:selected", onSelected],
    ["change:title", drawHead],
  ]);
  drawHead();
  drawTable();
  drawDetail();
  root.dataset.ready = "true";

  return () => {
    unlisten();
    root.remove();
  };
}

export default { render };
