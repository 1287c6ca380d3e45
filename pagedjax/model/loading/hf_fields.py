"""Typed readers of a Hugging Face `config.json`'s fields, shared by the config mappings (`hf_config` and the
family modules of `pagedjax.model.families`): each returns the field's value, or transformers' default where the
field is absent (or null), and raises a ValueError naming the field for a value of the wrong type or range (the
caller adds the file: `load_folder_config`, which reads a folder's config.json and its stop tokens).

Plain Python, no JAX.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from pagedjax.config.fields import is_int
from pagedjax.model.errors import ModelLoadError, read_json

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


def id_list(value: Any, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if is_int(value) and value >= 0:
        return (value,)
    if isinstance(value, list) and all(is_int(v) and v >= 0 for v in value):
        return tuple(value)
    raise ValueError(f"field {key!r}: expected a token id or a list of token ids, got {value!r}")


def optional_id(value: Any, key: str) -> int | None:
    if isinstance(value, list):  # some configs list several; the first is the one prepended
        value = value[0] if value else None
    if value is not None and not (is_int(value) and value >= 0):
        raise ValueError(f"field {key!r}: expected a token id or null, got {value!r}")
    return value


def positive_int(hf: dict, key: str, default: Any = None) -> int:
    value = hf.get(key)
    if value is None:  # absent or null: transformers falls back to the default too
        value = default
    if value is None:
        raise ValueError(f"required field {key!r} is missing (or null)")
    if not is_int(value) or value < 1:
        raise ValueError(f"field {key!r}: expected a positive int, got {value!r}")
    return value


def number(hf: dict, key: str, default: float | None = None) -> float:
    """A float field (JSON ints accepted); absent or null gives `default`."""
    value = hf.get(key)
    if value is None:
        value = default
    if value is None:
        raise ValueError(f"required field {key!r} is missing (or null)")
    if not isinstance(value, bool) and isinstance(value, int | float):
        try:
            if math.isfinite(value):
                return float(value)
        except OverflowError:  # an int beyond float's range
            pass
    raise ValueError(f"field {key!r}: expected a finite number, got {value!r}")


def flag(hf: dict, key: str, default: bool) -> bool:
    """A boolean field; absent or null gives `default`."""
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"field {key!r}: expected true or false, got {value!r}")
    return value


def rope_source(hf: dict) -> tuple[dict, str]:
    """(the rope parameters, the field they are in): `rope_parameters` (transformers 5) or `rope_scaling` (4)."""
    params, field = hf.get("rope_parameters"), "rope_parameters"
    if params is None:
        params, field = hf.get("rope_scaling"), "rope_scaling"
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"field {field!r}: expected an object or null, got {params!r}")
    return dict(params or {}), field


def rope_theta_and_type(hf: dict, params: dict, field: str, top_theta: float) -> tuple[float, str]:
    """(rope_theta, rope type) of the rope parameters `params` (from `field`; `top_theta`: the base when they have
    none). transformers 5 keeps rope_theta and partial_rotary_factor inside them, 4 at the top level; only full
    rotary embeddings (partial_rotary_factor 1) are computed, others refused naming the field."""
    theta = number(params, "rope_theta", top_theta)
    partial = number(params if params.get("partial_rotary_factor") is not None else hf, "partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"field 'partial_rotary_factor' = {partial!r}: only full rotary embeddings are supported")
    kind = params.get("rope_type", params.get("type", "default"))
    if not isinstance(kind, str):
        raise ValueError(f"field {field!r}: expected a string rope type, got {kind!r}")
    return theta, kind


def layer_types(hf: dict, num_layers: int) -> list[str] | None:
    layer_types = hf.get("layer_types")
    if layer_types is None:
        return None
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        raise ValueError(f"field 'layer_types': expected a list of strings, got {layer_types!r}")
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"field 'layer_types': unsupported attention types {unknown}")
    if len(layer_types) != num_layers:
        raise ValueError(f"field 'layer_types': {len(layer_types)} entries for {num_layers} layers")
    return layer_types


def checkpoint_dtype(hf: dict, dtype: str | None) -> str:
    """The dtype asked for, else the checkpoint's `torch_dtype` / `dtype` (float32 when absent)."""
    if dtype is None:
        key = "torch_dtype" if hf.get("torch_dtype") is not None else "dtype"
        dtype = hf.get(key) or "float32"
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"field {key!r} = {dtype!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_DTYPES)}); pass dtype= to override")
    elif dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (supported: {', '.join(SUPPORTED_DTYPES)})")
    return dtype


def load_folder_config(path: str | os.PathLike, build):
    """build(config.json parsed, bos id, eos ids) of a folder (the stop tokens from `generation_config.json`
    where it has them), its ValueErrors and TypeErrors as ModelLoadErrors naming the file; FileNotFoundError without
    config.json."""
    folder = Path(path)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    hf = read_json(config_path)
    gen_path = folder / "generation_config.json"
    gen = read_json(gen_path) if gen_path.is_file() else {}
    try:
        bos = optional_id(gen.get("bos_token_id"), "bos_token_id")
        eos = id_list(gen.get("eos_token_id"), "eos_token_id")  # what transformers' generate stops on
    except ValueError as e:
        raise ModelLoadError(gen_path, str(e)) from None
    try:
        return build(hf, bos, eos)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(config_path, str(e)) from None
