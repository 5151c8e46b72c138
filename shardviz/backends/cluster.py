"""Real process groups from the notebook: gloo or NCCL ranks on ipyparallel engines.

One engine per rank. ``sv.use("gloo", world_size=4)`` starts a local cluster (controller and engines
on 127.0.0.1) and owns it: switching backend stops those engines, by PID, and a watchdog process
stops them if the kernel dies first (``watchdog.py``). With ``profile=``,
``profile_dir=`` or ``cluster_id=`` it attaches to a cluster started elsewhere (``ipcluster start``
with the MPI, Slurm or SSH launchers, on several machines) and leaves its engines running.

Ranks are assigned by position among the engines, never by engine id (ids keep growing after
restarts). Every process group gets an explicit timeout and a fresh port. A ``%%spmd`` cell travels
as source text; each rank runs it inside ``record_rank`` and sends back plain data (its trace as
``trace.save`` bytes, its cell value, its ``sv.show`` payloads); the client merges the traces.

While ranks run, the client watches them: a rank that raised, died, or finished without entering a
collective another rank is waiting in becomes one error naming the ranks, as soon as it is certain,
instead of a hang until the process-group timeout. Ranks publish which collective they are entering
*before* entering it (a rank blocked inside gloo cannot answer), so the error says where each was.
A rank running Python past ``spin_limit`` without reaching a collective sends its stack: the
notebook warns (``SpinningRankWarning``) and keeps waiting, or, with ``on_spin="interrupt"``, the
rank stops itself with KeyboardInterrupt.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import sysconfig
import tempfile
import time
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from ..capture.recorder.snapshot import from_values
from ..data.trace import DEFAULT_VALUE_BUDGET, Trace
from ..data.trace_read import load_trace
from ..errors import BackendError, ShardvizError
from . import rank as _rank
from . import session
from .base import check_world_size, rank_tensor, refuse_record, refuse_simulation_options
from .watchdog import Watchdog

_LOG = logging.getLogger("shardviz.cluster")
_LOG.setLevel(logging.ERROR)  # ipyparallel logs engine output at WARNING when engines stop

DEFAULT_TIMEOUT = 60.0
ENGINE_TIMEOUT = 120.0
OPTIONS = (
    "timeout",
    "profile",
    "profile_dir",
    "cluster_id",
    "master_addr",
    "launcher",
    "engine_timeout",
    "progress",
    "spin_limit",
    "on_spin",
)


# --- errors --------------------------------------------------------------------------------------


class RankError(ShardvizError, RuntimeError):
    """Code raised on one or more ranks; carries each rank's traceback and where every rank was."""

    def __init__(
        self,
        message: str,
        errors: Mapping[int, Mapping[str, Any]] | None = None,
        where: Mapping[int, str] | None = None,
        missing: Sequence[int] = (),
        spinning: Mapping[int, Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__(message)
        self.errors = dict(errors or {})
        self.where = dict(where or {})
        self.missing = list(missing)
        self.spinning = dict(spinning or {})  # rank -> its spin report: seconds, stack, where

    @property
    def ranks(self) -> list[int]:
        """The ranks that raised (or, for a hang, the ranks that are missing)."""
        return sorted(self.errors) if self.errors else list(self.missing)

    def _render_traceback_(self) -> list[str]:
        """What IPython shows: the message and the ranks' tracebacks, not shardviz's own frames."""
        return [f"{type(self).__name__}: {self}"]


class CollectiveHangError(RankError):
    """A rank died, or never entered a collective the others entered: they would hang."""


class SpinningRankWarning(UserWarning):
    """A rank has run Python past ``spin_limit`` without reaching a collective. It may just be
    slow, so the notebook keeps waiting; turned into an error (``warnings.simplefilter("error",
    SpinningRankWarning)``), it stops every rank as Ctrl-C does."""


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


# --- what the client knows about each rank during a call -----------------------------------------


@dataclass
class RankRun:
    """One rank's side of a dispatched call, as the client sees it."""

    rank: int
    engine: int
    status: str = "running"  # running | done | died | failed (shardviz itself failed on the rank)
    result: dict[str, Any] | None = None
    flight: dict[str, Any] | None = None
    failure: str = ""
    stdout: str = ""
    stderr: str = ""
    outputs: list[dict[str, Any]] = field(default_factory=list)
    finished_at: float | None = None  # time.monotonic() when the client saw it finish
    spin: dict[str, Any] | None = None  # its report past the spin limit, while it still applies

    @property
    def finished(self) -> bool:
        return self.status != "running"

    @property
    def error(self) -> dict[str, Any] | None:
        return self.result.get("error") if self.result else None


def _counts(flight: Mapping[str, Any] | None) -> dict[tuple[int, ...], int]:
    return {tuple(g): int(n) for g, n in ((flight or {}).get("counts") or {}).items()}


def _coll(last: Mapping[str, Any]) -> str:
    group = ",".join(str(r) for r in last.get("group", ()))
    where = f" (line {last['line']}: {last['text']})" if last.get("line") else ""
    return f"{last['op']} #{last['gseq']} on group [{group}]{where}"


def spin_text(spin: Mapping[str, Any]) -> str:
    """A spin report in words: how long the rank has run Python since its last collective, where."""
    return (
        f"Python for {float(spin['seconds']):.1f} s without reaching a collective "
        f"(spin_limit {float(spin['limit']):g} s), at {spin['where']}"
    )


def where_text(run: RankRun) -> str:
    """Where a rank is or stopped, in words: inside a collective, or running code outside one."""
    flight = run.flight or {}
    last = flight.get("last")
    n = int(flight.get("n") or 0)
    interrupted = (run.error or {}).get("spin")
    if run.status == "done" and interrupted:
        return (
            f"stopped by on_spin='interrupt' after running {spin_text(interrupted)}; "
            f"{n} collective{'s' if n != 1 else ''} before"
        )
    if run.status == "died":
        return f"died (engine {run.engine} exited); " + (
            f"last collective entered: {_coll(last)}" if last else "it had entered no collective"
        )
    if run.status == "failed":
        return f"shardviz failed on this rank: {run.failure.splitlines()[-1] if run.failure else '?'}"
    if run.status == "done":
        err = run.error
        head = f"raised {err['ename']}" if err else "finished"
        return f"{head} after {n} collective{'s' if n != 1 else ''}" + (
            f"; last: {_coll(last)}" if last and err else ""
        )
    if last and last.get("state") == "in":
        return f"waiting in {_coll(last)}"
    after = f" (last: {_coll(last)})" if last else ""
    if run.spin:
        return f"running {spin_text(run.spin)}{after}"
    return f"running outside any collective{after}"


def running_python(run: RankRun) -> bool:
    """Still running, and not inside a collective: Ctrl-C (SIGINT) reaches its Python code."""
    last = (run.flight or {}).get("last") or {}
    return not run.finished and last.get("state") != "in"


@dataclass
class Fault:
    """Why the client stopped waiting: a rank that died, skipped or diverged."""

    kind: str  # died | skipped | mismatch | timeout
    missing: list[int]
    summary: str


def diagnose(runs: Sequence[RankRun], now: float | None = None, grace: float = 2.0) -> Fault | None:
    """Decide, from finished ranks and the others' published positions, whether waiting longer
    can only end in the process-group timeout. Pure: it reads what the ranks reported.

    A rank whose collective failed (a timeout, a peer that closed the connection) while others
    still run is only judged ``grace`` seconds later: a peer that died is reported by ipyparallel
    a moment after its neighbours notice, and "died" is the better answer."""
    dead = [r.rank for r in runs if r.status == "died"]
    if dead:
        blocked = [r.rank for r in runs if not r.finished]
        return Fault(
            "died",
            dead,
            f"{_ranks(dead)} died (engine exited) while running"
            + (f"; {_ranks(blocked)} cannot finish without {_them(dead)}" if blocked else ""),
        )
    finished = [r for r in runs if r.finished]
    running = [r for r in runs if not r.finished]
    for s in running:
        s_counts = _counts(s.flight)
        for g, n in sorted(s_counts.items()):
            for r in finished:
                if r.rank in g and _counts(r.flight).get(g, 0) < n:
                    last = (s.flight or {}).get("last") or {}
                    what = (
                        _coll(last)
                        if tuple(last.get("group", ())) == g
                        else f"collective #{n} on group {list(g)}"
                    )
                    how = "finished"
                    if r.error:
                        stopped = r.error.get("spin")
                        how = "was stopped (on_spin='interrupt')" if stopped else f"raised {r.error['ename']}"
                    return Fault(
                        "skipped",
                        [r.rank],
                        f"rank {r.rank} {how} without entering {what}, which rank {s.rank} entered; "
                        f"rank {s.rank} would wait for it until the process-group timeout",
                    )
    inside = [r for r in running if ((r.flight or {}).get("last") or {}).get("state") == "in"]
    for i, a in enumerate(inside):
        la = a.flight["last"]  # type: ignore[index]
        for b in inside[i + 1 :]:
            lb = b.flight["last"]  # type: ignore[index]
            same_step = tuple(la["group"]) == tuple(lb["group"]) and la["gseq"] == lb["gseq"]
            if same_step and la["op"] != lb["op"]:
                return Fault(
                    "mismatch",
                    [],
                    f"rank {a.rank} is in {_coll(la)} but rank {b.rank} is in {_coll(lb)}: the ranks "
                    "called different collectives",
                )
    now = time.monotonic() if now is None else now
    timed_out = [
        r
        for r in finished
        if r.error and r.error.get("distributed") and now - (r.finished_at or now) >= grace
    ]
    if timed_out and running:
        states = {True: "is running Python, outside any collective", False: "is inside a collective"}
        doing = ", ".join(f"rank {r.rank} {states[running_python(r)]}" for r in running)
        return Fault(
            "timeout",
            [r.rank for r in running],
            f"{_ranks([r.rank for r in timed_out])} failed inside a collective "
            f"({timed_out[0].error['evalue'].splitlines()[0][:160]}) while {doing}",  # type: ignore[index]
        )
    return None


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in sorted(ranks))


def _them(ranks: Sequence[int]) -> str:
    return "it" if len(ranks) == 1 else "them"


# --- shipping functions for sv.run ---------------------------------------------------------------

_LIB_DIRS = tuple(
    {
        os.path.realpath(p) + os.sep
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(key))
    }
)
_PLAIN = (type(None), bool, int, float, complex, str, bytes)


