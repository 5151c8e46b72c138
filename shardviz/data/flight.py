"""PyTorch Flight Recorder dumps, aligned across ranks into one trace.

The Flight Recorder keeps, in every process, a ring buffer of the last collectives it issued: for
each one its process group (name and description), its sequence number in that group, the op
(``nccl:all_reduce``, ``gloo:broadcast``...), input and output sizes and dtypes, a state
(``scheduled`` / ``started`` / ``completed``; gloo only says ``scheduled``) and — in torch's pickle
form only — the Python stack. Enable it with ``TORCH_FR_BUFFER_SIZE=2000`` (older:
``TORCH_NCCL_TRACE_BUFFER_SIZE``) before the process group is made; it records NCCL and, in torch
2.13 and 2.15, gloo collectives too. Dump each rank with ``shardviz.capture.flight.dump(folder)`` (JSON,
``torch._C._distributed_c10d._dump_fr_trace_json``), or let NCCL dump on a timeout
(``TORCH_NCCL_DUMP_ON_TIMEOUT=1``, files named ``$TORCH_FR_DUMP_TEMP_FILE<rank>``).

``sv.load(folder)`` reads every rank's dump, matches the collectives by (process group, sequence
number), orders them so that each rank's own order is kept, and gives a Trace whose collectives
carry no values but say which member rank is missing each one, where ranks disagree on the op or
the sizes, and each rank's stack when the dump has it (``event.params["flight"]``). The first
desync is ``trace.meta["start_event"]``: ``sv.play(trace)`` starts there.

JSON dumps are plain data. torch's default dump format is a pickle, and unpickling runs whatever
code the file names: ``sv.load(path, allow_pickle=True)`` reads one only when asked to.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import re
import stat
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ShardvizError, TraceFileError
from .describe import rank_list
from .events import CollectiveEvent, Source, TensorSnapshot, dtype_size
from .limits import MAX_DIMS, Bad, Limits, over, parse_json, read_file, read_head, resolve, short
from .trace import Trace

_TRAILING_RANK = re.compile(r"(\d+)(?:\.(?:json|pkl|pickle))?$")

# c10 scalar type names (what the dump says) to torch dtype names (what a trace says).
_DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
    "ComplexFloat": "complex64",
    "ComplexDouble": "complex128",
    "ComplexHalf": "complex32",
    "Float8_e4m3fn": "float8_e4m3fn",
    "Float8_e5m2": "float8_e5m2",
    "UInt16": "uint16",
    "UInt32": "uint32",
    "UInt64": "uint64",
}

# profiling names (after "nccl:" / "gloo:") to the trace's op names.
_OPS = {
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allgather": "all_gather",
    "all_gather": "all_gather",
    "_allgather_base": "all_gather",
    "allgather_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "scatter": "scatter",
    "gather": "gather",
    "reduce": "reduce",
    "barrier": "barrier",
    "send": "send",
    "recv": "recv",
    "recvanysource": "recv",
}


# --- files ---------------------------------------------------------------------------------------


def looks_like_dump(head: bytes) -> bool:
    """JSON (``{``) or a pickle (protocol 2+ starts with 0x80): what a dump file starts with."""
    return head.lstrip()[:1] == b"{" or head[:1] == b"\x80"


def _rank_of(path: Path) -> int | None:
    m = _TRAILING_RANK.search(path.name)
    return int(m.group(1)) if m else None


def dump_candidates(folder: str | Path) -> list[tuple[int, Path]]:
    """Every Flight Recorder dump in a folder with the rank its name ends with
    (``nccl_trace_rank_3``, ``flight00003.json``), by rank then name; a rank may appear twice."""
    out = []
    for p in sorted(Path(folder).iterdir()):
        if p.name.startswith(".") or p.suffix == ".svtrace":
            continue
        rank = _rank_of(p)
        if rank is None:
            continue
        try:
            if not stat.S_ISREG(p.stat().st_mode):
                continue
            head = read_head(p, 16)
        except OSError:
            continue
        if looks_like_dump(head):
            out.append((rank, p))
    return sorted(out, key=lambda rp: (rp[0], rp[1].name))


def dump_files(folder: str | Path) -> dict[int, Path]:
    """The Flight Recorder dumps in a folder, by the rank their names end with (the first by name
    where two name the same rank)."""
    out: dict[int, Path] = {}
    for rank, p in dump_candidates(folder):
        out.setdefault(rank, p)
    return out


def read_dump(path: str | Path, allow_pickle: bool = False, limits: Limits | None = None) -> dict[str, Any]:
    """One rank's dump as a dict. JSON is read as data; a pickle only with ``allow_pickle=True``,
    because unpickling runs whatever code the file names. The file's size is capped
    (``limits.json_bytes``) and its top level checked; ``entries`` checks each entry."""
    p = Path(path)
    lim = limits if limits is not None else resolve()
    data = read_file(p, lim.json_bytes, "json_bytes", lim, "Flight Recorder dump")
    if data.lstrip()[:1] == b"{":
        doc = parse_json(data, f"{p} is not a readable Flight Recorder dump")
    elif data[:1] == b"\x80":
        if not allow_pickle:
            raise TraceFileError(
                f"{p} is a pickled Flight Recorder dump. Unpickling runs whatever code the file names, "
                "so shardviz does not open it by default: pass allow_pickle=True "
                "(sv.load(path, allow_pickle=True)) only for a file you trust, or dump JSON instead "
                "(shardviz.capture.flight.dump, or torch._C._distributed_c10d._dump_fr_trace_json)"
            )
        import pickle

        try:
            doc = pickle.loads(data)  # the caller opted in, and was told what it means
        except Exception as e:
            raise TraceFileError(f"{p} is not a readable Flight Recorder dump ({e})") from None
    else:
        raise TraceFileError(f"{p} is not a Flight Recorder dump (neither JSON nor a pickle)")
    if not isinstance(doc, dict) or not isinstance(doc.get("entries", []), list | tuple):
        raise TraceFileError(f"{p} is not a Flight Recorder dump (no 'entries' list)")
    return doc


# --- alignment -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One collective in one rank's buffer."""

    rank: int
    index: int  # position in that rank's buffer (its own order)
    pg: str
    pg_desc: str
    seq: int
    p2p: bool
    name: str  # the profiling name, e.g. "nccl:all_reduce"
    input_sizes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]
    output_sizes: tuple[tuple[int, ...], ...]
    output_dtypes: tuple[str, ...]
    state: str
    time_ns: int
    frames: tuple[tuple[str, str, int], ...]  # (function, file, line), innermost first

    @property
    def key(self) -> tuple[Any, ...]:
        """What matches this entry with the other ranks' entries of the same collective."""
        if self.p2p:  # point-to-point entries are not paired: each stays its rank's own step
            return (self.pg, "p2p", self.rank, self.seq)
        return (self.pg, "coll", self.seq)

    @property
    def op(self) -> str:
        base = self.name.split(":", 1)[-1]
        return _OPS.get(base, base)

    def signature(self) -> tuple[Any, ...]:
        """What every member must agree on: the op and its sizes (for a scatter the outputs, since
        only the root passes inputs)."""
        if self.op == "scatter":
            return (self.op, self.output_sizes, self.output_dtypes)
        return (self.op, self.input_sizes, self.input_dtypes)


