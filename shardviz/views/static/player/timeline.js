// The timeline: one row per event (and per nn.Module header), the current step marked with the
// rows that enclose it, each step's time on the selected link; a click goes to that step.
// Concatenated into the player's ES module by esm_source("player"); see core.js.

const KINDS = { c: "collective", r: "redistribute", o: "op", l: "local", m: "module" };
const BADGES = { c: "C", r: "R", o: "op", l: "L", m: "M" };

function drawTimeline(p) {
  const { timelineBox, tl } = p;
  timelineBox.replaceChildren();
  p.rows = [];
  const stepOfRow = new Map(tl.steps.map((r, k) => [r, k]));
  const frag = document.createDocumentFragment();
  for (let i = 0; i < tl.ids.length; i++) {
    const kind = tl.kinds[i];
    const k = stepOfRow.get(i);
    const attrs = { class: `sv-row sv-kind-${KINDS[kind] || "other"}`, role: "listitem", style: `padding-left:${4 + 14 * tl.depth[i]}px` };
    if (k !== undefined) attrs["data-row-step"] = k;
    if (tl.ids[i] >= 0) attrs["data-row-event"] = tl.ids[i];
    const row = html("div", attrs, frag);
    html("span", { class: "sv-badge" }, row, BADGES[kind] || "?");
    if (tl.ids[i] >= 0) html("span", { class: "sv-row-id" }, row, `#${tl.ids[i]}`);
    html("span", { class: "sv-row-label" }, row, tlString(p, tl.label[i]));
    const src = tl.source[i] >= 0 ? tl.sources[tl.source[i]] : null;
    if (src) html("span", { class: "sv-row-src", title: src[1] }, row, `L${src[0]} ${src[1]}`);
    if (k !== undefined) html("span", { class: "sv-row-cost" }, row);
    p.rows.push(row);
  }
  timelineBox.appendChild(frag);
  drawRowCosts(p);
}

function drawRowCosts(p) {
  const { tl } = p;
  for (let k = 0; k < nSteps(p); k++) {
    const cell = p.rows[tl.steps[k]]?.querySelector(".sv-row-cost");
    if (cell) cell.textContent = humanSeconds(linkSeconds(p, tl.bus[k], tl.hops[k]));
  }
}

function listenTimeline(p) {
  p.timelineBox.addEventListener("click", (ev) => {
    const row = ev.target.closest ? ev.target.closest(".sv-row") : null;
    if (!row) return;
    const i = p.rows.indexOf(row);
    // a row that is not a step (an operator, local compute, a module) goes to the next step
    const k = p.tl.steps.findIndex((r) => r >= i);
    if (k >= 0) setStep(p, k);
  });
}

function markTimeline(p) {
  const { timelineBox, tl, rows } = p;
  for (const r of timelineBox.querySelectorAll(".sv-row-current, .sv-row-context")) r.classList.remove("sv-row-current", "sv-row-context");
  if (!nSteps(p)) return;
  const i = tl.steps[stepNow(p)];
  const row = rows[i];
  if (!row) return;
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
