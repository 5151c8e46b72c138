"""Issue 26: full tensors from per-rank shards, and the comparison of two runs (plain data).

Per-rank pieces come from torch's own sharding (``distribute_tensor`` in the simulator) or are
written by hand; expected full tensors are the global tensor they came from, or a reduction
written out by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import shardviz as sv
from shardviz.capture import torch as _torch
from shardviz.data.numerics import (
    EXACT,
    Entry,
    RawCapture,
    RawTensor,
    RowKey,
    StepNumerics,
    Tolerance,
    assemble,
    axes,
    build_run,
    compare,
    infer,
    merge_raw,
    tolerance_for,
)
from shardviz.geometry.layout import compute

pytestmark = pytest.mark.timeout(120)

F32 = tolerance_for("float32")


def shards_of(dt) -> dict[int, np.ndarray]:
    local = _torch.local_tensors(_torch.local_of(dt))
    assert local is not None
    return {r: t.numpy().copy() for r, t in local.items()}


@pytest.mark.parametrize(
    "placements",
    [
        [Shard(0), Shard(1)],  # uneven: 7 rows over 2, 5 columns over 4
        [_StridedShard(0, split_factor=2), Shard(0)],  # FSDP over TP's rows: non-contiguous rows
        [Shard(1), Shard(1)],  # one dim split twice: 5 columns over 8
    ],
    ids=["uneven", "strided", "twice"],
)
def test_shards_assemble_into_the_tensor_torch_split(placements):
    sv.use("local", world_size=8)
    x = torch.arange(35.0).reshape(7, 5)
    with sv.record():
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        dt = distribute_tensor(x, mesh, placements, src_data_rank=None)
        layout = sv.layout(dt)
        pieces = shards_of(dt)
    got = assemble(layout, pieces, F32)
    assert got.problem is None and got.disagreements == ()
    np.testing.assert_array_equal(got.full, x.numpy())


def test_partial_is_reduced_by_its_op():
    lay = compute((2, 3), (2, 2), ["P(sum)", "S(1)"], ("tp", "sp"))
    # Ranks (0, 1) hold columns 0:2 and 2:3 of one partial value, ranks (2, 3) of the other.
    a = np.array([[1.0, 2, 3], [4, 5, 6]])
    b = np.array([[10.0, 20, 30], [40, 50, 60]])
    pieces = {0: a[:, :2], 1: a[:, 2:], 2: b[:, :2], 3: b[:, 2:]}
    got = assemble(lay, pieces, F32)
    np.testing.assert_array_equal(got.full, a + b)
    assert any("Partial(sum) reduced over tp" in n for n in got.notes)
    avg = assemble(compute((2, 3), (2,), ["P(avg)"]), {0: a, 1: b}, F32)
    np.testing.assert_array_equal(avg.full, (a + b) / 2)
    mx = assemble(compute((2, 3), (2,), ["P(max)"]), {0: a, 1: -b}, F32)
    np.testing.assert_array_equal(mx.full, a)


def test_replicas_that_disagree_are_named_and_the_majority_kept():
    lay = compute((4,), (4,), ["R"], ("tp",))
    good = np.array([1.0, 2.0, 3.0, 4.0])
    bad = good.copy()
    bad[2] += 2e-3
    got = assemble(lay, {0: good, 1: good, 2: bad, 3: good}, F32)
    np.testing.assert_array_equal(got.full, good)
    (d,) = got.disagreements
    assert d.groups == ((0, 1, 3), (2,))
    assert d.max_abs == pytest.approx(2e-3)
    assert d.index == (2,)
    assert str(d) == "replicas over tp: rank 2 differs from ranks 0-1,3 (max abs 0.002 at [2])"
    # Within tolerance is agreement: a last-bit difference is no finding.
    close = good * (1 + 1e-7)
    assert assemble(lay, {0: good, 1: good, 2: close, 3: good}, F32).disagreements == ()


def test_replicas_of_one_shard_are_compared_shard_by_shard():
    # [S(0), R] on (2, 2): ranks 0, 1 hold rows 0:2, ranks 2, 3 rows 2:4; rank 3 drifts.
    lay = compute((4, 2), (2, 2), ["S(0)", "R"], ("dp", "tp"))
    x = np.arange(8.0).reshape(4, 2)
    drift = x[2:].copy()
    drift[1, 0] = 100.0
    got = assemble(lay, {0: x[:2], 1: x[:2], 2: x[2:], 3: drift}, F32)
    (d,) = got.disagreements
    assert d.scope == "replicas over tp"
    assert d.groups == ((2,), (3,))
    assert d.index == (3, 0)  # the global index of the differing element


def test_fsdp_padding_is_cut_and_a_short_local_tensor_is_a_problem():
    lay = compute((5, 2), (2,), ["S(0)"])  # rows 0:3 and 3:5: rank 1's shard is short
    x = np.arange(10.0).reshape(5, 2)
    padded = np.concatenate([x[3:], np.zeros((1, 2))])  # FSDP pads rank 1 to 3 rows
    got = assemble(lay, {0: x[:3], 1: padded}, F32)
    np.testing.assert_array_equal(got.full, x)
    assert any("padding cut" in n and "ranks 1" in n for n in got.notes)
    short = assemble(lay, {0: x[:2], 1: x[3:]}, F32)
    assert short.full is None and "rank 0 holds a local tensor of shape (2, 2)" in (short.problem or "")


def test_groups_of_a_sub_mesh_that_disagree_are_reported():
    lay = compute((2,), (2,), ["S(0)"], ("tp",), groups=[[0, 1], [2, 3]])
    got = assemble(lay, {0: np.array([1.0]), 1: np.array([2.0]), 2: np.array([1.0]), 3: np.array([5.0])}, F32)
    (d,) = got.disagreements
    assert "groups of the sub-mesh" in d.scope
    assert d.groups == ((0, 1), (2, 3))


def test_a_plain_local_shard_is_laid_out_by_the_reference_shape():
    tp = compute((8,), (2, 4), ["R", "S(0)"], ("dp", "tp"))  # a layout of the run: its meshes
    x = np.arange(2 * 8 * 3.0).reshape(2, 8, 3)
    # Sequence parallel: tp coordinate c holds positions 2c:2c+2 of dim 1, on both dp groups.
    pieces = {r: x[:, 2 * (r % 4) : 2 * (r % 4) + 2] for r in range(8)}
    got = infer((2, 8, 3), pieces, axes([tp]), F32)
    assert got.problem is None and got.inferred
    np.testing.assert_array_equal(got.full, x)
    assert got.notes[0] == "layout inferred from shapes: split along dim 1 over tp (4)"


def test_an_ambiguous_or_impossible_plain_layout_is_a_problem_not_a_guess():
    mesh = compute((4,), (2, 2), ["S(0)", "R"], ("dp", "tp"))
    x = np.arange(8.0).reshape(2, 4)
    # Both mesh dims have 2 ranks: split over dp or over tp fits the shapes; these values fit
    # neither without a disagreement and the two readings give different tensors.
    pieces = {0: x[:, :2], 1: x[:, 2:] + 1, 2: x[:, 2:], 3: x[:, :2] + 1}
    got = infer((2, 4), pieces, axes([mesh]), F32)
    assert got.full is None and "fit both" in (got.problem or "")
    odd = infer((2, 4), {r: x[:, :3] for r in range(4)}, axes([mesh]), F32)
    assert odd.full is None and "no mesh dim of this run splits dim 1" in (odd.problem or "")


def test_tolerances_by_dtype_and_overrides():
    assert tolerance_for("float32") == Tolerance(1e-5, 1e-5)
    assert tolerance_for("bfloat16") == Tolerance(1e-2, 1e-2)
    assert tolerance_for("int64") == EXACT
    assert tolerance_for("float32", 1e-3) == Tolerance(1e-3, 1e-3)
    assert tolerance_for("float32", {"bfloat16": 0.1}) == Tolerance(1e-5, 1e-5)
    assert tolerance_for("bfloat16", {"bfloat16": (0.1, 0.2)}) == Tolerance(0.1, 0.2)
    with pytest.raises(TypeError, match="rtol"):
        tolerance_for("float32", "tight")  # type: ignore[arg-type]


def _run(label: str, values: dict[RowKey, np.ndarray], world: int = 1) -> StepNumerics:
    tensors = tuple(
        RawTensor(key=k, order=i, dtype=str(v.dtype), values={None: v})
        for i, (k, v) in enumerate(values.items())
    )
    return build_run(label, RawCapture(world, "Net", (("", "Net"), ("fc", "Linear")), tensors))


def test_compare_finds_the_first_row_beyond_tolerance_and_where():
    out = RowKey("fc", 0, "output", "")
    inp = RowKey("fc", 0, "input", "0")
    grad = RowKey("fc", 0, "grad", "weight")
    want = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    got = want.copy()
    got[1, 2:4] += 0.5  # row 1, columns 2-3 differ
    ref = _run("plain", {inp: want, out: want, grad: want})
    par = _run("par", {inp: want * (1 + 1e-7), out: got, grad: got}, world=1)
    report = compare(ref, par)
    assert [r.status for r in report.rows] == ["ok", "differs", "differs"]
    first = report.first
    assert first is not None and first.key == out
    assert first.max_abs == pytest.approx(0.5)
    assert first.count == 2 and first.numel == 12
    assert first.spans == (((1, 2),), ((2, 4),))
    assert first.where() == "dim 0 [1], dim 1 [2:4]"
    assert first.index == (1, 2)  # the same error, where the reference is smaller
    assert first.values == (6.5, 6.0)
    assert report.after() == [report.rows[2]]
    assert report.row("Net.fc", "weight.grad").status == "differs"
    # Looser: nothing differs.
    assert compare(ref, par, tolerance=0.1).first is None


def test_compare_exact_ints_nan_and_missing_rows():
    k_ids = RowKey("", 0, "input", "0")
    k_nan = RowKey("fc", 0, "output", "")
    k_only = RowKey("fc", 1, "output", "")
    ids = np.array([1, 2, 3])
    nan = np.array([1.0, np.nan])
    ref = _run("plain", {k_ids: ids, k_nan: nan, k_only: nan})
    par = _run("par", {k_ids: np.array([1, 2, 4]), k_nan: nan.copy()})
    report = compare(ref, par)
    by = {r.key: r for r in report.rows}
    assert by[k_ids].status == "differs" and by[k_ids].index == (2,)
    assert by[k_nan].status == "ok"  # NaN where the reference has NaN is equal
    assert by[k_only].status == "missing"
    assert not report.ok


def test_copies_that_add_up_to_the_reference_are_called_a_partial_value():
    key = RowKey("fc", 0, "output", "")
    want = np.array([3.0, 5.0])
    ref = _run("plain", {key: want})
    # A plain tensor on two ranks holding two halves of a sum: not replicated at all.
    raw = RawCapture(
        2,
        "Net",
        (("fc", "Linear"),),
        (RawTensor(key, 0, "float32", {0: np.array([1.0, 2.0]), 1: np.array([2.0, 3.0])}),),
    )
    report = compare(ref, build_run("par", raw))
    (row,) = report.rows
    assert row.status == "differs"
    assert row.disagreements[0].groups == ((0,), (1,))
    assert any("add up to the reference: a Partial(sum) value" in n for n in row.notes)


def test_merge_raw_unions_each_ranks_pieces():
    key = RowKey("fc", 0, "output", "")
    lay = compute((4,), (2,), ["S(0)"])
    mine = [
        RawCapture(2, "Net", (), (RawTensor(key, 0, "float32", {r: np.full(2, float(r))}, lay),))
        for r in range(2)
    ]
    run = build_run("par", merge_raw(mine))
    entry: Entry = run[key]
    np.testing.assert_array_equal(entry.full, [0.0, 0.0, 1.0, 1.0])
