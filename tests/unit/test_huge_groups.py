"""A collective over a huge group (a Flight Recorder dump of a large job, a loaded trace) reads as
one short line: ranks as ranges, and past 8 ranges the first 4 and a count."""

from __future__ import annotations

import shardviz as sv

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
