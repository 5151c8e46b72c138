"""The layout view on the Python side, no browser: synced state, the value-fetch command through a
recording comm, global assembly against plain torch, text, matplotlib, HTML export and bad input.

Expected values are written out by hand or computed from plain torch on the global tensor.
"""

from __future__ import annotations

import base64
import io
import json
import re
import zipfile
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from widget_comm import attach, from_frontend, invoke

import shardviz as sv
from shardviz.views import geometry as g
from shardviz.views import html as svhtml
from shardviz.views.widgets import LayoutWidget, esm_files

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parents[2]


def fetch(widget: LayoutWidget, rank: int, msg_id: str = "req-1") -> tuple[dict, list]:
    """Ask for values exactly as layout.js does and read the reply."""
    return invoke(widget, "fetch_values", {"rank": rank}, msg_id=msg_id, only=True)


def decoded(widget: LayoutWidget, rank: int) -> np.ndarray:
    meta, buffers = fetch(widget, rank)
    assert "error" not in meta, meta
    assert len(buffers) == 1
    return g.decode(meta, bytes(buffers[0]))


# ---- DTensors from the simulation (one per world size) --------------------------------------------


@pytest.fixture(scope="module")
def dts4():
    sv.use("local", world_size=4)
    x = torch.arange(35.0).reshape(5, 7)
    base = torch.arange(6.0).reshape(2, 3)
    with sv.record():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        mesh1 = init_device_mesh("cpu", (4,))
        out = {
            "x": x,
            "base": base,
            "uneven": distribute_tensor(x, mesh, [Shard(0), Shard(1)]),
            "rep": distribute_tensor(x, mesh, [Shard(0), Replicate()]),
            "partial": DTensor.from_local(
                sv.per_rank(lambda r: base * (r + 1)), mesh, [Replicate(), Partial()], run_check=False
            ),
            "scalar": distribute_tensor(torch.tensor(2.5), mesh1, [Replicate()]),
            "empty": distribute_tensor(torch.zeros(0, 3), mesh1, [Shard(0)]),
            "bf16": distribute_tensor(
                torch.tensor([1.5, -2.25, 3.0, 8.0, 0.5]).bfloat16(), mesh1, [Shard(0)]
            ),
            "int": distribute_tensor(torch.arange(6, dtype=torch.int64) * 1000, mesh1, [Shard(0)]),
            "bool": distribute_tensor(torch.tensor([True, False, True, True, False]), mesh1, [Shard(0)]),
            "complex": distribute_tensor(torch.tensor([1 + 2j, 3 - 1j, -1j, 2.0 + 0j]), mesh1, [Shard(0)]),
            "nonfinite": distribute_tensor(
                torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0]), mesh1, [Shard(0)]
            ),
            "local": sv.per_rank(lambda r: torch.full((2, r + 1), float(r))),
        }
        out["partial_full"] = out["partial"].full_tensor()
    return out


# ---- synced state ---------------------------------------------------------------------------------


