"""The batched engine: LocalTensorMode with each operator run once for all ranks.

torch's LocalTensorMode keeps one tensor per rank and runs every operator once per rank, with
Python around each call (about 30 µs per rank per op: mapping the arguments, saving and
restoring the random generator, building the wrapper, a storage fix-up that re-enters the
dispatcher). Almost none of it is arithmetic. ``BatchedLocalTensorMode`` keeps the ranks' values
of a tensor in one stack (``StackedLocalTensor``) and runs each operator on the stacks once:

- elementwise operators (and ``copy_``, ``fill_``, ``*_like``) directly on the stacks, their
  ranks lined up on the stack's first dim (each element computed exactly as per rank);
- views on the stack, the rank dim kept first (the same memory a rank's view would see);
- data movement (``cat``, ``index_select``, ``embedding``, ...) through torch's batching rules
  (vmap's C++ machinery, without its Python front end), which only move data;
- collectives as gathers and reductions over the rank dim (``rank_collectives``).

Operators whose batched kernel could sum in another order than the per-rank one (matrix
products, reductions, attention, norms) run once per rank on the stack's slices, the results
written into one stack: the same kernels on the same values, so the same bits, without the
Python LocalTensorMode wraps around each rank. What cannot be batched runs exactly as
LocalTensorMode runs it (torch's own per-rank loop): random operators (each rank draws from its
own generator state, and only they touch it), operators returning numbers, ``out=`` variants,
storage changes, ranks holding different shapes (uneven shards), per-rank ints among the
arguments.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch._C._functorch import (
    _add_batch_dim,
    _remove_batch_dim,
    _vmap_decrement_nesting,
    _vmap_increment_nesting,
    is_batchedtensor,
    maybe_get_level,
)
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import get_alias_info, return_and_correct_aliasing

from . import rank_collectives, stacked
from .gate import LocalIntNode, LocalTensor, LocalTensorMode, _private
from .stacked import (
    META_OPS,
    PLAIN,
    StackedLocalTensor,
    flat_args,
    metadata,
    restack,
    stack_of,
    uniform,
    wrap,
)

_lt_module = _private["local_tensor_module"]
_for_each_rank_run_func = _lt_module._for_each_rank_run_func  # torch's own, kept while patched
_SLOT = LocalTensor.__dict__["_local_tensors"]
_DisableTorchDispatch = torch._C._DisableTorchDispatch
_get_dispatch_mode = torch._C._get_dispatch_mode
_FAKE = torch._C._TorchDispatchModeKey.FAKE
_PROXY = torch._C._TorchDispatchModeKey.PROXY
_FALLBACK = rank_collectives.FALLBACK
aten = torch.ops.aten
_WRAP_AUTOGRAD = getattr(getattr(torch.ops._c10d_functional, "_wrap_tensor_autograd", None), "default", None)

# --- dispatch keys for the batching rules ------------------------------------------------------

_K = torch._C.DispatchKey
# A __torch_dispatch__ handler runs with these excluded; the batching rules need them back. The
# Python keys go the other way: the stacks are plain tensors, which no mode or subclass sees.
_VMAP_KEYS = tuple(
    getattr(_K, n)
    for n in (
        "FuncTorchBatched",
        "FuncTorchVmapMode",
        "FuncTorchDynamicLayerFrontMode",
        "FuncTorchDynamicLayerBackMode",
        "BatchedNestedTensor",
    )
    if hasattr(_K, n)
)
_key_sets: dict[int, Any] = {}


def _batching_keys() -> Any:
    """A guard under which the batching rules run and no Python dispatch does; everything else
    stays excluded as the handler found it (autocast stays off, as for LocalTensorMode's ops)."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    key = exclude.raw_repr()
    found = _key_sets.get(key)
    if found is None:
        for k in _VMAP_KEYS:
            exclude = exclude.remove(k)
        for k in (_K.Python, _K.PythonTLSSnapshot):
            exclude = exclude.add(k)
        found = _key_sets[key] = exclude
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), found)


# --- what each operator is ----------------------------------------------------------------------

(_TORCH, _META, _COLLECTIVE, _PER_RANK, _POINTWISE, _VIEW, _INPLACE_VIEW, _MOVE, _LOOP) = range(9)


def _ops(*packets: Any) -> set[Any]:
    return {getattr(p, o) for p in packets for o in p.overloads()}


# Never batched: storage and metadata changes, results that depend on where a rank's tensor sits
# in memory, numbers and data-dependent shapes (combined per rank as LocalTensorMode combines them).
_NEVER_BATCHED = _ops(
    aten.set_,
    aten.resize_,
    aten.resize_as_,
    aten.as_strided,
    aten.as_strided_,
    aten.as_strided_scatter,
    aten._local_scalar_dense,
    aten.item,
    aten.nonzero,
    aten.masked_select,
    aten.unique_consecutive,
    aten._unique2,
    aten.equal,
    aten.allclose,
    aten.is_same_size,
    aten.hash_tensor,
)
# Elementwise, though not tagged so: run directly on the stacks.
_ELEMENTWISE = _ops(
    aten.copy_,
    aten.fill_,
    aten.zero_,
    aten._to_copy,
    aten.empty_like,
    aten.zeros_like,
    aten.ones_like,
    aten.full_like,
    aten.masked_fill_,
) | {
    getattr(getattr(aten, name), overload)  # ``mask_a | mask_b``: the bitwise ops on tensors
    for name in ("__and__", "__or__", "__xor__", "__iand__", "__ior__", "__ixor__")
    for overload in ("Tensor", "Scalar")
}
# Elementwise ops run straight on the stacks only where each output element is one correctly
# rounded IEEE operation (or none): then where an element falls in the kernel's loop (a vector
# lane, the scalar tail, another thread's chunk) cannot change its bits. Stacking ranks moves
# those boundaries, and for the rest it does: exp, tanh, silu, pow, complex products and fused
# forms such as ``a + alpha * b`` (one rounding in the vector lanes, two in the tail) round
# differently there. They run as per-rank kernels on each rank's slice, as matrix products do.
_EXACT = _ops(
    aten.abs,
    aten.add,
    aten.add_,
    aten.sub,
    aten.sub_,
    aten.rsub,
    aten.mul,
    aten.mul_,
    aten.div,
    aten.div_,
    aten.true_divide,
    aten.neg,
    aten.neg_,
    aten.positive,
    aten.reciprocal,
    aten.reciprocal_,
    aten.sqrt,
    aten.sqrt_,
    aten.pow,
    aten.pow_,
    aten.clamp,
    aten.clamp_,
    aten.clamp_min,
    aten.clamp_min_,
    aten.clamp_max,
    aten.clamp_max_,
    aten.clip,
    aten.clip_,
    aten.clone,
    aten.eq,
    aten.ne,
    aten.lt,
    aten.le,
    aten.gt,
    aten.ge,
    aten.maximum,
    aten.minimum,
    aten.max,
    aten.min,
    aten.fmax,
    aten.fmin,
    aten.where,
    aten.masked_fill,
    aten.isnan,
    aten.isinf,
    aten.isfinite,
    aten.isposinf,
    aten.isneginf,
    aten.signbit,
    aten.sign,
    aten.sign_,
    aten.copysign,
    aten.ceil,
    aten.ceil_,
    aten.floor,
    aten.floor_,
    aten.trunc,
    aten.trunc_,
    aten.round,
    aten.round_,
    aten.frac,
    aten.frac_,
    aten.relu,
    aten.relu_,
    aten.threshold,
    aten.threshold_backward,
    aten.hardtanh,
    aten.hardtanh_,
    aten.nan_to_num,
    aten.nan_to_num_,
    aten.logical_and,
    aten.logical_and_,
    aten.logical_or,
    aten.logical_or_,
    aten.logical_xor,
    aten.logical_xor_,
    aten.logical_not,
    aten.logical_not_,
    aten.bitwise_and,
    aten.bitwise_and_,
    aten.bitwise_or,
    aten.bitwise_or_,
    aten.bitwise_xor,
    aten.bitwise_xor_,
    aten.bitwise_not,
    aten.bitwise_not_,
    aten.conj_physical,
)
# Of those, exact on complex values too (no product of parts): complex values otherwise per rank.
_COMPLEX_EXACT = _ELEMENTWISE | _ops(
    aten.clone, aten.neg, aten.neg_, aten.conj_physical, aten.where, aten.masked_fill, aten.eq, aten.ne
)


