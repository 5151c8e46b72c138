"""What communication costs: bus bytes per rank and an alpha-beta time estimate per collective.

Bus bytes follow the convention of nccl-tests (``docs/PERFORMANCE.md`` there): the bytes each
rank must send (and receive) for the op over a ring of ``n`` ranks, from the size of its buffer:

- all_reduce: ``2 (n - 1) / n`` x buffer (reduce-scatter, then all-gather);
- all_gather: ``(n - 1) / n`` x output (= ``(n - 1)`` x each rank's input);
- reduce_scatter, all_to_all: ``(n - 1) / n`` x input;
- broadcast, scatter, gather, reduce, send, recv: 1 x buffer; barrier: none.

The time estimate is ``alpha x steps + bus_bytes / beta``: ``steps`` is the ring's number of
sequential steps (``2 (n - 1)`` for all_reduce, ``n - 1`` for the others, 1 for point-to-point),
``alpha`` a per-step latency and ``beta`` a per-rank link bandwidth. The presets give orders of
magnitude for common links (sources below); measure your own and pass a ``Link``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from . import describe
from .events import CollectiveEvent, Event


@dataclass(frozen=True, slots=True)
class Link:
    """A link model: ``alpha`` seconds per sequential step, ``beta`` bytes per second per rank."""

    name: str
    alpha: float
    beta: float
    source: str = ""

    def seconds(self, steps: int, bus_bytes: float) -> float:
        """The alpha-beta time of ``steps`` sequential steps moving ``bus_bytes`` per rank
        (a link with no bandwidth given, beta 0, counts latency only)."""
        return self.alpha * steps + (bus_bytes / self.beta if self.beta else 0.0)


# Bandwidths are per direction per GPU/port from the vendors' specifications; latencies are
# typical small-message per-step figures, rough by nature.
PRESETS: dict[str, Link] = {
    "nvlink4": Link(
        "NVLink 4 (H100 SXM)",
        alpha=2e-6,
        beta=450e9,
        source="NVIDIA H100 datasheet: 900 GB/s NVLink total bidirectional, 450 GB/s per direction",
    ),
    "nvlink3": Link(
        "NVLink 3 (A100 SXM)",
        alpha=2e-6,
        beta=300e9,
        source="NVIDIA A100 datasheet: 600 GB/s NVLink total bidirectional, 300 GB/s per direction",
    ),
    "pcie5": Link(
        "PCIe 5.0 x16",
        alpha=5e-6,
        beta=63e9,
        source="PCI-SIG PCIe 5.0: 32 GT/s per lane, 128b/130b encoding: ~63 GB/s per direction at x16",
    ),
    "pcie4": Link(
        "PCIe 4.0 x16",
        alpha=5e-6,
        beta=31.5e9,
        source="PCI-SIG PCIe 4.0: 16 GT/s per lane, 128b/130b encoding: ~31.5 GB/s per direction at x16",
    ),
    "ib-ndr": Link(
        "InfiniBand NDR (400 Gb/s)",
        alpha=8e-6,
        beta=50e9,
        source="NVIDIA ConnectX-7 / Quantum-2: NDR 400 Gb/s per port = 50 GB/s",
    ),
    "ib-hdr": Link(
        "InfiniBand HDR (200 Gb/s)",
        alpha=8e-6,
        beta=25e9,
        source="NVIDIA ConnectX-6 / Quantum: HDR 200 Gb/s per port = 25 GB/s",
    ),
}
DEFAULT_LINK = "nvlink4"


def link(spec: str | Link | None) -> Link:
    """A Link from a preset name, a Link, or None (the default preset)."""
    if spec is None:
        return PRESETS[DEFAULT_LINK]
    if isinstance(spec, Link):
        return spec
    if spec in PRESETS:
        return PRESETS[spec]
    raise ValueError(
        f"unknown link {spec!r}: use one of {sorted(PRESETS)} or shardviz.cost.Link(name, alpha, beta)"
    )


def bus_factor(op: str, n: int) -> float:
    """Bus bytes per byte of the rank's input buffer (see the module docstring)."""
    if n <= 1 or op == "barrier":
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "all_gather":
        return float(n - 1)  # (n - 1) / n of the n-times-larger output
    if op in ("reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def ring_steps(op: str, n: int) -> int:
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1)
    if op in ("send", "recv"):
        return 1
    return n - 1


