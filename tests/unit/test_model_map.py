"""The model map (issue 15): every parameter, grad, optimizer state and buffer of a module with its
placements and bytes per rank, as plain data, text, widget, matplotlib and offline HTML.

Expected shapes and bytes are written out by hand, and checked against the real local tensors
the simulator holds on each rank.
"""

from __future__ import annotations

import json
import re

import matplotlib
import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from widget_comm import attach, from_frontend, invoke

import shardviz as sv
from shardviz.views import geometry as g
from shardviz.views import html as svhtml
from shardviz.views.model_view import ModelWidget

matplotlib.use("Agg")


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.fixture(scope="module")
def tp4():
    """A 2-layer MLP, Colwise then Rowwise on a 1-D tp mesh of 4, after one Adam step."""
    sv.use("local", world_size=4)
    torch.manual_seed(0)
    model = MLP()
    with sv.record():
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
    return model, opt


def _local_bytes(t) -> list[int]:
    """Bytes each simulated rank really holds of a DTensor (or of a plain tensor, on every rank)."""
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    per = getattr(local, "_local_tensors", None)
    if per is None:
        return [local.numel() * local.element_size()] * 4
    return [per[r].numel() * per[r].element_size() for r in range(4)]


# ---- the data ------------------------------------------------------------------------------------


def test_colwise_rowwise_mlp_shapes_and_bytes_by_hand(tp4):
    model, _ = tp4
    m = sv.model_map(model, grads=False)
    assert m.world_size == 4
    assert [r.name for r in m.rows] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    expected = {
        # name: (placements, local shape on every rank, bytes per rank)
        "fc1.weight": (("S(0)",), (8, 16), 512),  # Linear(16, 32) colwise: (32, 16) rows / 4, fp32
        "fc1.bias": (("S(0)",), (8,), 32),
        "fc2.weight": (("S(1)",), (16, 8), 512),  # rowwise: (16, 32) columns / 4
        "fc2.bias": (("R",), (16,), 64),  # rowwise bias is replicated
    }
    for name, (placements, shape, nbytes) in expected.items():
        lay = m.layout(name)
        assert lay.placements == placements and lay.mesh_dim_names == ("tp",)
        assert [m.local_shape(name, r) for r in range(4)] == [shape] * 4
        assert m.bytes_of(name).tolist() == [nbytes] * 4
    for name, p in model.named_parameters():
        assert m.bytes_of(name).tolist() == _local_bytes(p), name
    assert m.totals().tolist() == [1120] * 4
    assert m.global_bytes == (32 * 16 + 32 + 16 * 32 + 16) * 4


def test_grads_and_adam_state_are_counted(tp4):
    model, opt = tp4
    m = sv.model_map(model, optimizer=opt)
    names = [r.name for r in m.rows if r.param == "fc1.weight"]
    assert names == [
        "fc1.weight",
        "fc1.weight.grad",
        "fc1.weight:step",
        "fc1.weight:exp_avg",
        "fc1.weight:exp_avg_sq",
    ]
    assert [m.row(n).kind for n in names] == ["param", "grad", "optimizer", "optimizer", "optimizer"]
    w = model.fc1.weight
    st = opt.state[w]
    assert m.bytes_of("fc1.weight.grad").tolist() == [512] * 4 == _local_bytes(w.grad)
    assert m.bytes_of("fc1.weight:exp_avg").tolist() == [512] * 4 == _local_bytes(st["exp_avg"])
    assert m.bytes_of("fc1.weight:exp_avg_sq").tolist() == [512] * 4 == _local_bytes(st["exp_avg_sq"])
    assert m.row("fc1.weight:exp_avg").distributed and m.layout("fc1.weight:exp_avg").placements == ("S(0)",)
    assert m.bytes_of("fc1.weight:step").tolist() == [4] * 4  # a plain fp32 scalar on every rank
    # params 1120 per rank, grads the same, exp_avg + exp_avg_sq twice that, 4 step scalars of 4 B
    assert m.totals("param").tolist() == [1120] * 4
    assert m.totals("grad").tolist() == [1120] * 4
    assert m.totals("optimizer").tolist() == [2 * 1120 + 16] * 4
    assert m.totals().tolist() == [4 * 1120 + 16] * 4
    np.testing.assert_array_equal(m.totals(), m.nbytes.sum(axis=0))
    assert sv.model_map(model, optimizer=opt, grads=False).totals().tolist() == [3 * 1120 + 16] * 4


