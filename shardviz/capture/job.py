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
import os
import select
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from ..data.events import Source
from ..data.load import rank_path
from ..data.trace import DEFAULT_VALUE_BUDGET, Trace
from .recorder import Recorder, ValueBudget

ENV_DIR = "SHARDVIZ_TRACE_DIR"


class SignalWarning(UserWarning):
    """``sv.record_job`` cannot write this rank's file on SIGTERM as it otherwise does; the
    message says why and what is still written."""


def rank_and_world() -> tuple[int, int]:
    """This process's rank and world size: its process group's, a launcher's variables, else (0, 1)."""
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


def backend_name() -> str:
    """The process group's backend (``gloo``, ``nccl``), or ``job`` before there is one."""
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


@contextlib.contextmanager
def record_rank(
    rank: int,
    world_size: int,
    values: str | int = DEFAULT_VALUE_BUDGET,
    on_collective: Callable[..., None] | None = None,
) -> Iterator[Trace]:
    """Record what one real process communicates: its own buffers and its own groups.

    Used on each rank of a real backend; the client merges the ranks' traces into one.
    ``on_collective`` is the Recorder's hook, called before and after each collective.
    """
    ValueBudget(values)
    trace = Trace(world_size, "rank", values)
    recorder = Recorder(trace, world_size, values, rank=rank, on_collective=on_collective)
    try:
        with recorder:
            yield trace
    except BaseException:
        trace.complete = False
        raise
    finally:
        recorder.finish()


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
        around: Callable[[JobRecording], AbstractContextManager[Any]] | None = None,
    ) -> None:
        ValueBudget(values)  # a bad policy fails here, before anything is entered
        self.folder = Path(folder) if folder is not None else None
        self.values = values
        self.flush_every = float(flush_every)
        self.signals = signals
        self.rank, self.world_size = rank_and_world()
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
        self._around = around  # entered by start, left when start's work is given back
        self._entered_around: AbstractContextManager[Any] | None = None
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
            if self._around is not None:
                self._entered_around = self._around(self)
                self._entered_around.__enter__()
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
        """Everything ``start`` installed: handlers, hooks, what ``around`` entered (the rank's
        backend) — the background thread is gone, so the wakeup sockets can close."""
        try:
            self._restore_signals(close=True)
            self._restore_hooks()
        finally:
            entered, self._entered_around = self._entered_around, None
            if entered is not None:
                entered.__exit__(None, None, None)

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
        trace.meta = {**self._meta, "backend": backend_name(), "updated": time.time(), "status": status}
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
