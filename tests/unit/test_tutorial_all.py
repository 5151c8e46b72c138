"""Every example of the LocalTensor tutorial through shardviz, with its trace checked.

The tutorial's ``with LocalTensorMode(n)`` becomes ``sv.use("local", world_size=n)`` plus
``with sv.record() as trace``; the expected values are the tutorial's own (plain torch).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensor, local_tensor_mode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardviz as sv


def values(snapshots, rank):
    s = snapshots[rank]
    return [x.values for x in s] if isinstance(s, list) else s.values


# --- example 1: basic LocalTensor ----------------------------------------------------------


def test_example1_create_and_arithmetic():
    r0, r1 = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[5.0, 6.0], [7.0, 8.0]])
    lt = LocalTensor({0: r0, 1: r1})
    assert lt.shape == torch.Size([2, 2]) and lt._ranks == frozenset({0, 1})
    sv.use("local", world_size=2)
    with sv.record() as trace:
        doubled, added = lt * 2, lt + 10
    assert torch.equal(doubled._local_tensors[1], r1 * 2) and torch.equal(added._local_tensors[0], r0 + 10)
    assert trace.events == []  # no communication, no DTensor


def test_example1_reconcile_and_mode():
    v = torch.tensor([1.0, 2.0, 3.0])
    assert torch.equal(LocalTensor({0: v.clone(), 1: v.clone(), 2: v.clone()}).reconcile(), v)
    sv.use("local", world_size=4)
    with sv.record():
        x = torch.ones(2, 3)
        assert isinstance(x, LocalTensor) and len(x._ranks) == 4


# --- example 2: collectives ------------------------------------------------------------------

TENSORS = {
    0: torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
    1: torch.tensor([[5.0, 6.0], [7.0, 8.0]]),
    2: torch.tensor([[9.0, 10.0], [11.0, 12.0]]),
}


def test_example2_all_reduce_sum():
    sv.use("local", world_size=3)
    with sv.record() as trace:
        lt = LocalTensor({k: v.clone() for k, v in TENSORS.items()})
        dist.all_reduce(lt, op=dist.ReduceOp.SUM)
        result = lt.reconcile()
    expected = sum(TENSORS.values())
    assert torch.equal(result, expected)
    (ev,) = trace.collectives()
    assert (ev.op, ev.impl, ev.reduce_op, ev.groups) == ("all_reduce", "c10d.allreduce_", "sum", ((0, 1, 2),))
    # In-place op: inputs are captured before it ran.
    for r in range(3):
        np.testing.assert_array_equal(values(ev.inputs, r), TENSORS[r].numpy())
        np.testing.assert_array_equal(values(ev.outputs, r), expected.numpy())
    assert ev.nbytes == {0: 16, 1: 16, 2: 16}
    assert ev.source.text == "dist.all_reduce(lt, op=dist.ReduceOp.SUM)"
    assert ev.source.file == __file__


def test_example2_broadcast():
    tensors = {
        0: torch.tensor([10.0, 20.0, 30.0]),
        1: torch.tensor([40.0, 50.0, 60.0]),
        2: torch.tensor([70.0, 80.0, 90.0]),
    }
    sv.use("local", world_size=3)
    with sv.record() as trace:
        lt = LocalTensor({k: v.clone() for k, v in tensors.items()})
        dist.broadcast(lt, src=0)
        result = lt.reconcile()
    assert torch.equal(result, tensors[0])
    (ev,) = trace.collectives()
    assert (ev.op, ev.root, ev.roots()) == ("broadcast", 0, [0])
    np.testing.assert_array_equal(values(ev.inputs, 2), tensors[2].numpy())
    np.testing.assert_array_equal(values(ev.outputs, 2), tensors[0].numpy())


def test_example2_all_gather_list():
    tensors = {0: torch.tensor([[1.0, 2.0]]), 1: torch.tensor([[3.0, 4.0]]), 2: torch.tensor([[5.0, 6.0]])}
    sv.use("local", world_size=3)
    with sv.record() as trace:
        lt = LocalTensor(tensors)
        output_list = [torch.zeros_like(lt) for _ in range(3)]
        dist.all_gather(output_list, lt)
        results = [out.reconcile() for out in output_list]
    for i in range(3):
        assert torch.equal(results[i], tensors[i])
    (ev,) = trace.collectives()
    assert ev.op == "all_gather" and ev.impl == "c10d.allgather_"
    outs = values(ev.outputs, 1)  # list-valued: one snapshot per slot
    assert len(outs) == 3 and all(np.array_equal(outs[i], tensors[i].numpy()) for i in range(3))
    assert ev.outputs[1][0].shape == (1, 2)


# --- example 3 and 4 (DTensor) with their traces ----------------------------------------------


def test_example3_trace_of_distribute_and_full_tensor():
    sv.use("local", world_size=4)
    with sv.record() as trace:
        mesh = init_device_mesh("cpu", (4,))
        tensor = torch.arange(16).reshape(4, 4).float()
        dt_sharded = distribute_tensor(tensor, mesh, [Shard(0)])
        full = dt_sharded.full_tensor().reconcile()
    assert torch.equal(full, torch.arange(16).reshape(4, 4).float())
    scatter, redist, gather = trace.events
    assert scatter.op == "scatter" and scatter.groups == ((0, 1, 2, 3),) and scatter.mesh_dim == 0
    for r in range(4):  # each rank received its row
        np.testing.assert_array_equal(values(scatter.outputs, r), np.arange(16.0).reshape(4, 4)[r : r + 1])
    assert redist.kind == "redistribute" and (redist.src, redist.dst) == (("S(0)",), ("R",))
    assert redist.before == sv.layout((4, 4), (4,), ["S(0)"]) and redist.after == sv.layout(
        (4, 4), (4,), ["R"]
    )
    assert gather.parent == redist.id and gather.op == "all_gather"
    assert gather.impl == "_c10d_functional.all_gather_into_tensor"
    np.testing.assert_array_equal(values(gather.outputs, 3), np.arange(16.0).reshape(4, 4))


def test_example4_uneven_all_gather_is_padded():
    sv.use("local", world_size=3)
    with sv.record() as trace:
        mesh = init_device_mesh("cpu", (3,))
        tensor = torch.arange(40).reshape(10, 4).float()
        dt = distribute_tensor(tensor, mesh, [Shard(0)])
        reconstructed = dt.full_tensor().reconcile()
    assert torch.equal(reconstructed, torch.arange(40).reshape(10, 4).float())
    gather = next(e for e in trace.collectives() if e.op == "all_gather")
    # 10 rows over 3 ranks: shards 4, 4, 2; the last is padded to 4 before the gather.
    assert [gather.inputs[r].shape for r in range(3)] == [(4, 4)] * 3
    assert gather.outputs[0].shape == (12, 4)


# --- example 5: rank-specific computation --------------------------------------------------


def test_example5_rank_map_and_per_rank():
    sv.use("local", world_size=4)
    with sv.record():
        lt = local_tensor_mode().rank_map(lambda rank: torch.full((2, 3), float(rank)))
        same = sv.per_rank(lambda rank: torch.full((2, 3), float(rank)))
        vals = {r: lt._local_tensors[r][0, 0].item() for r in range(4)}
        vals2 = {r: same._local_tensors[r][0, 0].item() for r in range(4)}
    assert vals == vals2 == {r: float(r) for r in range(4)}


def test_example5_tensor_map_and_disable():
    sv.use("local", world_size=4)
    with sv.record():
        mode = local_tensor_mode()
        lt = mode.rank_map(lambda rank: torch.ones(2, 2) * (rank + 1))
        scaled = mode.tensor_map(lt, lambda rank, t: t * (rank + 1))
        vals = {r: scaled._local_tensors[r][0, 0].item() for r in range(4)}
        inside = torch.ones(2, 2)
        with mode.disable():
            disabled = torch.ones(2, 2)
    assert vals == {r: float((r + 1) ** 2) for r in range(4)}
    # A LocalTensor inside (the batched engine's is a subclass of it), a plain tensor while disabled.
    assert isinstance(inside, LocalTensor) and type(disabled) is torch.Tensor


# --- example 6 with its trace ----------------------------------------------------------------


def test_example6_hybrid_trace_groups_and_mesh_dims():
    sv.use("local", world_size=8)
    with sv.record() as trace:
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        x = torch.randn(16, 8)
        dx = distribute_tensor(x, mesh, [Shard(0), Replicate()])
        w = torch.randn(8, 12)
        dw = distribute_tensor(w, mesh, [Replicate(), Shard(1)])
        dy = dx @ dw
        actual = dy.full_tensor().reconcile()
    torch.testing.assert_close(actual, (x @ w).reconcile())
    tp = ((0, 1), (2, 3), (4, 5), (6, 7))
    dp = ((0, 2, 4, 6), (1, 3, 5, 7))
    gathers = [e for e in trace.collectives() if e.op == "all_gather"]
    assert gathers, str(trace)
    for g in gathers:
        assert (g.groups, g.mesh_dim, g.mesh_dim_name) in ((tp, 1, "tp"), (dp, 0, "dp")), g
    (mm,) = [e for e in trace.ops() if e.name == "aten.mm"]
    assert mm.input_placements == (("S(0)", "R"), ("R", "S(1)")) and mm.output_placements == (
        ("S(0)", "S(1)"),
    )


def test_example6_3d_mesh():
    sv.use("local", world_size=24)
    with sv.record() as trace:
        mesh = init_device_mesh("cpu", (2, 3, 4), mesh_dim_names=("pp", "dp", "tp"))
        tensor = torch.randn(8, 16, 32)
        dt = distribute_tensor(tensor, mesh, [Replicate(), Shard(0), Shard(2)])
        actual = dt.full_tensor().reconcile()
    torch.testing.assert_close(actual, tensor.reconcile())
    gathers = [e for e in trace.collectives() if e.op == "all_gather"]
    assert {g.mesh_dim_name for g in gathers} == {"dp", "tp"}
    for g in gathers:
        assert len(g.groups) == {"dp": 8, "tp": 6}[g.mesh_dim_name]
        assert sorted(r for grp in g.groups for r in grp) == list(range(24))
    sv.use("local", world_size=4)