class PerPartOptimizers(torch.optim.Optimizer):
    """A wrapper of one optimizer per model part, as torchtitan's OptimizersContainer: an
    Optimizer whose own state stays empty, the parts' state in ``.optimizers``."""

    def __init__(self, parts: list[torch.optim.Optimizer], params: list[torch.nn.Parameter]) -> None:
        self.optimizers = parts
        super().__init__(params, {})


def test_an_optimizer_wrapper_counts_each_parts_state(tp4):
    model, opt = tp4
    fc1 = list(model.fc1.parameters())
    fc2 = list(model.fc2.parameters())
    parts = [torch.optim.Adam(fc1), torch.optim.Adam(fc2)]
    for part, params in zip(parts, (fc1, fc2), strict=True):  # each part's state: opt's, copied
        for p in params:
            part.state[p] = dict(opt.state[p])
    wrapper = PerPartOptimizers(parts, fc1 + fc2)
    assert len(wrapper.state) == 0  # what the model map read before: no optimizer state at all
    want = sv.model_map(model, optimizer=opt)
    for given in (wrapper, parts):
        m = sv.model_map(model, optimizer=given)
        assert [r.name for r in m.rows] == [r.name for r in want.rows]
        assert m.totals("optimizer").tolist() == [2 * 1120 + 16] * 4  # by hand, as above


def test_fsdp_tp_hand_placed_on_dp_tp_mesh():
    sv.use("local", world_size=4)
    model = torch.nn.Module()
    with sv.record():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        a = distribute_tensor(torch.randn(10, 6), mesh, [Shard(0), Shard(0)])
        b = distribute_tensor(torch.randn(10, 6), mesh, [Shard(0), Shard(1)])
    model.register_parameter("a", torch.nn.Parameter(a))
    model.register_parameter("b", torch.nn.Parameter(b))
    m = sv.model_map(model)
    # [S(0), S(0)]: rows 10 -> 5, 5 over dp, then each 5 -> 3, 2 over tp
    assert [m.local_shape("a", r) for r in range(4)] == [(3, 6), (2, 6), (3, 6), (2, 6)]
    assert m.bytes_of("a").tolist() == [72, 48, 72, 48] == _local_bytes(a)
    # [S(0), S(1)]: rows 10 -> 5, 5 over dp, columns 6 -> 3, 3 over tp
    assert [m.local_shape("b", r) for r in range(4)] == [(5, 3)] * 4
    assert m.bytes_of("b").tolist() == [60] * 4 == _local_bytes(b)
    assert m.totals().tolist() == [132, 108, 132, 108]
    dims = {d.name: d for d in m.by_mesh_dim()}
    assert (dims["dp"].size, dims["dp"].sharded, dims["dp"].replicated) == (2, 480, 0)
    assert (dims["tp"].size, dims["tp"].sharded) == (2, 480)


def test_uneven_shards_and_plain_params_by_pure_geometry():
    m = sv.model_map({"emb.weight": sv.layout((10, 3), (4,), ["S(0)"])})
    assert [m.local_shape("emb.weight", r) for r in range(4)] == [(3, 3), (3, 3), (3, 3), (1, 3)]
    assert m.bytes_of("emb.weight").tolist() == [36, 36, 36, 12]
    assert m.rows[0].module == "emb" and m.world_size == 4
    plain = sv.model_map(torch.nn.Linear(3, 2), world_size=8)
    assert plain.bytes_of("weight").tolist() == [24] * 8 and plain.bytes_of("bias").tolist() == [8] * 8
    assert not plain.rows[0].distributed and plain.by_mesh_dim() == ()


