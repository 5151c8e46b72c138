"""torchtitan's own Llama 3 code, unpatched, on 8 simulated ranks against the unsharded model in one
process (issue 24): its model (debug config cut to 2 layers), its ``Module.parallelize`` (TP + SP)
and ``parallelize_llama`` (FSDP2 + TP, HSDP + TP, DDP-style + TP), its cross-entropy loss.

What the tests set themselves, none of it torchtitan's code: the attention backend (torchtitan's
language-model default, FlexAttention, compiles its mask with inductor, which needs real storage;
its SDPA module runs as it is), the RoPE cache length (the trainer cuts it to the sequence length
the same way), and the mesh's device type (torchtitan takes "cuda" when it finds no accelerator;
the simulation is on CPU). The loss takes the logits gathered (``full_tensor()``): torchtitan's
vocab-parallel loss picks each rank's vocabulary range with Python ``min()`` on the rank, which
the lockstep simulation cannot branch on (it raises PerRankValueError, tested below).

Tolerances: float32 throughout; the sharded model sums the same products in other orders
(partial sums per TP rank, gradients summed over data-parallel ranks), which moves results by a
few ulps of values of order 1-10: loss and gradients to 1e-5 absolute / 1e-4 relative. AdamW's first
step moves a parameter by lr * g / (|g| + eps), whose slope in g is at most lr / eps = 1e3 (lr 1e-3,
eps 1e-6) where g is near 0: a gradient off by 1e-9 there moves the parameter by 1e-6. Parameters
after the step: 1e-5 absolute, 1% of the step itself, so a missing, doubled or wrong-signed update
(1e-3) still fails.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch

import shardviz as sv
from shardviz.capture import torch as _torch
from shardviz.errors import PerRankValueError

titan = pytest.importorskip("torchtitan", reason="torchtitan is installed by `make setup` (see Makefile)")

from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402
from torchtitan.components.loss import cross_entropy_loss  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import llama3_configs, parallelize_llama  # noqa: E402
from torchtitan.models.llama3.sharding import set_llama3_sharding_config  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

WORLD, SEQ, BATCH, VOCAB, LR = 8, 16, 2, 2048, 1e-3


@pytest.fixture(autouse=True)
def cpu_mesh(monkeypatch):
    import torchtitan.distributed.parallel_dims as parallel_dims

    monkeypatch.setattr(parallel_dims, "device_type", "cpu")
    dist_utils.set_spmd_backend("partial_dtensor")
    sv.use("local", world_size=WORLD)


def llama_config(parallelism: ParallelismConfig) -> Any:
    cfg = llama3_configs["debugmodel"](attn_backend="flex")
    cfg.layers = cfg.layers[:2]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=SEQ)
    set_llama3_sharding_config(cfg, enable_sp=parallelism.enable_sequence_parallel)
    return cfg


def reference() -> Any:
    torch.manual_seed(0)
    model = llama_config(ParallelismConfig(spmd_backend="partial_dtensor")).build()
    model.init_weights()
    return model


def batches(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (n, BATCH, SEQ), generator=g), torch.randint(
        0, VOCAB, (n, BATCH, SEQ), generator=g
    )


def rank_values(t: Any) -> dict[int, torch.Tensor]:
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return _torch.local_tensors(t) or {r: t for r in range(WORLD)}


def build(ref: Any, dp_replicate: int, dp_shard: int, tp: int, whole: bool) -> tuple[Any, Any]:
    """torchtitan's model on the simulated mesh, holding the reference's weights."""
    p = ParallelismConfig(
        spmd_backend="partial_dtensor",
        data_parallel_replicate_degree=dp_replicate,
        data_parallel_shard_degree=dp_shard,
        tensor_parallel_degree=tp,
    )
    with sv.record(values="none"):
        dims = ParallelDims.from_config(p, WORLD)
        dims.build_mesh()
        with torch.device("meta"):
            model = llama_config(p).build()
        if whole:
            parallelize_llama(
                model,
                parallel_dims=dims,
                training=TrainingConfig(mixed_precision_param="float32"),
                parallelism=p,
                compile_config=CompileConfig(),
                ac_config=None,
                dump_folder="",
            )
        else:
            model.parallelize(dims)
        model.to_empty(device="cpu")
        state = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
        with torch.no_grad():
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                if isinstance(t, DTensor):
                    t.copy_(distribute_tensor(state[name], t.device_mesh, t.placements, src_data_rank=None))
                else:
                    t.copy_(state[name])
    return model, dims


def train_step(model: Any, tokens: Any, labels: Any, n_tokens: int) -> Any:
    """torchtitan's step: the summed cross-entropy over this rank's batch / the global token count."""
    pred = model(tokens)
    if isinstance(pred, DTensor):
        pred = pred.full_tensor()
    loss = cross_entropy_loss(pred, labels) / n_tokens
    loss.backward()
    return loss


def check_against_reference(
    ref: Any, model: Any, loss: Any, tokens: torch.Tensor, labels: torch.Tensor, dp_of: Any
) -> None:
    """Loss per rank (its data-parallel replica's share), gradients and parameters after AdamW."""
    n = tokens.numel()
    shares = [cross_entropy_loss(ref(tokens[i]), labels[i]) / n for i in range(len(tokens))]
    sum(shares).backward()
    for r, got in rank_values(loss).items():
        torch.testing.assert_close(
            got, shares[dp_of(r)].detach(), atol=1e-5, rtol=1e-5, msg=lambda m, r=r: f"loss, rank {r}: {m}"
        )
    want = dict(ref.named_parameters())
    with sv.record(values="none"):
        for name, p in model.named_parameters():
            for r, g in rank_values(p.grad).items():
                torch.testing.assert_close(
                    g,
                    want[name].grad,
                    atol=1e-5,
                    rtol=1e-4,
                    msg=lambda m, n=name, r=r: f"grad {n}, rank {r}: {m}",
                )
        opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6)
        opt.step()
    torch.optim.AdamW(ref.parameters(), lr=LR, eps=1e-6).step()
    with sv.record(values="none"):
        for name, p in model.named_parameters():
            for r, v in rank_values(p.detach()).items():
                torch.testing.assert_close(
                    v,
                    want[name].detach(),
                    atol=1e-5,
                    rtol=1e-4,
                    msg=lambda m, n=name, r=r: f"{n}, rank {r}: {m}",
                )


