"""The trace file format: a zip of ``trace.json`` and ``.npy`` arrays, written and read back safely.

``save`` writes one (no pickle: every value is JSON or a numeric array). Reading a stranger's file
checks every size before anything is allocated (``shardviz.data.limits``) and each ``.npy``
header against the shape and dtype trace.json gives it (``Arrays``); ``trace_read`` decodes
trace.json's fields into a ``Trace``. A bad file is a ``TraceFileError`` naming the file, the
field and what was expected.
"""

from __future__ import annotations

import io
import json
import math
import struct
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import TraceFileError
from ..geometry.layout import Layout
from .events import DTYPE_SIZES, NUMPY_WIDENED, Event, Source, Summary, TensorSnapshot, array_of
from .limits import Bad, Limits, over

FORMAT = "shardviz-trace"
VERSION = 1


class Writer:
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


def write(
    path: str | Path,
    doc: dict[str, Any],
    arrays: Mapping[str, np.ndarray],
    *,
    member: str = "trace.json",
    fmt: str = FORMAT,
    version: int = VERSION,
) -> Path:
    """One trace file: ``doc`` as trace.json (its ``format`` and ``version`` added) and each array as
    ``arrays/<key>.npy``, never pickled. A numerics report is written the same way, as
    ``report.json`` of its own format."""
    path = Path(path)
    doc = {"format": fmt, "version": version, **doc}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr(member, json.dumps(doc, separators=(",", ":")))
        for key, arr in arrays.items():
            ab = io.BytesIO()
            np.lib.format.write_array(ab, arr, allow_pickle=False)
            z.writestr(f"arrays/{key}.npy", ab.getvalue())
    path.write_bytes(buf.getvalue())
    return path


def encode_result(value: Any, w: Writer) -> dict[str, Any] | None:
    """Tensors, JSON values, and tuples / lists / string-keyed dicts of them; None otherwise."""
    if hasattr(value, "detach") and hasattr(value, "dtype"):
        return {"tensor": w.array(array_of(value)), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, tuple | list):
        items = [encode_result(v, w) for v in value]
        if any(i is None for i in items):
            return None
        return {"tuple" if isinstance(value, tuple) else "list": items}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        enc = {k: encode_result(v, w) for k, v in value.items()}
        if any(v is None for v in enc.values()):
            return None
        return {"dict": enc}
    if value is None or isinstance(value, bool | int | float | str):
        return {"json": value}
    return None


# --- reading: the members of a trace file, each checked before it is allocated --------------------


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


def stored_dtypes(dtype: str) -> frozenset[np.dtype[Any]] | None:
    """The numpy dtypes a torch dtype's values are saved as (None: a dtype newer than the table,
    any numeric one)."""
    return _NPY_DTYPES.get(dtype.removeprefix("torch."))


class Arrays:
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
