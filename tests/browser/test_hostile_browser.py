"""Every view kind in Chromium with hostile strings in every field a trace, a layout, a model map
or a timeline carries: the strings show as text, no injected script runs, and the page still draws.

A trace file may come from anywhere, so names of modules, ops and mesh dims, sources, notes and
meta are data from strangers. Each page is an ``sv.export_html`` file (or a notebook ``text/html``
output wrapped in a page) opened from disk with every network request blocked. ``window.__pwned``
is what each payload would set if it ran; dialogs, CSP violations and stray ``<img>`` or
``<script>`` elements are counted too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import shardviz as sv
from shardviz.data.events import (
    CollectiveEvent,
    ComputeEvent,
    LocalEvent,
    OpEvent,
    RedistributeEvent,
    Source,
    TensorSnapshot,
)
from shardviz.data.memory import MemoryTimeline
from shardviz.data.trace import Trace

pytestmark = pytest.mark.browser

PWN = "window.__pwned=1"
HOSTILE = {
    "attr": f'x"><script>{PWN}</script>',
    "comment": "<!--<script",
    "close": f"</script><img src=x onerror={PWN}>",
    "quote": f"' onmouseover='{PWN}' autofocus onfocus='{PWN}",
    "separators": "a\u2028b\u2029c",
    "url": f"javascript:{PWN}",
}
# Watches the page from before its own scripts run (Playwright's init scripts are not subject to
# the page's CSP): what a payload would set, and every CSP violation.
WATCH = """
window.__violations = [];
document.addEventListener("securitypolicyviolation", (e) =>
  window.__violations.push(`${e.violatedDirective} ${e.blockedURI}`));
