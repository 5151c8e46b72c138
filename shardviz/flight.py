"""PyTorch Flight Recorder dumps, aligned across ranks into one trace.

The Flight Recorder keeps, in every process, a ring buffer of the last collectives it issued: for
each one its process group (name and description), its sequence number in that group, the op
(``nccl:all_reduce``, ``gloo:broadcast``...), input and output sizes and dtypes, a state
(``scheduled`` / ``started`` / ``completed``; gloo only says ``scheduled``) and — in torch's pickle
form only — the Python stack. Enable it with ``TORCH_FR_BUFFER_SIZE=2000`` (older:
``TORCH_NCCL_TRACE_BUFFER_SIZE``) before the process group is made; it records NCCL and, in torch
2.13 and 2.15, gloo collectives too. Dump each rank with ``shardviz.flight.dump(folder)`` (JSON,
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
import linecache
import math
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import TraceFileError
from .trace import CollectiveEvent, Source, TensorSnapshot, Trace, dtype_size

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


def dump_files(folder: str | Path) -> dict[int, Path]:
    """The Flight Recorder dumps in a folder, by the rank their names end with
    (``nccl_trace_rank_3``, ``flight00003.json``)."""
    out: dict[int, Path] = {}
    for p in sorted(Path(folder).iterdir()):
        if not p.is_file() or p.name.startswith(".") or p.suffix == ".svtrace":
            continue
        rank = _rank_of(p)
        if rank is None:
            continue
        with open(p, "rb") as f:
            if looks_like_dump(f.read(16)):
                out[rank] = p
    return dict(sorted(out.items()))


def read_dump(path: str | Path, allow_pickle: bool = False) -> dict[str, Any]:
    """One rank's dump as a dict. JSON is read as data; a pickle only with ``allow_pickle=True``,
    because unpickling runs whatever code the file names."""
    p = Path(path)
    data = p.read_bytes()
    if data.lstrip()[:1] == b"{":
        try:
            doc = json.loads(data)
        except ValueError as e:
            raise TraceFileError(f"{p} is not a readable Flight Recorder dump (bad JSON: {e})") from None
    elif data[:1] == b"\x80":
        if not allow_pickle:
            raise TraceFileError(
                f"{p} is a pickled Flight Recorder dump. Unpickling runs whatever code the file names, "
                "so shardviz does not open it by default: pass allow_pickle=True "
                "(sv.load(path, allow_pickle=True)) only for a file you trust, or dump JSON instead "
                "(shardviz.flight.dump, or torch._C._distributed_c10d._dump_fr_trace_json)"
            )
        import pickle

        try:
            doc = pickle.loads(data)  # the caller opted in, and was told what it means
        except Exception as e:
            raise TraceFileError(f"{p} is not a readable Flight Recorder dump ({e})") from None
    else:
        raise TraceFileError(f"{p} is not a Flight Recorder dump (neither JSON nor a pickle)")
    if not isinstance(doc, dict) or not isinstance(doc.get("entries", []), list):
        raise TraceFileError(f"{p} is not a Flight Recorder dump (no 'entries' list)")
    return doc


def dump(folder: str | Path, rank: int | None = None) -> Path:
    """Write this process's Flight Recorder buffer as JSON to ``folder/flight00003.json``
    (atomically: a temporary file, then a rename). Needs ``TORCH_FR_BUFFER_SIZE`` set before the
    process group was made, else the buffer is empty."""
    from . import _torch
    from .job import _rank_and_world

    rank = _rank_and_world()[0] if rank is None else rank
    path = Path(folder) / f"flight{rank:05d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(_torch.flight_recorder_dump())
    os.replace(tmp, path)
    return path


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


def _sizes(v: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(d) for d in s) for s in (v or []))


def entries(rank: int, doc: Mapping[str, Any]) -> list[Entry]:
    """A rank's dump as Entries, in its own order."""
    out = []
    raw = sorted(doc.get("entries") or [], key=lambda e: (e.get("record_id", 0), e.get("time_created_ns", 0)))
    for i, e in enumerate(raw):
        pg = e.get("process_group") or ["?", ""]
        p2p = bool(e.get("is_p2p", False))
        frames = tuple(
            (str(f.get("name", "")), str(f.get("filename", "")), int(f.get("line") or 0))
            for f in e.get("frames") or []
            if isinstance(f, Mapping)
        )
        out.append(
            Entry(
                rank=rank,
                index=i,
                pg=str(pg[0]),
                pg_desc=str(pg[1]) if len(pg) > 1 else "",
                seq=int(e.get("p2p_seq_id" if p2p else "collective_seq_id") or 0),
                p2p=p2p,
                name=str(e.get("profiling_name", "?")),
                input_sizes=_sizes(e.get("input_sizes")),
                input_dtypes=tuple(str(d) for d in e.get("input_dtypes") or []),
                output_sizes=_sizes(e.get("output_sizes")),
                output_dtypes=tuple(str(d) for d in e.get("output_dtypes") or []),
                state=str(e.get("state", "")),
                time_ns=int(e.get("time_created_ns") or 0),
                frames=frames,
            )
        )
    return out


