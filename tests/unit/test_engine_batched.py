"""The batched engine (``sv.use("local", engine="batched")``) against the lockstep one: the same
programs on both give the same trace (events, groups, recorded values) and the same per-rank
results, bit for bit. Lockstep is torch's own LocalTensorMode, each op once per rank: the
independent expectation here."""

from __future__ import annotations

import copy
import gc
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import shardviz as sv
from shardviz.backends import choose, session
from shardviz.capture import torch as _torch
from shardviz.errors import SimulationWarning
from shardviz.examples.llama import ModelArgs, Transformer, parallelize

TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
# below 2.13 the engine is refused (the last test)
needs_batched = pytest.mark.skipif(TORCH < (2, 13), reason="the batched engine needs torch >= 2.13")


@pytest.fixture(autouse=True)
def _fresh_backend():
    yield
    cur = session.peek()
    if cur is not None:
        cur.close()
    session.install(None)


def _per_rank(x: Any) -> Any:
    """Plain per-rank copies of what a program returned (DTensors by their local tensors)."""
    if isinstance(x, DTensor):
        x = _torch.local_of(x)
    if isinstance(x, (list, tuple)):
        return [_per_rank(y) for y in x]
    lt = _torch.local_tensors(x)
    if lt is not None:
        return {r: v.detach().clone() for r, v in sorted(lt.items())}
    return x


def _same_bits(a: Any, b: Any, where: str = "result") -> None:
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same_bits(x, y, f"{where}[{i}]")
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), where
        for r in a:
            x, y = a[r], b[r]
            assert (x.shape, x.dtype) == (y.shape, y.dtype), f"{where} rank {r}"
            assert torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)) or (
                torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())
            ), f"{where} rank {r}: {x} against {y}"
        return
    assert a == b, where


def _run(engine: str, world: int, program: Callable[[], Any]) -> tuple[Any, Any, Any]:
    cur = session.peek()
    if cur is not None:
        cur.close()
    session.install(None)
    sv.use("local", world_size=world, engine=engine)
    backend = choose.current()
    torch.manual_seed(0)
    with sv.record() as trace:
        out = _per_rank(program())
    return trace, out, backend._mode


def _both(world: int, program: Callable[[], Any]) -> Any:
    t_lock, out_lock, _ = _run("lockstep", world, program)
    t_bat, out_bat, mode = _run("batched", world, program)
    assert type(mode).__name__ == "BatchedLocalTensorMode"
    _same_bits(out_bat, out_lock)
    assert t_bat == t_lock  # events, groups, placements and the recorded values
    assert len(t_bat.events) == len(t_lock.events) > 0
    return mode


def _dtensor_program() -> Any:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = distribute_tensor(torch.randn(8, 6), mesh, [Shard(0), Shard(1)])
    w = distribute_tensor(torch.randn(6, 4, dtype=torch.float32), mesh, [Replicate(), Shard(0)])
    y = (x.relu() * 2 + 1) @ w  # a partial sum over tp, reduced on redistribute
    z = y.redistribute(mesh, [Shard(0), Replicate()])
    full = z.full_tensor()
    return [x, y, z, full, full.sum(), x.to(torch.bfloat16).exp()]


@needs_batched
def test_dtensor_program_gives_the_same_trace_and_bits():
    mode = _both(4, _dtensor_program)
    assert mode.batched_ops > 0  # the engine did run ops once for all ranks


@needs_batched
def test_rank_dependent_values_and_plain_collectives():
    def program() -> Any:
        rank = dist.get_rank()
        t = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1)
        r = torch.ones(()) * rank
        t[0, 0] = torch.where(r == 1, float("nan"), float("inf"))
        dist.all_reduce(t)
        g = torch.empty(4 * 2, 3)
        dist.all_gather_into_tensor(g, t)
        return [t, g, r + 0.5]

    _both(4, program)


