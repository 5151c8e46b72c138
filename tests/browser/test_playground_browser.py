"""The placement playground in Chromium, driven through its controls at 1280x800.

A live kernel is stood in for by the widget itself: the page runs the playground's ESM over a
small model whose ``save_changes`` sends the changed traits to Python (playwright's
``expose_function``), where they are set on a real ``PlaygroundWidget`` exactly as anywidget's comm
would, and the widget's synced state comes back; the player's commands are answered by the
widget's own reply methods. So a placement changed in the page recomputes in Python and redraws,
as in JupyterLab, without starting one.
"""

from __future__ import annotations

import base64
import json
import time

import pytest

import shardviz as sv
from shardviz.views.widgets import esm_source

pytestmark = pytest.mark.browser

ROOT = "[data-shardviz-view=playground]"

HOST = """
const data = JSON.parse(document.getElementById("pg-data").textContent);
const el = document.getElementById("root");
const b64 = (t) => { const s = atob(t); const a = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) a[i] = s.charCodeAt(i); return new DataView(a.buffer); };
class KernelModel {
  constructor(state) { this.state = state; this.listeners = new Map(); this.dirty = {}; }
  get(k) { return this.state[k]; }
  set(k, v) { const old = this.state[k]; this.state[k] = v; this.dirty[k] = v;
    if (JSON.stringify(old) !== JSON.stringify(v)) this.emit(`change:${k}`, v); }
  async save_changes() {
    const dirty = this.dirty; this.dirty = {};
    const state = JSON.parse(await window.kernelSync(JSON.stringify(dirty)));
    for (const [k, v] of Object.entries(state)) {
      const old = this.state[k]; this.state[k] = v;
      if (JSON.stringify(old) !== JSON.stringify(v)) this.emit(`change:${k}`, v);
    }
  }
  on(e, cb) { if (!this.listeners.has(e)) this.listeners.set(e, new Set()); this.listeners.get(e).add(cb); }
  off(e, cb) { if (!e) this.listeners.clear(); else if (!cb) this.listeners.delete(e);
    else this.listeners.get(e)?.delete(cb); }
  emit(e, ...a) { for (const cb of [...(this.listeners.get(e) || [])]) cb(...a); }
  send() {}
}
const model = new KernelModel(data.state);
const experimental = { invoke: async (name, msg) => {
  const [reply, bufs] = JSON.parse(await window.kernelCommand(name, JSON.stringify(msg)));
  return [reply, bufs.map(b64)];
} };
const url = URL.createObjectURL(new Blob([data.esm], { type: "text/javascript" }));
const mod = await import(url);
await mod.default.render({ model, el, experimental });
"""


def host_page(pg, path):
    payload = json.dumps({"state": pg.state_for_export(), "esm": esm_source("playground")})
    path.write_text(
        "<!doctype html><html><head><meta charset=utf-8><style>"
        + pg._css
        + "</style></head><body><div id=root></div>"
        + '<script type="application/json" id="pg-data">'
        + payload.replace("</", "<\\/")
        + "</script><script type=module>"
        + HOST
        + "</script></body></html>",
        encoding="utf-8",
    )
    return path


def bridge(page, pg) -> list[dict]:
    """Expose the widget to the page as its kernel; returns the list of changes it received."""
    received: list[dict] = []

    def sync(changes: str) -> str:
        change = json.loads(changes)
        received.append(change)
        for key, value in change.items():
            setattr(pg, key, value)  # as a comm message from the view would
        return json.dumps(pg.state_for_export())

    replies = {"fetch_step": lambda m: (pg.detail(m["step"]), [])}
    replies["fetch_values"] = lambda m: pg.values_reply(m["step"], m["group"])
    replies["fetch_ring"] = lambda m: pg.ring_reply(m["step"], m["group"])

    def command(name: str, msg: str) -> str:
        reply, bufs = replies[name](json.loads(msg))
        return json.dumps([reply, [base64.b64encode(bytes(b)).decode() for b in bufs]])

    page.expose_function("kernelSync", sync)
    page.expose_function("kernelCommand", command)
    return received


def placements(p, which: str) -> str:
    return p.get_attribute(f'{ROOT} [data-layout="{which}"]', "data-placements")


