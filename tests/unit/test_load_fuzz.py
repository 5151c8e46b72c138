"""Fuzzing the loaders: every input made from a real file (a recorded trace, a job folder of rank
files, gloo Flight Recorder dumps written by ``shardviz.capture.flight.dump``) and then damaged — bit
flips, truncation, type swaps, huge and negative numbers, deep nesting, ``.npy`` headers that lie,
zip bombs, duplicated and missing ranks — either loads (and prints, as ``python -m shardviz
summary`` does) or raises a ShardvizError, within a time budget and a memory bound.

``SHARDVIZ_FUZZ_SCALE=10`` runs ten times as many mutants (a longer local run).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fuzzing as fz
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardviz as sv
from shardviz.__main__ import main as cli
from shardviz.data.events import CollectiveEvent, Source, TensorSnapshot
from shardviz.data.load import PartialTraceWarning, rank_path
from shardviz.data.trace import Trace

pytestmark = pytest.mark.timeout(240)

DATA = Path(__file__).parent / "data" / "flight_gloo"
SCALE = int(os.environ.get("SHARDVIZ_FUZZ_SCALE", "1"))

# Small caps, so that the bound below tests the caps themselves: a bomb of 64 MiB must be refused.
CAPS_WORLD = {
    "max_member_bytes": 8 * fz.MiB,
    "max_file_bytes": 24 * fz.MiB,
    "max_json_bytes": 4 * fz.MiB,
    "max_world_size": 4096,
}
MEMORY_BOUND = 64 * fz.MiB  # tracemalloc peak of one load, printing included
TIME_BOUND = 10.0  # seconds for one input on a busy 2-core machine (most take milliseconds)


# --- the real files the mutants start from -------------------------------------------------------


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return make_seeds(tmp_path_factory.mktemp("seeds"))


def make_seeds(folder: Path) -> dict[str, Any]:
    """The real files: two recorded traces (one with results, one with a memory timeline), a job
    folder's rank files, and Flight Recorder dumps (gloo, written by shardviz.capture.flight.dump in a real
    3-rank job; NCCL-style, with pg_config and stacks)."""
    sv.use("local", world_size=4)
    folder.mkdir(parents=True, exist_ok=True)

    def body() -> Any:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dt = distribute_tensor(torch.arange(20.0).reshape(5, 4), mesh, [Shard(0), Replicate()])
        dt.redistribute(mesh, [Replicate(), Replicate()])
        t = sv.per_rank(lambda r: torch.tensor([r, float("nan"), 2.0], dtype=torch.bfloat16))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        outs = [torch.zeros(2, dtype=torch.int64) for _ in range(4)]
        dist.all_gather(outs, sv.per_rank(lambda r: torch.tensor([r, -r])))
        return dt.to_local(), {"step": 3, "name": ["a", 1.5]}

    ran = sv.run(body)
    with sv.record(memory=True) as recorded:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.ones(8, 8), mesh, [Shard(1)])
        (x @ x.T).full_tensor()
    files = [t.save(folder / f"{i}.svtrace").read_bytes() for i, t in enumerate((ran, recorded))]
    job = {r: rank_trace(r, ["all_reduce", "broadcast", "all_gather"]) for r in range(3)}
    job_bytes = {r: t.save(folder / f"rank{r}.svtrace").read_bytes() for r, t in job.items()}
    gloo = {int(p.stem[-5:]): json.loads(p.read_text()) for p in sorted(DATA.glob("flight*.json"))}
    return {"traces": files, "job": job_bytes, "flight": [gloo, nccl_dumps()]}


def rank_trace(rank: int, ops: list[str], world: int = 3) -> Trace:
    """A rank's file as ``sv.record_job`` writes it: its own buffers (with values) and group."""
    t = Trace(world, "rank", "all")
    t.events = [
        CollectiveEvent(
            id=i,
            source=Source("train.py", 10 + i, f"dist.{op}(t)"),
            op=op,
            impl=f"c10d.{op}_",
            groups=(tuple(range(world)),),
            inputs={rank: TensorSnapshot((2,), "float32", np.array([rank, i], np.float32))},
            outputs={rank: TensorSnapshot((2,), "float32", np.array([i, rank], np.float32))},
            nbytes={rank: 8},
        )
        for i, op in enumerate(ops)
    ]
    t.meta = {
        "rank": rank,
        "world_size": world,
        "host": "h",
        "pid": 1,
        "run_id": "r1",
        "started": 1.0,
        "backend": "gloo",
        "status": {"how": "finished", "in_collective": {"op": "all_reduce", "group": [0, 1], "line": 3}},
    }
    return t


