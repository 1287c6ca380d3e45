"""Load a local Hugging Face model folder (Llama / Mistral / Qwen2) into pagedjax.

    cfg, params, tokenizer = load_hf("path/to/folder")           # config.json, *.safetensors, tokenizer.json
    engine = LLMEngine(cfg, CacheConfig(...), SchedulerConfig(...), params=params, tokenizer=tokenizer)

- `load_hf_config(path)` maps `config.json` (+ `generation_config.json` for EOS/BOS ids) to a `ModelConfig`.
  Anything pagedjax cannot compute exactly (unknown `model_type`, `hidden_act` other than silu, `mlp_bias`,
  Llama's `attention_bias` (it also biases o_proj), rope scaling other than default/linear/llama3, partial
  rotary, quantized weights, ...) raises a `ValueError` naming the field: never silently wrong output.
  A sliding window is exact for sequences no longer than the window, so when one is in effect
  `max_position_embeddings` is capped to the window (with a warning) instead of refusing the model.
- `load_hf_params(path, cfg)` reads the safetensors (one file, or shards listed in
  `model.safetensors.index.json`) tensor by tensor with the numpy API (no torch), transposes linear weights
  to pagedjax's `[in, out]` kernels, casts to `cfg.dtype` and fills an abstract `nnx.State` leaf by leaf, so
  that the host never holds a second full copy of the weights. Names and shapes are checked against the
  model before any tensor is read; missing, unexpected and mis-shaped tensors are errors naming the tensor.

Parameter names of `pagedjax.model.llama.Llama` mirror `LlamaForCausalLM` (minus the `model.` prefix), so the
name mapping is mechanical; RoPE uses the same rotate-half convention, so q/k need no permutation.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.config import ModelConfig
from pagedjax.model.llama import abstract_model, model_from_state  # noqa: F401  (model_from_state: re-export)

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# Hugging Face's per-architecture defaults for fields a config.json may leave out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False},
    "mistral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "tie_word_embeddings": False},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False},
}
_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# Non-parameter tensors that some checkpoints carry and that pagedjax recomputes.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _id_list(value: Any, field: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list | tuple) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise ValueError(f"config field {field!r}: expected an int or a list of ints, got {value!r}")


def _positive_int(hf: dict, key: str, default: Any = None) -> int:
    value = hf.get(key)
    if value is None:  # absent or null: transformers falls back to the default too
        value = default
    if value is None:
        raise ValueError(f"config.json: required field {key!r} is missing")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json field {key!r}: expected a positive int, got {value!r}")
    return value


def _rope(hf: dict, model_type: str) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, ModelConfig.rope_scaling) from `rope_theta`/`rope_scaling` (transformers 4) or
    `rope_parameters` (transformers 5)."""
    params = hf.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params, field = hf.get("rope_scaling"), "rope_scaling"
    params = dict(params or {})
    if isinstance(params.get("full_attention"), dict):  # per-layer-type rope parameters
        raise ValueError(f"config.json field {field!r}: per-layer-type rope parameters are not supported")
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = hf.get("rope_theta", _DEFAULTS[model_type]["rope_theta"])
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"config.json field 'partial_rotary_factor' = {partial!r}: only full rotary embeddings "
                         "are supported")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind not in _ROPE_KEYS:
        raise ValueError(f"config.json field {field!r}: rope type {kind!r} is not supported "
                         f"(supported: default, {', '.join(_ROPE_KEYS)})")
    scaling: dict[str, Any] = {"rope_type": kind}
    for key in _ROPE_KEYS[kind]:
        if params.get(key) is None:
            raise ValueError(f"config.json field {field!r}: rope type {kind!r} needs {key!r}")
        scaling[key] = float(params[key])
    if kind == "linear" and scaling["factor"] <= 0:
        raise ValueError(f"config.json field {field!r}: factor must be > 0, got {scaling['factor']}")
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError(f"config.json field {field!r}: high_freq_factor must exceed low_freq_factor")
    return float(theta), tuple(sorted(scaling.items()))


def _sliding_window(hf: dict, model_type: str, num_layers: int) -> int | None:
    """The attention window if one is in effect on some layer, else None."""
    window = hf.get("sliding_window")
    if model_type == "llama" or window is None:
        return None
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"config.json field 'layer_types': unsupported attention types {unknown}")
        if "sliding_attention" not in layer_types:
            return None
    elif model_type == "qwen2":
        if not hf.get("use_sliding_window", False):
            return None
        if hf.get("max_window_layers", num_layers) >= num_layers:
            return None
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"config.json field 'sliding_window': expected a positive int or null, got {window!r}")
    return window


