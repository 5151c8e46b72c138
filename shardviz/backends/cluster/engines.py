"""Engines shardviz starts itself: an ipyparallel controller and one engine per rank on
127.0.0.1, watched by a watchdog process that stops them if the kernel dies first, stopped by
PID (TERM, then KILL); and the start-up progress line."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...errors import BackendError
from ..watchdog import Watchdog

_LOG = logging.getLogger("shardviz.cluster")
_LOG.setLevel(logging.ERROR)  # ipyparallel logs engine output at WARNING when engines stop


ENGINE_TIMEOUT = 120.0


# --- progress ------------------------------------------------------------------------------------


class Progress:
    """One status line: updated in place in a notebook, printed line by line elsewhere."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.handle: Any = None
        self.last = ""
        self.t0 = time.perf_counter()
        if enabled:
            with contextlib.suppress(Exception):
                from IPython import get_ipython

                ip = get_ipython()
                if ip is not None and getattr(ip, "kernel", None) is not None:
                    from IPython.display import display

                    self.handle = display({"text/plain": "shardviz: starting"}, raw=True, display_id=True)

    def __call__(self, text: str) -> None:
        if not self.enabled or text == self.last:
            return
        self.last = text
        line = f"shardviz: {text}"
        if self.handle is not None:
            self.handle.update({"text/plain": line}, raw=True)
        else:
            print(line, flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


# --- clusters shardviz starts itself -------------------------------------------------------------


class LocalCluster:
    """An ipyparallel controller and engines that shardviz started, so may stop (by PID)."""

    def __init__(self, cluster: Any, client: Any, profile_dir: str, watchdog: Watchdog | None = None) -> None:
        self.cluster = cluster
        self.client = client
        self.profile_dir = profile_dir
        self.watchdog = watchdog

    @classmethod
    def start(
        cls,
        n: int,
        *,
        launcher: str | None = None,
        env: Mapping[str, str] | None = None,
        progress: Callable[[str], None] = lambda text: None,
        engine_timeout: float = ENGINE_TIMEOUT,
    ) -> LocalCluster:
        """Start a controller on 127.0.0.1 and ``n`` engines, and wait until they registered.

        A watchdog process, started first, ends them and removes the profile folder if this
        process dies without stopping them (even by SIGKILL, even half-way through starting)."""
        import ipyparallel as ipp

        profile_dir = tempfile.mkdtemp(prefix="shardviz-ipp-")
        atexit.register(shutil.rmtree, profile_dir, True)  # ipyparallel stops the processes at exit
        cluster_id = f"shardviz-{os.getpid()}-{os.urandom(3).hex()}"
        watchdog = Watchdog.start(cluster_id, profile_dir)
        kwargs: dict[str, Any] = {
            "n": n,
            "profile_dir": profile_dir,
            "cluster_id": cluster_id,
            "controller_ip": "127.0.0.1",  # the controller's ports: this machine only
            "log": _LOG,
            "load_profile": False,
            "parent": None,
        }
        if launcher:
            kwargs["engines"] = launcher
        cluster = ipp.Cluster(**kwargs)
        self = cls(cluster, None, profile_dir, watchdog)
        try:
            progress(f"starting {n} engines: controller")
            cluster.start_controller_sync()
            watchdog.watch([p for p in [self.controller_pid()] if p])
            cluster.start_engines_sync(n, environment=dict(env or engine_env(n)))
            watchdog.watch(self.engine_pids())
            self.client = cluster.connect_client_sync()
            self.wait_for_engines(n, progress, engine_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def connection(self) -> dict[str, str]:
        """What another process passes to ``sv.use(..., **connection)`` to attach to these engines."""
        return {"profile_dir": self.profile_dir, "cluster_id": self.cluster.cluster_id}

    def engine_pids(self) -> list[int]:
        return [
            int(launcher.pid)
            for engine_set in self.cluster.engines.values()
            for launcher in getattr(engine_set, "launchers", {}).values()
        ]

    def controller_pid(self) -> int | None:
        ctl = self.cluster.controller
        return int(ctl.pid) if ctl is not None and getattr(ctl, "pid", -1) > 0 else None

    def engine_output(self, lines: int = 20) -> str:
        out = []
        for engine_set in self.cluster.engines.values():
            with contextlib.suppress(Exception):
                out.append(engine_set.get_output())
        text = "\n".join(o for o in out if o)
        return "\n".join(text.splitlines()[-lines:])

    def wait_for_engines(self, n: int, progress: Callable[[str], None], timeout: float) -> None:
        t0 = time.monotonic()
        while len(self.client.ids) < n:
            progress(f"engines up {len(self.client.ids)}/{n}")
            stopped = self.cluster.engines and all(
                es.state == "after" for es in self.cluster.engines.values()
            )
            if stopped or time.monotonic() - t0 > timeout:
                why = (
                    "the engines exited"
                    if stopped
                    else f"only {len(self.client.ids)} registered in {timeout:.0f} s"
                )
                raise BackendError(
                    f"could not start {n} ipyparallel engines: {why}. Engine output:\n{self.engine_output()}"
                )
            time.sleep(0.1)
        progress(f"engines up {n}/{n}")

    def add_engines(self, k: int, n_total: int) -> None:
        """Start ``k`` more engines (replacing dead ones) and wait until ``n_total`` are registered."""
        self.cluster.start_engines_sync(k, environment=dict(engine_env(n_total)))
        if self.watchdog is not None:
            self.watchdog.watch(self.engine_pids())

    def kill(self, pids: Sequence[int]) -> None:
        """SIGKILL engines of this cluster by PID (ranks stuck where no signal reaches them)."""
        own = set(self.engine_pids())
        for pid in pids:
            if pid in own:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        """Stop the engines and the controller (TERM, then KILL, by PID) and remove the profile."""
        pids = self.engine_pids()
        ctl = self.controller_pid()
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
        with contextlib.suppress(Exception):
            self.cluster.stop_cluster_sync()
        _reap([*pids, *([ctl] if ctl else [])])
        shutil.rmtree(self.profile_dir, ignore_errors=True)
        if self.watchdog is not None:  # it ends whatever is left, by the cluster's id, and exits
            self.watchdog.close()
            self.watchdog = None


def _reap(pids: Sequence[int], wait: float = 5.0) -> None:
    """Make sure these processes (ours, by PID) are gone: wait, then SIGKILL."""
    import psutil

    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=wait)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=wait)


def engine_env(n: int) -> dict[str, str]:
    """Environment for engines: one process per rank sharing the cores, unless the user chose."""
    env = {}
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, n)))
    return env
