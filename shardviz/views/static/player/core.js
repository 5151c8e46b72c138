// The collective player's shared state and the accessors every panel uses.
// Not a module of its own: shardviz/views/widgets.py:esm_source("player") concatenates common.js,
// the files of static/player/ and player.js into one ES module, so these top-level names are
// visible to the panels and to render() in player.js.
//
// One player object (`p`) per rendered view holds what the panels share: the model, the DOM
// skeleton, the synced timeline and info, the reply caches and the view's own small state (the
// ring view's open state and position, the picked group, playback).

// The same text as shardviz.data.cost.human_seconds, so times match trace.summary() (bytes:
// bytesText in common.js).
function humanSeconds(s) {
  if (s < 1e-3) return `${(s * 1e6).toFixed(1)} us`;
  if (s < 1) return `${(s * 1e3).toFixed(2)} ms`;
  return `${s.toFixed(2)} s`;
}

function makePlayer({ model, el, experimental }) {
  const p = {
    model,
    invoke: makeInvoke(model, experimental),
    uid: `sv${Math.random().toString(36).slice(2, 9)}`,
    t0: performance.now(),
    tl: model.get("timeline"),
    info: model.get("info"),
    details: new Map(), // step -> Promise<detail>
    valuesCache: new Map(), // "step/group" -> Promise<Map(key -> decoded)>
    ringCache: new Map(), // "step/group" -> Promise<{meta, vals}>
    playing: null, // the playback interval
    ringOpen: false,
    ringState: 0,
    groupPick: 0,
    token: 0, // the latest detail drawing; an older one that resolves late draws nothing
    rows: [], // timeline row index -> element
    quiet: new Set(), // timeline rows folded unless the filter asks for all operators
    rowModule: [], // per timeline row: its module (a string id) and its mesh dims (steps.py:rle)
    rowDims: [],
    shownCurrent: -1, // the timeline row the filter last kept shown as the current one
    filterCount: null,
    slider: null,
    stepLabel: null,
    playBtn: null,
  };
  p.root = html("div", { class: "shardviz sv-player", "data-shardviz-view": "player", tabindex: 0 }, el);
  p.head = html("div", { class: "sv-head" }, p.root);
  p.controls = html("div", { class: "sv-controls" }, p.root);
  p.current = html("div", { class: "sv-current", "aria-live": "polite" }, p.root);
  p.main = html("div", { class: "sv-main" }, p.root);
  p.side = html("div", { class: "sv-side-col" }, p.main);
  p.filterBox = html("div", { class: "sv-filter" }, p.side);
  p.timelineBox = html("div", { class: "sv-timeline", role: "list" }, p.side);
  p.detailBox = html("div", { class: "sv-detail" }, p.main);
  p.totals = html("div", { class: "sv-totals" }, p.root);
  return p;
}

const nSteps = (p) => p.tl.steps.length;
const stepNow = (p) => Math.min(Math.max(p.model.get("step") || 0, 0), Math.max(nSteps(p) - 1, 0));
const currentLink = (p) => p.info.links[p.model.get("link")] || Object.values(p.info.links)[0];
// alpha-beta time of `hops` sequential steps moving `bus` bytes on the selected link
const linkSeconds = (p, bus, hops) => {
  const lk = currentLink(p);
  return lk.alpha * hops + (lk.beta ? bus / lk.beta : 0); // as cost.Link.seconds
};
const tlString = (p, i) => (i >= 0 ? p.tl.strings[i] : "");
const styleOf = (p, rank) => rankStyle(p.info.palette, rank);

function setStep(p, k) {
  const n = nSteps(p);
  if (!n) return;
  const next = Math.min(Math.max(k, 0), n - 1);
  if (next === p.model.get("step")) return;
  p.model.set("step", next);
  p.model.save_changes();
}
