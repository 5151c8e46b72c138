"""Real process groups from the notebook: gloo or NCCL ranks on ipyparallel engines.

One engine per rank. ``sv.use("gloo", world_size=4)`` starts a local cluster (controller and engines
on 127.0.0.1) and owns it: switching backend stops those engines, by PID, and a watchdog process
stops them if the kernel dies first (``watchdog.py``). With ``profile=``,
``profile_dir=`` or ``cluster_id=`` it attaches to a cluster started elsewhere (``ipcluster start``
with the MPI, Slurm or SSH launchers, on several machines) and leaves its engines running.

Ranks are assigned by position among the engines, never by engine id (ids keep growing after
restarts). Every process group gets an explicit timeout and a fresh port. A ``%%spmd`` cell travels
as source text; each rank runs it inside ``record_rank`` and sends back plain data (its trace as
``trace.save`` bytes, its cell value, its ``sv.show`` payloads); the client merges the traces.

While ranks run, the client watches them: a rank that raised, died, or finished without entering a
collective another rank is waiting in becomes one error naming the ranks, as soon as it is certain,
instead of a hang until the process-group timeout. Ranks publish which collective they are entering
*before* entering it (a rank blocked inside gloo cannot answer), so the error says where each was.
A rank running Python past ``spin_limit`` without reaching a collective sends its stack: the
notebook warns (``SpinningRankWarning``) and keeps waiting, or, with ``on_spin="interrupt"``, the
rank stops itself with KeyboardInterrupt.

The package's modules, one job each: ``backend`` (the Backend itself: start-up, restart, running
code and watching it), ``engines`` (clusters shardviz starts: start, stop, reap, the watchdog),
``faults`` (hang, death and spin diagnosis; RankError and its text), ``shipping`` (functions and
arguments sent to the ranks), ``results`` (values, shows and traces coming back). This
``__init__`` is the package's interface: it imports what the rest of shardviz uses from them.
"""

from __future__ import annotations

from .backend import DEFAULT_TIMEOUT, OPTIONS, ClusterBackend
from .engines import ENGINE_TIMEOUT, LocalCluster, Progress, engine_env
from .faults import (
    CollectiveHangError,
    Fault,
    RankError,
    RankRun,
    SpinningRankWarning,
    diagnose,
    running_python,
    spin_text,
    where_text,
)
from .results import PerRank, draw_show, load_rank_trace, same_value
from .shipping import args_for_rank, import_spec, notebook_imports, ship_function

__all__ = [
    "DEFAULT_TIMEOUT",
    "ENGINE_TIMEOUT",
    "OPTIONS",
    "ClusterBackend",
    "CollectiveHangError",
    "Fault",
    "LocalCluster",
    "PerRank",
    "Progress",
    "RankError",
    "RankRun",
    "SpinningRankWarning",
    "args_for_rank",
    "diagnose",
    "draw_show",
    "engine_env",
    "import_spec",
    "load_rank_trace",
    "notebook_imports",
    "running_python",
    "same_value",
    "ship_function",
    "spin_text",
    "where_text",
]