def _alpha_one(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return len(args) <= 2 and kwargs.get("alpha", 1) == 1  # torch's vector lanes fuse a + alpha * b


def _no_rounding_mode(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return kwargs.get("rounding_mode") is None and len(args) <= 2


def _square_or_identity(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return len(args) == 2 and not isinstance(args[1], torch.Tensor) and args[1] in (1, 2)  # one product


def _no_decimals(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return not kwargs.get("decimals")


# Exact ops that are one rounding only for some arguments, by op name: the test of the arguments.
_ONE_ROUNDING: dict[str, Callable[[tuple[Any, ...], dict[str, Any]], bool]] = {
    **dict.fromkeys(("add", "add_", "sub", "sub_", "rsub"), _alpha_one),
    **dict.fromkeys(("div", "div_"), _no_rounding_mode),
    **dict.fromkeys(("pow", "pow_"), _square_or_identity),
    **dict.fromkeys(("round", "round_"), _no_decimals),
}


# Data movement through the batching rules: every output element is one input element.
_MOVES = _ops(
    aten.cat,
    aten.stack,
    aten.index_select,
    aten.gather,
    aten.embedding,
    aten.constant_pad_nd,
    aten.repeat,
    aten.flip,
    aten.roll,
    aten.tril,
    aten.triu,
    aten.index,
    aten._unsafe_index,
    aten.new_empty,
    aten.new_zeros,
    aten.new_ones,
    aten.new_full,
    aten.new_empty_strided,
    aten.narrow_copy,
    aten.slice_scatter,
    aten.select_scatter,
    aten.diagonal_scatter,
    aten.expand_copy,
    aten.permute_copy,
    aten.view_copy,
    aten.t_copy,
    aten.transpose_copy,
    aten.unsqueeze_copy,
    aten.squeeze_copy,
    aten.split_with_sizes_copy,
    aten.unbind_copy,
)


# Ops that return a view although their schema does not say so.
_ALIASING = _ops(aten._unsafe_view)
# Per-rank kernels that write straight into the result's stack (the functional op's own kernel).
_OUT_OPS = {
    aten.mm.default: aten.mm.out,
    aten.bmm.default: aten.bmm.out,
    aten.addmm.default: aten.addmm.out,
}


class _OpInfo:
    __slots__ = ("alias_pairs", "conditional", "dropout_at", "lanes", "out_op", "route", "write_arg")

    def __init__(self, func: Any) -> None:
        self.route = _TORCH
        self.alias_pairs: tuple[tuple[int, int], ...] = ()
        self.write_arg: int | None = None
        self.dropout_at: tuple[int, float] | None = None  # a seeded op's dropout_p: (position, default)
        self.out_op = _OUT_OPS.get(func)
        self.conditional: Any = None  # exact for some arguments only: their test (``_ONE_ROUNDING``)
        self.lanes = False  # elementwise, exact on stacks in whole vector lanes (``_whole_lanes``)
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional", "_dtensor"):
            self.route = _COLLECTIVE
            return
        if ns not in ("aten", "prims"):
            return  # device_mesh, profiler, custom ops: as LocalTensorMode runs them
        if func in META_OPS:
            self.route = _META
            return
        schema = func._schema
        returns = schema.returns
        tags = func.tags
        if func in _ALIASING:
            self.route = _VIEW
            self.alias_pairs = ((0, 0),)
            return
        if (
            torch.Tag.nondeterministic_seeded in tags
            and returns
            and all(_is_tensor_type(r.type) for r in returns)
        ):
            # Attention with dropout_p = 0 draws no random number: per-rank kernels then.
            names = [a.name for a in schema.arguments]
            if "dropout_p" in names:
                i = names.index("dropout_p")
                self.dropout_at = (i, float(schema.arguments[i].default_value or 0.0))
        info = get_alias_info(func)
        # A per-rank op's views too (``as_strided``): its result shares its input's memory.
        self.alias_pairs = tuple(info.read_only_alias_match_indexes)
        if (
            torch.Tag.nondeterministic_seeded in tags
            or func in _NEVER_BATCHED
            or not returns
            or not all(_is_tensor_type(r.type) for r in returns)
            or any(
                a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
            )
        ):
            self.route = _PER_RANK  # random, a number or a bool back, out= variants
            return
        writes = [
            i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        ]
        if writes:
            if writes != [0] or len(returns) != 1:
                self.route = _PER_RANK
                return
            self.write_arg = 0
        if info.is_inplace_view_op:
            self.route = _INPLACE_VIEW
        elif func in _ELEMENTWISE or (torch.Tag.pointwise in tags and func in _EXACT):
            self.route = _POINTWISE
            self.conditional = _ONE_ROUNDING.get(func._opname)
        elif torch.Tag.pointwise in tags:
            self.route = _LOOP
            self.lanes = True
        elif self.alias_pairs:
            self.route = _VIEW if self.write_arg is None else _PER_RANK
        elif func in _MOVES:
            self.route = _MOVE
        else:
            self.route = _LOOP


def _is_tensor_type(t: Any) -> bool:
    return str(t) in ("Tensor", "Tensor[]", "List[Tensor]", "Optional[Tensor]", "Tensor?")


_INFO: dict[Any, _OpInfo] = {}


def op_route(func: Any) -> str:
    """How the batched engine runs ``func`` (for tests and the notes)."""
    info = _INFO.get(func) or _info(func)
    return (
        "torch",
        "metadata",
        "collective",
        "per-rank",
        "elementwise",
        "view",
        "in-place view",
        "data movement",
        "per-rank kernels",
    )[info.route]


def _info(func: Any) -> _OpInfo:
    info = _INFO.get(func)
    if info is None:
        info = _INFO[func] = _OpInfo(func)
    return info


# --- the mode ----------------------------------------------------------------------------------

_entered = 0  # batched modes entered (nested ones and other threads' too)


class BatchedLocalTensorMode(LocalTensorMode):
    """LocalTensorMode that keeps the ranks' values stacked and runs each op once (see above).
    ``batched_ops`` and ``per_rank_ops`` count how ops ran since it was made."""

    def __init__(self, ranks: int | frozenset[int], check: bool | None = None) -> None:
        super().__init__(ranks)
        # ``check``: run every batched op rank by rank too and compare (bits, shapes, strides);
        # for tests and for hunting a difference ($SHARDVIZ_ENGINE_CHECK=1). Slow.
        self.check = bool(os.environ.get(CHECK_ENV)) if check is None else check
        self._world = len(self.ranks)
        self._full = self.ranks == frozenset(range(self._world))
        self.batched_ops = 0
        self.per_rank_ops = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Not wrapping __torch_dispatch__ in torch._disable_dynamo saves a frame-evaluation switch
        # on every op (as the recorder does); LocalTensorMode ignores compiled regions anyway.
        return False

    def __enter__(self) -> BatchedLocalTensorMode:
        global _entered
        if _entered == 0:
            _lt_module._for_each_rank_run_func = _for_each_rank_adopting
            torch._C._functorch._set_vmap_fallback_warning_enabled(  # type: ignore[attr-defined]
                False
            )
        _entered += 1
        try:
            super().__enter__()
        except BaseException:
            _left()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _left()

    def __torch_dispatch__(
        self,
        func: Any,
        types: tuple[Any, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        info = _INFO.get(func) or _info(func)
        route = info.route
        if route is _TORCH or not self._full or _get_dispatch_mode(_FAKE) is not None:
            # DTensor's sharding propagation runs ops on fake tensors below this mode: one fake per
            # rank, as LocalTensorMode makes them (nothing is computed).
            if route is _LOOP and info.write_arg is None and _get_dispatch_mode(_PROXY) is not None:
                args, kwargs = _traced_own_alignment((args, kwargs))
            return super().__torch_dispatch__(func, types, args, kwargs)
        if route is _META:
            if len(args) == 1 and type(args[0]) is StackedLocalTensor:
                return metadata(func, args[0])
            return super().__torch_dispatch__(func, types, args, kwargs)
        if route is _COLLECTIVE:
            done = rank_collectives.run(func, args, kwargs)
            if done is not _FALLBACK:
                self.batched_ops += 1
                return done
            if func is _WRAP_AUTOGRAD:
                # An AsyncCollectiveTensor around the input: nothing runs per rank, so no new
                # LocalTensorMode (and its copies of every rank's random state) around it.
                return func._op_dk(_K.CompositeExplicitAutograd, *args, **kwargs)  # type: ignore[union-attr]
            return super().__torch_dispatch__(func, types, args, kwargs)
        if func is _SCALAR and type(args[0]) is StackedLocalTensor and not self.check:
            same = _same_number(args[0])
            if same is not _FALLBACK:
                self.batched_ops += 1
                return same
        if route is _PER_RANK and info.dropout_at is not None:
            i, default = info.dropout_at
            p = args[i] if i < len(args) else kwargs.get("dropout_p", default)
            if p == 0:
                route = _LOOP
        if route is not _PER_RANK and self.check:
            return _checked(self, func, info, route, args, kwargs)
        return self._run(func, info, route, args, kwargs)

    def _run(
        self, func: Any, info: _OpInfo, route: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if route is not _PER_RANK:
            found = _scan(args, kwargs)
            if found is NotImplemented:
                return NotImplemented
            if found is not _FALLBACK:
                if found == 0:
                    out = self._no_local(func, args, kwargs)
                elif route is _POINTWISE:
                    if info.conditional is not None and not info.conditional(args, kwargs):
                        out = self._loop(func, info, args, kwargs)
                    else:
                        out = _pointwise(func, info, args, kwargs)
                        if out is _PER_SLICE:
                            out = self._loop(func, info, args, kwargs)
                        elif out is _FALLBACK and info.write_arg is None:
                            out = self._vmap(func, info, args, kwargs)
                elif route is _VIEW:
                    out = _view(func, info, args, kwargs)
                    if out is _FALLBACK:
                        out = self._vmap(func, info, args, kwargs)
                elif route is _MOVE:
                    out = _cat(args, kwargs) if func is _CAT else _FALLBACK
                    if out is _FALLBACK:
                        out = self._vmap(func, info, args, kwargs)
                elif route is _INPLACE_VIEW:
                    out = self._vmap(func, info, args, kwargs)
                elif info.lanes and _whole_lanes(args, kwargs):
                    out = _pointwise(func, info, args, kwargs)
                    if out is _PER_SLICE or out is _FALLBACK:
                        out = self._loop(func, info, args, kwargs)
                else:
                    out = self._loop(func, info, args, kwargs)
                if out is not _FALLBACK:
                    self.batched_ops += 1
                    return out
        return self._per_rank(func, info, args, kwargs)

    # --- once for all ranks ------------------------------------------------------------------

    def _no_local(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """No LocalTensor among the arguments. Plain tensors: plain code, as LocalTensorMode leaves
        it. None at all (``torch.zeros``): once, repeated for every rank."""
        if self._disable or any(isinstance(a, torch.Tensor) for a in flat_args(args, kwargs)):
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor) or type(out) not in PLAIN or not _row_major(out):
            return _FALLBACK
        return wrap(
            out.unsqueeze(0).expand(self._world, *out.shape).clone(memory_format=torch.contiguous_format)
        )

    def _vmap(self, func: Any, info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Through torch's batching rules, the stacks' first dim the batch dim."""
        world = self._world
        level = _vmap_increment_nesting(world, "error")
        try:
            with _batching_keys():
                bargs = tuple(_to_batched(a, level) for a in args)
                bkwargs = {k: _to_batched(v, level) for k, v in kwargs.items()} if kwargs else kwargs
                try:
                    out = func(*bargs, **bkwargs)
                except (RuntimeError, NotImplementedError, ValueError, IndexError, TypeError):
                    return _FALLBACK  # run per rank: LocalTensorMode's own error, if it is one
                if info.write_arg is not None:
                    target = args[info.write_arg]
                    if type(target) is not StackedLocalTensor:
                        return _FALLBACK
                    if info.route is _INPLACE_VIEW:
                        _sync_wrapper(target, _remove_batch_dim(out, level, world, 0))
                    return target
                result = _unbatch(out, level, world, fresh=not info.alias_pairs)
        finally:
            _vmap_decrement_nesting()
        if result is _FALLBACK:
            return _FALLBACK
        _alias_outputs(info, args, result)
        return result

    def _loop(self, func: Any, info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The op's own kernel on each rank's slice of the stacks, the results stacked: the same
        arithmetic as per rank, without LocalTensorMode's Python around each call."""
        world = self._world
        slices: dict[int, tuple[torch.Tensor, ...]] = {}
        written: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None = None
        target = None
        if info.write_arg is not None:
            target = args[info.write_arg]
            if type(target) is not StackedLocalTensor:
                return _FALLBACK  # a plain tensor written with per-rank values: rank by rank
            # Each rank's kernel writes its own tensor at its own alignment (a copy where the
            # slice sits elsewhere), copied back into the stack after.
            raw = target.__dict__["_stk"].unbind(0)
            written = raw, _own_slices(target.__dict__["_stk"], raw)
            slices[id(target)] = written[1]
        out_op: Any = info.out_op
        results = []
        stk = None
        outs: tuple[torch.Tensor, ...] = ()
        # Each argument as its ranks' values, cut once: a stack's slices, anything else repeated.
        cols = [_by_rank(a, world, slices) for a in args]
        names = list(kwargs) if kwargs else ()
        kcols = [_by_rank(kwargs[k], world, slices) for k in names]
        for r, rargs in enumerate(zip(*cols, strict=True) if cols else ((),) * world):
            rkwargs = dict(zip(names, (c[r] for c in kcols), strict=True)) if names else kwargs
            if stk is not None:
                out_op(*rargs, **rkwargs, out=outs[r])  # the same kernel, writing in place
                continue
            res = func(*rargs, **rkwargs)
            if out_op is not None and r == 0 and _row_major(res) and res.numel() and _aligned_rows(res):
                stk = res.new_empty((world, *res.shape))
                outs = stk.unbind(0)
                outs[0].copy_(res)
                continue
            results.append(res)
        if written is not None:
            for mine, own in zip(*written, strict=True):
                if own is not mine:
                    mine.copy_(own)
            return target
        if stk is not None:
            return wrap(stk)
        return _stack_results(results)

    # --- once per rank -------------------------------------------------------------------------

    def _per_rank(self, func: Any, info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """As LocalTensorMode runs it (torch's own per-rank loop, per-rank random generators
        included), its fresh results stacked where the ranks' results allow."""
        self.per_rank_ops += 1
        if info.route is _INPLACE_VIEW or (func in _NEVER_BATCHED and info.write_arg is not None):
            _unstack_written(args, kwargs)
        flat = flat_args(args, kwargs)
        if not any(isinstance(a, LocalTensor) for a in flat):
            if any(type(a) in PLAIN for a in flat):
                return func(*args, **kwargs)  # plain tensors: plain code, as LocalTensorMode leaves it
            return super().__torch_dispatch__(func, (), args, kwargs)
        if _lt_module._check_for_subclass(flat):
            return NotImplemented
        if info.route is _LOOP and info.write_arg is None:
            args, kwargs = _own_locals((args, kwargs))  # each rank's kernel at its own alignment
        elif func in _AS_STRIDED:
            args, kwargs = _offsets_per_rank(args, kwargs)
        out = _for_each_rank_run_func(func, self.ranks, args, kwargs, alias=False)
        if _lt_module._is_inplace_op(func):
            if info.route is _INPLACE_VIEW and type(out) is StackedLocalTensor:
                _sync_from_ranks(out)
            return out
        if info.alias_pairs:
            # A view keeps its input's class (torch's aliasing rules and nn.Parameter check it).
            if all(type(args[i]) is StackedLocalTensor for i, _ in info.alias_pairs):
                out = _adopt(out, view=True)
        else:
            # A result over an argument's memory stays a view of it, never a stacked copy.
            held = {
                v.untyped_storage()._cdata
                for a in flat
                if isinstance(a, LocalTensor)
                for v in a._local_tensors.values()
            }
            out = _adopt(out, view=False, held=held)
        _alias_outputs(info, args, out)
        if info.write_arg is not None:
            return args[info.write_arg]
        return out


def _slices_of(a: StackedLocalTensor, slices: dict[int, tuple[torch.Tensor, ...]]) -> tuple[Any, ...]:
    """A stacked argument's ranks as their own tensors (``_own_slices``), cut once into ``slices``."""
    views = slices.get(id(a))
    if views is None:
        views = slices[id(a)] = _own_slices(a.__dict__["_stk"])
    return views


def _by_rank(a: Any, world: int, slices: dict[int, tuple[torch.Tensor, ...]]) -> Any:
    """An argument's value on each rank: a stack's slices (cut once into ``slices``), a list's
    ranks' lists, anything else the same on every rank."""
    t = type(a)
    if t is StackedLocalTensor:
        return _slices_of(a, slices)
    if t is list or t is tuple:
        return [_at_rank(a, r, slices) for r in range(world)]
    return (a,) * world


def _at_rank(a: Any, r: int, slices: dict[int, tuple[torch.Tensor, ...]]) -> Any:
    """Rank ``r``'s slice of a stacked argument (lists too), each stack cut once into ``slices``.
    A function of the module, not a closure calling itself: that would be a reference cycle
    holding the slices, and so the stacks' memory, until the garbage collector ran."""
    t = type(a)
    if t is StackedLocalTensor:
        return _slices_of(a, slices)[r]
    if t is list or t is tuple:
        return t(_at_rank(b, r, slices) for b in a)
    return a


stacked.MODE_FOR[0] = BatchedLocalTensorMode
CHECK_ENV = "SHARDVIZ_ENGINE_CHECK"


class EngineMismatch(AssertionError):
    """The batched engine computed something other than the per-rank run (checking mode)."""


def _checked(
    mode: BatchedLocalTensorMode, func: Any, info: _OpInfo, route: int, args: Any, kwargs: Any
) -> Any:
    """The op batched, and rank by rank on copies of its inputs, compared."""
    if not any(isinstance(a, LocalTensor) for a in flat_args(args, kwargs)):
        return mode._run(func, info, route, args, kwargs)  # plain code, or a factory
    copies = _copy_locals((args, kwargs))
    out = mode._run(func, info, route, args, kwargs)
    if out is NotImplemented:
        return out
    ref_args, ref_kwargs = copies
    ref = _for_each_rank_run_func(func, mode.ranks, ref_args, ref_kwargs, alias=False)
    where = f"{func} ({op_route(func)})"
    _compare(out, ref, where, values=func not in _UNINITIALISED)
    for a, b in zip(flat_args(args, kwargs), flat_args(ref_args, ref_kwargs), strict=True):
        if isinstance(a, LocalTensor):
            _compare(a, b, where + ", an input written in place")
    return out


def _copy_locals(x: Any) -> Any:
    if isinstance(x, LocalTensor):
        with _DisableTorchDispatch():
            return LocalTensor({r: _same_layout_copy(v) for r, v in x._local_tensors.items()})
    if isinstance(x, (list, tuple)):
        return type(x)(_copy_locals(y) for y in x)
    if isinstance(x, dict):
        return {k: _copy_locals(v) for k, v in x.items()}
    return x


def _same_layout_copy(v: torch.Tensor) -> torch.Tensor:
    """A copy with ``v``'s strides, broadcast (zero) strides included, which ``clone`` makes dense."""
    if v.numel() == 0:
        return v.clone(memory_format=torch.preserve_format)
    span = 1 + sum((n - 1) * st for n, st in zip(v.shape, v.stride(), strict=True))
    region = v.as_strided((span,), (1,), v.storage_offset())
    return region.clone().as_strided(v.shape, v.stride(), 0)


# Their values are whatever the memory held: only shapes and strides compare.
_UNINITIALISED = _ops(aten.new_empty, aten.new_empty_strided, aten.empty_like)


def _compare(out: Any, ref: Any, where: str, values: bool = True) -> None:
    if isinstance(out, (list, tuple)):
        if not isinstance(ref, (list, tuple)) or len(out) != len(ref):
            raise EngineMismatch(f"{where}: {type(out).__name__} of {len(out)} against {ref!r}")
        for o, r in zip(out, ref, strict=True):
            _compare(o, r, where, values)
        return
    if isinstance(out, LocalTensor) and isinstance(ref, LocalTensor):
        with _DisableTorchDispatch():
            mine, theirs = out._local_tensors, ref._local_tensors
            if sorted(mine) != sorted(theirs):
                raise EngineMismatch(f"{where}: ranks {sorted(mine)} against {sorted(theirs)}")
            for r in theirs:
                a, b = mine[r], theirs[r]
                if a.shape != b.shape or a.dtype != b.dtype:
                    raise EngineMismatch(
                        f"{where}: rank {r} {tuple(a.shape)} {a.dtype} against {tuple(b.shape)} {b.dtype}"
                    )
                if a.numel() and a.stride() != b.stride():
                    raise EngineMismatch(f"{where}: rank {r} strides {a.stride()} against {b.stride()}")
                if values and a.numel() and not a.is_meta and not _same_values(a, b):
                    gap = (a.double() - b.double()).abs().max().item()
                    raise EngineMismatch(f"{where}: rank {r} values differ by {gap}")
        return
    either = isinstance(out, torch.Tensor) or isinstance(ref, torch.Tensor)
    if (
        either
        and type(out) is not type(ref)
        and not (isinstance(out, LocalTensor) and isinstance(ref, LocalTensor))
    ):
        raise EngineMismatch(f"{where}: {type(out).__name__} against {type(ref).__name__}")


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit where the layout allows; NaN in the same places and equal elsewhere otherwise."""
    if a.dtype.is_floating_point and a.is_contiguous() and b.is_contiguous():
        if torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            return True
    elif torch.equal(a, b):
        return True
    return (
        a.dtype.is_floating_point
        and torch.equal(a.isnan(), b.isnan())
        and torch.equal(a.nan_to_num(), b.nan_to_num())
    )


def _left() -> None:
    global _entered
    _entered -= 1
    if _entered == 0:
        _lt_module._for_each_rank_run_func = _for_each_rank_run_func
        torch._C._functorch._set_vmap_fallback_warning_enabled(  # type: ignore[attr-defined]
            True
        )


def _scan(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """How many stacked LocalTensors the arguments hold (lists in them too), stacking per-rank
    ones where that changes nothing a program can see (``restack``); ``_FALLBACK`` where some
    value is per rank (uneven shapes, a SymInt), ``NotImplemented`` for another tensor subclass
    (a DTensor: its own dispatch runs first, as with LocalTensorMode)."""
    found = 0
    for a in (*args, *kwargs.values()) if kwargs else args:
        t = type(a)
        if t is StackedLocalTensor:
            if a.__dict__.get("_stk") is None and not restack(a):
                return _FALLBACK
            found += 1
        elif t is list or t is tuple:
            for b in a:
                tb = type(b)
                if tb is StackedLocalTensor:
                    if b.__dict__.get("_stk") is None and not restack(b):
                        return _FALLBACK
                    found += 1
                elif tb is torch.SymInt or tb is list or tb is tuple:
                    return _FALLBACK
                elif tb not in PLAIN and isinstance(b, torch.Tensor):
                    if tb is not LocalTensor:
                        return _FALLBACK if isinstance(b, FakeTensor) else NotImplemented
                    if not restack(b):
                        return _FALLBACK
                    found += 1
        elif t is torch.SymInt:
            return _FALLBACK
        elif t not in PLAIN and isinstance(a, torch.Tensor):
            if t is not LocalTensor:
                return _FALLBACK if isinstance(a, FakeTensor) else NotImplemented
            if not restack(a):
                return _FALLBACK
            found += 1
    return found


def _pointwise(func: Any, info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An elementwise op straight on the stacks: they all hold ranks of the same number of dims,
    so broadcasting lines them up per rank, and plain tensors (no more dims) broadcast into every
    rank as they would into each. A rank's 0-dim value next to plain tensors would change type
    promotion, and falls back."""
    k = -1
    plain_nd = -1
    for a in (*args, *kwargs.values()) if kwargs else args:
        t = type(a)
        if t is StackedLocalTensor:
            stk = a.__dict__["_stk"]
            nd = stk.dim() - 1
            if stk.is_complex() and func not in _COMPLEX_EXACT:
                return _PER_SLICE  # a complex product rounds by where it falls in the loop
            if k == -1:
                k = nd
            elif nd != k:
                return _FALLBACK
        elif t is list or t is tuple:
            return _FALLBACK
        elif isinstance(a, torch.Tensor):
            plain_nd = max(plain_nd, a.dim())
            if a.is_complex() and func not in _COMPLEX_EXACT:
                return _PER_SLICE
        elif t is complex and func not in _COMPLEX_EXACT:
            return _PER_SLICE
    if plain_nd > k or (k == 0 and plain_nd >= 0):
        return _FALLBACK
    if info.write_arg is not None and type(args[0]) is not StackedLocalTensor:
        return _FALLBACK  # a plain tensor written with per-rank values: rank by rank
    sargs = tuple(a.__dict__["_stk"] if type(a) is StackedLocalTensor else a for a in args)
    skwargs = (
        {n: v.__dict__["_stk"] if type(v) is StackedLocalTensor else v for n, v in kwargs.items()}
        if kwargs
        else kwargs
    )
    try:
        out = func(*sargs, **skwargs)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return _FALLBACK  # run per rank: LocalTensorMode's own error
    if info.write_arg is not None:
        return args[0]
    if isinstance(out, torch.Tensor):
        return wrap(out)
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        return type(out)(wrap(o) for o in out)
    return _FALLBACK


_SCALAR = aten._local_scalar_dense.default


def _same_number(t: StackedLocalTensor) -> Any:
    """``.item()`` where every rank holds the same number: that number, as LocalTensorMode
    combines equal results (different ones, or NaN, which equals nothing: rank by rank)."""
    stk = t.__dict__.get("_stk")
    if stk is None or stk.numel() != stk.shape[0] or stk.is_conj() or stk.is_neg():
        return _FALLBACK
    values = stk.reshape(-1).tolist()
    first = values[0]
    if any(v != first for v in values):
        return _FALLBACK
    return first


_PER_SLICE = object()  # ``_pointwise``: run per-rank kernels on the slices instead
# torch's elementwise kernels run 2 vectors at a time (64 bytes of float32 ... 64 bfloat16 values
# at most) and the rest in scalar code; above GRAIN elements, several threads split the range.
_LANES = 64
_GRAIN = 32768


def _whole_lanes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an elementwise op that rounds by its place in torch's loop (``exp``, ``lerp``) gives
    each rank its own bits on the stacks: every tensor a contiguous stack of one shape and dtype,
    each rank a whole number of the kernels' widest step long, and one chunk of the range (or one
    thread). Each rank's elements then take the lanes, and none the scalar tail, that they take
    in the rank's own tensor."""
    shape = None
    for a in (*args, *kwargs.values()) if kwargs else args:
        t = type(a)
        if t is StackedLocalTensor:
            stk = a.__dict__["_stk"]
            if shape is None:
                shape, dtype = stk.shape, stk.dtype
            elif stk.shape != shape or stk.dtype != dtype:
                return False
            if not stk.is_contiguous() or stk.is_complex() or stk.is_neg() or stk.is_conj():
                return False
        elif t is list or t is tuple or isinstance(a, torch.Tensor):
            return False
    if shape is None or not shape[0]:
        return False
    numel = shape.numel()
    per_rank = numel // shape[0]
    return per_rank > 0 and per_rank % _LANES == 0 and (numel < _GRAIN or torch.get_num_threads() == 1)


_CAT = aten.cat.default


def _cat(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``cat`` of stacked tensors of the same number of dims: on the stacks, along the rank's dim."""
    if kwargs or not args or type(args[0]) not in (list, tuple):
        return _FALLBACK
    stks = []
    for t in args[0]:
        if type(t) is not StackedLocalTensor:
            return _FALLBACK
        stks.append(t.__dict__["_stk"])
    n = stks[0].dim() - 1
    if n == 0 or any(s.dim() - 1 != n for s in stks):
        return _FALLBACK  # 1-dim empty tensors and 0-dim ones: the batching rules know the corners
    dim = args[1] if len(args) > 1 else 0
    if not -n <= dim < n:
        return _FALLBACK
    try:
        return wrap(torch.cat(stks, _dim(dim, n)))
    except (RuntimeError, ValueError, TypeError, IndexError):
        return _FALLBACK


def _dim(d: int, n: int) -> int:
    """A per-rank dim (``n`` dims per rank) as the stack's dim."""
    return (d + n if d < 0 else d) + 1


def _view_t(s: torch.Tensor) -> torch.Tensor:
    return s.transpose(1, 2) if s.dim() == 3 else aten.alias.default(s)


def _view_expand(s: torch.Tensor, size: Any, implicit: bool = False) -> Any:
    if len(size) != s.dim() - 1:
        return _FALLBACK
    return s.expand(s.shape[0], *size)


def _view_squeeze_dims(s: torch.Tensor, dims: Any) -> torch.Tensor:
    n = s.dim() - 1
    return aten.squeeze.dims(s, [_dim(d, n) for d in dims]) if n else aten.alias.default(s)


_VIEWS: dict[Any, Callable[..., Any]] = {
    aten.view.default: lambda s, size: s.view(s.shape[0], *size),
    aten._unsafe_view.default: lambda s, size: aten._unsafe_view.default(s, [s.shape[0], *size]),
    aten.t.default: _view_t,
    aten.transpose.int: lambda s, a, b: s.transpose(_dim(a, s.dim() - 1), _dim(b, s.dim() - 1)),
    aten.permute.default: lambda s, dims: s.permute(0, *(_dim(d, s.dim() - 1) for d in dims)),
    aten.expand.default: _view_expand,
    aten.unsqueeze.default: lambda s, d: s.unsqueeze(_dim(d, s.dim())),
    aten.squeeze.dim: lambda s, d: _view_squeeze_dims(s, [d]),
    aten.squeeze.dims: _view_squeeze_dims,
    aten.select.int: lambda s, d, i: s.select(_dim(d, s.dim() - 1), i),
    aten.slice.Tensor: lambda s, d=0, start=None, end=None, step=1: aten.slice.Tensor(
        s, _dim(d, s.dim() - 1), start, end, step
    ),
    aten.split.Tensor: lambda s, size, d=0: aten.split.Tensor(s, size, _dim(d, s.dim() - 1)),
    aten.split_with_sizes.default: lambda s, sizes, d=0: aten.split_with_sizes.default(
        s, sizes, _dim(d, s.dim() - 1)
    ),
    aten.unbind.int: lambda s, d=0: aten.unbind.int(s, _dim(d, s.dim() - 1)),
    aten.detach.default: lambda s: aten.detach.default(s),
    aten.alias.default: lambda s: aten.alias.default(s),
}


def _view(func: Any, info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A view of one stacked tensor, taken on the stack with the rank dim kept first."""
    make = _VIEWS.get(func)
    if make is None or not args or type(args[0]) is not StackedLocalTensor or kwargs:
        return _FALLBACK
    stk = args[0].__dict__["_stk"]
    if stk.dim() == 1 and func is not aten.detach.default and func is not aten.alias.default:
        return _FALLBACK  # 0-dim ranks: the batching rules know their corner cases
    try:
        out = make(stk, *args[1:])
    except (RuntimeError, ValueError, TypeError, IndexError):
        return _FALLBACK
    if out is _FALLBACK:
        return out
    result: Any = wrap(out) if isinstance(out, torch.Tensor) else type(out)(wrap(o) for o in out)
    _alias_outputs(info, args, result)
    return result


def _alias_outputs(info: _OpInfo, args: tuple[Any, ...], result: Any) -> None:
    """A view's wrapper shares its input wrapper's storage, as torch's aliasing fix-up gives
    LocalTensorMode's (``return_and_correct_aliasing``)."""
    for arg_i, out_i in info.alias_pairs:
        src = args[arg_i]
        dst = result if not isinstance(result, (tuple, list)) else result[out_i]
        for d in dst if isinstance(dst, (list, tuple)) else (dst,):
            if isinstance(d, torch.Tensor) and isinstance(src, torch.Tensor):
                torch._functionalize_unsafe_set(d, src)


def _to_batched(a: Any, level: int) -> Any:
    t = type(a)
    if t is StackedLocalTensor:
        return _add_batch_dim(a.__dict__["_stk"], 0, level)
    if t is list or t is tuple:
        return t(_to_batched(b, level) for b in a)
    return a


def _unbatch(out: Any, level: int, world: int, fresh: bool) -> Any:
    if isinstance(out, torch.Tensor):
        if not is_batchedtensor(out) or maybe_get_level(out) != level:
            if not fresh:
                return _FALLBACK  # a view of a tensor every rank shares
            return wrap(
                out.unsqueeze(0).expand(world, *out.shape).clone(memory_format=torch.contiguous_format)
            )
        stk = _remove_batch_dim(out, level, world, 0)
        return wrap(_own_layout(stk) if fresh else stk)
    if isinstance(out, (list, tuple)):
        items = [_unbatch(o, level, world, fresh) for o in out]
        if any(i is _FALLBACK for i in items):
            return _FALLBACK
        return type(out)(items)
    if out is None:
        return None
    return _FALLBACK


def _dense(shape: Any, strides: Any) -> bool:
    """Whether a layout covers its memory exactly once (its dims in any order)."""
    expected = 1
    for size, stride in sorted(
        ((n, st) for n, st in zip(shape, strides, strict=True) if n != 1), key=lambda p: p[1]
    ):
        if stride != expected:
            return False
        expected *= size
    return True


# The matrix kernels (oneDNN/MKL) pick their code path by the output's address: written at an
# address off this alignment, a product can differ in the last bit from the one a fresh tensor gets.
_KERNEL_ALIGNMENT = 64


def _aligned_rows(t: torch.Tensor) -> bool:
    """Whether every rank's slot of a stack of ``t``'s shape starts aligned as a fresh tensor."""
    return (t.numel() * t.element_size()) % _KERNEL_ALIGNMENT == 0


def _own_slices(stk: torch.Tensor, views: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """A stack's slices (``views``, else cut here) as each rank's own tensor (``_as_own_tensors``);
    all of them as they are where one rank's slot is a whole number of alignments long."""
    aligned = (stk.stride(0) * stk.element_size()) % _KERNEL_ALIGNMENT == 0
    return _as_own_tensors(stk.unbind(0) if views is None else views, aligned)


def _as_own_tensors(views: tuple[torch.Tensor, ...], aligned: bool = False) -> tuple[torch.Tensor, ...]:
    """The ranks' slices of a stack as the kernels would see each rank's own tensor: a slice that
    starts at another alignment than rank 0's (which sits where a rank's own storage would) is
    copied to one that starts at rank 0's, with its strides."""
    if aligned or not views:
        return views
    want = views[0].data_ptr() % _KERNEL_ALIGNMENT
    return tuple(v if v.data_ptr() % _KERNEL_ALIGNMENT == want else _realigned(v, want) for v in views)


_AS_STRIDED = {aten.as_strided.default, aten.as_strided_.default}


def _offsets_per_rank(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``as_strided``'s storage offset counts from the start of a rank's own storage: where the
    ranks' tensors are slices of one stack, rank r's slice starts further in, and the offset
    follows it (else every rank would read rank 0's memory: FSDP's gradient shards)."""
    x = args[0] if args else None
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    if not isinstance(x, LocalTensor) or offset is None or not isinstance(offset, int):
        return args, kwargs
    with _DisableTorchDispatch():
        lts = x._local_tensors
        ranks = sorted(lts)
        if len({lts[r].untyped_storage().data_ptr() for r in ranks}) != 1:
            return args, kwargs  # each rank in a storage of its own: the offset is right as it is
        first = lts[ranks[0]].storage_offset()
        shifted = {r: offset + lts[r].storage_offset() - first for r in ranks}
    if len(set(shifted.values())) == 1:
        return args, kwargs
    per = torch.SymInt(LocalIntNode(shifted))  # a per-rank int, as LocalTensorMode makes them
    if len(args) > 3:
        return (*args[:3], per, *args[4:]), kwargs
    return args, {**kwargs, "storage_offset": per}


def _own_locals(x: Any) -> Any:
    """``x`` with every LocalTensor's per-rank slices of a stack realigned (``_as_own_tensors``)."""
    if isinstance(x, LocalTensor):
        with _DisableTorchDispatch():
            lts = x._local_tensors
            ranks = sorted(lts)
            views = _as_own_tensors(tuple(lts[r] for r in ranks))
            if all(v is lts[r] for v, r in zip(views, ranks, strict=True)):
                return x
            return LocalTensor(dict(zip(ranks, views, strict=True)))
    if isinstance(x, (list, tuple)):
        return type(x)(_own_locals(y) for y in x)
    if isinstance(x, dict):
        return {k: _own_locals(v) for k, v in x.items()}
    return x


@torch.library.custom_op("shardviz::own_alignment", mutates_args=())
def own_alignment(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` (its strides kept) that starts at ``like``'s alignment: what
    ``_as_own_tensors`` does, as an operator a compiled graph can hold (AOTAutograd's graphs run
    rank ``r``'s kernels on slices of the stacks)."""
    el = x.element_size()
    want = like.data_ptr() % _KERNEL_ALIGNMENT if like.numel() else 0
    pad = want // el if want % el == 0 else 0
    # The memory x spans, copied as it lies: any layout (broadcast, gaps) is kept exactly.
    span = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride(), strict=True)) if x.numel() else 0
    with _DisableTorchDispatch():
        buf = torch.empty(span + pad, dtype=x.dtype, device=x.device)
        if span:
            buf[pad:].copy_(x.as_strided((span,), (1,), x.storage_offset()))
        return buf.as_strided(x.shape, x.stride(), pad)


@own_alignment.register_fake
def _(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)


def _traced_own_alignment(x: Any) -> Any:
    """Traced into a compiled graph (torch.compile's AOTAutograd): every rank's tensor but the
    first read through ``own_alignment``, so its kernel runs at the alignment it has per rank,
    whichever slice of a stack the compiled graph is handed at run time."""
    if isinstance(x, LocalTensor):
        lts = x._local_tensors
        ranks = sorted(lts)
        if len(ranks) < 2:
            return x
        first = lts[ranks[0]]
        per = {r: lts[r] if r == ranks[0] else own_alignment(lts[r], first) for r in ranks}
        return LocalTensor.__new__(StackedLocalTensor, per)
    if isinstance(x, (list, tuple)):
        return type(x)(_traced_own_alignment(y) for y in x)
    if isinstance(x, dict):
        return {k: _traced_own_alignment(v) for k, v in x.items()}
    return x


def _realigned(v: torch.Tensor, want: int) -> torch.Tensor:
    el = v.element_size()
    if (
        v.numel() == 0
        or want % el
        or any(st == 0 for n, st in zip(v.shape, v.stride(), strict=True) if n > 1)
    ):
        return v  # nothing to read, or a layout a copy cannot keep (broadcast)
    span = 1 + sum((n - 1) * st for n, st in zip(v.shape, v.stride(), strict=True))
    pad = want // el
    buf = torch.empty(span + pad, dtype=v.dtype, device=v.device)
    out = buf.as_strided(v.shape, v.stride(), pad)
    out.copy_(v)
    return out


def _row_major(t: torch.Tensor) -> bool:
    expected = 1
    for n, st in zip(reversed(t.shape), reversed(t.stride()), strict=True):
        if n != 1 and st != expected:
            return False
        expected *= n
    return True


def _own_layout(stk: torch.Tensor) -> torch.Tensor:
    """A fresh result with the rank dim first and outermost, each rank's values laid out as the op
    lays out one rank's (a batching rule may hand the rank dim back anywhere)."""
    if stk.dim() == 1:
        return stk
    shape, strides = stk.shape[1:], stk.stride()[1:]
    numel = 1
    for n in shape:
        numel *= n
    if stk.stride(0) == numel and _dense(shape, strides):
        return stk
    like = torch.empty_like(stk[0])  # one rank's layout, as the op makes it for one rank
    out = torch.empty_strided(
        (stk.shape[0], *shape), (max(numel, 1), *like.stride()), dtype=stk.dtype, device=stk.device
    )
    out.copy_(stk)
    return out


def _stack_results(results: list[Any]) -> Any:
    """The ranks' results of one op as stacked LocalTensors (per position of a tuple), each rank's
    layout kept; held per rank where they differ in shape or layout."""
    first = results[0]
    if isinstance(first, torch.Tensor):
        if uniform(results):
            shape, stride = first.shape, first.stride()
            if first.is_contiguous():
                return wrap(torch.stack(results))
            if _dense(shape, stride):
                numel = first.numel()
                out = torch.empty_strided(
                    (len(results), *shape), (max(numel, 1), *stride), dtype=first.dtype, device=first.device
                )
                for r, v in enumerate(results):
                    out[r].copy_(v)
                return wrap(out)
        return LocalTensor.__new__(StackedLocalTensor, dict(enumerate(results)))
    if isinstance(first, (tuple, list)):
        return type(first)(_stack_results([res[i] for res in results]) for i in range(len(first)))
    if first is None:
        return None
    return _lt_module._combine_any_rank_results(dict(enumerate(results)))


def _sync_wrapper(target: StackedLocalTensor, stk: torch.Tensor) -> None:
    """An in-place view op (``unsqueeze_``) changed the stack's metadata: the wrapper follows,
    and views of the old stack handed out before are dropped from its cache."""
    target.__dict__["_stk"] = stk
    try:
        _SLOT.__delete__(target)
    except AttributeError:
        pass
    with torch.utils._mode_utils.no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            torch.Tensor.as_strided_(target, stk.shape[1:], stk.stride()[1:], stk.storage_offset())
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)
    target._size = list(stk.shape[1:])


def _sync_from_ranks(target: StackedLocalTensor) -> None:
    """The wrapper's sizes and strides after an in-place view op ran rank by rank."""
    values = list(target._local_tensors.values())
    if not uniform(values):
        return
    first = values[0]
    with torch.utils._mode_utils.no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            torch.Tensor.as_strided_(target, first.shape, first.stride(), first.storage_offset())
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)


def _unstack_written(args: Any, kwargs: Any) -> None:
    """A stacked tensor whose storage or metadata an op changes per rank (``resize_``, ``set_``)
    holds its ranks one by one from now on (the views it hands out are its ranks' tensors)."""
    for a in flat_args(args, kwargs):
        if type(a) is StackedLocalTensor and a.__dict__.get("_stk") is not None:
            views = a._local_tensors
            _SLOT.__set__(a, dict(views))
            a.__dict__["_stk"] = None


def _adopt(out: Any, view: bool, held: set[int] | None = None) -> Any:
    """LocalTensors from torch's per-rank loop as this engine's: stacked when they are fresh (not a
    view, sharing no storage in ``held``) and alike."""
    if isinstance(out, (list, tuple)):
        return type(out)(_adopt(o, view, held) for o in out)
    if type(out) is LocalTensor:
        per_rank = _SLOT.__get__(out)
        n = len(per_rank)
        values = [per_rank[r] for r in range(n)] if all(r in per_rank for r in range(n)) else []
        if (
            not view
            and values
            and uniform(values)
            and _dense(values[0].shape, values[0].stride())
            and not (held and any(v.untyped_storage()._cdata in held for v in values))
        ):
            with _DisableTorchDispatch():
                wrapped = _stack_results(values)
            if out.requires_grad:
                wrapped.requires_grad_(True)
            return wrapped
        out.__class__ = StackedLocalTensor
        out.__dict__["_stk"] = None
    return out


# --- torch's per-rank helpers (``maybe_run_for_local_tensor``) -------------------------------------


def _for_each_rank_adopting(func: Any, ranks: Any, args: Any, kwargs: Any, *, alias: bool = True) -> Any:
    """torch's per-rank loop, as ``maybe_run_for_local_tensor`` calls it (DTensor padding, cutting
    or selecting each rank's shard), under a batched mode: DTensor's own shape-only helpers run
    once on the stacks where no argument is per rank, a rank's chunk is picked for all ranks at
    once, and otherwise the per-rank results come back stacked where they are fresh (a result
    that shares memory with a LocalTensor argument, a view of it, stays per rank).

    An operator with torch's aliasing fix-up (``alias``, LocalTensorMode's own path: operators it
    runs per rank for this engine, and every operator on torch.compile's fake copies) keeps a
    stacked input's class on its views, as that fix-up requires."""
    if (
        alias
        and isinstance(func, torch._ops.OpOverload)
        and not _lt_module._is_inplace_op(func)
        and any(type(a) is StackedLocalTensor for a in flat_args(args, kwargs))
    ):
        out = _for_each_rank_run_func(func, ranks, args, kwargs, alias=False)
        return return_and_correct_aliasing(func, args, kwargs, _adopt(out, view=True))
    if (
        alias
        or isinstance(func, torch._ops.OpOverload)
        or not isinstance(_lt_module.local_tensor_mode(), BatchedLocalTensorMode)  # disabled meanwhile
    ):
        return _for_each_rank_run_func(func, ranks, args, kwargs, alias=alias)
    special = _ONCE.get(getattr(func, "__qualname__", ""))
    if special is not None and getattr(func, "__module__", "").startswith("torch.distributed.tensor"):
        done = special(func, args, kwargs)
        if done is not _FALLBACK:
            return done
    out = _for_each_rank_run_func(func, ranks, args, kwargs, alias=alias)
    held = {
        v.untyped_storage()._cdata
        for a in flat_args(args, kwargs)
        if isinstance(a, LocalTensor)
        for v in a._local_tensors.values()
    }
    return _adopt(out, view=False, held=held)


def _per_rank_value(x: Any) -> bool:
    """Whether ``x`` (nested lists too) holds a per-rank int, a LocalTensor that is not stacked,
    or a plain tensor (which the per-rank loop hands back as a LocalTensor of it on every rank)."""
    t = type(x)
    if t is torch.SymInt:
        return isinstance(x.node, LocalIntNode)
    if t is list or t is tuple:
        return any(_per_rank_value(y) for y in x)
    if isinstance(x, LocalTensor):
        return stack_of(x) is None
    return isinstance(x, torch.Tensor)


def _once(func: Any, args: Any, kwargs: Any) -> Any:
    """A shape-only per-rank helper run once over the stacks: every rank would run the same
    Python on values of the same shape, so the ops it dispatches are the batched ones. No
    autograd history, as per rank (the ranks' own tensors never require grad); a result that is
    an argument itself comes back as a new LocalTensor over the same values, as per rank."""
    if any(_per_rank_value(a) for a in args) or any(_per_rank_value(v) for v in kwargs.values()):
        return _FALLBACK
    with torch.no_grad():
        out = func(*args, **kwargs)
    return _fresh_wrappers(out, args)


def _fresh_wrappers(out: Any, args: Any) -> Any:
    if isinstance(out, (list, tuple)):
        return type(out)(_fresh_wrappers(o, args) for o in out)
    if isinstance(out, LocalTensor) and any(out is a for a in args):
        stk = stack_of(out)
        if stk is None:
            return _FALLBACK
        alias = wrap(stk)
        torch._functionalize_unsafe_set(alias, out)
        return alias
    return out


def _select_split(func: Any, args: Any, kwargs: Any) -> Any:
    """``Shard._select_split_tensor``: each rank's chunk of its own tensor, at its own index (its
    mesh coordinate), cloned; one gather over the stack where the chunks are even."""
    if len(args) != 4:
        return _FALLBACK
    placement, tensor, num_chunks, index = args
    if type(index) is int:
        return _once(func, args, kwargs)
    if kwargs.get("with_padding", True) is not False or not kwargs.get("clone", True):
        return _FALLBACK
    stk = stack_of(tensor)
    dim = getattr(placement, "dim", None)
    if (
        stk is None
        or type(placement).__name__ != "Shard"
        or type(dim) is not int
        or type(num_chunks) is not int
    ):
        return _FALLBACK
    if type(index) is not torch.SymInt or not isinstance(index.node, LocalIntNode):
        return _FALLBACK
    world = stk.shape[0]
    n = stk.dim() - 1
    if not -n <= dim < n:
        return _FALLBACK
    d = _dim(dim, n)
    size = stk.shape[d]
    picks = [int(index.node._local_ints[r]) for r in range(world)]
    if size <= 0 or num_chunks <= 0 or size % num_chunks or not _row_major(stk):
        return _FALLBACK
    if any(not 0 <= p < num_chunks for p in picks):
        return _FALLBACK
    with _DisableTorchDispatch():
        chunks = stk.unflatten(d, (num_chunks, size // num_chunks)).movedim(d, 1)
        out = chunks[torch.arange(world), torch.tensor(picks)]
    return wrap(out)


_ONCE: dict[str, Callable[[Any, Any, Any], Any]] = {
    "pad_tensor": _once,
    "unpad_tensor": _once,
    "Shard._maybe_pad_tensor": _once,
    "Shard._maybe_unpad_tensor": _once,
    "Shard._maybe_unpad_tensor_with_sizes": _once,
    "Shard._pad_for_new_shard_dim": _once,
    "Shard._unpad_for_new_shard_dim": _once,
    "Shard._get_shard_pad_size": _once,
    "Shard._select_split_tensor": _select_split,
}

__all__ = ["BatchedLocalTensorMode", "StackedLocalTensor", "op_route"]
