// The step's detail: what the event is (op, groups, source line, enclosing module and events),
// its cost, the semantics check, then the panel for its kind (the data flow and the ring, or a
// redistribute's layouts and plan) and its notes.
// Concatenated into the player's ES module by esm_source("player"); see core.js.

async function drawDetail(p) {
  const { detailBox } = p;
  const my = ++p.token;
  const n = nSteps(p);
  if (!n) {
    detailBox.replaceChildren(html("div", { class: "sv-note" }, null, "nothing to step through: record collectives or redistributes inside sv.record()"));
    finishDetail(p, -1);
    return;
  }
  const k = stepNow(p);
  let d;
  try {
    d = await fetchStep(p, k);
  } catch (err) {
    if (my !== p.token) return;
    detailBox.replaceChildren(html("div", { class: "sv-warning" }, null, `this step cannot be shown: ${err.message}`));
    finishDetail(p, k);
    return;
  }
  if (my !== p.token) return;
  detailBox.replaceChildren();
  drawMeta(p, d);
  drawCost(p, d);
  if (d.kind === "redistribute") drawRedistribute(p, d);
  else {
    drawCheck(p, d);
    drawFlow(p, d);
    drawRing(p, d);
  }
  if (d.notes?.length) {
    const ul = html("ul", { class: "sv-notes" }, detailBox);
    for (const note of d.notes) html("li", {}, ul, note);
  }
  finishDetail(p, k);
}

// data-detail-step says which step is drawn; data-ready and data-render-ms mark the first drawing.
function finishDetail(p, k) {
  const { root } = p;
  root.dataset.detailStep = String(k);
  if (!root.dataset.ready) {
    root.dataset.renderMs = String(Math.round(performance.now() - p.t0));
    root.dataset.ready = "true";
  }
}

function drawMeta(p, d) {
  const box = html("div", { class: "sv-meta" }, p.detailBox);
  const line = html("div", { class: "sv-meta-line" }, box);
  html("strong", {}, line, d.kind === "redistribute" ? "redistribute" : d.op === "local" ? `local ${d.name}` : d.op);
  const bits = [];
  if (d.kind === "collective") {
    if (d.reduce_op) bits.push(`reduce ${d.reduce_op}`);
    if (d.pairs?.length) {
      // send / recv: who sends to whom (the recorded root is the peer's index in each pair)
      const moves = d.pairs.slice(0, 6).map(([a, b]) => `rank ${a} → rank ${b}`);
      bits.push(`${moves.join(", ")}${d.pairs.length > 6 ? " …" : ""}`);
    } else if (d.root !== null && d.root !== undefined) bits.push(`root index ${d.root} (rank${d.roots.length > 1 ? "s" : ""} ${d.roots.join(", ")})`);
    bits.push(d.where);
    bits.push(
      `${d.groups.length} group${d.groups.length === 1 ? "" : "s"} of ${d.groups[0] ? d.groups[0].length : 0}: ${d.groups
        .slice(0, 6)
        .map((g) => `[${g.join(",")}]`)
        .join(" ")}${d.groups.length > 6 ? " …" : ""}`,
    );
    bits.push(d.impl);
  } else if (d.kind === "redistribute") {
    bits.push(`[${d.src.join(", ")}] → [${d.dst.join(", ")}]`);
    bits.push(d.explicit ? "explicit" : "implicit");
  }
  line.appendChild(document.createTextNode(` · ${bits.join(" · ")}`));
  if (d.source) html("div", { class: "sv-meta-src" }, box).appendChild(html("code", {}, null, `${d.source.file}:${d.source.line}  ${d.source.text}`));
  const ctx = [];
  if (d.module) ctx.push(`module ${d.module}`);
  if (d.phase) ctx.push(d.phase);
  const ctxLine = html("div", { class: "sv-meta-ctx" }, box, ctx.join(" · "));
  for (const a of d.context || []) {
    ctxLine.appendChild(document.createTextNode(ctxLine.childNodes.length ? " · in " : "in "));
    const link_ = html("button", { type: "button", class: "sv-linkish", "data-goto-event": a.id }, ctxLine, `#${a.id} ${a.label}`);
    if (a.step !== null && a.step !== undefined) link_.addEventListener("click", () => setStep(p, a.step));
    else link_.disabled = true;
  }
}

function drawCheck(p, d) {
  const { detailBox } = p;
  if (!d.check) return;
  const c = d.check;
  if (!c.checked) {
    html("div", { class: "sv-check sv-note", "data-check": "flow" }, detailBox, `semantics check: ${c.note}`);
    return;
  }
  const worst = Math.max(0, ...Object.values(c.max_error).map((x) => (x === null ? Infinity : x)));
  if (c.ok) {
    html(
      "div",
      { class: "sv-check sv-ok", "data-check": "flow" },
      detailBox,
      `✓ recorded outputs = the ${d.op} applied to the recorded inputs (max |difference| ${fmtNum(worst)})`,
    );
  } else {
    const bad = Object.entries(c.max_error)
      .filter(([, x]) => x === null || x > 0)
      .map(([r]) => r);
    html(
      "div",
      { class: "sv-warning", "data-check": "flow", role: "alert" },
      detailBox,
      `⚠ ${c.note}: ranks ${bad.join(", ")} (max |difference| ${fmtNum(worst)})`,
    );
  }
}
