"""Which nn.Module runs (forward and backward), and what torch.compile made of it: its
rewritten code, generated GraphModules, modules compiled in place."""

from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import Any

import torch
from torch.fx import GraphModule as _GraphModule
from torch.nn.modules.module import register_module_forward_pre_hook as _register_module_forward_pre_hook


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass."""
    return torch._C._current_graph_task_id() != -1


class ModuleStack:
    """Which nn.Module is running: its qualified name, in the forward and in the backward.

    Forward: a global pre-forward hook pushes the module and a forward hook of its own, registered
    after the module's existing hooks, pops it, so what tensor-parallel output hooks communicate
    belongs to the module that produced it. Backward: each module call remembers the range of
    autograd sequence numbers created while it ran; a backward collective looks up the node the
    engine is running. This costs two counter reads per module call and no autograd hooks.
    Names follow ModTracker's: the root's class name, then attribute paths (``MLP.net.0``).
    """

    def __init__(self) -> None:
        self._stack: list[tuple[str, int]] = []
        self._names: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._hooked: weakref.WeakSet[Any] = weakref.WeakSet()
        self._handles: list[Any] = []
        self._spans: list[tuple[int, int, str]] = []
        # The owner found for each autograd node's sequence number, until the next span is added.
        self._owners: dict[int, str | None] = {}
        # A named module runs compiled: the walk to the user's line looks for the module being
        # called (see ``current``), as no hook of its runs outside the compiled code.
        self.compiled = False

    def _name(self, mod: Any) -> str:
        name = self._names.get(mod)
        if name is None:
            name = type(mod).__name__
            for path, sub in mod.named_modules():
                self.compiled = self.compiled or is_compiled_module(sub)
                if path and sub not in self._names:
                    self._names[sub] = f"{name}.{path}"
            self._names[mod] = name
        return name

    def _enter_forward(self, mod: Any, inputs: Any) -> None:
        # Traced into a compiled region, a hook registered there would break the graph; the graph
        # torch.compile's backends run (a GraphModule of no model) is torch's, not a module of the user's.
        if torch.compiler.is_compiling() or (mod not in self._names and is_generated_module(mod)):
            return
        if mod not in self._hooked:
            self._hooked.add(mod)
            self._handles.append(mod.register_forward_hook(self._leave_forward, always_call=True))
        self._stack.append((self._name(mod), torch._C._autograd._get_sequence_nr()))

    def _leave_forward(self, mod: Any, inputs: Any, output: Any) -> None:
        if not self._stack or torch.compiler.is_compiling():
            return
        name, start = self._stack.pop()
        end = torch._C._autograd._get_sequence_nr()
        if end > start:
            self._spans.append((start, end, name))
            self._owners.clear()

    def current(self, fsdp_owner: Any = None, called: Any = None) -> str | None:
        """``fsdp_owner``: the module whose FSDP2 parameter group is on the stack (``fsdp_owner``
        of its frame, found by the walk to the user's line): what that group communicates
        belongs to it, in the simulator and on real ranks, whichever module's hook ran it.
        ``called``: the innermost module being called (asked for while ``compiled``); a compiled
        one is the module running, its hooks having stayed inside the compiled code. In the
        backward a compiled module's work belongs to the innermost module that ran uncompiled."""
        if fsdp_owner is not None:
            name = self._names.get(fsdp_owner)  # named once its model ran
            if name is not None:
                return name
        if in_backward():
            node = torch._C._current_autograd_node()
            return self._backward_owner(node._sequence_nr()) if node is not None else None
        if called is not None and is_compiled_module(called):
            name = self._names.get(called)
            if name is not None:
                return name
        return self._stack[-1][0] if self._stack else None

    def _backward_owner(self, seq: int) -> str | None:
        """The innermost module whose forward created node ``seq``; looked up once per node, as
        every op and collective of the backward asks."""
        try:
            return self._owners[seq]
        except KeyError:
            pass
        owner = self._owners[seq] = self._find_owner(seq)
        return owner

    def _find_owner(self, seq: int) -> str | None:
        best: tuple[int, str] | None = None
        for start, end, name in reversed(self._spans):
            if start <= seq < end and (best is None or end - start < best[0]):
                best = (end - start, name)
        return best[1] if best else None

    def __enter__(self) -> ModuleStack:
        self._handles.append(_register_module_forward_pre_hook(self._enter_forward))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._hooked:
            self._hooked = weakref.WeakSet()
        self._stack.clear()


# nn.Module.__call__'s code: a frame of it on the stack is a module being called (its ``self``).
MODULE_CALL_CODE = torch.nn.Module._wrapped_call_impl.__code__


def called_module(frame: FrameType) -> Any:
    """The module a frame of ``MODULE_CALL_CODE`` calls."""
    return frame.f_locals.get("self")


def is_compiled_code(code: Any) -> bool:
    """Whether ``code`` is torch.compile's rewrite of a function (Dynamo's bytecode, which keeps
    the function's file name): its lines do not run one by one, so the line to show is its caller's."""
    utils = sys.modules.get("torch._dynamo.utils")
    return utils is not None and code in utils.orig_code_map


def is_generated_module(mod: Any) -> bool:
    """Whether ``mod`` is a torch.fx GraphModule: torch.compile's backends run the code they
    compile as one."""
    return isinstance(mod, _GraphModule)


def is_compiled_module(mod: Any) -> bool:
    """Whether ``mod`` runs compiled (``module.compile()``): its own hooks run inside the compiled
    code, where shardviz's module tracking stays out."""
    return getattr(mod, "_compiled_call_impl", None) is not None