def test_changing_a_placement_recomputes_the_layouts_plan_and_player(browser, tmp_path, artifacts):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    p = context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    p.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    try:
        pg = sv.playground((10, 6), (4,), ["S(0)"], ["R"], ["tp"])
        received = bridge(p, pg)
        t0 = time.perf_counter()
        p.goto(host_page(pg, tmp_path / "pg.html").as_uri())
        p.wait_for_selector(f"{ROOT}[data-ready=true] [data-shardviz-view=player]")
        print(f"playground drawn in {(time.perf_counter() - t0) * 1000:.0f} ms")
        assert placements(p, "source") == "S(0)" and placements(p, "target") == "R"
        assert p.get_attribute(f"{ROOT} [data-plan]", "data-plan") == "S(0)->R"
        assert p.get_attribute(f"{ROOT} [data-mode]", "data-mode") == "values"
        assert "uneven shards: 3×6 on rank(s) 0-2; 1×6 on rank(s) 3" in p.inner_text(
            f"{ROOT} .sv-pg-messages"
        )

        # the target becomes S(1): Python recomputes, the target layout, the plan and the player follow
        p.select_option(f'{ROOT} [data-control="dst-0"]', "S(1)")
        p.wait_for_selector(f'{ROOT} [data-layout="target"][data-placements="S(1)"]')
        assert received[-1]["choice"]["dst"] == ["S(1)"]
        assert pg.result["plan"] == "S(0)->S(1)"
        assert p.get_attribute(f"{ROOT} [data-plan]", "data-plan") == "S(0)->S(1)"
        assert p.get_attribute(f"{ROOT} tr[data-plan-row='0']", "data-op") == "all_to_all"
        # the player steps to the all_to_all and draws its buffers
        p.click(f"{ROOT} [data-action=next]")
        p.wait_for_selector(f"{ROOT} [data-shardviz-view=player][data-detail-step='1']")
        event = int(p.get_attribute(f"{ROOT} [data-step][data-event-id]", "data-event-id"))
        assert pg.trace.events[[e.id for e in pg.trace.events].index(event)].op == "all_to_all"
        p.screenshot(path=str(artifacts / "playground_all_to_all.png"), full_page=True)
        # the controls and the plan are on screen together at 1280x800
        for sel in (f'{ROOT} [data-control="dst-0"]', f"{ROOT} [data-plan]"):
            box = p.locator(sel).bounding_box()
            assert box is not None and box["y"] + box["height"] <= 800, (sel, box)

        # a bad choice: the message explains, the last picture stays
        p.fill(f'{ROOT} [data-control="shape"]', "10, 6, x")
        p.press(f'{ROOT} [data-control="shape"]', "Enter")
        p.wait_for_selector(f"{ROOT} .sv-pg-error[data-error]")
        assert "the tensor shape must be whole numbers" in p.inner_text(f"{ROOT} .sv-pg-error")
        assert placements(p, "target") == "S(1)"
        p.screenshot(path=str(artifacts / "playground_error.png"), full_page=True)

        # a 2-D mesh: the mesh and a Partial source, typed in
        p.fill(f'{ROOT} [data-control="shape"]', "4, 6")
        p.fill(f'{ROOT} [data-control="mesh_dim_names"]', "dp, tp")
        p.fill(f'{ROOT} [data-control="mesh_shape"]', "2, 2")
        p.press(f'{ROOT} [data-control="mesh_shape"]', "Enter")
        p.wait_for_selector(f'{ROOT} [data-control="src-1"]')
        assert pg.choice["mesh_dim_names"] == ["dp", "tp"] and pg.choice["mesh_shape"] == [2, 2]
        assert p.get_attribute(f'{ROOT} [data-control="src-0"]', "aria-label") == "src placement on dp"
        p.select_option(f'{ROOT} [data-control="src-0"]', "P")
        p.wait_for_selector(f'{ROOT} [data-layout="source"][data-placements="P(sum),R"]')
        p.select_option(f'{ROOT} [data-control="dst-0"]', "R")
        p.wait_for_selector(f'{ROOT} [data-layout="target"][data-placements="R,R"]')
        assert p.locator(f"{ROOT} .sv-pg-error").count() == 0
        assert p.get_attribute(f"{ROOT} tr[data-plan-row='0']", "data-op") == "all_reduce"
        p.screenshot(path=str(artifacts / "playground_partial_2d.png"), full_page=True)
        assert errors == [], errors
    finally:
        context.close()


def test_the_exported_page_shows_the_last_state_drawn(page, tmp_path):
    pg = sv.playground((10, 6), (4,), ["S(0)"], ["R"], ["tp"])
    pg.choice = {**pg.choice, "dst": ["S(1)"]}
    page.page.goto(sv.export_html(pg, tmp_path / "pg.html").as_uri())
    p = page.page
    p.wait_for_selector(f"{ROOT}[data-ready=true]")
    assert placements(p, "target") == "S(1)"
    assert p.get_attribute(f"{ROOT} [data-plan]", "data-plan") == "S(0)->S(1)"
    assert "Saved page" in p.inner_text(f"{ROOT} .sv-pg-offline")
    assert p.locator(f'{ROOT} [data-control="dst-0"]').is_disabled()
    assert page.errors == [] and page.blocked == []
