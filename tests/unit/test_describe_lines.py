"""An event's text line stays short and true: a collective over a huge group (a Flight Recorder
dump of a large job) reads as ranges, past 8 ranges the first 4 and a count; shapes that differ by
rank (uneven shards) are each named with their ranks."""

from __future__ import annotations

import shardviz as sv
from shardviz.data.events import LocalEvent

WORLD = 1 << 20


def _line(groups: tuple[tuple[int, ...], ...]) -> str:
    trace = sv.Trace(WORLD)
    trace.events.append(sv.CollectiveEvent(id=0, op="all_reduce", impl="c10d.allreduce_", groups=groups))
    return str(trace)


def test_a_million_rank_group_is_a_range():
    text = _line((tuple(range(WORLD)),))
    assert f"[0-{WORLD - 1}]" in text
    assert len(text) < 400, text


def test_scattered_ranks_show_the_first_ranges_and_a_count():
    every_other = tuple(range(0, WORLD, 2))
    text = _line((every_other,))
    assert f"[0,2,4,6,... {len(every_other)} ranks]" in text
    assert len(text) < 400, text


def test_small_and_split_groups_keep_every_rank():
    assert "[0,1,2,3] [4,5,6,7]" in _line(((0, 1, 2, 3), (4, 5, 6, 7)))
    sixteen = tuple(range(0, 32, 2))  # 16 ranks: still each one
    assert "[" + ",".join(map(str, sixteen)) + "]" in _line((sixteen,))
    assert "[0-8,10-17]" in _line((tuple(r for r in range(18) if r != 9),))


def test_shapes_that_differ_by_rank_are_each_named_with_their_ranks():
    # uneven shards (3, 3, 2, 2) in a local op: rank 0's shape must not stand for every rank
    def snap(*shape: int) -> sv.TensorSnapshot:
        return sv.TensorSnapshot(shape=shape, dtype="float32")

    trace = sv.Trace(4)
    ins = {r: snap(n) for r, n in enumerate((3, 3, 2, 2))}
    outs = {r: snap() for r in range(4)}
    trace.events.append(LocalEvent(id=0, name="dot", inputs=ins, outputs=outs))
    assert "local dot {0-1:(3), 2-3:(2)}->() on every rank" in str(trace)
    even = {r: snap(4) for r in range(4)}
    trace.events[0] = LocalEvent(id=0, name="dot", inputs=even, outputs=outs)
    assert "local dot (4)->() on every rank" in str(trace)