def test_tp_and_sequence_parallel_match_the_unsharded_model_and_their_collectives():
    # TP + SP on the tp dim of (dp=2, tp=4), every rank the same batch (no gradient sync without
    # data parallelism). The vocab-parallel embedding offsets token ids by dist.get_rank(tp_group):
    # on torch 2.13 that was 0 on every rank, and the loss was wrong with only a warning.
    ref = reference()
    tokens, labels = batches(1)
    model, _ = build(ref, 1, 2, 4, whole=False)
    with sv.record() as trace:
        loss = train_step(model, tokens[0], labels[0], tokens[0].numel())
    check_against_reference(ref, model, loss, tokens, labels, dp_of=lambda r: 0)
    assert trace.check() == {}
    forward = Counter((e.op, e.module) for e in trace.collectives() if e.phase == "forward")
    for i in range(2):
        block = f"Llama3Model.layers.{i}"
        # Per block: sequence all-gathered into attention and the feed-forward, reduce-scattered out.
        assert forward[("all_gather", f"{block}.attention")] == 1
        assert forward[("reduce_scatter", f"{block}.attention.wo")] == 1
        assert forward[("all_gather", f"{block}.feed_forward")] == 1
        assert forward[("reduce_scatter", f"{block}.feed_forward.w2")] == 1
    assert forward[("reduce_scatter", "Llama3Model.tok_embeddings")] == 1
    for e in trace.collectives():
        assert e.groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and e.mesh_dim_name == "tp", e


def test_fsdp2_and_tp_through_parallelize_llama():
    # dp_shard=2, tp=4; each dp replica its own batch. torchtitan sums gradients over dp with a
    # divide factor of 1 (ReduceOp.PREMUL_SUM, which LocalTensorMode lacked on torch 2.13).
    ref = reference()
    tokens, labels = batches(2)
    model, _ = build(ref, 1, 2, 4, whole=True)
    mine = sv.per_rank(lambda r: tokens[r // 4]), sv.per_rank(lambda r: labels[r // 4])
    with sv.record() as trace:
        loss = train_step(model, *mine, tokens.numel())
    check_against_reference(ref, model, loss, tokens, labels, dp_of=lambda r: r // 4)
    assert trace.check() == {}
    grads = [e for e in trace.collectives() if e.op == "reduce_scatter" and e.mesh_dim_name == "fsdp"]
    assert grads and {e.reduce_op for e in grads} == {"premul_sum"}
    assert all(e.phase == "backward" and e.groups == ((0, 4), (1, 5), (2, 6), (3, 7)) for e in grads)


@pytest.mark.parametrize(
    ("dp_replicate", "dp_shard", "tp"),
    [(2, 2, 2), (2, 1, 4)],
    ids=["hsdp-2x2-tp2", "ddp-style-2-tp4"],
)
def test_hsdp_and_ddp_style_through_parallelize_llama(dp_replicate, dp_shard, tp):
    # (2, 2, 2): HSDP + TP. (2, 1, 4): fully_shard over a size-1 fsdp dim, whose coordinate is a
    # constant per-rank int (it was read with int() and failed).
    ref = reference()
    n_dp = dp_replicate * dp_shard
    tokens, labels = batches(n_dp)
    model, _ = build(ref, dp_replicate, dp_shard, tp, whole=True)
    mine = sv.per_rank(lambda r: tokens[r // tp]), sv.per_rank(lambda r: labels[r // tp])
    with sv.record(values="none"):
        loss = train_step(model, *mine, tokens.numel())
    check_against_reference(ref, model, loss, tokens, labels, dp_of=lambda r: r // tp)


def test_vocab_parallel_loss_is_refused_with_the_reason():
    # torchtitan's loss on the vocab-sharded logits needs a different Python min() per rank.
    ref = reference()
    tokens, labels = batches(1)
    model, _ = build(ref, 1, 2, 4, whole=False)
    with pytest.raises(PerRankValueError, match=r"ranks disagree"), sv.record(values="none"):
        cross_entropy_loss(model(tokens[0]), labels[0])
