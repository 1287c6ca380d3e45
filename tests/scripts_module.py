"""A script of `scripts/` imported as a module, for the tests that call its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str, monkeypatch=None):
    """`scripts/<name>.py` as the module `name`, registered in `sys.modules` (dataclasses and pickling look their
    module up there): for the test's duration with pytest's `monkeypatch`, else for the process (a test module's
    import-time load, kept as the first one)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    if monkeypatch is None:
        module = sys.modules.setdefault(name, module)
    else:
        monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module
