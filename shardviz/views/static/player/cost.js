// The cost panel: a step's bus bytes and alpha-beta time on the selected link, and the trace's
// totals (all of it, and up to the current step) under the player.
// Concatenated into the player's ES module by esm_source("player"); see core.js.

function drawCost(p, d) {
  const box = html("div", { class: "sv-cost", "data-cost-step": d.step }, p.detailBox);
  const t = linkSeconds(p, d.cost.bus, d.cost.hops);
  const lk = currentLink(p);
  const what = d.kind === "redistribute" ? `its ${d.children.length} collective${d.children.length === 1 ? "" : "s"}` : "this step";
  html("span", { class: "sv-cost-bytes" }, box, `bus bytes per rank: ${bytesText(d.cost.bus)}`);
  html("span", { class: "sv-cost-time", "data-seconds": t }, box, `estimated time: ${humanSeconds(t)}`);
  html(
    "span",
    { class: "sv-note" },
    box,
    `${what} on ${lk.name}: α ${humanSeconds(lk.alpha)} × ${d.cost.hops} sequential steps + bytes / β ${(lk.beta / 1e9).toFixed(1)} GB/s`,
  );
}

function drawTotals(p) {
  const { totals, tl, info } = p;
  totals.replaceChildren();
  const k = stepNow(p);
  let soFarBus = 0,
    soFarHops = 0;
  for (let i = 0; i < nSteps(p) && i <= k; i++) {
    if (tl.total_kinds[i] !== "c") continue;
    soFarBus += tl.bus[i];
    soFarHops += tl.hops[i];
  }
  const total = linkSeconds(p, info.total_bus, info.total_hops);
  html(
    "span",
    { class: "sv-total", "data-total-seconds": total },
    totals,
    `trace total: ${bytesText(info.total_bus)} bus bytes per rank, ${humanSeconds(total)} on ${currentLink(p).name}` +
      (nSteps(p) ? ` · through this step: ${bytesText(soFarBus)}, ${humanSeconds(linkSeconds(p, soFarBus, soFarHops))}` : ""),
  );
}
