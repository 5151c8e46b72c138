// shardviz: drawing code shared by the layout view and the collective player.
// Hand-written, no bundler: this file is not a module on its own. Python prepends it to each
// view's ESM (layout.js, player.js) to make one module, so every name here is visible to both.
// Everything reads plain data (the geometry payload of shardviz/views/geometry.py), never torch.

const SVGNS = "http://www.w3.org/2000/svg";
const TENSOR_PX = 420; // longest side of the tensor drawing
const MESH_PX = 360; // longest side of one 2-D mesh grid
const MAX_BLOCKS = 40000; // beyond this, cuts are merged to whole pixels
const VIRIDIS = ["#440154", "#472d7b", "#3b528b", "#2c728e", "#21918c", "#28ae80", "#5ec962", "#addc30", "#fde725"];
const NAN_COLOR = "#bbbbbb";

// Every element of every view is made by svg() or html(): names and text from a trace reach the
// page only as attribute values (setAttribute) and text nodes (textContent), never as markup, so a
// name like `x"><script>` shows as that text. No view writes innerHTML. Inline styles go through
// the CSSOM (node.style), which an exported page's Content-Security-Policy allows while it
// refuses style="..." attributes; event handlers are added with addEventListener, never as on*
// attributes.
function setAttrs(node, attrs) {
  for (const [k, v] of Object.entries(attrs)) {
    if (/^on/i.test(k)) throw new Error(`shardviz: refusing event handler attribute ${k}`);
    if (k === "style") node.style.cssText = String(v);
    else if (k === "class" && !(node instanceof SVGElement)) node.className = String(v);
    else node.setAttribute(k, String(v));
  }
}

function svg(tag, attrs = {}, parent = null) {
  const node = document.createElementNS(SVGNS, tag);
  setAttrs(node, attrs);
  if (parent) parent.appendChild(node);
  return node;
}