def load_hf_config(path: str | os.PathLike, dtype: str | None = None) -> ModelConfig:
    """Map a Hugging Face folder's `config.json` (and `generation_config.json`) to a `ModelConfig`.

    dtype: parameter/activation dtype ("float32" | "bfloat16" | "float16"); None takes the checkpoint's
    `torch_dtype`/`dtype`, float32 when absent. Raises ValueError naming the field for anything unsupported.
    """
    folder = Path(path)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    hf = _read_json(config_path)
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json field 'model_type' = {model_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    defaults = _DEFAULTS[model_type]

    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"config.json field 'hidden_act' = {act!r} is not supported (only silu)")
    if hf.get("mlp_bias", False):
        raise ValueError("config.json field 'mlp_bias' = true is not supported (MLP projections have no bias)")
    if hf.get("quantization_config") is not None:
        raise ValueError("config.json field 'quantization_config': quantized checkpoints are not supported")
    if model_type == "qwen2":
        qkv_bias = True  # Qwen2 always biases q/k/v (and never o_proj)
    elif model_type == "llama":
        if hf.get("attention_bias", False):
            # HF's Llama puts the bias on o_proj too, which pagedjax's attention does not have.
            raise ValueError("config.json field 'attention_bias' = true is not supported for llama "
                             "(it also biases o_proj)")
        qkv_bias = False
    else:
        qkv_bias = False

    hidden = _positive_int(hf, "hidden_size")
    num_heads = _positive_int(hf, "num_attention_heads")
    num_kv = _positive_int(hf, "num_key_value_heads", num_heads)
    num_layers = _positive_int(hf, "num_hidden_layers")
    head_dim = hf.get("head_dim")
    if head_dim is None:
        if hidden % num_heads:
            raise ValueError(f"config.json: 'hidden_size' ({hidden}) is not a multiple of 'num_attention_heads' "
                             f"({num_heads}) and there is no 'head_dim'")
        head_dim = hidden // num_heads
    head_dim = _positive_int({"head_dim": head_dim}, "head_dim")
    if head_dim % 2:
        raise ValueError(f"config.json field 'head_dim' = {head_dim}: RoPE needs an even head dim")
    if num_heads % num_kv:
        raise ValueError(f"config.json: 'num_attention_heads' ({num_heads}) is not a multiple of "
                         f"'num_key_value_heads' ({num_kv})")
    rope_theta, rope_scaling = _rope(hf, model_type)

    max_pos = _positive_int(hf, "max_position_embeddings", defaults["max_position_embeddings"])
    window = _sliding_window(hf, model_type, num_layers)
    if window is not None and window < max_pos:
        logger.warning("config.json field 'sliding_window' = %d is in effect: attention is exact only up to the "
                       "window, so max_position_embeddings is capped from %d to %d", window, max_pos, window)
        max_pos = window

    if dtype is None:
        dtype = hf.get("torch_dtype", hf.get("dtype")) or "float32"
        if dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"config.json field 'torch_dtype' = {dtype!r} is not supported "
                             f"(supported: {', '.join(_SUPPORTED_DTYPES)}); pass dtype= to override")
    elif dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (supported: {', '.join(_SUPPORTED_DTYPES)})")

    bos = hf.get("bos_token_id")
    eos = _id_list(hf.get("eos_token_id"), "eos_token_id")
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        gen = _read_json(gen_path)
        if gen.get("eos_token_id") is not None:  # what transformers' generate stops on
            eos = _id_list(gen["eos_token_id"], "generation_config.json eos_token_id")
        if gen.get("bos_token_id") is not None:
            bos = gen["bos_token_id"]
    if isinstance(bos, list):
        bos = bos[0] if bos else None

    tie = hf.get("tie_word_embeddings", defaults["tie_word_embeddings"])
    return ModelConfig(
        vocab_size=_positive_int(hf, "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_q_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        intermediate_size=_positive_int(hf, "intermediate_size"),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])),
        tie_word_embeddings=bool(tie),
        qkv_bias=qkv_bias,
        max_position_embeddings=max_pos,
        dtype=dtype,
        bos_token_id=bos,
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )


# ------------------------------------------------------------------------------------------------------ weights
def _hf_name(path: tuple) -> tuple[str, bool]:
    """pagedjax state path -> (Hugging Face tensor name, whether the tensor is transposed)."""
    *mods, leaf = (str(p) for p in path)
    if leaf == "kernel":
        name, transpose = "weight", True
    elif leaf in ("embedding", "weight"):
        name, transpose = "weight", False
    elif leaf == "bias":
        name, transpose = "bias", False
    else:
        raise ValueError(f"no Hugging Face name for model parameter {'.'.join(mods + [leaf])}")
    prefix = "" if mods[0] == "lm_head" else "model."
    return prefix + ".".join(mods + [name]), transpose


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The folder's safetensors files: the shards of `model.safetensors.index.json`, or `model.safetensors`,
    or else every `*.safetensors` file."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no 'weight_map'")
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that do not exist: {missing}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder} (pytorch .bin checkpoints are not supported)")
    return files


_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16}


def _read_tensor(handle, file: Path, name: str) -> np.ndarray:
    """One tensor as numpy. bf16 goes through the numpy API when this safetensors version maps it to
    ml_dtypes' bfloat16, else through the raw bytes of the file."""
    try:
        return handle.get_tensor(name)
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # e.g. an old safetensors without numpy bf16
        logger.debug("safetensors numpy API failed for %s (%s); reading raw bytes", name, e)
        return _read_raw(file, name)


