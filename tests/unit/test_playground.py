"""sv.playground(): the state recomputed for a choice, against hand-written expectations.

Each layout, plan string, collective, byte count and value below is written out by hand from
DTensor's rules (chunking: ceil(n / k) rows per rank, the last ranks short or empty), and the
simulated values are checked against ``torch.arange`` reshaped, not against shardviz's own output.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import shardviz as sv
from shardviz.data import cost
from shardviz.placement_playground import ChoiceError


@pytest.fixture(autouse=True)
def four_simulated_ranks():
    """The simulator the tests' meshes of 4 ranks reuse, whatever an earlier test left."""
    sv.use("local", world_size=4)


def rows(pg) -> list[tuple[str, str, int, int]]:
    return [(r["op"], r["mesh_dim"], len(r["groups"]), r["bytes"]) for r in pg.result["rows"]]


def collectives(pg):
    return [e for e in pg.trace.events if e.kind == "collective"]


def test_uneven_shard_to_replicate_runs_on_real_values():
    pg = sv.playground((10, 6), (4,), ["S(0)"], ["R"], ["tp"])
    r = pg.result
    assert r["ok"] and r["error"] == ""
    assert r["mode"] == "values" and "local simulator on 4 rank(s)" in r["mode_note"]
    assert r["plan"] == "S(0)->R"
    # ceil(10 / 4) = 3 rows of 6 float32 per rank (rank 3's single row padded to 3): 72 B in
    assert rows(pg) == [("all_gather", "tp", 1, 72)]
    # the alpha-beta time on the default link: 3 ring steps, bus bytes (n-1) x 72
    lk = cost.link("nvlink4")
    assert r["rows"][0]["bus_bytes"] == 3 * 72
    assert r["rows"][0]["seconds"] == pytest.approx(lk.alpha * 3 + 3 * 72 / lk.beta)
    assert r["shards"] == ["source: uneven shards: 3×6 on rank(s) 0-2; 1×6 on rank(s) 3"]
    (ag,) = collectives(pg)
    want = np.arange(60, dtype=np.float32).reshape(10, 6)
    for rank in range(4):
        assert ag.inputs[rank].values is not None
        assert np.array_equal(ag.outputs[rank].values[:10], want)  # past row 10: padding
    assert np.array_equal(ag.inputs[3].values[:1], want[9:10])
    assert r["before"]["placements"] == ["S(0)"] and r["after"]["placements"] == ["R"]


def test_a_change_of_choice_recomputes_and_names_the_empty_shard():
    pg = sv.playground((10, 6), (4,), ["S(0)"], ["R"], ["tp"])
    pg.choice = {**pg.choice, "shape": [3, 6]}
    r = pg.result
    assert r["ok"] and r["choice"]["shape"] == [3, 6]
    # 3 rows over 4 ranks: one row each on ranks 0-2, none on rank 3
    assert r["shards"] == [
        "source: uneven shards: 1×6 on rank(s) 0-2; 0×6 on rank(s) 3",
        "source: empty shards (hold no elements): rank(s) 3",
    ]
    assert rows(pg) == [("all_gather", "tp", 1, 24)]
    assert pg.timeline["steps"] and pg.step == 0  # the player follows the new trace
    assert pg.info["revision"] == 1  # and the view drops the old trace's cached steps
    assert "empty" in pg.text() and "0×6 on rank(s) 3" in pg.text()


def test_partial_to_replicate_on_a_2d_mesh():
    pg = sv.playground((4, 6), (2, 2), ["P", "S(1)"], ["R", "R"], ["dp", "tp"])
    r = pg.result
    assert r["mode"] == "values"
    # DTensor's greedy plan: the inner shard is gathered first, then the partial sum reduced
    assert r["plan"] == "P(sum)S(1)->P(sum)R->RR"
    # all_gather of a 4x3 float32 shard (48 B) in 2 tp groups; all_reduce of 4x6 (96 B) in 2 dp groups
    assert rows(pg) == [("all_gather", "tp", 2, 48), ("all_reduce", "dp", 2, 96)]
    ag, ar = collectives(pg)
    assert [sorted(g) for g in ag.groups] == [[0, 1], [2, 3]]
    assert [sorted(g) for g in ar.groups] == [[0, 2], [1, 3]]
    want = np.arange(24, dtype=np.float32).reshape(4, 6)
    for rank in range(4):
        assert np.array_equal(ar.inputs[rank].values, want / 2)  # each of the 2 terms of the sum
        assert np.array_equal(ar.outputs[rank].values, want)
    assert r["shards"] == []


