"""The recorder beyond the tutorial: modules and phases, value policy, run/per_rank, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

import shardviz as sv
from shardviz.capture import torch as _torch
from shardviz.capture.recorder import PlainTensorCollectiveError


def no_modes_left():
    return _torch.active_local_mode() is None and _torch.dispatch_mode_stack() == []


class MLP(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.act = nn.ReLU()
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


@pytest.fixture(scope="module")
def tp_mlp():
    sv.use("local", world_size=4)
    torch.manual_seed(0)
    ref = MLP()
    with sv.record():
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        model = MLP()
        model.load_state_dict(ref.state_dict())
        model = parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return ref, model, mesh


def test_tp_mlp_forward_and_backward_attribution(tp_mlp):
    ref, model, _ = tp_mlp
    x = torch.randn(8, 16, requires_grad=True)  # so the backward also needs the input's gradient
    with sv.record() as trace:
        y = model(x)
        y.sum().backward()
    expected = ref(x.detach())
    local = y.wait() if hasattr(y, "wait") else y  # an AsyncCollectiveTensor around a LocalTensor
    torch.testing.assert_close(local.reconcile(), expected)
    cols = trace.collectives()
    fwd = [c for c in cols if c.phase == "forward"]
    bwd = [c for c in cols if c.phase == "backward"]
    # Rowwise "down" sums partial outputs in the forward; Colwise "up" sums input grads in the backward.
    assert [(c.op, c.module) for c in fwd] == [("all_reduce", "MLP.down")], str(trace)
    assert [(c.op, c.module) for c in bwd] == [("all_reduce", "MLP.up")], str(trace)
    assert all(c.groups == ((0, 1, 2, 3),) and c.mesh_dim_name == "tp" for c in cols)
    # The forward all-reduce sums the partial outputs (DTensor puts the bias on one rank when it
    # turns the replicated bias into a Partial one): every rank then holds the layer's output.
    out = fwd[0].outputs[2].values
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-5, atol=1e-5)
    ops = {e.module for e in trace.ops() if e.phase == "forward"}
    assert {"MLP.up", "MLP.down"} <= ops
    # Events are numbered in execution order and children follow their parents.
    assert [e.id for e in trace.events] == list(range(len(trace.events)))
    assert all(e.parent is None or e.parent < e.id for e in trace.events)


def test_backward_noop_redistributes_are_dropped(tp_mlp):
    _, model, _ = tp_mlp
    with sv.record() as trace:
        model(torch.randn(8, 16)).sum().backward()
    for r in trace.redistributes():
        assert r.src != r.dst or trace.children(r.id), r


def test_str_is_one_line_per_event_indented_and_deterministic():
    sv.use("local", world_size=4)
    with sv.record():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dt = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0), Shard(1)])
    with sv.record() as trace:
        dt.redistribute(mesh, [Replicate(), Replicate()])
    assert str(trace) == "\n".join(
        [
            "Trace: local, 4 ranks, 3 events",
            "#0 redistribute (4,4) [S(0), S(1)] -> [R, R] plan S(0)S(1)->S(0)R->RR"
            "  <- dt.redistribute(mesh, [Replicate(), Replicate()])",
            "  #1 all_gather groups [0,1] [2,3] mesh tp (2,2)->(4,2) float32"
            "  <- dt.redistribute(mesh, [Replicate(), Replicate()])",
            "  #2 all_gather groups [0,2] [1,3] mesh dp (2,4)->(4,4) float32"
            "  <- dt.redistribute(mesh, [Replicate(), Replicate()])",
        ]
    )
    assert "/" not in str(trace).split("\n", 1)[1].replace("->", "")  # no file paths


def test_value_policy_none_keeps_metadata():
    sv.use("local", world_size=4)
    with sv.record(values="none") as trace:
        t = torch.ones(3)
        dist.all_reduce(t)
    (c,) = trace.collectives()
    assert c.outputs[0].values is None and c.outputs[0].shape == (3,) and c.outputs[0].dtype == "float32"
    assert c.nbytes == {r: 12 for r in range(4)}
    assert trace.values_dropped_from is None


def test_value_budget_runs_out_and_says_where():
    sv.use("local", world_size=4)
    # An all_reduce of 4 floats on 4 ranks keeps 4 x 16 bytes of inputs and one shared 16-byte
    # output (every rank holds the same sum): 80 bytes. A 100-byte budget keeps the first one
    # whole, then rank 0's input of the second, and nothing after.
    with sv.record(values=100) as trace:
        t = sv.per_rank(lambda r: torch.full((4,), float(r)))
        dist.all_reduce(t)
        dist.all_reduce(t)
    first, second = trace.collectives()
    assert first.outputs[3].values is not None and first.outputs[3].summary.max == 6.0
    assert first.outputs[0] is first.outputs[3]  # shared, not copied per rank
    assert second.inputs[0].values is not None and second.inputs[1].values is None
    assert second.outputs[0].values is None and second.outputs[0].summary is None
    assert second.outputs[0].shape == (4,)
    assert trace.values_dropped_from == second.id


def test_identical_outputs_are_shared_but_differing_ones_are_not():
    sv.use("local", world_size=4)
    with sv.record() as trace:
        mesh = init_device_mesh("cpu", (2, 2))
        t = sv.per_rank(lambda r: torch.full((2,), float(r)))
        dist.all_reduce(t, group=mesh.get_group(1))  # groups [0,1] and [2,3]
    (c,) = trace.collectives()
    assert c.outputs[0] is c.outputs[1] and c.outputs[2] is c.outputs[3]
    assert c.outputs[0].values.tolist() == [1.0, 1.0] and c.outputs[2].values.tolist() == [5.0, 5.0]


@pytest.mark.parametrize("bad", ["some", -1, 1.5, None])
def test_bad_value_policy(bad):
    with pytest.raises(ValueError, match="byte budget"), sv.record(values=bad):
        pass
    assert no_modes_left()


def test_summary_and_dtypes_numpy_lacks():
    sv.use("local", world_size=2)
    with sv.record() as trace:
        t = sv.per_rank(lambda r: torch.tensor([1.5, float("nan"), -2.0], dtype=torch.bfloat16) * (r + 1))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    (c,) = trace.collectives()
    snap = c.inputs[1]
    assert snap.dtype == "bfloat16" and snap.values.dtype == np.float32
    assert (snap.summary.min, snap.summary.max, snap.summary.nan) == (-4.0, 3.0, 1)


def test_run_returns_trace_with_per_rank_results():
    sv.use("local", world_size=4)

    def step(scale):
        t = sv.per_rank(lambda r: torch.full((2,), float(r)))
        dist.all_reduce(t)
        return t * scale, "done"

    trace = sv.run(step, 2.0)
    assert [c.op for c in trace.collectives()] == ["all_reduce"]
    for r in range(4):
        tensor, word = trace.results[r]
        assert torch.equal(tensor, torch.full((2,), 12.0)) and word == "done"
    assert sv.last_trace() is trace


def test_run_results_of_a_dtensor_are_local_shards():
    sv.use("local", world_size=4)

    def shard():
        mesh = init_device_mesh("cpu", (4,))
        return distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])

    trace = sv.run(shard)
    assert [trace.results[r].tolist() for r in range(4)] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]


def test_per_rank_bad_input():
    sv.use("local", world_size=2)
    with pytest.raises(TypeError, match="must return a tensor"):
        sv.per_rank(lambda r: r)
    with pytest.raises(TypeError, match="callable"):
        sv.per_rank(3)


def test_errors_keep_their_type_and_leave_no_mode():
    sv.use("local", world_size=4)
    with pytest.raises(ZeroDivisionError), sv.record():
        torch.ones(2)
        _ = 1 / 0
    assert no_modes_left()
    assert sv.last_trace() is not None and not sv.last_trace().complete


def test_plain_tensor_collective_is_refused_not_silently_wrong():
    sv.use("local", world_size=4)
    outside = torch.ones(3)  # made outside the simulation: one object for every rank
    with pytest.raises(PlainTensorCollectiveError, match="sv.per_rank"), sv.record():
        dist.all_reduce(outside)
    assert no_modes_left()
    # max of identical values is the value itself: allowed, and recorded.
    with sv.record() as trace:
        dist.all_reduce(outside, op=dist.ReduceOp.MAX)
    assert trace.collectives()[0].reduce_op == "max"


def test_strided_scatter_bug_is_explained():
    sv.use("local", world_size=4)
    with sv.record():
        mesh = init_device_mesh("cpu", (2, 2))
    x = torch.arange(8.0)
    with pytest.raises(PlainTensorCollectiveError, match="src_data_rank=None"), sv.record():
        distribute_tensor(x, mesh, [Replicate(), _StridedShard(0, split_factor=2)])
    with sv.record():
        dt = distribute_tensor(x, mesh, [Replicate(), _StridedShard(0, split_factor=2)], src_data_rank=None)
    assert dt.to_local()._local_tensors[1].tolist() == [2.0, 3.0, 6.0, 7.0]


@pytest.mark.timeout(240)
def test_torch_compile_eager_backends_work_and_inductor_is_explained():
    sv.use("local", world_size=4)
    with sv.record():
        mesh = init_device_mesh("cpu", (4,))
        dt = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    for backend in ("eager", "aot_eager"):
        with sv.record():
            out = torch.compile(lambda t: (t * 2).full_tensor(), backend=backend)(dt)
        assert out.reconcile().tolist() == [2.0 * i for i in range(8)], backend
    if not _torch.COMPILES_IN_SIMULATION:  # torch 2.11/2.12: Dynamo skips the frame, it runs eagerly
        with sv.record() as trace:
            out = torch.compile(lambda t: (t * 3).sum(), backend="inductor")(dt)
        assert out.full_tensor().reconcile().item() == 3 * sum(range(8))
        assert any("(t * 3).sum()" in e.source.text for e in trace.events if e.kind == "op")
        assert no_modes_left()
        return
    with pytest.raises(Exception, match='backend="aot_eager"') as e, sv.record():
        torch.compile(lambda t: (t * 3).sum(), backend="inductor")(dt)
    assert type(e.value).__module__.startswith("torch")  # the original error type, explained
    assert no_modes_left()


class Gather(nn.Module):
    """All-gathers its input and applies a submodule: module calls inside the compiled region."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(x.redistribute(x.device_mesh, [Replicate()]) * 2)


