"""Stopping the threads of a simulated run at once: on Ctrl-C the notebook's thread gets the
``KeyboardInterrupt``, and the rank threads have to be told.

A thread running Python gets an exception raised in it at its next line
(``PyThreadState_SetAsyncExc``); a thread in ``time.sleep`` would get it only when the sleep
ends, so while a run lasts ``time.sleep`` in one of its threads waits on the run's stop event
instead, and returns as soon as the run stops. A call Python cannot interrupt (a long torch op,
a lock, I/O) ends first; the run then says which thread is still in one.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any


class Stop:
    """One run's stop: set once (Ctrl-C, a failed rank); ``error()`` is what a sleeping thread of
    the run raises then."""

    def __init__(self, error: Callable[[], BaseException]) -> None:
        self.event = threading.Event()
        self.error = error

    def set(self) -> None:
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()


_enrolled: dict[int, Stop] = {}  # thread ident -> the stop of the run it works for
_lock = threading.Lock()
_patches = 0
_original_sleep = time.sleep


def _sleep(seconds: Any) -> None:
    stop = _enrolled.get(threading.get_ident())
    if stop is None or not isinstance(seconds, int | float) or seconds < 0:
        _original_sleep(seconds)
        return
    if stop.event.wait(seconds):
        raise stop.error()


@contextlib.contextmanager
def stoppable_sleeps() -> Iterator[None]:
    """While it lasts, ``time.sleep`` in an enrolled thread ends when its run stops (other threads
    sleep as before). Code that took ``sleep`` itself (``from time import sleep``) before is not
    reached: its sleep ends when it ends."""
    global _patches
    with _lock:
        _patches += 1
        if _patches == 1:
            time.sleep = _sleep
    try:
        yield
    finally:
        with _lock:
            _patches -= 1
            if _patches == 0:
                time.sleep = _original_sleep


def enrol(stop: Stop) -> None:
    """The calling thread works for the run that ``stop`` stops."""
    _enrolled[threading.get_ident()] = stop


def leave() -> None:
    _enrolled.pop(threading.get_ident(), None)


def raise_in(ident: int, error: type[BaseException]) -> bool:
    """Raise ``error`` in the thread ``ident`` at its next line of Python; whether it was found."""
    return ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(error)) == 1


def clear_pending(ident: int) -> None:
    """Take back an exception ``raise_in`` left for the thread that it has not raised yet."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.c_void_p(0))


def wait_ended(threads: Iterable[threading.Thread], deadline: float | None = None) -> bool:
    """Wait until every started thread of ``threads`` has ended (or ``time.monotonic()`` passes
    ``deadline``); whether they all have. It polls instead of ``Thread.join``: on Python 3.11 a
    Ctrl-C that interrupts a join marks the joined thread as ended while it still runs."""
    for thread in threads:
        while thread.ident is not None and thread.is_alive():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            _original_sleep(0.01)
    return True
