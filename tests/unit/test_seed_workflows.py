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
from shardviz.capture import torch as _torch
from shardviz.errors import PerRankValueError


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


def test_get_rank_is_each_ranks_own_number_on_every_torch(mesh4):
    # torch 2.13 answers 0 on every simulated rank, 2.14 on a per-rank value: the simulation gives
    # user code the per-rank value on both, with no warning, and torch's own calls are unchanged.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with sv.record():
            scaled = torch.ones(2) * dist.get_rank()
            distribute_tensor(torch.arange(4.0), mesh4, [Shard(0)])
    assert {r: t.tolist() for r, t in scaled._local_tensors.items()} == {r: [r, r] for r in range(4)}
    # Outside the simulation dist.get_rank() is the fake process group's own again: a plain 0.
    assert type(dist.get_rank()) is int and dist.get_rank() == 0


def test_group_ranks_are_per_rank_and_offset_a_plain_tensor_per_rank():
    # torchtitan's vocab-parallel embedding: offset = dist.get_rank(tp_group) * chunk, applied to
    # token ids made outside the simulation (one plain tensor for every rank).
    sv.use("local", world_size=8)
    tokens = torch.arange(16)
    with sv.record():
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
        ranks = (dist.get_rank(tp), dist.get_rank(dp), tp.rank(), dp.rank())
        offset = dist.get_rank(tp) * 4
        local = tokens - offset
        mask = (tokens >= offset) & (tokens < offset + 4)
    assert [_torch.per_rank_ints(v) for v in ranks] == [
        [0, 1, 2, 3, 0, 1, 2, 3],
        [0, 0, 0, 0, 1, 1, 1, 1],
        [0, 1, 2, 3, 0, 1, 2, 3],
        [0, 0, 0, 0, 1, 1, 1, 1],
    ]
    for r in range(8):
        assert torch.equal(local._local_tensors[r], tokens - 4 * (r % 4))
        assert mask._local_tensors[r].nonzero().flatten().tolist() == list(
            range(4 * (r % 4), 4 * (r % 4) + 4)
        )
    # An in-place write of a per-rank value into a plain tensor cannot be per rank: refused.
    with pytest.raises(PerRankValueError, match=r"in place with a per-rank value"), sv.record():
        tokens.sub_(dist.get_rank(mesh.get_group("tp")))
    assert torch.equal(tokens, torch.arange(16))


def test_a_branch_the_ranks_disagree_on_raises(mesh4):
    # `if dist.get_rank() == 0:` would take one branch for every rank: an explained error instead.
    with pytest.raises(PerRankValueError, match=r"ranks disagree: \{0: True, 1: False"), sv.record():
        if dist.get_rank() == 0:
            pass
    with pytest.raises(PerRankValueError, match=r"sv\.use\('gloo'"), sv.record():
        min(3, dist.get_rank() + 1)  # 1, 2, 3, 3: min compares 3 < rank + 1, which ranks disagree on
    # Comparisons every rank agrees on still answer.
    with sv.record():
        assert dist.get_rank() < 4 and dist.get_rank() != 7


def test_python_use_of_the_simulated_rank_is_explained(mesh4):
    # A per-rank value where Python needs one int: a PerRankValueError naming the way out.
    x = torch.arange(8.0)
    with pytest.raises(PerRankValueError, match=r"sv\.per_rank\(lambda rank"), sv.record():
        x.chunk(4)[dist.get_rank()]


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


# --- sv.show(chunk, of=global): hand-made partitions drawn like DTensors -------------------------


def expected_rows(n, world):
    """Row ranges of torch.chunk(n rows, world), written out: ceil(n / world) rows each."""
    size = -(-n // world)
    return [(min(i * size, n), min((i + 1) * size, n)) for i in range(world)]


@pytest.mark.parametrize("rows", [8, 10, 5])
def test_row_wise_chunks_are_placed_and_uneven_last_chunk_visible(mesh4, rows):
    big = torch.arange(rows * 3.0).reshape(rows, 3)
    with sv.record():
        mine = sv.per_rank(lambda r: big.chunk(4)[r].clone() if r < len(big.chunk(4)) else big[:0].clone())
    w = sv.show(mine, of=big)
    lay = w.tensor_layout
    assert lay.placements == ("S(0)",) and lay.global_shape == (rows, 3)
    for r, (a, b) in enumerate(expected_rows(rows, 4)):
        s = lay.shard(r)
        assert s.shape == (b - a, 3)
        assert s.indices[0] == ((range(a, b),) if b > a else ())
        np.testing.assert_array_equal(w.shard_values[r], big[a:b].numpy())
    np.testing.assert_array_equal(w.global_values(), big.numpy())


def test_column_and_block_wise_chunks():
    sv.use("local", world_size=4)
    g = torch.arange(32.0).reshape(4, 8)
    with sv.record():
        cols = sv.per_rank(lambda r: g.chunk(4, dim=1)[r].clone())
        blocks = sv.per_rank(
            lambda r: g[(r // 2) * 2 : (r // 2) * 2 + 2, (r % 2) * 4 : (r % 2) * 4 + 4].clone()
        )
    lay = sv.show(cols, of=g).tensor_layout
    assert lay.placements == ("S(1)",) and [s.offset for s in lay.shards] == [(0, 0), (0, 2), (0, 4), (0, 6)]
    lay = sv.show(blocks, of=g).tensor_layout
    assert lay.placements == ("S(0)", "S(1)") and lay.mesh_shape == (2, 2)
    assert [(s.rank, s.coord, s.offset) for s in lay.shards] == [
        (0, (0, 0), (0, 0)),
        (1, (0, 1), (0, 4)),
        (2, (1, 0), (2, 0)),
        (3, (1, 1), (2, 4)),
    ]


def test_ambiguous_chunks_ask_for_offsets(mesh4):
    with sv.record():
        zeros = sv.per_rank(lambda r: torch.zeros(2))
    with pytest.raises(ValueError, match=r"matches the global tensor at 7 places.*pass offsets="):
        sv.show(zeros, of=torch.zeros(8))
    lay = sv.show(zeros, of=torch.zeros(8), offsets=lambda r: (2 * r,)).tensor_layout
    assert [s.offset for s in lay.shards] == [(0,), (2,), (4,), (6,)]
    lay = sv.show(zeros, of=torch.zeros(8), offsets={0: (6,), 1: (4,), 2: (2,), 3: (0,)}).tensor_layout
    assert lay.shard(0).offset == (6,) and lay.shard(0).coord == (3,)
    with pytest.raises(ValueError, match="nowhere"):
        sv.show(sv.per_rank(lambda r: torch.full((2,), 9.0)), of=torch.zeros(8))
    with pytest.raises(TypeError, match="per-rank tensor"):
        sv.show(torch.zeros(2), of=torch.zeros(8))
    with pytest.raises(TypeError, match="goes with of="):
        sv.show(zeros, offsets=[(0,)] * 4)
