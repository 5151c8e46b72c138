"""Issue 26: the numerics report's exported view in Chromium (offline, every network request
blocked): the module tree coloured by error, the first difference open with its layout and
per-element error heat-map, and a click on another row opening that row."""

from __future__ import annotations

import numpy as np
import pytest

import shardviz as sv
from shardviz.data.numerics import EventNote, RawCapture, RawTensor, RowKey, build_run, compare
from shardviz.geometry.layout import compute

pytestmark = pytest.mark.browser

READY = "[data-shardviz-view=numerics][data-ready=true]"


def report() -> sv.NumericsReport:
    inp, out = RowKey("fc", 0, "input", "0"), RowKey("fc", 0, "output", "")
    modules = (("", "Net"), ("fc", "Linear"))
    x = np.ones((2, 2), dtype=np.float32)
    y = np.arange(1.0, 9.0, dtype=np.float32).reshape(2, 4)
    ref = build_run(
        "plain torch",
        RawCapture(
            1,
            "Net",
            modules,
            (RawTensor(inp, 0, "float32", {None: x}), RawTensor(out, 1, "float32", {None: y})),
        ),
    )
    bad = y.copy()
    bad[1, 3] = 9.0  # one element wrong on rank 1
    lay = compute((2, 4), (2,), ["S(1)"], ("tp",))
    note = EventNote(4, "collective", 'all_gather <img src=x onerror="alert(1)">', "fc", "forward")
    tensors = (
        RawTensor(inp, 0, "float32", {None: x}, events=(0, 0)),
        RawTensor(out, 1, "float32", {0: bad[:, :2], 1: bad[:, 2:]}, lay, events=(0, 5)),
    )
    return compare(ref, build_run("tp", RawCapture(2, "Net", modules, tensors), events={4: note}))


def test_the_first_difference_opens_with_its_layout_and_error(page, tmp_path):
    html = sv.export_html(report(), tmp_path / "numerics.html")
    p = page.page
    p.goto(html.as_uri())
    p.wait_for_selector(READY)
    rows = p.eval_on_selector_all("tr[data-row]", "els => els.map(e => [e.dataset.row, e.dataset.status])")
    assert rows == [["0", "ok"], ["1", "differs"]]
    assert p.get_attribute("tr[data-first=true]", "data-row") == "1"
    # The first difference is open: its layout (one region per rank) and its error heat-map.
    p.wait_for_selector("[data-detail-row='1'] [data-shardviz-view=layout] [data-rank='1']")
    ranks = p.eval_on_selector_all(
        "[data-detail-row] .sv-tensor [data-rank]",
        "els => [...new Set(els.map(e => Number(e.dataset.rank)))]",
    )
    assert sorted(ranks) == [0, 1]
    size = p.eval_on_selector("[data-detail-row] canvas.sv-heat", "c => [c.width, c.height]")
    assert size == [4, 2]  # one pixel per element of the (2, 4) output
    # The pixel of the wrong element is the top of the colour scale; a right one the bottom.
    top, good = p.eval_on_selector(
        "[data-detail-row] canvas.sv-heat",
        "c => { const d = c.getContext('2d');"
        " const px = (x, y) => Array.from(d.getImageData(x, y, 1, 1).data);"
        " return [px(3, 1), px(0, 0)]; }",
    )
    assert top[:3] != good[:3]
    # The event is shown as text: its markup never runs.
    assert "onerror" in p.inner_text("[data-event-id='4']")
    # Another row opens on a click.
    p.click("tr[data-row='0']")
    p.wait_for_selector("[data-detail-row='0']")
    assert page.errors == [], page.errors
    assert page.blocked == [], page.blocked
