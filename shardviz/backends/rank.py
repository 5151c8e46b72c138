"""What runs inside each rank's ipyparallel engine: the process group, ``%%spmd`` cells, ``sv.run``.

The client (``cluster.py``) sends these functions by reference; the engines import shardviz from
the same environment. Everything sent back is plain data — dicts, strings, bytes, numpy arrays and
CPU tensors — carried by ipyparallel's own transport; a rank's trace travels as the bytes of
``trace.save`` (JSON and ``.npy``), so the client never unpickles a shardviz object.

Before a rank enters a collective it publishes which one (ipyparallel's data channel, sent from a
background thread), so the client can see where a rank blocked inside gloo or NCCL is, even though
that rank cannot answer until the process-group timeout. A rank that runs Python past the spin limit
without reaching a collective publishes its stack from a watcher thread, and stops if asked to.

Nothing here listens on a wildcard address: rank 0's store is bound to the rendezvous address, and on
one machine gloo and NCCL are kept on the loopback interface.
"""

from __future__ import annotations

import datetime
import importlib
import ipaddress
import json
import linecache
import math
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .._version import __version__
from ..capture import torch as _torch
from ..capture.job import record_rank
from ..data.events import Source
from ..data.trace import DEFAULT_VALUE_BUDGET, Trace
from ..errors import BackendError
from . import session
from .base import rank_tensor, refuse_record, refuse_simulation_options

# The mimetype a ``sv.show`` marker displays as on a rank; the client swaps in the widget.
SHOW_MIME = "application/vnd.shardviz.show+json"
SHOW_KEY = "__shardviz_show__"
FLIGHT_KEY = "shardviz_flight"
SPIN_KEY = "shardviz_spin"
SPIN_ACTIONS = ("warn", "interrupt")

_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_MAX_SHOWS = 64


@dataclass
class _RankState:
    rank: int
    world_size: int
    backend: str
    local_rank: int
    timeout_s: float
    spin_limit: float = math.inf
    on_spin: str = "warn"
    shows: dict[int, dict[str, Any]] = field(default_factory=dict)
    displayed: set[int] = field(default_factory=set)
    next_show: int = 0
    running: bool = False  # a cell or sv.run function runs here: sv.show gathers for the client


_state: _RankState | None = None


class RankBackend:
    """shardviz's backend inside a rank's own process: code runs here directly, on this rank.

    Installed on the engine by ``setup`` (and by ``sv.record_job`` in a launched job) so that
    ``sv.device_type()``, ``sv.per_rank`` and ``sv.show`` in a ``%%spmd`` cell mean the same as in
    the simulator. What only the notebook can do (run cells, restart the ranks) is refused.
    """

    simulated = False

    def __init__(self, name: str, world_size: int, rank: int) -> None:
        self.name = name
        self.world_size = world_size
        self.rank = rank

    def key(self) -> tuple[Any, ...]:
        return (self.name, self.world_size)

    def device_type(self) -> str:
        return "cuda" if self.name == "nccl" else "cpu"

    def close(self) -> None:
        """The client owns the process group; nothing to release from inside a cell."""

    def restart(self) -> RankBackend:
        raise BackendError(
            "sv.restart() rebuilds the ranks from the notebook that started them; on a rank (a %%spmd "
            "cell, sv.record_job) there is nothing to restart"
        )

    def record(self, values: str | int, memory: Any) -> AbstractContextManager[Trace]:
        raise refuse_record(self.name)

    def per_rank(self, fn: Callable[[int], Any]) -> Any:
        return rank_tensor(fn, self.rank)

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
        refuse_simulation_options(self.name, values, threads, memory)
        raise BackendError(
            "sv.run inside a %%spmd cell: the cell already runs on every rank and is recorded; "
            "call the function directly"
        )

    def run_cell(self, cell: str, shell: Any, values: str | int | None = None) -> Any:
        raise BackendError("%%spmd cells are sent to the ranks from the notebook, not run on a rank")

    def show(self, obj: Any, **options: Any) -> Any:
        """While a cell or ``sv.run`` function runs here: keep this rank's part for the client,
        which draws every rank's together; otherwise (``%px``, ``sv.record_job``) draw here."""
        if _state is not None and _state.running:
            return gather_show(obj, **options)
        return session.draw(obj, **options)

    def __repr__(self) -> str:
        return f"RankBackend({self.name!r}, rank={self.rank}, world_size={self.world_size})"


