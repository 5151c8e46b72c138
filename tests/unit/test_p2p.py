"""Point-to-point in the simulator: sv.run(fn, threads=N), merged send/recv events, deadlocks."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

import shardviz as sv
from shardviz.capture import torch as _torch
from shardviz.data.flow import Transfer, transfers
from shardviz.errors import DeadlockError, P2PError

N = 4


@pytest.fixture(autouse=True)
def world4():
    sv.use("local", world_size=N)
    yield
    assert _torch.active_local_mode() is None and _torch.dispatch_mode_stack() == []


def pairs(trace, op):
    return [(e.groups, e.root) for e in trace.collectives() if e.op == op]


def values(snap):
    return snap.values.tolist()


def ring_blocking(rank):
    x = torch.full((2,), float(rank)) + torch.arange(2.0)
    y = torch.zeros(2)
    nxt, prv = (rank + 1) % N, (rank - 1) % N
    if rank % 2 == 0:  # even ranks send first, odd ranks receive first: no deadlock
        dist.send(x, nxt)
        dist.recv(y, prv)
    else:
        dist.recv(y, prv)
        dist.send(x, nxt)
    return y


@pytest.mark.timeout(60)
def test_send_recv_under_record_is_explained():
    with pytest.raises(P2PError, match=r"threads=") as info, sv.record():
        dist.send(torch.ones(2), 1)
    assert "__src_rank__" not in str(info.value)
    assert "Point-to-point and pipelines" in str(info.value)


@pytest.mark.timeout(60)
def test_ring_blocking_send_recv():
    trace = sv.run(ring_blocking, threads=N)
    # rank r receives rank r-1's [r-1, r]
    assert {r: trace.results[r].tolist() for r in range(N)} == {
        0: [3.0, 4.0],
        1: [0.0, 1.0],
        2: [1.0, 2.0],
        3: [2.0, 3.0],
    }
    sends = [e for e in trace.collectives() if e.op == "send"]
    recvs = [e for e in trace.collectives() if e.op == "recv"]
    assert sorted(e.groups for e in sends) == [((0, 1),), ((1, 2),), ((2, 3),), ((3, 0),)]
    assert all(e.root == 1 for e in sends) and all(e.root == 0 for e in recvs)
    for s in sends:
        ((src, dst),) = s.groups
        assert list(s.inputs) == [src] and s.outputs == {}
        assert values(s.inputs[src]) == [float(src), float(src) + 1]
        assert s.inputs[src].shape == (2,) and s.nbytes == {src: 8}
        r = trace.event(s.params["peer"])
        assert r.op == "recv" and r.groups == s.groups and r.params["peer"] == s.id
        assert r.id > s.id  # received after it was sent
        assert values(r.outputs[dst]) == [float(src), float(src) + 1]
        assert r.source is not None and "dist.recv" in r.source.text
        assert transfers(s) == [Transfer(src, dst)] and transfers(r) == [Transfer(src, dst)]
    assert trace.check() == {}
    # the first event: rank 0 sends (thread 0 runs first); rank 1 has posted its recv first
    assert trace.events[0].op == "send" and trace.events[0].groups == ((0, 1),)


@pytest.mark.timeout(60)
def test_isend_irecv():
    def ring(rank):
        x = torch.full((3,), 10.0 * rank)
        y = torch.zeros(3)
        s = dist.isend(x, (rank + 1) % N)
        r = dist.irecv(y, (rank - 1) % N)
        s.wait()
        r.wait()
        return y

    trace = sv.run(ring, threads=N)
    assert {r: trace.results[r].tolist() for r in range(N)} == {
        0: [30.0] * 3,
        1: [0.0] * 3,
        2: [10.0] * 3,
        3: [20.0] * 3,
    }
    recvs = {e.groups[0]: e for e in trace.collectives() if e.op == "recv"}
    assert sorted(recvs) == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert values(recvs[(3, 0)].outputs[0]) == [30.0] * 3


@pytest.mark.timeout(60)
def test_batch_isend_irecv():
    def ring(rank):
        x = torch.full((2, 2), 100.0 + rank)
        y = torch.zeros(2, 2)
        ops = [dist.P2POp(dist.isend, x, (rank + 1) % N), dist.P2POp(dist.irecv, y, (rank - 1) % N)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return y

    trace = sv.run(ring, threads=N)
    assert {r: trace.results[r].tolist() for r in range(N)} == {
        0: [[103.0, 103.0], [103.0, 103.0]],
        1: [[100.0, 100.0], [100.0, 100.0]],
        2: [[101.0, 101.0], [101.0, 101.0]],
        3: [[102.0, 102.0], [102.0, 102.0]],
    }
    assert len(pairs(trace, "send")) == 4 and len(pairs(trace, "recv")) == 4
    assert all(e.inputs[e.groups[0][0]].shape == (2, 2) for e in trace.collectives())


@pytest.mark.timeout(60)
def test_even_odd_branching_merges_into_one_trace():
    def fn(rank):
        if rank % 2 == 0:
            dist.send(torch.tensor([rank + 1.0]), rank + 1)
            return torch.tensor([0.0])
        y = torch.zeros(1)
        dist.recv(y, rank - 1)
        return y * 2

    trace = sv.run(fn, threads=N)
    assert {r: trace.results[r].tolist() for r in range(N)} == {0: [0.0], 1: [2.0], 2: [0.0], 3: [6.0]}
    assert [(e.op, e.groups) for e in trace.collectives()] == [
        ("send", ((0, 1),)),
        ("recv", ((0, 1),)),
        ("send", ((2, 3),)),
        ("recv", ((2, 3),)),
    ]
    assert [e.id for e in trace.events] == list(range(len(trace.events)))
    assert "send" in str(trace) and "recv" in str(trace)


@pytest.mark.timeout(30)
def test_deadlock_raises_fast_and_names_the_ranks():
    def everyone_receives_first(rank):
        y = torch.zeros(1)
        dist.recv(y, (rank - 1) % N)
        dist.send(y, (rank + 1) % N)
        return y

    with pytest.raises(DeadlockError) as info:
        sv.run(everyone_receives_first, threads=N)
    text = str(info.value)
    assert "ranks [0]: waiting for a message from rank 3 to rank 0" in text
    assert "ranks [3]: waiting for a message from rank 2 to rank 3" in text
    assert "dist.recv(y, (rank - 1) % N)" in text
    assert sv.last_trace() is not None and not sv.last_trace().complete
    # the simulator is usable again afterwards
    trace = sv.run(ring_blocking, threads=N)
    assert trace.results[1].tolist() == [0.0, 1.0]


@pytest.mark.timeout(60)
def test_collective_across_threads_is_refused():
    def fn(rank):
        t = sv.per_rank(lambda r: torch.ones(1) * r)
        dist.all_reduce(t)
        return t

    with pytest.raises(P2PError, match="spans several threads"):
        sv.run(fn, threads=2)


@pytest.mark.timeout(60)
def test_threads_must_divide_world():
    with pytest.raises(ValueError, match="does not divide"):
        sv.run(ring_blocking, threads=3)


@pytest.mark.timeout(60)
def test_save_load_and_player(tmp_path):
    trace = sv.run(ring_blocking, threads=N)
    path = trace.save(tmp_path / "ring.svtrace")
    again = sv.load(path)
    assert again == trace
    assert [e.params for e in again.collectives()] == [e.params for e in trace.collectives()]
    first = trace.collectives()[0]
    assert np.array_equal(again.collectives()[0].inputs[0].values, first.inputs[0].values)
    for player in (sv.play(trace), sv.play(again)):
        # One send and one recv per pair of the ring (r -> r + 1), each drawn as one arrow between
        # the pair; at the recv, the sender's buffer and what lands on the receiver are both
        # ring_blocking's x on the sender: [src, src + 1].
        shown = sorted((e.op, e.groups[0]) for e in player.steps)
        assert shown == sorted((op, (r, (r + 1) % N)) for r in range(N) for op in ("send", "recv"))
        for k, e in enumerate(player.steps):
            src, dst = e.groups[0]
            detail = player.detail(k)
            assert (detail["op"], detail["pairs"]) == (e.op, [[src, dst]])
            assert [t[:2] for t in detail["transfers"]] == [[src, dst]]
            assert sorted(int(r) for r in detail["ranks"]) == sorted((src, dst))
            if e.op == "recv":
                meta, buffers = player.values_reply(k)
                got = {
                    (m["rank"], m["side"]): np.frombuffer(b, m["format"]).tolist()
                    for m, b in zip(meta["entries"], buffers, strict=True)
                }
                assert got == {(src, "in"): [src, src + 1.0], (dst, "out"): [src, src + 1.0]}
    assert sv.play(again).timeline == sv.play(trace).timeline


@pytest.mark.timeout(30)
def test_recv_without_sender_raises():
    def fn(rank):
        if rank == 1:
            y = torch.zeros(1)
            dist.recv(y, 0)  # rank 0 returns without sending
            return y
        return torch.zeros(1)

    with pytest.raises(DeadlockError, match=r"ranks \[1\]: waiting for a message from rank 0 to rank 1"):
        sv.run(fn, threads=N)


@pytest.mark.timeout(60)
def test_a_recv_takes_the_same_elements_in_another_shape_and_refuses_another_count():
    # Real ranks move bytes: a (1,) buffer receives a 0-dim tensor (torch 2.11/2.12's pipeline
    # warm-up sends one), a (2, 3) buffer six elements sent flat. Another count is refused.
    def fn(rank, sent_shape, buf_shape):
        if rank == 0:
            dist.send(torch.arange(float(np.prod(sent_shape))).reshape(sent_shape) + 1, 1)
        elif rank == 1:
            y = torch.zeros(buf_shape)
            dist.recv(y, 0)
            return y
        return None

    for sent, buf in (((), (1,)), ((6,), (2, 3))):
        trace = sv.run(fn, sent, buf, threads=N)
        want = torch.arange(float(np.prod(sent))).reshape(buf) + 1
        assert torch.equal(trace.results[1], want), (sent, buf, trace.results[1])
    with pytest.raises(P2PError, match=r"receive buffer is \(2,\) float32 but rank 0 sent \(3,\) float32"):
        sv.run(fn, (3,), (2,), threads=N)


@pytest.mark.timeout(60)
def test_traces_are_deterministic():
    def fn(rank):
        return ring_blocking(rank)

    a = [(e.op, e.groups) for e in sv.run(fn, threads=N).collectives()]
    for _ in range(3):
        assert [(e.op, e.groups) for e in sv.run(fn, threads=N).collectives()] == a


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["running", "waiting"])
def test_ctrl_c_stops_every_thread_and_the_next_run_works(where):
    """Ctrl-C (SIGINT in the calling thread) while threads run: a KeyboardInterrupt, no runner
    thread left behind, and later threaded runs start clean."""
    caller = threading.main_thread().ident
    ops: list[int] = []

    def busy(rank):
        x = torch.zeros(2)
        if where == "waiting" and rank == 0:
            dist.recv(x, 1)  # lets thread 1 run until it waits
        if where == "waiting" and rank == 1:
            dist.send(x, 0)
            dist.recv(x, 0)  # waits for a message that thread 0 never sends
        if rank != 0:
            return x
        for i in range(2000):
            if rank == 0 and i == 5:
                signal.pthread_kill(caller, signal.SIGINT)
            x = x + 1
            ops.append(rank)
            time.sleep(0.002)
        return x

    with pytest.raises(KeyboardInterrupt):
        sv.run(busy, threads=N)
    assert [t for t in threading.enumerate() if t.name == "LocalRunnerMode"] == []
    assert 5 <= len(ops) < 2000 and set(ops) == {0}  # stopped at the next operator
    stopped = sv.last_trace()  # what the run did until then
    assert not stopped.complete
    if where == "waiting":
        assert [(e.op, e.groups) for e in stopped.collectives()] == [("send", ((1, 0),)), ("recv", ((1, 0),))]
    trace = sv.run(ring_blocking, threads=N)
    assert {r: trace.results[r].tolist() for r in range(N)} == {
        0: [3.0, 4.0],
        1: [0.0, 1.0],
        2: [1.0, 2.0],
        3: [2.0, 3.0],
    }
