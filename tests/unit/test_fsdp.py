"""FSDP2 (fully_shard) in the simulator: FSDP, HSDP and FSDP + TP against plain torch, and its
collectives recorded and attributed to the module whose parameters they move (issue 15)."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import shardviz as sv
from shardviz.backends import choose
from shardviz.capture import torch as _torch

pytestmark = pytest.mark.timeout(240)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    # 10 output features: uneven shards over 4 ranks (3, 3, 3, 1).
    return nn.Sequential(nn.Linear(8, 10), nn.ReLU(), nn.Linear(10, 4))


def plain_step(model: nn.Module, batches: list[torch.Tensor], opt_cls: type, steps: int) -> None:
    """What data parallelism computes: the mean of every rank's loss, one optimizer."""
    opt = opt_cls(model.parameters(), lr=0.1)
    for _ in range(steps):
        (sum(model(b).sum() for b in batches) / len(batches)).backward()
        opt.step()
        opt.zero_grad()


def assert_same_parameters(sharded: nn.Module, plain: nn.Module) -> None:
    want = dict(plain.named_parameters())
    with sv.record():
        for name, p in sharded.named_parameters():
            full = p.full_tensor() if _torch.is_dtensor(p) else p
            for r, t in (_torch.local_tensors(full) or {0: full}).items():
                torch.testing.assert_close(t, want[name], atol=1e-5, rtol=1e-5, msg=f"{name} rank {r}")


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam], ids=["sgd", "adam"])
def test_fsdp_on_a_dp_mesh_trains_as_plain_torch(opt_cls):
    sv.use("local", world_size=4)
    plain = mlp()
    batches = [torch.randn(3, 8) for _ in range(4)]
    model = copy.deepcopy(plain)  # built outside the simulation, as most scripts do
    with sv.record() as trace:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        for m in (model[0], model[2], model):
            fully_shard(m, mesh=mesh)
        opt = opt_cls(model.parameters(), lr=0.1)
        x = sv.per_rank(lambda r: batches[r])
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    plain_step(plain, batches, opt_cls, steps=2)
    assert_same_parameters(model, plain)

    # Each rank holds its own shard of each parameter: rank r rows 3r.. of the first weight.
    with sv.record():
        w = model[0].weight.to_local()
    shards = _torch.local_tensors(w)
    full = dict(plain.named_parameters())["0.weight"]
    for r in range(3):
        torch.testing.assert_close(shards[r], full[3 * r : 3 * r + 3], atol=1e-5, rtol=1e-5)

    steps = Counter((e.op, e.phase, e.module, e.reduce_op) for e in trace.collectives() if e.phase)
    for layer in ("FSDPSequential.0", "FSDPSequential.2"):
        # Per step: gathered for the forward, gathered again for the backward (resharded after
        # the forward), its gradient reduce-scattered as a mean.
        assert steps[("all_gather", "forward", layer, None)] == 2, steps
        assert steps[("all_gather", "backward", layer, None)] == 2, steps
        assert steps[("reduce_scatter", "backward", layer, "avg")] == 2, steps
    for e in trace.collectives():
        if e.phase:
            assert e.groups == ((0, 1, 2, 3),) and e.mesh_dim_name == "dp", e


