"""One ipyparallel cluster per test session: 4 local engines, stopped by PID at the end.

Tests attach to it with ``sv.use("gloo", world_size=n, **connection)`` (the first n engines by
position), so switching between 2, 3 and 4 ranks costs a new process group, not new engines.
Process groups use a short timeout and one OpenMP thread per engine: 4 ranks share 2 cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psutil
import pytest

import shardviz as sv
from shardviz.backends import choose, session
from shardviz.backends.cluster import LocalCluster

TIMEOUT = 10  # process-group timeout in tests (seconds)
ENGINES = 4


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster.start(ENGINES, env={"OMP_NUM_THREADS": "1"}, progress=lambda text: None)
    pids = [*c.engine_pids(), c.controller_pid()]
    try:
        yield c
    finally:
        if session.peek() is not None and session.peek().name != "local":
            sv.use("local")
        c.stop()
        alive = [p for p in pids if p and psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        assert not alive, f"cluster processes still running after stop: {alive}"


@pytest.fixture
def gloo(cluster: LocalCluster) -> Any:
    """Switch to gloo on the first n engines of the session cluster: ``gloo(2)``."""

    def use(n: int, **options: Any) -> Any:
        options = {"timeout": TIMEOUT, "progress": False, **cluster.connection, **options}
        sv.use("gloo", world_size=n, **options)
        return choose.current()

    return use


@pytest.fixture(autouse=True, scope="module")
def _back_to_local() -> Iterator[None]:
    """Leave the simulator as the backend for whatever runs after these modules."""
    yield
    if session.peek() is not None and session.peek().name != "local":
        sv.use("local")


@pytest.fixture(scope="session")
def ip() -> Any:
    """An IPython shell with the shardviz extension: ``ip.run_cell_magic("spmd", "", cell)``."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.extension_manager.load_extension("shardviz")
    return shell
