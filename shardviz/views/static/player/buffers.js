// One rank's buffer in the data flow: its parts tinted by the rank whose data they hold, padding
// hatched, ellipsis bands where elements are left out, part labels; and the value inspector:
// numbers printed into the drawn cells, or the value range beside the buffer where they do not fit.
// Concatenated into the player's ES module by esm_source("player"); see core.js and flow.js.

const VALUE_FONT = 10; // px of a printed value
const VALUE_FONT_MIN = 7; // smaller than this: the range is printed instead

// A value in a cell with at most `digits` significant digits (integers and special values in full).
function fmtCell(v, digits) {
  if (typeof v !== "number" || !Number.isFinite(v) || (Number.isInteger(v) && Math.abs(v) < 1e7)) return fmtNum(v);
  const s = v.toPrecision(digits);
  const plain = s.includes("e") ? s : s.replace(/\.?0+$/, "");
  const sci = v.toExponential(Math.max(digits - 1, 0)).replace("e+", "e");
  return sci.length < plain.length ? sci : plain;
}

// `a`: {x, y, geo, buf, rank, side, labelY} from drawGroup.
function drawBuffer(p, g, a, padId) {
  const { x, y, geo, buf, rank, side } = a;
  const parts = buf.parts || [];
  const own = side === "in" ? rank : buf.origin;
  const tint = (origin, reduced) => (reduced ? "#d9d9d9" : origin === null || origin === undefined ? "#eeeeee" : styleOf(p, origin).fill);
  const padRect = (sb, [a0, a1, b0, b1]) => {
    const py = y + sb.y + sb.rows.at(a0);
    const px = x + sb.cols.at(b0);
    svg(
      "rect",
      {
        x: px,
        y: py,
        width: Math.max(sb.cols.at(b1) - sb.cols.at(b0), 1),
        height: Math.max(sb.rows.at(a1) - sb.rows.at(a0), 1),
        fill: `url(#${padId})`,
        class: "sv-pad",
      },
      g,
    );
  };
  geo.slots.forEach((sb, k) => {
    const oy = y + sb.y;
    if (sb.nr * sb.nc === 0) {
      svg("rect", { x, y: oy, width: Math.max(sb.w, 10), height: Math.max(sb.h, 6), class: "sv-empty-buf" }, g);
      return;
    }
    const whole = !parts.some((pt) => (pt.slot ?? 0) === k);
    if (whole) svg("rect", { x, y: oy, width: sb.w, height: sb.h, fill: tint(own, buf.reduced), class: "sv-part" }, g);
    for (const pt of parts) {
      if ((pt.slot ?? 0) !== k) continue;
      const b = partBox(a, pt);
      const origin = pt.origin ?? (side === "in" ? rank : null);
      svg(
        "rect",
        { x: x + b.x0, y: y + b.y0, width: b.x1 - b.x0, height: b.y1 - b.y0, fill: tint(origin, pt.reduced), class: "sv-part", "data-part": parts.indexOf(pt) },
        g,
      );
      for (const box of pt.pad || []) padRect(sb, box);
    }
    for (const box of k === 0 && !buf.slots ? buf.pad || [] : []) padRect(sb, box);
    // cell borders inside each run; ellipsis bands between runs
    if (geo.ch >= 4 && sb.cols.cell >= 4) {
      let dd = "";
      for (const [r0, r1] of sb.rows.runs) for (let i = r0 + 1; i < r1; i++) dd += `M${x},${oy + sb.rows.at(i)}h${sb.w}`;
      for (const [c0, c1] of sb.cols.runs) for (let j = c0 + 1; j < c1; j++) dd += `M${x + sb.cols.at(j)},${oy}v${sb.h}`;
      if (dd) svg("path", { d: dd, class: "sv-cellgrid" }, g);
    }
    for (const gy of sb.rows.gaps()) {
      svg("rect", { x, y: oy + gy, width: sb.w, height: BAND, class: "sv-ellipsis" }, g);
      svg("text", { x: x + sb.w / 2, y: oy + gy + BAND - 1.5, "text-anchor": "middle", class: "sv-ellipsis-text" }, g).textContent = "⋮";
    }
    for (const gx of sb.cols.gaps()) {
      svg("rect", { x: x + gx, y: oy, width: BAND, height: sb.h, class: "sv-ellipsis" }, g);
      svg("text", { x: x + gx + BAND / 2, y: oy + Math.min(sb.h, 16) / 2 + 3, "text-anchor": "middle", class: "sv-ellipsis-text" }, g).textContent = "…";
    }
    svg("rect", { x, y: oy, width: sb.w, height: sb.h, class: "sv-buf-frame" }, g);
  });
  // part borders, and labels on the side no arrow uses (left of inputs, right of outputs)
  parts.forEach((pt, i) => {
    const b = partBox(a, pt);
    svg("rect", { x: x + b.x0, y: y + b.y0, width: b.x1 - b.x0, height: b.y1 - b.y0, class: "sv-part-edge" }, g);
    const sb = geo.slots[pt.slot ?? 0];
    const spans = pt.box[2] === 0 && pt.box[3] === sb.nc; // a band across the whole buffer
    if (b.y1 - b.y0 >= 9 && spans) {
      const ly = y + b.y0 + Math.min(b.y1 - b.y0, CELL_H) / 2 + 3;
      const lx = side === "in" ? x - 3 : x + geo.w + 3;
      svg("text", { x: lx, y: ly, class: "sv-part-label", "text-anchor": side === "in" ? "end" : "start" }, g).textContent = `${pt.reduced ? "Σ" : ""}${i}`;
    }
  });
  if (!parts.length && buf.reduced && geo.h >= 9) {
    svg(
      "text",
      { x: side === "in" ? x - 3 : x + geo.w + 3, y: y + 11, class: "sv-part-label", "text-anchor": side === "in" ? "end" : "start" },
      g,
    ).textContent = "Σ";
  }
}