def test_an_invalid_choice_is_explained_and_keeps_the_last_picture():
    pg = sv.playground((10, 6), (4,), ["S(0)"], ["R"], ["tp"])
    good, trace = dict(pg.result), pg.trace
    pg.choice = {**pg.choice, "src": ["S(5)"]}
    r = pg.result
    assert not r["ok"]
    assert r["error"] == (
        "source placements ['S(5)']: placement 'S(5)' shards dim 5, but the tensor has 2 dim(s) (valid: 0..1)"
    )
    assert r["plan"] == good["plan"] and r["before"] == good["before"] and pg.trace is trace
    assert pg.text().startswith("not drawn: source placements ['S(5)']")
    pg.choice = {**pg.choice, "src": ["S(0)", "R"]}  # two placements for a 1-D mesh
    assert (
        pg.result["error"] == "2 source placement(s) ['S(0)', 'R'] for a 1-D mesh [4]: give one per mesh dim"
    )
    pg.choice = {**pg.choice, "src": ["R"], "dst": ["P"]}
    assert "refuses to turn a Shard or Replicate placement into Partial" in pg.result["error"]
    pg.choice = {**pg.choice, "shape": "10, six", "src": ["S(0)"], "dst": ["R"]}
    assert pg.result["error"] == "the tensor shape must be whole numbers, e.g. 10, 6; got '10, six'"
    pg.choice = {**pg.choice, "shape": [10, 6]}  # a good choice again draws again
    assert pg.result["ok"] and pg.result["plan"] == "S(0)->R"
    with pytest.raises(ChoiceError, match="2 mesh dim name"):
        sv.playground((4,), (2,), ["S(0)"], ["R"], ["dp", "tp"])


def test_model_size_shapes_are_planned_from_geometry_and_say_so():
    pg = sv.playground((4096, 4096), (8,), ["S(0)"], ["R"], ["dp"])
    r = pg.result
    assert r["mode"] == "geometry"
    assert (
        r["mode_note"] == "geometry only (sv.plan: shapes and bytes, no values): 16,777,216 elements > 4,096"
    )
    assert rows(pg) == [("all_gather", "dp", 1, 512 * 4096 * 4)]
    pg.link = "pcie5"  # the time follows the link
    lk = cost.link("pcie5")
    assert pg.result["rows"][0]["seconds"] == pytest.approx(lk.alpha * 7 + 7 * 512 * 4096 * 4 / lk.beta)


def test_text_picture_and_export_show_the_current_state(tmp_path):
    pg = sv.playground((10, 6), (4,), ["S(0)"], ["R"], ["tp"])
    pg.choice = {**pg.choice, "dst": ["S(1)"]}
    text = pg.text()
    assert "plan: S(0)->S(1)" in text and "1. all_to_all over tp" in text
    assert "placements [S(0)]" in text and "placements [S(1)]" in text  # both layouts
    fig = sv.plot(pg)
    assert sorted(ax.get_gid() for ax in fig.axes) == ["source", "target"]
    page = sv.export_html(pg, tmp_path / "pg.html").read_text(encoding="utf-8")
    data = json.loads(re.search(r'id="shardviz-data"[^>]*>(.*?)</script>', page, re.S).group(1))
    assert data["view"] == "playground"
    assert data["state"]["choice"]["dst"] == ["S(1)"] and data["state"]["result"]["plan"] == "S(0)->S(1)"
    assert data["state"]["result"]["offline"] is True


def test_the_users_last_trace_and_backend_are_left_alone():
    before = sv.last_trace()
    pg = sv.playground((4,), (4,), ["S(0)"], ["R"], ["dp"])
    assert pg.result["mode"] == "values"
    assert sv.last_trace() is before
    # the events carry no source line: the line that ran them is the playground's, not the user's
    assert all(e.source is None for e in pg.trace.events)


def test_a_link_change_while_a_choice_is_refused_retimes_the_picture_and_keeps_the_message():
    pg = sv.playground((8, 4), (2,), ["S(0)"], ["R"], ["dp"])
    pg.choice = {**pg.choice, "mesh_shape": [0]}
    assert pg.result["error"] == "the mesh shape needs at least one dim, each of size 1 or more: got [0]"
    pg.link = "ib-ndr"
    lk = cost.link("ib-ndr")
    # all_gather of a 4x4 float32 shard (64 B) over 2 ranks: 1 ring step, 64 bus bytes
    assert pg.result["rows"][0]["seconds"] == pytest.approx(lk.alpha + 64 / lk.beta)
    assert not pg.result["ok"] and pg.result["error"].startswith("the mesh shape needs")
    assert sv.show(pg) is pg


def test_a_mesh_other_than_the_simulators_world_is_planned_and_says_how_to_get_values():
    pg = sv.playground((8, 4), (2, 4), ["S(0)", "R"], ["R", "R"], ["dp", "tp"])
    assert pg.result["mode"] == "geometry"
    assert pg.result["mode_note"] == (
        "geometry only (sv.plan): the simulator in this kernel runs 4 ranks and this mesh has "
        "8; sv.use('local', world_size=8) gives real values for it"
    )
    # all_gather of a 4x4 float32 shard (64 B) over dp, in 4 groups of 2
    assert rows(pg) == [("all_gather", "dp", 4, 64)]
