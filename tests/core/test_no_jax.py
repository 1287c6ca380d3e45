"""pagedjax.core is plain Python + numpy: no module in it imports JAX (or anything built on it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pagedjax.core

FORBIDDEN = ("jax", "jaxlib", "flax", "optax", "orbax", "pagedjax.device", "pagedjax.model", "pagedjax.engine",
             "pallas_kernels")


def test_core_imports_no_jax():
    core = Path(pagedjax.core.__file__).parent
    files = sorted(core.glob("*.py"))
    assert files
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert not any(name == f or name.startswith(f + ".") for f in FORBIDDEN), f"{path.name}: {name}"
