"""torch's own distributed code in the simulator, unpatched: DistributedDataParallel, and the debug
tools (``CommDebugMode``, ``DebugMode``, ``visualize_sharding``) on a TP MLP.

Expectations: plain torch on the whole batch in one process (DDP), hand-written counts, and each
backend against the other; tests/cluster/test_real_code_gloo.py compares both with gloo (torchrun,
4 processes).
"""

from __future__ import annotations

import pytest
import real_code_cases as cases
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import shardviz as sv
from shardviz.errors import LockstepLimitError

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _back_to_lockstep():
    yield
    sv.use("local", world_size=4)


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_on_threads_equals_the_whole_batch_in_one_process(world):
    # Before: "expected the hook result is either a Tensor or a TensorList found None" (the
    # reducer reads its bucket back from the all-reduce's future).
    sv.use("threads", world_size=world)
    trace = sv.run(cases.ddp_step)
    want = cases.small_reference(world)["params"]
    for r in range(world):
        got = trace.results[r]["params"]
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=name)
    reduces = [c for c in trace.collectives() if c.op == "all_reduce"]
    assert len(reduces) == 2 and all(c.groups == (tuple(range(world)),) for c in reduces)  # a bucket a step


def test_ddp_in_lockstep_is_refused_naming_the_threads():
    # Before: torch's "data is not allocated yet" from DDP's C++ checks, unexplained.
    sv.use("local", world_size=4)
    for _ in range(2):  # the same every run
        with pytest.raises(
            LockstepLimitError, match="DistributedDataParallel cannot run in the lockstep"
        ) as info:
            sv.run(cases.ddp_step)
        assert "sv.use('threads', world_size=N)" in str(info.value)


def test_debug_tools_give_the_same_on_threads_and_in_lockstep():
    results = {}
    for backend in ("threads", "local"):
        sv.use(backend, world_size=4)
        results[backend] = sv.run(cases.debug_tools, values="none").results
    threads, lockstep = results["threads"], results["local"]
    for r in range(4):
        mine = threads[r]
        # hand-written: one all-reduce, RowwiseParallel's output in the forward (x needs no grad)
        assert mine["comm_total"] == 1
        assert mine["comm_counts"] == {"c10d_functional.all_reduce": 1}
        assert "Sequential.2" in mine["comm_table"] and "FORWARD PASS" in mine["comm_table"]
        assert any("_c10d_functional::all_reduce" in line for line in mine["debug_lines"])
        assert any("[nn.Mod] Sequential.0" in line for line in mine["debug_lines"])
        for key in ("comm_total", "comm_counts", "comm_table", "comm_table_dtensor", "comm_table_all_ops"):
            assert lockstep[r][key] == mine[key], (r, key)
        assert lockstep[r]["debug_lines"] == mine["debug_lines"]
    # visualize_sharding: rank 0 prints (its coordinate is 0 on every mesh dim); on the tp
    # sub-mesh rank 2 does as well, with its own group's devices
    printed = {r: threads[r]["visualize"] for r in range(4)}
    assert printed[0]["whole"] and not any(printed[r]["whole"] for r in (1, 2, 3))
    assert printed[0]["tp"] and printed[2]["tp"] and not printed[1]["tp"] and not printed[3]["tp"]
    assert "cpu:0" in printed[0]["tp"] and "cpu:2" in printed[2]["tp"]
    assert lockstep[0]["visualize"] == printed[0]


@pytest.mark.parametrize("backend", ["local", "threads"])
@pytest.mark.parametrize(("dim", "cause"), [(1, "attention heads (dim 1)"), (2, "along the sequence")])
def test_head_sharded_attention_is_not_called_context_parallel(backend, dim, cause):
    sv.use(backend, world_size=4)
    q = torch.randn(2, 4, 8, 16)

    def fn():
        mesh = init_device_mesh("cpu", (4,))
        dq = distribute_tensor(q, mesh, [Shard(dim)], src_data_rank=None).requires_grad_()
        return F.scaled_dot_product_attention(dq, dq, dq, is_causal=True)

    with pytest.raises(NotImplementedError, match="_scaled_dot_product_flash_attention_for_cpu") as info:
        sv.run(fn)
    text = str(info.value)
    assert cause in text
    if dim == 1:
        assert "not context parallel" in text and "to_local()" in text
    else:
        assert "context parallel" in text and "context_parallel_degree=1" in text
