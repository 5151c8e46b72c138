"""Flight Recorder dumps (hand-written in torch's JSON dump format) and job folders, without
processes: alignment by process group and sequence number, desyncs, the pickle opt-in, and the
partial merge of per-rank traces whose ranks stopped at different places."""

from __future__ import annotations

import json
import pickle
import warnings

import pytest

import shardviz as sv
from shardviz.data import flight
from shardviz.data.events import CollectiveEvent, Source, TensorSnapshot
from shardviz.data.load import PartialTraceWarning, rank_path
from shardviz.data.merge import SequenceMismatchError, merge
from shardviz.data.trace import Trace
from shardviz.errors import TraceFileError

pytestmark = pytest.mark.timeout(60)


def entry(pg, seq, name, size=(4,), record_id=0, t=0, desc=None, frames=None):
    e = {
        "record_id": record_id,
        "pg_id": int(pg),
        "process_group": [pg, desc or ("default_pg" if pg == "0" else "undefined")],
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": f"nccl:{name}",
        "time_created_ns": t,
        "input_sizes": [list(size)],
        "input_dtypes": ["Float"],
        "output_sizes": [list(size)],
        "output_dtypes": ["Float"],
        "state": "completed",
        "retired": True,
        "timeout_ms": 10000,
        "is_p2p": False,
    }
    if frames:
        e["frames"] = frames
    return e


def dump(*entries, pg_config=None):
    es = [dict(e, record_id=i) for i, e in enumerate(entries)]
    return {"version": "2.10", "pg_config": pg_config or {}, "pg_status": {}, "entries": es}


def write_dumps(folder, dumps):
    folder.mkdir(exist_ok=True)
    for r, d in dumps.items():
        (folder / f"nccl_trace_rank_{r}").write_text(json.dumps(d))
    return folder


def healthy(r):
    return dump(
        entry("0", 1, "allreduce", t=10),
        entry("1", 1, "_allgather_base", t=20 + r, desc="tp"),
        entry("0", 2, "broadcast", t=30),
    )


def test_aligned_dumps_without_desync():
    groups = {"1": {"name": "1", "desc": "tp", "ranks": "[0, 1, 2, 3]"}}
    dumps = {r: {**healthy(r), "pg_config": groups} for r in range(4)}
    trace = flight.align(dumps)
    assert [(c.op, c.groups) for c in trace.collectives()] == [
        ("all_reduce", ((0, 1, 2, 3),)),
        ("all_gather", ((0, 1, 2, 3),)),
        ("broadcast", ((0, 1, 2, 3),)),
    ]
    assert trace.complete and "start_event" not in trace.meta
    assert trace.collectives()[0].inputs[3] == TensorSnapshot((4,), "float32")
    assert trace.collectives()[0].nbytes == {r: 16 for r in range(4)}
    assert "every member rank recorded every collective alike" in "\n".join(trace.notes)


def test_missing_rank_and_mismatch_are_desyncs():
    dumps = {r: healthy(r) for r in range(3)}
    # rank 2 never reaches the broadcast; rank 1 calls all_gather with other sizes
    dumps[2] = dump(entry("0", 1, "allreduce", t=10), entry("1", 1, "_allgather_base", t=21))
    dumps[1] = dump(
        entry("0", 1, "allreduce", t=10),
        entry("1", 1, "_allgather_base", size=(8,), t=21),
        entry("0", 2, "broadcast", t=30),
    )
    trace = flight.align(dumps)
    gather, bcast = trace.collectives()[1:]
    assert gather.params["flight"]["mismatch"] == [
        "ranks 0, 2: all_gather of [(4)] Float",
        "rank 1: all_gather of [(8)] Float",
    ]
    assert bcast.params["flight"]["missing"] == {
        "2": "it never reached it: its last on this group is #1 (all_reduce)"
    }
    assert sorted(bcast.inputs) == [0, 1]
    assert trace.meta["desyncs"] == [gather.id, bcast.id]
    assert trace.meta["start_event"] == gather.id and not trace.complete
    assert any(n.startswith("first desync at event #1: all_gather #1 on group 1") for n in trace.notes)
    player = sv.play(trace)
    try:
        assert player.step == 1
        notes = player._model.detail(2)["notes"]
        assert "rank 2 missing: it never reached it: its last on this group is #1 (all_reduce)" in notes
        assert any(n.startswith("Flight Recorder: process group 0 (default_pg), sequence #2") for n in notes)
    finally:
        player.close()
    # the offline page and the summary accept it too
    assert "all_gather" in str(trace.summary())


