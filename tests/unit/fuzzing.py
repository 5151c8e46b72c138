"""Hostile inputs for the loaders, made from real files: a mutator for JSON documents, zips and
``.npy`` members, zip bombs that cost nothing to make, and a harness that loads one input and
measures what it cost (time, tracemalloc peak).

A zip bomb is a deflate stream of one compressed mebibyte of zeros repeated: a full flush ends
every block on a byte boundary with a fresh dictionary, so the blocks can be concatenated, and a
1.5 GB member takes ~1.5 MB of file and no time to make.
"""

from __future__ import annotations

import copy
import io
import json
import random
import struct
import time
import tracemalloc
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardviz.errors import ShardvizError

MiB = 2**20

# --- zips written by hand ------------------------------------------------------------------------


@dataclass
class Member:
    name: str
    data: bytes  # what is stored (compressed for DEFLATED)
    size: int  # what it decompresses to
    crc: int
    method: int = zipfile.ZIP_DEFLATED
    flags: int = 0


def member(name: str, data: bytes, method: int = zipfile.ZIP_DEFLATED) -> Member:
    if method == zipfile.ZIP_DEFLATED:
        co = zlib.compressobj(6, zlib.DEFLATED, -15)
        stored = co.compress(data) + co.flush()
    else:
        stored = data
    return Member(name, stored, len(data), zlib.crc32(data), method)


_ZERO_BLOCK: bytes | None = None


def _zero_block() -> bytes:
    global _ZERO_BLOCK
    if _ZERO_BLOCK is None:
        co = zlib.compressobj(9, zlib.DEFLATED, -15)
        _ZERO_BLOCK = co.compress(b"\0" * MiB) + co.flush(zlib.Z_FULL_FLUSH)
    return _ZERO_BLOCK


def bomb(name: str, head: bytes, mebibytes: int) -> Member:
    """A member that inflates to ``head`` then ``mebibytes`` MiB of zeros, with a correct CRC."""
    co = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = co.compress(head) + co.flush(zlib.Z_FULL_FLUSH)
    tail = zlib.compressobj(9, zlib.DEFLATED, -15).flush(zlib.Z_FINISH)
    crc = zlib.crc32(head)
    zeros = b"\0" * MiB
    for _ in range(mebibytes):
        crc = zlib.crc32(zeros, crc)
    return Member(name, first + _zero_block() * mebibytes + tail, len(head) + mebibytes * MiB, crc)


def write_zip(members: list[Member]) -> bytes:
    """A zip of these members exactly as given (sizes, CRCs, flags and methods may lie)."""
    out = io.BytesIO()
    central = []
    for m in members:
        name = m.name.encode()
        offset = out.tell()
        out.write(
            struct.pack(
                "<4s5H3L2H",
                b"PK\x03\x04",
                20,
                m.flags,
                m.method,
                0,
                0x21,
                m.crc,
                len(m.data),
                m.size & 0xFFFFFFFF,
                len(name),
                0,
            )
        )
        out.write(name)
        out.write(m.data)
        central.append(
            struct.pack(
                "<4s6H3L5H2L",
                b"PK\x01\x02",
                20,
                20,
                m.flags,
                m.method,
                0,
                0x21,
                m.crc,
                len(m.data),
                m.size & 0xFFFFFFFF,
                len(name),
                0,
                0,
                0,
                0,
                0,
                offset,
            )
            + name
        )
    start = out.tell()
    for c in central:
        out.write(c)
    size = out.tell() - start
    out.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members), len(members), size, start, 0))
    return out.getvalue()


def read_zip(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {n: z.read(n) for n in z.namelist()}


def zip_of(files: dict[str, bytes]) -> bytes:
    return write_zip([member(n, d) for n, d in files.items()])


def npy(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    np.lib.format.write_array(b, a, allow_pickle=False)
    return b.getvalue()


def npy_header(shape: tuple[int, ...], descr: Any, fortran: bool = False) -> bytes:
    """A .npy header claiming any shape and dtype, written the way numpy writes one."""
    b = io.BytesIO()
    d = {"descr": descr, "fortran_order": fortran, "shape": shape}
    np.lib.format.write_array_header_1_0(b, d)
    return b.getvalue()


# --- mutating JSON -------------------------------------------------------------------------------

DEEP = "__DEEP__"  # replaced after json.dumps by text nested too deep for any parser

SWAPS: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    -4,
    99,
    10**9,
    2**63,
    10**30,
    1.5,
    -0.0,
    "x",
    "",
    "1",
    "../../etc/passwd",
    [],
    {},
    [1],
    [-1, 2**40],
    {"a": 1},
    [[[[]]]],
    DEEP,
]


def paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path into a JSON document (the root excluded)."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield (*prefix, k)
            yield from paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield (*prefix, i)
            yield from paths(v, (*prefix, i))


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def mutate_json(doc: Any, rng: random.Random) -> tuple[str, str]:
    """A mutated copy of ``doc`` as JSON text, and what was done."""
    doc = copy.deepcopy(doc)
    all_paths = list(paths(doc))
    path = rng.choice(all_paths)
    parent, key = _get(doc, path[:-1]), path[-1]
    op = rng.random()
    if op < 0.6:
        value = rng.choice(SWAPS)
        parent[key] = copy.deepcopy(value)
        what = f"{'.'.join(map(str, path))} = {value if value != DEEP else 'deep nesting'}"
    elif op < 0.7 and isinstance(parent, dict):
        del parent[key]
        what = f"del {'.'.join(map(str, path))}"
    elif op < 0.8:
        v = parent[key]
        parent[key] = [v] if rng.random() < 0.5 else {"0": v}
        what = f"{'.'.join(map(str, path))} wrapped"
    elif op < 0.9 and isinstance(parent[key], int) and not isinstance(parent[key], bool):
        parent[key] = rng.choice([-parent[key] - 1, parent[key] * 10**6, parent[key] + 1])
        what = f"{'.'.join(map(str, path))} = {parent[key]}"
    else:
        parent[key] = rng.choice([-(2**31), 2**31, 10**12, 10**9])
        what = f"{'.'.join(map(str, path))} = {parent[key]}"
    text = json.dumps(doc)
    return text.replace(json.dumps(DEEP), "[" * 100_000 + "]" * 100_000), what


def flip_bytes(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    b = bytearray(data)
    n = rng.choice([1, 1, 2, 8])
    for _ in range(n):
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    return bytes(b), f"{n} bit flip(s)"


def truncate(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    n = rng.randrange(len(data))
    return data[:n], f"truncated to {n} of {len(data)} bytes"


# --- loading one input ---------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str  # "loaded", "refused" (a ShardvizError) or the name of another exception
    message: str
    seconds: float
    peak: int  # bytes, tracemalloc
    text: str = ""  # what ``then`` returned, as text


def attempt(load: Callable[[], Any], then: Callable[[Any], Any] | None = None) -> Outcome:
    """Run ``load`` (and ``then`` on what it returns: printing the trace, say) and measure it."""
    tracemalloc.start()
    t0 = time.perf_counter()
    text = ""
    try:
        out = load()
        text = str(then(out)) if then is not None else ""
        kind, message = "loaded", ""
    except ShardvizError as e:
        kind, message = "refused", str(e)
    except RecursionError as e:  # BaseException subclasses are not caught: they mean a bug too
        kind, message = "RecursionError", str(e)[:200]
    except Exception as e:
        kind, message = type(e).__name__, str(e)[:200]
    finally:
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return Outcome(kind, message, seconds, peak, text)


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)
    return path
