"""Architecture rules, checked on the source: every module of the package is parsed, none imported.

1. Private torch (a ``torch`` module path or name with a segment starting with ``_``, the private
   attributes of torch objects that shardviz reads) is touched in ``shardviz/capture/torch/`` only, so
   that a torch release that moves one breaks one module with a message naming it.
2. The views read plain data only: nothing under ``shardviz/views/`` imports torch (or ``_torch``).
3. The plain-data modules (geometry and layouts, shared by real ranks, saved traces and views) and
   every shardviz module they import, at any depth, import neither torch nor the recorder, the
   backends or the views.

4. Torch's internal layout (its frames' locals, its private source files by name) is read in
   ``shardviz/capture/torch/`` and, for tracebacks it explains, ``shardviz/capture/explain.py`` only.

Imports anywhere count: at the top, in a function (a lazy import), under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "shardviz"

# The one package allowed to touch private torch (every module in it).
TORCH_GATE = "shardviz/capture/torch/"

# Plain-data modules, torch-free today. Not among them: trace.py, which imports torch (lazily, to
# rebuild tensor results when a trace file is loaded) and views.text (for its text form).
PLAIN_DATA = (
    "shardviz/geometry/chunks.py",
    "shardviz/geometry/layout.py",
    "shardviz/geometry/mesh.py",
    "shardviz/data/numerics/__init__.py",
    "shardviz/geometry/placement.py",
)
NOT_FOR_PLAIN_DATA = (
    "torch",
    "shardviz.capture.torch",
    "shardviz.capture.recorder",
    "shardviz.backends",
    "shardviz.views",
)
NOT_FOR_VIEWS = ("torch", "shardviz.capture.torch")

# Private attributes of torch objects (DTensor, LocalTensor, Tensor, OpOverload, DeviceMesh, ...)
# that shardviz reads. Their receivers are plain variables, so they are matched by name; a
# ``_get_*`` attribute (``mesh._get_root_mesh()``) counts too. ``self.x`` and ``cls.x`` do not.
PRIVATE_TORCH_ATTRIBUTES = frozenset(
    {
        "_base",
        "_cdata",
        "_coordinate_cache",
        "_flatten_rank_map",
        "_init_sharded_param",
        "_layout",
        "_local_ints",
        "_local_tensor",
        "_local_tensors",
        "_run_cond",
        "_runners",
        "_schema",
        "_sequence_nr",
        "_sharded_param_data",
        "_spec",
        "_split_factor_int",
        "_type",
        "_use_count",
        "_version",
    }
)


# A framework adapter reads its framework's objects (PhysicsNeMo's ShardTensor keeps ``_spec`` and
# ``_local_tensor``, names DTensor also has): those names are allowed in that one module, and the
# framework's other private names (``FRAMEWORK_PRIVATE``) are read there and nowhere else.
FRAMEWORK_ADAPTERS = {"shardviz/capture/adapters/physicsnemo.py": frozenset({"_spec", "_local_tensor"})}
FRAMEWORK_PRIVATE = {"shardviz/capture/adapters/physicsnemo.py": ("_sharding_shapes", "_shared_state")}
FRAMEWORKS = ("physicsnemo",)  # never imported by shardviz: adapters read sys.modules


@dataclass(frozen=True)
class Import:
    line: int
    module: str  # absolute dotted path of the module (or, for ``from m import n``, of ``m.n``)
    text: str  # the statement as written


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _module_name(rel: str) -> str:
    parts = rel.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_private(segment: str) -> bool:
    return segment.startswith("_") and not (segment.startswith("__") and segment.endswith("__"))


def _private_torch(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(_is_private(p) for p in parts[1:])


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _imports(tree: ast.Module, rel: str) -> Iterator[Import]:
    """Every import of the file, at any depth, with relative imports made absolute.
    ``from m import a`` gives ``m.a`` when ``a`` is a module of the package, else ``m`` itself
    (and ``m.a`` too for torch, to catch a private name: ``from torch.x import _Private``)."""
    name = _module_name(rel)
    package = name if rel.endswith("__init__.py") else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(node.lineno, alias.name, ast.unparse(node))
        elif isinstance(node, ast.ImportFrom):
            text = ast.unparse(node)
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                full = f"{module}.{alias.name}"
                if module.split(".")[0] == "torch":
                    yield Import(node.lineno, module, text)
                    yield Import(node.lineno, full, text)
                elif _source_file(full) is not None:
                    yield Import(node.lineno, full, text)
                else:
                    yield Import(node.lineno, module, text)


def _source_file(module: str) -> Path | None:
    """The file of a shardviz module (``shardviz.views`` → ``shardviz/views/__init__.py``)."""
    if module.split(".")[0] != "shardviz":
        return None
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _torch_names(tree: ast.Module) -> dict[str, str]:
    """Local names bound to torch modules or objects: ``torch``, ``dist`` → ``torch.distributed``."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    names[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("torch"):
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.expr) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _own_receiver(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _constant_str(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _private_attribute(name: str) -> bool:
    return name in PRIVATE_TORCH_ATTRIBUTES or name.startswith("_get_")


def private_torch_uses(source: str, rel: str, allowed: frozenset[str] = frozenset()) -> list[str]:
    """Where a module touches private torch: imports, ``torch._x`` / ``torch.ops._x`` chains
    (through any name bound to torch), private attributes of torch objects (also through
    ``getattr``), and ``importlib.import_module("torch._x")``. ``allowed``: attribute names the
    module reads on another framework's objects."""
    tree = ast.parse(source, filename=rel)
    found = []
    for imp in _imports(tree, rel):
        if _private_torch(imp.module):
            found.append(f"{rel}:{imp.line}: `{imp.text}` imports private torch `{imp.module}`")
    bound = _torch_names(tree)
    for node in ast.walk(tree):
        at = f"{rel}:{node.lineno}: `{ast.unparse(node)}`" if isinstance(node, ast.expr) else ""
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            chain = _dotted(node)
            if chain is not None and chain[0] in bound:
                found.append(f"{at} reaches private torch `{'.'.join([bound[chain[0]], *chain[1:]])}`")
            elif _private_attribute(node.attr) and not _own_receiver(node.value) and node.attr not in allowed:
                found.append(f"{at} reads the private torch attribute `{node.attr}`")
        elif isinstance(node, ast.Call) and node.args:
            func = ast.unparse(node.func)
            name = _constant_str(node.args[1]) if len(node.args) > 1 else None
            if func in ("getattr", "hasattr", "setattr", "delattr") and name and _private_attribute(name):
                found.append(f"{at} reads the private torch attribute `{name}`")
            module = _constant_str(node.args[0])
            importer = func in ("importlib.import_module", "import_module", "__import__")
            if importer and module and _private_torch(module):
                found.append(f"{at} imports private torch `{module}`")
    return found


def forbidden_imports(source: str, rel: str, forbidden: tuple[str, ...]) -> list[tuple[int, str, str]]:
    """(line, statement, module) of each import of a module under one of ``forbidden``."""
    tree = ast.parse(source, filename=rel)
    return [(i.line, i.text, i.module) for i in _imports(tree, rel) if _under(i.module, forbidden)]


# Modules allowed to read torch's frames: the gate, and the traceback explainer (whose whole job
# is recognising torch's frames by file, function and locals; test-compat runs it on new torch).
TORCH_LAYOUT_READERS = (TORCH_GATE, "shardviz/capture/explain.py")


def torch_layout_uses(source: str, rel: str) -> list[str]:
    """Reads of a frame's locals, and strings naming one of torch's private source files."""
    found = []
    for node in ast.walk(ast.parse(source, filename=rel)):
        if isinstance(node, ast.Attribute) and node.attr == "f_locals":
            found.append(f"{rel}:{node.lineno}: reads a frame's locals (`{ast.unparse(node)}`)")
        text = _constant_str(node) if isinstance(node, ast.expr) else None
        if text is not None and text.endswith(".py") and any(_is_private(p) for p in text.split("/")):
            found.append(f"{rel}:{node.lineno}: names torch's private file {text!r}")
    return found


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _fail(problems: list[str], rule: str) -> None:
    if problems:
        pytest.fail(f"{rule}:\n" + "\n".join(f"  {p}" for p in problems), pytrace=False)


# --- the rules ----------------------------------------------------------------------------------


def test_private_torch_only_in_the_gate():
    problems = []
    for path in _sources():
        rel = _rel(path)
        if not rel.startswith(TORCH_GATE):
            problems += private_torch_uses(_read(path), rel, FRAMEWORK_ADAPTERS.get(rel, frozenset()))
    _fail(
        problems,
        f"private torch is used outside {TORCH_GATE}; add a small named function there and call it",
    )


def test_frameworks_are_never_imported():
    problems = []
    for path in _sources():
        rel = _rel(path)
        for line, text, module in forbidden_imports(_read(path), rel, FRAMEWORKS):
            problems.append(f"{rel}:{line}: `{text}` imports `{module}`")
    _fail(problems, "shardviz imports a framework it adapts to; its adapter reads it from sys.modules")


def test_adapters_load_only_when_their_framework_does():
    adapters = {_module_name(rel) for rel in FRAMEWORK_ADAPTERS}
    problems = []
    for path in _sources():
        rel = _rel(path)
        for line, text, module in forbidden_imports(_read(path), rel, tuple(adapters)):
            if rel not in FRAMEWORK_ADAPTERS:
                problems.append(f"{rel}:{line}: `{text}` imports `{module}`")
    _fail(problems, "a framework adapter is imported directly; shardviz.capture.adapters loads it on demand")


def test_framework_privates_only_in_their_adapter():
    problems = []
    for path in _sources():
        rel = _rel(path)
        source = _read(path)
        for owner, names in FRAMEWORK_PRIVATE.items():
            if rel != owner:
                problems += [f"{rel}: reads `{n}` (only {owner} may)" for n in names if n in source]
    _fail(problems, "a framework's private attributes are read outside its adapter")


def test_torch_layout_only_in_the_gate():
    problems = []
    for path in _sources():
        rel = _rel(path)
        if not rel.startswith(TORCH_LAYOUT_READERS):
            problems.extend(torch_layout_uses(_read(path), rel))
    _fail(problems, "torch's frames and private files are read outside shardviz/capture/torch/")


@pytest.mark.parametrize(
    "source",
    [
        "def f(frame):\n    return frame.f_locals.get('current_spec')",
        "FILES = ('utils/_python_dispatch.py', 'overrides.py')",
        "import os\nX = os.path.join(TORCH_DIR, 'distributed', 'tensor', '_dispatch.py')",
    ],
)
def test_torch_layout_is_caught(source):
    assert torch_layout_uses(source, "shardviz/example.py") != []


def test_views_do_not_import_torch():
    problems = []
    for path in sorted((PACKAGE / "views").rglob("*.py")):
        rel = _rel(path)
        for line, text, module in forbidden_imports(_read(path), rel, NOT_FOR_VIEWS):
            problems.append(f"{rel}:{line}: `{text}` imports `{module}`")
    _fail(problems, "the views read plain data only, but import torch")


def test_plain_data_modules_stay_plain():
    problems: dict[tuple[str, int, str], str] = {}  # one per offending import, by its shortest chain
    for root in PLAIN_DATA:
        # Every shardviz module the plain-data module imports, at any depth, by the import chain.
        chains = {root: [root]}
        todo = [root]
        while todo:
            rel = todo.pop()
            tree = ast.parse(_read(ROOT / rel), filename=rel)
            for imp in _imports(tree, rel):
                via = " → ".join(chains[rel])
                if _under(imp.module, NOT_FOR_PLAIN_DATA):
                    key = (rel, imp.line, imp.module)
                    if key not in problems or len(chains[rel]) < problems[key].count("→") + 1:
                        problems[key] = f"{rel}:{imp.line}: `{imp.text}` imports `{imp.module}` (via {via})"
                    continue
                target = _source_file(imp.module)
                if target is None or imp.module == "shardviz":  # the package runs first anyway
                    continue
                trel = _rel(target)
                if trel not in chains:
                    chains[trel] = [*chains[rel], trel]
                    todo.append(trel)
    _fail(
        [problems[k] for k in sorted(problems)],
        "a plain-data module imports torch, the recorder, the backends or the views",
    )


def test_the_plain_data_list_is_current():
    for rel in (*PLAIN_DATA, TORCH_GATE):
        assert (ROOT / rel).exists(), f"{rel} is named by this test but does not exist"


# --- the checks catch what they are for ---------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "import torch._C",
        "import torch.distributed._local_tensor as lt",
        "from torch.distributed._local_tensor import LocalTensor",
        "from torch.distributed.tensor.placement_types import _StridedShard",
        "from torch.utils import _python_dispatch",
        "import torch\nx = torch.ops._c10d_functional.wait_tensor",
        "import torch\ntorch._C._current_graph_task_id()",
        "import torch.distributed as dist\ndist.distributed_c10d._resolve_process_group('g')",
        "def f(dt):\n    return dt._local_tensor",
        "def f(dt):\n    return dt._spec.placements",
        "def f(mesh):\n    return mesh._get_root_mesh()",
        "def f(op):\n    return getattr(op, '_schema', None)",
        "import importlib\nm = importlib.import_module('torch.distributed._local_tensor')",
    ],
)
def test_private_torch_is_caught(source):
    found = private_torch_uses(source, "shardviz/example.py")
    assert found, source
    assert found[0].startswith("shardviz/example.py:"), found