def _kept(snaps: dict[int, Any]) -> dict[int, list[bool]]:
    """Which of each rank's snapshots kept values."""
    return {r: [x.values is not None for x in (s if isinstance(s, list) else [s])] for r, s in snaps.items()}


def _shared(snaps: dict[int, Any]) -> set[tuple[int, int]]:
    """Which ranks' snapshots of one side of a collective are the same object (one copy kept)."""
    return {(r, s) for r in snaps for s in snaps if r < s and snaps[r] is snaps[s]}


@needs_batched
@pytest.mark.parametrize("values", ["all", "none", 100, 400])
def test_snapshots_of_stacks_keep_lockstep_values_sharing_and_budget(values, monkeypatch):
    """The recorder copies a stack of small buffers once for all ranks: the values, which ranks
    share one snapshot, and where the value budget runs out are lockstep's, with NaN, inf, -0.0
    and a dtype numpy lacks (bfloat16, which takes the per-rank path)."""
    from shardviz.capture.recorder.snapshot import Snapshots

    stacked: list[bool] = []
    own = Snapshots._stacked

    def counted(self: Any, *a: Any) -> Any:
        out = own(self, *a)
        stacked.append(out is not None)
        return out

    monkeypatch.setattr(Snapshots, "_stacked", counted)

    def program() -> Any:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = sv.per_rank(lambda r: torch.tensor([float(r), -0.0, float("nan"), float("inf")]) * (r + 1))
        dist.all_reduce(x)
        g = torch.empty(16)
        dist.all_gather_into_tensor(g, x)
        d = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0), Shard(1)])
        b = distribute_tensor(torch.randn(4, 4).to(torch.bfloat16), mesh, [Shard(0), Shard(1)])
        c = sv.per_rank(lambda r: torch.full((3,), complex(r, -r), dtype=torch.complex128))
        dist.all_reduce(c)  # no integer word as wide: compared as same_bits does
        s = sv.per_rank(lambda r: torch.tensor(float(r) * 0.5))
        dist.all_reduce(s)  # 0-d buffers
        return [x, g, d.full_tensor(), b.full_tensor(), (d @ d).redistribute(mesh, [Replicate()] * 2), c, s]

    traces = {}
    for engine in ("lockstep", "batched"):
        cur = session.peek()
        if cur is not None:
            cur.close()
        session.install(None)
        sv.use("local", world_size=4, engine=engine)
        torch.manual_seed(0)
        with sv.record(values=values) as traces[engine]:
            program()
    a, b = traces["lockstep"], traces["batched"]
    assert a == b
    assert a.values_dropped_from == b.values_dropped_from
    if values in ("all", 100, 400):
        assert any(stacked), "the batched engine's stacks took the one-copy path"
    for ea, eb in zip(a.collectives(), b.collectives(), strict=True):
        for side in ("inputs", "outputs"):
            sa, sb = getattr(ea, side), getattr(eb, side)
            assert _shared(sa) == _shared(sb), f"{ea.op} {side}"
            assert _kept(sa) == _kept(sb), f"{ea.op} {side}"
            for snap in sb.values():
                for one in snap if isinstance(snap, list) else [snap]:
                    assert one.values is None or type(one.values) is np.ndarray, f"{ea.op} {side}"


def _held_bytes(a: np.ndarray) -> int:
    """The bytes a snapshot's array keeps alive: its own, or those of what it views (a numpy
    array's, or a torch tensor's whole storage)."""
    base: Any = a
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.untyped_storage().nbytes() if isinstance(base, torch.Tensor) else base.nbytes


@needs_batched
def test_a_snapshot_over_a_spent_budget_holds_no_more_than_its_own_row():
    """Where the budget keeps some ranks' values and not others, a kept snapshot is its own copy,
    not a row of the whole stack's copy (which would hold every rank's bytes the budget refused)."""
    sv.use("local", world_size=4, engine="batched")
    row = 256 * 4
    with sv.record(values=row + 8) as trace:
        x = sv.per_rank(lambda r: torch.full((256,), float(r)))
        dist.all_reduce(x)
    (c,) = trace.collectives()
    kept = [r for r, s in sorted(c.inputs.items()) if s.values is not None]
    assert kept == [0]
    assert c.inputs[0].values.tolist() == [0.0] * 256
    assert _held_bytes(c.inputs[0].values) == row


