"""The threads backend (``sv.use("threads", world_size=N)``): one thread per rank.

Each rank runs the user's code in its own thread, with plain tensors and plain ints
(``shardviz.threadpg``), so Python that branches or indexes on the rank runs as written. Each rank
records itself with the Recorder real ranks use (``Recorder(rank=r)``), so a rank's trace is what
a gloo rank would record; the ranks' traces are merged with ``merge.merge`` when the ranks ran
the same sequence (SPMD code), else by where they met (``shardviz.interleave``).

Like on a real backend, each rank has its own names: a ``%%spmd`` cell runs in the rank's own
namespace, kept from cell to cell, and what a rank reads from the notebook (a tensor, a module,
a list) is copied for it on first use, so that one rank's changes never reach another (modules,
classes, functions and constants are shared as they are). ``sv.run(fn)`` gives each rank its own
copy of what ``fn`` reads the same way. A ``with sv.record():`` body runs once, in the notebook's
thread, which cannot be every rank: it is refused, with ``sv.run(fn)`` and ``%%spmd`` as the way.

``simulated`` is False: the ranks are not LocalTensorMode's, so memory counting and
``threads=`` are refused, and ``sv.compare`` / ``%%spmd --compare`` run the lockstep simulator next
to this backend, as next to a real one.

The package's modules, one job each: ``backend`` (the Backend itself: runs, merging the ranks'
traces), ``recorder`` (each rank's own recorder), ``names`` (each rank's names and the copies it
reads from the notebook), ``output`` (printed output, shows and values coming back). This
``__init__`` is the package's interface: it imports what the rest of shardviz uses from them.
"""

from __future__ import annotations

from .backend import NAME, ThreadsBackend

__all__ = ["NAME", "ThreadsBackend"]
