"""PhysicsNeMo's ShardTensor traced and drawn end to end (issue 25), on the lockstep simulator and
on one thread per rank; real ranks (gloo) in tests/cluster/test_physicsnemo_gloo.py.

Expectations are independent of shardviz: the dot product is ``torch.dot`` of the global vectors,
each rank's drawn shard is the shape its ``to_local()`` really has, the handler's all-reduce
inputs are ``torch.dot`` of each rank's slices, and sizes written by hand (3, 3, 2, 2 chosen by
the test; 3, 3, 3, 1 for PhysicsNeMo's chunking of 10 over 4).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

import shardviz as sv
from shardviz.errors import PerRankValueError, ShardSpecError

try:  # installed by `make setup`: outside CI a missing PhysicsNeMo skips, under CI it fails
    import physicsnemo.domain_parallel  # noqa: F401
except ImportError as e:
    if os.environ.get("CI") == "true":
        pytest.fail(f"the PhysicsNeMo tests must run in CI, but it is not installed ({e})", pytrace=False)
    pytest.skip(f"PhysicsNeMo is not installed ({e}); `make setup` installs it", allow_module_level=True)

from physicsnemo.distributed import DistributedManager
from physicsnemo.domain_parallel import ShardTensor, scatter_tensor

SIZES = (3, 3, 2, 2)  # uneven on purpose: chunking would give 3, 3, 3, 1
OFFSETS = (0, 3, 6, 8)
SHAPES = {0: tuple((s,) for s in SIZES)}
HERE = str(Path(__file__).resolve())


def piece(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[OFFSETS[rank] : OFFSETS[rank] + SIZES[rank]].clone()


def sharded_dot_product(func, types, args, kwargs):
    """The seed's handler for torch.dot: local dot on each rank, then a sum all-reduce."""

    def extract_args(x, y, *args, **kwargs):
        return x, y

    x, y = extract_args(*args, **kwargs)
    if x._spec.placements != y._spec.placements or x._spec.mesh != y._spec.mesh:
        raise NotImplementedError("both vectors must be sharded alike")
    mesh = x._spec.mesh
    local_dot_product = torch.dot(x.to_local(), y.to_local())
    dist.all_reduce(local_dot_product, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return ShardTensor.from_local(local_dot_product, mesh, (Replicate(),))


def sharded_histogram(func, types, args, kwargs):
    """torch.histogram with weights: each rank's histogram of its shard, summed over the ranks."""

    def extract(input, bins, *, range=None, weight=None, density=False):
        return input, bins, range, weight, density

    x, bins, rng, w, density = extract(*args, **kwargs)
    assert rng is not None and not density
    mesh = x._spec.mesh
    hist, edges = torch.histogram(x.to_local(), bins, range=rng, weight=w.to_local())
    dist.all_reduce(hist, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return ShardTensor.from_local(hist, mesh, (Replicate(),)), ShardTensor.from_local(
        edges, mesh, (Replicate(),)
    )


@pytest.fixture
def lockstep():
    sv.use("local", world_size=4)
    torch.manual_seed(0)
    a, b = torch.randn(10), torch.randn(10)
    with sv.record():
        DistributedManager.initialize()
        mesh = DistributedManager().initialize_mesh(mesh_shape=[-1], mesh_dim_names=["domain"])
        x = ShardTensor.from_local(
            sv.per_rank(lambda r: piece(a, r)), mesh, (Shard(0),), sharding_shapes=SHAPES
        )
        y = ShardTensor.from_local(
            sv.per_rank(lambda r: piece(b, r)), mesh, (Shard(0),), sharding_shapes=SHAPES
        )
    return SimpleNamespace(a=a, b=b, mesh=mesh, x=x, y=y)


def held(st) -> dict[int, tuple[int, ...]]:
    """Each simulated rank's local shard shape, read from the LocalTensor to_local() gives."""
    return {r: tuple(t.shape) for r, t in st.to_local()._local_tensors.items()}


# ---- lockstep ---------------------------------------------------------------------------------------


def test_the_manager_adopts_the_simulated_world_and_follows_it():
    sv.use("local", world_size=4)
    with sv.record():
        DistributedManager.initialize()  # would start a single-process job without shardviz
        dm = DistributedManager()
        assert dm.distributed and dm.world_size == 4 and dm.device == torch.device("cpu")
        mesh = dm.initialize_mesh(mesh_shape=[-1], mesh_dim_names=["domain"])
    assert mesh.size() == 4 and mesh.mesh_dim_names == ("domain",)
    with sv.record():
        DistributedManager.cleanup()  # PhysicsNeMo's clean-up leaves shardviz's process group alone
        assert dist.is_initialized() and dist.get_backend() == "fake"
        assert DistributedManager.is_initialized() and DistributedManager().world_size == 4
    sv.use("local", world_size=2)
    with sv.record():
        DistributedManager.initialize()
        assert DistributedManager().world_size == 2
        assert DistributedManager().initialize_mesh(mesh_shape=[-1], mesh_dim_names=["d"]).size() == 2
    sv.use("local", world_size=4)


def test_the_seeds_dot_product_is_right_and_traced_like_dtensor_code(lockstep, handlers):
    s = lockstep
    handlers.register_function_handler(torch.dot, sharded_dot_product)
    with sv.record() as trace:
        c = torch.dot(s.x, s.y)
    want = torch.dot(s.a, s.b)
    for r, value in c.to_local()._local_tensors.items():
        torch.testing.assert_close(value, want, msg=f"rank {r}")
    kinds = [(e.kind, getattr(e, "name", getattr(e, "op", ""))) for e in trace.events]
    assert kinds == [
        ("op", "ShardTensor.to_local"),
        ("op", "ShardTensor.to_local"),
        ("local", "aten.dot"),
        ("collective", "all_reduce"),
        ("op", "ShardTensor.from_local"),
    ]
    to_local, dot, reduce, from_local = trace.events[0], trace.events[2], trace.events[3], trace.events[4]
    assert to_local.input_placements == (("S(0)",),) and from_local.output_placements == (("R",),)
    # the all-reduce's inputs: each rank's dot of its own slices, computed here with plain torch
    for r in range(4):
        local = torch.dot(piece(s.a, r), piece(s.b, r))
        np.testing.assert_allclose(reduce.inputs[r].values, local.numpy(), rtol=1e-6)
        np.testing.assert_allclose(dot.outputs[r].values, local.numpy(), rtol=1e-6)
        np.testing.assert_allclose(reduce.outputs[r].values, want.numpy(), rtol=1e-6)
    assert reduce.groups == ((0, 1, 2, 3),)
    # every event names a line of this file (the handler's), none of PhysicsNeMo's
    assert {e.source.file for e in trace.events} == {HERE}
    assert reduce.source.text.startswith("dist.all_reduce(local_dot_product")


def _patches(fig, prefix):
    return [p for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith(prefix)]


def test_every_view_draws_each_ranks_true_shard(lockstep, tmp_path):
    s = lockstep
    have = held(s.x)
    assert sorted(have.values()) == [(2,), (2,), (3,), (3,)]
    lay = sv.layout(s.x)
    assert {sh.rank: sh.shape for sh in lay} == have
    assert [sh.offset for sh in lay] == [(0,), (3,), (6,), (8,)]
    widget = sv.show(s.x)
    assert {sh.rank: sh.shape for sh in widget.tensor_layout} == have
    assert widget.title == "ShardTensor 10 float32"  # not DTensor's title
    np.testing.assert_allclose(widget.global_values(), s.a.numpy())  # the shards tile the vector
    fig = sv.plot(s.x)
    areas = {
        int(p.get_gid()[len("shard-r") :]): p.get_width() * p.get_height() for p in _patches(fig, "shard-r")
    }
    assert areas == {r: float(np.prod(shape)) for r, shape in have.items()}
    out = sv.export_html(s.x, tmp_path / "x.html")
    data = re.search(
        r'<script type="application/json" id="shardviz-data">(.*?)</script>', out.read_text(), re.S
    )
    assert data is not None
    assert json.loads(data.group(1))["state"]["geometry"]["shapes"] == [list(have[r]) for r in range(4)]
    model = torch.nn.Module()
    model.register_buffer("field", s.x)
    m = sv.model_map(model)
    assert {r: m.local_shape("field", r) for r in range(4)} == have
    assert m.row("field").distributed


def test_a_spec_that_disagrees_with_the_data_is_refused_not_drawn(lockstep):
    s = lockstep
    with sv.record():  # chunks of 3, 3, 3, 1 declared as 3, 3, 2, 2: PhysicsNeMo does not check
        bad = ShardTensor.from_local(
            sv.per_rank(lambda r: s.a.chunk(4)[r].clone()), s.mesh, (Shard(0),), sharding_shapes=SHAPES
        )
    message = r"rank 2 holds a local tensor of shape \(3,\) where the spec says \(2,\); rank 3 holds"
    with pytest.raises(ShardSpecError, match=message):
        sv.layout(bad)
    with pytest.raises(ShardSpecError, match=message):
        sv.show(bad)


def test_the_sharding_error_shows_true_sizes_and_shardtensors_ways_out(lockstep):
    s = lockstep
    with pytest.raises(NotImplementedError) as info, sv.record():
        torch.histogram(s.x, 4, range=(-3.0, 3.0), weight=s.y)
    msg = str(info.value)
    assert msg.startswith("Operator aten.histogram.bin_ct does not have a sharding strategy registered.")
    table = (
        "rank  coord  offset  shape  indices\n"
        "   0  (0,)   (0,)    (3,)   [0:3]\n"
        "   1  (1,)   (3,)    (3,)   [3:6]\n"
        "   2  (2,)   (6,)    (2,)   [6:8]\n"
        "   3  (3,)   (8,)    (2,)   [8:10]"
    )
    assert msg.count(table) == 2  # both inputs, with their true sizes
    assert "would assume chunking: (3,), (3,), (3,), (1,)" in msg
    assert "ShardTensor.register_function_handler(torch.histogram, handler)" in msg
    assert "register_dispatch_handler(torch.ops.aten.histogram.bin_ct, handler)" in msg
    assert "reached only under torch.compile" in msg


def test_a_histogram_handler_equals_the_global_histogram(lockstep, handlers):
    s = lockstep
    handlers.register_function_handler(torch.histogram, sharded_histogram)
    with sv.record() as trace:
        hist, edges = torch.histogram(s.x, 4, range=(-3.0, 3.0), weight=s.y)
    want, want_edges = torch.histogram(s.a, 4, range=(-3.0, 3.0), weight=s.b)
    for r in range(4):
        torch.testing.assert_close(hist.to_local()._local_tensors[r], want)
        torch.testing.assert_close(edges.to_local()._local_tensors[r], want_edges)
    (reduce,) = trace.collectives()
    for r in range(4):
        local, _ = torch.histogram(piece(s.a, r), 4, range=(-3.0, 3.0), weight=piece(s.b, r))
        np.testing.assert_allclose(reduce.inputs[r].values, local.numpy(), rtol=1e-6)
    kinds = [(e.kind, getattr(e, "name", getattr(e, "op", ""))) for e in trace.events]
    assert kinds == [
        ("op", "ShardTensor.to_local"),
        ("op", "ShardTensor.to_local"),
        ("local", "aten.histogram.bin_ct"),
        ("collective", "all_reduce"),
        ("op", "ShardTensor.from_local"),
        ("op", "ShardTensor.from_local"),
    ]
    assert {e.source.file for e in trace.events} == {HERE}


def test_rank_dependent_physicsnemo_code_in_lockstep_points_at_threads(lockstep):
    s = lockstep
    with (
        pytest.raises(PerRankValueError, match=r'scatter_tensor .*sv\.use\("threads", world_size=N\)'),
        sv.record(),
    ):
        scatter_tensor(s.a, 0, s.mesh, (Shard(0),))
    with pytest.raises(PerRankValueError, match=r'_to_replicate_tensor .*sv\.use\("threads"'), sv.record():
        s.x.full_tensor()  # uneven: PhysicsNeMo pads with `if` on each rank's size
    # A list indexed by the mesh coordinate: a PerRankValueError (was torch's bare AttributeError).
    with (
        pytest.raises(PerRankValueError, match=r'(?s)_shard_tensor_spec.py:\d+: .*sv\.use\("threads"'),
        sv.record(),
    ):
        ShardTensor.from_local(
            sv.per_rank(lambda r: s.a.chunk(4)[r].clone()),
            s.mesh,
            (Shard(0),),
            sharding_shapes="chunk",
            global_shape=(10,),
        )


def test_a_users_handler_branching_on_the_rank_is_not_blamed_on_physicsnemo(lockstep, handlers):
    s = lockstep

    def rank_zero_only(func, types, args, kwargs):
        if dist.get_rank() == 0:  # the user's own rank-dependent line, called from ShardTensor
            return args[0]
        return args[1]

    handlers.register_function_handler(torch.dot, rank_zero_only)
    with pytest.raises(PerRankValueError) as info, sv.record():
        torch.dot(s.x, s.y)
    assert "PhysicsNeMo's" not in str(info.value) and "the simulated ranks disagree" in str(info.value)


def test_inferring_shard_sizes_on_cpu_says_to_give_them(lockstep):
    s = lockstep
    with (
        pytest.raises(
            RuntimeError, match=r'sharding_shapes="infer" \(the default of ShardTensor\.from_local\)'
        ),
        sv.record(),
    ):
        ShardTensor.from_local(sv.per_rank(lambda r: piece(s.a, r)), s.mesh, (Shard(0),))


def test_a_reduction_is_recorded_with_its_partial_and_the_all_reduce(lockstep):
    s = lockstep
    with sv.record() as trace:
        total = s.x.sum().full_tensor()
    assert total.reconcile().item() == pytest.approx(s.a.sum().item(), rel=1e-5)
    (red,) = trace.redistributes()
    assert (red.src, red.dst, red.explicit) == (("P(sum)",), ("R",), True)
    assert [c.op for c in trace.collectives()] == ["all_reduce"]
    assert trace.collectives()[0].parent == red.id and red.source.file == HERE


# ---- one thread per rank ----------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_the_seed_runs_as_written_on_one_thread_per_rank(handlers):
    sv.use("threads", world_size=4)
    handlers.register_function_handler(torch.dot, sharded_dot_product)
    torch.manual_seed(1)
    n = 10  # the seed's 1_000_000_000 does not fit a test
    a, b = torch.randn(n), torch.randn(n)

    def seed():
        DistributedManager.initialize()
        dm = DistributedManager()
        c_baseline = torch.dot(a, b)
        mesh = dm.initialize_mesh(mesh_shape=[-1], mesh_dim_names=["domain"])
        placements = (Shard(0),)
        a_sharded = scatter_tensor(tensor=a, global_src=0, mesh=mesh, placements=placements)
        b_sharded = scatter_tensor(tensor=b, global_src=0, mesh=mesh, placements=placements)
        c_sharded = torch.dot(a_sharded, b_sharded).full_tensor()
        return dm.rank, torch.allclose(c_baseline, c_sharded), c_sharded, tuple(a_sharded.to_local().shape)

    try:
        trace = sv.run(seed)
    finally:
        sv.use("local", world_size=4)
    want = torch.dot(a, b)
    chunks = [(0, 3), (3, 6), (6, 9), (9, 10)]  # PhysicsNeMo's split of 10 over 4, by hand
    for r in range(4):
        rank, agree, c, local_shape = trace.results[r]
        assert rank == r and agree
        torch.testing.assert_close(c, want)
        assert local_shape == (chunks[r][1] - chunks[r][0],)
    scatters = trace.redistributes()
    assert [(e.src, e.dst, e.explicit) for e in scatters] == [(("R",), ("S(0)",), True)] * 2
    for e in scatters:  # drawn after the scatter: exactly what each rank holds
        assert [sh.shape for sh in e.after] == [trace.results[r][3] for r in range(4)]
        assert [sh.shape for sh in e.before] == [(n,)] * 4
    reduce = next(c for c in trace.collectives() if c.op == "all_reduce")
    for r, (lo, hi) in enumerate(chunks):
        np.testing.assert_allclose(reduce.inputs[r].values, torch.dot(a[lo:hi], b[lo:hi]).numpy(), rtol=1e-6)
    assert {e.source.file for e in trace.events} == {HERE}
    assert {e.source.text for e in trace.events if e.kind == "collective" and e.op == "broadcast"} == {
        "a_sharded = scatter_tensor(tensor=a, global_src=0, mesh=mesh, placements=placements)",
        "b_sharded = scatter_tensor(tensor=b, global_src=0, mesh=mesh, placements=placements)",
    }


@pytest.mark.timeout(180)
def test_on_threads_the_sharding_error_is_explained_too():
    sv.use("threads", world_size=4)
    a = torch.arange(10.0)

    def fn():
        mesh = DistributedManager().initialize_mesh(mesh_shape=[-1], mesh_dim_names=["domain"])
        x = ShardTensor.from_local(piece(a, dist.get_rank()), mesh, (Shard(0),), sharding_shapes=SHAPES)
        return torch.histogram(x, 4, range=(0.0, 10.0), weight=x)

    try:
        with pytest.raises(NotImplementedError) as info:
            sv.run(fn)
    finally:
        sv.use("local", world_size=4)
    msg = str(info.value)
    assert "   2  (2,)   (6,)    (2,)   [6:8]" in msg  # rank 2's true shard
    assert "ShardTensor.register_function_handler(torch.histogram, handler)" in msg


@pytest.mark.timeout(180)
def test_on_threads_the_gather_of_uneven_shards_is_drawn_and_stepped_with_true_sizes():
    sv.use("threads", world_size=4)
    a = torch.arange(10.0)

    def fn():
        mesh = DistributedManager().initialize_mesh(mesh_shape=[-1], mesh_dim_names=["domain"])
        r = dist.get_rank()
        x = ShardTensor.from_local(piece(a, r), mesh, (Shard(0),), sharding_shapes=SHAPES)
        return tuple(x.to_local().shape), sv.show(x), x.full_tensor()

    try:
        trace = sv.run(fn)
    finally:
        sv.use("local", world_size=4)
    have = {r: trace.results[r][0] for r in range(4)}
    for r in range(4):
        torch.testing.assert_close(trace.results[r][2], a)
    widget = trace.results[0][1]  # every rank's part of sv.show, drawn together
    assert {sh.rank: sh.shape for sh in widget.tensor_layout} == have
    np.testing.assert_allclose(widget.global_values(), a.numpy())
    (red,) = trace.redistributes()
    assert {sh.rank: sh.shape for sh in red.before} == have and red.explicit
    player = sv.play(trace)
    gather = next(k for k, e in enumerate(player.steps) if getattr(e, "op", None) == "all_gather")
    d = player.detail(gather)
    # PhysicsNeMo pads each shard to the largest (3): ranks 2 and 3 send one padding element
    assert [d["ranks"][str(r)]["in"].get("pad", []) for r in range(4)] == [
        [],
        [],
        [[2, 3, 0, 1]],
        [[2, 3, 0, 1]],
    ]
    assert d["check"]["ok"] and d["check"]["checked"]


# ---- imported only when PhysicsNeMo is --------------------------------------------------------------


@pytest.mark.timeout(120)
def test_the_adapter_loads_when_physicsnemo_is_imported_and_not_before():
    code = (
        "import sys\n"
        "import shardviz\n"
        "assert 'physicsnemo' not in sys.modules, 'importing shardviz imported PhysicsNeMo'\n"
        "assert 'shardviz.capture.adapters.physicsnemo' not in sys.modules\n"
        "from physicsnemo.distributed import DistributedManager\n"
        "assert 'shardviz.capture.adapters.physicsnemo' in sys.modules\n"
        "print(type(DistributedManager.__dict__['_shared_state']).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "_ManagerState"