@pytest.mark.parametrize(
    "source",
    [
        "import torch\nprint(torch.__version__, torch.ops.aten.add.Tensor)",
        "import torch.distributed as dist\ndist.get_rank()",
        "from . import _torch\n_torch.local_of(x)",
        "import sys\nsys._getframe(1)",
        "class A:\n    def f(self):\n        return self._spec, super()._reserve()",
    ],
)
def test_public_torch_passes(source):
    assert private_torch_uses(source, "shardviz/example.py") == []


def test_forbidden_imports_are_found_at_any_depth():
    source = "def f():\n    import torch\n\nif TYPE_CHECKING:\n    from ..capture.recorder import Recorder\n"
    found = forbidden_imports(source, "shardviz/views/example.py", NOT_FOR_PLAIN_DATA)
    assert [(line, module) for line, _, module in found] == [(2, "torch"), (5, "shardviz.capture.recorder")]


def test_an_adapter_may_read_its_frameworks_attributes_and_nothing_more():
    adapter = "shardviz/capture/adapters/physicsnemo.py"
    allowed = FRAMEWORK_ADAPTERS[adapter]
    assert private_torch_uses("def f(st):\n    return st._spec, st._local_tensor", adapter, allowed) == []
    # torch's own privates stay the gate's, in the adapter too
    found = private_torch_uses("def f(dt):\n    return dt._local_tensor, dt._schema", adapter, allowed)
    assert found == [f"{adapter}:2: `dt._schema` reads the private torch attribute `_schema`"]
    assert private_torch_uses("def f(st):\n    return st._spec", "shardviz/show.py") != []
    imports = forbidden_imports("import physicsnemo.distributed\n", "shardviz/show.py", FRAMEWORKS)
    assert [module for _, _, module in imports] == ["physicsnemo.distributed"]
