"""Real torchrun jobs on gloo recorded with ``sv.record_job`` and opened with ``sv.load(folder)``.

Each test runs a small script under ``torchrun --standalone`` (2-4 processes, one OpenMP thread,
a 10 s process-group timeout) and reads what the ranks wrote. Expectations are independent: shard
values are chunks of the global tensor, sums are computed by hand; the merged trace is also
compared with the simulator's trace of the same function.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import shardviz as sv
from shardviz.data.events import CollectiveEvent
from shardviz.data.load import PartialTraceWarning
from shardviz.errors import TraceFileError

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

SCRIPT = """\
import datetime, os, sys, time
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
import shardviz as sv


def step(n):
    mesh = init_device_mesh("cpu", (n,))
    x = torch.arange(30.0).reshape(10, 3)
    dt = distribute_tensor(x, mesh, [Shard(0)])
    full = dt.redistribute(mesh, [Replicate()])
    t = sv.per_rank(lambda r: torch.full((2,), float(r + 1)))
    dist.all_reduce(t)
    return full.to_local(), t


def faulty(bad, how):
    t = sv.per_rank(lambda r: torch.full((2,), float(r + 1)))
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    if dist.get_rank() == bad:
        time.sleep(1.5)  # the background writer has written both collectives by now
        if how == "die":
            os._exit(3)
        time.sleep(60)  # hang: torchrun ends it with SIGTERM once the others failed
    dist.all_reduce(t)
    return t


def flight(folder, pickled):
    import shardviz.capture.flight
    from shardviz.capture import torch as _torch
    t = torch.ones(4) * dist.get_rank()
    dist.all_reduce(t)
    pair = dist.new_group([0, 1])
    if dist.get_rank() in (0, 1):
        dist.all_gather_into_tensor(torch.empty(8), torch.ones(4), group=pair)
    dist.broadcast(t, 0)
    dist.barrier()
    if dist.get_rank() != 1:
        dist.all_reduce(t, async_op=True)  # rank 1 never joins: its dump lacks this one
    time.sleep(0.5)
    shardviz.capture.flight.dump(folder)
    with open(os.path.join(pickled, f"fr_trace_rank_{dist.get_rank()}"), "wb") as f:
        f.write(_torch.flight_recorder_dump(pickled=True))
    sys.stdout.flush()
    os._exit(0)  # the all_reduce rank 1 skipped can never finish


if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    what = os.environ["JOB"]
    if what == "flight":
        flight(sys.argv[1], sys.argv[2])
    with sv.record_job(values="all"):
        if what == "step":
            step(dist.get_world_size())
        else:
            faulty(int(os.environ["BAD"]), what)
    dist.destroy_process_group()
