"""Hugging Face transformers: its distributed loading, explained where the lockstep simulator
cannot run it.

transformers keeps no per-process singleton of its own for distributed runs: a model's mesh and
plans live on the model (``_device_mesh``, ``tp_plan``), the process groups in torch.distributed.
Its loader (``from_pretrained(..., distributed_config=...)``) runs in a ``ThreadPoolExecutor``,
which the simulation runs in the rank's own thread (``shardviz.capture.processes``), so under
``sv.use("threads")`` TP and FSDP x TP load, train and are drawn as on real ranks.

In the lockstep simulator, transformers needs each rank's own number as a plain int: it binds the
device by ``LOCAL_RANK`` and slices every checkpoint tensor by the rank's mesh coordinate. Both
raise ``PerRankValueError`` there (every run the same); this adapter adds which transformers code
needed the int and the way out.

Imported only once transformers is (``shardviz.capture.adapters``); it never imports it.
"""

from __future__ import annotations

import linecache
import os
import sys
from types import TracebackType

from .. import adapters

NAME = "transformers"


def activate() -> None:
    """Nothing to hook: transformers' distributed state is torch's and the model's."""


def module_loaded(name: str) -> None:
    """Nothing to hook."""


def recording_started(rec: adapters.Recording) -> None:
    """Nothing to adopt."""


def handles(obj: object) -> bool:
    return False  # transformers shards with DTensor itself


def handles_spec(spec: object) -> bool:
    return False


def _package_dir() -> str | None:
    path = getattr(sys.modules.get("transformers"), "__file__", None)
    return os.path.join(os.path.dirname(path), "") if path else None


def _innermost(tb: TracebackType | None, package: str) -> tuple[str, int, str] | None:
    """The innermost traceback entry in ``package``: (file, line, function)."""
    found = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.startswith(package):
            found = (code.co_filename, tb.tb_lineno, code.co_name)
        tb = tb.tb_next
    return found


def explain_error(error: BaseException, where: list[tuple[str, str]], lockstep: bool) -> str | None:
    """A per-rank int that transformers' own code needed in the lockstep simulator."""
    from ...errors import PerRankValueError

    package = _package_dir()
    if not lockstep or package is None:
        return None
    msg = str(error.args[0]) if error.args else ""
    per_rank = isinstance(error, PerRankValueError) or (
        isinstance(error, AttributeError) and "'LocalIntNode' object has no attribute" in msg
    )
    if not per_rank:
        return None
    site = _innermost(error.__traceback__, package)
    if site is None:
        return None
    file, line, func = site
    text = linecache.getline(file, line).strip()
    return (
        f"shardviz: transformers' {func} (transformers/{os.path.relpath(file, package)}, line {line}: "
        f"{text}) needs this rank's own number as a plain Python int: its distributed loading binds "
        "the device by LOCAL_RANK and slices each checkpoint tensor by the rank's mesh coordinate. "
        "The lockstep simulator runs every rank's Python line at once, so it cannot give one. Run "
        "transformers' tensor parallel and FSDP with one thread per rank, where every rank has plain "
        "ints and the code runs as written: sv.use('threads', world_size=N), then sv.run(fn) or a "
        "%%spmd cell (or on real ranks: sv.use('gloo', world_size=N))."
    )
