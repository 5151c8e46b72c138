// shardviz collective player: a trace's collectives and redistributes, one step at a time.
// Hand-written ESM, no bundler: shardviz/views/widgets.py:esm_source("player") makes one module of
// common.js (svg/html helpers, value decoding, the layout view's tensor and mesh drawing), the
// player's panels in static/player/ (core.js: the shared state; then one file per panel, plain
// top-level functions taking the player object) and this file, which wires them to the model.
//
// Synced traits: step (the current step, from 0), link (cost preset), filter (phase, module,
// mesh dim, all_ops: which steps and rows show), timeline (columnar rows, strings deduplicated)
// and info. Everything per step comes on demand through anywidget commands:
// fetch_step {step} (JSON), fetch_values {step, group} (one binary buffer per tensor) and
// fetch_ring {step, group} (ring states, one float64 buffer). The offline HTML export answers the
// same commands from embedded replies.
//
// DOM contract: the root has data-shardviz-view="player"; buttons data-action="first", "prev",
// "next", "last"; one element (.sv-current) carries data-step="<step>" and data-event-id="<id>".

function render({ model, el, experimental }) {
  return mountPlayer({ model, el, experimental });
}

export default { render };