@pytest.mark.timeout(240)
# aot_eager first: torch fails to compile this module with it once the process compiled it with
# "eager" ("Node tangents_5 was invalid, but is output" in AOTAutograd's partitioner, plain
# LocalTensorMode too), a limit of torch's LocalTensor under torch.compile.
@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_a_module_compiled_with_fullgraph_runs_under_record(backend):
    # shardviz's module tracking used to be traced into the compiled region (it registers a hook
    # there: "setattr() on unsupported type" with fullgraph=True).
    sv.use("local", world_size=4)
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    want = x.clone().requires_grad_()
    torch.tanh(want * 2).sum().backward()
    model = nn.Sequential(nn.Identity(), Gather())
    with sv.record() as trace:
        mesh = init_device_mesh("cpu", (4,))
        dx = distribute_tensor(x.clone().requires_grad_(), mesh, [Shard(0)])
        model[1].compile(backend=backend, fullgraph=True)
        y = model(dx)
        y.to_local().sum().backward()
        grad = dx.grad.full_tensor()
    for r, v in _torch.local_tensors(y.to_local()).items():
        torch.testing.assert_close(v, torch.tanh(x * 2), msg=f"rank {r}")
    for r, g in _torch.local_tensors(grad).items():
        torch.testing.assert_close(g, want.grad, msg=f"rank {r}")
    gathers = [e for e in trace.collectives() if e.op == "all_gather" and e.source.text == "y = model(dx)"]
    if not _torch.COMPILES_IN_SIMULATION:  # torch 2.11/2.12: Dynamo skips the frame, it runs eagerly
        inner = "return self.act(x.redistribute(x.device_mesh, [Replicate()]) * 2)"
        ran = [(e.module, e.phase) for e in trace.collectives() if e.source.text == inner]
        assert gathers == [] and ran == [("Sequential.1", "forward")] and trace.notes == []
    elif backend == "eager":  # DTensor runs the compiled graph's ops as they come: all recorded
        # by the compiled module's name, at the line that called it (its compiled lines do not run)
        assert [(e.module, e.phase) for e in gathers] == [("Sequential.1", "forward")]
        assert trace.notes == []
    else:  # AOTAutograd compiled the per-rank tensors in: the trace says what it lacks
        assert gathers == []
        (note,) = trace.notes
        assert 'backend="aot_eager"' in note and "y = model(dx)" in note and "not in this trace" in note
    assert no_modes_left()


