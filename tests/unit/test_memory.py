"""Live bytes per rank over a recording (sv.record(memory=...)), against sizes worked out by hand."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

import shardviz as sv
from shardviz.data.memory import MemoryTimeline


@pytest.fixture
def two():
    sv.use("local", world_size=2)
    yield
    sv.use("local", world_size=4)


def _small_trace():
    with sv.record(memory=True) as trace:
        a = sv.per_rank(lambda r: torch.full((4,), float(r)))  # 16 B on each rank
        c = sv.per_rank(lambda r: torch.zeros(2 + 2 * r))  # 8 B on rank 0, 16 B on rank 1
        b = torch.zeros(8)  # 32 B on each rank
        dist.all_reduce(a)
        del b
        dist.all_reduce(a)
        del c
    return trace


def test_samples_by_hand(two):
    m = _small_trace().memory
    assert isinstance(m, MemoryTimeline)
    assert m.events == (0, 1, None)
    # At #0: a + c + b; at #1: b is gone; at the end c is gone too.
    assert m.bytes.tolist() == [[16 + 8 + 32, 16 + 16 + 32], [16 + 8, 16 + 16], [16, 16]]
    assert (m.peak >= [56, 64]).all()
    assert m.at(1).tolist() == [24, 32]
    assert m.rank(1).tolist() == [64, 32, 16]


def test_text_is_exact(two):
    m = _small_trace().memory
    rows = str(m).splitlines()
    assert rows[0] == (
        "Memory per rank: 2 ranks, 3 samples; live tensor storage (tensors made in the recording)"
    )
    assert rows[1].split() == ["ranks", "start", "peak", "end", "peak", "during", "timeline"]
    assert rows[2].split()[:2] == ["0", "56"]
    assert rows[3].split()[:2] == ["1", "64"]
    assert rows[-1].startswith("highest peak: ")


def test_nothing_is_counted_without_asking(two):
    with sv.record() as trace:
        dist.barrier()
    assert trace.memory is None


def test_an_fsdp_step_ends_with_sharded_params_and_grads(two):
    torch.manual_seed(0)
    with sv.record():
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        model = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = torch.ones(4, 16)
    with sv.record(memory=model) as trace:
        loss = model(x).sum()
        loss.backward()
        del loss
    m = trace.memory
    shard = 8 * 16 * 4  # each 16x16 float32 weight cut in two along dim 0
    # At the end: two sharded weights and their two sharded gradients, nothing else.
    assert m.end.tolist() == [4 * shard, 4 * shard]
    # The unsharded weights (16x16 each) were gathered and freed again in between.
    assert (m.peak >= m.end + 16 * 16 * 4).all()
    assert {trace.event(i).module for i in m.peak_event if i is not None} <= {
        e.module for e in trace.collectives()
    }
    assert "FSDPSequential's parameters, buffers and grads" in m.counted


def test_views_round_trip_and_exports(two, tmp_path):
    trace = _small_trace()
    m = trace.memory
    svg = sv.show(m).svg()
    assert 'data-shardviz-view="memory"' in svg
    assert 'data-ranks="1" data-peak="' in svg and 'data-ranks="0" data-peak="' in svg
    page = sv.export_html(m, tmp_path / "m.html").read_text()
    assert "<script" not in page and "Memory per rank" in page
    fig = sv.plot(m)
    assert {line.get_gid() for line in fig.axes[0].lines} >= {"memory-0", "memory-1"}
    back = sv.load(trace.save(tmp_path / "t.zip"))
    assert back.memory == m
    assert MemoryTimeline.from_dict(m.to_dict()) == m


def test_bad_input_says_what_to_do(two):
    with pytest.raises(TypeError, match="counts modules, optimizers and tensors"), sv.record(memory="yes"):
        pass
    with pytest.raises(NotImplementedError, match="single-thread runs only"):
        sv.run(lambda i: None, threads=2, memory=True)
    with pytest.raises(IndexError, match="rank 5 is not in this timeline"):
        _small_trace().memory.rank(5)


def _big_buffers_step():
    s = sv.per_rank(lambda r: torch.zeros(1))  # 4 B on each rank
    # 128 KiB per rank: large enough that a recording with values aliases the buffers it
    # snapshots instead of copying them at once.
    x = sv.per_rank(lambda r: torch.full((256, 128), float(r)))
    dist.all_reduce(x)
    y = x * 2
    dist.all_reduce(y)
    del x
    dist.all_reduce(s)
    del y
    dist.all_reduce(s)


@pytest.mark.parametrize("values", ["none", 64 * 2**20, "all"])
def test_the_value_policy_does_not_change_the_memory_counted(two, values):
    """The recorder's own snapshots are not the program's memory: a buffer the program dropped is
    gone, whatever the recording kept of it."""
    with sv.record(memory=True, values=values) as trace:
        _big_buffers_step()
    m = trace.memory
    kib128 = 256 * 128 * 4
    # s lives until the step returns; at #0 (all_reduce x) x too; at #1 (all_reduce y) x and y;
    # at #2 only y; at the end nothing.
    assert m.events == (0, 1, 2, 3, None)
    assert m.bytes.tolist() == [[4 + kib128] * 2, [4 + 2 * kib128] * 2, [4 + kib128] * 2, [4, 4], [0, 0]]
    assert m.peak.tolist() == [4 + 2 * kib128] * 2
    if values != "none":  # the values were kept all the same
        reduced = trace.collectives()[0].outputs[0].values
        assert reduced.shape == (256, 128) and (reduced == 1.0).all()  # 0 + 1


def test_sharding_propagation_fake_tensors_are_not_counted(two):
    """DTensor works out an operator's output shape on global-shape FakeTensors the first time it
    meets the operator and shapes: they hold no memory on any rank."""
    with sv.record():
        mesh = init_device_mesh("cpu", (2,))
        dt = distribute_tensor(torch.ones(26, 38), mesh, [Shard(0)])  # a shape no other test uses
    with sv.record(memory=dt) as trace:
        z = torch.tanh(dt)
    shard = 13 * 38 * 4  # each rank's half of the 26 rows
    assert trace.memory.peak.tolist() == [2 * shard, 2 * shard]  # dt's shard and z's
    assert trace.memory.end.tolist() == [2 * shard, 2 * shard]
    del z


class _PerPart(torch.optim.Optimizer):
    """One optimizer per model part in ``.optimizers``, its own state empty (as torchtitan's
    OptimizersContainer)."""

    def __init__(self, parts: list[torch.optim.Optimizer], params: list[nn.Parameter]) -> None:
        self.optimizers = parts
        super().__init__(params, {})


def test_an_optimizer_wrapper_counts_its_parts_state(two):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))  # 40 + 18 floats
    parts = [torch.optim.Adam(model[0].parameters()), torch.optim.Adam(model[1].parameters())]
    model(torch.randn(3, 4)).sum().backward()
    for opt in parts:
        opt.step()
    wrapper = _PerPart(parts, list(model.parameters()))
    with sv.record(memory=[model, wrapper]) as trace:
        pass
    # params + grads + Adam's exp_avg and exp_avg_sq: 4 x 58 floats, and 4 float steps
    assert trace.memory.start.tolist() == [4 * 58 * 4 + 4 * 4] * 2
