"""The package's shape, read from its source (stdlib `ast`, nothing imported): imports point down the layers
below and never form a cycle, and no module touches another object's private members (a class is one file's
concept: what it keeps private, only its own methods reach).

Every import counts, also one inside a function (a lazy import is still a dependency); imports under
`if TYPE_CHECKING:` (type hints) are exempt from the layers, not from the cycles: a module that names another's
type while that one imports it is one concept in two files.
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
    ("pagedjax.serve", "pagedjax.integrations"),  # front ends: the server (its engine built with the CLI's set-up
    # code) | other frameworks' interfaces over the engine (Tunix's rollout)
    ("pagedjax.cli",),
    ("pagedjax.engine",),  # the loop: one step path, output processing, beam search, data parallelism
    ("pagedjax.spec_decode", "pagedjax.lora"),  # engine features: proposers; adapters
    ("pagedjax.runner",),  # the device executor: every step's inputs, the compiled programs, weights
    ("pagedjax.model", "pagedjax.structured_output"),  # models, layers, loaders | grammar matchers and masks
    ("pagedjax.parallel",),  # SPMD: meshes, shardings, sharded attention
    ("pagedjax.device", "pagedjax.core"),  # pure JAX functions | host state without JAX
    ("pagedjax.sampling_params", "pagedjax.pooling_params", "pagedjax.outputs"),  # what a caller asks | it gets back
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


def _imported_names(module: str, path: Path, *, type_checking: bool = False) -> list[str]:
    """Absolute names of everything `module` imports (a `from X import y` gives X.y, which may be a module); those
    under `if TYPE_CHECKING:` only with `type_checking`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
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


def import_graph(*, type_checking: bool = False) -> dict[str, set[str]]:
    """module -> the project modules it imports (each import resolved to the longest module it names; type-hint
    imports with `type_checking`)."""
    sources = _sources()
    graph: dict[str, set[str]] = {}
    for module, path in sources.items():
        targets = set()
        for name in _imported_names(module, path, type_checking=type_checking):
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
    graph = import_graph(type_checking=True)
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
    assert "pagedjax.engine.X" in _imported_names("pagedjax.core.m", src, type_checking=True)  # for the cycles


# ------------------------------------------------------------------------------- errors: types, never text
# The server maps a refusal by its type and fields (`pagedjax.errors`: `param`, `code`), never by its message: a
# message reworded must not change the status or the field a client sees. What counts as an error's text: `str(e)`,
# `repr(e)`, `format(e)`, an f-string of `e`, and `e.args`, `e.message`, `e.msg`, `e.reason`, `e.detail`, for `e`
# bound by an `except ... as e`; a name assigned from such text; a parameter of a function (of the scanned modules)
# some call passes such text to. Matching it: `in` / `not in` / `==` / `!=`, `.startswith`, `.split`, ... (the
# methods below) or a `re` function. Rewording it (`.replace`, an f-string) is allowed.
TEXT_ATTRS = frozenset({"args", "message", "msg", "reason", "detail"})
MATCHING_METHODS = frozenset({"startswith", "endswith", "find", "rfind", "index", "rindex", "count", "split",
                              "rsplit", "partition", "rpartition", "removeprefix", "removesuffix"})
MATCHING_OPS = (ast.In, ast.NotIn, ast.Eq, ast.NotEq)


def _scopes(tree: ast.Module) -> list[ast.AST]:
    """The module and each function in it."""
    return [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))]


def _own_nodes(scope: ast.AST) -> list[ast.AST]:
    """The nodes of `scope` (a module or a function), not those of the functions inside it (scopes of their own)."""
    nodes, todo = [], list(ast.iter_child_nodes(scope))
    while todo:
        n = todo.pop()
        nodes.append(n)
        if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            todo.extend(ast.iter_child_nodes(n))
    return nodes


def _params(fn: ast.AST) -> list[str]:
    if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
        return []
    a = fn.args
    return [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]]


def _texts(scope: ast.AST, tainted_params: set[str]) -> tuple[set[str], set[str]]:
    """(names bound to caught exceptions, names holding an error's text) in `scope`."""
    nodes = _own_nodes(scope)
    errors = {n.name for n in nodes if isinstance(n, ast.ExceptHandler) and n.name}
    texts = set(tainted_params)
    while True:
        before = len(texts)
        for n in nodes:
            if isinstance(n, ast.Assign | ast.AnnAssign | ast.AugAssign | ast.NamedExpr | ast.For):
                value = n.iter if isinstance(n, ast.For) else n.value
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                if value is not None and _is_text(value, errors, texts):
                    texts.update(t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name))
        if len(texts) == before:
            return errors, texts


