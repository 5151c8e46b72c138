"""torchtitan's own Llama 3 code, unpatched, on 8 simulated ranks against the unsharded model in one
process (issue 24): its model (debug config cut to 2 layers), its ``Module.parallelize`` (TP + SP)
and ``parallelize_llama`` (FSDP2 + TP, HSDP + TP, DDP-style + TP, bf16 mixed precision, selective
activation checkpointing, the ``full_dtensor`` backend, context parallel refused with the reason),
its ``apply_compile`` (per-block torch.compile(fullgraph=True)), its cross-entropy loss. Its
pipeline and its vocab-parallel loss need one thread per rank: test_torchtitan_threads.py.

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
import torch.distributed as dist

import shardviz as sv
from shardviz.capture import torch as _torch
from shardviz.errors import PerRankValueError

titan = pytest.importorskip("torchtitan", reason="torchtitan is installed by `make setup` (see Makefile)")

from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402
from torchtitan.components.loss import cross_entropy_loss  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.distributed.activation_checkpoint import SelectiveAC  # noqa: E402
from torchtitan.distributed.compile import apply_compile  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import llama3_configs, parallelize_llama  # noqa: E402
from torchtitan.models.llama3.sharding import set_llama3_sharding_config  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

WORLD, SEQ, BATCH, VOCAB, LR = 8, 16, 2, 2048, 1e-3
TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


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


def canonical(name: str) -> str:
    """A parameter's name in the unwrapped model (activation checkpointing wraps each block)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def build(
    ref: Any,
    dp_replicate: int,
    dp_shard: int,
    tp: int,
    whole: bool,
    *,
    cp: int = 1,
    spmd_backend: str = "partial_dtensor",
    param_dtype: str = "float32",
    ac_config: Any = None,
    compile_config: Any = None,
) -> tuple[Any, Any]:
    """torchtitan's model on the simulated mesh, holding the reference's weights."""
    p = ParallelismConfig(
        spmd_backend=spmd_backend,
        data_parallel_replicate_degree=dp_replicate,
        data_parallel_shard_degree=dp_shard,
        tensor_parallel_degree=tp,
        context_parallel_degree=cp,
    )
    dist_utils.set_spmd_backend(spmd_backend)
    with sv.record(values="none"):
        dims = ParallelDims.from_config(p, WORLD)
        dims.build_mesh()
        with torch.device("meta"):
            model = llama_config(p).build()
        if whole:
            parallelize_llama(
                model,
                parallel_dims=dims,
                training=TrainingConfig(mixed_precision_param=param_dtype),
                parallelism=p,
                compile_config=compile_config or CompileConfig(),
                ac_config=ac_config,
                dump_folder="",
            )
        else:
            model.parallelize(dims)
        model.to_empty(device="cpu")
        state = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
        with torch.no_grad():
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                if isinstance(t, DTensor):
                    t.copy_(
                        distribute_tensor(
                            state[canonical(name)], t.device_mesh, t.placements, src_data_rank=None
                        )
                    )
                else:
                    t.copy_(state[canonical(name)])
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
    ref: Any,
    model: Any,
    loss: Any,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    dp_of: Any,
    *,
    whole_loss: bool = False,
) -> None:
    """Loss per rank (its data-parallel replica's share, or with ``whole_loss`` the whole batch's),
    gradients and parameters after AdamW."""
    n = tokens.numel()
    shares = [cross_entropy_loss(ref(tokens[i]), labels[i]) / n for i in range(len(tokens))]
    total = sum(shares)
    total.backward()
    for r, got in rank_values(loss).items():
        want_loss = total if whole_loss else shares[dp_of(r)]
        torch.testing.assert_close(
            got, want_loss.detach(), atol=1e-5, rtol=1e-5, msg=lambda m, r=r: f"loss, rank {r}: {m}"
        )
    want = dict(ref.named_parameters())
    with sv.record(values="none"):
        for name, p in model.named_parameters():
            for r, g in rank_values(p.grad).items():
                torch.testing.assert_close(
                    g,
                    want[canonical(name)].grad,
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
                    want[canonical(name)].detach(),
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
        # torchtitan's frames are a library's: each collective's line is this file's own
        assert e.source.file == __file__ and e.source.text.startswith(("pred = ", "loss.backward")), e


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


@pytest.mark.slow
def test_pipeline_llm_in_lockstep_names_its_per_rank_stage_index(monkeypatch):
    # torchtitan picks each rank's stage from a list by its pp coordinate: lockstep cannot, and says
    # where and what to do (it raised a bare AttributeError: 'LocalIntNode' ... 'int_').
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    monkeypatch.setattr(parallel_dims, "device_type", "cpu")
    dist_utils.set_spmd_backend("partial_dtensor")
    p = ParallelismConfig(
        spmd_backend="partial_dtensor",
        pipeline_parallel_degree=2,
        data_parallel_shard_degree=2,
        tensor_parallel_degree=2,
        pipeline_parallel_schedule="1F1B",
    )
    where = r"(?s)torchtitan/distributed/pipeline_parallel.py:\d+: .*\[stage_idx\].*sv\.use\('threads'"
    with pytest.raises(PerRankValueError, match=where), sv.record(values="none"):
        dims = ParallelDims.from_config(p, 8)
        dims.build_mesh()
        cfg = llama_config(p)
        with torch.device("meta"):
            model = cfg.build()
        pipeline_llm(
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


def test_selective_activation_checkpointing_with_fsdp2_and_tp():
    # torchtitan's own per-op SAC wraps each block; it recomputes the rest in the backward.
    ref = reference()
    tokens, labels = batches(2)
    model, _ = build(ref, 1, 2, 4, whole=True, ac_config=SelectiveAC.Config())
    assert "_checkpoint_wrapped_module" in next(n for n, _ in model.named_parameters() if "layers" in n)
    mine = sv.per_rank(lambda r: tokens[r // 4]), sv.per_rank(lambda r: labels[r // 4])
    with sv.record() as trace:
        loss = train_step(model, *mine, tokens.numel())
    check_against_reference(ref, model, loss, tokens, labels, dp_of=lambda r: r // 4)
    assert trace.check() == {}
    blocks = {e.module.split(".")[2] for e in trace.collectives() if (e.module or "").count(".") > 1}
    assert blocks >= {"0", "1"}


def test_full_dtensor_backend():
    # spmd_backend="full_dtensor": every activation a DTensor over the whole mesh, the inputs
    # wrapped by torchtitan's own parallelize_inputs (dp Shard(0), tp Replicate). The loss is the
    # whole batch's (the logits gathered), so every rank holds the sum of the dp shares.
    from torchtitan.distributed import full_dtensor

    ref = reference()
    tokens, labels = batches(2)
    model, dims = build(ref, 1, 2, 4, whole=True, spmd_backend="full_dtensor")
    mine = sv.per_rank(lambda r: tokens[r // 4]), sv.per_rank(lambda r: labels[r // 4])
    try:
        with sv.record() as trace:
            x, y, _ = full_dtensor.parallelize_inputs(dims, *mine, {})
            pred = model(x)
            assert isinstance(pred, DTensor) and pred.device_mesh.ndim == 2
            loss = cross_entropy_loss(pred.full_tensor(), y.full_tensor()) / tokens.numel()
            loss.backward()
    finally:
        dist_utils.set_spmd_backend("partial_dtensor")
    check_against_reference(ref, model, loss, tokens, labels, dp_of=lambda r: r // 4, whole_loss=True)
    assert trace.check() == {}


def test_bf16_mixed_precision_as_torchtitan_sets_it():
    # mixed_precision_param="bfloat16": FSDP2's MixedPrecisionPolicy(param_dtype=bf16,
    # reduce_dtype=fp32) on each block and the root; fp32 master weights stay sharded.
    ref = reference()
    tokens, labels = batches(2)
    model, _ = build(ref, 1, 2, 4, whole=True, param_dtype="bfloat16")
    mine = sv.per_rank(lambda r: tokens[r // 4]), sv.per_rank(lambda r: labels[r // 4])
    with sv.record() as trace:
        loss = train_step(model, *mine, tokens.numel())
    fsdp = [e for e in trace.collectives() if e.mesh_dim_name == "fsdp"]
    gathers = {e.inputs[0].dtype for e in fsdp if e.op == "all_gather"}
    scatters = {e.inputs[0].dtype for e in fsdp if e.op == "reduce_scatter"}
    assert gathers == {"bfloat16"} and scatters == {"float32"}
    # Against the fp32 model in one process. bf16 keeps 8 significant bits (a rounding moves a
    # value by up to 2^-9 of it): the loss, a mean of 64 fp32 log-probabilities of bf16 logits, to
    # 2e-3 relative (measured 2e-4); each gradient to 2% of its largest entry, a few bf16 roundings
    # of it (measured 0.9% at most, the attention's projections), so a missing or doubled
    # data-parallel sum (100%) still fails.
    n = tokens.numel()
    shares = [cross_entropy_loss(ref(tokens[i]), labels[i]) / n for i in range(2)]
    sum(shares).backward()
    want = {k: p.grad for k, p in ref.named_parameters()}
    for r, got in rank_values(loss).items():
        torch.testing.assert_close(got, shares[r // 4].detach(), atol=0, rtol=2e-3)
    with sv.record(values="none"):
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32  # the sharded master weights
            for g in rank_values(p.grad).values():
                scale = want[name].abs().max().item()
                torch.testing.assert_close(
                    g, want[name], atol=0.02 * scale, rtol=0, msg=lambda m, n=name: f"grad {n}: {m}"
                )


# aot_eager first: once this process compiled a block with "eager", torch fails to compile it
# again with aot_eager (a limit of LocalTensor under torch.compile, plain LocalTensorMode too).
@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_per_block_compile_fullgraph(backend):
    # torchtitan's apply_compile on the TP + SP model: each block torch.compile(fullgraph=True)'d.
    ref = reference()
    tokens, labels = batches(1)
    model, dims = build(ref, 1, 2, 4, whole=False)
    apply_compile(model, compile_config=CompileConfig(enable=True, backend=backend), parallel_dims=dims)
    if backend == "aot_eager" and TORCH >= (2, 15):
        # torch 2.15's AOTAutograd fails to flatten the LocalTensors inside these blocks' DTensors
        # (torch 2.13's compiles them): torch's limit, explained.
        with pytest.raises(Exception, match="could not take apart the simulated ranks' tensors"), sv.record():
            train_step(model, tokens[0], labels[0], tokens[0].numel())
        return
    with sv.record() as trace:
        loss = train_step(model, tokens[0], labels[0], tokens[0].numel())
    check_against_reference(ref, model, loss, tokens, labels, dp_of=lambda r: 0)
    fwd = Counter(e.module for e in trace.collectives() if e.phase == "forward")
    if backend == "eager":
        # every block's sequence-parallel all-gathers and reduce-scatters, by the block's name
        assert [fwd[f"Llama3Model.layers.{i}"] for i in range(2)] == [4, 4], fwd
        assert trace.notes == []
    else:
        # AOTAutograd compiled the simulated ranks into the blocks' graphs: the trace says so
        assert not any(".layers." in m for m in fwd if m)
        (note,) = trace.notes
        assert 'backend="aot_eager"' in note and "not in this trace" in note
    assert trace.check() == {}
    assert {e.source.file for e in trace.collectives() if e.source} == {__file__}


@pytest.mark.parametrize("engine", ["batched", "lockstep"])
def test_compiled_blocks_under_fsdp2(engine):
    # parallelize_llama compiles each block, then shards it with FSDP2. torch 2.15 runs it, and so
    # does the batched engine (the default from 2.13); on torch 2.13 and 2.14 Dynamo recurses
    # inside torch's own LocalTensorMode on the sharded parameters (torch's limit, any backend),
    # said so at once, and the next recording simulates again.
    if engine == "batched" and TORCH < (2, 13):
        pytest.skip("the batched engine needs torch >= 2.13")
    sv.use("local", world_size=WORLD, engine=engine)
    ref = reference()
    tokens, labels = batches(2)
    model, _ = build(ref, 1, 2, 4, whole=True, compile_config=CompileConfig(enable=True, backend="eager"))
    mine = sv.per_rank(lambda r: tokens[r // 4]), sv.per_rank(lambda r: labels[r // 4])
    if TORCH >= (2, 15) or engine == "batched":
        with sv.record():
            loss = train_step(model, *mine, tokens.numel())
        check_against_reference(ref, model, loss, tokens, labels, dp_of=lambda r: r // 4)
        return
    with pytest.raises(Exception, match="recursed without end inside torch's LocalTensorMode"), sv.record():
        train_step(model, *mine, tokens.numel())
    # The error unwound past LocalTensorMode's exit, which left it listed as active: the next
    # recording ran on plain tensors. It simulates again.
    with sv.record():
        t = sv.per_rank(lambda r: torch.ones(1) * r)
        dist.all_reduce(t)
    assert {float(v) for v in rank_values(t).values()} == {28.0}  # 0 + 1 + ... + 7


def test_context_parallel_is_refused_naming_the_missing_strategy():
    # cp=2: torchtitan shards attention along the sequence; on CPU SDPA is the CPU flash kernel,
    # which DTensor's context parallel does not cover (GPU kernels only).
    ref = reference()
    tokens, labels = batches(1)
    model, _ = build(ref, 1, 2, 2, whole=True, cp=2)
    with (
        pytest.raises(NotImplementedError, match="_scaled_dot_product_flash_attention_for_cpu") as info,
        sv.record(values="none"),
    ):
        train_step(model, tokens[0], labels[0], tokens[0].numel())
    text = str(info.value)
    assert "GPU kernels" in text and "context_parallel_degree=1" in text and "nccl" in text