def test_state_of_a_2d_uneven_layout_is_small_plain_geometry():
    w = sv.show(sv.layout((5, 7), (2, 2), ["S(0)", "S(1)"], ("dp", "tp")))
    state = w.get_state()
    geo = state["geometry"]
    assert geo["global_shape"] == [5, 7]
    assert geo["mesh_shape"] == [2, 2] and geo["dim_labels"] == ["dp", "tp"]
    assert geo["ranks"] == [0, 1, 2, 3]
    assert geo["coords"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert geo["shapes"] == [[3, 4], [3, 3], [2, 4], [2, 3]]
    assert geo["runs"] == [[[0, 3], [0, 4]], [[0, 3], [4, 7]], [[3, 5], [0, 4]], [[3, 5], [4, 7]]]
    assert geo["partial"] is None
    assert (
        geo["notes"][-1]
        == "uneven shards: 3×4 on rank(s) 0; 3×3 on rank(s) 1; 2×4 on rank(s) 2; 2×3 on rank(s) 3"
    )
    assert state["dims"] == [0, 1] and state["index"] == [0, 0]
    assert state["heatmap"] is False and state["selected"] == -1
    assert state["values_info"]["available"] is False
    assert state["_view_name"] == "AnyView"
    js = state["_esm"]
    assert 'data-shardviz-view": "layout"' in js and "data-rank" in js and "fetch_values" in js
    json.dumps(state)  # the whole state is JSON


def test_state_of_1d_3d_meshes_empty_partial_and_strided():
    one = sv.show(sv.layout((10,), (4,), ["S(0)"])).geometry
    assert one["shapes"] == [[3], [3], [3], [1]] and one["coords"] == [[0], [1], [2], [3]]
    three = sv.show(sv.layout((4, 6, 5), (2, 2, 2), ["S(0)", "R", "P"], ("pp", "dp", "tp")))
    geo = three.geometry
    assert geo["mesh_shape"] == [2, 2, 2]
    assert geo["coords"][5] == [1, 0, 1]
    assert geo["partial"] == {"op": "sum", "mesh_dims": [2], "over": ["tp"]}
    assert three.dims == [1, 2] and three.index == [0, 0, 0]
    assert geo["notes"] == [
        "pp (2): S(0): tensor dim 0 split into 2 chunks",
        "dp (2): R: replicated, each element held by the 2 ranks along dp",
        "tp (2): P(sum): hatched = partial values, pending sum over tp",
    ]
    empty = sv.show(sv.layout((2, 5), (4,), ["S(0)"])).geometry
    assert empty["shapes"] == [[1, 5], [1, 5], [0, 5], [0, 5]]
    assert empty["runs"][2] == [[], [0, 5]]
    assert empty["notes"][-1] == "empty shards (hold no elements): rank(s) 2-3"
    strided = sv.show(sv.layout((8, 8), (2, 2), ["_S(0,sf=2)", "S(0)"])).geometry
    # torch's _StridedShard docstring: ranks 0..3 hold rows 0-1, 4-5, 2-3, 6-7
    assert [r[0] for r in strided["runs"]] == [[0, 2], [4, 6], [2, 4], [6, 8]]
    strided3 = sv.layout((12,), (2, 2), ["_S(0,sf=3)", "S(0)"])
    geo3 = sv.show(strided3).geometry
    # sf=3 pieces [0,4) [4,8) [8,12), halves over mesh dim 0 -> rows 0,1,4,5,8,9 for coord 0,
    # then S(0) over mesh dim 1 halves that: rank 0 holds rows 0,1,4 and rank 1 rows 5,8,9.
    assert geo3["runs"][0] == [[0, 2, 4, 5]] and geo3["runs"][1] == [[5, 6, 8, 10]]


def test_256_rank_payload_stays_small():
    w = sv.show(sv.layout((64, 64), (16, 16), ["S(0)", "S(1)"]))
    state = {
        k: w.get_state()[k]
        for k in ("geometry", "values_info", "dims", "index", "heatmap", "selected", "title")
    }
    size = len(json.dumps(state))
    print(f"256-rank synced state: {size} bytes (ESM {len(w._esm)} bytes, sent once per session)")
    assert size < 20_000
    assert len(w.geometry["ranks"]) == 256


def test_python_side_changes_go_out_as_one_small_update():
    w = sv.show(sv.layout((5, 7), (2, 2), ["S(0)", "S(1)"]))
    comm = attach(w)
    w.selected = 3
    assert comm.sent == [("comm_msg", {"method": "update", "state": {"selected": 3}, "buffer_paths": []}, [])]


def test_frontend_click_syncs_selected_and_dims():
    w = sv.show(sv.layout((4, 6, 5), (2,), ["S(1)"]))
    attach(w)
    from_frontend(w, {"method": "update", "state": {"selected": 1, "dims": [0, 2], "index": [0, 3, 0]}})
    assert (w.selected, w.dims, w.index) == (1, [0, 2], [0, 3, 0])


# ---- blocks (matplotlib's and the browser's picture) ----------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ((5, 7), (2, 2), ["S(0)", "S(1)"]),
        ((8, 8), (2, 2), ["_S(0,sf=2)", "S(0)"]),
        ((12, 3), (2, 2), ["_S(0,sf=3)", "R"]),
        ((2, 5), (4,), ["S(0)"]),
        ((6, 4), (2, 3), ["S(1)", "S(0)"]),
        ((4, 6, 5), (2, 2, 2), ["S(0)", "R", "P"]),
    ],
)
def test_blocks_cover_every_element_with_its_owners(args):
    lay = sv.layout(*args)
    nd = len(lay.global_shape)
    rd, cd = g.view_dims(nd)
    index = [1] * nd
    blocks = g.blocks(lay, (rd, cd), index)
    seen = np.zeros((lay.global_shape[rd], lay.global_shape[cd]), dtype=int)
    for b in blocks:
        for i in range(b.row0, b.row1):
            for j in range(b.col0, b.col1):
                seen[i, j] += 1
                full = list(index)
                full[rd], full[cd] = i, j
                assert list(b.owners) == lay.owners(full)
    assert (seen == 1).all()


