"""Issue 15: a DTensor on a sub-mesh is drawn over every group that holds it, in the exported
layout view in Chromium (offline, every network request blocked)."""

from __future__ import annotations

import numpy as np
import pytest

import shardviz as sv
from shardviz.geometry.mesh import submesh_groups

pytestmark = pytest.mark.browser

READY = "[data-shardviz-view=layout][data-ready=true]"


def ranks_in(page, scope: str) -> set[int]:
    return set(
        page.eval_on_selector_all(f"{scope} [data-rank]", "els => els.map(e => Number(e.dataset.rank))")
    )


def test_tp_submesh_of_a_2x4_mesh_draws_both_groups(page, tmp_path):
    lay = sv.layout((8, 8), (4,), ["S(0)"], ("tp",), groups=submesh_groups((2, 4), (1,)))
    x = np.arange(64.0).reshape(8, 8)
    values = {r: x[2 * (r % 4) : 2 * (r % 4) + 2] + 100 * (r // 4) for r in range(8)}
    html = sv.export_html(lay, tmp_path / "tp.html", values=values, heatmap=True)
    p = page.page
    p.goto(html.as_uri())
    p.wait_for_selector(READY)
    assert p.locator('[data-rank="4"]').count() > 0
    assert ranks_in(p, ".sv-tensor") == set(range(8))
    assert ranks_in(p, ".sv-mesh") == set(range(8))
    assert p.locator('.sv-tensor [data-group="1"]').count() == 1
    p.click('.sv-mesh [data-rank="6"]')
    p.wait_for_selector('.sv-info [data-info-rank="6"]')
    assert "group 1" in p.inner_text(".sv-info")
    assert page.errors == [], page.errors
    assert page.blocked == [], page.blocked


def test_past_16_ranks_a_group_picker_draws_one_group(page, tmp_path):
    lay = sv.layout((8, 8), (4,), ["S(1)"], ("tp",), groups=submesh_groups((8, 4), (1,)))
    html = sv.export_html(lay, tmp_path / "tp32.html")
    p = page.page
    p.goto(html.as_uri())
    p.wait_for_selector(READY)
    assert ranks_in(p, ".sv-tensor") == {0, 1, 2, 3}
    p.select_option('select[data-control="group"]', "5")
    p.wait_for_function("() => document.querySelector('.sv-tensor [data-rank=\"22\"]') !== null")
    assert ranks_in(p, ".sv-tensor") == {20, 21, 22, 23}
    assert ranks_in(p, ".sv-mesh") == {20, 21, 22, 23}
    assert page.errors == [], page.errors