// Values into the drawn cells of every slot when they fit; otherwise the buffer's exact value range
// on its label line (above an input, below an output).
function fillValues(s, a, vals, key) {
  const [rank, side] = key.split("/");
  const entries = a.geo.slots.map((_, k) => vals.get(`${rank}/${side}/${a.buf.slots ? k : -1}`));
  if (!entries.some(Boolean)) return;
  const cells = []; // [slot, i, j, value]
  let fits = true;
  a.geo.slots.forEach((sb, k) => {
    const v = entries[k];
    if (!v || sb.nr * sb.nc === 0) return;
    if (v.step.some((x) => x > 1)) {
      fits = false; // a sample: the drawn cells' own values are not all there
      return;
    }
    for (const [r0, r1] of sb.rows.runs)
      for (let i = r0; i < r1; i++) for (const [c0, c1] of sb.cols.runs) for (let j = c0; j < c1; j++) cells.push([k, i, j, v.at(i * sb.nc + j)]);
  });
  // the most significant digits that fit the cells at a readable size
  let texts = [],
    fs = 0;
  for (const digits of [4, 3, 2]) {
    texts = cells.map(([k, i, j, v]) => [k, i, j, fmtCell(v, digits)]);
    const longest = Math.max(1, ...texts.map((t) => t[3].length));
    fs = Math.min(VALUE_FONT, a.geo.ch - 4, (a.geo.slots[0].cols.cell - 3) / (0.62 * longest));
    if (fs >= VALUE_FONT_MIN) break;
  }
  if (fits && texts.length && fs >= VALUE_FONT_MIN && !a.buf.role) {
    const g = svg("g", { class: "sv-values", "data-values-rank": rank, "data-values-side": side }, s);
    for (const [k, i, j, t] of texts) {
      const sb = a.geo.slots[k];
      svg(
        "text",
        {
          x: a.x + sb.cols.at(j) + sb.cols.cell / 2,
          y: a.y + sb.y + sb.rows.at(i) + a.geo.ch / 2 + fs * 0.35,
          "font-size": fs.toFixed(1),
          "text-anchor": "middle",
          class: "sv-value",
        },
        g,
      ).textContent = t;
    }
    return;
  }
  if (a.buf.role) return; // the role is on the label line
  let lo = Infinity,
    hi = -Infinity;
  for (const v of entries) {
    if (!v) continue;
    if (v.min !== undefined && v.max !== undefined) {
      lo = Math.min(lo, v.min);
      hi = Math.max(hi, v.max);
      continue;
    }
    const total = v.shape.reduce((x, y) => x * y, 1);
    for (let i = 0; i < total; i++) {
      const h = v.heat(i);
      if (h < lo) lo = h;
      if (h > hi) hi = h;
    }
  }
  if (lo > hi) return;
  const t = svg("text", { x: a.x, y: a.labelY, class: "sv-value-range", "data-range-rank": rank, "data-range-side": side }, s);
  t.textContent = `${fmtNum(lo)} … ${fmtNum(hi)}`;
  t.appendChild(svg("title", {})).textContent = `values of rank ${rank}'s buffer ${side === "in" ? "before" : "after"}: min ${lo}, max ${hi}`;
}
