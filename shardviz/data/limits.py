"""Caps on what loading a file may cost, and the checked reads that enforce them.

A trace file, a job folder or a Flight Recorder dump may come from a stranger. A few kilobytes
of zip can inflate to gigabytes, a JSON number can claim a billion ranks, a path can name
``/dev/zero``. Every loader reads through here, so that any input is either loaded or refused
with a ``TraceFileError`` naming the file, the field and what was expected — in bounded time and
memory. The caps are generous for real files and each says how to raise it.

Caps, from the strongest: a keyword of ``sv.load`` (``max_member_bytes=...``), the environment
(``SHARDVIZ_MAX_MEMBER_BYTES=2GiB``), then ``DEFAULTS`` (replace it with ``dataclasses.replace``
to change them for the whole process).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ShardvizError, TraceFileError
from .describe import bytes_text


class LimitError(TraceFileError):
    """A file asks for more than a loading cap allows; the message names the cap and how to raise it."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What one load may cost. Sizes are bytes after decompression."""

    # One array of a trace file (a snapshot's values, a result tensor, the memory timeline).
    member_bytes: int = 2**30
    # Everything inside one trace file together (its JSON and all its arrays).
    file_bytes: int = 4 * 2**30
    # One JSON document: a trace file's trace.json, one Flight Recorder dump. Parsing JSON takes
    # up to ~20x its size in memory, hence a smaller cap than for arrays.
    json_bytes: int = 256 * 2**20
    # Ranks: a world size, and any rank number a file names.
    world_size: int = 2**20


DEFAULTS = Limits()

# Per cap: the keyword of sv.load, the environment variable, the CLI flag.
KEYWORDS = {f.name: f"max_{f.name}" for f in dataclasses.fields(Limits)}
ENV = {f.name: f"SHARDVIZ_MAX_{f.name.upper()}" for f in dataclasses.fields(Limits)}
FLAGS = {f.name: f"--max-{f.name.replace('_', '-')}" for f in dataclasses.fields(Limits)}

WHAT = {
    "member_bytes": "one array of a trace file",
    "file_bytes": "all of one trace file, decompressed",
    "json_bytes": "one JSON document (a trace file's trace.json, a Flight Recorder dump)",
    "world_size": "the number of ranks",
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str, name: str = "size") -> int:
    """``"1048576"``, ``"512MiB"``, ``"2G"`` (powers of 1024) as an int; an error says what is
    accepted."""
    m = _SIZE.match(str(text))
    if not m:
        raise ShardvizError(
            f"{name}={text!r} is not a size: write a number of bytes, optionally with a unit "
            "(512MiB, 2GiB, 1T; powers of 1024)"
        )
    return int(float(m.group(1)) * 1024 ** _UNITS[m.group(2).lower()])


def resolve(limits: Limits | None = None, **caps: int | str | None) -> Limits:
    """The caps of one load: ``caps`` (``max_member_bytes=...``; None keeps the next source),
    else the environment, else ``limits`` (default: ``DEFAULTS``)."""
    base = limits if limits is not None else DEFAULTS
    out = {}
    for f in dataclasses.fields(Limits):
        value: Any = caps.pop(KEYWORDS[f.name], None)
        source = KEYWORDS[f.name]
        if value is None and os.environ.get(ENV[f.name]):
            value, source = os.environ[ENV[f.name]], ENV[f.name]
        if value is None:
            value = getattr(base, f.name)
        if isinstance(value, str):
            value = parse_size(value, source)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ShardvizError(f"{source}={value!r}: a cap is a positive whole number")
        out[f.name] = value
    if caps:
        raise TypeError(f"unknown cap(s) {sorted(caps)}; the caps are {sorted(KEYWORDS.values())}")
    return Limits(**out)


def over(where: str, what: str, amount: int, cap: str, limits: Limits) -> LimitError:
    """The error for ``amount`` past cap ``cap``, saying how to raise it."""
    value = getattr(limits, cap)
    shown = bytes_text if cap.endswith("bytes") else str
    return LimitError(
        f"{where}: {what} is {shown(amount)}, over the cap of {shown(value)} for {WHAT[cap]}. If the "
        f"file is yours and you expect it, raise the cap: sv.load(path, {KEYWORDS[cap]}=...), the "
        f"environment variable {ENV[cap]}, or {FLAGS[cap]} in python -m shardviz"
    )


