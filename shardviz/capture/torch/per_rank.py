"""Per-rank values in the simulation: per-rank SymInts, ``dist.get_rank`` and
``ProcessGroup.rank()`` per rank, and comparisons the simulated ranks disagree on."""

from __future__ import annotations

import contextlib
import functools
import linecache
import os
import sys
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from ...errors import PerRankValueError
from .c10d import p2p_groups
from .frames import TORCH_DIR
from .gate import ConstantIntNode, LocalIntNode
from .modes import active_local_mode

# In the lockstep simulation every rank runs each Python line at once, so a value that differs per
# rank can only be a per-rank SymInt (a LocalIntNode). torch 2.14 returns one from dist.get_rank();
# on 2.13 dist.get_rank() is 0 on every rank, and a process group's .rank() is 0 on every torch, so
# code that offsets by the rank (a vocab-parallel embedding) would silently compute rank 0's part
# on every rank. And a comparison the ranks disagree on (``if dist.get_rank() == 0:``) gives one
# answer for all ranks. While the simulation runs, code outside torch (the user's, a library's)
# gets the per-rank value, and a comparison of per-rank ints that the ranks disagree on raises
# PerRankValueError; torch's own code keeps the answers it was written against.


def symint_at_rank(value: Any, rank: int) -> int:
    """One rank's value of a per-rank SymInt made by LocalTensorMode (a plain int elsewhere). A
    SymInt every rank agrees on (a coordinate on a size-1 mesh dim) holds a ConstantIntNode, which
    ``int()`` cannot read: its value is taken as it is."""
    node = getattr(value, "node", None)
    local = getattr(node, "_local_ints", None)
    if local is not None:
        return int(local[rank])
    constant = node.maybe_as_int() if node is not None and hasattr(node, "maybe_as_int") else None
    if constant is not None:
        return int(constant)
    return int(value)


def per_rank_ints(value: Any) -> list[int] | None:
    """The per-rank values of a SymInt made by LocalTensorMode (None for a plain int)."""
    local = getattr(getattr(value, "node", None), "_local_ints", None)
    return [int(v) for v in local.values()] if local is not None else None


_THIS_FILE = os.path.abspath(__file__)
_ABSENT = object()  # an attribute the class did not have before it was patched
# SymInt's Python operators, between the code that compares and the node's method.
_SYMINT_PLUMBING = (
    os.path.join(TORCH_DIR, "fx", "experimental", "sym_node.py"),
    os.path.join(TORCH_DIR, "__init__.py"),
)
_COMPARISONS = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


def _asker(frame: FrameType | None) -> FrameType | None:
    """The frame of the code asking (past this file and SymInt's operator plumbing)."""
    while frame is not None:
        fn = frame.f_code.co_filename
        if fn != _THIS_FILE and fn not in _SYMINT_PLUMBING:
            return frame
        frame = frame.f_back
    return None


def _called_from_torch(frame: FrameType | None) -> bool:
    """Whether the code asking is torch's own (past this file and SymInt's operator plumbing)."""
    asking = _asker(frame)
    return asking is None or asking.f_code.co_filename.startswith(TORCH_DIR)


def group_rank_map(group: Any, ranks: Sequence[int]) -> dict[int, int]:
    """Each simulated rank's rank in its own copy of ``group`` (every group that runs a collective
    at once with it); -1 for a rank in none, as ``dist.get_rank(group)`` answers a non-member."""
    if group is None or group is dist.GroupMember.WORLD:
        return {r: r for r in ranks}
    mine = {r: i for g in p2p_groups(group) for i, r in enumerate(g)}
    return {r: mine.get(r, -1) for r in ranks}


def per_rank_int(values: Mapping[int, int]) -> Any:
    """A SymInt holding ``values[rank]`` on each simulated rank, as LocalTensorMode makes them."""
    return torch.SymInt(LocalIntNode(dict(values)))


