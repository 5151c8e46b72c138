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

Finding and reading one rank's dump into entries is ``flight_dump``; this module aligns them.
JSON dumps are plain data. torch's default dump format is a pickle, and unpickling runs whatever
code the file names: ``sv.load(path, allow_pickle=True)`` reads one only when asked to.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import stat
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import ShardvizError, TraceFileError
from .describe import rank_list
from .events import CollectiveEvent, Source, TensorSnapshot, dtype_size
from .flight_dump import DTYPES, SEQ, Entry, dump_candidates, entries, rank_of, read_dump
from .limits import Bad, Limits, over, resolve, short
from .trace import Trace


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
            if type(ranks) not in SEQ or any(type(r) is not int or r < 0 for r in ranks):
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
        TensorSnapshot(shape=s, dtype=DTYPES.get(dtypes[i] if i < len(dtypes) else "", "float32"))
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
                math.prod(s) * dtype_size(DTYPES.get(d, "float32"))
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
        candidates = [(rank_of(p), p) for p in items]
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
