"""Reproducible measurements for shardviz; writes the tables in benchmarks/README.md.

Every figure is a ratio against a baseline measured in the same run (interleaved, medians of
repeats), so the tables mean the same on a loaded laptop and on CI. Run with ``make bench``;
``python benchmarks/run.py recording`` runs one section.
"""

from __future__ import annotations

import contextlib
import gc
import platform
import random
import re
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import shardviz as sv
from shardviz.backends import choose
from shardviz.geometry.layout import _cached as _layout_memo

HERE = Path(__file__).resolve().parent
Row = tuple[str, str, str, str]


def median_seconds(fn: Callable[[], object], repeats: int = 7) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def interleaved(
    cases: dict[str, Callable[[], contextlib.AbstractContextManager[object]]],
    body: Callable[[], object] | dict[str, Callable[[], object]],
    rounds: int,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[dict[str, float], dict[str, float]]:
    """Median time of ``body`` under each context, the contexts taking turns to share the noise,
    and each context's ratio to the first one (``paired``).

    Each round runs every context once, in a shuffled order (seeded): a fixed order lets the
    context that runs after another inherit its caches and allocator state. The clock covers
    entering and leaving the context too (a recording is finished on leaving), and ``body``'s
    result is held until after, as a notebook cell's variable would be. Garbage is collected
    after every run, off the clock. ``body`` may be one per case (a dict); ``clock`` is
    ``time.process_time`` where the CPU a body costs is wanted, not what other processes take.
    """
    bodies = body if isinstance(body, dict) else dict.fromkeys(cases, body)
    times: dict[str, list[float]] = {k: [] for k in cases}
    for k, ctx in cases.items():  # warm up
        with ctx():
            bodies[k]()
    order = list(cases.items())
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for k, ctx in order:
            t = clock()
            with ctx():
                result = bodies[k]()
            times[k].append(clock() - t)
            del result
            # Off the clock: DTensor's outputs sit in reference cycles until the cyclic GC runs;
            # left to it, they pile up and the run that triggers it pays for all (bare
            # LocalTensorMode looked 1.3x slower than a recorded run at 128 ranks).
            gc.collect()
    base = times[next(iter(cases))]
    return {k: statistics.median(v) for k, v in times.items()}, {k: paired(v, base) for k, v in times.items()}


def training_step(model: Any, opt: Any, tokens: Any) -> Callable[[], object]:
    """One training step of a language model on ``tokens``: forward, a mean loss, backward, the
    optimizer's step; the loss is returned (held past the clock, as a notebook variable would be)."""

    def step() -> object:
        loss = model(tokens).float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def paired(times: list[float], base: list[float]) -> float:
    """The median of per-round ratios: a round's drift (allocator state, another process) cancels
    out within the round."""
    return statistics.median(t / b for t, b in zip(times, base, strict=True))


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# --- geometry --------------------------------------------------------------------------------


def bench_geometry() -> list[Row]:
    """sv.layout (exact per-rank indices) vs torch's own per-rank shape/offset computation."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from shardviz.capture import torch as _torch
    from shardviz.geometry import mesh
    from shardviz.geometry.placement import parse

    rows = []
    shape = (8192, 28672)
    for mesh_shape, placements in [
        ((8,), ["S(0)"]),
        ((8, 8), ["S(0)", "S(1)"]),
        ((8, 8, 8), ["S(0)", "S(1)", "R"]),
    ]:
        progress(f"geometry {mesh_shape}")
        torch_pl = [_torch.placement_from_plain(parse(p)) for p in placements]
        coords = mesh.coords(mesh_shape)

        def baseline(coords=coords, mesh_shape=mesh_shape, torch_pl=torch_pl) -> None:
            for c in coords:
                _compute_local_shape_and_global_offset(shape, mesh_shape, list(c), torch_pl)

        def ours(mesh_shape=mesh_shape, placements=placements) -> None:
            _layout_memo.cache_clear()  # the computation itself, not the memo
            sv.layout(shape, mesh_shape, placements)

        b, o = median_seconds(baseline), median_seconds(ours)
        rows.append(
            (
                f"layout of {shape} on mesh {mesh_shape} ({len(coords)} ranks)",
                f"{o * 1e3:.2f} ms",
                f"{b * 1e3:.2f} ms (torch shape+offset per rank)",
                f"{o / b:.2f}x",
            )
        )
    progress("plan on 512 ranks")
    src, dst = ["S(0)", "S(1)", "P"], ["R", "S(1)", "R"]
    names = ("pp", "dp", "tp")

    def plan() -> None:
        _layout_memo.cache_clear()
        sv.plan((8192, 28672), (8, 8, 8), src, dst, names, dtype="bfloat16")

    def layouts_only() -> None:
        _layout_memo.cache_clear()
        sv.layout((8192, 28672), (8, 8, 8), src, names)
        sv.layout((8192, 28672), (8, 8, 8), dst, names)

    p, lo = median_seconds(plan, 5), median_seconds(layouts_only, 5)
    tracemalloc.start()
    plan()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    rows.append(
        (
            "sv.plan of one 8192x28672 bf16 weight, (8,8,8) mesh, 512 ranks (target < 1 s, < 200 MB)",
            f"{p * 1e3:.0f} ms, peak {peak / 2**20:.1f} MiB",
            f"{lo * 1e3:.0f} ms (its two layouts alone)",
            f"{p / lo:.2f}x",
        )
    )
    rows.append(_model_map_row())
    return rows


def _llama_layouts(layers: int = 32, d: int = 4096, ff: int = 14336, vocab: int = 128256) -> dict[str, Any]:
    """A 32-layer Llama-3-8B-style model's parameters as pure geometry on (pp, dp, tp) = (8, 8, 8):
    FSDP Shard(0) over dp, Colwise Shard(0) / Rowwise Shard(1) over tp, norms replicated on tp."""
    mesh, names = (8, 8, 8), ("pp", "dp", "tp")

    def lay(shape: tuple[int, ...], tp: str) -> Any:
        return sv.layout(shape, mesh, ["R", "S(0)", tp], names, dtype="bfloat16")

    out = {"tok_embeddings.weight": lay((vocab, d), "S(1)")}
    for i in range(layers):
        p = f"layers.{i}."
        for name, shape, tp in [
            ("attention.wq", (d, d), "S(0)"),
            ("attention.wk", (d // 4, d), "S(0)"),
            ("attention.wv", (d // 4, d), "S(0)"),
            ("attention.wo", (d, d), "S(1)"),
            ("feed_forward.w1", (ff, d), "S(0)"),
            ("feed_forward.w2", (d, ff), "S(1)"),
            ("feed_forward.w3", (ff, d), "S(0)"),
            ("attention_norm", (d,), "R"),
            ("ffn_norm", (d,), "R"),
        ]:
            out[f"{p}{name}.weight"] = lay(shape, tp)
    out["norm.weight"] = lay((d,), "R")
    out["output.weight"] = lay((vocab, d), "S(0)")
    return out


def _model_map_row() -> Row:
    """sv.model_map of the 32-layer model on 512 ranks (target < 1 s), from scratch (layout memo
    cleared), against computing its distinct layouts alone."""
    progress("model map of a 32-layer Llama on 512 ranks")

    def whole() -> object:
        _layout_memo.cache_clear()
        return sv.model_map(_llama_layouts(), world_size=512)

    def layouts_only() -> object:
        _layout_memo.cache_clear()
        return _llama_layouts()

    w, lo = median_seconds(whole, 5), median_seconds(layouts_only, 5)
    m = whole()
    return (
        f"sv.model_map of a 32-layer Llama ({len(m.rows)} params), (8,8,8) mesh, 512 ranks (target < 1 s)",
        f"{w * 1e3:.0f} ms",
        f"{lo * 1e3:.0f} ms (its {len(m.layouts)} distinct layouts alone)",
        f"{w / lo:.2f}x",
    )


# --- recording overhead ----------------------------------------------------------------------


def _tp_mlp(world: int = 8) -> tuple[torch.nn.Module, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())][:-1]
    net = torch.nn.Sequential(*layers)
    plan = {str(i): ColwiseParallel() if i % 4 == 0 else RowwiseParallel() for i in range(0, 7, 2)}
    sv.use("local", world_size=world)
    with sv.record():
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        model = parallelize_module(net, mesh, plan)
        x = torch.randn(64, 256)
    return model, x


@contextlib.contextmanager
def _with_mode(mode_cls: type) -> Iterator[None]:
    backend = choose.current()
    with backend.simulate(), mode_cls():  # type: ignore[attr-defined]
        yield


def bench_recording() -> list[Row]:
    """The TP MLP forward of the engine notes: 4 x Linear(256,256), batch 64, mesh of 8."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils._debug_mode import DebugMode

    torch.set_num_threads(1)
    progress("recording overhead: TP MLP on 8 ranks")
    model, x = _tp_mlp(8)
    backend = choose.current()
    cases = {
        "bare simulation": backend.simulate,  # type: ignore[attr-defined]
        'sv.record(values="none")': lambda: sv.record(values="none"),
        "sv.record() (default value policy)": lambda: sv.record(),
        'sv.record(values="all")': lambda: sv.record(values="all"),
        "DebugMode": lambda: _with_mode(DebugMode),
        "CommDebugMode": lambda: _with_mode(CommDebugMode),
    }
    med, ratio = interleaved(cases, lambda: model(x), rounds=30)
    base = med["bare simulation"]
    targets = {
        'sv.record(values="none")': " (target <= 1.10)",
        "sv.record() (default value policy)": " (target <= 1.25)",
    }
    return [
        (
            f"TP MLP forward under {k}{targets.get(k, '')}",
            f"{v * 1e3:.1f} ms",
            f"{base * 1e3:.1f} ms (bare)",
            f"{ratio[k]:.2f}x",
        )
        for k, v in med.items()
        if k != "bare simulation"
    ]


def bench_scale(
    sizes: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128, 256), sides: tuple[int, ...] = (64, 512)
) -> list[Row]:
    """A 2-D redistribute [S(0), S(1)] -> [R, R] at growing world sizes, of a tiny tensor (where
    shardviz's fixed cost per event shows most) and of a modest one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    rows = []
    for n in sizes:
        a = 1 << ((n.bit_length() - 1) // 2)
        shape = (a, n // a)
        progress(f"scale: 2-D redistribute on {shape} ({n} ranks) - setup")
        sv.use("local", world_size=n)
        with sv.record(values="none"):
            mesh = init_device_mesh("cpu", shape)
        backend = choose.current()
        cases = {
            "bare": backend.simulate,  # type: ignore[attr-defined]
            "none": lambda: sv.record(values="none"),
            "default": lambda: sv.record(),
        }
        for side in sides:
            with sv.record(values="none"):
                dt = distribute_tensor(
                    torch.randn(side, side), mesh, [Shard(0), Shard(1)], src_data_rank=None
                )
            progress(f"scale: {n} ranks, {side}x{side} - timing")
            rounds = 101 if n <= 4 else 51 if n <= 16 else 21 if n <= 64 else 7

            def body(dt=dt, mesh=mesh) -> object:
                return dt.redistribute(mesh, [Replicate(), Replicate()])

            med, ratio = interleaved(cases, body, rounds)
            rows.append(
                (
                    f"2-D redistribute [S(0),S(1)]->[R,R] of {side}x{side} on mesh {shape} ({n} ranks)",
                    f'{med["none"] * 1e3:.1f} ms (values="none"), {med["default"] * 1e3:.1f} ms (default)',
                    f"{med['bare'] * 1e3:.1f} ms (bare)",
                    f"{ratio['none']:.2f}x / {ratio['default']:.2f}x",
                )
            )
    sv.use("local", world_size=4)
    return rows


def bench_collectives() -> list[Row]:
    """The collectives shardviz does itself while recording (once per group, see the recorder),
    against LocalTensorMode's own, on the same inputs: how much of the recording ratios comes
    from doing them differently rather than from recording."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardviz.capture.recorder import c10d

    functional = torch.ops._c10d_functional

    torch.set_num_threads(1)
    rows = []
    for n, side in ((2, 64), (8, 64), (8, 512)):
        progress(f"collectives: {n} ranks, {side}x{side}")
        sv.use("local", world_size=n, engine="lockstep")  # LocalTensorMode's own collectives
        with sv.record(values="none"):
            mesh = init_device_mesh("cpu", (n,))
        backend = choose.current()
        name = mesh.get_group(0).group_name
        groups = (tuple(range(n)),)
        with backend.simulate():  # type: ignore[attr-defined]
            shard = sv.per_rank(lambda r, side=side, n=n: torch.randn(side // n, side))
            part = sv.per_rank(lambda r, side=side: torch.randn(side, side))
        ops = {
            "all_gather": (
                lambda shard=shard, n=n, name=name: functional.all_gather_into_tensor(shard, n, name),
                lambda shard=shard, n=n, name=name, groups=groups: c10d.gather_per_group(
                    {"input": shard, "group_size": n, "group_name": name}, groups
                ),
            ),
            "all_reduce": (
                lambda part=part, name=name: functional.all_reduce(part, "sum", name),
                lambda part=part, name=name, groups=groups: c10d.reduce_per_group(
                    {"input": part, "reduce_op": "sum", "group_name": name}, groups
                ),
            ),
        }
        for op, (theirs, ours) in ops.items():
            times: dict[str, list[float]] = {"theirs": [], "ours": []}
            with backend.simulate():  # type: ignore[attr-defined]
                for _ in range(201):
                    for key, fn in (("theirs", theirs), ("ours", ours)):
                        t = time.perf_counter()
                        out = fn()
                        times[key].append(time.perf_counter() - t)
                        del out
            ours_s, theirs_s = statistics.median(times["ours"]), statistics.median(times["theirs"])
            rows.append(
                (
                    f"{op} of {side}x{side} over {n} ranks, once per group (as recorded)",
                    f"{ours_s * 1e6:.0f} us",
                    f"{theirs_s * 1e6:.0f} us (LocalTensorMode's)",
                    f"{paired(times['ours'], times['theirs']):.2f}x",
                )
            )
    sv.use("local", world_size=4)
    return rows


def bench_memory() -> list[Row]:
    """Bytes a trace holds per event, for each value policy (TP MLP forward on 8 ranks)."""
    progress("trace memory per event")
    model, x = _tp_mlp(8)
    rows = []
    for policy in ("none", 2**20, "all"):
        gc.collect()
        tracemalloc.start()
        with sv.record(values=policy) as trace:
            y = model(x)
        del y
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] + _torch_held_values(trace)
        tracemalloc.stop()
        n = len(trace.events)
        values = sum(a.nbytes for a in _snapshot_values(trace))
        rows.append(
            (
                f"trace of the TP MLP forward, values={policy!r} ({n} events)",
                f"{held / n / 1024:.1f} KiB per event",
                f"{values / n / 1024:.1f} KiB per event of raw snapshot values",
                f"{held / max(values, 1):.2f}x" if values else "-",
            )
        )
        del trace
    return rows


def _snapshot_values(trace: sv.Trace) -> Iterator[Any]:
    """The values array of every snapshot that kept one, once per rank that holds it."""
    for event in trace.events:
        for side in (getattr(event, "inputs", {}), getattr(event, "outputs", {})):
            for v in side.values():
                for snap in v if isinstance(v, list) else [v]:
                    if snap.values is not None:
                        yield snap.values


def _torch_held_values(trace: sv.Trace) -> int:
    """Bytes of snapshot values in memory torch allocated (large copies, aliased buffers), which
    tracemalloc does not see; each buffer counted once."""
    import numpy as np

    seen: set[int] = set()
    total = 0
    for a in _snapshot_values(trace):
        root = a
        while isinstance(root, np.ndarray) and root.base is not None:
            root = root.base
        ptr = a.__array_interface__["data"][0]
        if isinstance(root, torch.Tensor) and ptr not in seen:
            seen.add(ptr)
            total += a.nbytes
    return total


TRIVIAL_ESM = """
export default {
  render({ model, el }) {
    const d = document.createElement("div");
    d.setAttribute("data-shardviz-view", "trivial");
    d.textContent = String(model.get("value"));
    el.appendChild(d);
  },
};
"""


def _state_bytes(state: dict[str, object]) -> int:
    import json

    return len(json.dumps(state, separators=(",", ":")).encode())


def _render_seconds(page: object, html: Path, repeats: int = 5) -> float:
    def once() -> None:
        page.goto(html.as_uri())  # type: ignore[attr-defined]
        page.wait_for_selector("[data-shardviz-view]")  # type: ignore[attr-defined]

    return median_seconds(once, repeats)


def bench_views() -> list[Row]:
    """Synced-state bytes and time to first render in Chromium, against a trivial widget."""
    import tempfile

    import torch.distributed as dist
    from playwright.sync_api import sync_playwright

    from shardviz.views import html as export

    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        trivial = export.export("trivial", {"value": 0}, None, TRIVIAL_ESM, "", tmp / "trivial.html")
        trivial_bytes = _state_bytes({"value": 0})
        progress("views: a 256-rank layout")
        pages: dict[str, tuple[Path, int]] = {}
        for n, mesh_shape in ((8, (2, 4)), (256, (16, 16))):
            widget = sv.show(sv.layout((64, 64), mesh_shape, ["S(0)", "S(1)"]))
            state = {
                k: getattr(widget, k) for k in widget.keys if not k.startswith("_") and k not in _WIDGET_BASE
            }
            pages[f"layout view, {n} ranks (geometry only)"] = (
                sv.export_html(sv.layout((64, 64), mesh_shape, ["S(0)", "S(1)"]), tmp / f"layout{n}.html"),
                _state_bytes(state),
            )
        if hasattr(sv, "play"):
            progress("views: a 1,000-event trace")
            sv.use("local", world_size=4)
            with sv.record() as trace:
                t = sv.per_rank(lambda r: torch.full((8,), float(r)))
                for _ in range(1000):
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
            player = sv.play(trace)
            state = {
                k: getattr(player, k) for k in player.keys if not k.startswith("_") and k not in _WIDGET_BASE
            }
            pages["collective player, 1,000 events"] = (
                sv.export_html(trace, tmp / "player.html"),
                _state_bytes(state),
            )
        progress("views: rendering in Chromium")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path="/usr/bin/chromium",
                args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
            )
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            base = _render_seconds(page, trivial)
            for name, (html, nbytes) in pages.items():
                secs = _render_seconds(page, html)
                rows.append(
                    (
                        f"{name}: synced state / time to first render",
                        f"{nbytes / 1024:.1f} KiB / {secs * 1e3:.0f} ms",
                        f"{trivial_bytes} B / {base * 1e3:.0f} ms (trivial widget)",
                        f"{secs / base:.2f}x render",
                    )
                )
            browser.close()
    return rows


