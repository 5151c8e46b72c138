"""While recording, shardviz does DTensor's all_gather and all_reduce (the functional
all_gather_into_tensor and all_reduce) itself, once per group, so that the outputs' snapshot needs
no copy and no compare.

The program must get exactly what bare LocalTensorMode gives it (bit for bit, on every rank, for
every mesh dim, uneven shards, dtypes, reduce ops and sub-groups), the snapshot must show the
gathered or reduced values (computed here with plain torch), and writes to the program's outputs
must not reach it.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import shardviz as sv
from shardviz.backends import choose
from shardviz.capture import torch as _torch

# (mesh shape, mesh dim gathered over)
MESHES = [((4,), 0), ((2, 2), 0), ((2, 2), 1), ((2, 2, 2), 1), ((2, 2, 2), 2), ((1, 3), 1)]
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


def build(mesh_shape):
    sv.use("local", world_size=int(np.prod(mesh_shape)))
    with sv.record(values="none"):
        return init_device_mesh("cpu", mesh_shape)


def values(shape, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 7
    if dtype == torch.bool:
        return x > 0
    return x.to(dtype)


def per_rank(dt):
    return {r: t.clone() for r, t in _torch.local_tensors(dt.to_local()).items()}


def assert_same_on_every_rank(bare, recorded, dtype, world):
    """Bit for bit what bare LocalTensorMode gives, on every rank, in the same dtype."""
    assert sorted(bare) == sorted(recorded) == list(range(world))
    for r in bare:
        assert bare[r].dtype == recorded[r].dtype == dtype
        assert torch.equal(bare[r], recorded[r]), r


def run(mesh, x, src, dst, record: bool):
    """Distribute ``x`` and redistribute it, bare or recorded; each rank's result."""
    if record:
        with sv.record() as trace:
            out = distribute_tensor(x, mesh, src, src_data_rank=None).redistribute(mesh, dst)
        return per_rank(out), trace
    with choose.current().simulate():
        out = distribute_tensor(x, mesh, src, src_data_rank=None).redistribute(mesh, dst)
        return per_rank(out), None


SHAPES = [((8, 6), 0), ((7, 5), 0), ((6, 7), 1), ((2, 3, 5), 2)]  # even, uneven, a later dim


@pytest.mark.parametrize("mesh_shape, dim", MESHES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, tensor_dim", SHAPES, ids=str)
def test_program_gets_what_bare_local_tensor_mode_gives(mesh_shape, dim, dtype, shape, tensor_dim):
    mesh = build(mesh_shape)
    x = values(shape, dtype)
    src = [Shard(tensor_dim) if i == dim else Replicate() for i in range(len(mesh_shape))]
    dst = [Replicate()] * len(mesh_shape)
    bare, _ = run(mesh, x, src, dst, record=False)
    recorded, trace = run(mesh, x, src, dst, record=True)
    assert_same_on_every_rank(bare, recorded, dtype, mesh.size())
    for r in recorded:
        assert torch.equal(recorded[r], x), r  # Replicate: every rank holds the whole tensor
    gather = next(c for c in trace.collectives() if c.op == "all_gather")
    assert gather.impl == "_c10d_functional.all_gather_into_tensor"
    # Each member's output is its group's shards stacked along dim 0 (padded where uneven).
    for g in gather.groups:
        stacked = np.concatenate([np.asarray(gather.inputs[r].values) for r in g], axis=0)
        for r in g:
            got = gather.outputs[r].values
            assert got is not None and got.shape == stacked.shape
            np.testing.assert_array_equal(got, stacked)


def test_snapshot_is_not_the_programs_buffer():
    mesh = build((2, 2))
    x = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    with sv.record() as trace:
        out = distribute_tensor(x, mesh, [Shard(0), Replicate()], src_data_rank=None).redistribute(
            mesh, [Replicate(), Replicate()]
        )
        local = out.to_local()
        local.mul_(-1)  # in the recording
    for t in _torch.local_tensors(out.to_local()).values():
        t.fill_(7)  # and after it
    gather = next(c for c in trace.collectives() if c.op == "all_gather")
    for r in range(4):
        np.testing.assert_array_equal(gather.outputs[r].values, x.numpy())
    # One snapshot per group, not one per rank.
    assert gather.outputs[0] is gather.outputs[2] and gather.outputs[1] is gather.outputs[3]


# all_gather_single from torch 2.13; all_gather_tensor (deprecated since) dispatches the same op.
all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def test_subgroup_call_and_value_policies():
    mesh = build((2, 2))
    tp = mesh.get_group(1)
    src = torch.arange(4, dtype=torch.float32).reshape(1, 4)
    for policy, kept in (("all", True), ("none", False), (0, False)):
        with sv.record(values=policy) as trace:
            local = sv.per_rank(lambda r: src + 10 * r)
            out = funcol.wait_tensor(all_gather_single(local, 0, tp))
        gather = trace.collectives()[-1]
        assert gather.groups == ((0, 1), (2, 3))
        got = {r: v.clone() for r, v in _torch.local_tensors(out).items()}
        for g in gather.groups:
            expected = torch.cat([src + 10 * r for r in g])
            for r in g:
                assert torch.equal(got[r], expected)
                snap = gather.outputs[r]
                assert snap.shape == (2, 4) and snap.dtype == "float32"
                if kept:
                    np.testing.assert_array_equal(snap.values, expected.numpy())
                else:
                    assert snap.values is None


def test_budget_counts_one_value_per_group():
    mesh = build((4,))
    x = torch.zeros(4, 1024)  # 16 KiB gathered
    with sv.record(values=16 * 1024 + 4 * 4096) as trace:  # the inputs, then one gathered value
        distribute_tensor(x, mesh, [Shard(0)], src_data_rank=None).redistribute(mesh, [Replicate()])
    gather = next(c for c in trace.collectives() if c.op == "all_gather")
    assert all(gather.outputs[r].values is not None for r in range(4))
    assert trace.values_dropped_from is None


REDUCE_DTYPES = [
    ("sum", torch.float32),
    ("sum", torch.bfloat16),
    ("sum", torch.int64),
    ("avg", torch.float32),
    ("max", torch.float32),
    ("min", torch.int64),
    ("product", torch.float64),
]
PLAIN_REDUCE = {
    "sum": lambda ts: functools.reduce(torch.add, ts),
    "avg": lambda ts: functools.reduce(torch.add, ts) / len(ts),
    "max": lambda ts: functools.reduce(torch.maximum, ts),
    "min": lambda ts: functools.reduce(torch.minimum, ts),
    "product": lambda ts: functools.reduce(torch.mul, ts),
}


def partial_to_replicate(mesh, dim, op, rank_value, record: bool):
    placements = [Partial(op) if i == dim else Replicate() for i in range(mesh.ndim)]

    def body():
        local = sv.per_rank(rank_value)
        return DTensor.from_local(local, mesh, placements).redistribute(mesh, [Replicate()] * mesh.ndim)

    if record:
        with sv.record() as trace:
            out = body()
        return per_rank(out), trace
    with choose.current().simulate():
        return per_rank(body()), None


@pytest.mark.parametrize("mesh_shape, dim", MESHES, ids=str)
@pytest.mark.parametrize("op, dtype", REDUCE_DTYPES, ids=str)
def test_all_reduce_gives_what_bare_local_tensor_mode_gives(mesh_shape, dim, op, dtype):
    mesh = build(mesh_shape)

    def noisy(r):  # rounding makes the order of the reduction show in the bits
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(r), dtype=torch.float64) * 3
        return x.to(dtype)

    bare, _ = partial_to_replicate(mesh, dim, op, noisy, record=False)
    recorded, trace = partial_to_replicate(mesh, dim, op, noisy, record=True)
    assert_same_on_every_rank(bare, recorded, dtype, mesh.size())
    reduce = trace.collectives()[-1]
    assert reduce.op == "all_reduce" and reduce.impl == "_c10d_functional.all_reduce"


