// shardviz placement playground: choose a tensor shape, a mesh and source / target placements;
// see both layouts, DTensor's redistribute plan with bytes and alpha-beta time, and step through
// its collectives in the collective player. Hand-written ESM, no bundler: esm_source("playground")
// joins common.js, the player's panels (static/player/, mountPlayer in mount.js) and this file.
//
// Synced traits: choice (what the controls ask for; Python recomputes on each change), result
// (what is drawn: layouts, plan, rows, notes, or error with the last good picture kept) and the
// player's own traits (step, link, filter, timeline, info).
//
// DOM contract: the root has data-shardviz-view="playground"; controls data-control="shape",
// "mesh_shape", "mesh_dim_names", "src-<m>", "dst-<m>"; the message of a choice that cannot be
// drawn is .sv-pg-error[data-error]; the mode note carries data-mode="values" | "geometry"; each
// layout is [data-layout="source" | "target"] with data-placements; the plan is [data-plan] and
// each collective a tr[data-plan-row] with data-op.

function placementOptions(ndim, current) {
  const opts = ["R", "P"];
  for (let d = 0; d < ndim; d++) opts.push(`S(${d})`);
  if (current && !opts.includes(current)) opts.push(current);
  return opts;
}

// The same reading as shardviz/placement_playground.py:_ints: "10, 6", "(10, 6)" or "10x6".
function parseInts(text) {
  const parts = String(text)
    .split(/[,\s()[\]×]+|(?<=\d)x(?=\d)/)
    .filter((s) => s);
  return parts.every((s) => /^\d+$/.test(s)) ? parts.map(Number) : null;
}

// A choice's list as typed text (a value Python could not read stays the text the user typed).
const joined = (v) => (Array.isArray(v) ? v.join(", ") : String(v ?? ""));

const fit = (list, n, fill) => Array.from({ length: n }, (_, m) => (list && list[m] !== undefined ? list[m] : fill(m)));

