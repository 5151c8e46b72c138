"""The recorder's memos live in ``shardviz.capture.recorder.caches``: one place to see and to clear them."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
import torch.distributed as dist

import shardviz as sv
from shardviz.capture.recorder import caches, snapshot

PACKAGE = Path(sv.__file__).parent / "recorder"


def test_no_memo_outside_the_caches_module():
    """A module-level cache elsewhere in the package would outlive ``caches.clear()``."""
    found = []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "caches.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                for deco in node.decorator_list:
                    text = ast.unparse(deco)
                    if "lru_cache" in text or "functools.cache" in text or text == "cache":
                        found.append(f"{path.name}:{node.lineno} {node.name}")
    assert found == []


def test_clear_forgets_what_a_recording_remembered():
    sv.use("local", world_size=4)
    with sv.record() as trace:
        x = sv.per_rank(lambda r: torch.full((4,), float(r)))
        dist.all_reduce(x)
    assert trace.collectives()[0].source is not None
    assert caches.SOURCES and caches.CODE_KINDS
    assert snapshot.describe.cache_info().currsize
    caches.clear()
    assert not caches.SOURCES and not caches.WRITTEN and not caches.LAYOUTS
    assert not caches.CODE_KINDS
    assert snapshot.describe.cache_info().currsize == 0
    # and recording again fills them afresh, with the same result
    with sv.record() as again:
        y = sv.per_rank(lambda r: torch.full((4,), float(r)))
        dist.all_reduce(y)
    (c,) = again.collectives()
    assert c.groups == ((0, 1, 2, 3),)
    assert c.outputs[2].values.tolist() == [6.0] * 4


def test_group_memos_start_afresh_with_a_new_world():
    """A new world reuses group names for other groups: what a name stood for is forgotten."""
    sv.use("local", world_size=4)
    with sv.record() as four:
        dist.all_reduce(sv.per_rank(lambda r: torch.ones(2)))
    sv.use("local", world_size=2)
    try:
        with sv.record() as two:
            dist.all_reduce(sv.per_rank(lambda r: torch.ones(2)))
    finally:
        sv.use("local", world_size=4)
    assert four.collectives()[0].groups == ((0, 1, 2, 3),)
    assert two.collectives()[0].groups == ((0, 1),)
    assert two.collectives()[0].outputs[1].values.tolist() == [2.0, 2.0]
