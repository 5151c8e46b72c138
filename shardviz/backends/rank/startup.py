"""A rank joining its process group: what the engine has, rank 0's store socket, the transports kept
on loopback on one machine, setup and teardown."""

from __future__ import annotations

import datetime
import ipaddress
import math
import os
import socket
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from ..._version import __version__
from ...errors import BackendError
from .. import session
from . import state
from .backend import RankBackend


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
    global _listener
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
    state.current = state.RankState(rank, world_size, backend, local_rank, timeout_s, spin_limit, on_spin)
    _install(RankBackend(backend, world_size, rank))
    return {"rank": rank, "pid": os.getpid(), "init_s": time.perf_counter() - t0}


def teardown() -> None:
    """Leave the process group and forget this rank's state; the engine itself keeps running."""
    _destroy_pg()
    state.current = None
    if isinstance(session.peek(), RankBackend):
        session.install(None)


def _destroy_pg() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _install(backend: RankBackend) -> None:
    session.install(backend)
