"""The same %%spmd cells under the simulator and under gloo give the same trace.

Expectations are computed independently: shard shapes with ``torch.chunk`` on the global tensor,
values by slicing it, reductions by hand. The two traces are then compared event by event, exactly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import shardviz as sv
from shardviz.backends.cluster import PerRank
from shardviz.capture import torch as _torch
from shardviz.data.events import CollectiveEvent

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

IMPORTS = """\
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
import shardviz as sv
"""

CELL_1D = """\
mesh = init_device_mesh("cpu", ({n},))
x = torch.arange(30.0).reshape(10, 3)
dt = distribute_tensor(x, mesh, [Shard(0)])
full = dt.redistribute(mesh, [Replicate()])
t = sv.per_rank(lambda r: torch.full((2,), float(r + 1)))
dist.all_reduce(t)
t
"""

CELL_2D = """\
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
x = torch.arange(35.0).reshape(5, 7)
dt = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
r = dt.redistribute(mesh, [Replicate(), Shard(0)])
r.to_local()
"""


def normalized(trace: sv.Trace) -> list[sv.Event]:
    """Events without what legitimately differs between two runs of one cell: the cell's file name
    (each run compiles it anew) and the list a scatter ignores on non-root ranks (the simulator runs
    every rank as if it were the root, a real non-root rank passes no list)."""
    out = []
    for e in trace.events:
        src = dataclasses.replace(e.source, file="") if e.source else None
        e = dataclasses.replace(e, source=src)
        if isinstance(e, CollectiveEvent) and e.op == "scatter":
            roots = set(e.roots())
            e = dataclasses.replace(
                e,
                inputs={r: v for r, v in e.inputs.items() if r in roots},
                nbytes={r: b for r, b in e.nbytes.items() if r in roots},
            )
        out.append(e)
    return out


def run_both(ip, gloo, n: int, cell: str):
    ip.run_cell(IMPORTS)
    ip.run_line_magic("shardviz", f"use local {n}")
    local_value = ip.run_cell_magic("spmd", "", cell)
    local = sv.last_trace()
    gloo(n)
    real_value = ip.run_cell_magic("spmd", "", cell)
    real = sv.last_trace()
    assert real is not local
    return (local, local_value), (real, real_value)


@pytest.mark.parametrize("n", [2, 4])
def test_1d_cell_same_trace(ip, gloo, n):
    (local, lv), (real, rv) = run_both(ip, gloo, n, CELL_1D.format(n=n))
    x = torch.arange(30.0).reshape(10, 3)
    chunks = x.chunk(n)
    for trace in (local, real):
        cols = trace.collectives()
        assert [c.op for c in cols] == ["scatter", "all_gather", "all_reduce"]
        assert all(c.groups == (tuple(range(n)),) for c in cols)
        # the raw dist.all_reduce ran on the default group, not on the mesh's dim (which reuses it)
        assert [c.mesh_dim for c in cols] == [0, 0, None]
        scatter, _, reduce = cols
        for r in range(n):
            assert scatter.outputs[r].shape[0] == chunks[0].shape[0]  # padded to the largest chunk
            mine = chunks[r] if r < len(chunks) else x[:0]
            assert torch.equal(torch.from_numpy(scatter.outputs[r].values[: mine.shape[0]]), mine)
            assert reduce.outputs[r].values.tolist() == [n * (n + 1) / 2] * 2
            assert reduce.inputs[r].values.tolist() == [r + 1.0] * 2
    assert real.backend == "gloo" and local.backend == "local"
    assert normalized(real) == normalized(local)
    # The cell's value looks as in the simulator: a LocalTensor, one tensor per rank.
    total = torch.full((2,), n * (n + 1) / 2)
    for value in (lv, rv):
        per_rank = _torch.local_tensors(value)
        assert sorted(per_rank) == list(range(n)) and all(torch.equal(v, total) for v in per_rank.values())


def test_2d_mesh_redistribute_same_trace(ip, gloo):
    (local, lv), (real, rv) = run_both(ip, gloo, 4, CELL_2D)
    x = torch.arange(35.0).reshape(5, 7)
    for trace in (local, real):
        cols = trace.collectives()
        assert [c.op for c in cols] == ["scatter", "scatter", "all_gather", "all_gather"]
        tp, dp = ((0, 1), (2, 3)), ((0, 2), (1, 3))
        assert [c.groups for c in cols] == [dp, tp, tp, dp]
        assert [c.mesh_dim_name for c in cols] == ["dp", "tp", "tp", "dp"]
        (redist,) = trace.redistributes()
        assert (redist.src, redist.dst) == (("S(0)", "S(1)"), ("R", "S(0)"))
        assert redist.after == sv.layout((5, 7), (2, 2), ["R", "S(0)"], ("dp", "tp"))
    assert normalized(real) == normalized(local)
    # [R, S(0)] on a (dp, tp) mesh: rank (i, j) holds row chunk j of x, whatever i is.
    expected = {r: x.chunk(2, dim=0)[r % 2] for r in range(4)}
    for value in (lv, rv):
        per_rank = _torch.local_tensors(value)
        assert sorted(per_rank) == [0, 1, 2, 3]
        assert all(torch.equal(per_rank[r], expected[r]) for r in range(4))


def test_names_persist_on_the_ranks_between_cells(ip, gloo):
    ip.run_cell(IMPORTS)
    gloo(2)
    ip.run_cell_magic("spmd", "", "value = torch.tensor([dist.get_rank() * 10.0])")
    out = ip.run_cell_magic("spmd", "", "value + 1")
    assert {r: v.tolist() for r, v in _torch.local_tensors(out).items()} == {0: [1.0], 1: [11.0]}
    ranks = ip.run_cell_magic("spmd", "", "dist.get_rank(), 'same'")
    assert isinstance(ranks, PerRank) and ranks == {0: (0, "same"), 1: (1, "same")}
    assert "value" not in ip.user_ns  # the names live on the ranks, not in the notebook
    assert sv.device_type() == "cpu"