def test_hsdp_replicates_over_one_dim_and_shards_over_the_other():
    sv.use("local", world_size=4)
    plain = mlp()
    batches = [torch.randn(3, 8) for _ in range(4)]
    model = copy.deepcopy(plain)
    with sv.record() as trace:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for m in (model[0], model[2], model):
            fully_shard(m, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(sv.per_rank(lambda r: batches[r])).sum().backward()
        opt.step()
    plain_step(plain, batches, torch.optim.SGD, steps=1)
    assert_same_parameters(model, plain)
    dims = Counter((e.op, e.mesh_dim_name) for e in trace.collectives() if e.phase == "backward")
    assert dims[("reduce_scatter", "shard")] == 2 and dims[("all_reduce", "replicate")] == 2, dims
    rs = next(e for e in trace.collectives() if e.op == "reduce_scatter")
    assert rs.groups == ((0, 1), (2, 3))


def test_fsdp_composed_with_tensor_parallel_on_a_dp_tp_mesh():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    sv.use("local", world_size=4)
    plain = mlp()
    batches = [torch.randn(3, 8) for _ in range(2)]  # one per dp group, shared by its tp ranks
    model = copy.deepcopy(plain)
    with sv.record() as trace:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for m in (model[0], model[2], model):
            fully_shard(m, mesh=mesh["dp"])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(sv.per_rank(lambda r: batches[r // 2])).sum().backward()
        opt.step()
    plain_step(plain, batches, torch.optim.SGD, steps=1)
    assert_same_parameters(model, plain)
    by_dim = {(e.op, e.mesh_dim_name) for e in trace.collectives() if e.phase}
    assert {("all_gather", "dp"), ("reduce_scatter", "dp"), ("all_reduce", "tp")} <= by_dim, by_dim
    gather = next(e for e in trace.collectives() if e.op == "all_gather" and e.phase)
    assert gather.groups == ((0, 2), (1, 3))
    with sv.record():
        layout = sv.layout(model[0].weight)
    # FSDP's dp shard of TP's colwise shard: tp rank t holds rows 5t..5t+5 of the 10, and dp rank
    # d the d-th chunk of those (3 rows, then 2).
    for rank in range(4):
        d, t = divmod(rank, 2)
        rows = range(5 * t, 5 * t + 3) if d == 0 else range(5 * t + 3, 5 * t + 5)
        assert [i for r in layout.shard(rank).indices[0] for i in r] == list(rows), (rank, layout)


def test_fsdp_attribution_reads_frames_only_for_what_fsdp_issues(monkeypatch):
    """The owner of what FSDP issues is found on the walk to the user's line that every event
    makes anyway: FSDP's frames are read for the events FSDP issues, not for every event."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    sv.use("local", world_size=4)
    model = mlp()
    with sv.record():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for m in (model[0], model[2], model):
            fully_shard(m, mesh=mesh["dp"])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = sv.per_rank(lambda r: torch.ones(3, 8) * r)
    lookups: list[str] = []
    owner = getattr(_torch, "fsdp_owner", None)

    def counted(frame):
        lookups.append(frame.f_code.co_filename)
        return owner(frame)

    monkeypatch.setattr(_torch, "fsdp_owner", counted, raising=False)
    with sv.record() as trace:
        model(x).sum().backward()
        opt.step()
    issued = [e for e in trace.events if e.kind == "collective" and e.mesh_dim_name == "dp"]
    # Per layer: gathered for the forward, again for the backward, its gradient reduce-scattered.
    assert Counter((e.op, e.module) for e in issued) == {
        (op, f"FSDPSequential.{i}"): n for i in (0, 2) for op, n in (("all_gather", 2), ("reduce_scatter", 1))
    }
    in_fsdp_modules = [e for e in trace.events if (e.module or "").startswith("FSDPSequential.")]
    # TP's collectives and operators inside those modules, and the optimizer's, need no lookup.
    assert len(issued) <= len(lookups) < len(in_fsdp_modules) < len(trace.events)
    assert set(lookups) == {_torch.FSDP_GROUP_FILE}


def test_fsdp_in_a_threaded_run_trains_as_plain_torch():
    """sv.run(fn, threads=N) (pipelines) with FSDP2 over the dp dim inside each thread's ranks:
    the same per-rank simulation of FSDP as sv.record(), and the parameters plain torch gives."""
    sv.use("local", world_size=4)
    plain = mlp()
    batches = [torch.randn(3, 8) for _ in range(4)]

    def stage(thread):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        model = copy.deepcopy(plain)
        for m in (model[0], model[2], model):
            fully_shard(m, mesh=mesh["dp"])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(sv.per_rank(lambda r: batches[r])).sum().backward()
        opt.step()
        return {name: p.full_tensor() for name, p in model.named_parameters()}

    trace = sv.run(stage, threads=2)
    for ranks in ((0, 1), (2, 3)):  # each thread's dp group trains on its own batches
        want = copy.deepcopy(plain)
        plain_step(want, [batches[r] for r in ranks], torch.optim.SGD, steps=1)
        for r in ranks:
            got = trace.results[r]
            for name, p in want.named_parameters():
                torch.testing.assert_close(got[name], p, atol=1e-5, rtol=1e-5, msg=f"{name} rank {r}")
    scatters = [e for e in trace.collectives() if e.op == "reduce_scatter"]
    assert {e.groups for e in scatters} == {((0, 1),), ((2, 3),)}
    assert {e.module for e in scatters} == {"FSDPSequential.0", "FSDPSequential.2"}


@pytest.mark.timeout(120)
def test_fsdp_gradient_reduce_scatter_in_a_pipeline_is_the_backward():
    """A 1F1B pipeline on a (pp, dp) mesh, each stage sharded over dp: torch's schedule calls
    FSDP's post_backward itself after the last microbatch, outside the autograd engine; the
    gradients' reduce-scatter is still the backward (it was labelled "forward")."""
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    x, y = torch.randn(2, 8, 8), torch.randn(2, 8, 8)  # one batch per dp rank

    def step():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
        part = [full[0:2], full[2:4]][pp]
        fully_shard(part, mesh=mesh["dp"])
        stage = PipelineStage(part, pp, 2, torch.device("cpu"), group=mesh.get_group("pp"))
        schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=nn.MSELoss())
        if pp == 0:
            schedule.step(x[dp])
        else:
            schedule.step(target=y[dp])
        return {n: p.grad.full_tensor() for n, p in part.named_parameters()}

    assert [n for n, _ in full[2:4].named_parameters()] == ["2.weight", "2.bias"]
    sv.use("threads", world_size=4)
    try:
        trace = sv.run(step)
    finally:
        sv.use("local", world_size=4)
    # plain torch: each dp rank's loss is the mean over its 4 microbatches; FSDP averages over dp
    ref = copy.deepcopy(full)
    losses = [
        sum(F.mse_loss(o, t) for o, t in zip(ref(x[d]).chunk(4), y[d].chunk(4), strict=True)) / 4
        for d in range(2)
    ]
    (sum(losses) / 2).backward()
    want = dict(ref.named_parameters())
    for r in range(4):
        for name, g in trace.results[r].items():  # a slice of a Sequential keeps its names
            torch.testing.assert_close(g, want[name].grad, atol=1e-6, rtol=1e-5, msg=f"{name} rank {r}")
    scatters = [e for e in trace.collectives() if e.op == "reduce_scatter"]
    assert {e.groups for e in scatters} == {((0, 1),), ((2, 3),)}
    assert [e.phase for e in scatters] == ["backward", "backward"]


def test_cpu_offload_trains_and_pinned_memory_is_explained_by_its_real_cause():
    from torch.distributed.fsdp import CPUOffloadPolicy

    sv.use("local", world_size=4)
    plain = mlp()
    batches = [torch.randn(3, 8) for _ in range(4)]
    model = copy.deepcopy(plain)
    with sv.record():
        mesh = init_device_mesh("cpu", (4,))
        for m in (model[0], model[2], model):
            fully_shard(m, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(sv.per_rank(lambda r: batches[r])).sum().backward()
        opt.step()
    plain_step(plain, batches, torch.optim.SGD, steps=1)
    assert_same_parameters(model, plain)
    # Pinned host memory needs an accelerator: torch raises this on CPU-only real ranks too.
    with pytest.raises(RuntimeError, match=r"pin_memory=False") as info, sv.record():
        mesh = init_device_mesh("cpu", (4,))
        fully_shard(mlp(), mesh=mesh, offload_policy=CPUOffloadPolicy())
    text = str(info.value)
    assert "real CPU ranks (gloo) as well" in text and "mixed precision" not in text


def test_a_gradient_divide_factor_runs_in_the_simulation_without_a_recorder():
    # ReduceOp.PREMUL_SUM(1 / factor): torch 2.13's LocalTensorMode lacks it; the simulation itself
    # (sv.record's recorder aside) applies it, so an unrecorded step runs the same numbers.
    sv.use("local", world_size=4)
    plain = mlp()
    batches = [torch.randn(3, 8) for _ in range(4)]
    model = copy.deepcopy(plain)
    with choose.current().simulate():
        mesh = init_device_mesh("cpu", (4,))
        for m in (model[0], model[2], model):
            fully_shard(m, mesh=mesh)
            m.set_gradient_divide_factor(2.0)
        model(sv.per_rank(lambda r: batches[r])).sum().backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    (sum(plain(b).sum() for b in batches) / 2).backward()
    for name, p in plain.named_parameters():
        for r, g in _torch.local_tensors(grads[name]).items():
            torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-5, msg=f"{name} rank {r}")


OUTSIDE = """
import torch, shardviz as sv
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from shardviz.capture import torch as _torch
from shardviz.errors import BackendError

sv.use("local", world_size=2)
torch.manual_seed(0)
plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
model.load_state_dict(plain.state_dict())
x = torch.arange(12.0).reshape(3, 4)
with sv.record():
    mesh = init_device_mesh("cpu", (2,))
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(x)
try:
    model(x)
except BackendError as e:
    print("refused:", "inside the simulation" in str(e) and "sv.record" in str(e))
with sv.record():
    out = model(x)
want = plain(x).detach()
print("inside again:", all(torch.allclose(t.detach(), want) for t in _torch.local_tensors(out).values()))
"""


def test_an_fsdp2_module_sharded_in_the_simulation_is_refused_outside_it_not_a_crash():
    # Sharded inside sv.record, called outside any: torch's storage resize cannot act on a
    # simulated rank's tensor, and the all-gather then wrote into freed memory (exit -11). In a
    # process of its own, so that a crash fails this test, not the whole run.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", OUTSIDE], capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: True" in done.stdout and "inside again: True" in done.stdout, done.stdout
