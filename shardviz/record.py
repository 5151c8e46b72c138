"""Entering the simulation: ``record()`` runs its body as SPMD ranks on the local backend."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from . import backends
from .errors import BackendError
from .explain import explain_simulation_error


@contextlib.contextmanager
def record() -> Iterator[None]:
    """Run the body under the local backend's simulation; no mode is left behind, even on error."""
    backend = backends.current()
    if backend.name != "local":
        raise BackendError(
            f"record() runs code in this process, which the {backend.name!r} backend cannot do; "
            "use sv.run(fn) or a %%spmd cell, or switch with sv.use('local')"
        )
    try:
        with backend.simulate():  # type: ignore[attr-defined]
            yield None
    except BaseException as e:
        raise explain_simulation_error(e, backend.world_size) from None
