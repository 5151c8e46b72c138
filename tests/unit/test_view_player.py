"""The collective player on the Python side, no browser: synced state, the three command replies
through a recording comm, step driving, cost, matplotlib, text/PNG fallbacks, export and bad input.

Expected values are written out by hand or computed with plain torch / numpy on the global tensor;
data-flow models and ring steps themselves are tested in test_flow.py and test_ring.py.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import subprocess
import sys

import matplotlib
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import traitlets
from matplotlib.patches import FancyArrowPatch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from widget_comm import attach, invoke

import shardviz as sv
from shardviz.data import cost
from shardviz.data.events import TensorSnapshot
from shardviz.data.trace import Trace
from shardviz.views import geometry as g
from shardviz.views import html as svhtml
from shardviz.views.player import PlayerWidget

matplotlib.use("Agg")

X = torch.arange(35.0).reshape(7, 5)  # 7 rows on 4 ranks: torch.chunk gives 2, 2, 2, 1 (uneven)
OPS = [
    "scatter",  # 0  distribute_tensor
    "redistribute",  # 1  S(0) -> R
    "all_gather",  # 2
    "redistribute",  # 3  S(0) -> S(1)
    "all_to_all",  # 4
    "op",  # 5  DTensor.from_local
    "redistribute",  # 6  P -> S(0)
    "reduce_scatter",  # 7
    "all_reduce",  # 8
    "broadcast",  # 9
    "barrier",  # 10
    "all_gather",  # 11 list-valued
    "reduce",  # 12
    "gather",  # 13
    "scatter",  # 14
]


def ring_values(meta: dict, buf: bytes):
    """Decode a fetch_ring reply: (state, rank index, chunk) -> leading values or None."""
    data = np.frombuffer(buf, dtype="<f8" if meta["format"] == "f8" else "<f4")
    counts = meta["counts"]
    offsets = np.concatenate([[0], np.cumsum(np.maximum(counts, 0))])
    n = meta["n"]

    def at(state: int, i: int, c: int):
        j = (state * n + i) * n + c
        return None if counts[j] < 0 else data[offsets[j] : offsets[j] + counts[j]]

    return at


@pytest.fixture(scope="module")
def traces():
    sv.use("local", world_size=4)
    with sv.record() as t:
        mesh = init_device_mesh("cpu", (4,))
        dt = distribute_tensor(X, mesh, [Shard(0)])
        dt.redistribute(mesh, [Replicate()])
        dt.redistribute(mesh, [Shard(1)])
        p = DTensor.from_local(
            sv.per_rank(lambda r: torch.full((7, 5), float(r + 1))), mesh, [Partial()], run_check=False
        )
        p.redistribute(mesh, [Shard(0)])
        dist.all_reduce(sv.per_rank(lambda r: torch.arange(6.0) + 10 * r))
        dist.broadcast(sv.per_rank(lambda r: torch.full((2,), float(r))), src=2)
        dist.barrier()
        dist.all_gather([torch.zeros(2) for _ in range(4)], sv.per_rank(lambda r: torch.full((2,), float(r))))
        dist.reduce(sv.per_rank(lambda r: torch.full((2,), float(r + 1))), dst=1)
        dist.gather(
            sv.per_rank(lambda r: torch.full((2,), float(r))), [torch.zeros(2) for _ in range(4)], dst=0
        )
        dist.scatter(
            torch.zeros(3),
            [sv.per_rank(lambda r, k=k: torch.full((3,), float(k + r))) for k in range(4)],
            src=0,
        )
    with sv.record() as t2d:
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        d2 = distribute_tensor(X, mesh2, [Shard(0), Shard(1)])
        d2.redistribute(mesh2, [Replicate(), Replicate()])
    with sv.record(values="none") as bare:
        dist.all_reduce(sv.per_rank(lambda r: torch.full((3,), float(r))))
    return {"t": t, "2d": t2d, "bare": bare}


def kinds(trace: Trace) -> list[str]:
    return [e.op if e.kind == "collective" else e.kind for e in trace.events]


def step_of(w: PlayerWidget, event_id: int) -> int:
    return next(k for k, e in enumerate(w.steps) if e.id == event_id)


# ---- synced state -----------------------------------------------------------------------------------


def test_state_is_a_small_columnar_timeline(traces):
    t = traces["t"]
    assert kinds(t) == OPS, str(t)
    w = sv.play(t)
    state = w.get_state()
    tl = state["timeline"]
    assert tl["ids"] == list(range(15))
    assert tl["kinds"] == "crcrcorc" + "c" * 7
    assert tl["depth"] == [0, 0, 1, 0, 1, 0, 0, 1] + [0] * 7
    # every collective and redistribute is a step, in order; the DTensor op (#5) is not
    assert [tl["ids"][r] for r in tl["steps"]] == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert [e.id for e in w.steps] == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    labels = [tl["strings"][i] for i in tl["label"]]
    assert labels[2] == "all_gather · dim 0 · (2,5)→(8,5)"
    assert labels[1] == "redistribute [S(0)] → [R]"
    # a raw dist.* call on the default group: no mesh dim, though the world's 1-D mesh reuses it
    assert labels[8] == "all_reduce sum · (6)→(6)"
    _, text = tl["sources"][tl["source"][8]]
    assert text == "dist.all_reduce(sv.per_rank(lambda r: torch.arange(6.0) + 10 * r))"
    assert state["step"] == 0 and state["link"] == "nvlink4"
    assert state["info"]["steps"] == 14 and state["info"]["world_size"] == 4
    js = state["_esm"]
    assert 'data-shardviz-view": "player"' in js and "fetch_step" in js and "data-event-id" in js
    assert "function drawTensorGrid" in js  # the layout view's drawing code, shared through common.js
    json.dumps({k: state[k] for k in ("timeline", "info", "step", "link")})


def test_modules_nest_as_headers_and_local_compute_can_be_a_step():
    class Block(nn.Module):
        def forward(self, x):
            return x.redistribute(x.device_mesh, [Replicate()])

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            return self.block(x) * 2

    sv.use("local", world_size=4)
    with sv.record() as t:
        mesh = init_device_mesh("cpu", (4,))
        dt = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
        Net()(dt)
        z = dt.to_local() * 3
        dist.all_reduce(z)
    tl = sv.play(t).timeline
    rows = [(tl["kinds"][i], tl["depth"][i], tl["strings"][tl["label"][i]]) for i in range(len(tl["ids"]))]
    assert rows[1:5] == [
        ("m", 0, "Net · forward"),
        ("m", 1, "block"),
        ("r", 2, "redistribute [S(0)] → [R]"),
        ("c", 3, "all_gather · dim 0 · (2)→(8)"),
    ]
    assert rows[5][:2] == ("o", 1)  # the multiply runs in Net, after block
    local = [e for e in t.events if e.kind == "local"]
    assert local and local[0].id not in {e.id for e in sv.play(t).steps}
    w = sv.play(t, local_steps=True)
    k = step_of(w, local[0].id)
    d = w.detail(k)
    assert d["op"] == "local" and d["transfers"] == [] and d["groups"] == [[0, 1, 2, 3]]
    meta, bufs = w.values_reply(k, 0)
    got = {(m["rank"], m["side"]): g.decode(m, b) for m, b in zip(meta["entries"], bufs, strict=True)}
    np.testing.assert_array_equal(got[(2, "in")], [4.0, 5.0])
    np.testing.assert_array_equal(got[(2, "out")], [12.0, 15.0])


def test_1000_event_trace_keeps_the_synced_state_small():
    sv.use("local", world_size=4)
    with sv.record() as t:
        for _ in range(500):
            dist.all_reduce(sv.per_rank(lambda r: torch.full((4,), float(r))))
            dist.broadcast(sv.per_rank(lambda r: torch.full((4,), float(r))), src=1)
    assert len(t.events) == 1000
    w = sv.play(t)
    size = len(json.dumps({k: getattr(w, k) for k in ("timeline", "info", "step", "link")}))
    print(f"1,000-event trace: synced state {size} bytes (ESM {len(w._esm)} bytes, sent once)")
    assert size < 40_000
    # two labels and one mesh dim ("-": none, the filter's), each sent once; the rows' mesh dims
    # are one run
    assert len(w.timeline["steps"]) == 1000 and len(w.timeline["strings"]) == 3
    assert w.timeline["dims"] == [w.timeline["strings"].index("-"), 1000]
    assert w.timeline["module"] == [-1, 1000]


# ---- driving the step -------------------------------------------------------------------------------


def test_step_from_python_goes_out_as_one_update_and_selects_the_event(traces):
    t = traces["t"]
    w = sv.play(t)
    comm = attach(w)
    w.step = 4
    assert comm.sent == [("comm_msg", {"method": "update", "state": {"step": 4}, "buffer_paths": []}, [])]
    assert w.event is t.events[4]  # step 4 is the all_to_all, event #4
    assert w.detail()["id"] == 4 and w.detail()["op"] == "all_to_all"
    with pytest.raises(traitlets.TraitError, match=r"step 14 is out of range.*14 step\(s\) \(0..13\)"):
        w.step = 14
    w._handle_msg({"content": {"data": {"method": "update", "state": {"step": 7}}}, "buffers": []})
    assert w.step == 7 and w.event.op == "all_reduce"
    assert sv.play(t, step=5).event.id == 6


# ---- fetch_step: groups, buffers, parts, padding, transfers -------------------------------------------


def test_uneven_all_gather_step_shows_padding_parts_and_transfers(traces):
    w = sv.play(traces["t"])
    d, bufs = invoke(w, "fetch_step", {"step": 2})
    assert bufs == [] and d["id"] == 2 and d["op"] == "all_gather" and d["groups"] == [[0, 1, 2, 3]]
    assert d["source"]["text"] == "dt.redistribute(mesh, [Replicate()])"
    assert d["context"] == [{"id": 1, "label": "redistribute [S(0)] → [R]", "step": 1}]
    # all_gather: rank i's whole input goes to slot i of every other rank
    assert sorted(map(tuple, d["transfers"])) == sorted(
        (i, j, None, i, False) for i in range(4) for j in range(4) if i != j
    )
    assert sorted(map(tuple, d["stays"])) == [(r, r, None, r, False) for r in range(4)]
    r3 = d["ranks"]["3"]
    # 7 rows on 4 ranks: rank 3 holds 1 row, padded to 2: its second row is padding
    assert r3["in"]["shape"] == [2, 5] and r3["in"]["pad"] == [[1, 2, 0, 5]] and r3["in"]["origin"] == 3
    parts = r3["out"]["parts"]
    assert [p["box"] for p in parts] == [[0, 2, 0, 5], [2, 4, 0, 5], [4, 6, 0, 5], [6, 8, 0, 5]]
    assert [p["origin"] for p in parts] == [0, 1, 2, 3]
    assert [p.get("pad", []) for p in parts] == [[], [], [], [[7, 8, 0, 5]]]
    assert d["check"]["ok"] and d["check"]["checked"]
    assert any("padding" in n for n in d["notes"])
    assert d["ring"] == {"available": True, "note": ""}


def test_all_to_all_parts_follow_shard_and_gather_dims(traces):
    w = sv.play(traces["t"])
    d = w.detail(step_of(w, 4))
    assert d["op"] == "all_to_all"
    # S(0) -> S(1) of (7, 5): each rank's rows (padded to 2) cut into 4 column chunks of 2 (cols
    # padded to 8: the 5 real columns split 2, 2, 1, 0); rank j receives chunk j of everyone
    assert sorted(map(tuple, d["transfers"])) == sorted(
        (i, j, j, i, False) for i in range(4) for j in range(4) if i != j
    )
    r0_in = d["ranks"]["0"]["in"]["parts"]
    assert [p["box"] for p in r0_in] == [[0, 2, 0, 2], [0, 2, 2, 4], [0, 2, 4, 6], [0, 2, 6, 8]]
    assert [p.get("pad", []) for p in r0_in] == [[], [], [[0, 2, 5, 6]], [[0, 2, 6, 8]]]
    r0_out = d["ranks"]["0"]["out"]["parts"]
    assert [p["box"] for p in r0_out] == [[0, 2, 0, 2], [2, 4, 0, 2], [4, 6, 0, 2], [6, 8, 0, 2]]
    assert [p.get("pad", []) for p in r0_out] == [[], [], [], [[7, 8, 0, 2]]]  # rank 3 sent 1 row
    r3_out = d["ranks"]["3"]["out"]["parts"]
    assert all(p.get("pad") for p in r3_out)  # rank 3's S(1) shard has 0 columns: all padding


def test_reduce_scatter_and_rooted_ops_by_hand(traces):
    w = sv.play(traces["t"])
    rs = w.detail(step_of(w, 7))
    assert sorted(map(tuple, rs["transfers"])) == sorted(
        (i, j, j, None, True) for i in range(4) for j in range(4) if i != j
    )
    assert rs["ranks"]["1"]["out"]["reduced"] is True
    assert [p.get("pad", []) for p in rs["ranks"]["0"]["in"]["parts"]][3] == [[7, 8, 0, 5]]
    bc = w.detail(step_of(w, 9))
    assert bc["roots"] == [2] and sorted(map(tuple, bc["transfers"])) == [
        (2, 0, None, None, False),
        (2, 1, None, None, False),
        (2, 3, None, None, False),
    ]
    assert bc["ranks"]["0"]["out"]["origin"] == 2
    barrier = w.detail(step_of(w, 10))
    assert barrier["transfers"] == [] and barrier["stays"] == []
    assert any("barrier" in n for n in barrier["notes"])
    listed = w.detail(step_of(w, 11))
    assert listed["ranks"]["2"]["out"]["slots"] == [[2], [2], [2], [2]]
    assert [p["slot"] for p in listed["ranks"]["2"]["out"]["parts"]] == [0, 1, 2, 3]
    red = w.detail(step_of(w, 12))
    assert red["roots"] == [1] and red["ranks"]["0"]["out"]["role"] == "undefined"
    assert "role" not in red["ranks"]["1"]["out"] and red["ranks"]["1"]["out"]["reduced"]
    gat = w.detail(step_of(w, 13))
    assert gat["ranks"]["3"]["out"]["role"] == "undefined" and len(gat["ranks"]["0"]["out"]["parts"]) == 4
    sc = w.detail(step_of(w, 14))
    assert sc["ranks"]["1"]["in"]["role"] == "ignored" and len(sc["ranks"]["0"]["in"]["parts"]) == 4
    assert sorted(map(tuple, sc["transfers"])) == [(0, j, j, None, False) for j in (1, 2, 3)]


def test_redistribute_step_has_both_layouts_and_its_plan_per_mesh_dim(traces):
    t = traces["2d"]
    w = sv.play(t)
    red = t.redistributes()[0]
    k = step_of(w, red.id)
    d = w.detail(k)
    assert d["kind"] == "redistribute" and d["plan"] == "S(0)S(1)->S(0)R->RR"
    assert d["before"] == g.payload(red.before) and d["after"] == g.payload(red.after)
    gathers = [e.id for e in t.collectives() if e.parent == red.id]
    assert [(p["dim_label"], p["src"], p["dst"], p["op"], p["event"]) for p in d["plan_steps"]] == [
        ("tp", "S(1)", "R", "all_gather", gathers[0]),
        ("dp", "S(0)", "R", "all_gather", gathers[1]),
    ]
    assert [p["step"] for p in d["plan_steps"]] == [k + 1, k + 2]
    # the second all_gather (over dp) gathers the S(0)R intermediate: rows 4, 4, 3, 3 padded to 4
    dp = w.detail(k + 2)
    assert dp["groups"] == [[0, 2], [1, 3]] and dp["mesh_dim_name"] == "dp"
    assert dp["ranks"]["2"]["in"]["pad"] == [[3, 4, 0, 5]] and "pad" not in dp["ranks"]["0"]["in"]
    meta, bufs = w.values_reply(k, 0)
    assert "error" in meta and bufs == []


# ---- fetch_values ------------------------------------------------------------------------------------


def test_values_reply_is_binary_and_matches_plain_torch(traces):
    w = sv.play(traces["t"])
    meta, bufs = invoke(w, "fetch_values", {"step": 2, "group": 0})
    assert meta["step"] == 2 and len(bufs) == len(meta["entries"]) == 8
    got = {(m["rank"], m["side"]): g.decode(m, bytes(b)) for m, b in zip(meta["entries"], bufs, strict=True)}
    x = X.numpy()
    chunks = [c.numpy() for c in X.chunk(4)]
    for r in range(3):
        np.testing.assert_array_equal(got[(r, "in")], chunks[r])
    np.testing.assert_array_equal(got[(3, "in")][:1], x[6:7])  # its real row; the other is padding
    for r in range(4):
        out = got[(r, "out")]
        assert out.shape == (8, 5)
        np.testing.assert_array_equal(out[:7], x)  # the padding row of rank 3 sits at the end
    listed, _ = w.values_reply(step_of(w, 11), 0)
    slots = [(m["rank"], m["side"], m["slot"]) for m in listed["entries"] if m["rank"] == 0]
    assert slots == [(0, "in", None), (0, "out", 0), (0, "out", 1), (0, "out", 2), (0, "out", 3)]
    assert (
        invoke(w, "fetch_values", {"step": 2, "group": 5})[0]["error"] == "step 2 has no group 5 (it has 1)"
    )
    assert "must be an int" in invoke(w, "fetch_values", {"step": "2", "group": 0})[0]["error"]
    assert "no step 99" in invoke(w, "fetch_step", {"step": 99})[0]["error"]


def test_large_buffers_are_sampled():
    sv.use("local", world_size=2)
    with sv.record() as t:
        dist.all_reduce(sv.per_rank(lambda r: torch.ones(300, 100) * r))
    meta, bufs = sv.play(t).values_reply(0, 0)
    first = meta["entries"][0]
    assert first["source_shape"] == [300, 100] and np.prod(first["shape"]) <= 4096
    assert len(bufs[0]) == np.prod(first["shape"]) * 4


# ---- fetch_ring --------------------------------------------------------------------------------------


def test_ring_reply_steps_contributors_and_final_check(traces):
    t = traces["t"]
    w = sv.play(t)
    k = step_of(w, 8)
    meta, bufs = invoke(w, "fetch_ring", {"step": k, "group": 0})
    assert meta["op"] == "all_reduce" and meta["n"] == 4 and meta["states"] == 7
    assert meta["phases"] == ["reduce-scatter"] * 3 + ["all-gather"] * 3
    masks = np.array(meta["contributors"]).reshape(7, 4, 4)
    assert (masks[0] == np.array([[1] * 4, [2] * 4, [4] * 4, [8] * 4])).all()
    # step 1: rank k sent chunk k to rank k+1, which now holds {k, k+1} there
    assert [masks[1][1][0], masks[1][2][1], masks[1][3][2], masks[1][0][3]] == [3, 6, 12, 9]
    assert (masks[-1] == 15).all()
    at = ring_values(meta, bufs[0])
    # 6 elements in 4 chunks (2, 2, 1, 1): rank 2 starts with 20..25
    np.testing.assert_array_equal(at(0, 2, 0), [20.0, 21.0])
    np.testing.assert_array_equal(at(0, 2, 3), [25.0])
    want = sum(torch.arange(6.0) + 10 * r for r in range(4)).numpy()  # plain torch, by hand
    for i in range(4):
        np.testing.assert_array_equal(at(7, i, 0), want)  # the ring's result
        np.testing.assert_array_equal(at(8, i, 0), want)  # the recorded output
    assert meta["check"]["ok"] and meta["check"]["checked"]
    gk = step_of(w, 2)
    gmeta, _ = w.ring_reply(gk, 0)
    assert gmeta["states"] == 4 and np.array(gmeta["contributors"]).reshape(4, 4, 4)[0][1].tolist() == [
        0,
        2,
        0,
        0,
    ]
    assert "ring view is for" in w.ring_reply(step_of(w, 9), 0)[0]["error"]


def test_a_wrong_recorded_output_is_a_visible_warning_not_an_exception(traces):
    e = traces["t"].events[8]
    outs = dict(e.outputs)
    outs[1] = TensorSnapshot(outs[1].shape, outs[1].dtype, outs[1].values + 1.0)
    bad = Trace(4)
    bad.events = [dataclasses.replace(e, outputs=outs)]
    w = sv.play(bad)
    d = w.detail(0)
    assert d["check"]["ok"] is False and d["check"]["max_error"]["1"] == pytest.approx(1.0)
    assert d["check"]["max_error"]["0"] == 0.0
    meta, _ = w.ring_reply(0, 0)
    assert meta["check"]["ok"] is False and "differs" in meta["check"]["note"]
    assert "WARNING" in " ".join(t.get_text() for t in sv.plot(bad.events[0], trace=bad).texts)


# ---- cost --------------------------------------------------------------------------------------------


def test_cost_per_step_and_link_follow_the_cost_model(traces):
    t = traces["t"]
    w = sv.play(t, link="pcie5")
    k = step_of(w, 8)
    w.step = k
    # all_reduce of 6 float32 (24 bytes) over 4 ranks: 2 (n - 1) / n x 24 = 36 bus bytes, 6 steps
    assert w.timeline["bus"][k] == 36.0 and w.timeline["hops"][k] == 6
    c = w.cost()
    assert c["bus_bytes"] == 36.0 and c["steps"] == 6
    assert c["seconds"] == pytest.approx(5e-6 * 6 + 36 / 63e9)
    assert c["seconds"] == pytest.approx(cost.event_cost(t.events[8], "pcie5").seconds)
    # a redistribute costs what its collectives cost: S(0) -> R is one all_gather of 40 bytes x 3
    assert w.timeline["bus"][1] == 120.0 and w.timeline["hops"][1] == 3
    assert w.info["total_bus"] == pytest.approx(t.summary().total_bus_bytes)
    assert w.info["links"]["ib-ndr"] == {"name": "InfiniBand NDR (400 Gb/s)", "alpha": 8e-6, "beta": 50e9}
    with pytest.raises(traitlets.TraitError, match="unknown link 'warp'"):
        w.link = "warp"
    with pytest.raises(ValueError, match="unknown link 'warp'"):
        sv.play(t, link="warp")


# ---- static renderings --------------------------------------------------------------------------------


def test_text_and_png_fallbacks_are_deterministic(traces):
    w = sv.play(traces["t"], step=2)
    data, _ = w._repr_mimebundle_()
    assert data["application/vnd.jupyter.widget-view+json"]["model_id"] == w.model_id
    text = data["text/plain"]
    assert text.startswith("Trace: local, 4 ranks, 15 events")
    marked = [line for line in text.split("\n") if line.startswith("> ")]
    assert marked == [
        "> " + "  #2 all_gather groups [0,1,2,3] mesh dim 0 (2,5)->(8,5) float32  <- "
        "dt.redistribute(mesh, [Replicate()])"
    ]
    assert text.endswith(
        "player: step 3 of 14, event #2; 120 B bus bytes per rank, 6.0 us on NVLink 4 (H100 SXM)"
    )
    assert not re.search(r"0x[0-9a-f]{6,}", text + repr(w))
    png = base64.b64decode(data["image/png"])
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert w._repr_mimebundle_()[0]["image/png"] == data["image/png"]
    assert repr(w) == (
        "PlayerWidget(<Trace local world_size=4: 11 collectives, 3 redistributes, 1 op>, steps=14, step=2, "
        "event=#2 all_gather · dim 0 · (2,5)→(8,5))"
    )


def _arrows(fig, gid):
    return [p for ax in fig.axes for p in ax.patches if isinstance(p, FancyArrowPatch) and p.get_gid() == gid]


def test_plot_event_draws_one_arrow_per_transfer(traces):
    from shardviz.views.mpl import to_png

    t = traces["t"]
    gather = sv.plot(t.events[2], trace=t)
    assert len(_arrows(gather, "transfer")) == 12  # 4 ranks, each to the 3 others
    assert len(_arrows(gather, "stay")) == 4
    assert len([p for ax in gather.axes for p in ax.patches if p.get_gid() == "pad"]) == 1 + 4  # in + outs
    bc = sv.plot(t.events[9])  # an event alone plots too
    assert len(_arrows(bc, "transfer")) == 3 and len(_arrows(bc, "stay")) == 1
    rs = sv.plot(t.events[7], trace=t)
    assert len(_arrows(rs, "transfer-reduce")) == 12
    barrier = sv.plot(t.events[10])
    assert _arrows(barrier, "transfer") == [] and any(
        ln.get_gid() == "barrier" for ln in barrier.axes[0].lines
    )
    red = sv.plot(traces["2d"].redistributes()[0])
    assert [ax.get_gid() for ax in red.axes] == ["layout-before", "layout-after"]
    assert "1. mesh tp: S(1) -> R: all_gather" in next(
        x.get_text() for x in red.texts if x.get_gid() == "plan"
    )
    assert to_png(sv.plot(t.events[2], trace=t)) == to_png(gather)
    whole = sv.plot(t, link="ib-hdr")
    bars = [p for p in whole.axes[0].patches if p.get_gid() == "collective"]
    assert len(bars) == len(t.collectives())


_PLOT_WITHOUT_WIDGETS = """
import sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
import shardviz as sv
from shardviz.views.trace_mpl import plot_event

