"""Issue 26: ``sv.diff`` finds where a parallel run first leaves the single-device one.

Clean runs of the example Llama (TP + SP, FSDP2 + TP) report nothing; four bugs planted in user
code are found at the exact module. Where the report gives a value of the parallel run, the test
recomputes it with plain torch from what the bug does (a partial sum, a mean of per-rank means,
rows looked up at the wrong offset), so the assembly from shards is checked, not only the verdict.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

import shardviz as sv
from shardviz.capture.numerics_hooks import NumericsBudgetError
from shardviz.errors import BackendError
from shardviz.examples.llama import ModelArgs, Transformer, parallelize

pytestmark = pytest.mark.timeout(300)


# --- the example Llama ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Transformer(ModelArgs()), torch.randint(0, ModelArgs().vocab_size, (2, 16))


def tp_sp(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    return parallelize(model, mesh["tp"])


def fsdp_tp(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    parallelize(model, mesh["tp"])
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


@pytest.mark.parametrize("plan", [tp_sp, fsdp_tp], ids=["tp+sp", "fsdp2+tp"])
def test_clean_runs_of_the_example_llama_report_nothing(llama, plan):
    sv.use("local", world_size=8)
    model, tokens = llama
    report = sv.diff(model, plan, tokens)
    assert report.ok, str(report)
    assert report.first is None and report.differences == []
    # Every parameter is compared at the start, as a gradient and after the step.
    whats = {(r.key.module, r.what) for r in report.rows}
    for name, _ in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        for what in (f"{leaf} at start", f"{leaf}.grad", f"{leaf} after step"):
            assert (module, what) in whats, (name, what)
    assert report.row("Transformer", "loss").status == "ok"
    # Sequence-parallel activations (plain local tensors of (2, 4, 64)) were laid out along dim 1.
    block = report.row("Transformer.layers.0", "output")
    assert block.inferred and block.layout is not None and block.layout.placements == ("S(1)",)
    assert block.layout.mesh_dim_names == ("tp",)


def partial_w2(model: nn.Module) -> nn.Module:
    """Tensor parallel without SP, but block 1's w2 leaves its output Partial: the residual add
    then reads each rank's partial sum as if it were the whole value."""
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    parallelize_module(
        model,
        tp,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    for i, block in model.layers.items():
        plan = {f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
        plan |= {"feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel()}
        plan["attention.wo"] = RowwiseParallel()
        plan["feed_forward.w2"] = RowwiseParallel(output_layouts=Partial() if i == "1" else Replicate())
        parallelize_module(block, tp, plan)
    return model


def test_an_output_left_partial_is_found_at_the_module(llama):
    sv.use("local", world_size=8)
    model, tokens = llama
    report = sv.diff(model, partial_w2, tokens)
    first = report.first
    assert first is not None
    assert (first.module, first.phase, first.what) == (
        "Transformer.layers.1.feed_forward.w2",
        "forward",
        "output",
    )
    # Each tp rank holds its own partial sum; the dp groups agree.
    (d,) = first.disagreements
    assert d.groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert any("add up to the reference: a Partial(sum) value" in n for n in first.notes)
    # The value shown is rank 0's partial sum: w2 on tp rank 0's quarter of the hidden features.
    plain = copy.deepcopy(model)
    seen = {}
    plain.layers["1"].feed_forward.w2.register_forward_hook(lambda m, a, out: seen.update(h=a[0].detach()))
    plain(tokens)
    w2 = plain.layers["1"].feed_forward.w2.weight.detach()
    rank0 = (seen["h"][..., :32] @ w2[:, :32].T).numpy()
    assert first.index is not None and first.values is not None
    assert first.values[0] == pytest.approx(float(rank0[first.index]), rel=1e-5, abs=1e-6)
    # Everything before it agreed; what follows it differs too.
    assert all(r.status == "ok" for r in report.rows if r.order < first.order)
    assert report.row("Transformer.layers.1", "output").status == "differs"


# --- a drifting replicated bias -------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return MLP(), torch.randn(8, 16)


def tp_mlp(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    return parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def drifting_bias(model: nn.Module) -> nn.Module:
    """fc2's bias is replicated (RowwiseParallel); rank 2's copy drifts, as after a bad restore."""
    tp_mlp(model)
    mesh = model.fc2.bias.device_mesh
    drift = sv.per_rank(lambda rank: torch.full((16,), 1e-3 if rank == 2 else 0.0))
    with torch.no_grad():
        model.fc2.bias.add_(DTensor.from_local(drift, mesh, [Replicate()], run_check=False))
    return model


def test_one_ranks_drifting_replicated_bias_is_found_at_the_module():
    sv.use("local", world_size=4)
    model, x = mlp()
    report = sv.diff(model, drifting_bias, x)
    first = report.first
    assert first is not None
    assert (first.module, first.what, first.status) == ("MLP.fc2", "bias at start", "replicas")
    (d,) = first.disagreements
    assert d.scope == "replicas over tp"
    assert d.groups == ((0, 1, 3), (2,))
    assert d.max_abs == pytest.approx(1e-3, rel=1e-3)
    # fc2 adds its bias to a partial sum that the tp all-reduce then adds up: each rank's bias
    # counts for a quarter, so every rank's output is off by the same 1e-3 / 4.
    out = report.row("MLP.fc2", "output")
    assert out.status == "differs" and out.disagreements == ()
    assert out.max_abs == pytest.approx(1e-3 / 4, rel=1e-2)
    assert sv.diff(model, tp_mlp, x).ok  # without the drift, nothing


# --- a mean over an uneven shard with the wrong count ---------------------------------------------


class SeqMean(nn.Module):
    """The mean over the sequence; sharded, each rank averages its own positions, and the ranks'
    means are averaged: right only when every rank holds as many positions."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):
            count = x.to_local().shape[1]  # this rank's positions
            mean = x.sum(dim=1).to_local() / count
            return DTensor.from_local(mean, x.device_mesh, [Partial("avg")]).full_tensor()
        return x.mean(dim=1)


class Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.pool = SeqMean()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.proj(x)))


def sequence_sharded(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("sp",))
    style = PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=False
    )
    return parallelize_module(model, mesh, {"pool": style})


def test_a_mean_over_an_uneven_shard_with_the_wrong_count_is_found_at_the_module():
    sv.use("local", world_size=4)
    torch.manual_seed(0)
    model, x = Pool(), torch.randn(2, 10, 8)  # 10 positions over 4 ranks: 3, 3, 3, 1
    report = sv.diff(model, sequence_sharded, x)
    first = report.first
    assert first is not None
    assert (first.module, first.phase, first.what, first.status) == (
        "Pool.pool",
        "forward",
        "output",
        "differs",
    )
    assert first.spans == (((0, 2),), ((0, 8),))  # every element
    # What the parallel run computed: the mean of the four chunks' means.
    with torch.no_grad():
        h = model.proj(x)
    wrong = torch.stack([c.mean(dim=1) for c in h.chunk(4, dim=1)]).mean(dim=0).numpy()
    assert first.index is not None and first.values is not None
    assert first.values[0] == pytest.approx(float(wrong[first.index]), rel=1e-5)
    assert first.values[1] == pytest.approx(float(h.mean(dim=1).numpy()[first.index]), rel=1e-5)
    # With 8 positions (2 per rank) the same forward is right.
    even = sv.diff(model, sequence_sharded, torch.randn(2, 8, 8))
    assert even.row("Pool.pool", "output").status == "ok"


# --- a vocab-parallel embedding that takes its row offset from the wrong group --------------------


class VocabParallelEmbedding(nn.Module):
    """Rows of the table split over tp; each rank looks up the ids in its rows, the partial
    results are summed. The offset of a rank's rows is its coordinate on ``rank_mesh``."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim))
        self.rank_mesh = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rank_mesh is None:
            return F.embedding(ids, self.weight)
        local = self.weight.to_local()
        rows = local.shape[0]
        local_ids = ids - self.rank_mesh.get_local_rank() * rows
        outside = (local_ids < 0) | (local_ids >= rows)
        out = F.embedding(local_ids.masked_fill(outside, 0), local) * (~outside).unsqueeze(-1)
        return DTensor.from_local(out, self.weight.device_mesh, [Partial()]).full_tensor()


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = VocabParallelEmbedding(32, 8)
        self.head = nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def vocab_parallel(model: nn.Module, offset: str = "tp") -> nn.Module:
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    model.embed.weight = nn.Parameter(distribute_tensor(model.embed.weight.detach(), mesh["tp"], [Shard(0)]))
    model.embed.rank_mesh = mesh[offset]
    return model


def offset_from_dp(model: nn.Module) -> nn.Module:
    return vocab_parallel(model, offset="dp")  # the bug: the dp group's coordinate


def test_a_vocab_parallel_embedding_offset_by_the_wrong_groups_rank_is_found_at_the_module():
    sv.use("local", world_size=8)
    torch.manual_seed(0)
    model, ids = LM(), torch.randint(0, 32, (2, 6))
    assert sv.diff(model, vocab_parallel, ids).ok
    report = sv.diff(model, offset_from_dp, ids)
    first = report.first
    assert first is not None
    assert (first.module, first.phase, first.what) == ("LM.embed", "forward", "output")
    (d,) = first.disagreements
    assert d.groups == ((0, 1, 2, 3), (4, 5, 6, 7))  # the two dp groups used offsets 0 and 8
    # dp group 0 (kept: it holds rank 0) shifted every tp rank's rows to offset 0: an id below
    # 8 picks up row id of each rank's shard, summed; larger ids find nothing.
    w = model.embed.weight.detach().numpy()
    near = ids.numpy() < 8
    want = np.where(near[..., None], sum(w[8 * c + np.minimum(ids.numpy(), 7)] for c in range(4)), 0.0)
    assert first.index is not None and first.values is not None
    assert first.values[0] == pytest.approx(float(want[first.index]), rel=1e-5, abs=1e-6)
    # The report names what ran there: the embedding's partial sum reduced over tp.
    assert first.events_during
    reds = [e for e in first.events if e.kind == "redistribute"]
    assert reds and all(e.module == "embed" and "P(sum)" in e.text for e in reds)
    for e in first.events:  # the ids are the parallel run's trace's
        assert report.trace.events[e.id].kind == e.kind


# --- two parallel configurations, captured runs, budget, refusals ---------------------------------


def tp2(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def test_two_parallel_configurations_against_each_other():
    sv.use("local", world_size=4)
    model, x = mlp()
    report = sv.diff(model, tp_mlp, x, against=tp2)
    assert report.ok, str(report)
    assert report.reference == "tp2 on local (4 ranks)" and report.parallel == "tp_mlp on local (4 ranks)"
    bad = sv.diff(model, drifting_bias, x, against=tp2)
    assert bad.first is not None and (bad.first.module, bad.first.what) == ("MLP.fc2", "bias at start")


def test_captured_runs_compare_later():
    sv.use("local", world_size=4)
    model, x = mlp()
    plain = sv.numerics(model, x)
    par = sv.numerics(model, x, tp_mlp, reference=plain)
    assert len(plain) == len(par)
    assert sv.diff(plain, par).ok
    assert str(sv.diff(plain, par)).startswith(
        "NumericsReport: tp_mlp on local (4 ranks) against plain torch"
    )


def test_the_capture_keeps_to_its_budget():
    sv.use("local", world_size=4)
    model, x = mlp()
    with pytest.raises(NumericsBudgetError, match=r"passes its budget of 0.0 MiB.*budget="):
        sv.diff(model, tp_mlp, x, budget=2000)


def test_refusals_before_anything_runs():
    sv.use("local", world_size=4)
    model, x = mlp()
    with pytest.raises(BackendError, match="outside sv.record"), sv.record():
        sv.diff(model, tp_mlp, x)
    with pytest.raises(TypeError, match="function that takes a copy of the model"):
        sv.diff(model, "tp", x)
    with pytest.raises(TypeError, match=r"lambda params: torch.optim.sgd.SGD\(params, lr=0.1\)"):
        sv.diff(model, tp_mlp, x, optimizer=torch.optim.SGD)
    with pytest.raises(TypeError, match="tolerance"):
        sv.diff(model, tp_mlp, x, tolerance="loose")
    with pytest.raises(ValueError, match="against="):
        sv.diff(model, tp_mlp, x, against="gloo")


# --- one thread per rank --------------------------------------------------------------------------


class RankOffsetEmbedding(VocabParallelEmbedding):
    """The vocab-parallel embedding written as on real ranks: the offset from ``dist.get_rank``
    of a process group, a plain int per rank (what ``sv.use("threads")`` gives)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rank_mesh is None:
            return F.embedding(ids, self.weight)
        local = self.weight.to_local()
        rows = local.shape[0]
        start = dist.get_rank(self.rank_mesh.get_group()) * rows
        outside = (ids < start) | (ids >= start + rows)
        out = F.embedding((ids - start).masked_fill(outside, 0), local) * (~outside).unsqueeze(-1)
        return DTensor.from_local(out, self.weight.device_mesh, [Partial()]).full_tensor()


class RankLM(LM):
    def __init__(self) -> None:
        super().__init__()
        self.embed = RankOffsetEmbedding(32, 8)


def test_one_thread_per_rank_runs_the_same_diff_and_finds_the_wrong_groups_rank(llama):
    sv.use("threads", world_size=8)
    try:
        model, tokens = llama
        assert sv.diff(model, tp_sp, tokens).ok
        # The same function in the lockstep simulator against the threads: the same numbers.
        both = sv.diff(model, tp_sp, tokens, against="simulator")
        assert both.ok and both.reference == "tp_sp on local (8 ranks)"
        torch.manual_seed(0)
        lm, ids = RankLM(), torch.randint(0, 32, (2, 6))
        assert sv.diff(lm, vocab_parallel, ids).ok  # dist.get_rank(tp group): right
        first = sv.diff(lm, offset_from_dp, ids).first  # dist.get_rank(dp group): the bug
        assert first is not None and (first.module, first.what) == ("RankLM.embed", "output")
        assert first.disagreements[0].groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    finally:
        sv.use("local", world_size=4)
