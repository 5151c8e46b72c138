"""Issue 30: the simulator never crashes on code that runs under torch's own LocalTensorMode, and
every per-rank value lockstep cannot run is a PerRankValueError naming the user's line and the way
out, on every entry point; where torch raises first, its error is kept and explained.

Expectations come from plain torch on the global tensors, or are written out by hand.
"""

from __future__ import annotations

import linecache

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

import shardviz as sv

pytestmark = pytest.mark.timeout(240)


# --- 1. work on the to_local() of a reduce-scatter output ------------------------------------------


def test_local_work_on_a_reduce_scatter_output_is_recorded_per_rank():
    """``to_local()`` of a collective's output is an AsyncCollectiveTensor around every rank's
    LocalTensor: the recorder reads each rank's value, never one reconciled value (which
    raised 'LocalTensor shards must be the same to reconcile')."""
    sv.use("local", world_size=4)
    torch.manual_seed(0)
    lin, x0 = nn.Linear(8, 16), torch.randn(2, 8, 8)
    want = lin(x0).detach()  # plain torch, the global output
    with sv.record() as trace:
        mesh = init_device_mesh("cpu", (4,))
        parallelize_module(lin, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)))
        x = DTensor.from_local(lin(x0), mesh, [Shard(1)])
        y = x.to_local().pow(2)  # a fused sequence-parallel norm starts like this
    pieces = want.chunk(4, dim=1)
    got = _torch_per_rank(y)
    for r in range(4):
        torch.testing.assert_close(got[r], pieces[r].pow(2))
    (local,) = [e for e in trace.events if e.kind == "local"]
    assert local.name == "aten.pow.Tensor_Scalar"
    for r in range(4):
        np.testing.assert_allclose(local.inputs[r].values, pieces[r].numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(local.outputs[r].values, pieces[r].pow(2).numpy(), rtol=1e-5, atol=1e-6)


def _torch_per_rank(t):
    from shardviz.capture import torch as _torch

    return {r: v.detach() for r, v in _torch.local_tensors(_torch.settled(t)).items()}


# --- 6. per-rank ints where Python needs one int, on every entry point ------------------------------

# Each uses a per-rank int the way Python needs one plain value; lockstep cannot run any of them.
PER_RANK_USES = {
    "index": "['stage0', 'stage1', 'stage2', 'stage3'][dist.get_rank()]",
    "int": "int(dist.get_rank())",
    "range": "list(range(dist.get_rank()))",
    "bool": "bool(dist.get_rank())",
    "len": "len(sv.per_rank(lambda r: torch.ones(r + 1)))",
    "float": "float(dist.get_rank())",
    "tensor": "torch.tensor(dist.get_rank())",
    "mesh coordinate": "['first', 'second'][mesh.get_local_rank('pp')]",
}


def _namespace():
    import torch.distributed as dist

    return {"torch": torch, "dist": dist, "sv": sv, "init_device_mesh": init_device_mesh}


def _check_named(err: BaseException, line: str) -> None:
    from shardviz.errors import PerRankValueError

    assert isinstance(err, PerRankValueError), repr(err)
    text = str(err)
    assert line in text  # the line that used it
    assert "sv.use('threads', world_size=N)" in text
    assert "sv.per_rank(lambda rank: ...)" in text
    assert "int_" not in text and "AttributeError" not in text


@pytest.mark.parametrize("use", sorted(PER_RANK_USES))
def test_a_per_rank_int_used_as_one_int_is_named_in_sv_record(use):
    sv.use("local", world_size=4)
    expr = PER_RANK_USES[use]
    ns = _namespace()
    text = f"mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('pp', 'tp'))\nvalue = {expr}\n"
    name = f"<per-rank use {use}>"
    linecache.cache[name] = (len(text), None, text.splitlines(keepends=True), name)
    code = compile(text, name, "exec")
    with pytest.raises(Exception) as info, sv.record():
        exec(code, ns)
    _check_named(info.value, f"{name}:2: value = {expr}")


def test_a_per_rank_int_is_named_in_sv_run_threads_spmd_cells_and_sv_diff():
    import torch.distributed as dist

    sv.use("local", world_size=4)

    def pick(thread: int) -> str:
        return ["a", "b", "c", "d"][int(dist.get_rank())]

    with pytest.raises(Exception) as info:
        sv.run(pick, threads=2)
    _check_named(info.value, 'return ["a", "b", "c", "d"][int(dist.get_rank())]')

    from shardviz.backends import choose

    shell = type("Shell", (), {"user_ns": _namespace()})()
    with pytest.raises(Exception) as info:
        choose.current().run_cell("x = 1\nlabel = ['a', 'b', 'c', 'd'][dist.get_rank()]\n", shell)
    _check_named(info.value, "<spmd-cell-")
    assert "label = ['a', 'b', 'c', 'd'][dist.get_rank()]" in str(info.value)

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * [1.0, 2.0, 3.0, 4.0][dist.get_rank()]

    with pytest.raises(Exception) as info:
        sv.diff(Scaled(), lambda m: m, torch.randn(2, 4))
    _check_named(info.value, "return self.lin(x) * [1.0, 2.0, 3.0, 4.0][dist.get_rank()]")


def test_threads_have_their_ranks_own_values_and_ints():
    """``sv.run(fn, threads=N)``: ``dist.get_rank()`` is each rank's (it was 0 on every rank, a
    silently wrong value), and a per-rank value the ranks of one thread agree on is one int there
    (a pipeline stage picked by the mesh coordinate)."""
    import torch.distributed as dist

    sv.use("local", world_size=4)

    def fn(thread: int) -> dict:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        return {
            "stage": ["stage0", "stage1"][mesh.get_local_rank("pp")],
            "first": mesh.get_local_rank("pp") == 0,
            "rank": torch.ones(1) * dist.get_rank(),
        }

    got = sv.run(fn, threads=2).results
    for r in range(4):
        assert got[r]["stage"] == f"stage{r // 2}" and got[r]["first"] == (r < 2)
        assert got[r]["rank"].tolist() == [float(r)]
    assert sv.run(lambda t: int(dist.get_rank()), threads=4).results == {0: 0, 1: 1, 2: 2, 3: 3}


def test_ints_every_rank_agrees_on_stay_ints():
    import torch.distributed as dist

    sv.use("local", world_size=4)
    with sv.record():
        mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("pp", "tp"))
        assert ["only"][mesh.get_local_rank("pp")] == "only"
        assert int(dist.get_rank() * 0) == 0


