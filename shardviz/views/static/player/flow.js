// The data flow of a collective (or local compute): every rank's buffer before and after, one
// column per rank and one panel per group, with arrows for what moves; values filled in on demand.
// Concatenated into the player's ES module by esm_source("player"); see core.js.

const BUF_W = 96; // widest buffer drawing in a rank column, px
const BUF_H = 150; // tallest buffer drawing, px
const MAX_CELL = 22; // largest element cell, px
const SHOW_GROUPS_UP_TO = 16; // ranks drawn at once before a group selector appears

function groupsShown(p, d) {
  const total = d.groups.reduce((a, g) => a + g.length, 0);
  if (total <= SHOW_GROUPS_UP_TO) return d.groups.map((_, i) => i);
  return [Math.min(p.groupPick, d.groups.length - 1)];
}

// Slots (or the one tensor) of a buffer stacked vertically, in element units.
function bufferBoxes(buf) {
  const shapes = buf.slots || [buf.shape];
  let y = 0;
  const out = [];
  for (const shape of shapes) {
    const rows = shape.length ? shape[0] : 1;
    const cols = shape.length > 1 ? shape.slice(1).reduce((a, b) => a * b, 1) : 1;
    out.push({ y, rows, cols, shape });
    y += rows;
  }
  return { slots: out, rows: y, cols: Math.max(1, ...out.map((s) => s.cols)), nslots: shapes.length };
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
    "top: each rank's buffer before · bottom: after · arrows: what moves (colour of the sending rank); dashed: what a rank keeps of its own; Σ: reduced";
  const panels = html("div", { class: "sv-groups" }, section);
  for (const gi of shown) drawGroup(p, d, gi, panels);
}

