// shardviz collective player: a trace's collectives and redistributes, one step at a time.
// Hand-written ESM, no bundler; Python prepends common.js (svg/html helpers, value decoding, the
// layout view's tensor and mesh drawing) to make one module.
//
// Synced traits: step (the current step, from 0), link (cost preset), timeline (columnar rows,
// strings deduplicated) and info. Everything per step comes on demand through anywidget commands:
// fetch_step {step} (JSON), fetch_values {step, group} (one binary buffer per tensor) and
// fetch_ring {step, group} (ring states, one float64 buffer). The offline HTML export answers the
// same commands from embedded replies.
//
// DOM contract: the root has data-shardviz-view="player"; buttons data-action="first", "prev",
// "next", "last"; one element (.sv-current) carries data-step="<step>" and data-event-id="<id>".

const PLAY_MS = 1200; // one step per this many ms while playing
const BUF_W = 96; // widest buffer drawing in a rank column, px
const BUF_H = 150; // tallest buffer drawing, px
const MAX_CELL = 22; // largest element cell, px
const TEXT_CELL = 14; // cells at least this big print their value
const SHOW_GROUPS_UP_TO = 16; // ranks drawn at once before a group selector appears
const KINDS = { c: "collective", r: "redistribute", o: "op", l: "local", m: "module" };
const BADGES = { c: "C", r: "R", o: "op", l: "L", m: "M" };

// The same text as shardviz.cost.human_bytes / human_seconds, so numbers match trace.summary().
function humanBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  for (const unit of units) {
    if (Math.abs(n) < 1024 || unit === "TiB") return unit === "B" ? `${n.toFixed(0)} B` : `${n.toFixed(2)} ${unit}`;
    n /= 1024;
  }
  return `${n.toFixed(2)} TiB`;
}

function humanSeconds(s) {
  if (s < 1e-3) return `${(s * 1e6).toFixed(1)} us`;
  if (s < 1) return `${(s * 1e3).toFixed(2)} ms`;
  return `${s.toFixed(2)} s`;
}

function maskRanks(mask, ranks) {
  const out = [];
  for (let i = 0; i < ranks.length; i++) if (mask & (1 << i)) out.push(ranks[i]);
  return out;
}

