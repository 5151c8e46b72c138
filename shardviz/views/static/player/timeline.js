// The timeline: one row per event (and per nn.Module header), the current step marked with the
// rows that enclose it, each step's time on the selected link; a click goes to that step.
// The filter (synced trait `filter`, steps.py:Model.matches) hides rows and steps: by phase,
// module and mesh dim; operators that move no data (views, detach) are folded unless all_ops.
// Concatenated into the player's ES module by esm_source("player"); see core.js.

const KINDS = { c: "collective", r: "redistribute", o: "op", l: "local", m: "module" };
const BADGES = { c: "C", r: "R", o: "op", l: "L", m: "M" };
const PHASE_OF = { f: "forward", b: "backward" };

// [value, count, value, count, ...] (steps.py:rle) -> one value per row
function unrle(pairs) {
  const out = [];
  for (let i = 0; i + 1 < (pairs || []).length; i += 2) for (let k = 0; k < pairs[i + 1]; k++) out.push(pairs[i]);
  return out;
}

function drawTimeline(p) {
  const { timelineBox, tl } = p;
  p.rowModule = unrle(tl.module);
  p.rowDims = unrle(tl.dims);
  timelineBox.replaceChildren();
  p.rows = [];
  p.quiet = new Set(tl.quiet || []);
  const stepOfRow = new Map(tl.steps.map((r, k) => [r, k]));
  const frag = document.createDocumentFragment();
  for (let i = 0; i < tl.ids.length; i++) {
    const kind = tl.kinds[i];
    const k = stepOfRow.get(i);
    const attrs = { class: `sv-row sv-kind-${KINDS[kind] || "other"}`, role: "listitem", style: `padding-left:${4 + 14 * tl.depth[i]}px` };
    if (k !== undefined) attrs["data-row-step"] = k;
    if (tl.ids[i] >= 0) attrs["data-row-event"] = tl.ids[i];
    if (p.quiet.has(i)) attrs["data-quiet"] = "true";
    const row = html("div", attrs, frag);
    html("span", { class: "sv-badge" }, row, BADGES[kind] || "?");
    if (tl.ids[i] >= 0) html("span", { class: "sv-row-id" }, row, `#${tl.ids[i]}`);
    const text = tlString(p, tl.label[i]);
    html("span", { class: "sv-row-label", title: text }, row, text);
    const src = tl.source[i] >= 0 ? tl.sources[tl.source[i]] : null;
    if (src) html("span", { class: "sv-row-src", title: `line ${src[0]}: ${src[1]}` }, row, `L${src[0]} ${src[1]}`);
    if (k !== undefined) html("span", { class: "sv-row-cost" }, row);
    p.rows.push(row);
  }
  timelineBox.appendChild(frag);
  drawRowCosts(p);
  applyFilter(p);
}

function drawRowCosts(p) {
  const { tl } = p;
  for (let k = 0; k < nSteps(p); k++) {
    const cell = p.rows[tl.steps[k]]?.querySelector(".sv-row-cost");
    if (cell) cell.textContent = humanSeconds(linkSeconds(p, tl.bus[k], tl.hops[k]));
  }
}

const currentFilter = (p) => p.model.get("filter") || {};
const filtering = (flt) => Boolean(flt.phase || flt.module || flt.mesh_dim);

// Does timeline row i pass the filter (steps.py:Model.matches, plus the fold of no-data operators)?
function rowMatches(p, i, flt) {
  const { tl } = p;
  if (!flt.all_ops && p.quiet.has(i)) return false;
  if (tl.kinds[i] === "m") return false; // a module header shows when a row under it does
  if (flt.phase && (PHASE_OF[tl.phase?.[i]] || "none") !== flt.phase) return false;
  if (flt.module) {
    const m = p.rowModule[i] >= 0 ? tl.strings[p.rowModule[i]] : null;
    if (!m?.includes(flt.module)) return false;
  }
  if (flt.mesh_dim) {
    const dims = p.rowDims[i] >= 0 ? tl.strings[p.rowDims[i]].split(",") : [];
    if (!dims.includes(flt.mesh_dim)) return false;
  }
  return true;
}

// The steps the filter keeps, in order: prev / next / first / last / play move between them.
function shownSteps(p) {
  const flt = currentFilter(p);
  if (!filtering(flt)) return p.tl.steps.map((_, k) => k);
  return p.tl.steps.map((r, k) => (rowMatches(p, r, { ...flt, all_ops: true }) ? k : -1)).filter((k) => k >= 0);
}

// Hide the rows the filter drops; a row shows with every row that encloses it (modules,
// redistributes, operators), so the nesting stays readable.
function applyFilter(p) {
  const { tl, rows } = p;
  const flt = currentFilter(p);
  const show = new Array(tl.ids.length).fill(false);
  const open = []; // indices of the rows enclosing the current one
  for (let i = 0; i < tl.ids.length; i++) {
    while (open.length && tl.depth[open[open.length - 1]] >= tl.depth[i]) open.pop();
    if (rowMatches(p, i, flt)) {
      show[i] = true;
      for (let j = open.length - 1; j >= 0 && !show[open[j]]; j--) show[open[j]] = true;
    }
    open.push(i);
  }
  // the current step's row always shows, so the view never points at a hidden row
  const cur = nSteps(p) ? tl.steps[stepNow(p)] : -1;
  if (cur >= 0) show[cur] = true;
  rows.forEach((row, i) => {
    row.hidden = !show[i];
  });
  p.root.dataset.filtered = filtering(flt) ? "true" : "false";
  if (p.filterCount) {
    const kept = shownSteps(p).length;
    const folded = flt.all_ops ? 0 : p.quiet.size;
    const bits = [];
    if (filtering(flt)) bits.push(`${kept} of ${nSteps(p)} steps`);
    if (folded) bits.push(`${folded} view/detach rows folded`);
    p.filterCount.textContent = bits.join(" · ");
  }
}