def test_block_counts_by_hand():
    assert len(g.blocks(sv.layout((10, 3), (4,), ["S(0)"]), (0, 1), (0, 0))) == 4
    rep = g.blocks(sv.layout((4, 6), (2, 2), ["S(0)", "R"]), (0, 1), (0, 0))
    assert [b.owners for b in rep] == [(0, 1), (2, 3)]
    strided = g.blocks(sv.layout((8, 8), (2, 2), ["_S(0,sf=2)", "S(0)"]), (0, 1), (0, 0))
    assert [(b.row0, b.row1, b.owners) for b in strided] == [
        (0, 2, (0,)),
        (2, 4, (2,)),
        (4, 6, (1,)),
        (6, 8, (3,)),
    ]


# ---- values through the command -------------------------------------------------------------------


def test_fetch_values_of_each_rank_match_plain_torch_chunks(dts4):
    w = sv.show(dts4["uneven"])
    x = dts4["x"].numpy()
    for rank, (i, j) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        expected = np.array_split(x, [3], axis=0)[i]
        expected = np.array_split(expected, [4], axis=1)[j]
        np.testing.assert_array_equal(decoded(w, rank), expected)
    meta, _ = fetch(w, 2)
    assert meta["shape"] == [2, 4] and meta["format"] == "f4" and meta["dtype"] == "float32"
    assert meta["step"] == [1, 1]
    np.testing.assert_array_equal(decoded(w, -1), x)
    assert fetch(w, -1)[0]["format"] == "f4"  # float32 source: the global tensor goes as float32


def test_partial_values_per_rank_and_reduced_global_match_full_tensor(dts4):
    w = sv.show(dts4["partial"])
    base = dts4["base"].numpy()
    for r in range(4):
        np.testing.assert_array_equal(decoded(w, r), base * (r + 1))
    full = dts4["partial_full"]
    np.testing.assert_allclose(decoded(w, -1), full._local_tensors[0].numpy())
    np.testing.assert_allclose(decoded(w, -1), base * (1 + 2))  # dp = 0 ranks 0, 1 summed over tp
    assert w.geometry["partial"]["over"] == ["tp"]


def test_replicated_values_read_once_per_replica(dts4):
    w = sv.show(dts4["rep"])
    np.testing.assert_array_equal(decoded(w, 1), dts4["x"].numpy()[:3])
    np.testing.assert_array_equal(decoded(w, -1), dts4["x"].numpy())


def test_global_reduce_ops_by_hand():
    lay = sv.layout((2,), (3,), ["P(max)"])
    vals = {0: np.array([1.0, 5.0]), 1: np.array([4.0, -1.0]), 2: np.array([2.0, 2.0])}
    np.testing.assert_array_equal(g.global_values(lay, vals), [4.0, 5.0])
    lay = sv.layout((2,), (3,), ["P(avg)"])
    np.testing.assert_array_equal(g.global_values(lay, vals), [7 / 3, 2.0])
    lay = sv.layout((2,), (3,), ["P(min)"])
    np.testing.assert_array_equal(g.global_values(lay, vals), [1.0, -1.0])


def test_bad_requests_get_an_error_reply_not_an_exception(dts4):
    w = sv.show(dts4["uneven"])
    assert "no values for rank 9" in fetch(w, 9)[0]["error"]
    geo_only = sv.show(sv.layout((4,), (2,), ["S(0)"]))
    meta, buffers = fetch(geo_only, 0)
    assert meta == {"error": "no values: this view was made from geometry only"} and buffers == []


def test_big_values_are_sampled_and_say_so():
    a = np.arange(3000 * 1000, dtype=np.float32).reshape(3000, 1000)
    meta, data = g.encode(a, "float32", limit=10_000)
    out = g.decode(meta, data)
    assert meta["source_shape"] == [3000, 1000] and np.prod(meta["shape"]) <= 10_000
    s0, s1 = meta["step"]
    np.testing.assert_array_equal(out, a[::s0, ::s1])


