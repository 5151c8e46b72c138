"""Where a parallel run leaves a reference run, row by row (``DiffRow``, ``NumericsReport``), and
how a report reads as text: its summary, its module tree as a table, a differing row in words."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...geometry.layout import Layout
from .assembly import Disagreement
from .report_write import save_report
from .run import KINDS, EventNote, RowKey
from .text import STATUS_TEXT, number, rank_ranges, shape_text, value_text
from .tolerance import Tolerance, ToleranceSpec, same

STATUSES = ("ok", "differs", "replicas", "shape", "unassembled", "missing")


@dataclass(frozen=True, slots=True, eq=False)
class DiffRow:
    """One row of the report: a tensor of the parallel run against the reference's.

    ``status``: ``ok``; ``differs`` (beyond ``tolerance``); ``replicas`` (equal to the reference
    where it was read, but copies that should agree do not); ``shape``; ``unassembled`` (its
    full tensor could not be made: ``notes`` says why); ``missing`` (in one run only).
    ``spans`` are, per tensor dim, the index ranges holding elements that differ; ``ranks`` the
    ranks whose shards hold them; ``error`` the per-element error in units of the tolerance
    (above 1 differs), for heat-maps.
    """

    key: RowKey
    module: str
    status: str
    dtype: str
    shape: tuple[int, ...] | None
    tolerance: Tolerance
    order: int
    max_abs: float | None = None
    max_rel: float | None = None
    worst: float | None = None  # the largest error, in units of the tolerance
    index: tuple[int, ...] | None = None  # where it is
    values: tuple[Any, Any] | None = None  # (parallel, reference) there
    count: int = 0  # elements beyond the tolerance
    numel: int = 0
    spans: tuple[tuple[tuple[int, int], ...], ...] = ()
    ranks: tuple[int, ...] = ()
    disagreements: tuple[Disagreement, ...] = ()
    reference_disagreements: tuple[Disagreement, ...] = ()
    events: tuple[EventNote, ...] = ()
    events_during: bool = False  # the events ran while this row was computed (else: just before)
    notes: tuple[str, ...] = ()
    layout: Layout | None = None
    inferred: bool = False
    error: np.ndarray | None = None

    def __eq__(self, other: object) -> bool:
        return same(self, other)

    @property
    def phase(self) -> str:
        return self.key.phase

    @property
    def what(self) -> str:
        return self.key.what

    @property
    def differs(self) -> bool:
        """A finding: beyond tolerance, replicas that disagree, or another shape."""
        return self.status in ("differs", "replicas", "shape")

    def where(self) -> str:
        """The index ranges that differ, per dim: ``dim 1 [0:4, 8:12], dim 2 [all 64]``."""
        if not self.spans or self.shape is None:
            return ""
        parts = []
        for d, runs in enumerate(self.spans):
            n = self.shape[d]
            if runs == ((0, n),):
                parts.append(f"dim {d} [all {n}]")
            else:
                parts.append(f"dim {d} [{', '.join(f'{a}:{b}' if b - a > 1 else str(a) for a, b in runs)}]")
        return ", ".join(parts)

    def __str__(self) -> str:
        return f"{self.module} {self.phase} {self.what}: {self.status}"


@dataclass(frozen=True, eq=False)
class NumericsReport:
    """Where a parallel run of a training step leaves a reference run, row by row.

    ``rows`` are in the parallel run's order (forward, loss, backward, gradients, the step);
    ``first`` is the first that differs (None when none does). ``str(report)`` is the summary
    and the module tree with the error of every row; ``sv.show`` / ``sv.plot`` /
    ``sv.export_html`` draw it.
    """

    reference: str
    parallel: str
    root: str
    modules: tuple[tuple[str, str], ...]
    rows: tuple[DiffRow, ...]
    world_size: int
    tolerance: ToleranceSpec = None
    # The parallel run's Trace (event ids in the rows are its ids): sv.play(report.trace, step=...).
    trace: Any = field(default=None, repr=False, compare=False)
    notes: tuple[str, ...] = ()  # about the comparison as a whole (a forward-only step)

    def __eq__(self, other: object) -> bool:
        return same(self, other)

    def save(self, path: str | Path) -> Path:
        """Write the report (with the parallel run's trace) to ``path``: JSON and numpy arrays in one
        zip, as a trace file, never pickle; ``sv.load(path)`` reads it back equal."""
        return save_report(self, path)

    @property
    def differences(self) -> list[DiffRow]:
        """Every finding (beyond tolerance, copies that disagree, another shape), in the order the
        parallel step ran them."""
        return [r for r in self.rows if r.differs]

    @property
    def unassembled(self) -> list[DiffRow]:
        """Rows whose full tensor could not be put together from the ranks' shards (each says why)."""
        return [r for r in self.rows if r.status == "unassembled"]

    @property
    def missing(self) -> list[DiffRow]:
        """Rows that are in one run only (a module called on one side only, say)."""
        return [r for r in self.rows if r.status == "missing"]

    @property
    def first(self) -> DiffRow | None:
        """The first finding: where the parallel run first leaves the reference (None: nowhere)."""
        for r in self.rows:
            if r.differs:
                return r
        return None

    @property
    def ok(self) -> bool:
        """No difference, nothing missing and every row assembled."""
        return not any(r.status != "ok" for r in self.rows)

    def after(self) -> list[DiffRow]:
        """The rows that differ after the first one."""
        diffs = self.differences
        return diffs[1:]

    def row(self, module: str, what: str = "output", call: int = 0) -> DiffRow:
        """A row by module name (with or without the root's class name) and ``what`` as printed
        (``"output"``, ``"input[0]"``, ``"grad_input[0]"``, ``"weight.grad"``, ...)."""
        path = module.removeprefix(self.root).removeprefix(".") if module.startswith(self.root) else module
        for r in self.rows:
            if r.key.module == path and r.key.call == call and r.what == what:
                return r
        raise KeyError(f"no row {what!r} of {module!r} (call {call}) in this report")

    def summary(self) -> str:
        """What was compared and the first difference, with no per-row table."""
        return "\n".join(self._head())

    def _head(self) -> list[str]:
        n = len(self.differences)
        lines = [
            f"NumericsReport: {self.parallel} against {self.reference}: {len(self.rows)} rows, "
            + (f"{n} differ" if n else "no difference beyond tolerance")
        ]
        first = self.first
        if first is None:
            largest = max(
                (r for r in self.rows if r.worst is not None and r.status == "ok"),
                key=lambda r: r.worst or 0.0,
                default=None,
            )
            if largest is not None and largest.worst:
                lines.append(
                    f"largest error: {largest.worst:.2g} of the tolerance ({largest.tolerance}) at "
                    f"{largest.module} {largest.phase} {largest.what}"
                )
        else:
            lines += describe_row(first, "first difference: ")
            later = self.after()
            if later:
                names = ", ".join(f"{r.module} {r.phase} {r.what}" for r in later[:3])
                more = f", ... ({len(later) - 3} more)" if len(later) > 3 else ""
                lines.append(
                    f"then {len(later)} more row{'s' if len(later) != 1 else ''} differ: {names}{more}"
                )
        lines += [f"note: {n}" for n in self.notes]
        if self.unassembled:
            names = ", ".join(f"{r.module} {r.phase} {r.what}" for r in self.unassembled[:3])
            lines.append(f"not assembled: {len(self.unassembled)} row(s) ({names}); see their notes")
        if self.missing:
            lines.append(f"in one run only: {len(self.missing)} row(s)")
        return lines

    def tree(self) -> list[tuple[int, str | None, DiffRow | None]]:
        """The module tree as (depth, module name or None, row or None): one line per module, then
        its rows, modules in the tree's order."""
        by_module: dict[str, list[DiffRow]] = {}
        for r in self.rows:
            by_module.setdefault(r.key.module, []).append(r)
        order = [p for p, _ in self.modules]
        order += [m for m in by_module if m not in order]
        shown = {""} if by_module else set()
        for m in by_module:
            parts = m.split(".") if m else []
            shown.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        out: list[tuple[int, str | None, DiffRow | None]] = []
        for path in order:
            if path not in shown:
                continue
            rows = by_module.get(path, [])
            depth = 0 if not path else path.count(".") + 1
            cls = dict(self.modules).get(path, "")
            name = (path.rsplit(".", 1)[-1] if path else self.root) + (f" ({cls})" if cls and path else "")
            out.append((depth, name, None))
            rows.sort(key=lambda r: (KINDS.index(r.key.kind), r.key.call, r.order))
            out += [(depth + 1, None, r) for r in rows]
        return out

    def table(self) -> str:
        """The module tree, one line per row with its error and status."""
        head = ("module / tensor", "phase", "shape", "dtype", "max abs", "max rel", "status")
        lines: list[tuple[str, ...]] = [head]
        for depth, name, row in self.tree():
            if row is None:
                lines.append(("  " * depth + (name or ""), "", "", "", "", "", ""))
                continue
            call = f" #{row.key.call}" if row.key.call else ""
            lines.append(
                (
                    "  " * depth + row.what + call,
                    row.phase,
                    shape_text(row.shape),
                    row.dtype,
                    number(row.max_abs),
                    number(row.max_rel),
                    STATUS_TEXT[row.status],
                )
            )
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        return "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
        )

    def __str__(self) -> str:
        return "\n".join([*self._head(), "", self.table()])

    def __repr__(self) -> str:
        first = self.first
        where = f", first at {first.module} {first.phase} {first.what}" if first else ""
        return f"<NumericsReport {self.parallel} vs {self.reference}: {len(self.differences)} differ{where}>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def describe_row(row: DiffRow, lead: str = "") -> list[str]:
    """A differing row in words: where, how much, which ranks, and what ran just before."""
    call = f" (call {row.key.call})" if row.key.call else ""
    lines = [f"{lead}{row.module} · {row.phase} · {row.what}{call} · {STATUS_TEXT[row.status]}"]
    if row.max_abs is not None and row.count:
        lines.append(
            f"  max abs {number(row.max_abs)}, max rel {number(row.max_rel)}; {row.count} of {row.numel} "
            f"elements beyond {row.dtype} tolerance ({row.tolerance})"
        )
        if row.index is not None and row.values is not None:
            at = list(row.index) if row.index else "the scalar"
            lines.append(
                f"  worst at {at}: {value_text(row.values[0])} here, "
                f"{value_text(row.values[1])} in the reference"
            )
        if row.where():
            lines.append(f"  differs in {row.where()}")
        if row.ranks:
            lines.append(f"  held by rank{'s' if len(row.ranks) > 1 else ''} {rank_ranges(row.ranks)}")
    lines += [f"  {d}" for d in row.disagreements]
    lines += [f"  in the reference: {d}" for d in row.reference_disagreements]
    if row.layout is not None:
        how = " (inferred)" if row.inferred else ""
        lines.append(
            f"  layout [{', '.join(row.layout.placements)}] on mesh {row.layout.mesh_shape}"
            + (f" {row.layout.mesh_dim_names}" if row.layout.mesh_dim_names else "")
            + how
        )
    lines += [f"  note: {n}" for n in row.notes]
    if row.events:
        lines.append(
            "  collectives and redistributes " + ("while it ran:" if row.events_during else "just before it:")
        )
        lines += [f"    #{e.id} {e.text}" for e in row.events]
    return lines