def test_meta_device_module_and_buffers():
    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False), torch.nn.BatchNorm1d(4096))
    m = sv.model_map(net.to(torch.bfloat16), world_size=512)
    assert [(r.name, r.kind) for r in m.rows] == [
        ("0.weight", "param"),
        ("1.weight", "param"),
        ("1.bias", "param"),
        ("1.running_mean", "buffer"),
        ("1.running_var", "buffer"),
        ("1.num_batches_tracked", "buffer"),
    ]
    assert m.nbytes.shape == (6, 512)
    assert m.totals()[511] == 4096 * 4096 * 2 + 4 * 4096 * 2 + 8
    assert m.modules == (("", "Sequential"), ("0", "Linear"), ("1", "BatchNorm1d"))


def test_to_dict_round_trips_through_json(tp4):
    model, opt = tp4
    m = sv.model_map(model, optimizer=opt)
    back = sv.ModelMap.from_dict(json.loads(json.dumps(m.to_dict())))
    assert back == m and str(back) == str(m)
    assert len(m.layouts) == 5  # S(0) (8,16)... : identical layouts are stored once


def test_text_is_exact(tp4):
    model, _ = tp4
    assert str(sv.model_map(model, grads=False)) == (
        "ModelMap MLP: 4 ranks, 4 params\n"
        "name      kind   shape     dtype    mesh  placements  local shape  bytes/rank\n"
        "fc1 (Linear)\n"
        "  weight  param  (32, 16)  float32  tp=4  [S(0)]      (8, 16)      512\n"
        "  bias    param  (32,)     float32  tp=4  [S(0)]      (8,)         32\n"
        "fc2 (Linear)\n"
        "  weight  param  (16, 32)  float32  tp=4  [S(1)]      (16, 8)      512\n"
        "  bias    param  (16,)     float32  tp=4  [R]         (16,)        64\n"
        "total per rank: 1120 B (1.1 KiB) on every rank\n"
        "unsharded: 4288 B (4.2 KiB)\n"
        "mesh dim tp (4): sharded 4.1 KiB, replicated 64 B"
    )
    uneven = sv.model_map({"w": sv.layout((10, 3), (4,), ["S(0)"])}, name="toy")
    assert str(uneven) == (
        "ModelMap toy: 4 ranks, 1 param\n"
        "name  kind   shape    dtype    mesh  placements  local shape              bytes/rank\n"
        "(root)\n"
        "  w   param  (10, 3)  float32  4     [S(0)]      (3, 3) r0-2 · (1, 3) r3  36 r0-2 · 12 r3\n"
        "total per rank: 36 r0-2 · 12 r3 (min 12 B, max 36 B)\n"
        "unsharded: 120 B\n"
        "mesh dim 0 (4): sharded 120 B"
    )


def test_bad_input_says_what_is_accepted():
    with pytest.raises(TypeError, match=r"nn.Module.*got int"):
        sv.model_map(3)
    with pytest.raises(TypeError, match=r"\{name: Layout\}"):
        sv.model_map({"w": (10, 3)})
    with pytest.raises(TypeError, match="optimizer="):
        sv.model_map(torch.nn.Linear(2, 2), optimizer=object())


# ---- the widget ----------------------------------------------------------------------------------


def test_widget_state_is_small_and_repr_deterministic(tp4):
    model, opt = tp4
    w = sv.show(model, optimizer=opt)
    assert isinstance(w, ModelWidget)
    assert repr(w) == "ModelWidget('MLP', world_size=4, tensors=20, layouts=5, max_bytes_per_rank=4496)"
    state = w.get_state()
    synced = {k: state[k] for k in ("summary", "rank", "selected", "title")}
    assert len(json.dumps(synced)) < 4000
    s = state["summary"]
    assert s["rows"]["name"][:2] == ["fc1.weight", "fc1.weight.grad"]
    assert s["totals"] == [4496] * 4 and s["kinds"] == ["param", "grad", "optimizer"]
    assert 'data-shardviz-view": "model"' in state["_esm"] and "data-row" in state["_esm"]
    data, _ = w._repr_mimebundle_()
    assert data["text/plain"] == str(sv.model_map(model, optimizer=opt))
    assert "image/png" in data


