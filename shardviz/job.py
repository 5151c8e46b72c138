"""Recording a real job — torchrun, Slurm, any launcher — one trace file per rank.

A training script adds two lines::

    import shardviz as sv
    with sv.record_job("traces/run1"):      # or no path: $SHARDVIZ_TRACE_DIR, else nothing is recorded
        train()

Each rank records what it communicates (its own buffers and groups, the value policy of
``sv.record``) and writes ``rank00003.svtrace`` into the folder — the format of ``trace.save``
(JSON and ``.npy``, no pickle), written to a temporary file and renamed, so a reader never sees half
a file. ``sv.load(folder)`` merges the ranks into one trace.

A rank that dies or hangs still leaves a readable file: a background thread rewrites it while the
rank runs (every ``flush_every`` seconds at most, and only when something changed), and the rank
writes it once more when the block ends — normally, on an exception, on SIGTERM (what torchrun
sends the survivors when a peer dies; handled even while the rank is stuck inside gloo or NCCL),
or at interpreter exit. Each file says how its rank ended (``trace.meta["status"]``), so the merge
can tell which rank stopped where.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import re
import select
import signal
import socket
import stat
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import TraceFileError
from .limits import Limits, over, read_head, resolve, short
from .trace import DEFAULT_VALUE_BUDGET, Source, Trace

ENV_DIR = "SHARDVIZ_TRACE_DIR"
SUFFIX = ".svtrace"
_RANK_FILE = re.compile(r"^rank(\d+)\.svtrace$")


class PartialTraceWarning(UserWarning):
    """A job's ranks did not all record the same whole run: the merged trace is the common prefix;
    ``trace.notes`` says which rank stopped where."""


class SignalWarning(UserWarning):
    """``sv.record_job`` cannot write this rank's file on SIGTERM as it otherwise does; the
    message says why and what is still written."""


def rank_path(folder: str | Path, rank: int) -> Path:
    """Where rank ``rank`` of a job writes its trace: ``folder/rank00003.svtrace``."""
    return Path(folder) / f"rank{rank:05d}{SUFFIX}"


def _rank_and_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for rank_var, size_var in (
        ("SLURM_PROCID", "SLURM_NTASKS"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


def _backend_name() -> str:
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            return str(dist.get_backend())
    except Exception:
        pass
    return "job"


def _run_id() -> str:
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        if os.environ.get(var):
            return f"{var}={os.environ[var]}"
    return ""


class JobRecording:
    """One rank's recording of a job (what ``sv.record_job`` returns): a context manager, or
    started by the call itself and written at exit. ``.trace`` is the trace once it has stopped;
    ``.path`` the file; ``.enabled`` is False when no folder was given and ``$SHARDVIZ_TRACE_DIR``
    is unset (then nothing is recorded and nothing written)."""

    def __init__(
        self,
        folder: str | Path | None,
        values: str | int = DEFAULT_VALUE_BUDGET,
        flush_every: float = 1.0,
        signals: bool = True,
    ) -> None:
        from .recorder import ValueBudget

        ValueBudget(values)  # a bad policy fails here, before anything is entered
        self.folder = Path(folder) if folder is not None else None
        self.values = values
        self.flush_every = float(flush_every)
        self.signals = signals
        self.rank, self.world_size = _rank_and_world()
        self.path = rank_path(self.folder, self.rank) if self.folder is not None else None
        self.trace: Trace | None = None
        self._recorder: Any = None
        self._lock = threading.RLock()
        self._final = False  # a last write happened: no background write may replace it
        self._stopped = False  # stop() ran: everything start() installed is given back
        self._signal = ""  # "SIGTERM" once one came (the process may live on: a handler of its own)
        self._ended_by_signal = False  # the program's own SIGTERM handler raised (sys.exit)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending: dict[str, Any] | None = None
        self._entered = 0
        self._version = 0  # bumped as each collective is entered and left
        self._written: tuple[int, int] = (-1, -1)  # the _progress() the file shows
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._wake_given_back = False
        self._forward_fd: int | None = None  # the wakeup fd someone else (asyncio) had set
        self._prev_term: Any = None
        self._prev_hook: Any = None
        self._error: str | None = None
        self._backend: Any = None  # the RankBackend installed, while it is
        self._prev_backend: Any = None
        self._meta = {
            "rank": self.rank,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "run_id": _run_id(),
            "started": time.time(),
            "argv": list(sys.argv[:8]),
        }

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    # --- starting and stopping ---------------------------------------------------------------

    def start(self) -> JobRecording:
        if not self.enabled or self._recorder is not None:
            return self
        from .recorder import Recorder

        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # an earlier run's file must not pass for this one's
        trace = Trace(self.world_size, "rank", self.values)
        # Snapshots are copied when taken, never aliased: the background writer reads them while
        # the program runs on and writes its own buffers.
        rec = Recorder(
            trace,
            self.world_size,
            self.values,
            rank=self.rank,
            on_collective=self._on_collective,
            alias_buffers=False,
        )
        rec.__enter__()
        self._recorder = rec
        try:
            self._use_rank_backend()
            if self.signals:
                self._install_signals()
            self._prev_hook = sys.excepthook
            sys.excepthook = self._excepthook
            atexit.register(self._at_exit)
            self._write_partial("running")
            self._thread = threading.Thread(target=self._watch, name="shardviz-record-job", daemon=True)
            self._thread.start()
        except BaseException:
            # Nothing may stay behind (the dispatch mode, the backend, the handlers): a script that
            # goes on without its recording runs as it would without shardviz.
            self._undo_start()
            raise
        return self

    def _undo_start(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.ident is not None:
            self._thread.join(timeout=30)
        rec, self._recorder = self._recorder, None
        self._final = self._stopped = True
        try:
            rec.__exit__(None, None, None)
        finally:
            self._give_back()

    def stop(self, error: BaseException | None = None) -> Trace | None:
        """Stop recording and write this rank's file for the last time; returns the trace.

        Everything ``start`` installed is given back here, also when a SIGTERM came before and
        the process lived on (a handler of its own): the file is then rewritten with all that was
        recorded, its status noting the signal."""
        if self._recorder is None or self._stopped:
            return self.trace
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        rec = self._recorder
        with self._lock:
            if self._stopped:
                return self.trace
            self._stopped = True
            try:
                rec.__exit__(type(error) if error else None, error, None)
            finally:
                try:
                    complete = error is None and rec.all_closed()
                    if complete:
                        rec.finish()
                        trace = rec.trace
                    else:
                        trace = self._snapshot()
                    how = "error" if error is not None or self._error else "finished"
                    if isinstance(error, SystemExit):
                        how = "exit"
                    if self._ended_by_signal:
                        how = "signal"  # the program's SIGTERM handler raised (sys.exit)
                    self.trace = self._finish_trace(trace, how, error, sig=self._signal)
                    self._write(self.trace)
                    self._final = True
                finally:
                    self._give_back()
        return self.trace

    def _give_back(self) -> None:
        """Everything ``start`` installed: handlers, hooks, the backend (the background thread is
        gone, so the wakeup sockets can close)."""
        try:
            self._restore_signals(close=True)
            self._restore_hooks()
        finally:
            self._restore_backend()

    def _use_rank_backend(self) -> None:
        """``sv.per_rank`` and ``sv.device_type`` inside the job mean this rank, as in a ``%%spmd``
        cell on a real backend (the code's own ``dist`` calls need nothing from shardviz)."""
        from . import backends
        from .backends.rank import RankBackend

        self._backend = RankBackend(_backend_name(), self.world_size, self.rank)
        self._prev_backend = backends.install(self._backend)

    def _restore_backend(self) -> None:
        from . import backends

        if self._backend is not None and backends.peek() is self._backend:
            backends.install(self._prev_backend)
        self._backend = None

    def __enter__(self) -> JobRecording:
        return self.start()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.stop(exc)

    def __repr__(self) -> str:
        where = str(self.path) if self.path else f"off (no folder and ${ENV_DIR} unset)"
        return f"<shardviz job recording rank {self.rank}/{self.world_size}: {where}>"

    # --- what the recorder tells us --------------------------------------------------------------

    def _on_collective(
        self, stage: str, op: str, groups: tuple[tuple[int, ...], ...], source: Source | None
    ) -> None:
        if stage == "enter":
            self._entered += 1
            self._pending = {
                "n": self._entered,
                "op": op,
                "group": list(groups[0]) if groups else [],
                "line": source.line if source else None,
                "text": source.text if source else "",
                "since": time.time(),
            }
        else:
            self._pending = None
        self._version += 1

    # --- writing ---------------------------------------------------------------------------------

    def _snapshot(self) -> Trace:
        """The events recorded so far, as ``Recorder.finish`` would number them, without touching
        the recorder: every finished event up to the first one still open (a collective a rank is
        blocked in, the redistribute around it)."""
        rec = self._recorder
        t = Trace(self.world_size, "rank", self.values)
        t.events, t.values_dropped_from = rec.partial()
        t.meshes = list(rec.trace.meshes)
        t.complete = False
        return t

    def _finish_trace(
        self, trace: Trace, how: str, error: BaseException | None = None, sig: str = ""
    ) -> Trace:
        status: dict[str, Any] = {
            "how": how,
            "events": len(trace.events),
            "collectives_entered": self._entered,
        }
        if isinstance(error, SystemExit):
            status["exit_code"] = error.code if isinstance(error.code, int | str | None) else str(error.code)
        elif error is not None:
            status["error"] = (
                f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
            )
        elif self._error:
            status["error"] = self._error
        if sig:
            status["signal"] = sig
        if self._pending is not None:
            status["in_collective"] = dict(self._pending)
        trace.backend = "rank"
        trace.meta = {**self._meta, "backend": _backend_name(), "updated": time.time(), "status": status}
        if how != "finished":
            trace.complete = False
        return trace

    def _write(self, trace: Trace) -> None:
        assert self.path is not None
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            trace.save(tmp)
            os.replace(tmp, self.path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def _progress(self) -> tuple[int, int]:
        """What the file would show changes with this: collectives entered and left, events the
        recorder completed (a collective's own event is complete only after it was left)."""
        return self._version, self._recorder.ended

    def _write_partial(self, how: str, sig: str = "") -> None:
        with self._lock:
            if self._final:
                return
            progress = self._progress()
            trace = self._finish_trace(self._snapshot(), how, sig=sig)
            self._write(trace)
            self._written = progress

    def _watch(self) -> None:
        """The background writer: rewrites the file when something changed (at most every
        ``flush_every`` seconds, slower when writing takes long), and on SIGTERM at once."""
        interval = self.flush_every
        last = time.monotonic()
        wake = self._wake[0] if self._wake else None
        while not self._stop.is_set():
            timeout = max(0.05, min(0.5, interval - (time.monotonic() - last)))
            got = b""
            if wake is not None:
                try:
                    ready, _, _ = select.select([wake], [], [], timeout)
                    if ready:
                        got = wake.recv(64)
                except BlockingIOError:
                    pass
                except (OSError, ValueError):
                    wake = None  # closed under us: wait on the stop event from now on
                    continue
            else:
                self._stop.wait(timeout)
            if self._stop.is_set():
                return
            if got:
                self._forward(got)
            if got and signal.SIGTERM in got:
                self._terminated_from_thread()
                continue
            if self._progress() != self._written and time.monotonic() - last >= interval:
                t0 = time.monotonic()
                with contextlib.suppress(Exception):
                    self._write_partial("running")
                last = time.monotonic()
                interval = max(self.flush_every, 5 * (last - t0))

    # --- signals, uncaught errors, exit ----------------------------------------------------------
    #
    # SIGTERM is handled twice: by a Python handler (the main thread, as soon as it runs Python
    # again) and by the background thread, which learns of it through the signal wakeup fd even
    # while the main thread is stuck inside gloo or NCCL. Only one process-wide wakeup fd exists;
    # when someone else holds it (asyncio's event loop does), the background thread takes it and
    # passes every byte on to theirs, so both keep working. One set after the recording started
    # replaces ours unseen (only the main thread may ask): SIGTERM then waits for the main thread.

    def _install_signals(self) -> None:
        lost = "a SIGTERM (what torchrun sends the other ranks when one dies) will not write this rank's file"
        still = (
            f"it is still written while the rank runs (at most every {self.flush_every:g} s), at the "
            "end of the block, on an exception and at exit"
        )
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                f"sv.record_job was started outside the main thread, where Python cannot set signal "
                f"handlers: {lost}; {still}. Start it in the main thread to have SIGTERM handled.",
                SignalWarning,
                stacklevel=4,
            )
            return
        prev = signal.getsignal(signal.SIGTERM)
        if prev is None:
            warnings.warn(
                f"SIGTERM has a handler installed outside Python, which shardviz leaves alone: {lost}; "
                f"{still}.",
                SignalWarning,
                stacklevel=4,
            )
            return
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        try:
            old = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError) as e:
            r.close()
            w.close()
            warnings.warn(
                f"signal.set_wakeup_fd failed ({e}): a SIGTERM that comes while this rank is stuck "
                "inside a collective (gloo, NCCL) writes its file only once the collective returns "
                f"or times out, if the process lives that long; {still}.",
                SignalWarning,
                stacklevel=4,
            )
        else:
            self._wake = (r, w)
            self._forward_fd = old if old >= 0 else None
        self._prev_term = prev
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _forward(self, got: bytes) -> None:
        """Pass the wakeup bytes on to whoever had the wakeup fd before (asyncio reads which
        signals came from them)."""
        if self._forward_fd is not None:
            with contextlib.suppress(OSError):
                os.write(self._forward_fd, got)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM in the main thread: write the file (how far this rank got), then do what the
        signal would have done. A handler of the program's own may keep the process alive: the
        recording then goes on, and ``stop`` gives everything back as usual."""
        prev = self._prev_term
        with self._lock:
            self._signal = "SIGTERM"
            if not self._final:
                self._error = None
                self.trace = self._finish_trace(self._snapshot(), "signal", sig="SIGTERM")
                self._write(self.trace)
                self._final = True
        self._restore_signals(close=False)  # the sockets stay open for the background thread
        if callable(prev):
            try:
                prev(signum, frame)
            except BaseException:
                self._ended_by_signal = True  # sys.exit() in the handler: the file says SIGTERM
                raise
        elif prev == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGTERM)  # the default handler is back: exit as it would

    def _terminated_from_thread(self) -> None:
        """SIGTERM seen by the background thread: the main thread may be blocked inside a
        collective for the whole process-group timeout, so write from here and, when SIGTERM had
        its default meaning, end the process as it would have."""
        with self._lock:
            self._signal = "SIGTERM"
            if self._final:
                return
            self.trace = self._finish_trace(self._snapshot(), "signal", sig="SIGTERM")
            self._write(self.trace)
            self._final = True
            if self._prev_term == signal.SIG_DFL:
                os._exit(128 + signal.SIGTERM)

    def _excepthook(self, exc_type: Any, exc: BaseException, tb: Any) -> None:
        if not self._final:
            self._error = f"{exc_type.__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        (self._prev_hook or sys.__excepthook__)(exc_type, exc, tb)

    def _at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()

    def _restore_hooks(self) -> None:
        """Give back the excepthook and the exit hook."""
        with contextlib.suppress(Exception):
            atexit.unregister(self._at_exit)
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_hook or sys.__excepthook__

    def _restore_signals(self, close: bool) -> None:
        """Give back the SIGTERM handler and the wakeup fd (main thread only); ``close`` the
        wakeup sockets once the background thread is gone."""
        if threading.current_thread() is threading.main_thread():
            if self._prev_term is not None and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, self._prev_term)
            if self._wake is not None and not self._wake_given_back:
                self._wake_given_back = True
                mine = self._wake[1].fileno()
                with contextlib.suppress(ValueError, OSError):
                    now = signal.set_wakeup_fd(-1 if self._forward_fd is None else self._forward_fd)
                    if now != mine:  # someone else set theirs since: it stays
                        signal.set_wakeup_fd(now)
        if close and self._wake is not None and self._wake_given_back:
            for s in self._wake:
                s.close()
            self._wake = None


def record_job(
    path: str | Path | None = None,
    *,
    values: str | int = DEFAULT_VALUE_BUDGET,
    flush_every: float = 1.0,
    signals: bool = True,
) -> JobRecording:
    """Record this rank of a real job (torchrun, Slurm, ...) into ``path/rankNNNNN.svtrace``.

    ``with sv.record_job("traces/run1"): train()`` — or ``sv.record_job()`` alone, which records
    from here to the end of the process. With no ``path`` the folder is ``$SHARDVIZ_TRACE_DIR``;
    when that is unset too, nothing is recorded (so the line can stay in a script). ``values`` is
    the value policy of ``sv.record`` (``"all"``, ``"none"`` or a byte budget per rank). The file is
    rewritten while the rank runs (at most every ``flush_every`` seconds) and when it ends — also on
    an exception, SIGTERM (``signals=False`` leaves SIGTERM alone) or exit — so a rank that died or
    hung leaves how far it got. Open the folder with ``sv.load(folder)``.
    """
    folder = path if path is not None else os.environ.get(ENV_DIR) or None
    return JobRecording(folder, values=values, flush_every=flush_every, signals=signals).start()


# --- reading a job's folder ----------------------------------------------------------------------


def rank_files(folder: str | Path) -> dict[int, Path]:
    """The per-rank trace files of a job folder, by the rank in their names."""
    out = {}
    for p in Path(folder).iterdir():
        m = _RANK_FILE.match(p.name)
        if m and len(m.group(1)) <= 12:
            out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def _progress(total: int, what: str) -> Callable[[int], None]:
    """A status line on stderr for slow loads: shown once loading takes over half a second."""
    t0 = time.perf_counter()
    shown = [0.0]

    def update(done: int) -> None:
        now = time.perf_counter()
        if now - t0 < 0.5 or (now - shown[0] < 0.5 and done < total):
            return
        shown[0] = now
        end = "\n" if done >= total else "\r"
        print(f"shardviz: loading {what}: {done}/{total}", end=end, file=sys.stderr, flush=True)

    return update


def _job_meta(path: Path, t: Trace, rank: int, limits: Limits) -> tuple[int, int]:
    """A rank file's own rank and world size (``trace.meta``, written by ``record_job``), checked:
    the merge builds per-rank lists from them."""

    def bad(name: str, expected: str) -> TraceFileError:
        return TraceFileError(
            f"{path}: field meta.{name} of trace.json: expected {expected}, got {short(t.meta.get(name))}"
        )

    r = t.meta.get("rank", rank)
    if type(r) is not int or r < 0:
        raise bad("rank", "the rank that wrote the file (an integer >= 0)")
    if r >= limits.world_size:
        raise over(str(path), "its rank", r, "world_size", limits)
    world = t.meta.get("world_size", t.world_size)
    if type(world) is not int or world < 1:
        raise bad("world_size", "the job's world size (an integer >= 1)")
    if world != t.world_size:
        raise bad("world_size", f"the trace's world_size, {t.world_size}")
    for name, types in (("run_id", (str,)), ("started", (int, float)), ("backend", (str,))):
        if t.meta.get(name) is not None and type(t.meta[name]) not in types:
            raise bad(name, "a string" if types == (str,) else "a number")
    status = t.meta.get("status")
    if status is not None:
        pending = status.get("in_collective") if isinstance(status, dict) else None
        if not isinstance(status, dict) or not isinstance(status.get("how", ""), str):
            raise bad("status", 'how the rank ended ({"how": "finished", ...})')
        if pending is not None and not (
            isinstance(pending, dict)
            and isinstance(pending.get("group", []), list)
            and all(type(x) is int for x in pending.get("group", []))
            and (pending.get("line") is None or type(pending.get("line")) is int)
        ):
            raise bad("status", 'the collective the rank was in ({"op", "group": [ranks], "line"})')
    return r, world


def load_job(folder: str | Path, progress: bool = True, *, limits: Limits | None = None) -> Trace:
    """Merge a job folder's per-rank traces into one trace.

    When the ranks did not all record the same whole run (a rank died, hung or diverged), the
    result is the common prefix, ``complete`` is False, ``trace.notes`` says which rank stopped
    where, ``trace.meta["start_event"]`` is the last event they shared (the player starts there),
    and a ``PartialTraceWarning`` repeats the notes. Two files claiming one rank, and files of a
    rank beyond the world size, are named in the notes and left out.
    """
    from .merge import merge_partial
    from .trace import load

    lim = limits if limits is not None else resolve()
    files = rank_files(folder)
    if not files:
        raise TraceFileError(f"{folder} holds no rank*.svtrace files (written by sv.record_job)")
    update = _progress(len(files), f"{len(files)} rank traces") if progress else (lambda done: None)
    traces: dict[int, Trace] = {}
    sizes: dict[int, set[Path]] = {}
    claimed: dict[int, list[Path]] = {}
    for i, (rank, f) in enumerate(files.items()):
        t = load(f, limits=lim)
        r, world = _job_meta(f, t, rank, lim)
        claimed.setdefault(r, []).append(f)
        if r not in traces:
            traces[r] = t
            sizes.setdefault(world, set()).add(f)
        update(i + 1)
    skipped = [
        f"rank {r} (claimed by {len(fs)} files: {', '.join(f.name for f in fs)}; read {fs[0].name})"
        for r, fs in sorted(claimed.items())
        if len(fs) > 1
    ]
    traces, other_runs = _one_run(traces)
    skipped += other_runs
    worlds = sorted({traces[r].world_size for r in traces})
    if len(worlds) != 1:
        by = "; ".join(f"{w}: {', '.join(sorted(f.name for f in sizes[w]))}" for w in worlds)
        raise TraceFileError(f"{folder}: the rank files report different world sizes ({by})")
    world_size = worlds[0]
    for r in [r for r in traces if r >= world_size]:
        skipped.append(f"rank {r} (beyond the world size {world_size})")
        del traces[r]
    if not traces:
        raise TraceFileError(
            f"{folder}: no rank file is of a rank within the job's world size ({world_size}); "
            + "ignored: "
            + ", ".join(skipped)
        )
    first = traces[min(traces)]
    backend = str(first.meta.get("backend") or "job")
    trace = merge_partial(traces, backend, first.values, world_size=world_size)
    if skipped:
        trace.notes.append("ignored files: " + ", ".join(skipped))
    if trace.notes:
        warnings.warn(
            f"{folder}: partial trace —\n  " + "\n  ".join(trace.notes), PartialTraceWarning, stacklevel=3
        )
    return trace


def _one_run(traces: dict[int, Trace]) -> tuple[dict[int, Trace], list[str]]:
    """Files from several runs in one folder: keep the run of the most recently started file."""
    runs = {(t.meta.get("run_id") or "") for t in traces.values()}
    if len(runs) <= 1:
        return traces, []
    newest = max(traces.values(), key=lambda t: float(t.meta.get("started") or 0))
    keep = newest.meta.get("run_id") or ""
    kept = {r: t for r, t in traces.items() if (t.meta.get("run_id") or "") == keep}
    skipped = [
        f"rank {r} (of another run: {t.meta.get('run_id') or 'no run id'})"
        for r, t in traces.items()
        if r not in kept
    ]
    return kept, skipped


def load_path(
    path: str | Path,
    allow_pickle: bool = False,
    progress: bool = True,
    *,
    source_root: str | Path | None = None,
    limits: Limits | None = None,
) -> Trace:
    """What ``sv.load`` opens: a trace file, a job folder, a Flight Recorder dump or a folder of
    them (see ``shardviz.flight``), with every size capped (``limits``, default
    ``shardviz.limits.resolve()``). ``source_root`` is where Flight Recorder stacks' source lines
    may be read from (nowhere without it)."""
    from . import flight
    from .trace import load

    lim = limits if limits is not None else resolve()
    p = Path(path)
    if p.is_dir():
        if rank_files(p):
            return load_job(p, progress=progress, limits=lim)
        if flight.dump_candidates(p):
            return flight.load(
                p, allow_pickle=allow_pickle, progress=progress, source_root=source_root, limits=lim
            )
        raise TraceFileError(
            f"{p} holds neither rank*.svtrace files (sv.record_job) nor Flight Recorder dumps"
        )
    if not p.exists():
        raise FileNotFoundError(errno.ENOENT, "no such file or folder", str(p))
    if not stat.S_ISREG(p.stat().st_mode):
        raise TraceFileError(f"{p} is not a regular file (a device or a pipe): not a trace or a dump")
    head = read_head(p, 4)
    if head[:2] == b"PK":
        return load(p, limits=lim)
    if flight.looks_like_dump(head):
        return flight.load(
            [p], allow_pickle=allow_pickle, progress=progress, source_root=source_root, limits=lim
        )
    return load(p, limits=lim)  # its own clear error
