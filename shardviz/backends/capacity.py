"""What this machine can hold, checked before a simulated world starts: the threads the OS allows
(one per rank under ``sv.use("threads")``, one per thread of ``sv.run(fn, threads=N)``) and the
memory every simulated rank takes at least.

A world past either fails late otherwise: 100,000 rank threads raised "can't start new thread"
after half a minute, left 22,256 threads running and broke every later threads run; a lockstep
world of 100,000 ranks ran past 150 s and 10 GB building one mesh. The figures are read from the
kernel (Linux ``/proc`` and cgroup files; elsewhere only what ``resource`` says), each a ceiling
the start cannot pass, so the check refuses only what cannot fit; ``check_capacity=False`` skips it.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ..errors import BackendError

# The least one simulated rank takes (measured on torch 2.13, 1 torch thread: a mesh and one
# redistribute of a small tensor take 0.7 to 2 MiB a rank, lockstep or threads).
MEMORY_PER_RANK = 512 * 1024
OVERRIDE = "check_capacity=False"


def _read_int(path: str | Path) -> int | None:
    try:
        text = Path(path).read_text().split()[0]
    except (OSError, IndexError):
        return None
    return int(text) if text.isdigit() else None


def _cgroup_file(controller: str, name: str) -> int | None:
    """A cgroup limit or count of this process: v2 (one tree) first, then v1 (one per controller)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and Path(f"/sys/fs/cgroup{path}/{name}").exists():
            return _read_int(f"/sys/fs/cgroup{path}/{name}")
        if controller in controllers.split(","):
            v1 = name.replace("memory.max", "memory.limit_in_bytes").replace(
                "memory.current", "memory.usage_in_bytes"
            )
            return _read_int(f"/sys/fs/cgroup/{controllers}{path}/{v1}")
    return None


def _threads_running() -> int | None:
    """Threads on the whole machine now (``/proc/loadavg``'s ``running/total``)."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
    except (OSError, IndexError, ValueError):
        return None


def thread_room() -> tuple[int | None, str]:
    """How many more threads the OS allows now (None: no limit found), and why."""
    room: list[tuple[int, str]] = []
    running = _threads_running()
    if running is not None:
        for path, what in (
            ("/proc/sys/kernel/threads-max", "threads-max"),
            ("/proc/sys/kernel/pid_max", "pid_max"),
        ):
            limit = _read_int(path)
            if limit is not None:
                room.append(
                    (limit - running, f"the kernel's {what} {limit:,} less the {running:,} threads running")
                )
    pids_max, pids_now = _cgroup_file("pids", "pids.max"), _cgroup_file("pids", "pids.current")
    if pids_max is not None and pids_now is not None:
        room.append(
            (pids_max - pids_now, f"this cgroup's pids.max {pids_max:,} less the {pids_now:,} in use")
        )
    try:
        import resource  # POSIX only
    except ImportError:
        resource = None  # type: ignore[assignment]
    if resource is not None and hasattr(resource, "RLIMIT_NPROC"):
        mine = threading.active_count()
        soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
        if soft != resource.RLIM_INFINITY and os.geteuid() != 0:  # root is not held to it
            room.append((soft - mine, f"ulimit -u {soft:,} less this process's {mine} threads"))
    maps = _read_int("/proc/sys/vm/max_map_count")
    if maps is not None:
        try:
            used = Path("/proc/self/maps").read_text().count("\n")
        except OSError:
            used = 0
        room.append(((maps - used) // 2, f"vm.max_map_count {maps:,} (two mappings a thread's stack)"))
    if not room:
        return None, ""
    n, why = min(room)
    return max(n, 0), why


def memory_room() -> tuple[int | None, str]:
    """Bytes of memory free for this process now (None: unknown), and where that comes from."""
    room: list[tuple[int, str]] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                room.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError, IndexError):
        pass
    limit, used = _cgroup_file("memory", "memory.max"), _cgroup_file("memory", "memory.current")
    if limit is not None and used is not None and limit < 2**60:
        room.append((limit - used, "this cgroup's memory limit less its use"))
    if not room:
        return None, ""
    n, why = min(room)
    return max(n, 0), why


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def check(call: str, threads: int, ranks: int, way_out: str, override: str = f"pass {OVERRIDE}") -> None:
    """Refuse ``call`` before it starts when its ``threads`` new threads or the memory of ``ranks``
    simulated ranks cannot fit on this machine now; the message names ``way_out`` and ``override``."""
    problems = []
    if threads:
        room, why = thread_room()
        if room is not None and threads > room:
            problems.append(f"{threads:,} threads, and the OS allows about {room:,} more ({why})")
    need = ranks * MEMORY_PER_RANK
    room, why = memory_room()
    if room is not None and need > room:
        problems.append(
            f"at least {_size(need)} ({ranks:,} simulated ranks at {MEMORY_PER_RANK // 1024} KiB or more "
            f"each), and {_size(room)} is free ({why})"
        )
    if problems:
        raise BackendError(
            f"{call} needs {' and '.join(problems)}: it cannot run on this machine, so nothing was "
            f"started. {way_out}, or {override} to try anyway (a thread the OS refuses then "
            "fails the start, and the threads started are stopped again)."
        )
