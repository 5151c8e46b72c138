"""Reading a trace file into a ``Trace``: every field of trace.json checked as it is decoded.

Types, ranges, ranks within the world size, distinct ranks in a group, parents that come before
their children, nesting depth; the arrays through ``trace_file.Arrays``, checked before they are
allocated; layouts and their shards through ``layout_read``. A bad file is a ``TraceFileError``
naming the file, the field and what was expected; no pickle, no code runs. No torch either: a saved
tensor result comes back through the ``tensor`` function the caller passes (``sv.load`` passes one
that makes a torch tensor).
"""

from __future__ import annotations

import contextlib
import json
import math
import stat
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import TraceFileError
from ..geometry.layout import Layout
from .events import EVENT_TYPES, Event, PerRank, Source, TensorSnapshot
from .layout_read import checked, decode_layout, fields, rank_list, shape_at, str_tuple
from .limits import (
    MAX_DEPTH,
    MAX_DIMS,
    Bad,
    Limits,
    array,
    boolean,
    integer,
    mapping,
    opt_integer,
    opt_string,
    over,
    parse_json,
    plain_json,
    rank_key,
    resolve,
    shape,
    short,
    string,
)
from .memory import MemoryTimeline
from .trace import Trace
from .trace_file import _ZIP_ERRORS, FORMAT, VERSION, Arrays, stored_dtypes

# How a saved tensor result (its values, its torch dtype's name) comes back; raises ValueError for
# a dtype name it does not know.
TensorFromValues = Callable[[np.ndarray, str], Any]


def load_trace(
    path: str | Path, *, limits: Limits | None = None, tensor: TensorFromValues | None = None
) -> Trace:
    """Read a trace written by ``trace.save`` (``limits``: default ``shardviz.data.limits.resolve()``).

    A tensor in ``trace.results`` comes back as ``tensor(values, dtype_name)``; without ``tensor``,
    as its numpy values (dtypes numpy lacks widened, as in a snapshot)."""
    lim = limits if limits is not None else resolve()
    with open_document(path, lim) as (doc, arrays):
        try:
            return decode_trace(doc, arrays, lim, tensor)
        except Bad as e:
            raise e.error(str(path), "trace.json") from None


