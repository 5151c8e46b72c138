"""PhysicsNeMo's ShardTensor on two real gloo ranks (issue 25): the engines already hold a process
group, which ``DistributedManager`` adopts (instead of "initialize the default process group
twice!"); uneven shards 3 and 7 are drawn as they are, the seed's dot product is right, and its
all-reduce is recorded with each rank's local dot.

Expectations: ``torch.dot`` and slices of the global vectors, computed here in the test process.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

import shardviz as sv

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

try:
    from physicsnemo.distributed import DistributedManager
    from physicsnemo.domain_parallel import ShardTensor
except ImportError as e:  # pragma: no cover - installed by `make setup`
    if os.environ.get("CI") == "true":
        pytest.fail(f"the PhysicsNeMo tests must run in CI, but it is not installed ({e})", pytrace=False)
    pytest.skip(f"PhysicsNeMo is not installed ({e}); `make setup` installs it", allow_module_level=True)

HERE = str(Path(__file__).resolve())
CUTS = ((0, 3), (3, 10))  # rank 0 holds 3 elements, rank 1 holds 7 (chunking would give 5 and 5)


def seed_on_a_rank(a, b):
    def sharded_dot_product(func, types, args, kwargs):  # the seed's handler (sent with the function)
        x, y = args[0], args[1]
        mesh = x._spec.mesh
        local_dot_product = torch.dot(x.to_local(), y.to_local())
        dist.all_reduce(local_dot_product, op=dist.ReduceOp.SUM, group=mesh.get_group())
        return ShardTensor.from_local(local_dot_product, mesh, (Replicate(),))

    ShardTensor.register_function_handler(torch.dot, sharded_dot_product)
    DistributedManager.initialize()  # the engine's process group exists already: adopted
    dm = DistributedManager()
    mesh = dm.initialize_mesh(mesh_shape=[-1], mesh_dim_names=["domain"])
    lo, hi = ((0, 3), (3, 10))[dm.rank]
    shapes = {0: ((3,), (7,))}
    x = ShardTensor.from_local(a[lo:hi].clone(), mesh, (Shard(0),), sharding_shapes=shapes)
    y = ShardTensor.from_local(b[lo:hi].clone(), mesh, (Shard(0),), sharding_shapes=shapes)
    c = torch.dot(x, y).full_tensor()
    return dm.rank, dm.world_size, c, tuple(x.to_local().shape), sv.layout(x), x.full_tensor()


def test_the_seed_on_two_gloo_ranks(gloo):
    gloo(2)
    torch.manual_seed(0)
    a, b = torch.randn(10), torch.randn(10)
    trace = sv.run(seed_on_a_rank, a, b)
    want = torch.dot(a, b)
    for r in range(2):
        rank, world, c, local_shape, layout, full = trace.results[r]
        assert (rank, world) == (r, 2)
        torch.testing.assert_close(c, want)
        torch.testing.assert_close(full, a)
        assert local_shape == (CUTS[r][1] - CUTS[r][0],)
        assert {s.rank: s.shape for s in layout} == {0: (3,), 1: (7,)}  # drawn as each rank holds it
    reduce = next(c for c in trace.collectives() if c.op == "all_reduce")
    for r, (lo, hi) in enumerate(CUTS):
        np.testing.assert_allclose(reduce.inputs[r].values, torch.dot(a[lo:hi], b[lo:hi]).numpy(), rtol=1e-6)
    (gather,) = trace.redistributes()
    assert [s.shape for s in gather.before] == [(3,), (7,)] and [s.shape for s in gather.after] == [(10,)] * 2
    assert {e.source.file for e in trace.events} == {HERE}


def test_show_in_a_cell_on_gloo_draws_each_ranks_true_shard(ip, gloo):
    ip.run_cell(
        "import torch\nfrom torch.distributed.tensor import Shard\n"
        "from physicsnemo.distributed import DistributedManager\n"
        "from physicsnemo.domain_parallel import ShardTensor\nimport shardviz as sv"
    )
    gloo(2)
    widget = ip.run_cell_magic(
        "spmd",
        "",
        "DistributedManager.initialize()\n"
        "dm = DistributedManager()\n"
        "mesh = dm.initialize_mesh(mesh_shape=[-1], mesh_dim_names=['domain'])\n"
        "lo, hi = ((0, 3), (3, 10))[dm.rank]\n"
        "x = ShardTensor.from_local(torch.arange(10.0)[lo:hi].clone(), mesh, (Shard(0),), "
        "sharding_shapes={0: ((3,), (7,))})\n"
        "sv.show(x)",
    )
    assert {s.rank: s.shape for s in widget.tensor_layout} == {0: (3,), 1: (7,)}
    np.testing.assert_array_equal(widget.global_values(), np.arange(10.0))