def _is_text(node: ast.AST, errors: set[str], texts: set[str]) -> bool:
    """Whether `node` holds an error's text (see above)."""
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id in texts:
            return True
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("str", "repr", "format")
                and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id in errors):
            return True
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in errors \
                and n.attr in TEXT_ATTRS:
            return True
        if isinstance(n, ast.FormattedValue) and isinstance(n.value, ast.Name) and n.value.id in errors:
            return True
    return False


def _called_name(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def error_text_matches(sources: dict[str, str]) -> list[str]:
    """`path:line: code` for each place in `sources` (path -> source) that matches an error's text (see above)."""
    trees = {path: ast.parse(source) for path, source in sources.items()}
    functions: dict[str, list[ast.AST]] = {}
    for tree in trees.values():
        for scope in _scopes(tree)[1:]:
            functions.setdefault(scope.name, []).append(scope)
    tainted: dict[int, set[str]] = {}  # id(function) -> its parameters that some call passes an error's text
    while True:  # until no call taints another parameter
        changed = False
        for tree in trees.values():
            for scope in _scopes(tree):
                errors, texts = _texts(scope, tainted.get(id(scope), set()))
                for call in (n for n in _own_nodes(scope) if isinstance(n, ast.Call)):
                    for fn in functions.get(_called_name(call), ()):
                        params = _params(fn)
                        if isinstance(call.func, ast.Attribute) and params[:1] in (["self"], ["cls"]):
                            params = params[1:]
                        given = [(p, a) for p, a in zip(params, call.args, strict=False)]
                        given += [(k.arg, k.value) for k in call.keywords if k.arg in params]
                        for p, arg in given:
                            if _is_text(arg, errors, texts) and p not in tainted.setdefault(id(fn), set()):
                                tainted[id(fn)].add(p)
                                changed = True
        if not changed:
            break
    found = set()
    for path, tree in trees.items():
        for scope in _scopes(tree):
            errors, texts = _texts(scope, tainted.get(id(scope), set()))
            for n in _own_nodes(scope):
                if isinstance(n, ast.Compare) and any(isinstance(op, MATCHING_OPS) for op in n.ops):
                    hit = any(_is_text(x, errors, texts) for x in [n.left, *n.comparators])
                elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                    f = n.func
                    hit = ((f.attr in MATCHING_METHODS and _is_text(f.value, errors, texts))
                           or (isinstance(f.value, ast.Name) and f.value.id == "re"
                               and any(_is_text(a, errors, texts) for a in n.args)))
                else:
                    hit = False
                if hit:
                    found.add((path, n.lineno, ast.unparse(n)))
    return [f"{path}:{line}: {code}" for path, line, code in sorted(found)]


def test_the_server_maps_error_types_never_their_text():
    serve = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "pagedjax" / "serve").rglob("*.py"))}
    found = error_text_matches(serve)
    assert found == [], ("these match an exception's message text; raise a typed error (pagedjax.errors: "
                         "InvalidRequest and its kinds, with param and code) and map its type instead:\n"
                         + "\n".join(found))


OLD_SERVING = '''
def engine_error_param(message):
    for says, param in (("stop_token_ids", "stop_token_ids"), ("prompt", "prompt")):
        if says in message:
            return param
    return None


async def start(self, prepared):
    try:
        return await self.engine.add_request(prepared.prompt_token_ids)
    except (TypeError, ValueError) as e:
        message = str(e).replace("request: ", "")
        if message.startswith("SamplingParams.structured"):
            raise bad_request(f"x: {message.split(': ', 1)[-1]}", "x") from None
        raise bad_request(message, engine_error_param(message)) from None


def sampling_params(fields):
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        param = next((n for n in fields if f"SamplingParams.{n} " in str(e)), None)
        raise APIError(400, str(e), param=param) from None
'''


def test_the_text_check_catches_the_old_servers_lookups():
    """The lookups the server used to recover a refusal's field from its message (issue 54): every one is caught,
    also the one in a function the message is passed to; rewording a message is not."""
    found = error_text_matches({"old.py": OLD_SERVING})
    assert [line.split(": ", 1)[1] for line in found] == [
        "says in message",
        "message.startswith('SamplingParams.structured')",
        "message.split(': ', 1)",
        "f'SamplingParams.{n} ' in str(e)",
    ]
    reworded = "try:\n    f()\nexcept ValueError as e:\n    m = str(e).replace('a', 'b')\n    raise X(f'{m}: {e}')\n"
    typed = "try:\n    f()\nexcept InvalidRequest as e:\n    if e.param == 'structured':\n        raise X(e.code)\n"
    assert error_text_matches({"a.py": reworded, "b.py": typed}) == []
