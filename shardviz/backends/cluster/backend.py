"""The cluster backend: gloo or NCCL ranks on ipyparallel engines (see the package docstring)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from ...data.trace import DEFAULT_VALUE_BUDGET, Trace
from ...errors import BackendError
from .. import rank as _rank
from .. import session
from ..base import check_world_size, rank_tensor, refuse_record, refuse_simulation_options
from .engines import ENGINE_TIMEOUT, LocalCluster, Progress
from .faults import (
    RankError,
    RankRun,
    SpinningRankWarning,
    broken_by,
    diagnose,
    error_head,
    error_lines,
    fault_error,
    pid_alive,
    ranks_text,
    report_spinning,
    restart_advice,
    spinning_reports,
    update_run,
    where_lines,
    where_text,
)
from .results import (
    PerRank,
    gather_shows,
    load_rank_trace,
    same_value,
    show_outputs,
    swap_markers,
)
from .shipping import args_for_rank, notebook_imports, ship_function

DEFAULT_TIMEOUT = 60.0


OPTIONS = (
    "timeout",
    "profile",
    "profile_dir",
    "cluster_id",
    "master_addr",
    "launcher",
    "engine_timeout",
    "progress",
    "spin_limit",
    "on_spin",
)


# --- the backend ---------------------------------------------------------------------------------


class ClusterBackend:
    """gloo or NCCL ranks on ipyparallel engines, one engine per rank."""

    simulated = False

    def __init__(self, name: str, world_size: int, **options: Any) -> None:
        if name not in ("gloo", "nccl"):
            raise ValueError(f"ClusterBackend runs gloo or nccl, not {name!r}")
        self.name = name
        self.world_size = check_world_size(world_size)
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TypeError(
                f"unknown option(s) {unknown} for the {name} backend; options are {list(OPTIONS)}"
            )
        self.options = dict(options)
        self.timeout = float(options.get("timeout", DEFAULT_TIMEOUT))
        if not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, not {options.get('timeout')!r}")
        self.engine_timeout = float(options.get("engine_timeout", ENGINE_TIMEOUT))
        spin = options.get("spin_limit")
        if spin is None:
            spin = self.timeout
        if isinstance(spin, bool) or not isinstance(spin, int | float) or not spin > 0:
            raise ValueError(
                f"spin_limit must be a positive number of seconds (math.inf: never report), not {spin!r}"
            )
        self.spin_limit = float(spin)
        self.on_spin = options.get("on_spin", "warn")
        if self.on_spin not in _rank.SPIN_ACTIONS:
            raise ValueError(
                f"on_spin must be 'warn' (report a rank past spin_limit and keep waiting) or 'interrupt' "
                f"(stop it with KeyboardInterrupt), not {self.on_spin!r}"
            )
        self.attach = any(options.get(k) is not None for k in ("profile", "profile_dir", "cluster_id"))
        try:
            import ipyparallel  # noqa: F401
        except ImportError:
            raise BackendError(
                f"the {name} backend runs ranks on ipyparallel engines: pip install 'shardviz[cluster]'"
            ) from None
        self.local: LocalCluster | None = None
        self.client: Any = None
        self.engines: list[int] = []
        self.pids: dict[int, int] = {}
        self.hosts: dict[int, str] = {}
        self.master: tuple[str, int] | None = None
        self.broken: str | None = None
        self.busy: dict[int, Any] = {}  # engine -> its unfinished call, after a fault
        self.known_meshes: list[dict[str, Any]] = []
        self._views: dict[int, Any] = {}
        self._sent_imports: dict[str, tuple[str, ...]] = {}
        self.timings: dict[str, float] = {}
        try:
            self._connect(Progress(bool(options.get("progress", True))))
        except BaseException:
            self.close()
            raise

    # --- Backend interface ---------------------------------------------------------------------

    def key(self) -> tuple[Any, ...]:
        return (self.name, self.world_size, *sorted(self.options.items()))

    def device_type(self) -> str:
        return "cuda" if self.name == "nccl" else "cpu"

    def close(self) -> None:
        """Stop engines shardviz started; on attached clusters leave the engines running."""
        if self.local is not None:
            self.local.stop()
            self.local = None
        elif self.client is not None:
            idle = [e for e in self.engines if e in self.client.ids and not self._is_busy(e)]
            with contextlib.suppress(Exception):
                ars = [self._view(e).apply_async(_rank.teardown) for e in idle]
                concurrent.futures.wait(ars, timeout=5)
            with contextlib.suppress(Exception):
                self.client.close()
        self.client = None
        self._views.clear()

    def __repr__(self) -> str:
        where = "attached" if self.attach else "local cluster"
        state = f", broken: {self.broken}" if self.broken else ""
        return (
            f"ClusterBackend({self.name!r}, world_size={self.world_size}, {where}, "
            f"engines {self.engines}{state})"
        )

    # --- start-up ------------------------------------------------------------------------------

    def _connect(self, progress: Progress) -> None:
        t0 = time.perf_counter()
        if self.attach:
            import ipyparallel as ipp

            kwargs = {
                k: self.options[k] for k in ("profile", "profile_dir", "cluster_id") if self.options.get(k)
            }
            progress("connecting to the cluster")
            try:
                self.client = ipp.Client(**kwargs)
            except (OSError, TimeoutError) as e:
                raise BackendError(
                    f"could not attach to an ipyparallel cluster with {kwargs}: {e}. Start one with "
                    f"`ipcluster start -n {self.world_size}` (see the README, 'Real process groups')"
                ) from None
            self._wait_for(self.world_size, progress)
        else:
            self.local = LocalCluster.start(
                self.world_size,
                launcher=self.options.get("launcher"),
                progress=progress,
                engine_timeout=self.engine_timeout,
            )
            self.client = self.local.client
        self.timings["engines"] = time.perf_counter() - t0
        self.engines = sorted(self.client.ids)[: self.world_size]
        self._hello(self.engines, progress)
        self._init_pg(progress)
        progress(
            f"{self.name} backend ready: {self.world_size} ranks (engines {self.timings['engines']:.1f} s, "
            f"torch {self.timings['torch']:.1f} s, process group {self.timings['pg']:.1f} s)"
        )

    def _wait_for(self, n: int, progress: Callable[[str], None]) -> None:
        t0 = time.monotonic()
        while len(self.client.ids) < n:
            progress(f"waiting for engines: {len(self.client.ids)}/{n} registered")
            if time.monotonic() - t0 > self.engine_timeout:
                raise BackendError(
                    f"the {self.name} backend needs {n} engines but the cluster has {len(self.client.ids)} "
                    f"after {self.engine_timeout:.0f} s; start more (e.g. `ipcluster engines -n ...`) or use "
                    "a smaller world_size"
                )
            time.sleep(0.2)

    def _view(self, engine: int) -> Any:
        v = self._views.get(engine)
        if v is None:
            v = self._views[engine] = self.client[engine]
        return v

    def _hello(self, engines: Sequence[int], progress: Callable[[str], None]) -> None:
        progress(f"importing torch on {len(engines)} engines")
        t0 = time.perf_counter()
        ars = {e: self._view(e).apply_async(_rank.hello) for e in engines}
        for e, ar in ars.items():
            try:
                info = ar.get(timeout=self.engine_timeout)
            except Exception as err:
                raise BackendError(
                    f"engine {e} could not import shardviz: {err}. The engines must run the notebook's "
                    f"Python environment ({sys.executable})"
                ) from None
            self.pids[e] = int(info["pid"])
            self.hosts[e] = str(info["host"])
        self.timings["torch"] = time.perf_counter() - t0
        progress(f"torch imported on {len(engines)} engines")

    def _init_pg(self, progress: Callable[[str], None]) -> None:
        progress(f"initialising the {self.name} process group")
        t0 = time.perf_counter()
        here = socket.gethostname()
        first = self.engines[0]
        addr = self.options.get("master_addr")
        if not addr:
            one_host = all(self.hosts.get(e) == here for e in self.engines)
            addr = "127.0.0.1" if one_host else self._view(first).apply_sync(_rank.address)
        port = int(self._view(first).apply_sync(_rank.store_port, addr))
        local_rank: dict[int, int] = {}
        per_host: dict[str, int] = {}
        for e in self.engines:
            h = self.hosts.get(e, "")
            local_rank[e] = per_host.get(h, 0)
            per_host[h] = local_rank[e] + 1
        ars = [
            self._view(e).apply_async(
                _rank.setup,
                r,
                self.world_size,
                self.name,
                addr,
                port,
                self.timeout,
                local_rank[e],
                self.spin_limit,
                self.on_spin,
            )
            for r, e in enumerate(self.engines)
        ]
        _, pending = concurrent.futures.wait(ars, timeout=self.timeout + 30)
        errors = []
        for r, ar in enumerate(ars):
            if ar in pending:
                errors.append(f"rank {r}: did not join within {self.timeout + 30:.0f} s")
                continue
            exc = ar.exception()
            if exc is not None:
                errors.append(
                    f"rank {r}: {getattr(exc, 'ename', type(exc).__name__)}: {getattr(exc, 'evalue', exc)}"
                )
        if errors:
            hint = ""
            if self.name == "nccl":
                hint = "\nnccl needs one CUDA GPU per rank on each machine (torch.cuda.device_count())."
            self.broken = "the process group did not initialise"
            self.busy = {e: ar for e, ar in zip(self.engines, ars, strict=True) if ar in pending}
            raise BackendError(
                f"could not initialise the {self.name} process group on {addr}:{port}:\n  "
                + "\n  ".join(errors)
                + hint
            )
        self.master = (addr, port)
        self.broken = None
        self.busy = {}
        self._sent_imports = {}
        self.timings["pg"] = time.perf_counter() - t0
        progress(
            f"process group ready: {self.name}, {self.world_size} ranks, {addr}:{port}, "
            f"timeout {self.timeout:g} s"
        )

    # --- restart -------------------------------------------------------------------------------

    def restart(self) -> ClusterBackend:
        """Bring the mesh back, in place. Surviving ranks get a new process group on a new port;
        dead ranks (or ranks stuck past the timeout) get new engines first. Names the cells
        defined on the ranks are cleared: their DTensors belong to the old process group."""
        progress = Progress(bool(self.options.get("progress", True)))
        if self.client is None:
            self._connect(progress)
            return self
        dead = self._dead_engines()
        for e in dead:
            self.busy.pop(e, None)
        stuck = self._wait_idle(progress)
        dead += [e for e in self._dead_engines() if e not in dead]
        if stuck and self.local is not None:
            self.local.kill([self.pids[e] for e in stuck if e in self.pids])
            dead += stuck
        elif stuck:
            raise BackendError(
                f"{ranks_text([self.engines.index(e) for e in stuck])} still busy after the process-group "
                "timeout, and this cluster was not started by shardviz: restart its engines "
                "(e.g. `ipcluster engines`), then sv.restart()"
            )
        if dead:
            self._await_unregistered(dead)
            for e in dead:
                self.pids.pop(e, None)
        if dead and self.local is not None:
            progress(f"starting {len(dead)} new engine{'s' if len(dead) > 1 else ''} for dead ranks")
            self.local.add_engines(len(dead), self.world_size)
            self.local.wait_for_engines(self.world_size, progress, self.engine_timeout)
        self._wait_for(self.world_size, progress)
        engines = sorted(self.client.ids)[: self.world_size]
        self._views = {e: v for e, v in self._views.items() if e in engines}
        fresh = [e for e in engines if e not in self.pids]
        self.engines = engines
        with contextlib.suppress(Exception):
            self.client.clear(targets=engines, block=True)
        if fresh:
            self._hello(fresh, progress)
        self._init_pg(progress)
        progress(f"{self.name} backend restarted: {self.world_size} ranks")
        return self

    def _dead_engines(self) -> list[int]:
        live = set(self.client.ids)
        return [
            e
            for e in self.engines
            if e not in live or (self.local is not None and e in self.pids and not pid_alive(self.pids[e]))
        ]

    def _is_busy(self, engine: int) -> bool:
        ar = self.busy.get(engine)
        return ar is not None and not ar.done()

    def _wait_idle(self, progress: Callable[[str], None]) -> list[int]:
        """Wait for ranks still inside a collective to reach the process-group timeout."""
        pending = {e: ar for e, ar in self.busy.items() if not ar.done()}
        self.busy = {}
        if not pending:
            return []
        # Ranks running Python stop at SIGINT; ranks inside a collective take it once they leave.
        with contextlib.suppress(Exception):
            self.client.send_signal(signal.SIGINT, targets=list(pending), block=False)
        concurrent.futures.wait(list(pending.values()), timeout=2)
        pending = {e: ar for e, ar in pending.items() if not ar.done()}
        if not pending:
            return []
        limit = self.timeout + 10
        progress(
            f"waiting up to {limit:.0f} s for {ranks_text([self.engines.index(e) for e in pending])} to "
            "reach the process-group timeout"
        )
        concurrent.futures.wait(list(pending.values()), timeout=limit)
        return [e for e, ar in pending.items() if not ar.done()]

    def _await_unregistered(self, engines: Sequence[int], timeout: float = 30) -> None:
        t0 = time.monotonic()
        while any(e in self.client.ids for e in engines) and time.monotonic() - t0 < timeout:
            time.sleep(0.1)

    # --- running code --------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self.client is None:
            raise BackendError(f"the {self.name} backend is closed; call sv.use or sv.restart()")
        if self.broken:
            raise BackendError(
                f"the {self.name} process group is unusable after the last error ({self.broken}); run "
                "sv.restart() (or %shardviz restart) to rebuild it"
            )
        gone = [r for r, e in enumerate(self.engines) if e not in self.client.ids]
        if gone:
            self.broken = f"the engine of {ranks_text(gone)} is gone"
            raise BackendError(
                f"the engine of {ranks_text(gone)} is gone (it died between cells); run sv.restart() to "
                "replace it"
            )

    def _rank_values(self, values: str | int) -> str | int:
        """Each rank's share of the trace's value budget, so the merged trace keeps to it."""
        if isinstance(values, int) and not isinstance(values, bool):
            return max(0, values // self.world_size)
        return values

    def dispatch(self, func: Callable[..., Any], per_rank_args: Sequence[tuple[Any, ...]]) -> list[RankRun]:
        """Run ``func(*args)`` on every rank and watch until all finish or a fault is certain."""
        self._check_usable()
        ars = [
            self._view(e).apply_async(func, *args)
            for e, args in zip(self.engines, per_rank_args, strict=True)
        ]
        runs = [RankRun(r, e) for r, e in enumerate(self.engines)]
        fault = None
        warned: set[tuple[int, int]] = set()  # (rank, collectives before): one report per stretch
        try:
            while True:
                for run, ar in zip(runs, ars, strict=True):
                    self._update(run, ar)
                # Diagnosed before the all-done exit too: a rank that died in the same poll in
                # which its peer's collective failed is still reported as the death it is.
                fault = diagnose(runs)
                pending = [ar for ar in ars if not ar.done()]
                if fault is not None or not pending:
                    break
                report_spinning(runs, warned, self.on_spin)
                concurrent.futures.wait(pending, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
        except KeyboardInterrupt:
            raise KeyboardInterrupt(self._interrupt(ars, runs)) from None
        except SpinningRankWarning:  # the user made the warning an error: stop the ranks as Ctrl-C
            self._interrupt(ars, runs)
            raise
        for run, ar in zip(runs, ars, strict=True):
            if ar.done():
                with contextlib.suppress(Exception):
                    ar.wait_for_output(2.0)
            self._update(run, ar, outputs=True)
        if fault is not None:
            self.busy = {e: ar for e, ar in zip(self.engines, ars, strict=True) if not ar.done()}
            self.broken = fault.summary
            raise fault_error(runs, fault, restart_advice(runs, self.local is not None, self.timeout))
        self._check_consistent(runs)
        return runs

    def _update(self, run: RankRun, ar: Any, outputs: bool = False) -> None:
        pid = self.pids.get(run.engine) if self.local is not None else None  # our own engines
        update_run(run, ar, pid, outputs)

    def _interrupt(self, ars: Sequence[Any], runs: Sequence[RankRun]) -> str:
        """Ctrl-C in the notebook: SIGINT to every rank. Code running Python stops with
        KeyboardInterrupt; a rank inside a collective cannot be interrupted (gloo and NCCL wait
        for the process-group timeout). Returns where the ranks were, in words."""
        for run, ar in zip(runs, ars, strict=True):
            self._update(run, ar)
        before = {r.rank: where_text(r) for r in runs if not r.finished}
        pending = [ar for ar in ars if not ar.done()]
        if not pending:
            return ""
        with contextlib.suppress(Exception):
            self.client.send_signal(signal.SIGINT, targets=self.engines, block=False)
        concurrent.futures.wait(pending, timeout=2)
        for run, ar in zip(runs, ars, strict=True):
            self._update(run, ar)
        still = {e: ar for e, ar in zip(self.engines, ars, strict=True) if not ar.done()}
        stopped = sorted(r for r in before if self.engines[r] not in still)
        stuck = sorted(r for r in before if self.engines[r] in still)
        lines = ["Interrupted. When Ctrl-C came:", *(f"  rank {r}: {before[r]}" for r in sorted(before))]
        if stopped:
            lines.append(f"{ranks_text(stopped)} stopped.")
        if still:
            self.busy = still
            self.broken = "interrupted while " + "; ".join(f"rank {r} was {before[r]}" for r in stuck)
            lines.append(
                f"{ranks_text(stuck)} did not stop within 2 s (a rank inside a collective waits for the "
                "process-group timeout)."
            )
        else:
            self._check_consistent(runs)  # ranks stopped at different collectives: the group is off
        if self.broken:
            lines.append("Run sv.restart() (or %shardviz restart) before the next cell.")
        return "\n".join(lines)

    def _check_consistent(self, runs: Sequence[RankRun]) -> None:
        broken = broken_by(runs)
        if broken is not None:
            self.broken = broken

    def merge(self, runs: Sequence[RankRun], values: str | int) -> Trace:
        from ...data.merge import merge

        traces = {
            r.rank: load_rank_trace(r.result["trace"]) for r in runs if r.result and r.result.get("trace")
        }
        trace = merge(traces, self.name, values, self.known_meshes)
        for m in trace.meshes:
            if m not in self.known_meshes:
                self.known_meshes.append(m)
        return trace

    def finish(self, runs: Sequence[RankRun], values: str | int) -> tuple[Trace | None, dict[int, Any]]:
        """Show outputs, merge the traces, raise the ranks' errors: what every call ends with."""
        widgets = gather_shows(runs)
        show_outputs(runs, widgets)
        errors = {r.rank: r.error for r in runs if r.error}
        trace = None
        try:
            trace = self.merge(runs, values)
        except Exception as e:
            if not errors:
                raise
            trace_note = f"(no merged trace: {str(e).splitlines()[0]})"
        else:
            trace_note = ""
            session.set_last(trace)
        if errors:
            where = {r.rank: where_text(r) for r in runs}
            head = error_head(errors)
            lines = [head, *error_lines(errors)]
            if self.broken:
                lines += where_lines(where)
                lines.append(restart_advice(runs, self.local is not None, self.timeout))
            if trace_note:
                lines.append(trace_note)
            raise RankError("\n".join(lines), errors, where, spinning=spinning_reports(runs))
        return trace, widgets

    def record(self, values: str | int, memory: Any) -> AbstractContextManager[Trace]:
        """Refused: a ``with`` body runs in this process, and the ranks are other processes."""
        raise refuse_record(self.name)

    def run_cell(self, cell: str, shell: Any, values: str | int | None = None) -> Any:
        """A ``%%spmd`` cell on every rank; its names stay on the ranks; returns its value."""
        from ..cells import compile_cell

        body, last = compile_cell(cell)
        code = body or last
        if code is None:  # an empty cell
            return None
        filename = code.co_filename
        values = DEFAULT_VALUE_BUDGET if values is None else values
        ns = getattr(shell, "user_ns", None) or {}
        imports = notebook_imports(ns)
        send = {k: v for k, v in imports.items() if self._sent_imports.get(k) != v}
        args = (cell, filename, self._rank_values(values), send)
        runs = self.dispatch(_rank.run_cell, [args] * self.world_size)
        self._sent_imports.update(send)
        _, widgets = self.finish(runs, values)
        return self._value(runs, widgets)

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        values: str | int = DEFAULT_VALUE_BUDGET,
        threads: int | None = None,
        memory: Any = False,
    ) -> Trace:
        """``sv.run(fn, *args)`` on every rank; ``trace.results[rank]`` is what fn returned there.
        ``threads=`` and ``memory=`` are the simulator's: refused with the way out."""
        refuse_simulation_options(self.name, values, threads, memory)
        shipped, env = ship_function(fn)
        per_rank = [
            (shipped, args_for_rank(args, r), args_for_rank(kwargs, r), env, self._rank_values(values))
            for r in range(self.world_size)
        ]
        runs = self.dispatch(_rank.run_fn, per_rank)
        trace, widgets = self.finish(runs, values)
        assert trace is not None
        trace.results = {r.rank: swap_markers(r.result["value"], widgets) for r in runs if r.result}
        return trace

    def per_rank(self, fn: Callable[[int], Any]) -> Any:
        """A per-rank tensor in the notebook; ``sv.run`` hands each rank its own value."""
        from ...capture import torch as _torch

        values = {r: rank_tensor(fn, r).detach().clone() for r in range(self.world_size)}
        return _torch.new_local_tensor(values)

    def show(self, obj: Any, **options: Any) -> Any:
        """In the notebook: the view itself (a cell's ``sv.show`` on the ranks comes back as its
        widget, drawn from every rank's shard)."""
        return session.draw(obj, **options)

    def _value(self, runs: Sequence[RankRun], widgets: Mapping[int, Any]) -> Any:
        """The cell's value as the simulator shows it: a tensor per rank is a LocalTensor, a value
        every rank agrees on is that value; other per-rank values are a PerRank dict."""
        import torch

        from ...capture import torch as _torch

        vals = [r.result["value"] if r.result else None for r in runs]
        if all(v is None for v in vals):
            return None
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        if len(tensors) == len(vals):
            with contextlib.suppress(Exception):
                return _torch.new_local_tensor({r.rank: v for r, v in zip(runs, tensors, strict=True)})
        if all(same_value(vals[0], v) for v in vals[1:]):
            return swap_markers(vals[0], widgets)
        return PerRank({r.rank: swap_markers(v, widgets) for r, v in zip(runs, vals, strict=True)})
