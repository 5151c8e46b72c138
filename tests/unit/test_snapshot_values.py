"""Snapshot values stay what the buffer held at that moment, whatever the program does next.

Snapshots of large buffers alias them instead of copying, and are copied only when the buffer may
change; small ones are copied at once. These tests run with both sizes, write to every kind of
buffer afterwards, in and after the recording, and compare with values written out by hand.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardviz as sv
from shardviz.backends import choose
from shardviz.capture import torch as _torch
from shardviz.capture.recorder import to_numpy
from shardviz.data.events import NUMPY_WIDENED
from shardviz.data.trace import Trace
from shardviz.errors import SimulationWarning

WORLD = 4


# Elements per row: 4 floats are copied at once; 20,000 floats (80 KB) are past the size above
# which a snapshot aliases its buffer.
SIZES = [4, 20_000]


@pytest.fixture(params=SIZES, ids=["copied", "aliased"])
def n(request):
    return request.param


@pytest.fixture
def mesh():
    sv.use("local", world_size=WORLD)
    with sv.record(values="none"):
        return init_device_mesh("cpu", (WORLD,))


def full(n: int) -> torch.Tensor:
    return torch.arange(8 * n, dtype=torch.float32).reshape(8, n)


def same(values, fill: float) -> bool:
    return values is not None and bool(np.all(values == fill))


def test_output_written_in_place_later_in_the_recording(mesh, n):
    with sv.record() as trace:
        dt = distribute_tensor(full(n), mesh, [Shard(0)], src_data_rank=None)
        out = dt.redistribute(mesh, [Replicate()])
        out.add_(100)  # a DTensor op writing the all_gather's output buffers
        local = out.to_local()
        local.mul_(-1)  # and a write on the local shards
    gather = next(c for c in trace.collectives() if c.op == "all_gather")
    for r in range(WORLD):
        np.testing.assert_array_equal(gather.outputs[r].values, full(n).numpy())
        np.testing.assert_array_equal(gather.inputs[r].values, full(n)[2 * r : 2 * r + 2].numpy())
    np.testing.assert_array_equal(out.to_local().reconcile().numpy(), -(full(n) + 100).numpy())


def test_output_written_after_the_recording(mesh, n):
    with sv.record() as trace:
        dt = distribute_tensor(full(n), mesh, [Shard(0)], src_data_rank=None)
        out = dt.redistribute(mesh, [Replicate()])
    with choose.current().simulate():
        out.zero_()
        dt.fill_(7)
    (gather,) = [c for c in trace.collectives() if c.op == "all_gather"]
    np.testing.assert_array_equal(gather.outputs[0].values, full(n).numpy())
    np.testing.assert_array_equal(gather.inputs[3].values, full(n)[6:8].numpy())


def test_the_same_buffer_reduced_twice_in_place(mesh, n):
    with sv.record() as trace:
        t = sv.per_rank(lambda r: torch.full((n,), float(r + 1)))
        dist.all_reduce(t)
        dist.all_reduce(t)
        t.sub_(1)
    first, second = trace.collectives()
    total = sum(range(1, WORLD + 1))
    assert same(first.inputs[2].values, 3.0)
    assert same(first.outputs[2].values, total)
    assert same(second.inputs[2].values, total)
    assert same(second.outputs[2].values, total * WORLD)


def test_a_gather_list_reused_for_two_all_gathers(mesh, n):
    with sv.record() as trace:
        bufs = [sv.per_rank(lambda r: torch.zeros(n)) for _ in range(WORLD)]
        dist.all_gather(bufs, sv.per_rank(lambda r: torch.full((n,), float(r))))
        dist.all_gather(bufs, sv.per_rank(lambda r: torch.full((n,), 10.0 + r)))
    first, second = trace.collectives()
    assert all(same(s.values, float(i)) for i, s in enumerate(first.outputs[1]))
    assert all(same(s.values, 10.0 + i) for i, s in enumerate(second.outputs[1]))


def test_a_write_the_recorder_cannot_see_never_shows_wrong_values(mesh, n):
    # A large buffer that is a tensor of its own is aliased; the batched engine's ranks are slices
    # of one stack, which are copied at once as small buffers are: the values at the collective.
    aliased = n == SIZES[-1] and choose.current().engine != "batched"
    with warnings.catch_warnings(record=True) as caught, sv.record() as trace:
        warnings.simplefilter("always")
        t = sv.per_rank(lambda r: torch.full((n,), float(r)))
        dist.all_reduce(t)
        with _torch.no_dispatch():  # per-rank code of the simulation runs like this: unseen
            for x in _torch.local_tensors(t).values():
                x.fill_(-1.0)
    (c,) = trace.collectives()
    dropped = [w for w in caught if issubclass(w.category, SimulationWarning)]
    total = float(sum(range(WORLD)))
    for r in range(WORLD):
        assert c.outputs[r].shape == (n,)
        if aliased:  # the buffer was written under the alias: its values are dropped, not -1.0
            assert c.outputs[r].values is None
        else:  # copied at once, before the write
            assert same(c.outputs[r].values, total)
        assert same(c.inputs[r].values, float(r))  # an in-place op's input is always copied
    assert len(dropped) == aliased and (not aliased or "values of 1 snapshot" in str(dropped[0].message))


def test_buffers_the_user_still_holds_are_copied_when_the_recording_ends(mesh, n):
    with sv.record() as trace:
        t = sv.per_rank(lambda r: torch.full((n,), float(r)))
        dist.all_reduce(t)
        scratch = sv.per_rank(lambda r: torch.full((n,), float(r)))
        dist.all_reduce(scratch)
        del scratch
    held, dropped = trace.collectives()
    per = _torch.local_tensors(t)
    assert not any(np.shares_memory(held.outputs[r].values, per[r].numpy()) for r in range(WORLD))
    with choose.current().simulate():
        t.fill_(-5.0)
    total = float(sum(range(WORLD)))
    assert same(held.outputs[0].values, total)
    assert same(dropped.outputs[0].values, total)


def test_identical_bits_share_a_snapshot_nan_included_and_signed_zeros_do_not(mesh):
    with sv.record() as trace:
        nan = sv.per_rank(lambda r: torch.tensor([float("nan"), 1.0]))
        dist.broadcast(nan, src=0)
        zeros = sv.per_rank(lambda r: torch.tensor([0.0 if r % 2 else -0.0]))
        out = [sv.per_rank(lambda r: torch.empty(1)) for _ in range(WORLD)]
        dist.all_gather(out, zeros)
    bcast, gather = trace.collectives()
    assert all(bcast.outputs[r] is bcast.outputs[0] for r in range(WORLD))
    assert np.isnan(bcast.outputs[3].values[0])
    signs = [np.signbit(s.values[0]) for s in gather.inputs.values()]
    assert signs == [True, False, True, False]
    assert gather.inputs[0] is not gather.inputs[1]


def test_no_warning_when_nothing_is_written_behind_the_recorders_back(mesh, n):
    with warnings.catch_warnings():
        warnings.simplefilter("error", SimulationWarning)
        with sv.record():
            dt = distribute_tensor(full(n), mesh, [Shard(0)], src_data_rank=None)
            dt.redistribute(mesh, [Replicate()]).add_(1)


def test_a_gradient_reduced_then_accumulated_into_after_the_recording(mesh, n):
    x = sv.per_rank(lambda r: torch.full((n,), float(r + 1))).requires_grad_()
    with sv.record() as trace:
        (x * 2).sum().backward()
        dist.all_reduce(x.grad)
    with choose.current().simulate():
        (x * 3).sum().backward()  # accumulates into x.grad in place
    (c,) = trace.collectives()
    assert same(c.inputs[1].values, 2.0)
    assert same(c.outputs[1].values, 2.0 * WORLD)
    assert same(_torch.local_tensors(x.grad)[1].numpy(), 2.0 * WORLD + 3)


def test_a_tensor_held_only_by_a_grad_slot_counts_as_reached():
    from shardviz.capture.recorder.snapshot import Alias, alone, holders

    p = torch.nn.Parameter(torch.ones(2))
    p.sum().backward()
    held = Alias(p.grad, p.grad._version, p.grad.numpy(force=True))
    assert holders(held) != alone()  # the .grad slot holds it from C++: it may be written
    free = torch.ones(2)
    held = Alias(free, 0, free.numpy(force=True))
    del free
    assert holders(held) == alone()


def test_a_view_of_a_buffer_written_through_its_base(mesh, n):
    total = float(sum(range(WORLD)))
    with sv.record() as trace:
        base = sv.per_rank(lambda r: torch.full((2, n), float(r)))
        dist.all_reduce(base.view(-1))
        base.add_(1)  # through the base, in the recording
        dist.all_reduce(base.view(-1))
    with choose.current().simulate():
        base.fill_(-1)  # and after it
    first, second = trace.collectives()
    assert first.outputs[0].shape == (2 * n,) and same(first.outputs[0].values, total)
    assert same(second.inputs[2].values, total + 1)
    assert same(second.outputs[0].values, (total + 1) * WORLD)


def test_an_in_place_op_on_local_shards_keeps_its_input(mesh, n):
    with sv.record() as trace:
        dt = distribute_tensor(full(n), mesh, [Shard(0)], src_data_rank=None)
        loc = dt.to_local()
        loc.mul_(2)  # the first op the recorder sees after the collectives: a write of its input
    (mul,) = [e for e in trace.locals() if "mul" in e.name]
    for r in range(WORLD):
        rows = full(n)[2 * r : 2 * r + 2].numpy()
        np.testing.assert_array_equal(mul.inputs[r].values, rows)
        np.testing.assert_array_equal(mul.outputs[r].values, rows * 2)


@pytest.mark.parametrize("name", sorted(NUMPY_WIDENED))
def test_dtypes_numpy_lacks_are_read_widened_with_their_values(name):
    """One table says how each dtype numpy lacks is read, for snapshots and for results alike."""
    dtype = getattr(torch, name)
    plain = (
        torch.tensor([0.0, 1.0, 2.0, 3.0]) if dtype.is_floating_point or dtype.is_complex else torch.arange(4)
    )
    t = plain.to(dtype)
    values = to_numpy(t)
    assert values.dtype == np.dtype(NUMPY_WIDENED[name])
    assert values.tolist() == plain.to(getattr(torch, NUMPY_WIDENED[name])).tolist()
    a, b = Trace(1, "local", "all"), Trace(1, "local", "all")
    a.results, b.results = {0: t}, {0: t.clone()}
    assert a == b
    b.results = {0: (plain + 1).to(dtype)}
    assert a != b
