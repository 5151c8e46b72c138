// Mounts one collective player into `el` over `model` (the player's traits); returns its cleanup.
// The player view (player.js) and the placement playground (playground.js) both call it.
// Concatenated into the ES module by esm_source("player"); see core.js.

function mountPlayer({ model, el, experimental }) {
  const p = makePlayer({ model, el, experimental });
  listenTimeline(p);
  listenKeys(p);

  function onStep() {
    p.ringState = 0;
    drawCurrent(p);
    markTimeline(p);
    drawTotals(p);
    drawDetail(p);
  }
  function onLink() {
    drawControls(p);
    drawCurrent(p);
    drawRowCosts(p);
    drawTotals(p);
    drawDetail(p);
  }
  function onFilter() {
    drawFilter(p);
    applyFilter(p);
    drawCurrent(p);
    markTimeline(p);
  }
  function onData() {
    p.tl = model.get("timeline");
    p.info = model.get("info");
    p.details.clear();
    p.valuesCache.clear();
    p.ringCache.clear();
    drawAll();
  }
  function drawAll() {
    drawHead(p);
    drawControls(p);
    p.quiet = new Set(p.tl.quiet || []);
    drawFilter(p);
    drawTimeline(p);
    drawCurrent(p);
    markTimeline(p);
    drawTotals(p);
    drawDetail(p);
  }
  const unlisten = listen(model, [
    ["change:step", onStep],
    ["change:link", onLink],
    ["change:filter", onFilter],
    ["change:timeline", onData],
    ["change:info", onData],
  ]);
  drawAll();

  return () => {
    if (p.playing) clearInterval(p.playing);
    unlisten();
    p.root.remove();
  };
}
