"""What runs inside each rank's ipyparallel engine: the process group, ``%%spmd`` cells, ``sv.run``.

The client (``backends.cluster``) sends these functions by reference; the engines import shardviz from
the same environment. Everything sent back is plain data — dicts, strings, bytes, numpy arrays and
CPU tensors — carried by ipyparallel's own transport; a rank's trace travels as the bytes of
``trace.save`` (JSON and ``.npy``), so the client never unpickles a shardviz object.

Before a rank enters a collective it publishes which one (ipyparallel's data channel, sent from a
background thread), so the client can see where a rank blocked inside gloo or NCCL is, even though
that rank cannot answer until the process-group timeout. A rank that runs Python past the spin limit
without reaching a collective publishes its stack from a watcher thread, and stops if asked to.

Nothing here listens on a wildcard address: rank 0's store is bound to the rendezvous address, and on
one machine gloo and NCCL are kept on the loopback interface.

The package's modules, one job each: ``state`` (this rank's state while its process group lives),
``backend`` (the Backend inside the rank), ``startup`` (joining and leaving the process group),
``watch`` (the flight recorder and the spin watch), ``shows`` (``sv.show`` on a rank), ``running``
(running a cell or a function, and what it sends back). This ``__init__`` is the package's
interface: it imports what the rest of shardviz uses from them.
"""

from __future__ import annotations

from .backend import RankBackend
from .running import run_cell, run_fn
from .shows import SHOW_KEY, SHOW_MIME, show_payload
from .startup import address, hello, setup, store_port, teardown
from .watch import FLIGHT_KEY, SPIN_ACTIONS, SPIN_KEY, Flight, SpinWatch, format_stack

__all__ = [
    "FLIGHT_KEY",
    "SHOW_KEY",
    "SHOW_MIME",
    "SPIN_ACTIONS",
    "SPIN_KEY",
    "Flight",
    "RankBackend",
    "SpinWatch",
    "address",
    "format_stack",
    "hello",
    "run_cell",
    "run_fn",
    "setup",
    "show_payload",
    "store_port",
    "teardown",
]
