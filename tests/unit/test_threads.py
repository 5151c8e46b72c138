"""sv.use("threads"): one thread per rank, plain tensors and plain ints, collectives meeting across
threads. Expectations are plain torch on the whole tensor, hand-written values, or the lockstep
simulator's trace of the same code (compared field by field)."""

from __future__ import annotations

import math
import time
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

import shardviz as sv
from shardviz.backends import choose
from shardviz.capture import torch as _torch
from shardviz.capture.threadpg import CollectiveMismatchError
from shardviz.data.events import CollectiveEvent, OpEvent, RedistributeEvent
from shardviz.errors import BackendError, DeadlockError

N = 4


@pytest.fixture(autouse=True)
def threads4():
    sv.use("threads", world_size=N)
    yield
    assert _torch.dispatch_mode_stack() == []
    assert not dist.is_initialized() or dist.get_backend() == "fake"


def _np(snap):
    return None if snap is None else snap.values


# --- Python that needs a plain int per rank ----------------------------------------------------


@pytest.mark.timeout(60)
def test_if_rank_zero_branches():
    def fn():
        rank = dist.get_rank()
        assert isinstance(rank, int)
        t = torch.full((3,), float(rank + 1))
        if rank == 0:
            t = t * 10  # only rank 0 scales its part
            print("rank zero here")
        dist.all_reduce(t)
        return t

    trace = sv.run(fn)
    # 10 + 2 + 3 + 4, by hand
    for r in range(N):
        assert trace.results[r].tolist() == [19.0, 19.0, 19.0]
    (ar,) = trace.collectives()
    assert ar.op == "all_reduce" and ar.groups == ((0, 1, 2, 3),)
    assert _np(ar.inputs[0]).tolist() == [10.0] * 3 and _np(ar.inputs[3]).tolist() == [4.0] * 3
    assert all(_np(ar.outputs[r]).tolist() == [19.0] * 3 for r in range(N))


@pytest.mark.timeout(60)
def test_rank_branch_output_is_tagged(capsys):
    def fn():
        if dist.get_rank() == 2:
            print("only rank two")

    sv.run(fn)
    assert capsys.readouterr().out == "[rank 2] only rank two\n"


