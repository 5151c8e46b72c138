"""Layer-by-layer numerics of a training step, as plain data: full tensors from per-rank shards,
and where a parallel run first leaves a reference run.

A run reports, for every module call, what went in and out, the gradients flowing back out of
it, each parameter at the start, its gradient and its value after the optimizer step — as each
rank's local tensor and, for a DTensor, its placements (``RawCapture``, built by
``shardviz.numerics_capture`` on every rank, or once for all simulated ranks). ``build_run``
turns the per-rank pieces into one full tensor per row (``assemble``): Shard concatenated at its
true (uneven, strided) indices, Partial reduced by its op, FSDP's padding dropped, and every
replica — Replicate mesh dims, the groups of a sub-mesh, plain tensors on every rank — checked
against the others: replicas that disagree are a finding of their own, with the ranks named.
A plain local tensor (what ``to_local()`` hands a module in tensor-parallel code) has no
placements; its layout is inferred from the reference's global shape and the run's meshes, and
marked as inferred. ``compare`` sets two runs side by side and returns a ``NumericsReport``.

No torch here: a report is made on any rank, saved in a notebook, drawn by the views.

The modules, each importing only those listed before it: ``tolerance`` (when values count as
equal), ``text`` (how numbers and ranks are written), ``assembly`` (shards to full tensors),
``run`` (one run's rows), ``report`` (the report and its text form), ``comparison`` (two runs).
This ``__init__`` states the package's interface by importing from them.
"""

from __future__ import annotations

from .assembly import Assembled, Axis, Disagreement, assemble, axes, infer
from .comparison import compare
from .report import STATUSES, DiffRow, NumericsReport, describe_row
from .run import (
    KINDS,
    PHASES,
    Entry,
    EventNote,
    MeshSplit,
    RawCapture,
    RawTensor,
    RowKey,
    StepNumerics,
    build_run,
    merge_raw,
    rounding_errors,
)
from .tolerance import (
    EXACT,
    TOLERANCES,
    Tolerance,
    ToleranceSpec,
    check_tolerance,
    precision,
    tolerance_for,
)

__all__ = [
    "EXACT",
    "KINDS",
    "PHASES",
    "STATUSES",
    "TOLERANCES",
    "Assembled",
    "Axis",
    "DiffRow",
    "Disagreement",
    "Entry",
    "EventNote",
    "MeshSplit",
    "NumericsReport",
    "RawCapture",
    "RawTensor",
    "RowKey",
    "StepNumerics",
    "Tolerance",
    "ToleranceSpec",
    "assemble",
    "axes",
    "build_run",
    "check_tolerance",
    "compare",
    "describe_row",
    "infer",
    "merge_raw",
    "precision",
    "rounding_errors",
    "tolerance_for",
]
