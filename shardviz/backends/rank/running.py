"""Running code on a rank: a ``%%spmd`` cell or ``sv.run``'s function, with the notebook's names,
recorded, watched, and sent back as plain data."""

from __future__ import annotations

import importlib
import linecache
import pickle
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...capture import torch as _torch
from ...capture.job import record_rank
from ...data.trace import Trace
from . import state
from .shows import SHOW_KEY, ShowMarker
from .watch import Flight, SpinWatch, plumbing, publisher


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
        from ..cells import run_compiled, split_cell

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
    st = state.require()
    st.displayed = set()
    first_show = st.next_show
    publish = publisher()
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
        from ...capture.explain import explain_rank_error

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
    frames = [f for f in te.stack if not plumbing(f.filename)]
    te.stack = traceback.StackSummary.from_list(frames or list(te.stack))
    text = "".join(te.format())
    msg = str(e)
    distributed = isinstance(e, getattr(dist, "DistError", ())) or any(
        word in msg for word in ("gloo", "NCCL", "Timed out", "Connection closed", "Connection reset")
    )
    return {"ename": type(e).__name__, "evalue": msg, "traceback": text, "distributed": distributed}


def portable(value: Any) -> Any:
    """A value as the client may see it: DTensor → its local shard, tensors on the CPU, markers as
    plain dicts; anything that cannot travel becomes its repr."""
    if isinstance(value, ShowMarker):
        return {SHOW_KEY: value.id}
    if _torch.is_dtensor(value):
        value = value.to_local()
    from ...capture import adapters

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
