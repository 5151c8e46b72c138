"""Where a rank is, published as it runs: which collective it enters (the flight recorder), and
its stack when it runs Python past the spin limit (the spin watch)."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from ...capture import torch as _torch
from ...data.events import Source

FLIGHT_KEY = "shardviz_flight"
SPIN_KEY = "shardviz_spin"
SPIN_ACTIONS = ("warn", "interrupt")

# shardviz's own folder: frames under it are plumbing to the user.
OWN_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


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
        own = [i for i, f in enumerate(frames) if f.filename.startswith(OWN_DIR)]
        start = own[0] + 1 if own else 0
        while start < len(frames) and frames[start].filename.startswith(OWN_DIR):
            start += 1
    user = [f for f in frames[start:] if not plumbing(f.filename)] or list(frames[start:])
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


def publisher() -> Callable[[dict[str, Any]], None] | None:
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


def plumbing(filename: str) -> bool:
    """Frames the user did not write and cannot act on: shardviz's own, torch's dispatch layers."""
    return filename.startswith((OWN_DIR, *_torch.TRACEBACK_PLUMBING)) or filename.endswith("contextlib.py")