function drawGroup(p, d, gi, parent) {
  const ranks = d.groups[gi];
  const panel = html("div", { class: "sv-group", "data-group": gi }, parent);
  if (d.groups.length > 1) html("div", { class: "sv-group-title" }, panel, `group ${gi}: ranks ${rankList(ranks)}`);
  const geo = ranks.map((r) => {
    const info_ = d.ranks[String(r)] || {};
    return { rank: r, info: info_, in: info_.in ? bufferBoxes(info_.in) : null, out: info_.out ? bufferBoxes(info_.out) : null };
  });
  const maxCols = Math.max(1, ...geo.flatMap((x) => [x.in ? x.in.cols : 1, x.out ? x.out.cols : 1]));
  const maxRows = Math.max(1, ...geo.flatMap((x) => [x.in ? x.in.rows : 1, x.out ? x.out.rows : 1]));
  const cell = Math.min(MAX_CELL, BUF_W / maxCols, BUF_H / maxRows);
  const gap = 3; // px between the slots of a list
  const size = (b) => (b ? { w: Math.max(b.cols * cell, 4), h: b.rows * cell + (b.nslots - 1) * gap } : { w: 0, h: 0 });
  const colW = Math.max(70, Math.min(BUF_W, maxCols * cell) + 34);
  const n = ranks.length;
  const hIn = Math.max(8, ...geo.map((x) => size(x.in).h));
  const hOut = Math.max(8, ...geo.map((x) => size(x.out).h));
  const top = 30;
  const zone = d.op === "barrier" ? 40 : Math.min(140, 46 + 8 * n);
  const yIn = top,
    yOut = top + hIn + zone;
  const W = n * colW + 26,
    H = yOut + hOut + 30;
  const s = svg("svg", { width: W, height: H, class: "sv-flow-svg", role: "img", "aria-label": `data flow of group ${gi}` }, panel);
  const defs = svg("defs", {}, s);
  const padId = `${p.uid}-pad`;
  const pat = svg("pattern", { id: padId, patternUnits: "userSpaceOnUse", width: 5, height: 5, patternTransform: "rotate(45)" }, defs);
  svg("rect", { width: 5, height: 5, fill: "#e6e6e6" }, pat);
  svg("line", { x1: 0, y1: 0, x2: 0, y2: 5, stroke: "#888", "stroke-width": 1.6 }, pat);
  const markers = new Map();
  const marker = (color) => {
    if (!markers.has(color)) {
      const id = `${p.uid}-m${markers.size}`;
      const m = svg("marker", { id, viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" }, defs);
      svg("path", { d: "M0,0 L10,5 L0,10 z", fill: color }, m);
      markers.set(color, id);
    }
    return markers.get(color);
  };
  const xOf = (i) => 22 + i * colW + (colW - 34 - Math.min(BUF_W, maxCols * cell)) / 2;
  const pos = new Map(ranks.map((r, i) => [r, i]));
  const drawn = new Map(); // `${rank}/${side}` -> {x, y, box, cell}
  ranks.forEach((r, i) => {
    const st = styleOf(p, r);
    const cx = 22 + i * colW + (colW - 34) / 2;
    const isRoot = d.roots?.includes(r);
    const lab = svg("g", { class: "sv-rank-head", "data-flow-rank": r }, s);
    svg("rect", { x: cx - 22, y: 4, width: 44, height: 16, rx: 3, fill: st.fill }, lab);
    svg("text", { x: cx, y: 16, "text-anchor": "middle", fill: st.text, class: "sv-rank-text" }, lab).textContent = `r${r}${isRoot ? " root" : ""}`;
    for (const [side, y] of [
      ["in", yIn],
      ["out", yOut],
    ]) {
      const b = geo[i][side];
      const buf = geo[i].info[side];
      if (!b) {
        if (d.op !== "barrier") svg("text", { x: cx, y: y + 12, "text-anchor": "middle", class: "sv-none" }, s).textContent = "—";
        continue;
      }
      const x = xOf(i);
      const g = svg("g", { class: `sv-buf sv-buf-${side}${buf.role ? ` sv-${buf.role}` : ""}`, "data-buf-rank": r, "data-buf-side": side }, s);
      drawBuffer(p, g, buf, b, x, y, cell, gap, r, side, padId);
      drawn.set(`${r}/${side}`, { x, y, b, buf, cell, gap });
      if (buf.role) svg("text", { x: x, y: y + size(b).h + 11, class: "sv-role" }, s).textContent = buf.role === "ignored" ? "not read" : "not defined";
    }
    const nb = geo[i].info.nbytes;
    if (nb !== undefined && d.kind !== "local")
      svg("text", { x: cx, y: H - 6, "text-anchor": "middle", class: "sv-bytes" }, s).textContent = `${humanBytes(geo[i].info.bus || 0)} bus`;
  });
  for (const [text, y, h] of [
    ["before", yIn, hIn],
    ["after", yOut, hOut],
  ]) {
    const cy = y + h / 2;
    svg("text", { x: 9, y: cy, class: "sv-side", "text-anchor": "middle", transform: `rotate(-90 9 ${cy})` }, s).textContent = text;
  }
  if (d.op === "barrier") {
    const y = yIn + hIn + zone / 2;
    svg("line", { x1: 4, x2: W - 4, y1: y, y2: y, class: "sv-barrier" }, s);
    svg("text", { x: W / 2, y: y - 4, "text-anchor": "middle", class: "sv-note-svg" }, s).textContent = "barrier: all wait here";
  }
  // arrows
  // Where an arrow leaves / enters a part: the buffer's bottom / top edge when the part touches
  // it, else the part's right / left side, so that arrowheads never cover another part's values.
  const anchor = (rank, side, part) => {
    const a = drawn.get(`${rank}/${side}`);
    if (!a) return null;
    const parts = a.buf.parts || [];
    const pt = part === null || part === undefined ? null : parts[part];
    const bottom = a.y + a.b.rows * a.cell + (a.b.nslots - 1) * a.gap;
    let x0, x1, y0, y1;
    if (pt) {
      const slot = pt.slot === undefined || pt.slot === null ? 0 : pt.slot;
      const sb = a.b.slots[slot];
      const oy = a.y + sb.y * a.cell + slot * a.gap;
      [y0, y1, x0, x1] = [oy + pt.box[0] * a.cell, oy + pt.box[1] * a.cell, a.x + pt.box[2] * a.cell, a.x + pt.box[3] * a.cell];
    } else {
      [x0, x1, y0, y1] = [a.x, a.x + Math.max(a.b.cols * a.cell, 4), a.y, bottom];
    }
    if (side === "in") {
      return Math.abs(y1 - bottom) < 0.5 ? { x: (x0 + x1) / 2, y: y1, dx: 0, dy: 1 } : { x: x1 + 12, y: (y0 + y1) / 2, dx: 1, dy: 0 };
    }
    return Math.abs(y0 - a.y) < 0.5 ? { x: (x0 + x1) / 2, y: y0 - 1, dx: 0, dy: 1 } : { x: x0 - 1, y: (y0 + y1) / 2, dx: 1, dy: 0 };
  };
  const layer = svg("g", { class: "sv-arrows" }, s);
  const members = new Set(ranks);
  const list = [...(d.stays || []).map((t) => [...t, true]), ...(d.transfers || []).map((t) => [...t, false])];
  let count = 0;
  for (const [src, dst, sp, dp, reduce, stay] of list) {
    if (!members.has(src) || !members.has(dst)) continue;
    const a = anchor(src, "in", sp),
      b = anchor(dst, "out", dp);
    if (!a || !b) continue;
    const color = styleOf(p, src).fill;
    // spread arrows that leave one point a little, so that each stays visible
    const spread = stay || a.dx ? 0 : (((pos.get(dst) - pos.get(src) + n) % n) - n / 2) * 1.5;
    const ka = a.dy ? Math.max((b.y - a.y) * 0.5, 20) : 28;
    const kb = b.dy ? Math.max((b.y - a.y) * 0.5, 20) : 28;
    const ax = a.x + spread;
    const path = svg(
      "path",
      {
        d: `M${ax},${a.y} C${ax + a.dx * ka},${a.y + a.dy * ka} ${b.x - b.dx * kb},${b.y - b.dy * kb} ${b.x},${b.y}`,
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
  panel.dataset.arrows = String(count);
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