@pytest.mark.timeout(60)
def test_per_rank_ints_index_python_lists():
    x = torch.arange(24.0).reshape(8, 3)

    def fn():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh.get_coordinate()
        chunks = list(x.chunk(2))  # a Python list indexed by the mesh coordinate
        rows = chunks[dp].chunk(2)[tp]
        out = [torch.zeros_like(rows) for _ in range(N)]
        dist.all_gather(out, rows)
        return torch.cat(out), (dp, tp)

    trace = sv.run(fn)
    for r in range(N):
        whole, coord = trace.results[r]
        assert torch.equal(whole, x)  # the four quarters in rank order are x again
        assert coord == (r // 2, r % 2)


def _hand_cross_entropy(logits, target, vocab):
    """A loss-parallel cross-entropy written for one rank's vocabulary slice, the way
    torchtitan-style code does it: plain ints for the slice bounds."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunk = -(-vocab // n)
    start = min(vocab, rank * chunk)
    end = min(vocab, start + chunk)
    local = logits[:, start:end]
    b = logits.shape[0]
    m = local.max(dim=1).values if end > start else torch.full((b,), -float("inf"))
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    s = (local - m[:, None]).exp().sum(1)
    dist.all_reduce(s)
    mine = (target >= start) & (target < end)
    picked = torch.zeros(b)
    if end > start:
        idx = (target - start).clamp(0, end - start - 1)
        picked = torch.where(mine, local.gather(1, idx[:, None])[:, 0], picked)
    dist.all_reduce(picked)
    return (m + s.log() - picked).mean(), (start, end)


@pytest.mark.timeout(60)
def test_loss_parallel_cross_entropy_with_min_of_vocab():
    torch.manual_seed(0)
    vocab = 10  # 3 + 3 + 3 + 1 columns: the last rank's slice is cut by min(vocab, ...)
    logits, target = torch.randn(5, vocab), torch.randint(0, vocab, (5,))
    want = F.cross_entropy(logits, target)

    trace = sv.run(_hand_cross_entropy, logits, target, vocab)
    for r in range(N):
        loss, bounds = trace.results[r]
        torch.testing.assert_close(loss, want)
        assert bounds == [(0, 3), (3, 6), (6, 9), (9, 10)][r]
    assert [e.reduce_op for e in trace.collectives()] == ["max", "sum", "sum"]


@pytest.mark.timeout(60)
def test_torch_loss_parallel_forward_and_backward():
    torch.manual_seed(1)
    logits, target = torch.randn(6, 12), torch.randint(0, 12, (6,))
    ref = logits.clone().requires_grad_()
    want = F.cross_entropy(ref, target)
    want.backward()

    def fn():
        mesh = init_device_mesh("cpu", (N,))
        dl = distribute_tensor(logits, mesh, [Shard(1)], src_data_rank=None).requires_grad_()
        with loss_parallel():  # a process-wide switch in torch: each rank thread keeps its own
            loss = F.cross_entropy(dl, target)
            loss.backward()
        return loss.full_tensor(), dl.grad.full_tensor()

    trace = sv.run(fn)
    for r in range(N):
        loss, grad = trace.results[r]
        torch.testing.assert_close(loss, want.detach())
        torch.testing.assert_close(grad, ref.grad)


# --- the same trace as the lockstep simulator ----------------------------------------------------


def _same_events(a, b):
    """Field by field: kind, op, groups, mesh dim, root, reductions, placements, plans, source
    lines, modules, phases, and every rank's buffer values."""
    assert len(a.events) == len(b.events), (str(a), str(b))
    for ea, eb in zip(a.events, b.events, strict=True):
        assert type(ea) is type(eb)
        assert (ea.id, ea.parent, ea.module, ea.phase) == (eb.id, eb.parent, eb.module, eb.phase)
        assert (ea.source.line, ea.source.text) == (eb.source.line, eb.source.text)
        if isinstance(ea, CollectiveEvent):
            assert (ea.op, ea.impl, ea.groups, ea.root, ea.reduce_op) == (
                eb.op,
                eb.impl,
                eb.groups,
                eb.root,
                eb.reduce_op,
            )
            assert (ea.mesh_dim, ea.mesh_dim_name) == (eb.mesh_dim, eb.mesh_dim_name)
            # A scatter reads only its root's list: real ranks (and the threads) pass none
            # elsewhere, where the lockstep simulator, which cannot branch on the rank, passes it.
            unread = {r for g in ea.groups for r in g} - set(ea.roots()) if ea.op == "scatter" else set()
            assert {r: n for r, n in ea.nbytes.items() if r not in unread} == {
                r: n for r, n in eb.nbytes.items() if r not in unread
            }
            assert all(eb.nbytes[r] == 0 for r in unread)
            for side in ("inputs", "outputs"):
                sa, sb = getattr(ea, side), getattr(eb, side)
                assert sorted(sa) == sorted(sb)
                for r in sa:
                    if side == "inputs" and r in unread:
                        continue
                    la = sa[r] if isinstance(sa[r], list) else [sa[r]]
                    lb = sb[r] if isinstance(sb[r], list) else [sb[r]]
                    for x, y in zip(la, lb, strict=True):
                        assert (x.shape, x.dtype) == (y.shape, y.dtype)
                        np.testing.assert_array_equal(x.values, y.values)
        elif isinstance(ea, RedistributeEvent):
            assert (ea.src, ea.dst, ea.plan, ea.explicit, ea.before, ea.after) == (
                eb.src,
                eb.dst,
                eb.plan,
                eb.explicit,
                eb.before,
                eb.after,
            )
        elif isinstance(ea, OpEvent):
            assert (ea.name, ea.input_placements, ea.output_placements) == (
                eb.name,
                eb.input_placements,
                eb.output_placements,
            )


def _both(fn):
    sv.use("local", world_size=N)
    lockstep = sv.run(fn, values="all")
    sv.use("threads", world_size=N)
    threaded = sv.run(fn, values="all")
    assert threaded.backend == "threads" and lockstep.backend == "local"
    return lockstep, threaded


def _redistributes():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = distribute_tensor(torch.arange(40.0).reshape(10, 4), mesh, [Shard(0), Shard(1)])
    a = x.redistribute(mesh, [Shard(0), Replicate()])
    b = a.redistribute(mesh, [Replicate(), Replicate()])
    p = DTensor.from_local(torch.ones(4, 4), mesh, [Replicate(), Partial()])
    c = p.redistribute(mesh, [Replicate(), Replicate()])
    d = (p * 2).redistribute(mesh, [Replicate(), Shard(0)])
    return b, c, d.to_local()


@pytest.mark.timeout(120)
def test_redistributes_trace_like_the_lockstep_simulator():
    lockstep, threaded = _both(_redistributes)
    _same_events(lockstep, threaded)
    assert [e.op for e in threaded.collectives()] == [
        "scatter",
        "scatter",
        "all_gather",
        "all_gather",
        "all_reduce",
        "reduce_scatter",
    ]
    whole = torch.arange(40.0).reshape(10, 4)
    for r in range(N):
        b, c, d = threaded.results[r]
        assert torch.equal(b, whole)
        assert torch.equal(c, torch.full((4, 4), 2.0))  # a Partial(sum) of ones over 2 ranks
        assert torch.equal(d, torch.full((2, 4), 4.0))  # each tp rank holds 2: summed over 2, rows split


@pytest.mark.timeout(120)
def test_shard_to_shard_records_what_cpu_process_groups_do():
    """S(0) -> S(1): DTensor on a CPU process group (gloo, and the threads) gathers then cuts; the
    lockstep simulator runs its all-to-all instead. The values are the same."""

    def fn():
        mesh = init_device_mesh("cpu", (N,))
        x = distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [Shard(0)])
        return x.redistribute(mesh, [Shard(1)]).to_local()

    lockstep, threaded = _both(fn)
    (red,) = [e for e in threaded.events if isinstance(e, RedistributeEvent)]
    assert [e.op for e in threaded.collectives() if e.parent == red.id] == ["all_gather"]
    assert [e.op for e in lockstep.collectives()][-1] == "all_to_all"
    for r in range(N):
        assert torch.equal(threaded.results[r], torch.arange(32.0).reshape(8, 4)[:, r : r + 1])
        assert torch.equal(threaded.results[r], lockstep.results[r])


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _tp_step():
    torch.manual_seed(0)
    model = _MLP()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.arange(32.0).reshape(4, 8) / 32
    y = tp(x)
    y.sum().backward()
    return y, tp.up.weight.grad.full_tensor(), tp.down.weight.grad.full_tensor()


