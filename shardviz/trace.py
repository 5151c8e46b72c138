"""The trace: plain frozen dataclasses of what a SPMD run did, saved as JSON plus numpy arrays.

A trace holds no live tensors and no torch objects, so views can read it anywhere (a notebook
without torch, a saved file, a browser) and opening a stranger's trace runs no code: the file is
a zip of one JSON document and ``.npy`` arrays read with ``allow_pickle=False``.
"""

from __future__ import annotations

import io
import json
import math
import warnings
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .layout import Layout

if TYPE_CHECKING:
    from .limits import Limits
    from .memory import MemoryTimeline

FORMAT = "shardviz-trace"
VERSION = 1

# The value policy's default budget: values of all snapshots in one trace, in bytes. Enough for
# every teaching-size example; a model-size run keeps metadata (shapes, groups, bytes) only.
DEFAULT_VALUE_BUDGET = 64 * 2**20


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
        return math.prod(self.shape) * dtype_size(self.dtype)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorSnapshot):
            return NotImplemented
        if self.shape != other.shape or self.dtype != other.dtype:
            return False
        if (self.values is None) != (other.values is None):
            return False
        return self.values is None or _array_eq(self.values, other.values)  # type: ignore[arg-type]

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


def _array_eq(a: np.ndarray, b: np.ndarray) -> bool:
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


class Trace:
    """What one ``record()`` / ``run()`` / ``%%spmd`` cell did, in execution order."""

    def __init__(
        self,
        world_size: int,
        backend: str = "local",
        values: str | int = DEFAULT_VALUE_BUDGET,
    ) -> None:
        self.world_size = world_size
        self.backend = backend
        self.values = values
        self.events: list[Event] = []
        self.results: dict[int, Any] | None = None
        self.values_dropped_from: int | None = None
        self.meshes: list[dict[str, Any]] = []
        self.complete = True
        # What a reader should know before trusting the picture (a partial merge's report, a Flight
        # Recorder dump's desyncs), one line each; printed by str(trace) and shown by the player.
        self.notes: list[str] = []
        # Plain JSON facts about where the trace came from: a job rank's status, the event a viewer
        # should start at ("start_event"), a Flight Recorder dump's groups.
        self.meta: dict[str, Any] = {}
        # Live bytes per rank over the recording (``sv.record(memory=...)``), else None.
        self.memory: MemoryTimeline | None = None

    # --- reading -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def __getitem__(self, i: int) -> Event:
        return self.events[i]

    def event(self, event_id: int) -> Event:
        for e in self.events:
            if e.id == event_id:
                return e
        raise KeyError(f"no event with id {event_id} in this trace")

    def collectives(self) -> list[CollectiveEvent]:
        return [e for e in self.events if isinstance(e, CollectiveEvent)]

    def redistributes(self) -> list[RedistributeEvent]:
        return [e for e in self.events if isinstance(e, RedistributeEvent)]

    def ops(self) -> list[OpEvent]:
        return [e for e in self.events if isinstance(e, OpEvent)]

    def locals(self) -> list[LocalEvent]:
        return [e for e in self.events if isinstance(e, LocalEvent)]

    def children(self, event_id: int | None) -> list[Event]:
        return [e for e in self.events if e.parent == event_id]

    def __str__(self) -> str:
        from .views.text import trace_text

        return trace_text(self)

    def check(self) -> dict[int, Any]:
        """Collectives whose recorded outputs differ from what the op's semantics give for their
        recorded inputs (``shardviz.flow``), by event id: empty when everything adds up. A
        debugging tool must not hide a wrong result, the simulator's own included."""
        from .flow import check_trace

        return {i: c for i, c in check_trace(self.events).items() if c.checked and not c.ok}

    def summary(self, link: Any = None) -> Any:
        """Communication cost per collective, per mesh dim and per module (``str()`` is a table,
        ``.rows`` the data); ``link`` is a preset name ("nvlink4", "pcie5", "ib-ndr", ...) or a
        ``shardviz.cost.Link``."""
        from .cost import summary

        return summary(self.events, link)

    def __repr__(self) -> str:
        kinds = {k: sum(1 for e in self.events if e.kind == k) for k in EVENT_TYPES}
        parts = ", ".join(f"{n} {k}{'s' if n != 1 else ''}" for k, n in kinds.items() if n)
        return f"<Trace {self.backend} world_size={self.world_size}: {parts or 'no events'}>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        return (
            self.world_size == other.world_size
            and self.backend == other.backend
            and self.values == other.values
            and self.complete == other.complete
            and self.values_dropped_from == other.values_dropped_from
            and self.meshes == other.meshes
            and self.notes == other.notes
            and self.meta == other.meta
            and self.memory == other.memory
            and self.events == other.events
            and _results_eq(self.results, other.results)
        )

    __hash__ = None  # type: ignore[assignment]

    # --- files -------------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write the trace (values and results included) as one zip of JSON and .npy files."""
        return save(self, path)


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


def _results_eq(a: dict[int, Any] | None, b: dict[int, Any] | None) -> bool:
    if a is None or b is None:
        return a is b
    return set(a) == set(b) and all(_value_eq(a[k], b[k]) for k in a)


