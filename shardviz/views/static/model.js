// shardviz model map: a module's tensors (parameters, buffers, grads, optimizer state) with their
// placements and bytes per rank, totals per rank as bars, and the layout of any row drawn inline.
// Hand-written ESM, no bundler; Python prepends common.js (the drawing code shared with the
// layout view). It reads the synced traits (summary, rank, selected, title) and asks the kernel
// for per-rank data on demand through anywidget commands: `layout` ({layout: k} -> the geometry
// payload of the map's k-th distinct layout) and `rank_bytes` ({rank: r} -> each row's bytes on r).
//
// DOM contract: the root has data-shardviz-view="model"; every tensor row carries
// data-row="<index>" and data-name="<name>"; the inline layout has data-shardviz-view="layout"
// and its shard regions data-rank="<rank>", as in the layout view.

const BAR_PX = 520;

// far (CIE76 >= 25) from every rank colour: a kind never reads as a rank (views/geometry.delta_e)
const KIND_COLOR = { param: "#386cb0", buffer: "#666666", grad: "#ff7f00", optimizer: "#e41a1c" };

function render({ model, el, experimental }) {
  const invoke = makeInvoke(model, experimental);
  const root = html("div", { class: "shardviz sv-model", "data-shardviz-view": "model" }, el);
  const uid = `sv${Math.random().toString(36).slice(2, 9)}`;
  const layoutCache = new Map(); // layout index -> Promise<geometry>
  const rankCache = new Map(); // rank -> Promise<reply>
  let rankReply = null; // the reply for the shown rank, or null (max over ranks)

  const head = html("div", { class: "sv-head" }, root);
  const bars = html("div", { class: "sv-bars" }, root);
  const controls = html("div", { class: "sv-controls" }, root);
  const tableBox = html("div", { class: "sv-table-box" }, root);
  const detail = html("div", { class: "sv-detail", "aria-live": "polite" }, root);

  const S = () => model.get("summary");

  function setTrait(name, value) {
    model.set(name, value);
    model.save_changes();
  }

  function drawHead() {
    head.replaceChildren();
    const s = S();
    const n = s.rows.name.length;
    html("div", { class: "sv-title" }, head, model.get("title") || `model map: ${s.name}`);
    const tot = s.totals;
    const most = tot.length ? Math.max(...tot) : 0;
    const least = tot.length ? Math.min(...tot) : 0;
    const dims = s.mesh_dims.map((d) => `${d.name} (${d.size}) shards ${bytesText(d.sharded)}`).join(" · ");
    html(
      "div",
      { class: "sv-sub" },
      head,
      `${n} tensors on ${s.world_size} ranks · unsharded ${bytesText(s.global_bytes)} · per rank ${least === most ? bytesText(most) : `${bytesText(least)} – ${bytesText(most)}`}${dims ? ` · ${dims}` : ""}`,
    );
  }

  // Bytes per rank, stacked by kind; one bar per rank (thin bars past a few hundred ranks).
  function drawBars() {
    bars.replaceChildren();
    const s = S();
    const n = s.world_size;
    if (!n) return;
    const most = Math.max(1, ...s.totals);
    const bw = Math.max(1, Math.min(24, Math.floor(BAR_PX / n)));
    const H = 70;
    const caption = `ranks 0–${n - 1} · max ${bytesText(most)}`;
    const W = Math.max(bw * n + 4, 4 + caption.length * 7); // the caption fits under the bars
    const box = svg("svg", { width: W, height: H + 14, class: "sv-bar-chart", role: "img", "aria-label": "bytes per rank" }, bars);
    const sel = model.get("rank");
    for (let r = 0; r < n; r++) {
      const g = svg("g", { class: `sv-bar${r === sel ? " sv-bar-on" : ""}`, "data-bar-rank": r }, box);
      let y = H;
      for (const k of s.kinds) {
        const v = s.by_kind[k][r];
        const h = (v / most) * (H - 2);
        y -= h;
        svg("rect", { x: 2 + r * bw, y, width: Math.max(bw - (bw > 3 ? 1 : 0), 1), height: h, fill: KIND_COLOR[k] || "#999" }, g);
      }
      const t = svg("title", {}, g);
      t.textContent = `rank ${r}: ${bytesText(s.totals[r])}`;
      g.addEventListener("click", () => setTrait("rank", model.get("rank") === r ? -1 : r));
    }
    svg("text", { x: 2, y: H + 12, class: "sv-axis-label" }, box).textContent = caption;
    const key = html("div", { class: "sv-kinds" }, bars);
    for (const k of s.kinds) {
      const item = html("span", { class: "sv-kind-item" }, key);
      html("span", { class: "sv-kind-swatch", style: `background:${KIND_COLOR[k] || "#999"}` }, item);
      item.appendChild(document.createTextNode(` ${k}`));
    }
  }

  function drawControls() {
    controls.replaceChildren();
    const s = S();
    const lab = html("label", {}, controls, "bytes on rank ");
    const input = html("input", { type: "number", min: 0, max: s.world_size - 1, "data-control": "rank", class: "sv-goto", placeholder: "max" }, lab);
    const r = model.get("rank");
    if (r >= 0) input.value = String(r);
    onCommit(input, () => {
      const v = input.value === "" ? -1 : Number(input.value);
      if (v === -1 || (Number.isInteger(v) && v >= 0 && v < s.world_size)) setTrait("rank", v);
    });
    html(
      "span",
      { class: "sv-note" },
      controls,
      r >= 0 ? ` showing rank ${r}'s bytes and local shapes` : " (empty: bytes per rank as grouped over every rank)",
    );
  }

  function fetchLayout(k) {
    if (!layoutCache.has(k)) {
      const p = invoke("layout", { layout: k }).then(([reply]) => {
        if (!reply || reply.error) throw new Error(reply ? reply.error : "no reply");
        return reply.geometry;
      });
      p.catch(() => layoutCache.delete(k));
      layoutCache.set(k, p);
    }
    return layoutCache.get(k);
  }

  function fetchRank(r) {
    if (!rankCache.has(r)) {
      const p = invoke("rank_bytes", { rank: r }).then(([reply]) => {
        if (!reply || reply.error) throw new Error(reply ? reply.error : "no reply");
        return reply;
      });
      p.catch(() => rankCache.delete(r));
      rankCache.set(r, p);
    }
    return rankCache.get(r);
  }

  function drawTable() {
    tableBox.replaceChildren();
    const s = S();
    const R = s.rows;
    const sel = model.get("selected");
    const rank = model.get("rank");
    const byRank = rankReply && rankReply.rank === rank ? rankReply : null;
    const table = html("table", { class: "sv-model-table" }, tableBox);
    const hr = html("tr", {}, html("thead", {}, table));
    const cols = [
      "name",
      "kind",
      "shape",
      "dtype",
      "mesh",
      "placements",
      byRank ? `local shape (rank ${rank})` : "local shape",
      byRank ? `bytes (rank ${rank})` : "bytes/rank",
    ];
    for (const c of cols) html("th", {}, hr, c);
    const body = html("tbody", {}, table);
    let current = -1;
    for (let i = 0; i < R.name.length; i++) {
      if (R.module[i] !== current) {
        current = R.module[i];
        const [mname, cls] = s.modules[current] || ["", ""];
        const tr = html("tr", { class: "sv-module-row" }, body);
        html("td", { colspan: cols.length }, tr, `${mname || "(root)"}${cls ? ` (${cls})` : ""}`);
      }
      const mname = (s.modules[R.module[i]] || [""])[0];
      const leaf = mname && R.name[i].startsWith(`${mname}.`) ? R.name[i].slice(mname.length + 1) : R.name[i];
      const tr = html(
        "tr",
        { class: `sv-row sv-kind-${R.kind[i]}${i === sel ? " sv-selected" : ""}`, "data-row": i, "data-name": R.name[i], tabindex: 0 },
        body,
      );
      html("td", { class: "sv-name" }, tr, leaf);
      html("td", {}, tr, R.kind[i]);
      html("td", {}, tr, fmtShape(R.shape[i]));
      html("td", {}, tr, R.dtype[i]);
      html("td", {}, tr, R.mesh[i]);
      html("td", {}, tr, R.placements[i].length ? `[${R.placements[i].join(", ")}]` : "plain");
      if (byRank) {
        html("td", {}, tr, byRank.shapes[i] === null ? "—" : byRank.shapes[i]);
        html("td", { class: "sv-num" }, tr, String(byRank.bytes[i]));
      } else {
        html("td", {}, tr, R.local[i]);
        html("td", { class: "sv-num" }, tr, R.bytes[i]);
      }
    }
    const tot = html("tr", { class: "sv-total-row" }, html("tfoot", {}, table));
    html("td", { colspan: cols.length - 1 }, tot, byRank ? `total on rank ${rank}` : "total per rank (max)");
    const t = byRank ? s.totals[rank] : Math.max(0, ...s.totals);
    html("td", { class: "sv-num" }, tot, `${t} (${bytesText(t)})`);
  }

  async function drawDetail() {
    detail.replaceChildren();
    const s = S();
    const i = model.get("selected");
    if (!(i >= 0 && i < s.rows.name.length)) {
      html("div", { class: "sv-note" }, detail, "click a row to see its layout");
      return;
    }
    const k = s.rows.layout[i];
    html(
      "div",
      { class: "sv-panel-title" },
      detail,
      `${s.rows.name[i]} · ${fmtShape(s.rows.shape[i])} ${s.rows.dtype[i]} · ${s.rows.placements[i].length ? `[${s.rows.placements[i].join(", ")}]` : "plain: replicated on every rank"}`,
    );
    const box = html("div", { class: "sv-note" }, detail, "loading layout…");
    let geo;
    try {
      geo = prepare(await fetchLayout(k));
    } catch (err) {
      box.textContent = `layout unavailable: ${err.message}`;
      return;
    }
    if (model.get("selected") !== i) return;
    box.remove();
    const lay = html("div", { class: "sv-layout sv-inline-layout", "data-shardviz-view": "layout", "data-layout": k }, detail);
    const main = html("div", { class: "sv-main" }, lay);
    const tensorBox = html("div", { class: "sv-tensor" }, main);
    const meshBox = html("div", { class: "sv-mesh" }, main);
    const fillFor = (rank, defs, used) => makeFill(uid, geo.palette)(rank, defs, used);
    html("div", { class: "sv-panel-title" }, tensorBox, `global tensor ${fmtShape(geo.global_shape)}`);
    drawLayoutGroups(geo, tensorBox, meshBox, { uid, fillFor, tensorPx: geo.instances.length > 1 ? 220 : 300, meshPx: 260, most: 4 });
    const ul = html("ul", { class: "sv-notes" }, lay);
    for (const line of geo.notes) html("li", {}, ul, line);
  }

  async function onRank() {
    const r = model.get("rank");
    drawControls();
    drawBars();
    if (r < 0) {
      rankReply = null;
      drawTable();
      return;
    }
    try {
      const reply = await fetchRank(r);
      if (model.get("rank") !== r) return;
      rankReply = reply;
    } catch (err) {
      rankReply = null;
      html("span", { class: "sv-note" }, controls, ` · rank ${r} unavailable: ${err.message}`);
    }
    drawTable();
  }

  const markSelected = selectableRows(root, tableBox, model, setTrait);
  const onSelected = () => {
    markSelected();
    drawDetail();
  };
  const onSummary = () => {
    layoutCache.clear();
    rankCache.clear();
    rankReply = null;
    drawHead();
    onRank();
    drawDetail();
  };
  const unlisten = listen(model, [
    ["change:summary", onSummary],
    ["change:rank", onRank],
    ["change:selected", onSelected],
    ["change:title", drawHead],
  ]);
  drawHead();
  drawBars();
  drawControls();
  drawTable();
  drawDetail();
  if (model.get("rank") >= 0) onRank();
  root.dataset.ready = "true";

  return () => {
    unlisten();
    root.remove();
  };
}

export default { render };
