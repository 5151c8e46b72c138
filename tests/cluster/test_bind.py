"""What the real backend listens on: on one machine nothing on a wildcard address; with an explicit
``master_addr`` (several machines) the store listens on that address only.

Checked on the sockets themselves (psutil), for every process of the cluster: the controller and
its children, the engines and their nannies.
"""

from __future__ import annotations

import ipaddress
import os
import socket

import psutil
import pytest

from shardviz.backends.cluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]


def cluster_processes(cluster: LocalCluster) -> list[psutil.Process]:
    roots = [psutil.Process(p) for p in [*cluster.engine_pids(), cluster.controller_pid()] if p]
    return roots + [c for p in roots for c in p.children(recursive=True)]


def listening(cluster: LocalCluster) -> dict[tuple[str, int], int]:
    """(address, port) -> pid, for every TCP socket the cluster's processes listen on."""
    out = {}
    for p in cluster_processes(cluster):
        for c in p.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN:
                out[(c.laddr.ip, c.laddr.port)] = p.pid
    return out


def test_nothing_listens_beyond_this_machine(cluster, gloo):
    backend = gloo(2)
    sockets = listening(cluster)
    assert backend.master is not None
    addr, port = backend.master
    assert addr == "127.0.0.1"
    # rank 0's store is among them, on the loopback address
    assert sockets.get(("127.0.0.1", port)) == backend.pids[backend.engines[0]]
    wide = {a: pid for a, pid in sockets.items() if not ipaddress.ip_address(a[0]).is_loopback}
    assert not wide, f"listening beyond 127.0.0.1: {wide}"


def test_gloo_is_kept_on_the_loopback_interface(cluster, gloo):
    """Where the host name resolves to a network address, gloo would listen there; on one machine
    the ranks pin it to the interface that holds 127.0.0.1."""
    backend = gloo(2)
    lo = next(
        name
        for name, addrs in psutil.net_if_addrs().items()
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs)
    )
    env = backend.client[backend.engines].apply_sync(os.getenv, "GLOO_SOCKET_IFNAME")  # on the ranks
    assert env == [lo, lo]


def _network_address() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return str(a.address)
    return None


def test_an_explicit_master_addr_is_the_only_address_the_store_listens_on(cluster, gloo, ip):
    """As across machines: ``master_addr`` names rank 0's address; the store listens there, not on
    every interface, and the ranks reach it."""
    addr = _network_address()
    if addr is None:
        pytest.skip("this machine has no network address besides loopback")
    backend = gloo(2, master_addr=addr)
    assert backend.master is not None and backend.master[0] == addr
    port = backend.master[1]
    on_port = {a for a in listening(cluster) if a[1] == port}
    assert on_port == {(addr, port)}
    ip.run_cell("import torch\nimport torch.distributed as dist")
    out = ip.run_cell_magic("spmd", "", "t = torch.ones(2)\ndist.all_reduce(t)\nt")
    assert out.tolist() == [2.0, 2.0]  # summed over 2 ranks: the process group works
