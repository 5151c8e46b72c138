"""Data-flow models: applied to each recorded collective's inputs, they reproduce its outputs.

Every collective kind the simulation runs, on 1-D and 2-D meshes, with even and uneven (padded)
buffers; and a tampered event is caught.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import shardviz as sv
from shardviz.data import flow
from shardviz.data.events import TensorSnapshot


def rank_values(shape, dtype=torch.float32):
    return sv.per_rank(lambda r: (torch.arange(int(np.prod(shape))).reshape(shape) * (r + 1) + r).to(dtype))


def recorded(body, world=4):
    sv.use("local", world_size=world)
    with sv.record() as trace:
        body()
    assert trace.collectives(), str(trace)
    return trace


def assert_all_checked(trace):
    for e in trace.collectives():
        c = flow.check(e)
        assert c.checked, (e.op, e.impl, c.note)
        assert c.ok, (e.op, e.impl, c.max_error, str(trace))


def test_raw_collectives_1d():
    def body():
        t = rank_values((3, 2))
        dist.all_reduce(t)
        dist.all_reduce(rank_values((2,)), op=dist.ReduceOp.MAX)
        dist.all_reduce(rank_values((2,), torch.int64), op=dist.ReduceOp.MIN)
        dist.broadcast(rank_values((4,)), src=2)
        outs = [torch.zeros(2, 2) for _ in range(4)]
        dist.all_gather(outs, rank_values((2, 2)))
        big = torch.zeros(8, 2)
        dist.all_gather_into_tensor(big, rank_values((2, 2)))
        small = torch.zeros(2, 3)
        dist.reduce_scatter_tensor(small, rank_values((8, 3)))
        out = torch.zeros(8)
        dist.all_to_all_single(out, rank_values((8,)))
        outs = [torch.zeros(2) for _ in range(4)]
        dist.all_to_all(outs, [rank_values((2,)) * (k + 1) for k in range(4)])
        recv = torch.zeros(3)
        dist.scatter(recv, [rank_values((3,)) + k for k in range(4)], src=0)
        gathered = [torch.zeros(2) for _ in range(4)]
        dist.gather(rank_values((2,)), gathered, dst=0)

    trace = recorded(body)
    ops = [c.op for c in trace.collectives()]
    assert ops == [
        "all_reduce",
        "all_reduce",
        "all_reduce",
        "broadcast",
        "all_gather",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "all_to_all",
        "scatter",
        "gather",
    ]
    assert_all_checked(trace)


def test_raw_collectives_on_2d_mesh_subgroups():
    def body():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for d in (0, 1):
            g = mesh.get_group(d)
            t = rank_values((2, 3))
            dist.all_reduce(t, group=g)
            big = torch.zeros(4, 3)
            dist.all_gather_into_tensor(big, rank_values((2, 3)), group=g)
            small = torch.zeros(1, 3)
            dist.reduce_scatter_tensor(small, rank_values((2, 3)), group=g)

    trace = recorded(body)
    assert {c.mesh_dim_name for c in trace.collectives()} == {"dp", "tp"}
    assert_all_checked(trace)


@pytest.mark.parametrize("rows", [8, 7, 2], ids=["even", "uneven", "fewer-rows-than-ranks"])
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
def test_dtensor_redistributes(rows, mesh_shape):
    def body():
        mesh = init_device_mesh("cpu", mesh_shape)
        x = torch.arange(rows * 6, dtype=torch.float32).reshape(rows, 6)
        last = len(mesh_shape) - 1
        rep = [Replicate()] * last
        dt = distribute_tensor(x, mesh, [*rep, Shard(0)])
        dt.redistribute(mesh, [*rep, Shard(1)])
        dt.redistribute(mesh, [*rep, Replicate()])
        p = DTensor.from_local(rank_values((rows, 6)), mesh, [*rep, Partial()], run_check=False)
        p.redistribute(mesh, [*rep, Replicate()])
        p.redistribute(mesh, [*rep, Shard(0)])
        if len(mesh_shape) == 2:
            dt2 = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
            dt2.redistribute(mesh, [Replicate(), Replicate()])

    trace = recorded(body)
    assert {"scatter", "all_to_all", "all_gather", "all_reduce", "reduce_scatter"} <= {
        c.op for c in trace.collectives()
    }
    assert_all_checked(trace)


def test_trace_check_lists_only_mismatches():
    trace = recorded(lambda: (dist.all_reduce(rank_values((3,))), dist.broadcast(rank_values((2,)), src=1)))
    assert trace.check() == {}
    e = trace.collectives()[0]
    outputs = dict(e.outputs)
    outputs[1] = TensorSnapshot(outputs[1].shape, outputs[1].dtype, outputs[1].values + 1)
    trace.events[0] = dataclasses.replace(e, outputs=outputs)
    (bad,) = trace.check()
    assert bad == e.id and not trace.check()[bad].ok


def test_tampered_output_is_caught():
    trace = recorded(lambda: dist.all_reduce(rank_values((3,))))
    (e,) = trace.collectives()
    assert flow.check(e).ok
    outputs = dict(e.outputs)
    bad = outputs[2].values.copy()
    bad[1] += 1.0
    outputs[2] = TensorSnapshot(outputs[2].shape, outputs[2].dtype, bad)
    c = flow.check(dataclasses.replace(e, outputs=outputs))
    assert c.checked and not c.ok and c.max_error[2] == pytest.approx(1.0) and c.max_error[0] == 0.0


def test_missing_values_are_not_checked():
    sv.use("local", world_size=4)
    with sv.record(values="none") as trace:
        dist.all_reduce(rank_values((3,)))
    c = flow.check(trace.collectives()[0])
    assert c.ok and not c.checked and "not checked" in c.note


def test_transfers_follow_each_op():
    trace = recorded(lambda: dist.broadcast(rank_values((2,)), src=1))
    (e,) = trace.collectives()
    assert flow.transfers(e) == [flow.Transfer(1, 0), flow.Transfer(1, 2), flow.Transfer(1, 3)]

    def rs():
        mesh = init_device_mesh("cpu", (2, 2))
        small = torch.zeros(1)
        dist.reduce_scatter_tensor(small, rank_values((2,)), group=mesh.get_group(1))

    (e,) = recorded(rs).collectives()
    assert flow.transfers(e) == [
        flow.Transfer(0, 1, 1, None, True),
        flow.Transfer(1, 0, 0, None, True),
        flow.Transfer(2, 3, 1, None, True),
        flow.Transfer(3, 2, 0, None, True),
    ]


def test_tolerances_by_dtype():
    a = np.array([1.0, 2.0], dtype=np.float32)
    assert flow.compare(a, a + 1e-7, "float32") is not None
    assert flow.compare(a, a + 1e-2, "float32") is None
    assert flow.compare(a, a + 1e-2, "bfloat16") is not None
    assert flow.compare(np.array([1, 2]), np.array([1, 3]), "int64") is None


def test_broadcast_from_a_non_zero_root_on_strided_groups():
    # dp groups of a (2, 2) mesh are [0, 2] and [1, 3]; src=2 is index 1 of each group, so rank 0
    # gets rank 2's buffer and rank 1 gets rank 3's (LocalTensorMode alone copies rank 1's to all).
    def body():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = sv.per_rank(lambda r: torch.full((2,), float(r)))
        dist.broadcast(x, src=2, group=mesh.get_group("dp"))
        assert {r: t.tolist() for r, t in x._local_tensors.items()} == {
            0: [2.0, 2.0],
            1: [3.0, 3.0],
            2: [2.0, 2.0],
            3: [3.0, 3.0],
        }

    (e,) = recorded(body).collectives()
    assert (e.root, e.roots()) == (1, [2, 3])
    assert flow.check(e).ok and flow.check(e).checked
