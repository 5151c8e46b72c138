"""Finding the user's line: the innermost Python frame outside torch, shardviz and every other
installed library (site-packages, dist-packages, the standard library).

Every event names the line of user code that caused it, so this walk runs once per event. Each
code object is classified once (user, library, DTensor dispatch, holds a mesh) and each source
position read once; see ``caches``.
"""

from __future__ import annotations

import io
import linecache
import os
import re
import site
import sysconfig
import tokenize
from types import FrameType
from typing import Any

from ...data.events import Source
from .. import torch as _torch
from . import caches

# Frames from these places are library code, not the user's line.
TORCH_DIR = _torch.TORCH_DIR
OWN_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep  # shardviz/
# Library wrappers between a user's call and torch (typing_extensions' @deprecated wraps
# dist.all_gather_into_tensor and dist.reduce_scatter_tensor).
_SKIP_FILES = ("contextlib.py", "functools.py", "threading.py", "typing_extensions.py", "warnings.py")
_IPYKERNEL_CELL = re.compile(r"ipykernel_\d+[/\\]\d+\.py$")
# Other libraries' folders, added by a framework adapter (PhysicsNeMo's ShardTensor issues
# collectives from its own code): like torch, never the user's line.
_OTHER_LIBRARIES: tuple[str, ...] = ()


def add_library(folder: str) -> None:
    """Frames from files under ``folder`` are library code from now on."""
    global _OTHER_LIBRARIES
    folder = os.path.join(os.path.abspath(folder), "")
    if folder not in _OTHER_LIBRARIES:
        _OTHER_LIBRARIES = (*_OTHER_LIBRARIES, folder)
        caches.CODE_KINDS.clear()


# Code torch generates and runs between a compiled module's caller and its ops (torch.fx's
# GraphModule source, which torch.compile's eager backends run).
_GENERATED = ("<frozen", "<eval_with_key>")


def _library_dirs() -> tuple[str, ...]:
    """Where installed code lives: a training library (torchtitan, physicsnemo, torchao) calls
    torch for the user, but the line to show is the user's call into it."""
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)}
    dirs.update(getattr(site, "getsitepackages", list)())
    user_site = getattr(site, "getusersitepackages", lambda: None)()
    if user_site:
        dirs.add(user_site)
    return tuple(sorted({os.path.join(os.path.abspath(d), "") for d in dirs}))


LIBRARY_DIRS = _library_dirs()
# Installed packages found elsewhere than this interpreter's own directories (a conda environment,
# PYTHONPATH pointing into another one).
_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")

# What a frame's code is: a bit set. _ON_BEHALF: torch code other than the c10d Python API and
# dispatch plumbing (which a raw dist.* call passes through): DTensor, FSDP, pipelining calling
# collectives on the user's behalf.
_USER, _LIBRARY, _DISPATCH, _MESH, _FSDP, _ON_BEHALF, _FSDP_BACKWARD, _MODULE_CALL = 0, 1, 2, 4, 8, 16, 32, 64


class Found:
    """What the walk to the user's line passed on its way, as asked for: the module whose FSDP2
    parameter group is running (``fsdp``: what it issues belongs to it) and whether that is its
    backward; the innermost module being called (``called``: a compiled module's own hooks do not
    run outside its compiled code); whether torch code other than the c10d API is on the way
    (``on_behalf``: DTensor, FSDP or pipelining communicating for the user)."""

    __slots__ = ("called", "fsdp", "fsdp_backward", "look_for_call", "on_behalf")

    def __init__(self, look_for_call: bool = False) -> None:
        self.fsdp: Any = None
        self.fsdp_backward = False
        self.called: Any = None
        self.look_for_call = look_for_call
        self.on_behalf = False


def user_frame(
    frame: FrameType | None, meshes: list[Any] | None = None, found: Found | None = None
) -> tuple[FrameType | None, bool]:
    """The innermost frame outside torch, shardviz and other libraries, and whether DTensor
    dispatch is on the way.

    With ``meshes``, DeviceMeshes held by torch's frames on the way (``distribute_tensor``'s
    ``device_mesh``, a redistribute's ``mesh``) are collected: they name the mesh dims. With
    ``found``, the FSDP2 parameter group, the module call and torch code communicating on the
    user's behalf on the way (see ``Found``). All come from frames this walk passes anyway, so an
    event costs no second walk.
    """
    in_dispatch = False
    kinds = caches.CODE_KINDS
    while frame is not None:
        kind = kinds.get(frame.f_code)
        if kind is None:
            kind = _code_kind(frame.f_code)
        if kind == _USER:
            return frame, in_dispatch
        if kind & _DISPATCH:
            in_dispatch = True
        if kind & _MESH and meshes is not None and not meshes:
            m = _torch.frame_mesh(frame)  # only for the innermost frame with a mesh
            if m is not None:
                meshes.append(m)
        if found is not None and kind > _MESH | _DISPATCH | _LIBRARY:
            if kind & _ON_BEHALF:
                found.on_behalf = True
            if kind & _FSDP and found.fsdp is None:
                found.fsdp = _torch.fsdp_owner(frame)  # only for the innermost parameter group
            if kind & _FSDP_BACKWARD:
                found.fsdp_backward = True
            if kind & _MODULE_CALL and found.look_for_call:
                called = _torch.called_module(frame)
                if not _torch.is_generated_module(called):  # the graph a compiled module runs
                    found.called = called  # only the innermost
                    found.look_for_call = False
        frame = frame.f_back
    return None, in_dispatch


