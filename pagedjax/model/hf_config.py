"""Map a Hugging Face model folder's `config.json` (+ `generation_config.json`) to a pagedjax `ModelConfig`.

    cfg = load_hf_config("path/to/folder")                       # or pagedjax.model.hf_loader.load_hf_config

Supported `model_type`s: llama, mistral, qwen2 (`ModelConfig.architecture` "llama") and gemma2 ("gemma2":
soft-capped attention and final logits, `query_pre_attn_scalar`, GeGLU, sandwich norms, scaled embeddings).
Sliding windows map to `ModelConfig.sliding_windows`, one entry per layer, as transformers applies them:
Mistral's `sliding_window` on every layer; Qwen2's with `use_sliding_window` on the layers `layer_types` marks
"sliding_attention" (else those from `max_window_layers` on); Gemma 2's on the layers `layer_types` marks (else
the even ones: 0, 2, ...).

Anything pagedjax cannot compute exactly (unknown `model_type`, `hidden_act` other than silu (Gemma 2:
`hidden_activation` other than gelu_pytorch_tanh), `mlp_bias`, `attention_bias` for Llama and Gemma 2 (it also
biases o_proj), rope scaling other than `pagedjax.config.ROPE_TYPES`, partial rotary, quantized weights,
bidirectional attention, ...) and any field of the wrong type (`"hidden_size": "256"`, `2.0`) or invalid JSON
raises a `ModelLoadError` (a ValueError) naming the file and field: never silently wrong output.

The weights are read by `pagedjax.model.hf_loader`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from pagedjax.config import ROPE_SCALING_PARAMS, ROPE_TYPES, ModelConfig, is_int
from pagedjax.model.errors import ModelLoadError, read_json

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "gemma2")
_SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# Hugging Face's per-architecture defaults for fields a config.json may leave out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False},
    "mistral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "tie_word_embeddings": False, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "max_window_layers": 28, "sliding_window": 4096},
    "gemma2": {"max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               "tie_word_embeddings": True, "head_dim": 256, "query_pre_attn_scalar": 256.0,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "sliding_window": 4096},
}
_GEMMA2_ACTIVATION = "gelu_pytorch_tanh"


def _id_list(value: Any, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if is_int(value) and value >= 0:
        return (value,)
    if isinstance(value, list) and all(is_int(v) and v >= 0 for v in value):
        return tuple(value)
    raise ValueError(f"field {key!r}: expected a token id or a list of token ids, got {value!r}")


def _optional_id(value: Any, key: str) -> int | None:
    if isinstance(value, list):  # some configs list several; the first is the one prepended
        value = value[0] if value else None
    if value is not None and not (is_int(value) and value >= 0):
        raise ValueError(f"field {key!r}: expected a token id or null, got {value!r}")
    return value


def _positive_int(hf: dict, key: str, default: Any = None) -> int:
    value = hf.get(key)
    if value is None:  # absent or null: transformers falls back to the default too
        value = default
    if value is None:
        raise ValueError(f"required field {key!r} is missing (or null)")
    if not is_int(value) or value < 1:
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


def _defaulted(hf: dict, key: str, model_type: str) -> Any:
    """The field's value; transformers' default for this model type when absent (an explicit null stays None:
    for a window or a soft cap, null switches it off)."""
    return hf[key] if key in hf else _DEFAULTS[model_type].get(key)


def _optional_positive_number(hf: dict, key: str, model_type: str) -> float | None:
    value = _defaulted(hf, key, model_type)
    if value is None:
        return None
    value = _number({key: value}, key)
    if value <= 0:
        raise ValueError(f"field {key!r}: expected a number > 0 or null, got {value!r}")
    return value


def _layer_types(hf: dict, num_layers: int) -> list[str] | None:
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


def _sliding_windows(hf: dict, model_type: str, num_layers: int) -> tuple[int | None, ...] | None:
    """Each layer's attention window (None: global), as transformers applies them; None if no layer has one."""
    if model_type == "llama":
        return None
    if model_type == "qwen2" and not _flag(hf, "use_sliding_window", False):
        return None  # transformers drops Qwen2's window unless use_sliding_window is set
    window = _defaulted(hf, "sliding_window", model_type)
    if window is None:
        return None
    if not is_int(window) or window < 1:
        raise ValueError(f"field 'sliding_window': expected a positive int or null, got {window!r}")
    layer_types = _layer_types(hf, num_layers)
    if model_type == "mistral":
        # transformers' Mistral windows every layer whatever layer_types says; a checkpoint that says otherwise
        # was probably written for another architecture, so refuse rather than guess.
        if layer_types is not None and "full_attention" in layer_types:
            raise ValueError("field 'layer_types': Mistral windows every layer (transformers ignores "
                             "'full_attention' entries here); load this checkpoint as its own architecture")
        return (window,) * num_layers
    if layer_types is None:
        if model_type == "qwen2":
            cut = _defaulted(hf, "max_window_layers", model_type)
            if not is_int(cut) or cut < 0:
                raise ValueError(f"field 'max_window_layers': expected an int >= 0, got {cut!r}")
            layer_types = ["sliding_attention" if i >= cut else "full_attention" for i in range(num_layers)]
        else:  # gemma2: local and global layers alternate, starting with a local one
            layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    return None if all(w is None for w in windows) else windows


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
    hf = read_json(config_path)
    gen_path = folder / "generation_config.json"
    gen = read_json(gen_path) if gen_path.is_file() else {}
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

    if model_type == "gemma2":
        # transformers' Gemma 2 reads hidden_activation (older configs also carry a hidden_act it ignores).
        act = hf.get("hidden_activation") or _GEMMA2_ACTIVATION
        if act != _GEMMA2_ACTIVATION:
            raise ValueError(f"field 'hidden_activation' = {act!r} is not supported for gemma2 "
                             f"(only {_GEMMA2_ACTIVATION})")
        if _flag(hf, "use_bidirectional_attention", False):
            raise ValueError("field 'use_bidirectional_attention' = true is not supported (attention is causal)")
    else:
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"field 'hidden_act' = {act!r} is not supported (only silu)")
    if _flag(hf, "mlp_bias", False):
        raise ValueError("field 'mlp_bias' = true is not supported (MLP projections have no bias)")
    if hf.get("quantization_config") is not None:
        raise ValueError("field 'quantization_config': quantized checkpoints are not supported")
    if model_type == "qwen2":
        qkv_bias = True  # Qwen2 always biases q/k/v (and never o_proj)
    elif model_type in ("llama", "gemma2"):
        if _flag(hf, "attention_bias", False):
            # HF's Llama and Gemma 2 put the bias on o_proj too, which pagedjax's attention does not have.
            raise ValueError(f"field 'attention_bias' = true is not supported for {model_type} "
                             "(it also biases o_proj)")
        qkv_bias = False
    else:
        qkv_bias = False

    hidden = _positive_int(hf, "hidden_size")
    num_heads = _positive_int(hf, "num_attention_heads")
    num_kv = _positive_int(hf, "num_key_value_heads", num_heads)
    num_layers = _positive_int(hf, "num_hidden_layers")
    if hf.get("head_dim") is None and "head_dim" not in defaults:
        if hidden % num_heads:
            raise ValueError(f"'hidden_size' ({hidden}) is not a multiple of 'num_attention_heads' ({num_heads}) "
                             "and there is no 'head_dim'")
    head_dim = _positive_int(hf, "head_dim", defaults.get("head_dim", hidden // num_heads))
    if head_dim % 2:
        raise ValueError(f"field 'head_dim' = {head_dim}: RoPE needs an even head dim")
    if num_heads % num_kv:
        raise ValueError(f"'num_attention_heads' ({num_heads}) is not a multiple of 'num_key_value_heads' ({num_kv})")
    rope_theta, rope_scaling = _rope(hf, model_type)

    max_pos = _positive_int(hf, "max_position_embeddings", defaults["max_position_embeddings"])
    sliding_windows = _sliding_windows(hf, model_type, num_layers)
    if model_type == "gemma2":
        gemma = dict(architecture="gemma2",
                     attn_logit_softcapping=_optional_positive_number(hf, "attn_logit_softcapping", model_type),
                     final_logit_softcapping=_optional_positive_number(hf, "final_logit_softcapping", model_type),
                     query_pre_attn_scalar=_optional_positive_number(hf, "query_pre_attn_scalar", model_type))
        if gemma["query_pre_attn_scalar"] is None:
            raise ValueError("required field 'query_pre_attn_scalar' is null")
    else:
        gemma = {}

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
        sliding_windows=sliding_windows,
        **gemma,
    )
