"""Loading a stranger's file: caps checked before reading, every field checked, clear errors.

One test per way a small or malformed file used to take gigabytes, read another file, raise a raw
exception or be accepted without a word; each expectation is written out by hand.
"""

from __future__ import annotations

import contextlib
import io
import json
import tracemalloc
from pathlib import Path
from typing import Any

import fuzzing as fz
import numpy as np
import pytest

import shardviz as sv
from shardviz.__main__ import main as cli
from shardviz.data.events import CollectiveEvent, Source, TensorSnapshot
from shardviz.data.limits import LimitError
from shardviz.data.load import PartialTraceWarning, rank_path
from shardviz.data.trace import Trace
from shardviz.errors import ShardvizError, TraceFileError
from shardviz.geometry.layout import compute

pytestmark = pytest.mark.timeout(120)


def small_trace(world: int = 4, values: bool = True) -> Trace:
    """Two collectives on every rank, with values: what a recording of a few lines gives."""
    t = Trace(world, "local", "all")
    t.events = [
        CollectiveEvent(
            id=i,
            source=Source("train.py", 3 + i, "dist.all_reduce(t)"),
            op="all_reduce",
            impl="c10d.allreduce_",
            reduce_op="sum",
            groups=(tuple(range(world)),),
            inputs={
                r: TensorSnapshot((3,), "float32", np.full(3, r, np.float32) if values else None)
                for r in range(world)
            },
            outputs={
                r: TensorSnapshot((3,), "float32", np.full(3, 6, np.float32) if values else None)
                for r in range(world)
            },
            nbytes={r: 12 for r in range(world)},
        )
        for i in range(2)
    ]
    return t


