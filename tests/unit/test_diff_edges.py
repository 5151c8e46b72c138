"""Issue 30: ``sv.diff`` never misleads at any dtype, on any parallel code: correct models in
bfloat16 and float16 report nothing while a planted wrong reduction is still named; NaN and inf
compare equal where both runs hold them and a NaN of the parallel run alone is named where it
appears; hand-written data parallel (chunk and tensor_split, per-rank inputs, per-rank losses) is
assembled and compared; models that return None or integers; reports saved and loaded.

Expectations are plain torch on the whole batch, computed here, or written out by hand.
"""

from __future__ import annotations

import copy
import zipfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_diff import (
    LM,
    MLP,
    Pool,
    drifting_bias,
    fsdp_tp,
    mlp,
    offset_from_dp,
    partial_w2,
    sequence_sharded,
    tp_mlp,
    tp_sp,
    vocab_parallel,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import shardviz as sv
from shardviz.errors import TraceFileError
from shardviz.examples.llama import ModelArgs, Transformer

pytestmark = pytest.mark.timeout(300)


# --- 2/3. bfloat16 and float16: no false alarm, a wrong reduction still named ---------------------


def _llama(dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Transformer(ModelArgs()).to(dtype), torch.randint(0, ModelArgs().vocab_size, (2, 16))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("plan", [tp_sp, fsdp_tp], ids=["tp+sp", "fsdp2+tp"])
def test_correct_llama_in_low_precision_reports_no_difference(plan, dtype):
    sv.use("local", world_size=8)
    model, tokens = _llama(dtype)
    report = sv.diff(model, plan, tokens)
    assert report.ok, str(report)
    loss = report.row("Transformer", "loss")
    # The float32 loss of a low-precision output is held to the output's dtype and magnitude.
    assert loss.tolerance.dtype == str(dtype).removeprefix("torch.")
    assert loss.tolerance.scale is not None and loss.tolerance.scale > abs(loss.values[1])
    if plan is fsdp_tp:  # two parallel configurations against each other round alike
        assert sv.diff(model, fsdp_tp, tokens, against=tp_sp).ok


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_two_more_correct_models_in_low_precision_report_no_difference(dtype):
    sv.use("local", world_size=4)
    model, x = mlp()
    assert sv.diff(model.to(dtype), tp_mlp, x.to(dtype)).ok
    sv.use("local", world_size=8)
    torch.manual_seed(0)
    lm, ids = LM().to(dtype), torch.randint(0, 32, (2, 6))
    assert sv.diff(lm, vocab_parallel, ids).ok


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_wrong_reduction_in_low_precision_is_still_named(dtype):
    sv.use("local", world_size=8)
    model, tokens = _llama(dtype)
    first = sv.diff(model, partial_w2, tokens).first
    assert first is not None
    assert (first.module, first.phase, first.what) == (
        "Transformer.layers.1.feed_forward.w2",
        "forward",
        "output",
    )
    torch.manual_seed(0)
    lm, ids = LM().to(dtype), torch.randint(0, 32, (2, 6))
    first = sv.diff(lm, offset_from_dp, ids).first
    assert first is not None and (first.module, first.what) == ("LM.embed", "output")


def test_a_wrong_count_in_bf16_is_named_and_the_loss_tolerance_follows_the_output():
    sv.use("local", world_size=4)
    torch.manual_seed(0)
    model, x = Pool().to(torch.bfloat16), torch.randn(2, 10, 8, dtype=torch.bfloat16)
    first = sv.diff(model, sequence_sharded, x).first
    assert first is not None and (first.module, first.what) == ("Pool.pool", "output")
    even = sv.diff(model, sequence_sharded, torch.randn(2, 8, 8, dtype=torch.bfloat16))
    # The forward is right; the backward of this hand-written Partial("avg") is torch's own
    # (each rank's gradient is the whole one, not a quarter), found in float32 too.
    assert all(r.status == "ok" for r in even.rows if r.phase in ("start", "forward")), str(even)


class Cancelling(MLP):
    """A centred output: its mean (the default loss) is zero but for rounding, tiny next to the
    values it sums."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y - y.mean(dim=0, keepdim=True)


def test_a_cancelling_mean_in_bf16_is_no_false_alarm():
    sv.use("local", world_size=4)
    torch.manual_seed(0)
    model, x = Cancelling().to(torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16)
    report = sv.diff(model, tp_mlp, x)
    assert report.ok, str(report)


# --- 3. NaN and infinities ---------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["input nan", "input inf", "weight nan"])
def test_nan_and_inf_in_both_runs_compare_equal(where):
    sv.use("local", world_size=4)
    model, x = mlp()
    if where == "weight nan":
        with torch.no_grad():
            model.fc1.weight[3, 2] = float("nan")
    else:
        x[1, 3] = float("nan") if where == "input nan" else float("inf")
    # The reference itself holds NaN (checked here, in plain torch), and the report says equal.
    assert torch.isnan(copy.deepcopy(model)(x)).any()
    report = sv.diff(model, tp_mlp, x)
    assert report.ok, str(report)
    assert report.row("MLP", "input[0]").status == "ok"


def test_a_nan_only_in_the_parallel_run_is_named_where_it_first_appears():
    sv.use("local", world_size=4)
    torch.manual_seed(0)
    model, x = Pool(), torch.randn(2, 3, 8)  # 3 positions over 4 ranks: rank 3 holds none
    assert not torch.isnan(copy.deepcopy(model)(x)).any()
    report = sv.diff(model, sequence_sharded, x)
    first = report.first
    assert first is not None and (first.module, first.what) == ("Pool.pool", "output")
    assert any(
        "16 NaN here where the reference has a finite value (first at [0, 0])" in n for n in first.notes
    )
    assert all(r.status == "ok" for r in report.rows if r.order < first.order)


# --- 8. outputs the default loss cannot take --------------------------------------------------------


class ReturnsNone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> None:
        self.last = self.fc2(torch.relu(self.fc1(x)))


class ReturnsArgmax(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).argmax(-1)


@pytest.mark.parametrize(
    ("cls", "what"), [(ReturnsNone, "it returned None"), (ReturnsArgmax, "only int64 tensors")]
)
def test_outputs_without_a_float_tensor_compare_the_forward_with_a_note(cls, what):
    sv.use("local", world_size=4)
    torch.manual_seed(0)
    model, x = cls(), torch.randn(8, 16)
    report = sv.diff(model, tp_mlp, x)
    assert report.ok, str(report)
    (note,) = report.notes
    assert f"forward only: the model's output holds no floating-point tensor ({what})" in note
    assert "pass loss=" in note and "note: forward only" in str(report)
    kinds = {r.key.kind for r in report.rows}
    assert "loss" not in kinds and "grad" not in kinds and "output" in kinds
    # A bug in the forward is still found.
    assert sv.diff(model, drifting_bias, x).first is not None


# --- 4. data parallel written by hand ---------------------------------------------------------------


def hand_dp(model: nn.Module, average: bool = True) -> nn.Module:
    """Each parameter's gradient all-reduced by hand as it is accumulated (and divided by the
    world size for a mean of per-rank mean losses)."""
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))

    def all_reduce(p: torch.Tensor) -> None:
        dist.all_reduce(p.grad, group=mesh.get_group())
        if average:
            p.grad /= 4

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(all_reduce)
    return model


def hand_dp_sum(model: nn.Module) -> nn.Module:
    return hand_dp(model, average=False)


def _dp_step_reference(model: nn.Module, x: torch.Tensor, loss) -> dict[str, torch.Tensor]:
    """Gradients of the whole batch's loss, in plain torch."""
    m = copy.deepcopy(model)
    loss(m(x)).backward()
    return {n: p.grad.detach().clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("split", ["chunk", "tensor_split"])
@pytest.mark.parametrize("backend", ["local", "threads"])
def test_hand_written_data_parallel_is_assembled_over_the_dp_dim(split, backend):
    sv.use(backend, world_size=4)
    try:
        torch.manual_seed(0)
        model = MLP()
        x = torch.randn(8 if split == "chunk" else 10, 16)
        pieces = x.chunk(4) if split == "chunk" else x.tensor_split(4)  # 2 each; or 3, 3, 2, 2
        if split == "chunk":  # per-rank mean losses, gradients averaged
            plan, loss = hand_dp, None
            inputs = sv.per_rank(lambda r: pieces[r]) if backend == "local" else (lambda r: pieces[r])
        else:  # uneven: each rank's rows summed over the whole batch's count, gradients summed
            plan, loss = hand_dp_sum, (lambda out: out.sum() / (10 * 16))
            inputs = lambda r: pieces[r]  # noqa: E731
        report = sv.diff(model, plan, inputs, loss=loss)
        assert report.ok, str(report)
        out = report.row("MLP.fc1", "output")
        assert out.inferred and out.layout is not None and out.layout.mesh_dim_names == ("dp",)
        sizes = [s.shape[0] for s in out.layout.shards]
        assert sizes == ([2, 2, 2, 2] if split == "chunk" else [3, 3, 2, 2])
        assert report.row("MLP", "input[0]").shape == tuple(x.shape)
        (note,) = [n for n in report.row("MLP", "loss").notes if "own rows" in n]
        want = "their mean over the 4 copies" if split == "chunk" else "their sum"
        assert want in note
        grad = report.row("MLP.fc2", "grad_input[0]")
        assert grad.status == "ok" and any("each rank's own loss" in n for n in grad.notes)
    finally:
        sv.use("local", world_size=4)


def test_hand_written_data_parallel_gradients_are_plain_torchs():
    """The gradient hooks a hand-written data parallel registers survive the per-rank copies the
    simulator makes of plain parameters (they were silently dropped: no all-reduce ran)."""
    sv.use("local", world_size=4)
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 16)
    pieces = x.chunk(4)
    seen: list[str] = []
    want = _dp_step_reference(model, x, lambda out: out.mean())

    def dp(m: nn.Module) -> nn.Module:
        hand_dp(m)
        m.fc1.weight.register_hook(lambda g: seen.append("hook") or g)
        return m

    report = sv.diff(model, dp, lambda r: pieces[r])
    assert report.ok, str(report)
    assert seen == ["hook"]
    for name, g in want.items():
        module, _, leaf = name.rpartition(".")
        row = report.row(f"MLP.{module}", f"{leaf}.grad")
        assert row.status == "ok" and row.max_abs is not None and row.max_abs <= 1e-6 * float(g.abs().max())


def test_uneven_data_parallel_averaged_as_if_even_is_found():
    """Averaging per-rank mean losses over 3, 3, 2, 2 rows weighs the rows unequally: the
    gradients differ from the whole batch's, and the report says so."""
    sv.use("local", world_size=4)
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(10, 16)
    pieces = x.tensor_split(4)
    report = sv.diff(model, hand_dp, lambda r: pieces[r])
    assert not report.ok
    assert report.row("MLP.fc2", "weight.grad").status == "differs"
    # What the parallel run computed: the mean over ranks of each rank's mean-loss gradient.
    grads = []
    for piece in pieces:
        m = copy.deepcopy(model)
        m(piece).mean().backward()
        grads.append(m.fc2.weight.grad.detach())
    row = report.row("MLP.fc2", "weight.grad")
    wrong = torch.stack(grads).mean(0).numpy()
    assert row.index is not None and row.values is not None
    assert row.values[0] == pytest.approx(float(wrong[row.index]), rel=1e-5)


def test_data_and_tensor_parallel_activations_are_assembled_over_dp():
    """A (2, 2) mesh: each dp group's two tp ranks take the same half of the batch."""
    sv.use("local", world_size=4)
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(6, 16)
    halves = x.chunk(2)

    def dp_tp(m: nn.Module) -> nn.Module:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(m, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})

        def all_reduce(p: torch.Tensor) -> None:
            grad = p.grad
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            dist.all_reduce(local, group=mesh["dp"].get_group())
            local /= 2

        for p in m.parameters():
            p.register_post_accumulate_grad_hook(all_reduce)
        return m

    report = sv.diff(model, dp_tp, lambda r: halves[r // 2])
    assert report.ok, str(report)
    out = report.row("MLP.fc2", "output")
    assert out.layout is not None and out.layout.mesh_dim_names == ("dp",) and out.inferred
    assert report.row("MLP", "input[0]").shape == (6, 16)


def test_per_rank_inputs_must_join_into_one_batch():
    sv.use("local", world_size=4)
    model, _ = mlp()
    with pytest.raises(ValueError, match="do not join into one batch"):
        sv.diff(model, hand_dp, lambda r: torch.randn(2, 16 + r))


# --- 5. reports persist -----------------------------------------------------------------------------


def test_a_report_saves_and_loads_equal(tmp_path):
    sv.use("local", world_size=4)
    model, x = mlp()
    report = sv.diff(model, drifting_bias, x)
    assert report.first is not None and report.first.disagreements
    path = report.save(tmp_path / "drift.svdiff")
    back = sv.load(path)
    assert isinstance(back, sv.NumericsReport)
    assert back == report and str(back) == str(report)
    assert back.first is not None and back.first.error is not None
    np.testing.assert_array_equal(back.first.error, report.first.error)
    assert back.trace.events == report.trace.events  # the player can replay the parallel run
    with zipfile.ZipFile(path) as z:  # JSON and plain numeric arrays, nothing to unpickle
        assert all(
            n == "report.json" or (n.startswith("arrays/") and n.endswith(".npy")) for n in z.namelist()
        )
    # NaN, infinities, a forward-only note and an explicit tolerance survive too.
    _model2, x2 = mlp()
    x2[0, 0] = float("nan")
    nan_report = sv.diff(ReturnsNone(), tp_mlp, x2, tolerance={"float32": (1e-4, 1e-4)})
    assert sv.load(nan_report.save(tmp_path / "nan.svdiff")) == nan_report


def test_a_damaged_report_is_refused_with_the_field_named(tmp_path):
    import json

    sv.use("local", world_size=4)
    model, x = mlp()
    path = sv.diff(model, tp_mlp, x).save(tmp_path / "ok.svdiff")
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    doc = json.loads(members["report.json"])

    def write(name: str, change) -> str:
        d = json.loads(json.dumps(doc))
        change(d)
        out = tmp_path / name
        with zipfile.ZipFile(out, "w") as z:
            for n, b in members.items():
                z.writestr(n, json.dumps(d) if n == "report.json" else b)
        return str(out)

    bad_status = write("status.svdiff", lambda d: d["rows"][0].update(status="fine"))
    with pytest.raises(TraceFileError, match=r"rows\[0\]\.status .*one of ok, differs"):
        sv.load(bad_status)
    bad_rank = write("rank.svdiff", lambda d: d["rows"][0].update(ranks=[99]))
    with pytest.raises(TraceFileError, match=r"rows\[0\]\.ranks"):
        sv.load(bad_rank)
    newer = write("newer.svdiff", lambda d: d.update(version=99))
    with pytest.raises(TraceFileError, match="written by a newer shardviz"):
        sv.load(newer)
    with pytest.raises(TraceFileError, match="world_size"):
        sv.load(path, max_world_size=2)
