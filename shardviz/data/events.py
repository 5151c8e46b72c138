"""The events of a trace and the snapshots they hold: plain frozen dataclasses, no torch.

Every analysis (flow, cost, ring, plan, merge, describe) reads these; ``trace.Trace`` is the
list of them with what a run recorded around them. ``DTYPE_SIZES`` and ``NUMPY_WIDENED`` say how
torch's dtypes, named as strings, are sized and read as numpy arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..geometry.layout import Layout


@dataclass(frozen=True, slots=True)
class Source:
    """The user's line that caused an event."""

    file: str
    line: int
    text: str


@dataclass(frozen=True, slots=True)
class Summary:
    """min / max / mean / NaN count of a snapshot's values (None where undefined, e.g. empty)."""

    min: float | None
    max: float | None
    mean: float | None
    nan: int


@dataclass(frozen=True, slots=True, eq=False)
class TensorSnapshot:
    """One rank's buffer at one moment: shape and dtype always, values within the budget.

    ``values`` may be shared between ranks that hold identical buffers (after an all-reduce,
    say): treat them as read-only. ``summary`` is derived from the values when first read.
    """

    shape: tuple[int, ...]
    dtype: str
    values: np.ndarray | None = None
    _summary: Summary | None = field(default=None, repr=False)

    @property
    def summary(self) -> Summary | None:
        """min / max / mean / NaN count of the values (None when only metadata was kept)."""
        if self.values is None:
            return None
        if self._summary is None:
            object.__setattr__(self, "_summary", summarize(self.values))
        return self._summary

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer, from its shape and dtype (values kept or not)."""
        return math.prod(self.shape) * dtype_size(self.dtype)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorSnapshot):
            return NotImplemented
        if self.shape != other.shape or self.dtype != other.dtype:
            return False
        if (self.values is None) != (other.values is None):
            return False
        return self.values is None or array_eq(self.values, other.values)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        kept = "values" if self.values is not None else "no values"
        return f"TensorSnapshot(shape={self.shape}, dtype={self.dtype!r}, {kept})"


def summarize(a: np.ndarray) -> Summary:
    if a.size == 0:
        return Summary(None, None, None, 0)
    x = np.abs(a) if a.dtype.kind == "c" else a.astype(np.float64) if a.dtype.kind == "b" else a
    nan = int(np.isnan(x).sum()) if x.dtype.kind == "f" else 0
    if nan == x.size:
        return Summary(None, None, None, nan)
    if nan:
        return Summary(float(np.nanmin(x)), float(np.nanmax(x)), float(np.nanmean(x)), nan)
    return Summary(float(x.min()), float(x.max()), float(x.mean(dtype=np.float64)), 0)


def array_eq(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind in "fc":
        return bool(np.array_equal(a, b, equal_nan=True))
    return bool(np.array_equal(a, b))


# A rank's snapshot, or a list of them for list-valued collectives (all_gather(list, t), ...).
PerRank = dict[int, "TensorSnapshot | list[TensorSnapshot]"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Fields every event has; ``kind`` says which of the subclasses it is."""

    id: int
    kind: str
    parent: int | None = None
    source: Source | None = None
    module: str | None = None
    phase: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveEvent(Event):
    """One collective, run by every group in ``groups`` at once, with each rank's buffers."""

    kind: str = "collective"
    op: str
    impl: str
    reduce_op: str | None = None
    groups: tuple[tuple[int, ...], ...] = ()
    mesh_dim: int | None = None
    mesh_dim_name: str | None = None
    root: int | None = None
    inputs: PerRank = field(default_factory=dict)
    outputs: PerRank = field(default_factory=dict)
    nbytes: dict[int, int] = field(default_factory=dict)
    # The op's other arguments that shape its data flow (gather_dim / shard_dim of a DTensor
    # all-to-all, split sizes, ...), as JSON values.
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def group_size(self) -> int:
        """The number of ranks in each of ``groups`` (0 when there are none)."""
        return len(self.groups[0]) if self.groups else 0

    def roots(self) -> list[int]:
        """The root's global rank in each group (``root`` is its index within a group)."""
        if self.root is None:
            return []
        return [g[self.root] for g in self.groups if self.root < len(g)]


@dataclass(frozen=True, slots=True, kw_only=True)
class RedistributeEvent(Event):
    """A DTensor redistribute from ``src`` to ``dst`` placements; its collectives are children."""

    kind: str = "redistribute"
    src: tuple[str, ...] = ()
    dst: tuple[str, ...] = ()
    plan: str = ""
    explicit: bool = True
    before: Layout | None = None
    after: Layout | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OpEvent(Event):
    """A DTensor operator; implicit redistributes of its inputs are its children."""

    kind: str = "op"
    name: str = ""
    input_placements: tuple[tuple[str, ...], ...] = ()
    output_placements: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalEvent(Event):
    """Per-rank compute on the local shards of a DTensor (after ``to_local()``), with each rank's
    inputs and outputs: the "compute locally" step of a hand-written sharded operator."""

    kind: str = "local"
    name: str = ""
    inputs: PerRank = field(default_factory=dict)
    outputs: PerRank = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class ComputeEvent(Event):
    """A stretch of compute on some ranks, e.g. one pipeline stage's forward or backward of one
    microbatch (``name``: ``"forward"``, ``"backward"``, ``"backward_weight"``); what it
    communicates (tensor-parallel collectives) are its children."""

    kind: str = "compute"
    name: str = ""
    ranks: tuple[int, ...] = ()
    stage: int | None = None
    microbatch: int | None = None


EVENT_TYPES: dict[str, type[Event]] = {
    "collective": CollectiveEvent,
    "redistribute": RedistributeEvent,
    "op": OpEvent,
    "local": LocalEvent,
    "compute": ComputeEvent,
}


# Bytes per element of the torch dtypes, by name.
DTYPE_SIZES = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "complex32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}


# Torch dtypes numpy has no type for (or, float16, none it computes with as torch does), and
# the dtype their values are read as: a snapshot's values, a result compared.
NUMPY_WIDENED = {
    "float16": "float32",
    "bfloat16": "float32",
    "float8_e4m3fn": "float32",
    "float8_e5m2": "float32",
    "float8_e4m3fnuz": "float32",
    "float8_e5m2fnuz": "float32",
    "complex32": "complex64",
    "uint16": "int64",
    "uint32": "int64",
    "uint64": "int64",
}


def dtype_size(dtype: str) -> int:
    """Bytes per element of a torch dtype name (``"float32"``, ``"bfloat16"``, ...)."""
    return DTYPE_SIZES.get(dtype.removeprefix("torch."), 4)


def array_of(x: Any) -> np.ndarray:
    """A tensor's values as numpy, widened as ``NUMPY_WIDENED`` says; a numpy array as it is.
    Duck-typed (``detach``/``cpu``/``numpy``), so reading a tensor needs no torch import here."""
    if isinstance(x, np.ndarray):
        return x
    t = x.detach().cpu()  # a torch tensor, read without importing torch here
    widened = NUMPY_WIDENED.get(str(t.dtype).removeprefix("torch."))
    if widened is not None:
        t = getattr(t, _CONVERT[widened])()
    return np.asarray(t.numpy())


_CONVERT = {"float32": "float", "complex64": "cfloat", "int64": "long"}