@pytest.mark.timeout(120)
def test_tp_mlp_forward_backward_like_the_lockstep_simulator_and_plain_torch():
    lockstep, threaded = _both(_tp_step)
    _same_events(lockstep, threaded)
    ar = [e for e in threaded.collectives() if e.op == "all_reduce"]
    assert ar and ar[0].module == "_MLP.down" and ar[0].phase == "forward" and ar[0].mesh_dim_name == "tp"
    assert ar[0].groups == ((0, 1), (2, 3))
    # plain torch, one process
    torch.manual_seed(0)
    ref = _MLP()
    x = torch.arange(32.0).reshape(4, 8) / 32
    y = ref(x)
    y.sum().backward()
    for r in range(N):
        out, g_up, g_down = threaded.results[r]
        torch.testing.assert_close(out, y.detach())
        torch.testing.assert_close(g_up, ref.up.weight.grad)
        torch.testing.assert_close(g_down, ref.down.weight.grad)


# --- point-to-point --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_send_recv_between_two_ranks():
    def fn():
        if dist.get_rank() == 0:
            dist.send(torch.tensor([1.0, 2.0]), dst=3)
            return None
        if dist.get_rank() == 3:
            buf = torch.zeros(2)
            dist.recv(buf, src=0)
            return buf
        return None

    trace = sv.run(fn)
    assert trace.results[3].tolist() == [1.0, 2.0]
    send, recv = trace.collectives()
    assert (send.op, send.groups, send.root, send.params["peer"]) == ("send", ((0, 3),), 1, recv.id)
    assert (recv.op, recv.groups, recv.root, recv.params["peer"]) == ("recv", ((0, 3),), 0, send.id)
    assert _np(send.inputs[0]).tolist() == [1.0, 2.0]
    assert _np(recv.inputs[0]).tolist() == [1.0, 2.0] and _np(recv.outputs[3]).tolist() == [1.0, 2.0]
    assert send.source.text == "dist.send(torch.tensor([1.0, 2.0]), dst=3)"


@pytest.mark.timeout(60)
def test_a_recv_takes_the_same_elements_in_another_shape_and_refuses_another_count():
    # As real ranks, which move bytes: a 0-dim tensor into a (1,) buffer (torch 2.11/2.12's
    # pipeline warm-up), six elements into a (2, 3) one; another count is refused.
    def fn(sent_shape, buf_shape):
        if dist.get_rank() == 0:
            dist.send(torch.arange(float(math.prod(sent_shape))).reshape(sent_shape) + 1, dst=1)
        elif dist.get_rank() == 1:
            buf = torch.zeros(buf_shape)
            dist.recv(buf, src=0)
            return buf
        return None

    for sent, buf in (((), (1,)), ((6,), (2, 3))):
        got = sv.run(fn, sent, buf).results[1]
        assert torch.equal(got, torch.arange(float(math.prod(sent))).reshape(buf) + 1), (sent, buf, got)
    with pytest.raises(Exception, match=r"receive buffer is float32\[2\] but rank 0 sent float32\[3\]"):
        sv.run(fn, (3,), (2,))