@needs_batched
@pytest.mark.parametrize("engine", ["lockstep", "batched"])
def test_group_outputs_over_a_spent_budget_hold_no_more_than_their_own_row(engine):
    """The same for the outputs the recorder computes per group: where the budget keeps the first
    group's value and not the second's, the kept one holds its own bytes, and both engines agree."""
    sv.use("local", world_size=4, engine=engine)
    row = 256 * 4
    mesh = init_device_mesh("cpu", (2, 2))
    with sv.record(values=4 * row + row + 8) as trace:  # every input, then one group's output
        x = sv.per_rank(lambda r: torch.full((256,), float(r)))  # inside: the batched engine's stack
        # DTensor's all-reduce over mesh dim 1, groups (0, 1) and (2, 3): the recorder's own
        # per-group values (on the batched engine, rows of one tensor)
        DTensor.from_local(x, mesh, [Replicate(), Partial()]).redistribute(mesh, [Replicate()] * 2)
    (c,) = trace.collectives()
    kept = [r for r, s in sorted(c.outputs.items()) if s.values is not None]
    assert kept == [0, 1]
    assert c.outputs[0].values.tolist() == [1.0] * 256  # 0 + 1
    assert _held_bytes(c.outputs[0].values) == row


@needs_batched
def test_uneven_shards_fall_back_per_op():
    def program() -> Any:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)])  # 2, 1, 1, 1 rows; empty: none
        e = distribute_tensor(torch.randn(2, 3), mesh, [Shard(0)])  # two ranks hold no rows
        s = (x * 3).sum(0)
        return [x, e * 2, s, x.redistribute(mesh, [Replicate()]), e.full_tensor()]

    _both(4, program)


@needs_batched
def test_random_ops_draw_from_each_ranks_generator():
    def program() -> Any:
        mesh = init_device_mesh("cpu", (4,))
        a = torch.randn(3, 2)
        b = torch.nn.functional.dropout(torch.ones(4, 4), p=0.5)
        c = distribute_tensor(torch.ones(8, 2), mesh, [Shard(0)])
        d = torch.nn.functional.dropout(c, p=0.25)
        return [a, b, d, torch.rand(2)]

    _both(4, program)


@needs_batched
def test_small_llama_tp_step():
    def program() -> Any:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        args = ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=64, hidden_dim=64)
        model = parallelize(Transformer(args), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, args.vocab_size, (2, 8))
        loss = model(tokens).float().mean()
        loss.backward()
        opt.step()
        return [loss, *[p for _, p in sorted(model.named_parameters())]]

    _both(2, program)


@needs_batched
def test_a_lazy_conjugate_is_read_conjugated_as_per_rank():
    # RoPE's backward multiplies by freqs.conj(): a conjugate bit on the stack that the wrapper
    # lacked, so ops on the stack read the unconjugated values (torchtitan's Llama gradients off).
    f0 = torch.randn(2, 3, dtype=torch.complex64)
    x0 = torch.randn(2, 3, dtype=torch.complex64)

    def program() -> Any:
        rank = dist.get_rank()
        f = f0 * (rank + 1)  # rank-dependent, held as one stack
        x = x0 + 0
        fc = f.conj()
        out = [x * fc, fc + 1, fc.imag * 1, torch.view_as_real(fc.resolve_conj()), fc]
        dist.all_reduce(total := torch.view_as_real(x * fc).clone())
        return [*out, total]

    _both(4, program)
    _, out, _ = _run("batched", 4, program)
    for r in range(4):
        f = f0 * (r + 1)
        want = [x0 * f.conj(), f.conj() + 1, f.conj().imag * 1, torch.view_as_real(f.conj().resolve_conj())]
        for i, w in enumerate(want):
            torch.testing.assert_close(out[i][r], w, atol=0, rtol=0, msg=f"result {i}, rank {r}")


