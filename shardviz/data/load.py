"""One loader for what ``sv.load`` opens: a trace file, a job folder, Flight Recorder dumps.

A job folder holds one ``rankNNNNN.svtrace`` per rank (``sv.record_job`` writes them, each in the
format of ``trace.save``); loading merges them into one trace, and says which rank stopped where
when they did not all record the same whole run. A Flight Recorder dump is aligned across ranks by
``shardviz.data.flight``. Every size is capped (``shardviz.data.limits``).
"""

from __future__ import annotations

import errno
import re
import stat
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from ..errors import TraceFileError
from . import flight, flight_dump
from .limits import Limits, over, read_head, resolve, short
from .merge import merge_partial
from .trace import Trace
from .trace_read import TensorFromValues, load_trace

SUFFIX = ".svtrace"
_RANK_FILE = re.compile(r"^rank(\d+)\.svtrace$")


class PartialTraceWarning(UserWarning):
    """A job's ranks did not all record the same whole run: the merged trace is the common prefix;
    ``trace.notes`` says which rank stopped where."""


def rank_path(folder: str | Path, rank: int) -> Path:
    """Where rank ``rank`` of a job writes its trace: ``folder/rank00003.svtrace``."""
    return Path(folder) / f"rank{rank:05d}{SUFFIX}"


# --- reading a job's folder ----------------------------------------------------------------------


def rank_files(folder: str | Path) -> dict[int, Path]:
    """The per-rank trace files of a job folder, by the rank in their names."""
    out = {}
    for p in Path(folder).iterdir():
        m = _RANK_FILE.match(p.name)
        if m and len(m.group(1)) <= 12:
            out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def _progress(total: int, what: str) -> Callable[[int], None]:
    """A status line on stderr for slow loads: shown once loading takes over half a second."""
    t0 = time.perf_counter()
    shown = [0.0]

    def update(done: int) -> None:
        now = time.perf_counter()
        if now - t0 < 0.5 or (now - shown[0] < 0.5 and done < total):
            return
        shown[0] = now
        end = "\n" if done >= total else "\r"
        print(f"shardviz: loading {what}: {done}/{total}", end=end, file=sys.stderr, flush=True)

    return update


def _job_meta(path: Path, t: Trace, rank: int, limits: Limits) -> tuple[int, int]:
    """A rank file's own rank and world size (``trace.meta``, written by ``record_job``), checked:
    the merge builds per-rank lists from them."""

    def bad(name: str, expected: str) -> TraceFileError:
        return TraceFileError(
            f"{path}: field meta.{name} of trace.json: expected {expected}, got {short(t.meta.get(name))}"
        )

    r = t.meta.get("rank", rank)
    if type(r) is not int or r < 0:
        raise bad("rank", "the rank that wrote the file (an integer >= 0)")
    if r >= limits.world_size:
        raise over(str(path), "its rank", r, "world_size", limits)
    world = t.meta.get("world_size", t.world_size)
    if type(world) is not int or world < 1:
        raise bad("world_size", "the job's world size (an integer >= 1)")
    if world != t.world_size:
        raise bad("world_size", f"the trace's world_size, {t.world_size}")
    for name, types in (("run_id", (str,)), ("started", (int, float)), ("backend", (str,))):
        if t.meta.get(name) is not None and type(t.meta[name]) not in types:
            raise bad(name, "a string" if types == (str,) else "a number")
    status = t.meta.get("status")
    if status is not None:
        pending = status.get("in_collective") if isinstance(status, dict) else None
        if not isinstance(status, dict) or not isinstance(status.get("how", ""), str):
            raise bad("status", 'how the rank ended ({"how": "finished", ...})')
        if pending is not None and not (
            isinstance(pending, dict)
            and isinstance(pending.get("group", []), list)
            and all(type(x) is int for x in pending.get("group", []))
            and (pending.get("line") is None or type(pending.get("line")) is int)
        ):
            raise bad("status", 'the collective the rank was in ({"op", "group": [ranks], "line"})')
    return r, world


