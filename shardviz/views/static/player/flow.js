// The data flow of a collective (or local compute): every rank's buffer before and after, one
// column per rank and one panel per group, with arrows for what moves; values filled in on demand.
// Concatenated into the player's ES module by esm_source("player"); see core.js.
//
// Buffers are drawn at a readable size whatever their shape: the kernel sends, per buffer slot,
// the runs of rows and columns to draw (steps.py:drawn_grid); the elements between two runs are
// one ellipsis band, and every chunk border stays a border between drawn cells.
//
// Arrows never cross a buffer: one leaves an input part through the buffer's bottom edge, or
// (for a part above the bottom) sideways into a lane right of the buffer and down it; below every
// input buffer it curves to its destination and enters an output part through the top edge, or
// down a lane left of the buffer and sideways into the part. Part labels sit on the side without
// lanes (left of inputs, right of outputs); value ranges and roles sit above inputs and below
// outputs, where no arrow goes.

const SHOW_GROUPS_UP_TO = 16; // ranks drawn at once before a group selector appears
const FLOW_WIDTH = 880; // px assumed when the view is not laid out yet (steps.py:FLOW_WIDTH)
const CELL_H = 16; // px per drawn row
const CELL_W_MAX = 46; // px per drawn column at most (room for a printed value)
const CELL_W_MIN = 6;
const MAX_BUF_H = 250; // a buffer taller than this shrinks its rows
const BAND = 10; // px of an ellipsis band (elements left out)
const SLOT_GAP = 6; // px between the slots of a list
const LABEL_W = 20; // px of the gutter that holds part labels
const LANE = 4; // px between arrow lanes
const LINE = 13; // px of a text line (ranges, roles, bytes)
const COL_W_MAX = 220; // px of a rank's column when the width allows

function groupsShown(p, d) {
  const total = d.groups.reduce((a, g) => a + g.length, 0);
  if (total <= SHOW_GROUPS_UP_TO) return d.groups.map((_, i) => i);
  return [Math.min(p.groupPick, d.groups.length - 1)];
}

// Rows and columns of a slot's drawn grid: dim 0, and the other dims flattened.
function gridShape(shape) {
  if (!shape.length) return [1, 1];
  return [shape[0], shape.length > 1 ? shape.slice(1).reduce((a, b) => a * b, 1) : 1];
}

// One axis of a slot as drawn: runs of cells with a band between runs. `at(g)` is the pixel
// offset of the border before element g (g = n: the far edge).
function axisMap(runs, n, cell) {
  const rs = runs || (n > 0 ? [[0, n]] : []);
  const starts = [];
  let px = 0;
  rs.forEach(([a, b], i) => {
    if (i) px += BAND;
    starts.push(px);
    px += (b - a) * cell;
  });
  return {
    runs: rs,
    cell,
    size: px,
    at(g) {
      for (let i = 0; i < rs.length; i++) {
        const [a, b] = rs[i];
        if (g <= b) return g >= a ? starts[i] + (g - a) * cell : starts[i] - BAND / 2;
      }
      return px;
    },
    gaps() {
      return starts.slice(1).map((s) => s - BAND);
    },
  };
}

const drawnCount = (runs) => runs.reduce((a, [s, e]) => a + e - s, 0);

// How many cells and bands a buffer draws along each axis, before any pixel size is chosen.
function bufferCounts(buf) {
  const shapes = buf.slots || [buf.shape];
  let rows = 0,
    rowBands = 0,
    cols = 0,
    colBands = 0;
  shapes.forEach((shape, k) => {
    const [nr, nc] = gridShape(shape);
    const g = buf.grid?.[k];
    const rr = g ? g[0] : nr ? [[0, nr]] : [];
    const cc = g ? g[1] : nc ? [[0, nc]] : [];
    rows += Math.max(drawnCount(rr), 1);
    rowBands += Math.max(rr.length - 1, 0);
    const c = drawnCount(cc) + (Math.max(cc.length - 1, 0) * BAND) / CELL_W_MAX;
    if (c > cols) {
      cols = drawnCount(cc);
      colBands = Math.max(cc.length - 1, 0);
    }
  });
  return { rows, rowBands, cols: Math.max(cols, 1), colBands, nslots: shapes.length };
}

// Pixel geometry of one buffer: per slot its offset and axis maps.
function bufferGeo(buf, cw, chFor) {
  const shapes = buf.slots || [buf.shape];
  const counts = bufferCounts(buf);
  const ch = chFor(counts);
  let y = 0;
  const slots = shapes.map((shape, k) => {
    const [nr, nc] = gridShape(shape);
    const g = buf.grid?.[k];
    const rows = axisMap(g ? g[0] : null, nr, ch);
    const cols = axisMap(g ? g[1] : null, nc, cw);
    const s = { y, rows, cols, nr, nc, shape, w: Math.max(cols.size, 4), h: Math.max(rows.size, 6) };
    y += s.h + SLOT_GAP;
    return s;
  });
  const h = Math.max(y - SLOT_GAP, 6);
  return { slots, w: Math.max(4, ...slots.map((s) => s.w)), h, ch };
}