def test_older_entries_dropped_from_a_ring_buffer_are_not_missing():
    full = dump(*(entry("0", s, "allreduce", t=s) for s in range(1, 6)))
    short = dump(*(entry("0", s, "allreduce", t=s) for s in range(4, 6)))  # buffer of 2
    trace = flight.align({0: full, 1: short})
    assert [sorted(c.inputs) for c in trace.collectives()] == [[0], [0], [0], [0, 1], [0, 1]]
    assert all(not c.params["flight"]["missing"] for c in trace.collectives())
    assert trace.complete


def test_order_keeps_every_ranks_own_order():
    # rank 1's clock is far ahead: creation times alone would put its group-1 entry first
    d0 = dump(entry("0", 1, "allreduce", t=100), entry("1", 1, "allreduce", t=200, desc="a"))
    d1 = dump(entry("0", 1, "allreduce", t=900), entry("1", 1, "allreduce", t=1000, desc="a"))
    d2 = dump(entry("2", 1, "barrier", t=1, desc="b"), entry("0", 1, "allreduce", t=50))
    trace = flight.align({0: d0, 1: d1, 2: d2})
    assert [c.params["flight"]["pg"] for c in trace.collectives()] == ["2", "0", "1"]


def test_stack_becomes_the_source_line(tmp_path):
    src = tmp_path / "train.py"
    src.write_text("import torch\n\ndist.all_reduce(grad)\n")
    frames = [
        {"name": "all_reduce", "filename": "/x/torch/distributed/distributed_c10d.py", "line": 9},
        {"name": "<module>", "filename": str(src), "line": 3},
    ]
    trace = flight.align({0: dump(entry("0", 1, "allreduce", frames=frames))}, source_root=tmp_path)
    (c,) = trace.collectives()
    assert c.source == Source(str(src), 3, "dist.all_reduce(grad)")
    assert c.params["flight"]["stacks"]["0"].splitlines()[0] == f'File "{src}", line 3, in <module>'
    # without a source root the dump opens no file: the frame's function stands for the line
    (c,) = flight.align({0: dump(entry("0", 1, "allreduce", frames=frames))}).collectives()
    assert c.source == Source(str(src), 3, "<module>()")


def test_installed_packages_on_the_stack_are_not_the_source_line(tmp_path):
    src = tmp_path / "train.py"
    src.write_text("import torchtitan\n\ntrainer.train()\n")
    frames = [
        {"name": "all_reduce", "filename": "/x/torch/distributed/distributed_c10d.py", "line": 9},
        {"name": "fwd", "filename": "/usr/lib/python3/dist-packages/physicsnemo/model.py", "line": 7},
        {"name": "step", "filename": "/venv/lib/python3.11/site-packages/torchtitan/trainer.py", "line": 40},
        {"name": "<module>", "filename": str(src), "line": 3},
    ]
    trace = flight.align({0: dump(entry("0", 1, "allreduce", frames=frames))}, source_root=tmp_path)
    (c,) = trace.collectives()
    assert c.source == Source(str(src), 3, "trainer.train()")


def test_load_folder_and_pickle_opt_in(tmp_path):
    folder = write_dumps(tmp_path / "fr", {r: healthy(r) for r in range(2)})
    trace = sv.load(folder)
    assert len(trace.collectives()) == 3 and trace.meta["source"] == "flight_recorder"
    # round trip through a trace file keeps notes and meta
    back = sv.load(trace.save(tmp_path / "fr.svtrace"))
    assert back == trace and back.notes == trace.notes and back.meta == trace.meta
    pk = tmp_path / "pk"
    pk.mkdir()
    for r in range(2):
        (pk / f"nccl_trace_rank_{r}").write_bytes(pickle.dumps(healthy(r)))
    with pytest.raises(TraceFileError, match="runs whatever code the file names.*allow_pickle=True"):
        sv.load(pk)
    with pytest.raises(TraceFileError, match="allow_pickle"):
        sv.load(pk / "nccl_trace_rank_0")
    assert sv.load(pk, allow_pickle=True).events == trace.events


