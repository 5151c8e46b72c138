"""A kernel that dies by SIGKILL leaves nothing behind: every process shardviz started for it ends,
and the profile folder (with the cluster's keys) is removed — also when it dies half-way, between
starting the controller and starting the engines.

The kernel is a subprocess that calls ``sv.use("gloo", world_size=2)``. What it started is known
from the outside: its descendants while it lives, and any process whose environment names its
profile folder (ipyparallel sets ``IPP_PROFILE_DIR`` for everything it launches).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]

KERNEL = """
import sys, time
import ipyparallel as ipp
import shardviz as sv
from shardviz.backends import choose

if sys.argv[1] == "half":  # die between the controller and the engines
    def hang(cluster, *args, **kwargs):
        print("started", cluster.profile_dir, flush=True)
        time.sleep(600)
    ipp.Cluster.start_engines_sync = hang
sv.use("gloo", world_size=2, timeout=5, progress=False)
print("started", choose.current().local.profile_dir, flush=True)
time.sleep(600)
"""


def _live(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _by_profile(profile: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("IPP_PROFILE_DIR") == profile:
                found.append(p)
        except psutil.Error:
            pass
    return found


def _descendants_settled(
    kernel: psutil.Process, quiet: float = 1.5, limit: float = 20
) -> list[psutil.Process]:
    """The kernel's descendants once no new one has appeared for ``quiet`` seconds (the controller
    starts its schedulers after it reports that it runs)."""
    seen: dict[int, psutil.Process] = {}
    t0 = last_new = time.monotonic()
    while time.monotonic() - last_new < quiet and time.monotonic() - t0 < limit:
        for c in kernel.children(recursive=True):
            if c.pid not in seen:
                seen[c.pid] = c
                last_new = time.monotonic()
        time.sleep(0.1)
    return list(seen.values())


@pytest.mark.parametrize("when", ["ready", "half"])
def test_a_sigkilled_kernel_leaves_no_process_and_no_profile(when):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    kernel = subprocess.Popen(
        [sys.executable, "-c", KERNEL, when], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    started: list[psutil.Process] = []
    try:
        line = kernel.stdout.readline() if kernel.stdout else ""
        assert line.startswith("started "), f"the kernel did not start: {line!r}"
        profile = line.split(" ", 1)[1].strip()
        assert os.path.isdir(profile)
        started = _descendants_settled(psutil.Process(kernel.pid))
        started += [p for p in _by_profile(profile) if p.pid not in {s.pid for s in started}]
        expected = 2 if when == "half" else 6  # at least: watchdog + controller (+ 2 engines, 2 nannies)
        assert len(started) >= expected, [p.cmdline() for p in started]
        kernel.send_signal(signal.SIGKILL)
        kernel.wait(10)
        t0 = time.monotonic()
        _, alive = psutil.wait_procs(started, timeout=20)
        alive = _live(alive) + [p for p in _live(_by_profile(profile)) if p not in alive]
        elapsed = time.monotonic() - t0
        assert not alive, f"left running {elapsed:.1f} s after the kernel's SIGKILL: " + str(
            [(p.pid, " ".join(p.cmdline())[-60:]) for p in alive]
        )
        deadline = time.monotonic() + 5
        while os.path.exists(profile) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(profile), f"profile folder left behind: {profile}"
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait(10)
        for p in _live(started):  # whatever this test started, by PID, should it fail
            p.kill()