def nccl_dumps() -> dict[int, dict[str, Any]]:
    """NCCL-style dumps: pg_config naming the groups, and stacks (torch's pickle form has them)."""
    cfg = {
        "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
        "1": {"name": "1", "desc": "tp", "ranks": "[0, 1]"},
    }
    frames = [
        {"name": "all_reduce", "filename": "/x/torch/distributed/distributed_c10d.py", "line": 9},
        {"name": "train", "filename": "/job/train.py", "line": 3},
    ]

    def entry(i: int, pg: str, seq: int, name: str) -> dict[str, Any]:
        return {
            "record_id": i,
            "process_group": [pg, cfg[pg]["desc"]],
            "collective_seq_id": seq,
            "p2p_seq_id": 0,
            "profiling_name": f"nccl:{name}",
            "time_created_ns": 100 * i,
            "input_sizes": [[4, 2]],
            "input_dtypes": ["BFloat16"],
            "output_sizes": [[4, 2]],
            "output_dtypes": ["BFloat16"],
            "state": "completed",
            "is_p2p": False,
            "frames": frames,
        }

    return {
        r: {
            "version": "2.10",
            "rank": r,
            "pg_config": cfg,
            "entries": [entry(0, "0", 1, "allreduce"), entry(1, "1", 1, "_allgather_base")][
                : 2 if r < 2 else 1
            ],
        }
        for r in range(3)  # rank 3, the highest, wrote no dump
    }


# --- the mutants ---------------------------------------------------------------------------------


@dataclass
class Case:
    kind: str  # what was damaged, for the table
    what: str
    make: Callable[[Path], Path]  # writes the input under a fresh folder, returns what to load


