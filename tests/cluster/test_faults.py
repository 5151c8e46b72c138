"""Faults on real ranks are one clear error in the notebook, within the process-group timeout.

A rank that raises, skips a collective, or dies (its engine exits) is named, with where every rank
was; the kernel stays usable, and after ``sv.restart()`` the next cell works.
"""

from __future__ import annotations

import time

import psutil
import pytest

import shardviz as sv
from shardviz.backends import choose
from shardviz.backends.cluster import CollectiveHangError, RankError
from shardviz.errors import BackendError

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

TIMEOUT = 5  # shorter than the suite's 10 s: each hang costs one timeout before the restart

SETUP = "import torch\nimport torch.distributed as dist"
ALL_REDUCE = "t = torch.ones(2)\ndist.all_reduce(t)\nt"


def spmd(ip, cell):
    t0 = time.monotonic()
    try:
        return ip.run_cell_magic("spmd", "", cell), time.monotonic() - t0
    except Exception as e:
        e.elapsed = time.monotonic() - t0
        raise


def assert_recovers(ip):
    t0 = time.monotonic()
    sv.restart()
    # At most one wait for the timeout and, for a dead rank, an engine's start (Python, torch, a
    # process group): 9 s on an idle 2-core machine, 24 s on a CI machine installing a venv
    # meanwhile. The bound catches a restart that hangs, not a slow machine.
    assert time.monotonic() - t0 < TIMEOUT + 40
    out, _ = spmd(ip, ALL_REDUCE)
    assert out.tolist() == [2.0, 2.0]  # a sum over 2 ranks: the process group works again


def test_rank_that_raises_is_named_and_recovery_works(ip, gloo):
    ip.run_cell(SETUP)
    gloo(2, timeout=TIMEOUT)
    cell = (
        "t = torch.ones(2)\nif dist.get_rank() == 1:\n    raise KeyError('only on rank 1')\n"
        "dist.all_reduce(t)"
    )
    with pytest.raises(RankError) as info:
        spmd(ip, cell)
    err = info.value
    assert err.elapsed < TIMEOUT  # found before rank 0's all_reduce times out
    assert err.ranks == [1] and err.errors[1]["ename"] == "KeyError"
    assert "only on rank 1" in str(err) and "line 3" in err.errors[1]["traceback"]
    assert err.where[0].startswith("waiting in all_reduce #1 on group [0,1]")
    assert "sv.restart()" in str(err)
    with pytest.raises(BackendError, match=r"sv\.restart\(\)"):  # refuses instead of hanging
        spmd(ip, ALL_REDUCE)
    assert_recovers(ip)


def test_rank_that_skips_a_collective_is_named(ip, gloo):
    ip.run_cell(SETUP)
    gloo(2, timeout=TIMEOUT)
    cell = "t = torch.ones(2)\nif dist.get_rank() == 0:\n    dist.all_reduce(t)\nprint('done')"
    with pytest.raises(CollectiveHangError) as info:
        spmd(ip, cell)
    err = info.value
    assert err.elapsed < TIMEOUT
    assert err.missing == [1]
    assert "rank 1 finished without entering all_reduce #1 on group [0,1] (line 3" in str(err)
    assert err.where == {
        0: "waiting in all_reduce #1 on group [0,1] (line 3: dist.all_reduce(t))",
        1: "finished after 0 collectives",
    }
    assert_recovers(ip)


def test_an_error_on_every_rank_leaves_the_process_group_usable(ip, gloo):
    ip.run_cell(SETUP)
    gloo(2, timeout=TIMEOUT)
    with pytest.raises(RankError) as info:
        spmd(ip, "undefined_name + 1")
    assert info.value.ranks == [0, 1] and "ranks 0, 1 raised NameError" in str(info.value)
    out, _ = spmd(ip, ALL_REDUCE)  # no restart needed: no rank was left inside a collective
    assert out.tolist() == [2.0, 2.0]


def test_a_dying_rank_on_an_owned_cluster(ip, capsys):
    """sv.use without a cluster to attach to starts engines; a death is named, restart replaces the
    engine, and switching back to local stops every process shardviz started."""
    ip.run_cell(SETUP)
    sv.use("gloo", world_size=2, timeout=TIMEOUT)
    out = capsys.readouterr().out
    stages = [
        "engines up 2/2",
        "torch imported on 2 engines",
        "process group ready: gloo, 2 ranks, 127.0.0.1:",
    ]
    positions = [out.find(s) for s in stages]
    assert -1 not in positions and positions == sorted(positions), out
    backend = choose.current()
    first_pids = backend.local.engine_pids()
    controller = backend.local.controller_pid()
    cell = "import os, time\nt = torch.ones(2)\nif dist.get_rank() == 1:\n    os._exit(3)\ndist.all_reduce(t)"
    with pytest.raises(CollectiveHangError) as info:
        spmd(ip, cell)
    err = info.value
    assert err.elapsed < TIMEOUT
    assert err.missing == [1] and err.where[1].startswith("died")
    assert "starts a new engine for rank 1" in str(err)
    assert_recovers(ip)
    assert backend.engines == sorted(backend.client.ids)[:2]  # ranks by position after the restart
    pids = backend.local.engine_pids()
    assert len(set(pids) - set(first_pids)) == 1
    sv.use("local")
    gone = psutil.wait_procs(
        [psutil.Process(p) for p in [*pids, controller] if psutil.pid_exists(p)], timeout=10
    )
    assert not gone[1], f"still running after sv.use('local'): {gone[1]}"


def test_switching_away_leaves_an_attached_cluster_running(cluster, gloo):
    gloo(2)
    sv.use("local")
    assert len(cluster.client.ids) == 4
    pids = cluster.engine_pids()
    assert all(psutil.pid_exists(p) for p in pids)
