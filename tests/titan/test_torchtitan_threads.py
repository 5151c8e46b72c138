"""torchtitan's own loss-parallel cross-entropy, unpatched, on one thread per rank.

``torchtitan.components.loss.cross_entropy_loss`` on vocab-sharded logits computes each rank's
vocabulary slice with plain ints (``min(global_vocab_size, vocab_start + chunk_size)`` on
``dist.get_rank(tp_group)``): the lockstep simulator cannot give it one int per rank, the threads
do. Expectation: ``F.cross_entropy`` (sum) on the whole logits in one process, loss and gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardviz as sv

pytest.importorskip("torchtitan", reason="torchtitan is installed by `make setup` (see Makefile)")

from torchtitan.components.loss import cross_entropy_loss


@pytest.mark.timeout(120)
def test_loss_parallel_cross_entropy_on_uneven_vocab_shards():
    sv.use("threads", world_size=4)
    torch.manual_seed(0)
    vocab = 10  # 3 + 3 + 3 + 1 columns: the last rank's slice is cut by min(vocab, ...)
    logits, labels = torch.randn(2, 3, vocab), torch.randint(0, vocab, (2, 3))
    ref = logits.clone().requires_grad_()
    want = F.cross_entropy(ref.flatten(0, 1), labels.flatten(), reduction="sum")
    want.backward()

    def fn():
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        pred = distribute_tensor(logits, mesh, [Shard(2)], src_data_rank=None).requires_grad_()
        target = distribute_tensor(labels, mesh, [Replicate()], src_data_rank=None)
        loss = cross_entropy_loss(pred, target)
        loss.backward()
        return loss.full_tensor(), pred.grad.full_tensor(), pred.to_local().shape[-1]

    trace = sv.run(fn)
    for r in range(4):
        loss, grad, local_vocab = trace.results[r]
        torch.testing.assert_close(loss, want.detach())
        torch.testing.assert_close(grad, ref.grad)
        assert local_vocab == [3, 3, 3, 1][r]
    # its three tensor-parallel all-reduces (max, sum of exponentials, the target's logit)
    reduces = [e.reduce_op for e in trace.collectives() if e.op == "all_reduce"]
    assert reduces == ["max", "sum", "sum"]
    assert all(e.mesh_dim_name == "tp" for e in trace.collectives())
    sv.use("local", world_size=4)
    assert dist.is_initialized() and dist.get_backend() == "fake"