@needs_batched
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("size", [13, 128])
def test_elementwise_functions_keep_each_ranks_bits_at_any_size(size, dtype):
    # torch's vector lanes and its scalar tail round sigmoid, silu, exp ... differently; a stack
    # moves which elements fall in the tail (13 floats a rank: 5 in the tail per rank, 1 in the
    # stack's), so those run per rank. 128 a rank: whole lanes, run on the stack. Written out
    # against plain torch on each rank's tensor, NaN and inf included.
    base = (torch.randn(size) * 3).to(dtype)
    base[3], base[5] = float("nan"), float("-inf")

    def program() -> Any:
        rank = dist.get_rank()
        x = base * (rank + 1) + 0
        y = base.flip(0) + 0
        fns = [torch.sigmoid(x), torch.nn.functional.silu(x), torch.tanh(x), torch.exp(x), x.pow(3)]
        fns += [torch.add(x, y, alpha=0.3), torch.lerp(x, y, 0.7), torch.addcmul(x, x, y, value=0.1)]
        # In place, as AdamW writes: ranks 1-3's slices of the stack sit off the kernels' alignment
        # (13 floats a rank), where the per-rank kernel writes into a copy, copied back.
        fns += [x.clone().lerp_(y, 0.7), x.clone().addcmul_(x, y, value=0.1), x.clone().sigmoid_()]
        fns.append(x.clone().index_put_((torch.tensor([1, 4]),), torch.tensor([-1.0, -2.0], dtype=dtype)))
        dist.all_reduce(total := fns[0].clone())
        return [*fns, total]

    _both(4, program)
    _, out, _ = _run("batched", 4, program)
    for r in range(4):
        x, y = base * (r + 1), base.flip(0)
        want = [torch.sigmoid(x), torch.nn.functional.silu(x), torch.tanh(x), torch.exp(x), x.pow(3)]
        want += [torch.add(x, y, alpha=0.3), torch.lerp(x, y, 0.7), torch.addcmul(x, x, y, value=0.1)]
        want += [x.clone().lerp_(y, 0.7), x.clone().addcmul_(x, y, value=0.1), x.clone().sigmoid_()]
        want.append(x.clone().index_put_((torch.tensor([1, 4]),), torch.tensor([-1.0, -2.0], dtype=dtype)))
        for i, w in enumerate(want):
            got = out[i][r]
            same = torch.equal(got.isnan(), w.isnan()) and torch.equal(got.nan_to_num(), w.nan_to_num())
            assert same and got.dtype == w.dtype, f"result {i}, rank {r}"


@needs_batched
def test_the_checking_mode_passes_a_correct_program_and_names_a_wrong_op(monkeypatch):
    # SHARDVIZ_ENGINE_CHECK=1 reruns each batched op rank by rank: quiet on a correct program
    # (meta tensors too, which hold no values: torchtitan builds its model on them), and a wrong
    # result is named with its op and rank.
    from shardviz.capture.torch import batched

    def program() -> Any:
        rank = dist.get_rank()
        x = torch.randn(4, 64) * (rank + 1)
        y = torch.nn.functional.silu(x) @ x.t() + x.sum() + (x * x).sum(1)
        with torch.device("meta"):
            m = torch.empty(8, 8) * 2
        t = x.clone()
        dist.all_reduce(t)
        return [y, t, (x > 0).sum().item(), m.shape]

    monkeypatch.setenv("SHARDVIZ_ENGINE_CHECK", "1")
    _both(4, program)

    def wrong(func: Any, info: Any, args: Any, kwargs: Any) -> Any:
        out = right(func, info, args, kwargs)
        if func is torch.ops.aten.mul.Tensor and type(out) is batched.StackedLocalTensor:
            out.stack[2] += 1  # rank 2 off by one
        return out

    right = batched._pointwise
    monkeypatch.setattr(batched, "_pointwise", wrong)
    with pytest.raises(batched.EngineMismatch, match=r"aten\.mul\.Tensor.*rank 2 values differ by 1"):
        _run("batched", 4, program)


