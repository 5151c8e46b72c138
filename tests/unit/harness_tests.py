"""Test classes of the project's own on torch's DTensor harness (``create_local_tensor_test_class``,
which runs each test inside a LocalTensorMode on a fake process group, as PyTorch's DTensor tests
do). Imported by tests/unit/test_pytest_plugin.py and test_attach.py, and copied as a test module
into the folders where they run pytest; not collected itself (no ``test_`` prefix)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorTestBase,
    create_local_tensor_test_class,
    with_comms,
)


class RedistributeTest(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 4

    @with_comms
    def test_gather_passes(self) -> None:
        mesh = self.build_device_mesh()
        dt = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
        assert dt.redistribute(mesh, [Replicate()]).to_local().shape == (8,)

    @with_comms
    def test_gather_fails(self) -> None:
        mesh = self.build_device_mesh()
        dt = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
        assert dt.redistribute(mesh, [Replicate()]).to_local().shape == (4,), "wrong on purpose"

    @with_comms
    def test_reduce_runs_as_without_shardviz(self) -> None:
        # dist.reduce: LocalTensorMode lacks it on torch 2.13, shardviz's simulator does it. The
        # outcome goes to $HARNESS_OUTCOME, to compare runs with and without a recording.
        mesh = self.build_device_mesh()
        t = distribute_tensor(torch.ones(8), mesh, [Shard(0)]).to_local()
        try:
            dist.reduce(t, dst=0)
            outcome = "done"
        except NotImplementedError as e:
            outcome = f"NotImplementedError: {e}"
        if os.environ.get("HARNESS_OUTCOME"):
            Path(os.environ["HARNESS_OUTCOME"]).write_text(outcome)

    def test_fails_before_any_collective(self) -> None:
        raise AssertionError("fails before it communicates anything")


RedistributeTestWithLocalTensor = create_local_tensor_test_class(RedistributeTest)
del RedistributeTest
