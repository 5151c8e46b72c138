// shardviz layout view: the global tensor coloured by owning rank(s), the mesh beside it.
// Hand-written ESM, no bundler; Python prepends common.js (the drawing code shared with the
// collective player) to make one module. It reads only the synced traits (geometry, values_info,
// dims, index, heatmap, selected, title) and asks the kernel for values on demand through
// anywidget's command protocol (`fetch_values`), which answers with one binary buffer. The
// offline HTML export supplies the same model and command interface from embedded data.
//
// DOM contract: the root has data-shardviz-view="layout"; every drawn shard region (tensor blocks
// and mesh cells) carries data-rank="<rank>".

const TABLE_MAX = 16;
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

  const style = (rank) => rankStyle(geo.palette, rank);
  const fillFor = (rank, defs, used) => makeFill(uid, geo.palette)(rank, defs, used);

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

  // The groups of a sub-mesh drawn now: all side by side when they fit, else the picked one.
  function shownInstances() {
    const inst = geo.instances;
    if (inst.length === 1 || geo.ranks.length <= (geo.max_side_by_side || 16)) return inst;
    const g = Math.min(Math.max(model.get("group") || 0, 0), inst.length - 1);
    return [inst[g]];
  }

  function groupTitle(inst) {
    return `group ${inst.group}: ranks ${rankList(inst.ranks)}`;
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
      `mesh ${fmtShape(geo.mesh_shape)}${names} · placements [${geo.placements.join(", ")}] · ${geo.ranks.length} ranks${geo.instances.length > 1 ? ` in ${geo.instances.length} groups` : ""}`,
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
    // a greyed-out box says why, on screen, not only in a tooltip
    if (!vi.available) {
      const why = vi.note || "no values";
      html("span", { class: "sv-heat-why", "data-heat-why": "true", title: why }, lab, `(off: ${why})`);
    }
    box.addEventListener("change", () => setTrait("heatmap", box.checked));
    if (shownInstances().length < geo.instances.length) {
      const gl = html("label", {}, controls, "group ");
      const sel = html("select", { "data-control": "group" }, gl);
      for (const inst of geo.instances) html("option", { value: inst.group }, sel, groupTitle(inst));
      sel.value = String(shownInstances()[0].group);
      sel.addEventListener("change", () => setTrait("group", Number(sel.value)));
    }
    if (geo.ranks.length > 16) {
      const gl = html("label", {}, controls, "rank ");
      const go = html("input", { type: "number", min: Math.min(...geo.ranks), max: Math.max(...geo.ranks), "data-control": "goto", class: "sv-goto" }, gl);
      onCommit(go, () => {
        const r = Number(go.value);
        if (!geo.byRank.has(r)) return;
        const g = geo.byRank.get(r).group;
        if (!shownInstances().some((inst) => inst.group === g)) setTrait("group", g);
        setTrait("selected", r);
      });
    }
  }

  // ---- tensor ----

  let tensorStates = []; // one per group drawn: {group, state}

  function drawTensor() {
    regions.clear();
    tensorBox.replaceChildren();
    tensorStates = [];
    const [rd, cd] = viewDims();
    const idx = viewIndex();
    const gshape = geo.global_shape;
    const heading = html("div", { class: "sv-panel-title" }, tensorBox, `global tensor ${fmtShape(gshape)}`);
    if (gshape.length >= 3) heading.textContent += ` · rows dim ${rd}, columns dim ${cd}`;
    if (gshape.includes(0)) {
      html("div", { class: "sv-empty-tensor" }, tensorBox, `empty tensor ${fmtShape(gshape)}: no elements to draw`);
      return;
    }
    const t0 = performance.now();
    const shown = shownInstances();
    if (geo.instances.length === 1) {
      tensorStates.push({ group: 0, state: drawTensorGrid(geo, tensorBox, { rd, cd, idx, uid, fillFor, addRegion }) });
    } else {
      // Each group of a sub-mesh holds the whole tensor with its own values: one picture each.
      const px = shown.length === 1 ? TENSOR_PX : Math.max(160, Math.round(TENSOR_PX / Math.min(shown.length, 2)));
      const row = html("div", { class: "sv-groups", style: "display:flex;flex-wrap:wrap;gap:8px" }, tensorBox);
      for (const inst of shown) {
        const box = html("div", { class: "sv-group", "data-group": inst.group }, row);
        html("div", { class: "sv-grid-title" }, box, groupTitle(inst));
        tensorStates.push({ group: inst.group, state: drawTensorGrid(inst, box, { rd, cd, idx, uid: `${uid}g${inst.group}`, fillFor, addRegion, px }) });
      }
    }
    root.dataset.renderMs = String(Math.round(performance.now() - t0));
    if (model.get("heatmap")) drawHeat();
  }

  function drawOutline(rank) {
    for (const { state } of tensorStates) state.outline.replaceChildren();
    const s = rank === null ? null : geo.byRank.get(rank);
    const hit = s ? tensorStates.find((t) => t.group === s.group) : null;
    if (!hit) return;
    const { outline, rd, cd, idx, sx, sy } = hit.state;
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
    if (geo.instances.length === 1) {
      drawMeshGrids(geo, meshBox, { uid, fillFor, addRegion });
      return;
    }
    for (const inst of shownInstances()) {
      const box = html("div", { class: "sv-group", "data-group": inst.group }, meshBox);
      drawMeshGrids(inst, box, { uid: `${uid}g${inst.group}`, fillFor, addRegion, title: `mesh ${fmtShape(geo.mesh_shape)} · ${groupTitle(inst)}` });
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
      svg(
        "rect",
        { width: 14, height: 14, rx: 2, fill: s.empty ? "#fff" : fillFor(s.rank, defs, used), stroke: "#555", "stroke-dasharray": s.empty ? "2,2" : "" },
        sw,
      );
      item.appendChild(document.createTextNode(` r${s.rank} ${fmtShape(s.shape)}`));
    }
    if (n > shown.length)
      html("span", { class: "sv-note" }, list, `… colours and patterns repeat every ${shown.length} ranks; hover or type a rank to find it`);
    const ul = html("ul", { class: "sv-notes" }, legend);
    for (const line of geo.notes) html("li", {}, ul, line);
    if (geo.shards.some((s) => s.empty)) html("li", {}, ul, "dashed white cell = empty shard (0 elements)");
    if (model.get("heatmap")) html("div", { class: "sv-heat-legend" }, legend);
  }

  // ---- values ----

  function fetchValues(key) {
    if (!valuesCache.has(key)) {
      // "global" (one group) or "global:<group>" (a sub-mesh: each group holds its own tensor)
      const g = typeof key === "string" && key.startsWith("global:") ? Number(key.slice(7)) : null;
      const msg = key === "global" ? { rank: -1 } : g !== null ? { rank: -1, group: g } : { rank: key };
      const p = invoke("fetch_values", msg).then(([reply, buffers]) => {
        if (!reply || reply.error) throw new Error(reply ? reply.error : "no reply");
        return decodeValues(reply, buffers[0]);
      });
      p.catch(() => valuesCache.delete(key));
      valuesCache.set(key, p);
    }
    return valuesCache.get(key);
  }

  function drawHeat() {
    for (const { group, state } of tensorStates) drawHeatOf(group, state);
  }

  async function drawHeatOf(group, st) {
    let vals;
    try {
      vals = await fetchValues(geo.instances.length > 1 ? `global:${group}` : "global");
    } catch (err) {
      const lg = legend.querySelector(".sv-heat-legend");
      if (lg) lg.textContent = `heat-map unavailable: ${err.message}`;
      return;
    }
    if (!tensorStates.some((t) => t.state === st) || !model.get("heatmap")) return;
    const lg = legend.querySelector(".sv-heat-legend");
    const { rd, cd, idx } = st;
    const step = vals.step;
    const rows = rd === null ? 1 : vals.shape[rd];
    const cols = cd === null ? 1 : vals.shape[cd];
    let base = 0;
    for (let d = 0; d < vals.shape.length; d++) if (d !== rd && d !== cd) base += Math.floor(idx[d] / step[d]) * vals.strides[d];
    const rs = rd === null ? 0 : vals.strides[rd];
    const cs = cd === null ? 0 : vals.strides[cd];
    let lo = Infinity,
      hi = -Infinity,
      nan = 0,
      pinf = 0,
      ninf = 0;
    for (let i = 0; i < rows; i++)
      for (let j = 0; j < cols; j++) {
        const v = vals.heat(base + i * rs + j * cs);
        if (Number.isNaN(v)) nan++;
        else if (v === Infinity) pinf++;
        else if (v === -Infinity) ninf++;
        else {
          if (v < lo) lo = v;
          if (v > hi) hi = v;
        }
      }
    const canvas = st.canvas;
    canvas.width = cols;
    canvas.height = rows;
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(cols, rows);
    const span = hi > lo ? hi - lo : 1;
    const nanRGB = lerpColor(NAN_COLOR, NAN_COLOR, 0);
    for (let i = 0; i < rows; i++)
      for (let j = 0; j < cols; j++) {
        const v = vals.heat(base + i * rs + j * cs);
        const rgb = Number.isNaN(v) ? nanRGB : v === Infinity ? heatRGB(1) : v === -Infinity ? heatRGB(0) : heatRGB((v - lo) / span);
        const o = 4 * (i * cols + j);
        img.data[o] = rgb[0];
        img.data[o + 1] = rgb[1];
        img.data[o + 2] = rgb[2];
        img.data[o + 3] = 255;
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
    if (geo.instances.length > 1) parts.push(`group ${s.group}`);
    parts.push(`mesh coord (${coord})`);
    parts.push(s.empty ? "empty shard (no global offset)" : `global offset (${s.offset.join(", ")})`);
    parts.push(`local shape (${s.shape.join(", ")})${s.empty ? " · empty" : ""}`);
    return { s, parts };
  }

  // What the info panel shows: the pointer moving between regions that show the same rank (the
  // tensor block, then its "show values" button) leaves the panel as it is, so that a click on
  // the button is not lost to a redraw between its mousedown and its mouseup.
  let infoShown = null;
  function infoKey() {
    const sel = model.get("selected");
    const rank = hover !== null && hover.length === 1 ? hover[0] : geo.byRank.has(sel) ? sel : null;
    return rank === null ? `none ${hover && hover.length > 1 ? hover.join(",") : ""}` : `rank ${rank}`;
  }

  function drawInfo() {
    info.replaceChildren();
    infoShown = infoKey();
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
      if (infoKey() !== infoShown) drawInfo();
    });
  }
  function onLeave() {
    hover = null;
    cancelAnimationFrame(raf);
    raf = requestAnimationFrame(() => {
      applyHighlight();
      if (infoKey() !== infoShown) drawInfo();
    });
  }
  function select(rs) {
    if (!rs) return;
    const r = rs.length === 1 ? rs[0] : rs[0];
    setTrait("selected", model.get("selected") === r ? -1 : r);
  }
  function onClick(ev) {
    if (ev.target.closest?.("button, input, select")) return;
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

  // Everything below the title: what a change of the shown dims or index redraws.
  function drawView() {
    drawControls();
    drawTensor();
    drawMesh();
    drawLegend();
    applyHighlight();
    drawInfo();
  }

  function drawAll() {
    drawHead();
    drawView();
  }

  const onGeometry = () => {
    geo = prepare(model.get("geometry"));
    valuesCache.clear();
    drawAll();
  };
  const onHeat = () => {
    root.classList.remove("sv-heat-on");
    drawLegend();
    if (model.get("heatmap")) drawHeat();
    else for (const { state } of tensorStates) state.canvas.width = 1;
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
  const unlisten = listen(model, [
    ["change:geometry", onGeometry],
    ["change:dims", drawView],
    ["change:index", drawView],
    ["change:heatmap", onHeat],
    ["change:selected", onSelected],
    ["change:group", drawView],
    ["change:values_info", onValuesInfo],
    ["change:title", drawHead],
  ]);
  drawAll();
  root.dataset.ready = "true";

  return () => {
    unlisten();
    cancelAnimationFrame(raf);
    root.remove();
  };
}

export default { render };