def _members(
    dumps: Mapping[int, Mapping[str, Any]], by_rank: Mapping[int, list[Entry]], world_size: int
) -> dict[str, tuple[int, ...]]:
    """Each process group's ranks: from the dumps' pg_config when it names the group, else the
    default group is everyone and another group is whoever recorded a collective on it."""
    config: dict[str, tuple[int, ...]] = {}
    for doc in dumps.values():
        for name, cfg in (doc.get("pg_config") or {}).items():
            try:
                ranks = cfg.get("ranks") if isinstance(cfg, Mapping) else None
                ranks = json.loads(ranks) if isinstance(ranks, str) else ranks
                if name and ranks:
                    config[str(name)] = tuple(sorted(int(r) for r in ranks))
            except (ValueError, TypeError):
                continue
    seen: dict[str, set[int]] = {}
    descs: dict[str, str] = {}
    for r, es in by_rank.items():
        for e in es:
            seen.setdefault(e.pg, set()).add(r)
            descs.setdefault(e.pg, e.pg_desc)
    out = {}
    for pg, ranks in seen.items():
        if pg in config:
            out[pg] = config[pg]
        elif descs.get(pg) == "default_pg":
            out[pg] = tuple(range(world_size))
        else:
            out[pg] = tuple(sorted(ranks))
    return out


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


def _source(es: Iterable[Entry]) -> Source | None:
    for e in es:
        fr = _user_frame(e.frames)
        if fr is not None:
            name, file, line = fr
            text = linecache.getline(file, line).strip() if file and line else ""
            return Source(file, line, text or f"{name}()")
    return None


def align(dumps: Mapping[int, Mapping[str, Any]], world_size: int | None = None) -> Trace:
    """One trace from every rank's dump (rank → the dump's dict)."""
    if not dumps:
        raise ValueError("align needs at least one rank's dump")
    by_rank = {r: entries(r, d) for r, d in sorted(dumps.items())}
    world_size = world_size or max(dumps) + 1
    members = _members(dumps, by_rank, world_size)
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
            for r in group:
                if r in got:
                    continue
                if r not in dumps:
                    missing[str(r)] = "no dump from this rank"
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
        mismatch = []
        sigs: dict[tuple[Any, ...], list[int]] = {}
        for r, e in sorted(got.items()):
            sigs.setdefault(e.signature(), []).append(r)
        if len(sigs) > 1:
            for (op, sizes, dtypes), rs in sorted(sigs.items(), key=lambda kv: kv[1]):
                shapes = ", ".join("(" + ",".join(map(str, s)) + ")" for s in sizes)
                mismatch.append(f"{_ranks(rs)}: {op} of [{shapes}] {'/'.join(dtypes)}")
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
                source=_source(got[r] for r in sorted(got)),
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
    trace.complete = not desyncs and set(dumps) >= set(range(world_size))
    versions = sorted({str(d.get("version", "?")) for d in dumps.values()})
    groups = {
        pg: {
            "ranks": list(rs),
            "desc": next((e.pg_desc for es in by_rank.values() for e in es if e.pg == pg), ""),
        }
        for pg, rs in members.items()
    }
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
    absent = [r for r in range(world_size) if r not in dumps]
    if absent:
        notes.append(f"no dump from {_ranks(absent)}")
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


def describe_desync(e: CollectiveEvent) -> str:
    """What is wrong with one aligned collective, in a line."""
    info = e.params.get("flight", {})
    where = f"{e.op} #{info.get('seq')} on group {info.get('pg')} ({info.get('pg_desc')})"
    parts = [f"rank {r}: {why}" for r, why in info.get("missing", {}).items()]
    if info.get("mismatch"):
        parts.append("ranks disagree — " + "; ".join(info["mismatch"]))
    return where + ": " + "; ".join(parts) if parts else where


def flight_notes(e: CollectiveEvent) -> list[str]:
    """The player's notes for one aligned collective: missing ranks, mismatches, stacks."""
    info = e.params.get("flight")
    if not isinstance(info, Mapping):
        return []
    pg = f"process group {info.get('pg')} ({info.get('pg_desc')})"
    out = [f"Flight Recorder: {pg}, sequence #{info.get('seq')}"]
    for r, why in (info.get("missing") or {}).items():
        out.append(f"rank {r} missing: {why}")
    for line in info.get("mismatch") or []:
        out.append(f"mismatch — {line}")
    states = info.get("states") or {}
    if len(set(states.values())) > 1:
        out.append("states: " + ", ".join(f"rank {r} {s}" for r, s in states.items()))
    for r, stack in (info.get("stacks") or {}).items():
        out.append(f"rank {r} stack:\n{stack}")
    return out


def _ranks(ranks: Iterable[int]) -> str:
    rs = sorted(ranks)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(str(r) for r in rs)


def load(
    paths: str | Path | Iterable[str | Path], allow_pickle: bool = False, progress: bool = True
) -> Trace:
    """Read a folder of per-rank dumps (or a list of dump files) and align them."""
    if isinstance(paths, str | Path) and Path(paths).is_dir():
        files = dump_files(paths)
        if not files:
            raise TraceFileError(f"{paths} holds no Flight Recorder dumps")
    else:
        items = [Path(paths)] if isinstance(paths, str | Path) else [Path(p) for p in paths]
        files = {}
        for i, p in enumerate(items):
            r = _rank_of(p)
            files[r if r is not None and r not in files else i] = p
    t0 = time.perf_counter()
    dumps: dict[int, dict[str, Any]] = {}
    for i, (rank, p) in enumerate(sorted(files.items())):
        doc = read_dump(p, allow_pickle=allow_pickle)
        dumps[int(doc["rank"]) if isinstance(doc.get("rank"), int) else rank] = doc
        if progress and time.perf_counter() - t0 > 0.5:
            end = "\n" if i + 1 == len(files) else "\r"
            print(f"shardviz: reading Flight Recorder dumps: {i + 1}/{len(files)}", end=end, file=sys.stderr)
    return align(dumps)