# ---- dtypes, odd tensors ---------------------------------------------------------------------------


def test_bf16_int_bool_complex_nan_inf(dts4):
    bf = sv.show(dts4["bf16"])
    assert bf.geometry["dtype"] == "bfloat16"
    meta, _ = fetch(bf, 0)
    assert meta["format"] == "f4" and meta["dtype"] == "bfloat16"
    np.testing.assert_array_equal(decoded(bf, 0), [1.5, -2.25])
    ints = sv.show(dts4["int"])
    np.testing.assert_array_equal(decoded(ints, 2), [4000, 5000])  # torch.chunk(6, 4): 2, 2, 2, 0
    assert decoded(ints, 3).shape == (0,)
    assert fetch(ints, 2)[0]["format"] == "f8" and fetch(ints, -1)[0]["format"] == "f8"
    bools = sv.show(dts4["bool"])
    np.testing.assert_array_equal(decoded(bools, 1), [True, True])
    np.testing.assert_array_equal(decoded(bools, -1), [1.0, 0.0, 1.0, 1.0, 0.0])
    cx = sv.show(dts4["complex"])
    assert fetch(cx, 0)[0]["format"] == "c8"
    np.testing.assert_array_equal(decoded(cx, 0), [1 + 2j])
    nf = sv.show(dts4["nonfinite"], heatmap=True)
    got = decoded(nf, -1)
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == -np.inf and got[3] == 1.0
    fig = sv.plot(dts4["nonfinite"], heatmap=True)
    (bar,) = [ax for ax in fig.axes if ax.get_gid() == "colorbar"]
    assert "1 NaN (grey)" in bar.get_xlabel()


def test_scalar_and_empty_dtensors_draw(dts4):
    sc = sv.show(dts4["scalar"])
    assert sc.geometry["global_shape"] == [] and sc.geometry["shapes"] == [[], [], [], []]
    assert sc.dims == [-1, -1]
    np.testing.assert_array_equal(decoded(sc, 2), np.array(2.5))
    assert [b.owners for b in g.blocks(sc.tensor_layout, (None, None), ())] == [(0, 1, 2, 3)]
    stripes = _patches(sv.plot(dts4["scalar"]), "shard-r")  # one cell in diagonal stripes of 4 ranks
    assert {p.get_gid() for p in stripes} == {"shard-r0", "shard-r1", "shard-r2", "shard-r3"}
    em = sv.show(dts4["empty"])
    assert em.geometry["shapes"] == [[0, 3]] * 4
    fig = sv.plot(dts4["empty"])
    assert _patches(fig, "shard-r") == [] and len(_patches(fig, "mesh-r")) == 4
    assert any("empty tensor 0×3" in t.get_text() for t in fig.axes[0].texts)


def test_local_tensor_draws_each_rank_side_by_side(dts4):
    w = sv.show(dts4["local"])
    assert w.geometry["global_shape"] == [2, 10]
    assert w.geometry["runs"] == [[[0, 2], [0, 1]], [[0, 2], [1, 3]], [[0, 2], [3, 6]], [[0, 2], [6, 10]]]
    assert "side by side" in w.title
    np.testing.assert_array_equal(decoded(w, 3), np.full((2, 4), 3.0))


# ---- text ----------------------------------------------------------------------------------------


def test_text_and_repr_are_exact():
    w = sv.show(sv.layout((10, 3), (4,), ["S(0)"]))
    assert w.text() == (
        "Layout (10, 3) float32 on mesh (4,) placements [S(0)]\n"
        "rank  coord  offset  shape   indices\n"
        "   0  (0,)   (0, 0)  (3, 3)  [0:3, 0:3]\n"
        "   1  (1,)   (3, 0)  (3, 3)  [3:6, 0:3]\n"
        "   2  (2,)   (6, 0)  (3, 3)  [6:9, 0:3]\n"
        "   3  (3,)   (9, 0)  (1, 3)  [9:10, 0:3]\n"
        "values: none (geometry only)"
    )
    assert repr(w) == (
        "LayoutWidget(global_shape=(10, 3), dtype='float32', mesh_shape=(4,), "
        "placements=['S(0)'], values=none)"
    )