@pytest.mark.parametrize("mesh_shape, dim", MESHES, ids=str)
@pytest.mark.parametrize("op, dtype", REDUCE_DTYPES, ids=str)
def test_all_reduce_values_and_snapshots(mesh_shape, dim, op, dtype):
    mesh = build(mesh_shape)

    def small(r):  # small integers: every order of the reduction gives the same exact result
        return (torch.arange(12, dtype=torch.float64).reshape(4, 3) % 3 + r + 1).to(dtype)

    got, trace = partial_to_replicate(mesh, dim, op, small, record=True)
    reduce = trace.collectives()[-1]
    # The groups along the mesh dim, from the mesh's rank grid.
    expected_groups = {
        tuple(int(r) for r in g) for g in mesh.mesh.transpose(dim, -1).reshape(-1, mesh.size(dim)).tolist()
    }
    assert set(reduce.groups) == expected_groups
    for g in reduce.groups:
        expected = PLAIN_REDUCE[op]([small(r) for r in g]).to(dtype)
        for r in g:
            assert torch.equal(got[r], expected), r
            np.testing.assert_array_equal(
                reduce.outputs[r].values,
                expected.float().numpy() if dtype == torch.bfloat16 else expected.numpy(),
            )
            np.testing.assert_array_equal(
                reduce.inputs[r].values,
                small(r).float().numpy() if dtype == torch.bfloat16 else small(r).numpy(),
            )
        assert all(reduce.outputs[r] is reduce.outputs[g[0]] for r in g)  # one snapshot per group


def test_all_reduce_snapshot_is_not_the_programs_buffer():
    mesh = build((4,))
    with sv.record() as trace:
        local = sv.per_rank(lambda r: torch.full((3, 3), float(r)))
        out = DTensor.from_local(local, mesh, [Partial()]).redistribute(mesh, [Replicate()])
        out.to_local().add_(100)  # in the recording
    for t in _torch.local_tensors(out.to_local()).values():
        t.fill_(-1)  # and after it
    reduce = trace.collectives()[-1]
    for r in range(4):
        np.testing.assert_array_equal(reduce.outputs[r].values, np.full((3, 3), 6.0))


@pytest.mark.parametrize("rebuild", ["restart", "use"])
def test_groups_and_mesh_dims_follow_a_new_world(rebuild):
    """A new world group (sv.restart, sv.use) may reuse the old one's group names for other groups."""
    mesh = build((2, 2))
    x = torch.arange(16.0).reshape(4, 4)
    with sv.record() as first:
        distribute_tensor(x, mesh, [Shard(0), Replicate()], src_data_rank=None).redistribute(
            mesh, [Replicate()] * 2
        )
    assert next(c for c in first.collectives() if c.op == "all_gather").groups == ((0, 2), (1, 3))
    if rebuild == "restart":
        sv.restart()
    else:
        sv.use("local", world_size=2)
        sv.use("local", world_size=4)
    with sv.record(values="none"):
        flat = init_device_mesh("cpu", (4,), mesh_dim_names=("x",))
    with sv.record() as second:
        distribute_tensor(x, flat, [Shard(0)], src_data_rank=None).redistribute(flat, [Replicate()])
    gather = next(c for c in second.collectives() if c.op == "all_gather")
    assert gather.groups == ((0, 1, 2, 3),) and gather.mesh_dim_name == "x"
    for r in range(4):
        np.testing.assert_array_equal(gather.outputs[r].values, x.numpy())