sv.use("local", world_size=2)
with sv.record() as t:
    mesh = init_device_mesh("cpu", (2,))
    distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
    dist.all_reduce(sv.per_rank(lambda r: torch.full((2,), float(r))))
for e in t.events:
    if e.kind in ("collective", "redistribute"):
        plot_event(e, t)
print(sorted(m for m in ("anywidget", "traitlets", "ipywidgets") if m in sys.modules))
"""


def test_plot_event_does_not_import_the_widget_libraries():
    """sv.plot of an event is a matplotlib picture: it reads the player's step data, never the
    widget, so it works (and stays light) where anywidget is not installed."""
    done = subprocess.run(
        [sys.executable, "-c", _PLOT_WITHOUT_WIDGETS],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "[]", done.stdout


# ---- HTML export -------------------------------------------------------------------------------------


def _embedded(path):
    text = path.read_text(encoding="utf-8")
    m = re.search(r'<script type="application/json" id="shardviz-data">(.*?)</script>', text, re.S)
    assert m
    return json.loads(m.group(1))


def test_export_html_embeds_every_step_and_values_within_budget(traces, tmp_path):
    out = sv.export_html(traces["t"], tmp_path / "player.html")
    text = out.read_text(encoding="utf-8")
    assert "default-src 'none'" in text and not re.search(r"""(src|href)=["']?https?:""", text)
    data = _embedded(out)
    assert data["view"] == "player" and data["state"]["timeline"]["ids"] == list(range(15))
    keys = {key for key, _, _ in data["responses"]}
    for k in range(14):
        assert svhtml.request_key("fetch_step", {"step": k}) in keys
    replies = {key: (meta, bufs) for key, meta, bufs in data["responses"]}
    meta, bufs = replies[svhtml.request_key("fetch_values", {"step": 2, "group": 0})]
    first = meta["entries"][0]
    np.testing.assert_array_equal(g.decode(first, base64.b64decode(bufs[0])), X.chunk(4)[0].numpy())
    assert svhtml.request_key("fetch_ring", {"step": 2, "group": 0}) in keys
    lean = _embedded(sv.export_html(traces["t"], tmp_path / "lean.html", values_budget=0))
    assert {json.loads(key)[0] for key, _, _ in lean["responses"]} == {"fetch_step"}


