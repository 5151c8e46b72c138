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


class ShardSpecError(ShardvizError, ValueError):
    """A tensor's own sharding spec (PhysicsNeMo's ShardTensor) disagrees with its local shards."""


class SimulationWarning(UserWarning):
    """Code that runs under the simulation but does not mean what it would on real ranks."""


class TraceFileError(ShardvizError, ValueError):
    """A file is not a shardviz trace, is damaged, or comes from a newer shardviz."""


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