"""


def tagged(field: str, h: str) -> str:
    """One field's hostile value: the field's name, so the text found on the page says whose it is."""
    return f"{field}:{h}"


class Watched:
    def __init__(self, page: Any) -> None:
        self.page = page
        self.dialogs: list[str] = []
        page.page.add_init_script(WATCH)
        page.page.on("dialog", self._dialog)

    def _dialog(self, d: Any) -> None:
        self.dialogs.append(d.message)
        d.dismiss()

    def open(self, path: Path, ready: str) -> Any:
        p = self.page.page
        p.goto(path.as_uri())
        p.wait_for_selector(ready)
        p.wait_for_timeout(50)  # an onerror or a late module would have run by now
        return p

    def assert_clean(self, scripts: int) -> None:
        p = self.page.page
        assert p.evaluate("window.__pwned") is None, "an injected script ran"
        assert self.dialogs == []
        assert p.evaluate("window.__violations") == [], "CSP refused something the page tried to run or load"
        assert self.page.errors == [], self.page.errors
        assert self.page.blocked == [], self.page.blocked
        assert p.locator("img").count() == 0, "injected markup became an element"
        assert p.locator("script").count() == scripts
        assert p.locator("[onerror], [onmouseover], [onfocus], [autofocus]").count() == 0


def text_of(p: Any, selector: str) -> str:
    return p.eval_on_selector(selector, "el => el.textContent")


# ---- hostile objects, built with the public API and plain dataclasses ---------------------------


def hostile_layout(h: str) -> tuple[sv.Layout, dict[int, np.ndarray]]:
    lay = sv.layout((5, 7), (2, 2), ["S(0)", "S(1)"], (tagged("dp", h), tagged("tp", h)))
    lay = dataclasses.replace(lay, dtype=tagged("dtype", h))
    x = np.arange(35.0).reshape(5, 7)
    return lay, {0: x[:3, :4], 1: x[:3, 4:], 2: x[3:, :4], 3: x[3:, 4:]}


def hostile_dtensor(h: str) -> Any:
    sv.use("local", world_size=4)
    with sv.record():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=(tagged("dp", h), tagged("tp", h)))
        return distribute_tensor(torch.arange(35.0).reshape(5, 7), mesh, [Shard(0), Shard(1)])


def hostile_trace(h: str) -> Trace:
    sv.use("local", world_size=4)
    with sv.record() as t:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        dt = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
        dt.redistribute(mesh, [Replicate()])
        dist.all_reduce(sv.per_rank(lambda r: torch.arange(4.0) + r))
    last = max(e.id for e in t.events if isinstance(e, CollectiveEvent))

    def snaps(per_rank: dict[int, Any]) -> dict[int, Any]:
        def one(s: TensorSnapshot) -> TensorSnapshot:
            return dataclasses.replace(s, dtype=tagged("dtype", h))

        return {r: [one(x) for x in s] if isinstance(s, list) else one(s) for r, s in per_rank.items()}

    def layout(lay: sv.Layout | None) -> sv.Layout | None:
        names = tuple(tagged(f"dim{k}", h) for k in range(len(lay.mesh_shape))) if lay else None
        return lay and dataclasses.replace(lay, mesh_dim_names=names, dtype=tagged("dtype", h))

    events = []
    for e in t.events:
        common: dict[str, Any] = {
            "module": tagged("module", h),
            "phase": tagged("phase", h),
            "source": Source(tagged("file", h), 7, tagged("source", h)),
        }
        if isinstance(e, CollectiveEvent):
            common |= {
                "mesh_dim_name": tagged("mesh_dim", h),
                "params": {**e.params, h: tagged("param", h)},
                "inputs": snaps(e.inputs),
                "outputs": snaps(e.outputs),
            }
            if e.id == last:  # an op no version of torch has
                common |= {"op": tagged("collective", h), "impl": tagged("impl", h), "reduce_op": h}
        if isinstance(e, RedistributeEvent):
            common |= {"before": layout(e.before), "after": layout(e.after), "plan": tagged("plan", h)}
        events.append(dataclasses.replace(e, **common))
    n = len(events)
    events += [
        OpEvent(id=n, name=tagged("op", h), module=tagged("module", h)),
        LocalEvent(id=n + 1, name=tagged("local", h), module=tagged("module", h)),
        ComputeEvent(id=n + 2, name=tagged("compute", h), ranks=(0, 1), phase=tagged("phase", h)),
    ]
    t.events = events
    t.backend = tagged("backend", h)
    t.notes = [tagged("note", h)]
    t.meta = {h: tagged("meta", h), "start_event": 0}
    return t


def hostile_model_map(h: str) -> sv.ModelMap:
    sv.use("local", world_size=4)
    with sv.record():
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=(tagged("tp", h),))
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        m = sv.model_map(model)
    module = tagged("module", h)
    rows = tuple(
        dataclasses.replace(
            r, name=f"{module}.{tagged('param', h)}{k}", module=module, dtype=tagged("dtype", h)
        )
        for k, r in enumerate(m.rows)
    )
    return dataclasses.replace(m, name=tagged("model", h), modules=((module, tagged("class", h)),), rows=rows)


def hostile_timeline(h: str) -> sv.Timeline:
    """A trace of two stages' compute, named and phased by a stranger, then its pipeline timeline."""
    t = Trace(world_size=2)
    t.events = [
        ComputeEvent(id=0, name=tagged("compute", h), ranks=(0,), stage=0, microbatch=0),
        CollectiveEvent(
            id=1,
            op="send",
            impl="p2p",
            groups=((0, 1),),
            root=1,
            params={"pipeline": {"phase": tagged("phase", h)}},
        ),
        CollectiveEvent(
            id=2,
            op="recv",
            impl="p2p",
            groups=((0, 1),),
            root=0,
            params={"peer": 1, "pipeline": {"phase": tagged("phase", h)}},
        ),
        ComputeEvent(id=3, name=tagged("compute", h), ranks=(1,), stage=1, microbatch=0),
    ]
    return sv.pipeline_timeline(t)


def hostile_memory(h: str) -> MemoryTimeline:
    return MemoryTimeline(
        world_size=2,
        events=(0, 1, None),
        bytes=np.array([[16, 32], [64, 32], [0, 0]]),
        peak=np.array([64, 32]),
        peak_event=(1, 0),
        counted=tagged("counted", h),
        labels={0: tagged("label", h), 1: tagged("label", h)},
    )


# ---- the pages ----------------------------------------------------------------------------------

PARAMS = pytest.mark.parametrize("h", list(HOSTILE.values()), ids=list(HOSTILE))