def _library_module(name: str) -> bool:
    """A module the engines import the same way: installed or standard library, not a script."""
    mod = sys.modules.get(name)
    if mod is None:
        return False
    file = getattr(mod, "__file__", None)
    if file is None:
        return name in sys.builtin_module_names or name.split(".")[0] in ("torch", "numpy", "shardviz")
    return os.path.realpath(file).startswith(_LIB_DIRS) or name.split(".")[0] == "shardviz"


def import_spec(value: Any) -> tuple[str, ...] | None:
    """How a rank gets the same object by importing it, or None."""
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__) if value.__name__ != "__main__" else None
    mod = getattr(value, "__module__", None)
    qual = getattr(value, "__qualname__", None)
    if not isinstance(mod, str) or not isinstance(qual, str) or "<" in qual or not _library_module(mod):
        return None
    obj: Any = sys.modules[mod]
    for part in qual.split("."):
        obj = getattr(obj, part, None)
    return ("attr", mod, qual) if obj is value else None


def notebook_imports(ns: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Names the notebook imported (``sv``, ``torch``, ``Shard``...), so cells see them on ranks."""
    out = {}
    for name, value in list(ns.items()):
        if name.startswith("_") or name in ("In", "Out", "exit", "quit", "get_ipython"):
            continue
        if isinstance(value, types.ModuleType | type) or callable(value):
            spec = import_spec(value)
            if spec is not None:
                out[name] = spec
    return out


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _plain(value: Any, depth: int = 0) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if depth < 3 and isinstance(value, tuple | list | frozenset | set):
        return all(_plain(v, depth + 1) for v in value)
    if depth < 3 and isinstance(value, dict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return type(value).__module__ == "torch" and type(value).__name__ in ("dtype", "device")


def ship_function(fn: Callable[..., Any]) -> tuple[Any, dict[str, Any]]:
    """``fn`` and what its globals must hold on a rank: imports by name, plain constants and
    helper functions by value. Names it finds nowhere come from the rank (earlier cells' names).

    Functions from scripts and test files are sent by code, since the engines may not import them.
    """
    env: dict[str, Any] = {"imports": {}, "constants": {}, "functions": {}, "lines": {}}
    if not isinstance(fn, types.FunctionType) or import_spec(fn) is not None:
        return fn, env
    done: dict[int, types.FunctionType] = {}

    def detach(f: types.FunctionType) -> types.FunctionType:
        if id(f) in done:
            return done[id(f)]
        closure = None
        if f.__closure__:
            closure = tuple(types.CellType(_ship_cell(c, detach)) for c in f.__closure__)
        new = types.FunctionType(f.__code__, {}, f.__name__, f.__defaults__, closure)
        new.__kwdefaults__ = f.__kwdefaults__
        new.__module__ = "__main__"  # ipyparallel then binds it to the rank's namespace
        new.__qualname__ = f.__qualname__
        done[id(f)] = new
        filename = f.__code__.co_filename
        import linecache

        if filename not in env["lines"]:
            env["lines"][filename] = linecache.getlines(filename)
        for name in sorted(_global_names(f.__code__)):
            if name not in f.__globals__:
                continue
            value = f.__globals__[name]
            spec = import_spec(value)
            if spec is not None:
                env["imports"][name] = spec
            elif isinstance(value, types.FunctionType):
                env["functions"][name] = detach(value)
            elif _plain(value):
                env["constants"][name] = value
        return new

    return detach(fn), env


def _ship_cell(cell: Any, detach: Callable[[types.FunctionType], types.FunctionType]) -> Any:
    try:
        value = cell.cell_contents
    except ValueError:
        return None
    if isinstance(value, types.FunctionType) and import_spec(value) is None:
        return detach(value)
    return value


def args_for_rank(value: Any, rank: int) -> Any:
    """An argument as one rank receives it: a per-rank tensor (``sv.per_rank``) gives its own."""
    from ..capture import torch as _torch

    local = _torch.local_tensors(value)
    if local is not None:
        return local[rank]
    if _torch.is_dtensor(value):
        raise BackendError(
            "sv.run got a DTensor made in the notebook; under a real backend DTensors live on the ranks: "
            "make it inside the function (or a %%spmd cell)"
        )
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(args_for_rank(v, rank) for v in value)
    if isinstance(value, list):
        return [args_for_rank(v, rank) for v in value]
    if isinstance(value, dict):
        return {k: args_for_rank(v, rank) for k, v in value.items()}
    return value


# --- values and shows ----------------------------------------------------------------------------


class PerRank(dict):
    """A cell's value that differs between ranks: rank → value."""

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        for i, (r, v) in enumerate(self.items()):
            if i:
                p.break_()
            p.text(f"rank {r}: ")
            p.pretty(v)


def same_value(a: Any, b: Any) -> bool:
    """Equal values (tensors by dtype, shape and contents), for folding a cell's per-rank values."""
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_value, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:
        return False


def draw_show(payloads: Mapping[int, Mapping[str, Any]]) -> Any:
    """The widget for one ``sv.show`` call from every rank's layout and shard: plain data handed
    to the drawer, which draws it exactly as under the simulator."""
    from ..geometry.layout import Layout

    ranks = sorted(payloads)
    first = payloads[ranks[0]]
    if "chunk" in first:  # sv.show(chunk, of=global): every rank sent its chunk and offset
        from ..geometry.chunks import chunk_layout

        meta = first["chunk"]
        chunks = {r: payloads[r]["values"] for r in ranks}
        offsets = {r: tuple(payloads[r]["chunk"]["offset"]) for r in ranks}
        layout = chunk_layout(chunks, offsets, meta["global_shape"], meta["dtype"])
        return session.draw(layout, values=chunks, **dict(first.get("options") or {}))
    layout = Layout.from_dict(first["layout"])
    values = {r: payloads[r]["values"] for r in ranks if payloads[r].get("values") is not None}
    return session.draw(layout, values=values or None, **dict(first.get("options") or {}))


def _swap_markers(value: Any, widgets: Mapping[int, Any]) -> Any:
    if isinstance(value, dict):
        if set(value) == {_rank.SHOW_KEY}:
            return widgets.get(int(value[_rank.SHOW_KEY]), value)
        return {k: _swap_markers(v, widgets) for k, v in value.items()}
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_swap_markers(v, widgets) for v in value)
    if isinstance(value, list):
        return [_swap_markers(v, widgets) for v in value]
    return value


def load_rank_trace(data: bytes) -> Trace:
    """A rank's trace from the bytes of ``trace.save``: JSON and ``.npy`` only, no pickle."""
    with tempfile.TemporaryDirectory(prefix="shardviz-") as d:
        path = os.path.join(d, "rank.svtrace")
        with open(path, "wb") as f:
            f.write(data)
        return load_trace(path, tensor=from_values)


# --- the backend ---------------------------------------------------------------------------------


class ClusterBackend:
    """gloo or NCCL ranks on ipyparallel engines, one engine per rank."""

    simulated = False

    def __init__(self, name: str, world_size: int, **options: Any) -> None:
        if name not in ("gloo", "nccl"):
            raise ValueError(f"ClusterBackend runs gloo or nccl, not {name!r}")
        self.name = name
        self.world_size = check_world_size(world_size)
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TypeError(
                f"unknown option(s) {unknown} for the {name} backend; options are {list(OPTIONS)}"
            )
        self.options = dict(options)
        self.timeout = float(options.get("timeout", DEFAULT_TIMEOUT))
        if not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, not {options.get('timeout')!r}")
        self.engine_timeout = float(options.get("engine_timeout", ENGINE_TIMEOUT))
        spin = options.get("spin_limit")
        if spin is None:
            spin = self.timeout
        if isinstance(spin, bool) or not isinstance(spin, int | float) or not spin > 0:
            raise ValueError(
                f"spin_limit must be a positive number of seconds (math.inf: never report), not {spin!r}"
            )
        self.spin_limit = float(spin)
        self.on_spin = options.get("on_spin", "warn")
        if self.on_spin not in _rank.SPIN_ACTIONS:
            raise ValueError(
                f"on_spin must be 'warn' (report a rank past spin_limit and keep waiting) or 'interrupt' "
                f"(stop it with KeyboardInterrupt), not {self.on_spin!r}"
            )
        self.attach = any(options.get(k) is not None for k in ("profile", "profile_dir", "cluster_id"))
        try:
            import ipyparallel  # noqa: F401
        except ImportError:
            raise BackendError(
                f"the {name} backend runs ranks on ipyparallel engines: pip install 'shardviz[cluster]'"
            ) from None
        self.local: LocalCluster | None = None
        self.client: Any = None
        self.engines: list[int] = []
        self.pids: dict[int, int] = {}
        self.hosts: dict[int, str] = {}
        self.master: tuple[str, int] | None = None
        self.broken: str | None = None
        self.busy: dict[int, Any] = {}  # engine -> its unfinished call, after a fault
        self.known_meshes: list[dict[str, Any]] = []
        self._views: dict[int, Any] = {}
        self._sent_imports: dict[str, tuple[str, ...]] = {}
        self.timings: dict[str, float] = {}
        try:
            self._connect(Progress(bool(options.get("progress", True))))
        except BaseException:
            self.close()
            raise

    # --- Backend interface ---------------------------------------------------------------------

    def key(self) -> tuple[Any, ...]:
        return (self.name, self.world_size, *sorted(self.options.items()))

    def device_type(self) -> str:
        return "cuda" if self.name == "nccl" else "cpu"

    def close(self) -> None:
        """Stop engines shardviz started; on attached clusters leave the engines running."""
        if self.local is not None:
            self.local.stop()
            self.local = None
        elif self.client is not None:
            idle = [e for e in self.engines if e in self.client.ids and not self._is_busy(e)]
            with contextlib.suppress(Exception):
                ars = [self._view(e).apply_async(_rank.teardown) for e in idle]
                concurrent.futures.wait(ars, timeout=5)
            with contextlib.suppress(Exception):
                self.client.close()
        self.client = None
        self._views.clear()

    def __repr__(self) -> str:
        where = "attached" if self.attach else "local cluster"
        state = f", broken: {self.broken}" if self.broken else ""
        return (
            f"ClusterBackend({self.name!r}, world_size={self.world_size}, {where}, "
            f"engines {self.engines}{state})"
        )

    # --- start-up ------------------------------------------------------------------------------

    def _connect(self, progress: Progress) -> None:
        t0 = time.perf_counter()
        if self.attach:
            import ipyparallel as ipp

            kwargs = {
                k: self.options[k] for k in ("profile", "profile_dir", "cluster_id") if self.options.get(k)
            }
            progress("connecting to the cluster")
            try:
                self.client = ipp.Client(**kwargs)
            except (OSError, TimeoutError) as e:
                raise BackendError(
                    f"could not attach to an ipyparallel cluster with {kwargs}: {e}. Start one with "
                    f"`ipcluster start -n {self.world_size}` (see the README, 'Real process groups')"
                ) from None
            self._wait_for(self.world_size, progress)
        else:
            self.local = LocalCluster.start(
                self.world_size,
                launcher=self.options.get("launcher"),
                progress=progress,
                engine_timeout=self.engine_timeout,
            )
            self.client = self.local.client
        self.timings["engines"] = time.perf_counter() - t0
        self.engines = sorted(self.client.ids)[: self.world_size]
        self._hello(self.engines, progress)
        self._init_pg(progress)
        progress(
            f"{self.name} backend ready: {self.world_size} ranks (engines {self.timings['engines']:.1f} s, "
            f"torch {self.timings['torch']:.1f} s, process group {self.timings['pg']:.1f} s)"
        )

    def _wait_for(self, n: int, progress: Callable[[str], None]) -> None:
        t0 = time.monotonic()
        while len(self.client.ids) < n:
            progress(f"waiting for engines: {len(self.client.ids)}/{n} registered")
            if time.monotonic() - t0 > self.engine_timeout:
                raise BackendError(
                    f"the {self.name} backend needs {n} engines but the cluster has {len(self.client.ids)} "
                    f"after {self.engine_timeout:.0f} s; start more (e.g. `ipcluster engines -n ...`) or use "
                    "a smaller world_size"
                )
            time.sleep(0.2)

    def _view(self, engine: int) -> Any:
        v = self._views.get(engine)
        if v is None:
            v = self._views[engine] = self.client[engine]
        return v

    def _hello(self, engines: Sequence[int], progress: Callable[[str], None]) -> None:
        progress(f"importing torch on {len(engines)} engines")
        t0 = time.perf_counter()
        ars = {e: self._view(e).apply_async(_rank.hello) for e in engines}
        for e, ar in ars.items():
            try:
                info = ar.get(timeout=self.engine_timeout)
            except Exception as err:
                raise BackendError(
                    f"engine {e} could not import shardviz: {err}. The engines must run the notebook's "
                    f"Python environment ({sys.executable})"
                ) from None
            self.pids[e] = int(info["pid"])
            self.hosts[e] = str(info["host"])
        self.timings["torch"] = time.perf_counter() - t0
        progress(f"torch imported on {len(engines)} engines")

    def _init_pg(self, progress: Callable[[str], None]) -> None:
        progress(f"initialising the {self.name} process group")
        t0 = time.perf_counter()
        here = socket.gethostname()
        first = self.engines[0]
        addr = self.options.get("master_addr")
        if not addr:
            one_host = all(self.hosts.get(e) == here for e in self.engines)
            addr = "127.0.0.1" if one_host else self._view(first).apply_sync(_rank.address)
        port = int(self._view(first).apply_sync(_rank.store_port, addr))
        local_rank: dict[int, int] = {}
        per_host: dict[str, int] = {}
        for e in self.engines:
            h = self.hosts.get(e, "")
            local_rank[e] = per_host.get(h, 0)
            per_host[h] = local_rank[e] + 1
        ars = [
            self._view(e).apply_async(
                _rank.setup,
                r,
                self.world_size,
                self.name,
                addr,
                port,
                self.timeout,
                local_rank[e],
                self.spin_limit,
                self.on_spin,
            )
            for r, e in enumerate(self.engines)
        ]
        _, pending = concurrent.futures.wait(ars, timeout=self.timeout + 30)
        errors = []
        for r, ar in enumerate(ars):
            if ar in pending:
                errors.append(f"rank {r}: did not join within {self.timeout + 30:.0f} s")
                continue
            exc = ar.exception()
            if exc is not None:
                errors.append(
                    f"rank {r}: {getattr(exc, 'ename', type(exc).__name__)}: {getattr(exc, 'evalue', exc)}"
                )
        if errors:
            hint = ""
            if self.name == "nccl":
                hint = "\nnccl needs one CUDA GPU per rank on each machine (torch.cuda.device_count())."
            self.broken = "the process group did not initialise"
            self.busy = {e: ar for e, ar in zip(self.engines, ars, strict=True) if ar in pending}
            raise BackendError(
                f"could not initialise the {self.name} process group on {addr}:{port}:\n  "
                + "\n  ".join(errors)
                + hint
            )
        self.master = (addr, port)
        self.broken = None
        self.busy = {}
        self._sent_imports = {}
        self.timings["pg"] = time.perf_counter() - t0
        progress(
            f"process group ready: {self.name}, {self.world_size} ranks, {addr}:{port}, "
            f"timeout {self.timeout:g} s"
        )

    # --- restart -------------------------------------------------------------------------------

    def restart(self) -> ClusterBackend:
        """Bring the mesh back, in place. Surviving ranks get a new process group on a new port;
        dead ranks (or ranks stuck past the timeout) get new engines first. Names the cells
        defined on the ranks are cleared: their DTensors belong to the old process group."""
        progress = Progress(bool(self.options.get("progress", True)))
        if self.client is None:
            self._connect(progress)
            return self
        dead = self._dead_engines()
        for e in dead:
            self.busy.pop(e, None)
        stuck = self._wait_idle(progress)
        dead += [e for e in self._dead_engines() if e not in dead]
        if stuck and self.local is not None:
            self.local.kill([self.pids[e] for e in stuck if e in self.pids])
            dead += stuck
        elif stuck:
            raise BackendError(
                f"{_ranks([self.engines.index(e) for e in stuck])} still busy after the process-group "
                "timeout, and this cluster was not started by shardviz: restart its engines "
                "(e.g. `ipcluster engines`), then sv.restart()"
            )
        if dead:
            self._await_unregistered(dead)
            for e in dead:
                self.pids.pop(e, None)
        if dead and self.local is not None:
            progress(f"starting {len(dead)} new engine{'s' if len(dead) > 1 else ''} for dead ranks")
            self.local.add_engines(len(dead), self.world_size)
            self.local.wait_for_engines(self.world_size, progress, self.engine_timeout)
        self._wait_for(self.world_size, progress)
        engines = sorted(self.client.ids)[: self.world_size]
        self._views = {e: v for e, v in self._views.items() if e in engines}
        fresh = [e for e in engines if e not in self.pids]
        self.engines = engines
        with contextlib.suppress(Exception):
            self.client.clear(targets=engines, block=True)
        if fresh:
            self._hello(fresh, progress)
        self._init_pg(progress)
        progress(f"{self.name} backend restarted: {self.world_size} ranks")
        return self

    def _dead_engines(self) -> list[int]:
        live = set(self.client.ids)
        return [
            e
            for e in self.engines
            if e not in live or (self.local is not None and e in self.pids and not _alive(self.pids[e]))
        ]

    def _is_busy(self, engine: int) -> bool:
        ar = self.busy.get(engine)
        return ar is not None and not ar.done()

    def _wait_idle(self, progress: Callable[[str], None]) -> list[int]:
        """Wait for ranks still inside a collective to reach the process-group timeout."""
        pending = {e: ar for e, ar in self.busy.items() if not ar.done()}
        self.busy = {}
        if not pending:
            return []
        # Ranks running Python stop at SIGINT; ranks inside a collective take it once they leave.
        with contextlib.suppress(Exception):
            self.client.send_signal(signal.SIGINT, targets=list(pending), block=False)
        concurrent.futures.wait(list(pending.values()), timeout=2)
        pending = {e: ar for e, ar in pending.items() if not ar.done()}
        if not pending:
            return []
        limit = self.timeout + 10
        progress(
            f"waiting up to {limit:.0f} s for {_ranks([self.engines.index(e) for e in pending])} to reach "
            "the process-group timeout"
        )
        concurrent.futures.wait(list(pending.values()), timeout=limit)
        return [e for e, ar in pending.items() if not ar.done()]

    def _await_unregistered(self, engines: Sequence[int], timeout: float = 30) -> None:
        t0 = time.monotonic()
        while any(e in self.client.ids for e in engines) and time.monotonic() - t0 < timeout:
            time.sleep(0.1)

    # --- running code --------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self.client is None:
            raise BackendError(f"the {self.name} backend is closed; call sv.use or sv.restart()")
        if self.broken:
            raise BackendError(
                f"the {self.name} process group is unusable after the last error ({self.broken}); run "
                "sv.restart() (or %shardviz restart) to rebuild it"
            )
        gone = [r for r, e in enumerate(self.engines) if e not in self.client.ids]
        if gone:
            self.broken = f"the engine of {_ranks(gone)} is gone"
            raise BackendError(
                f"the engine of {_ranks(gone)} is gone (it died between cells); run sv.restart() to "
                "replace it"
            )

    def _rank_values(self, values: str | int) -> str | int:
        """Each rank's share of the trace's value budget, so the merged trace keeps to it."""
        if isinstance(values, int) and not isinstance(values, bool):
            return max(0, values // self.world_size)
        return values

    def dispatch(self, func: Callable[..., Any], per_rank_args: Sequence[tuple[Any, ...]]) -> list[RankRun]:
        """Run ``func(*args)`` on every rank and watch until all finish or a fault is certain."""
        self._check_usable()
        ars = [
            self._view(e).apply_async(func, *args)
            for e, args in zip(self.engines, per_rank_args, strict=True)
        ]
        runs = [RankRun(r, e) for r, e in enumerate(self.engines)]
        fault = None
        warned: set[tuple[int, int]] = set()  # (rank, collectives before): one report per stretch
        try:
            while True:
                for run, ar in zip(runs, ars, strict=True):
                    self._update(run, ar)
                # Diagnosed before the all-done exit too: a rank that died in the same poll in
                # which its peer's collective failed is still reported as the death it is.
                fault = diagnose(runs)
                pending = [ar for ar in ars if not ar.done()]
                if fault is not None or not pending:
                    break
                self._report_spinning(runs, warned)
                concurrent.futures.wait(pending, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
        except KeyboardInterrupt:
            raise KeyboardInterrupt(self._interrupt(ars, runs)) from None
        except SpinningRankWarning:  # the user made the warning an error: stop the ranks as Ctrl-C
            self._interrupt(ars, runs)
            raise
        for run, ar in zip(runs, ars, strict=True):
            if ar.done():
                with contextlib.suppress(Exception):
                    ar.wait_for_output(2.0)
            self._update(run, ar, outputs=True)
        if fault is not None:
            self.busy = {e: ar for e, ar in zip(self.engines, ars, strict=True) if not ar.done()}
            self.broken = fault.summary
            raise self._fault_error(runs, fault)
        self._check_consistent(runs)
        return runs

    def _update(self, run: RankRun, ar: Any, outputs: bool = False) -> None:
        if run.status == "running" and not ar.done() and self.local is not None:
            pid = self.pids.get(run.engine)  # our own engines: a dead process is known at once
            if pid is not None and not _alive(pid):
                run.status, run.finished_at = "died", time.monotonic()
        if run.status == "running" and ar.done():
            run.finished_at = time.monotonic()
            exc = ar.exception()
            if exc is None:
                run.status, run.result = "done", ar.result()
                run.flight = run.result.get("flight")
            elif getattr(exc, "ename", "") == "EngineError" or type(exc).__name__ == "EngineError":
                run.status = "died"
            else:
                run.status = "failed"
                run.failure = getattr(exc, "traceback", None) or f"{type(exc).__name__}: {exc}"
        if run.status in ("running", "died"):
            flight = (ar.data or {}).get(_rank.FLIGHT_KEY)
            if flight is not None:
                run.flight = flight
        run.spin = None
        if run.status == "running":  # a report holds until the rank enters its next collective
            spin = (ar.data or {}).get(_rank.SPIN_KEY)
            last = (run.flight or {}).get("last") or {}
            current = spin is not None and int(spin["n"]) == int((run.flight or {}).get("n") or 0)
            if current and last.get("state") != "in":
                run.spin = spin
        if outputs:
            run.stdout = ar.stdout or ""
            run.stderr = ar.stderr or ""
            run.outputs = list(ar.outputs or [])

    def _report_spinning(self, runs: Sequence[RankRun], warned: set[tuple[int, int]]) -> None:
        """A SpinningRankWarning for ranks newly past the spin limit: who, for how long, their stack,
        where the others are. The ranks keep running (they may just be slow) unless on_spin says:
        a rank that on_spin='interrupt' has just stopped reports the error instead, and one it could
        not stop (its code catches KeyboardInterrupt) is reported here."""
        new = [
            r
            for r in runs
            if r.spin and not r.spin.get("interrupted") and (r.rank, int(r.spin["n"])) not in warned
        ]
        if not new:
            return
        for r in new:
            warned.add((r.rank, int(r.spin["n"])))  # type: ignore[index]
        lines = []
        for r in new:
            spin = r.spin or {}
            lines.append(f"rank {r.rank} has run {spin_text(spin)}.")
            lines.append(f"Its stack now:\n{_rank.format_stack(spin.get('stack') or [])}")
        waiting = [r for r in runs if not r.finished and not running_python(r)]
        if waiting:
            lines += _where_lines({r.rank: where_text(r) for r in runs})
        if self.on_spin == "interrupt":
            lines.append(
                "on_spin='interrupt' could not stop it: its code caught the KeyboardInterrupt, or runs "
                "outside the rank's main thread. Interrupt the kernel (Ctrl-C) or run sv.restart()."
            )
        else:
            lines.append(
                "It may just be slow: shardviz keeps waiting. Interrupt the kernel (Ctrl-C, or the stop "
                "button) to stop every rank; sv.use(..., on_spin='interrupt') stops such ranks by itself, "
                "spin_limit= sets the time."
            )
        first = (new[0].spin or {}).get("stack") or [{}]
        warnings.warn_explicit(
            "\n".join(lines),
            SpinningRankWarning,
            f"<rank {new[0].rank}>",
            int(first[-1].get("line") or 0),
            module="shardviz.backends.cluster",
        )

    def _interrupt(self, ars: Sequence[Any], runs: Sequence[RankRun]) -> str:
        """Ctrl-C in the notebook: SIGINT to every rank. Code running Python stops with
        KeyboardInterrupt; a rank inside a collective cannot be interrupted (gloo and NCCL wait
        for the process-group timeout). Returns where the ranks were, in words."""
        for run, ar in zip(runs, ars, strict=True):
            self._update(run, ar)
        before = {r.rank: where_text(r) for r in runs if not r.finished}
        pending = [ar for ar in ars if not ar.done()]
        if not pending:
            return ""
        with contextlib.suppress(Exception):
            self.client.send_signal(signal.SIGINT, targets=self.engines, block=False)
        concurrent.futures.wait(pending, timeout=2)
        for run, ar in zip(runs, ars, strict=True):
            self._update(run, ar)
        still = {e: ar for e, ar in zip(self.engines, ars, strict=True) if not ar.done()}
        stopped = sorted(r for r in before if self.engines[r] not in still)
        stuck = sorted(r for r in before if self.engines[r] in still)
        lines = ["Interrupted. When Ctrl-C came:", *(f"  rank {r}: {before[r]}" for r in sorted(before))]
        if stopped:
            lines.append(f"{_ranks(stopped)} stopped.")
        if still:
            self.busy = still
            self.broken = "interrupted while " + "; ".join(f"rank {r} was {before[r]}" for r in stuck)
            lines.append(
                f"{_ranks(stuck)} did not stop within 2 s (a rank inside a collective waits for the "
                "process-group timeout)."
            )
        else:
            self._check_consistent(runs)  # ranks stopped at different collectives: the group is off
        if self.broken:
            lines.append("Run sv.restart() (or %shardviz restart) before the next cell.")
        return "\n".join(lines)

    def _check_consistent(self, runs: Sequence[RankRun]) -> None:
        """After every rank finished: different collective counts mean a broken process group."""
        counts = [_counts(r.flight) for r in runs]
        groups = {g for c in counts for g in c}
        for g in groups:
            per = {r.rank: counts[r.rank].get(g, 0) for r in runs if r.rank in g}
            if len(set(per.values())) > 1:
                self.broken = "the ranks entered different numbers of collectives on group " + str(list(g))
                return
        if any(r.error and r.error.get("distributed") for r in runs):
            self.broken = "a collective failed on " + _ranks(
                [r.rank for r in runs if r.error and r.error.get("distributed")]
            )

    def _fault_error(self, runs: Sequence[RankRun], fault: Fault) -> RankError:
        where = {r.rank: where_text(r) for r in runs}
        errors = {r.rank: r.error for r in runs if r.error}
        lines = [_error_head(errors)] if errors else []
        lines.append(fault.summary[0].upper() + fault.summary[1:] + "." if errors else fault.summary + ".")
        lines += _where_lines(where)
        lines += _error_lines(errors)
        lines.append(_restart_advice(runs, self))
        cls = RankError if any(not e.get("distributed") for e in errors.values()) else CollectiveHangError
        return cls("\n".join(lines), errors, where, fault.missing, _spinning(runs))

    def show_outputs(self, runs: Sequence[RankRun], widgets: Mapping[int, Any]) -> None:
        """Each rank's stdout, stderr and displays, in rank order; ``sv.show`` markers as widgets."""
        from IPython.display import display, publish_display_data

        for r in runs:
            if r.stdout:
                sys.stdout.write(_tag(r.rank, r.stdout))
            if r.stderr:
                sys.stderr.write(_tag(r.rank, r.stderr))
        sys.stdout.flush()
        shown: set[int] = set()
        for r in runs:
            for out in r.outputs:
                data = out.get("data") or {}
                if _rank.SHOW_MIME in data:
                    sid = int(data[_rank.SHOW_MIME]["id"])
                    if sid not in shown and sid in widgets:
                        shown.add(sid)
                        display(widgets[sid])
                    continue
                publish_display_data(data, out.get("metadata") or {})

    def gather_shows(self, runs: Sequence[RankRun]) -> dict[int, Any]:
        """Every ``sv.show`` of the call: all ranks' payloads of one id drawn as one widget."""
        ids = sorted({i for r in runs if r.result for i in (r.result.get("shows") or {})})
        out = {}
        for i in ids:
            payloads = {
                r.rank: r.result["shows"][i] for r in runs if r.result and i in (r.result.get("shows") or {})
            }
            out[i] = draw_show(payloads)
        return out

    def merge(self, runs: Sequence[RankRun], values: str | int) -> Trace:
        from ..data.merge import merge

        traces = {
            r.rank: load_rank_trace(r.result["trace"]) for r in runs if r.result and r.result.get("trace")
        }
        trace = merge(traces, self.name, values, self.known_meshes)
        for m in trace.meshes:
            if m not in self.known_meshes:
                self.known_meshes.append(m)
        return trace

    def finish(self, runs: Sequence[RankRun], values: str | int) -> tuple[Trace | None, dict[int, Any]]:
        """Show outputs, merge the traces, raise the ranks' errors: what every call ends with."""
        widgets = self.gather_shows(runs)
        self.show_outputs(runs, widgets)
        errors = {r.rank: r.error for r in runs if r.error}
        trace = None
        try:
            trace = self.merge(runs, values)
        except Exception as e:
            if not errors:
                raise
            trace_note = f"(no merged trace: {str(e).splitlines()[0]})"
        else:
            trace_note = ""
            session.set_last(trace)
        if errors:
            where = {r.rank: where_text(r) for r in runs}
            head = _error_head(errors)
            lines = [head, *_error_lines(errors)]
            if self.broken:
                lines += _where_lines(where)
                lines.append(_restart_advice(runs, self))
            if trace_note:
                lines.append(trace_note)
            raise RankError("\n".join(lines), errors, where, spinning=_spinning(runs))
        return trace, widgets

    def record(self, values: str | int, memory: Any) -> AbstractContextManager[Trace]:
        """Refused: a ``with`` body runs in this process, and the ranks are other processes."""
        raise refuse_record(self.name)

    def run_cell(self, cell: str, shell: Any, values: str | int | None = None) -> Any:
        """A ``%%spmd`` cell on every rank; its names stay on the ranks; returns its value."""
        from .cells import compile_cell

        body, last = compile_cell(cell)
        code = body or last
        if code is None:  # an empty cell
            return None
        filename = code.co_filename
        values = DEFAULT_VALUE_BUDGET if values is None else values
        ns = getattr(shell, "user_ns", None) or {}
        imports = notebook_imports(ns)
        send = {k: v for k, v in imports.items() if self._sent_imports.get(k) != v}
        args = (cell, filename, self._rank_values(values), send)
        runs = self.dispatch(_rank.run_cell, [args] * self.world_size)
        self._sent_imports.update(send)
        _, widgets = self.finish(runs, values)
        return self._value(runs, widgets)

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        values: str | int = DEFAULT_VALUE_BUDGET,
        threads: int | None = None,
        memory: Any = False,
    ) -> Trace:
        """``sv.run(fn, *args)`` on every rank; ``trace.results[rank]`` is what fn returned there.
        ``threads=`` and ``memory=`` are the simulator's: refused with the way out."""
        refuse_simulation_options(self.name, values, threads, memory)
        shipped, env = ship_function(fn)
        per_rank = [
            (shipped, args_for_rank(args, r), args_for_rank(kwargs, r), env, self._rank_values(values))
            for r in range(self.world_size)
        ]
        runs = self.dispatch(_rank.run_fn, per_rank)
        trace, widgets = self.finish(runs, values)
        assert trace is not None
        trace.results = {r.rank: _swap_markers(r.result["value"], widgets) for r in runs if r.result}
        return trace

    def per_rank(self, fn: Callable[[int], Any]) -> Any:
        """A per-rank tensor in the notebook; ``sv.run`` hands each rank its own value."""
        from ..capture import torch as _torch

        values = {r: rank_tensor(fn, r).detach().clone() for r in range(self.world_size)}
        return _torch.new_local_tensor(values)

    def show(self, obj: Any, **options: Any) -> Any:
        """In the notebook: the view itself (a cell's ``sv.show`` on the ranks comes back as its
        widget, drawn from every rank's shard)."""
        return session.draw(obj, **options)

    def _value(self, runs: Sequence[RankRun], widgets: Mapping[int, Any]) -> Any:
        """The cell's value as the simulator shows it: a tensor per rank is a LocalTensor, a value
        every rank agrees on is that value; other per-rank values are a PerRank dict."""
        import torch

        from ..capture import torch as _torch

        vals = [r.result["value"] if r.result else None for r in runs]
        if all(v is None for v in vals):
            return None
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        if len(tensors) == len(vals):
            with contextlib.suppress(Exception):
                return _torch.new_local_tensor({r.rank: v for r, v in zip(runs, tensors, strict=True)})
        if all(same_value(vals[0], v) for v in vals[1:]):
            return _swap_markers(vals[0], widgets)
        return PerRank({r.rank: _swap_markers(v, widgets) for r, v in zip(runs, vals, strict=True)})


def _tag(rank: int, text: str) -> str:
    lines = text.splitlines()
    return "".join(f"[rank {rank}] {line}\n" for line in lines)


def _where_lines(where: Mapping[int, str]) -> list[str]:
    return ["Where each rank is:", *(f"  rank {r}: {w}" for r, w in sorted(where.items()))]


def _spinning(runs: Sequence[RankRun]) -> dict[int, dict[str, Any]]:
    """Each rank's report past the spin limit: stopped by it, or still running past it."""
    out = {}
    for r in runs:
        spin = (r.error or {}).get("spin") or r.spin
        if spin:
            out[r.rank] = dict(spin)
    return out


def _error_head(errors: Mapping[int, Mapping[str, Any]]) -> str:
    kinds: dict[str, list[int]] = {}
    heads = []
    for r, e in sorted(errors.items()):
        spin = e.get("spin")
        if spin:  # stopped on purpose: say why, not only "KeyboardInterrupt"
            heads.append(f"rank {r} was stopped (on_spin='interrupt'): it ran {spin_text(spin)}")
            continue
        first = e["evalue"].splitlines()[0] if e["evalue"] else ""
        kinds.setdefault(f"{e['ename']}: {first}" if first else e["ename"], []).append(r)
    return "; ".join([*heads, *(f"{_ranks(rs)} raised {k}" for k, rs in kinds.items())])


def _error_lines(errors: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """Each distinct traceback once, headed by the ranks that raised it."""
    by_text: dict[str, list[int]] = {}
    for r, e in sorted(errors.items()):
        by_text.setdefault(e["traceback"].rstrip(), []).append(r)
    lines = []
    for text, rs in by_text.items():
        lines.append(f"--- {_ranks(rs)} ---")
        lines.append(text)
    return lines


def _restart_advice(runs: Sequence[RankRun], backend: ClusterBackend) -> str:
    dead = [r.rank for r in runs if r.status == "died"]
    if dead and backend.local is not None:
        return (
            f"Run sv.restart() (or %shardviz restart): it starts a new engine for {_ranks(dead)} and "
            "rebuilds the process group; names defined on the ranks are cleared."
        )
    if dead:
        return (
            f"{_ranks(dead)} died on a cluster shardviz did not start: restart its engines, then "
            "sv.restart()."
        )
    python = [r.rank for r in runs if running_python(r)]
    inside = [r.rank for r in runs if not r.finished and not running_python(r)]
    steps = []
    if python:
        steps.append(f"interrupts {_ranks(python)} (running Python, outside any collective)")
    if inside:
        steps.append(
            f"waits up to {backend.timeout:g} s (the process-group timeout) for {_ranks(inside)} to leave "
            f"{'its collective' if len(inside) == 1 else 'their collectives'}"
        )
    steps.append("rebuilds the process group on a new port")
    then = ", then " if len(steps) > 1 else ""
    return (
        f"Run sv.restart() (or %shardviz restart): it {', '.join(steps[:-1])}{then}{steps[-1]}; names "
        "defined on the ranks are cleared."
    )
