// A redistribute: its layouts before and after (drawn with the layout view's code from common.js)
// and its plan, one row per mesh dim with a link to the step of its collective.
// Concatenated into the player's ES module by esm_source("player"); see core.js.

function drawLayoutMini(p, payload, parent, title) {
  const wrap = html("div", { class: "shardviz sv-layout sv-mini" }, parent);
  html("div", { class: "sv-panel-title" }, wrap, title);
  if (!payload) {
    html("div", { class: "sv-note" }, wrap, "layout not recorded");
    return;
  }
  const geo = prepare(payload);
  const uid = `${p.uid}-${title.replace(/\W/g, "")}`;
  const fillFor = makeFill(uid, geo.palette);
  const tbox = html("div", { class: "sv-tensor" }, wrap);
  html("div", { class: "sv-sub" }, tbox, `[${geo.placements.join(", ")}] on mesh ${fmtShape(geo.mesh_shape)}`);
  const mbox = html("div", { class: "sv-mesh" }, wrap);
  drawLayoutGroups(geo, tbox, mbox, { uid, fillFor, tensorPx: 200, meshPx: 140, most: 2 });
}

function drawRedistribute(p, d) {
  const section = html("div", { class: "sv-redistribute" }, p.detailBox);
  const pair = html("div", { class: "sv-layout-pair" }, section);
  drawLayoutMini(p, d.before, pair, "before");
  html("div", { class: "sv-big-arrow", "aria-hidden": "true" }, pair, "→");
  drawLayoutMini(p, d.after, pair, "after");
  const plan = html("div", { class: "sv-plan" }, section);
  html("div", { class: "sv-panel-title" }, plan, `plan ${d.plan || "(none recorded)"}`);
  if (!d.plan_steps.length) return;
  const table = html("table", { class: "sv-plan-table" }, plan);
  const hr = html("tr", {}, table);
  for (const h of ["#", "mesh dim", "placement", "collective", ""]) html("th", {}, hr, h);
  d.plan_steps.forEach((ps, i) => {
    const tr = html("tr", { "data-plan-step": i }, table);
    html("td", {}, tr, String(i + 1));
    html("td", {}, tr, ps.dim_label);
    html("td", {}, tr, `${ps.src} → ${ps.dst}`);
    html("td", {}, tr, ps.op || "local: no communication");
    const td = html("td", {}, tr);
    if (ps.step !== null && ps.step !== undefined) {
      const b = html("button", { type: "button", class: "sv-linkish", "data-goto-step": ps.step }, td, `step ${ps.step + 1} (#${ps.event})`);
      b.addEventListener("click", () => setStep(p, ps.step));
    }
  });
}
