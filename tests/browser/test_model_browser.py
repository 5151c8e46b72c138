"""Issue 15: the model map's exported view in Chromium (offline, every network request blocked):
one row per tensor, and a click on a row draws that tensor's layout."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import shardviz as sv

pytestmark = pytest.mark.browser

READY = "[data-shardviz-view=model][data-ready=true]"


def test_rows_and_a_click_opens_the_layout(page, tmp_path):
    sv.use("local", world_size=4)
    with sv.record():
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    html = sv.export_html(model, tmp_path / "model.html")
    p = page.page
    p.goto(html.as_uri())
    p.wait_for_selector(READY)
    names = p.eval_on_selector_all("tr[data-row]", "els => els.map(e => e.dataset.name)")
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    p.click('tr[data-name="2.weight"]')
    # Row-wise: rank r holds columns 8r..8r+8 of the (16, 32) weight; its layout is drawn inline.
    p.wait_for_selector('[data-shardviz-view=layout] [data-rank="3"]')
    ranks = p.eval_on_selector_all(
        "[data-shardviz-view=layout] [data-rank]", "els => [...new Set(els.map(e => Number(e.dataset.rank)))]"
    )
    assert sorted(ranks) == [0, 1, 2, 3]
    assert page.errors == [], page.errors
    assert page.blocked == [], page.blocked