def load_job(
    folder: str | Path,
    progress: bool = True,
    *,
    limits: Limits | None = None,
    tensor: TensorFromValues | None = None,
) -> Trace:
    """Merge a job folder's per-rank traces into one trace.

    When the ranks did not all record the same whole run (a rank died, hung or diverged), the
    result is the common prefix, ``complete`` is False, ``trace.notes`` says which rank stopped
    where, ``trace.meta["start_event"]`` is the last event they shared (the player starts there),
    and a ``PartialTraceWarning`` repeats the notes. Two files claiming one rank, and files of a
    rank beyond the world size, are named in the notes and left out.
    """
    lim = limits if limits is not None else resolve()
    files = rank_files(folder)
    if not files:
        raise TraceFileError(f"{folder} holds no rank*.svtrace files (written by sv.record_job)")
    update = _progress(len(files), f"{len(files)} rank traces") if progress else (lambda done: None)
    traces: dict[int, Trace] = {}
    sizes: dict[int, set[Path]] = {}
    claimed: dict[int, list[Path]] = {}
    for i, (rank, f) in enumerate(files.items()):
        t = load_trace(f, limits=lim, tensor=tensor)
        r, world = _job_meta(f, t, rank, lim)
        claimed.setdefault(r, []).append(f)
        if r not in traces:
            traces[r] = t
            sizes.setdefault(world, set()).add(f)
        update(i + 1)
    skipped = [
        f"rank {r} (claimed by {len(fs)} files: {', '.join(f.name for f in fs)}; read {fs[0].name})"
        for r, fs in sorted(claimed.items())
        if len(fs) > 1
    ]
    traces, other_runs = _one_run(traces)
    skipped += other_runs
    worlds = sorted({traces[r].world_size for r in traces})
    if len(worlds) != 1:
        by = "; ".join(f"{w}: {', '.join(sorted(f.name for f in sizes[w]))}" for w in worlds)
        raise TraceFileError(f"{folder}: the rank files report different world sizes ({by})")
    world_size = worlds[0]
    for r in [r for r in traces if r >= world_size]:
        skipped.append(f"rank {r} (beyond the world size {world_size})")
        del traces[r]
    if not traces:
        raise TraceFileError(
            f"{folder}: no rank file is of a rank within the job's world size ({world_size}); "
            + "ignored: "
            + ", ".join(skipped)
        )
    first = traces[min(traces)]
    backend = str(first.meta.get("backend") or "job")
    trace = merge_partial(traces, backend, first.values, world_size=world_size)
    if skipped:
        trace.notes.append("ignored files: " + ", ".join(skipped))
    if trace.notes:
        warnings.warn(
            f"{folder}: partial trace —\n  " + "\n  ".join(trace.notes), PartialTraceWarning, stacklevel=3
        )
    return trace


def _one_run(traces: dict[int, Trace]) -> tuple[dict[int, Trace], list[str]]:
    """Files from several runs in one folder: keep the run of the most recently started file."""
    runs = {(t.meta.get("run_id") or "") for t in traces.values()}
    if len(runs) <= 1:
        return traces, []
    newest = max(traces.values(), key=lambda t: float(t.meta.get("started") or 0))
    keep = newest.meta.get("run_id") or ""
    kept = {r: t for r, t in traces.items() if (t.meta.get("run_id") or "") == keep}
    skipped = [
        f"rank {r} (of another run: {t.meta.get('run_id') or 'no run id'})"
        for r, t in traces.items()
        if r not in kept
    ]
    return kept, skipped


def load_path(
    path: str | Path,
    allow_pickle: bool = False,
    progress: bool = True,
    *,
    source_root: str | Path | None = None,
    limits: Limits | None = None,
    tensor: TensorFromValues | None = None,
) -> Trace:
    """What ``sv.load`` opens: a trace file, a job folder, a Flight Recorder dump or a folder of
    them (see ``shardviz.data.flight``), with every size capped (``limits``, default
    ``shardviz.data.limits.resolve()``). ``source_root`` is where Flight Recorder stacks' source
    lines may be read from (nowhere without it); ``tensor`` makes a saved tensor result a tensor
    (``trace_read.load_trace``)."""
    lim = limits if limits is not None else resolve()
    p = Path(path)
    if p.is_dir():
        if rank_files(p):
            return load_job(p, progress=progress, limits=lim, tensor=tensor)
        if flight_dump.dump_candidates(p):
            return flight.load(
                p, allow_pickle=allow_pickle, progress=progress, source_root=source_root, limits=lim
            )
        raise TraceFileError(
            f"{p} holds neither rank*.svtrace files (sv.record_job) nor Flight Recorder dumps"
        )
    if not p.exists():
        raise FileNotFoundError(errno.ENOENT, "no such file or folder", str(p))
    if not stat.S_ISREG(p.stat().st_mode):
        raise TraceFileError(f"{p} is not a regular file (a device or a pipe): not a trace or a dump")
    head = read_head(p, 4)
    if head[:2] == b"PK":
        return load_trace(p, limits=lim, tensor=tensor)
    if flight_dump.looks_like_dump(head):
        return flight.load(
            [p], allow_pickle=allow_pickle, progress=progress, source_root=source_root, limits=lim
        )
    return load_trace(p, limits=lim, tensor=tensor)  # its own clear error