@pytest.mark.timeout(60)
def test_ring_of_irecv_then_send():
    def fn():
        rank = dist.get_rank()
        y = torch.zeros(2)
        req = dist.irecv(y, (rank - 1) % N)  # posted before the send: it must not block here
        dist.send(torch.full((2,), float(rank)), (rank + 1) % N)
        req.wait()
        return y

    trace = sv.run(fn)
    assert {r: trace.results[r].tolist() for r in range(N)} == {r: [float((r - 1) % N)] * 2 for r in range(N)}
    send, recv = trace.collectives()
    assert sorted(send.groups) == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert sorted(recv.groups) == sorted(send.groups) and recv.id > send.id
    assert {r: _np(recv.outputs[r]).tolist() for r in range(N)} == {
        r: [float((r - 1) % N)] * 2 for r in range(N)
    }


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_two_ranks_receiving_from_each_other_is_a_named_deadlock():
    def fn():
        rank = dist.get_rank()
        if rank < 2:
            buf = torch.zeros(1)
            dist.recv(buf, src=1 - rank)

    t0 = time.monotonic()
    with pytest.raises(DeadlockError) as info:
        sv.run(fn)
    assert time.monotonic() - t0 < 10  # at once: no process-group timeout to wait out
    text = str(info.value)
    assert "rank 0: in recv from rank 1" in text and "rank 1: in recv from rank 0" in text
    assert "dist.recv(buf, src=1 - rank)" in text
    assert "rank 2: finished" in text and "rank 3: finished" in text
    assert "ranks 0 and 1 wait for each other" in text


@pytest.mark.timeout(30)
def test_mismatched_collective_is_named_at_once():
    def fn():
        x = torch.ones(2)
        if dist.get_rank() == 0:
            dist.all_reduce(x)
        else:
            dist.all_gather([torch.zeros(2) for _ in range(N)], x)

    t0 = time.monotonic()
    with pytest.raises(CollectiveMismatchError) as info:
        sv.run(fn)
    assert time.monotonic() - t0 < 10  # at once: no process-group timeout to wait out
    text = str(info.value)
    assert "different collectives" in text
    assert "rank 0: all_reduce(sum) of float32[2]" in text and "dist.all_reduce(x)" in text
    assert "rank 1: all_gather of float32[2]" in text and "dist.all_gather([torch.zeros(2)" in text


@pytest.mark.timeout(30)
def test_mismatched_shapes_are_named():
    def fn():
        dist.all_reduce(torch.ones(2 + (dist.get_rank() == 1)))

    with pytest.raises(CollectiveMismatchError, match=r"different shapes") as info:
        sv.run(fn)
    assert "float32[2]" in str(info.value) and "float32[3]" in str(info.value)


@pytest.mark.timeout(30)
def test_a_collective_some_ranks_skip_is_a_deadlock_naming_them():
    def fn():
        if dist.get_rank() != 2:
            dist.all_reduce(torch.ones(1))

    with pytest.raises(DeadlockError, match=r"waiting for rank 2") as info:
        sv.run(fn)
    assert "rank 2: finished" in str(info.value)
    assert "rank 0 waits for rank 2, which finished without taking part" in str(info.value)


@pytest.mark.timeout(30)
def test_an_exception_on_one_rank_ends_the_run_naming_it():
    def fn():
        if dist.get_rank() == 1:
            raise ValueError("bad batch on this rank")
        dist.all_reduce(torch.ones(1))

    with pytest.raises(ValueError, match="bad batch") as info:
        sv.run(fn)
    note = "\n".join(info.value.__notes__)
    assert "raised on rank 1 of 4" in note
    assert "rank 0: in all_reduce(sum)" in note and "waiting for ranks 1, 2, 3" in note
    # the ranks are usable again
    assert sv.run(lambda: dist.get_rank()).results == {0: 0, 1: 1, 2: 2, 3: 3}