def test_not_a_dump(tmp_path):
    (tmp_path / "notes_1.txt").write_text("hello")
    with pytest.raises(TraceFileError, match="neither"):
        sv.load(tmp_path)
    bad = tmp_path / "x" / "rank_0"
    bad.parent.mkdir()
    bad.write_text("{not json")
    with pytest.raises(TraceFileError, match="bad JSON"):
        sv.load(bad.parent)


# --- job folders ---------------------------------------------------------------------------------


def rank_trace(rank, ops, status=None, world=3):
    t = Trace(world, "rank", "all")
    t.events = [
        CollectiveEvent(
            id=i,
            source=Source("train.py", 10 + i, f"dist.{op}(t)"),
            op=op,
            impl=f"c10d.{op}_",
            groups=(tuple(range(world)),),
            inputs={rank: TensorSnapshot((2,), "float32")},
            outputs={rank: TensorSnapshot((2,), "float32")},
            nbytes={rank: 8},
        )
        for i, op in enumerate(ops)
    ]
    t.meta = {"rank": rank, "world_size": world, "backend": "gloo", "run_id": "r1"}
    t.meta["status"] = status or {"how": "finished"}
    return t


def save_job(folder, traces):
    folder.mkdir()
    for r, t in traces.items():
        t.save(rank_path(folder, r))
    return folder


def test_job_folder_of_a_clean_run_merges_without_notes(tmp_path):
    folder = save_job(tmp_path / "job", {r: rank_trace(r, ["all_reduce", "broadcast"]) for r in range(3)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace = sv.load(folder)
    assert trace.complete and trace.notes == [] and trace.backend == "gloo"
    assert [sorted(c.inputs) for c in trace.collectives()] == [[0, 1, 2], [0, 1, 2]]


def test_job_folder_with_a_rank_that_stopped(tmp_path):
    stuck = {
        "how": "signal",
        "signal": "SIGTERM",
        "in_collective": {"op": "all_reduce", "group": [0, 1, 2], "line": 12, "text": "dist.all_reduce(t)"},
    }
    traces = {
        0: rank_trace(0, ["all_reduce", "broadcast", "all_gather"]),
        1: rank_trace(1, ["all_reduce"], stuck),
        # rank 2 wrote nothing
    }
    folder = save_job(tmp_path / "job", traces)
    with pytest.warns(PartialTraceWarning, match="rank 1 stopped after event #0"):
        trace = sv.load(folder)
    assert len(trace.events) == 1 and not trace.complete and trace.world_size == 3
    assert trace.notes[0].startswith("the ranks recorded the same first 1 event;")
    assert trace.notes[1] == (
        "rank 1 stopped after event #0 (all_reduce on group [0,1,2] (line 10: dist.all_reduce(t))): it was "
        "stopped by SIGTERM; it was inside all_reduce on group [0,1,2] (line 12: dist.all_reduce(t)), "
        "never finished"
    )
    assert trace.notes[2].startswith(
        "rank 0 went on to #1: broadcast on group [0,1,2] (line 11: dist.broadcast(t)) (3 events"
    )
    assert trace.notes[3].startswith("rank 2: no trace")
    assert "note: rank 1 stopped after event #0" in str(trace)


def test_job_folder_of_diverged_ranks_gives_the_common_prefix(tmp_path):
    traces = {r: rank_trace(r, ["all_reduce", "broadcast" if r == 1 else "all_gather"]) for r in range(3)}
    with pytest.raises(SequenceMismatchError):
        merge(traces, "gloo")  # merge itself still refuses non-SPMD sequences
    folder = save_job(tmp_path / "job", traces)
    with pytest.warns(PartialTraceWarning):
        trace = sv.load(folder)
    assert [c.op for c in trace.collectives()] == ["all_reduce"]
    report = "\n".join(trace.notes)
    assert "ranks 0, 2 went on to #1: all_gather" in report and "rank 1 went on to #1: broadcast" in report
    assert "disagree at #1" in report
    assert trace.meta["start_event"] == 0