def test_mimebundle_has_widget_text_and_png(dts4):
    w = sv.show(dts4["uneven"])
    data, _ = w._repr_mimebundle_()
    assert data["application/vnd.jupyter.widget-view+json"]["model_id"] == w.model_id
    assert data["text/plain"].startswith("Layout (5, 7) float32 on mesh (2, 2) ('dp', 'tp')")
    assert data["text/plain"].endswith("values: ranks 0-3")
    assert not re.search(r"0x[0-9a-f]{6,}", data["text/plain"])
    png = base64.b64decode(data["image/png"])
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert w._repr_mimebundle_()[0]["image/png"] == data["image/png"]  # deterministic


# ---- matplotlib ----------------------------------------------------------------------------------


def _patches(fig, prefix):
    return [p for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith(prefix)]


def test_plot_draws_one_patch_per_shard_region_and_mesh_cell():
    from matplotlib.figure import Figure

    fig = sv.plot(sv.layout((5, 7), (2, 2), ["S(0)", "S(1)"], ("dp", "tp")))
    assert isinstance(fig, Figure)
    assert [ax.get_gid() for ax in fig.axes] == ["tensor", "mesh"]
    assert sorted(p.get_gid() for p in _patches(fig, "shard-r")) == [
        "shard-r0",
        "shard-r1",
        "shard-r2",
        "shard-r3",
    ]
    assert len(_patches(fig, "mesh-r")) == 4
    tensor = fig.axes[0]
    assert [p.get_width() * p.get_height() for p in _patches(fig, "shard-r")] == [12, 9, 8, 6]
    assert tensor.get_xlim() == (0.0, 7.0) and tensor.get_ylim() == (5.0, 0.0)


