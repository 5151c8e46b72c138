"""One rank's Flight Recorder dump: finding the files (one per rank, named by its trailing rank),
reading one (JSON, or torch's pickle only when asked to), and its entries as plain records with
every field checked (``entries``). Aligning the ranks' entries into one trace is ``flight``'s job.
"""

from __future__ import annotations

import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import TraceFileError
from .limits import MAX_DIMS, Bad, Limits, parse_json, read_file, read_head, resolve

_TRAILING_RANK = re.compile(r"(\d+)(?:\.(?:json|pkl|pickle))?$")

# c10 scalar type names (what the dump says) to torch dtype names (what a trace says).
DTYPES = {
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


def looks_like_dump(head: bytes) -> bool:
    """JSON (``{``) or a pickle (protocol 2+ starts with 0x80): what a dump file starts with."""
    return head.lstrip()[:1] == b"{" or head[:1] == b"\x80"


def rank_of(path: Path) -> int | None:
    m = _TRAILING_RANK.search(path.name)
    return int(m.group(1)) if m else None


def dump_candidates(folder: str | Path) -> list[tuple[int, Path]]:
    """Every Flight Recorder dump in a folder with the rank its name ends with
    (``nccl_trace_rank_3``, ``flight00003.json``), by rank then name; a rank may appear twice."""
    out = []
    for p in sorted(Path(folder).iterdir()):
        if p.name.startswith(".") or p.suffix == ".svtrace":
            continue
        rank = rank_of(p)
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
SEQ = (list, tuple)


def _sizes(v: Any) -> tuple[tuple[int, ...], ...]:
    if v is None:
        return ()
    if type(v) not in SEQ:
        raise Bad("a list of tensor sizes", v)
    out = []
    for s in v:
        if type(s) not in SEQ or len(s) > MAX_DIMS or any(type(d) is not int or d < 0 for d in s):
            raise Bad(f"a list of tensor sizes (lists of at most {MAX_DIMS} integers >= 0)", v)
        out.append(tuple(s))
    return tuple(out)


def _strings(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if type(v) not in SEQ or any(type(x) is not str for x in v):
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
    if type(v) not in SEQ:
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
    elif type(pg) not in SEQ or not 1 <= len(pg) <= 2 or any(type(x) is not str for x in pg):
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
    if type(raw) not in SEQ:
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