# --- start-up ------------------------------------------------------------------------------------


def hello() -> dict[str, Any]:
    """Where this engine runs and what it has; importing this module imported torch and shardviz."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "python": sys.executable,
        "torch": torch.__version__,
        "shardviz": __version__,
    }


_listener: socket.socket | None = None  # rank 0: the store's socket, bound before setup


def store_port(addr: str) -> int:
    """Bind rank 0's store socket to ``addr`` (never a wildcard) on a free port, and keep it open
    for ``setup``: nothing else can take the port in between, and nothing listens elsewhere."""
    global _listener
    if _listener is not None:
        _listener.close()
    host = "127.0.0.1" if addr in ("", "localhost") else addr
    infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    family, _, _, _, sockaddr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind(sockaddr)
        s.listen(128)
    except BaseException:
        s.close()
        raise
    _listener = s
    return int(s.getsockname()[1])


def address() -> str:
    """This host's address as other hosts would reach it (for MASTER_ADDR across machines)."""
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name


def loopback(addr: str) -> bool:
    """Whether ``addr`` is this machine's loopback (127.0.0.0/8, ::1, localhost)."""
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_interface() -> str | None:
    """The name of the interface holding 127.0.0.1 (``lo`` on Linux, ``lo0`` on macOS)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs):
            return name
    return None


# The transports' interface variables this module set (so that a later multi-host setup undoes
# them); a value the user set is never touched.
_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_set_ifnames: dict[str, str] = {}


def keep_transport_local(local: bool) -> None:
    """On one machine, gloo and NCCL listen on the loopback interface only; otherwise they choose
    as usual (or as the user's ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` say)."""
    for var in _IFNAME_VARS:
        if var in _set_ifnames and os.environ.get(var) == _set_ifnames[var]:
            del os.environ[var]
        _set_ifnames.pop(var, None)
    iface = loopback_interface() if local else None
    if iface is None:
        return
    for var in _IFNAME_VARS:
        if var not in os.environ:
            os.environ[var] = _set_ifnames[var] = iface


def setup(
    rank: int,
    world_size: int,
    backend: str,
    master_addr: str,
    master_port: int,
    timeout_s: float,
    local_rank: int,
    spin_limit: float = math.inf,
    on_spin: str = "warn",
) -> dict[str, Any]:
    """Join a fresh process group: a new port each time and an explicit timeout.

    Rank 0 serves the store on the socket ``store_port`` bound; the others connect to it. nccl
    ranks pick their GPU first (``local_rank`` among the engines on this host), so that each
    process initialises CUDA on its own device only.
    """
    global _state, _listener
    _destroy_pg()
    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
    )
    keep_transport_local(loopback(master_addr))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    t0 = time.perf_counter()
    timeout = datetime.timedelta(seconds=timeout_s)
    host = "127.0.0.1" if master_addr in ("", "localhost") else master_addr.strip("[]")
    if rank == 0:
        if _listener is None or _listener.getsockname()[1] != master_port:
            raise BackendError(
                f"rank 0 holds no store socket on port {master_port}; run sv.restart() in the notebook"
            )
        fd, _listener = _listener.detach(), None  # the store owns the socket from here on
        store = dist.TCPStore(host, master_port, world_size, True, timeout, master_listen_fd=fd)
    else:
        store = dist.TCPStore(host, master_port, world_size, False, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    _state = _RankState(rank, world_size, backend, local_rank, timeout_s, spin_limit, on_spin)
    _install(RankBackend(backend, world_size, rank))
    return {"rank": rank, "pid": os.getpid(), "init_s": time.perf_counter() - t0}


def teardown() -> None:
    """Leave the process group and forget this rank's state; the engine itself keeps running."""
    global _state
    _destroy_pg()
    _state = None
    if isinstance(session.peek(), RankBackend):
        session.install(None)


def _destroy_pg() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _install(backend: RankBackend) -> None:
    session.install(backend)


def _require_state() -> _RankState:
    if _state is None or not dist.is_initialized():
        raise BackendError("this engine has no shardviz process group; run sv.restart() in the notebook")
    return _state


# --- the flight recorder -------------------------------------------------------------------------


class Flight:
    """Which collective this rank is in, published before it enters, for the client to compare."""

    def __init__(self, publish: Callable[[dict[str, Any]], None] | None) -> None:
        self.publish = publish
        self.n = 0
        self.counts: dict[tuple[int, ...], int] = {}
        self.last: dict[str, Any] | None = None
        self.since = time.monotonic()  # when this rank last started or left a collective (or entered)

    def __call__(
        self, stage: str, op: str, groups: tuple[tuple[int, ...], ...], source: Source | None
    ) -> None:
        group = tuple(int(r) for r in groups[0]) if groups else ()
        if stage == "enter":
            self.n += 1
            self.counts[group] = self.counts.get(group, 0) + 1
            self.last = {
                "n": self.n,
                "op": op,
                "group": group,
                "gseq": self.counts[group],
                "line": source.line if source else None,
                "text": source.text if source else "",
                "state": "in",
            }
        elif self.last is not None:
            self.last = {**self.last, "state": "out"}
        self.since = time.monotonic()
        if self.publish is not None:
            self.publish({FLIGHT_KEY: self.summary()})

    def summary(self) -> dict[str, Any]:
        return {"last": self.last, "counts": dict(self.counts), "n": self.n}

    def in_collective(self) -> bool:
        return self.last is not None and self.last.get("state") == "in"


class SpinWatch:
    """Watches the thread running a cell: past ``limit`` seconds of Python since the rank started or
    last left a collective, it publishes that thread's stack (again every second while it lasts),
    and with ``interrupt`` raises KeyboardInterrupt there, once. A rank inside a collective is
    waiting for its peers, not spinning: the peers are the ones to report."""

    def __init__(
        self,
        flight: Flight,
        limit: float,
        interrupt: bool,
        filename: str,
        publish: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        self.flight = flight
        self.limit = limit
        self.interrupt = interrupt
        self.filename = filename
        self.publish = publish
        self.ident = threading.get_ident()
        self.report: dict[str, Any] | None = None  # the latest, for the result
        self.interrupted: dict[str, Any] | None = None  # the report it stopped the thread with
        self.tried = False
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> SpinWatch:
        if math.isfinite(self.limit):
            self.thread = threading.Thread(target=self._watch, name="shardviz-spin-watch", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self.lock:
            self.stopped.set()
        if self.thread is not None:
            self.thread.join()

    def _watch(self) -> None:
        period = min(1.0, self.limit / 4)
        last_sent = -math.inf
        while not self.stopped.wait(period):
            flight = self.flight
            if flight.in_collective():
                continue
            now = time.monotonic()
            seconds = now - flight.since
            if seconds < self.limit:
                continue
            if self.report is not None and self.report["n"] == flight.n and now - last_sent < 1.0:
                continue
            stack = thread_stack(self.ident, self.filename)
            report = {
                "n": flight.n,
                "seconds": round(seconds, 3),
                "limit": self.limit,
                "stack": stack,
                "where": stack_where(stack),
                "interrupted": False,
            }
            with self.lock:
                if self.stopped.is_set():
                    return
                if self.interrupt and not self.tried:
                    self.tried = True
                    report["interrupted"] = interrupt_thread(self.ident)
                    if report["interrupted"]:
                        self.interrupted = report
                self.report = report
            last_sent = time.monotonic()
            if self.publish is not None:
                self.publish({SPIN_KEY: report})


def thread_stack(ident: int, filename: str = "", limit: int = 20) -> list[dict[str, Any]]:
    """The user's frames of a running thread, outermost first: from the first frame of the cell (or
    function) ``filename`` on, without shardviz's and torch's dispatch plumbing."""
    frame = sys._current_frames().get(ident)
    if frame is None:
        return []
    frames = traceback.extract_stack(frame)
    start = next((i for i, f in enumerate(frames) if filename and f.filename == filename), None)
    if start is None:  # after shardviz's own frames (the rank's entry points)
        own = [i for i, f in enumerate(frames) if f.filename.startswith(_OWN_DIR)]
        start = own[0] + 1 if own else 0
        while start < len(frames) and frames[start].filename.startswith(_OWN_DIR):
            start += 1
    user = [f for f in frames[start:] if not _plumbing(f.filename)] or list(frames[start:])
    return [
        {"file": f.filename, "line": f.lineno, "name": f.name, "text": (f.line or "").strip()}
        for f in user[-limit:]
    ]


def stack_where(stack: list[dict[str, Any]]) -> str:
    """The innermost frame in words: ``line 4: x += 1`` (a cell) or ``line 9 in f (util.py)``."""
    if not stack:
        return "in code outside any Python frame"
    f = stack[-1]
    place = f"line {f['line']}" + ("" if f["name"] == "<module>" else f" in {f['name']}")
    if not f["file"].startswith("<"):
        place += f" ({os.path.basename(f['file'])})"
    return place + (f": {f['text']}" if f["text"] else "")


def format_stack(stack: list[dict[str, Any]]) -> str:
    """A stack as Python prints one, outermost first."""
    lines = []
    for f in stack:
        lines.append(f'  File "{f["file"]}", line {f["line"]}, in {f["name"]}')
        if f["text"]:
            lines.append(f"    {f['text']}")
    return "\n".join(lines)


def interrupt_thread(ident: int) -> bool:
    """KeyboardInterrupt in the thread running the cell, as Ctrl-C would raise it; only where Python
    handles SIGINT and that thread is the main one (signals reach no other)."""
    if ident != threading.main_thread().ident or not callable(signal.getsignal(signal.SIGINT)):
        return False
    signal.pthread_kill(ident, signal.SIGINT)  # also wakes a sleep or a blocking read
    return True


def _publisher() -> Callable[[dict[str, Any]], None] | None:
    """ipyparallel's data channel when running in an engine, else nothing (in-process tests)."""
    try:
        from ipykernel.zmqshell import ZMQInteractiveShell
    except ImportError:
        return None
    if not ZMQInteractiveShell.initialized():
        return None
    shell = ZMQInteractiveShell.instance()
    if getattr(shell, "data_pub", None) is None:
        return None
    from ipyparallel.datapub import publish_data

    return publish_data


# --- sv.show on a rank ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ShowMarker:
    """What ``sv.show(x)`` returns on a rank: the client draws the widget in its place."""

    id: int

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        if _state is not None:
            _state.displayed.add(self.id)
        return {"text/plain": f"<shardviz show #{self.id}>", SHOW_MIME: {"id": self.id}}


def gather_show(obj: Any, **options: Any) -> Any:
    """``sv.show`` inside a ``%%spmd`` cell: keep this rank's layout and shard (on the CPU) for the
    client, which gathers every rank's and draws the widget in the notebook."""
    st = _require_state()
    payload = show_payload(obj, st.rank, **options)
    if not isinstance(payload, dict):
        return payload
    mid = st.next_show
    st.next_show += 1
    st.shows[mid] = payload
    for old in [k for k in st.shows if k < mid - _MAX_SHOWS]:
        del st.shows[old]
    return ShowMarker(mid)


def show_payload(obj: Any, rank: int, **options: Any) -> Any:
    """What ``rank`` contributes to ``sv.show(obj)`` inside a cell: its layout and shard (or its
    chunk of a global tensor, ``of=``) as plain data, which ``cluster.draw_show`` draws together
    with the other ranks'. A module gives its model map, the same on every rank, not a payload."""
    from ..capture.recorder import to_numpy
    from ..geometry.layout import Layout
    from ..geometry.layout import compute as compute_layout

    if "of" in options:  # this rank's hand-made chunk of a global tensor: the client places it
        from ..geometry.chunks import find_offset, resolve_offsets

        whole = to_numpy(options.pop("of"))
        chunk = to_numpy(obj)
        given = resolve_offsets(options.pop("offsets", None), [rank])
        offset = given[rank] if given else find_offset(whole, chunk, rank)
        return {
            "chunk": {
                "offset": list(offset),
                "global_shape": list(whole.shape),
                "dtype": _torch.dtype_name(obj.dtype),
            },
            "values": chunk,
            "options": options,
        }
    if isinstance(obj, torch.nn.Module):
        # The model map is plain data, the same on every rank: it travels back as the cell's
        # value (or displays as its text table); sv.show(map) in an ordinary cell draws the widget.
        from ..capture.model_map import model_map

        return model_map(obj, **options, backend_world=session.world_size())
    from ..capture import adapters

    adapter = adapters.for_object(obj)
    if _torch.is_dtensor(obj):
        layout = compute_layout(**_torch.dtensor_geometry(obj))
        values: np.ndarray | None = to_numpy(obj.to_local())
    elif adapter is not None:  # PhysicsNeMo's ShardTensor: its spec's own shard sizes
        layout = adapter.layout(obj)
        values = to_numpy(adapter.local(obj))
        options = {"title": adapters.view_title(obj, layout), **options}
    elif isinstance(obj, Layout):
        layout, values = obj, None
    else:
        raise TypeError(
            f"sv.show inside a %%spmd cell takes a DTensor or a Layout, not {type(obj).__name__}; show a "
            "trace from an ordinary cell: sv.show(sv.last_trace())"
        )
    try:
        json.dumps(options)
    except TypeError:
        raise TypeError(
            "sv.show options inside a %%spmd cell must be plain values (numbers, strings, lists)"
        ) from None
    return {"layout": layout.to_dict(), "values": values, "options": options}


# --- running code --------------------------------------------------------------------------------


def _user_ns() -> dict[str, Any]:
    from IPython import get_ipython

    ip = get_ipython()
    if ip is None:
        return globals().setdefault("_fallback_ns", {})
    return ip.user_ns


def bind_imports(ns: dict[str, Any], imports: dict[str, tuple[str, ...]]) -> None:
    """Bind the notebook's imported names here (``sv``, ``torch``, ``Shard``...), by name."""
    for name, spec in imports.items():
        try:
            obj: Any = importlib.import_module(spec[1])
            if spec[0] == "attr":
                for part in spec[2].split("."):
                    obj = getattr(obj, part)
        except Exception:
            continue
        ns[name] = obj


def run_cell(
    source: str, filename: str, values: str | int, imports: dict[str, tuple[str, ...]]
) -> dict[str, Any]:
    """Run a ``%%spmd`` cell on this rank inside ``record_rank``; names persist in the engine."""
    ns = _user_ns()
    bind_imports(ns, imports)
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)

    def body() -> Any:
        from .cells import run_compiled, split_cell

        return run_compiled(*split_cell(source, filename), ns)

    return _recorded(body, values, filename)


def run_fn(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    env: dict[str, Any],
    values: str | int,
) -> dict[str, Any]:
    """Run ``sv.run``'s function on this rank; its globals are this rank's names plus what the
    client resolved (imports by name, plain constants, helper functions)."""
    ns = _user_ns()
    for filename, lines in env.get("lines", {}).items():
        if not linecache.getlines(filename):
            linecache.cache[filename] = (sum(map(len, lines)), None, list(lines), filename)
    g = dict(ns)
    bind_imports(g, env.get("imports", {}))
    g.update(env.get("constants", {}))
    for name, f in env.get("functions", {}).items():
        g[name] = _rebind(f, g)
    fn = _rebind(fn, g) if isinstance(fn, types.FunctionType) else fn
    seen: set[int] = set()
    for f in (fn, *(g[name] for name in env.get("functions", {}))):
        _rebind_closure(f, g, seen)
    filename = fn.__code__.co_filename if isinstance(fn, types.FunctionType) else ""
    return _recorded(lambda: fn(*args, **kwargs), values, filename)


def _rebind_closure(f: Any, g: dict[str, Any], seen: set[int]) -> None:
    """The functions ``f`` holds in its closure (a helper or a lambda it was given), sent by code
    as ``f`` was: bound to the same globals, so that they see the client's imports too."""
    if not isinstance(f, types.FunctionType) or id(f) in seen or not f.__closure__:
        return
    seen.add(id(f))
    for cell in f.__closure__:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, types.FunctionType) and value.__module__ == "__main__":
            value = _rebind(value, g)
            cell.cell_contents = value
        _rebind_closure(value, g, seen)


def _rebind(f: Any, g: dict[str, Any]) -> Any:
    if not isinstance(f, types.FunctionType):
        return f
    new = types.FunctionType(f.__code__, g, f.__name__, f.__defaults__, f.__closure__)
    new.__kwdefaults__ = f.__kwdefaults__
    new.__qualname__ = f.__qualname__
    return new


def _recorded(body: Callable[[], Any], values: str | int, filename: str) -> dict[str, Any]:
    st = _require_state()
    st.displayed = set()
    first_show = st.next_show
    publish = _publisher()
    flight = Flight(publish)
    watch = SpinWatch(flight, st.spin_limit, st.on_spin == "interrupt", filename, publish)
    error = None
    value: Any = None
    trace: Trace | None = None
    t0 = time.perf_counter()
    st.running = True  # sv.show, through this rank's backend, now gathers for the client
    try:
        try:
            with watch, record_rank(st.rank, st.world_size, values, on_collective=flight) as trace:
                value = body()
        finally:
            st.running = False
            if watch.interrupted is not None:
                _absorb_interrupt()  # one sent just as the body finished lands here, not later
    except BaseException as e:
        from ..capture.explain import explain_rank_error

        error = describe_error(explain_rank_error(e), filename)
        if watch.interrupted is not None and isinstance(e, KeyboardInterrupt):
            error["spin"] = watch.interrupted
    elapsed = time.perf_counter() - t0
    value = portable(value)
    _flush_stdio()
    shown = set(range(first_show, st.next_show)) | st.displayed | _marker_ids(value)
    return {
        "rank": st.rank,
        "error": error,
        "value": value,
        "trace": trace_bytes(trace) if trace is not None else None,
        "flight": flight.summary(),
        "spin": watch.report,
        "shows": {i: st.shows[i] for i in sorted(shown) if i in st.shows},
        "seconds": elapsed,
    }


def _absorb_interrupt() -> None:
    """Give a KeyboardInterrupt already sent to this thread the chance to be raised here."""
    time.sleep(0.01)  # the signal handler runs once the sleep ends (or is cut short by it)


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def describe_error(e: BaseException, filename: str) -> dict[str, Any]:
    """The rank's exception as text, starting at the user's code rather than in shardviz."""
    te = traceback.TracebackException.from_exception(e)
    frames = [f for f in te.stack if not _plumbing(f.filename)]
    te.stack = traceback.StackSummary.from_list(frames or list(te.stack))
    text = "".join(te.format())
    msg = str(e)
    distributed = isinstance(e, getattr(dist, "DistError", ())) or any(
        word in msg for word in ("gloo", "NCCL", "Timed out", "Connection closed", "Connection reset")
    )
    return {"ename": type(e).__name__, "evalue": msg, "traceback": text, "distributed": distributed}


def _plumbing(filename: str) -> bool:
    """Frames the user did not write and cannot act on: shardviz's own, torch's dispatch layers."""
    return filename.startswith((_OWN_DIR, *_torch.TRACEBACK_PLUMBING)) or filename.endswith("contextlib.py")


def portable(value: Any) -> Any:
    """A value as the client may see it: DTensor → its local shard, tensors on the CPU, markers as
    plain dicts; anything that cannot travel becomes its repr."""
    if isinstance(value, ShowMarker):
        return {SHOW_KEY: value.id}
    if _torch.is_dtensor(value):
        value = value.to_local()
    from ..capture import adapters

    local = adapters.local_of(value)  # a framework's sharded tensor (ShardTensor): its shard too
    if local is not None:
        value = local
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(portable(v) for v in value)
    if isinstance(value, list):
        return [portable(v) for v in value]
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    try:
        pickle.dumps(value)
    except Exception:
        return f"<unpicklable {type(value).__name__}: {value!r:.200}>"
    return value


def _marker_ids(value: Any) -> set[int]:
    if isinstance(value, dict):
        if set(value) == {SHOW_KEY}:
            return {int(value[SHOW_KEY])}
        return set().union(*(_marker_ids(v) for v in value.values())) if value else set()
    if isinstance(value, tuple | list):
        return set().union(*(_marker_ids(v) for v in value)) if value else set()
    return set()


def trace_bytes(trace: Trace) -> bytes:
    """The trace as the bytes of ``trace.save``: JSON and ``.npy``, no pickle."""
    with tempfile.TemporaryDirectory(prefix="shardviz-") as d:
        return trace.save(Path(d) / "rank.svtrace").read_bytes()
