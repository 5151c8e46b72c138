"""NVIDIA PhysicsNeMo's ShardTensor in shardviz (issue 25); ``make setup`` installs PhysicsNeMo.

Handlers registered with ``ShardTensor.register_function_handler`` are class-level and outlive a
test: the ``handlers`` fixture puts the registry back as it was.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def handlers() -> Iterator[Any]:
    from physicsnemo.domain_parallel import ShardTensor

    saved = dict(ShardTensor._function_registry)
    try:
        yield ShardTensor
    finally:
        ShardTensor._function_registry.clear()
        ShardTensor._function_registry.update(saved)
