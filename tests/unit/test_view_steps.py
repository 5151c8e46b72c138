"""Issue 27: the player's step data for real models, no browser.

The drawn grid (rows and columns of a buffer summarised, chunk borders kept), the timeline's fold
of operators that move no data, the filter by phase / module / mesh dim, the training step's
first collective, point-to-point steps drawn source -> destination, where a raw ``dist.*`` call
ran, and the matplotlib pictures drawn from the same data (values, arrows around buffers, shared
blocks striped diagonally, pipeline colours shared with the SVG). Expectations are written out by
hand from the code each test records.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import traitlets
from matplotlib.patches import FancyArrowPatch, Rectangle
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import shardviz as sv
from shardviz.views import grid, steps

# ---- the drawn grid -------------------------------------------------------------------------------


def test_summarize_axis_keeps_every_cut_and_elides_long_stretches():
    # short axes are drawn whole
    assert grid.summarize_axis(8, [2, 4, 6], 10) == ((0, 8),)
    assert grid.summarize_axis(0, [], 4) == ()
    # one long stretch: its first cells, a band, its last cell
    assert grid.summarize_axis(256, [], 4) == ((0, 3), (255, 256))
    assert grid.summarize_axis(32, [], 3) == ((0, 2), (31, 32))
    # four chunks of 64 columns: each keeps its first and last cell, so every border is drawn
    assert grid.summarize_axis(256, [64, 128, 192], 8) == (
        (0, 1),
        (63, 65),
        (127, 129),
        (191, 193),
        (255, 256),
    )
    # stretches short enough for their share are kept whole; cuts outside the axis are ignored
    assert grid.summarize_axis(12, [3, 6, 9, 40], 8) == ((0, 12),)
    # many chunks: more cells than asked for, never merged
    assert grid.summarize_axis(64, range(0, 64, 2), 8) == ((0, 64),)
    # hundreds of chunks (an all_to_all over 64 ranks and more): the first 16 keep their borders,
    # then one cell of the 17th, a band, and the last chunk (it drew all 64 chunks)
    assert grid.summarize_axis(128, range(0, 128, 2), 8) == ((0, 33), (125, 128))


@pytest.fixture(scope="module")
def gathered():
    """An all_gather of a (2, 4, 64) buffer per rank on 4 ranks (the Llama's sequence all-gather)."""
    sv.use("local", world_size=4)
    with sv.record() as t:
        x = sv.per_rank(lambda r: torch.arange(512.0).reshape(2, 4, 64) + 1000 * r)
        out = torch.zeros(8, 4, 64)
        dist.all_gather_into_tensor(out, x)
    return t


def test_llama_sized_buffers_are_drawn_as_a_few_readable_rows_and_columns(gathered):
    d = sv.play(gathered).detail(0)
    inp, out = d["ranks"]["0"]["in"], d["ranks"]["0"]["out"]
    # (2, 4, 64) is a grid of 2 x 256: both rows, the first 3 columns and the last one (4 ranks side
    # by side leave room for 4 columns)
    assert grid.col_cells(4) == 4
    assert inp["grid"] == [[[[0, 2]], [[0, 3], [255, 256]]]]
    # the output's 8 rows are its 4 chunks of 2 rows: all drawn, every chunk border a drawn border
    assert [p["box"] for p in out["parts"]] == [
        [0, 2, 0, 256],
        [2, 4, 0, 256],
        [4, 6, 0, 256],
        [6, 8, 0, 256],
    ]
    assert out["grid"] == [[[[0, 8]], [[0, 3], [255, 256]]]]
    # a list of four (32, 64) slots shares the row budget: 2 rows each (the first and the last)
    buf = grid.Buffer((4,), "float32", ((32, 64),) * 4, True)
    assert grid.drawn_grid(buf, 4) == [(((0, 1), (31, 32)), ((0, 3), (63, 64)))] * 4
    # small buffers send no grid at all (every element is drawn)
    small = grid.Buffer((7, 5), "float32", None, True)
    assert grid.grid_json(small, 4) is None


def test_values_reply_carries_the_exact_range_of_a_sampled_buffer():
    sv.use("local", world_size=2)
    big = np.zeros((300, 100), dtype=np.float32)
    big[151, 99] = 7.5  # an odd row and column: a strided sample leaves it out
    big[3, 1] = -2.0
    with sv.record() as t:
        dist.all_reduce(sv.per_rank(lambda r: torch.from_numpy(big) * (r + 1)))
    meta, _ = sv.play(t).values_reply(0, 0)
    first = next(m for m in meta["entries"] if m["rank"] == 1 and m["side"] == "in")
    assert any(s > 1 for s in first["step"])  # sampled
    assert (first["min"], first["max"]) == (-4.0, 15.0)  # rank 1 holds 2 x big
    out = next(m for m in meta["entries"] if m["rank"] == 0 and m["side"] == "out")
    assert (out["min"], out["max"]) == (-6.0, 22.5)  # the sum, 3 x big


# ---- the timeline: fold, filter, the training step ------------------------------------------------


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.fixture(scope="module")
def mlp():
    """Setup (parallelize_module), one forward and backward of a Colwise/Rowwise MLP on a 1-D tp mesh
    of the whole world (the input needs its gradient: fc1's backward all-reduces it), then a raw
    dist.all_reduce."""
    sv.use("local", world_size=4)
    torch.manual_seed(0)
    with sv.record() as t:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        m = parallelize_module(MLP(), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        m(torch.ones(2, 4, requires_grad=True)).sum().backward()
        dist.all_reduce(sv.per_rank(lambda r: torch.full((2,), float(r))))
    return t


def test_view_and_detach_rows_are_folded(mlp):
    w = sv.play(mlp)
    quiet = [w.timeline["ids"][i] for i in w.timeline["quiet"]]
    # every aten.detach, aten.t and aten.view (they only view a tensor); aten.addmm (#11) moves
    # data through its implicit redistribute and aten.mm / aten.sum compute: not folded
    names = {e.id: e.name for e in mlp.events if e.kind == "op"}
    assert sorted(names[i] for i in quiet) == sorted(
        n for n in names.values() if n in ("aten.detach", "aten.t", "aten.view")
    )
    assert all(names.get(i) not in ("aten.addmm", "aten.mm", "aten.sum.dim_IntList") for i in quiet)


def test_filter_by_phase_module_and_mesh_dim(mlp):
    got = [(e.kind, getattr(e, "op", None), e.module, e.phase) for e in sv.play(mlp).steps]
    assert got == [
        ("collective", "scatter", None, None),  # parallelize_module: fc1.weight S(0)
        ("collective", "scatter", None, None),  # fc1.bias S(0)
        ("collective", "scatter", None, None),  # fc2.weight S(1)
        ("collective", "broadcast", None, None),  # fc2.bias R
        ("redistribute", None, "MLP.fc2", "forward"),  # the bias to P(sum), locally
        ("redistribute", None, "MLP.fc2", "forward"),  # the row-wise output P(sum) -> R
        ("collective", "all_reduce", "MLP.fc2", "forward"),
        ("redistribute", None, "MLP.fc1", "backward"),  # the input's gradient P(sum) -> R
        ("collective", "all_reduce", "MLP.fc1", "backward"),
        ("collective", "all_reduce", None, None),  # the raw dist.all_reduce
    ]
    m = steps.Model(mlp)
    assert m.steps_matching({}) == list(range(10))
    assert m.steps_matching({"phase": "forward"}) == [4, 5, 6]
    assert m.steps_matching({"phase": "backward"}) == [7, 8]
    assert m.steps_matching({"phase": "none"}) == [0, 1, 2, 3, 9]
    assert m.steps_matching({"module": "fc2"}) == [4, 5, 6]
    assert m.steps_matching({"module": "MLP.fc1"}) == [7, 8]
    assert m.steps_matching({"module": "fc3"}) == []
    # a redistribute goes with the mesh dims of its collectives (the local one has none)
    assert m.steps_matching({"mesh_dim": "tp"}) == [0, 1, 2, 3, 5, 6, 7, 8]
    assert m.steps_matching({"mesh_dim": "-"}) == [9]
    assert m.steps_matching({"phase": "forward", "mesh_dim": "tp"}) == [5, 6]


def test_the_player_opens_on_the_training_steps_first_collective(mlp):
    w = sv.play(mlp)
    assert w.step_start == 6 and w.step == 6 and w.info["step_start"] == 6
    assert sv.play(mlp, step=0).step == 0  # an explicit start wins
    # a trace with no nn.Module has no training step: it opens on its first step
    sv.use("local", world_size=4)
    with sv.record() as t:
        dist.all_reduce(sv.per_rank(lambda r: torch.ones(2) * r))
        dist.broadcast(sv.per_rank(lambda r: torch.ones(2) * r), src=1)
    assert sv.play(t).step == 0 and sv.play(t).step_start is None


def test_the_filter_trait_is_validated_and_synced(mlp):
    w = sv.play(mlp, filter={"phase": "forward"})
    assert w.steps_shown == [4, 5, 6]
    w.filter = {"mesh_dim": "-", "all_ops": True}
    assert w.steps_shown == [9]
    with pytest.raises(traitlets.TraitError, match="unknown filter key 'stage'"):
        w.filter = {"stage": "forward"}
    with pytest.raises(traitlets.TraitError, match="use one of"):
        w.filter = {"phase": "fwd"}
    with pytest.raises(traitlets.TraitError, match="all_ops must be True or False"):
        w.filter = {"all_ops": "yes"}
    assert "filter" in w.state_for_export()


# ---- where a collective ran, and what each step says ----------------------------------------------


def test_raw_calls_run_on_the_default_group_not_on_a_mesh_dim(mlp):
    m = steps.Model(mlp)
    raw = mlp.events[-1]
    # a 1-D mesh of the whole world reuses the default group, but this call came from user code
    assert raw.mesh_dim is None and raw.mesh_dim_name is None
    assert m.detail(9)["where"] == "default process group (all 4 ranks)"
    assert m.detail(6)["where"] == "mesh tp" and m.detail(0)["where"] == "mesh tp"


def test_a_barrier_says_nothing_moves_and_raw_calls_without_a_mesh_are_not_unmatched():
    sv.use("local", world_size=4)
    with sv.record() as t:
        dist.all_reduce(sv.per_rank(lambda r: torch.ones(2) * r))
        dist.barrier()
    m = steps.Model(t)
    d = m.detail(1)
    assert d["where"] == "default process group (all 4 ranks)"
    assert not any("value policy" in n for n in d["notes"]), d["notes"]
    assert d["check"]["note"] == "nothing to check: a barrier moves no data"
    with sv.record(values="none") as bare:
        dist.all_reduce(sv.per_rank(lambda r: torch.ones(2) * r))
    bd = steps.Model(bare).detail(0)
    assert "values not kept for this step (value policy): shapes and bytes only" in bd["notes"]
    assert bd["check"]["note"] == "not checked: values not kept (value policy)"


def ring(rank: int) -> torch.Tensor:
    x, y = torch.full((2,), float(rank)), torch.zeros(2)
    if rank % 2 == 0:
        dist.send(x, (rank + 1) % 4)
        dist.recv(y, (rank - 1) % 4)
    else:
        dist.recv(y, (rank - 1) % 4)
        dist.send(x, (rank + 1) % 4)
    return y


def test_send_and_recv_are_drawn_from_source_to_destination():
    sv.use("local", world_size=4)
    t = sv.run(ring, threads=4)
    w = sv.play(t)
    send = w.detail(0)  # rank 0 sends first (even ranks send, odd ones receive first)
    assert send["op"] == "send" and send["pairs"] == [[0, 1]]
    assert send["where"] == "point-to-point, 1 pair"
    assert send["transfers"] == [[0, 1, None, None, False]]
    # the arrow has both ends: the source's buffer, and at the destination what is on its way
    assert send["ranks"]["0"]["in"]["shape"] == [2] and send["ranks"]["0"]["out"] is None
    assert send["ranks"]["1"]["in"] is None
    assert send["ranks"]["1"]["out"]["role"] == "pending" and send["ranks"]["1"]["out"]["origin"] == 0
    recv_step = next(k for k, e in enumerate(w.steps) if e.op == "recv" and e.groups == ((0, 1),))
    assert send["notes"] == [
        f"point-to-point send: rank 0 sends its whole buffer to rank 1; it lands in rank 1's "
        f"matching recv (step {recv_step + 1})"
    ]
    recv = w.detail(recv_step)
    assert recv["pairs"] == [[0, 1]] and recv["transfers"] == [[0, 1, None, None, False]]
    assert recv["ranks"]["1"]["out"]["origin"] == 0 and "role" not in recv["ranks"]["1"]["out"]
    assert recv["notes"][0] == "point-to-point recv: rank 1 receives the whole buffer rank 0 sent (step 1)"
    assert recv["check"]["ok"] and recv["check"]["checked"]
    assert send["check"]["note"] == "checked at the matching recv, where the data arrives"
    # the text names source and destination too (the recorded root is the peer's index)
    assert send["label"].startswith("send 0->1 ") and recv["label"].startswith("recv 0->1 ")
    assert str(t).split("\n")[1].startswith("#0 send 0->1 groups [0,1]")


# ---- the matplotlib pictures ----------------------------------------------------------------------


def _points(path, step: float = 1.0) -> np.ndarray:
    """Points every ``step`` along a path (curves flattened)."""
    out = []
    for poly in path.to_polygons(closed_only=False):
        for a, b in itertools.pairwise(poly):
            n = max(int(np.hypot(*(b - a)) / step), 1)
            out += [a + (b - a) * i / n for i in range(n + 1)]
    return np.array(out)


def test_plot_event_prints_values_and_routes_arrows_around_buffers():
    sv.use("local", world_size=4)
    with sv.record() as t:
        swapped = torch.zeros(8)
        dist.all_to_all_single(swapped, sv.per_rank(lambda r: torch.arange(8.0) + 10 * r))
    fig = sv.plot(t.events[0])
    ax = fig.axes[0]
    values = [x.get_text() for x in ax.texts if x.get_gid() == "value"]
    # before: rank r holds 10r .. 10r+7; after: rank j holds chunk j (2 values) of every rank
    before = [str(10 * r + i) for r in range(4) for i in range(8)]
    after = [str(10 * r + 2 * j + i) for j in range(4) for r in range(4) for i in range(2)]
    assert sorted(values) == sorted(before + after) and len(values) == 64
    buffers = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_gid() == "buffer"]
    assert len(buffers) == 8
    arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    assert len(arrows) == 16  # 12 transfers and 4 kept chunks
    for arrow in arrows:
        pts = _points(arrow.get_path())
        for b in buffers:
            x, y = b.get_xy()
            inside = (
                (pts[:, 0] > x + 1.5)
                & (pts[:, 0] < x + b.get_width() - 1.5)
                & (pts[:, 1] > y + 1.5)
                & (pts[:, 1] < y + b.get_height() - 1.5)
            )
            assert not inside.any(), f"an arrow ({arrow.get_gid()}) crosses a buffer"
    # the text is the player's size: 9 px and more at 100 dpi
    assert fig.dpi == 100 and min(x.get_fontsize() for x in ax.texts) * 100 / 72 >= 8.9


def test_replicated_blocks_are_striped_diagonally():
    from shardviz.views.mpl import _stripes

    bands = _stripes(6.0, 4.0, 3)
    assert [i for i, _ in bands] == [k % 3 for k in range(len(bands))]  # owners in turn
    area = 0.0
    for _, pts in bands:
        xs, ys = np.array(pts).T
        area += 0.5 * abs(np.dot(xs, np.roll(ys, 1)) - np.dot(ys, np.roll(xs, 1)))
        s = xs + ys  # every stripe lies between two lines u + v = const: not a column
        assert s.max() - s.min() <= (6 + 4) / 9 + 1e-9
    assert area == pytest.approx(24.0)
    fig = sv.plot(sv.layout((4, 6), (2,), ["R"]))
    polys = [p for p in fig.axes[0].patches if (p.get_gid() or "").startswith("shard-r")]
    assert len(polys) > 2 and all(len(p.get_xy()) >= 4 for p in polys)
    # no stripe is an axis-aligned rectangle
    for p in polys:
        xy = p.get_xy()[:-1]
        edges = np.diff(np.vstack([xy, xy[:1]]), axis=0)
        assert any(abs(dx) > 1e-9 and abs(dy) > 1e-9 for dx, dy in edges)


def test_pipeline_pictures_share_one_palette():
    from shardviz.data.pipeline import Interval, Timeline
    from shardviz.views.pipeline_svg import COLOURS, LEGEND, timeline_svg

    tl = Timeline(
        (0, 1),
        tuple(
            Interval(r, float(r + k), float(r + k + 1), "forward", r, k, 10 * r + k, f"F{k}")
            for r in range(2)
            for k in range(3)
        ),
        (),
        4.0,
    )
    fig = sv.plot(tl)
    faces = [p.get_facecolor() for p in fig.axes[0].patches if (p.get_gid() or "").startswith("interval-")]
    from matplotlib.colors import to_rgba

    assert faces == [to_rgba(COLOURS[k]) for _ in range(2) for k in range(3)]
    svg = str(timeline_svg(tl))
    for k in range(3):
        assert f'fill="{COLOURS[k]}"' in svg
    assert all(line in svg for line in LEGEND)
    assert "\n".join(LEGEND) in [x.get_text() for x in fig.texts]


def test_a_layout_picture_prints_the_values_where_they_fit():
    sv.use("local", world_size=4)
    with sv.record():
        mesh = init_device_mesh("cpu", (2, 2))
        dt = distribute_tensor(torch.arange(35.0).reshape(5, 7), mesh, [Shard(0), Replicate()])
    fig = sv.plot(dt)
    texts = [(t.get_position(), t.get_text()) for t in fig.axes[0].texts if t.get_gid() == "value"]
    # element (i, j) of the global tensor, 7 i + j, in the middle of its cell
    assert sorted(texts) == sorted(((j + 0.5, i + 0.5), str(7 * i + j)) for i in range(5) for j in range(7))
    big = sv.plot(sv.layout((64, 64), (4,), ["S(0)"]), values={r: np.ones((16, 64)) for r in range(4)})
    assert not [t for t in big.axes[0].texts if t.get_gid() == "value"]  # too small to print into


def test_merged_ranks_keep_a_raw_call_off_the_worlds_mesh_dim():
    """On real ranks each rank records its own event and the merge finds the mesh dim from the
    merged groups: a raw call on the default group must not gain the world mesh's dim there."""
    from shardviz.data.events import CollectiveEvent, TensorSnapshot
    from shardviz.data.merge import merge
    from shardviz.data.trace import Trace

    world = {"mesh_shape": [4], "mesh_dim_names": ["tp"], "ranks": [0, 1, 2, 3]}

    def ranks(params):
        out = {}
        for r in range(4):
            t = Trace(4, "rank", "all")
            one = TensorSnapshot((1,), "float32", np.array([float(r)], dtype=np.float32))
            t.events = [
                CollectiveEvent(
                    id=0,
                    op="all_reduce",
                    impl="c10d.allreduce_",
                    reduce_op="sum",
                    groups=((0, 1, 2, 3),),
                    inputs={r: one},
                    outputs={r: one},
                    nbytes={r: 4},
                    params=dict(params),
                )
            ]
            t.meshes = [world]
            out[r] = t
        return out

    raw = merge(ranks({"default_group": True}), "gloo").events[0]
    assert (raw.mesh_dim, raw.mesh_dim_name) == (None, None)
    on_mesh = merge(ranks({}), "gloo").events[0]  # DTensor's own call on the same group
    assert (on_mesh.mesh_dim, on_mesh.mesh_dim_name) == (0, "tp")