@dataclass(frozen=True, slots=True)
class CostRow:
    """The cost of one collective event."""

    id: int
    op: str
    mesh_dim: str
    module: str
    group_size: int
    groups: int
    bytes_per_rank: int
    bus_bytes_per_rank: float
    seconds: float

    def as_dict(self) -> dict[str, object]:
        return {f: getattr(self, f) for f in self.__slots__}


@dataclass(frozen=True, slots=True)
class CostSummary:
    """Costs of a trace's collectives: ``rows`` per event, totals per mesh dim, per module, overall."""

    link: Link
    rows: list[CostRow]
    by_mesh_dim: dict[str, tuple[float, float]] = field(default_factory=dict)  # bus bytes, seconds
    by_module: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def total_bus_bytes(self) -> float:
        return sum(r.bus_bytes_per_rank for r in self.rows)

    @property
    def total_seconds(self) -> float:
        return sum(r.seconds for r in self.rows)

    def __str__(self) -> str:
        return _table(self)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def event_cost(e: CollectiveEvent, spec: str | Link | None = None) -> CostRow:
    """Bus bytes per rank (the largest over ranks) and the alpha-beta time of one collective."""
    lk = link(spec)
    n = e.group_size
    per_rank = max(e.nbytes.values(), default=0)
    bus = bus_factor(e.op, n) * per_rank
    steps = ring_steps(e.op, n)
    secs = lk.seconds(steps, bus)
    dim = describe.mesh_dim(e) or "-"
    return CostRow(e.id, e.op, dim, e.module or "-", n, len(e.groups), per_rank, bus, secs)


def summary(events: Iterable[Event], spec: str | Link | None = None) -> CostSummary:
    lk = link(spec)
    rows = [event_cost(e, lk) for e in events if isinstance(e, CollectiveEvent)]
    by_dim: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    by_mod: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        for acc, key in ((by_dim, r.mesh_dim), (by_mod, r.module)):
            acc[key][0] += r.bus_bytes_per_rank
            acc[key][1] += r.seconds
    return CostSummary(
        lk,
        rows,
        {k: (v[0], v[1]) for k, v in by_dim.items()},
        {k: (v[0], v[1]) for k, v in by_mod.items()},
    )


def human_seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def _table(c: CostSummary) -> str:
    head = ("#", "op", "mesh dim", "module", "group", "bytes/rank", "bus bytes/rank", "time")
    rows = [
        (
            str(r.id),
            r.op,
            r.mesh_dim,
            r.module,
            f"{r.groups}x{r.group_size}",
            describe.bytes_text(r.bytes_per_rank),
            describe.bytes_text(r.bus_bytes_per_rank),
            human_seconds(r.seconds),
        )
        for r in c.rows
    ]
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(cell.ljust(w) for cell, w in zip(cells, widths, strict=True)).rstrip()

    out = [
        f"Communication on {c.link.name} "
        f"(alpha {human_seconds(c.link.alpha)}, beta {c.link.beta / 1e9:g} GB/s)"
    ]
    out += [line(head), *[line(r) for r in rows]]
    out.append(
        f"total: {describe.bytes_text(c.total_bus_bytes)} bus bytes per rank, "
        f"{human_seconds(c.total_seconds)}"
    )
    for title, groups in (("by mesh dim", c.by_mesh_dim), ("by module", c.by_module)):
        if len(groups) > 1 or (groups and next(iter(groups)) != "-"):
            parts = [f"{k}: {describe.bytes_text(b)}, {human_seconds(t)}" for k, (b, t) in groups.items()]
            out.append(f"{title}: " + "; ".join(parts))
    return "\n".join(out)