def parts(path: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    files = fz.read_zip(path.read_bytes())
    return json.loads(files["trace.json"]), files


def rewrite(path: Path, doc: Any = None, **members: bytes) -> Path:
    """The trace file at ``path`` with its trace.json replaced by ``doc`` and members replaced."""
    old_doc, files = parts(path)
    files = {**files, **{k.replace("__", "/") + ".npy": v for k, v in members.items()}}
    files["trace.json"] = json.dumps(old_doc if doc is None else doc).encode()
    out = path.with_name("bad.svtrace")
    out.write_bytes(fz.zip_of(files))
    return out


def peak_of(fn: Any) -> tuple[Any, int]:
    """``fn()``'s result (or the ShardvizError it raised) and the tracemalloc peak it reached."""
    tracemalloc.start()
    try:
        try:
            out: Any = fn()
        except ShardvizError as e:
            out = e
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    return small_trace().save(tmp_path / "t.svtrace")


# --- memory bombs ----------------------------------------------------------------------------------


def test_a_small_file_whose_array_inflates_to_gigabytes_is_refused_unread(saved: Path) -> None:
    doc, files = parts(saved)
    # 1.5 GB of float32 behind a header that agrees with trace.json: only the cap can stop it
    n = 1500 * fz.MiB // 4
    doc["events"][0]["inputs"]["0"]["shape"] = [n]
    members = [fz.member("trace.json", json.dumps(doc).encode())]
    members += [fz.member(k, v) for k, v in files.items() if k not in ("trace.json", "arrays/a0.npy")]
    members.append(fz.bomb("arrays/a0.npy", fz.npy_header((n,), "<f4"), 1500))
    bomb = saved.with_name("bomb.svtrace")
    bomb.write_bytes(fz.write_zip(members))
    assert bomb.stat().st_size < 2 * fz.MiB
    err, peak = peak_of(lambda: sv.load(bomb))
    assert isinstance(err, LimitError), err
    assert "array a0" in str(err) and "1.5 GiB" in str(err) and "over the cap of 1 GiB" in str(err)
    assert "max_member_bytes=" in str(err) and "SHARDVIZ_MAX_MEMBER_BYTES" in str(err)
    assert peak < 16 * fz.MiB


def test_an_array_header_is_checked_against_trace_json_before_allocating(saved: Path) -> None:
    # within every cap (100 MB), but trace.json says (3,): refused before the 100 MB is read
    members = [fz.member(k, v) for k, v in fz.read_zip(saved.read_bytes()).items() if k != "arrays/a0.npy"]
    members.append(fz.bomb("arrays/a0.npy", fz.npy_header((25 * fz.MiB,), "<f4"), 100))
    bad = saved.with_name("lying.svtrace")
    bad.write_bytes(fz.write_zip(members))
    err, peak = peak_of(lambda: sv.load(bad))
    assert isinstance(err, TraceFileError)
    assert f"array a0 has shape [{25 * fz.MiB}], but trace.json says [3] (rank 0's input)" in str(err)
    assert peak < 8 * fz.MiB


def test_trace_json_inflating_past_its_cap_is_refused(saved: Path) -> None:
    members = [fz.bomb("trace.json", b'{"format": "shardviz-trace", "pad": "', 300)]
    bad = saved.with_name("json-bomb.svtrace")
    bad.write_bytes(fz.write_zip(members))
    err, peak = peak_of(lambda: sv.load(bad))
    assert isinstance(err, LimitError) and "trace.json" in str(err) and "max_json_bytes" in str(err)
    assert peak < 8 * fz.MiB


def test_caps_are_raised_by_keyword_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = small_trace()
    big = np.arange(300_000, dtype=np.float32)  # 1.2 MB
    t.events[0].inputs[0] = TensorSnapshot(big.shape, "float32", big)
    path = t.save(tmp_path / "big.svtrace")
    with pytest.raises(LimitError, match=r"1\.1 MiB, over the cap of 1 MiB"):
        sv.load(path, max_member_bytes="1MiB")
    assert np.array_equal(sv.load(path, max_member_bytes="2MiB").events[0].inputs[0].values, big)
    monkeypatch.setenv("SHARDVIZ_MAX_MEMBER_BYTES", "1MiB")
    with pytest.raises(LimitError, match="SHARDVIZ_MAX_MEMBER_BYTES"):
        sv.load(path)
    assert sv.load(path, max_member_bytes=2**21) == t  # the keyword wins over the environment
    monkeypatch.setenv("SHARDVIZ_MAX_MEMBER_BYTES", "lots")
    with pytest.raises(ShardvizError, match="SHARDVIZ_MAX_MEMBER_BYTES='lots' is not a size"):
        sv.load(path)


def job_folder(tmp_path: Path, world: int, ranks: range, **meta: Any) -> Path:
    folder = tmp_path / "job"
    folder.mkdir()
    for r in ranks:
        t = small_trace(3, values=False)
        t.events = [
            CollectiveEvent(
                **{
                    **{f: getattr(e, f) for f in ("id", "source", "op", "impl", "groups")},
                    "inputs": {r: e.inputs[r]},
                    "outputs": {r: e.outputs[r]},
                    "nbytes": {r: 12},
                }
            )
            for e in t.events
        ]
        t.meta = {"rank": r, "world_size": 3, "run_id": "a", "status": {"how": "finished"}, **meta}
        path = t.save(rank_path(folder, r))
        doc, files = parts(path)
        doc["world_size"] = doc["meta"]["world_size"] = world
        path.write_bytes(fz.zip_of({**files, "trace.json": json.dumps(doc).encode()}))
    return folder


def test_a_job_folder_claiming_a_billion_ranks_is_refused(tmp_path: Path) -> None:
    folder = job_folder(tmp_path, 10**9, range(3))
    err, peak = peak_of(lambda: sv.load(folder))
    assert isinstance(err, LimitError)
    assert "rank00000.svtrace: its world_size is 1000000000, over the cap of 1048576" in str(err)
    assert "max_world_size" in str(err) and peak < 8 * fz.MiB


def test_a_large_claimed_world_costs_one_note_not_a_list_per_rank(tmp_path: Path) -> None:
    folder = job_folder(tmp_path, 1_000_000, range(3))
    with pytest.warns(PartialTraceWarning):
        trace, peak = peak_of(lambda: sv.load(folder))
    assert trace.world_size == 1_000_000 and not trace.complete
    assert trace.notes[-1] == (
        "ranks 3-999999: no trace (it died before shardviz wrote its file, or never started recording)"
    )
    assert peak < 64 * fz.MiB


def set_meta(path: Path, **meta: Any) -> None:
    doc, files = parts(path)
    doc["meta"].update(meta)
    path.write_bytes(fz.zip_of({**files, "trace.json": json.dumps(doc).encode()}))


def test_a_job_folder_whose_ranks_all_lie_beyond_its_world_is_an_error(tmp_path: Path) -> None:
    folder = job_folder(tmp_path, 3, range(3))
    for r in range(3):
        set_meta(rank_path(folder, r), rank=5 + r)
    with pytest.raises(TraceFileError, match=r"no rank file is of a rank within the job's world size \(3\)"):
        sv.load(folder)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli(["summary", str(folder)]) == 2
    assert err.getvalue().count("\n") == 1 and err.getvalue().startswith("shardviz: error: ")


def test_two_rank_files_claiming_one_rank_are_named(tmp_path: Path) -> None:
    folder = job_folder(tmp_path, 3, range(3))
    set_meta(rank_path(folder, 2), rank=1)
    with pytest.warns(PartialTraceWarning):
        trace = sv.load(folder)
    assert trace.notes[-2:] == [
        "rank 2: no trace (it died before shardviz wrote its file, or never started recording)",
        "ignored files: rank 1 (claimed by 2 files: rank00001.svtrace, rank00002.svtrace; "
        "read rank00001.svtrace)",
    ]


# --- Flight Recorder dumps -----------------------------------------------------------------------


def fr_entry(seq: int, frames: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "record_id": seq,
        "process_group": ["0", "default_pg"],
        "collective_seq_id": seq,
        "profiling_name": "nccl:allreduce",
        "input_sizes": [[4]],
        "input_dtypes": ["Float"],
        "output_sizes": [[4]],
        "output_dtypes": ["Float"],
        "state": "completed",
        "is_p2p": False,
        "frames": frames or [],
    }


def fr_folder(tmp_path: Path, dumps: dict[str, Any]) -> Path:
    folder = tmp_path / "fr"
    folder.mkdir(exist_ok=True)
    for name, d in dumps.items():
        (folder / name).write_text(json.dumps(d))
    return folder


def test_a_dump_claiming_a_billion_ranks_is_refused(tmp_path: Path) -> None:
    folder = fr_folder(
        tmp_path, {f"rank_{r}": {"rank": r * 10**9, "entries": [fr_entry(1)]} for r in range(2)}
    )
    err, peak = peak_of(lambda: sv.load(folder))
    assert isinstance(err, LimitError) and "rank_1: its rank is 1000000000, over the cap" in str(err)
    assert peak < 8 * fz.MiB


def test_a_large_world_of_dumps_costs_one_entry_for_its_missing_ranks(tmp_path: Path) -> None:
    gloo = sorted((Path(__file__).parent / "data" / "flight_gloo").glob("flight*.json"))
    docs = [json.loads(p.read_text()) for p in gloo]
    docs[2]["rank"] = 99_999  # gloo dumps list no members: the world is the highest rank + 1
    folder = fr_folder(tmp_path, {p.name: d for p, d in zip(gloo, docs, strict=True)})
    trace, peak = peak_of(lambda: sv.load(folder))
    assert trace.world_size == 100_000 and "no dump from ranks 2-99998" in trace.notes
    world = trace.collectives()[0]
    assert world.params["flight"]["missing"] == {"2-99998": "no dump from these ranks"}
    assert trace.collectives()[-1].params["flight"]["missing"] == {
        "1": "it never reached it: its last on this group is #3 (barrier)",
        "2-99998": "no dump from these ranks",
    }
    assert peak < 32 * fz.MiB


@pytest.mark.parametrize("target", ["/etc/passwd", "/dev/zero", "outside"])
def test_a_dump_never_makes_shardviz_read_another_file(tmp_path: Path, target: str) -> None:
    secret = tmp_path / "secret.py"
    secret.write_text("the secret\n")
    path = str(secret) if target == "outside" else target
    frames = [{"name": "step", "filename": path, "line": 1}]
    folder = fr_folder(tmp_path, {"rank_0": {"entries": [fr_entry(1, frames)]}})
    (c,) = sv.load(folder).collectives()
    assert c.source == Source(path, 1, "step()")
    # a source root elsewhere does not reach it either, whole or through a symlink or ".."
    root = tmp_path / "src"
    root.mkdir()
    (root / "link.py").symlink_to(secret)
    for name in (path, str(root / "link.py"), str(root / ".." / "secret.py")):
        frames[0]["filename"] = name
        folder = fr_folder(tmp_path, {"rank_0": {"entries": [fr_entry(1, frames)]}})
        (c,) = sv.load(folder, source_root=root).collectives()
        assert c.source is not None and c.source.text == "step()", name


def test_source_lines_come_from_under_the_source_root(tmp_path: Path) -> None:
    root = tmp_path / "checkout"
    (root / "job").mkdir(parents=True)
    (root / "job" / "train.py").write_text("import torch\nloss.backward()\ndist.all_reduce(grad)\n")
    # the dump's paths are another machine's: found under the root by their trailing parts
    frames = [{"name": "step", "filename": "/workspace/job/train.py", "line": 3}]
    folder = fr_folder(tmp_path, {"rank_0": {"entries": [fr_entry(1, frames)]}})
    (c,) = sv.load(folder, source_root=root).collectives()
    assert c.source == Source("/workspace/job/train.py", 3, "dist.all_reduce(grad)")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli(["summary", str(folder), "--source-root", str(root)]) == 0
    assert "dist.all_reduce(grad)" in out.getvalue()
    with pytest.raises(ShardvizError, match="source_root=.* cannot be used"):
        sv.load(folder, source_root=tmp_path / "nowhere")


def nccl_dump(rank: int, world: int = 4) -> dict[str, Any]:
    cfg = {"0": {"name": "0", "desc": "default_pg", "ranks": json.dumps(list(range(world)))}}
    return {"version": "2.10", "pg_config": cfg, "entries": [fr_entry(1), fr_entry(2)]}


def test_a_missing_highest_rank_is_named(tmp_path: Path) -> None:
    folder = fr_folder(tmp_path, {f"nccl_trace_rank_{r}": nccl_dump(r) for r in range(3)})
    trace = sv.load(folder)
    assert trace.world_size == 4 and not trace.complete
    assert "no dump from rank 3" in trace.notes
    assert trace.collectives()[0].params["flight"]["missing"] == {"3": "no dump from this rank"}
    assert trace.collectives()[0].groups == ((0, 1, 2, 3),)


def test_two_dumps_of_one_rank_are_named(tmp_path: Path) -> None:
    dumps = {f"nccl_trace_rank_{r}": nccl_dump(r, 3) for r in range(3)}
    folder = fr_folder(tmp_path, {**dumps, "flight00001.json": nccl_dump(1, 3)})
    trace = sv.load(folder)
    both = f"{folder / 'flight00001.json'}, {folder / 'nccl_trace_rank_1'}"
    assert f"rank 1 has 2 dumps ({both}): only the first was read" in trace.notes
    assert trace.meta["ranks"] == [0, 1, 2] and trace.complete


def test_a_dumps_rank_outside_its_default_group_is_an_error(tmp_path: Path) -> None:
    folder = fr_folder(tmp_path, {f"nccl_trace_rank_{r}": nccl_dump(r, 2) for r in range(3)})
    with pytest.raises(
        TraceFileError, match=r"default process group has 2 ranks \(pg_config\), but rank 2 has a dump"
    ):
        sv.load(folder)


# --- raw exceptions and what was accepted without a word ----------------------------------------


def flipped_deflate(saved: Path) -> Path:
    files = fz.read_zip(saved.read_bytes())
    m = fz.member("trace.json", files["trace.json"])
    m.data = b"\xff" + m.data[1:]  # a reserved block type: zlib.error
    out = saved.with_name("flipped.svtrace")
    out.write_bytes(fz.write_zip([m, *(fz.member(k, v) for k, v in files.items() if k != "trace.json")]))
    return out


def npy_of(a: np.ndarray) -> bytes:
    return fz.npy(a)


BAD_FILES: dict[str, tuple[Any, str]] = {
    # what trace.json (or a member) becomes -> what the error says
    "trace.json a list": (lambda d: [d], r"its trace.json holds a JSON list, not an object"),
    "events are ints": (
        lambda d: {**d, "events": [1, 2]},
        r"field events\[0\] of trace.json: expected an object, got 1",
    ),
    "an op that is an int": (
        lambda d: {**d, "events": [{**d["events"][0], "op": 7}]},
        r"field events\[0\]\.op of trace.json: expected a string, got 7",
    ),
    "deep nesting": (lambda d: {**d, "meta": fz.DEEP}, r"nests too deep"),
    "world_size=-4": (
        lambda d: {**d, "world_size": -4},
        r"field world_size of trace.json: expected an integer >= 1, got -4",
    ),
    "a group naming rank 99 of 4": (
        lambda d: {**d, "events": [{**d["events"][0], "groups": [[0, 99]]}]},
        r"field events\[0\]\.groups\[0\] of trace.json: expected a list of ranks in 0\.\.3, "
        r"got list \[0, 99\]",
    ),
    "a negative shape": (
        lambda d: {
            **d,
            "events": [{**d["events"][0], "inputs": {"0": {**d["events"][0]["inputs"]["0"], "shape": [-3]}}}],
        },
        r"field events\[0\]\.inputs\.0\.shape of trace.json: expected a shape",
    ),
    "a shape that is not an integer": (
        lambda d: {
            **d,
            "events": [
                {**d["events"][0], "inputs": {"0": {**d["events"][0]["inputs"]["0"], "shape": [1.5]}}}
            ],
        },
        r"inputs\.0\.shape of trace.json: expected a shape",
    ),
    "a shape disagreeing with its array": (
        lambda d: {
            **d,
            "events": [{**d["events"][0], "inputs": {"0": {**d["events"][0]["inputs"]["0"], "shape": [4]}}}],
        },
        r"array a0 has shape \[3\], but trace.json says \[4\]",
    ),
    "a rank key beyond the world": (
        lambda d: {**d, "events": [{**d["events"][0], "nbytes": {"7": 12}}]},
        r"field events\[0\]\.nbytes\.7 of trace.json: expected a rank in 0\.\.3",
    ),
    "version '1'": (
        lambda d: {**d, "version": "1"},
        r"is damaged: its trace format version is \"1\", expected a whole number from 1 to 1",
    ),
    "a parent that comes later": (
        lambda d: {**d, "events": [{**d["events"][0], "parent": 1}, d["events"][1]]},
        r"events\[0\]\.parent of trace.json: expected null or the id of an earlier event, got 1",
    ),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_malformed_trace_json_is_a_trace_file_error(saved: Path, name: str) -> None:
    change, message = BAD_FILES[name]
    doc, files = parts(saved)
    text = json.dumps(change(doc)).replace(json.dumps(fz.DEEP), "[" * 100_000 + "]" * 100_000)
    bad = saved.with_name("bad.svtrace")
    bad.write_bytes(fz.zip_of({**files, "trace.json": text.encode()}))
    with pytest.raises(TraceFileError, match=message):
        sv.load(bad)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli(["summary", str(bad)]) == 2
    assert err.getvalue().count("\n") == 1 and err.getvalue().startswith(f"shardviz: error: {bad}")


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.array(["a", "b", "c"]), r"array a0 cannot be read: it holds <U1 values, not numbers"),
        (np.zeros(3, dtype=[("x", "<f4")]), r"array a0 cannot be read: it holds \[\('x', '<f4'\)\] values"),
        (np.zeros(3, dtype=np.float64), r"array a0 holds float64 values, but trace.json expects float32"),
    ],
)
def test_arrays_of_another_kind_are_refused(saved: Path, array: np.ndarray, message: str) -> None:
    _, files = parts(saved)
    bad = saved.with_name("bad.svtrace")
    bad.write_bytes(fz.zip_of({**files, "arrays/a0.npy": npy_of(array)}))
    with pytest.raises(TraceFileError, match=message):
        sv.load(bad)