def bench_llama() -> list[Row]:
    """A whole training step of a torchtitan-style Llama (2 layers, TP + sequence parallel on the
    tp slice of a (dp=2, tp=4) mesh, 8 ranks): forward, backward and an SGD step."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardviz.examples.llama import ModelArgs, Transformer, parallelize

    torch.set_num_threads(1)
    progress("recording overhead: Llama-style training step on 8 ranks")
    sv.use("local", world_size=8)
    torch.manual_seed(0)
    with sv.record():
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        model = parallelize(Transformer(ModelArgs()), mesh["tp"])
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, 128, (2, 16))

    step = training_step(model, opt, tokens)

    backend = choose.current()
    cases = {
        "bare simulation": backend.simulate,  # type: ignore[attr-defined]
        'sv.record(values="none")': lambda: sv.record(values="none"),
        "sv.record() (default value policy)": lambda: sv.record(),
        # Opt-in: looks at every operator's result to count live storage per rank.
        "sv.record(memory=[model, opt])": lambda: sv.record(memory=[model, opt]),
    }
    med, ratio = interleaved(cases, step, rounds=20)
    base = med["bare simulation"]
    targets = {
        'sv.record(values="none")': " (target <= 1.10)",
        "sv.record() (default value policy)": " (target <= 1.25)",
    }
    return [
        (
            f"Llama step under {k}{targets.get(k, '')}",
            f"{v * 1e3:.0f} ms",
            f"{base * 1e3:.0f} ms (bare)",
            f"{ratio[k]:.2f}x",
        )
        for k, v in med.items()
        if k != "bare simulation"
    ]


def bench_titan() -> list[Row]:
    """torchtitan's own Llama 3 step, unpatched (debug config cut to 2 layers, SDPA, sequence 16):
    its parallelize_llama with FSDP2 + TP on (dp_shard=2, tp=4), 8 ranks, each dp replica its own
    batch: forward, its cross-entropy loss, backward, an AdamW step."""
    try:
        import torchtitan.distributed.parallel_dims as parallel_dims
    except ImportError:
        return [("torchtitan FSDP2 + TP step", "-", "-", "torchtitan not installed (make setup)")]
    import dataclasses

    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs, parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    torch.set_num_threads(1)
    progress("recording overhead: torchtitan FSDP2 + TP step on 8 ranks")
    parallel_dims.device_type = "cpu"  # torchtitan takes "cuda" when it finds no accelerator
    dist_utils.set_spmd_backend("partial_dtensor")
    sv.use("local", world_size=8)
    p = ParallelismConfig(
        spmd_backend="partial_dtensor", data_parallel_shard_degree=2, tensor_parallel_degree=4
    )
    cfg = llama3_configs["debugmodel"](attn_backend="flex")
    cfg.layers = cfg.layers[:2]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=16)
    set_llama3_sharding_config(cfg, enable_sp=True)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    tokens, labels = (torch.randint(0, 2048, (2, 2, 16), generator=g) for _ in range(2))
    with sv.record(values="none"):
        dims = ParallelDims.from_config(p, 8)
        dims.build_mesh()
        with torch.device("meta"):
            model = cfg.build()
        parallelize_llama(
            model,
            parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param="float32"),
            parallelism=p,
            compile_config=CompileConfig(),
            ac_config=None,
            dump_folder="",
        )
        model.to_empty(device="cpu")
        model.init_weights()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mine = sv.per_rank(lambda r: tokens[r // 4]), sv.per_rank(lambda r: labels[r // 4])

    def step() -> object:
        pred = model(mine[0])
        loss = cross_entropy_loss(pred.full_tensor(), mine[1]) / tokens.numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    backend = choose.current()
    cases = {
        "bare simulation": backend.simulate,  # type: ignore[attr-defined]
        'sv.record(values="none")': lambda: sv.record(values="none"),
        "sv.record() (default value policy)": lambda: sv.record(),
    }
    med, ratio = interleaved(cases, step, rounds=10)
    base = med["bare simulation"]
    target = {'sv.record(values="none")': " (target <= 1.10)"}
    return [
        (
            f"torchtitan FSDP2 + TP step under {k}{target.get(k, '')}",
            f"{v * 1e3:.0f} ms",
            f"{base * 1e3:.0f} ms (bare)",
            f"{ratio[k]:.2f}x",
        )
        for k, v in med.items()
        if k != "bare simulation"
    ]


_LLAMA_SETUP = """
import torch
from torch.distributed.device_mesh import init_device_mesh
from shardviz.examples.llama import ModelArgs, Transformer, parallelize
torch.manual_seed(0)
mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
model = parallelize(Transformer(ModelArgs()), mesh["tp"])
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
tokens = torch.randint(0, 128, (2, 16))
"""
_LLAMA_STEP = "loss = model(tokens).float().mean()\nloss.backward()\nopt.step()\nopt.zero_grad()\nloss.item()"


_MLP_SETUP = """
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
torch.manual_seed(0)
mesh = init_device_mesh("cpu", (WORLD,))
plan = {"0": ColwiseParallel(), "1": RowwiseParallel(), "2": ColwiseParallel(), "3": RowwiseParallel()}
model = parallelize_module(nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]), mesh, plan)
x = torch.randn(64, 256)
"""
_MLP_STEP = "model(x).sum().item()"


def _threads_vs_lockstep(world: int, setup: str, step: str, rounds: int) -> tuple[float, float, float]:
    """A recorded %%spmd cell on one thread per rank and on the lockstep simulator, taking turns:
    (threads ms, lockstep ms, paired ratio). Both must give the same value."""
    import types

    from shardviz.backends import session
    from shardviz.backends.local import LocalBackend
    from shardviz.backends.threads import ThreadsBackend

    old = session.peek()  # an earlier section's backend holds a process group of its world size
    if old is not None:
        old.close()
        session.install(None)
    # The lockstep engine: the threads, like it, run each op once per rank.
    sims: dict[str, Any] = {
        "lockstep": LocalBackend(world, engine="lockstep"),
        "threads": ThreadsBackend(world),
    }
    shells = {k: types.SimpleNamespace(user_ns={}) for k in sims}
    got = {}
    for k, b in sims.items():
        with session.swapped(b):
            b.run_cell(setup.replace("WORLD", str(world)), shells[k])
            got[k] = b.run_cell(step, shells[k])
    assert got["lockstep"] == got["threads"], got  # the same step, the same value
    now: list[str] = []

    @contextlib.contextmanager
    def on(k: str) -> Iterator[None]:
        now[:] = [k]
        with session.swapped(sims[k]):
            yield

    def body() -> object:
        return sims[now[0]].run_cell(step, shells[now[0]])

    med, ratio = interleaved({k: (lambda k=k: on(k)) for k in sims}, body, rounds=rounds)
    for b in sims.values():
        b.close()
    return med["threads"], med["lockstep"], ratio["threads"]


def bench_threads() -> list[Row]:
    """Recorded ``%%spmd`` cells on one thread per rank (``sv.use("threads")``) against the
    lockstep simulator (``sv.use("local")``) in the same run, the model kept from a set-up cell:
    the Llama step of ``bench_llama``, and the TP MLP forward of ``bench_recording`` at 8 and 16
    ranks (lockstep dispatches each DTensor op once for all ranks, the threads once per rank)."""
    torch.set_num_threads(1)
    rows = []
    progress("one thread per rank vs lockstep: Llama-style training step on 8 ranks")
    t, b, r = _threads_vs_lockstep(8, _LLAMA_SETUP, _LLAMA_STEP, rounds=10)
    rows.append(("Llama step (8 ranks), recorded %%spmd cell, one thread per rank", t, b, r))
    for world in (8, 16):
        progress(f"one thread per rank vs lockstep: TP MLP forward on {world} ranks")
        t, b, r = _threads_vs_lockstep(world, _MLP_SETUP, _MLP_STEP, rounds=15)
        rows.append((f"TP MLP forward ({world} ranks), recorded %%spmd cell, one thread per rank", t, b, r))
    return [
        (k, f"{t * 1e3:.0f} ms", f"{b * 1e3:.0f} ms (lockstep simulator)", f"{r:.2f}x") for k, t, b, r in rows
    ]


_FIRST_PICTURE = """
import torch
import shardviz as sv
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
sv.use("local", world_size=4)
with sv.record():
    mesh = init_device_mesh("cpu", (4,))
    dt = distribute_tensor(torch.arange(30.0).reshape(10, 3), mesh, [Shard(0)])