@needs_batched
def test_matrix_products_of_slices_off_the_kernels_alignment_match_per_rank_bits():
    # A rank's [3, 10] float32 slice of a stack starts 120 bytes after the previous one: the
    # matrix kernels took another code path there and rounded the last bit otherwise (FSDP's
    # linear layers on 4 ranks: weights 1 ulp off lockstep's, then plain torch's).
    def program() -> Any:
        rank = dist.get_rank()
        x = torch.randn(3, 10) * (rank + 1)
        w = torch.randn(4, 10)
        b = torch.randn(4)
        y = torch.nn.functional.linear(x, w, b)
        out = [y, torch.addmm(b, x, w.t()), x @ w.t(), torch.bmm(x[None], w.t()[None]), y.t() @ x]
        dist.all_reduce(out[-1])
        return out

    _both(4, program)


@needs_batched
def test_as_strided_with_an_offset_reads_each_ranks_own_memory():
    # FSDP2 cuts each rank's gradient shard out of the reduce-scatter's output with as_strided
    # and a storage offset: on slices of one stack, every rank read rank 0's shard.
    def program() -> Any:
        rank = dist.get_rank()
        t = (torch.arange(12.0) * (rank + 1)).reshape(3, 4) + 0
        dist.all_reduce(t.clone())
        return [torch.as_strided(t, (2, 2), (4, 1), 5), t.as_strided((3,), (2,), 1).clone() * 2]

    _both(4, program)


@needs_batched
def test_as_strided_is_a_view_that_sees_later_writes():
    # FSDP2's unsharded parameter is an as_strided view of its all-gather buffer, which each step
    # gathers into anew: the batched engine made it a stacked copy, stale from the second step.
    def program() -> Any:
        rank = dist.get_rank()
        buf = torch.zeros(2 * 8)
        dist.all_gather_into_tensor(buf, torch.ones(8) * (rank + 1))
        param = torch.as_strided(buf, (4, 4), (4, 1), 0)
        dist.all_gather_into_tensor(buf, torch.arange(8.0) * (rank + 1))
        buf.add_(rank)
        return [param.clone(), buf]

    _both(2, program)


@needs_batched
def test_memory_a_program_dropped_is_free_as_on_lockstep():
    # The per-rank kernels' slices of their input stacks were held in a reference cycle, so a
    # stack the program dropped stayed counted until the garbage collector ran (test_memory's
    # FSDP2 step ended with 2820 bytes a rank where lockstep counts 2048). The collector is off,
    # as between its runs.
    def counted(engine: str) -> tuple[list[int], list[int]]:
        sv.use("local", world_size=2, engine=engine)
        torch.manual_seed(0)
        gc.disable()
        try:
            with sv.record(memory=True) as trace:
                x = torch.randn(4, 16)
                w = torch.randn(16, 8)
                y = x @ w
                del x
                z = (y @ w.t()).sum()
                del y
        finally:
            gc.enable()
        assert z is not None
        return trace.memory.end.tolist(), trace.memory.peak.tolist()

    assert counted("batched") == counted("lockstep")


@needs_batched
def test_a_shard_cut_from_a_stack_has_each_ranks_own_storage_offset():
    # A shard held as slices of one stack reported each slice's offset in the stack (0, 2, 4, 6):
    # a per-rank offset in the DTensor, whose data_ptr() then failed ("symbolic sizes"), and
    # copy.deepcopy with it. Lockstep: offset 0 on every rank.
    def program() -> Any:
        mesh = init_device_mesh("cpu", (4,))
        dt = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
        assert dt.storage_offset() == 0 and dt.to_local().storage_offset() == 0
        c = copy.deepcopy(dt)
        return [c, c.redistribute(mesh, [Replicate()])]

    _both(4, program)


