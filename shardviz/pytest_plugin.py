"""``pytest --shardviz-traces DIR``: a trace and an offline player of every failing test that ran
under torch's LocalTensorMode (PyTorch's own DTensor tests through ``create_local_tensor_test_class``,
or a project's built the same way).

While a test runs, the outermost LocalTensorMode it enters (one shardviz did not enter itself) gets
a passive recorder on top: every op runs exactly as it would without shardviz, and collectives,
redistributes and DTensor ops are noted. When the test fails, ``DIR/<test id>.<hash>.svtrace``
(``sv.load``) and ``DIR/<test id>.<hash>.html`` (the player, no network) are written: the test id
made a file name, and a hash of the whole id, so that ids that read alike (``a/b`` and ``a.b``)
never share a file. A passing test, and a failing one that recorded no event, leave nothing. A test
that enters such a mode several times gets ``<test id>.<hash>.2.svtrace`` and so on.

Files are written in a private folder inside DIR, then renamed into place: a link planted at a
file's name is replaced, never written through. An error of the plugin's own is a warning; the
tests run on with their own outcome.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .capture import torch as _torch
from .capture.recorder import Recorder
from .data.trace import DEFAULT_VALUE_BUDGET, Trace

_UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]+")
HASH_CHARS = 10


def file_stem(nodeid: str, hash_chars: int | None = None) -> str:
    """A test id as a file name: ``tests/test_a.py::TestX::test_y[1]`` becomes
    ``tests.test_a.py--TestX--test_y-1.<hash>``, the hash of the whole id keeping ids that read
    alike apart; at most 130 readable characters, ASCII only, never a path or a hidden file."""
    readable = _UNSAFE.sub("-", nodeid.replace("::", "--").replace("/", ".")).strip("-.")[:130]
    digest = hashlib.sha256(nodeid.encode("utf-8", "surrogatepass")).hexdigest()
    digest = digest[: HASH_CHARS if hash_chars is None else hash_chars]
    return f"{readable or 'test'}.{digest}"


class FileNames:
    """One file stem per test id for a session: distinct ids always get distinct stems (on the
    astronomically rare clash of two short hashes, the later id gets its whole hash)."""

    def __init__(self) -> None:
        self._owner: dict[str, str] = {}  # stem -> the test id it belongs to
        self._stem: dict[str, str] = {}

    def __call__(self, nodeid: str) -> str:
        stem = self._stem.get(nodeid)
        if stem is None:
            stem = file_stem(nodeid)
            if self._owner.get(stem, nodeid) != nodeid:
                stem = file_stem(nodeid, 64)
            self._owner[stem] = nodeid
            self._stem[nodeid] = stem
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


class ShardvizPluginWarning(pytest.PytestWarning):
    """The plugin could not record or save a test's trace; the test itself ran as it would."""


class TracesOfFailures:
    """The plugin object ``_shardviz_pytest`` registers when ``--shardviz-traces`` is given, with
    the folder it made ready (``created``: the folders it made, removed again if left empty)."""

    def __init__(self, folder: str | Path, created: list[Path] | None = None) -> None:
        self.folder = Path(folder)
        self.created = list(created or [])
        self.saved: list[Path] = []
        self.errors: list[str] = []
        self.names = FileNames()
        self._recordings: list[_Recording] = []
        self._failed = False

    def _warn(self, what: str, error: BaseException) -> None:
        """The plugin's own failure: a warning and a summary line, never the test's outcome."""
        text = f"shardviz --shardviz-traces: {what}: {type(error).__name__}: {error}"
        self.errors.append(text)
        warnings.warn(ShardvizPluginWarning(text), stacklevel=2)

    def _enter(self, mode: Any) -> None:
        try:
            rec = _Recording(mode)
            rec.start()
        except Exception as e:  # a recording that cannot start must not fail the test it watches
            self._warn(f"a LocalTensorMode over {len(mode.ranks)} ranks not recorded", e)
            return
        self._recordings.append(rec)

    def _exit(self, mode: Any, exc: tuple[Any, ...]) -> None:
        if self._recordings and self._recordings[-1].mode is mode:  # outermost modes do not nest
            try:
                self._recordings[-1].stop(exc)
            except Exception as e:
                self._recordings.pop()
                self._warn("a recording could not be finished", e)

    @contextlib.contextmanager
    def _watching(self) -> Iterator[None]:
        self._recordings, self._failed = [], False
        with _torch.watching_local_modes(self._enter, self._exit):
            yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        watching = contextlib.ExitStack()
        try:
            watching.enter_context(self._watching())
        except Exception as e:
            self._warn(f"{item.nodeid} not recorded", e)
        try:
            yield
        finally:
            try:
                watching.close()
            except Exception as e:
                self._warn(f"{item.nodeid}: its recording could not be finished", e)
        if self._failed and self._recordings:
            try:
                self._save(item.nodeid)
            except Exception as e:
                self._warn(f"{item.nodeid}: trace not saved", e)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
        outcome: Any = yield
        with contextlib.suppress(Exception):
            if outcome.get_result().failed:
                self._failed = True

    def _save(self, nodeid: str) -> None:
        from .show import export_html

        recorded = [rec for rec in self._recordings if rec.trace.events]
        if not recorded:
            self.errors.append(f"{nodeid}: ran under LocalTensorMode but recorded no event; nothing saved")
            return
        stem = self.names(nodeid)
        # A private folder inside DIR (made anew, never a link), then a rename into place: a link
        # planted at a file's name is replaced by the file, never written through.
        private = Path(tempfile.mkdtemp(prefix=".shardviz-", dir=self.folder))
        try:
            for i, rec in enumerate(recorded):
                name = stem if i == 0 else f"{stem}.{i + 1}"
                rec.trace.save(private / f"{name}.svtrace")
                self._place(private / f"{name}.svtrace")
                try:
                    export_html(rec.trace, private / f"{name}.html")
                    self._place(private / f"{name}.html")
                except Exception as e:  # the trace is saved; a view that cannot draw it must not hide it
                    self.errors.append(f"{name}.html not written: {type(e).__name__}: {e}")
        finally:
            with contextlib.suppress(OSError):
                shutil.rmtree(private)

    def _place(self, made: Path) -> None:
        target = self.folder / made.name
        os.replace(made, target)
        if target.suffix == ".svtrace":
            self.saved.append(target)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.saved or self.errors:
            terminalreporter.write_sep("-", "shardviz traces of failing tests")
            for path in self.saved:
                terminalreporter.write_line(
                    f"{path}  (sv.load; {path.with_suffix('.html').name}: the player)"
                )
            for line in self.errors:
                terminalreporter.write_line(line)

    def pytest_unconfigure(self, config: Any) -> None:
        """Folders the plugin made for traces and left empty go again."""
        for folder in reversed(self.created):
            with contextlib.suppress(OSError):
                folder.rmdir()
