"""The LocalTensor tutorial's DTensor examples (3, 4, 6) through shardviz.

Each example's ``with LocalTensorMode(n)`` is replaced by ``sv.use("local", world_size=n)`` and
``with sv.record():``; the expected values are the tutorial's own (plain torch on the global tensor).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardviz as sv


def test_example3_distribute_and_verify():
    sv.use("local", world_size=4)
    with sv.record():
        mesh = init_device_mesh("cpu", (4,))
        tensor = torch.arange(16).reshape(4, 4).float()
        dt_sharded = distribute_tensor(tensor, mesh, [Shard(0)])
        dt_replicated = distribute_tensor(tensor, mesh, [Replicate()])
        sharded_actual = dt_sharded.full_tensor().reconcile()
        replicated_actual = dt_replicated.to_local().reconcile()
    assert torch.equal(sharded_actual, torch.arange(16).reshape(4, 4).float())
    assert torch.equal(replicated_actual, torch.arange(16).reshape(4, 4).float())
    assert [s.shape for s in sv.layout(dt_sharded).shards] == [(1, 4)] * 4


def test_example3_matmul():
    sv.use("local", world_size=4)
    torch.manual_seed(0)
    with sv.record():
        mesh = init_device_mesh("cpu", (4,))
        a = torch.randn(8, 4)
        b = torch.randn(4, 6)
        da = distribute_tensor(a, mesh, [Shard(0)])
        db = distribute_tensor(b, mesh, [Replicate()])
        dc = da @ db
        expected = a @ b
        actual = dc.full_tensor().reconcile()
    torch.testing.assert_close(actual, expected.reconcile())
    assert sv.layout(dc).placements == ("S(0)",)


def test_example3_linear_layer():
    sv.use("local", world_size=4)
    with sv.record():
        mesh = init_device_mesh("cpu", (4,))
        x = torch.randn(16, 8)
        w = torch.randn(8, 4)
        b = torch.randn(4)
        dx = distribute_tensor(x, mesh, [Shard(0)])
        dw = distribute_tensor(w, mesh, [Replicate()])
        db = distribute_tensor(b, mesh, [Replicate()])
        dy = torch.relu(dx @ dw + db)
        expected = torch.relu(x @ w + b)
        actual = dy.full_tensor().reconcile()
    torch.testing.assert_close(actual, expected.reconcile())


def test_example4_uneven_local_tensor():
    tensors = {
        0: torch.tensor([[1.0, 2.0, 3.0, 4.0]]),
        1: torch.tensor([[5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]]),
        2: torch.tensor([[13.0, 14.0, 15.0, 16.0]]),
    }
    sv.use("local", world_size=3)
    with sv.record():
        lt = sv.per_rank(lambda rank: tensors[rank])
        rows = lt.shape[0]
    assert isinstance(rows, torch.SymInt)  # the ranks disagree on it
    view = sv.show(lt)
    # Each rank's own tensor, drawn side by side along the last dim: 4 columns per rank, as many
    # rows as the longest rank's.
    assert view.shard_values is not None
    assert {r: v.tolist() for r, v in view.shard_values.items()} == {
        r: t.tolist() for r, t in tensors.items()
    }
    assert view.tensor_layout.global_shape == (2, 12)
    assert [(s.rank, s.shape, s.offset) for s in view.tensor_layout.shards] == [
        (0, (1, 4), (0, 0)),
        (1, (2, 4), (0, 4)),
        (2, (1, 4), (0, 8)),
    ]


def test_example4_local_int_node():
    # The tutorial adds and multiplies per-rank ints (LocalIntNode); in shardviz they are the sizes
    # of per-rank tensors, and a tensor sized by their sum or product has that size on each rank.
    a, b = {0: 10, 1: 20, 2: 30}, {0: 1, 1: 2, 2: 3}
    sv.use("local", world_size=3)
    with sv.record():
        ta = sv.per_rank(lambda rank: torch.zeros(a[rank]))
        tb = sv.per_rank(lambda rank: torch.zeros(b[rank]))
        total = torch.arange(ta.shape[0] + tb.shape[0])
        product = torch.arange(ta.shape[0] * tb.shape[0])
    for got, op in ((sv.show(total).shard_values, int.__add__), (sv.show(product).shard_values, int.__mul__)):
        assert got is not None
        assert {r: v.tolist() for r, v in got.items()} == {
            r: torch.arange(op(a[r], b[r])).tolist() for r in a
        }


def test_example4_dtensor_uneven_sharding():
    sv.use("local", world_size=3)
    tensor = torch.arange(10 * 4).reshape(10, 4).float()
    with sv.record():
        mesh = init_device_mesh("cpu", (3,))
        dt = distribute_tensor(tensor, mesh, [Shard(0)])
        local = dt.to_local()
        reconstructed = dt.full_tensor().reconcile()
    # torch.chunk's rule: ceil(10 / 3) = 4 rows per rank, the last rank keeps what is left.
    expected = dict(enumerate(tensor.chunk(3, dim=0)))
    local_values = sv.show(local).shard_values
    assert local_values is not None
    assert {r: v.tolist() for r, v in local_values.items()} == {r: t.tolist() for r, t in expected.items()}
    assert {s.rank: (s.shape, s.offset) for s in sv.layout(dt).shards} == {
        0: ((4, 4), (0, 0)),
        1: ((4, 4), (4, 0)),
        2: ((2, 4), (8, 0)),
    }
    view = sv.show(dt)
    assert view.shard_values is not None and view.global_values() is not None
    assert {r: v.tolist() for r, v in view.shard_values.items()} == {
        r: t.tolist() for r, t in expected.items()
    }
    assert view.global_values().tolist() == tensor.tolist()
    assert torch.equal(reconstructed, tensor)


def test_example6_2d_mesh():
    sv.use("local", world_size=8)
    with sv.record():
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        shape, names, size = mesh.shape, mesh.mesh_dim_names, mesh.size()
    assert (shape, names, size) == ((4, 2), ("dp", "tp"), 8)


def test_example6_hybrid_parallelism():
    sv.use("local", world_size=8)
    with sv.record():
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        x = torch.randn(16, 8)
        dx = distribute_tensor(x, mesh, [Shard(0), Replicate()])
        w = torch.randn(8, 12)
        dw = distribute_tensor(w, mesh, [Replicate(), Shard(1)])
        dy = dx @ dw
        expected = x @ w
        actual = dy.full_tensor().reconcile()
    torch.testing.assert_close(actual, expected.reconcile())
    assert sv.layout(dy) == sv.layout((16, 12), (4, 2), ["S(0)", "S(1)"], ("dp", "tp"))


def test_example6_3d_mesh():
    sv.use("local", world_size=24)
    with sv.record():
        mesh = init_device_mesh("cpu", (2, 3, 4), mesh_dim_names=("pp", "dp", "tp"))
        tensor = torch.randn(8, 16, 32)
        dt = distribute_tensor(tensor, mesh, [Replicate(), Shard(0), Shard(2)])
        actual = dt.full_tensor().reconcile()
    torch.testing.assert_close(actual, tensor.reconcile())
    lay = sv.layout(dt)
    assert lay.mesh_dim_names == ("pp", "dp", "tp")
    assert lay.shard(23).shape == (2, 16, 8) and lay.shard(23).offset == (6, 0, 24)
    sv.use("local", world_size=4)
