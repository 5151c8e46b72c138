"""``sv.record()`` inside a LocalTensorMode a test harness entered (torch's
``create_local_tensor_test_class``, on its own fake process group) records there and leaves the
mode, the process group and shardviz's backend as it found them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorTestBase,
    create_local_tensor_test_class,
    with_comms,
)

import shardviz as sv
from shardviz.backends import session
from shardviz.capture import torch as _torch
from shardviz.capture.recorder import Recorder
from shardviz.data.trace import Trace


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_of_shardviz():
    # The harness initialises the default process group itself: one left by an earlier test's
    # sv.use would make it fail ("initialize the default process group twice").
    previous = session.peek()
    if previous is not None:
        previous.close()
        session.install(None)


class AttachTest(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 8  # not shardviz's default of 4: the recording takes the harness's world

    @with_comms
    def test_record_attaches_to_the_harness(self) -> None:
        mode, pg = _torch.active_local_mode(), dist.group.WORLD
        modes_before = _torch.dispatch_mode_stack()
        backend_before = session.peek()
        mesh = self.build_device_mesh()
        dt = distribute_tensor(torch.arange(16.0), mesh, [Shard(0)])

        with sv.record() as trace:
            full = dt.redistribute(mesh, [Replicate()])
            t = sv.per_rank(lambda rank: torch.full((2,), float(rank)))
            dist.all_reduce(t)

        (gather,) = [e for e in trace.events if getattr(e, "op", None) == "all_gather"]
        assert gather.groups == (tuple(range(8)),)
        for rank in range(8):
            np.testing.assert_array_equal(gather.outputs[rank].values, np.arange(16.0))
        (reduce,) = [e for e in trace.events if getattr(e, "op", None) == "all_reduce"]
        np.testing.assert_array_equal(reduce.outputs[5].values, np.full(2, float(sum(range(8)))))
        assert trace.world_size == 8 and sv.last_trace() is trace
        assert full.to_local().shape == (16,)

        # As it was: the harness's mode on top, its process group, no mode of shardviz's left,
        # no backend built or closed.
        assert _torch.active_local_mode() is mode
        assert dist.group.WORLD is pg and dist.get_world_size() == 8
        assert _torch.dispatch_mode_stack() == modes_before
        assert session.peek() is backend_before
        assert sv.per_rank(lambda rank: torch.tensor([rank])).shape == (1,)  # still this harness's world

    @with_comms
    def test_a_passive_recording_of_the_test_steps_aside(self) -> None:
        # pytest --shardviz-traces records the whole test passively; an sv.record() block inside
        # gets its events whole (the redistribute and its all_gather), the passive one the rest.
        mesh = self.build_device_mesh()
        dt = distribute_tensor(torch.arange(16.0), mesh, [Shard(0)])
        whole = Trace(8, "local", "all")
        passive = Recorder(whole, 8, "all", passive=True)
        with passive:
            with sv.record() as block:
                dt.redistribute(mesh, [Replicate()])
            dist.all_reduce(dt.to_local())
        passive.finish()
        assert [(e.kind, e.parent) for e in block.events] == [("redistribute", None), ("collective", 0)]
        assert [getattr(e, "op", e.kind) for e in whole.events] == ["op", "all_reduce"]  # to_local, then it


AttachTestWithLocalTensor = create_local_tensor_test_class(AttachTest)
del AttachTest
