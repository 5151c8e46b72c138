// shardviz layout view: the global tensor coloured by owning rank(s), the mesh beside it.
// Hand-written ESM, no bundler. It reads only the synced traits (geometry, values_info, dims,
// index, heatmap, selected, title) and asks the kernel for values on demand through anywidget's
// command protocol (`fetch_values`), which answers with one binary buffer. The offline HTML export
// supplies the same model and command interface from embedded data.
//
// DOM contract: the root has data-shardviz-view="layout"; every drawn shard region (tensor blocks
// and mesh cells) carries data-rank="<rank>".

const SVGNS = "http://www.w3.org/2000/svg";
const TENSOR_PX = 420; // longest side of the tensor drawing
const MESH_PX = 360; // longest side of one 2-D mesh grid
const MAX_BLOCKS = 40000; // beyond this, cuts are merged to whole pixels
const VIRIDIS = ["#440154", "#472d7b", "#3b528b", "#2c728e", "#21918c", "#28ae80", "#5ec962", "#addc30", "#fde725"];
const NAN_COLOR = "#bbbbbb";
const TABLE_MAX = 16;

function svg(tag, attrs = {}, parent = null) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (parent) parent.appendChild(node);
  return node;
}

function html(tag, attrs = {}, parent = null, text = null) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else node.setAttribute(k, String(v));
  }
  if (text !== null) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

function rankList(ranks) {
  const rs = [...ranks].sort((a, b) => a - b);
  const out = [];
  for (let i = 0; i < rs.length; ) {
    let j = i;
    while (j + 1 < rs.length && rs[j + 1] === rs[j] + 1) j++;
    out.push(i === j ? `${rs[i]}` : `${rs[i]}-${rs[j]}`);
    i = j + 1;
  }
  return out.join(",");
}

function fmtShape(shape) {
  return shape.length ? shape.join("×") : "scalar";
}

function fmtNum(v) {
  if (typeof v === "boolean") return v ? "True" : "False";
  if (Array.isArray(v)) {
    const [re, im] = v;
    return `${fmtNum(re)}${im < 0 || Object.is(im, -0) ? "-" : "+"}${fmtNum(Math.abs(im))}j`;
  }
  if (Number.isNaN(v)) return "nan";
  if (v === Infinity) return "inf";
  if (v === -Infinity) return "-inf";
  if (Number.isInteger(v) && Math.abs(v) < 1e7) return String(v);
  const s = v.toPrecision(4);
  return s.includes("e") ? s : s.replace(/\.?0+$/, "");
}

function lerpColor(a, b, t) {
  const pa = [1, 3, 5].map((i) => parseInt(a.slice(i, i + 2), 16));
  const pb = [1, 3, 5].map((i) => parseInt(b.slice(i, i + 2), 16));
  return pa.map((x, i) => Math.round(x + (pb[i] - x) * t));
}

function heatRGB(t) {
  const x = Math.min(Math.max(t, 0), 1) * (VIRIDIS.length - 1);
  const i = Math.min(Math.floor(x), VIRIDIS.length - 2);
  return lerpColor(VIRIDIS[i], VIRIDIS[i + 1], x - i);
}

// Values as sent by the kernel: {shape, source_shape, step, format, dtype} + one buffer.
function decodeValues(meta, buffer) {
  const bytes = buffer instanceof DataView
    ? buffer.buffer.slice(buffer.byteOffset, buffer.byteOffset + buffer.byteLength)
    : buffer instanceof ArrayBuffer ? buffer : buffer.buffer.slice(buffer.byteOffset, buffer.byteOffset + buffer.byteLength);
  const fmt = meta.format;
  let data;
  if (fmt === "u1") data = new Uint8Array(bytes);
  else if (fmt === "f4" || fmt === "c8") data = new Float32Array(bytes);
  else data = new Float64Array(bytes);
  const complex = fmt === "c8" || fmt === "c16";
  const strides = [];
  let acc = 1;
  for (let d = meta.shape.length - 1; d >= 0; d--) {
    strides[d] = acc;
    acc *= meta.shape[d];
  }
  return {
    ...meta,
    complex,
    strides,
    at(flat) {
      if (complex) return [data[2 * flat], data[2 * flat + 1]];
      return fmt === "u1" ? data[flat] !== 0 : data[flat];
    },
    heat(flat) {
      if (complex) return Math.hypot(data[2 * flat], data[2 * flat + 1]);
      return Number(data[flat]);
    },
  };
}

function makeInvoke(model, experimental) {
  if (experimental && typeof experimental.invoke === "function") {
    return (name, msg) => experimental.invoke(name, msg, { signal: AbortSignal.timeout(30000) });
  }
  // The same wire protocol as anywidget's invoke, for hosts that do not provide it.
  let next = 0;
  return (name, msg) =>
    new Promise((resolve, reject) => {
      const id = `shardviz-${Date.now()}-${next++}`;
      const timer = setTimeout(() => {
        model.off("msg:custom", handler);
        reject(new Error("no reply from the kernel"));
      }, 30000);
      function handler(reply, buffers) {
        if (!reply || reply.id !== id) return;
        clearTimeout(timer);
        model.off("msg:custom", handler);
        resolve([reply.response, buffers]);
      }
      model.on("msg:custom", handler);
      model.send({ id, kind: "anywidget-command", name, msg }, undefined, []);
    });
}

// ---- geometry -------------------------------------------------------------------------------

