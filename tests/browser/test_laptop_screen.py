"""Issue 34: every widget on a laptop screen, 1280x800 with JupyterLab's file browser open (an
output area about 1000 px wide): the player's controls and the current step's before and after
rows on screen together, no label cut, and no colour that encodes a state within a set distance
(CIE76 deltaE on the computed styles) of any rank's colour.

The pages are ``sv.export_html`` files opened from disk with every network request blocked.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardviz as sv
from shardviz.views.geometry import PALETTE

pytestmark = pytest.mark.browser

# 1280 px wide minus JupyterLab's file browser and gutters: about 1000 px for the output area.
SIDEBAR_PX = 280
# A state colour closer than this (CIE76 deltaE) to a rank's colour reads as that rank.
MIN_DELTA_E = 25.0


@pytest.fixture
def laptop(page: Any) -> Any:
    page.page.set_viewport_size({"width": 1280, "height": 800})
    return page


def open_view(page: Any, html: Path, view: str) -> Any:
    p = page.page
    p.goto(html.as_uri())
    p.evaluate(f"document.body.style.margin = '0 0 0 {SIDEBAR_PX}px'")
    p.wait_for_selector(f"[data-shardviz-view={view}][data-ready=true]")
    return p


def no_trouble(page: Any) -> None:
    assert page.errors == [], page.errors
    assert page.blocked == [], page.blocked


# Text that does not fit: an HTML element whose own text overflows it (unless it ends in an
# ellipsis and carries a title that says the whole), or runs past an ancestor that clips or
# scrolls it; an SVG text past its picture's edge.
CUT = """(root) => {
  const out = [];
  const own = (el) => [...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
  for (const el of root.querySelectorAll('*')) {
    if (!own(el) || !el.getClientRects().length) continue;
    const cs = getComputedStyle(el);
    if (cs.visibility === 'hidden') continue;
    const text = el.textContent.trim().slice(0, 60);
    if (el instanceof SVGElement) {
      if (el.tagName !== 'text') continue;
      const s = el.ownerSVGElement.getBoundingClientRect(), b = el.getBoundingClientRect();
      const past =
        b.left < s.left - 1 || b.right > s.right + 1 || b.top < s.top - 1 || b.bottom > s.bottom + 1;
      if (b.width && past) out.push(`svg text past the edge: ${text}`);
      continue;
    }
    if (el.tagName === 'OPTION' || el.tagName === 'SELECT') continue;
    if (el.scrollWidth > el.clientWidth + 1 && cs.overflow !== 'visible')
      if (cs.textOverflow !== 'ellipsis' || !el.closest('[title]')) out.push(`cut: ${text}`);
    const r = el.getBoundingClientRect();
    for (let a = el.parentElement; a && a !== document.body; a = a.parentElement) {
      const o = getComputedStyle(a);
      if (o.overflowX === 'visible') continue;  // a scroller hides text too, until scrolled
      const ar = a.getBoundingClientRect();
      if (r.right > ar.right + 1) { out.push(`clipped: ${text}`); break; }
    }
  }
  return out;
}"""


def cut_labels(p: Any, root: str) -> list[str]:
    return p.eval_on_selector(root, CUT)


# Every colour a set of elements paints with: fill, stroke, background and border colours, and
# the colours of a fill's SVG pattern and of a background gradient.
COLOURS = """(els) => {
  const out = [];
  const add = (el, v) => {
    for (const m of String(v).matchAll(/rgba?\\(([^)]*)\\)/g)) {
      const [r, g, b, a] = m[1].split(',').map(Number);
      if (a === 0) continue;
      out.push([el.getAttribute('class') || el.tagName, r, g, b]);
    }
  };
  for (const el of els) {
    const cs = getComputedStyle(el);
    for (const k of ['fill', 'stroke', 'color', 'backgroundColor', 'backgroundImage', 'borderLeftColor']) {
      const v = cs[k];
      const url = /url\\("?#([^")]+)"?\\)/.exec(v);
      if (url) {
        const pat = el.ownerSVGElement && el.ownerSVGElement.getElementById(url[1]);
        for (const c of pat ? pat.querySelectorAll('*') : []) {
          const pc = getComputedStyle(c);
          add(c, pc.fill);
          add(c, pc.stroke);
        }
      } else add(el, v);
    }
  }
  return out;
}"""


def _lab(rgb: tuple[float, float, float]) -> np.ndarray:
    c = np.asarray(rgb, dtype=float) / 255
    c = np.where(c > 0.04045, ((c + 0.055) / 1.055) ** 2.4, c / 12.92)
    m = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]])
    xyz = m @ c / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > 0.008856, np.cbrt(xyz), 7.787 * xyz + 16 / 116)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def _hex(h: str) -> tuple[int, int, int]:
    return int(h[1:3], 16), int(h[3:5], 16), int(h[5:7], 16)


def too_close_to_a_rank(colours: list[list[Any]]) -> list[str]:
    bad = []
    for name, r, g, b in colours:
        lab = _lab((r, g, b))
        for rank, h in enumerate(PALETTE):
            d = float(np.linalg.norm(lab - _lab(_hex(h))))
            if d < MIN_DELTA_E:
                bad.append(f"{name} rgb({r},{g},{b}) is {d:.1f} from rank {rank}'s {h}")
    return bad


def test_the_distance_check_catches_the_old_ring_colours() -> None:
    # the partial-sum yellow the ring used before reads as rank 2's sand
    assert too_close_to_a_rank([["old partial", *_hex("#f3e6b3")]])
    assert not too_close_to_a_rank([["grey", 77, 77, 77], ["pale grey", 232, 232, 232]])


@pytest.fixture(scope="module")
def trace() -> Any:
    sv.use("local", world_size=4)
    with sv.record() as t:
        mesh = init_device_mesh("cpu", (4,))
        line_that_is_long_enough_to_be_cut_in_a_narrow_column = torch.arange(64.0).reshape(8, 8)
        dt = distribute_tensor(line_that_is_long_enough_to_be_cut_in_a_narrow_column, mesh, [Shard(0)])
        dt.redistribute(mesh, [Replicate()])
        dist.all_reduce(sv.per_rank(lambda r: torch.arange(12.0) + 10 * r))
    return t


def on_screen(p: Any, selector: str) -> bool:
    return p.eval_on_selector_all(
        selector,
        """els => els.length > 0 && els.every(e => {
          const r = e.getBoundingClientRect();
          return r.top >= 0 && r.bottom <= innerHeight && r.left >= 0 && r.right <= innerWidth;
        })""",
    )


def test_player_controls_and_the_steps_before_and_after_fit_together(laptop, trace, tmp_path, artifacts):
    out = artifacts / "laptop"
    out.mkdir(parents=True, exist_ok=True)
    p = open_view(laptop, sv.export_html(trace, tmp_path / "player.html"), "player")
    root = "[data-shardviz-view=player]"
    p.click("[data-action=first]")
    n = len(trace.events)
    for k in range(n):
        if k:
            p.click("[data-action=next]")
        p.wait_for_selector(f"{root}[data-detail-step='{k}']")
        p.wait_for_selector("[data-buf-side=out], .sv-layout-pair")
        flow = p.locator("[data-buf-side=out]").count() > 0
        after = "[data-buf-side=out]" if flow else ".sv-layout-pair > :last-child"
        before = "[data-buf-side=in]" if flow else ".sv-layout-pair > :first-child"
        p.locator(after).last.scroll_into_view_if_needed()
        # the step buttons, the current step's line and both rows: on screen at once
        assert on_screen(p, "[data-action=next]"), f"step {k}: next is off screen"
        assert on_screen(p, before) and on_screen(p, after), f"step {k}: before / after off screen"
        p.screenshot(path=str(out / f"player_step_{k}.png"))
        assert cut_labels(p, root) == [], f"step {k}"
        assert rank_colours_only_for_ranks(p, root) == [], f"step {k}"
    # the step list: each source line in full, on its own line
    srcs = p.eval_on_selector_all(".sv-row-src", "els => els.map(e => e.textContent)")
    assert any("line_that_is_long_enough_to_be_cut_in_a_narrow_column" in s for s in srcs), srcs
    no_trouble(laptop)


def test_the_ring_states_are_greys_with_a_legend_never_a_ranks_colour(laptop, trace, tmp_path, artifacts):
    out = artifacts / "laptop"
    out.mkdir(parents=True, exist_ok=True)
    p = open_view(laptop, sv.export_html(trace, tmp_path / "ring.html"), "player")
    p.click("[data-action=last]")
    p.click("[data-action=ring]")
    p.wait_for_selector(".sv-ring-svg")
    seen: set[str] = set()
    while p.locator(".sv-ring-svg").count():
        seen |= set(p.eval_on_selector_all("[data-ring-state]", "els => els.map(e => e.dataset.ringState)"))
        assert p.locator("[data-ring-legend]").count() == 1
        colours = p.eval_on_selector_all(
            "[data-ring-state=partial] rect, [data-ring-state=done] rect, [data-ring-state=empty] rect,"
            " [data-ring-swatch=partial], [data-ring-swatch=done], [data-ring-swatch=empty]",
            COLOURS,
        )
        assert colours
        assert too_close_to_a_rank(colours) == []
        assert cut_labels(p, "[data-shardviz-view=player]") == []
        if seen >= {"own", "partial", "done"}:
            p.locator(".sv-ring").scroll_into_view_if_needed()
            p.screenshot(path=str(out / "player_ring.png"))
        p.click("[data-action=ring-next]")
    assert seen >= {"own", "partial", "done"}, seen
    # the last state is the check against the recorded output, with no chunk grid to explain
    assert p.locator("table.sv-ring-final").count() == 1
    assert p.locator("[data-ring-legend]").count() == 0
    no_trouble(laptop)


def test_layout_labels_over_the_heatmap_and_dimmed_stay_legible(laptop, tmp_path, artifacts):
    out = artifacts / "laptop"
    out.mkdir(parents=True, exist_ok=True)
    lay = sv.layout((8, 8), (4,), ["S(0)"])
    values = {r: np.arange(16.0).reshape(2, 8) + 16 * r for r in range(4)}
    p = open_view(laptop, sv.export_html(lay, tmp_path / "lay.html", values=values), "layout")
    p.check("[data-control=heatmap]")
    p.wait_for_selector(".sv-heat-on")
    labels = p.eval_on_selector_all(
        ".sv-tensor .sv-label",
        """els => els.map(e => { const c = getComputedStyle(e);
          return [c.display, c.fill, c.stroke, e.getBBox().width]; })""",
    )
    assert len(labels) >= 4  # each rank's name (and its local shape)
    for display, fill, stroke, width in labels:
        assert display != "none" and width > 0
        assert (fill, stroke) == ("rgb(0, 0, 0)", "rgb(255, 255, 255)")
    p.screenshot(path=str(out / "layout_heatmap.png"))
    p.uncheck("[data-control=heatmap]")
    p.click(".sv-cell[data-rank='1']")
    p.wait_for_selector(".sv-hl")
    dimmed = p.eval_on_selector_all(
        ".sv-hl .sv-tensor .sv-block:not(:has(.sv-on)) .sv-label, .sv-hl .sv-cell:not(.sv-on) .sv-label",
        """els => els.map(e => { const c = getComputedStyle(e);
          let o = 1;  // the opacity it is drawn with: its own times every ancestor's
          for (let a = e; a; a = a.parentElement) o *= Number(getComputedStyle(a).opacity);
          return [c.fill, c.stroke, String(o)]; })""",
    )
    assert len(dimmed) >= 6  # the three other ranks' names (and shapes), in the tensor and the mesh
    # solid grey letters on a white halo, not a faded outline around faded letters
    assert all(d == ["rgb(138, 138, 138)", "rgb(255, 255, 255)", "1"] for d in dimmed), dimmed
    p.screenshot(path=str(out / "layout_dimmed.png"))
    assert cut_labels(p, "[data-shardviz-view=layout]") == []
    no_trouble(laptop)


def test_a_greyed_out_heatmap_box_says_why(laptop, tmp_path, artifacts):
    out = artifacts / "laptop"
    out.mkdir(parents=True, exist_ok=True)
    geometry_only = sv.layout((8, 8), (2, 2), ["S(0)", "S(1)"])
    p = open_view(laptop, sv.export_html(geometry_only, tmp_path / "geo.html"), "layout")
    assert p.is_disabled("[data-control=heatmap]")
    why = p.text_content("[data-heat-why]")
    assert why is not None and "geometry only" in why
    assert on_screen(p, "[data-heat-why]")
    p.screenshot(path=str(out / "layout_no_values.png"))
    assert cut_labels(p, "[data-shardviz-view=layout]") == []
    no_trouble(laptop)


def rank_colours_only_for_ranks(p: Any, root: str) -> list[str]:
    """State marks of a view (selected, current, ok / bad, warnings) far from every rank colour."""
    sel = ", ".join(
        f"{root} {s}"
        for s in (
            ".sv-selected",
            ".sv-row-current",
            ".sv-current",
            ".sv-badge",
            ".sv-ok",
            ".sv-bad",
            ".sv-warning",
            "[aria-selected=true]",
        )
    )
    return too_close_to_a_rank(p.eval_on_selector_all(sel, COLOURS))


def test_model_map_numerics_and_playground_fit_a_laptop(laptop, tmp_path, artifacts):
    from test_numerics_browser import report  # the same small report (tests/browser is on the path)
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    out = artifacts / "laptop"
    out.mkdir(parents=True, exist_ok=True)
    sv.use("local", world_size=4)
    with sv.record():
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    views = [
        ("model", sv.export_html(model, tmp_path / "model.html")),
        ("numerics", sv.export_html(report(), tmp_path / "numerics.html")),
        ("playground", sv.export_html(sv.playground(), tmp_path / "playground.html")),
    ]
    for view, html in views:
        p = open_view(laptop, html, view)
        if view == "model":
            p.click('tr[data-name="2.weight"]')
        p.wait_for_timeout(200)
        p.screenshot(path=str(out / f"{view}.png"))
        root = f"[data-shardviz-view={view}]"
        assert cut_labels(p, root) == [], view
        assert rank_colours_only_for_ranks(p, root) == [], view
    no_trouble(laptop)


def test_numbers_in_the_step_list_are_not_ellipsized(laptop, trace, tmp_path):
    p = open_view(laptop, sv.export_html(trace, tmp_path / "list.html"), "player")
    widths = p.eval_on_selector_all(
        ".sv-row-label, .sv-row-src",
        "els => els.map(e => [e.scrollWidth, e.clientWidth, getComputedStyle(e).textOverflow])",
    )
    assert widths and all(sw <= cw + 1 and to != "ellipsis" for sw, cw, to in widths), widths
    assert re.search(r"L\d+ ", p.text_content(".sv-row-src") or "")