def test_a_flipped_compressed_byte_is_a_trace_file_error(saved: Path) -> None:
    with pytest.raises(TraceFileError, match="its trace.json cannot be read"):
        sv.load(flipped_deflate(saved))


def test_flight_entries_that_are_not_objects_are_a_trace_file_error(tmp_path: Path) -> None:
    folder = fr_folder(
        tmp_path,
        {"rank_0": {"entries": [1]}, "rank_1": {"entries": [{**fr_entry(1), "input_sizes": [[-1]]}]}},
    )
    with pytest.raises(
        TraceFileError, match=r"rank_0: field entries\[0\] of the Flight Recorder dump: expected an entry"
    ):
        sv.load(folder)
    (folder / "rank_0").unlink()
    with pytest.raises(
        TraceFileError, match=r"rank_1: field entries\[0\]\.input_sizes of the Flight Recorder dump"
    ):
        sv.load(folder)


# --- review findings -----------------------------------------------------------------------------


def test_telling_a_trace_from_a_dump_reads_four_bytes(tmp_path: Path) -> None:
    junk = tmp_path / "junk.bin"
    with open(junk, "wb") as f:
        f.truncate(256 * fz.MiB)  # sparse: no disk used
    err, peak = peak_of(lambda: sv.load(junk))
    assert isinstance(err, TraceFileError) and "not a zip archive" in str(err)
    assert peak < 8 * fz.MiB