@needs_batched
def test_a_factory_on_a_local_shard_records_no_op_the_ranks_do_not_run():
    # The differential test's Partial inputs: torch.full_like on a shard taken with to_local(),
    # the recorder reading each rank's values. The stacked tensor's per-rank views referred back
    # to it, a cycle that kept it alive: torch then handed the user a detached alias of the
    # result, and the recorder showed an aten.detach no rank runs (lockstep records none).
    def program() -> Any:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        local = distribute_tensor(torch.arange(4.0), mesh, [Replicate(), Replicate()]).to_local()
        for m in range(2):
            first = (torch.ones(()) * mesh.get_local_rank(m) == 0).float()
            share = torch.full_like(local, 0.5)
            local = first * (local - share) + (1 - first) * share
        return [local, torch.zeros_like(local), torch.full_like(local, 2.0)]

    _both(4, program)


@needs_batched
def test_a_large_buffer_written_unseen_after_a_collective_keeps_the_collectives_values():
    # Lockstep aliases a large buffer and drops its values when a write bypasses dispatch; a rank's
    # buffer here is a slice of one stack, copied at once: the values the collective left, by hand.
    sv.use("local", world_size=4, engine="batched")
    n = 20_000
    with warnings.catch_warnings(record=True) as caught, sv.record() as trace:
        warnings.simplefilter("always")
        t = sv.per_rank(lambda r: torch.full((n,), float(r)))
        dist.all_reduce(t)
        assert _torch.local_tensors(t)[1].untyped_storage().nbytes() == 4 * n * 4  # one stack
        with _torch.no_dispatch():
            for x in _torch.local_tensors(t).values():
                x.fill_(-1.0)
    (c,) = trace.collectives()
    for r in range(4):
        assert c.inputs[r].values is not None and bool((c.inputs[r].values == r).all())
        assert c.outputs[r].values is not None and bool((c.outputs[r].values == 6.0).all())
    assert not [w for w in caught if issubclass(w.category, SimulationWarning)]


# --- torch.compile: Dynamo's fake copies of the stacked tensors, AOTAutograd's graphs on them ---------


def _compiled_step(backend: str, x: torch.Tensor, w: torch.Tensor) -> Callable[[], Any]:
    """A compiled DTensor function on a (2, 2) mesh, a backward through it, then a second call
    (the cached code). Each rank's [3, 5] and [5, 7] float32 shards sit 60 and 140 bytes apart in
    a stack: off the matrix kernels' alignment, where a compiled graph's per-rank products must
    still give each rank's own bits."""

    def program() -> Any:
        torch._dynamo.reset()  # nothing compiled for the other engine is reused
        mesh = init_device_mesh("cpu", (2, 2))

        def f(x: DTensor, w: DTensor) -> Any:
            y = torch.tanh(x) @ w  # a partial sum over the second mesh dim
            return y.redistribute(mesh, [Shard(0), Replicate()]) * 3

        step = torch.compile(f, backend=backend)
        dw = distribute_tensor(w.clone().requires_grad_(), mesh, [Replicate(), Shard(0)])
        y = step(distribute_tensor(x, mesh, [Shard(0), Shard(1)]), dw)
        y.to_local().sum().backward()
        again = step(distribute_tensor(x * 2, mesh, [Shard(0), Shard(1)]), dw)
        return [y, dw.grad, again, again.full_tensor()]

    return program


