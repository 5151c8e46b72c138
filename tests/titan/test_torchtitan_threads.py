"""torchtitan's own code that needs a plain int per rank, unpatched, on one thread per rank: its
loss-parallel cross-entropy, and pipeline_llm with 1F1B.

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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_llm_1f1b_with_fsdp2_tp_and_loss_parallel(monkeypatch):
    """torchtitan's own pipeline_llm (its stage split by pp rank, parallelize_llama on each part:
    FSDP2 with its divide factor of 1, TP + SP, the vocab-parallel loss on the last stage) and
    1F1B on (pp=2, dp_shard=2, tp=2), one thread per rank. No stage shapes are given: the stages
    infer them. Expectation: the unsplit model in one process, each dp replica's loss (the sum over
    its microbatches / all tokens) and the gradients of their sum; float32, to the tolerances of
    tests/titan/test_torchtitan.py (sums in other orders: a few ulps of values of order 1-10)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from test_torchtitan import BATCH, batches, llama_config, reference
    from torch.distributed.tensor import DTensor
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3 import parallelize_llama

    monkeypatch.setattr(parallel_dims, "device_type", "cpu")  # torchtitan's "cuda" with no accelerator
    dist_utils.set_spmd_backend("partial_dtensor")
    ref = reference()
    tokens, labels = batches(2)  # one batch per dp replica, 2 microbatches of 1 each
    n_tokens = tokens.numel()

    def step():
        p = ParallelismConfig(
            spmd_backend="partial_dtensor",
            pipeline_parallel_degree=2,
            data_parallel_shard_degree=2,
            tensor_parallel_degree=2,
            pipeline_parallel_schedule="1F1B",
        )
        dims = ParallelDims.from_config(p, 8)
        dims.build_mesh()
        cfg = llama_config(p)
        with torch.device("meta"):
            model = cfg.build()
        schedule, parts, first, last = pipeline_llm(
            model,
            parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param="float32", local_batch_size=BATCH),
            parallelism=p,
            compile_config=CompileConfig(),
            ac_config=None,
            dump_folder="",
            device=torch.device("cpu"),
            model_config=cfg,
            parallelize_fn=parallelize_llama,
            loss_fn=CrossEntropyLoss(CrossEntropyLoss.Config()),
        )
        state = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
        for part in parts:
            part.to_empty(device="cpu")
            with torch.no_grad():
                for name, t in [*part.named_parameters(), *part.named_buffers()]:
                    if isinstance(t, DTensor):
                        t.copy_(
                            distribute_tensor(state[name], t.device_mesh, t.placements, src_data_rank=None)
                        )
                    else:
                        t.copy_(state[name])
        dp = dims.get_mesh("fsdp").get_local_rank()
        losses: list[torch.Tensor] | None = [] if last else None
        kw = {"losses": losses, "loss_kwargs": {"global_valid_tokens": torch.tensor(n_tokens)}}
        if first:
            schedule.step(tokens[dp], return_outputs=False, **kw)
        else:
            schedule.step(target=labels[dp], return_outputs=False, **kw)
        grads = {n: p.grad.full_tensor() for part in parts for n, p in part.named_parameters()}
        return (torch.stack(losses).sum() if losses else None), grads

    sv.use("threads", world_size=8)
    try:
        trace = sv.run(step)
    finally:
        sv.use("local", world_size=8)
    shares = [cross_entropy_loss(ref(tokens[i]), labels[i]) / n_tokens for i in range(2)]
    sum(shares).backward()
    want = dict(ref.named_parameters())
    seen: set[str] = set()
    for r in range(8):  # ranks 0-3: stage 0 (dp 0: ranks 0, 1); ranks 4-7: stage 1, with the loss
        loss, grads = trace.results[r]
        if r < 4:
            assert loss is None
        else:
            dp = (r % 4) // 2
            torch.testing.assert_close(loss, shares[dp].detach(), atol=1e-5, rtol=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g, want[name].grad, atol=1e-5, rtol=1e-4, msg=f"{name}, rank {r}")
            seen.add(name)
    assert seen == set(want)  # the two stages hold the whole model between them
    # 1F1B with 2 stages and 2 microbatches, by hand: stage 1 runs each microbatch's backward right
    # after its forward; stage 0 waits for the gradients.
    lanes = str(sv.pipeline_timeline(trace)).splitlines()[1:9]
    assert lanes == [f"rank {r} |F0 F1 .  B0 .  B1 |" for r in range(4)] + [
        f"rank {r} |.  F0 B0 F1 B1 .  |" for r in range(4, 8)
    ]
    fsdp = [e for e in trace.collectives() if e.mesh_dim_name == "fsdp" and e.op == "reduce_scatter"]
    assert fsdp and {(e.reduce_op, e.phase) for e in fsdp} == {("premul_sum", "backward")}
    assert {e.reduce_op for e in trace.collectives() if e.op == "all_reduce" and e.mesh_dim_name == "tp"} >= {
        "max"
    }  # the vocab-parallel loss's max over the vocabulary shards