function listenTimeline(p) {
  p.timelineBox.addEventListener("click", (ev) => {
    const row = ev.target.closest ? ev.target.closest(".sv-row") : null;
    if (!row) return;
    const i = p.rows.indexOf(row);
    // a row that is not a step (an operator, local compute, a module) goes to the next step shown
    const k = shownSteps(p).find((s) => p.tl.steps[s] >= i);
    if (k !== undefined) setStep(p, k);
  });
}

function markTimeline(p) {
  const { timelineBox, tl, rows } = p;
  for (const r of timelineBox.querySelectorAll(".sv-row-current, .sv-row-context")) r.classList.remove("sv-row-current", "sv-row-context");
  if (!nSteps(p)) return;
  const i = tl.steps[stepNow(p)];
  const row = rows[i];
  if (!row) return;
  // the filter keeps the current row shown: re-apply it when the row moved, or a row shown only
  // because it was current stays
  if (row.hidden || p.shownCurrent !== i) {
    p.shownCurrent = i;
    applyFilter(p);
  }
  row.classList.add("sv-row-current");
  // the enclosing rows (redistribute, operator, module) stay visible as context
  for (let j = i - 1, d = tl.depth[i]; j >= 0 && d > 0; j--) {
    if (tl.depth[j] < d) {
      rows[j].classList.add("sv-row-context");
      d = tl.depth[j];
    }
  }
  const top = row.offsetTop; // the timeline is the rows' offsetParent (position: relative)
  if (top < timelineBox.scrollTop || top + row.offsetHeight > timelineBox.scrollTop + timelineBox.clientHeight) {
    timelineBox.scrollTop = Math.max(0, top - timelineBox.clientHeight / 3);
  }
}

// The filter bar above the timeline: phase, module, mesh dim, and the fold of no-data operators.
function drawFilter(p) {
  const { filterBox, tl } = p;
  filterBox.replaceChildren();
  const flt = currentFilter(p);
  const set = (key, value) => {
    const next = { ...currentFilter(p) };
    if (value === "" || value === false || value === null) delete next[key];
    else next[key] = value;
    p.model.set("filter", next);
    p.model.save_changes();
  };
  const phases = new Set(tl.phase || "");
  if (phases.has("f") || phases.has("b")) {
    const sel = html("select", { "data-control": "phase", "aria-label": "phase", title: "only steps of this phase" }, filterBox);
    for (const [v, t] of [
      ["", "all phases"],
      ["forward", "forward"],
      ["backward", "backward"],
      ["none", "outside forward / backward"],
    ])
      html("option", { value: v }, sel, t);
    sel.value = flt.phase || "";
    sel.addEventListener("change", () => set("phase", sel.value));
  }
  const modules = [
    ...new Set(
      unrle(tl.module)
        .filter((m) => m >= 0)
        .map((m) => tl.strings[m]),
    ),
  ];
  if (modules.length) {
    const listId = `${p.uid}-modules`;
    const input = html(
      "input",
      { type: "search", list: listId, "data-control": "module", placeholder: "module contains…", "aria-label": "module", size: 16 },
      filterBox,
    );
    const dl = html("datalist", { id: listId }, filterBox);
    for (const m of modules.slice(0, 500)) html("option", { value: m }, dl);
    input.value = flt.module || "";
    onCommit(input, () => {
      if ((currentFilter(p).module || "") !== input.value.trim()) set("module", input.value.trim());
    });
  }
  const dims = [
    ...new Set(
      unrle(tl.dims)
        .filter((d) => d >= 0)
        .flatMap((d) => tl.strings[d].split(",")),
    ),
  ].sort();
  if (dims.length > 1 || (dims.length === 1 && dims[0] !== "-")) {
    const sel = html("select", { "data-control": "mesh-dim", "aria-label": "mesh dim", title: "only collectives on this mesh dim" }, filterBox);
    html("option", { value: "" }, sel, "all mesh dims");
    for (const d of dims) html("option", { value: d }, sel, d === "-" ? "no mesh dim" : `mesh ${d}`);
    sel.value = flt.mesh_dim || "";
    sel.addEventListener("change", () => set("mesh_dim", sel.value));
  }
  if (p.quiet.size) {
    const lab = html(
      "label",
      { class: "sv-all-ops", title: "operators that only view a tensor (detach, view, t, ...) move no data; they are folded" },
      filterBox,
    );
    const box = html("input", { type: "checkbox", "data-control": "all-ops" }, lab);
    box.checked = !!flt.all_ops;
    lab.appendChild(document.createTextNode(` view ops (${p.quiet.size})`));
    box.addEventListener("change", () => set("all_ops", box.checked));
  }
  p.filterCount = html("span", { class: "sv-filter-count", "aria-live": "polite" }, filterBox);
  filterBox.hidden = !filterBox.querySelector("select, input");
}