"""


def torchrun(tmp_path: Path, n: int, job: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "JOB": job,
        "SHARDVIZ_TRACE_DIR": str(tmp_path / "traces"),
        **env,
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    return subprocess.run(
        [*cmd, str(script), *args], env=full_env, capture_output=True, text=True, timeout=150
    )


def load_quietly(path: Path) -> sv.Trace:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PartialTraceWarning)
        return sv.load(path)


def normalized(trace: sv.Trace) -> list[sv.Event]:
    """Events without what legitimately differs: the script's path, and the list a scatter
    ignores on non-root ranks (the simulator runs every rank as if it were the root)."""
    out = []
    for e in trace.events:
        e = dataclasses.replace(e, source=dataclasses.replace(e.source, file="") if e.source else None)
        if isinstance(e, CollectiveEvent) and e.op == "scatter":
            roots = set(e.roots())
            e = dataclasses.replace(
                e,
                inputs={r: v for r, v in e.inputs.items() if r in roots},
                nbytes={r: b for r, b in e.nbytes.items() if r in roots},
            )
        out.append(e)
    return out


@pytest.fixture(scope="module")
def job2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("job2")
    done = torchrun(tmp, 2, "step")
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp


@pytest.mark.parametrize("n", [2, 4])
def test_job_folder_merges_like_the_simulator(n, job2, tmp_path):
    tmp = job2 if n == 2 else tmp_path
    if n != 2:
        done = torchrun(tmp, n, "step")
        assert done.returncode == 0, done.stderr[-3000:]
    folder = tmp / "traces"
    assert sorted(p.name for p in folder.iterdir()) == [f"rank{r:05d}.svtrace" for r in range(n)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialTraceWarning)  # a clean run warns about nothing
        real = sv.load(folder)
    assert real.complete and real.notes == [] and real.backend == "gloo" and real.world_size == n

    x = torch.arange(30.0).reshape(10, 3)
    chunks = x.chunk(n)
    cols = real.collectives()
    assert [c.op for c in cols] == ["scatter", "all_gather", "all_reduce"]
    assert all(c.groups == (tuple(range(n)),) for c in cols)
    # distribute_tensor and the redistribute ran on the mesh; the raw dist.all_reduce on the
    # default group (which the world's 1-D mesh reuses), as in the simulator
    assert [c.mesh_dim for c in cols] == [0, 0, None]
    scatter, gather, reduce = cols
    for r in range(n):
        mine = chunks[r] if r < len(chunks) else x[:0]
        assert np.array_equal(scatter.outputs[r].values[: mine.shape[0]], mine.numpy())
        assert np.array_equal(gather.outputs[r].values[:10], x.numpy())
        assert reduce.inputs[r].values.tolist() == [r + 1.0] * 2
        assert reduce.outputs[r].values.tolist() == [n * (n + 1) / 2] * 2
    assert real.check() == {}

    # The simulator, running the same function from the same file, records the same trace.
    spec = importlib.util.spec_from_file_location(f"svjob{n}", tmp / "job.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sv.use("local", world_size=n)
    sim = sv.run(module.step, n, values="all")
    assert normalized(real) == normalized(sim)
    assert str(real.summary()) == str(sim.summary())


@pytest.mark.parametrize("how", ["die", "hang"])
def test_rank_that_died_or_hung_leaves_a_partial_trace(how, tmp_path):
    done = torchrun(tmp_path, 3, how, BAD="1")
    assert done.returncode != 0
    folder = tmp_path / "traces"
    with pytest.warns(PartialTraceWarning, match="rank 1 stopped after event #1"):
        trace = sv.load(folder)
    assert not trace.complete
    assert [c.op for c in trace.collectives()] == ["all_reduce", "broadcast"]
    assert trace.collectives()[1].outputs[2].values.tolist() == [6.0, 6.0]  # 1 + 2 + 3, from rank 0
    report = "\n".join(trace.notes)
    assert "every rank recorded the same 2 events" in report
    if how == "die":
        assert "rank 1 stopped after event #1 (broadcast" in report
        assert "its file was last written while it ran" in report
    else:
        assert "rank 1 stopped after event #1 (broadcast" in report and "SIGTERM" in report
    # The survivors were inside the third collective, which rank 1 never joined.
    for r in (0, 2):
        line = next(n for n in trace.notes if n.startswith(f"rank {r} "))
        assert "inside all_reduce on group [0,1,2]" in line and "dist.all_reduce(t)" in line
    assert trace.meta["start_event"] == 1
    player = sv.play(trace)
    try:
        assert player.step == 1  # the player opens where the ranks last agreed
        assert any("rank 1 stopped" in note for note in player.info["notes"])
    finally:
        player.close()


def test_cli_summary_and_html(job2, tmp_path):
    folder = job2 / "traces"
    out = subprocess.run(
        [sys.executable, "-m", "shardviz", "summary", str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Trace: gloo, 2 ranks")
    # a raw dist.all_reduce on the default group: no mesh dim, even where a 1-D mesh spans the world
    line = next(ln for ln in out.stdout.splitlines() if " all_reduce sum groups [0,1]" in ln)
    assert "mesh dim" not in line and "bus bytes/rank" in out.stdout
    page = tmp_path / "job.html"
    out = subprocess.run(
        [sys.executable, "-m", "shardviz", "html", str(folder), str(page)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    html = page.read_text()
    assert "data-shardviz-view" in html or "player" in html
    assert page.stat().st_size > 10_000
    missing = subprocess.run(
        [sys.executable, "-m", "shardviz", "summary", str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "nothing" in missing.stderr


def test_flight_recorder_dumps_of_a_gloo_job(tmp_path):
    dumps, pickled = tmp_path / "fr", tmp_path / "fr_pickle"
    pickled.mkdir()
    done = torchrun(tmp_path, 3, "flight", str(dumps), str(pickled), TORCH_FR_BUFFER_SIZE="200")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in dumps.iterdir()) == [f"flight{r:05d}.json" for r in range(3)]
    trace = sv.load(dumps)
    ops = [(c.op, c.groups) for c in trace.collectives()]
    world, pair = ((0, 1, 2),), ((0, 1),)
    assert ops == [
        ("all_reduce", world),
        ("all_gather", pair),
        ("broadcast", world),
        ("barrier", world),
        ("all_reduce", world),
    ]
    gather = trace.collectives()[1]
    assert gather.inputs[0].shape == (4,) and gather.outputs[1].shape in ((8,), (2, 4))
    last = trace.collectives()[-1]
    assert sorted(last.inputs) == [0, 2]
    assert last.params["flight"]["missing"] == {
        "1": "it never reached it: its last on this group is #3 (barrier)"
    }
    assert trace.meta["start_event"] == last.id and not trace.complete
    assert any("first desync at event #4" in n and "rank 1" in n for n in trace.notes)
    player = sv.play(trace)
    try:
        assert player.step == 4
        assert any("rank 1 missing" in n for n in player._model.detail(4)["notes"])
    finally:
        player.close()

    # torch's pickle dump (with stacks) opens only when asked to, since unpickling runs code.
    with pytest.raises(TraceFileError, match="allow_pickle"):
        sv.load(pickled)
    with_stacks = sv.load(pickled, allow_pickle=True, source_root=tmp_path)
    assert [c.op for c in with_stacks.collectives()] == [c.op for c in trace.collectives()]
    first = with_stacks.collectives()[0]
    assert first.source is not None and first.source.text == "dist.all_reduce(t)"
    # without a source root a dump opens no file: the frame's function stands for the line
    assert sv.load(pickled, allow_pickle=True).collectives()[0].source.text.endswith("()")
    assert "job.py" in first.params["flight"]["stacks"]["0"]
