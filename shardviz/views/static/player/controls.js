// The top of the player: the header, the step controls (buttons, slider, play, link preset), the
// current event (the DOM contract element) and the keyboard.
// Concatenated into the player's ES module by esm_source("player"); see core.js.

const PLAY_MS = 1200; // one step per this many ms while playing

function drawHead(p) {
  const { head, info } = p;
  head.replaceChildren();
  html("div", { class: "sv-title" }, head, info.title);
  const parts = [`${info.world_size} ranks`, `${info.events} events`, `${info.collectives} collectives`, `${info.steps} steps`];
  if (info.local_steps) parts.push("local compute included as steps");
  html("div", { class: "sv-sub" }, head, parts.join(" · "));
  for (const note of info.notes || []) html("div", { class: "sv-note" }, head, note);
}

function drawControls(p) {
  const { controls, model } = p;
  controls.replaceChildren();
  const n = nSteps(p);
  const button = (action, text, label) => {
    const b = html("button", { type: "button", "data-action": action, "aria-label": label, title: label }, controls, text);
    if (n === 0) b.classList.add("sv-at-end");
    b.addEventListener("click", () => act(p, action));
    return b;
  };
  button("first", "« first", "first step (Home)");
  button("prev", "‹ prev", "previous step (←)");
  p.playBtn = button("play", "▶ play", "play / pause (space)");
  button("next", "next ›", "next step (→)");
  button("last", "last »", "last step (End)");
  if (p.info.step_start !== null && p.info.step_start !== undefined) {
    button("start", "⇥ training step", `the first collective inside a module's forward or backward (step ${p.info.step_start + 1}), past the setup`);
  }
  const slider = html("input", { type: "range", min: 0, max: Math.max(n - 1, 0), value: stepNow(p), "data-control": "step", "aria-label": "step" }, controls);
  slider.disabled = n === 0;
  slider.addEventListener("input", () => setStep(p, Number(slider.value)));
  p.slider = slider;
  p.stepLabel = html("span", { class: "sv-step-label" }, controls);
  const lab = html("label", { class: "sv-link" }, controls, "link ");
  const sel = html("select", { "data-control": "link" }, lab);
  for (const [key, lk] of Object.entries(p.info.links)) html("option", { value: key }, sel, lk.name);
  sel.value = model.get("link");
  sel.addEventListener("change", () => {
    model.set("link", sel.value);
    model.save_changes();
  });
}

// Moves go between the steps the filter keeps (all of them with no filter).
function act(p, action) {
  const k = stepNow(p);
  const shown = shownSteps(p);
  if (action === "play") togglePlay(p);
  else if (action === "start") setStep(p, p.info.step_start);
  else if (!shown.length) return;
  else if (action === "first") setStep(p, shown[0]);
  else if (action === "last") setStep(p, shown[shown.length - 1]);
  else if (action === "next") setStep(p, shown.find((s) => s > k) ?? k);
  else if (action === "prev") setStep(p, [...shown].reverse().find((s) => s < k) ?? k);
}

function togglePlay(p) {
  if (p.playing) {
    clearInterval(p.playing);
    p.playing = null;
  } else if (shownSteps(p).length > 1) {
    const last = () => shownSteps(p).at(-1);
    if (stepNow(p) >= last()) act(p, "first");
    p.playing = setInterval(() => {
      if (stepNow(p) >= last()) togglePlay(p);
      else act(p, "next");
    }, PLAY_MS);
  }
  p.root.classList.toggle("sv-playing", !!p.playing);
  if (p.playBtn) p.playBtn.textContent = p.playing ? "❚❚ pause" : "▶ play";
}

// The current event: data-step and data-event-id (the DOM contract), the slider and step label.
function drawCurrent(p) {
  const { current, controls, tl } = p;
  current.replaceChildren();
  const n = nSteps(p);
  const k = stepNow(p);
  current.setAttribute("data-step", String(k));
  if (!n) {
    current.setAttribute("data-event-id", "");
    html("span", {}, current, "no collectives or redistributes in this trace");
    if (p.stepLabel) p.stepLabel.textContent = "step – / 0";
    return;
  }
  const i = tl.steps[k];
  current.setAttribute("data-event-id", String(tl.ids[i]));
  if (p.slider) p.slider.value = String(k);
  if (p.stepLabel) p.stepLabel.textContent = `step ${k + 1} / ${n}`;
  html("span", { class: "sv-current-step" }, current, `step ${k + 1} of ${n}`);
  html("strong", { class: "sv-current-label" }, current, ` #${tl.ids[i]} ${tlString(p, tl.label[i])}`);
  const src = tl.source[i] >= 0 ? tl.sources[tl.source[i]] : null;
  if (src) html("code", { class: "sv-current-src" }, current, `line ${src[0]}: ${src[1]}`);
  // at an end the buttons stay enabled (a click is a no-op), only greyed: scripts and tests may
  // click "first" on the first step (Playwright also treats aria-disabled as disabled)
  const shown = shownSteps(p);
  for (const b of controls.querySelectorAll("[data-action=first], [data-action=prev]")) b.classList.toggle("sv-at-end", !shown.some((s) => s < k));
  for (const b of controls.querySelectorAll("[data-action=next], [data-action=last]")) b.classList.toggle("sv-at-end", !shown.some((s) => s > k));
}

function listenKeys(p) {
  p.root.addEventListener("keydown", (ev) => {
    const t = ev.target;
    if (t?.closest?.("input, select, textarea")) return;
    const map = { ArrowRight: "next", ArrowDown: "next", ArrowLeft: "prev", ArrowUp: "prev", Home: "first", End: "last" };
    let action = map[ev.key];
    if (!action && ev.key === " " && !t?.closest?.("button")) action = "play";
    if (!action) return;
    ev.preventDefault();
    ev.stopPropagation(); // keep the notebook's own shortcuts out of it
    act(p, action);
  });
}
