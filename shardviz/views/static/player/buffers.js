// One rank's buffer in the data flow: its parts tinted by the rank whose data they hold, padding
// hatched, part labels; and the value inspector: numbers printed into small buffers, the value
// range under large or sampled ones.
// Concatenated into the player's ES module by esm_source("player"); see core.js.

const TEXT_CELL = 14; // cells at least this big print their value

function drawBuffer(p, g, buf, b, x, y, cell, gap, rank, side, padId) {
  const parts = buf.parts || [];
  const own = side === "in" ? rank : buf.origin;
  const tint = (origin, reduced) => (reduced ? "#d9d9d9" : origin === null || origin === undefined ? "#eeeeee" : styleOf(p, origin).fill);
  b.slots.forEach((sb, k) => {
    const oy = y + sb.y * cell + k * gap;
    const w = Math.max(sb.cols * cell, 4),
      h = sb.rows * cell;
    if (sb.rows * sb.cols === 0) {
      svg("rect", { x, y: oy, width: Math.max(w, 10), height: Math.max(h, 6), class: "sv-empty-buf" }, g);
      return;
    }
    const whole = !parts.some((pt) => (pt.slot ?? 0) === k);
    if (whole) svg("rect", { x, y: oy, width: w, height: h, fill: tint(own, buf.reduced), class: "sv-part" }, g);
    for (const pt of parts) {
      if ((pt.slot ?? 0) !== k) continue;
      const [r0, r1, c0, c1] = pt.box;
      const px = x + c0 * cell,
        py = oy + r0 * cell,
        pw = Math.max((c1 - c0) * cell, 1),
        ph = Math.max((r1 - r0) * cell, 1);
      const origin = pt.origin ?? (side === "in" ? rank : null);
      svg("rect", { x: px, y: py, width: pw, height: ph, fill: tint(origin, pt.reduced), class: "sv-part", "data-part": parts.indexOf(pt) }, g);
      for (const [a0, a1, b0, b1] of pt.pad || []) {
        svg("rect", { x: x + b0 * cell, y: oy + a0 * cell, width: (b1 - b0) * cell, height: (a1 - a0) * cell, fill: `url(#${padId})`, class: "sv-pad" }, g);
      }
    }
    for (const [a0, a1, b0, b1] of k === 0 && !buf.slots ? buf.pad || [] : []) {
      svg("rect", { x: x + b0 * cell, y: oy + a0 * cell, width: (b1 - b0) * cell, height: (a1 - a0) * cell, fill: `url(#${padId})`, class: "sv-pad" }, g);
    }
    if (cell >= 4 && sb.rows * sb.cols <= 4096) {
      let dd = "";
      for (let i = 1; i < sb.rows; i++) dd += `M${x},${oy + i * cell}h${w}`;
      for (let j = 1; j < sb.cols; j++) dd += `M${x + j * cell},${oy}v${h}`;
      if (dd) svg("path", { d: dd, class: "sv-cellgrid" }, g);
    }
    svg("rect", { x, y: oy, width: w, height: h, class: "sv-buf-frame" }, g);
  });
  parts.forEach((pt, i) => {
    const k = pt.slot ?? 0;
    const sb = b.slots[k];
    const oy = y + sb.y * cell + k * gap;
    const [r0, r1, c0, c1] = pt.box;
    const px = x + c0 * cell,
      py = oy + r0 * cell,
      pw = (c1 - c0) * cell,
      ph = (r1 - r0) * cell;
    svg("rect", { x: px, y: py, width: pw, height: ph, class: "sv-part-edge" }, g);
    if (ph >= 9 && (c1 === sb.cols || pw >= 14)) {
      const lx = c1 === sb.cols ? x + sb.cols * cell + 2 : px + pw / 2;
      const anchor = c1 === sb.cols ? "start" : "middle";
      svg("text", { x: lx, y: py + Math.min(ph, 20) / 2 + 3, class: "sv-part-label", "text-anchor": anchor }, g).textContent = `${pt.reduced ? "Σ" : ""}${i}`;
    }
  });
  if (!parts.length && buf.reduced && b.rows * cell >= 9) {
    svg("text", { x: x + b.cols * cell + 2, y: y + 11, class: "sv-part-label" }, g).textContent = "Σ";
  }
}

function fillValues(s, a, vals, key) {
  const [rank, side] = key.split("/");
  a.b.slots.forEach((sb, k) => {
    const v = vals.get(`${rank}/${side}/${a.buf.slots ? k : -1}`);
    if (!v) return;
    const sampled = v.step.some((x) => x > 1);
    const oy = a.y + sb.y * a.cell + k * a.gap;
    const n = sb.rows * sb.cols;
    if (!sampled && a.cell >= TEXT_CELL && n <= 256) {
      const g = svg("g", { class: "sv-values", "data-values-rank": rank, "data-values-side": side }, s);
      for (let i = 0; i < sb.rows; i++) {
        for (let j = 0; j < sb.cols; j++) {
          const t = fmtNum(v.at(i * sb.cols + j));
          const fs = Math.min(10, (a.cell * 1.5) / Math.max(t.length, 2));
          svg(
            "text",
            { x: a.x + (j + 0.5) * a.cell, y: oy + (i + 0.5) * a.cell + fs * 0.35, "font-size": fs, "text-anchor": "middle", class: "sv-value" },
            g,
          ).textContent = t;
        }
      }
    } else if (n > 0) {
      let lo = Infinity,
        hi = -Infinity;
      const total = v.shape.reduce((a, b) => a * b, 1);
      for (let i = 0; i < total; i++) {
        const h = v.heat(i);
        if (h < lo) lo = h;
        if (h > hi) hi = h;
      }
      const t = svg("text", { x: a.x, y: oy + sb.rows * a.cell + 9, class: "sv-value-range" }, s);
      t.textContent = `${fmtNum(lo)}…${fmtNum(hi)}${sampled ? " (sampled)" : ""}`;
    }
  });
}