def trace_cases(seeds: dict[str, Any], rng: random.Random) -> Iterator[Case]:
    for _ in range(240 * SCALE):
        seed = rng.choice(seeds["traces"])
        files = fz.read_zip(seed)
        text, what = fz.mutate_json(json.loads(files["trace.json"]), rng)
        data = fz.zip_of({**files, "trace.json": text.encode()})
        yield Case("trace file: trace.json field", what, lambda d, b=data: fz.write(d / "t.svtrace", b))
    for _ in range(60 * SCALE):
        data, what = fz.flip_bytes(rng.choice(seeds["traces"]), rng)
        yield Case("trace file: bit flips", what, lambda d, b=data: fz.write(d / "t.svtrace", b))
    for _ in range(30 * SCALE):
        data, what = fz.truncate(rng.choice(seeds["traces"]), rng)
        yield Case("trace file: truncated", what, lambda d, b=data: fz.write(d / "t.svtrace", b))
    headers: list[tuple[str, Callable[[tuple[int, ...], str], bytes]]] = [
        ("shape grown", lambda s, d: fz.npy_header((*s[:-1], s[-1] * 1000) if s else (1000,), d)),
        ("shape negative", lambda s, d: fz.npy_header((-(2**20),), d)),
        ("shape of a billion", lambda s, d: fz.npy_header((10**9,), d)),
        ("object dtype", lambda s, d: fz.npy_header(s, "|O")),
        ("string dtype", lambda s, d: fz.npy_header(s, "<U8")),
        ("structured dtype", lambda s, d: fz.npy_header(s, [("a", "<f4"), ("b", "<i4")])),
        ("big-endian", lambda s, d: fz.npy_header(s, ">" + d[1:])),
        ("fortran order", lambda s, d: fz.npy_header(s, d, fortran=True)),
        ("dtype swapped", lambda s, d: fz.npy_header(s, "<f8" if d != "<f8" else "<i8")),
    ]
    for _ in range(60 * SCALE):
        files = fz.read_zip(rng.choice(seeds["traces"]))
        name = rng.choice([n for n in files if n.endswith(".npy")])
        a = np.lib.format.read_array(io.BytesIO(files[name]))
        label, header = rng.choice(headers)
        raw = fz.npy(a)
        body = raw[len(fz.npy_header(a.shape, np.lib.format.dtype_to_descr(a.dtype))) :]
        bad = header(a.shape, np.lib.format.dtype_to_descr(a.dtype)) + body
        data = fz.zip_of({**files, name: bad})
        yield Case(
            "trace file: .npy header", f"{name}: {label}", lambda d, b=data: fz.write(d / "t.svtrace", b)
        )
    files = fz.read_zip(seeds["traces"][0])
    json_member = fz.member("trace.json", files["trace.json"])
    others = [fz.member(n, b) for n, b in files.items() if n != "trace.json"]
    key = next(n for n in files if n.endswith(".npy"))
    a = np.lib.format.read_array(io.BytesIO(files[key]))
    zips = {
        "trace.json inflating to 64 MiB": [
            fz.bomb("trace.json", b'{"format": "shardviz-trace", "x": "', 64),
            *others,
        ],
        ".npy inflating to 64 MiB": [
            json_member,
            *[m for m in others if m.name != key],
            fz.bomb(key, fz.npy_header((16 * fz.MiB,), "<f4"), 64),
        ],
        "members inflating to 40 MiB in all": [
            json_member,
            *others,
            *(fz.bomb(f"x{i}", b"", 7) for i in range(6)),
        ],
        "trace.json twice": [json_member, fz.member("trace.json", b"[1, 2]"), *others],
        "encrypted flag": [fz.Member(**{**json_member.__dict__, "flags": 1}), *others],
        "unknown compression method": [fz.Member(**{**json_member.__dict__, "method": 99}), *others],
        "stored size lies": [fz.Member(**{**json_member.__dict__, "size": json_member.size * 50}), *others],
        "CRC lies": [fz.Member(**{**json_member.__dict__, "crc": json_member.crc ^ 1}), *others],
        "no members": [],
    }
    for what, members in zips.items():
        data = fz.write_zip(members)
        yield Case("trace file: zip structure", what, lambda d, b=data: fz.write(d / "t.svtrace", b))
    doc = json.loads(files["trace.json"])
    for what, change in {
        "trace.json a list": lambda: [doc],
        "version '1'": lambda: {**doc, "version": "1"},
        "world_size -4": lambda: {**doc, "world_size": -4},
        "world_size 1e9": lambda: {**doc, "world_size": 10**9},
        "events are ints": lambda: {**doc, "events": [1, 2]},
        "an op that is an int": lambda: {
            **doc,
            "events": [{**e, "op": 7} if e["kind"] == "collective" else e for e in doc["events"]],
        },
        "a group naming rank 99 of 4": lambda: {
            **doc,
            "events": [{**e, "groups": [[0, 99]]} if e["kind"] == "collective" else e for e in doc["events"]],
        },
        "a shape disagreeing with its array": lambda: {
            **doc,
            "events": [
                {
                    **e,
                    "inputs": {k: {**v, "shape": [3]} for k, v in e["inputs"].items() if isinstance(v, dict)},
                }
                if e["kind"] == "collective"
                else e
                for e in doc["events"]
            ],
        },
    }.items():
        data = fz.zip_of({**files, "trace.json": json.dumps(change()).encode()})
        yield Case("trace file: trace.json field", what, lambda d, b=data: fz.write(d / "t.svtrace", b))