def _rank_per_rank(original: Any) -> Any:
    @functools.wraps(original)
    def rank(*args: Any, **kwargs: Any) -> Any:
        mode = active_local_mode()
        if mode is None or _called_from_torch(sys._getframe(1)):
            return original(*args, **kwargs)
        group = args[0] if args else kwargs.get("group")
        return per_rank_int(group_rank_map(group, sorted(mode.ranks)))

    return rank


def _int_on(value: Any, rank: int) -> int:
    local = getattr(value, "_local_ints", None)
    if local is not None:
        return int(local[rank])
    return int(getattr(value, "val", value))


_OWN_DIR = os.path.dirname(os.path.dirname(os.path.dirname(_THIS_FILE))) + os.sep  # shardviz/
_PLUMBING_FILES = ("contextlib.py", "functools.py")


def _where(frame: FrameType | None) -> str:
    """The line that used the per-rank value: the innermost frame outside torch and shardviz (the
    user's, or a library's such as torchtitan's), as ``file:line: text``."""
    while frame is not None:
        fn = frame.f_code.co_filename
        if not (fn.startswith((TORCH_DIR, _OWN_DIR)) or fn.endswith(_PLUMBING_FILES)):
            text = linecache.getline(fn, frame.f_lineno).strip()
            return f"{fn}:{frame.f_lineno}" + (f": {text}" if text else "")
        frame = frame.f_back
    return "torch's own code"


_WAY_OUT = (
    "In the lockstep simulation every rank runs each Python line at once, so the line cannot "
    "take a different int or branch on each rank; one answer for all of them would be silently "
    "wrong. Tensor arithmetic with the value works per rank (torch.ones(2) * dist.get_rank()); "
    "to index or slice by rank write sv.per_rank(lambda rank: ...), which calls your function "
    "with each rank; or run this code with one thread per rank, where each rank has plain ints: "
    "sv.use('threads', world_size=N) (or on real process groups: sv.use('gloo', world_size=N))."
)


# The ranks whose values count in the running thread (``sv.run(fn, threads=N)``: a thread's
# LocalTensorMode computes every rank, but stands for a block of them); None: every rank.
_live: list[Callable[[], Collection[int] | None]] = []


def _considered(values: Mapping[int, int]) -> dict[int, int]:
    live = _live[-1]() if _live else None
    if live is None:
        return dict(values)
    return {r: v for r, v in values.items() if r in live} or dict(values)


def _one_int(name: str) -> Any:
    """A LocalIntNode's conversion to one Python value (``int()``, a list index, ``range``,
    ``len``, ``float()``, ``torch.tensor()``): the value when every rank agrees, else a
    PerRankValueError naming the line (instead of torch's bare AttributeError)."""

    def convert(self: Any, *args: Any) -> Any:
        values = _considered(self._local_ints)
        if len(set(values.values())) == 1:
            (v,) = set(values.values())
            return float(v) if name == "guard_float" else int(v)
        raise PerRankValueError(
            f"a per-rank value ({values}, rank: value) is used where Python needs one plain int or "
            f"number (a list index, int(), range(), len(), float(), torch.tensor()), at "
            f"{_where(sys._getframe(1))}. " + _WAY_OUT
        )

    convert.__name__ = name
    return convert


def _constant(name: str) -> Any:
    def convert(self: Any, *args: Any) -> Any:
        return float(self.val) if name == "guard_float" else int(self.val)

    convert.__name__ = name
    return convert


# The node methods SymInt's conversions call (``__int__`` / ``__index__``: ``int_``; torch.tensor:
# ``guard_int``); LocalIntNode and ConstantIntNode (the value of a size-1 mesh dim's coordinate)
# have none of them, so each raised a bare AttributeError.
_CONVERSIONS = ("int_", "guard_int", "guard_float")