# --- the front ends -------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_record_and_options_only_the_lockstep_simulator_has_are_refused():
    with pytest.raises(BackendError, match=r"sv\.run\(fn\)"), sv.record():
        pass
    with pytest.raises(BackendError, match="already runs in its own thread"):
        sv.run(lambda: None, threads=2)
    with pytest.raises(NotImplementedError, match="lockstep simulator only"):
        sv.run(lambda: None, memory=True)
    with pytest.raises(BackendError, match="inside a rank's code"):
        sv.per_rank(lambda r: torch.ones(1) * r)
    trace = sv.run(lambda: sv.per_rank(lambda r: torch.arange(3.0) + r))
    assert {r: trace.results[r].tolist() for r in range(N)} == {r: [r, r + 1.0, r + 2.0] for r in range(N)}


@pytest.mark.timeout(30)
def test_each_rank_gets_its_own_copy_of_what_it_reads():
    shared = torch.zeros(2)
    model = nn.Linear(2, 2, bias=False)
    weight = model.weight.detach().clone()
    seen: list[int] = []

    def fn():
        rank = dist.get_rank()
        shared.add_(rank)  # each rank's own copy, as on real ranks
        with torch.no_grad():
            model.weight.fill_(rank)
        seen.append(rank)
        return shared.clone(), model.weight.sum().item()

    trace = sv.run(fn)
    for r in range(N):
        assert trace.results[r][0].tolist() == [r, r] and trace.results[r][1] == 4 * r
    assert shared.tolist() == [0.0, 0.0] and torch.equal(model.weight, weight)
    assert seen == []  # the notebook's list is not the ranks'


def _shell(**names):
    return types.SimpleNamespace(user_ns=dict(names))


@pytest.mark.timeout(60)
def test_spmd_cells_keep_names_per_rank_and_show_gathers_every_shard():
    shell = _shell(torch=torch, dist=dist, sv=sv, init_device_mesh=init_device_mesh)
    shell.user_ns.update(distribute_tensor=distribute_tensor, Shard=Shard)
    backend = choose.current()
    value = backend.run_cell(
        "rank = dist.get_rank()\n"
        "mesh = init_device_mesh('cpu', (4,))\n"
        "x = distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])\n"
        "rank",
        shell,
    )
    assert value == {0: 0, 1: 1, 2: 2, 3: 3}
    assert "x" not in shell.user_ns  # names live on the ranks
    local = backend.run_cell("x.to_local() + rank", shell)
    assert _torch.is_local_tensor(local)
    whole = torch.arange(12.0).reshape(6, 2)
    expected = [whole[0:2], whole[2:4] + 1, whole[4:6] + 2, whole[6:6] + 3]
    for r, want in enumerate(expected):
        assert torch.equal(_torch.local_tensors(local)[r], want)
    view = backend.run_cell("sv.show(x)", shell)  # the view of every rank's shard, in the notebook
    assert view.tensor_layout == sv.layout((6, 2), (4,), ["S(0)"])
    np.testing.assert_array_equal(view.global_values(), whole.numpy())
    assert "S(0)" in repr(view)
    text = backend.run_cell("str(sv.layout(x))", shell)
    assert text == str(sv.layout((6, 2), (4,), ["S(0)"]))
    assert sv.last_trace().backend == "threads"


@pytest.mark.timeout(60)
def test_spmd_cell_reads_a_notebook_tensor_as_its_own_copy():
    shell = _shell(torch=torch, dist=dist, big=torch.zeros(3))
    backend = choose.current()
    out = backend.run_cell("big.add_(dist.get_rank())\nbig", shell)
    assert [_torch.local_tensors(out)[r].tolist() for r in range(N)] == [[float(r)] * 3 for r in range(N)]
    assert shell.user_ns["big"].tolist() == [0.0, 0.0, 0.0]
    shell.user_ns["big"] = torch.ones(3)  # the notebook rebinds the name: the ranks see the new one
    out = backend.run_cell("big", shell)
    assert [_torch.local_tensors(out)[r].tolist() for r in range(N)] == [[1.0] * 3] * N


@pytest.mark.timeout(120)
def test_spmd_compare_runs_the_lockstep_simulator_next_to_the_threads():
    from shardviz.compare import compare_cell

    shell = _shell(torch=torch, init_device_mesh=init_device_mesh, distribute_tensor=distribute_tensor)
    shell.user_ns.update(Shard=Shard, Replicate=Replicate)
    cmp = compare_cell(
        "mesh = init_device_mesh('cpu', (4,))\n"
        "x = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])\n"
        "x.redistribute(mesh, [Replicate()]).to_local().sum()",
        shell,
    )
    assert cmp.ok, str(cmp)
    assert cmp.real.backend == "threads" and len(cmp.real.collectives()) == 2

    def fn():
        t = torch.arange(4.0)
        dist.all_reduce(t)
        return t

    cmp = sv.compare(fn)
    assert cmp.ok, str(cmp)
    assert cmp.real.results[2].tolist() == [0.0, 4.0, 8.0, 12.0]  # four ranks' arange summed