def job_cases(seeds: dict[str, Any], rng: random.Random) -> Iterator[Case]:
    ranks = seeds["job"]

    def folder(changed: dict[int, bytes | None]) -> Callable[[Path], Path]:
        def make(d: Path) -> Path:
            for r, b in {**ranks, **changed}.items():
                if b is not None:
                    fz.write(rank_path(d / "job", r), b)
            return d / "job"

        return make

    for _ in range(100 * SCALE):
        r = rng.randrange(3)
        files = fz.read_zip(ranks[r])
        doc = json.loads(files["trace.json"])
        if rng.random() < 0.6:  # what the merge reads: the meta, the world size, the groups
            sub = rng.choice(["meta", "world_size", "events"])
            text, what = fz.mutate_json({sub: doc[sub]}, rng)
            text = json.dumps({**doc, **json.loads(text)}) if "[[[[[" not in text else text
        else:
            text, what = fz.mutate_json(doc, rng)
        yield Case(
            "job folder: rank file field",
            f"rank {r}: {what}",
            folder({r: fz.zip_of({**files, "trace.json": text.encode()})}),
        )
    for _ in range(30 * SCALE):
        r = rng.randrange(3)
        data, what = (fz.flip_bytes if rng.random() < 0.6 else fz.truncate)(ranks[r], rng)
        yield Case("job folder: rank file bytes", f"rank {r}: {what}", folder({r: data}))

    def with_meta(r: int, **meta: Any) -> bytes:
        files = fz.read_zip(ranks[r])
        doc = json.loads(files["trace.json"])
        doc["meta"].update(meta)
        doc.update({k: v for k, v in meta.items() if k == "world_size"})
        return fz.zip_of({**files, "trace.json": json.dumps(doc).encode()})

    fixed = {
        "world_size 1e9 in every rank file": {r: with_meta(r, world_size=10**9) for r in ranks},
        "world_size 4000 with 3 rank files": {r: with_meta(r, world_size=4000) for r in ranks},
        "world_size -4": {0: with_meta(0, world_size=-4)},
        "every rank beyond the world size (empty rank set)": {
            r: with_meta(r, world_size=1, rank=5 + r) for r in ranks
        },
        "two files claim rank 1": {2: with_meta(2, rank=1)},
        "rank 1e9": {1: with_meta(1, rank=10**9)},
        "status.in_collective.group an int": {
            0: with_meta(0, status={"how": "signal", "in_collective": {"group": 3}})
        },
        "rank files of two world sizes": {0: with_meta(0, world_size=4)},
        "rank 0 missing": {0: None},
    }
    for what, changed in fixed.items():
        yield Case("job folder: ranks and world size", what, folder(changed))


def flight_cases(seeds: dict[str, Any], rng: random.Random, root: Path) -> Iterator[Case]:
    def folder(
        dumps: dict[int, Any], names: Callable[[int], str] = lambda r: f"flight{r:05d}.json"
    ) -> Callable[[Path], Path]:
        def make(d: Path) -> Path:
            for r, doc in dumps.items():
                fz.write(d / "fr" / names(r), doc if isinstance(doc, bytes | str) else json.dumps(doc))
            return d / "fr"

        return make

    for _ in range(200 * SCALE):
        dumps = dict(rng.choice(seeds["flight"]))
        r = rng.choice(sorted(dumps))
        text, what = fz.mutate_json(dumps[r], rng)
        yield Case("Flight Recorder dump: field", f"rank {r}: {what}", folder({**dumps, r: text}))
    for _ in range(50 * SCALE):
        dumps = dict(rng.choice(seeds["flight"]))
        r = rng.choice(sorted(dumps))
        data, what = (fz.flip_bytes if rng.random() < 0.6 else fz.truncate)(
            json.dumps(dumps[r]).encode(), rng
        )
        yield Case("Flight Recorder dump: bytes", f"rank {r}: {what}", folder({**dumps, r: data}))
    gloo, nccl = seeds["flight"]

    def frames(path: str) -> dict[int, Any]:
        f = [{"name": "train", "filename": path, "line": 1}]
        return {r: {**d, "entries": [{**e, "frames": f} for e in d["entries"]]} for r, d in nccl.items()}

    secret = root / "outside" / "secret.txt"
    fz.write(secret, SECRET + "\n")
    link = root / "src" / "link.py"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(secret)
    fixed = {
        "a frame naming /etc/passwd": frames("/etc/passwd"),
        "a frame naming /dev/zero": frames("/dev/zero"),
        "a frame naming a file outside the source root": frames(str(secret)),
        "a frame naming ../outside/secret.txt": frames("../outside/secret.txt"),
        "a frame naming a symlink out of the source root": frames(str(link)),
        '"rank": 1e9': {**gloo, 0: {**gloo[0], "rank": 10**9}},
        '"rank": 1e9 (a float)': {**gloo, 0: {**gloo[0], "rank": 1e9}},
        '"rank": 1000000 (a world of a million, within the cap)': {**gloo, 2: {**gloo[2], "rank": 10**6}},
        "entries: [1]": {**gloo, 1: {**gloo[1], "entries": [1]}},
        "pg_config naming rank 9 of a world of 4": {
            **nccl,
            0: {**nccl[0], "pg_config": {**nccl[0]["pg_config"], "1": {"desc": "tp", "ranks": "[0, 9]"}}},
        },
        "pg_config ranks not JSON": {
            **nccl,
            0: {**nccl[0], "pg_config": {"1": {"desc": "tp", "ranks": "[0, 1"}}},
        },
        "a dump of 5 MiB": {**gloo, 0: {**gloo[0], "pad": "x" * (5 * fz.MiB)}},
        "deep nesting": {**gloo, 2: '{"entries": ' + "[" * 100_000 + "]" * 100_000 + "}"},
    }
    for what, dumps in fixed.items():
        yield Case("Flight Recorder dump: fixed", what, folder(dumps))
    yield Case(
        "Flight Recorder dump: fixed",
        "two dumps of rank 1",
        folder(
            {**{r: d for r, d in gloo.items()}, 11: gloo[1]},
            names=lambda r: f"flight{r:05d}.json" if r < 10 else "nccl_trace_rank_1",
        ),
    )


