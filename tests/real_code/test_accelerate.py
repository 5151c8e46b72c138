"""Hugging Face accelerate as its users write it, unpatched: ``Accelerator(cpu=True)`` training a
small model DDP-style on one thread per rank (each rank a process of its own: its own
``PartialState``), refused in the lockstep simulator. The same function on gloo:
tests/cluster/test_real_code_gloo.py.

Expectations: the whole batch in one process (DDP-style data parallel averages the gradients),
hand-written process indices and splits.
"""

from __future__ import annotations

import os

import pytest
import torch

import shardviz as sv
from shardviz.errors import PerRankValueError

pytest.importorskip("accelerate", reason="accelerate is installed by `make setup` (the `hf` extra)")

import real_code_cases as cases

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(autouse=True)
def _back_to_lockstep():
    yield
    sv.use("local", world_size=4)


@pytest.mark.parametrize("world", [2, 4])
def test_accelerator_on_threads_is_one_process_per_rank(world):
    # Before: every rank saw process_index 0 (the PartialState singleton was rank 0's), and all
    # trained on rank 0's batch.
    from accelerate.state import AcceleratorState, GradientState, PartialState

    sv.use("threads", world_size=world)
    trace = sv.run(cases.accelerate_step)
    want = cases.small_reference(world)["params"]
    for r in range(world):
        got = trace.results[r]
        assert got["process_index"] == r and got["num_processes"] == world
        assert got["distributed_type"] == "DistributedType.MULTI_CPU"
        assert got["is_main_process"] == (r == 0) and got["env_rank"] == str(r)
        for name in want:
            torch.testing.assert_close(got["params"][name], want[name], msg=name)
    # the notebook is no rank: its own singletons and environment are as they were
    for cls in (PartialState, AcceleratorState, GradientState):
        assert cls._shared_state == {}, cls.__name__
    assert "RANK" not in os.environ


def test_split_between_processes_gives_each_rank_its_part():
    from accelerate import PartialState

    sv.use("threads", world_size=4)
    items = list(range(10))

    def fn():
        state = PartialState(cpu=True)
        with state.split_between_processes(items) as mine:
            return list(mine)

    # accelerate's own split of 10 over 4: 3, 3, 2, 2
    assert sv.run(fn).results == {0: [0, 1, 2], 1: [3, 4, 5], 2: [6, 7], 3: [8, 9]}


def test_lockstep_refuses_accelerate_instead_of_one_silent_process():
    # Before: DistributedType.NO, one process, without a word.
    sv.use("local", world_size=4)
    for _ in range(2):
        with pytest.raises(PerRankValueError, match="accelerate's PartialState") as info:
            sv.run(cases.accelerate_step)
        text = str(info.value)
        assert "DistributedType.NO" in text and "sv.use('threads', world_size=N)" in text
