"""A model folder's pooling: its sentence-transformers files (`modules.json`, each Pooling module's `config.json`) as
`PoolingDefaults` (`pagedjax.config.pooling`), the default for decoder models where the folder has none."""

from __future__ import annotations

import json
from pathlib import Path

from pagedjax.config.pooling import PoolingDefaults
from pagedjax.model.loading.checkpoint import bundled_model_path

MODULES = "modules.json"


def _read(file: Path):
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{file}: not a readable JSON file ({e})") from None


def folder_pooling_defaults(path) -> PoolingDefaults:
    """The pooling of the model folder `path` (None: the bundled model's): its sentence-transformers modules where
    it has a `modules.json`, else the default for decoder models. ValueError naming a file that is not JSON."""
    folder = bundled_model_path() if path is None else Path(path)
    file = folder / MODULES
    if not file.is_file():
        return PoolingDefaults()
    modules = _read(file)
    configs = {}
    for m in modules if isinstance(modules, list) else ():
        if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling") and isinstance(m.get("path"), str):
            config = folder / m["path"] / "config.json"
            configs[m["path"]] = _read(config) if config.is_file() else None
    return PoolingDefaults.from_sentence_transformers(modules, configs, str(file))
