// The ring algorithm of an all_reduce, all_gather or reduce_scatter: a rank x chunk grid per ring
// step (who contributed to each chunk, its leading values, the sends), and the final state
// against the recorded output.
// Concatenated into the player's ES module by esm_source("player"); see core.js.

function maskRanks(mask, ranks) {
  const out = [];
  for (let i = 0; i < ranks.length; i++) if (mask & (1 << i)) out.push(ranks[i]);
  return out;
}

function drawRing(p, d) {
  if (!d.ring) return;
  const section = html("div", { class: "sv-ring-section" }, p.detailBox);
  if (!d.ring.available) {
    html("div", { class: "sv-note" }, section, `ring algorithm: ${d.ring.note}`);
    return;
  }
  const btn = html(
    "button",
    { type: "button", "data-action": "ring" },
    section,
    p.ringOpen ? "hide the ring algorithm" : "show the ring algorithm (how NCCL / gloo run it)",
  );
  btn.addEventListener("click", () => {
    p.ringOpen = !p.ringOpen;
    p.ringState = 0;
    drawDetail(p);
  });
  if (!p.ringOpen) return;
  const box = html("div", { class: "sv-ring", "data-ring-step": d.step }, section, null);
  box.appendChild(html("span", { class: "sv-note" }, null, "loading the ring…"));
  const gi = groupsShown(p, d)[0];
  fetchRing(p, d.step, gi).then(
    (r) => {
      if (!box.isConnected) return;
      drawRingState(p, box, d, r);
    },
    (err) => {
      if (box.isConnected) box.replaceChildren(html("div", { class: "sv-note" }, null, `ring: ${err.message}`));
    },
  );
}