@pytest.mark.timeout(60)
def test_a_threads_trace_saves_loads_and_draws(tmp_path):
    def fn():
        rank = dist.get_rank()
        if rank % 2 == 0:
            dist.send(torch.full((2,), float(rank)), rank + 1)
        else:
            buf = torch.zeros(2)
            dist.recv(buf, rank - 1)
        dist.all_reduce(torch.ones(1))

    trace = sv.run(fn)
    assert [e.op for e in trace.collectives()] == ["send", "recv", "all_reduce"]
    path = trace.save(tmp_path / "t.svtrace")
    again = sv.load(path)
    assert [e.op for e in again.collectives()] == ["send", "recv", "all_reduce"]
    assert again.collectives()[1].params["peer"] == 0
    assert "send" in str(again) and "recv" in str(again)
    assert trace.check() == {}  # every recorded output is what the op gives for its inputs
    assert sv.export_html(trace, tmp_path / "t.html").stat().st_size > 0
    assert sv.play(trace).step == 0


@pytest.mark.timeout(60)
def test_each_rank_has_its_own_generator():
    def fn():
        rank = dist.get_rank()
        torch.manual_seed(100 + rank)
        a = torch.randn(2)
        dist.all_reduce(torch.ones(1))  # the other ranks run (and seed) in between
        return a, torch.randn(2)

    trace = sv.run(fn)
    for r in range(N):
        g = torch.Generator().manual_seed(100 + r)
        a, b = torch.randn(2, generator=g), torch.randn(2, generator=g)
        assert torch.equal(trace.results[r][0], a) and torch.equal(trace.results[r][1], b)
    assert str(sv.run(fn)) == str(trace)  # and the same run gives the same trace


@pytest.mark.timeout(60)
def test_every_c10d_collective_against_plain_torch():
    """Each rank r holds x_r = arange(4) + 10 r; every collective's result is computed here from
    the x_r by hand (plain torch on the whole data)."""
    xs = [torch.arange(4.0) + 10 * r for r in range(N)]
    total = sum(xs)

    def fn():
        r = dist.get_rank()
        x = torch.arange(4.0) + 10 * r
        out = {}
        t = x.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out["max"] = t
        t = x.clone()
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        out["avg"] = t
        big = torch.zeros(4 * N)
        dist.all_gather_into_tensor(big, x)
        out["gather_into"] = big
        small = torch.zeros(1)
        dist.reduce_scatter_tensor(small, x)
        out["reduce_scatter"] = small
        lst = [torch.zeros(1) for _ in range(N)]
        dist.reduce_scatter(lst[0], list(x.chunk(N)))
        out["reduce_scatter_list"] = lst[0]
        t = x.clone()
        dist.broadcast(t, src=2)
        out["broadcast"] = t
        t = x.clone()
        dist.reduce(t, dst=1)
        out["reduce"] = t
        s = torch.zeros(1)
        dist.scatter(s, list(x.chunk(N)) if r == 3 else None, src=3)
        out["scatter"] = s
        g = [torch.zeros(4) for _ in range(N)] if r == 0 else None
        dist.gather(x, g, dst=0)
        out["gather"] = torch.stack(g) if g is not None else None
        a2a = torch.zeros(4)
        dist.all_to_all_single(a2a, x)
        out["all_to_all"] = a2a
        # uneven splits: rank r sends r + 1 rows to each rank
        send = torch.full(((r + 1) * N,), float(r))
        recv = torch.zeros(sum(q + 1 for q in range(N)))
        dist.all_to_all_single(recv, send, [q + 1 for q in range(N)], [r + 1] * N)
        out["all_to_all_uneven"] = recv
        sub = dist.new_group([1, 3])
        if r in (1, 3):
            t = x.clone()
            dist.all_reduce(t, group=sub)
            out["subgroup"] = t
        dist.barrier()
        return out

    trace = sv.run(fn)
    for r in range(N):
        o = trace.results[r]
        assert o["max"].tolist() == xs[-1].tolist()
        torch.testing.assert_close(o["avg"], total / N)
        assert o["gather_into"].tolist() == torch.cat(xs).tolist()
        assert o["reduce_scatter"].tolist() == [total[r].item()]
        assert o["reduce_scatter_list"].tolist() == [total[r].item()]
        assert o["broadcast"].tolist() == xs[2].tolist()
        assert o["reduce"].tolist() == (total if r == 1 else xs[r]).tolist()  # gloo leaves non-roots
        assert o["scatter"].tolist() == [xs[3][r].item()]
        if r == 0:
            assert o["gather"].tolist() == torch.stack(xs).tolist()
        assert o["all_to_all"].tolist() == [xs[q][r].item() for q in range(N)]
        assert o["all_to_all_uneven"].tolist() == [float(q) for q in range(N) for _ in range(q + 1)]
        if r in (1, 3):
            assert o["subgroup"].tolist() == (xs[1] + xs[3]).tolist()
    sub = [e for e in trace.collectives() if e.groups == ((1, 3),)]
    assert len(sub) == 1 and sub[0].op == "all_reduce"
    assert trace.collectives()[-1].op == "barrier"
    assert trace.check() == {}