@needs_batched
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_gives_lockstep_traces_and_bits_and_plain_torch_values(backend):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(6, 10, generator=g), torch.randn(10, 7, generator=g)
    t_lock, out_lock, _ = _run("lockstep", 4, _compiled_step(backend, x, w))
    t_bat, out_bat, mode = _run("batched", 4, _compiled_step(backend, x, w))
    assert type(mode).__name__ == "BatchedLocalTensorMode" and mode.batched_ops > 0
    _same_bits(out_bat, out_lock)
    assert t_bat == t_lock and len(t_bat.collectives()) > 0
    # plain torch on the global tensors: rank (i, j) holds rows 3i..3i+2 of y and of w.grad's
    # share j (each of the two ranks of a row block summed its own 3 rows)
    wg = w.clone().requires_grad_()
    yg = torch.tanh(x) @ wg
    (yg * 3).sum().backward()
    y, gw, again, full = out_bat
    for r in range(4):
        i, j = divmod(r, 2)
        torch.testing.assert_close(y[r], 3 * yg.detach()[3 * i : 3 * i + 3], msg=f"rank {r}")
        torch.testing.assert_close(full[r], 3 * torch.tanh(x * 2) @ w, msg=f"rank {r}")
        torch.testing.assert_close(again[r], full[r][3 * i : 3 * i + 3], msg=f"rank {r}")
        assert gw[r].shape == (5, 7), f"rank {r}"
    # the two ranks of a column share hold the gradient of their half of the rows each
    for j in range(2):
        total = gw[j] + gw[2 + j]
        torch.testing.assert_close(total, wg.grad[5 * j : 5 * j + 5], msg=f"share {j}")


@needs_batched
@pytest.mark.timeout(240)
def test_aot_eager_graph_products_on_stack_slices_give_each_ranks_own_bits():
    # AOTAutograd's graph runs each rank's matrix kernels itself, on the slices of the stacks it
    # is handed: a [3, 10] float32 shard sits 120 bytes after the previous rank's, and the
    # kernels rounded the last bit otherwise there (ranks 1 and 3 one ulp off lockstep's).
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(12, 10, generator=g) * 3, torch.randn(4, 10, generator=g)
    b = torch.randn(4, generator=g)

    def program() -> Any:
        torch._dynamo.reset()
        mesh = init_device_mesh("cpu", (4,))

        def f(x: DTensor, w: DTensor, b: DTensor) -> Any:
            y = torch.nn.functional.linear(x, w, b)
            return [y, torch.addmm(b, x, w.t()), x @ w.t(), y.t() @ x]

        # Made under the simulation, the replicated ones are LocalTensors (a plain tensor
        # distributed as Replicate stays plain, which AOTAutograd cannot trace beside
        # LocalTensors: torch's limit, lockstep too).
        args = [distribute_tensor(x, mesh, [Shard(0)])] + [
            distribute_tensor(torch.zeros(t.shape) + t, mesh, [Replicate()]) for t in (w, b)
        ]
        return torch.compile(f, backend="aot_eager")(*args)

    t_lock, out_lock, _ = _run("lockstep", 4, program)
    t_bat, out_bat, _ = _run("batched", 4, program)
    _same_bits(out_bat, out_lock)
    assert t_bat == t_lock
    for r in range(4):  # plain torch on each rank's rows
        rows = x[3 * r : 3 * r + 3]
        want = torch.nn.functional.linear(rows, w, b)
        torch.testing.assert_close(out_bat[0][r], want, msg=f"rank {r}")
        torch.testing.assert_close(out_bat[1][r], want, msg=f"rank {r}")
        torch.testing.assert_close(out_bat[2][r], rows @ w.t(), msg=f"rank {r}")
        torch.testing.assert_close(out_bat[3][r], want.t() @ rows, msg=f"rank {r}")