def test_plot_replicate_stripes_partial_hatch_and_3d_mesh():
    fig = sv.plot(sv.layout((4, 6), (2, 2), ["S(0)", "R"]))
    # each block: diagonal stripes of its two owners in turn (rows 0-1: ranks 0, 1; rows 2-3: 2, 3)
    gids = [p.get_gid() for p in _patches(fig, "shard-r")]
    assert gids[: len(gids) // 2] == ["shard-r0", "shard-r1"] * (len(gids) // 4)
    assert gids[len(gids) // 2 :] == ["shard-r2", "shard-r3"] * (len(gids) // 4)
    fig = sv.plot(sv.layout((4, 6, 5), (2, 2, 2), ["S(0)", "R", "P"]), index=(2, 0, 0))
    # row 2 of dim 0 is pp = 1's (rows 2-3): ranks 4-7 in turn over the replicated block
    gids = [p.get_gid() for p in _patches(fig, "shard-r")]
    assert gids[:8] == [f"shard-r{r}" for r in (4, 5, 6, 7)] * 2
    assert len(_patches(fig, "partial")) == 1 + 8  # the drawn block, and every mesh cell
    assert len(_patches(fig, "mesh-r")) == 8
    empty = sv.plot(sv.layout((2, 5), (4,), ["S(0)"]))
    dashed = [p for p in _patches(empty, "mesh-r") if p.get_linestyle() == "--"]
    assert [p.get_gid() for p in dashed] == ["mesh-r2", "mesh-r3"]


def test_plot_256_ranks_and_is_deterministic():
    lay = sv.layout((64, 64), (16, 16), ["S(0)", "S(1)"])
    fig = sv.plot(lay)
    assert len(_patches(fig, "shard-r")) == 256 and len(_patches(fig, "mesh-r")) == 256
    small = sv.layout((5, 7), (2, 2), ["S(0)", "S(1)"])
    from shardviz.views.mpl import to_png

    assert to_png(sv.plot(small)) == to_png(sv.plot(small))


# ---- HTML export ---------------------------------------------------------------------------------


def _embedded(path: Path) -> dict:
    text = path.read_text(encoding="utf-8")
    m = re.search(r'<script type="application/json" id="shardviz-data">(.*?)</script>', text, re.S)
    assert m
    return json.loads(m.group(1))


def test_export_html_is_self_contained_and_answers_value_requests(dts4, tmp_path):
    out = sv.export_html(dts4["uneven"], tmp_path / "uneven.html")
    text = out.read_text(encoding="utf-8")
    assert "Content-Security-Policy" in text and "default-src 'none'" in text
    assert not re.search(r"""(src|href)=["']?https?:""", text)
    data = _embedded(out)
    assert data["view"] == "layout"
    assert data["state"]["geometry"]["shapes"] == [[3, 4], [3, 3], [2, 4], [2, 3]]
    replies = {key: (meta, bufs) for key, meta, bufs in data["responses"]}
    meta, bufs = replies[svhtml.request_key("fetch_values", {"rank": 3})]
    got = g.decode(meta, base64.b64decode(bufs[0]))
    np.testing.assert_array_equal(got, dts4["x"].numpy()[3:, 4:])
    assert svhtml.request_key("fetch_values", {"rank": -1}) in replies


def test_export_over_budget_keeps_geometry_and_says_why(dts4, tmp_path):
    out = sv.export_html(dts4["uneven"], tmp_path / "small.html", values_budget=10)
    data = _embedded(out)
    assert data["responses"] == []
    assert data["state"]["values_info"]["available"] is False
    assert "over the export budget" in data["state"]["values_info"]["note"]


def test_generic_exporter_embeds_binary_state_and_escapes_script_end(tmp_path):
    out = svhtml.export(
        "player",
        {"step": 0, "label": "</script><b>"},
        {"blob": b"\x00\x01\xff"},
        "export default { render() {} };",
        "",
        tmp_path / "p.html",
        responses=[("cmd", {"a": 1}, {"ok": True}, [b"xy"])],
    )
    text = out.read_text(encoding="utf-8")
    assert text.count("</script>") == 2  # the data and the host script; none from the state
    data = _embedded(out)
    assert data["state"]["label"] == "</script><b>"
    assert base64.b64decode(data["buffers"]["blob"]) == b"\x00\x01\xff"
    assert data["responses"] == [['["cmd",{"a":1}]', {"ok": True}, [base64.b64encode(b"xy").decode()]]]


# ---- bad input -----------------------------------------------------------------------------------


def test_bad_inputs_say_what_is_accepted(dts4):
    with pytest.raises(TypeError, match=r"accepts a DTensor, a LocalTensor, or a Layout.*got int"):
        sv.show(42)
    with pytest.raises(TypeError, match=r"plain torch.Tensor \(3, 4\).*distribute_tensor"):
        sv.show(torch.zeros(3, 4))
    with pytest.raises(TypeError, match=r"sv.plot accepts"):
        sv.plot("S(0)")
    with pytest.raises(ValueError, match=r"values\[0\] has shape \(5, 7\).*shard is \(3, 4\)"):
        sv.show(sv.layout((5, 7), (2, 2), ["S(0)", "S(1)"]), values={r: np.zeros((5, 7)) for r in range(4)})
    with pytest.raises(ValueError, match="not a rank of this layout"):
        sv.show(sv.layout((4,), (2,), ["S(0)"]), values={5: np.zeros(2)})
    with pytest.raises(TypeError, match=r"values=.*only for a Layout"):
        sv.show(dts4["uneven"], values={})
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['colour'\]"):
        sv.show(sv.layout((4,), (2,), ["S(0)"]), colour="red")
    with pytest.raises(ValueError, match="two different tensor dims"):
        sv.show(sv.layout((4, 4, 4), (2,), ["S(0)"]), dims=(1, 1))
    with pytest.raises(ValueError, match="heatmap=True needs values"):
        sv.show(sv.layout((4,), (2,), ["S(0)"]), heatmap=True)
    with pytest.raises(ValueError, match="outside a dim of size 4"):
        sv.plot(sv.layout((4, 4, 4), (2,), ["S(0)"]), index=(4, 0, 0))


# ---- packaging -----------------------------------------------------------------------------------


@pytest.mark.slow  # builds the wheel (~20 s): in `make test`, not `make test-unit`
def test_wheel_ships_the_widget_js_and_css(built_wheel):
    """An editable install hides files missing from the package; look inside the real wheel."""
    names = set(zipfile.ZipFile(io.BytesIO(built_wheel.read_bytes())).namelist())
    for f in ("layout.js", "layout.css", "standalone.js", "player.css", *esm_files("player")):
        assert f"shardviz/views/static/{f}" in names
    package = ROOT / "shardviz"
    shipped = {"*.py", "*.js", "*.css"}
    sources = {
        p.relative_to(ROOT).as_posix()
        for pattern in shipped
        for p in package.rglob(pattern)
        if "__pycache__" not in p.parts
    }
    assert {"shardviz/show.py", "shardviz/views/player.py"} <= sources
    assert sorted(sources - names) == [], "files of the package missing from the wheel"