sv.plot(dt).savefig(PATH)
"""


# What the first picture loads that is not shardviz's: the user's own DTensor import, torch._dynamo
# (LocalTensor's constructor is @torch._disable_dynamo: the first simulated tensor imports it) and
# the matplotlib Figure that sv.plot returns, drawn by Agg.
_PICTURE_FLOOR = """
import torch
import torch.distributed.tensor
import torch._dynamo
import matplotlib.figure, matplotlib.backends.backend_agg
"""


def bench_startup() -> list[Row]:
    """Time to first picture: fresh interpreters, taking turns (shuffled, seeded), against
    ``import torch`` in the same rounds: ``import shardviz``, and the README's first picture (a
    4-rank DTensor drawn to PNG). The clock covers the whole process, start-up included."""
    import subprocess
    import tempfile

    progress("time to first picture: fresh processes")
    with tempfile.TemporaryDirectory() as tmp:
        codes = {
            "torch": "import torch",
            "shardviz": "import shardviz",
            "picture": _FIRST_PICTURE.replace("PATH", repr(str(Path(tmp) / "dt.png"))),
            "floor": _PICTURE_FLOOR,
        }
        times: dict[str, list[float]] = {k: [] for k in codes}

        def once(code: str) -> float:
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            return time.perf_counter() - t

        for code in codes.values():
            once(code)  # warm the file cache
        order = list(codes.items())
        for i in range(9):
            random.Random(i).shuffle(order)
            for k, code in order:
                times[k].append(once(code))
    med = {k: statistics.median(v) for k, v in times.items()}
    base = f"{med['torch'] * 1e3:.0f} ms (import torch)"
    return [
        (
            "import shardviz, fresh process (target <= 1.15x)",
            f"{med['shardviz'] * 1e3:.0f} ms",
            base,
            f"{paired(times['shardviz'], times['torch']):.2f}x",
        ),
        (
            "a 4-rank DTensor drawn to PNG (sv.plot), fresh process (target <= 2x)",
            f"{med['picture'] * 1e3:.0f} ms",
            base,
            f"{paired(times['picture'], times['torch']):.2f}x",
        ),
        (
            "torch's own part of that picture: the imports it cannot skip (see above), fresh process",
            f"{med['floor'] * 1e3:.0f} ms",
            base,
            f"{paired(times['floor'], times['torch']):.2f}x",
        ),
    ]


def bench_numerics() -> list[Row]:
    """sv.diff of the Llama step (plain-torch reference, the parallel step captured module by
    module, full tensors assembled and compared) against recording the same parallel step alone
    with sv.run: both build the mesh, parallelize a fresh copy, and run forward, backward and an
    SGD step on 8 simulated ranks. Paired rounds in a shuffled (seeded) order, garbage collected
    after every run, off the clock."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from shardviz.examples.llama import ModelArgs, Transformer, parallelize

    torch.set_num_threads(1)
    progress("sv.diff of the Llama step against recording the step alone")
    sv.use("local", world_size=8)
    torch.manual_seed(0)
    model = Transformer(ModelArgs())
    tokens = torch.randint(0, 128, (2, 16))

    def tp_sp(m: torch.nn.Module) -> torch.nn.Module:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        return parallelize(m, mesh["tp"])

    def step_alone() -> object:
        twin = copy.deepcopy(model)

        def step() -> object:
            m = tp_sp(twin)
            opt = torch.optim.SGD(m.parameters(), lr=1e-2)
            m(tokens).mean().backward()
            opt.step()
            return None

        return sv.run(step)

    def diff() -> object:
        return sv.diff(model, tp_sp, tokens)

    cases = {"step": step_alone, "diff": diff}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():
        fn()  # warm up
    order = list(cases.items())
    for _ in range(9):
        random.Random(len(times["step"])).shuffle(order)
        for k, fn in order:
            t = time.perf_counter()
            result = fn()
            times[k].append(time.perf_counter() - t)
            del result
            gc.collect()
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = len(diff().rows)  # type: ignore[attr-defined]
    return [
        (
            f"sv.diff of the Llama step ({rows} rows) against recording the step alone (target <= 2x)",
            f"{med['diff'] * 1e3:.0f} ms",
            f"{med['step'] * 1e3:.0f} ms (sv.run of the step)",
            f"{paired(times['diff'], times['step']):.2f}x",
        )
    ]