@needs_batched
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_writing_an_input_in_place_with_nan_inf_and_bf16(backend):
    g = torch.randn(12, 3, generator=torch.Generator().manual_seed(4))
    g[1, 1], g[7, 0] = float("nan"), float("inf")
    wg = torch.randn(12, 3, generator=torch.Generator().manual_seed(5))

    def program() -> Any:
        torch._dynamo.reset()
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(g, mesh, [Shard(0)])
        w = distribute_tensor(wg, mesh, [Shard(0)])

        def f(x: DTensor, w: DTensor) -> Any:
            x.mul_(2)
            return (x * w).relu().to(torch.bfloat16), x.sum()

        step = torch.compile(f, backend=backend)
        return [*step(x, w), *step(x, w), x]

    t_lock, out_lock, _ = _run("lockstep", 4, program)
    t_bat, out_bat, _ = _run("batched", 4, program)
    _same_bits(out_bat, out_lock)
    assert t_bat == t_lock
    first, _, second, _, x = out_bat
    for r in range(4):  # plain torch: the input written twice, the compiled code run on each
        rows, ws = g[3 * r : 3 * r + 3], wg[3 * r : 3 * r + 3]
        torch.testing.assert_close(x[r], rows * 4, equal_nan=True)
        torch.testing.assert_close(first[r], (rows * 2 * ws).relu().bfloat16(), equal_nan=True)
        torch.testing.assert_close(second[r], (rows * 4 * ws).relu().bfloat16(), equal_nan=True)


@needs_batched
@pytest.mark.timeout(120)
def test_torch_compile_of_uneven_shards_fails_as_on_lockstep():
    # Per-rank sizes are per-rank ints, which Dynamo cannot trace (torch's limit, lockstep too):
    # the batched engine raises torch's own error, with shardviz's way out, as lockstep does.
    def program() -> Any:
        torch._dynamo.reset()
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.arange(10.0), mesh, [Shard(0)])  # 3, 3, 2, 2 rows
        return torch.compile(lambda t: t * 2, backend="eager")(x)

    errors = []
    for engine in ("lockstep", "batched"):
        with pytest.raises(Exception) as e:
            _run(engine, 4, program)
        errors.append(e.value)
    lock, bat = errors
    assert type(bat) is type(lock) and type(bat).__module__.startswith("torch")
    assert str(bat).split("\n")[0] == str(lock).split("\n")[0]
    assert "shardviz:" in str(bat) and "sv.use('gloo'" in str(bat)


@needs_batched
def test_engine_switch_and_default():
    sv.use("local", world_size=2, engine="batched")
    b = choose.current()
    assert b.engine == "batched" and "engine='batched'" in repr(b)
    again = b.restart()
    session.install(again)
    assert again.engine == "batched"
    sv.use("local", world_size=2, engine="lockstep")
    assert choose.current().engine == "lockstep"


def test_the_default_engine_is_batched_from_torch_2_13(monkeypatch):
    monkeypatch.delenv("SHARDVIZ_ENGINE", raising=False)
    sv.use("local", world_size=2)
    want = "batched" if TORCH >= (2, 13) else "lockstep"
    assert choose.current().engine == want
    assert choose.current().key() == ("local", 2)  # the key the local backend always had
    mode = type(choose.current()._mode).__name__  # type: ignore[attr-defined]
    assert mode == ("BatchedLocalTensorMode" if want == "batched" else "LocalTensorMode")


@needs_batched
def test_an_engine_named_in_sv_use_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("SHARDVIZ_ENGINE", "lockstep")
    try:
        sv.use("local", world_size=2, engine="batched")
        assert choose.current().engine == "batched"
        assert choose.current().key() == ("local", 2)  # the default engine's key
        sv.use("local", world_size=2)  # the environment's engine: another backend
        assert choose.current().engine == "lockstep"
        assert choose.current().key() == ("local", 2, ("engine", "lockstep"))
    finally:
        monkeypatch.delenv("SHARDVIZ_ENGINE")
        sv.use("local")


@pytest.mark.skipif(TORCH >= (2, 13), reason="the refusal is for torch below 2.13")
def test_below_torch_2_13_the_batched_engine_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match=r"needs torch >= 2\.13 .*engine='lockstep'"):
        sv.use("local", world_size=2, engine="batched")