# --- 5. torch's error explained, never replaced ------------------------------------------------------


class UnevenMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 30)  # 30 hidden over 4 ranks: 8, 8, 8, 6
        self.fc2 = nn.Linear(30, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def uneven_tp(model: nn.Module) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel

    mesh = init_device_mesh("cpu", (4,))
    return parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def _check_torch_error_explained(err: BaseException) -> None:
    assert type(err) is RuntimeError  # torch's own error, not one of shardviz's
    text = str(err)
    assert "Sharding propagation failed" in text  # torch's message, kept
    assert "different global shape on each rank ((3, 32) on ranks 0-2; (3, 24) on rank 3)" in text
    assert "DTensor.from_local without shape=" in text and "use_local_output=False" in text
    assert "per-rank value" not in text  # the user used no per-rank int


def test_uneven_tensor_parallel_keeps_torchs_error_with_its_explanation():
    sv.use("local", world_size=4)
    torch.manual_seed(0)
    model, x = UnevenMLP(), torch.randn(3, 8)
    with pytest.raises(RuntimeError) as info:
        sv.diff(model, uneven_tp, x)
    _check_torch_error_explained(info.value)
    with pytest.raises(RuntimeError) as info, sv.record():
        uneven_tp(model)(x)
    _check_torch_error_explained(info.value)


def test_a_failure_while_explaining_leaves_the_error_as_raised(monkeypatch):
    from shardviz.capture import explain

    def broken(*a, **k):
        raise AttributeError("explaining failed")

    monkeypatch.setattr(explain, "explain_sharding_error", broken)
    err = RuntimeError("Sharding propagation failed for aten.mm")
    assert explain.explain_simulation_error(err, 4) is err
    assert str(err) == "Sharding propagation failed for aten.mm"
    assert explain.explain_rank_error(err) is err and str(err) == "Sharding propagation failed for aten.mm"


# --- 7. torch.compile(fullgraph=True) under a recording ---------------------------------------------


def _check_fullgraph_explained(err: BaseException) -> None:
    text = str(err)
    assert type(err).__module__.startswith(("torch", "builtins"))  # torch's own error, kept
    assert "torch.compile(fullgraph=True) cannot compile while shardviz records" in text
    assert "compile without fullgraph=True" in text
    assert "shardviz bug" not in text


def test_fullgraph_compile_under_a_recording_is_explained_as_torchs_limit():
    torch._dynamo.reset()  # what earlier tests compiled is not reused
    sv.use("local", world_size=4)
    lin = nn.Linear(8, 8)
    x0 = torch.randn(2, 8)
    expected = lin(x0).detach()  # plain torch, before compiling
    lin.compile(backend="eager", fullgraph=True)
    try:
        with sv.record():
            out = lin(x0)
    except Exception as e:  # torch 2.13: no compiling under a non-infra dispatch mode
        _check_fullgraph_explained(e)
        assert "from user code" in str(e)  # Dynamo's own report
    else:  # torch 2.15 compiles it under the recording: then its numbers are plain torch's
        torch.testing.assert_close(torch.as_tensor(out.detach()), expected)
    # Without fullgraph=True the same module runs in the recording, with plain torch's numbers.
    plain = nn.Linear(8, 8)
    x = torch.randn(2, 8)
    want = plain(x).detach()
    plain.compile(backend="eager")
    with sv.record():
        got = plain(x)
    torch.testing.assert_close(torch.as_tensor(got.detach()), want)


def test_fullgraph_compile_on_threads_is_explained_as_torchs_limit():
    torch._dynamo.reset()
    sv.use("threads", world_size=2)
    try:

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            lin = nn.Linear(8, 8)
            x = torch.randn(2, 8)
            expected = lin(x).detach()  # plain torch, before compiling
            lin.compile(backend="eager", fullgraph=True)
            return lin(x).detach(), expected

        try:
            trace = sv.run(step)
        except RuntimeError as e:  # torch 2.13: no compiling under a non-infra dispatch mode
            _check_fullgraph_explained(e)
            assert "found no compiled frames" in str(e)  # torch's own words
        else:  # 2.11/2.12 run it uncompiled, 2.15 compiles it: plain torch's numbers either way
            for out, expected in trace.results.values():
                torch.testing.assert_close(out, expected)
    finally:
        sv.use("local", world_size=4)


# --- 9. a DTensor whose local pieces disagree with its spec ------------------------------------------

PIECES = (3, 3, 2, 2)  # what the ranks hold; chunking the spec's 10 rows gives 3, 3, 3, 1
WHOLE = torch.arange(20.0).reshape(10, 2)


def _piece(rank: int) -> torch.Tensor:
    start = sum(PIECES[:rank])
    return WHOLE[start : start + PIECES[rank]].clone()


def _check_held(lay: sv.Layout, spec_note: str) -> None:
    assert [s.shape for s in lay.shards] == [(n, 2) for n in PIECES]
    assert [s.offset for s in lay.shards] == [(0, 0), (3, 0), (6, 0), (8, 0)]
    (note,) = lay.notes
    assert spec_note in note and "Drawn as the ranks hold them." in note
    assert f"note: {note}" in str(lay)


def test_a_dtensor_whose_pieces_disagree_with_its_spec_is_drawn_as_the_ranks_hold_it():
    sv.use("local", world_size=4)
    with sv.record():
        mesh = init_device_mesh("cpu", (4,))
        dt = DTensor.from_local(
            sv.per_rank(_piece), mesh, [Shard(0)], run_check=False, shape=(10, 2), stride=(2, 1)
        )
        lay = sv.layout(dt)
    _check_held(lay, "ranks 2, 3 hold (2, 2), (2, 2) where the spec gives (3, 2), (1, 2)")
    view = sv.show(dt)
    assert view.tensor_layout == lay
    np.testing.assert_array_equal(view.global_values(), WHOLE.numpy())  # the pieces tile it
    assert "disagree with this DTensor's spec" in view.values_info["note"]
    fig = sv.plot(dt)  # the static picture draws the same pieces
    assert fig is not None
    # A spec the pieces agree with is drawn as before, with no note.
    with sv.record():
        even = DTensor.from_local(
            sv.per_rank(lambda r: WHOLE.chunk(4)[r].clone()),
            mesh,
            [Shard(0)],
            run_check=False,
            shape=(10, 2),
            stride=(2, 1),
        )
        assert sv.layout(even) == sv.layout((10, 2), (4,), ["S(0)"]) and not sv.layout(even).notes


def test_a_dtensor_whose_global_shape_differs_per_rank_is_drawn_as_held():
    sv.use("local", world_size=4)
    with sv.record():
        mesh = init_device_mesh("cpu", (4,))
        dt = DTensor.from_local(sv.per_rank(_piece), mesh, [Shard(0)])  # no shape=: 12 or 8 rows
        lay = sv.layout(dt)
    _check_held(lay, "global shape differs per rank ({0: (12, 2), 1: (12, 2), 2: (8, 2), 3: (8, 2)})")
    assert lay.global_shape == (10, 2)
    np.testing.assert_array_equal(sv.show(dt).global_values(), WHOLE.numpy())


def test_on_threads_the_pieces_each_rank_holds_are_drawn():
    import torch.distributed as dist

    sv.use("threads", world_size=4)
    try:
        from shardviz.backends import choose

        shell = type(
            "Shell", (), {"user_ns": {**_namespace(), "DTensor": DTensor, "Shard": Shard, "piece": _piece}}
        )()
        backend = choose.current()
        backend.run_cell(
            "mesh = init_device_mesh('cpu', (4,))\n"
            "x = DTensor.from_local(piece(dist.get_rank()), mesh, [Shard(0)], run_check=False, "
            "shape=(10, 2), stride=(2, 1))\n",
            shell,
        )
        view = backend.run_cell("sv.show(x)", shell)
        _check_held(view.tensor_layout, "ranks 2, 3 hold (2, 2), (2, 2) where the spec gives (3, 2), (1, 2)")
        np.testing.assert_array_equal(view.global_values(), WHOLE.numpy())
        own = backend.run_cell("sv.layout(x).notes", shell)  # a rank alone knows its own piece
        assert own[0] == () and "rank 3 holds (2, 2) where the spec gives (1, 2)" in own[3][0]
        assert "the other ranks' are not known here" in own[3][0]
        _ = dist
    finally:
        sv.use("local", world_size=4)


def test_pieces_that_do_not_tile_the_tensor_keep_the_spec_with_the_note():
    from shardviz.geometry.layout import as_held

    spec = sv.layout((10, 2), (4,), ["S(0)"])
    lay = as_held(spec, {r: (3, 2) for r in range(4)})  # 12 rows held for 10
    assert lay.shards == spec.shards
    assert "rank 3 holds (3, 2) where the spec gives (1, 2)" in lay.notes[0]
    assert "the pieces do not tile the tensor" in lay.notes[0]
    assert sv.Layout.from_dict(lay.to_dict()) == lay  # notes travel with a saved trace
    from shardviz.data.layout_read import decode_layout

    assert decode_layout(lay.to_dict()) == lay
    assert "notes" not in spec.to_dict()  # a layout without notes is written as before


# --- random ops with a generator of the program's own ------------------------------------------------


def test_a_seeded_generator_draws_the_same_numbers_on_every_rank():
    """Each real rank seeds its own generator and draws the same numbers; in lockstep the ranks
    shared the one generator object, so rank r drew rank r-1's next numbers."""
    sv.use("local", world_size=4)
    plain = torch.Generator().manual_seed(7)
    want_first, want_second = torch.randn(3, generator=plain), torch.randn(3, generator=plain)
    from shardviz.capture import torch as _torch

    with sv.record():
        g = torch.Generator().manual_seed(7)
        first = torch.randn(3, generator=g)
        second = torch.randn(3, generator=g)  # the generator advanced once, not once per rank
        filled = sv.per_rank(lambda r: torch.zeros(2) + r).uniform_(generator=g)
    for got, want in ((first, want_first), (second, want_second)):
        per_rank = _torch.local_tensors(got) or dict.fromkeys(range(4), got)
        for r in range(4):
            torch.testing.assert_close(per_rank[r], want)
    draws = _torch.local_tensors(filled)
    assert draws is not None
    assert all(torch.equal(draws[r], draws[0]) for r in range(4))
    assert torch.equal(draws[0], torch.rand(2, generator=plain))
