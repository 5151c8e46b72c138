"""Reading a trace file (``trace.save``'s zip of trace.json and ``.npy`` arrays), for a stranger's file.

Every size is checked before anything is allocated (``shardviz.limits``), each ``.npy`` header
against the shape and dtype trace.json gives it, and every field of trace.json as it is decoded:
types, ranges, ranks within the world size, distinct ranks in a group, parents that come before
their children, nesting depth. A bad file is a ``TraceFileError`` naming the file, the field and
what was expected; no pickle, no code runs.
"""

from __future__ import annotations

import io
import json
import math
import stat
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import TraceFileError
from .layout import Layout, ShardInfo
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
from .trace import (
    DTYPE_SIZES,
    EVENT_TYPES,
    FORMAT,
    NUMPY_WIDENED,
    VERSION,
    Event,
    PerRank,
    Source,
    TensorSnapshot,
    Trace,
)

if TYPE_CHECKING:
    from .memory import MemoryTimeline

# Errors the zip and zlib layers raise on damaged bytes (an encrypted member: RuntimeError; an
# unknown compression method: NotImplementedError).
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    zlib.error,
    EOFError,
    OSError,
    ValueError,
    struct.error,
    OverflowError,
    NotImplementedError,
    RuntimeError,
)

# numpy dtypes a snapshot's values may be stored as: what numpy computes with, nothing with
# fields, objects (pickle) or text.
_NUMERIC_KINDS = frozenset("biufc")


def _numpy_dtypes(name: str) -> frozenset[np.dtype[Any]]:
    """The dtype itself where numpy has it, and the one it is widened to (bfloat16 -> float32)."""
    names = {name, NUMPY_WIDENED.get(name, name)}
    return frozenset(np.dtype(n) for n in names if isinstance(getattr(np, n, None), type))


_NPY_DTYPES = {name: _numpy_dtypes(name) for name in DTYPE_SIZES}


def _stored_dtypes(dtype: str) -> frozenset[np.dtype[Any]] | None:
    """The numpy dtypes a torch dtype's values are saved as (None: a dtype newer than the table,
    any numeric one)."""
    return _NPY_DTYPES.get(dtype.removeprefix("torch."))


