"""Operator schemas: overloads, argument names, what an op writes, and DTensor's OpSchema inputs."""

from __future__ import annotations

from typing import Any

import torch

from .meshes import spec_geometry


def op_overloads(qualified_name: str) -> list[tuple[str, Any]]:
    """(overload name, OpOverload) of every overload of ``"namespace.op"`` (``"c10d.allreduce_"``,
    ``"_c10d_functional.all_reduce"``); empty when this torch has no such operator. Some namespaces
    (``_c10d_functional``, ``_dtensor``) are private: they are only looked up here. Meant for
    import time: the dispatch path compares the resolved objects."""
    namespace, op = qualified_name.split(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        return []
    return [(name, getattr(packet, name)) for name in packet.overloads()]


def op_argument_names(op: Any) -> list[str]:
    """The argument names of an OpOverload, in order, from its schema (``OpOverload._schema``)."""
    return [a.name for a in op._schema.arguments]


def written_arguments(op: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument an op writes in place, from its schema; none for an op
    without a schema. Callers memoise it per op: it is not for the per-op dispatch path."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return ()
    return tuple(
        (i, a.name)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


def op_schema_inputs(schema: Any) -> tuple[str, list[dict[str, Any]]]:
    """(operator name, geometry of each DTensor input) of a DTensor OpSchema."""
    op, specs = op_schema_specs(schema)
    return op, [g for g in map(spec_geometry, specs) if g is not None]


def op_schema_specs(schema: Any) -> tuple[str, list[Any]]:
    """(operator name, the spec of each DTensor input, keyword inputs too) of a DTensor OpSchema."""
    op = str(getattr(schema, "op", "?")).removesuffix(".default")
    kwargs = getattr(schema, "kwargs_schema", None) or {}
    args = [*getattr(schema, "args_schema", ()), *kwargs.values()]
    return op, [a for a in args if getattr(a, "tensor_meta", None) is not None and hasattr(a, "placements")]
