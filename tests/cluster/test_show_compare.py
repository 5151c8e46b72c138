"""``sv.show`` inside a %%spmd cell on real ranks, and the simulator compared with real ranks."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardviz as sv
from shardviz.compare import Comparison
from shardviz.errors import BackendError, PerRankValueError

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

IMPORTS = (
    "import torch\nimport torch.distributed as dist\n"
    "from torch.distributed.device_mesh import init_device_mesh\n"
    "from torch.distributed.tensor import Replicate, Shard, distribute_tensor\nimport shardviz as sv"
)
MAKE_2D = (
    "mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))\n"
    "dt = distribute_tensor(torch.arange(35.0).reshape(5, 7), mesh, [Shard(0), Shard(1)])"
)


class FakeWidget:
    """Stands in for the layout widget: keeps what show_layout was given."""

    def __init__(self, layout: Any, values: Any, **options: Any) -> None:
        self.layout, self.values, self.options = layout, values, options

    def __repr__(self) -> str:
        return f"FakeWidget({self.layout.placements})"


def test_show_gathers_every_ranks_shard(ip, gloo, monkeypatch, capsys):
    monkeypatch.setattr(sys.modules["shardviz.show"], "show_layout", FakeWidget)
    ip.run_cell(IMPORTS)
    gloo(4)
    widget = ip.run_cell_magic("spmd", "", MAKE_2D + "\nsv.show(dt, title='x')")
    assert isinstance(widget, FakeWidget) and widget.options == {"title": "x"}
    assert widget.layout == sv.layout((5, 7), (2, 2), ["S(0)", "S(1)"], ("dp", "tp"))
    x = torch.arange(35.0).reshape(5, 7).numpy()
    assert sorted(widget.values) == [0, 1, 2, 3]
    for s in widget.layout.shards:  # each rank's values are its slice of the global tensor
        rows, cols = (slice(o, o + n) for o, n in zip(s.offset, s.shape, strict=True))
        assert (widget.values[s.rank] == x[rows, cols]).all()
    # Displayed mid-cell: drawn once (not once per rank); made and dropped: not drawn.
    capsys.readouterr()
    out = ip.run_cell_magic(
        "spmd", "", "from IPython.display import display\nw = sv.show(dt)\ndisplay(sv.show(dt))\nNone"
    )
    assert out is None
    assert capsys.readouterr().out.count("FakeWidget(('S(0)', 'S(1)'))") == 1


def test_show_draws_the_same_widget_as_the_simulator(ip, gloo):
    ip.run_cell(IMPORTS)
    ip.run_line_magic("shardviz", "use local 4")
    local = ip.run_cell_magic("spmd", "", MAKE_2D + "\nsv.show(dt)")
    gloo(4)
    real = ip.run_cell_magic("spmd", "", MAKE_2D + "\nsv.show(dt)")
    widget_class = type(local).__mro__[1]  # anywidget gives each instance its own subclass
    assert widget_class.__name__ == "LayoutWidget" and isinstance(real, widget_class)
    assert repr(real) == repr(local)
    assert real.geometry == local.geometry and real.values_info == local.values_info


def spmd_fn():
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
    dt = torch.distributed.tensor.distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])
    return dt.redistribute(mesh, [Replicate()]).to_local()


def rank_dependent():
    x = torch.arange(8.0)
    t = x.chunk(2)[dist.get_rank()].clone()  # a list index by rank: the lockstep simulator refuses it
    dist.all_reduce(t)
    return t


def rank_offset():
    t = torch.arange(4.0) + 4 * dist.get_rank()  # per-rank arithmetic: each simulated rank its own
    dist.all_reduce(t)
    return t


def backend_dependent():
    # code that asks which process-group backend runs it: "fake" in the simulator, "gloo" for real
    t = torch.arange(4.0) + dist.get_rank() + (10.0 if dist.get_backend() == "gloo" else 0.0)
    dist.all_reduce(t)
    return t


from torch.distributed.tensor import Replicate, Shard  # noqa: E402  (used by spmd_fn on the ranks)


def test_compare_agrees_on_spmd_code(gloo):
    gloo(2)
    c = sv.compare(spmd_fn)
    assert isinstance(c, Comparison) and c.ok, str(c)
    assert str(c) == "simulator vs gloo, 2 ranks, 4 events: no differences (rtol=1e-05, atol=1e-06)"
    assert sv.last_trace() is c.real and c.real.backend == "gloo" and c.simulated.backend == "local"
    ops = ["scatter", "redistribute", "all_gather", "DTensor.to_local"]  # what spmd_fn does
    assert [getattr(e, "op", getattr(e, "name", e.kind)) for e in c.real.events] == ops
    for r in range(2):
        assert torch.equal(c.real.results[r], torch.arange(12.0).reshape(6, 2))


def test_compare_explains_a_list_index_by_rank(gloo):
    gloo(2)
    with pytest.raises(PerRankValueError, match="per-rank value") as info:
        sv.compare(rank_dependent)
    assert "sv.use('threads', world_size=N)" in str(info.value)


def test_compare_agrees_on_per_rank_arithmetic(gloo):
    gloo(2)
    c = sv.compare(rank_offset)
    assert c.ok, str(c)
    # by hand: rank 0 holds [0,1,2,3], rank 1 [4,5,6,7]; their sum on both
    for r in range(2):
        assert c.real.results[r].tolist() == [4.0, 6.0, 8.0, 10.0]
        assert c.simulated.results[r].tolist() == [4.0, 6.0, 8.0, 10.0]


def test_compare_reports_differences_per_rank(gloo):
    gloo(2)
    c = sv.compare(backend_dependent)
    found = {(d.rank, d.event, d.what) for d in c.differences}
    # Each real rank adds 10 to every element before the all_reduce; the simulator does not.
    assert found == {
        (0, 0, "input values"),
        (1, 0, "input values"),
        (0, 0, "output values"),
        (1, 0, "output values"),
        (0, None, "result values"),
        (1, None, "result values"),
    }
    text = str(c)
    assert "rank 1:\n  event #0 input values: 4 of 4 elements differ" in text
    # by hand: rank 0 [10,11,12,13] + rank 1 [11,12,13,14]
    assert torch.equal(c.real.results[0], torch.tensor([21.0, 23.0, 25.0, 27.0]))
    assert torch.equal(c.simulated.results[0], torch.tensor([1.0, 3.0, 5.0, 7.0]))


def test_spmd_compare_magic(ip, gloo):
    ip.run_cell(IMPORTS)
    gloo(2)
    c = ip.run_cell_magic("spmd", "--compare", "t = torch.ones(3)\ndist.all_reduce(t)\nt")
    assert isinstance(c, Comparison) and c.ok, str(c)
    assert [e.op for e in c.real.collectives()] == ["all_reduce"] == [e.op for e in c.simulated.collectives()]
    assert c.real.collectives()[0].outputs[1].values.tolist() == [2.0, 2.0, 2.0]
    assert sv.last_trace().backend == "gloo"
    out = ip.run_cell_magic("spmd", "", "t")  # the real run's names stay on the ranks
    assert out is not None


def test_compare_needs_a_real_backend():
    sv.use("local", world_size=2)
    with pytest.raises(BackendError, match="switch to one first"):
        sv.compare(spmd_fn)


def test_show_of_hand_made_chunks_on_real_ranks(ip, gloo, monkeypatch):
    """sv.show(chunk, of=global): each real rank finds its chunk's offset; the notebook places them."""
    monkeypatch.setattr(sys.modules["shardviz.show"], "show_layout", FakeWidget)
    ip.run_cell(IMPORTS)
    gloo(4)
    cell = (
        "big = torch.arange(20.0).reshape(10, 2)\n"
        "mine = big.chunk(4)[dist.get_rank()]\n"  # real ranks: get_rank() is the rank
        "sv.show(mine, of=big)"
    )
    widget = ip.run_cell_magic("spmd", "", cell)
    assert widget.layout.placements == ("S(0)",)
    assert [s.shape for s in widget.layout.shards] == [(3, 2), (3, 2), (3, 2), (1, 2)]
    big = torch.arange(20.0).reshape(10, 2)
    for r in range(4):
        assert (widget.values[r] == big.chunk(4)[r].numpy()).all()
    # The same cell in the simulator, written with sv.per_rank, gives the same layout.
    sv.use("local", world_size=4)
    with sv.record():
        local = sv.per_rank(lambda r: big.chunk(4)[r].clone())
    assert sv.show(local, of=big).layout == widget.layout  # (show_layout is the fake here too)
