"""What the client knows about each rank during a call, and the faults it diagnoses from it: a
rank that raised, died, hangs in a collective another rank never enters, or runs Python past the
spin limit; the errors (RankError, CollectiveHangError) and their text."""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import ShardvizError
from .. import rank as _rank

# --- errors --------------------------------------------------------------------------------------


class RankError(ShardvizError, RuntimeError):
    """Code raised on one or more ranks; carries each rank's traceback and where every rank was."""

    def __init__(
        self,
        message: str,
        errors: Mapping[int, Mapping[str, Any]] | None = None,
        where: Mapping[int, str] | None = None,
        missing: Sequence[int] = (),
        spinning: Mapping[int, Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__(message)
        self.errors = dict(errors or {})
        self.where = dict(where or {})
        self.missing = list(missing)
        self.spinning = dict(spinning or {})  # rank -> its spin report: seconds, stack, where

    @property
    def ranks(self) -> list[int]:
        """The ranks that raised (or, for a hang, the ranks that are missing)."""
        return sorted(self.errors) if self.errors else list(self.missing)

    def _render_traceback_(self) -> list[str]:
        """What IPython shows: the message and the ranks' tracebacks, not shardviz's own frames."""
        return [f"{type(self).__name__}: {self}"]


class CollectiveHangError(RankError):
    """A rank died, or never entered a collective the others entered: they would hang."""


class SpinningRankWarning(UserWarning):
    """A rank has run Python past ``spin_limit`` without reaching a collective. It may just be
    slow, so the notebook keeps waiting; turned into an error (``warnings.simplefilter("error",
    SpinningRankWarning)``), it stops every rank as Ctrl-C does."""


# --- what the client knows about each rank during a call -----------------------------------------


@dataclass
class RankRun:
    """One rank's side of a dispatched call, as the client sees it."""

    rank: int
    engine: int
    status: str = "running"  # running | done | died | failed (shardviz itself failed on the rank)
    result: dict[str, Any] | None = None
    flight: dict[str, Any] | None = None
    failure: str = ""
    stdout: str = ""
    stderr: str = ""
    outputs: list[dict[str, Any]] = field(default_factory=list)
    finished_at: float | None = None  # time.monotonic() when the client saw it finish
    spin: dict[str, Any] | None = None  # its report past the spin limit, while it still applies

    @property
    def finished(self) -> bool:
        return self.status != "running"

    @property
    def error(self) -> dict[str, Any] | None:
        return self.result.get("error") if self.result else None


def collective_counts(flight: Mapping[str, Any] | None) -> dict[tuple[int, ...], int]:
    return {tuple(g): int(n) for g, n in ((flight or {}).get("counts") or {}).items()}


def _coll(last: Mapping[str, Any]) -> str:
    group = ",".join(str(r) for r in last.get("group", ()))
    where = f" (line {last['line']}: {last['text']})" if last.get("line") else ""
    return f"{last['op']} #{last['gseq']} on group [{group}]{where}"


def spin_text(spin: Mapping[str, Any]) -> str:
    """A spin report in words: how long the rank has run Python since its last collective, where."""
    return (
        f"Python for {float(spin['seconds']):.1f} s without reaching a collective "
        f"(spin_limit {float(spin['limit']):g} s), at {spin['where']}"
    )


def where_text(run: RankRun) -> str:
    """Where a rank is or stopped, in words: inside a collective, or running code outside one."""
    flight = run.flight or {}
    last = flight.get("last")
    n = int(flight.get("n") or 0)
    interrupted = (run.error or {}).get("spin")
    if run.status == "done" and interrupted:
        return (
            f"stopped by on_spin='interrupt' after running {spin_text(interrupted)}; "
            f"{n} collective{'s' if n != 1 else ''} before"
        )
    if run.status == "died":
        return f"died (engine {run.engine} exited); " + (
            f"last collective entered: {_coll(last)}" if last else "it had entered no collective"
        )
    if run.status == "failed":
        return f"shardviz failed on this rank: {run.failure.splitlines()[-1] if run.failure else '?'}"
    if run.status == "done":
        err = run.error
        head = f"raised {err['ename']}" if err else "finished"
        return f"{head} after {n} collective{'s' if n != 1 else ''}" + (
            f"; last: {_coll(last)}" if last and err else ""
        )
    if last and last.get("state") == "in":
        return f"waiting in {_coll(last)}"
    after = f" (last: {_coll(last)})" if last else ""
    if run.spin:
        return f"running {spin_text(run.spin)}{after}"
    return f"running outside any collective{after}"


def running_python(run: RankRun) -> bool:
    """Still running, and not inside a collective: Ctrl-C (SIGINT) reaches its Python code."""
    last = (run.flight or {}).get("last") or {}
    return not run.finished and last.get("state") != "in"


@dataclass
class Fault:
    """Why the client stopped waiting: a rank that died, skipped or diverged."""

    kind: str  # died | skipped | mismatch | timeout
    missing: list[int]
    summary: str


def diagnose(runs: Sequence[RankRun], now: float | None = None, grace: float = 2.0) -> Fault | None:
    """Decide, from finished ranks and the others' published positions, whether waiting longer
    can only end in the process-group timeout. Pure: it reads what the ranks reported.

    A rank whose collective failed (a timeout, a peer that closed the connection) while others
    still run is only judged ``grace`` seconds later: a peer that died is reported by ipyparallel
    a moment after its neighbours notice, and "died" is the better answer."""
    dead = [r.rank for r in runs if r.status == "died"]
    if dead:
        blocked = [r.rank for r in runs if not r.finished]
        return Fault(
            "died",
            dead,
            f"{ranks_text(dead)} died (engine exited) while running"
            + (f"; {ranks_text(blocked)} cannot finish without {_them(dead)}" if blocked else ""),
        )
    finished = [r for r in runs if r.finished]
    running = [r for r in runs if not r.finished]
    for s in running:
        s_counts = collective_counts(s.flight)
        for g, n in sorted(s_counts.items()):
            for r in finished:
                if r.rank in g and collective_counts(r.flight).get(g, 0) < n:
                    last = (s.flight or {}).get("last") or {}
                    what = (
                        _coll(last)
                        if tuple(last.get("group", ())) == g
                        else f"collective #{n} on group {list(g)}"
                    )
                    how = "finished"
                    if r.error:
                        stopped = r.error.get("spin")
                        how = "was stopped (on_spin='interrupt')" if stopped else f"raised {r.error['ename']}"
                    return Fault(
                        "skipped",
                        [r.rank],
                        f"rank {r.rank} {how} without entering {what}, which rank {s.rank} entered; "
                        f"rank {s.rank} would wait for it until the process-group timeout",
                    )
    inside = [r for r in running if ((r.flight or {}).get("last") or {}).get("state") == "in"]
    for i, a in enumerate(inside):
        la = a.flight["last"]  # type: ignore[index]
        for b in inside[i + 1 :]:
            lb = b.flight["last"]  # type: ignore[index]
            same_step = tuple(la["group"]) == tuple(lb["group"]) and la["gseq"] == lb["gseq"]
            if same_step and la["op"] != lb["op"]:
                return Fault(
                    "mismatch",
                    [],
                    f"rank {a.rank} is in {_coll(la)} but rank {b.rank} is in {_coll(lb)}: the ranks "
                    "called different collectives",
                )
    now = time.monotonic() if now is None else now
    timed_out = [
        r
        for r in finished
        if r.error and r.error.get("distributed") and now - (r.finished_at or now) >= grace
    ]
    if timed_out and running:
        states = {True: "is running Python, outside any collective", False: "is inside a collective"}
        doing = ", ".join(f"rank {r.rank} {states[running_python(r)]}" for r in running)
        return Fault(
            "timeout",
            [r.rank for r in running],
            f"{ranks_text([r.rank for r in timed_out])} failed inside a collective "
            f"({timed_out[0].error['evalue'].splitlines()[0][:160]}) while {doing}",  # type: ignore[index]
        )
    return None


def pid_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in sorted(ranks))


def _them(ranks: Sequence[int]) -> str:
    return "it" if len(ranks) == 1 else "them"


def where_lines(where: Mapping[int, str]) -> list[str]:
    return ["Where each rank is:", *(f"  rank {r}: {w}" for r, w in sorted(where.items()))]


def spinning_reports(runs: Sequence[RankRun]) -> dict[int, dict[str, Any]]:
    """Each rank's report past the spin limit: stopped by it, or still running past it."""
    out = {}
    for r in runs:
        spin = (r.error or {}).get("spin") or r.spin
        if spin:
            out[r.rank] = dict(spin)
    return out


def error_head(errors: Mapping[int, Mapping[str, Any]]) -> str:
    kinds: dict[str, list[int]] = {}
    heads = []
    for r, e in sorted(errors.items()):
        spin = e.get("spin")
        if spin:  # stopped on purpose: say why, not only "KeyboardInterrupt"
            heads.append(f"rank {r} was stopped (on_spin='interrupt'): it ran {spin_text(spin)}")
            continue
        first = e["evalue"].splitlines()[0] if e["evalue"] else ""
        kinds.setdefault(f"{e['ename']}: {first}" if first else e["ename"], []).append(r)
    return "; ".join([*heads, *(f"{ranks_text(rs)} raised {k}" for k, rs in kinds.items())])


def error_lines(errors: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """Each distinct traceback once, headed by the ranks that raised it."""
    by_text: dict[str, list[int]] = {}
    for r, e in sorted(errors.items()):
        by_text.setdefault(e["traceback"].rstrip(), []).append(r)
    lines = []
    for text, rs in by_text.items():
        lines.append(f"--- {ranks_text(rs)} ---")
        lines.append(text)
    return lines


def restart_advice(runs: Sequence[RankRun], started_here: bool, timeout: float) -> str:
    """What sv.restart() will do for these ranks (``started_here``: on engines shardviz started)."""
    dead = [r.rank for r in runs if r.status == "died"]
    if dead and started_here:
        return (
            f"Run sv.restart() (or %shardviz restart): it starts a new engine for {ranks_text(dead)} and "
            "rebuilds the process group; names defined on the ranks are cleared."
        )
    if dead:
        return (
            f"{ranks_text(dead)} died on a cluster shardviz did not start: restart its engines, then "
            "sv.restart()."
        )
    python = [r.rank for r in runs if running_python(r)]
    inside = [r.rank for r in runs if not r.finished and not running_python(r)]
    steps = []
    if python:
        steps.append(f"interrupts {ranks_text(python)} (running Python, outside any collective)")
    if inside:
        steps.append(
            f"waits up to {timeout:g} s (the process-group timeout) for {ranks_text(inside)} to leave "
            f"{'its collective' if len(inside) == 1 else 'their collectives'}"
        )
    steps.append("rebuilds the process group on a new port")
    then = ", then " if len(steps) > 1 else ""
    return (
        f"Run sv.restart() (or %shardviz restart): it {', '.join(steps[:-1])}{then}{steps[-1]}; names "
        "defined on the ranks are cleared."
    )


def update_run(run: RankRun, ar: Any, pid: int | None, outputs: bool = False) -> None:
    """Bring ``run`` up to date from its AsyncResult ``ar``; ``pid``: the rank's engine process when
    shardviz started it (a dead process is known at once), else None."""
    if run.status == "running" and not ar.done() and pid is not None and not pid_alive(pid):
        run.status, run.finished_at = "died", time.monotonic()
    if run.status == "running" and ar.done():
        run.finished_at = time.monotonic()
        exc = ar.exception()
        if exc is None:
            run.status, run.result = "done", ar.result()
            run.flight = run.result.get("flight")
        elif getattr(exc, "ename", "") == "EngineError" or type(exc).__name__ == "EngineError":
            run.status = "died"
        else:
            run.status = "failed"
            run.failure = getattr(exc, "traceback", None) or f"{type(exc).__name__}: {exc}"
    if run.status in ("running", "died"):
        flight = (ar.data or {}).get(_rank.FLIGHT_KEY)
        if flight is not None:
            run.flight = flight
    run.spin = None
    if run.status == "running":  # a report holds until the rank enters its next collective
        spin = (ar.data or {}).get(_rank.SPIN_KEY)
        last = (run.flight or {}).get("last") or {}
        current = spin is not None and int(spin["n"]) == int((run.flight or {}).get("n") or 0)
        if current and last.get("state") != "in":
            run.spin = spin
    if outputs:
        run.stdout = ar.stdout or ""
        run.stderr = ar.stderr or ""
        run.outputs = list(ar.outputs or [])


def report_spinning(runs: Sequence[RankRun], warned: set[tuple[int, int]], on_spin: str) -> None:
    """A SpinningRankWarning for ranks newly past the spin limit: who, for how long, their stack,
    where the others are. The ranks keep running (they may just be slow) unless on_spin says:
    a rank that on_spin='interrupt' has just stopped reports the error instead, and one it could
    not stop (its code catches KeyboardInterrupt) is reported here."""
    new = [
        r
        for r in runs
        if r.spin and not r.spin.get("interrupted") and (r.rank, int(r.spin["n"])) not in warned
    ]
    if not new:
        return
    for r in new:
        warned.add((r.rank, int(r.spin["n"])))  # type: ignore[index]
    lines = []
    for r in new:
        spin = r.spin or {}
        lines.append(f"rank {r.rank} has run {spin_text(spin)}.")
        lines.append(f"Its stack now:\n{_rank.format_stack(spin.get('stack') or [])}")
    waiting = [r for r in runs if not r.finished and not running_python(r)]
    if waiting:
        lines += where_lines({r.rank: where_text(r) for r in runs})
    if on_spin == "interrupt":
        lines.append(
            "on_spin='interrupt' could not stop it: its code caught the KeyboardInterrupt, or runs "
            "outside the rank's main thread. Interrupt the kernel (Ctrl-C) or run sv.restart()."
        )
    else:
        lines.append(
            "It may just be slow: shardviz keeps waiting. Interrupt the kernel (Ctrl-C, or the stop "
            "button) to stop every rank; sv.use(..., on_spin='interrupt') stops such ranks by itself, "
            "spin_limit= sets the time."
        )
    first = (new[0].spin or {}).get("stack") or [{}]
    warnings.warn_explicit(
        "\n".join(lines),
        SpinningRankWarning,
        f"<rank {new[0].rank}>",
        int(first[-1].get("line") or 0),
        module="shardviz.backends.cluster",
    )


def broken_by(runs: Sequence[RankRun]) -> str | None:
    """After every rank finished: what broke the process group (different collective counts, a
    failed collective), or None."""
    counts = [collective_counts(r.flight) for r in runs]
    groups = {g for c in counts for g in c}
    for g in groups:
        per = {r.rank: counts[r.rank].get(g, 0) for r in runs if r.rank in g}
        if len(set(per.values())) > 1:
            return "the ranks entered different numbers of collectives on group " + str(list(g))
    if any(r.error and r.error.get("distributed") for r in runs):
        return "a collective failed on " + ranks_text(
            [r.rank for r in runs if r.error and r.error.get("distributed")]
        )
    return None


def fault_error(runs: Sequence[RankRun], fault: Fault, advice: str) -> RankError:
    """The error a diagnosed fault raises: what happened, where each rank is, the tracebacks, and
    ``advice`` (what sv.restart() will do)."""
    where = {r.rank: where_text(r) for r in runs}
    errors = {r.rank: r.error for r in runs if r.error}
    lines = [error_head(errors)] if errors else []
    lines.append(fault.summary[0].upper() + fault.summary[1:] + "." if errors else fault.summary + ".")
    lines += where_lines(where)
    lines += error_lines(errors)
    lines.append(advice)
    cls = RankError if any(not e.get("distributed") for e in errors.values()) else CollectiveHangError
    return cls("\n".join(lines), errors, where, fault.missing, spinning_reports(runs))
