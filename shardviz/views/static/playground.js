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

  function drawControls() {
    controls.replaceChildren();
    const c = model.get("choice") || {};
    const offline = Boolean(model.get("result")?.offline);
    const text = (key, label, value, title) => {
      const lab = html("label", { class: "sv-pg-field" }, controls, `${label} `);
      const input = html("input", { type: "text", "data-control": key, value, title, size: 12 }, lab);
      input.disabled = offline;
      return input;
    };
    const shape = text("shape", "tensor shape", joined(c.shape), "the global tensor's shape, e.g. 10, 6");
    const mesh = text("mesh_shape", "mesh", joined(c.mesh_shape), "the mesh shape, e.g. 2, 2");
    const names = text("mesh_dim_names", "dim names", joined(c.mesh_dim_names), "one name per mesh dim");
    const nd = (parseInts(c.shape) || []).length;
    const ms = parseInts(c.mesh_shape) || [];
    const grid = html("div", { class: "sv-pg-placements" }, controls);
    const selects = { src: [], dst: [] };
    for (const which of ["src", "dst"]) {
      const row = html("div", { class: "sv-pg-row" }, grid);
      html("span", { class: "sv-pg-label" }, row, which === "src" ? "source" : "target");
      ms.forEach((_, m) => {
        const cur = (c[which] || [])[m] || "R";
        const name = (c.mesh_dim_names || [])[m] || `d${m}`;
        const lab = html("label", { class: "sv-pg-field" }, row, `${name} `);
        const sel = html("select", { "data-control": `${which}-${m}`, "aria-label": `${which} placement on ${name}` }, lab);
        for (const o of placementOptions(nd, cur)) html("option", { value: o }, sel, o);
        sel.value = cur;
        sel.disabled = offline;
        sel.addEventListener("change", commit);
        selects[which].push(sel);
      });
    }
    function commit() {
      const shapeV = parseInts(shape.value);
      const meshV = parseInts(mesh.value);
      const n = meshV ? meshV.length : ms.length;
      const nameList = names.value
        .split(",")
        .map((s) => s.trim())
        .filter((s) => s);
      const choice = {
        shape: shapeV || shape.value,
        mesh_shape: meshV || mesh.value,
        // a new mesh rank keeps what was chosen per dim and fills the rest: one name and one
        // placement per mesh dim, Replicate where nothing was chosen
        mesh_dim_names: nameList.length === ms.length && n !== ms.length ? fit(nameList, n, (m) => `d${m}`) : nameList,
        src: fit(
          selects.src.map((s) => s.value),
          n,
          () => "R",
        ),
        dst: fit(
          selects.dst.map((s) => s.value),
          n,
          () => "R",
        ),
      };
      send(choice);
    }
    for (const input of [shape, mesh, names]) onCommit(input, commit);
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
