"""Architecture rules, checked on the source: every module of the package is parsed, none imported.

The package lies in layers, one folder each (``docs/reference/architecture.md``):

    examples/                      user code: may import anything
    front ends (shardviz/*.py)     the public API: may import every layer below and views/
    backends/                      may import capture/, data/, geometry/
    capture/                       may import data/, geometry/
    data/                          may import geometry/
    geometry/                      may import nothing above it
    views/                         may import data/ and geometry/ only
    errors.py, _version.py         importable by all, importing nothing of shardviz

Every layer may import itself, ``errors.py`` and ``_version.py``. The rules, on the file-level
import graph (imports anywhere count: at the top, in a function, under ``if TYPE_CHECKING:``,
``importlib.import_module`` with a constant name; importing ``a.b`` does not count as importing
``a/__init__.py``, which Python runs first anyway):

1. No import goes from a layer to one it may not import.
2. No circle between files.
3. Nothing under ``views/``, ``geometry/`` or ``data/`` reaches torch, directly or through any
   shardviz module it imports at any depth: a saved trace, a model map and a picture read the same
   on a machine without torch's internals, and a view never waits on torch's import.
4. Private torch (a ``torch`` module path or name with a segment starting with ``_``, the private
   attributes of torch objects that shardviz reads) is touched under ``shardviz/capture/torch/`` only,
   so that a torch release that moves one breaks one place with a message naming it.
5. Torch's internal layout (its frames' locals, its private source files by name) is read under
   ``shardviz/capture/torch/`` and, for tracebacks it explains, ``shardviz/capture/explain.py`` only.

Each checker takes a tree of sources (path -> text), so the tests below run it on the package and
on small planted trees that break one rule each.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "shardviz"

Sources = Mapping[str, str]  # "shardviz/data/trace.py" -> its text

# --- layers -------------------------------------------------------------------------------------

BASE = "errors.py/_version.py"
FRONT = "front ends"
BASE_FILES = ("shardviz/errors.py", "shardviz/_version.py")
FOLDERS = ("examples", "backends", "capture", "data", "geometry", "views")

# Which layers each layer may import (itself included where it may).
ALLOWED: dict[str, frozenset[str]] = {
    "examples": frozenset({"examples", FRONT, "backends", "capture", "data", "geometry", "views", BASE}),
    FRONT: frozenset({FRONT, "backends", "capture", "data", "geometry", "views", BASE}),
    "backends": frozenset({"backends", "capture", "data", "geometry", BASE}),
    "capture": frozenset({"capture", "data", "geometry", BASE}),
    "data": frozenset({"data", "geometry", BASE}),
    "geometry": frozenset({"geometry", BASE}),
    "views": frozenset({"views", "data", "geometry", BASE}),
    BASE: frozenset(),
}
TORCH_FREE = ("views", "geometry", "data")

# The one folder allowed to touch private torch.
TORCH_GATE = "shardviz/capture/torch/"

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
FRAMEWORK_ADAPTERS = {
    "shardviz/capture/adapters/physicsnemo.py": frozenset({"_spec", "_local_tensor"}),
    "shardviz/capture/adapters/accelerate.py": frozenset(),
    "shardviz/capture/adapters/transformers.py": frozenset(),
}
FRAMEWORK_PRIVATE = {
    "shardviz/capture/adapters/physicsnemo.py": ("_sharding_shapes", "_shared_state"),
    "shardviz/capture/adapters/accelerate.py": ("_shared_state",),  # accelerate's Borg singletons
}
FRAMEWORKS = ("physicsnemo", "accelerate", "transformers")  # never imported: adapters read sys.modules

IMPORTERS = ("importlib.import_module", "import_module", "__import__")


def layer_of(rel: str) -> str | None:
    """The layer of a file of the package, or None for a folder no layer owns."""
    parts = rel.split("/")
    if len(parts) == 2:
        return BASE if rel in BASE_FILES else FRONT
    return parts[1] if parts[1] in FOLDERS else None


def _under_gate(rel: str) -> bool:
    return rel.startswith(TORCH_GATE)


@dataclass(frozen=True)
class Import:
    line: int
    module: str  # absolute dotted path of the module (or, for ``from m import n``, of ``m.n``)
    text: str  # the statement as written


@dataclass(frozen=True)
class Edge:
    source: str  # the importing file
    line: int
    text: str
    target: str  # the imported file of the package

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: `{self.text}` imports {self.target}"


def _module_name(rel: str) -> str:
    parts = rel.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _is_private(segment: str) -> bool:
    return segment.startswith("_") and not (segment.startswith("__") and segment.endswith("__"))


def _private_torch(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(_is_private(p) for p in parts[1:])


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _source_file(module: str, files: Sources | None = None) -> str | None:
    """The file of a shardviz module (``shardviz.views`` → ``shardviz/views/__init__.py``), looked up
    in ``files`` (a planted tree) or on disk."""
    if module.split(".")[0] != "shardviz":
        return None
    base = "/".join(module.split("."))
    for candidate in (f"{base}.py", f"{base}/__init__.py"):
        if candidate in files if files is not None else (ROOT / candidate).is_file():
            return candidate
    return None


def _absolute(name: str, level: int, package: str) -> str:
    if not level:
        return name
    base = package.split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _constant_str(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _imports(tree: ast.Module, rel: str, files: Sources | None = None) -> Iterator[Import]:
    """Every import of the file, at any depth, with relative imports made absolute.
    ``from m import a`` gives ``m.a`` when ``a`` is a module of the package, else ``m`` itself
    (and ``m.a`` too for torch, to catch a private name: ``from torch.x import _Private``).
    ``importlib.import_module("m")`` with a constant name gives ``m``."""
    name = _module_name(rel)
    package = name if rel.endswith("__init__.py") else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(node.lineno, alias.name, ast.unparse(node))
        elif isinstance(node, ast.ImportFrom):
            text = ast.unparse(node)
            module = _absolute(node.module or "", node.level, package)
            for alias in node.names:
                full = f"{module}.{alias.name}"
                if module.split(".")[0] == "torch":
                    yield Import(node.lineno, module, text)
                    yield Import(node.lineno, full, text)
                elif _source_file(full, files) is not None:
                    yield Import(node.lineno, full, text)
                else:
                    yield Import(node.lineno, module, text)
        elif isinstance(node, ast.Call) and node.args and ast.unparse(node.func) in IMPORTERS:
            target = _constant_str(node.args[0])
            if target:
                level = len(target) - len(target.lstrip("."))
                yield Import(node.lineno, _absolute(target.lstrip("."), level, package), ast.unparse(node))


# --- the import graph ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Graph:
    edges: dict[str, list[Edge]]  # file -> its imports of package files (self-imports left out)
    torch: dict[str, Import]  # file -> its first import of torch, for files that import torch


def import_graph(files: Sources) -> Graph:
    edges: dict[str, list[Edge]] = {}
    torch: dict[str, Import] = {}
    for rel in sorted(files):
        tree = ast.parse(files[rel], filename=rel)
        out = edges.setdefault(rel, [])
        for imp in _imports(tree, rel, files):
            if imp.module.split(".")[0] == "torch":
                if rel not in torch or imp.line < torch[rel].line:
                    torch[rel] = imp
                continue
            target = _source_file(_deepest_module(imp.module, files), files)
            if target is not None and target != rel:
                edge = Edge(rel, imp.line, imp.text, target)
                if edge not in out:
                    out.append(edge)
    return Graph(edges, torch)


def _deepest_module(module: str, files: Sources) -> str:
    """``import shardviz.a.b`` imports the deepest of ``shardviz.a.b``, ``shardviz.a``, ... that exists."""
    parts = module.split(".")
    while len(parts) > 1 and _source_file(".".join(parts), files) is None:
        parts.pop()
    return ".".join(parts)


def layer_violations(graph: Graph) -> list[str]:
    problems = []
    for rel, edges in graph.edges.items():
        layer = layer_of(rel)
        if layer is None:
            problems.append(
                f"{rel}: lies in no layer; put it in one of {', '.join(FOLDERS)} (or name its folder here)"
            )
            continue
        for edge in edges:
            target = layer_of(edge.target)
            if target is not None and target not in ALLOWED[layer]:
                may = ", ".join(sorted(ALLOWED[layer])) or "nothing of shardviz"
                problems.append(f"{edge}: {layer} imports {target} (it may import {may})")
    return problems


def cycles(graph: Graph) -> list[list[Edge]]:
    """One circle of imports for each group of files that import each other (Tarjan's components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:  # recursion depth is bounded by the package's file count
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for edge in graph.edges.get(node, []):
            if edge.target not in index:
                visit(edge.target)
                low[node] = min(low[node], low[edge.target])
            elif edge.target in on_stack:
                low[node] = min(low[node], index[edge.target])
        if low[node] == index[node]:
            component = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.add(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph.edges):
        if node not in index:
            visit(node)
    return [_shortest_cycle(graph, sorted(c)[0], c) for c in sorted(components, key=min)]


def _shortest_cycle(graph: Graph, start: str, within: set[str]) -> list[Edge]:
    paths: dict[str, list[Edge]] = {start: []}
    todo = [start]
    while todo:
        node = todo.pop(0)
        for edge in graph.edges.get(node, []):
            if edge.target == start:
                return [*paths[node], edge]
            if edge.target in within and edge.target not in paths:
                paths[edge.target] = [*paths[node], edge]
                todo.append(edge.target)
    raise AssertionError(f"{start} is in a component but on no circle")


def cycle_violations(graph: Graph) -> list[str]:
    problems = []
    for cycle in cycles(graph):
        files = " → ".join([e.source for e in cycle] + [cycle[0].source])
        problems.append(f"circle {files}:\n" + "\n".join(f"      {e}" for e in cycle))
    return problems


def torch_chain(graph: Graph, start: str) -> list[Edge] | None:
    """The shortest chain of imports from ``start`` to a file that imports torch, if any."""
    paths: dict[str, list[Edge]] = {start: []}
    todo = [start]
    while todo:
        node = todo.pop(0)
        if node in graph.torch:
            return paths[node]
        for edge in graph.edges.get(node, []):
            if edge.target not in paths:
                paths[edge.target] = [*paths[node], edge]
                todo.append(edge.target)
    return None


def torch_reach_violations(graph: Graph) -> list[str]:
    problems = []
    for rel in graph.edges:
        if layer_of(rel) not in TORCH_FREE:
            continue
        chain = torch_chain(graph, rel)
        if chain is not None:
            last = chain[-1].target if chain else rel
            imp = graph.torch[last]
            steps = [str(e) for e in chain] + [f"{last}:{imp.line}: `{imp.text}` imports {imp.module}"]
            problems.append(f"{rel} reaches torch:\n" + "\n".join(f"      {s}" for s in steps))
    return problems


# --- private torch ------------------------------------------------------------------------------


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


def _private_attribute(name: str) -> bool:
    return name in PRIVATE_TORCH_ATTRIBUTES or name.startswith("_get_")


def private_torch_uses(source: str, rel: str, allowed: frozenset[str] = frozenset()) -> list[str]:
    """Where a module touches private torch: imports (``importlib.import_module("torch._x")`` too),
    ``torch._x`` / ``torch.ops._x`` chains (through any name bound to torch), and private attributes
    of torch objects (also through ``getattr``). ``allowed``: attribute names the module reads on
    another framework's objects."""
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
        elif isinstance(node, ast.Call) and len(node.args) > 1:
            func = ast.unparse(node.func)
            name = _constant_str(node.args[1])
            if func in ("getattr", "hasattr", "setattr", "delattr") and name and _private_attribute(name):
                found.append(f"{at} reads the private torch attribute `{name}`")
    return found


def private_torch_violations(files: Sources) -> list[str]:
    problems = []
    for rel in sorted(files):
        if not _under_gate(rel):
            problems += private_torch_uses(files[rel], rel, FRAMEWORK_ADAPTERS.get(rel, frozenset()))
    return problems


def forbidden_imports(source: str, rel: str, forbidden: tuple[str, ...]) -> list[tuple[int, str, str]]:
    """(line, statement, module) of each import of a module under one of ``forbidden``."""
    tree = ast.parse(source, filename=rel)
    return [(i.line, i.text, i.module) for i in _imports(tree, rel) if _under(i.module, forbidden)]


# The traceback explainer may read torch's frames too: its whole job is recognising torch's frames
# by file, function and locals (test-compat runs it on new torch).
TORCH_LAYOUT_READERS = ("shardviz/capture/explain.py",)


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


def _package() -> dict[str, str]:
    paths = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
    return {_rel(p): p.read_text(encoding="utf-8") for p in paths}


def _fail(problems: list[str], rule: str) -> None:
    if problems:
        pytest.fail(f"{rule}:\n" + "\n".join(f"  {p}" for p in problems), pytrace=False)


LAYER_RULE = (
    "an import goes against the layers (docs/reference/architecture.md); move the code or pass plain "
    "data down"
)
CYCLE_RULE = "files import each other in a circle; move what both need into a lower module"
TORCH_RULE = (
    "views/, geometry/ and data/ must not reach torch, even through another module; "
    "convert torch objects to plain data in capture/ and hand that down"
)
PRIVATE_RULE = f"private torch is used outside {TORCH_GATE}; add a small named function there and call it"


# --- the rules, on the package ------------------------------------------------------------------


@pytest.fixture(scope="module")
def package() -> dict[str, str]:
    return _package()


@pytest.fixture(scope="module")
def graph(package: dict[str, str]) -> Graph:
    return import_graph(package)


def test_every_file_lies_in_a_layer(package):
    assert set(ALLOWED) == {*FOLDERS, FRONT, BASE}
    _fail([rel for rel in package if layer_of(rel) is None], f"files outside the layers {FOLDERS}")
    assert (PACKAGE / "capture" / "torch").is_dir() and all((PACKAGE / f).is_dir() for f in FOLDERS)


def test_imports_go_down_the_layers(graph):
    _fail(layer_violations(graph), LAYER_RULE)


def test_no_circle_between_files(graph):
    _fail(cycle_violations(graph), CYCLE_RULE)


def test_views_geometry_and_data_never_reach_torch(graph):
    _fail(torch_reach_violations(graph), TORCH_RULE)


def test_private_torch_only_in_the_gate(package):
    _fail(private_torch_violations(package), PRIVATE_RULE)


def test_frameworks_are_never_imported(package):
    problems = []
    for rel, source in package.items():
        for line, text, module in forbidden_imports(source, rel, FRAMEWORKS):
            problems.append(f"{rel}:{line}: `{text}` imports `{module}`")
    _fail(problems, "shardviz imports a framework it adapts to; its adapter reads it from sys.modules")


def test_adapters_load_only_when_their_framework_does(package):
    adapters = {_module_name(rel) for rel in FRAMEWORK_ADAPTERS}
    problems = []
    for rel, source in package.items():
        for line, text, module in forbidden_imports(source, rel, tuple(adapters)):
            if rel not in FRAMEWORK_ADAPTERS:
                problems.append(f"{rel}:{line}: `{text}` imports `{module}`")
    _fail(problems, "a framework adapter is imported directly; shardviz.capture.adapters loads it on demand")


def test_framework_privates_only_in_their_adapter(package):
    problems = []
    for rel, source in package.items():
        for owner, names in FRAMEWORK_PRIVATE.items():
            if rel != owner:
                problems += [
                    f"{rel}: reads `{n}` (only {owner} may)"
                    for n in names
                    if n in source and rel not in [o for o, ns in FRAMEWORK_PRIVATE.items() if n in ns]
                ]
    _fail(problems, "a framework's private attributes are read outside its adapter")


def test_torch_layout_only_in_the_gate(package):
    problems = []
    for rel, source in package.items():
        if not _under_gate(rel) and rel not in TORCH_LAYOUT_READERS:
            problems.extend(torch_layout_uses(source, rel))
    _fail(problems, f"torch's frames and private files are read outside {TORCH_GATE}")


def test_the_named_files_exist(package):
    for rel in (*BASE_FILES, *TORCH_LAYOUT_READERS, *FRAMEWORK_ADAPTERS):
        assert rel in package, f"{rel} is named by this test but does not exist"
    assert any(_under_gate(rel) for rel in package), f"{TORCH_GATE} is named by this test but holds no module"


# --- the checks catch what they are for: planted trees -----------------------------------------


def _messages(problems: list[str]) -> str:
    return "\n".join(problems)


def test_an_upward_import_is_caught():
    tree = {
        "shardviz/data/trace.py": "from ..backends.session import current\n",
        "shardviz/backends/session.py": "from ..data import events\n",
        "shardviz/data/events.py": "X = 1\n",
        "shardviz/data/__init__.py": "",
        "shardviz/backends/__init__.py": "",
    }
    problems = layer_violations(import_graph(tree))
    assert problems == [
        "shardviz/data/trace.py:1: `from ..backends.session import current` imports "
        "shardviz/backends/session.py: data imports backends "
        "(it may import data, errors.py/_version.py, geometry)"
    ]


def test_a_lazy_or_type_checking_import_counts():
    tree = {
        "shardviz/geometry/mesh.py": "def f():\n    from ..views import widgets\n",
        "shardviz/views/widgets.py": "",
        "shardviz/capture/job.py": "if TYPE_CHECKING:\n    from shardviz.show import show\n",
        "shardviz/show.py": "",
        "shardviz/errors.py": "import shardviz._version\n",
        "shardviz/_version.py": "",
    }
    problems = _messages(layer_violations(import_graph(tree)))
    assert (
        "shardviz/geometry/mesh.py:2: `from ..views import widgets` imports shardviz/views/widgets.py"
        in problems
    )
    assert "shardviz/capture/job.py:2: `from shardviz.show import show` imports shardviz/show.py" in problems
    assert "capture imports front ends" in problems
    assert "shardviz/errors.py:1: `import shardviz._version` imports shardviz/_version.py" in problems
    assert (
        "errors.py/_version.py imports errors.py/_version.py (it may import nothing of shardviz)" in problems
    )


def test_a_view_importing_a_front_end_or_a_backend_is_caught():
    tree = {
        "shardviz/views/player.py": "from .. import show\nimport shardviz.backends.session\n",
        "shardviz/show.py": "from .views import player\n",
        "shardviz/backends/session.py": "",
    }
    problems = _messages(layer_violations(import_graph(tree)))
    assert (
        "shardviz/views/player.py:1: `from .. import show` imports shardviz/show.py: views imports front ends"
        in problems
    )
    assert "views imports backends" in problems
    assert "shardviz/show.py" not in problems.replace(
        "imports shardviz/show.py", ""
    )  # front -> views is fine


def test_a_file_outside_the_layers_is_caught():
    problems = layer_violations(import_graph({"shardviz/misc/tools.py": "import os\n"}))
    assert problems == [
        "shardviz/misc/tools.py: lies in no layer; put it in one of "
        "examples, backends, capture, data, geometry, views (or name its folder here)"
    ]


def test_a_three_file_circle_is_caught_and_printed():
    tree = {
        "shardviz/data/a.py": "from . import b\n",
        "shardviz/data/b.py": "def f():\n    from .c import g\n",
        "shardviz/data/c.py": "if TYPE_CHECKING:\n    import shardviz.data.a\n",
        "shardviz/data/d.py": "from . import a\n",  # imports the circle but is not on it
    }
    graph = import_graph(tree)
    assert layer_violations(graph) == []
    problems = cycle_violations(graph)
    assert len(problems) == 1
    head, *lines = problems[0].splitlines()
    assert head == "circle shardviz/data/a.py → shardviz/data/b.py → shardviz/data/c.py → shardviz/data/a.py:"
    assert [line.strip() for line in lines] == [
        "shardviz/data/a.py:1: `from . import b` imports shardviz/data/b.py",
        "shardviz/data/b.py:2: `from .c import g` imports shardviz/data/c.py",
        "shardviz/data/c.py:2: `import shardviz.data.a` imports shardviz/data/a.py",
    ]


def test_a_package_importing_itself_is_no_circle():
    tree = {
        "shardviz/data/__init__.py": "from . import x\nfrom .trace import T\n",
        "shardviz/data/trace.py": "",
    }
    assert cycle_violations(import_graph(tree)) == []


def test_a_view_reaching_torch_through_a_lazy_import_is_caught():
    tree = {
        "shardviz/views/mpl.py": "from ..data.cost import summary\n",
        "shardviz/data/cost.py": "from .load import read\n",
        "shardviz/data/load.py": "def read(path):\n    import torch\n    return torch.load(path)\n",
        "shardviz/geometry/mesh.py": "import numpy\n",
    }
    problems = torch_reach_violations(import_graph(tree))
    assert problems[0].splitlines() == [
        "shardviz/data/cost.py reaches torch:",
        "      shardviz/data/cost.py:1: `from .load import read` imports shardviz/data/load.py",
        "      shardviz/data/load.py:2: `import torch` imports torch",
    ]
    assert problems[2].splitlines() == [
        "shardviz/views/mpl.py reaches torch:",
        "      shardviz/views/mpl.py:1: `from ..data.cost import summary` imports shardviz/data/cost.py",
        "      shardviz/data/cost.py:1: `from .load import read` imports shardviz/data/load.py",
        "      shardviz/data/load.py:2: `import torch` imports torch",
    ]
    assert len(problems) == 3  # cost, load, mpl; not the torch-free mesh
    assert "shardviz/data/load.py reaches torch:" in problems[1]


def test_a_view_reaching_torch_through_importlib_is_caught():
    tree = {
        "shardviz/views/html.py": "import importlib\nm = importlib.import_module('shardviz.data.raw')\n",
        "shardviz/data/raw.py": "if TYPE_CHECKING:\n    from torch import Tensor\n",
    }
    problems = torch_reach_violations(import_graph(tree))
    assert any(p.startswith("shardviz/views/html.py reaches torch:") for p in problems), problems
    assert "shardviz/data/raw.py:2: `from torch import Tensor` imports torch" in _messages(problems)


def test_capture_and_backends_may_import_torch():
    tree = {
        "shardviz/capture/layouts.py": "import torch\n",
        "shardviz/backends/local.py": "from ..capture import layouts\n",
    }
    graph = import_graph(tree)
    assert torch_reach_violations(graph) == [] and layer_violations(graph) == []


def test_private_torch_in_backends_is_caught():
    tree = {
        "shardviz/backends/local.py": "from torch.distributed._local_tensor import LocalTensorMode\n",
        "shardviz/backends/rank.py": "def f(dt):\n    return dt._local_tensor\n",
        "shardviz/capture/torch/local.py": "from torch.distributed._local_tensor import LocalTensorMode\n",
        "shardviz/capture/torch/__init__.py": "import torch\nx = torch._C\n",
    }
    assert private_torch_violations(tree) == [
        "shardviz/backends/local.py:1: `from torch.distributed._local_tensor import LocalTensorMode` "
        "imports private torch `torch.distributed._local_tensor`",
        "shardviz/backends/local.py:1: `from torch.distributed._local_tensor import LocalTensorMode` "
        "imports private torch `torch.distributed._local_tensor.LocalTensorMode`",
        "shardviz/backends/rank.py:2: `dt._local_tensor` reads the private torch attribute `_local_tensor`",
    ]


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
