"""The local backend: N SPMD ranks simulated in this process by LocalTensorMode.

``use()`` only sets up a fake process group of the right size; the dispatch mode is entered by
``record()``/``run()``/``%%spmd`` and left when they finish, so plain torch code in the notebook
stays plain between cells.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from .. import _torch
from ..errors import BackendError, WorldSizeError
from .base import check_world_size


class LocalBackend:
    name = "local"

    def __init__(self, world_size: int = 4) -> None:
        self.world_size = check_world_size(world_size)
        self._owns_pg = False
        self._ensure_pg()
        # One mode for the backend's life: its cache of per-rank mesh coordinates then survives
        # from cell to cell (recomputing them costs ~N^2 small ops: seconds at 256 ranks).
        self._mode = _torch.LocalTensorMode(self.world_size)

    def key(self) -> tuple[Any, ...]:
        return ("local", self.world_size)

    def device_type(self) -> str:
        return "cpu"

    def _ensure_pg(self) -> None:
        """Create the fake process group, or adopt a matching one the user already made."""
        if dist.is_initialized():
            backend = dist.get_backend()
            size = dist.get_world_size()
            if backend == "fake" and size == self.world_size:
                return
            if self._owns_pg:
                dist.destroy_process_group()
            else:
                raise BackendError(
                    f"a {backend!r} process group of world size {size} is already initialized; the local "
                    f"backend needs a 'fake' one of size {self.world_size}. Call "
                    "torch.distributed.destroy_process_group() first, or use "
                    f"sv.use('local', world_size={size}) if it is a fake group."
                )
        dist.init_process_group("fake", rank=0, world_size=self.world_size)
        self._owns_pg = True

    @contextlib.contextmanager
    def simulate(self) -> Iterator[Any]:
        """Enter LocalTensorMode for this world size; always leave it, even on error."""
        self._ensure_pg()
        outer = _torch.active_local_mode()
        if outer is not None and outer.ranks != frozenset(range(self.world_size)):
            raise WorldSizeError(
                f"a LocalTensorMode over {len(outer.ranks)} ranks is already active, but the local backend "
                f"simulates {self.world_size}; collectives would silently skip ranks. Leave that mode, or "
                f"call sv.use('local', world_size={len(outer.ranks)})."
            )
        mode = self._mode
        if outer is mode:
            yield mode  # already inside this backend's simulation
            return
        _torch.reuse_local_mode(mode)
        with _torch.tracking_meshes(), _torch.fsdp_in_simulation(), mode:
            yield mode

    def close(self) -> None:
        if self._owns_pg and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_pg = False

    def __repr__(self) -> str:
        return f"LocalBackend(world_size={self.world_size})"