function prepare(geo) {
  const n = geo.ranks.length;
  const shards = [];
  for (let i = 0; i < n; i++) {
    const runs = geo.runs[i].map((flat) => {
      const out = [];
      for (let k = 0; k < flat.length; k += 2) out.push([flat[k], flat[k + 1]]);
      return out;
    });
    const shape = geo.shapes[i];
    shards.push({
      index: i,
      rank: geo.ranks[i],
      coord: geo.coords[i],
      shape,
      runs,
      empty: shape.includes(0),
      strided: runs.some((r) => r.length > 1),
      offset: runs.map((r, d) => (r.length ? r[0][0] : geo.global_shape[d])),
    });
  }
  const byRank = new Map(shards.map((s) => [s.rank, s]));
  return { ...geo, shards, byRank };
}

function covers(runs, i) {
  for (const [a, b] of runs) if (a <= i && i < b) return true;
  return false;
}

// Cut the drawn slice into blocks of equal ownership (same algorithm as geometry.blocks).
function computeBlocks(geo, rd, cd, index) {
  const ndim = geo.global_shape.length;
  const visible = geo.shards.filter((s) => {
    for (let d = 0; d < ndim; d++) {
      if (d === rd || d === cd) continue;
      if (!covers(s.runs[d], index[d])) return false;
    }
    return true;
  });
  const nrows = rd === null ? 1 : geo.global_shape[rd];
  const ncols = cd === null ? 1 : geo.global_shape[cd];
  const cuts = (dim, n) => {
    const set = new Set([0, n]);
    if (dim !== null) for (const s of visible) for (const [a, b] of s.runs[dim]) set.add(a).add(b);
    return [...set].sort((a, b) => a - b);
  };
  let rcuts = cuts(rd, nrows);
  let ccuts = cuts(cd, ncols);
  let coarse = false;
  if ((rcuts.length - 1) * (ccuts.length - 1) > MAX_BLOCKS) {
    // Too fine to draw one rectangle each: keep at most one cut per pixel.
    const thin = (cs, n) => {
      const out = [cs[0]];
      for (const c of cs) if (Math.floor((c * TENSOR_PX) / n) > Math.floor((out[out.length - 1] * TENSOR_PX) / n)) out.push(c);
      if (out[out.length - 1] !== cs[cs.length - 1]) out.push(cs[cs.length - 1]);
      return out;
    };
    rcuts = thin(rcuts, nrows);
    ccuts = thin(ccuts, ncols);
    coarse = true;
  }
  const owners = (dim, cs) => {
    const lists = [];
    for (let k = 0; k + 1 < cs.length; k++) lists.push([]);
    for (const s of visible) {
      if (dim === null) {
        lists[0].push(s.index);
        continue;
      }
      for (const [a, b] of s.runs[dim]) {
        // every interval [cs[k], cs[k+1]) that overlaps [a, b)
        let lo = 0, hi = cs.length - 1;
        while (lo < hi) {
          const mid = (lo + hi + 1) >> 1;
          if (cs[mid] <= a) lo = mid;
          else hi = mid - 1;
        }
        for (let k = lo; k + 1 < cs.length && cs[k] < b; k++) if (cs[k + 1] > a && lists[k].at(-1) !== s.index) lists[k].push(s.index);
      }
    }
    return lists;
  };
  const rowOwners = owners(rd, rcuts);
  const colOwners = owners(cd, ccuts);
  const colSets = colOwners.map((l) => new Set(l));
  const blocks = [];
  for (let i = 0; i + 1 < rcuts.length; i++) {
    for (let j = 0; j + 1 < ccuts.length; j++) {
      const own = rowOwners[i].filter((x) => colSets[j].has(x)).map((x) => geo.shards[x].rank);
      blocks.push({ r0: rcuts[i], r1: rcuts[i + 1], c0: ccuts[j], c1: ccuts[j + 1], owners: own });
    }
  }
  return { blocks, nrows, ncols, rcuts, ccuts, visible, coarse };
}

// ---- the view -------------------------------------------------------------------------------

