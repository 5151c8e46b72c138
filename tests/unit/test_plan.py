"""sv.plan (no tensors) against what DTensor really does under the simulation.

Property: for random shapes, meshes up to 3-D / 8 ranks and random Shard/Replicate/Partial source
and target placements, the pure plan has the same plan string, the same collectives (op, groups,
mesh dim) and the same per-rank buffer shapes and bytes as the recorded redistribute.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

import shardviz as sv
from shardviz.backends import choose
from shardviz.capture import torch as _torch
from shardviz.data.plan import parse_plan_string, plan_steps
from shardviz.geometry.placement import parse

MESHES = [(4,), (2, 2), (3, 2), (2, 2, 2)]
_meshes: dict = {}


def get_mesh(shape):
    sv.use("local", world_size=int(torch.Size(shape).numel()))
    backend = choose.current()
    if shape not in _meshes or _meshes[shape][0] is not backend:
        with sv.record():
            _meshes[shape] = (backend, init_device_mesh("cpu", shape))
    return _meshes[shape][1]


def placements(ndim):
    return st.one_of(st.just("R"), st.just("P"), st.integers(0, ndim - 1).map(lambda d: f"S({d})"))


@st.composite
def cases(draw, mesh_shape):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    src = [draw(placements(ndim)) for _ in mesh_shape]
    dst = [draw(placements(ndim)) for _ in mesh_shape]
    return shape, src, dst


def make_dtensor(x, mesh, src):
    torch_src = [_torch.placement_from_plain(parse(p)) for p in src]
    if any(p.startswith("P") for p in src):
        # A Partial input: build the local tensors of the non-partial placements, then declare
        # them partial; values do not matter here, shapes do.
        plain = [p if not p.startswith("P") else "R" for p in src]
        base = distribute_tensor(
            x, mesh, [_torch.placement_from_plain(parse(p)) for p in plain], src_data_rank=None
        )
        local = base.to_local()
        if not _torch.is_local_tensor(local):  # Replicate-only keeps a plain tensor: give each rank one
            local = sv.per_rank(lambda r, t=local: t)
        return DTensor.from_local(local, mesh, torch_src, run_check=False, shape=x.shape, stride=x.stride())
    return distribute_tensor(x, mesh, torch_src, src_data_rank=None)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_plan_matches_the_recorded_redistribute(mesh_shape):
    @given(cases(mesh_shape))
    def check(case):
        shape, src, dst = case
        # DTensor refuses to create Partial from Shard/Replicate.
        assume(not any(d.startswith("P") and not s.startswith("P") for s, d in zip(src, dst, strict=True)))
        mesh = get_mesh(mesh_shape)
        x = torch.arange(int(torch.Size(shape).numel()), dtype=torch.float32).reshape(shape)
        with sv.record():
            dt = make_dtensor(x, mesh, src)
        with sv.record() as trace:
            dt.redistribute(mesh, [_torch.placement_from_plain(parse(p)) for p in dst])
        planned = sv.plan(shape, mesh_shape, src, dst)
        recorded_red = trace.redistributes()
        if src == dst or not recorded_red:
            assert planned.collectives() == [] and not recorded_red
            return
        (red,) = recorded_red
        assert planned.events[0].plan == red.plan, (src, dst)
        assert planned.events[0].before == red.before and planned.events[0].after == red.after
        got, want = planned.collectives(), trace.collectives()
        assert [(c.op, c.groups, c.mesh_dim, c.reduce_op) for c in got] == [
            (c.op, c.groups, c.mesh_dim, c.reduce_op) for c in want
        ], (src, dst, str(trace))
        for g, w in zip(got, want, strict=True):
            assert {r: s.shape for r, s in g.inputs.items()} == {r: s.shape for r, s in w.inputs.items()}, (
                src,
                dst,
                g.op,
            )
            assert {r: s.shape for r, s in g.outputs.items()} == {r: s.shape for r, s in w.outputs.items()}, (
                src,
                dst,
                g.op,
            )
            assert g.nbytes == w.nbytes

    check()


def test_plan_of_a_model_size_weight_on_512_ranks():
    trace = sv.plan(
        (8192, 28672),
        (8, 8, 8),
        ["S(0)", "S(1)", "P"],
        ["R", "S(1)", "R"],
        ("pp", "dp", "tp"),
        dtype="bfloat16",
    )
    red, *cols = trace.events
    assert red.plan == "S(0)S(1)P(sum)->S(0)S(1)R->RS(1)R"
    assert [(c.op, c.mesh_dim_name, len(c.groups), len(c.groups[0])) for c in cols] == [
        ("all_reduce", "tp", 64, 8),
        ("all_gather", "pp", 64, 8),
    ]
    # The all-reduce moves each rank's (1024, 3584) bf16 shard: 7 MiB.
    assert cols[0].nbytes[0] == 1024 * 3584 * 2 and cols[0].inputs[511].values is None
    assert cols[1].outputs[0].shape == (8192, 3584)
    assert red.after.shard(511).shape == (8192, 3584)


def test_plan_refuses_what_dtensor_refuses():
    with pytest.raises(ValueError, match="refuses"):
        sv.plan((4,), (2,), ["R"], ["P"])
    with pytest.raises(ValueError, match="_StridedShard"):
        sv.plan((8,), (2, 2), ["_S(0,sf=2)", "S(0)"], ["R", "R"])


def test_a_plan_string_reads_back_into_steps():
    """What sv.plan writes, plan_steps reads back: one step per mesh dim, with the layouts around
    it and the collective that ran it (the player draws a recorded redistribute from these)."""
    trace = sv.plan((8, 4), (2, 2), ["S(0)", "S(0)"], ["R", "S(1)"], ("dp", "tp"))
    red, *cols = trace.events
    assert red.plan == "S(0)[0]S(0)[1]->S(0)S(1)->RS(1)"
    assert parse_plan_string(red.plan) == [
        [("S(0)", 0), ("S(0)", 1)],
        [("S(0)", None), ("S(1)", None)],
        [("R", None), ("S(1)", None)],
    ]
    steps = plan_steps(red, cols)
    assert [(s.mesh_dim, s.src, s.dst, s.op, s.event) for s in steps] == [
        (1, "S(0)", "S(1)", "all_to_all", 1),
        (0, "S(0)", "R", "all_gather", 2),
    ]
    assert steps[0].before == red.before and steps[-1].after == red.after
    assert steps[0].after is not None and steps[0].after.placements == ("S(0)", "S(1)")
    for text in ("", "S(0)", "S(0)->Q", "S(0)R->R"):
        assert parse_plan_string(text) is None, text
