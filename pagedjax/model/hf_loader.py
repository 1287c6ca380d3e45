"""Load a local Hugging Face model folder (Llama / Mistral / Qwen2) into pagedjax.

    cfg, params, tokenizer = load_hf("path/to/folder")           # config.json, *.safetensors, tokenizer.json
    engine = LLMEngine(cfg, CacheConfig(...), SchedulerConfig(...), params=params, tokenizer=tokenizer)

- `load_hf_config(path)` maps `config.json` (+ `generation_config.json` for EOS/BOS ids) to a `ModelConfig`.
  Anything pagedjax cannot compute exactly (unknown `model_type`, `hidden_act` other than silu, `mlp_bias`,
  Llama's `attention_bias` (it also biases o_proj), rope scaling other than `pagedjax.config.ROPE_TYPES`,
  partial rotary, quantized weights, ...) and any field of the wrong type (`"hidden_size": "256"`, `2.0`) or
  invalid JSON raises a `ModelLoadError` (a ValueError) naming the file and field: never silently wrong output.
  A sliding window is exact for sequences no longer than the window, so when one is in effect
  `max_position_embeddings` is capped to the window (with a warning) instead of refusing the model.
- `load_hf_params(path, cfg)` reads the safetensors (one file, or shards listed in
  `model.safetensors.index.json`) tensor by tensor with the numpy API (no torch), transposes linear weights
  to pagedjax's `[in, out]` kernels, casts to `cfg.dtype` and fills an abstract `nnx.State` leaf by leaf, so
  that the host never holds a second full copy of the weights. Names and shapes are checked against the
  model before any tensor is read; missing, unexpected and mis-shaped tensors are errors naming the tensor, and
  a truncated or corrupted file is an error naming the file.

Parameter names of `pagedjax.model.llama.Llama` mirror `LlamaForCausalLM` (minus the `model.` prefix), so the
name mapping is mechanical; RoPE uses the same rotate-half convention, so q/k need no permutation.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.config import ROPE_SCALING_PARAMS, ROPE_TYPES, ModelConfig
from pagedjax.model.llama import abstract_model, model_from_state  # noqa: F401  (model_from_state: re-export)
from pagedjax.model.loader import ModelLoadError

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
# Non-parameter tensors that some checkpoints carry and that pagedjax recomputes.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _read_json(path: Path) -> dict:
    """A JSON object from `path`; ModelLoadError naming the file if it is unreadable, invalid or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except UnicodeDecodeError as e:
        raise ModelLoadError(path, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    except ValueError as e:
        raise ModelLoadError(path, f"invalid JSON: {e}") from None
    except OSError as e:
        raise ModelLoadError(path, f"cannot read: {e.strerror or e}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(path, f"expected a JSON object, got {type(value).__name__}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _id_list(value: Any, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if _is_int(value) and value >= 0:
        return (value,)
    if isinstance(value, list) and all(_is_int(v) and v >= 0 for v in value):
        return tuple(value)
    raise ValueError(f"field {key!r}: expected a token id or a list of token ids, got {value!r}")


def _optional_id(value: Any, key: str) -> int | None:
    if isinstance(value, list):  # some configs list several; the first is the one prepended
        value = value[0] if value else None
    if value is not None and not (_is_int(value) and value >= 0):
        raise ValueError(f"field {key!r}: expected a token id or null, got {value!r}")
    return value


def _positive_int(hf: dict, key: str, default: Any = None) -> int:
    value = hf.get(key)
    if value is None:  # absent or null: transformers falls back to the default too
        value = default
    if value is None:
        raise ValueError(f"required field {key!r} is missing (or null)")
    if not _is_int(value) or value < 1:
        raise ValueError(f"field {key!r}: expected a positive int, got {value!r}")
    return value


def _number(hf: dict, key: str, default: float | None = None) -> float:
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


def _flag(hf: dict, key: str, default: bool) -> bool:
    """A boolean field; absent or null gives `default`."""
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"field {key!r}: expected true or false, got {value!r}")
    return value


def _rope(hf: dict, model_type: str) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, ModelConfig.rope_scaling) from `rope_theta`/`rope_scaling` (transformers 4) or
    `rope_parameters` (transformers 5)."""
    params = hf.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params, field = hf.get("rope_scaling"), "rope_scaling"
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"field {field!r}: expected an object or null, got {params!r}")
    params = dict(params or {})
    if isinstance(params.get("full_attention"), dict):  # per-layer-type rope parameters
        raise ValueError(f"field {field!r}: per-layer-type rope parameters are not supported")
    # transformers 5 keeps rope_theta (and partial_rotary_factor) inside rope_parameters, 4 at the top level.
    theta = _number(params if params.get("rope_theta") is not None else hf, "rope_theta",
                    _DEFAULTS[model_type]["rope_theta"])
    partial = _number(params if params.get("partial_rotary_factor") is not None else hf, "partial_rotary_factor",
                      1.0)
    if partial != 1.0:
        raise ValueError(f"field 'partial_rotary_factor' = {partial!r}: only full rotary embeddings are supported")
    kind = params.get("rope_type", params.get("type", "default"))
    if not isinstance(kind, str):
        raise ValueError(f"field {field!r}: expected a string rope type, got {kind!r}")
    if kind == "default":
        return theta, None
    if kind not in ROPE_SCALING_PARAMS:
        raise ValueError(f"field {field!r}: rope type {kind!r} is not supported "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    scaling: dict[str, Any] = {"rope_type": kind}
    for key in ROPE_SCALING_PARAMS[kind]:
        if params.get(key) is None:
            raise ValueError(f"field {field!r}: rope type {kind!r} needs {key!r}")
        try:
            scaling[key] = _number(params, key)
        except ValueError as e:
            raise ValueError(f"field {field!r}: {e}") from None
    if kind == "linear" and scaling["factor"] <= 0:
        raise ValueError(f"field {field!r}: factor must be > 0, got {scaling['factor']}")
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError(f"field {field!r}: high_freq_factor must exceed low_freq_factor")
    return theta, tuple(sorted(scaling.items()))


def _sliding_window(hf: dict, model_type: str, num_layers: int) -> int | None:
    """The attention window if one is in effect on some layer, else None."""
    window = hf.get("sliding_window")
    if model_type == "llama" or window is None:
        return None
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
            raise ValueError(f"field 'layer_types': expected a list of strings, got {layer_types!r}")
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"field 'layer_types': unsupported attention types {unknown}")
        if "sliding_attention" not in layer_types:
            return None
    elif model_type == "qwen2":
        if not _flag(hf, "use_sliding_window", False):
            return None
        max_window_layers = hf.get("max_window_layers")
        if max_window_layers is None:
            return None  # every layer is below the cut-off: full attention
        if not _is_int(max_window_layers) or max_window_layers < 0:
            raise ValueError(f"field 'max_window_layers': expected an int >= 0, got {max_window_layers!r}")
        if max_window_layers >= num_layers:
            return None
    if not _is_int(window) or window < 1:
        raise ValueError(f"field 'sliding_window': expected a positive int or null, got {window!r}")
    return window


def load_hf_config(path: str | os.PathLike, dtype: str | None = None) -> ModelConfig:
    """Map a Hugging Face folder's `config.json` (and `generation_config.json`) to a `ModelConfig`.

    dtype: parameter/activation dtype ("float32" | "bfloat16" | "float16"); None takes the checkpoint's
    `torch_dtype`/`dtype`, float32 when absent. Raises FileNotFoundError without config.json and
    ModelLoadError (a ValueError) naming the file and field for invalid JSON, a field of the wrong type or
    anything unsupported.
    """
    folder = Path(path)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    hf = _read_json(config_path)
    gen_path = folder / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else {}
    try:
        bos = _optional_id(gen.get("bos_token_id"), "bos_token_id")
        eos = _id_list(gen.get("eos_token_id"), "eos_token_id")  # what transformers' generate stops on
    except ValueError as e:
        raise ModelLoadError(gen_path, str(e)) from None
    try:
        return _config_from_hf(hf, dtype, bos, eos)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(config_path, str(e)) from None


def _config_from_hf(hf: dict, dtype: str | None, gen_bos: int | None, gen_eos: tuple[int, ...]) -> ModelConfig:
    """`load_hf_config` on parsed JSON; ValueErrors name the field (the caller adds the file)."""
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"field 'model_type' = {model_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    defaults = _DEFAULTS[model_type]

    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"field 'hidden_act' = {act!r} is not supported (only silu)")
    if _flag(hf, "mlp_bias", False):
        raise ValueError("field 'mlp_bias' = true is not supported (MLP projections have no bias)")
    if hf.get("quantization_config") is not None:
        raise ValueError("field 'quantization_config': quantized checkpoints are not supported")
    if model_type == "qwen2":
        qkv_bias = True  # Qwen2 always biases q/k/v (and never o_proj)
    elif model_type == "llama":
        if _flag(hf, "attention_bias", False):
            # HF's Llama puts the bias on o_proj too, which pagedjax's attention does not have.
            raise ValueError("field 'attention_bias' = true is not supported for llama (it also biases o_proj)")
        qkv_bias = False
    else:
        qkv_bias = False

    hidden = _positive_int(hf, "hidden_size")
    num_heads = _positive_int(hf, "num_attention_heads")
    num_kv = _positive_int(hf, "num_key_value_heads", num_heads)
    num_layers = _positive_int(hf, "num_hidden_layers")
    if hf.get("head_dim") is None:
        if hidden % num_heads:
            raise ValueError(f"'hidden_size' ({hidden}) is not a multiple of 'num_attention_heads' ({num_heads}) "
                             "and there is no 'head_dim'")
    head_dim = _positive_int(hf, "head_dim", hidden // num_heads)
    if head_dim % 2:
        raise ValueError(f"field 'head_dim' = {head_dim}: RoPE needs an even head dim")
    if num_heads % num_kv:
        raise ValueError(f"'num_attention_heads' ({num_heads}) is not a multiple of 'num_key_value_heads' ({num_kv})")
    rope_theta, rope_scaling = _rope(hf, model_type)

    max_pos = _positive_int(hf, "max_position_embeddings", defaults["max_position_embeddings"])
    window = _sliding_window(hf, model_type, num_layers)
    if window is not None and window < max_pos:
        logger.warning("config.json field 'sliding_window' = %d is in effect: attention is exact only up to the "
                       "window, so max_position_embeddings is capped from %d to %d", window, max_pos, window)
        max_pos = window

    if dtype is None:
        key = "torch_dtype" if hf.get("torch_dtype") is not None else "dtype"
        dtype = hf.get(key) or "float32"
        if dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"field {key!r} = {dtype!r} is not supported "
                             f"(supported: {', '.join(_SUPPORTED_DTYPES)}); pass dtype= to override")
    elif dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (supported: {', '.join(_SUPPORTED_DTYPES)})")

    bos = gen_bos if gen_bos is not None else _optional_id(hf.get("bos_token_id"), "bos_token_id")
    eos = gen_eos or _id_list(hf.get("eos_token_id"), "eos_token_id")
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
        rms_norm_eps=_number(hf, "rms_norm_eps", defaults["rms_norm_eps"]),
        tie_word_embeddings=_flag(hf, "tie_word_embeddings", defaults["tie_word_embeddings"]),
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
            raise ModelLoadError(index, "no 'weight_map' object")
        if not all(isinstance(f, str) for f in weight_map.values()):
            raise ModelLoadError(index, "field 'weight_map': file names must be strings")
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
    """(file, tensor name, shape, safetensors dtype) of every tensor; ModelLoadError naming a file whose header
    cannot be read (safetensors checks there that the header covers the whole file: truncation shows here)."""
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as f:
                entries = []
                for name in f.keys():
                    sl = f.get_slice(name)
                    entries.append((file, name, tuple(sl.get_shape()), sl.get_dtype()))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError (an Exception)
            raise ModelLoadError(file, f"not a readable safetensors file (truncated or corrupted?): {e}") from e
        yield from entries


def load_hf_params(path: str | os.PathLike, cfg: ModelConfig) -> nnx.State:
    """Weights of a Hugging Face folder as an `nnx.State` with the structure of `nnx.split(init_model(cfg))[1]`.

    Streams tensor by tensor: each is read, transposed if it is a linear weight, cast to `cfg.dtype` and put
    on the device before the next is read. Raises ModelLoadError (a ValueError) for missing, unexpected or
    mis-shaped tensors (naming them) before reading any data, and naming the file for unreadable data. The load
    time is logged (logger `pagedjax.model.hf_loader`, level INFO).
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
            raise ModelLoadError(file, f"tensor {name!r} also appears in {seen[name].name}")
        var, transpose = targets[name]
        want = tuple(var.get_value().shape)
        want = want[::-1] if transpose else want
        if shape != want:
            misshaped.append(f"{name}: checkpoint {list(shape)}, model expects {list(want)}")
        if st_dtype not in _ST_DTYPES:
            raise ModelLoadError(file, f"tensor {name!r}: dtype {st_dtype} is not supported "
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
        raise ModelLoadError(path, "the weights do not match the model config: " + ". ".join(problems))
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
                try:
                    array = _read_tensor(f, file, name)
                except Exception as e:  # noqa: BLE001 - whatever the reader raised, name the file and tensor
                    raise ModelLoadError(file, f"cannot read tensor {name!r} (truncated or corrupted?): {e}") from e
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
    return state


def load_hf(path: str | os.PathLike, dtype: str | None = None) -> tuple[ModelConfig, nnx.State, Any]:
    """(ModelConfig, params, tokenizer or None) of a local Hugging Face folder.

    The tokenizer is an `HFTokenizer` when the folder has `tokenizer.json` and the `tokenizers` package is
    installed, else None.
    """
    cfg = load_hf_config(path, dtype=dtype)
    params = load_hf_params(path, cfg)
    tokenizer = None
    if (Path(path) / "tokenizer.json").is_file():
        try:
            from pagedjax.hf_tokenizer import HFTokenizer

            tokenizer = HFTokenizer.from_pretrained(path, eos_token_ids=cfg.eos_token_ids,
                                                    bos_token_id=cfg.bos_token_id)
        except ImportError:
            logger.warning("%s has tokenizer.json but the 'tokenizers' package is not installed", path)
    return cfg, params, tokenizer

