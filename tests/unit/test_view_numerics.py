"""Issue 26: the NumericsReport as text, widget, offline HTML and matplotlib, from plain data.

The report is made by hand from per-rank pieces (no simulation): a (2, 4) output split in
columns over two ranks, with one element wrong on rank 1. The expected text is written out.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from matplotlib.colors import to_hex
from widget_comm import invoke

import shardviz as sv
from shardviz.data.numerics import TOLERANCES, EventNote, RawCapture, RawTensor, RowKey, build_run, compare
from shardviz.geometry.layout import compute
from shardviz.views import geometry as g
from shardviz.views.numerics_agreement import agreement, groups

pytestmark = pytest.mark.timeout(60)

INPUT = RowKey("fc", 0, "input", "0")
OUTPUT = RowKey("fc", 0, "output", "")
MODULES = (("", "Net"), ("fc", "Linear"))


@pytest.fixture(scope="module")
def report() -> sv.NumericsReport:
    x = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    y = np.arange(1.0, 9.0, dtype=np.float32).reshape(2, 4)
    ref = build_run(
        "plain torch",
        RawCapture(
            1,
            "Net",
            MODULES,
            (RawTensor(INPUT, 0, "float32", {None: x}), RawTensor(OUTPUT, 1, "float32", {None: y})),
        ),
    )
    bad = y.copy()
    bad[1, 3] = 9.0
    lay = compute((2, 4), (2,), ["S(1)"], ("tp",))
    gather = EventNote(
        0,
        "collective",
        "all_gather groups [0,1] mesh tp (2,2)->(2,4) float32 in Net.fc (forward)",
        "fc",
        "forward",
    )
    tensors = (
        RawTensor(INPUT, 0, "float32", {None: x}, events=(0, 0)),
        RawTensor(OUTPUT, 1, "float32", {0: bad[:, :2], 1: bad[:, 2:]}, lay, events=(0, 1)),
    )
    par = build_run("tp on local (2 ranks)", RawCapture(2, "Net", MODULES, tensors), events={0: gather})
    return compare(ref, par)


TEXT = """\
NumericsReport: tp on local (2 ranks) against plain torch: 2 rows, 1 differ
first difference: Net.fc · forward · output · DIFFERS
  max abs 1, max rel 0.12; 1 of 8 elements beyond float32 tolerance (rtol 1e-05, atol 1e-05 x max|ref|)
  worst at [1, 3]: 9 here, 8 in the reference
  differs in dim 0 [1], dim 1 [3]
  held by rank 1
  layout [S(1)] on mesh (2,) ('tp',)
  collectives and redistributes while it ran:
    #0 all_gather groups [0,1] mesh tp (2,2)->(2,4) float32 in Net.fc (forward)

