"""Errors with messages that say what went wrong and what to do."""

from __future__ import annotations


class ShardvizError(Exception):
    """Base class for errors shardviz raises itself."""


class BackendError(ShardvizError, RuntimeError):
    """The backend could not be set up, or the request does not fit it."""


class WorldSizeError(ShardvizError, ValueError):
    """A mesh or a simulation does not match the backend's world size."""


class PerRankValueError(ShardvizError, RuntimeError):
    """Python needs one answer (a branch, a number) from a value that differs per simulated rank."""


class LockstepLimitError(ShardvizError, NotImplementedError):
    """Code the lockstep simulator cannot run as written; the message names the backend that can."""


class ShardSpecError(ShardvizError, ValueError):
    """A tensor's own sharding spec (PhysicsNeMo's ShardTensor) disagrees with its local shards."""


class SimulationWarning(UserWarning):
    """Code that runs under the simulation but does not mean what it would on real ranks."""


class RankExitError(ShardvizError, RuntimeError):
    """A simulated rank (a thread) called ``sys.exit``: the run stops, and the process goes on."""

    def __init__(self, message: str, rank: int, code: object = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.code = code


class TraceFileError(ShardvizError, ValueError):
    """A file is not a shardviz trace, is damaged, or comes from a newer shardviz."""


class P2PError(ShardvizError, RuntimeError):
    """Point-to-point code the simulator cannot run as written; the message says what to do."""


class DeadlockError(P2PError):
    """Every simulated rank is finished or waits for a message that no rank will send."""


P2P_HELP = (
    "In the simulator, send/recv (dist.send, dist.recv, isend, irecv, batch_isend_irecv) and "
    "torch.distributed.pipelining need one thread per block of ranks: write the code as a function "
    "of the thread index and run it with sv.run(fn, threads=N), e.g.\n"
    "    def ring(rank):\n"
    "        dist.send(x, (rank + 1) % 4) ...\n"
    "    trace = sv.run(ring, threads=4)\n"
    "Thread i stands for the i-th block of world_size/N ranks (the pipeline stage when 'pp' is the "
    "outermost mesh dim). See the README section 'Point-to-point and pipelines'."
)


def explain(error: BaseException, text: str) -> BaseException:
    """Append guidance to an exception's message, keeping its type and traceback.

    Users' ``except`` clauses keep working, and the notebook shows what to do next.
    """
    if getattr(error, "_shardviz_explained", False):
        return error
    first = error.args[0] if error.args else ""
    head = str(first) if first else type(error).__name__
    error.args = (f"{head}\n\n{text}", *error.args[1:])
    error._shardviz_explained = True  # type: ignore[attr-defined]
    return error