@contextlib.contextmanager
def open_document(
    path: str | Path,
    lim: Limits,
    *,
    member: str = "trace.json",
    fmt: str = FORMAT,
    version: int = VERSION,
    kind: str = "shardviz trace",
) -> Iterator[tuple[dict[str, Any], Arrays]]:
    """A file written by ``trace_file.write``: its JSON document (``member``, of format ``fmt`` up
    to ``version``) and its arrays, every size checked against ``lim`` before it is read."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise
    except OSError as e:
        raise TraceFileError(f"{path} cannot be read ({e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise TraceFileError(f"{path} is a folder, not a {kind} file")
    if not stat.S_ISREG(st.st_mode):
        raise TraceFileError(f"{path} is not a regular file, so not a {kind}")
    try:
        z = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise
    except _ZIP_ERRORS as e:
        raise TraceFileError(f"{path} is not a {kind} (not a zip archive: {e})") from None
    with z:
        infos = z.infolist()
        total = sum(i.file_size for i in infos)
        if total > lim.file_bytes:
            raise over(
                str(path), f"its {len(infos)} members together, decompressed,", total, "file_bytes", lim
            )
        try:
            info = z.getinfo(member)
        except KeyError:
            raise TraceFileError(f"{path} is not a {kind} (no {member} inside)") from None
        if info.file_size > lim.json_bytes:
            raise over(str(path), f"its {member}, decompressed,", info.file_size, "json_bytes", lim)
        try:
            raw = z.read(info)
        except _ZIP_ERRORS as e:
            raise TraceFileError(f"{path} is damaged: its {member} cannot be read ({e})") from None
        doc = parse_json(raw, f"{path} is damaged: its {member} is not JSON")
        del raw
        if type(doc) is not dict:
            raise TraceFileError(
                f"{path} is not a {kind} (its {member} holds a JSON {type(doc).__name__}, "
                f"not an object with format {fmt!r})"
            )
        if doc.get("format") != fmt:
            raise TraceFileError(
                f"{path} is not a {kind} ({member} holds format {short(doc.get('format'))}, expected {fmt!r})"
            )
        got = doc.get("version")
        what = kind.removeprefix("shardviz ")
        if type(got) is not int or got < 1:
            raise TraceFileError(
                f"{path} is damaged: its {what} format version is {short(got)}, expected a whole "
                f"number from 1 to {version}"
            )
        if got > version:
            raise TraceFileError(
                f"{path} was written by a newer shardviz ({what} format {got}; this shardviz reads "
                f"up to {version}): upgrade shardviz to open it"
            )
        yield doc, Arrays(z, path, lim)


class _Missing:
    pass


_MISSING: Any = _Missing()


def decode_trace(doc: dict[str, Any], arrays: Arrays, lim: Limits, tensor: TensorFromValues | None) -> Trace:
    """A Trace from its document (trace.json, or the ``trace`` a saved report embeds)."""

    def field(name: str, decode: Any, *args: Any, default: Any = _MISSING) -> Any:
        if name not in doc:
            if default is _MISSING:
                raise Bad("a value (the field is missing)", None, name)
            return default
        try:
            return decode(doc[name], *args)
        except Bad as e:
            raise e.at(name) from None

    ws = doc.get("world_size")
    if type(ws) is int and ws > lim.world_size:
        raise over(str(arrays.path), "its world_size", ws, "world_size", lim)
    world_size = field("world_size", integer, 1)
    trace = Trace(world_size, field("backend", string), field("values", _value_policy))
    trace.values_dropped_from = field("values_dropped_from", opt_integer, default=None)
    trace.complete = field("complete", boolean, default=True)
    trace.meshes = field("meshes", _decode_meshes, lim.world_size, default=None) or []
    trace.notes = field("notes", _decode_notes, default=None) or []
    meta = field("meta", _opt_json_object, default=None)
    trace.meta = meta if meta is not None else {}
    events = field("events", _decode_events, arrays, world_size)
    trace.events = events
    memory = field("memory", _decode_memory, arrays, world_size, {e.id for e in events}, default=None)
    trace.memory = memory
    results = field("results", _decode_results, arrays, world_size, tensor, default=None)
    trace.results = results
    start = trace.meta.get("start_event")
    if start is not None and (type(start) is not int or not any(e.id == start for e in events)):
        raise Bad("the id of an event of this trace", start, "start_event").at("meta")
    return trace


def _value_policy(v: Any) -> str | int:
    if v in ("all", "none") or (type(v) is int and v >= 0):
        return v
    raise Bad('"all", "none" or a byte budget (an integer >= 0)', v)


def _opt_json_object(v: Any) -> dict[str, Any] | None:
    if v is None:
        return None
    return plain_json(mapping(v))


def _decode_notes(v: Any) -> list[str]:
    out = array(v)
    for i, n in enumerate(out):
        if type(n) is not str:
            raise Bad("a string", n, i)
    return list(out)


def _decode_meshes(v: Any, max_rank: int) -> list[dict[str, Any]]:
    """The meshes a recording saw; a rank's own file may name meshes wider than its world size
    (only the merge reads them, to name mesh dims), so their ranks are checked against the cap."""
    out = array(v)
    for i, m in enumerate(out):
        try:
            mapping(m)
            mesh = checked("mesh_shape", m, shape)
            if not mesh or 0 in mesh:
                raise Bad("a mesh shape (a non-empty list of sizes >= 1)", m["mesh_shape"], "mesh_shape")
            names = m.get("mesh_dim_names")
            if names is not None and (
                type(names) is not list or len(names) != len(mesh) or any(type(n) is not str for n in names)
            ):
                raise Bad(f"null or {len(mesh)} mesh dim names (strings)", names, "mesh_dim_names")
            ranks = checked("ranks", m, rank_list, max_rank)
            if len(ranks) != math.prod(mesh):
                raise Bad(f"{math.prod(mesh)} ranks (one per mesh position)", m["ranks"], "ranks")
        except Bad as e:
            raise e.at(i) from None
    return list(out)


def _decode_events(v: Any, arrays: Arrays, world_size: int) -> list[Event]:
    out: list[Event] = []
    ctx = _Ctx(arrays, world_size, set(), {})
    for i, d in enumerate(array(v)):
        try:
            e = _decode_event(d, ctx)
        except Bad as err:
            raise err.at(i) from None
        ctx.seen.add(e.id)
        out.append(e)
    return out


def _source(v: Any) -> Source | None:
    if v is None:
        return None
    d = mapping(v)
    return Source(checked("file", d, string), checked("line", d, integer, 0), checked("text", d, string))


def _placements_list(v: Any) -> tuple[tuple[str, ...], ...]:
    if type(v) is not list:
        raise Bad("a list of placement lists", v)
    return tuple(str_tuple(x) for x in v)


def _groups(v: Any, world_size: int) -> tuple[tuple[int, ...], ...]:
    """Groups of distinct ranks of this world (they may overlap: a ring of sends pairs each rank
    with both neighbours)."""
    if type(v) is not list:
        raise Bad("a list of rank groups", v)
    out = []
    for i, g in enumerate(v):
        try:
            out.append(rank_list(g, world_size))
        except Bad as e:
            raise e.at(i) from None
    return tuple(out)


def _json_params(v: Any, ctx: _Ctx) -> dict[str, Any]:
    return plain_json(mapping(v))


@dataclass(frozen=True, slots=True)
class _Ctx:
    """What decoding an event needs besides the event: the file's arrays, the world size, the
    ids of the events before it, and the layouts decoded so far (a trace repeats a few layouts)."""

    arrays: Arrays
    world_size: int
    seen: set[int]
    layouts: dict[str, Layout]


def _decode_event(d: Any, ctx: _Ctx) -> Event:
    d = mapping(d)
    kind = d.get("kind")
    decoders = _FIELDS.get(kind) if type(kind) is str else None
    if decoders is None:
        raise Bad(f"an event kind ({', '.join(EVENT_TYPES)})", kind, "kind")
    eid = checked("id", d, integer, 0)
    if eid in ctx.seen:
        raise Bad("an id no earlier event has", eid, "id")
    kwargs: dict[str, Any] = {"id": eid}
    for name, decode in decoders.items():
        if name in d:
            try:
                kwargs[name] = decode(d[name], ctx)
            except Bad as e:
                raise e.at(name) from None
    if kind == "collective":
        for name in ("op", "impl"):
            if name not in d:
                raise Bad("a value (the field is missing)", None, name)
        root = kwargs.get("root")
        if root is not None and any(root >= len(g) for g in kwargs.get("groups", ())):
            raise Bad("null or a position within every group", root, "root")
    return EVENT_TYPES[kind](**kwargs)


def _parent(v: Any, ctx: _Ctx) -> int | None:
    if v is not None and (type(v) is not int or v not in ctx.seen):
        raise Bad("null or the id of an earlier event", v)
    return v


def _plain(decode: Any) -> Any:
    """A decoder that needs no context."""
    return lambda v, ctx: decode(v)


def _layout_or_none(v: Any, ctx: _Ctx) -> Layout | None:
    """A layout, checked once however often the trace repeats it (its JSON text is the key)."""
    if v is None:
        return None
    try:
        key = json.dumps(v, separators=(",", ":"))
    except (ValueError, RecursionError):
        return decode_layout(v)
    layout = ctx.layouts.get(key)
    if layout is None:
        layout = ctx.layouts[key] = decode_layout(v)
    return layout


def _ranks_of_world(v: Any, ctx: _Ctx) -> tuple[int, ...]:
    return rank_list(v, ctx.world_size)


def _groups_of_world(v: Any, ctx: _Ctx) -> tuple[tuple[int, ...], ...]:
    return _groups(v, ctx.world_size)


def _inputs(v: Any, ctx: _Ctx) -> PerRank:
    return _decode_per_rank(v, ctx.arrays, ctx.world_size, "input")


def _outputs(v: Any, ctx: _Ctx) -> PerRank:
    return _decode_per_rank(v, ctx.arrays, ctx.world_size, "output")


def _nbytes(v: Any, ctx: _Ctx) -> dict[int, int]:
    return _decode_nbytes(v, ctx.world_size)


# Per event kind, each field's decoder (fields a file has beyond these are ignored: a newer
# shardviz may add some).
_COMMON: dict[str, Any] = {
    "parent": _parent,
    "source": _plain(_source),
    "module": _plain(opt_string),
    "phase": _plain(opt_string),
}
_FIELDS: dict[str, dict[str, Any]] = {
    "collective": {
        **_COMMON,
        "op": _plain(string),
        "impl": _plain(string),
        "reduce_op": _plain(opt_string),
        "groups": _groups_of_world,
        "mesh_dim": _plain(lambda v: opt_integer(v, 0, MAX_DIMS)),
        "mesh_dim_name": _plain(opt_string),
        "root": _plain(opt_integer),
        "inputs": _inputs,
        "outputs": _outputs,
        "nbytes": _nbytes,
        "params": _json_params,
    },
    "redistribute": {
        **_COMMON,
        "src": _plain(str_tuple),
        "dst": _plain(str_tuple),
        "plan": _plain(string),
        "explicit": _plain(boolean),
        "before": _layout_or_none,
        "after": _layout_or_none,
    },
    "op": {
        **_COMMON,
        "name": _plain(string),
        "input_placements": _plain(_placements_list),
        "output_placements": _plain(_placements_list),
    },
    "local": {**_COMMON, "name": _plain(string), "inputs": _inputs, "outputs": _outputs},
    "compute": {
        **_COMMON,
        "name": _plain(string),
        "ranks": _ranks_of_world,
        "stage": _plain(opt_integer),
        "microbatch": _plain(opt_integer),
    },
}


def _decode_snapshot(d: Any, arrays: Arrays, what: str) -> TensorSnapshot:
    shp, dtype = fields(d, "shape", "dtype")
    shp = shape_at(shp, "shape")
    if type(dtype) is not str or not 0 < len(dtype) <= 64:
        raise Bad("a dtype name (a string)", dtype, "dtype")
    key = d.get("values")
    if key is None:
        return TensorSnapshot(shape=shp, dtype=dtype)
    try:
        values = arrays.get(key, shp, stored_dtypes(dtype), what)
    except Bad as e:
        raise e.at("values") from None
    return TensorSnapshot(shape=shp, dtype=dtype, values=values)


def _decode_per_rank(v: Any, arrays: Arrays, world_size: int, name: str) -> PerRank:
    out: PerRank = {}
    for k, s in mapping(v).items():
        try:
            r = rank_key(k, world_size)
            what = f"rank {r}'s {name}"
            if type(s) is list:
                snaps = []
                for i, x in enumerate(s):
                    try:
                        snaps.append(_decode_snapshot(x, arrays, what))
                    except Bad as e:
                        raise e.at(i) from None
                out[r] = snaps
            else:
                out[r] = _decode_snapshot(s, arrays, what)
        except Bad as e:
            raise e.at(k) from None
    return out


def _decode_nbytes(v: Any, world_size: int) -> dict[int, int]:
    out = {}
    for k, n in mapping(v).items():
        try:
            out[rank_key(k, world_size)] = integer(n, 0)
        except Bad as e:
            raise e.at(k) from None
    return out


def _decode_memory(v: Any, arrays: Arrays, world_size: int, event_ids: set[int]) -> MemoryTimeline | None:
    if v is None:
        return None
    from .memory import MemoryTimeline

    d = mapping(v)
    n = checked("world_size", d, integer, 1, world_size + 1)

    def event_list(x: Any) -> tuple[int | None, ...]:
        if type(x) is not list or any(
            e is not None and (type(e) is not int or e not in event_ids) for e in x
        ):
            raise Bad("a list of event ids of this trace (or null)", x)
        return tuple(x)

    events = checked("events", d, event_list)
    peak_event = checked("peak_event", d, event_list)
    if len(peak_event) != n:
        raise Bad(f"{n} entries (one per rank)", len(peak_event), "peak_event")

    def ints(x: Any, count: int) -> np.ndarray:
        if type(x) is not list or len(x) != count or any(type(i) is not int or i < 0 for i in x):
            raise Bad(f"a list of {count} integers >= 0", x)
        return np.asarray(x, dtype=np.int64).reshape(count)

    peak = checked("peak", d, ints, n)
    raw = d.get("bytes")
    if type(raw) is str:
        try:
            nbytes = arrays.get(raw, (len(events), n), frozenset({np.dtype(np.int64)}), "memory per rank")
        except Bad as e:
            raise e.at("bytes") from None
    else:
        if type(raw) is not list or len(raw) != len(events):
            raise Bad(f"{len(events)} rows of {n} byte counts", raw, "bytes")
        rows = []
        for i, row in enumerate(raw):
            try:
                rows.append(ints(row, n))
            except Bad as e:
                raise e.at(i).at("bytes") from None
        nbytes = np.stack(rows) if rows else np.zeros((0, n), np.int64)
    labels: dict[int, str] = {}
    for k, s in (checked("labels", d, mapping) if "labels" in d else {}).items():
        if not k.isdigit() or len(k) > 12 or type(s) is not str:
            raise Bad("an event id and its label (a string)", s, k).at("labels")
        labels[int(k)] = s
    counted = checked("counted", d, string) if "counted" in d else ""
    return MemoryTimeline(
        world_size=n,
        events=events,
        bytes=nbytes,
        peak=peak,
        peak_event=peak_event,
        counted=counted,
        labels=labels,
    )


def _decode_results(
    v: Any, arrays: Arrays, world_size: int, tensor: TensorFromValues | None
) -> dict[int, Any] | None:
    if v is None:
        return None
    out = {}
    for k, r in mapping(v).items():
        try:
            out[rank_key(k, world_size)] = _decode_result(r, arrays, MAX_DEPTH, tensor)
        except Bad as e:
            raise e.at(k) from None
    return out


_RESULT = 'one of {"json": v}, {"tuple": [...]}, {"list": [...]}, {"dict": {...}}, {"tensor": k, "dtype": d}'


def _decode_result(v: Any, arrays: Arrays, depth: int, tensor: TensorFromValues | None) -> Any:
    d = mapping(v)
    if depth <= 0:
        raise Bad(f"results nested at most {MAX_DEPTH} levels", "...")
    if len(d) == 1 and "json" in d:
        x = d["json"]
        if x is not None and type(x) not in (bool, int, float, str):
            raise Bad("a JSON scalar", x, "json")
        return x
    if len(d) == 1 and ("tuple" in d or "list" in d):
        kind = "tuple" if "tuple" in d else "list"
        items = []
        for i, x in enumerate(checked(kind, d, array)):
            try:
                items.append(_decode_result(x, arrays, depth - 1, tensor))
            except Bad as e:
                raise e.at(i).at(kind) from None
        return tuple(items) if kind == "tuple" else items
    if len(d) == 1 and "dict" in d:
        out = {}
        for k, x in checked("dict", d, mapping).items():
            try:
                out[k] = _decode_result(x, arrays, depth - 1, tensor)
            except Bad as e:
                raise e.at(k).at("dict") from None
        return out
    if len(d) != 2 or "tensor" not in d or "dtype" not in d:
        raise Bad(_RESULT, d)
    name = checked("dtype", d, string)
    if not name.isidentifier():
        raise Bad("a torch dtype name", name, "dtype")
    try:
        values = arrays.get(d["tensor"], None, stored_dtypes(name), "a result tensor")
    except Bad as e:
        raise e.at("tensor") from None
    if tensor is None:
        return values.copy()
    try:
        return tensor(values.copy(), name)
    except ValueError:
        raise Bad("a torch dtype name", name, "dtype") from None
