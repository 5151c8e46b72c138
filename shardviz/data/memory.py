"""Live bytes per rank over a recording: plain data, text and the numbers a view needs.

``sv.record(memory=...)`` samples, as each event starts, how many bytes of tensor storage every
rank holds (``shardviz.storage`` does the counting); this module keeps the result as numpy arrays
and event ids, with no torch, so that it saves with the trace and views can read it anywhere.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .describe import bytes_exact, bytes_text, rank_list

_BARS = " ▁▂▃▄▅▆▇█"


@dataclass(frozen=True, eq=False)
class MemoryTimeline:
    """Bytes of live tensor storage on every rank, sampled as each event of a trace starts.

    ``bytes[i, r]`` is what rank ``r`` held when event ``events[i]`` started (``None``: the end of
    the recording). ``peak[r]`` is the most rank ``r`` ever held, allocations between samples
    included, and ``peak_event[r]`` the last event started before it (``None``: before any event).
    ``counted`` says what the numbers cover: tensors made inside the recording, plus those of the
    modules and optimizers it was given.
    """

    world_size: int
    events: tuple[int | None, ...]
    bytes: np.ndarray
    peak: np.ndarray
    peak_event: tuple[int | None, ...]
    counted: str = "tensors made in the recording"
    labels: Mapping[int, str] = field(default_factory=dict)  # event id -> short description

    def __post_init__(self) -> None:
        b = np.asarray(self.bytes, dtype=np.int64).reshape(len(self.events), self.world_size)
        object.__setattr__(self, "bytes", b)
        object.__setattr__(self, "peak", np.asarray(self.peak, dtype=np.int64).reshape(self.world_size))
        if len(self.peak_event) != self.world_size:
            raise ValueError(f"peak_event has {len(self.peak_event)} entries for {self.world_size} ranks")

    # --- reading -----------------------------------------------------------------------------

    def rank(self, r: int) -> np.ndarray:
        """Rank ``r``'s live bytes at every sample."""
        if not 0 <= r < self.world_size:
            raise IndexError(f"rank {r} is not in this timeline (0-{self.world_size - 1})")
        return self.bytes[:, r]

    def at(self, event_id: int) -> np.ndarray:
        """Live bytes per rank as event ``event_id`` started."""
        try:
            return self.bytes[self.events.index(event_id)]
        except ValueError:
            raise KeyError(f"no memory sample at event {event_id}") from None

    @property
    def start(self) -> np.ndarray:
        """Each rank's live bytes at the first sample (zeros when nothing was sampled)."""
        return self.bytes[0] if len(self.events) else np.zeros(self.world_size, np.int64)

    @property
    def end(self) -> np.ndarray:
        """Each rank's live bytes at the last sample (zeros when nothing was sampled)."""
        return self.bytes[-1] if len(self.events) else np.zeros(self.world_size, np.int64)

    def rows(self) -> list[tuple[list[int], int, int, int, int | None]]:
        """``(ranks, start, peak, end, peak_event)``, ranks with the same numbers together."""
        seen: dict[tuple[int, int, int, int | None], list[int]] = {}
        for r in range(self.world_size):
            key = (int(self.start[r]), int(self.peak[r]), int(self.end[r]), self.peak_event[r])
            seen.setdefault(key, []).append(r)
        return [(ranks, *key) for key, ranks in seen.items()]

    def sparkline(self, r: int, width: int = 60) -> str:
        """Rank ``r``'s live bytes as one line of block characters (0 to the highest peak)."""
        return _spark(self.rank(r), int(self.peak.max(initial=0)), width)

    # --- plain data ----------------------------------------------------------------------------

    def to_dict(self, array: Callable[[np.ndarray], Any] | None = None) -> dict[str, Any]:
        """JSON-ready; ``array`` turns the bytes matrix into a reference (a trace file's arrays)."""
        return {
            "world_size": self.world_size,
            "events": list(self.events),
            "bytes": array(self.bytes) if array else self.bytes.tolist(),
            "peak": self.peak.tolist(),
            "peak_event": list(self.peak_event),
            "counted": self.counted,
            "labels": {str(k): v for k, v in self.labels.items()},
        }

    @classmethod
    def from_dict(
        cls, d: Mapping[str, Any], array: Callable[[Any], np.ndarray] | None = None
    ) -> MemoryTimeline:
        """The timeline ``to_dict`` wrote; ``array`` reads ``bytes`` back when it is an array's key."""
        raw = d["bytes"]
        return cls(
            world_size=int(d["world_size"]),
            events=tuple(None if e is None else int(e) for e in d["events"]),
            bytes=array(raw) if array and isinstance(raw, str) else np.asarray(raw, dtype=np.int64),
            peak=np.asarray(d["peak"], dtype=np.int64),
            peak_event=tuple(None if e is None else int(e) for e in d["peak_event"]),
            counted=str(d.get("counted", "")),
            labels={int(k): str(v) for k, v in (d.get("labels") or {}).items()},
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MemoryTimeline):
            return NotImplemented
        return (
            self.world_size == other.world_size
            and self.events == other.events
            and np.array_equal(self.bytes, other.bytes)
            and np.array_equal(self.peak, other.peak)
            and self.peak_event == other.peak_event
            and self.counted == other.counted
            and dict(self.labels) == dict(other.labels)
        )

    __hash__ = None  # type: ignore[assignment]

    def __str__(self) -> str:
        return text(self)

    def __repr__(self) -> str:
        top = int(self.peak.max(initial=0))
        return (
            f"<MemoryTimeline {self.world_size} ranks, {len(self.events)} samples, peak {bytes_exact(top)}>"
        )

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def _spark(values: np.ndarray, top: int, width: int) -> str:
    """Max per bucket, so a short peak between quiet samples still shows."""
    n = len(values)
    if n == 0:
        return ""
    edges = np.linspace(0, n, min(width, n) + 1).astype(int)
    out = []
    for a, b in itertools.pairwise(edges):
        v = int(values[a:b].max()) if b > a else 0
        out.append(_BARS[0 if top <= 0 else min(len(_BARS) - 1, -(-v * (len(_BARS) - 1) // top))])
    return "".join(out)


def event_label(m: MemoryTimeline, event_id: int | None) -> str:
    if event_id is None:
        return "before the first event"
    label = m.labels.get(event_id)
    return f"#{event_id} {label}" if label else f"#{event_id}"


def text(m: MemoryTimeline) -> str:
    """A table of start / peak / end per rank (equal ranks on one row) and a sparkline each."""
    rows = m.rows()
    head = (
        f"Memory per rank: {m.world_size} ranks, {len(m.events)} samples; live tensor storage ({m.counted})"
    )
    table = [("ranks", "start", "peak", "end", "peak during", "timeline")]
    for ranks, start, peak, end, at in rows:
        table.append(
            (
                rank_list(ranks),
                bytes_text(start),
                bytes_text(peak),
                bytes_text(end),
                event_label(m, at),
                m.sparkline(ranks[0], 40),
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]
    lines = [head]
    for r in table:
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)]
        lines.append("  ".join([*cells, f"|{r[-1]}|" if r is not table[0] else r[-1]]).rstrip())
    top = int(m.peak.max(initial=0))
    busiest = [r for r in range(m.world_size) if int(m.peak[r]) == top]
    lines.append(
        f"highest peak: {bytes_exact(top)} on rank{'s' if len(busiest) > 1 else ''} {rank_list(busiest)}"
    )
    return "\n".join(lines)