@pytest.mark.timeout(120)
def test_a_graph_break_is_explained_as_dynamos_not_inductors():
    sv.use("local", world_size=4)
    with sv.record():
        mesh = init_device_mesh("cpu", (4,))
        dt = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])

    def noisy(t):
        print("not traceable with fullgraph=True")
        return t * 2

    if not _torch.COMPILES_IN_SIMULATION:  # torch 2.11/2.12: Dynamo skips the frame, it runs eagerly
        with sv.record():
            out = torch.compile(noisy, backend="eager", fullgraph=True)(dt)
        assert out.full_tensor().reconcile().tolist() == [2.0 * i for i in range(8)]
        return
    with pytest.raises(Exception, match="cannot turn this code into one graph") as e, sv.record():
        torch.compile(noisy, backend="eager", fullgraph=True)(dt)
    assert "inductor" not in str(e.value).split("shardviz:")[1]
    assert type(e.value).__module__.startswith("torch")


def test_fsdp2_runs_in_the_simulation_and_torch_is_left_as_it_was():
    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param
    import torch.distributed.fsdp._fully_shard._fsdp_state as fsdp_state
    from torch.distributed.fsdp import fully_shard

    from shardviz.errors import BackendError

    def torch_own(f):
        return getattr(f, "__wrapped__", f)  # outside the simulation: torch's, behind a check

    before = (torch_own(fsdp_param.alloc_storage), torch_own(fsdp_param.free_storage))
    methods = (fsdp_param.FSDPParam._init_sharded_param, fsdp_state.FSDPState._pre_forward)
    sv.use("local", world_size=4)
    with sv.record() as trace:
        mesh = init_device_mesh("cpu", (4,))
        m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        for layer in (m[0], m[2], m):
            fully_shard(layer, mesh=mesh)
        m(torch.randn(2, 8)).sum().backward()
        simulated = sv.per_rank(lambda r: torch.ones(4) * r)
    assert {e.op for e in trace.collectives()} == {"all_gather", "reduce_scatter"}
    # torch's own methods are back; the storage functions are torch's for a plain tensor ...
    assert (fsdp_param.FSDPParam._init_sharded_param, fsdp_state.FSDPState._pre_forward) == methods
    assert (torch_own(fsdp_param.alloc_storage), torch_own(fsdp_param.free_storage)) == before
    plain = torch.ones(4)
    fsdp_param.free_storage(plain)
    assert plain.untyped_storage().size() == 0
    fsdp_param.alloc_storage(plain)
    assert plain.untyped_storage().size() == 4 * plain.element_size()
    # ... and refuse a simulated rank's, which torch's would leave as freed memory
    with pytest.raises(BackendError, match="inside the simulation"):
        fsdp_param.free_storage(simulated)
    with pytest.raises(BackendError, match="sv.record"):
        m(torch.randn(2, 8))
    assert no_modes_left()