function html(tag, attrs = {}, parent = null, text = null) {
  const node = document.createElement(tag);
  setAttrs(node, attrs);
  if (text !== null) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

// Run `fn` when the value of a text or number box is committed: on change, and on Enter, which
// is kept from the notebook (JupyterLab's command mode takes Enter to edit the cell and cancels
// the box's own commit, so Enter did nothing).
function onCommit(input, fn) {
  input.addEventListener("change", () => fn());
  input.addEventListener("keydown", (ev) => {
    if (ev.key !== "Enter") return;
    ev.preventDefault();
    ev.stopPropagation();
    fn();
  });
}

// A table whose rows (tr[data-row] inside `tableBox`) select with a click, Enter or Space: the
// `selected` trait toggles between the row's index and -1. Returns the function that marks the
// selected row (class sv-selected), to call when the trait changes.
function selectableRows(root, tableBox, model, setTrait) {
  function rowOf(target) {
    const tr = target.closest ? target.closest("tr[data-row]") : null;
    return tr && root.contains(tr) ? Number(tr.dataset.row) : null;
  }
  function pick(i) {
    if (i === null) return;
    setTrait("selected", model.get("selected") === i ? -1 : i);
  }
  tableBox.addEventListener("click", (ev) => pick(rowOf(ev.target)));
  tableBox.addEventListener("keydown", (ev) => {
    if (ev.key !== "Enter" && ev.key !== " ") return;
    const i = rowOf(ev.target);
    if (i === null) return;
    ev.preventDefault();
    pick(i);
  });
  return () => {
    for (const tr of tableBox.querySelectorAll("tr.sv-selected")) tr.classList.remove("sv-selected");
    const tr = tableBox.querySelector(`tr[data-row="${model.get("selected")}"]`);
    if (tr) tr.classList.add("sv-selected");
  };
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

// Bytes in words, the rule of shardviz.data.describe.bytes_text: exact below 1 KiB, else one
// decimal in the largest binary unit (a trailing .0 dropped), rounded half up.
const BYTE_UNITS = ["KiB", "MiB", "GiB", "TiB", "PiB"];

function bytesText(n) {
  if (n < 0) return `-${bytesText(-n)}`;
  if (n < 1024) return `${Math.round(n)} B`;
  let v = n;
  let unit = "B";
  for (const u of BYTE_UNITS) {
    if (v < 1024 && unit !== "B") break;
    v /= 1024;
    unit = u;
  }
  return `${Math.round(v * 10) / 10} ${unit}`;
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
  const bytes =
    buffer instanceof DataView
      ? buffer.buffer.slice(buffer.byteOffset, buffer.byteOffset + buffer.byteLength)
      : buffer instanceof ArrayBuffer
        ? buffer
        : buffer.buffer.slice(buffer.byteOffset, buffer.byteOffset + buffer.byteLength);
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

// Subscribe each [event, handler] pair; the returned function undoes exactly those.
function listen(model, pairs) {
  for (const [event, handler] of pairs) model.on(event, handler);
  return () => {
    for (const [event, handler] of pairs) model.off(event, handler);
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
  const out = { ...geo, shards, byRank };
  // A sub-mesh exists once per group of ranks: each group is drawn from its own geometry, a copy
  // of this one with that group's shards only (re-indexed, as computeBlocks expects).
  const groupOf = geo.group_of || [];
  const ngroups = (geo.groups || []).length;
  for (const s of shards) s.group = groupOf[s.index] || 0;
  if (ngroups > 1) {
    out.instances = geo.groups.map((ranks, g) => {
      const own = shards.filter((s) => s.group === g).map((s, i) => ({ ...s, index: i }));
      return { ...geo, ranks, shards: own, byRank: new Map(own.map((s) => [s.rank, s])), group: g };
    });
  } else {
    out.instances = [{ ...out, group: 0 }];
  }
  return out;
}

function covers(runs, i) {
  for (const [a, b] of runs) if (a <= i && i < b) return true;
  return false;
}

// Cut the drawn slice into blocks of equal ownership (same algorithm as geometry.blocks).
function computeBlocks(geo, rd, cd, index, px = TENSOR_PX) {
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
      for (const c of cs) if (Math.floor((c * px) / n) > Math.floor((out[out.length - 1] * px) / n)) out.push(c);
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
        let lo = 0,
          hi = cs.length - 1;
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

// ---- rank colours ---------------------------------------------------------------------------

// (fill, text, pattern) of a rank from the palette geometry.py sends: the same in every view.
function rankStyle(palette, rank) {
  const i = ((rank % palette.fill.length) + palette.fill.length) % palette.fill.length;
  const pat = palette.patterns[Math.floor(rank / palette.fill.length) % palette.patterns.length];
  return { fill: palette.fill[i], text: palette.text[i], pattern: pat };
}

// A fill for a rank: its colour, or an SVG pattern (ranks past the palette) added to `defs` once.
function makeFill(uid, palette) {
  return function fillFor(rank, defs, used) {
    const st = rankStyle(palette, rank);
    if (st.pattern === "solid") return st.fill;
    const id = `${uid}-p${rank % palette.fill.length}-${st.pattern}`;
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
  };
}

// Diagonal stripes over a w x h block for k owners: per owner, the polygons of its stripes (the
// block cut by the lines u + v = const, stripe i mod k going to owner i). Same cut as
// views/mpl.py:_stripes.
function diagonalStripes(w, h, k) {
  const width = Math.min(10, Math.max(3, (w + h) / Math.max(6, 3 * k)));
  const out = Array.from({ length: k }, () => []);
  const clip = (poly, keep) => {
    const res = [];
    for (let i = 0; i < poly.length; i++) {
      const a = poly[i],
        b = poly[(i + 1) % poly.length];
      const fa = keep(a),
        fb = keep(b);
      if (fa >= 0) res.push(a);
      if (fa >= 0 !== fb >= 0) {
        const t = fa / (fa - fb);
        res.push([a[0] + t * (b[0] - a[0]), a[1] + t * (b[1] - a[1])]);
      }
    }
    return res;
  };
  let m = 0;
  for (let c = 0; c < w + h; c += width, m++) {
    let poly = [
      [0, 0],
      [w, 0],
      [w, h],
      [0, h],
    ];
    poly = clip(poly, ([u, v]) => u + v - c);
    poly = clip(poly, ([u, v]) => c + width - (u + v));
    if (poly.length >= 3) out[m % k].push(poly);
  }
  return out;
}

// ---- drawing a layout (the layout view's tensor and mesh; the player's before / after) -------

// The drawn slice of the global tensor, each block coloured by its owner(s), into `box`.
// opts: rd, cd, idx (view dims and slider positions), uid, fillFor, addRegion(node, rank), px.
// Returns what the layout view needs to overlay a heat-map and an outline.
const TICK_CHAR_PX = 6; // width of a digit of a tick label (.sv-tick, 9 px), generously

function drawTensorGrid(geo, box, opts) {
  const { rd, cd, idx, uid, fillFor } = opts;
  const addRegion = opts.addRegion || ((node, rank) => node.setAttribute("data-rank", String(rank)));
  const px = opts.px || TENSOR_PX;
  const gshape = geo.global_shape;
  const style = (rank) => rankStyle(geo.palette, rank);
  const res = computeBlocks(geo, rd, cd, idx, px);
  const { nrows, ncols } = res;
  const cell = Math.min(32, px / Math.max(nrows, ncols));
  const w = Math.max(ncols * cell, 28);
  const h = Math.max(nrows * cell, 28);
  const sx = w / ncols;
  const sy = h / nrows;
  // room for the rotated axis title and the widest row tick (4-digit rows of a big tensor too)
  const tickChars = rd === null ? 0 : Math.max(...res.rcuts.map((c) => String(c).length));
  const padL = rd === null ? 8 : Math.max(34, 22 + TICK_CHAR_PX * tickChars);
  const padT = 28;
  const padR = 18;
  const wrap = html("div", { class: "sv-tensor-wrap", style: `width:${w + padL + padR}px;height:${h + padT + 4}px` }, box);
  const canvas = html("canvas", { class: "sv-heat", width: 1, height: 1, style: `left:${padL}px;top:${padT}px;width:${w}px;height:${h}px` }, wrap);
  const root_ = svg(
    "svg",
    { width: w + padL + padR, height: h + padT + 4, class: "sv-tensor-svg", role: "img", "aria-label": `global tensor ${fmtShape(gshape)}` },
    wrap,
  );
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
    // read bottom to top, so the arrow leads: rotated, "←" points down, the way row indices grow
    t.textContent = `← dim ${rd}`;
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
    const x = b.c0 * sx,
      y = b.r0 * sy,
      bw = (b.c1 - b.c0) * sx,
      bh = (b.r1 - b.r0) * sy;
    if (!b.owners.length) {
      svg("rect", { x, y, width: bw, height: bh, class: "sv-unowned" }, g);
      continue;
    }
    const bg = svg("g", { class: "sv-block" }, g);
    if (b.owners.length === 1) {
      const rect = svg("rect", { x, y, width: bw, height: bh, fill: fillFor(b.owners[0], defs, used), class: "sv-region" }, bg);
      addRegion(rect, b.owners[0]);
    } else if (b.owners.length <= maxStripes) {
      // diagonal stripes, one colour per owner in turn: shared, never read as a split into columns
      diagonalStripes(bw, bh, b.owners.length).forEach((polys, i) => {
        const r = b.owners[i];
        const d = polys.map((pts) => `M${pts.map(([u, v]) => `${(x + u).toFixed(2)},${(y + v).toFixed(2)}`).join("L")}Z`).join("");
        const path = svg("path", { d, fill: fillFor(r, defs, used), class: "sv-region sv-shared" }, bg);
        addRegion(path, r);
      });
    } else {
      const rect = svg("rect", { x, y, width: bw, height: bh, class: "sv-region sv-many", "data-ranks": b.owners.join(" ") }, bg);
      addRegion(rect, b.owners[0]);
    }
    if (partial) svg("rect", { x, y, width: bw, height: bh, fill: `url(#${hatchId})`, class: "sv-partial" }, bg);
    if (bw >= 5 && bh >= 5) svg("rect", { x, y, width: bw, height: bh, class: "sv-block-edge" }, bg);
    // label: owners, and the local shape of a single owner (uneven / empty shards stand out)
    const label = b.owners.length === 1 ? `r${b.owners[0]}` : b.owners.length <= maxStripes ? `r${rankList(b.owners)}` : `${b.owners.length} ranks`;
    const one = b.owners.length === 1 ? geo.byRank.get(b.owners[0]) : null;
    const sub = one ? fmtShape(one.shape) : partial ? "partial" : "shared";
    const fs = fontFor(b);
    if (fits(label, b) && (b.owners.length > 1 || labelSingles)) {
      const st = b.owners.length === 1 ? style(b.owners[0]) : { text: "#000", fill: "#fff" };
      const cls = b.owners.length === 1 ? "sv-label" : "sv-label sv-label-boxed";
      const two = bh >= fs * 2.6 && sub.length * fs * 0.55 < bw - 2;
      const ty = y + bh / 2 + (two ? -fs * 0.15 : fs * 0.35);
      svg("text", { x: x + bw / 2, y: ty, "font-size": fs, fill: st.text, stroke: st.fill, class: cls, "text-anchor": "middle" }, bg).textContent = label;
      if (two)
        svg(
          "text",
          { x: x + bw / 2, y: ty + fs * 1.05, "font-size": fs * 0.85, fill: st.text, stroke: st.fill, class: cls, "text-anchor": "middle" },
          bg,
        ).textContent = sub;
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
  if (res.coarse) html("div", { class: "sv-note" }, box, "very fine shards: neighbouring cuts merged to whole pixels");
  return { rd, cd, idx, sx, sy, w, h, canvas, outline, res };
}

// A layout's tensor (into tensorBox) and mesh (into meshBox) with its first view dims, one picture
// per group of a sub-mesh, up to `most` groups: each group holds the whole tensor with its own
// values, so ranks of different groups are never drawn as one tensor "shared" between them.
// opts: uid, fillFor, tensorPx, meshPx, most.
function drawLayoutGroups(geo, tensorBox, meshBox, opts) {
  const nd = geo.global_shape.length;
  const rd = nd >= 2 ? nd - 2 : null;
  const cd = nd >= 1 ? nd - 1 : null;
  const idx = new Array(nd).fill(0);
  const insts = geo.instances || [geo];
  const shown = insts.slice(0, opts.most || 4);
  for (const inst of shown) {
    const many = insts.length > 1;
    const title = many ? `group ${inst.group}: ranks ${rankList(inst.ranks)}` : null;
    const tb = many ? html("div", { class: "sv-group", "data-group": inst.group }, tensorBox) : tensorBox;
    if (title) html("div", { class: "sv-grid-title" }, tb, title);
    if (geo.global_shape.includes(0)) html("div", { class: "sv-empty-tensor" }, tb, `empty tensor ${fmtShape(geo.global_shape)}`);
    else drawTensorGrid(inst, tb, { rd, cd, idx, uid: `${opts.uid}g${inst.group}`, fillFor: opts.fillFor, px: opts.tensorPx });
    const mb = many ? html("div", { class: "sv-group", "data-group": inst.group }, meshBox) : meshBox;
    drawMeshGrids(inst, mb, {
      uid: `${opts.uid}g${inst.group}`,
      fillFor: opts.fillFor,
      px: opts.meshPx,
      title: title ? `mesh ${fmtShape(geo.mesh_shape)} · ${title}` : undefined,
    });
  }
  if (shown.length < insts.length) html("div", { class: "sv-note" }, tensorBox, `${insts.length - shown.length} more groups hold the same tensor (not drawn)`);
}

// The mesh: 1-D a row, 2-D a grid, 3-D+ a stack of 2-D grids, each cell a rank, into `box`.
// opts: uid, fillFor, addRegion(node, rank), px (longest side of one grid).
function drawMeshGrids(geo, box, opts) {
  const { fillFor } = opts;
  const addRegion = opts.addRegion || ((node, rank) => node.setAttribute("data-rank", String(rank)));
  const px = opts.px || MESH_PX;
  const ms = geo.mesh_shape;
  const labels = geo.dim_labels;
  html("div", { class: "sv-panel-title" }, box, opts.title || `mesh ${fmtShape(ms)}`);
  const grids = html("div", { class: "sv-mesh-grids" }, box);
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
  const cellPx = Math.max(12, Math.min(48, Math.floor(px / Math.max(rowsN, colsN))));
  const defs0 = svg("svg", { width: 0, height: 0, class: "sv-defs" }, grids);
  const defs = svg("defs", {}, defs0);
  const used = new Set();
  const padL = ms.length >= 2 ? 18 : 4;
  const padT = 16;
  for (let gi = 0; gi < lead; gi++) {
    const gbox = html("div", { class: "sv-mesh-grid" }, grids);
    if (ms.length >= 3) {
      const coord = geo.coords[gi * perGrid];
      const name = coord
        .slice(0, -2)
        .map((c, m) => `${labels[m]} = ${c}`)
        .join(", ");
      html("div", { class: "sv-grid-title" }, gbox, name);
    }
    const W = colsN * cellPx + padL + 2,
      H = rowsN * cellPx + padT + 2;
    const s = svg("svg", { width: W, height: H, role: "group", "aria-label": "mesh" }, gbox);
    if (ms.length >= 2) {
      svg("text", { x: padL, y: 11, class: "sv-axis-label" }, s).textContent = `${labels[ms.length - 1]} (${colsN}) →`;
      svg(
        "text",
        { x: 11, y: padT + (rowsN * cellPx) / 2, class: "sv-axis-label", "text-anchor": "middle", transform: `rotate(-90 11 ${padT + (rowsN * cellPx) / 2})` },
        s,
      ).textContent = `← ${labels[ms.length - 2]} (${rowsN})`;
    } else {
      svg("text", { x: padL, y: 11, class: "sv-axis-label" }, s).textContent = `${labels[0]} (${ms[0]}) →`;
    }
    for (let k = 0; k < perGrid; k++) {
      const sh = geo.shards[gi * perGrid + k];
      const r = Math.floor(k / colsN),
        c = k % colsN;
      const x = padL + c * cellPx,
        y = padT + r * cellPx;
      const cellG = svg(
        "g",
        {
          class: `sv-cell${sh.empty ? " sv-empty" : ""}`,
          tabindex: 0,
          role: "button",
          "aria-label": `rank ${sh.rank}, coord (${sh.coord.join(", ")}), local shape ${fmtShape(sh.shape)}${sh.empty ? ", empty" : ""}`,
        },
        s,
      );
      addRegion(cellG, sh.rank);
      const st = rankStyle(geo.palette, sh.rank);
      svg(
        "rect",
        { x: x + 1, y: y + 1, width: cellPx - 2, height: cellPx - 2, rx: 3, fill: sh.empty ? "#ffffff" : fillFor(sh.rank, defs, used), class: "sv-cell-rect" },
        cellG,
      );
      if (geo.partial && !sh.empty) svg("rect", { x: x + 1, y: y + 1, width: cellPx - 2, height: cellPx - 2, rx: 3, class: "sv-partial-cell" }, cellG);
      const fs = Math.min(13, cellPx * 0.36);
      if (cellPx >= 16) {
        const ink = sh.empty ? "#333" : st.text;
        const showShape = cellPx >= 40;
        const halo = sh.empty ? "#ffffff" : st.fill;
        svg(
          "text",
          {
            x: x + cellPx / 2,
            y: y + cellPx / 2 + (showShape ? -1 : fs * 0.35),
            "font-size": fs,
            fill: ink,
            stroke: halo,
            "text-anchor": "middle",
            class: "sv-label",
          },
          cellG,
        ).textContent = String(sh.rank);
        if (showShape)
          svg(
            "text",
            { x: x + cellPx / 2, y: y + cellPx / 2 + fs, "font-size": fs * 0.75, fill: ink, stroke: halo, "text-anchor": "middle", class: "sv-label" },
            cellG,
          ).textContent = sh.empty ? "empty" : fmtShape(sh.shape);
      }
    }
  }
}
