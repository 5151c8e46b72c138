"""What every backend offers: a name, a world size, a device type and a way to shut down."""

from __future__ import annotations

from typing import Any, Protocol


class Backend(Protocol):
    name: str
    world_size: int

    def key(self) -> tuple[Any, ...]:
        """Arguments that identify this backend; ``use()`` with the same key is a no-op."""
        ...

    def device_type(self) -> str: ...

    def close(self) -> None:
        """Release what the backend started (process groups, engines)."""
        ...


def check_world_size(world_size: object) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, not {world_size!r}")
    return world_size
