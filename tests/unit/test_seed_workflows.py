"""The seed documents' workflows in the recorder: custom sharded operators, rank-dependent code,
and sharding errors explained (issue 9)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import shardviz as sv
from shardviz import _torch
from shardviz.errors import SimulationWarning


@pytest.fixture
def mesh4():
    sv.use("local", world_size=4)
    with sv.record():
        return init_device_mesh("cpu", (4,))


def test_custom_sharded_dot_product_is_traced_end_to_end(mesh4):
    a0, b0 = torch.arange(10.0), torch.arange(10.0) * 2
    with sv.record() as trace:
        a = distribute_tensor(a0, mesh4, [Shard(0)])
        b = distribute_tensor(b0, mesh4, [Shard(0)])
        local = torch.dot(a.to_local(), b.to_local())
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=mesh4.get_group())
        out = DTensor.from_local(local, mesh4, [Replicate()])
    assert out.to_local().reconcile().item() == torch.dot(a0, b0).item()
    kinds = [(e.kind, getattr(e, "name", getattr(e, "op", ""))) for e in trace.events]
    assert kinds == [
        ("collective", "scatter"),
        ("collective", "scatter"),
        ("op", "DTensor.to_local"),
        ("op", "DTensor.to_local"),
        ("local", "aten.dot"),
        ("collective", "all_reduce"),
        ("op", "DTensor.from_local"),
    ]
    to_local, dot, red, from_local = trace.events[2], trace.events[4], trace.events[5], trace.events[6]
    assert to_local.input_placements == (("S(0)",),) and from_local.output_placements == (("R",),)
    # The local compute's per-rank values: each rank's partial dot product, computed independently.
    chunks_a, chunks_b = a0.chunk(4), b0.chunk(4)
    for r in range(4):
        expected = torch.dot(chunks_a[r], chunks_b[r]).item()
        assert dot.outputs[r].values.item() == expected
        assert red.inputs[r].values.item() == expected
        np.testing.assert_array_equal(dot.inputs[r][0].values, chunks_a[r].numpy())
    assert red.outputs[0].values.item() == torch.dot(a0, b0).item()


def test_get_rank_in_the_simulation_warns_once_and_points_to_per_rank(mesh4):
    from shardviz import recorder

    recorder._warned_get_rank = False
    with pytest.warns(SimulationWarning, match=r"sv\.per_rank"), sv.record():
        assert dist.get_rank() == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with sv.record():
            dist.get_rank()  # once is enough
    # torch's own get_rank calls do not warn.
    recorder._warned_get_rank = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with sv.record():
            distribute_tensor(torch.arange(4.0), mesh4, [Shard(0)])


def test_rank_dependent_chunks_with_per_rank(mesh4):
    # The seed's x.chunk(world)[rank], written with sv.per_rank, then gathered back.
    x = torch.arange(16.0).reshape(8, 2)
    with sv.record() as trace:
        mine = sv.per_rank(lambda r: x.chunk(4, dim=0)[r].clone())
        out = [torch.zeros(2, 2) for _ in range(4)]
        dist.all_gather(out, mine)
        gathered = torch.cat(out)
    assert torch.equal(gathered.reconcile(), x)
    (c,) = trace.collectives()
    for r in range(4):
        assert c.inputs[r].values.tolist() == x[2 * r : 2 * r + 2].tolist()


def test_sharding_propagation_failure_is_explained(mesh4):
    with sv.record():
        dt = distribute_tensor(torch.tensor([3.0, 1, 2, 3, 1, 5, 5, 0]), mesh4, [Shard(0)])
    with pytest.raises(RuntimeError) as e, sv.record():
        torch.unique(dt)
    msg = str(e.value)
    assert "Sharding propagation failed for aten._unique2.default" in msg  # torch's own words kept
    assert "the output shape of aten._unique2 depends on the values" in msg
    assert "input 0: Layout (8,) float32 on mesh (4,) placements [S(0)]" in msg
    assert "   3  (3,)   (6,)    (2,)   [6:8]" in msg  # the input drawn as text
    assert "x.redistribute(mesh, [Replicate()])" in msg and "DTensor.from_local" in msg
    assert "register_sharding" in msg and "notebooks/07_custom_operators.ipynb" in msg
    assert _torch.dispatch_mode_stack() == []
    # The first way out works.
    with sv.record():
        u = torch.unique(dt.redistribute(mesh4, [Replicate()]).to_local())
    assert u.reconcile().tolist() == [0.0, 1.0, 2.0, 3.0, 5.0]


def test_a_shape_mistake_is_not_called_a_sharding_limitation(mesh4):
    with sv.record():
        w = distribute_tensor(torch.ones(3, 8), mesh4, [Shard(0)])
    with pytest.raises(RuntimeError) as e, sv.record():
        torch.mm(w, w)
    msg = str(e.value)
    assert "aten.mm rejected these inputs before any sharding was decided" in msg
    assert "must have same reduction dim" in msg and "Ways out" not in msg
    assert isinstance(e.value.__cause__, RuntimeError)  # torch's own cause is kept


def test_missing_strategy_is_explained(mesh4):
    with sv.record():
        dt = distribute_tensor(torch.arange(8.0), mesh4, [Shard(0)])
    with pytest.raises(NotImplementedError) as e, sv.record():
        torch.searchsorted(dt, dt)
    msg = str(e.value)
    assert "aten.searchsorted.Tensor has no sharding strategy in DTensor" in msg
    assert msg.count("placements [S(0)]") == 2  # both inputs drawn


def test_scatter_from_a_list_of_plain_tensors(mesh4):
    # The seed's block-wise recipe: rank 0 scatters blocks it built from a plain global tensor.
    big = torch.arange(24.0).reshape(12, 2)
    blocks = list(big.chunk(4))
    with sv.record() as trace:
        recv = torch.zeros(3, 2)
        dist.scatter(recv, blocks, src=0)
        back = [torch.zeros(3, 2) for _ in range(4)]
        dist.gather(recv * 10, back, dst=0)
    for r in range(4):
        assert torch.equal(recv._local_tensors[r], blocks[r])
        assert torch.equal(back[r]._local_tensors[0], blocks[r] * 10)  # the root received them all
    scatter, gather = trace.collectives()
    assert scatter.inputs[2][1].values.tolist() == blocks[1].tolist()  # every rank lists the blocks
    assert [gather.outputs[0][i].values.tolist() for i in range(4)] == [(b * 10).tolist() for b in blocks]