def _value_eq(x: Any, y: Any) -> bool:
    if hasattr(x, "shape") and hasattr(y, "shape"):
        same_dtype = str(getattr(x, "dtype", "")) == str(getattr(y, "dtype", ""))
        return same_dtype and _array_eq(np.asarray(_to_numpy(x)), np.asarray(_to_numpy(y)))
    if isinstance(x, tuple | list) and isinstance(y, tuple | list):
        same = type(x) is type(y) and len(x) == len(y)
        return same and all(_value_eq(p, q) for p, q in zip(x, y, strict=True))
    if isinstance(x, dict) and isinstance(y, dict):
        return set(x) == set(y) and all(_value_eq(x[k], y[k]) for k in x)
    return bool(x == y)


def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    t = x.detach().cpu()  # a torch tensor, read without importing torch here
    widened = NUMPY_WIDENED.get(str(t.dtype).removeprefix("torch."))
    if widened is not None:
        t = getattr(t, _CONVERT[widened])()
    return np.asarray(t.numpy())


_CONVERT = {"float32": "float", "complex64": "cfloat", "int64": "long"}


# --- serialisation ---------------------------------------------------------------------------


class _Writer:
    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}
        self._keys: dict[int, str] = {}  # arrays shared between snapshots are written once

    def array(self, a: np.ndarray) -> str:
        key = self._keys.get(id(a))
        if key is None:
            key = f"a{len(self.arrays)}"
            # ascontiguousarray makes a 0-d array 1-d: a scalar must come back a scalar
            self.arrays[key] = np.ascontiguousarray(a).reshape(a.shape)
            self._keys[id(a)] = key
        return key

    def snapshot(self, s: TensorSnapshot) -> dict[str, Any]:
        return {
            "shape": list(s.shape),
            "dtype": s.dtype,
            "values": self.array(s.values) if s.values is not None else None,
            "summary": _summary_json(s.summary),
        }

    def per_rank(self, d: Mapping[int, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for rank, v in d.items():
            if isinstance(v, list):
                out[str(rank)] = [self.snapshot(s) for s in v]
            else:
                out[str(rank)] = self.snapshot(v)
        return out

    def event(self, e: Event) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(e):
            v = getattr(e, f.name)
            if f.name in ("inputs", "outputs"):
                out[f.name] = self.per_rank(v)
            elif f.name == "nbytes":
                out[f.name] = {str(k): n for k, n in v.items()}
            elif isinstance(v, Source):
                out[f.name] = {"file": v.file, "line": v.line, "text": v.text}
            elif isinstance(v, Layout):
                out[f.name] = v.to_dict()
            elif isinstance(v, tuple):
                out[f.name] = _jsonable_tuple(v)
            else:
                out[f.name] = v
        return out


def _jsonable_tuple(v: Any) -> Any:
    if isinstance(v, tuple | list):
        return [_jsonable_tuple(x) for x in v]
    return v


def _summary_json(s: Summary | None) -> dict[str, Any] | None:
    if s is None:
        return None

    def num(x: float | None) -> Any:
        if x is None:
            return None
        if math.isnan(x) or math.isinf(x):
            return repr(x)  # "nan", "inf", "-inf": JSON has no literal for them
        return x

    return {"min": num(s.min), "max": num(s.max), "mean": num(s.mean), "nan": s.nan}


def save(trace: Trace, path: str | Path) -> Path:
    path = Path(path)
    w = _Writer()
    results: dict[str, Any] | None = None
    if trace.results is not None:
        results = {}
        dropped = []
        for rank, value in trace.results.items():
            enc = _encode_result(value, w)
            if enc is None:
                dropped.append(f"rank {rank}: {type(value).__name__}")
            else:
                results[str(rank)] = enc
        if dropped:
            warnings.warn(
                "trace.save: results that are neither tensors nor JSON values are not saved ("
                + ", ".join(dropped)
                + ")",
                stacklevel=3,
            )
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": trace.world_size,
        "backend": trace.backend,
        "values": trace.values,
        "values_dropped_from": trace.values_dropped_from,
        "complete": trace.complete,
        "meshes": trace.meshes,
        "events": [w.event(e) for e in trace.events],
        "results": results,
        "notes": list(trace.notes),
        "meta": trace.meta,
        "memory": trace.memory.to_dict(w.array) if trace.memory is not None else None,
    }
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("trace.json", json.dumps(doc, separators=(",", ":")))
        for key, arr in w.arrays.items():
            ab = io.BytesIO()
            np.lib.format.write_array(ab, arr, allow_pickle=False)
            z.writestr(f"arrays/{key}.npy", ab.getvalue())
    path.write_bytes(buf.getvalue())
    return path


def _encode_result(value: Any, w: _Writer) -> dict[str, Any] | None:
    """Tensors, JSON values, and tuples / lists / string-keyed dicts of them; None otherwise."""
    if hasattr(value, "detach") and hasattr(value, "dtype"):
        return {"tensor": w.array(_to_numpy(value)), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, tuple | list):
        items = [_encode_result(v, w) for v in value]
        if any(i is None for i in items):
            return None
        return {"tuple" if isinstance(value, tuple) else "list": items}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        enc = {k: _encode_result(v, w) for k, v in value.items()}
        if any(v is None for v in enc.values()):
            return None
        return {"dict": enc}
    if value is None or isinstance(value, bool | int | float | str):
        return {"json": value}
    return None


def load(path: str | Path, *, limits: Limits | None = None) -> Trace:
    """Read a trace written by ``trace.save``: no pickle, no code runs, every size capped and every
    field checked (``shardviz.trace_file``); a bad file is a ``TraceFileError``."""
    from .trace_file import load_trace

    return load_trace(path, limits=limits)