# --- the test ------------------------------------------------------------------------------------


SECRET = "the secret"  # what the file outside the source root holds


def summarize(trace: Trace) -> str:
    """What ``python -m shardviz summary`` prints for a trace (and the sources it shows)."""
    sources = [e.source.text for e in trace.events if e.source is not None]
    return f"{trace}\n{trace.summary()}\n{trace.check()}\n{sources}"


def all_cases(seeds: dict[str, Any], root: Path) -> list[Case]:
    rng = random.Random(22)
    return [*trace_cases(seeds, rng), *job_cases(seeds, rng), *flight_cases(seeds, rng, root)]


def caps_for(case: Case) -> dict[str, Any]:
    return CAPS_WORLD


def test_every_damaged_input_loads_or_is_refused(seeds: dict[str, Any], tmp_path: Path) -> None:
    root = tmp_path / "root"
    cases = all_cases(seeds, root)
    table: Counter[tuple[str, str]] = Counter()
    failures = []
    for i, case in enumerate(cases):
        path = case.make(tmp_path / f"c{i}")
        caps = caps_for(case)
        kwargs = {**caps, "source_root": root / "src"} if case.kind.startswith("Flight") else caps
        with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore", PartialTraceWarning)
            out = fz.attempt(lambda p=path, k=kwargs: sv.load(p, progress=False, **k), summarize)
        table[(case.kind, out.kind)] += 1
        if out.kind not in ("loaded", "refused"):
            failures.append(f"{case.kind} / {case.what}: {out.kind}: {out.message}")
        elif SECRET in out.text or "root:x:0:0" in out.text:
            failures.append(f"{case.kind} / {case.what}: another file's contents are in the trace")
        elif out.seconds > TIME_BOUND or out.peak > MEMORY_BOUND:
            failures.append(f"{case.kind} / {case.what}: {out.seconds:.1f} s, {out.peak / fz.MiB:.0f} MiB")
        if i % 9 == 0:  # the command line on a sample: exit 0, or exit 2 with one line
            err = io.StringIO()
            args = [f"--max-{k[4:].replace('_', '-')}={v}" for k, v in caps.items()]
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                rc = cli(["summary", str(path), *args])
            lines = err.getvalue().splitlines()
            if not (rc == 0 or (rc == 2 and len(lines) == 1 and lines[0].startswith("shardviz: error: "))):
                failures.append(
                    f"CLI on {case.kind} / {case.what}: exit {rc}, stderr {err.getvalue()[:300]!r}"
                )
    print("\n" + "\n".join(f"{n:5d}  {kind}: {what}" for (kind, what), n in sorted(table.items())))
    assert not failures, f"{len(failures)} of {len(cases)} inputs:\n" + "\n".join(failures[:40])
    assert sum(table.values()) >= 800 * SCALE
    # the real files themselves still load
    assert (
        table[("Flight Recorder dump: field", "loaded")] and table[("trace file: trace.json field", "loaded")]
    )


def test_flight_frames_never_read_a_file_outside_the_source_root(
    seeds: dict[str, Any], tmp_path: Path
) -> None:
    rng = random.Random(7)
    root = tmp_path / "root"
    for case in flight_cases(seeds, rng, root):
        if "frame naming" not in case.what:
            continue
        trace = sv.load(
            case.make(tmp_path / case.what.replace("/", "_").replace(" ", "_")), source_root=root / "src"
        )
        texts = {c.source.text for c in trace.collectives() if c.source is not None}
        assert texts == {"train()"}, (case.what, texts)