// A part's box in pixels, relative to the buffer's top left.
function partBox(a, pt) {
  const k = pt.slot ?? 0;
  const sb = a.geo.slots[k];
  const [r0, r1, c0, c1] = pt.box;
  const y0 = sb.y + sb.rows.at(r0),
    y1 = sb.y + sb.rows.at(r1);
  const x0 = sb.cols.at(c0),
    x1 = sb.cols.at(c1);
  return { x0, x1: Math.max(x1, x0 + 1), y0, y1: Math.max(y1, y0 + 1) };
}

function drawFlow(p, d) {
  const section = html("div", { class: "sv-flow" }, p.detailBox);
  const shown = groupsShown(p, d);
  if (shown.length < d.groups.length) {
    const lab = html("label", { class: "sv-group-pick" }, section, `${d.groups.length} groups ran this step at once; showing group `);
    const sel = html("select", { "data-control": "group" }, lab);
    d.groups.forEach((g, i) => {
      html("option", { value: i }, sel, `${i}: ranks ${rankList(g)}`);
    });
    sel.value = String(shown[0]);
    sel.addEventListener("change", () => {
      p.groupPick = Number(sel.value);
      drawDetail(p);
    });
  }
  const legend = html("div", { class: "sv-flow-legend sv-note" }, section);
  legend.textContent =
    "top: each rank's buffer before · bottom: after · arrows: what moves (colour of the sending rank); dashed: what a rank keeps of its own; Σ: reduced; ⋮ …: elements left out";
  const panels = html("div", { class: "sv-groups" }, section);
  const width = p.detailBox.clientWidth || FLOW_WIDTH;
  for (const gi of shown) drawGroup(p, d, gi, panels, width);
}

// The arrows of one group as [src, dst, srcPart, dstPart, reduce, stay].
function groupArrows(d, members) {
  const list = [...(d.stays || []).map((t) => [...t, true]), ...(d.transfers || []).map((t) => [...t, false])];
  return list.filter(([src, dst]) => members.has(src) && members.has(dst));
}