@PARAMS
def test_layout_export(page, tmp_path, h):
    w = Watched(page)
    lay, values = hostile_layout(h)
    path = sv.export_html(lay, tmp_path / "layout.html", values=values, title=tagged("title", h))
    p = w.open(path, "[data-shardviz-view=layout][data-ready=true]")
    ranks = p.eval_on_selector_all(
        ".sv-mesh [data-rank]", "els => [...new Set(els.map(e => e.dataset.rank))]"
    )
    assert sorted(ranks) == ["0", "1", "2", "3"]
    text = text_of(p, "[data-shardviz-view=layout]")
    for field in ("title", "dp", "tp"):
        assert tagged(field, h) in text, field
    # a click names the rank's mesh coordinate by the dims' names, its values their dtype
    p.click('.sv-tensor [data-rank="2"]')
    p.wait_for_selector('.sv-info [data-info-rank="2"]')
    assert f"mesh coord ({tagged('dp', h)}=1, {tagged('tp', h)}=0)" in text_of(p, ".sv-info")
    p.click("[data-action=values]")
    p.wait_for_selector('table.sv-values[data-values-rank="2"]')
    assert f"rank 2's local values ({tagged('dtype', h)})" in text_of(p, ".sv-info")
    p.check("[data-control=heatmap]")
    p.wait_for_selector(".sv-layout.sv-heat-on")
    w.assert_clean(scripts=2)


@PARAMS
def test_dtensor_export(page, tmp_path, h):
    w = Watched(page)
    path = sv.export_html(hostile_dtensor(h), tmp_path / "dtensor.html")
    p = w.open(path, "[data-shardviz-view=layout][data-ready=true]")
    ranks = p.eval_on_selector_all(
        ".sv-mesh [data-rank]", "els => [...new Set(els.map(e => e.dataset.rank))]"
    )
    assert sorted(ranks) == ["0", "1", "2", "3"]
    text = text_of(p, "[data-shardviz-view=layout]")
    assert tagged("dp", h) in text and tagged("tp", h) in text
    w.assert_clean(scripts=2)


@PARAMS
def test_player_export(page, tmp_path, h):
    w = Watched(page)
    trace = hostile_trace(h)
    path = sv.export_html(trace, tmp_path / "player.html")
    p = w.open(path, "[data-shardviz-view=player][data-ready=true]")
    steps = sum(1 for e in trace.events if e.kind in ("collective", "redistribute"))
    assert p.locator(".sv-row[data-row-step]").count() == steps, "one timeline row per step"
    text = text_of(p, "[data-shardviz-view=player]")
    for field in ("backend", "note", "module", "source", "op", "local", "collective"):
        assert tagged(field, h) in text, field
    # the first step's detail: its source file, module, phase and the mesh dim it ran over
    p.wait_for_selector("[data-shardviz-view=player][data-detail-step='0'] .sv-meta")
    detail = text_of(p, ".sv-detail")
    for field in ("module", "phase", "mesh_dim"):
        assert tagged(field, h) in detail, field
    assert f"{Path(tagged('file', h)).name}:7" in detail  # the player names a source by its file name
    # every step draws; the redistribute's shows its plan and the mesh dims of its layouts
    kinds = [e.kind for e in trace.events if e.kind in ("collective", "redistribute")]
    for k, kind in enumerate(kinds):
        p.locator(".sv-row[data-row-step]").nth(k).click()
        p.wait_for_selector(f"[data-shardviz-view=player][data-detail-step='{k}'] .sv-meta")
        if kind == "redistribute":
            detail = text_of(p, ".sv-detail")
            for field in ("plan", "dim0"):
                assert tagged(field, h) in detail, field
    assert "redistribute" in kinds
    w.assert_clean(scripts=2)


@PARAMS
def test_model_map_export(page, tmp_path, h):
    w = Watched(page)
    m = hostile_model_map(h)
    path = sv.export_html(m, tmp_path / "model.html")
    p = w.open(path, "[data-shardviz-view=model][data-ready=true]")
    names = p.eval_on_selector_all("tr[data-row]", "els => els.map(e => e.dataset.name)")
    assert names == [r.name for r in m.rows]
    p.locator("tr[data-row]").nth(0).click()
    p.wait_for_selector("[data-shardviz-view=layout] .sv-mesh [data-rank='3']")
    text = text_of(p, "[data-shardviz-view=model]")
    for field in ("model", "tp", "param", "dtype", "class"):
        assert tagged(field, h) in text, field
    w.assert_clean(scripts=2)


