"""Snapshot values stay what the buffer held at that moment, whatever the program does next.

Snapshots alias a collective's buffers instead of copying them, and are copied only when the
buffer may change: these tests write to every kind of buffer afterwards, in and after the
recording, and compare with values computed by plain torch.
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
from shardviz import _torch
from shardviz.errors import SimulationWarning

WORLD = 4


@pytest.fixture
def mesh():
    sv.use("local", world_size=WORLD)
    with sv.record(values="none"):
        return init_device_mesh("cpu", (WORLD,))


def full() -> torch.Tensor:
    return torch.arange(32, dtype=torch.float32).reshape(8, 4)


def test_output_written_in_place_later_in_the_recording(mesh):
    with sv.record() as trace:
        dt = distribute_tensor(full(), mesh, [Shard(0)], src_data_rank=None)
        out = dt.redistribute(mesh, [Replicate()])
        out.add_(100)  # a DTensor op writing the all_gather's output buffers
        local = out.to_local()
        local.mul_(-1)  # and a write on the local shards
    gather = next(c for c in trace.collectives() if c.op == "all_gather")
    for r in range(WORLD):
        np.testing.assert_array_equal(gather.outputs[r].values, full().numpy())
        np.testing.assert_array_equal(gather.inputs[r].values, full()[2 * r : 2 * r + 2].numpy())
    np.testing.assert_array_equal(out.to_local().reconcile().numpy(), -(full() + 100).numpy())


def test_output_written_after_the_recording(mesh):
    with sv.record() as trace:
        dt = distribute_tensor(full(), mesh, [Shard(0)], src_data_rank=None)
        out = dt.redistribute(mesh, [Replicate()])
    with sv.backends.current().simulate():
        out.zero_()
        dt.fill_(7)
    (gather,) = [c for c in trace.collectives() if c.op == "all_gather"]
    np.testing.assert_array_equal(gather.outputs[0].values, full().numpy())
    np.testing.assert_array_equal(gather.inputs[3].values, full()[6:8].numpy())


def test_the_same_buffer_reduced_twice_in_place(mesh):
    with sv.record() as trace:
        t = sv.per_rank(lambda r: torch.full((3,), float(r + 1)))
        dist.all_reduce(t)
        dist.all_reduce(t)
        t.sub_(1)
    first, second = trace.collectives()
    total = sum(range(1, WORLD + 1))
    assert first.inputs[2].values.tolist() == [3.0] * 3
    assert first.outputs[2].values.tolist() == [total] * 3
    assert second.inputs[2].values.tolist() == [total] * 3
    assert second.outputs[2].values.tolist() == [total * WORLD] * 3


def test_a_gather_list_reused_for_two_all_gathers(mesh):
    with sv.record() as trace:
        bufs = [sv.per_rank(lambda r: torch.zeros(2)) for _ in range(WORLD)]
        dist.all_gather(bufs, sv.per_rank(lambda r: torch.full((2,), float(r))))
        dist.all_gather(bufs, sv.per_rank(lambda r: torch.full((2,), 10.0 + r)))
    first, second = trace.collectives()
    assert [s.values.tolist() for s in first.outputs[1]] == [[float(i)] * 2 for i in range(WORLD)]
    assert [s.values.tolist() for s in second.outputs[1]] == [[10.0 + i] * 2 for i in range(WORLD)]


def test_a_write_the_recorder_cannot_see_drops_values_rather_than_show_wrong_ones(mesh):
    with pytest.warns(SimulationWarning, match=r"values of \d+ snapshot"), sv.record() as trace:
        t = sv.per_rank(lambda r: torch.full((3,), float(r)))
        dist.all_reduce(t)
        with _torch.no_dispatch():  # per-rank code of the simulation runs like this: unseen
            for x in _torch.local_tensors(t).values():
                x.fill_(-1.0)
    (c,) = trace.collectives()
    for r in range(WORLD):
        assert c.outputs[r].values is None and c.outputs[r].shape == (3,)  # dropped, not -1.0
        assert c.inputs[r].values.tolist() == [float(r)] * 3


def test_buffers_the_user_still_holds_are_copied_when_the_recording_ends(mesh):
    with sv.record() as trace:
        t = sv.per_rank(lambda r: torch.full((2,), float(r)))
        dist.all_reduce(t)
        scratch = sv.per_rank(lambda r: torch.full((2,), float(r)))
        dist.all_reduce(scratch)
        del scratch
    held, dropped = trace.collectives()
    per = _torch.local_tensors(t)
    assert not any(np.shares_memory(held.outputs[r].values, per[r].numpy()) for r in range(WORLD))
    with sv.backends.current().simulate():
        t.fill_(-5.0)
    total = float(sum(range(WORLD)))
    assert held.outputs[0].values.tolist() == [total, total]
    assert dropped.outputs[0].values.tolist() == [total, total]


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


def test_no_warning_when_nothing_is_written_behind_the_recorders_back(mesh):
    with warnings.catch_warnings():
        warnings.simplefilter("error", SimulationWarning)
        with sv.record():
            dt = distribute_tensor(full(), mesh, [Shard(0)], src_data_rank=None)
            dt.redistribute(mesh, [Replicate()]).add_(1)


def test_a_gradient_reduced_then_accumulated_into_after_the_recording(mesh):
    x = sv.per_rank(lambda r: torch.full((3,), float(r + 1))).requires_grad_()
    with sv.record() as trace:
        (x * 2).sum().backward()
        dist.all_reduce(x.grad)
    with sv.backends.current().simulate():
        (x * 3).sum().backward()  # accumulates into x.grad in place
    (c,) = trace.collectives()
    assert c.inputs[1].values.tolist() == [2.0] * 3
    assert c.outputs[1].values.tolist() == [2.0 * WORLD] * 3
    assert _torch.local_tensors(x.grad)[1].tolist() == [2.0 * WORLD + 3] * 3


def test_a_tensor_held_only_by_a_grad_slot_counts_as_reached():
    from shardviz.recorder import _Alias, _alone, _holders

    p = torch.nn.Parameter(torch.ones(2))
    p.sum().backward()
    held = _Alias(p.grad, p.grad._version, p.grad.numpy(force=True))
    assert _holders(held) != _alone()  # the .grad slot holds it from C++: it may be written
    free = torch.ones(2)
    held = _Alias(free, 0, free.numpy(force=True))
    del free
    assert _holders(held) == _alone()