def _code_kind(code: Any) -> int:
    """What ``code`` is (a bit set), worked out once per code object (``caches.CODE_KINDS``): the
    walk to the user's line asks for every frame of every event."""
    kind = caches.CODE_KINDS.get(code)
    if kind is None:
        kind = caches.remember(caches.CODE_KINDS, code, _classify(code), 65536)
    return kind


def _classify(code: Any) -> int:
    fn = code.co_filename
    if fn.startswith(TORCH_DIR):
        kind = _LIBRARY
        if fn == _torch.DTENSOR_DISPATCH_FILE:
            kind |= _DISPATCH
        elif fn == _torch.FSDP_GROUP_FILE:
            kind |= _FSDP
            if code.co_name in _torch.FSDP_BACKWARD_METHODS:
                kind |= _FSDP_BACKWARD
        elif code is _torch.MODULE_CALL_CODE:
            kind |= _MODULE_CALL
        if fn not in _torch.C10D_API_FILES and fn not in _torch.DISPATCH_PLUMBING:
            kind |= _ON_BEHALF
        if _torch.may_hold_mesh(code):
            kind |= _MESH
    elif is_library_file(fn) or _torch.is_compiled_code(code):
        kind = _LIBRARY
    else:
        kind = _USER
    return kind


def is_library_file(fn: str) -> bool:
    """Whether code from file ``fn`` is installed code (shardviz, a library, the standard
    library, code torch generates) rather than the user's."""
    return (
        fn.startswith((OWN_DIR, *_OTHER_LIBRARIES))
        or fn.startswith(LIBRARY_DIRS)
        or fn.startswith(_GENERATED)
        or fn.endswith(_SKIP_FILES)
        or any(part in fn for part in _INSTALLED)
    )


def source(frame: FrameType | None) -> Source | None:
    """The user's source line; memoised per code position (loops record the same line again)."""
    if frame is None:
        return None
    key = (frame.f_code, frame.f_lasti)
    hit = caches.SOURCES.get(key)
    if hit is None:
        hit = caches.remember(caches.SOURCES, key, _read_source(frame), 4096)
    return hit


def user_source(frame: FrameType | None) -> Source | None:
    """The source line of the innermost user frame at or above ``frame``."""
    return source(user_frame(frame)[0])


def _read_source(frame: FrameType) -> Source:
    fn = frame.f_code.co_filename
    line = frame.f_lineno
    text = linecache.getline(fn, line).strip()
    end = _end_line(frame) if text.count("(") > text.count(")") else None
    if end is not None and end > line:  # a call spread over several lines: the whole call
        rest = (linecache.getline(fn, i).strip() for i in range(line + 1, min(end, line + 8) + 1))
        text = " ".join([text, *rest])
    if "#" in text:
        text = _without_comment(text)
    if _IPYKERNEL_CELL.search(fn):
        fn = "<cell>"
    return Source(fn, line, text)


def _without_comment(text: str) -> str:
    """The line without its trailing comment (tokenized, so a '#' inside a string stays)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return text
    for tok in tokens:
        if tok.type == tokenize.COMMENT and tok.start[0] == 1:
            return text[: tok.start[1]].rstrip() or text
    return text


def _end_line(frame: FrameType) -> int | None:
    """Last source line of the instruction running in ``frame`` (positions of Python 3.11+)."""
    try:
        positions = iter(frame.f_code.co_positions())
        for _ in range(frame.f_lasti // 2):
            next(positions)
        return next(positions)[1]
    except (StopIteration, AttributeError, ValueError):
        return None


def called_by_user(frame: FrameType | None) -> bool:
    """Whether the op being dispatched was called by user code rather than inside torch or
    another library."""
    while frame is not None:
        fn = frame.f_code.co_filename
        if not (fn.startswith((OWN_DIR, *_torch.DISPATCH_PLUMBING)) or fn.endswith(_SKIP_FILES)):
            return _code_kind(frame.f_code) == _USER
        frame = frame.f_back
    return False


def is_library(frame: FrameType) -> bool:
    """Whether ``frame`` runs library code (torch's, shardviz's, an installed package's)."""
    return _code_kind(frame.f_code) != _USER