module / tensor  phase    shape   dtype    max abs  max rel  status
Net
  fc (Linear)
    input[0]     forward  (2, 2)  float32  0        0        ok
    output       forward  (2, 4)  float32  1        0.12     DIFFERS"""


def test_text_is_exact(report):
    assert str(report) == TEXT
    assert (
        repr(report)
        == "<NumericsReport tp on local (2 ranks) vs plain torch: 1 differ, first at Net.fc forward output>"
    )


def test_widget_syncs_the_tree_and_opens_the_first_difference(report):
    w = sv.show(report)
    s = w.summary
    assert s["lines"]["name"] == ["Net", "fc (Linear)", "", ""]
    assert s["lines"]["row"] == [-1, -1, 0, 1]
    assert s["lines"]["status"] == [
        "differs",
        "differs",
        "ok",
        "differs",
    ]  # a module shows the worst below it
    assert s["first"] == 1 and w.selected == 1
    assert s["rows"]["what"] == ["input[0]", "output"]
    assert len(json.dumps(s)) < 4000
    assert w.text() == TEXT
    assert repr(w).startswith("NumericsWidget('tp on local (2 ranks)' vs 'plain torch', rows=2, differ=1")
    with pytest.raises(TypeError, match="unknown option"):
        sv.show(report, heatmap=True)


def test_a_rows_detail_carries_its_layout_error_and_events(report):
    w = sv.show(report)
    reply, buffers = invoke(w, "detail", {"row": 1})
    assert reply["geometry"] == g.payload(report.rows[1].layout)
    assert reply["index"] == [1, 3] and reply["ranks"] == [1]
    assert [e["id"] for e in reply["events"]] == [0] and reply["events_during"]
    err = g.decode(reply["heat"], buffers[0])
    # In units of the tolerance: 1 / (1e-5 * 8 + 1e-5 * 8) at [1, 3], 0 elsewhere.
    want = np.zeros((2, 4), dtype=np.float32)
    want[1, 3] = 1 / (1e-5 * 8 + 1e-5 * 8)
    np.testing.assert_allclose(err, want, rtol=1e-5)
    bad, _ = invoke(w, "detail", {"row": 7})
    assert "no row 7" in bad["error"]


def test_export_html_embeds_the_tree_and_the_details(report, tmp_path):
    path = sv.export_html(report, tmp_path / "numerics.html")
    text = path.read_text(encoding="utf-8")
    assert 'data-shardviz-export="numerics"' in text
    assert '[\\"detail\\",{\\"row\\":1}]' in text or '["detail",{"row":1}]' in text
    assert "Content-Security-Policy" in text


def test_plot_draws_the_tree_coloured_by_error_and_where_the_first_difference_is(report):
    fig = sv.plot(report)
    assert len(fig.axes) == 3  # tree, heat-map and its colour bar (no copies disagree: no matrix)
    tree = fig.axes[0]
    # One bar per tree line (Net, fc, input, output); output beyond 1e3 tolerances: the darkest bin.
    colors = [to_hex(b.get_facecolor()) for b in tree.patches if b.get_fill()]
    assert colors == ["#d94801", "#d94801", "#e6e6e6", "#d94801"]
    image = fig.axes[1].images[0].get_array()
    assert image.shape == (2, 4) and float(image[1, 3]) == pytest.approx(1 / 1.6e-4, rel=1e-4)


def test_plot_shows_itself_as_a_png_in_a_notebook(report):
    from IPython.core.formatters import PNGFormatter

    fig = sv.plot(report)
    png = PNGFormatter()(fig)  # what IPython's display puts in the cell as image/png
    assert isinstance(png, bytes) and png.startswith(b"\x89PNG")


# --- which ranks agree: hand-written expectations ------------------------------------------------

F32 = TOLERANCES["float32"]


def test_agreement_of_8_ranks_where_4_to_7_disagree_with_0_to_3():
    y = np.arange(6.0, dtype=np.float32)
    ranks, m = agreement({r: y if r < 4 else y + 8 for r in range(8)}, F32)
    want = np.zeros((8, 8))
    want[:4, :4] = want[4:, 4:] = 1.0
    assert ranks == list(range(8))
    np.testing.assert_array_equal(m, want)
    assert groups(ranks, m) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_agreement_when_all_agree_and_with_one_rank():
    y = np.ones((2, 3), dtype=np.float32)
    ranks, m = agreement({r: y for r in range(4)}, F32)
    np.testing.assert_array_equal(m, np.ones((4, 4)))
    assert groups(ranks, m) == [[0, 1, 2, 3]]
    ranks, m = agreement({5: y}, F32)
    assert ranks == [5] and m.tolist() == [[1.0]] and groups(ranks, m) == [[5]]


def test_agreement_with_a_nan_on_one_rank():
    y = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    bad = y.copy()
    bad[2] = np.nan  # one of 4 elements
    ranks, m = agreement({0: y, 1: y, 2: bad}, F32)
    want = np.array([[1, 1, 0.75], [1, 1, 0.75], [0.75, 0.75, 1]])
    np.testing.assert_array_equal(m, want)
    assert groups(ranks, m) == [[0, 1], [2]]
    # NaN equals NaN: two ranks with the same NaN agree.
    _, m = agreement({0: bad, 1: bad.copy()}, F32)
    assert m.tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_agreement_in_bf16_tolerance():
    # bf16 keeps 8 bits of mantissa: 1 + 2**-8 rounds to 1 + 2**-7 or 1; a difference of one bf16
    # step (2**-7 at 1.0) is within bf16's tolerance (rtol 1e-2), a difference of 0.1 is not.
    y = np.ones(4, dtype=np.float32)
    step = y + 2.0**-7
    far = y + 0.1
    ranks, m = agreement({0: y, 1: step, 2: far}, TOLERANCES["bfloat16"])
    np.testing.assert_array_equal(m, [[1, 1, 0], [1, 1, 0], [0, 0, 1]])
    assert groups(ranks, m) == [[0, 1], [2]]


def test_a_rows_detail_carries_the_agreement_of_its_copies():
    key, modules = RowKey("embed", 0, "output", ""), (("", "LM"), ("embed", "Embedding"))
    y = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    ref = build_run("plain torch", RawCapture(1, "LM", modules, (RawTensor(key, 0, "float32", {None: y}),)))
    lay = compute((3, 4), (4,), ["S(1)"], ("tp",), groups=[[0, 1, 2, 3], [4, 5, 6, 7]])
    vals: dict[int | None, np.ndarray] = {r: (y if r < 4 else y + 8)[:, r % 4 : r % 4 + 1] for r in range(8)}
    rep = compare(
        ref, build_run("tp", RawCapture(8, "LM", modules, (RawTensor(key, 0, "float32", vals, lay),)))
    )
    reply, _ = invoke(sv.show(rep), "detail", {"row": 0})
    a = reply["agreement"]
    assert a["ranks"] == list(range(8)) and a["groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert a["matrix"][0] == [1.0] * 4 + [0.0] * 4 and a["matrix"][7] == [0.0] * 4 + [1.0] * 4
    # The picture draws the matrix with the two groups outlined.
    fig = sv.plot(rep)
    matrix = fig.axes[-1]
    np.testing.assert_array_equal(matrix.images[0].get_array(), np.asarray(a["matrix"]))
    assert "0-3 | 4-7" in matrix.get_title(loc="left")
    # Each fact once in the widget's header and detail: the disagreement only in the detail.
    head = "\n".join(sv.show(rep).summary["head"])
    assert "differ from" not in head and any("4-7 differ from ranks 0-3" in x for x in reply["lines"])


def test_the_widgets_static_picture_follows_its_selected_row(report):
    from shardviz.views.numerics_view import NumericsWidget

    # Row 0 (the input) equals the reference everywhere: the tree alone, its bar outlined.
    fig = NumericsWidget(report, selected=0).figure()
    assert len(fig.axes) == 1
    outlined = [p for p in fig.axes[0].patches if not p.get_fill()]
    assert len(outlined) == 1 and outlined[0].get_y() == pytest.approx(2 - 0.4)  # tree line 2: input[0]
    assert len(NumericsWidget(report, selected=1).figure().axes) == 3
