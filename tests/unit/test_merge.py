"""Merging per-rank traces into one, and judging the ranks' published collective positions.

No cluster: the per-rank traces are written out by hand as a real rank records them (its own
buffers, its own group), and the expectations (groups, mesh dims) are written out too.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shardviz import load
from shardviz.backends.cluster import RankRun, diagnose, where_text
from shardviz.data.events import CollectiveEvent, OpEvent, RedistributeEvent, Source, TensorSnapshot
from shardviz.data.merge import SequenceMismatchError, merge
from shardviz.data.trace import Trace
from shardviz.geometry.layout import compute as layout

MESH_2x2 = {"mesh_shape": [2, 2], "mesh_dim_names": ["dp", "tp"], "ranks": [0, 1, 2, 3]}
TP = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
LINE = Source("<spmd-cell-1>", 3, "r = dt.redistribute(mesh, [Replicate(), Shard(0)])")


def snap(values):
    a = np.asarray(values, dtype=np.float32)
    return TensorSnapshot(tuple(a.shape), "float32", a)


def rank_trace(rank, events, meshes=(MESH_2x2,), world_size=4):
    t = Trace(world_size, "rank", "all")
    t.events = list(events)
    t.meshes = list(meshes)
    return t


def gather_event(rank, eid=1, parent=0, op="all_gather", group=None, name="tp"):
    return CollectiveEvent(
        id=eid,
        parent=parent,
        source=LINE,
        op=op,
        impl="_c10d_functional.all_gather_into_tensor",
        groups=(group or TP[rank],),
        mesh_dim=None,
        mesh_dim_name=name,
        inputs={rank: snap([rank])},
        outputs={rank: snap([10 * rank, 10 * rank + 1])},
        nbytes={rank: 4},
    )


def redistribute_event():
    before = layout((4,), (2, 2), ["S(0)", "S(0)"], ("dp", "tp"))
    after = layout((4,), (2, 2), ["S(0)", "R"], ("dp", "tp"))
    return RedistributeEvent(
        id=0,
        source=LINE,
        src=("S(0)", "S(0)"),
        dst=("S(0)", "R"),
        plan="S(0)S(0)->S(0)R",
        before=before,
        after=after,
    )


def per_rank_traces(**kw):
    return {r: rank_trace(r, [redistribute_event(), gather_event(r, **kw)]) for r in range(4)}


def test_merge_collects_every_rank_and_every_group():
    merged = merge(per_rank_traces(), "gloo", "all")
    assert (merged.backend, merged.world_size, merged.values) == ("gloo", 4, "all")
    red, col = merged.events
    assert red == redistribute_event()  # non-collective events pass through unchanged
    assert col.groups == ((0, 1), (2, 3))
    assert (col.mesh_dim, col.mesh_dim_name) == (1, "tp")
    assert col.parent == 0 and col.source == LINE
    assert sorted(col.inputs) == [0, 1, 2, 3]
    assert [col.inputs[r].values.tolist() for r in range(4)] == [[0], [1], [2], [3]]
    assert col.outputs[3].values.tolist() == [30, 31]
    assert col.nbytes == {0: 4, 1: 4, 2: 4, 3: 4}
    assert merged.meshes == [MESH_2x2]


def test_merged_trace_has_the_simulators_file_format(tmp_path):
    merged = merge(per_rank_traces(), "gloo", "all")
    again = load(merged.save(tmp_path / "m.svtrace"))
    assert again == merged and again.backend == "gloo"


def test_mesh_dim_comes_from_meshes_of_earlier_cells():
    traces = {r: rank_trace(r, [gather_event(r, eid=0, parent=None)], meshes=()) for r in range(4)}
    assert merge(traces, "gloo").events[0].mesh_dim is None
    col = merge(traces, "gloo", known_meshes=[MESH_2x2]).events[0]
    assert (col.mesh_dim, col.mesh_dim_name) == (1, "tp")
    dp = {0: (0, 2), 2: (0, 2), 1: (1, 3), 3: (1, 3)}
    traces = {
        r: rank_trace(r, [gather_event(r, eid=0, parent=None, group=dp[r], name="dp")]) for r in range(4)
    }
    col = merge(traces, "gloo").events[0]
    assert col.groups == ((0, 2), (1, 3)) and (col.mesh_dim, col.mesh_dim_name) == (0, "dp")


def test_a_rank_keeps_only_its_own_buffers():
    """A rank knows its own buffers only; anything it reports for other ranks is not taken."""
    traces = per_rank_traces()
    traces[1].events[1] = dataclasses.replace(traces[1].events[1], inputs={0: snap([99]), 1: snap([1])})
    assert merge(traces, "gloo").events[1].inputs[0].values.tolist() == [0]


def test_different_collectives_are_reported_not_merged():
    traces = per_rank_traces()
    traces[2].events[1] = gather_event(2, op="all_reduce")
    with pytest.raises(SequenceMismatchError) as info:
        merge(traces, "gloo")
    msg = str(info.value)
    assert info.value.index == 1
    assert "First difference at event #1" in msg
    assert "  ranks 0, 1, 3: all_gather (line 3: r = dt.redistribute" in msg
    assert "  rank 2: all_reduce (line 3: r = dt.redistribute" in msg


def test_a_rank_with_fewer_events_is_reported():
    traces = per_rank_traces()
    traces[3].events = traces[3].events[:1]
    with pytest.raises(SequenceMismatchError, match=r"rank 3: nothing: it recorded 1 events"):
        merge(traces, "gloo")


def test_ranks_that_disagree_on_the_group_are_reported():
    traces = per_rank_traces()
    traces[1].events[1] = gather_event(1, group=(1, 2))
    with pytest.raises(SequenceMismatchError, match=r"disagree on who takes part"):
        merge(traces, "gloo")


def test_completeness_and_value_budget_combine():
    traces = per_rank_traces()
    traces[2].complete = False
    traces[1].values_dropped_from = 1
    traces[3].values_dropped_from = 0
    merged = merge(traces, "gloo")
    assert merged.complete is False and merged.values_dropped_from == 0


def test_op_events_must_agree_too():
    mm = OpEvent(id=0, name="aten.mm", input_placements=(("S(0)",), ("R",)), output_placements=(("S(0)",),))
    other = OpEvent(
        id=0, name="aten.mm", input_placements=(("S(0)",), ("S(1)",)), output_placements=(("P(sum)",),)
    )
    traces = {0: rank_trace(0, [mm], world_size=2), 1: rank_trace(1, [other], world_size=2)}
    with pytest.raises(SequenceMismatchError):
        merge(traces, "gloo")


# --- the client's judgement of where ranks are --------------------------------------------------


def flight(n, op=None, group=(0, 1), state="in", counts=None, line=4, text="dist.all_reduce(t)"):
    last = (
        None
        if op is None
        else {"n": n, "op": op, "group": group, "gseq": n, "line": line, "text": text, "state": state}
    )
    return {"last": last, "counts": counts if counts is not None else ({group: n} if n else {}), "n": n}


def test_a_finished_rank_that_never_entered_a_waited_collective_is_named():
    runs = [
        RankRun(0, 10, flight=flight(1, "all_reduce")),
        RankRun(1, 11, status="done", result={"error": None}, flight=flight(0)),
    ]
    fault = diagnose(runs)
    assert fault is not None and fault.kind == "skipped" and fault.missing == [1]
    assert (
        "rank 1 finished without entering all_reduce #1 on group [0,1] (line 4: dist.all_reduce(t))"
        in fault.summary
    )
    assert where_text(runs[0]) == "waiting in all_reduce #1 on group [0,1] (line 4: dist.all_reduce(t))"
    assert where_text(runs[1]) == "finished after 0 collectives"


def test_a_rank_outside_the_group_is_not_missing():
    runs = [
        RankRun(0, 10, flight=flight(1, "all_reduce", group=(0, 1))),
        RankRun(1, 11, flight=flight(0)),
        RankRun(2, 12, status="done", result={"error": None}, flight=flight(0)),
    ]
    assert diagnose(runs) is None  # rank 1 may still arrive; rank 2 is not in the group


def test_a_dead_rank_is_named_with_its_last_collective():
    runs = [
        RankRun(0, 4, flight=flight(2, "all_gather")),
        RankRun(1, 5, status="died", flight=flight(1, "all_reduce")),
    ]
    fault = diagnose(runs)
    assert fault.kind == "died" and fault.missing == [1]
    assert "rank 0 cannot finish without it" in fault.summary
    assert where_text(runs[1]) == (
        "died (engine 5 exited); last collective entered: all_reduce #1 on group [0,1] "
        "(line 4: dist.all_reduce(t))"
    )


def test_ranks_in_different_collectives_at_the_same_step():
    runs = [RankRun(0, 0, flight=flight(1, "all_reduce")), RankRun(1, 1, flight=flight(1, "all_gather"))]
    fault = diagnose(runs)
    assert fault.kind == "mismatch" and "rank 0 is in all_reduce #1" in fault.summary
    assert "rank 1 is in all_gather #1" in fault.summary


def test_a_timed_out_rank_while_another_still_runs():
    error = {"ename": "RuntimeError", "evalue": "Timed out waiting 10000ms for recv", "distributed": True}
    runs = [
        RankRun(
            0, 0, status="done", result={"error": error}, flight=flight(1, "all_reduce", counts={(0, 1): 1})
        ),
        RankRun(1, 1, flight=flight(1, "all_reduce", counts={(0, 1): 1}, state="out")),
    ]
    runs[0].finished_at = 100.0
    assert diagnose(runs, now=101.0, grace=2.0) is None  # a dying peer may still be reported
    fault = diagnose(runs, now=102.5, grace=2.0)
    assert fault.kind == "timeout" and fault.missing == [1]


def test_ranks_all_inside_the_same_collective_are_fine():
    runs = [RankRun(r, r, flight=flight(1, "all_reduce")) for r in range(2)]
    assert diagnose(runs) is None


def test_a_death_seen_with_its_peers_failure_is_the_fault():
    """Rank 1's engine exits and rank 0's all_reduce fails on the closed connection; both are seen
    finished in the same poll. The death is the cause, so it is what dispatch reports."""
    from shardviz.backends.cluster import ClusterBackend, CollectiveHangError

    error = {
        "ename": "RuntimeError",
        "evalue": "Connection closed by peer [127.0.0.1]:48520",
        "traceback": "RuntimeError: Connection closed by peer",
        "distributed": True,
    }

    class Done:
        stdout = stderr = ""

        def __init__(self, result=None, exc=None):
            self._result, self._exc = result, exc
            self.data, self.outputs = {}, []

        def done(self):
            return True

        def exception(self):
            return self._exc

        def result(self):
            return self._result

        def wait_for_output(self, timeout):
            return None

    class EngineError(Exception):
        ename = "EngineError"

    ars = [Done(result={"error": error, "flight": flight(1, "all_reduce")}), Done(exc=EngineError())]

    class View:
        def __init__(self, ar):
            self.ar = ar

        def apply_async(self, func, *args):
            return self.ar

    backend = ClusterBackend.__new__(ClusterBackend)
    backend.engines, backend.local, backend.timeout = [0, 1], None, 10.0
    backend.broken, backend.busy = "", {}
    backend._check_usable = lambda: None
    backend._view = lambda e: View(ars[e])
    with pytest.raises(CollectiveHangError) as info:
        backend.dispatch(lambda: None, [(), ()])
    assert info.value.missing == [1] and info.value.where[1].startswith("died")
    assert "Rank 1 died (engine exited) while running." in str(info.value)