def read_file(path: Path, cap: int, cap_name: str, limits: Limits, what: str) -> bytes:
    """A regular file's bytes, refused past ``cap`` before reading (and again while reading, for a
    file that grows). Devices, pipes and folders are refused: ``/dev/zero`` never ends."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise TraceFileError(f"{path} is not a regular file: {what} is read from regular files only")
            if st.st_size > cap:
                raise over(str(path), f"the {what}", st.st_size, cap_name, limits)
            data = f.read(min(st.st_size, cap) + 1)  # read(n) allocates n bytes up front
    except IsADirectoryError:
        raise TraceFileError(f"{path} is a folder, not {what}") from None
    if len(data) > cap:
        raise over(str(path), f"the {what}", len(data), cap_name, limits)
    return data


def read_head(path: Path, n: int) -> bytes:
    """The first ``n`` bytes of a file (what tells a trace from a dump), never more."""
    with open(path, "rb") as f:
        return f.read(n)


def parse_json(data: bytes | str, where: str) -> Any:
    """JSON as data; bad JSON, and nesting too deep for the parser, are a TraceFileError."""
    try:
        return json.loads(data)
    except RecursionError:
        raise TraceFileError(f"{where}: the JSON nests too deep to be a shardviz or torch file") from None
    except ValueError as e:  # UnicodeDecodeError included
        raise TraceFileError(f"{where}: bad JSON ({e})") from None


# --- field checks ------------------------------------------------------------------------------
# Loaders check each field as they decode it. A failed check raises Bad; each enclosing decoder
# prepends its own part of the field's path on the way out, so the valid path pays nothing for
# the error message.

# Dimensions of one tensor shape, and levels of free-form JSON (meta, params, results).
MAX_DIMS = 64
MAX_DEPTH = 32


class Bad(Exception):
    """A field that is not what the format says: ``expected`` and the value ``got``."""

    def __init__(self, expected: str, got: Any, part: str | int | None = None) -> None:
        super().__init__(expected)
        self.expected = expected
        self.got = got
        self.path: list[str | int] = [] if part is None else [part]

    def at(self, part: str | int) -> Bad:
        self.path.insert(0, part)
        return self

    def field(self) -> str:
        out = ""
        for p in self.path:
            out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
        return out or "(the document)"

    def error(self, where: str, doc: str) -> TraceFileError:
        return TraceFileError(
            f"{where}: field {self.field()} of {doc}: expected {self.expected}, got {short(self.got)}"
        )


def short(v: Any, n: int = 80) -> str:
    """A value for an error message: its repr, cut short, with its type when that is the issue."""
    try:
        text = json.dumps(v)
    except (TypeError, ValueError, RecursionError):
        text = repr(v)
    if len(text) > n:
        text = text[: n - 3] + "..."
    return f"{type(v).__name__} {text}" if isinstance(v, dict | list) else text


def integer(v: Any, lo: int | None = 0, hi: int | None = None, what: str = "") -> int:
    """An int (never a bool or a float) in [lo, hi)."""
    if type(v) is not int or (lo is not None and v < lo) or (hi is not None and v >= hi):
        if hi is not None:
            raise Bad(what or f"an integer in {lo}..{hi - 1}", v)
        raise Bad(what or (f"an integer >= {lo}" if lo is not None else "an integer"), v)
    return v


def opt_integer(v: Any, lo: int | None = 0, hi: int | None = None) -> int | None:
    return None if v is None else integer(v, lo, hi)


def string(v: Any) -> str:
    if type(v) is not str:
        raise Bad("a string", v)
    return v


def opt_string(v: Any) -> str | None:
    return None if v is None else string(v)


def boolean(v: Any) -> bool:
    if type(v) is not bool:
        raise Bad("true or false", v)
    return v


def number(v: Any) -> float:
    if type(v) not in (int, float):
        raise Bad("a number", v)
    return float(v)


def mapping(v: Any) -> dict[str, Any]:
    if type(v) is not dict:
        raise Bad("an object", v)
    return v


def array(v: Any) -> list[Any]:
    if type(v) is not list:
        raise Bad("a list", v)
    return v


def shape(v: Any) -> tuple[int, ...]:
    """A tensor shape: at most MAX_DIMS sizes >= 0 whose product stays below 2**63."""
    if type(v) is not list or len(v) > MAX_DIMS:
        raise Bad(f"a shape (a list of at most {MAX_DIMS} integers >= 0)", v)
    for d in v:
        if type(d) is not int or d < 0:
            raise Bad("a shape (a list of integers >= 0)", v)
    if len(v) > 1 and math.prod(v) >= 2**63:
        raise Bad("a shape of fewer than 2**63 elements", v)
    return tuple(v)


def rank_key(k: str, world_size: int) -> int:
    """A rank written as a JSON object key ("3")."""
    if not k.isdigit() or len(k) > 12 or int(k) >= world_size:
        raise Bad(f"a rank in 0..{world_size - 1} as an object key", k)
    return int(k)


def plain_json(v: Any, depth: int = MAX_DEPTH) -> Any:
    """Free-form JSON (meta, params) nested at most ``depth`` levels: views and merges walk it."""
    if type(v) in (dict, list):
        if depth <= 0:
            raise Bad(f"JSON nested at most {MAX_DEPTH} levels", "...")
        items = v.items() if type(v) is dict else enumerate(v)
        for k, x in items:
            if type(x) in (dict, list):
                try:
                    plain_json(x, depth - 1)
                except Bad as e:
                    raise e.at(k) from None
    return v