def hostile_report(h: str) -> Any:
    """A NumericsReport whose every name is hostile: labels, root and module class names, module
    path, input keyword, mesh dims, dtype and the event's text."""
    from shardviz.data.numerics import EventNote, RawCapture, RawTensor, RowKey, build_run, compare

    path = tagged("module", h)
    out, inp = RowKey(path, 0, "output", ""), RowKey(path, 0, "input", tagged("kwarg", h))
    modules = (("", tagged("root", h)), (path, tagged("class", h)))
    y = np.arange(8.0).reshape(2, 4)
    ref = build_run(
        tagged("reference", h),
        RawCapture(
            1,
            tagged("root", h),
            modules,
            (RawTensor(inp, 0, "float32", {None: y}), RawTensor(out, 1, "float32", {None: y})),
        ),
    )
    lay = sv.layout((2, 4), (2,), ["S(1)"], (tagged("tp", h),))
    bad = y + 1
    note = EventNote(3, "collective", tagged("event", h), path, "forward")
    tensors = (
        RawTensor(inp, 0, "float32", {None: y}, events=(0, 0)),
        RawTensor(out, 1, "float32", {0: bad[:, :2], 1: bad[:, 2:]}, lay, events=(0, 4)),
    )
    return compare(
        ref,
        build_run(
            tagged("parallel", h), RawCapture(2, tagged("root", h), modules, tensors), events={3: note}
        ),
    )


@PARAMS
def test_numerics_export(page, tmp_path, h):
    w = Watched(page)
    path = sv.export_html(hostile_report(h), tmp_path / "numerics.html")
    p = w.open(path, "[data-shardviz-view=numerics][data-ready=true]")
    p.wait_for_selector("[data-detail-row] [data-shardviz-view=layout] [data-rank='1']")
    text = text_of(p, "[data-shardviz-view=numerics]")
    for field in ("reference", "parallel", "root", "class", "module", "kwarg", "tp", "event"):
        assert tagged(field, h) in text, field
    w.assert_clean(scripts=2)


def _svg_views(h: str) -> dict[str, tuple[Any, int]]:
    """Each static SVG view with the number of rows it draws: lanes for the timeline, curves
    (distinct ranks' lines) for memory."""
    return {"pipeline": (hostile_timeline(h), 2), "memory": (hostile_memory(h), 2)}


@PARAMS
@pytest.mark.parametrize("kind", ["pipeline", "memory"])
def test_svg_export_and_notebook_html(page, tmp_path, h, kind):
    w = Watched(page)
    obj, rows = _svg_views(h)[kind]
    title = tagged("title", h)
    path = sv.export_html(obj, tmp_path / f"{kind}.html", title=title)
    p = w.open(path, f"svg[data-shardviz-view={kind}]")
    row = "g[data-rank]" if kind == "pipeline" else "g[data-ranks]"
    assert p.locator(f"svg[data-shardviz-view={kind}] {row}").count() == rows
    svg_text = text_of(p, f"svg[data-shardviz-view={kind}]")
    assert title in svg_text
    if kind == "pipeline":
        phases = p.eval_on_selector_all("g[data-phase]", "els => els.map(e => e.dataset.phase)")
        assert phases.count(tagged("compute", h)) == 2 and tagged("phase", h) in phases
    else:
        assert tagged("label", h) in svg_text
    assert str(obj) in text_of(p, "pre")  # the text form below the picture, as written
    w.assert_clean(scripts=0)
    # The notebook's text/html output, as a front end would insert it into its page.
    bundle = sv.show(obj, title=title)._repr_mimebundle_()
    note = tmp_path / f"{kind}-notebook.html"
    note.write_text(
        f"<!DOCTYPE html><meta charset='utf-8'><body>{bundle['text/html']}</body>", encoding="utf-8"
    )
    p = w.open(note, f"svg[data-shardviz-view={kind}]")
    assert p.locator(f"svg[data-shardviz-view={kind}] {row}").count() == rows
    assert title in text_of(p, f"svg[data-shardviz-view={kind}]")
    w.assert_clean(scripts=0)


def test_the_csp_refuses_script_the_page_did_not_bring(page, tmp_path):
    """The escaping is the first guard, the policy the second: markup slipped into an exported
    page after the fact neither runs nor loads, while the view still draws."""
    w = Watched(page)
    lay, values = hostile_layout("dim")
    path = sv.export_html(lay, tmp_path / "layout.html", values=values)
    slipped = f'<script>{PWN}</script><img src="data:image/gif;base64,R0lGODlhAQABAAAAACw=" onerror="{PWN}">'
    path.write_text(
        path.read_text(encoding="utf-8").replace("</body>", f"{slipped}</body>"), encoding="utf-8"
    )
    p = w.open(path, "[data-shardviz-view=layout][data-ready=true]")
    assert p.evaluate("window.__pwned") is None
    violations = p.evaluate("window.__violations")
    assert any(v.startswith("script-src") for v in violations), violations
    assert any(v.startswith("img-src") for v in violations), violations