def _compare_per_rank(name: str, original: Any) -> Any:
    symbol = _COMPARISONS[name]

    @functools.wraps(original)
    def compare(self: Any, other: Any) -> Any:
        asking = _asker(sys._getframe(1))
        if asking is not None and asking.f_code in _rank_zero_codes():
            rank = min(self._local_ints)
            answer = getattr(int(self._local_ints[rank]), f"__{name}__")(_int_on(other, rank))
            return torch._C._get_constant_bool_symnode(bool(answer))
        if not _called_from_torch(sys._getframe(1)):
            per_rank = {
                r: getattr(v, f"__{name}__")(_int_on(other, r))
                for r, v in sorted(_considered(self._local_ints).items())
            }
            if len(set(per_rank.values())) > 1:
                rhs = dict(getattr(other, "_local_ints", {})) or _int_on(other, 0)
                raise PerRankValueError(
                    f"a per-rank value is compared here ({dict(self._local_ints)} {symbol} {rhs}, "
                    f"rank: value) and the simulated ranks disagree: {per_rank}, at "
                    f"{_where(sys._getframe(1))}. Write rank-dependent values as tensors (torch.where "
                    "on sv.per_rank(lambda rank: ...) or on torch.ones(n) * dist.get_rank() works per "
                    "rank). " + _WAY_OUT
                )
            if len(per_rank) < len(self._local_ints):  # the ranks this thread stands for agree
                return torch._C._get_constant_bool_symnode(next(iter(per_rank.values())))
        return original(self, other)

    return compare


# --- the environment a launcher gives each rank -----------------------------------------------------
# torchrun gives every process WORLD_SIZE and LOCAL_WORLD_SIZE (the same on every rank) and its own
# RANK and LOCAL_RANK. In the lockstep simulation one process is every rank: the sizes are set, as
# they are true for all; a rank's own number cannot be one string, and code that read "0" (or
# nothing, and fell back to one process) would silently act as rank 0 on every rank. So code
# outside torch and shardviz that reads RANK or LOCAL_RANK gets PerRankValueError naming its line;
# "RANK" in os.environ is True, as on real ranks; torch's own code and shardviz's find them unset,
# as they always have (they have their own per-rank ways).
_PER_RANK_ENV = ("RANK", "LOCAL_RANK")
_SHARED_ENV = ("WORLD_SIZE", "LOCAL_WORLD_SIZE")
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
# os.environ's own methods and the Mapping methods it inherits (get, setdefault), as files or as
# the interpreter's frozen modules
_MAPPING_PLUMBING = frozenset(
    {os.__file__, sys.modules["_collections_abc"].__file__ or "", "<frozen os>", "<frozen _collections_abc>"}
)


def _environ_reader(frame: FrameType | None) -> FrameType | None:
    """The frame that reads the environment (past os.py's and the Mapping methods' own)."""
    while frame is not None and frame.f_code.co_filename in _MAPPING_PLUMBING:
        frame = frame.f_back
    return frame


