"""The package's shape, read from its source (stdlib `ast`, nothing imported): imports point down the layers
below and never form a cycle, and no module touches another object's private members (a class is one file's
concept: what it keeps private, only its own methods reach).

Every import counts, also one inside a function (a lazy import is still a dependency); only imports under
`if TYPE_CHECKING:` (type hints) are exempt.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pagedjax", "pallas_kernels")

# The layers, top first: a module may import its own layer's modules and those of any layer below its own.
# Modules named in one tier (a tuple of several) are siblings and must not import each other.
LAYERS: list[tuple[str, ...]] = [
    ("pagedjax.__main__",),
    ("pagedjax.serve",),  # front ends: the server builds its engine with the CLI's set-up code
    ("pagedjax.cli",),
    ("pagedjax.engine",),  # the loop: one step path, output processing, beam search, data parallelism
    ("pagedjax.spec_decode", "pagedjax.lora"),  # engine features: proposers; adapters
    ("pagedjax.runner",),  # the device executor: every step's inputs, the compiled programs, weights
    ("pagedjax.model", "pagedjax.structured_output"),  # models, layers, loaders | grammar matchers and masks
    ("pagedjax.parallel",),  # SPMD: meshes, shardings, sharded attention
    ("pagedjax.device", "pagedjax.core"),  # pure JAX functions | host state without JAX
    ("pagedjax.sampling_params", "pagedjax.outputs"),  # what a caller asks | what it gets back
    ("pagedjax.config", "pagedjax.compile_cache"),  # every frozen config
    ("pagedjax.config.fields", "pagedjax.errors"),  # the field checks every config class uses | request errors
    ("pallas_kernels",),  # kernels: import nothing of pagedjax
]
# Names with a leading underscore that are public by their library's convention (namedtuple's API, os._exit).
PUBLIC_UNDERSCORED = frozenset({"_replace", "_asdict", "_fields", "_make", "_exit"})


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(module: str, path: Path) -> list[str]:
    """Absolute names of everything `module` imports (a `from X import y` gives X.y, which may be a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names.extend(f"{base}.{a.name}" for a in node.names)
            names.append(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (each import resolved to the longest module it names)."""
    sources = _sources()
    graph: dict[str, set[str]] = {}
    for module, path in sources.items():
        targets = set()
        for name in _imported_names(module, path):
            parts = name.split(".")
            while parts and ".".join(parts) not in sources:
                parts.pop()
            if parts and ".".join(parts) != module:
                targets.add(".".join(parts))
        graph[module] = targets
    return graph


def _tier(module: str) -> tuple[int, str]:
    """(layer index, the layer prefix) of a module: its longest matching prefix."""
    best = None
    for i, tier in enumerate(LAYERS):
        for prefix in tier:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[1]):
                    best = (i, prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add its package to LAYERS")
    return best


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in graph.items():
        if src in PACKAGES:  # a top-level package's __init__ re-exports (pagedjax's is lazy, by string)
            continue
        src_layer, src_prefix = _tier(src)
        for dst in sorted(targets):
            dst_layer, dst_prefix = _tier(dst)
            if dst_layer < src_layer:
                bad.append(f"{src} imports {dst}: {dst_prefix} is a layer above {src_prefix}")
            elif dst_layer == src_layer and dst_prefix != src_prefix:
                bad.append(f"{src} imports {dst}: siblings {src_prefix} and {dst_prefix} must not import each other")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_imports_point_down_the_layers():
    assert layer_violations(import_graph()) == []


def test_no_import_cycles():
    graph = import_graph()
    # A package's __init__ importing its own submodules is not a cycle through them: drop those edges.
    for module, targets in graph.items():
        if _sources()[module].name == "__init__.py":
            targets.difference_update({t for t in targets if t.startswith(module + ".")})
    assert cycles(graph) == []


def private_member_uses(source: str) -> list[tuple[int, str]]:
    """`(line, x._name)` for each `x._name` in `source` where x is not `self`, `cls` or `super()`: another object's
    private member."""
    uses = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        if node.attr in PUBLIC_UNDERSCORED:
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            continue
        uses.append((node.lineno, ast.unparse(node)))
    return uses


def test_no_module_touches_another_objects_private_members():
    found = [f"{p.relative_to(ROOT)}:{line}: {use}" for p in _sources().values()
             for line, use in private_member_uses(p.read_text())]
    assert found == []


def test_the_private_member_check_sees_another_objects_members():
    source = "class A:\n    def f(self, other):\n        self._x = super()._z\n        return other._y._replace(a=1)\n"
    assert private_member_uses(source) == [(4, "other._y")]


def async_engine_reach_throughs(source: str) -> list[tuple[int, str]]:
    """`(line, expression)` for each `engine.engine` / `x.engine.engine` in `source`: the `LLMEngine` behind an
    `AsyncLLMEngine`, reached around it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "engine" and (
                (isinstance(node.value, ast.Name) and node.value.id == "engine")
                or (isinstance(node.value, ast.Attribute) and node.value.attr == "engine")):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_server_reaches_the_engine_only_through_the_async_engine():
    """`AsyncLLMEngine` is the server's only door to the engine (its public attributes and methods): no module of
    `pagedjax.serve` but `async_engine` reaches through it to the `LLMEngine` (it did at six sites)."""
    serve = ROOT / "pagedjax" / "serve"
    found = [f"{p.relative_to(ROOT)}:{line}: {use}" for p in sorted(serve.glob("*.py")) if p.name != "async_engine.py"
             for line, use in async_engine_reach_throughs(p.read_text())]
    assert found == []


def test_the_reach_through_check_sees_both_spellings():
    source = "def f(self, engine):\n    a = engine.engine.tokenizer\n    return self.engine.engine, self.engine.x\n"
    assert async_engine_reach_throughs(source) == [(2, "engine.engine"), (3, "self.engine.engine")]


@pytest.mark.parametrize("graph,expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert cycles(graph) == expected


def test_the_layer_check_catches_an_upward_and_a_sibling_import():
    graph = {"pagedjax.core.request": {"pagedjax.engine.llm_engine", "pagedjax.device.kv_cache",
                                       "pagedjax.config"}}
    assert layer_violations(graph) == [
        "pagedjax.core.request imports pagedjax.device.kv_cache: siblings pagedjax.core and pagedjax.device must "
        "not import each other",
        "pagedjax.core.request imports pagedjax.engine.llm_engine: pagedjax.engine is a layer above pagedjax.core"]


def test_imports_inside_functions_count_and_type_checking_ones_do_not(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pagedjax.engine import X\n"
                   "def f():\n    from pagedjax.serve import app\n")
    names = _imported_names("pagedjax.core.m", src)
    assert "pagedjax.serve.app" in names and not any(n.startswith("pagedjax.engine") for n in names)