def _plain_llama_step(args: Any, tokens: torch.Tensor) -> Callable[[], object]:
    """Plain torch's step (forward, backward, AdamW) of the example Llama on the global batch."""
    from shardviz.examples.llama import Transformer

    torch.manual_seed(1)
    model = Transformer(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    return training_step(model, opt, tokens)


def _simulated_llama_step(
    args: Any, tokens: torch.Tensor, world: int, tp: int, engine: str
) -> Callable[[], object]:
    """The same step on ``world`` simulated ranks (``sv.use("local", engine=engine)``): TP +
    sequence parallel on the ``tp`` slice of a ``(world // tp, tp)`` mesh, each dp replica its own
    rows of the global batch. Same seed as the plain step, so both start from the same weights."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardviz.examples.llama import Transformer, parallelize

    dp = world // tp
    rows = tokens.shape[0] // dp
    sv.use("local", world_size=world, engine=engine)
    with choose.current().simulate():  # type: ignore[attr-defined]
        torch.manual_seed(1)
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        model = parallelize(Transformer(args), mesh["tp"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mine = sv.per_rank(lambda r: tokens[(r // tp) * rows : (r // tp + 1) * rows])

    return training_step(model, opt, mine)


def bench_engine() -> list[Row]:
    """The simulator's engines against plain torch on the global batch: a recorded Llama step
    (forward, backward, AdamW; TP + sequence parallel, each dp replica its own rows) of the small
    example model on 8 ranks and on 64, and of a debug-size one on 8. Each engine takes turns with
    plain torch in rounds of its own (switching engines starts a new simulated world). CPU time,
    one torch thread."""
    from shardviz.capture import torch as _torch
    from shardviz.examples.llama import ModelArgs

    torch.set_num_threads(1)
    rows: list[Row] = []
    debug = ModelArgs(dim=256, n_layers=4, vocab_size=2048, hidden_dim=512)
    configs = [
        ("small Llama (2 layers, dim 64), 8 ranks", ModelArgs(), 8, 16, 9, "15x"),
        ("debug-size Llama (4 layers, dim 256, vocab 2048, seq 128), 8 ranks", debug, 8, 128, 5, "2.5x"),
        ("small Llama, 64 ranks", ModelArgs(), 64, 16, 3, None),
    ]
    for what, args, world, seq, rounds, target in configs:
        torch.manual_seed(0)
        tokens = torch.randint(0, args.vocab_size, (2 * (world // 4), seq))
        plain = _plain_llama_step(args, tokens)
        for engine in _torch.ENGINES:
            progress(f"engines: {what}, {engine}")
            step = _simulated_llama_step(args, tokens, world, 4, engine)
            med, ratio = interleaved(
                {"plain": contextlib.nullcontext, engine: sv.record},
                {"plain": plain, engine: step},
                rounds,
                clock=time.process_time,
            )
            aim = ""
            if engine == "batched":
                aim = f" (target <= {target})" if target else " (target < 0.5 s)"
            rows.append(
                (
                    f"{what}: recorded step, {engine} engine{aim}",
                    f"{med[engine] * 1e3:.0f} ms CPU",
                    f"{med['plain'] * 1e3:.1f} ms (plain torch, global batch)",
                    f"{ratio[engine]:.1f}x",
                )
            )
    return rows


# Traits every ipywidget has (layout, tabbable, ...): not part of a view's own payload.
_WIDGET_BASE = {"layout", "tabbable", "tooltip", "comm", "keys", "log"}


SECTIONS: dict[str, Callable[[], list[Row]]] = {
    "geometry": bench_geometry,
    "recording": bench_recording,
    "llama": bench_llama,
    "titan": bench_titan,
    "threads": bench_threads,
    "scale": bench_scale,
    "collectives": bench_collectives,
    "memory": bench_memory,
    "views": bench_views,
    "numerics": bench_numerics,
    "startup": bench_startup,
    "engine": bench_engine,
}


def write(tables: dict[str, list[Row]]) -> None:
    readme = HERE / "README.md"
    text = readme.read_text()
    machine = (
        f"Machine: {platform.machine()}, {platform.system()}, Python {sys.version.split()[0]}, "
        f"torch {torch.__version__}, shardviz {sv.__version__}, {torch.get_num_threads()} torch thread(s)."
    )
    for name, rows in tables.items():
        table = "\n".join(
            [
                machine,
                "",
                "| measurement | shardviz | baseline (same run) | ratio |",
                "|---|---|---|---|",
                *[f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows],
            ]
        )
        text = re.sub(
            rf"<!-- {name} -->.*?<!-- /{name} -->",
            lambda _, table=table, name=name: f"<!-- {name} -->\n{table}\n<!-- /{name} -->",
            text,
            flags=re.S,
        )
        print(f"\n## {name}\n{table}")
    readme.write_text(text)


if __name__ == "__main__":
    chosen = sys.argv[1:] or list(SECTIONS)
    unknown = [c for c in chosen if c not in SECTIONS]
    if unknown:
        sys.exit(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    write({name: SECTIONS[name]() for name in chosen})
