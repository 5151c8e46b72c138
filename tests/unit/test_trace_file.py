"""trace.save / sv.load: an exact round trip without pickle, and clear errors for bad files."""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardviz as sv
from shardviz.errors import TraceFileError


@pytest.fixture(scope="module")
def trace():
    sv.use("local", world_size=4)

    def body():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dt = distribute_tensor(torch.arange(20.0).reshape(5, 4), mesh, [Shard(0), Replicate()])
        dt.redistribute(mesh, [Replicate(), Replicate()])
        t = sv.per_rank(lambda r: torch.tensor([r, float("nan"), float("inf")], dtype=torch.bfloat16))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        outs = [torch.zeros(2, dtype=torch.int64) for _ in range(4)]
        dist.all_gather(outs, sv.per_rank(lambda r: torch.tensor([r, -r])))
        return dt.to_local(), {"step": 3, "ok": True}

    return sv.run(body)


def test_round_trip_is_exact(trace, tmp_path):
    path = trace.save(tmp_path / "t.svtrace")
    loaded = sv.load(path)
    assert loaded == trace
    assert str(loaded) == str(trace)
    a, b = trace.collectives(), loaded.collectives()
    for x, y in zip(a, b, strict=True):
        for r in x.outputs:
            xs, ys = x.outputs[r], y.outputs[r]
            if isinstance(xs, list):
                assert all(np.array_equal(p.values, q.values) for p, q in zip(xs, ys, strict=True))
            else:
                assert np.array_equal(xs.values, ys.values, equal_nan=True) and xs.dtype == ys.dtype
    bf16 = next(c for c in b if c.op == "all_reduce")
    assert bf16.inputs[2].dtype == "bfloat16" and bf16.outputs[0].summary.nan == 1
    for r in range(4):
        assert torch.equal(loaded.results[r][0], trace.results[r][0])
        assert loaded.results[r][1] == {"step": 3, "ok": True}
    red = loaded.redistributes()[0]
    assert red.before == trace.redistributes()[0].before and red.after.placements == ("R", "R")


def test_file_is_json_and_npy_only(trace, tmp_path):
    path = trace.save(tmp_path / "t.svtrace")
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        doc = json.loads(z.read("trace.json"))
    assert names[0] == "trace.json" and all(n.startswith("arrays/") and n.endswith(".npy") for n in names[1:])
    assert doc["format"] == "shardviz-trace" and doc["version"] == 1


def test_unsaveable_results_are_dropped_with_a_warning(tmp_path):
    sv.use("local", world_size=2)
    t = sv.run(lambda: object())
    with pytest.warns(UserWarning, match="not saved"):
        t.save(tmp_path / "x")
    assert sv.load(tmp_path / "x").results == {}


def write_zip(path, files):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    path.write_bytes(buf.getvalue())
    return path


def test_bad_files(tmp_path, trace):
    not_zip = tmp_path / "a"
    not_zip.write_bytes(b"hello")
    with pytest.raises(TraceFileError, match="not a shardviz trace"):
        sv.load(not_zip)
    with pytest.raises(TraceFileError, match="no trace.json"):
        sv.load(write_zip(tmp_path / "b", {"other.txt": "x"}))
    with pytest.raises(TraceFileError, match="not a shardviz trace"):
        sv.load(write_zip(tmp_path / "c", {"trace.json": json.dumps({"format": "else"})}))
    with pytest.raises(TraceFileError, match="newer shardviz"):
        sv.load(
            write_zip(tmp_path / "d", {"trace.json": json.dumps({"format": "shardviz-trace", "version": 99})})
        )
    with pytest.raises(TraceFileError, match="damaged"):
        sv.load(write_zip(tmp_path / "e", {"trace.json": "{not json"}))
    # A real trace with one array removed.
    good = trace.save(tmp_path / "f")
    with zipfile.ZipFile(good) as z:
        files = {n: z.read(n) for n in z.namelist() if n != "arrays/a0.npy"}
    with pytest.raises(TraceFileError, match="array a0 is missing"):
        sv.load(write_zip(tmp_path / "g", files))
    # Truncated bytes.
    data = good.read_bytes()
    cut = tmp_path / "h"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceFileError):
        sv.load(cut)
    with pytest.raises(FileNotFoundError):
        sv.load(tmp_path / "missing")


def test_pickled_arrays_are_refused(tmp_path, trace):
    good = trace.save(tmp_path / "f")
    with zipfile.ZipFile(good) as z:
        files = {n: z.read(n) for n in z.namelist()}
    evil = io.BytesIO()
    np.save(evil, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    files["arrays/a0.npy"] = evil.getvalue()
    with pytest.raises(TraceFileError, match="cannot be read"):
        sv.load(write_zip(tmp_path / "evil", files))