function render({ model, el, experimental }) {
  const invoke = makeInvoke(model, experimental);
  const uid = `sv${Math.random().toString(36).slice(2, 9)}`;
  const t0 = performance.now();
  const root = html("div", { class: "shardviz sv-player", "data-shardviz-view": "player", tabindex: 0 }, el);
  let tl = model.get("timeline");
  let info = model.get("info");
  const style = (rank) => rankStyle(info.palette, rank);
  const details = new Map(); // step -> Promise<detail>
  const valuesCache = new Map(); // "step/group" -> Promise<Map(key -> decoded)>
  const ringCache = new Map(); // "step/group" -> Promise<{meta, vals}>
  let playing = null;
  let ringOpen = false;
  let ringState = 0;
  let groupPick = 0;
  let token = 0;

  const head = html("div", { class: "sv-head" }, root);
  const controls = html("div", { class: "sv-controls" }, root);
  const current = html("div", { class: "sv-current", "aria-live": "polite" }, root);
  const main = html("div", { class: "sv-main" }, root);
  const timelineBox = html("div", { class: "sv-timeline", role: "list" }, main);
  const detailBox = html("div", { class: "sv-detail" }, main);
  const totals = html("div", { class: "sv-totals" }, root);

  const nSteps = () => tl.steps.length;
  const stepNow = () => Math.min(Math.max(model.get("step") || 0, 0), Math.max(nSteps() - 1, 0));
  const link = () => info.links[model.get("link")] || Object.values(info.links)[0];
  const secs = (bus, hops) => link().alpha * hops + bus / link().beta;
  const str = (i) => (i >= 0 ? tl.strings[i] : "");

  function setStep(k) {
    const n = nSteps();
    if (!n) return;
    const next = Math.min(Math.max(k, 0), n - 1);
    if (next === model.get("step")) return;
    model.set("step", next);
    model.save_changes();
  }

  // ---- header, controls, totals ----

  function drawHead() {
    head.replaceChildren();
    html("div", { class: "sv-title" }, head, info.title);
    const parts = [`${info.world_size} ranks`, `${info.events} events`, `${info.collectives} collectives`, `${info.steps} steps`];
    if (info.local_steps) parts.push("local compute included as steps");
    html("div", { class: "sv-sub" }, head, parts.join(" · "));
    for (const note of info.notes || []) html("div", { class: "sv-note" }, head, note);
  }

  let slider, stepLabel, playBtn;
  function drawControls() {
    controls.replaceChildren();
    const n = nSteps();
    const button = (action, text, label) => {
      const b = html("button", { type: "button", "data-action": action, "aria-label": label, title: label }, controls, text);
      if (n === 0) b.classList.add("sv-at-end");
      b.addEventListener("click", () => act(action));
      return b;
    };
    button("first", "« first", "first step (Home)");
    button("prev", "‹ prev", "previous step (←)");
    playBtn = button("play", "▶ play", "play / pause (space)");
    button("next", "next ›", "next step (→)");
    button("last", "last »", "last step (End)");
    slider = html("input", { type: "range", min: 0, max: Math.max(n - 1, 0), value: stepNow(), "data-control": "step", "aria-label": "step" }, controls);
    slider.disabled = n === 0;
    slider.addEventListener("input", () => setStep(Number(slider.value)));
    stepLabel = html("span", { class: "sv-step-label" }, controls);
    const lab = html("label", { class: "sv-link" }, controls, "link ");
    const sel = html("select", { "data-control": "link" }, lab);
    for (const [key, lk] of Object.entries(info.links)) html("option", { value: key }, sel, lk.name);
    sel.value = model.get("link");
    sel.addEventListener("change", () => {
      model.set("link", sel.value);
      model.save_changes();
    });
  }

  function act(action) {
    const k = stepNow();
    if (action === "first") setStep(0);
    else if (action === "prev") setStep(k - 1);
    else if (action === "next") setStep(k + 1);
    else if (action === "last") setStep(nSteps() - 1);
    else if (action === "play") togglePlay();
  }

  function togglePlay() {
    if (playing) {
      clearInterval(playing);
      playing = null;
    } else if (nSteps() > 1) {
      if (stepNow() >= nSteps() - 1) setStep(0);
      playing = setInterval(() => {
        if (stepNow() >= nSteps() - 1) togglePlay();
        else setStep(stepNow() + 1);
      }, PLAY_MS);
    }
    root.classList.toggle("sv-playing", !!playing);
    if (playBtn) playBtn.textContent = playing ? "❚❚ pause" : "▶ play";
  }

  function drawTotals() {
    totals.replaceChildren();
    const k = stepNow();
    let soFarBus = 0,
      soFarHops = 0;
    for (let i = 0; i < nSteps() && i <= k; i++) {
      if (tl.total_kinds[i] !== "c") continue;
      soFarBus += tl.bus[i];
      soFarHops += tl.hops[i];
    }
    const total = secs(info.total_bus, info.total_hops);
    html(
      "span",
      { class: "sv-total", "data-total-seconds": total },
      totals,
      `trace total: ${humanBytes(info.total_bus)} bus bytes per rank, ${humanSeconds(total)} on ${link().name}` +
        (nSteps() ? ` · through this step: ${humanBytes(soFarBus)}, ${humanSeconds(secs(soFarBus, soFarHops))}` : ""),
    );
  }

  // ---- timeline ----

  let rows = []; // row index -> element
  const stepRow = () => tl.steps[stepNow()];
  function drawTimeline() {
    timelineBox.replaceChildren();
    rows = [];
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
      html("span", { class: "sv-row-label" }, row, str(tl.label[i]));
      const src = tl.source[i] >= 0 ? tl.sources[tl.source[i]] : null;
      if (src) html("span", { class: "sv-row-src", title: src[1] }, row, `L${src[0]} ${src[1]}`);
      if (k !== undefined) html("span", { class: "sv-row-cost" }, row);
      rows.push(row);
    }
    timelineBox.appendChild(frag);
    drawRowCosts();
  }

  function drawRowCosts() {
    for (let k = 0; k < nSteps(); k++) {
      const cell = rows[tl.steps[k]]?.querySelector(".sv-row-cost");
      if (cell) cell.textContent = humanSeconds(secs(tl.bus[k], tl.hops[k]));
    }
  }

  timelineBox.addEventListener("click", (ev) => {
    const row = ev.target.closest ? ev.target.closest(".sv-row") : null;
    if (!row) return;
    const i = rows.indexOf(row);
    // a row that is not a step (an operator, local compute, a module) goes to the next step
    const k = tl.steps.findIndex((r) => r >= i);
    if (k >= 0) setStep(k);
  });

  function markTimeline() {
    for (const r of timelineBox.querySelectorAll(".sv-row-current, .sv-row-context")) r.classList.remove("sv-row-current", "sv-row-context");
    if (!nSteps()) return;
    const i = stepRow();
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

  // ---- the current event (contract element) ----

  function drawCurrent() {
    current.replaceChildren();
    const n = nSteps();
    const k = stepNow();
    current.setAttribute("data-step", String(k));
    if (!n) {
      current.setAttribute("data-event-id", "");
      html("span", {}, current, "no collectives or redistributes in this trace");
      if (stepLabel) stepLabel.textContent = "step – / 0";
      return;
    }
    const i = tl.steps[k];
    current.setAttribute("data-event-id", String(tl.ids[i]));
    if (slider) slider.value = String(k);
    if (stepLabel) stepLabel.textContent = `step ${k + 1} / ${n}`;
    html("span", { class: "sv-current-step" }, current, `step ${k + 1} of ${n}`);
    html("strong", { class: "sv-current-label" }, current, ` #${tl.ids[i]} ${str(tl.label[i])}`);
    const src = tl.source[i] >= 0 ? tl.sources[tl.source[i]] : null;
    if (src) html("code", { class: "sv-current-src" }, current, `line ${src[0]}: ${src[1]}`);
    // at an end the buttons stay enabled (a click is a no-op), only greyed: scripts and tests may
    // click "first" on the first step (Playwright also treats aria-disabled as disabled)
    for (const b of controls.querySelectorAll("[data-action=first], [data-action=prev]")) b.classList.toggle("sv-at-end", k === 0);
    for (const b of controls.querySelectorAll("[data-action=next], [data-action=last]")) b.classList.toggle("sv-at-end", k >= n - 1);
  }

  // ---- requests ----

  function fetchStep(k) {
    if (!details.has(k)) {
      const p = invoke("fetch_step", { step: k }).then(([reply]) => {
        if (!reply || reply.error) throw new Error(reply ? reply.error : "no reply");
        return reply;
      });
      p.catch(() => details.delete(k));
      details.set(k, p);
    }
    return details.get(k);
  }

  function fetchValues(k, group) {
    const key = `${k}/${group}`;
    if (!valuesCache.has(key)) {
      const p = invoke("fetch_values", { step: k, group }).then(([reply, buffers]) => {
        if (!reply || reply.error) throw new Error(reply ? reply.error : "no reply");
        const out = new Map();
        reply.entries.forEach((meta, j) => {
          out.set(`${meta.rank}/${meta.side}/${meta.slot ?? -1}`, decodeValues(meta, buffers[j]));
        });
        return out;
      });
      p.catch(() => valuesCache.delete(key));
      valuesCache.set(key, p);
    }
    return valuesCache.get(key);
  }

  function fetchRing(k, group) {
    const key = `${k}/${group}`;
    if (!ringCache.has(key)) {
      const p = invoke("fetch_ring", { step: k, group }).then(([reply, buffers]) => {
        if (!reply || reply.error) throw new Error(reply ? reply.error : "no reply");
        const b = buffers[0];
        const bytes =
          b instanceof DataView
            ? b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength)
            : b.buffer
              ? b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength)
              : b;
        const data = reply.format === "f8" ? new Float64Array(bytes) : new Float32Array(bytes);
        // counts[(state * n + rank) * n + chunk] leading values, packed in that order
        const offsets = new Int32Array(reply.counts.length + 1);
        reply.counts.forEach((c, i) => {
          offsets[i + 1] = offsets[i] + Math.max(c, 0);
        });
        const n = reply.n;
        const sends = reply.sends.map((flat) => {
          const out = [];
          for (let i = 0; i < flat.length; i += 3) out.push([flat[i], flat[i + 1], flat[i + 2]]);
          return out;
        });
        const at = (si, i, c) => (si * n + i) * n + c;
        return {
          meta: { ...reply, sends },
          mask: (si, i, c) => reply.contributors[at(si, i, c)],
          val: (si, i, c) => {
            const j = at(si, i, c);
            const cnt = reply.counts[j];
            return cnt < 0 ? null : Array.from(data.subarray(offsets[j], offsets[j] + cnt));
          },
        };
      });
      p.catch(() => ringCache.delete(key));
      ringCache.set(key, p);
    }
    return ringCache.get(key);
  }

  // ---- the step's detail ----

  async function drawDetail() {
    const my = ++token;
    const n = nSteps();
    if (!n) {
      detailBox.replaceChildren(html("div", { class: "sv-note" }, null, "nothing to step through: record collectives or redistributes inside sv.record()"));
      finish(-1);
      return;
    }
    const k = stepNow();
    let d;
    try {
      d = await fetchStep(k);
    } catch (err) {
      if (my !== token) return;
      detailBox.replaceChildren(html("div", { class: "sv-warning" }, null, `this step cannot be shown: ${err.message}`));
      finish(k);
      return;
    }
    if (my !== token) return;
    detailBox.replaceChildren();
    drawMeta(d);
    drawCost(d);
    if (d.kind === "redistribute") drawRedistribute(d);
    else {
      drawCheck(d);
      drawFlow(d);
      drawRing(d);
    }
    if (d.notes?.length) {
      const ul = html("ul", { class: "sv-notes" }, detailBox);
      for (const note of d.notes) html("li", {}, ul, note);
    }
    finish(k);
  }

  function finish(k) {
    root.dataset.detailStep = String(k);
    if (!root.dataset.ready) {
      root.dataset.renderMs = String(Math.round(performance.now() - t0));
      root.dataset.ready = "true";
    }
  }

  function drawMeta(d) {
    const box = html("div", { class: "sv-meta" }, detailBox);
    const line = html("div", { class: "sv-meta-line" }, box);
    html("strong", {}, line, d.kind === "redistribute" ? "redistribute" : d.op === "local" ? `local ${d.name}` : d.op);
    const bits = [];
    if (d.kind === "collective") {
      if (d.reduce_op) bits.push(`reduce ${d.reduce_op}`);
      if (d.root !== null && d.root !== undefined) bits.push(`root index ${d.root} (rank${d.roots.length > 1 ? "s" : ""} ${d.roots.join(", ")})`);
      const where = d.mesh_dim_name || (d.mesh_dim !== null && d.mesh_dim !== undefined ? `dim ${d.mesh_dim}` : null);
      bits.push(where ? `mesh ${where}` : "groups match no mesh dim");
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
      if (a.step !== null && a.step !== undefined) link_.addEventListener("click", () => setStep(a.step));
      else link_.disabled = true;
    }
  }

  function drawCost(d) {
    const box = html("div", { class: "sv-cost", "data-cost-step": d.step }, detailBox);
    const t = secs(d.cost.bus, d.cost.hops);
    const lk = link();
    const what = d.kind === "redistribute" ? `its ${d.children.length} collective${d.children.length === 1 ? "" : "s"}` : "this step";
    html("span", { class: "sv-cost-bytes" }, box, `bus bytes per rank: ${humanBytes(d.cost.bus)}`);
    html("span", { class: "sv-cost-time", "data-seconds": t }, box, `estimated time: ${humanSeconds(t)}`);
    html(
      "span",
      { class: "sv-note" },
      box,
      `${what} on ${lk.name}: α ${humanSeconds(lk.alpha)} × ${d.cost.hops} sequential steps + bytes / β ${(lk.beta / 1e9).toFixed(1)} GB/s`,
    );
  }

  function drawCheck(d) {
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

  // ---- data flow: every rank's buffer before and after, arrows for what moves ----

  function groupsShown(d) {
    const total = d.groups.reduce((a, g) => a + g.length, 0);
    if (total <= SHOW_GROUPS_UP_TO) return d.groups.map((_, i) => i);
    return [Math.min(groupPick, d.groups.length - 1)];
  }

  // Slots (or the one tensor) of a buffer stacked vertically, in element units.
  function bufferBoxes(buf) {
    const shapes = buf.slots || [buf.shape];
    let y = 0;
    const out = [];
    for (const shape of shapes) {
      const rows = shape.length ? shape[0] : 1;
      const cols = shape.length > 1 ? shape.slice(1).reduce((a, b) => a * b, 1) : 1;
      out.push({ y, rows, cols, shape });
      y += rows;
    }
    return { slots: out, rows: y, cols: Math.max(1, ...out.map((s) => s.cols)), nslots: shapes.length };
  }

  function drawFlow(d) {
    const section = html("div", { class: "sv-flow" }, detailBox);
    const shown = groupsShown(d);
    if (shown.length < d.groups.length) {
      const lab = html("label", { class: "sv-group-pick" }, section, `${d.groups.length} groups ran this step at once; showing group `);
      const sel = html("select", { "data-control": "group" }, lab);
      d.groups.forEach((g, i) => {
        html("option", { value: i }, sel, `${i}: ranks ${rankList(g)}`);
      });
      sel.value = String(shown[0]);
      sel.addEventListener("change", () => {
        groupPick = Number(sel.value);
        drawDetail();
      });
    }
    const legend = html("div", { class: "sv-flow-legend sv-note" }, section);
    legend.textContent =
      "top: each rank's buffer before · bottom: after · arrows: what moves (colour of the sending rank); dashed: what a rank keeps of its own; Σ: reduced";
    const panels = html("div", { class: "sv-groups" }, section);
    for (const gi of shown) drawGroup(d, gi, panels);
  }

  function drawGroup(d, gi, parent) {
    const ranks = d.groups[gi];
    const panel = html("div", { class: "sv-group", "data-group": gi }, parent);
    if (d.groups.length > 1) html("div", { class: "sv-group-title" }, panel, `group ${gi}: ranks ${rankList(ranks)}`);
    const geo = ranks.map((r) => {
      const info_ = d.ranks[String(r)] || {};
      return { rank: r, info: info_, in: info_.in ? bufferBoxes(info_.in) : null, out: info_.out ? bufferBoxes(info_.out) : null };
    });
    const maxCols = Math.max(1, ...geo.flatMap((x) => [x.in ? x.in.cols : 1, x.out ? x.out.cols : 1]));
    const maxRows = Math.max(1, ...geo.flatMap((x) => [x.in ? x.in.rows : 1, x.out ? x.out.rows : 1]));
    const cell = Math.min(MAX_CELL, BUF_W / maxCols, BUF_H / maxRows);
    const gap = 3; // px between the slots of a list
    const size = (b) => (b ? { w: Math.max(b.cols * cell, 4), h: b.rows * cell + (b.nslots - 1) * gap } : { w: 0, h: 0 });
    const colW = Math.max(70, Math.min(BUF_W, maxCols * cell) + 34);
    const n = ranks.length;
    const hIn = Math.max(8, ...geo.map((x) => size(x.in).h));
    const hOut = Math.max(8, ...geo.map((x) => size(x.out).h));
    const top = 30;
    const zone = d.op === "barrier" ? 40 : Math.min(140, 46 + 8 * n);
    const yIn = top,
      yOut = top + hIn + zone;
    const W = n * colW + 26,
      H = yOut + hOut + 30;
    const s = svg("svg", { width: W, height: H, class: "sv-flow-svg", role: "img", "aria-label": `data flow of group ${gi}` }, panel);
    const defs = svg("defs", {}, s);
    const padId = `${uid}-pad`;
    const pat = svg("pattern", { id: padId, patternUnits: "userSpaceOnUse", width: 5, height: 5, patternTransform: "rotate(45)" }, defs);
    svg("rect", { width: 5, height: 5, fill: "#e6e6e6" }, pat);
    svg("line", { x1: 0, y1: 0, x2: 0, y2: 5, stroke: "#888", "stroke-width": 1.6 }, pat);
    const markers = new Map();
    const marker = (color) => {
      if (!markers.has(color)) {
        const id = `${uid}-m${markers.size}`;
        const m = svg("marker", { id, viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" }, defs);
        svg("path", { d: "M0,0 L10,5 L0,10 z", fill: color }, m);
        markers.set(color, id);
      }
      return markers.get(color);
    };
    const xOf = (i) => 22 + i * colW + (colW - 34 - Math.min(BUF_W, maxCols * cell)) / 2;
    const pos = new Map(ranks.map((r, i) => [r, i]));
    const drawn = new Map(); // `${rank}/${side}` -> {x, y, box, cell}
    ranks.forEach((r, i) => {
      const st = style(r);
      const cx = 22 + i * colW + (colW - 34) / 2;
      const isRoot = d.roots?.includes(r);
      const lab = svg("g", { class: "sv-rank-head", "data-flow-rank": r }, s);
      svg("rect", { x: cx - 22, y: 4, width: 44, height: 16, rx: 3, fill: st.fill }, lab);
      svg("text", { x: cx, y: 16, "text-anchor": "middle", fill: st.text, class: "sv-rank-text" }, lab).textContent = `r${r}${isRoot ? " root" : ""}`;
      for (const [side, y] of [
        ["in", yIn],
        ["out", yOut],
      ]) {
        const b = geo[i][side];
        const buf = geo[i].info[side];
        if (!b) {
          if (d.op !== "barrier") svg("text", { x: cx, y: y + 12, "text-anchor": "middle", class: "sv-none" }, s).textContent = "—";
          continue;
        }
        const x = xOf(i);
        const g = svg("g", { class: `sv-buf sv-buf-${side}${buf.role ? ` sv-${buf.role}` : ""}`, "data-buf-rank": r, "data-buf-side": side }, s);
        drawBuffer(g, buf, b, x, y, cell, gap, r, side, padId);
        drawn.set(`${r}/${side}`, { x, y, b, buf, cell, gap });
        if (buf.role) svg("text", { x: x, y: y + size(b).h + 11, class: "sv-role" }, s).textContent = buf.role === "ignored" ? "not read" : "not defined";
      }
      const nb = geo[i].info.nbytes;
      if (nb !== undefined && d.kind !== "local")
        svg("text", { x: cx, y: H - 6, "text-anchor": "middle", class: "sv-bytes" }, s).textContent = `${humanBytes(geo[i].info.bus || 0)} bus`;
    });
    for (const [text, y, h] of [
      ["before", yIn, hIn],
      ["after", yOut, hOut],
    ]) {
      const cy = y + h / 2;
      svg("text", { x: 9, y: cy, class: "sv-side", "text-anchor": "middle", transform: `rotate(-90 9 ${cy})` }, s).textContent = text;
    }
    if (d.op === "barrier") {
      const y = yIn + hIn + zone / 2;
      svg("line", { x1: 4, x2: W - 4, y1: y, y2: y, class: "sv-barrier" }, s);
      svg("text", { x: W / 2, y: y - 4, "text-anchor": "middle", class: "sv-note-svg" }, s).textContent = "barrier: all wait here";
    }
    // arrows
    // Where an arrow leaves / enters a part: the buffer's bottom / top edge when the part touches
    // it, else the part's right / left side, so that arrowheads never cover another part's values.
    const anchor = (rank, side, part) => {
      const a = drawn.get(`${rank}/${side}`);
      if (!a) return null;
      const parts = a.buf.parts || [];
      const p = part === null || part === undefined ? null : parts[part];
      const bottom = a.y + a.b.rows * a.cell + (a.b.nslots - 1) * a.gap;
      let x0, x1, y0, y1;
      if (p) {
        const slot = p.slot === undefined || p.slot === null ? 0 : p.slot;
        const sb = a.b.slots[slot];
        const oy = a.y + sb.y * a.cell + slot * a.gap;
        [y0, y1, x0, x1] = [oy + p.box[0] * a.cell, oy + p.box[1] * a.cell, a.x + p.box[2] * a.cell, a.x + p.box[3] * a.cell];
      } else {
        [x0, x1, y0, y1] = [a.x, a.x + Math.max(a.b.cols * a.cell, 4), a.y, bottom];
      }
      if (side === "in") {
        return Math.abs(y1 - bottom) < 0.5 ? { x: (x0 + x1) / 2, y: y1, dx: 0, dy: 1 } : { x: x1 + 12, y: (y0 + y1) / 2, dx: 1, dy: 0 };
      }
      return Math.abs(y0 - a.y) < 0.5 ? { x: (x0 + x1) / 2, y: y0 - 1, dx: 0, dy: 1 } : { x: x0 - 1, y: (y0 + y1) / 2, dx: 1, dy: 0 };
    };
    const layer = svg("g", { class: "sv-arrows" }, s);
    const members = new Set(ranks);
    const list = [...(d.stays || []).map((t) => [...t, true]), ...(d.transfers || []).map((t) => [...t, false])];
    let count = 0;
    for (const [src, dst, sp, dp, reduce, stay] of list) {
      if (!members.has(src) || !members.has(dst)) continue;
      const a = anchor(src, "in", sp),
        b = anchor(dst, "out", dp);
      if (!a || !b) continue;
      const color = style(src).fill;
      // spread arrows that leave one point a little, so that each stays visible
      const spread = stay || a.dx ? 0 : (((pos.get(dst) - pos.get(src) + n) % n) - n / 2) * 1.5;
      const ka = a.dy ? Math.max((b.y - a.y) * 0.5, 20) : 28;
      const kb = b.dy ? Math.max((b.y - a.y) * 0.5, 20) : 28;
      const ax = a.x + spread;
      const path = svg(
        "path",
        {
          d: `M${ax},${a.y} C${ax + a.dx * ka},${a.y + a.dy * ka} ${b.x - b.dx * kb},${b.y - b.dy * kb} ${b.x},${b.y}`,
          class: `sv-arrow${stay ? " sv-stay" : ""}${reduce ? " sv-reduce" : ""}`,
          stroke: color,
          "marker-end": `url(#${marker(color)})`,
          "data-src": src,
          "data-dst": dst,
        },
        layer,
      );
      if (!stay) count++;
      path.appendChild(svg("title", {})).textContent =
        `rank ${src}${sp !== null ? ` part ${sp}` : ""} → rank ${dst}${dp !== null ? ` part ${dp}` : ""}${reduce ? " (reduced on arrival)" : ""}`;
    }
    panel.dataset.arrows = String(count);
    // values, on demand
    if (d.kind !== "redistribute" && Object.values(d.ranks).some((x) => x.in?.values || x.out?.values)) {
      const step = d.step;
      fetchValues(step, gi).then(
        (vals) => {
          if (!panel.isConnected) return;
          for (const [key, a] of drawn) fillValues(s, a, vals, key);
          panel.dataset.values = "true";
        },
        (err) => {
          if (!panel.isConnected) return;
          html("div", { class: "sv-note" }, panel, `values: ${err.message}`);
          panel.dataset.values = "error";
        },
      );
    }
  }

  function drawBuffer(g, buf, b, x, y, cell, gap, rank, side, padId) {
    const parts = buf.parts || [];
    const own = side === "in" ? rank : buf.origin;
    const tint = (origin, reduced) => (reduced ? "#d9d9d9" : origin === null || origin === undefined ? "#eeeeee" : style(origin).fill);
    b.slots.forEach((sb, k) => {
      const oy = y + sb.y * cell + k * gap;
      const w = Math.max(sb.cols * cell, 4),
        h = sb.rows * cell;
      if (sb.rows * sb.cols === 0) {
        svg("rect", { x, y: oy, width: Math.max(w, 10), height: Math.max(h, 6), class: "sv-empty-buf" }, g);
        return;
      }
      const whole = !parts.some((p) => (p.slot ?? 0) === k);
      if (whole) svg("rect", { x, y: oy, width: w, height: h, fill: tint(own, buf.reduced), class: "sv-part" }, g);
      for (const p of parts) {
        if ((p.slot ?? 0) !== k) continue;
        const [r0, r1, c0, c1] = p.box;
        const px = x + c0 * cell,
          py = oy + r0 * cell,
          pw = Math.max((c1 - c0) * cell, 1),
          ph = Math.max((r1 - r0) * cell, 1);
        const origin = p.origin ?? (side === "in" ? rank : null);
        svg("rect", { x: px, y: py, width: pw, height: ph, fill: tint(origin, p.reduced), class: "sv-part", "data-part": parts.indexOf(p) }, g);
        for (const [a0, a1, b0, b1] of p.pad || []) {
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
    parts.forEach((p, i) => {
      const k = p.slot ?? 0;
      const sb = b.slots[k];
      const oy = y + sb.y * cell + k * gap;
      const [r0, r1, c0, c1] = p.box;
      const px = x + c0 * cell,
        py = oy + r0 * cell,
        pw = (c1 - c0) * cell,
        ph = (r1 - r0) * cell;
      svg("rect", { x: px, y: py, width: pw, height: ph, class: "sv-part-edge" }, g);
      if (ph >= 9 && (c1 === sb.cols || pw >= 14)) {
        const lx = c1 === sb.cols ? x + sb.cols * cell + 2 : px + pw / 2;
        const anchor = c1 === sb.cols ? "start" : "middle";
        svg("text", { x: lx, y: py + Math.min(ph, 20) / 2 + 3, class: "sv-part-label", "text-anchor": anchor }, g).textContent = `${p.reduced ? "Σ" : ""}${i}`;
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
        const total = v.shape.reduce((p, q) => p * q, 1);
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

  // ---- ring algorithm ----

  function drawRing(d) {
    if (!d.ring) return;
    const section = html("div", { class: "sv-ring-section" }, detailBox);
    if (!d.ring.available) {
      html("div", { class: "sv-note" }, section, `ring algorithm: ${d.ring.note}`);
      return;
    }
    const btn = html(
      "button",
      { type: "button", "data-action": "ring" },
      section,
      ringOpen ? "hide the ring algorithm" : "show the ring algorithm (how NCCL / gloo run it)",
    );
    btn.addEventListener("click", () => {
      ringOpen = !ringOpen;
      ringState = 0;
      drawDetail();
    });
    if (!ringOpen) return;
    const box = html("div", { class: "sv-ring", "data-ring-step": d.step }, section, null);
    box.appendChild(html("span", { class: "sv-note" }, null, "loading the ring…"));
    const gi = groupsShown(d)[0];
    fetchRing(d.step, gi).then(
      (r) => {
        if (!box.isConnected) return;
        drawRingState(box, d, r);
      },
      (err) => {
        if (box.isConnected) box.replaceChildren(html("div", { class: "sv-note" }, null, `ring: ${err.message}`));
      },
    );
  }

  function drawRingState(box, d, ring) {
    const { meta, val, mask: maskOf } = ring;
    box.replaceChildren();
    const n = meta.n,
      S = meta.states;
    const last = S; // index S shows the final state against the recorded output
    ringState = Math.min(Math.max(ringState, 0), last);
    const ctl = html("div", { class: "sv-ring-controls" }, box);
    const prev = html("button", { type: "button", "data-action": "ring-prev" }, ctl, "◀ ring step");
    const range = html("input", { type: "range", min: 0, max: last, value: ringState, "data-control": "ring-step" }, ctl);
    const next = html("button", { type: "button", "data-action": "ring-next" }, ctl, "ring step ▶");
    const go = (s_) => {
      ringState = s_;
      drawRingState(box, d, ring);
    };
    prev.disabled = ringState === 0;
    next.disabled = ringState === last;
    prev.addEventListener("click", () => go(ringState - 1));
    next.addEventListener("click", () => go(ringState + 1));
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
    box.dataset.ringState = String(ringState);
    if (ringState === last) {
      drawRingFinal(box, meta, val, list);
      return;
    }
    const phase = ringState === 0 ? "initial state" : `${meta.phases[ringState - 1]} phase`;
    const steps = S - 1;
    const explain =
      ringState === 0
        ? `${meta.op === "all_gather" ? "each rank holds only its own chunk" : `each rank's buffer is cut into ${n} chunks`}; ${steps} steps follow, each rank sending one chunk to the next rank of the ring at the same time`
        : meta.phases[ringState - 1] === "reduce-scatter"
          ? "each rank sends one chunk to the next rank, which adds it to its own copy of that chunk"
          : "each rank passes a finished chunk on to the next rank, which keeps it";
    const which = d.groups.length > 1 ? `group ${meta.group} (ranks ${rankList(ranks)}) · ` : "";
    html("div", { class: "sv-ring-head" }, box, `${which}ring step ${ringState} of ${steps} · ${phase}: ${explain}`);
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
      { id: `${uid}-ring`, viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" },
      defs,
    );
    svg("path", { d: "M0,0 L10,5 L0,10 z", fill: "#333" }, mk);
    for (let c = 0; c < n; c++) svg("text", { x: padL + c * cw + cw / 2, y: 12, "text-anchor": "middle", class: "sv-side" }, s).textContent = `chunk ${c}`;
    const received = new Set();
    const sends = ringState > 0 ? meta.sends[ringState - 1] : [];
    const posOf = new Map(ranks.map((r, i) => [r, i]));
    for (const [, dst, c] of sends) received.add(`${posOf.get(dst)}/${c}`);
    for (let i = 0; i < n; i++) {
      const st = style(ranks[i]);
      const y = padT + i * ch;
      svg("rect", { x: 2, y: y + 4, width: padL - 8, height: ch - 8, rx: 3, fill: st.fill }, s);
      svg("text", { x: (padL - 6) / 2 + 2, y: y + ch / 2 + 4, "text-anchor": "middle", fill: st.text, class: "sv-rank-text" }, s).textContent = `r${ranks[i]}`;
      for (let c = 0; c < n; c++) {
        const mask = maskOf(ringState, i, c);
        const who = maskRanks(mask, ranks);
        const x = padL + c * cw;
        const full = who.length === n;
        const fill = mask === 0 ? "#ffffff" : full ? "#cfe8cf" : who.length === 1 ? style(who[0]).fill : "#f3e6b3";
        const g = svg(
          "g",
          {
            class: `sv-ring-cell${received.has(`${i}/${c}`) ? " sv-received" : ""}`,
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
            fill,
            "fill-opacity": who.length === 1 ? 0.45 : 1,
            class: mask === 0 ? "sv-ring-empty" : "sv-ring-rect",
          },
          g,
        );
        const label = mask === 0 ? "—" : full ? `all ${n}` : who.map((r) => `r${r}`).join("+");
        svg("text", { x: x + cw / 2, y: y + 15, "text-anchor": "middle", class: "sv-ring-who" }, g).textContent =
          label.length > 16 ? `${who.length} ranks` : label;
        const v = val(ringState, i, c);
        if (v !== null)
          svg("text", { x: x + cw / 2, y: y + 28, "text-anchor": "middle", class: "sv-ring-val" }, g).textContent = list(v, meta.chunk_sizes[i][c], 15);
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
          "marker-end": `url(#${uid}-ring)`,
          stroke: style(src).fill,
        },
        s,
      );
    }
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

  // ---- redistribute: the layouts before and after, and the plan ----

  function drawLayoutMini(payload, parent, title) {
    const wrap = html("div", { class: "shardviz sv-layout sv-mini" }, parent);
    html("div", { class: "sv-panel-title" }, wrap, title);
    if (!payload) {
      html("div", { class: "sv-note" }, wrap, "layout not recorded");
      return;
    }
    const geo = prepare(payload);
    const nd = geo.global_shape.length;
    const rd = nd >= 2 ? nd - 2 : null;
    const cd = nd >= 1 ? nd - 1 : null;
    const idx = geo.global_shape.map(() => 0);
    const fillFor = makeFill(`${uid}-${title.replace(/\W/g, "")}`, geo.palette);
    const tbox = html("div", { class: "sv-tensor" }, wrap);
    html("div", { class: "sv-sub" }, tbox, `[${geo.placements.join(", ")}] on mesh ${fmtShape(geo.mesh_shape)}`);
    if (geo.global_shape.includes(0)) html("div", { class: "sv-empty-tensor" }, tbox, `empty tensor ${fmtShape(geo.global_shape)}`);
    else drawTensorGrid(geo, tbox, { rd, cd, idx, uid: `${uid}-${title.replace(/\W/g, "")}`, fillFor, px: 200 });
    const mbox = html("div", { class: "sv-mesh" }, wrap);
    drawMeshGrids(geo, mbox, { uid, fillFor, px: 140 });
  }

  function drawRedistribute(d) {
    const section = html("div", { class: "sv-redistribute" }, detailBox);
    const pair = html("div", { class: "sv-layout-pair" }, section);
    drawLayoutMini(d.before, pair, "before");
    html("div", { class: "sv-big-arrow", "aria-hidden": "true" }, pair, "→");
    drawLayoutMini(d.after, pair, "after");
    const plan = html("div", { class: "sv-plan" }, section);
    html("div", { class: "sv-panel-title" }, plan, `plan ${d.plan || "(none recorded)"}`);
    if (!d.plan_steps.length) return;
    const table = html("table", { class: "sv-plan-table" }, plan);
    const hr = html("tr", {}, table);
    for (const h of ["#", "mesh dim", "placement", "collective", ""]) html("th", {}, hr, h);
    d.plan_steps.forEach((p, i) => {
      const tr = html("tr", { "data-plan-step": i }, table);
      html("td", {}, tr, String(i + 1));
      html("td", {}, tr, p.dim_label);
      html("td", {}, tr, `${p.src} → ${p.dst}`);
      html("td", {}, tr, p.op || "local: no communication");
      const td = html("td", {}, tr);
      if (p.step !== null && p.step !== undefined) {
        const b = html("button", { type: "button", class: "sv-linkish", "data-goto-step": p.step }, td, `step ${p.step + 1} (#${p.event})`);
        b.addEventListener("click", () => setStep(p.step));
      }
    });
  }

  // ---- keyboard ----

  function onKey(ev) {
    const t = ev.target;
    if (t?.closest?.("input, select, textarea")) return;
    const map = { ArrowRight: "next", ArrowDown: "next", ArrowLeft: "prev", ArrowUp: "prev", Home: "first", End: "last" };
    let action = map[ev.key];
    if (!action && ev.key === " " && !t?.closest?.("button")) action = "play";
    if (!action) return;
    ev.preventDefault();
    ev.stopPropagation(); // keep the notebook's own shortcuts out of it
    act(action);
  }
  root.addEventListener("keydown", onKey);

  // ---- wiring ----

  function onStep() {
    ringState = 0;
    drawCurrent();
    markTimeline();
    drawTotals();
    drawDetail();
  }
  function onLink() {
    drawControls();
    drawCurrent();
    drawRowCosts();
    drawTotals();
    drawDetail();
  }
  function onData() {
    tl = model.get("timeline");
    info = model.get("info");
    details.clear();
    valuesCache.clear();
    ringCache.clear();
    drawAll();
  }
  function drawAll() {
    drawHead();
    drawControls();
    drawTimeline();
    drawCurrent();
    markTimeline();
    drawTotals();
    drawDetail();
  }
  const unlisten = listen(model, [
    ["change:step", onStep],
    ["change:link", onLink],
    ["change:timeline", onData],
    ["change:info", onData],
  ]);
  drawAll();

  return () => {
    if (playing) clearInterval(playing);
    unlisten();
    root.remove();
  };
}

export default { render };
