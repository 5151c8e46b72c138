"""nccl: one engine per GPU, each on its own device; the notebook kernel never initialises CUDA.

Needs CUDA GPUs; skipped (and so not counted as passing) on machines without one.
"""

from __future__ import annotations

import pytest
import torch

import shardviz as sv

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"
    ),
]


def on_each_gpu(n):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cuda", (n,))
    dt = distribute_tensor(torch.arange(8.0 * n).reshape(2 * n, 4).cuda(), mesh, [Shard(0)])
    t = torch.full((2,), float(dist.get_rank() + 1), device="cuda")
    dist.all_reduce(t)
    return dt.full_tensor(), t, torch.cuda.current_device(), dt


def test_nccl_ranks_on_their_own_gpus():
    n = torch.cuda.device_count()
    sv.use("nccl", world_size=n, timeout=60)
    try:
        assert sv.device_type() == "cuda"
        trace = sv.run(on_each_gpu, n)
        for r in range(n):
            full, total, device, shard = trace.results[r]
            assert full.device.type == "cpu" and torch.equal(full, torch.arange(8.0 * n).reshape(2 * n, 4))
            assert total.tolist() == [n * (n + 1) / 2] * 2
            assert device == r  # torch.cuda.set_device(local_rank) before init_process_group
            assert torch.equal(shard, torch.arange(8.0 * n).reshape(2 * n, 4)[2 * r : 2 * r + 2])
        assert [c.op for c in trace.collectives()][-2:] == ["all_reduce", "all_gather"]
        reduce = trace.collectives()[-2]
        assert all(reduce.outputs[r].values.tolist() == [n * (n + 1) / 2] * 2 for r in range(n))
    finally:
        sv.use("local")
    assert not torch.cuda.is_initialized(), "the notebook process initialised CUDA"