function drawGroup(p, d, gi, parent, width) {
  const ranks = d.groups[gi];
  const n = ranks.length;
  const panel = html("div", { class: "sv-group", "data-group": gi }, parent);
  if (d.groups.length > 1) html("div", { class: "sv-group-title" }, panel, `group ${gi}: ranks ${rankList(ranks)}`);
  const members = new Set(ranks);
  const arrows = groupArrows(d, members);
  const info = ranks.map((r) => d.ranks[String(r)] || {});
  // lanes: parts that arrows leave above an input's bottom / enter below an output's top
  const lanesOf = (r, side) => {
    const buf = d.ranks[String(r)]?.[side];
    if (!buf?.parts) return [];
    const used = new Set(arrows.filter((t) => (side === "in" ? t[0] : t[1]) === r).map((t) => (side === "in" ? t[2] : t[3])));
    return buf.parts.map((_, i) => i).filter((i) => used.has(i));
  };
  const laneCount = (side) => Math.max(0, ...ranks.map((r) => lanesOf(r, side).length));
  const gl = Math.max(LABEL_W, 10 + LANE * laneCount("out"));
  const gr = Math.max(LABEL_W, 10 + LANE * laneCount("in"));
  // cell sizes: columns share the width, rows are CELL_H unless a buffer would be too tall
  const counts = info.flatMap((x) => ["in", "out"].filter((s) => x[s]).map((s) => bufferCounts(x[s])));
  const maxCols = Math.max(1, ...counts.map((c) => c.cols + (c.colBands * BAND) / CELL_W_MAX));
  const perCol = Math.max(60, (width - 40) / n);
  const cw = Math.min(CELL_W_MAX, Math.max(CELL_W_MIN, (perCol - gl - gr - 6) / maxCols));
  const chFor = (c) => Math.min(CELL_H, Math.max(3, (MAX_BUF_H - c.rowBands * BAND - (c.nslots - 1) * SLOT_GAP) / Math.max(c.rows, 1)));
  const geo = info.map((x) => ({ in: x.in ? bufferGeo(x.in, cw, chFor) : null, out: x.out ? bufferGeo(x.out, cw, chFor) : null }));
  const bufW = Math.max(8, ...geo.flatMap((x) => [x.in ? x.in.w : 0, x.out ? x.out.w : 0]));
  // columns use the width there is (up to COL_W_MAX), so arrows and labels have room
  const colW = Math.max(gl + bufW + gr, Math.min(perCol, COL_W_MAX));
  const left = 20;
  const hIn = Math.max(8, ...geo.map((x) => (x.in ? x.in.h : 0)));
  const hOut = Math.max(8, ...geo.map((x) => (x.out ? x.out.h : 0)));
  const yIn = 24 + LINE;
  const exitY = yIn + hIn + 8;
  const zone = d.op === "barrier" ? 40 : Math.min(150, 56 + 8 * n);
  const entryY = exitY + zone;
  const yOut = entryY + 8;
  const W = left + n * colW + 6,
    H = yOut + hOut + 2 * LINE + 6;
  const s = svg("svg", { width: W, height: H, class: "sv-flow-svg", role: "img", "aria-label": `data flow of group ${gi}` }, panel);
  const defs = svg("defs", {}, s);
  // ids unique per widget instance (p.uid) and per group: several SVGs share one page
  const pre = `${p.uid}-g${gi}`;
  const padId = `${pre}-pad`;
  const pat = svg("pattern", { id: padId, patternUnits: "userSpaceOnUse", width: 5, height: 5, patternTransform: "rotate(45)" }, defs);
  svg("rect", { width: 5, height: 5, fill: "#e6e6e6" }, pat);
  svg("line", { x1: 0, y1: 0, x2: 0, y2: 5, stroke: "#888", "stroke-width": 1.6 }, pat);
  const markers = new Map();
  const marker = (color) => {
    if (!markers.has(color)) {
      const id = `${pre}-m${markers.size}`;
      const m = svg("marker", { id, viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" }, defs);
      svg("path", { d: "M0,0 L10,5 L0,10 z", fill: color, class: "sv-arrowhead" }, m);
      markers.set(color, id);
    }
    return markers.get(color);
  };
  const drawn = new Map(); // `${rank}/${side}` -> {x, y, geo, buf}
  ranks.forEach((r, i) => {
    const st = styleOf(p, r);
    const x0 = left + i * colW;
    const inset = (colW - gl - bufW - gr) / 2;
    const cx = x0 + inset + gl + bufW / 2;
    const isRoot = !d.pairs?.length && d.roots?.includes(r);
    const pairRole = d.pairs?.some(([a]) => a === r) ? " src" : d.pairs?.some(([, b]) => b === r) ? " dst" : "";
    const lab = svg("g", { class: "sv-rank-head", "data-flow-rank": r }, s);
    svg("rect", { x: cx - 24, y: 4, width: 48, height: 16, rx: 3, fill: st.fill }, lab);
    svg("text", { x: cx, y: 16, "text-anchor": "middle", fill: st.text, class: "sv-rank-text" }, lab).textContent = `r${r}${isRoot ? " root" : pairRole}`;
    for (const [side, y] of [
      ["in", yIn],
      ["out", yOut],
    ]) {
      const g_ = geo[i][side];
      const buf = info[i][side];
      if (!g_) {
        if (d.op !== "barrier") svg("text", { x: cx, y: y + 12, "text-anchor": "middle", class: "sv-none" }, s).textContent = "—";
        continue;
      }
      const x = x0 + inset + gl + (bufW - g_.w) / 2;
      const g = svg("g", { class: `sv-buf sv-buf-${side}${buf.role ? ` sv-${buf.role}` : ""}`, "data-buf-rank": r, "data-buf-side": side }, s);
      const a = { x, y, geo: g_, buf, rank: r, side, labelY: side === "in" ? y - 4 : y + g_.h + 11, colX: x0, colW };
      drawBuffer(p, g, a, padId);
      drawn.set(`${r}/${side}`, a);
      if (buf.role) {
        const text = { ignored: "not read", undefined: "not defined", pending: "→ its recv" }[buf.role] || buf.role;
        svg("text", { x, y: a.labelY, class: "sv-role" }, s).textContent = text;
      }
    }
    const nb = info[i].nbytes;
    if (nb !== undefined && d.kind !== "local")
      svg("text", { x: cx, y: H - 6, "text-anchor": "middle", class: "sv-bytes" }, s).textContent = `${bytesText(info[i].bus || 0)} bus`;
  });
  for (const [text, y, h] of [
    ["before", yIn, hIn],
    ["after", yOut, hOut],
  ]) {
    const cy = y + h / 2;
    svg("text", { x: 9, y: cy, class: "sv-side", "text-anchor": "middle", transform: `rotate(-90 9 ${cy})` }, s).textContent = text;
  }
  if (d.op === "barrier") {
    const y = (exitY + entryY) / 2;
    svg("line", { x1: 4, x2: W - 4, y1: y, y2: y, class: "sv-barrier" }, s);
    svg("text", { x: W / 2, y: y - 4, "text-anchor": "middle", class: "sv-note-svg" }, s).textContent = "barrier: all wait here";
  }
  drawArrows(p, s, arrows, drawn, { exitY, entryY, marker, lanesOf });
  // values, on demand
  if (d.kind !== "redistribute" && Object.values(d.ranks).some((x) => x.in?.values || x.out?.values)) {
    const step = d.step;
    fetchValues(p, step, gi).then(
      (vals) => {
        if (!panel.isConnected) return;
        for (const [key, a] of drawn) fillValues(s, a, vals, key);
        panel.dataset.values = "true";
      },
      (err) => {
        if (!panel.isConnected) return;
        html("div", { class: "sv-note" }, panel, `values: ${err.message}`);
        panel.dataset.values = "error";
      },
    );
  }
}

// Where an arrow leaves an input part / enters an output part, and the path between them.
function drawArrows(p, s, arrows, drawn, { exitY, entryY, marker, lanesOf }) {
  const layer = svg("g", { class: "sv-arrows" }, s);
  // the point on a buffer's edge for (rank, side, part), with the lane when it goes sideways
  const ends = new Map();
  const endOf = (rank, side, part) => {
    const key = `${rank}/${side}/${part ?? "-"}`;
    if (ends.has(key)) return ends.get(key);
    const a = drawn.get(`${rank}/${side}`);
    let e = null;
    if (a) {
      const pt = part === null || part === undefined ? null : (a.buf.parts || [])[part];
      const b = pt ? partBox(a, pt) : { x0: 0, x1: a.geo.w, y0: 0, y1: a.geo.h };
      const edge = side === "in" ? Math.abs(b.y1 - a.geo.h) < 0.5 : Math.abs(b.y0) < 0.5;
      if (edge) e = { kind: "edge", x0: a.x + b.x0, x1: a.x + b.x1, y: side === "in" ? a.y + a.geo.h : a.y, n: 0 };
      else {
        const lanes = lanesOf(rank, side);
        const order = lanes.indexOf(part);
        // inputs: upper parts take the outer lanes; outputs: upper parts the inner ones (no lane crosses another's way in or out)
        const idx = side === "in" ? lanes.length - 1 - order : order;
        const mid = a.y + (b.y0 + b.y1) / 2;
        const laneX = side === "in" ? a.x + a.geo.w + 6 + idx * LANE : a.x - 6 - idx * LANE;
        e = { kind: "lane", laneX, mid, edgeX: side === "in" ? a.x + b.x1 : a.x + b.x0 - 1 };
      }
    }
    ends.set(key, e);
    return e;
  };
  // arrows that share an edge point are spread along it
  for (const [src, dst, sp, dp] of arrows) {
    const a = endOf(src, "in", sp),
      b = endOf(dst, "out", dp);
    if (a?.kind === "edge") a.n++;
    if (b?.kind === "edge") b.n++;
  }
  const spreadX = (e) => {
    const k = e.used || 0;
    e.used = k + 1;
    const w = e.x1 - e.x0;
    const step = Math.min(5, w / (e.n + 1));
    return (e.x0 + e.x1) / 2 + (k - (e.n - 1) / 2) * step;
  };
  let count = 0;
  for (const [src, dst, sp, dp, reduce, stay] of arrows) {
    const a = endOf(src, "in", sp),
      b = endOf(dst, "out", dp);
    if (!a || !b) continue;
    const color = styleOf(p, src).fill;
    let d;
    let x1;
    if (a.kind === "edge") {
      const x = spreadX(a);
      d = `M${x},${a.y} V${exitY}`;
      x1 = x;
    } else {
      d = `M${a.edgeX},${a.mid} H${a.laneX} V${exitY}`;
      x1 = a.laneX;
    }
    const x2 = b.kind === "edge" ? spreadX(b) : b.laneX;
    const k = (entryY - exitY) * 0.5;
    d += ` C${x1},${exitY + k} ${x2},${entryY - k} ${x2},${entryY}`;
    d += b.kind === "edge" ? ` V${b.y}` : ` V${b.mid} H${b.edgeX}`;
    const path = svg(
      "path",
      {
        d,
        class: `sv-arrow${stay ? " sv-stay" : ""}${reduce ? " sv-reduce" : ""}`,
        stroke: color,
        "marker-end": `url(#${marker(color)})`,
        "data-src": src,
        "data-dst": dst,
      },
      layer,
    );
    if (!stay) count++;
    path.appendChild(svg("title", {})).textContent =
      `rank ${src}${sp !== null ? ` part ${sp}` : ""} → rank ${dst}${dp !== null ? ` part ${dp}` : ""}${reduce ? " (reduced on arrival)" : ""}`;
  }
  s.parentNode.dataset.arrows = String(count);
}
