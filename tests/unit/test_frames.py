"""The user's line of an event: never a frame of an installed library (site-packages,
dist-packages, the standard library) or of code torch generates, only the line the user wrote."""

from __future__ import annotations

import copy
import importlib
import textwrap

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardviz as sv
from shardviz.capture import torch as _torch

LIBRARY = """
import torch.distributed as dist
from torch.distributed.tensor import Replicate


def sum_over_ranks(t):
    dist.all_reduce(t)
    return t


def gather(dt):
    return dt.redistribute(dt.device_mesh, [Replicate()])
"""


def _line_of(fragment: str) -> int:
    """The line number of the one line of this file holding ``fragment``."""
    with open(__file__) as f:
        hits = [i for i, text in enumerate(f, 1) if fragment in text and "_line_of" not in text]
    assert len(hits) == 1, hits
    return hits[0]


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A package installed in a site-packages folder (as torchtitan or physicsnemo are)."""
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (site / "trainlib.py").write_text(textwrap.dedent(LIBRARY))
    monkeypatch.syspath_prepend(str(site))
    yield importlib.import_module("trainlib")
    import sys

    sys.modules.pop("trainlib", None)


def test_a_collective_inside_an_installed_library_has_the_users_line(installed):
    sv.use("local", world_size=4)
    with sv.record() as trace:
        mesh = init_device_mesh("cpu", (4,))
        dt = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
        t = sv.per_rank(lambda r: torch.ones(2) * r)
        installed.sum_over_ranks(t)  # the all-reduce's line
        installed.gather(dt)  # the all-gather's line
    reduce, gather = (e for e in trace.collectives() if e.op in ("all_reduce", "all_gather"))
    assert (reduce.source.file, reduce.source.line) == (__file__, _line_of("# the all-reduce's line"))
    assert reduce.source.text == "installed.sum_over_ranks(t)"
    assert gather.source.line == _line_of("# the all-gather's line")
    (redistribute,) = trace.redistributes()
    assert redistribute.source == gather.source
    assert all(v.tolist() == [6.0, 6.0] for v in _torch.local_tensors(t).values())  # 0+1+2+3


def test_standard_library_frames_are_not_the_users_line():
    # copy.deepcopy calls DTensor.__deepcopy__ from copy.py: the op's line is the caller's.
    sv.use("local", world_size=4)
    with sv.record() as trace:
        mesh = init_device_mesh("cpu", (4,))
        dt = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
        copy.deepcopy(dt).redistribute(mesh, [Replicate()])  # the deepcopy's line
    line = _line_of("# the deepcopy's line")
    copied = [e for e in trace.events if e.source is not None and e.source.line == line]
    assert copied and all(e.source.file == __file__ for e in trace.events if e.source is not None)
    assert not [e for e in trace.events if e.source is not None and e.source.file.endswith("copy.py")]