def test_clicking_a_row_yields_its_layout(tp4):
    model, _ = tp4
    w = sv.show(model, grads=False)
    attach(w)
    from_frontend(w, {"method": "update", "state": {"selected": 2}})  # the view's row click
    assert w.selected == 2 and w.selected_layout == sv.layout(model.fc2.weight)
    k = w.summary["rows"]["layout"][2]
    reply, buffers = invoke(w, "layout", {"layout": k}, only=True)
    assert buffers == [] and reply["geometry"] == g.payload(sv.layout(model.fc2.weight))
    assert reply["geometry"]["shapes"] == [[16, 8]] * 4
    full = w.layout_view()
    assert full.tensor_layout == sv.layout(model.fc2.weight) and full.title == "fc2.weight (16, 32) float32"
    assert "error" in invoke(w, "layout", {"layout": 99})[0]
    by_rank, _ = invoke(w, "rank_bytes", {"rank": 3})
    assert by_rank["bytes"] == [512, 32, 512, 64] and by_rank["shapes"][1] == "(8,)"
    assert sv.show(model, grads=False, selected="fc1.bias").selected == 1


def test_export_html_is_self_contained(tp4, tmp_path):
    model, opt = tp4
    out = sv.export_html(model, tmp_path / "map.html", optimizer=opt)
    text = out.read_text(encoding="utf-8")
    assert "default-src 'none'" in text and not re.search(r"""(src|href)=["']?https?:""", text)
    m = re.search(r'<script type="application/json" id="shardviz-data">(.*?)</script>', text, re.S)
    data = json.loads(m.group(1))
    assert data["view"] == "model" and data["state"]["summary"]["totals"] == [4496] * 4
    keys = {key for key, _, _ in data["responses"]}
    for k in range(5):
        assert svhtml.request_key("layout", {"layout": k}) in keys
    assert svhtml.request_key("rank_bytes", {"rank": 3}) in keys


def test_plot_is_a_figure_with_one_bar_per_rank_and_part(tp4):
    from matplotlib.figure import Figure

    model, opt = tp4
    fig = sv.plot(model, optimizer=opt)
    assert isinstance(fig, Figure)
    bars = [p for p in fig.axes[0].patches if (p.get_gid() or "").startswith("stack-")]
    assert len(bars) == 4 * 3  # 4 ranks × (param, grad, optimizer)
    fig = sv.plot(sv.model_map(model), stack="mesh_dim")
    assert sorted({p.get_gid() for p in fig.axes[0].patches}) == [
        "stack-not sharded",
        "stack-sharded over tp",
    ]
    with pytest.raises(ValueError, match="stack="):
        sv.plot(model, stack="colour")


def test_kind_colours_never_read_as_a_rank():
    """The model map's kind colours (param, buffer, grad, optimizer), in the widget and the picture,
    keep CIE76 >= 25 from every rank's colour; buffer was rank 6's teal (13.2)."""
    import re
    from pathlib import Path

    from shardviz.views import geometry
    from shardviz.views.model_mpl import _KIND_COLORS

    js = (Path(geometry.__file__).parent / "static" / "model.js").read_text()
    widget = dict(
        re.findall(r'(\w+): "(#[0-9a-f]{6})"', js.split("const KIND_COLOR = ", 1)[1].split("}", 1)[0])
    )
    assert widget == _KIND_COLORS
    assert geometry.delta_e("#72b7b2", geometry.PALETTE[6]) < 25  # the check sees the old teal
    for kind, colour in _KIND_COLORS.items():
        for rank, own in enumerate(geometry.PALETTE):
            assert geometry.delta_e(colour, own) >= 25, (kind, rank)
