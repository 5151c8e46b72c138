"""The Backend interface: every backend implements all of it, callers reach the backend only
through it, and the backends never load the IPython front end. No cluster is started."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import pkgutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_architecture import PACKAGE, ROOT, forbidden_imports

import shardviz as sv
import shardviz.backends
from shardviz.backends import session
from shardviz.backends.base import Backend
from shardviz.backends.cluster import ClusterBackend
from shardviz.backends.local import LocalBackend
from shardviz.backends.rank import RankBackend
from shardviz.backends.threads import ThreadsBackend
from shardviz.errors import BackendError
from shardviz.magics import ShardvizMagics

# The interface, read from the Protocol itself: its methods and its annotated attributes.
METHODS = sorted(n for n, v in vars(Backend).items() if callable(v) and not n.startswith("_"))
ATTRIBUTES = sorted(Backend.__annotations__)


def _backend_classes() -> list[type]:
    """Every ``*Backend`` class defined in ``shardviz.backends`` (any module, any depth)."""
    found: dict[str, type] = {}
    for info in pkgutil.walk_packages(shardviz.backends.__path__, "shardviz.backends."):
        for name, obj in vars(importlib.import_module(info.name)).items():
            ours = inspect.isclass(obj) and obj.__module__.startswith("shardviz.backends.")
            if ours and obj is not Backend and name.endswith("Backend"):
                found[f"{obj.__module__}.{name}"] = obj
    return [found[k] for k in sorted(found)]


BACKENDS = _backend_classes()


def _parameters(fn):
    params = list(inspect.signature(fn).parameters.values())
    return [(p.name, p.kind) for p in params[1:]]  # without self


def test_the_backends_are_found():
    for cls in (LocalBackend, ClusterBackend, RankBackend, ThreadsBackend):
        assert cls in BACKENDS
    assert len(METHODS) >= 5 and {"name", "world_size", "simulated"} <= set(ATTRIBUTES)


class _Probe:
    """A backend that is the Protocol and nothing more: it notes which members the front ends ask
    for, and refuses any other (a front end needing more than the Protocol fails here)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or (name not in METHODS and name not in ATTRIBUTES):
            raise AttributeError(
                f"a front end asked the backend for {name!r}, which the Backend protocol lacks"
            )
        self.asked.append(name)
        plain = {"name": "probe", "world_size": 2, "simulated": True}
        if name in plain:
            return plain[name]
        return getattr(self, f"_{name}")

    def _key(self) -> tuple[Any, ...]:
        return ("probe",)

    def _device_type(self) -> str:
        return "cpu"

    def _close(self) -> None:
        return None

    def _restart(self) -> _Probe:
        return self

    @contextlib.contextmanager
    def _record(self, values: str | int, memory: Any) -> Iterator[str]:
        yield "recorded"

    def _run(self, fn: Any, args: Any, kwargs: Any, **options: Any) -> str:
        return "ran"

    def _per_rank(self, fn: Any) -> str:
        return "per rank"

    def _run_cell(self, cell: str, shell: Any, values: Any = None) -> str:
        return "cell"

    def _show(self, obj: Any, **options: Any) -> str:
        return "shown"


def test_the_interface_is_the_one_callers_need():
    """Each Protocol method is reached from the public front ends, and they need nothing else."""
    sv.use("local", world_size=4)  # the simulator the probe stands in for, and its process group
    probe = _Probe()
    with session.swapped(probe):  # type: ignore[arg-type]
        with sv.record() as trace:
            assert trace == "recorded"
        assert sv.run(lambda: None) == "ran"
        assert sv.per_rank(lambda rank: rank) == "per rank"
        assert sv.show("x") == "shown"
        assert sv.device_type() == "cpu"
        assert ShardvizMagics(None).spmd("", "x = 1") == "cell"
        assert sv.restart() is probe
        sv.use("local", world_size=4)  # another key than the probe's: the probe is closed
        built = session.peek()
        assert isinstance(built, LocalBackend) and built is not probe
        built.close()
    assert sorted(set(probe.asked)) == METHODS


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_every_backend_implements_every_method(cls):
    for name in METHODS:
        method = getattr(cls, name, None)
        assert callable(method), f"{cls.__name__} has no {name}()"
        assert _parameters(method) == _parameters(getattr(Backend, name)), f"{cls.__name__}.{name}"


def test_the_simulator_is_the_one_simulated_backend():
    assert LocalBackend.simulated is True
    assert ClusterBackend.simulated is False and RankBackend.simulated is False
    # one thread per rank runs no LocalTensorMode: sv.compare runs the lockstep simulator next to it
    assert ThreadsBackend.simulated is False


def _real(cls: type) -> object:
    """A real backend's refusals need no engines: an unstarted ClusterBackend, or a rank's."""
    if cls is RankBackend:
        return RankBackend("gloo", 2, 0)
    backend = ClusterBackend.__new__(ClusterBackend)
    backend.name, backend.world_size = "gloo", 2
    return backend


@pytest.mark.parametrize("cls", [ClusterBackend, RankBackend], ids=lambda c: c.__name__)
def test_real_backends_refuse_what_only_the_simulator_does(cls):
    backend = _real(cls)

    def fn(*args):
        return torch.ones(1)

    with session.swapped(backend):
        refused = "record\\(\\) runs code in this process, which the 'gloo'"
        with pytest.raises(BackendError, match=refused), sv.record():
            pass
        with pytest.raises(NotImplementedError, match="single-thread runs only"):
            sv.run(fn, memory=True)
        with pytest.raises(BackendError, match="on the 'gloo' backend every rank is a real process"):
            sv.run(fn, threads=2)


def test_compare_refuses_the_simulator():
    sv.use("local")
    with pytest.raises(BackendError, match="switch to one first"):
        sv.compare(lambda: None)


def test_sv_show_asks_the_current_backend():
    class Drawing:
        def show(self, obj, **options):
            return ("drawn", obj, options)

    with session.swapped(Drawing()):
        assert sv.show("x", title="t") == ("drawn", "x", {"title": "t"})


def test_no_module_but_the_extension_hook_imports_the_ipython_front_end():
    """Backends, compare and record reach cells through ``shardviz.backends.cells``, not ``magics``, so
    that nothing below the front end loads IPython (and backends → magics → compare → record →
    backends is no cycle)."""
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ("shardviz/__init__.py", "shardviz/magics.py") or "__pycache__" in path.parts:
            continue
        for line, text, _ in forbidden_imports(path.read_text(encoding="utf-8"), rel, ("shardviz.magics",)):
            problems.append(f"{rel}:{line}: `{text}`")
    assert not problems, "imports of the IPython front end:\n" + "\n".join(problems)


def test_importing_the_backends_loads_no_ipython():
    code = (
        "import sys\n"
        "import shardviz.backends, shardviz.backends.rank, shardviz.backends.cluster\n"
        "import shardviz.backends.cells\n"
        "import shardviz.backends.threads\n"
        "print(sorted(m for m in sys.modules if m == 'shardviz.magics' or m.split('.')[0] == 'IPython'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(ROOT), timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
