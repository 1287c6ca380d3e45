"""A model folder's pooling: its sentence-transformers files (`modules.json`, each Pooling module's `config.json`,
each Dense module's `config.json` and `model.safetensors`) as `PoolingDefaults` (`pagedjax.config.pooling`), the
default for decoder models where the folder has none."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pagedjax.config.pooling import DENSE_ACTIVATIONS, DenseLayer, PoolingDefaults
from pagedjax.model.loading.checkpoint import bundled_model_path
from pagedjax.model.loading.hf_loader import read_stored, tensor_headers

MODULES = "modules.json"


def _read(file: Path):
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{file}: not a readable JSON file ({e})") from None


def folder_pooling_defaults(path) -> PoolingDefaults:
    """The pooling of the model folder `path` (None: the bundled model's): its sentence-transformers modules where
    it has a `modules.json`, else the default for decoder models. ValueError naming a file that is not JSON or a
    Dense module's weights of the wrong shape."""
    folder = bundled_model_path() if path is None else Path(path)
    file = folder / MODULES
    if not file.is_file():
        return PoolingDefaults()
    modules = _read(file)
    configs, dense = {}, {}
    for m in modules if isinstance(modules, list) else ():
        if not (isinstance(m, dict) and isinstance(m.get("path"), str)):
            continue
        kind = str(m.get("type", ""))
        if kind.endswith("Pooling"):
            config = folder / m["path"] / "config.json"
            configs[m["path"]] = _read(config) if config.is_file() else None
        elif kind.endswith("Dense"):
            dense[m["path"]] = _dense_layer(folder / m["path"])
    return PoolingDefaults.from_sentence_transformers(modules, configs, str(file), dense)


def _dense_layer(module: Path) -> DenseLayer | str:
    """A Dense module's layer, or why pagedjax cannot compute it (its activation, weights not in safetensors).
    ValueError naming the file for a config or tensors of the wrong shape."""
    config = _read(module / "config.json") if (module / "config.json").is_file() else None
    if not isinstance(config, dict):
        return f"no config.json object in {module}"
    activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")  # sentence-transformers'
    if activation not in DENSE_ACTIVATIONS:
        return f"activation {activation!r} is not one pagedjax computes ({', '.join(DENSE_ACTIVATIONS)})"
    weights = module / "model.safetensors"
    if not weights.is_file():
        return f"no model.safetensors in {module} (pagedjax reads no pickled pytorch_model.bin)"
    names = {name for _, name, _, _ in tensor_headers([weights])}  # ModelLoadError (a ValueError) if unreadable
    wanted = ["linear.weight", *(["linear.bias"] if config.get("bias", True) else [])]
    missing = [name for name in wanted if name not in names]
    if missing:
        raise ValueError(f"{weights}: cannot read the Dense layer's {' and '.join(missing)}: not in the file")
    read = lambda name: np.asarray(read_stored(weights, name), np.float32)
    weight, bias = read("linear.weight"), read("linear.bias") if "linear.bias" in wanted else None
    want = (config.get("out_features"), config.get("in_features"))
    if weight.shape != want:
        raise ValueError(f"{weights}: linear.weight has shape {list(weight.shape)}, its config.json says "
                         f"[out_features, in_features] = {list(want)}")
    try:
        return DenseLayer(weight, bias, DENSE_ACTIVATIONS[activation])
    except ValueError as e:
        raise ValueError(f"{weights}: {e}") from None