function drawRingState(p, box, d, ring) {
  const { meta, val, mask: maskOf } = ring;
  box.replaceChildren();
  const n = meta.n,
    S = meta.states;
  const last = S; // index S shows the final state against the recorded output
  p.ringState = Math.min(Math.max(p.ringState, 0), last);
  const ctl = html("div", { class: "sv-ring-controls" }, box);
  const prev = html("button", { type: "button", "data-action": "ring-prev" }, ctl, "◀ ring step");
  const range = html("input", { type: "range", min: 0, max: last, value: p.ringState, "data-control": "ring-step" }, ctl);
  const next = html("button", { type: "button", "data-action": "ring-next" }, ctl, "ring step ▶");
  const go = (s_) => {
    p.ringState = s_;
    drawRingState(p, box, d, ring);
  };
  prev.disabled = p.ringState === 0;
  next.disabled = p.ringState === last;
  prev.addEventListener("click", () => go(p.ringState - 1));
  next.addEventListener("click", () => go(p.ringState + 1));
  range.addEventListener("input", () => go(Number(range.value)));
  const ranks = meta.ranks;
  // leading values, as many as fit in `width` characters
  const list = (arr, size, width = 40) => {
    if (arr === null) return "";
    let out = "";
    for (let i = 0; i < arr.length; i++) {
      const next = (i ? ", " : "") + fmtNum(arr[i]);
      if (out.length + next.length > width - 2) return `${out}, …`;
      out += next;
    }
    return size > arr.length ? `${out}, …` : out;
  };
  box.dataset.ringState = String(p.ringState);
  if (p.ringState === last) {
    drawRingFinal(box, meta, val, list);
    return;
  }
  const phase = p.ringState === 0 ? "initial state" : `${meta.phases[p.ringState - 1]} phase`;
  const steps = S - 1;
  const explain =
    p.ringState === 0
      ? `${meta.op === "all_gather" ? "each rank holds only its own chunk" : `each rank's buffer is cut into ${n} chunks`}; ${steps} steps follow, each rank sending one chunk to the next rank of the ring at the same time`
      : meta.phases[p.ringState - 1] === "reduce-scatter"
        ? "each rank sends one chunk to the next rank, which adds it to its own copy of that chunk"
        : "each rank passes a finished chunk on to the next rank, which keeps it";
  const which = d.groups.length > 1 ? `group ${meta.group} (ranks ${rankList(ranks)}) · ` : "";
  html("div", { class: "sv-ring-head" }, box, `${which}ring step ${p.ringState} of ${steps} · ${phase}: ${explain}`);
  const cw = 86,
    ch = 36,
    padL = 44,
    padT = 18;
  const W = padL + n * cw + 60,
    H = padT + n * ch + 8;
  const s = svg("svg", { width: W, height: H, class: "sv-ring-svg" }, box);
  const defs = svg("defs", {}, s);
  const mk = svg(
    "marker",
    { id: `${p.uid}-ring`, viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" },
    defs,
  );
  svg("path", { d: "M0,0 L10,5 L0,10 z", fill: "#333" }, mk);
  const hatch = svg("pattern", { id: `${p.uid}-ring-hatch`, width: 6, height: 6, patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)" }, defs);
  svg("rect", { width: 6, height: 6, class: "sv-ring-hatch-bg" }, hatch);
  svg("line", { x1: 0, y1: 0, x2: 0, y2: 6, class: "sv-ring-hatch-line" }, hatch);
  for (let c = 0; c < n; c++) svg("text", { x: padL + c * cw + cw / 2, y: 12, "text-anchor": "middle", class: "sv-side" }, s).textContent = `chunk ${c}`;
  const received = new Set();
  const sends = p.ringState > 0 ? meta.sends[p.ringState - 1] : [];
  const posOf = new Map(ranks.map((r, i) => [r, i]));
  for (const [, dst, c] of sends) received.add(`${posOf.get(dst)}/${c}`);
  for (let i = 0; i < n; i++) {
    const st = styleOf(p, ranks[i]);
    const y = padT + i * ch;
    svg("rect", { x: 2, y: y + 4, width: padL - 8, height: ch - 8, rx: 3, fill: st.fill }, s);
    svg("text", { x: (padL - 6) / 2 + 2, y: y + ch / 2 + 4, "text-anchor": "middle", fill: st.text, class: "sv-rank-text" }, s).textContent = `r${ranks[i]}`;
    for (let c = 0; c < n; c++) {
      const mask = maskOf(p.ringState, i, c);
      const who = maskRanks(mask, ranks);
      const x = padL + c * cw;
      const full = who.length === n;
      // a chunk's state in neutral greys, never a rank's hue: one rank's data keeps that rank's
      // colour; a partial sum is light grey, hatched; a finished chunk dark grey
      const state = mask === 0 ? "empty" : full && n > 1 ? "done" : who.length === 1 ? "own" : "partial";
      const fill = state === "own" ? styleOf(p, who[0]).fill : state === "partial" ? `url(#${p.uid}-ring-hatch)` : null;
      const g = svg(
        "g",
        {
          class: `sv-ring-cell sv-ring-${state}${received.has(`${i}/${c}`) ? " sv-received" : ""}`,
          "data-ring-state": state,
          "data-ring-rank": ranks[i],
          "data-ring-chunk": c,
          "data-contributors": who.join(" "),
        },
        s,
      );
      svg(
        "rect",
        {
          x: x + 2,
          y: y + 2,
          width: cw - 4,
          height: ch - 4,
          rx: 3,
          ...(fill ? { fill } : {}),
          class: mask === 0 ? "sv-ring-empty" : "sv-ring-rect",
        },
        g,
      );
      const label = mask === 0 ? "—" : full ? `all ${n}` : who.map((r) => `r${r}`).join("+");
      const whoText = svg("text", { x: x + cw / 2, y: y + 15, "text-anchor": "middle", class: "sv-ring-who" }, g);
      whoText.textContent = label.length > 16 ? `${who.length} ranks` : label;
      const v = val(p.ringState, i, c);
      const valText = v === null ? null : svg("text", { x: x + cw / 2, y: y + 28, "text-anchor": "middle", class: "sv-ring-val" }, g);
      if (valText) valText.textContent = list(v, meta.chunk_sizes[i][c], 15);
      // one rank's chunk in that rank's full colour, its text in the ink that reads on it
      if (state === "own") for (const t of [whoText, valText]) if (t) t.style.fill = styleOf(p, who[0]).text;
    }
  }
  // this step's sends: chunk c from row i to row i+1 (the last row wraps to the first)
  for (const [src, dst, c] of sends) {
    const i = posOf.get(src),
      j = posOf.get(dst);
    const x = padL + c * cw + cw - 10;
    const y0 = padT + i * ch + ch / 2,
      y1 = padT + j * ch + ch / 2;
    const bend = j > i ? 14 : 30 + (i - j) * 2;
    svg(
      "path",
      {
        d: `M${x},${y0} C${x + bend},${y0} ${x + bend},${y1} ${x + 2},${y1}`,
        class: "sv-ring-send",
        "marker-end": `url(#${p.uid}-ring)`,
        stroke: styleOf(p, src).fill,
      },
      s,
    );
  }
  drawRingLegend(box, meta.op, n);
}

// What the chunk fills mean: the states are greys and hatching, far from every rank's colour.
function drawRingLegend(box, op, n) {
  const lg = html("div", { class: "sv-ring-legend", "data-ring-legend": "true" }, box);
  const item = (state, text) => {
    const it = html("span", { class: "sv-ring-key" }, lg);
    html("span", { class: `sv-ring-swatch sv-ring-swatch-${state}`, "data-ring-swatch": state }, it);
    it.appendChild(document.createTextNode(text));
  };
  item("own", "one rank's data (that rank's colour)");
  if (op !== "all_gather") item("partial", "partial sum of some ranks");
  item("done", `finished: all ${n} ranks`);
  item("empty", "not there yet");
  item("received", "received this step");
}

function drawRingFinal(box, meta, val, list) {
  const c = meta.check;
  const S = meta.states;
  html("div", { class: "sv-ring-head" }, box, `after ${S - 1} ring steps: each rank's result, compared with what the collective really returned`);
  const table = html("table", { class: "sv-ring-final" }, box);
  const hr = html("tr", {}, table);
  for (const h of ["rank", "ring result", "recorded output", ""]) html("th", {}, hr, h);
  meta.ranks.forEach((r, i) => {
    const tr = html("tr", { "data-final-rank": r }, table);
    html("td", {}, tr, `r${r}`);
    html("td", {}, tr, list(val(S, i, 0), meta.final_sizes[i]));
    html("td", {}, tr, list(val(S + 1, i, 0), meta.final_sizes[i]));
    const err = c.max_error[String(r)];
    const ok = c.checked && err !== undefined && (c.ok || (err !== null && err === 0));
    html(
      "td",
      { class: ok ? "sv-ok" : "sv-bad" },
      tr,
      err === undefined ? "not recorded" : ok ? "✓" : `✗ ${err === null ? "shape differs" : `|diff| ${fmtNum(err)}`}`,
    );
  });
  if (!c.checked) html("div", { class: "sv-note", "data-check": "ring" }, box, c.note);
  else if (c.ok)
    html("div", { class: "sv-ok", "data-check": "ring" }, box, "✓ the ring's final state equals the recorded output (floats: up to summation order)");
  else html("div", { class: "sv-warning", "data-check": "ring", role: "alert" }, box, `⚠ ${c.note}`);
}