function render({ model, el, experimental }) {
  const invoke = makeInvoke(model, experimental);
  const root = html("div", { class: "shardviz sv-layout", "data-shardviz-view": "layout" }, el);
  const uid = `sv${Math.random().toString(36).slice(2, 9)}`;
  const valuesCache = new Map(); // key ("global" or rank) -> Promise<decoded>
  let geo = prepare(model.get("geometry"));
  let hover = null; // ranks highlighted by the pointer
  let shownValues = null; // rank whose values table is open
  const regions = new Map(); // rank -> elements carrying data-rank

  const head = html("div", { class: "sv-head" }, root);
  const controls = html("div", { class: "sv-controls" }, root);
  const main = html("div", { class: "sv-main" }, root);
  const tensorBox = html("div", { class: "sv-tensor" }, main);
  const meshBox = html("div", { class: "sv-mesh" }, main);
  const info = html("div", { class: "sv-info", "aria-live": "polite" }, root);
  const legend = html("div", { class: "sv-legend" }, root);

  const style = (rank) => {
    const p = geo.palette;
    const i = ((rank % p.fill.length) + p.fill.length) % p.fill.length;
    const pat = p.patterns[Math.floor(rank / p.fill.length) % p.patterns.length];
    return { fill: p.fill[i], text: p.text[i], pattern: pat };
  };

  function fillFor(rank, defs, used) {
    const st = style(rank);
    if (st.pattern === "solid") return st.fill;
    const id = `${uid}-p${rank % geo.palette.fill.length}-${st.pattern}`;
    if (!used.has(id)) {
      used.add(id);
      const pat = svg("pattern", { id, patternUnits: "userSpaceOnUse", width: 8, height: 8 }, defs);
      svg("rect", { width: 8, height: 8, fill: st.fill }, pat);
      const ink = st.text === "#FFFFFF" ? "rgba(255,255,255,.75)" : "rgba(0,0,0,.55)";
      if (st.pattern === "diagonal") svg("path", { d: "M-2,2 l4,-4 M0,8 l8,-8 M6,10 l4,-4", stroke: ink, "stroke-width": 1.5 }, pat);
      else if (st.pattern === "dots") svg("circle", { cx: 4, cy: 4, r: 1.6, fill: ink }, pat);
      else svg("path", { d: "M0,4 h8 M4,0 v8", stroke: ink, "stroke-width": 1.2 }, pat);
    }
    return `url(#${id})`;
  }

  function addRegion(node, rank) {
    node.setAttribute("data-rank", String(rank));
    if (!regions.has(rank)) regions.set(rank, []);
    regions.get(rank).push(node);
  }

  function viewDims() {
    const nd = geo.global_shape.length;
    if (nd === 0) return [null, null];
    if (nd === 1) return [null, 0];
    const d = model.get("dims") || [];
    if (d.length === 2 && d[0] !== d[1] && d.every((x) => x >= 0 && x < nd)) return d;
    return [nd - 2, nd - 1];
  }

  function viewIndex() {
    const nd = geo.global_shape.length;
    const idx = (model.get("index") || []).slice(0, nd);
    while (idx.length < nd) idx.push(0);
    return idx.map((v, d) => Math.min(Math.max(v, 0), Math.max(geo.global_shape[d] - 1, 0)));
  }

  function setTrait(name, value) {
    model.set(name, value);
    model.save_changes();
  }

  // ---- header and controls ----

  function drawHead() {
    head.replaceChildren();
    const title = model.get("title");
    const names = geo.mesh_dim_names ? ` (${geo.mesh_dim_names.join(", ")})` : "";
    html("div", { class: "sv-title" }, head, title || `DTensor ${fmtShape(geo.global_shape)} ${geo.dtype}`);
    html(
      "div",
      { class: "sv-sub" },
      head,
      `mesh ${fmtShape(geo.mesh_shape)}${names} · placements [${geo.placements.join(", ")}] · ${geo.ranks.length} ranks`,
    );
  }

  function drawControls() {
    controls.replaceChildren();
    const nd = geo.global_shape.length;
    const [rd, cd] = viewDims();
    const idx = viewIndex();
    if (nd >= 3) {
      const pick = (label, which) => {
        const lab = html("label", {}, controls, `${label} `);
        const sel = html("select", { "data-control": which === 0 ? "rows" : "cols" }, lab);
        for (let d = 0; d < nd; d++) html("option", { value: d }, sel, `dim ${d} (${geo.global_shape[d]})`);
        sel.value = String(which === 0 ? rd : cd);
        sel.addEventListener("change", () => {
          const next = [rd, cd];
          const v = Number(sel.value);
          if (v === next[1 - which]) next[1 - which] = next[which]; // picking the other axis swaps them
          next[which] = v;
          setTrait("dims", next);
        });
      };
      pick("rows:", 0);
      pick("columns:", 1);
      for (let d = 0; d < nd; d++) {
        if (d === rd || d === cd) continue;
        const lab = html("label", { class: "sv-slider" }, controls, `dim ${d} = `);
        const out = html("span", { class: "sv-slider-value" }, lab, String(idx[d]));
        const input = html("input", { type: "range", min: 0, max: Math.max(geo.global_shape[d] - 1, 0), value: idx[d], "data-control": `index-${d}` }, lab);
        input.addEventListener("input", () => {
          out.textContent = input.value;
          const next = viewIndex();
          next[d] = Number(input.value);
          setTrait("index", next);
        });
      }
    }
    const vi = model.get("values_info") || {};
    const lab = html("label", { class: "sv-toggle", title: vi.available ? "" : vi.note || "no values" }, controls);
    const box = html("input", { type: "checkbox", "data-control": "heatmap" }, lab);
    box.checked = !!model.get("heatmap");
    box.disabled = !vi.available;
    lab.appendChild(document.createTextNode(" value heat-map"));
    box.addEventListener("change", () => setTrait("heatmap", box.checked));
    if (geo.ranks.length > 16) {
      const gl = html("label", {}, controls, "rank ");
      const go = html("input", { type: "number", min: Math.min(...geo.ranks), max: Math.max(...geo.ranks), "data-control": "goto", class: "sv-goto" }, gl);
      go.addEventListener("change", () => {
        const r = Number(go.value);
        if (geo.byRank.has(r)) setTrait("selected", r);
      });
    }
  }

  // ---- tensor ----

  let tensorState = null;

  function drawTensor() {
    regions.clear();
    tensorBox.replaceChildren();
    const [rd, cd] = viewDims();
    const idx = viewIndex();
    const gshape = geo.global_shape;
    const heading = html("div", { class: "sv-panel-title" }, tensorBox, `global tensor ${fmtShape(gshape)}`);
    if (gshape.length >= 3) heading.textContent += ` · rows dim ${rd}, columns dim ${cd}`;
    if (gshape.includes(0)) {
      html("div", { class: "sv-empty-tensor" }, tensorBox, `empty tensor ${fmtShape(gshape)}: no elements to draw`);
      tensorState = null;
      return;
    }
    const t0 = performance.now();
    const res = computeBlocks(geo, rd, cd, idx);
    const { nrows, ncols } = res;
    const cell = Math.min(32, TENSOR_PX / Math.max(nrows, ncols));
    const w = Math.max(ncols * cell, 28);
    const h = Math.max(nrows * cell, 28);
    const sx = w / ncols;
    const sy = h / nrows;
    const padL = rd === null ? 8 : 34;
    const padT = 28;
    const padR = 18;
    const wrap = html("div", { class: "sv-tensor-wrap", style: `width:${w + padL + padR}px;height:${h + padT + 4}px` }, tensorBox);
    const canvas = html("canvas", { class: "sv-heat", width: 1, height: 1, style: `left:${padL}px;top:${padT}px;width:${w}px;height:${h}px` }, wrap);
    const root_ = svg("svg", { width: w + padL + padR, height: h + padT + 4, class: "sv-tensor-svg", role: "img", "aria-label": `global tensor ${fmtShape(gshape)}` }, wrap);
    const defs = svg("defs", {}, root_);
    const used = new Set();
    const hatchId = `${uid}-hatch`;
    const hatch = svg("pattern", { id: hatchId, patternUnits: "userSpaceOnUse", width: 6, height: 6, patternTransform: "rotate(45)" }, defs);
    svg("line", { x1: 0, y1: 0, x2: 0, y2: 6, stroke: "#000", "stroke-width": 2, "stroke-opacity": 0.45 }, hatch);
    // axes
    const ax = svg("g", { class: "sv-axis" }, root_);
    svg("text", { x: padL, y: 11, class: "sv-axis-label" }, ax).textContent = cd === null ? "" : `dim ${cd} →`;
    if (rd !== null) {
      const t = svg("text", { x: 10, y: padT + h / 2, class: "sv-axis-label", transform: `rotate(-90 10 ${padT + h / 2})`, "text-anchor": "middle" }, ax);
      t.textContent = `dim ${rd} →`;
    }
    const ticks = (cs, horizontal) => {
      let last = -1e9;
      for (const c of cs) {
        const pos = horizontal ? padL + c * sx : padT + c * sy;
        if (pos - last < 18 && c !== cs[cs.length - 1]) continue;
        last = pos;
        const attrs = horizontal ? { x: pos, y: padT - 3, "text-anchor": "middle" } : { x: padL - 3, y: pos + 3, "text-anchor": "end" };
        svg("text", { ...attrs, class: "sv-tick" }, ax).textContent = String(c);
      }
    };
    if (cd !== null) ticks(res.ccuts, true);
    if (rd !== null) ticks(res.rcuts, false);
    const g = svg("g", { transform: `translate(${padL},${padT})` }, root_);
    const partial = !!geo.partial;
    const maxStripes = geo.max_stripes || 16;
    // Rank labels on every single-owner block or on none, so a dense picture is not half-labelled.
    const fontFor = (b) => Math.min(12, (b.r1 - b.r0) * sy * 0.38);
    const fits = (text, b) => fontFor(b) >= 7 && text.length * fontFor(b) * 0.62 < (b.c1 - b.c0) * sx - 2;
    const singles = res.blocks.filter((b) => b.owners.length === 1);
    const labelSingles = singles.every((b) => fits(`r${b.owners[0]}`, b));
    for (const b of res.blocks) {
      const x = b.c0 * sx, y = b.r0 * sy, bw = (b.c1 - b.c0) * sx, bh = (b.r1 - b.r0) * sy;
      if (!b.owners.length) {
        svg("rect", { x, y, width: bw, height: bh, class: "sv-unowned" }, g);
        continue;
      }
      const bg = svg("g", { class: "sv-block" }, g);
      if (b.owners.length === 1) {
        const rect = svg("rect", { x, y, width: bw, height: bh, fill: fillFor(b.owners[0], defs, used), class: "sv-region" }, bg);
        addRegion(rect, b.owners[0]);
      } else if (b.owners.length <= maxStripes) {
        const k = b.owners.length;
        b.owners.forEach((r, i) => {
          const rect = svg("rect", { x: x + (bw * i) / k, y, width: bw / k, height: bh, fill: fillFor(r, defs, used), class: "sv-region sv-shared" }, bg);
          addRegion(rect, r);
        });
      } else {
        const rect = svg("rect", { x, y, width: bw, height: bh, class: "sv-region sv-many", "data-ranks": b.owners.join(" ") }, bg);
        addRegion(rect, b.owners[0]);
      }
      if (partial) svg("rect", { x, y, width: bw, height: bh, fill: `url(#${hatchId})`, class: "sv-partial" }, bg);
      if (bw >= 5 && bh >= 5) svg("rect", { x, y, width: bw, height: bh, class: "sv-block-edge" }, bg);
      // label: owners, and the local shape of a single owner (uneven / empty shards stand out)
      let label = b.owners.length === 1 ? `r${b.owners[0]}` : b.owners.length <= maxStripes ? `r${rankList(b.owners)}` : `${b.owners.length} ranks`;
      const one = b.owners.length === 1 ? geo.byRank.get(b.owners[0]) : null;
      const sub = one ? fmtShape(one.shape) : partial ? "partial" : "shared";
      const fs = fontFor(b);
      if (fits(label, b) && (b.owners.length > 1 || labelSingles)) {
        const st = b.owners.length === 1 ? style(b.owners[0]) : { text: "#000", fill: "#fff" };
        const cls = b.owners.length === 1 ? "sv-label" : "sv-label sv-label-boxed";
        const two = bh >= fs * 2.6 && sub.length * fs * 0.55 < bw - 2;
        const ty = y + bh / 2 + (two ? -fs * 0.15 : fs * 0.35);
        svg("text", { x: x + bw / 2, y: ty, "font-size": fs, fill: st.text, stroke: st.fill, class: cls, "text-anchor": "middle" }, bg).textContent = label;
        if (two) svg("text", { x: x + bw / 2, y: ty + fs * 1.05, "font-size": fs * 0.85, fill: st.text, stroke: st.fill, class: cls, "text-anchor": "middle" }, bg).textContent = sub;
      }
    }
    // element grid so that every element is visible on small tensors
    if (cell >= 6 && nrows * ncols <= 4096 && nrows * ncols > 1) {
      let d = "";
      for (let i = 1; i < nrows; i++) d += `M0,${i * sy}h${w}`;
      for (let j = 1; j < ncols; j++) d += `M${j * sx},0v${h}`;
      if (d) svg("path", { d, class: "sv-grid" }, g);
    }
    svg("rect", { x: 0, y: 0, width: w, height: h, class: "sv-frame" }, g);
    const outline = svg("g", { class: "sv-outline" }, g);
    tensorState = { rd, cd, idx, sx, sy, w, h, canvas, outline, res };
    if (res.coarse) html("div", { class: "sv-note" }, tensorBox, "very fine shards: neighbouring cuts merged to whole pixels");
    root.dataset.renderMs = String(Math.round(performance.now() - t0));
    if (model.get("heatmap")) drawHeat();
  }

  function drawOutline(rank) {
    if (!tensorState) return;
    const { outline, rd, cd, idx, sx, sy } = tensorState;
    outline.replaceChildren();
    const s = rank === null ? null : geo.byRank.get(rank);
    if (!s || s.empty) return;
    for (let d = 0; d < geo.global_shape.length; d++) {
      if (d !== rd && d !== cd && !covers(s.runs[d], idx[d])) return; // not in this slice
    }
    const rr = rd === null ? [[0, 1]] : s.runs[rd];
    const cc = cd === null ? [[0, 1]] : s.runs[cd];
    for (const [r0, r1] of rr) {
      for (const [c0, c1] of cc) {
        svg("rect", { x: c0 * sx, y: r0 * sy, width: (c1 - c0) * sx, height: (r1 - r0) * sy, class: "sv-outline-rect", "data-outline-rank": rank }, outline);
      }
    }
  }

  // ---- mesh ----

  function drawMesh() {
    meshBox.replaceChildren();
    const ms = geo.mesh_shape;
    const labels = geo.dim_labels;
    html("div", { class: "sv-panel-title" }, meshBox, `mesh ${fmtShape(ms)}`);
    const grids = html("div", { class: "sv-mesh-grids" }, meshBox);
    let rowsN, colsN, lead;
    if (ms.length === 1) {
      colsN = Math.min(ms[0], 32);
      rowsN = Math.ceil(ms[0] / colsN);
      lead = 1;
    } else {
      rowsN = ms[ms.length - 2];
      colsN = ms[ms.length - 1];
      lead = ms.slice(0, -2).reduce((a, b) => a * b, 1);
    }
    const perGrid = ms.length === 1 ? ms[0] : rowsN * colsN;
    const cellPx = Math.max(12, Math.min(48, Math.floor(MESH_PX / Math.max(rowsN, colsN))));
    const defs0 = svg("svg", { width: 0, height: 0, class: "sv-defs" }, grids);
    const defs = svg("defs", {}, defs0);
    const used = new Set();
    const padL = ms.length >= 2 ? 18 : 4;
    const padT = 16;
    for (let gi = 0; gi < lead; gi++) {
      const box = html("div", { class: "sv-mesh-grid" }, grids);
      if (ms.length >= 3) {
        const coord = geo.coords[gi * perGrid];
        const name = coord.slice(0, -2).map((c, m) => `${labels[m]} = ${c}`).join(", ");
        html("div", { class: "sv-grid-title" }, box, name);
      }
      const W = colsN * cellPx + padL + 2, H = rowsN * cellPx + padT + 2;
      const s = svg("svg", { width: W, height: H, role: "group", "aria-label": "mesh" }, box);
      if (ms.length >= 2) {
        svg("text", { x: padL, y: 11, class: "sv-axis-label" }, s).textContent = `${labels[ms.length - 1]} (${colsN}) →`;
        svg("text", { x: 11, y: padT + (rowsN * cellPx) / 2, class: "sv-axis-label", "text-anchor": "middle", transform: `rotate(-90 11 ${padT + (rowsN * cellPx) / 2})` }, s).textContent = `${labels[ms.length - 2]} (${rowsN}) →`;
      } else {
        svg("text", { x: padL, y: 11, class: "sv-axis-label" }, s).textContent = `${labels[0]} (${ms[0]}) →`;
      }
      for (let k = 0; k < perGrid; k++) {
        const sh = geo.shards[gi * perGrid + k];
        const r = Math.floor(k / colsN), c = k % colsN;
        const x = padL + c * cellPx, y = padT + r * cellPx;
        const cellG = svg("g", { class: `sv-cell${sh.empty ? " sv-empty" : ""}`, tabindex: 0, role: "button", "aria-label": `rank ${sh.rank}, coord (${sh.coord.join(", ")}), local shape ${fmtShape(sh.shape)}${sh.empty ? ", empty" : ""}` }, s);
        addRegion(cellG, sh.rank);
        const st = style(sh.rank);
        svg("rect", { x: x + 1, y: y + 1, width: cellPx - 2, height: cellPx - 2, rx: 3, fill: sh.empty ? "#ffffff" : fillFor(sh.rank, defs, used), class: "sv-cell-rect" }, cellG);
        if (geo.partial && !sh.empty) svg("rect", { x: x + 1, y: y + 1, width: cellPx - 2, height: cellPx - 2, rx: 3, class: "sv-partial-cell" }, cellG);
        const fs = Math.min(13, cellPx * 0.36);
        if (cellPx >= 16) {
          const ink = sh.empty ? "#333" : st.text;
          const showShape = cellPx >= 40;
          const halo = sh.empty ? "#ffffff" : st.fill;
          svg("text", { x: x + cellPx / 2, y: y + cellPx / 2 + (showShape ? -1 : fs * 0.35), "font-size": fs, fill: ink, stroke: halo, "text-anchor": "middle", class: "sv-label" }, cellG).textContent = String(sh.rank);
          if (showShape) svg("text", { x: x + cellPx / 2, y: y + cellPx / 2 + fs, "font-size": fs * 0.75, fill: ink, stroke: halo, "text-anchor": "middle", class: "sv-label" }, cellG).textContent = sh.empty ? "empty" : fmtShape(sh.shape);
        }
      }
    }
  }

  // ---- legend ----

  function drawLegend() {
    legend.replaceChildren();
    const list = html("div", { class: "sv-swatches" }, legend);
    const n = geo.shards.length;
    const defs0 = svg("svg", { width: 0, height: 0, class: "sv-defs" }, legend);
    const defs = svg("defs", {}, defs0);
    const used = new Set();
    const shown = n <= 32 ? geo.shards : geo.shards.slice(0, geo.palette.fill.length * geo.palette.patterns.length);
    for (const s of shown) {
      const item = html("span", { class: "sv-swatch-item" }, list);
      const sw = svg("svg", { width: 14, height: 14 }, item);
      svg("rect", { width: 14, height: 14, rx: 2, fill: s.empty ? "#fff" : fillFor(s.rank, defs, used), stroke: "#555", "stroke-dasharray": s.empty ? "2,2" : "" }, sw);
      item.appendChild(document.createTextNode(` r${s.rank} ${fmtShape(s.shape)}`));
    }
    if (n > shown.length) html("span", { class: "sv-note" }, list, `… colours and patterns repeat every ${shown.length} ranks; hover or type a rank to find it`);
    const ul = html("ul", { class: "sv-notes" }, legend);
    for (const line of geo.notes) html("li", {}, ul, line);
    if (geo.shards.some((s) => s.empty)) html("li", {}, ul, "dashed white cell = empty shard (0 elements)");
    if (model.get("heatmap")) html("div", { class: "sv-heat-legend" }, legend);
  }

  // ---- values ----

  function fetchValues(key) {
    if (!valuesCache.has(key)) {
      const msg = key === "global" ? { rank: -1 } : { rank: key };
      const p = invoke("fetch_values", msg).then(([reply, buffers]) => {
        if (!reply || reply.error) throw new Error(reply ? reply.error : "no reply");
        return decodeValues(reply, buffers[0]);
      });
      p.catch(() => valuesCache.delete(key));
      valuesCache.set(key, p);
    }
    return valuesCache.get(key);
  }

  async function drawHeat() {
    if (!tensorState) return;
    const st = tensorState;
    let vals;
    try {
      vals = await fetchValues("global");
    } catch (err) {
      const lg = legend.querySelector(".sv-heat-legend");
      if (lg) lg.textContent = `heat-map unavailable: ${err.message}`;
      return;
    }
    if (st !== tensorState || !model.get("heatmap")) return;
    const lg = legend.querySelector(".sv-heat-legend");
    const { rd, cd, idx } = st;
    const step = vals.step;
    const rows = rd === null ? 1 : vals.shape[rd];
    const cols = cd === null ? 1 : vals.shape[cd];
    let base = 0;
    for (let d = 0; d < vals.shape.length; d++) if (d !== rd && d !== cd) base += Math.floor(idx[d] / step[d]) * vals.strides[d];
    const rs = rd === null ? 0 : vals.strides[rd];
    const cs = cd === null ? 0 : vals.strides[cd];
    let lo = Infinity, hi = -Infinity, nan = 0, pinf = 0, ninf = 0;
    for (let i = 0; i < rows; i++) for (let j = 0; j < cols; j++) {
      const v = vals.heat(base + i * rs + j * cs);
      if (Number.isNaN(v)) nan++;
      else if (v === Infinity) pinf++;
      else if (v === -Infinity) ninf++;
      else { if (v < lo) lo = v; if (v > hi) hi = v; }
    }
    const canvas = st.canvas;
    canvas.width = cols;
    canvas.height = rows;
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(cols, rows);
    const span = hi > lo ? hi - lo : 1;
    const nanRGB = lerpColor(NAN_COLOR, NAN_COLOR, 0);
    for (let i = 0; i < rows; i++) for (let j = 0; j < cols; j++) {
      const v = vals.heat(base + i * rs + j * cs);
      const rgb = Number.isNaN(v) ? nanRGB : v === Infinity ? heatRGB(1) : v === -Infinity ? heatRGB(0) : heatRGB((v - lo) / span);
      const o = 4 * (i * cols + j);
      img.data[o] = rgb[0]; img.data[o + 1] = rgb[1]; img.data[o + 2] = rgb[2]; img.data[o + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
    root.classList.add("sv-heat-on");
    if (lg) {
      lg.replaceChildren();
      html("span", {}, lg, `values ${fmtNum(lo === Infinity ? NaN : lo)} `);
      html("span", { class: "sv-colorbar", style: `background:linear-gradient(to right, ${VIRIDIS.join(",")})` }, lg);
      html("span", {}, lg, ` ${fmtNum(hi === -Infinity ? NaN : hi)}`);
      const extra = [];
      if (nan) extra.push(`${nan} NaN (grey)`);
      if (pinf) extra.push(`${pinf} +inf (top colour)`);
      if (ninf) extra.push(`${ninf} -inf (bottom colour)`);
      if (step.some((s) => s > 1)) extra.push(`sampled every ${step.join("×")} elements`);
      if (vals.complex) extra.push("complex: coloured by magnitude");
      if (extra.length) html("span", { class: "sv-note" }, lg, ` · ${extra.join(" · ")}`);
    }
  }

  function localPos(runs, i) {
    let pos = 0;
    for (const [a, b] of runs) {
      if (a <= i && i < b) return pos + (i - a);
      pos += b - a;
    }
    return -1;
  }

  function globalOf(runs, p) {
    for (const [a, b] of runs) {
      if (p < b - a) return a + p;
      p -= b - a;
    }
    return -1;
  }

  async function showValues(rank, box) {
    box.replaceChildren(html("span", { class: "sv-note" }, null, "loading values…"));
    let vals;
    try {
      vals = await fetchValues(rank);
    } catch (err) {
      box.replaceChildren(html("span", { class: "sv-note" }, null, `values unavailable: ${err.message}`));
      return;
    }
    if (shownValues !== rank) return;
    box.replaceChildren();
    const s = geo.byRank.get(rank);
    const [rd, cd] = viewDims();
    const idx = viewIndex();
    const step = vals.step;
    let base = 0;
    const notes = [];
    for (let d = 0; d < s.shape.length; d++) {
      if (d === rd || d === cd) continue;
      let p = localPos(s.runs[d], idx[d]);
      if (p < 0) {
        notes.push(`dim ${d} = ${idx[d]} is not in this shard: showing its local index 0`);
        p = 0;
      }
      base += Math.floor(p / step[d]) * vals.strides[d];
    }
    const rows = rd === null ? 1 : vals.shape[rd];
    const cols = cd === null ? 1 : vals.shape[cd];
    const table = html("table", { class: "sv-values", "data-values-rank": rank }, box);
    const hr = html("tr", {}, table);
    html("th", {}, hr, "");
    const colIdx = [];
    for (let j = 0; j < Math.min(cols, TABLE_MAX); j++) {
      const g = cd === null ? 0 : globalOf(s.runs[cd], j * step[cd]);
      colIdx.push(g);
      html("th", {}, hr, cd === null ? "" : String(g));
    }
    if (cols > TABLE_MAX) html("th", {}, hr, "…");
    for (let i = 0; i < Math.min(rows, TABLE_MAX); i++) {
      const tr = html("tr", {}, table);
      html("th", {}, tr, rd === null ? "" : String(globalOf(s.runs[rd], i * step[rd])));
      for (let j = 0; j < Math.min(cols, TABLE_MAX); j++) {
        const flat = base + i * (rd === null ? 0 : vals.strides[rd]) + j * (cd === null ? 0 : vals.strides[cd]);
        html("td", {}, tr, fmtNum(vals.at(flat)));
      }
      if (cols > TABLE_MAX) html("td", {}, tr, "…");
    }
    if (rows > TABLE_MAX) html("tr", {}, table).appendChild(html("td", { colspan: Math.min(cols, TABLE_MAX) + 2 }, null, "…"));
    const caption = [`rank ${rank}'s local values (${vals.dtype}); headers are global indices`];
    if (s.shape.length === 0) caption[0] = `rank ${rank}'s value (${vals.dtype})`;
    if (geo.partial) caption.push(`partial: the true value is the ${geo.partial.op} over ${geo.partial.over.join(", ")}`);
    if (step.some((x) => x > 1)) caption.push(`sampled every ${step.join("×")} elements`);
    html("div", { class: "sv-note" }, box, [...caption, ...notes].join(" · "));
  }

  // ---- info panel and highlighting ----

  function describe(rank) {
    const s = geo.byRank.get(rank);
    const parts = [];
    const coord = s.coord.map((c, m) => `${geo.dim_labels[m]}=${c}`).join(", ");
    parts.push(`rank ${rank}`);
    parts.push(`mesh coord (${coord})`);
    parts.push(s.empty ? "empty shard (no global offset)" : `global offset (${s.offset.join(", ")})`);
    parts.push(`local shape (${s.shape.join(", ")})${s.empty ? " · empty" : ""}`);
    return { s, parts };
  }

  function drawInfo() {
    info.replaceChildren();
    const sel = model.get("selected");
    const rank = hover !== null && hover.length === 1 ? hover[0] : geo.byRank.has(sel) ? sel : null;
    if (rank === null) {
      if (hover && hover.length > 1) html("div", {}, info, `ranks ${rankList(hover)} share this block`);
      else html("div", { class: "sv-note" }, info, "hover or click a rank (in the mesh or the tensor) to see its shard");
      return;
    }
    const { s, parts } = describe(rank);
    const line = html("div", { class: "sv-info-line", "data-info-rank": rank }, info);
    const st = style(rank);
    const sw = html("span", { class: "sv-info-swatch", style: `background:${st.fill}` }, line);
    sw.setAttribute("aria-hidden", "true");
    html("strong", {}, line, parts[0]);
    line.appendChild(document.createTextNode(` · ${parts.slice(1).join(" · ")}`));
    const idxLine = s.runs.map((r, d) => `dim ${d}: ${r.length ? r.map(([a, b]) => `${a}:${b}`).join(",") : "—"}`).join(" · ");
    html("div", { class: "sv-info-indices" }, info, `indices ${idxLine}${s.strided ? " (strided: non-contiguous)" : ""}`);
    if (geo.partial) html("div", { class: "sv-info-partial" }, info, `partial value: pending ${geo.partial.op} over ${geo.partial.over.join(", ")}`);
    const vi = model.get("values_info") || {};
    const btnRow = html("div", {}, info);
    const box = html("div", { class: "sv-values-box" }, info);
    if (s.empty) {
      html("span", { class: "sv-note" }, btnRow, "empty shard: it holds no elements");
    } else if (vi.available && (vi.ranks || []).includes(rank)) {
      const btn = html("button", { type: "button", "data-action": "values" }, btnRow, shownValues === rank ? "hide values" : "show values");
      btn.addEventListener("click", () => {
        shownValues = shownValues === rank ? null : rank;
        drawInfo();
      });
      if (shownValues === rank) showValues(rank, box);
    } else {
      html("span", { class: "sv-note" }, btnRow, vi.note || "no values");
    }
  }

  function applyHighlight() {
    const sel = model.get("selected");
    const on = new Set(hover || []);
    if (geo.byRank.has(sel)) on.add(sel);
    root.classList.toggle("sv-hl", on.size > 0);
    for (const node of root.querySelectorAll(".sv-on")) node.classList.remove("sv-on");
    for (const node of root.querySelectorAll(".sv-selected")) node.classList.remove("sv-selected");
    for (const r of on) for (const node of regions.get(r) || []) node.classList.add("sv-on");
    for (const node of root.querySelectorAll(".sv-many")) {
      if (node.dataset.ranks.split(" ").some((r) => on.has(Number(r)))) node.classList.add("sv-on");
    }
    if (geo.byRank.has(sel)) for (const node of regions.get(sel) || []) node.classList.add("sv-selected");
    drawOutline(hover && hover.length === 1 ? hover[0] : geo.byRank.has(sel) ? sel : null);
  }

  function ranksOf(target) {
    const node = target.closest ? target.closest("[data-rank]") : null;
    if (!node || !root.contains(node)) return null;
    if (node.dataset.ranks) return node.dataset.ranks.split(" ").map(Number);
    return [Number(node.dataset.rank)];
  }

  let raf = 0;
  function onOver(ev) {
    const rs = ranksOf(ev.target);
    const same = rs && hover && rs.length === hover.length && rs.every((r, i) => r === hover[i]);
    if (same || (!rs && !hover)) return;
    hover = rs;
    cancelAnimationFrame(raf);
    raf = requestAnimationFrame(() => {
      applyHighlight();
      drawInfo();
    });
  }
  function onLeave() {
    hover = null;
    cancelAnimationFrame(raf);
    raf = requestAnimationFrame(() => {
      applyHighlight();
      drawInfo();
    });
  }
  function select(rs) {
    if (!rs) return;
    const r = rs.length === 1 ? rs[0] : rs[0];
    setTrait("selected", model.get("selected") === r ? -1 : r);
  }
  function onClick(ev) {
    if (ev.target.closest && ev.target.closest("button, input, select")) return;
    select(ranksOf(ev.target));
  }
  function onKey(ev) {
    if (ev.key !== "Enter" && ev.key !== " ") return;
    const rs = ranksOf(ev.target);
    if (!rs) return;
    ev.preventDefault();
    select(rs);
  }
  main.addEventListener("pointerover", onOver);
  main.addEventListener("pointerleave", onLeave);
  main.addEventListener("click", onClick);
  main.addEventListener("keydown", onKey);

  function drawAll() {
    drawHead();
    drawControls();
    drawTensor();
    drawMesh();
    drawLegend();
    applyHighlight();
    drawInfo();
  }

  const onGeometry = () => {
    geo = prepare(model.get("geometry"));
    valuesCache.clear();
    drawAll();
  };
  const onView = () => {
    drawControls();
    drawTensor();
    drawMesh();
    drawLegend();
    applyHighlight();
    drawInfo();
  };
  const onHeat = () => {
    root.classList.remove("sv-heat-on");
    drawLegend();
    if (model.get("heatmap")) drawHeat();
    else if (tensorState) tensorState.canvas.width = 1;
  };
  const onSelected = () => {
    applyHighlight();
    drawInfo();
  };
  const onValuesInfo = () => {
    valuesCache.clear();
    drawControls();
    drawInfo();
  };
  model.on("change:geometry", onGeometry);
  model.on("change:dims", onView);
  model.on("change:index", onView);
  model.on("change:heatmap", onHeat);
  model.on("change:selected", onSelected);
  model.on("change:values_info", onValuesInfo);
  model.on("change:title", drawHead);
  drawAll();
  root.dataset.ready = "true";

  return () => {
    model.off("change:geometry", onGeometry);
    model.off("change:dims", onView);
    model.off("change:index", onView);
    model.off("change:heatmap", onHeat);
    model.off("change:selected", onSelected);
    model.off("change:values_info", onValuesInfo);
    model.off("change:title", drawHead);
    cancelAnimationFrame(raf);
    root.remove();
  };
}

export default { render };
