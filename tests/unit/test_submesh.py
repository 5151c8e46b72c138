"""Sub-meshes in their world (issue 15): a DTensor on ``mesh["tp"]`` of a (2, 4) mesh is held by
all 8 ranks, in two groups of 4, each with its own values.

Expectations are written out by hand (ranks per group, the text table) or computed from plain
torch on the global tensor (each rank's local tensor is ``torch.chunk`` of its group's tensor).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import matplotlib
import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from widget_comm import invoke

import shardviz as sv
from shardviz.capture import torch as _torch
from shardviz.geometry.layout import Layout
from shardviz.geometry.mesh import submesh_groups
from shardviz.views import geometry as g

matplotlib.use("Agg")

TP_GROUPS = ((0, 1, 2, 3), (4, 5, 6, 7))
DP_GROUPS = ((0, 4), (1, 5), (2, 6), (3, 7))
DP_TP_GROUPS = ((0, 1, 4, 5), (2, 3, 6, 7))  # mesh["dp", "tp"] of a (2, 2, 2) dp-cp-tp mesh
DP_CP_GROUPS = ((0, 2, 4, 6), (1, 3, 5, 7))  # mesh["dp", "cp"] flattened


def _base(r: int) -> torch.Tensor:
    """Rank r's data: the same 8x8 tensor, shifted by 100 per tp group, so groups differ."""
    return torch.arange(64.0).reshape(8, 8) + 100 * (r // 4)


@pytest.fixture(scope="module")
def sim():
    sv.use("local", world_size=8)
    with sv.record():
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        m3 = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
        flat = m3["dp", "cp"]._flatten("dp_cp")
        per = sv.per_rank(_base)
        out = {
            "mesh": mesh,
            "m3": m3,
            "flat": flat,
            "tp": distribute_tensor(per, mesh["tp"], [Shard(0)], src_data_rank=None),
            "dp": distribute_tensor(per, mesh["dp"], [Shard(1)], src_data_rank=None),
            "dp_tp": distribute_tensor(per, m3["dp", "tp"], [Shard(0), Shard(1)], src_data_rank=None),
            "dp_cp": distribute_tensor(per, flat, [Shard(0)], src_data_rank=None),
            "whole": distribute_tensor(torch.arange(64.0).reshape(8, 8), mesh, [Shard(0), Shard(1)]),
        }
    return out


# ---- which ranks hold a sub-mesh ----------------------------------------------------------------


def test_submesh_groups_pure_by_hand():
    assert submesh_groups((2, 4), (1,)) == [list(g) for g in TP_GROUPS]
    assert submesh_groups((2, 4), (0,)) == [list(g) for g in DP_GROUPS]
    assert submesh_groups((2, 2, 2), (0, 2)) == [list(g) for g in DP_TP_GROUPS]
    assert submesh_groups((2, 2, 2), (0, 1)) == [list(g) for g in DP_CP_GROUPS]
    assert submesh_groups((2, 4), (0, 1)) == [list(range(8))]
    with pytest.raises(ValueError, match="distinct mesh dims"):
        submesh_groups((2, 4), (1, 0))


def test_mesh_groups_of_slices_and_flattens_by_hand(sim):
    mesh, m3, flat = sim["mesh"], sim["m3"], sim["flat"]
    assert _torch.mesh_groups(mesh["tp"]) == TP_GROUPS
    assert _torch.mesh_groups(mesh["dp"]) == DP_GROUPS
    assert _torch.mesh_groups(m3["dp", "tp"]) == DP_TP_GROUPS
    assert _torch.mesh_groups(flat) == DP_CP_GROUPS
    assert _torch.mesh_groups(mesh) == (tuple(range(8)),)


@pytest.mark.parametrize(
    ("name", "groups", "mesh_shape"),
    [
        ("tp", TP_GROUPS, (4,)),
        ("dp", DP_GROUPS, (2,)),
        ("dp_tp", DP_TP_GROUPS, (2, 2)),
        ("dp_cp", DP_CP_GROUPS, (4,)),
    ],
)
def test_every_rank_of_every_group_is_laid_out_as_torch_chunks_it(sim, name, groups, mesh_shape):
    d = sim[name]
    lay = sv.layout(d)
    assert lay.groups == groups
    assert lay.mesh_shape == mesh_shape
    assert lay.mesh_ranks == groups[0]
    assert sorted(lay.ranks) == list(range(8))
    assert [s.rank for s in lay.shards] == [r for grp in groups for r in grp]
    local = _torch.local_tensors(d._local_tensor)
    placements = d.placements
    for gi, grp in enumerate(groups):
        for k, rank in enumerate(grp):
            whole = _base(rank)  # src_data_rank=None: each rank cuts its shard from its own data
            s = lay.shard(rank)
            assert s.group == gi
            coord = tuple(int(c) for c in np.unravel_index(k, mesh_shape))
            assert s.coord == coord
            want = whole
            for m, p in enumerate(placements):  # torch.chunk per mesh dim, left to right
                want = torch.chunk(want, mesh_shape[m], dim=p.dim)[coord[m]]
            assert torch.equal(local[rank], want), (name, rank)
            assert s.shape == tuple(want.shape)
            ix = np.ix_(*(np.concatenate([np.arange(r.start, r.stop) for r in runs]) for runs in s.indices))
            assert torch.equal(whole[ix], want)


def test_whole_world_mesh_is_unchanged(sim):
    lay = sv.layout(sim["whole"])
    assert lay.groups == () and lay.instances == (tuple(range(8)),)
    assert all(s.group == 0 for s in lay.shards)
    assert "groups" not in lay.to_dict() and "group" not in lay.to_dict()["shards"][0]
    assert "group" not in str(lay)
    assert lay == sv.layout((8, 8), (2, 4), ["S(0)", "S(1)"], ("dp", "tp"))


def test_text_lists_every_rank_with_its_group_by_hand(sim):
    assert str(sv.layout(sim["tp"])) == textwrap.dedent(
        """\
        Layout (8, 8) float32 on mesh (4,) ('tp',) placements [S(0)]
        sub-mesh in 2 groups of 4 ranks, each holding the whole tensor: [0, 1, 2, 3] [4, 5, 6, 7]
        rank  group  coord  offset  shape   indices
           0  0      (0,)   (0, 0)  (2, 8)  [0:2, 0:8]
           1  0      (1,)   (2, 0)  (2, 8)  [2:4, 0:8]
           2  0      (2,)   (4, 0)  (2, 8)  [4:6, 0:8]
           3  0      (3,)   (6, 0)  (2, 8)  [6:8, 0:8]
           4  1      (0,)   (0, 0)  (2, 8)  [0:2, 0:8]
           5  1      (1,)   (2, 0)  (2, 8)  [2:4, 0:8]
           6  1      (2,)   (4, 0)  (2, 8)  [4:6, 0:8]
           7  1      (3,)   (6, 0)  (2, 8)  [6:8, 0:8]"""
    )


def test_pure_layout_with_groups_equals_the_dtensors(sim):
    for name, world, dims, shape, placements, names in [
        ("tp", (2, 4), (1,), (4,), ["S(0)"], ("tp",)),
        ("dp", (2, 4), (0,), (2,), ["S(1)"], ("dp",)),
        ("dp_tp", (2, 2, 2), (0, 2), (2, 2), ["S(0)", "S(1)"], ("dp", "tp")),
        ("dp_cp", (2, 2, 2), (0, 1), (4,), ["S(0)"], ("dp_cp",)),
    ]:
        pure = sv.layout((8, 8), shape, placements, names, groups=submesh_groups(world, dims))
        assert pure == sv.layout(sim[name]), name


def test_trace_dict_round_trips_and_old_files_still_read(sim):
    lay = sv.layout(sim["dp"])
    d = json.loads(json.dumps(lay.to_dict()))
    assert d["groups"] == [list(g) for g in DP_GROUPS]
    assert Layout.from_dict(d) == lay
    old = sv.layout((8, 8), (4,), ["S(0)"]).to_dict()  # a file written before groups existed
    assert Layout.from_dict(old).groups == () and Layout.from_dict(old) == sv.layout((8, 8), (4,), ["S(0)"])


def test_bad_groups_are_explained():
    with pytest.raises(ValueError, match="group of 3 ranks"):
        sv.layout((8,), (4,), ["S(0)"], groups=[[0, 1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="one group only"):
        sv.layout((8,), (2,), ["S(0)"], groups=[[0, 1], [1, 2]])
    # one group is the same as mesh_ranks
    assert sv.layout((8,), (2,), ["S(0)"], groups=[[2, 3]]) == sv.layout(
        (8,), (2,), ["S(0)"], mesh_ranks=[2, 3]
    )


# ---- views --------------------------------------------------------------------------------------


def test_show_syncs_all_ranks_and_each_group_has_its_own_global_tensor(sim):
    w = sv.show(sim["tp"])
    geo = w.geometry
    assert geo["ranks"] == list(range(8))
    assert geo["groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert geo["group_of"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert w.values_info["ranks"] == list(range(8))
    for grp in (0, 1):
        meta, buffers = invoke(w, "fetch_values", {"rank": -1, "group": grp}, only=True)
        assert meta["group"] == grp
        np.testing.assert_array_equal(g.decode(meta, bytes(buffers[0])), _base(4 * grp).numpy())
    meta, buffers = invoke(w, "fetch_values", {"rank": 6}, only=True)
    np.testing.assert_array_equal(g.decode(meta, bytes(buffers[0])), torch.chunk(_base(6), 4)[2].numpy())
    meta, _ = invoke(w, "fetch_values", {"rank": -1, "group": 2}, only=True)
    assert "no group 2" in meta["error"]
    assert "group 1: ranks 4-7" in " ".join(geo["notes"])
    assert w.text().endswith("values: ranks 0-7")


def test_plot_draws_every_group(sim):
    fig = sv.plot(sim["dp"])
    gids = {ax.get_gid() for ax in fig.axes}
    assert {f"tensor-g{k}" for k in range(4)} <= gids and {f"mesh-g{k}" for k in range(4)} <= gids
    mesh_ranks = {p.get_gid() for ax in fig.axes for p in ax.patches if str(p.get_gid()).startswith("mesh-r")}
    assert mesh_ranks == {f"mesh-r{r}" for r in range(8)}
    fig = sv.plot(sim["tp"], heatmap=True)
    assert {"tensor-g0", "tensor-g1", "colorbar"} <= {ax.get_gid() for ax in fig.axes}


def test_export_html_holds_every_rank_and_each_groups_tensor(sim, tmp_path):
    path = sv.export_html(sim["tp"], tmp_path / "tp.html")
    text = path.read_text(encoding="utf-8")
    data = json.loads(text.split('id="shardviz-data">', 1)[1].split("</script>", 1)[0].replace("<\\/", "</"))
    assert data["state"]["geometry"]["ranks"] == list(range(8))
    keys = {json.loads(k)[1].get("rank") for k, _, _ in data["responses"]}
    assert keys == {-1, *range(8)}
    groups = sorted(
        json.loads(k)[1].get("group") for k, _, _ in data["responses"] if json.loads(k)[1]["rank"] == -1
    )
    assert groups == [0, 1]


def test_past_16_ranks_one_group_is_drawn_and_picked():
    lay = sv.layout((8, 8), (4,), ["S(1)"], ("tp",), groups=submesh_groups((8, 4), (1,)))
    assert lay.world_size == 32 and len(lay.groups) == 8
    assert g.shown_groups(lay) == [0] and g.shown_groups(lay, 5) == [5]
    w = sv.show(lay, selected=22)
    assert w.group == 5  # opens on the selected rank's group
    fig = sv.plot(lay, group=3)
    gids = {ax.get_gid() for ax in fig.axes}
    assert "tensor-g3" in gids and "tensor-g0" not in gids
    with pytest.raises(ValueError, match="group=8"):
        sv.plot(lay, group=8)


# ---- real ranks: each rank's sub-mesh is its own group, the layouts still agree -----------------

_RANKS_SCRIPT = """
import json, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
import shardviz as sv
out = {}
for r in range(8):
    dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=8)
    tp = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))["tp"]
    local = torch.chunk(torch.arange(64.0).reshape(8, 8) + 100 * (r // 4), 4)[tp.get_local_rank()]
    d = DTensor.from_local(local.clone(), tp, [Shard(0)], run_check=False)
    out[r] = {"layout": sv.layout(d).to_dict(), "values": local.tolist(), "mesh": tp.mesh.tolist()}
    dist.destroy_process_group()
json.dump(out, sys.stdout)
"""


def test_real_ranks_each_see_their_group_and_the_gathered_view_has_all():
    """As on gloo: each process is one rank of a fake process group (no simulation), builds the
    layout ``sv.show`` sends from a %%spmd cell, and the client merges them with draw_show."""
    done = subprocess.run(
        [sys.executable, "-c", _RANKS_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        check=True,
    )
    per_rank = {int(r): v for r, v in json.loads(done.stdout).items()}
    assert per_rank[1]["mesh"] == [0, 1, 2, 3] and per_rank[5]["mesh"] == [4, 5, 6, 7]
    assert all(v["layout"] == per_rank[0]["layout"] for v in per_rank.values())
    from shardviz.backends.cluster import draw_show

    payloads = {
        r: {"layout": v["layout"], "values": np.array(v["values"]), "options": {}}
        for r, v in per_rank.items()
    }
    w = draw_show(payloads)
    assert w.geometry["ranks"] == list(range(8))
    np.testing.assert_array_equal(w.global_values(1), _base(4).numpy())