def load_trace(path: str | Path, *, limits: Limits | None = None) -> Trace:
    """Read a trace written by ``trace.save`` (``limits``: default ``shardviz.limits.resolve()``)."""
    path = Path(path)
    lim = limits if limits is not None else resolve()
    try:
        st = path.stat()
    except FileNotFoundError:
        raise
    except OSError as e:
        raise TraceFileError(f"{path} cannot be read ({e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise TraceFileError(f"{path} is a folder, not a shardviz trace file")
    if not stat.S_ISREG(st.st_mode):
        raise TraceFileError(f"{path} is not a regular file, so not a shardviz trace")
    try:
        z = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise
    except _ZIP_ERRORS as e:
        raise TraceFileError(f"{path} is not a shardviz trace (not a zip archive: {e})") from None
    with z:
        infos = z.infolist()
        total = sum(i.file_size for i in infos)
        if total > lim.file_bytes:
            raise over(
                str(path), f"its {len(infos)} members together, decompressed,", total, "file_bytes", lim
            )
        try:
            info = z.getinfo("trace.json")
        except KeyError:
            raise TraceFileError(f"{path} is not a shardviz trace (no trace.json inside)") from None
        if info.file_size > lim.json_bytes:
            raise over(str(path), "its trace.json, decompressed,", info.file_size, "json_bytes", lim)
        try:
            raw = z.read(info)
        except _ZIP_ERRORS as e:
            raise TraceFileError(f"{path} is damaged: its trace.json cannot be read ({e})") from None
        doc = parse_json(raw, f"{path} is damaged: its trace.json is not JSON")
        del raw
        if type(doc) is not dict:
            raise TraceFileError(
                f"{path} is not a shardviz trace (its trace.json holds a JSON {type(doc).__name__}, "
                f"not an object with format {FORMAT!r})"
            )
        if doc.get("format") != FORMAT:
            raise TraceFileError(
                f"{path} is not a shardviz trace (trace.json holds format {short(doc.get('format'))}, "
                f"expected {FORMAT!r})"
            )
        version = doc.get("version")
        if type(version) is not int or version < 1:
            raise TraceFileError(
                f"{path} is damaged: its trace format version is {short(version)}, expected a whole "
                f"number from 1 to {VERSION}"
            )
        if version > VERSION:
            raise TraceFileError(
                f"{path} was written by a newer shardviz (trace format {version}; this shardviz reads "
                f"up to {VERSION}): upgrade shardviz to open it"
            )
        arrays = _Arrays(z, path, lim)
        try:
            return _decode_trace(doc, arrays, lim)
        except Bad as e:
            raise e.error(str(path), "trace.json") from None


class _Arrays:
    """The ``.npy`` members of an open trace file, each read once, checked before allocating."""

    def __init__(self, z: zipfile.ZipFile, path: Path, limits: Limits) -> None:
        self.z = z
        self.path = path
        self.limits = limits
        self.cache: dict[str, np.ndarray] = {}

    def get(
        self,
        key: Any,
        shape: tuple[int, ...] | None = None,
        dtypes: frozenset[np.dtype[Any]] | None = None,
        what: str = "",
    ) -> np.ndarray:
        """Array ``key``, which must have ``shape`` and one of ``dtypes`` (None: any shape / any
        numeric dtype); a failed check raises Bad for the field that names the key."""
        if type(key) is not str or len(key) > 64:
            raise Bad("the name of an array (a string)", key)
        a = self.cache.get(key)
        if a is None:
            a = self.cache[key] = self._read(key, shape, dtypes, what)
        if shape is not None and a.shape != shape:
            if not _scalar(shape, a.shape):
                raise Bad(
                    f"an array of shape {list(shape)} ({what}), array {key} has shape {list(a.shape)}", key
                )
            a = a.reshape(())
        if dtypes is not None and a.dtype not in dtypes:
            raise Bad(f"an array of {_dtypes_text(dtypes)} ({what}), array {key} holds {a.dtype}", key)
        return a

    def _read(
        self, key: str, shape: tuple[int, ...] | None, dtypes: frozenset[np.dtype[Any]] | None, what: str
    ) -> np.ndarray:
        name = f"arrays/{key}.npy"
        where = f"{self.path}: array {key}"
        try:
            info = self.z.getinfo(name)
        except KeyError:
            raise TraceFileError(f"{self.path} is damaged: array {key} is missing") from None
        if info.file_size > self.limits.member_bytes:
            raise over(where, "the array, decompressed,", info.file_size, "member_bytes", self.limits)
        try:
            with self.z.open(info) as f:
                # A small array is read whole (one call); a large one header first, then in pieces
                # straight into the array, so that its bytes are never held twice.
                small = info.file_size <= _SMALL_ARRAY
                head = f.read(info.file_size if small else _HEADER_MAX)
                got_shape, fortran, dtype, offset = _npy_header(head, where)
                _check_header(where, got_shape, dtype, shape, dtypes, what)
                count = math.prod(got_shape)
                nbytes = count * dtype.itemsize
                if nbytes != info.file_size - offset:
                    raise TraceFileError(
                        f"{where} is damaged: its header says {list(got_shape)} {dtype} ({nbytes} bytes), "
                        f"its data has {info.file_size - offset} bytes"
                    )
                out = np.empty(count, dtype=dtype)
                view = out.view(np.uint8).reshape(-1) if nbytes else np.empty(0, np.uint8)
                pos = min(len(head) - offset, nbytes)
                view[:pos] = np.frombuffer(head, np.uint8, pos, offset)
                while pos < nbytes:
                    n = f.readinto(view[pos : pos + 2**22])  # type: ignore[attr-defined]
                    if not n:
                        raise TraceFileError(f"{where} is damaged: its data ends early")
                    pos += n
        except TraceFileError:
            raise
        except _ZIP_ERRORS as e:
            raise TraceFileError(f"{where} cannot be read ({type(e).__name__}: {e})") from None
        return out.reshape(got_shape, order="F" if fortran else "C")


_SMALL_ARRAY = 2**20  # bytes: read in one piece
_HEADER_MAX = 65536 + 12  # numpy's own readers refuse longer headers
# Parsed .npy headers by their bytes: the arrays of one trace share a few shapes and dtypes, and
# numpy parses a header with ast.literal_eval.
_HEADERS: dict[bytes, tuple[tuple[int, ...], bool, np.dtype[Any]]] = {}


def _npy_header(head: bytes, where: str) -> tuple[tuple[int, ...], bool, np.dtype[Any], int]:
    """Shape, Fortran order, dtype and data offset of a .npy member from its first bytes."""
    if head[:6] != b"\x93NUMPY" or len(head) < 10:
        raise TraceFileError(f"{where} cannot be read: it is not a .npy array")
    major, minor = head[6], head[7]
    if (major, minor) == (1, 0):
        offset = 10 + struct.unpack("<H", head[8:10])[0]
    elif (major, minor) == (2, 0) and len(head) >= 12:
        offset = 12 + struct.unpack("<I", head[8:12])[0]
    else:
        raise TraceFileError(f"{where} is a .npy of format {major}.{minor}; shardviz writes 1.0 and 2.0")
    if offset > len(head):
        raise TraceFileError(f"{where} cannot be read: its .npy header is cut short or too long")
    key = head[:offset]
    parsed = _HEADERS.get(key)
    if parsed is None:
        f = io.BytesIO(key[8:])
        read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        got_shape, fortran, dtype = read(f)
        parsed = (tuple(got_shape), bool(fortran), dtype)
        if len(_HEADERS) < 4096:
            _HEADERS[key] = parsed
    return (*parsed, offset)


def _check_header(
    where: str,
    got_shape: tuple[int, ...],
    dtype: np.dtype[Any],
    shape: tuple[int, ...] | None,
    dtypes: frozenset[np.dtype[Any]] | None,
    what: str,
) -> None:
    """A .npy header against what trace.json says of the array, before anything is allocated."""
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise TraceFileError(
            f"{where} cannot be read: it holds {dtype} values (objects, records or sub-arrays); "
            "shardviz stores plain numbers only, and never unpickles"
        )
    if dtype.kind not in _NUMERIC_KINDS:
        raise TraceFileError(f"{where} cannot be read: it holds {dtype} values, not numbers")
    if shape is not None and got_shape != shape and not _scalar(shape, got_shape):
        raise TraceFileError(
            f"{where} has shape {list(got_shape)}, but trace.json says {list(shape)} ({what})"
        )
    if dtypes is not None and dtype not in dtypes:
        raise TraceFileError(
            f"{where} holds {dtype} values, but trace.json expects {_dtypes_text(dtypes)} ({what})"
        )


def _scalar(shape: tuple[int, ...], got: tuple[int, ...]) -> bool:
    """A 0-d tensor's values as one element: how files written before shardviz kept 0-d arrays
    0-d saved them (read back 0-d)."""
    return shape == () and got == (1,)


def _dtypes_text(dtypes: frozenset[np.dtype[Any]]) -> str:
    return " or ".join(sorted(str(d) for d in dtypes))


class _Missing:
    pass


_MISSING: Any = _Missing()


def _decode_trace(doc: dict[str, Any], arrays: _Arrays, lim: Limits) -> Trace:
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
    results = field("results", _decode_results, arrays, world_size, default=None)
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
            mesh = _checked("mesh_shape", m, shape)
            if not mesh or 0 in mesh:
                raise Bad("a mesh shape (a non-empty list of sizes >= 1)", m["mesh_shape"], "mesh_shape")
            names = m.get("mesh_dim_names")
            if names is not None and (
                type(names) is not list or len(names) != len(mesh) or any(type(n) is not str for n in names)
            ):
                raise Bad(f"null or {len(mesh)} mesh dim names (strings)", names, "mesh_dim_names")
            ranks = _checked("ranks", m, _rank_list, max_rank)
            if len(ranks) != math.prod(mesh):
                raise Bad(f"{math.prod(mesh)} ranks (one per mesh position)", m["ranks"], "ranks")
        except Bad as e:
            raise e.at(i) from None
    return list(out)


def _checked(name: str, d: dict[str, Any], decode: Any, *args: Any) -> Any:
    """``decode(d[name])``, its errors naming the field."""
    if name not in d:
        raise Bad("a value (the field is missing)", None, name)
    try:
        return decode(d[name], *args)
    except Bad as e:
        raise e.at(name) from None


def _rank_list(v: Any, world_size: int) -> tuple[int, ...]:
    """Distinct ranks of this world."""
    if type(v) is not list:
        raise Bad(f"a list of ranks in 0..{world_size - 1}", v)
    for r in v:
        if type(r) is not int or not 0 <= r < world_size:
            raise Bad(f"a list of ranks in 0..{world_size - 1}", v)
    t = tuple(v)
    if len(set(t)) != len(t):
        raise Bad("a list of distinct ranks", v)
    return t


def _decode_events(v: Any, arrays: _Arrays, world_size: int) -> list[Event]:
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
    return Source(_checked("file", d, string), _checked("line", d, integer, 0), _checked("text", d, string))


def _str_tuple(v: Any) -> tuple[str, ...]:
    if type(v) is not list or any(type(x) is not str for x in v):
        raise Bad("a list of strings", v)
    return tuple(v)


def _placements_list(v: Any) -> tuple[tuple[str, ...], ...]:
    if type(v) is not list:
        raise Bad("a list of placement lists", v)
    return tuple(_str_tuple(x) for x in v)


def _groups(v: Any, world_size: int) -> tuple[tuple[int, ...], ...]:
    """Groups of distinct ranks of this world (they may overlap: a ring of sends pairs each rank
    with both neighbours)."""
    if type(v) is not list:
        raise Bad("a list of rank groups", v)
    out = []
    for i, g in enumerate(v):
        try:
            out.append(_rank_list(g, world_size))
        except Bad as e:
            raise e.at(i) from None
    return tuple(out)


def _json_params(v: Any, ctx: _Ctx) -> dict[str, Any]:
    return plain_json(mapping(v))


@dataclass(frozen=True, slots=True)
class _Ctx:
    """What decoding an event needs besides the event: the file's arrays, the world size, the
    ids of the events before it, and the layouts decoded so far (a trace repeats a few layouts)."""

    arrays: _Arrays
    world_size: int
    seen: set[int]
    layouts: dict[str, Layout]


def _decode_event(d: Any, ctx: _Ctx) -> Event:
    d = mapping(d)
    kind = d.get("kind")
    decoders = _FIELDS.get(kind) if type(kind) is str else None
    if decoders is None:
        raise Bad(f"an event kind ({', '.join(EVENT_TYPES)})", kind, "kind")
    eid = _checked("id", d, integer, 0)
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
        return _decode_layout(v)
    layout = ctx.layouts.get(key)
    if layout is None:
        layout = ctx.layouts[key] = _decode_layout(v)
    return layout


def _ranks_of_world(v: Any, ctx: _Ctx) -> tuple[int, ...]:
    return _rank_list(v, ctx.world_size)


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
        "src": _plain(_str_tuple),
        "dst": _plain(_str_tuple),
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


def _decode_snapshot(d: Any, arrays: _Arrays, what: str) -> TensorSnapshot:
    shp, dtype = _fields(d, "shape", "dtype")
    shp = _shape_at(shp, "shape")
    if type(dtype) is not str or not 0 < len(dtype) <= 64:
        raise Bad("a dtype name (a string)", dtype, "dtype")
    key = d.get("values")
    if key is None:
        return TensorSnapshot(shape=shp, dtype=dtype)
    try:
        values = arrays.get(key, shp, _stored_dtypes(dtype), what)
    except Bad as e:
        raise e.at("values") from None
    return TensorSnapshot(shape=shp, dtype=dtype, values=values)


def _decode_per_rank(v: Any, arrays: _Arrays, world_size: int, name: str) -> PerRank:
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


def _decode_layout(v: Any) -> Layout:
    """A Layout from its dict, checked so that views can draw it: placements that parse, one per
    mesh dim; shards with coordinates on the mesh and indices within the global shape."""
    from .placement import parse

    d = mapping(v)
    gshape = _checked("global_shape", d, shape)
    mesh = _checked("mesh_shape", d, shape)
    if not mesh or 0 in mesh:
        raise Bad("a mesh shape (a non-empty list of sizes >= 1)", d.get("mesh_shape"), "mesh_shape")
    placements = _checked("placements", d, _str_tuple)
    if len(placements) != len(mesh):
        raise Bad(f"{len(mesh)} placements (one per mesh dim)", list(placements), "placements")
    for i, p in enumerate(placements):
        try:
            parse(p)
        except (TypeError, ValueError):
            raise Bad('a placement ("S(d)", "R", "P(op)", "_S(d,sf=k)")', p, i).at("placements") from None
    names = d.get("mesh_dim_names")
    if names is not None:
        names = _checked("mesh_dim_names", d, _str_tuple)
        if len(names) != len(mesh):
            raise Bad(f"null or {len(mesh)} mesh dim names", list(names), "mesh_dim_names")
    shards = []
    ranks: set[int] = set()
    for i, s in enumerate(array(_checked("shards", d, lambda x: x))):
        try:
            shards.append(_decode_shard(s, gshape, mesh))
        except Bad as e:
            raise e.at(i).at("shards") from None
        ranks.add(shards[-1].rank)
    if len(ranks) != len(shards):
        raise Bad("shards of distinct ranks", "...", "shards")
    groups: tuple[tuple[int, ...], ...] = ()
    if d.get("groups"):
        groups = tuple(tuple(g) for g in _checked("groups", d, _layout_groups, math.prod(mesh)))
    per = math.prod(mesh)
    if len(shards) != per * max(1, len(groups)):
        raise Bad(
            f"{per * max(1, len(groups))} shards (one per mesh position and group)", len(shards), "shards"
        )
    mesh_ranks = d.get("mesh_ranks")
    if mesh_ranks:
        mesh_ranks = _checked("mesh_ranks", d, _layout_group, per)
    return Layout(
        global_shape=gshape,
        dtype=_checked("dtype", d, string),
        mesh_shape=mesh,
        mesh_dim_names=names,
        placements=placements,
        shards=tuple(shards),
        mesh_ranks=tuple(mesh_ranks) if mesh_ranks else tuple(s.rank for s in shards),
        groups=groups,
    )


def _layout_group(v: Any, size: int) -> tuple[int, ...]:
    if type(v) is not list or len(v) != size:
        raise Bad(f"{size} ranks", v)
    return _rank_list(v, 2**62)


def _layout_groups(v: Any, size: int) -> list[tuple[int, ...]]:
    return [_layout_group(g, size) for g in array(v)]


def _fields(d: Any, *names: str) -> list[Any]:
    """The named fields of an object (the hot path of decoding: no call per field)."""
    if type(d) is not dict:
        raise Bad("an object", d)
    try:
        return [d[n] for n in names]
    except KeyError as e:
        raise Bad("a value (the field is missing)", None, e.args[0]) from None


def _shape_at(v: Any, name: str) -> tuple[int, ...]:
    try:
        return shape(v)
    except Bad as e:
        raise e.at(name) from None


def _decode_shard(v: Any, gshape: tuple[int, ...], mesh: tuple[int, ...]) -> ShardInfo:
    rank, coord, offset, local, runs, partial = _fields(
        v, "rank", "coord", "offset", "shape", "indices", "partial"
    )
    group = v.get("group", 0)
    if type(rank) is not int or not 0 <= rank < 2**62:
        raise Bad("a rank (an integer >= 0)", rank, "rank")
    if type(partial) is not bool:
        raise Bad("true or false", partial, "partial")
    if type(group) is not int or group < 0:
        raise Bad("an integer >= 0", group, "group")
    coord = _shape_at(coord, "coord")
    if len(coord) != len(mesh) or any(c >= m for c, m in zip(coord, mesh, strict=True)):
        raise Bad(f"a coordinate on mesh {list(mesh)}", list(coord), "coord")
    offset = _shape_at(offset, "offset")
    local = _shape_at(local, "shape")
    n = len(gshape)
    if len(offset) != n or len(local) != n:
        raise Bad(f"{n} sizes (one per tensor dim)", list(local), "shape")
    if type(runs) is not list or len(runs) != n:
        raise Bad(f"{n} index lists (one per tensor dim)", runs, "indices")
    indices = []
    for dim in range(n):
        rs, size = runs[dim], gshape[dim]
        if type(rs) is not list:
            raise Bad("a list of [start, stop, step] ranges", rs, dim).at("indices")
        out = []
        count = 0
        for r in rs:
            if type(r) is not list or len(r) != 3:
                raise Bad("[start, stop, step]", r, dim).at("indices")
            start, stop, step = r
            if (
                type(start) is not int
                or type(stop) is not int
                or type(step) is not int
                or not 0 <= start <= stop <= size
                or step < 1
            ):
                raise Bad(f"[start, stop, step] with 0 <= start <= stop <= {size}, step >= 1", r, dim).at(
                    "indices"
                )
            run = range(start, stop, step)
            count += len(run)
            out.append(run)
        if count != local[dim] or offset[dim] > size:
            raise Bad(
                f"indices as many as the shard's size {local[dim]} along dim {dim}, an offset within {size}",
                rs,
                dim,
            ).at("indices")
        indices.append(tuple(out))
    return ShardInfo(
        rank=rank,
        coord=coord,
        offset=offset,
        shape=local,
        indices=tuple(indices),
        partial=partial,
        group=group,
    )


def _decode_memory(v: Any, arrays: _Arrays, world_size: int, event_ids: set[int]) -> MemoryTimeline | None:
    if v is None:
        return None
    from .memory import MemoryTimeline

    d = mapping(v)
    n = _checked("world_size", d, integer, 1, world_size + 1)

    def event_list(x: Any) -> tuple[int | None, ...]:
        if type(x) is not list or any(
            e is not None and (type(e) is not int or e not in event_ids) for e in x
        ):
            raise Bad("a list of event ids of this trace (or null)", x)
        return tuple(x)

    events = _checked("events", d, event_list)
    peak_event = _checked("peak_event", d, event_list)
    if len(peak_event) != n:
        raise Bad(f"{n} entries (one per rank)", len(peak_event), "peak_event")

    def ints(x: Any, count: int) -> np.ndarray:
        if type(x) is not list or len(x) != count or any(type(i) is not int or i < 0 for i in x):
            raise Bad(f"a list of {count} integers >= 0", x)
        return np.asarray(x, dtype=np.int64).reshape(count)

    peak = _checked("peak", d, ints, n)
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
    for k, s in (_checked("labels", d, mapping) if "labels" in d else {}).items():
        if not k.isdigit() or len(k) > 12 or type(s) is not str:
            raise Bad("an event id and its label (a string)", s, k).at("labels")
        labels[int(k)] = s
    counted = _checked("counted", d, string) if "counted" in d else ""
    return MemoryTimeline(
        world_size=n,
        events=events,
        bytes=nbytes,
        peak=peak,
        peak_event=peak_event,
        counted=counted,
        labels=labels,
    )


def _decode_results(v: Any, arrays: _Arrays, world_size: int) -> dict[int, Any] | None:
    if v is None:
        return None
    out = {}
    for k, r in mapping(v).items():
        try:
            out[rank_key(k, world_size)] = _decode_result(r, arrays, MAX_DEPTH)
        except Bad as e:
            raise e.at(k) from None
    return out


_RESULT = 'one of {"json": v}, {"tuple": [...]}, {"list": [...]}, {"dict": {...}}, {"tensor": k, "dtype": d}'


def _decode_result(v: Any, arrays: _Arrays, depth: int) -> Any:
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
        for i, x in enumerate(_checked(kind, d, array)):
            try:
                items.append(_decode_result(x, arrays, depth - 1))
            except Bad as e:
                raise e.at(i).at(kind) from None
        return tuple(items) if kind == "tuple" else items
    if len(d) == 1 and "dict" in d:
        out = {}
        for k, x in _checked("dict", d, mapping).items():
            try:
                out[k] = _decode_result(x, arrays, depth - 1)
            except Bad as e:
                raise e.at(k).at("dict") from None
        return out
    if len(d) != 2 or "tensor" not in d or "dtype" not in d:
        raise Bad(_RESULT, d)
    import torch

    name = _checked("dtype", d, string)
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise Bad("a torch dtype name", name, "dtype")
    try:
        values = arrays.get(d["tensor"], None, _stored_dtypes(name), "a result tensor")
    except Bad as e:
        raise e.at("tensor") from None
    return torch.from_numpy(values.copy()).to(dtype)
