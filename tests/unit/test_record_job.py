"""``sv.record_job`` in one real process (a gloo group of one rank): what it leaves behind when it
stops, fails to start or outlives a SIGTERM, what its files hold, and SIGTERM while the rank is
stuck. The multi-process runs under torchrun are in tests/cluster/test_torchrun.py."""

from __future__ import annotations

import datetime
import errno
import os
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import shardviz as sv
from shardviz.backends import session
from shardviz.capture import torch as _torch
from shardviz.capture.job import SignalWarning
from shardviz.data.load import rank_path

pytestmark = pytest.mark.timeout(60)


def wakeup_fd() -> int:
    fd = signal.set_wakeup_fd(-1)
    if fd != -1:
        signal.set_wakeup_fd(fd)
    return fd


def installed() -> dict[str, Any]:
    """What a recording installs in the process while it runs."""
    return {
        "dispatch modes": _torch.dispatch_mode_stack(),
        "backend": session.peek(),
        "dist.get_rank": dist.get_rank,
        "DTensor.to_local": DTensor.to_local,
        "excepthook": sys.excepthook,
        "SIGTERM handler": signal.getsignal(signal.SIGTERM),
        "wakeup fd": wakeup_fd(),
        "writer threads": [t.name for t in threading.enumerate() if t.name == "shardviz-record-job"],
    }


def wait_for(ready: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = ready()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def status(path: Path) -> dict[str, Any]:
    return sv.load(path).meta.get("status", {}) if path.exists() else {}


@pytest.fixture
def rank0() -> Iterator[None]:
    """This process as rank 0 of a one-rank gloo group; the simulator's group, the SIGTERM
    handler, the excepthook and the wakeup fd are put back afterwards."""
    if dist.is_initialized():
        dist.destroy_process_group()  # the local backend makes its fake group again when needed
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=10)
    )
    saved = (signal.getsignal(signal.SIGTERM), sys.excepthook, wakeup_fd(), session.peek())
    try:
        yield
    finally:
        dist.destroy_process_group()
        signal.signal(signal.SIGTERM, saved[0])
        sys.excepthook = saved[1]
        signal.set_wakeup_fd(saved[2])
        session.install(saved[3])


def test_a_sigterm_the_process_survives_leaves_nothing_behind(rank0, tmp_path):
    got: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))  # the rank lives on
    before = installed()
    with sv.record_job(tmp_path, values="all") as rec:
        t = torch.ones(2)
        dist.all_reduce(t)
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: got, "the program's own SIGTERM handler")  # called after shardviz's
        at_signal = status(rec.path)
        dist.all_reduce(t)  # the recording goes on
    assert got == [signal.SIGTERM]
    assert installed() == before
    assert at_signal["how"] == "signal" and at_signal["events"] == 1
    final = sv.load(rec.path)
    assert final.meta["status"]["how"] == "finished" and final.meta["status"]["signal"] == "SIGTERM"
    assert [e.outputs[0].values.tolist() for e in final.collectives()] == [[1.0, 1.0], [1.0, 1.0]]


def test_a_sigterm_handler_that_exits_ends_the_recording_as_a_signal(rank0, tmp_path):
    def leave(signum: int, frame: Any) -> None:
        sys.exit(3)  # what many training scripts do on SIGTERM (after a checkpoint)

    signal.signal(signal.SIGTERM, leave)
    before = installed()
    with pytest.raises(SystemExit), sv.record_job(tmp_path, values="all") as rec:
        dist.all_reduce(torch.ones(2))
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: False, "SystemExit from the handler", timeout=5)
    assert installed() == before
    final = sv.load(rec.path)
    assert final.meta["status"]["how"] == "signal" and len(final.collectives()) == 1


def test_a_failure_while_starting_leaves_nothing_behind(rank0, tmp_path):
    # A folder whose rank file fits in PATH_MAX (4096) but whose temporary file does not.
    folder = tmp_path
    while len(str(folder)) < 4070 - 201:
        folder = folder / ("d" * 200)
    folder = folder / ("d" * (4070 - len(str(folder)) - 1))
    assert len(str(rank_path(folder, 0))) < 4096
    before = installed()
    with pytest.raises(OSError) as info:
        sv.record_job(folder)
    assert info.value.errno == errno.ENAMETOOLONG
    assert installed() == before
    t = torch.ones(2)
    dist.all_reduce(t)  # the script goes on as it would without shardviz
    assert t.tolist() == [1.0, 1.0]


def test_files_hold_the_values_at_record_time(rank0, tmp_path):
    """The background writer serialises while the program runs on: what it writes is what the
    collective produced, not what the buffer holds later."""
    with sv.record_job(tmp_path, values="all", flush_every=0.05) as rec:
        t = torch.zeros(64 * 1024)  # 256 KiB
        dist.all_reduce(t)
        t.numpy()[:] = -1.0  # the program writes its buffer, where no torch operator sees it
        running = wait_for(
            lambda: (tr := sv.load(rec.path)).collectives() and tr,
            "the background writer to write the all_reduce",
        )
    assert running.meta["status"]["how"] == "running"
    for trace in (running, sv.load(rec.path)):
        out = trace.collectives()[0].outputs[0].values
        assert out.shape == (64 * 1024,) and not out.any()


def test_sigterm_while_stuck_is_handled_when_someone_else_has_the_wakeup_fd(rank0, tmp_path):
    """asyncio's event loop (and others) hold the process's one signal wakeup fd: the recording
    still writes the file while the main thread cannot run Python, and the owner still gets its
    bytes."""
    theirs, theirs_w = socket.socketpair()
    theirs.setblocking(False)
    theirs_w.setblocking(False)
    signal.set_wakeup_fd(theirs_w.fileno())
    got: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", SignalWarning)  # nothing is lost: nothing to warn of
            rec = sv.record_job(tmp_path, values="all", flush_every=3600)
        with rec:
            dist.all_reduce(torch.ones(2))
            # The main thread is stuck (as inside gloo or NCCL): SIGTERM, sent from another
            # thread, is delivered to a thread other than the main one, which runs no Python
            # handler for 2 s.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            try:
                sent = time.time() + 0.1
                threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
                time.sleep(2.0)
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            wait_for(lambda: got, "the program's own SIGTERM handler")
            at_signal = sv.load(rec.path).meta
        # Written by the background thread while the main thread was stuck, not after.
        assert at_signal["status"]["how"] == "signal"
        assert at_signal["updated"] - sent < 1.0
        assert status(rec.path)["how"] == "finished"
        assert wakeup_fd() == theirs_w.fileno()  # given back
        assert signal.SIGTERM in theirs.recv(64)  # passed on
    finally:
        signal.set_wakeup_fd(-1)
        theirs.close()
        theirs_w.close()
    assert got == [signal.SIGTERM]


def test_a_recording_that_cannot_handle_sigterm_says_so(rank0, tmp_path):
    caught: list[warnings.WarningMessage] = []

    def record() -> None:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            rec = sv.record_job(tmp_path)
            dist.all_reduce(torch.ones(2))
            rec.stop()
        caught.extend(w)

    before = installed()
    worker = threading.Thread(target=record)  # Python sets signal handlers in the main thread only
    worker.start()
    worker.join()
    assert [w.category for w in caught] == [SignalWarning]
    text = str(caught[0].message)
    assert "outside the main thread" in text and "a SIGTERM" in text and "will not write" in text
    assert installed() == before
    assert len(sv.load(rank_path(tmp_path, 0)).collectives()) == 1
