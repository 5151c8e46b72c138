"""Ring algorithm steps end in the recorded outputs, for several world sizes (non-powers of two
included); a wrong recorded output shows up as a failed check, not an exception."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist

import shardviz as sv
from shardviz.data import ring
from shardviz.data.events import TensorSnapshot


def values(shape, dtype):
    return sv.per_rank(
        lambda r: ((torch.arange(int(np.prod(shape))) % 7 - 3) * (r + 1) + r).reshape(shape).to(dtype)
    )


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16], ids=str)
def test_ring_steps_end_in_the_recorded_output(world, dtype):
    sv.use("local", world_size=world)
    with sv.record() as trace:
        t = values((3, 5), dtype)  # 15 elements: chunks of unequal size for most world sizes
        dist.all_reduce(t)
        out = torch.zeros(world * 2, 3, dtype=dtype)
        dist.all_gather_into_tensor(out, values((2, 3), dtype))
        small = torch.zeros(2, 4, dtype=dtype)
        dist.reduce_scatter_tensor(small, values((world * 2, 4), dtype))
        m = values((4,), dtype)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
    for e in trace.collectives():
        (r,) = ring.rings(e)
        assert r.check.checked and r.check.ok, (e.op, world, dtype, r.check)
        n = r.n
        expected_steps = 2 * (n - 1) if e.op == "all_reduce" else n - 1
        assert len(r.steps) == expected_steps
        # Every step moves exactly one chunk from each rank to its ring neighbour.
        for step in r.steps:
            assert sorted((a, b) for a, b, _ in step.sends) == sorted(
                (g, r.group[(i + 1) % n]) for i, g in enumerate(r.group)
            )
        if dtype != torch.bfloat16:
            for k in range(world):
                np.testing.assert_array_equal(r.final[k], e.outputs[k].values)


def test_ring_state_after_reduce_scatter_phase_by_hand():
    # Three ranks holding [r, r, r] (chunks of one element): after the reduce-scatter phase, rank k
    # owns the finished chunk (k + 1) % 3, which is 0 + 1 + 2 = 3.
    sv.use("local", world_size=3)
    with sv.record() as trace:
        t = sv.per_rank(lambda r: torch.full((3,), float(r)))
        dist.all_reduce(t)
    r = ring.ring(trace.collectives()[0])
    after_rs = r.steps[1].chunks
    for k in range(3):
        assert after_rs[k][(k + 1) % 3].tolist() == [3.0]
    assert [s.phase for s in r.steps] == ["reduce-scatter", "reduce-scatter", "all-gather", "all-gather"]
    assert r.steps[0].sends == ((0, 1, 0), (1, 2, 1), (2, 0, 2))


def test_mismatch_is_reported_not_raised():
    sv.use("local", world_size=4)
    with sv.record() as trace:
        dist.all_reduce(values((4,), torch.float32))
    e = trace.collectives()[0]
    outs = dict(e.outputs)
    wrong = outs[1].values + 1
    outs[1] = TensorSnapshot(outs[1].shape, outs[1].dtype, wrong)
    r = ring.ring(dataclasses.replace(e, outputs=outs))
    assert r.check.checked and not r.check.ok and r.check.max_error[1] == pytest.approx(1.0)
    assert "differs" in r.check.note


def test_no_ring_without_values_or_for_other_ops():
    sv.use("local", world_size=4)
    with sv.record(values="none") as trace:
        dist.all_reduce(values((4,), torch.float32))
        dist.broadcast(values((4,), torch.float32), src=0)
    a, b = trace.collectives()
    assert ring.rings(a) == [] and ring.rings(b) == []