@contextlib.contextmanager
def _per_rank_environ(world_size: int) -> Iterator[None]:
    environ_type = type(os.environ)
    getitem, contains = environ_type.__getitem__, environ_type.__contains__

    def reader_is_ours(frame: FrameType | None) -> bool:
        reader = _environ_reader(frame)
        return reader is None or reader.f_code.co_filename.startswith((TORCH_DIR, _OWN_DIR))

    def per_rank_getitem(self: Any, key: Any) -> Any:
        if self is os.environ and key in _PER_RANK_ENV and not reader_is_ours(sys._getframe(1)):
            reader = _environ_reader(sys._getframe(1))
            line = f" ({reader.f_code.co_filename}, line {reader.f_lineno})" if reader is not None else ""
            values = {r: r for r in range(world_size)}
            raise PerRankValueError(
                f"os.environ[{key!r}] is read here{line}: on real ranks it is each process's own number "
                f"({values}, rank: value). The lockstep simulator runs every rank in one process, so "
                "it has no one string to give; reading it as 0 (or falling back to a single process) "
                "would silently make every rank rank 0. Take the rank from torch.distributed "
                "(dist.get_rank() is a per-rank value here), or run this code with one thread per "
                "rank, where each rank has its own environment: sv.use('threads', world_size=N)."
            )
        return getitem(self, key)

    def per_rank_contains(self: Any, key: Any) -> bool:
        if self is os.environ and key in _PER_RANK_ENV and not reader_is_ours(sys._getframe(1)):
            return True
        return bool(contains(self, key))

    saved = {k: os.environ.get(k) for k in _SHARED_ENV}
    os.environ.update({k: str(world_size) for k in _SHARED_ENV})
    environ_type.__getitem__ = per_rank_getitem  # type: ignore[method-assign]
    environ_type.__contains__ = per_rank_contains  # type: ignore[method-assign]
    try:
        yield
    finally:
        environ_type.__getitem__ = getitem  # type: ignore[method-assign]
        environ_type.__contains__ = contains  # type: ignore[method-assign]
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --- torch's debug printing, once, as rank 0 ---------------------------------------------------------
# visualize_sharding prints on the rank whose mesh coordinate is 0 on every dim and returns on the
# others. In the simulation that test compares per-rank values inside torch, where every answer is
# kept as torch was written against (true only when all ranks agree), so it printed nothing at
# all. Compared in that function, a per-rank value answers as on rank 0: it prints what rank 0
# prints on real ranks.
@functools.cache
def _rank_zero_codes() -> frozenset[Any]:
    try:
        from torch.distributed.tensor.debug import _visualize_sharding
    except ImportError:
        return frozenset()

    def nested(code: Any) -> Iterator[Any]:  # the function's own code and its generator expressions
        yield code
        for const in code.co_consts:
            if hasattr(const, "co_code"):
                yield from nested(const)

    return frozenset(nested(_visualize_sharding.visualize_sharding.__code__))


@contextlib.contextmanager
def per_rank_values(live: Callable[[], Collection[int] | None] | None = None) -> Iterator[None]:
    """While the simulation runs (entered inside its LocalTensorMode): ``dist.get_rank(group)`` and
    ``ProcessGroup.rank()`` give code outside torch each rank's own value, comparisons and
    conversions to one int of per-rank ints that the ranks disagree on raise, and the
    launcher's environment is set as far as it is the same on every rank (see above). ``live``
    gives the ranks the running thread stands for (threaded runs), whose values alone count.
    Put back when it ends."""
    c10d = dist.distributed_c10d
    saved: list[tuple[Any, str, Any]] = [(dist.ProcessGroup, "rank", dist.ProcessGroup.__dict__["rank"])]
    patched: list[tuple[Any, str, Any]] = [
        (dist.ProcessGroup, "rank", _rank_per_rank(dist.ProcessGroup.rank))
    ]
    # On every torch: 2.14's own per-rank get_rank(group) maps a strided group's ranks wrongly (the
    # dp group [1, 5] of a (2, 4) mesh gives rank 1 the dp rank 1). Entered inside the mode, so
    # that torch's own callers keep whatever the mode put in place.
    wrapped = _rank_per_rank(dist.get_rank)
    for owner in (dist, c10d):
        saved.append((owner, "get_rank", owner.get_rank))
        patched.append((owner, "get_rank", wrapped))
    for name in _COMPARISONS:
        original = LocalIntNode.__dict__[name]
        saved.append((LocalIntNode, name, original))
        patched.append((LocalIntNode, name, _compare_per_rank(name, original)))
    for name in _CONVERSIONS:
        saved.append((LocalIntNode, name, LocalIntNode.__dict__.get(name, _ABSENT)))
        patched.append((LocalIntNode, name, _one_int(name)))
        if name not in ConstantIntNode.__dict__:  # a value every rank agrees on is one int
            saved.append((ConstantIntNode, name, _ABSENT))
            patched.append((ConstantIntNode, name, _constant(name)))
    for owner, name, value in patched:
        setattr(owner, name, value)
    if live is not None:
        _live.append(live)
    mode = active_local_mode()
    # the environment once, by the outermost call: a thread of a threaded run is inside it already
    environ = (
        _per_rank_environ(len(mode.ranks)) if mode is not None and live is None else contextlib.nullcontext()
    )
    try:
        with environ:
            yield
    finally:
        if live is not None:
            _live.remove(live)
        for owner, name, value in saved:
            if value is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