function render({ model, el, experimental }) {
  const uid = `svpg${Math.random().toString(36).slice(2, 9)}`;
  const root = html("div", { class: "shardviz sv-playground", "data-shardviz-view": "playground" }, el);
  const controls = html("div", { class: "sv-pg-controls" }, root);
  const message = html("div", { class: "sv-pg-messages" }, root);
  const pair = html("div", { class: "sv-pg-pair" }, root);
  const planBox = html("div", { class: "sv-pg-plan" }, root);
  const playerBox = html("div", { class: "sv-pg-player" }, root);

  function send(choice) {
    model.set("choice", choice);
    model.save_changes();
  }

  // The text fields are made once and only refreshed while not being edited (a redraw would take
  // the focus from the field the user moved to); the placement selects follow the mesh's dims.
  const text = (key, label, title) => {
    const lab = html("label", { class: "sv-pg-field" }, controls, `${label} `);
    const input = html("input", { type: "text", "data-control": key, title, size: 12 }, lab);
    onCommit(input, commit);
    return input;
  };
  const fields = {
    shape: text("shape", "tensor shape", "the global tensor's shape, e.g. 10, 6"),
    mesh_shape: text("mesh_shape", "mesh", "the mesh shape, e.g. 2, 2"),
    mesh_dim_names: text("mesh_dim_names", "dim names", "one name per mesh dim"),
  };
  const grid = html("div", { class: "sv-pg-placements" }, controls);
  const selects = { src: [], dst: [] };
  let drawnMesh = [];

  function commit() {
    const shapeV = parseInts(fields.shape.value);
    const meshV = parseInts(fields.mesh_shape.value);
    const n = meshV ? meshV.length : drawnMesh.length;
    const nameList = fields.mesh_dim_names.value
      .split(",")
      .map((s) => s.trim())
      .filter((s) => s);
    // A mesh of another rank keeps the names and placements chosen per dim and fills the rest
    // (d<m>, Replicate); names typed for another count go as typed, and Python says what is wrong.
    const names = nameList.length === drawnMesh.length && n !== drawnMesh.length ? fit(nameList, n, (m) => `d${m}`) : nameList;
    send({
      shape: shapeV || fields.shape.value,
      mesh_shape: meshV || fields.mesh_shape.value,
      mesh_dim_names: names,
      src: fit(
        selects.src.map((x) => x.value),
        n,
        () => "R",
      ),
      dst: fit(
        selects.dst.map((x) => x.value),
        n,
        () => "R",
      ),
    });
  }

  function drawControls() {
    const c = model.get("choice") || {};
    const offline = Boolean(model.get("result")?.offline);
    const active = el.getRootNode().activeElement;
    for (const [key, input] of Object.entries(fields)) {
      if (input !== active) input.value = joined(c[key]);
      input.disabled = offline;
    }
    const nd = (parseInts(c.shape) || []).length;
    drawnMesh = parseInts(c.mesh_shape) || drawnMesh;
    grid.replaceChildren();
    for (const which of ["src", "dst"]) {
      selects[which] = [];
      const row = html("div", { class: "sv-pg-row" }, grid);
      html("span", { class: "sv-pg-label" }, row, which === "src" ? "source" : "target");
      drawnMesh.forEach((_, m) => {
        const cur = (c[which] || [])[m] || "R";
        const name = (Array.isArray(c.mesh_dim_names) && c.mesh_dim_names[m]) || `d${m}`;
        const lab = html("label", { class: "sv-pg-field" }, row, `${name} `);
        const sel = html("select", { "data-control": `${which}-${m}`, "aria-label": `${which} placement on ${name}` }, lab);
        for (const o of placementOptions(nd, cur)) html("option", { value: o }, sel, o);
        sel.value = cur;
        sel.disabled = offline;
        sel.addEventListener("change", commit);
        selects[which].push(sel);
      });
    }
  }

  function drawLayout(payload, which, parent) {
    const wrap = html("div", { class: "shardviz sv-layout sv-mini", "data-layout": which }, parent);
    const geo = prepare(payload);
    wrap.dataset.placements = geo.placements.join(",");
    html("div", { class: "sv-panel-title" }, wrap, `${which}: [${geo.placements.join(", ")}]`);
    const fillFor = makeFill(`${uid}-${which}`, geo.palette);
    const tbox = html("div", { class: "sv-tensor" }, wrap);
    html("div", { class: "sv-sub" }, tbox, `${fmtShape(geo.global_shape)} on mesh ${fmtShape(geo.mesh_shape)}`);
    const mbox = html("div", { class: "sv-mesh" }, wrap);
    drawLayoutGroups(geo, tbox, mbox, { uid: `${uid}-${which}`, fillFor, tensorPx: 260, meshPx: 160, most: 2 });
  }

  function drawResult() {
    const r = model.get("result") || {};
    message.replaceChildren();
    if (!r.ok) {
      const box = html("div", { class: "sv-pg-error", role: "alert", "data-error": "true" }, message);
      html("strong", {}, box, "This choice cannot be drawn: ");
      html("span", {}, box, r.error || "unknown reason");
      html("div", { class: "sv-note" }, box, "Showing the last choice that could be drawn.");
    }
    if (r.offline)
      html("div", { class: "sv-note sv-pg-offline" }, message, "Saved page: the choices drawn when it was saved; changing them needs a running kernel.");
    html("div", { class: `sv-pg-mode sv-pg-${r.mode}`, "data-mode": r.mode }, message, r.mode_note || "");
    for (const line of r.shards || []) html("div", { class: "sv-pg-shards", "data-shards": "true" }, message, line);
    if (!r.before) return;
    pair.replaceChildren();
    drawLayout(r.before, "source", pair);
    html("div", { class: "sv-big-arrow", "aria-hidden": "true" }, pair, "→");
    drawLayout(r.after, "target", pair);
    planBox.replaceChildren();
    planBox.dataset.plan = r.plan || "";
    html("div", { class: "sv-panel-title" }, planBox, `DTensor's plan: ${r.plan || "(nothing to do)"}`);
    if (!r.rows.length) {
      html("div", { class: "sv-note" }, planBox, "no collective: every step is local (no communication)");
      return;
    }
    const table = html("table", { class: "sv-plan-table" }, planBox);
    const hr = html("tr", {}, table);
    for (const h of ["#", "collective", "mesh dim", "groups", "in per rank", "bus bytes per rank", `time on ${r.link}`]) html("th", {}, hr, h);
    r.rows.forEach((row, i) => {
      const tr = html("tr", { "data-plan-row": i, "data-op": row.op }, table);
      html("td", {}, tr, String(i + 1));
      html("td", {}, tr, row.op);
      html("td", {}, tr, row.mesh_dim);
      html("td", {}, tr, String(row.groups.length));
      html("td", {}, tr, bytesText(row.bytes));
      html("td", {}, tr, bytesText(row.bus_bytes));
      html("td", {}, tr, humanSeconds(row.seconds));
    });
    html("div", { class: "sv-pg-total" }, planBox, `total ${humanSeconds(r.total_seconds)} on ${r.link} (alpha-beta model)`);
  }

  const unmount = mountPlayer({ model, el: playerBox, experimental });
  const unlisten = listen(model, [
    [
      "change:result",
      () => {
        drawControls();
        drawResult();
      },
    ],
    ["change:choice", drawControls],
  ]);
  drawControls();
  drawResult();
  root.dataset.ready = "true";
  return () => {
    unlisten();
    unmount();
    root.remove();
  };
}

export default { render };
