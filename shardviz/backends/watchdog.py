"""A watchdog for the ipyparallel processes shardviz starts: they end when the kernel ends, however
it ends (SIGKILL included), and their profile folder (it holds the cluster's keys) goes with them.

``Watchdog.start`` runs this file as a script in a process of its own session (so that signals to
the kernel's process group leave it alone), before the controller starts. It reads the kernel's
pipe: the kernel's death closes it, as does ``Watchdog.close``. It also polls the kernel's PID (a
process forked from the kernel would keep the pipe open). Then it ends, TERM and after 3 s KILL,
every process whose environment carries the cluster's id (ipyparallel sets ``IPP_CLUSTER_ID`` for
the controller, the engines and everything they start), and every PID the kernel reported, and
removes the profile folder. A process started by a kernel killed before it reported the PID is
still found by its environment.

As a script it imports nothing but the standard library and psutil: no torch, no shardviz.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable
from typing import Any

POLL = 0.5  # seconds between checks that the kernel still runs
GRACE = 3.0  # seconds between TERM and KILL


class Watchdog:
    """The kernel's end of the watchdog: a pipe to a process that outlives the kernel."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    @classmethod
    def start(cls, cluster_id: str, profile_dir: str) -> Watchdog:
        import psutil

        me = psutil.Process()
        args = [str(me.pid), repr(me.create_time()), cluster_id, profile_dir]
        proc = subprocess.Popen(
            [sys.executable, "-P", os.path.abspath(__file__), *args],  # -P: no package dir on sys.path
            stdin=subprocess.PIPE,  # not inherited by the engines: Python opens it close-on-exec
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return cls(proc)

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def watch(self, pids: Iterable[int]) -> None:
        """Report processes to end with the kernel (found by the cluster's id anyway, where the
        platform shows other processes' environments)."""
        text = "".join(f"pid {int(p)}\n" for p in pids)
        if text and self.proc.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.write(text.encode())
                self.proc.stdin.flush()

    def close(self, timeout: float = 10.0) -> None:
        """End the watch: it cleans up what is left (nothing, after a clean stop) and exits."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)


# --- the watchdog process ------------------------------------------------------------------------


def _alive(pid: int, create_time: float) -> bool:
    import psutil

    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - create_time) < 1e-3 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _targets(cluster_id: str, known: Iterable[Any]) -> list[Any]:
    """The cluster's processes still running: by environment, and the reported ones (captured when
    reported, so a reused PID is not mistaken for them) with their children."""
    import psutil

    me = os.getpid()
    found: dict[int, psutil.Process] = {}
    for p in known:
        with contextlib.suppress(psutil.Error):
            if p.is_running():
                found[p.pid] = p
                for c in p.children(recursive=True):
                    found[c.pid] = c
    for p in psutil.process_iter():
        if p.pid == me or p.pid in found:
            continue
        with contextlib.suppress(psutil.Error):
            if p.environ().get("IPP_CLUSTER_ID") == cluster_id:
                found[p.pid] = p
    alive = []
    for p in found.values():
        with contextlib.suppress(psutil.Error):
            if p.pid != me and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
    return alive


def reap(cluster_id: str, known: Iterable[Any] = ()) -> int:
    """End the cluster's processes (TERM, then KILL); return how many there were."""
    import psutil

    known = list(known)
    total = 0
    for _ in range(3):  # again: a controller may have started a child while it was being ended
        procs = _targets(cluster_id, known)
        if not procs:
            break
        total += len(procs)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=GRACE)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=GRACE)
    return total


def main(argv: list[str]) -> None:
    import psutil

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the kernel is not for us
    parent, create_time, cluster_id, profile_dir = int(argv[0]), float(argv[1]), argv[2], argv[3]
    known: list[psutil.Process] = []
    buffer = b""
    fd = sys.stdin.fileno()
    while _alive(parent, create_time):
        readable, _, _ = select.select([fd], [], [], POLL)
        if not readable:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:  # the kernel closed the pipe, or died
            break
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            word, _, value = line.decode().partition(" ")
            if word == "pid" and value.strip().isdigit():
                with contextlib.suppress(psutil.Error):
                    known.append(psutil.Process(int(value)))
    reap(cluster_id, known)
    shutil.rmtree(profile_dir, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