# ---- bad input ----------------------------------------------------------------------------------------


def test_bad_input_is_drawn_or_a_clear_error(traces, tmp_path):
    with pytest.raises(TypeError, match=r"sv.play plays a shardviz Trace .* got int"):
        sv.play(42)
    with pytest.raises(TypeError, match=r"record\(\) returns one"):
        sv.play(sv.record)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['speed'\]"):
        sv.play(traces["t"], speed=2)
    # an empty trace draws a player that says there is nothing to step through
    empty = sv.show(Trace(4))
    assert isinstance(empty, PlayerWidget) and empty.steps == [] and empty.event is None
    assert "nothing to step through" in empty.info["notes"][0]
    assert empty.text().endswith("player: no collectives or redistributes to step through")
    assert empty.detail(0)["error"] == "no step 0: this trace has 0 step(s)"
    assert base64.b64decode(empty._repr_mimebundle_()[0]["image/png"]).startswith(b"\x89PNG")
    with pytest.raises(traitlets.TraitError, match="out of range"):
        empty.step = 1
    sv.export_html(Trace(4), tmp_path / "empty.html")
    # a trace without values: shapes, flow and cost, and it says why values are missing
    bare = sv.play(traces["bare"])
    d = bare.detail(0)
    assert d["ranks"]["0"]["in"] == {"shape": [3], "dtype": "float32", "values": False, "origin": 0}
    assert d["check"]["checked"] is False and len(d["transfers"]) == 12
    assert d["ring"]["available"] is False and "values" in d["ring"]["note"]
    assert any("values not kept" in n for n in d["notes"])
    assert bare.values_reply(0, 0)[0]["error"].startswith("values not kept")
    assert "needs the buffers' values" in bare.ring_reply(0, 0)[0]["error"]
    assert len(_arrows(sv.plot(traces["bare"].events[0]), "transfer-reduce")) == 12