def test_a_devices_contents_are_never_read(tmp_path: Path) -> None:
    err, peak = peak_of(lambda: sv.load("/dev/zero"))
    assert isinstance(err, TraceFileError) and "not a regular file" in str(err)
    assert peak < fz.MiB


@pytest.mark.parametrize("group", [0, 1, 2, 3])
def test_one_group_of_a_sub_mesh_round_trips(group: int) -> None:
    # mesh["tp"] of a (dp=4, tp=2) world: 4 groups of 2 ranks
    lay = compute((8, 4), (2,), ["S(0)"], ("tp",), groups=[[0, 1], [2, 3], [4, 5], [6, 7]])
    one = lay.group_layout(group)
    assert one.mesh_ranks == (2 * group, 2 * group + 1) and one.groups == ()
    assert [s.rank for s in one.shards] == [2 * group, 2 * group + 1]
    assert all(s.group == 0 for s in one.shards)  # a mesh that exists once has only group 0
    assert type(one).from_dict(json.loads(json.dumps(one.to_dict()))) == one


def test_a_scalar_snapshot_round_trips_as_a_scalar(tmp_path: Path) -> None:
    t = small_trace()
    t.events[0].outputs[2] = TensorSnapshot((), "float32", np.array(2.5, np.float32))
    back = sv.load(t.save(tmp_path / "scalar.svtrace"))
    assert back.events[0].outputs[2].values.shape == () and back == t
    # files written before held a 0-d value as one element: read back 0-d
    path = tmp_path / "scalar.svtrace"
    doc, files = parts(path)
    key = doc["events"][0]["outputs"]["2"]["values"]
    path.write_bytes(fz.zip_of({**files, f"arrays/{key}.npy": fz.npy(np.array([2.5], np.float32))}))
    assert sv.load(path) == t


def test_trace_equality_covers_every_saved_field(tmp_path: Path) -> None:
    a = small_trace()
    changes = {
        "notes": lambda t: t.notes.append("rank 3 stopped"),
        "meta": lambda t: t.meta.update(start_event=1),
        "complete": lambda t: setattr(t, "complete", False),
        "values_dropped_from": lambda t: setattr(t, "values_dropped_from", 1),
        "meshes": lambda t: t.meshes.append(
            {"mesh_shape": [4], "mesh_dim_names": None, "ranks": [0, 1, 2, 3]}
        ),
    }
    for name, change in changes.items():
        b = small_trace()
        change(b)
        assert a != b, name
        assert sv.load(b.save(tmp_path / f"{name}.svtrace")) == b, name
    assert small_trace() == a