def _read_raw(file: Path, name: str) -> np.ndarray:
    """Read one tensor straight from a safetensors file: u64 header length, JSON header, data."""
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        info = header[name]
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r} in {file.name}: dtype {info['dtype']} is not supported")
        begin, end = info["data_offsets"]
        f.seek(8 + header_len + begin)
        data = f.read(end - begin)
    return np.frombuffer(data, dtype=np.dtype(_ST_DTYPES[info["dtype"]])).reshape(info["shape"])


def _headers(files: list[Path]) -> Iterator[tuple[Path, str, tuple[int, ...], str]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                yield file, name, tuple(sl.get_shape()), sl.get_dtype()


def load_hf_params(path: str | os.PathLike, cfg: ModelConfig, *, verbose: bool = True) -> nnx.State:
    """Weights of a Hugging Face folder as an `nnx.State` with the structure of `nnx.split(init_model(cfg))[1]`.

    Streams tensor by tensor: each is read, transposed if it is a linear weight, cast to `cfg.dtype` and put
    on the device before the next is read. Raises ValueError for missing, unexpected or mis-shaped tensors
    (naming them) before reading any data. verbose: print the load time to stderr (it is logged either way).
    """
    from safetensors import safe_open

    start = time.perf_counter()
    files = safetensors_files(path)
    _, state = nnx.split(abstract_model(cfg))
    targets: dict[str, tuple[Any, bool]] = {}
    for p, var in nnx.to_flat_state(state):
        name, transpose = _hf_name(p)
        targets[name] = (var, transpose)

    # Pass 1: headers only. Check names and shapes; decide which file each tensor comes from.
    plan: dict[Path, list[str]] = {f: [] for f in files}
    seen: dict[str, Path] = {}
    unexpected, misshaped, skipped = [], [], []
    for file, name, shape, st_dtype in _headers(files):
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            skipped.append(name)  # tied: the embedding is the head, as in transformers
            continue
        if name not in targets:
            unexpected.append(name)
            continue
        if name in seen:
            raise ValueError(f"tensor {name!r} appears in both {seen[name].name} and {file.name}")
        var, transpose = targets[name]
        want = tuple(var.get_value().shape)
        want = want[::-1] if transpose else want
        if shape != want:
            misshaped.append(f"{name}: checkpoint {list(shape)}, model expects {list(want)}")
        if st_dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r} in {file.name}: dtype {st_dtype} is not supported "
                             f"(supported: {', '.join(_ST_DTYPES)})")
        seen[name] = file
        plan[file].append(name)
    missing = sorted(set(targets) - set(seen))
    problems = []
    if missing:
        problems.append(f"missing tensors: {missing}")
    if unexpected:
        problems.append(f"unexpected tensors: {sorted(unexpected)}")
    if misshaped:
        problems.append("mis-shaped tensors: " + "; ".join(misshaped))
    if problems:
        raise ValueError(f"checkpoint {path} does not match the model config: " + ". ".join(problems))
    if skipped:
        logger.debug("ignored tensors: %s", skipped)

    # Pass 2: data, one tensor at a time.
    target_dtype = jnp.dtype(cfg.dtype)
    num_bytes = 0
    for file, names in plan.items():
        if not names:
            continue
        with safe_open(str(file), framework="numpy") as f:
            for name in names:
                var, transpose = targets[name]
                array = _read_tensor(f, file, name)
                num_bytes += array.nbytes
                if transpose:
                    array = array.T
                value = jax.device_put(np.ascontiguousarray(array, dtype=target_dtype))
                del array
                var.set_value(value)

    elapsed = time.perf_counter() - start
    msg = (f"loaded {len(seen)} tensors ({num_bytes / 2**20:.1f} MiB) from {len(files)} safetensors file(s) "
           f"in {elapsed:.2f}s as {cfg.dtype}")
    logger.info("%s: %s", path, msg)
    if verbose:
        print(f"pagedjax: {msg}", file=sys.stderr)
    return state


def load_hf(path: str | os.PathLike, dtype: str | None = None, *, verbose: bool = True
            ) -> tuple[ModelConfig, nnx.State, Any]:
    """(ModelConfig, params, tokenizer or None) of a local Hugging Face folder.

    The tokenizer is an `HFTokenizer` when the folder has `tokenizer.json` and the `tokenizers` package is
    installed, else None.
    """
    cfg = load_hf_config(path, dtype=dtype)
    params = load_hf_params(path, cfg, verbose=verbose)
    tokenizer = None
    if (Path(path) / "tokenizer.json").is_file():
        try:
            from pagedjax.hf_tokenizer import HFTokenizer

            tokenizer = HFTokenizer.from_pretrained(path, eos_token_ids=cfg.eos_token_ids,
                                                    bos_token_id=cfg.bos_token_id)
        except ImportError:
            logger.warning("%s has tokenizer.json but the 'tokenizers' package is not installed", path)
    return cfg, params, tokenizer

