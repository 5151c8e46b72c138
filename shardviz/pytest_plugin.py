"""``pytest --shardviz-traces DIR``: a trace and an offline player of every failing test that ran
under torch's LocalTensorMode (PyTorch's own DTensor tests through ``create_local_tensor_test_class``,
or a project's built the same way).

While a test runs, the outermost LocalTensorMode it enters (one shardviz did not enter itself) gets
a passive recorder on top: every op runs exactly as it would without shardviz, and collectives,
redistributes and DTensor ops are noted. When the test fails, ``DIR/<test id>.svtrace``
(``sv.load``) and ``DIR/<test id>.html`` (the player, no network) are written; a passing test,
and a failing one that recorded no event, leave nothing. A test that enters such a mode several
times gets ``<test id>.2.svtrace`` and so on.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .capture import torch as _torch
from .capture.recorder import Recorder
from .data.trace import DEFAULT_VALUE_BUDGET, Trace

_UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]+")


def file_stem(nodeid: str) -> str:
    """A test id as a file name: ``tests/test_a.py::TestX::test_y[1]`` becomes
    ``tests.test_a.py--TestX--test_y-1``; very long ids end in a hash of the whole id."""
    stem = _UNSAFE.sub("-", nodeid.replace("::", "--").replace("/", ".")).strip("-")
    if len(stem) > 150:
        stem = f"{stem[:130]}-{hashlib.sha1(nodeid.encode()).hexdigest()[:12]}"
    return stem


class _Recording:
    """One LocalTensorMode entry of a test, recorded until the mode is left."""

    def __init__(self, mode: Any) -> None:
        world = len(mode.ranks)
        self.trace = Trace(world, "local", DEFAULT_VALUE_BUDGET)
        self.recorder = Recorder(self.trace, world, DEFAULT_VALUE_BUDGET, passive=True)
        self.stack = contextlib.ExitStack()
        self.mode = mode

    def start(self) -> None:
        self.stack.enter_context(_torch.tracking_meshes())  # names the mesh dims of raw dist calls
        self.recorder.__enter__()

    def stop(self, exc: tuple[Any, ...]) -> None:
        try:
            self.recorder.__exit__(*exc)
        finally:
            self.stack.close()
            if exc and exc[0] is not None:
                self.trace.complete = False
            self.recorder.finish()


class TracesOfFailures:
    """The plugin object ``_shardviz_pytest`` registers when ``--shardviz-traces`` is given."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.saved: list[Path] = []
        self.errors: list[str] = []
        self._recordings: list[_Recording] = []
        self._failed = False

    def _enter(self, mode: Any) -> None:
        try:
            rec = _Recording(mode)
            rec.start()
        except Exception as e:  # a recording that cannot start must not fail the test it watches
            self.errors.append(f"a LocalTensorMode over {len(mode.ranks)} ranks not recorded: {e}")
            return
        self._recordings.append(rec)

    def _exit(self, mode: Any, exc: tuple[Any, ...]) -> None:
        if self._recordings and self._recordings[-1].mode is mode:  # outermost modes do not nest
            self._recordings[-1].stop(exc)

    @contextlib.contextmanager
    def _watching(self) -> Iterator[None]:
        self._recordings, self._failed = [], False
        with _torch.watching_local_modes(self._enter, self._exit):
            yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        with self._watching():
            yield
        if self._failed and self._recordings:
            self._save(item.nodeid)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
        outcome: Any = yield
        if outcome.get_result().failed:
            self._failed = True

    def _save(self, nodeid: str) -> None:
        from .show import export_html

        recorded = [rec for rec in self._recordings if rec.trace.events]
        if not recorded:
            self.errors.append(f"{nodeid}: ran under LocalTensorMode but recorded no event; nothing saved")
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = file_stem(nodeid)
        for i, rec in enumerate(recorded):
            name = stem if i == 0 else f"{stem}.{i + 1}"
            path = self.folder / f"{name}.svtrace"
            rec.trace.save(path)
            self.saved.append(path)
            try:
                export_html(rec.trace, self.folder / f"{name}.html")
            except Exception as e:  # the trace is saved; a view that cannot draw it must not hide it
                self.errors.append(f"{name}.html not written: {type(e).__name__}: {e}")

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.saved and not self.errors:
            return
        terminalreporter.write_sep("-", "shardviz traces of failing tests")
        for path in self.saved:
            terminalreporter.write_line(f"{path}  (sv.load; {path.with_suffix('.html').name}: the player)")
        for line in self.errors:
            terminalreporter.write_line(line)
