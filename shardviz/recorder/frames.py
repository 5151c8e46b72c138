"""Finding the user's line: the innermost Python frame outside torch and shardviz.

Every event names the line of user code that caused it, so this walk runs once per event. Each
code object is classified once (user, library, DTensor dispatch, holds a mesh) and each source
position read once; see ``caches``.
"""

from __future__ import annotations

import io
import linecache
import os
import re
import tokenize
from types import FrameType
from typing import Any

from .. import _torch
from ..trace import Source
from . import caches

# Frames from these places are library code, not the user's line.
TORCH_DIR = _torch.TORCH_DIR
OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the shardviz package
# Library wrappers between a user's call and torch (typing_extensions' @deprecated wraps
# dist.all_gather_into_tensor and dist.reduce_scatter_tensor).
_SKIP_FILES = ("contextlib.py", "functools.py", "threading.py", "typing_extensions.py", "warnings.py")
_IPYKERNEL_CELL = re.compile(r"ipykernel_\d+[/\\]\d+\.py$")

# What a frame's code is: a bit set. _ON_BEHALF: torch code other than the c10d Python API and
# dispatch plumbing (which a raw dist.* call passes through): DTensor, FSDP, pipelining calling
# collectives on the user's behalf.
_USER, _LIBRARY, _DISPATCH, _MESH, _FSDP, _ON_BEHALF = 0, 1, 2, 4, 8, 16


def user_frame(
    frame: FrameType | None,
    meshes: list[Any] | None = None,
    fsdp: list[Any] | None = None,
    on_behalf: list[bool] | None = None,
) -> tuple[FrameType | None, bool]:
    """The innermost frame outside torch and shardviz, and whether DTensor dispatch is on the way.

    With ``meshes``, DeviceMeshes held by torch's frames on the way (``distribute_tensor``'s
    ``device_mesh``, a redistribute's ``mesh``) are collected: they name the mesh dims. With
    ``fsdp``, the module whose FSDP2 parameter group is on the way: what it issues belongs to it.
    Both come from frames this walk passes anyway, so an event costs no second walk. With
    ``on_behalf``, True is appended when a torch frame other than the c10d API is on the way.
    """
    in_dispatch = False
    while frame is not None:
        kind = _code_kind(frame.f_code)
        if kind == _USER:
            return frame, in_dispatch
        if kind & _ON_BEHALF and on_behalf is not None and not on_behalf:
            on_behalf.append(True)
        if kind & _DISPATCH:
            in_dispatch = True
        if kind & _MESH and meshes is not None and not meshes:
            m = _torch.frame_mesh(frame)  # only for the innermost frame with a mesh
            if m is not None:
                meshes.append(m)
        if kind & _FSDP and fsdp is not None and not fsdp:
            owner = _torch.fsdp_owner(frame)  # only for the innermost parameter group
            if owner is not None:
                fsdp.append(owner)
        frame = frame.f_back
    return None, in_dispatch


@caches.memo(maxsize=65536)
def _code_kind(code: Any) -> int:
    fn = code.co_filename
    if fn.startswith(TORCH_DIR):
        kind = _LIBRARY
        if fn == _torch.DTENSOR_DISPATCH_FILE:
            kind |= _DISPATCH
        elif fn == _torch.FSDP_GROUP_FILE:
            kind |= _FSDP
        if fn not in _torch.C10D_API_FILES and fn not in _torch.DISPATCH_PLUMBING:
            kind |= _ON_BEHALF
        if _torch.may_hold_mesh(code):
            kind |= _MESH
    elif fn.startswith(OWN_DIR) or fn.endswith(_SKIP_FILES) or fn.startswith("<frozen"):
        kind = _LIBRARY
    else:
        kind = _USER
    return kind


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
    """Whether the op being dispatched was called by user code rather than inside torch."""
    while frame is not None:
        fn = frame.f_code.co_filename
        if not (fn.startswith(OWN_DIR) or fn.startswith(_torch.DISPATCH_PLUMBING)):
            return not fn.startswith(TORCH_DIR)
        frame = frame.f_back
    return False


def is_library(frame: FrameType) -> bool:
    fn = frame.f_code.co_filename
    return fn.startswith(TORCH_DIR) or fn.startswith(OWN_DIR)