@pytest.mark.timeout(60)
def test_fsdp2_data_parallel_step_against_plain_torch():
    """FSDP2 on plain tensors: each rank its own batch slice; the reduce-scattered (averaged)
    gradient is the gradient of the mean of the ranks' losses, computed here in one process."""
    from torch.distributed.fsdp import fully_shard

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    x = torch.arange(64.0).reshape(8, 8) / 64

    def fn():
        model = build()
        mesh = init_device_mesh("cpu", (N,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        rank = dist.get_rank()
        loss = model(x[2 * rank : 2 * rank + 2]).sum()
        loss.backward()
        return loss.detach(), model[0].weight.grad.full_tensor(), model[2].bias.grad.full_tensor()

    trace = sv.run(fn)
    ref = build()
    losses = [ref(x[2 * r : 2 * r + 2]).sum() for r in range(N)]
    (sum(losses) / N).backward()
    for r in range(N):
        loss, g0, g2 = trace.results[r]
        torch.testing.assert_close(loss, losses[r].detach())
        torch.testing.assert_close(g0, ref[0].weight.grad)
        torch.testing.assert_close(g2, ref[2].bias.grad)
    ops = [(e.op, e.reduce_op, e.module, e.phase) for e in trace.collectives()]
    assert ops[:2] == [
        ("all_gather", None, "FSDPSequential.0", "forward"),
        ("all_gather", None, "FSDPSequential.2", "forward"),
    ]
    assert ("reduce_scatter", "avg", "FSDPSequential.0", "backward") in ops


@pytest.mark.timeout(60)
def test_fsdp2_gradient_divide_factor_premul_sum_against_plain_torch():
    """A divide factor other than the group size makes FSDP2 reduce-scatter with
    ReduceOp.PREMUL_SUM(1 / factor) (torchtitan sets 1): each member's gradient is scaled by its
    factor, then summed. Expectation: the summed gradients of the ranks' losses / 2, in one process."""
    from torch.distributed.fsdp import fully_shard

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    x = torch.arange(64.0).reshape(8, 8) / 64

    def fn():
        model = build()
        mesh = init_device_mesh("cpu", (N,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for m in (model, model[0], model[2]):  # each module's own parameter group
            m.set_gradient_divide_factor(2.0)
        rank = dist.get_rank()
        model(x[2 * rank : 2 * rank + 2]).sum().backward()
        return model[0].weight.grad.full_tensor(), model[2].bias.grad.full_tensor()

    trace = sv.run(fn)
    ref = build()
    (sum(ref(x[2 * r : 2 * r + 2]).sum() for r in range(N)) / 2).backward()
    for r in range(N):
        g0, g2 = trace.results[r]
        torch.testing.assert_close(g0, ref[0].weight.grad)
        torch.testing.assert_close(g2, ref[2].bias.grad)
    scatters = [e for e in trace.collectives() if e.op == "reduce_scatter"]
    assert scatters and {e.reduce_op for e in scatters} == {"premul_sum"}


@pytest.mark.timeout(60)
def test_restart_gives_new_ranks_without_their_names():
    shell = _shell(dist=dist)
    backend = choose.current()
    backend.run_cell("kept = dist.get_rank() * 2", shell)
    assert backend.run_cell("kept", shell) == {0: 0, 1: 2, 2: 4, 3: 6}
    fresh = sv.restart()
    assert fresh is not backend and fresh.name == "threads"
    assert sv.run(lambda: dist.get_rank()).results == {0: 0, 1: 1, 2: 2, 3: 3}
    with pytest.raises(NameError, match="kept"):
        fresh.run_cell("kept", shell)


@pytest.mark.timeout(30)
def test_a_send_nobody_receives_is_noted():
    def fn():
        if dist.get_rank() == 1:
            dist.send(torch.ones(2), dst=2)  # sends are buffered, as on gloo: rank 1 goes on

    trace = sv.run(fn)
    assert trace.notes == ["sent but never received (no matching recv, or its wait() never called): 1->2"]
    (send,) = trace.collectives()
    assert send.op == "send" and send.params["peer"] is None


@pytest.mark.timeout(60)
def test_a_1f1b_pipeline_selects_its_stage_by_rank():
    """Each rank picks its stage by indexing a list with its pp rank; stage shapes are inferred
    (no input_args); gradients equal the unsplit model's; the timeline is the classic 1F1B one."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def step():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        pp = mesh.get_local_rank("pp")
        part = [full[0:2], full[2:4]][pp]  # the stage this rank holds
        stage = PipelineStage(part, pp, 2, torch.device("cpu"), group=mesh.get_group("pp"))
        schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=nn.MSELoss())
        if pp == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        return part[0].weight.grad

    trace = sv.run(step)
    out = full(x)
    (sum(F.mse_loss(o, t) for o, t in zip(out.chunk(4), y.chunk(4), strict=True)) / 4).backward()
    for r in range(N):
        torch.testing.assert_close(trace.results[r], full[0 if r < 2 else 2].weight.grad)
    tl = sv.pipeline_timeline(trace)
    assert str(tl).splitlines()[:5] == [
        "Pipeline timeline: 4 ranks, 10 steps, bubble 20.0% (F forward, B backward, . idle)",
        "rank 0 |F0 F1 .  B0 F2 B1 F3 B2 .  B3 |",
        "rank 1 |F0 F1 .  B0 F2 B1 F3 B2 .  B3 |",
        "rank 2 |.  F0 B0 F1 B1 F2 B2 F3 B3 .  |",
        "rank 3 |.  F0 B0 F1 B1 F2 B2 F3 B3 .  |",
    ]
    computes = [e for e in trace.events if e.kind == "compute"]
    assert {e.ranks for e in computes} == {(0, 1), (2, 3)}  # one event per stage step, both dp ranks
    acts = [
        e
        for e in trace.collectives()
        if e.op == "send" and e.params.get("pipeline", {}).get("phase") == "forward"
    ]
    assert len(acts) == 4 and all(e.groups == ((0, 2), (1, 3)) for e in acts)


@pytest.mark.timeout(30)
def test_collectives_on_different_groups_at_one_step_are_named():
    def fn():
        pair = dist.new_group([0, 1])  # every rank makes the group, as torch requires
        t = torch.ones(1)
        if dist.get_rank() == 0:
            dist.all_reduce(t)  # the whole world
        elif dist.get_rank() == 1:
            dist.all_reduce(t, group=pair)

    with pytest.raises(DeadlockError) as info:
        sv.run(fn)
    text = str(info.value)
    assert (
        "rank 0 waits for rank 1 in a collective over [0, 1, 2, 3], but rank 1 is in one over [0, 1]" in text
    )
    assert "different groups" in text


@pytest.mark.timeout(180)
def test_a_dtensor_op_in_a_new_thread_after_the_rank_threads_ended_does_not_crash():
    # A CUDA build of torch without a GPU (PyPI's wheels; CI's older-torch tier) keeps the no-op
    # CUDA guard that the first FakeTensorMode installs in that thread's storage: first entered in
    # a rank thread, it died with it and the next FakeTensorMode crashed the process (torch 2.11).
    import subprocess
    import sys

    code = """
import threading, torch
import shardviz as sv
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch._subclasses.fake_tensor import FakeTensorMode

sv.use("threads", world_size=2)

def fn():
    mesh = init_device_mesh("cpu", (2,))
    dt = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    return (dt * 2 + 1).full_tensor()

trace = sv.run(fn)
sv.use("local", world_size=2)  # the rank threads end

def later():
    with FakeTensorMode():
        torch.empty(3) + 1

t = threading.Thread(target=later)
t.start()
t.join()
print("ok", torch.equal(trace.results[0], torch.arange(8.0).reshape(4, 2) * 2 + 1))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == "ok True"
