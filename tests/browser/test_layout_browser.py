"""The exported layout view in Chromium: one region per rank, clicks highlight, 256 ranks stay fast.

The pages are ``sv.export_html`` files opened from disk with every network request blocked, so
the same ESM that runs in JupyterLab is exercised here against the offline stand-in model.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import shardviz as sv

pytestmark = pytest.mark.browser

READY = "[data-shardviz-view=layout][data-ready=true]"


def ranks_in(page, scope: str) -> set[int]:
    return set(
        page.eval_on_selector_all(f"{scope} [data-rank]", "els => els.map(e => Number(e.dataset.rank))")
    )


def open_export(page, path) -> float:
    t0 = time.perf_counter()
    page.page.goto(path.as_uri())
    page.page.wait_for_selector(READY)
    return time.perf_counter() - t0


def no_trouble(page) -> None:
    assert page.errors == [], page.errors
    assert page.blocked == [], page.blocked


def test_2d_uneven_layout_draws_every_rank_and_a_click_shows_the_shard(page, tmp_path, artifacts):
    lay = sv.layout((5, 7), (2, 2), ["S(0)", "S(1)"], ("dp", "tp"))
    x = np.arange(35.0).reshape(5, 7)
    values = {0: x[:3, :4], 1: x[:3, 4:], 2: x[3:, :4], 3: x[3:, 4:]}
    html = sv.export_html(lay, tmp_path / "uneven.html", values=values)
    seconds = open_export(page, html)
    print(f"2-D uneven, 4 ranks: rendered in {seconds * 1000:.0f} ms, file {html.stat().st_size} bytes")
    p = page.page
    assert p.locator("[data-shardviz-view=layout]").count() == 1
    assert ranks_in(p, ".sv-tensor") == {0, 1, 2, 3}
    assert ranks_in(p, ".sv-mesh") == {0, 1, 2, 3}
    # the drawn regions have the uneven sizes: 3x4, 3x3, 2x4, 2x3 elements
    areas = p.eval_on_selector_all(
        ".sv-tensor rect[data-rank]",
        "els => els.map(e => [Number(e.dataset.rank), e.width.baseVal.value * e.height.baseVal.value])",
    )
    area = dict(areas)
    unit = area[3] / 6
    assert [round(area[r] / unit) for r in range(4)] == [12, 9, 8, 6]

    p.click('.sv-tensor [data-rank="2"]')
    p.wait_for_selector('.sv-info [data-info-rank="2"]')
    info = p.inner_text(".sv-info")
    assert (
        "mesh coord (dp=1, tp=0)" in info and "global offset (3, 0)" in info and "local shape (2, 4)" in info
    )
    assert "sv-selected" in p.get_attribute('.sv-mesh [data-rank="2"]', "class")
    assert "sv-selected" not in p.get_attribute('.sv-mesh [data-rank="1"]', "class")
    # The pointer leaving the clicked block for the "show values" button leaves the panel as it
    # is: it shows rank 2 either way, and a redraw between a click's mousedown and mouseup (under
    # load) lost the click.
    button = p.query_selector("[data-action=values]")
    p.hover("[data-action=values]")
    p.wait_for_timeout(100)  # two animation frames at least
    assert button.evaluate("b => b.isConnected"), "the info panel was redrawn under the pointer"
    p.click("[data-action=values]")
    p.wait_for_selector('table.sv-values[data-values-rank="2"]')
    cells = p.eval_on_selector_all("table.sv-values td", "els => els.map(e => Number(e.textContent))")
    assert cells == x[3:5, 0:4].ravel().tolist()
    p.check("[data-control=heatmap]")
    p.wait_for_selector(".sv-layout.sv-heat-on")
    assert "values 0" in p.inner_text(".sv-heat-legend")
    p.screenshot(path=str(artifacts / "layout_2d_uneven.png"), full_page=True)
    no_trouble(page)


def test_3d_mesh_draws_stacked_grids_partial_hatching_and_slices(page, tmp_path, artifacts):
    lay = sv.layout((4, 6, 5), (2, 2, 2), ["S(0)", "R", "P"], ("pp", "dp", "tp"))
    open_export(page, sv.export_html(lay, tmp_path / "mesh3d.html"))
    p = page.page
    assert p.locator(".sv-mesh-grid").count() == 2  # pp = 0 and pp = 1, each a 2x2 grid
    assert ranks_in(p, ".sv-mesh") == set(range(8))
    assert p.inner_text(".sv-mesh").count("pp = ") == 2
    # slice dim 0 = 0 is held by pp = 0: ranks 0-3, replicated over dp and partial over tp
    assert ranks_in(p, ".sv-tensor") == {0, 1, 2, 3}
    assert p.locator(".sv-tensor .sv-partial").count() >= 1
    assert "pending sum over tp" in p.inner_text(".sv-legend")
    p.fill("[data-control=index-0]", "2")
    p.wait_for_function("document.querySelector('.sv-tensor [data-rank]').dataset.rank === '4'")
    assert ranks_in(p, ".sv-tensor") == {4, 5, 6, 7}
    p.click('.sv-mesh [data-rank="5"]')
    info = p.inner_text(".sv-info")
    assert "mesh coord (pp=1, dp=0, tp=1)" in info and "pending sum over tp" in info
    p.screenshot(path=str(artifacts / "layout_3d_mesh.png"), full_page=True)
    no_trouble(page)


def test_strided_shard_regions_sit_at_their_true_rows(page, tmp_path):
    lay = sv.layout((8, 8), (2, 2), ["_S(0,sf=2)", "S(0)"])
    open_export(page, sv.export_html(lay, tmp_path / "strided.html"))
    tops = page.page.eval_on_selector_all(
        ".sv-tensor rect[data-rank]", "els => els.map(e => [Number(e.dataset.rank), e.y.baseVal.value])"
    )
    # torch's _StridedShard docstring: ranks 0..3 hold rows 0-1, 4-5, 2-3, 6-7
    assert [r for r, _ in sorted(tops, key=lambda t: t[1])] == [0, 2, 1, 3]
    no_trouble(page)


def test_256_ranks_render_and_stay_responsive(page, tmp_path, artifacts):
    lay = sv.layout((64, 64), (16, 16), ["S(0)", "S(1)"])
    html = sv.export_html(lay, tmp_path / "big.html")
    seconds = open_export(page, html)
    p = page.page
    draw_ms = p.get_attribute("[data-shardviz-view=layout]", "data-render-ms")
    print(
        f"16x16 mesh, 256 ranks: first render {seconds * 1000:.0f} ms (tensor drawing {draw_ms} ms), "
        f"file {html.stat().st_size} bytes"
    )
    assert seconds < 5
    assert ranks_in(p, ".sv-tensor") == set(range(256))
    assert ranks_in(p, ".sv-mesh") == set(range(256))
    timings = []
    for rank in (17, 200, 255):
        t0 = time.perf_counter()
        p.hover(f'.sv-mesh [data-rank="{rank}"]')
        p.wait_for_selector(f'.sv-info [data-info-rank="{rank}"]')
        timings.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    p.click('.sv-tensor [data-rank="200"]')
    p.wait_for_selector('.sv-mesh [data-rank="200"].sv-selected')
    timings.append(time.perf_counter() - t0)
    print("256 ranks: hover/click to highlight (ms):", [round(t * 1000) for t in timings])
    assert max(timings) < 1.5
    assert p.evaluate("1 + 1") == 2  # the page's event loop answers
    p.screenshot(path=str(artifacts / "layout_256_ranks.png"), full_page=True)
    no_trouble(page)


def test_axis_arrows_point_the_way_indices_grow(page, tmp_path):
    """Each axis label's arrow, mapped through the label's on-screen transform, points right for
    columns and down for rows (rows grow downward), in the tensor and in the mesh."""
    lay = sv.layout((6, 8), (2, 2), ["S(0)", "S(1)"], ("dp", "tp"))
    open_export(page, sv.export_html(lay, tmp_path / "arrows.html"))
    got = page.page.eval_on_selector_all(
        ".sv-axis-label",
        """els => els.filter(e => e.textContent).map(e => {
            const t = e.textContent, m = e.getCTM();
            const along = t.includes("←") ? -1 : t.includes("→") ? 1 : 0;
            return [t, along * m.a, along * m.b];  // the arrow's screen direction (x, y)
        })""",
    )
    rows = [g for g in got if abs(g[2]) > 0.5]
    cols = [g for g in got if abs(g[1]) > 0.5]
    assert rows and cols, got
    assert all(dy > 0.5 for _, _, dy in rows), rows  # down
    assert all(dx > 0.5 for _, dx, _ in cols), cols  # right
    assert len(rows) + len(cols) == len(got), got  # every label has an arrow
    no_trouble(page)
