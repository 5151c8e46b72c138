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


def two_groups() -> sv.NumericsReport:
    """8 ranks, two tp groups of 4, each holding the whole (3, 4) output in columns: ranks 4-7
    (the second group) computed it from the wrong offset, 8 too large everywhere."""
    key, modules = RowKey("embed", 0, "output", ""), (("", "LM"), ("embed", "Embedding"))
    y = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    ref = build_run("plain torch", RawCapture(1, "LM", modules, (RawTensor(key, 0, "float32", {None: y}),)))
    lay = compute((3, 4), (4,), ["S(1)"], ("tp",), groups=[[0, 1, 2, 3], [4, 5, 6, 7]])
    vals: dict[int | None, np.ndarray] = {r: (y if r < 4 else y + 8)[:, r % 4 : r % 4 + 1] for r in range(8)}
    par = build_run("tp", RawCapture(8, "LM", modules, (RawTensor(key, 0, "float32", vals, lay),)))
    return compare(ref, par)


def test_the_picture_first_view_at_1280x800(browser, tmp_path, artifacts):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    try:
        p = context.new_page()
        errors: list[str] = []
        p.on("pageerror", lambda e: errors.append(str(e)))
        p.goto(sv.export_html(two_groups(), tmp_path / "groups.html").as_uri())
        p.wait_for_selector(READY)
        # The tree is coloured by error: every line carries its bin, the replicas row the
        # "replicas disagree" colour, shown as its left border.
        bins = p.eval_on_selector_all("tr[data-error-bin]", "els => els.map(e => e.dataset.errorBin)")
        assert bins == ["4", "4", "4"]
        border = p.eval_on_selector("tr[data-row='0'] td", "td => getComputedStyle(td).borderLeftColor")
        assert border == "rgb(128, 115, 172)"  # #8073ac, numerics_mpl.BINS[4]
        assert p.locator("[data-legend-bin]").count() == 7
        # The selected row shows the agreement matrix: two blocks, 0-3 and 4-7.
        p.wait_for_selector("[data-agreement]")
        groups = p.eval_on_selector_all(
            "[data-agreement-group]", "els => els.map(e => e.dataset.agreementGroup)"
        )
        assert groups == ["0,1,2,3", "4,5,6,7"]
        frac = p.eval_on_selector_all(
            "[data-agree]",
            "els => Object.fromEntries(els.map(e => [e.dataset.agree, Number(e.dataset.fraction)]))",
        )
        assert len(frac) == 64
        assert all(
            frac[f"{a},{b}"] == (1.0 if (a < 4) == (b < 4) else 0.0) for a in range(8) for b in range(8)
        )
        # Each fact once: the disagreement sentence is in the detail, not in the header too.
        fact = "ranks 4-7 differ from ranks 0-3"
        assert p.inner_text(".sv-head").count(fact) == 0
        assert p.inner_text("[data-shardviz-view=numerics]").count(fact) == 1
        # Long lines wrap between words only, never mid-word.
        wrap = p.eval_on_selector_all(
            "pre.sv-lines, pre.sv-summary",
            "els => els.map(e => [getComputedStyle(e).whiteSpace, getComputedStyle(e).wordBreak,"
            " getComputedStyle(e).overflowWrap])",
        )
        assert wrap and all(w == ["pre-wrap", "normal", "normal"] for w in wrap), wrap
        # The group selector draws group 1: its shards are ranks 4-7.
        p.select_option("select[data-control=layout-group]", "1")
        p.wait_for_selector("[data-layout-group='1']")
        ranks = p.eval_on_selector_all(
            ".sv-tensor [data-rank]", "els => [...new Set(els.map(e => Number(e.dataset.rank)))].sort()"
        )
        assert ranks == [4, 5, 6, 7]
        (artifacts / "numerics").mkdir(exist_ok=True)
        p.screenshot(path=str(artifacts / "numerics" / "numerics_1280x800.png"), full_page=True)
        assert errors == [], errors
    finally:
        context.close()


def test_turning_the_heatmap_off_hides_its_colour_bar(page, tmp_path):
    p = page.page
    p.set_viewport_size({"width": 1280, "height": 800})
    p.goto(sv.export_html(report(), tmp_path / "numerics.html").as_uri())
    p.wait_for_selector("[data-detail-row='1'] [data-heat-legend]")
    assert p.is_visible("[data-heat-legend]")
    p.uncheck("[data-control=error-heatmap]")
    assert not p.is_visible("[data-heat-legend]")
    p.check("[data-control=error-heatmap]")
    assert p.is_visible("[data-heat-legend]")
    # The event line is one line, cut with an ellipsis, its full text in the tooltip.
    ev = p.eval_on_selector("[data-event-id='4']", "e => [getComputedStyle(e).textOverflow, e.title]")
    assert ev[0] == "ellipsis" and "onerror" in ev[1]
    assert page.errors == [], page.errors