# Dumps are read field by field: a pickle gives tuples where JSON gives lists, so both are lists.
_SEQ = (list, tuple)


def _sizes(v: Any) -> tuple[tuple[int, ...], ...]:
    if v is None:
        return ()
    if type(v) not in _SEQ:
        raise Bad("a list of tensor sizes", v)
    out = []
    for s in v:
        if type(s) not in _SEQ or len(s) > MAX_DIMS or any(type(d) is not int or d < 0 for d in s):
            raise Bad(f"a list of tensor sizes (lists of at most {MAX_DIMS} integers >= 0)", v)
        out.append(tuple(s))
    return tuple(out)


def _strings(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if type(v) not in _SEQ or any(type(x) is not str for x in v):
        raise Bad("a list of strings", v)
    return tuple(v)


def _int(e: Mapping[str, Any], key: str) -> int:
    v = e.get(key)
    if v is None:
        return 0
    if type(v) is not int or v < 0:
        raise Bad("an integer >= 0", v, key)
    return v


def _str(e: Mapping[str, Any], key: str, default: str) -> str:
    v = e.get(key)
    if v is None:
        return default
    if type(v) is not str:
        raise Bad("a string", v, key)
    return v


def _frames(v: Any) -> tuple[tuple[str, str, int], ...]:
    if v is None:
        return ()
    if type(v) not in _SEQ:
        raise Bad("a list of stack frames", v)
    out = []
    for i, f in enumerate(v):
        if not isinstance(f, Mapping):
            raise Bad('a frame ({"name", "filename", "line"})', f, i)
        try:
            out.append((_str(f, "name", ""), _str(f, "filename", ""), _int(f, "line")))
        except Bad as e:
            raise e.at(i) from None
    return tuple(out)


def _entry(rank: int, index: int, e: Any) -> Entry:
    if not isinstance(e, Mapping):
        raise Bad("an entry (an object)", e)
    pg = e.get("process_group")
    if pg is None:
        pg = ("?", "")
    elif type(pg) not in _SEQ or not 1 <= len(pg) <= 2 or any(type(x) is not str for x in pg):
        raise Bad("[process group name, description]", pg, "process_group")
    p2p = e.get("is_p2p", False)
    if type(p2p) is not bool:
        raise Bad("true or false", p2p, "is_p2p")
    fields: dict[str, Any] = {}
    for key, read in (
        ("input_sizes", _sizes),
        ("output_sizes", _sizes),
        ("input_dtypes", _strings),
        ("output_dtypes", _strings),
        ("frames", _frames),
    ):
        try:
            fields[key] = read(e.get(key))
        except Bad as err:
            raise err.at(key) from None
    return Entry(
        rank=rank,
        index=index,
        pg=pg[0],
        pg_desc=pg[1] if len(pg) > 1 else "",
        seq=_int(e, "p2p_seq_id" if p2p else "collective_seq_id"),
        p2p=p2p,
        name=_str(e, "profiling_name", "?"),
        state=_str(e, "state", ""),
        time_ns=_int(e, "time_created_ns"),
        **fields,
    )


def entries(rank: int, doc: Mapping[str, Any]) -> list[Entry]:
    """A rank's dump as Entries, in its own order; a field that is not what torch writes raises
    ``Bad`` naming it (``load`` and ``align`` turn it into a TraceFileError)."""
    raw = doc.get("entries")
    if raw is None:
        return []
    if type(raw) not in _SEQ:
        raise Bad("a list of entries", raw, "entries")
    keyed = []
    for i, e in enumerate(raw):
        if not isinstance(e, Mapping):
            raise Bad("an entry (an object)", e, i).at("entries")
        try:
            keyed.append((_int(e, "record_id"), _int(e, "time_created_ns"), i))
        except Bad as err:
            raise err.at(i).at("entries") from None
    out = []
    for n, (_, _, i) in enumerate(sorted(keyed)):
        try:
            out.append(_entry(rank, n, raw[i]))
        except Bad as err:
            raise err.at(i).at("entries") from None
    return out


def _config_ranks(doc: Mapping[str, Any], limits: Limits) -> dict[str, tuple[tuple[int, ...], str]]:
    """The process groups a dump's ``pg_config`` names: name -> (its ranks, its description)."""
    cfg = doc.get("pg_config")
    if cfg is None:
        return {}
    if not isinstance(cfg, Mapping):
        raise Bad("an object of process groups", cfg, "pg_config")
    out = {}
    for name, c in cfg.items():
        try:
            if not isinstance(c, Mapping):
                raise Bad('a process group ({"name", "desc", "ranks"})', c)
            ranks = c.get("ranks")
            if isinstance(ranks, str):
                try:
                    ranks = json.loads(ranks) if len(ranks) <= 64 * 2**20 else None
                except (ValueError, RecursionError):
                    raise Bad("a list of ranks", c.get("ranks"), "ranks") from None
            if ranks is None:
                continue
            if type(ranks) not in _SEQ or any(type(r) is not int or r < 0 for r in ranks):
                raise Bad("a list of ranks (integers >= 0)", c.get("ranks"), "ranks")
            if ranks and max(ranks) >= limits.world_size:
                raise Bad(f"ranks below the cap max_world_size={limits.world_size}", max(ranks), "ranks")
            if len(set(ranks)) != len(ranks):
                raise Bad("a list of distinct ranks", c.get("ranks"), "ranks")
            desc = c.get("desc")
            if name and ranks:
                out[str(name)] = (tuple(sorted(ranks)), desc if type(desc) is str else "")
        except Bad as e:
            raise e.at(str(name)).at("pg_config") from None
    return out


def _members(
    configs: Mapping[str, tuple[tuple[int, ...], str]],
    by_rank: Mapping[int, list[Entry]],
    everyone: tuple[int, ...],
) -> dict[str, tuple[int, ...]]:
    """Each process group's ranks: from the dumps' pg_config when it names the group, else the
    default group (one: the first group described as "default_pg") is everyone and another group
    is whoever recorded a collective on it."""
    seen: dict[str, set[int]] = {}
    descs: dict[str, str] = {}
    for r, es in by_rank.items():
        for e in es:
            seen.setdefault(e.pg, set()).add(r)
            descs.setdefault(e.pg, e.pg_desc)
    default = next((pg for pg in sorted(seen) if descs.get(pg) == "default_pg"), None)
    out = {}
    for pg, ranks in seen.items():
        if pg in configs:
            out[pg] = configs[pg][0]
        elif pg == default:
            out[pg] = everyone
        else:
            out[pg] = tuple(sorted(ranks))
    return out


def _world_size(
    ranks: Iterable[int], configs: list[dict[str, tuple[tuple[int, ...], str]]], limits: Limits
) -> tuple[int, str | None]:
    """The world size from the dumps' process-group metadata (every dump's pg_config): the default
    group's members when pg_config lists them, else the highest rank seen (with a note saying so)."""
    seen = list(ranks)
    default = [rs for cfg in configs for rs, desc in cfg.values() if desc == "default_pg"]
    named = [rs[-1] for cfg in configs for rs, _ in cfg.values()]
    if default:
        world = max(rs[-1] for rs in default) + 1
        outside = [r for r in [*seen, *named] if r >= world]
        if outside:
            raise TraceFileError(
                f"the Flight Recorder dumps' default process group has {world} ranks (pg_config), but "
                f"rank {max(outside)} has a dump or is named in a group: the dumps are not of one job"
            )
        return world, None
    world = max([*seen, *named]) + 1
    if world > limits.world_size:
        raise over("the Flight Recorder dumps", "the highest rank", world - 1, "world_size", limits)
    return world, (
        f"the dumps list no members of the default process group (gloo dumps carry none): the world "
        f"size, {world}, is the highest rank seen + 1, so a missing highest rank cannot be told"
    )


def _order(by_rank: Mapping[int, list[Entry]]) -> tuple[list[tuple[Any, ...]], bool]:
    """All collectives in one order that keeps every rank's own order (a topological merge, ties
    broken by creation time); False when the ranks' orders contradict each other."""
    succ: dict[tuple[Any, ...], set[tuple[Any, ...]]] = {}
    indeg: dict[tuple[Any, ...], int] = {}
    t0: dict[tuple[Any, ...], int] = {}
    for es in by_rank.values():
        prev = None
        for e in es:
            k = e.key
            indeg.setdefault(k, 0)
            succ.setdefault(k, set())
            t0[k] = min(t0.get(k, e.time_ns), e.time_ns)
            if prev is not None and prev != k and k not in succ[prev]:
                succ[prev].add(k)
                indeg[k] += 1
            prev = k
    heap = [(t0[k], repr(k), k) for k, d in indeg.items() if d == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        _, _, k = heapq.heappop(heap)
        out.append(k)
        for s in succ[k]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, (t0[s], repr(s), s))
    consistent = len(out) == len(indeg)
    if not consistent:
        done = set(out)
        out += sorted((k for k in indeg if k not in done), key=lambda k: (t0[k], repr(k)))
    return out, consistent


def _snapshots(sizes: tuple[tuple[int, ...], ...], dtypes: tuple[str, ...]) -> Any:
    snaps = [
        TensorSnapshot(shape=s, dtype=_DTYPES.get(dtypes[i] if i < len(dtypes) else "", "float32"))
        for i, s in enumerate(sizes)
    ]
    if not snaps:
        return None
    return snaps[0] if len(snaps) == 1 else snaps


def _stack_text(frames: tuple[tuple[str, str, int], ...], limit: int = 16) -> str:
    lines = [f'File "{f}", line {ln}, in {name}' for name, f, ln in reversed(frames[:limit])]
    return "\n".join(lines)


def _user_frame(frames: tuple[tuple[str, str, int], ...]) -> tuple[str, str, int] | None:
    for fr in frames:
        f = fr[1].replace(os.sep, "/")
        library = ("/torch/", "/shardviz/", "/site-packages/", "/dist-packages/")
        if not any(part in f for part in library) and not f.startswith("<"):
            return fr
    return None


class SourceLines:
    """Lines of the user's files under one folder the user named (``source_root``), for the source
    line of a stack frame. A dump names any path it likes; only regular files under the root (after
    resolving symlinks and ``..``) are read, each at most ``max_bytes``. A frame's path is tried
    whole under the root, then with its leading folders dropped one by one, so that the paths of
    another machine (``/workspace/job/train.py``) find the same file in a local checkout."""

    def __init__(self, root: str | Path, max_bytes: int = 8 * 2**20) -> None:
        try:
            self.root = Path(root).resolve(strict=True)
        except OSError as e:
            raise ShardvizError(f"source_root={str(root)!r} cannot be used: {e}") from None
        if not self.root.is_dir():
            raise ShardvizError(f"source_root={str(root)!r} is not a folder")
        self.max_bytes = max_bytes
        self._files: dict[Path, list[str] | None] = {}

    def line(self, file: str, line: int) -> str | None:
        """Line ``line`` of ``file`` as found under the root, stripped; None when not found."""
        if not file or line < 1:
            return None
        parts = [p for p in Path(file.replace("\\", "/")).parts if p not in ("/", "")][-32:]
        for i in range(len(parts)):
            lines = self._lines(self.root.joinpath(*parts[i:]))
            if lines is not None:
                return lines[line - 1].strip()[:500] if line <= len(lines) else None
        return None

    def _lines(self, candidate: Path) -> list[str] | None:
        try:
            path = candidate.resolve()
        except (OSError, RuntimeError, ValueError):
            return None
        if path in self._files:
            return self._files[path]
        lines = None
        if path.is_relative_to(self.root):
            try:
                with open(path, "rb") as f:
                    st = os.fstat(f.fileno())
                    if stat.S_ISREG(st.st_mode) and st.st_size <= self.max_bytes:
                        lines = f.read(self.max_bytes).decode("utf-8", "replace").splitlines()
            except OSError:
                lines = None
        self._files[path] = lines
        return lines


def _source(es: Iterable[Entry], lines: SourceLines | None) -> Source | None:
    """The first user frame of the entries' stacks; its text from ``lines`` when given, else the
    function's name: a dump never makes shardviz open a file on its own."""
    for e in es:
        fr = _user_frame(e.frames)
        if fr is not None:
            name, file, line = fr
            text = lines.line(file, line) if lines is not None else None
            return Source(file, line, text or f"{name}()")
    return None


Parsed = tuple[list[Entry], dict[str, tuple[tuple[int, ...], str]]]


def _parsed(rank: int, doc: Mapping[str, Any], limits: Limits, where: str) -> Parsed:
    """A dump's entries and process groups, every field checked; errors name ``where``."""
    try:
        return entries(rank, doc), _config_ranks(doc, limits)
    except Bad as e:
        raise e.error(where, "the Flight Recorder dump") from None


def align(
    dumps: Mapping[int, Mapping[str, Any]],
    world_size: int | None = None,
    *,
    source_root: str | Path | None = None,
    limits: Limits | None = None,
) -> Trace:
    """One trace from every rank's dump (rank → the dump's dict). Source lines are read only from
    files under ``source_root`` (see ``SourceLines``)."""
    if not dumps:
        raise ValueError("align needs at least one rank's dump")
    lim = limits if limits is not None else resolve()
    parsed = {r: _parsed(r, d, lim, f"rank {r}'s dump") for r, d in sorted(dumps.items())}
    return _align(dumps, parsed, world_size, source_root, lim, [])


def _align(
    dumps: Mapping[int, Mapping[str, Any]],
    parsed: Mapping[int, Parsed],
    world_size: int | None,
    source_root: str | Path | None,
    lim: Limits,
    read_notes: list[str],
) -> Trace:
    for r in dumps:
        if type(r) is not int or not 0 <= r < lim.world_size:
            raise over("the Flight Recorder dumps", "a dump's rank", r, "world_size", lim)
    by_rank = {r: parsed[r][0] for r in sorted(parsed)}
    configs: dict[str, tuple[tuple[int, ...], str]] = {}
    disagree: dict[str, list[str]] = {}
    for r in sorted(parsed):
        for name, cfg in parsed[r][1].items():
            if name not in configs:
                configs[name] = cfg
            elif configs[name][0] != cfg[0]:
                disagree.setdefault(name, []).append(f"rank {r}'s lists {rank_list(cfg[0])}")
    read_notes = read_notes + [
        f"the dumps disagree on the members of process group {name}: the first lists "
        f"{rank_list(configs[name][0])}, " + ", ".join(others) + " (the first is used)"
        for name, others in disagree.items()
    ]
    guessed: str | None = None
    if world_size is None:
        world_size, guessed = _world_size(dumps, [c for _, c in parsed.values()], lim)
    elif world_size > lim.world_size:
        raise over("the Flight Recorder dumps", "the world size", world_size, "world_size", lim)
    lines = SourceLines(source_root) if source_root is not None else None
    everyone = tuple(range(world_size))
    members = _members(configs, by_rank, everyone)
    # Per group: the members that have a dump (checked event by event) and those that have none
    # (one line for all of them: a group of a million ranks costs nothing per event).
    dumped: dict[str, list[int]] = {}
    undumped: dict[str, str] = {}
    by_members: dict[int, tuple[list[int], str]] = {}
    for pg, rs in members.items():
        if id(rs) not in by_members:
            inside = set(rs) if rs is not everyone else None
            have = [r for r in sorted(dumps) if inside is None or r in inside]
            by_members[id(rs)] = (have, _absent(rs, have))
        dumped[pg], undumped[pg] = by_members[id(rs)]
    libs = {e.name.split(":", 1)[0] for es in by_rank.values() for e in es if ":" in e.name}
    lib = "/".join(sorted(libs)) or "unknown"
    order, consistent = _order(by_rank)
    table: dict[tuple[Any, ...], dict[int, Entry]] = {}
    for r, es in by_rank.items():
        for e in es:
            table.setdefault(e.key, {})[r] = e
    # Each rank's window per group: the sequence numbers its buffer still holds.
    window: dict[tuple[int, str], tuple[int, int]] = {}
    for r, es in by_rank.items():
        for e in es:
            if e.p2p:
                continue
            lo, hi = window.get((r, e.pg), (e.seq, e.seq))
            window[(r, e.pg)] = (min(lo, e.seq), max(hi, e.seq))

    trace = Trace(world_size, f"flight recorder ({lib})", "none")
    desyncs: list[int] = []
    events: list[CollectiveEvent] = []
    for k in order:
        got = table[k]
        first = got[min(got)]
        pg, seq = first.pg, first.seq
        group = members.get(pg, tuple(sorted(got)))
        missing: dict[str, str] = {}
        if not first.p2p:
            for r in dumped[pg]:
                if r in got:
                    continue
                held = window.get((r, pg))
                if held is None:
                    missing[str(r)] = "it recorded no collective on this group"
                elif seq > held[1]:
                    last = table[(pg, "coll", held[1])][r]
                    missing[str(r)] = f"it never reached it: its last on this group is #{held[1]} ({last.op})"
                elif seq < held[0]:
                    continue  # older than this rank's buffer holds: not evidence of anything
                else:
                    missing[str(r)] = "it skipped it (later ones on this group are in its buffer)"
            if undumped[pg]:
                absent = undumped[pg]
                missing[absent] = "no dump from this rank" if absent.isdigit() else "no dump from these ranks"
        mismatch = []
        sigs: dict[tuple[Any, ...], list[int]] = {}
        for r, e in sorted(got.items()):
            sigs.setdefault(e.signature(), []).append(r)
        if len(sigs) > 1:
            for (op, sizes, dtypes), who in sorted(sigs.items(), key=lambda kv: kv[1]):
                shapes = ", ".join("(" + ",".join(map(str, s)) + ")" for s in sizes)
                mismatch.append(f"{_ranks(who)}: {op} of [{shapes}] {'/'.join(dtypes)}")
        states = {str(r): e.state for r, e in sorted(got.items())}
        stacks = {str(r): _stack_text(e.frames) for r, e in sorted(got.items()) if e.frames}
        info: dict[str, Any] = {
            "pg": pg,
            "pg_desc": first.pg_desc,
            "seq": seq,
            "p2p": first.p2p,
            "names": {str(r): e.name for r, e in sorted(got.items())},
            "states": states,
            "missing": missing,
            "mismatch": mismatch,
            "stacks": stacks,
        }
        eid = len(events)
        if missing or mismatch:
            desyncs.append(eid)
        inputs = {
            r: s for r, e in got.items() if (s := _snapshots(e.input_sizes, e.input_dtypes)) is not None
        }
        outputs = {
            r: s for r, e in got.items() if (s := _snapshots(e.output_sizes, e.output_dtypes)) is not None
        }
        nbytes = {
            r: sum(
                math.prod(s) * dtype_size(_DTYPES.get(d, "float32"))
                for s, d in zip(e.input_sizes, e.input_dtypes, strict=False)
            )
            for r, e in got.items()
        }
        events.append(
            CollectiveEvent(
                id=eid,
                source=_source((got[r] for r in sorted(got)), lines),
                op=first.op,
                impl=first.name,
                groups=(group,),
                inputs=dict(sorted(inputs.items())),
                outputs=dict(sorted(outputs.items())),
                nbytes=dict(sorted(nbytes.items())),
                params={"flight": info},
            )
        )
    trace.events = list(events)
    trace.complete = not desyncs and len(dumps) == world_size
    versions = sorted({str(d.get("version", "?")) for d in dumps.values()})
    descs: dict[str, str] = {}
    for es in by_rank.values():
        for e in es:
            descs.setdefault(e.pg, e.pg_desc)
    groups = {pg: {"ranks": list(rs), "desc": descs.get(pg, "")} for pg, rs in members.items()}
    trace.meta = {
        "source": "flight_recorder",
        "version": versions,
        "ranks": sorted(dumps),
        "groups": groups,
        "desyncs": desyncs,
    }
    notes = [
        f"Flight Recorder dumps of {len(dumps)} rank{'s' if len(dumps) != 1 else ''} ({lib}, format "
        f"{'/'.join(versions)}): {len(events)} collectives on {len(members)} process group"
        f"{'s' if len(members) != 1 else ''}; no values (the recorder keeps sizes only)"
    ]
    absent = _absent(everyone, sorted(dumps))
    if absent:
        notes.append(f"no dump from rank{'s' if not absent.isdigit() else ''} {absent}")
    if guessed:
        notes.append(guessed)
    notes.extend(read_notes)
    if desyncs:
        trace.meta["start_event"] = desyncs[0]
        notes.append(f"first desync at event #{desyncs[0]}: " + describe_desync(events[desyncs[0]]))
        if len(desyncs) > 1:
            notes.append(
                f"{len(desyncs)} collectives in all with a missing rank or a mismatch: "
                + ", ".join(f"#{i}" for i in desyncs[:20])
                + (" ..." if len(desyncs) > 20 else "")
            )
    else:
        notes.append("every member rank recorded every collective alike (within the buffers)")
    if not consistent:
        notes.append(
            "the ranks issued collectives of different process groups in different orders (a "
            "deadlock risk): the order shown keeps what it can"
        )
    for r, es in by_rank.items():
        if es:
            e = es[-1]
            notes.append(f"rank {r}: last {e.op} #{e.seq} on group {e.pg} ({e.pg_desc}), {e.state}")
    trace.notes = notes
    return trace


def _absent(members: tuple[int, ...], have: list[int]) -> str:
    """The members with no dump as rank ranges ("3, 5-9"), from the sorted ranks that have one,
    without listing the members one by one when they are a range (everyone)."""
    if members and members[-1] - members[0] + 1 == len(members):  # sorted and distinct: a range
        out, start = [], members[0]
        for r in [*(h for h in have if members[0] <= h <= members[-1]), members[-1] + 1]:
            if r > start:
                out.append(str(start) if r - 1 == start else f"{start}-{r - 1}")
            start = max(start, r + 1)
        return ", ".join(out)
    got = set(have)
    return rank_list(r for r in members if r not in got)


def _who(key: Any) -> str:
    """A ``missing`` key: one rank ("3") or ranges of them ("3-7, 9")."""
    return f"rank {key}" if str(key).isdigit() else f"ranks {key}"


def _dict(v: Any) -> Mapping[Any, Any]:
    return v if isinstance(v, Mapping) else {}


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def describe_desync(e: CollectiveEvent) -> str:
    """What is wrong with one aligned collective, in a line."""
    info = _dict(e.params.get("flight"))
    where = f"{e.op} #{info.get('seq')} on group {info.get('pg')} ({info.get('pg_desc')})"
    parts = [f"{_who(r)}: {why}" for r, why in _dict(info.get("missing")).items()]
    if info.get("mismatch"):
        parts.append("ranks disagree — " + "; ".join(str(m) for m in _list(info["mismatch"])))
    return where + ": " + "; ".join(parts) if parts else where


def flight_notes(e: CollectiveEvent) -> list[str]:
    """The player's notes for one aligned collective: missing ranks, mismatches, stacks. Read
    from a trace file, the fields may be anything: what is not what ``align`` writes is skipped."""
    info = e.params.get("flight")
    if not isinstance(info, Mapping):
        return []
    pg = f"process group {info.get('pg')} ({info.get('pg_desc')})"
    out = [f"Flight Recorder: {pg}, sequence #{info.get('seq')}"]
    for r, why in _dict(info.get("missing")).items():
        out.append(f"{_who(r)} missing: {why}")
    for line in _list(info.get("mismatch")):
        out.append(f"mismatch — {line}")
    states = _dict(info.get("states"))
    if len({str(s) for s in states.values()}) > 1:
        out.append("states: " + ", ".join(f"rank {r} {s}" for r, s in states.items()))
    for r, stack in _dict(info.get("stacks")).items():
        out.append(f"rank {r} stack:\n{stack}")
    return out


def _ranks(ranks: Iterable[int]) -> str:
    rs = sorted(ranks)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(str(r) for r in rs)


def load(
    paths: str | Path | Iterable[str | Path],
    allow_pickle: bool = False,
    progress: bool = True,
    *,
    source_root: str | Path | None = None,
    limits: Limits | None = None,
) -> Trace:
    """Read a folder of per-rank dumps (or a list of dump files) and align them. A rank is the
    dump's own ``rank`` field, else the number its file name ends with; a second dump of a rank is
    named in ``trace.notes`` and not read. Source lines come only from files under
    ``source_root`` (none without it)."""
    lim = limits if limits is not None else resolve()
    candidates: list[tuple[int | None, Path]]
    if isinstance(paths, str | Path) and Path(paths).is_dir():
        candidates = list(dump_candidates(paths))
        if not candidates:
            raise TraceFileError(f"{paths} holds no Flight Recorder dumps")
    else:
        items = [Path(paths)] if isinstance(paths, str | Path) else [Path(p) for p in paths]
        candidates = [(_rank_of(p), p) for p in items]
    t0 = time.perf_counter()
    dumps: dict[int, dict[str, Any]] = {}
    parsed: dict[int, Parsed] = {}
    files: dict[int, list[Path]] = {}
    for i, (named, p) in enumerate(candidates):
        doc = read_dump(p, allow_pickle=allow_pickle, limits=lim)
        rank = doc.get("rank")
        if rank is not None and (type(rank) is not int or rank < 0):
            raise TraceFileError(
                f"{p}: field rank of the Flight Recorder dump: expected an integer >= 0, got {short(rank)}"
            )
        what = "its rank" if rank is not None else "the rank its name ends with"
        rank = rank if rank is not None else named if named is not None else i
        if rank >= lim.world_size:
            raise over(str(p), what, rank, "world_size", lim)
        files.setdefault(rank, []).append(p)
        if rank not in dumps:
            parsed[rank] = _parsed(rank, doc, lim, str(p))
            dumps[rank] = doc
        if progress and time.perf_counter() - t0 > 0.5:
            end = "\n" if i + 1 == len(candidates) else "\r"
            print(
                f"shardviz: reading Flight Recorder dumps: {i + 1}/{len(candidates)}",
                end=end,
                file=sys.stderr,
            )
    twice = [
        f"rank {r} has {len(ps)} dumps ({', '.join(str(p) for p in ps)}): only the first was read"
        for r, ps in sorted(files.items())
        if len(ps) > 1
    ]
    return _align(dumps, parsed, None, source_root, lim, twice)
