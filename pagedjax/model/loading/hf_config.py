"""Map a Hugging Face model folder's `config.json` (+ `generation_config.json`) to a pagedjax `ModelConfig`.

    cfg = load_hf_config("path/to/folder")                       # or pagedjax.model.loading.hf_loader.load_hf_config

Supported `model_type`s (`SUPPORTED_MODEL_TYPES`), each as a few `ModelConfig` fields (`_FAMILIES`):
llama, mistral, qwen2, phi3 (`architecture` "llama"; Phi-3's fused qkv_proj / gate_up_proj are split by the
weight loader), qwen3 (`qk_norm` "head"), olmo2 (`qk_norm` "full", `norm_placement` "post"), gemma2 and
gemma3_text ("gemma2": soft-capped attention and final logits, `query_pre_attn_scalar`, GeGLU, sandwich norms,
scaled embeddings; Gemma 3 adds `qk_norm` "head" and `rope_local_theta` for its local layers), mixtral and
qwen3_moe (`ModelConfig.moe`, `_moe`: every layer's MLP a mixture of experts; Qwen3-MoE with `qk_norm` "head"),
gpt_oss (mapped by its family module, `pagedjax.model.families.gpt_oss.config_from_hf`: sinks, biases, YaRN, its
experts).
Sliding windows map to `ModelConfig.sliding_windows`, one entry per layer, as transformers applies them (the
query at p sees keys in (p - W, p] in transformers' masks as in pagedjax, so W is taken as is): Mistral's,
Mixtral's and Phi-3's `sliding_window` on every layer, Qwen3-MoE's too with `use_sliding_window`; Qwen2's and
Qwen3's with `use_sliding_window` on the layers `layer_types` marks "sliding_attention" (else those from
`max_window_layers` on); Gemma's on the layers `layer_types` marks (else every layer but each
`sliding_window_pattern`-th: Gemma 2 alternates, Gemma 3 defaults to 6).

Anything pagedjax cannot compute exactly (unknown `model_type`, `hidden_act` other than silu (Gemma:
`hidden_activation` other than gelu_pytorch_tanh), `mlp_bias`, `attention_bias` where it also biases o_proj,
rope scaling other than `pagedjax.config.ROPE_TYPES` (YaRN: gpt_oss only), partial rotary, quantized weights,
bidirectional attention, Gemma 3's `attn_logit_softcapping` (which transformers does not apply), ...) and any
field of the wrong type (`"hidden_size": "256"`, `2.0`) or invalid JSON raises a `ModelLoadError` (a ValueError)
naming the file and field: never silently wrong output. Phi-3's LongRoPE ("longrope", "su") is computed exactly within
`original_max_position_embeddings`, to which the context is capped (with a warning): its long factors are not
implemented.

DeepSeek V2 / V3 / V3.2 and GLM-5 (`deepseek_v2`, `deepseek_v3`, `deepseek_v32`, `glm_moe_dsa`) map to a
`pagedjax.config.deepseek.DeepSeekConfig` instead (`load_deepseek_config`; `load_hf_config` refuses them, naming
it). Qwen3-Next (`qwen3_next`) and Qwen3.5 (`qwen3_5_text`,
`qwen3_5_moe_text`, and the text of `qwen3_5`, `qwen3_5_moe`) map to a
`pagedjax.model.families.qwen3_next.Qwen3NextConfig` (`load_qwen3_next_config`; `load_hf_config` refuses them,
naming it); Nemotron-H (`nemotron_h`) likewise to a `pagedjax.model.families.nemotron_h.NemotronHConfig`
(`load_nemotron_h_config`). LLaVA and Gemma 3 with images (`llava`, `gemma3`,
`VISION_MODEL_TYPES`) load through `pagedjax.model.loading.hf_vision`, whose text models map with `config_from_dict`.
An unknown `model_type` is refused with the list of every one `from_pretrained` loads (`LOADABLE_MODEL_TYPES`, the
loader's dispatch, and the types registered in `pagedjax.ModelRegistry`).

The weights are read by `pagedjax.model.loading.hf_loader`.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

from pagedjax.config import ModelConfig
from pagedjax.config.fields import is_int
from pagedjax.config.model import ROPE_SCALING_PARAMS, ROPE_TYPES
from pagedjax.config.moe import MoEConfig
from pagedjax.model.errors import ModelLoadError, read_json
from pagedjax.model.families import gpt_oss, nemotron_h, qwen3_next
from pagedjax.model.loading.hf_fields import (
    checkpoint_dtype,
    flag,
    id_list,
    layer_types,
    number,
    optional_id,
    positive_int,
    rope_source,
)

logger = logging.getLogger(__name__)

# model_type -> the ModelConfig fields its family fixes (everything else comes from config.json).
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {}, "mistral": {}, "phi3": {},
    "qwen2": {"qkv_bias": True},  # Qwen2 always biases q/k/v (and never o_proj)
    "qwen3": {"qk_norm": "head"},
    "olmo2": {"qk_norm": "full", "norm_placement": "post"},
    "gemma2": {"architecture": "gemma2"},
    "gemma3_text": {"architecture": "gemma2", "qk_norm": "head"},
    "mixtral": {},  # + ModelConfig.moe (`_moe`)
    "qwen3_moe": {"qk_norm": "head"},
}
SUPPORTED_MODEL_TYPES = (*_FAMILIES, *gpt_oss.MODEL_TYPES)  # gpt-oss: mapped by its family module
_GEMMA = ("gemma2", "gemma3_text")
# Families whose `attention_bias` biases o_proj too, which pagedjax's attention does not have. (Qwen2 biases q/k/v
# whatever it says; Mistral and Phi-3 have no such field in transformers, which ignores it.)
_O_PROJ_BIAS = ("llama", "qwen3", "qwen3_moe", "olmo2", "gemma2", "gemma3_text")
# Hugging Face's per-architecture defaults for fields a config.json may leave out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False},
    "mistral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "tie_word_embeddings": False, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "max_window_layers": 28, "sliding_window": 4096},
    "qwen3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "head_dim": 128, "max_window_layers": 28, "sliding_window": 4096},
    "phi3": {"max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
             "rope_theta": 10000.0, "tie_word_embeddings": False, "sliding_window": None},
    "olmo2": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False},
    "gemma2": {"max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               "tie_word_embeddings": True, "head_dim": 256, "query_pre_attn_scalar": 256.0,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "sliding_window": 4096},
    "mixtral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0,
                "tie_word_embeddings": False, "sliding_window": None, "num_local_experts": 8,
                "num_experts_per_tok": 2},
    "qwen3_moe": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                  "tie_word_embeddings": False, "sliding_window": 4096, "num_local_experts": 128,
                  "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False},
    "gemma3_text": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
                    "rope_local_base_freq": 10000.0, "tie_word_embeddings": True, "head_dim": 256,
                    "query_pre_attn_scalar": 256.0, "attn_logit_softcapping": None, "final_logit_softcapping": None,
                    "sliding_window": 4096, "sliding_window_pattern": 6},
}
_GEMMA_ACTIVATION = "gelu_pytorch_tanh"








def _rope(hf: dict, model_type: str, params: dict, field: str, top_theta: float, head_dim: int,
          max_pos: int) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, ModelConfig.rope_scaling) of one set of rope parameters (`params`, from `field`);
    `top_theta`: the base when they have none (config.json's top-level one, or the family's default)."""
    if any(isinstance(params.get(t), dict) for t in ("full_attention", "sliding_attention")):
        raise ValueError(f"field {field!r}: per-layer-type rope parameters are not supported for {model_type}")
    # transformers 5 keeps rope_theta (and partial_rotary_factor) inside rope_parameters, 4 at the top level.
    theta = number(params, "rope_theta", top_theta)
    partial = number(params if params.get("partial_rotary_factor") is not None else hf, "partial_rotary_factor",
                      1.0)
    if partial != 1.0:
        raise ValueError(f"field 'partial_rotary_factor' = {partial!r}: only full rotary embeddings are supported")
    kind = params.get("rope_type", params.get("type", "default"))
    if not isinstance(kind, str):
        raise ValueError(f"field {field!r}: expected a string rope type, got {kind!r}")
    if model_type == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # transformers' Phi-3 reads both older names as LongRoPE
    if kind == "default":
        return theta, None
    if kind not in ROPE_SCALING_PARAMS:
        raise ValueError(f"field {field!r}: rope type {kind!r} is not supported "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    if kind == "yarn":  # its optional parameters are read by gpt-oss's family module only
        raise ValueError(f"field {field!r}: rope type 'yarn' is supported for gpt_oss only")
    if kind == "longrope":
        if model_type != "phi3":
            raise ValueError(f"field {field!r}: rope type 'longrope' is supported for phi3 only")
        return theta, _longrope(hf, params, field, head_dim, max_pos)
    scaling: dict[str, Any] = {"rope_type": kind}
    for key in ROPE_SCALING_PARAMS[kind]:
        if params.get(key) is None:
            raise ValueError(f"field {field!r}: rope type {kind!r} needs {key!r}")
        try:
            scaling[key] = number(params, key)
        except ValueError as e:
            raise ValueError(f"field {field!r}: {e}") from None
    if kind == "linear" and scaling["factor"] <= 0:
        raise ValueError(f"field {field!r}: factor must be > 0, got {scaling['factor']}")
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError(f"field {field!r}: high_freq_factor must exceed low_freq_factor")
    return theta, tuple(sorted(scaling.items()))


def _longrope(hf: dict, params: dict, field: str, head_dim: int, max_pos: int) -> tuple[tuple[str, Any], ...]:
    """Phi-3's LongRoPE as transformers computes it for sequences within the original context: the short
    factors, and the attention factor (given, or from the context extension max_position_embeddings / original)."""
    # Phi3Config always has a top-level original_max_position_embeddings (default 4096), and transformers gives
    # it priority over the one inside the rope parameters.
    original = positive_int(hf, "original_max_position_embeddings",
                             _DEFAULTS["phi3"]["original_max_position_embeddings"])
    short = params.get("short_factor")
    if not isinstance(short, list) or len(short) != head_dim // 2 or not all(
            is_int(x) or isinstance(x, float) for x in short):
        raise ValueError(f"field {field!r}: longrope needs 'short_factor', a list of head_dim // 2 = {head_dim // 2} "
                         f"numbers, got {short!r}")
    factor = number(params, "factor", max_pos / original)
    default_attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    attention = number(params, "attention_factor", default_attention)
    return (("attention_factor", attention), ("original_max_position_embeddings", float(original)),
            ("rope_type", "longrope"), ("short_factor", tuple(float(x) for x in short)))


def _rope_fields(hf: dict, model_type: str, head_dim: int, max_pos: int) -> dict[str, Any]:
    """ModelConfig's rope_theta, rope_scaling, max_position_embeddings (capped to LongRoPE's original context)
    and (Gemma 3) rope_local_theta."""
    params, field = rope_source(hf)
    top_theta = number(hf, "rope_theta", _DEFAULTS[model_type]["rope_theta"])
    if model_type != "gemma3_text":
        theta, scaling = _rope(hf, model_type, params, field, top_theta, head_dim, max_pos)
        original = dict(scaling or ()).get("original_max_position_embeddings")
        if dict(scaling or ()).get("rope_type") == "longrope" and max_pos > original:
            logger.warning("%s: serving at most original_max_position_embeddings = %d positions, not %d: beyond "
                           "them LongRoPE switches to its long factors, which pagedjax does not implement",
                           model_type, original, max_pos)
            max_pos = int(original)
        return dict(rope_theta=theta, rope_scaling=scaling, max_position_embeddings=max_pos)
    # Gemma 3: the global layers rotate by rope_theta with rope_scaling, the local ones by their own base. In
    # transformers 5 each layer type has its parameters; in 4, rope_local_base_freq is the local base.
    local_theta = number(hf, "rope_local_base_freq", _DEFAULTS[model_type]["rope_local_base_freq"])
    if field == "rope_parameters" and any(isinstance(params.get(t), dict)
                                          for t in ("full_attention", "sliding_attention")):
        glob, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        theta, scaling = _rope(hf, model_type, glob, f"{field}.full_attention", top_theta, head_dim, max_pos)
        local_theta, local_scaling = _rope(hf, model_type, local, f"{field}.sliding_attention", local_theta,
                                           head_dim, max_pos)
        if local_scaling is not None:
            raise ValueError(f"field '{field}.sliding_attention': rope scaling on the local layers is not supported")
    else:
        theta, scaling = _rope(hf, model_type, params, field, top_theta, head_dim, max_pos)
    return dict(rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta, max_position_embeddings=max_pos)


def _defaulted(hf: dict, key: str, model_type: str) -> Any:
    """The field's value; transformers' default for this model type when absent (an explicit null stays None:
    for a window or a soft cap, null switches it off)."""
    return hf[key] if key in hf else _DEFAULTS[model_type].get(key)


def _optional_positive_number(hf: dict, key: str, model_type: str) -> float | None:
    value = _defaulted(hf, key, model_type)
    if value is None:
        return None
    value = number({key: value}, key)
    if value <= 0:
        raise ValueError(f"field {key!r}: expected a number > 0 or null, got {value!r}")
    return value



def _sliding_windows(hf: dict, model_type: str, num_layers: int) -> tuple[int | None, ...] | None:
    """Each layer's attention window (None: global), as transformers applies them; None if no layer has one."""
    if model_type in ("llama", "olmo2"):
        return None
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not flag(hf, "use_sliding_window", False):
        return None  # transformers drops Qwen's window unless use_sliding_window is set
    window = _defaulted(hf, "sliding_window", model_type)
    if window is None:
        if model_type == "gemma3_text":
            # Its local layers would still rotate by their own base: not a plain window-less model.
            raise ValueError("field 'sliding_window': null is not supported for gemma3_text")
        return None
    if not is_int(window) or window < 1:
        raise ValueError(f"field 'sliding_window': expected a positive int or null, got {window!r}")
    kinds = layer_types(hf, num_layers)
    if model_type in ("mistral", "phi3", "mixtral", "qwen3_moe"):
        # transformers windows every layer of these whatever layer_types says; a checkpoint that says otherwise
        # was probably written for another architecture, so refuse rather than guess.
        if kinds is not None and "full_attention" in kinds:
            raise ValueError(f"field 'layer_types': {model_type} windows every layer (transformers ignores "
                             "'full_attention' entries here); load this checkpoint as its own architecture")
        return (window,) * num_layers
    if kinds is None:
        if model_type in ("qwen2", "qwen3"):
            cut = _defaulted(hf, "max_window_layers", model_type)
            if not is_int(cut) or cut < 0:
                raise ValueError(f"field 'max_window_layers': expected an int >= 0, got {cut!r}")
            kinds = ["sliding_attention" if i >= cut else "full_attention" for i in range(num_layers)]
        else:  # Gemma: every pattern-th layer is global, the others local (Gemma 2 alternates)
            pattern = positive_int(hf, "sliding_window_pattern", 6) if model_type == "gemma3_text" else 2
            kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    windows = tuple(window if t == "sliding_attention" else None for t in kinds)
    return None if all(w is None for w in windows) else windows


def load_hf_config(path: str | os.PathLike, dtype: str | None = None) -> ModelConfig:
    """Map a Hugging Face folder's `config.json` (and `generation_config.json`) to a `ModelConfig`.

    dtype: parameter/activation dtype ("float32" | "bfloat16" | "float16"); None takes the checkpoint's
    `torch_dtype`/`dtype`, float32 when absent. Raises FileNotFoundError without config.json and
    ModelLoadError (a ValueError) naming the file and field for invalid JSON, a field of the wrong type or
    anything unsupported.
    """
    return load_folder_config(path, lambda hf, bos, eos: _config_from_hf(hf, dtype, bos, eos))


def config_from_dict(hf: dict, dtype: str | None = None, *, bos_token_id: int | None = None,
                     eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
    """`load_hf_config` of a parsed config (e.g. a vision-language checkpoint's `text_config`): `dtype` as there,
    `bos_token_id` / `eos_token_ids` (generation_config.json's) in place of the config's own when given. ValueError
    naming the field."""
    return _config_from_hf(hf, dtype, bos_token_id, tuple(eos_token_ids))


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



# A mixture-of-experts layer's router as checkpoints name it (`hf_quant.quant_config` wants each left unquantized):
# Mixtral's `block_sparse_moe` is transformers 5's `mlp`.
_ROUTER_NAMES = {"mixtral": ("model.layers.{i}.block_sparse_moe.gate", "model.layers.{i}.mlp.gate"),
                 "qwen3_moe": ("model.layers.{i}.mlp.gate",)}


def _quantization(hf: dict, num_layers: int):
    """A pre-quantized checkpoint's scheme (`pagedjax.model.loading.hf_quant`), or None for a float one."""
    if hf.get("quantization_config") is None:
        return None
    from pagedjax.model.loading.hf_quant import quant_config

    names = _ROUTER_NAMES.get(hf.get("model_type"), ())
    routers = tuple(tuple(name.format(i=i) for name in names) for i in range(num_layers)) if names else ()
    try:
        return quant_config(hf["quantization_config"], routers)
    except ValueError as e:
        raise ValueError(f"field 'quantization_config': {e}") from None


def _config_from_hf(hf: dict, dtype: str | None, gen_bos: int | None, gen_eos: tuple[int, ...]) -> ModelConfig:
    """`load_hf_config` on parsed JSON; ValueErrors name the field (the caller adds the file)."""
    model_type = hf.get("model_type")
    if model_type in DEEPSEEK_MODEL_TYPES:
        raise ValueError(f"field 'model_type' = {model_type!r}: a DeepSeek model, not a ModelConfig one; "
                         "LLMEngine.from_pretrained and --model serve it (pagedjax.model.deepseek), and "
                         "load_deepseek_config maps its config")
    if model_type in qwen3_next.MODEL_TYPES:
        raise ValueError(f"field 'model_type' = {model_type!r}: a hybrid recurrent model, not a ModelConfig one; "
                         "LLMEngine.from_pretrained and --model serve it (pagedjax.model.families.qwen3_next), and "
                         "load_qwen3_next_config maps its config")
    if model_type in nemotron_h.MODEL_TYPES:
        raise ValueError(f"field 'model_type' = {model_type!r}: a hybrid recurrent model, not a ModelConfig one; "
                         "LLMEngine.from_pretrained and --model serve it (pagedjax.model.families.nemotron_h), and "
                         "load_nemotron_h_config maps its config")
    if model_type in VISION_MODEL_TYPES:
        raise ValueError(f"field 'model_type' = {model_type!r}: a vision-language model, not a ModelConfig one; "
                         "LLMEngine.from_pretrained and --model serve it (pagedjax.model.loading.hf_vision), and "
                         "its text_config maps with config_from_dict")
    if model_type in gpt_oss.MODEL_TYPES:
        return gpt_oss.config_from_hf(hf, dtype, gen_bos, gen_eos)
    if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"field 'model_type' = {model_type!r} is not supported: {loadable_model_types()}; a "
                         "model of your own serves it once registered: "
                         f"pagedjax.ModelRegistry.register_model({model_type!r}, factory)")
    defaults = _DEFAULTS[model_type]
    _check_unsupported(hf, model_type)

    hidden = positive_int(hf, "hidden_size")
    num_heads = positive_int(hf, "num_attention_heads")
    num_kv = positive_int(hf, "num_key_value_heads", num_heads)
    num_layers = positive_int(hf, "num_hidden_layers")
    if hf.get("head_dim") is None and "head_dim" not in defaults:
        if hidden % num_heads:
            raise ValueError(f"'hidden_size' ({hidden}) is not a multiple of 'num_attention_heads' ({num_heads}) "
                             "and there is no 'head_dim'")
    head_dim = positive_int(hf, "head_dim", defaults.get("head_dim", hidden // num_heads))
    if head_dim % 2:
        raise ValueError(f"field 'head_dim' = {head_dim}: RoPE needs an even head dim")
    if num_heads % num_kv:
        raise ValueError(f"'num_attention_heads' ({num_heads}) is not a multiple of 'num_key_value_heads' ({num_kv})")
    max_pos = positive_int(hf, "max_position_embeddings", defaults["max_position_embeddings"])
    rope = _rope_fields(hf, model_type, head_dim, max_pos)  # with max_position_embeddings (LongRoPE caps it)
    sliding_windows = _sliding_windows(hf, model_type, num_layers)
    if model_type in _GEMMA:
        gemma = dict(attn_logit_softcapping=_optional_positive_number(hf, "attn_logit_softcapping", model_type),
                     final_logit_softcapping=_optional_positive_number(hf, "final_logit_softcapping", model_type),
                     query_pre_attn_scalar=_optional_positive_number(hf, "query_pre_attn_scalar", model_type))
        if gemma["query_pre_attn_scalar"] is None:
            raise ValueError("required field 'query_pre_attn_scalar' is null")
    else:
        gemma = {}

    dtype = checkpoint_dtype(hf, dtype)
    bos = gen_bos if gen_bos is not None else optional_id(hf.get("bos_token_id"), "bos_token_id")
    eos = gen_eos or id_list(hf.get("eos_token_id"), "eos_token_id")
    return ModelConfig(
        vocab_size=positive_int(hf, "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_q_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        intermediate_size=positive_int(hf, "intermediate_size"),
        rms_norm_eps=number(hf, "rms_norm_eps", defaults["rms_norm_eps"]),
        tie_word_embeddings=flag(hf, "tie_word_embeddings", defaults["tie_word_embeddings"]),
        dtype=dtype,
        bos_token_id=bos,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        sliding_windows=sliding_windows,
        **rope,
        moe=_moe(hf, model_type, num_layers),
        quantization=_quantization(hf, num_layers),
        **gemma,
        **_FAMILIES[model_type],
    )


def _moe(hf: dict, model_type: str, num_layers: int) -> MoEConfig | None:
    """ModelConfig.moe of a Mixtral or Qwen3-MoE config (None for the dense families). Mixtral's experts are
    `intermediate_size` wide and its router takes the top-k logits, then their softmax; Qwen3-MoE's are
    `moe_intermediate_size` wide, its router a softmax over every expert, then the top k (renormalized with
    `norm_topk_prob`). Qwen3-MoE's dense layers (`decoder_sparse_step` > 1, `mlp_only_layers`) are refused."""
    if model_type not in ("mixtral", "qwen3_moe"):
        return None
    defaults = _DEFAULTS[model_type]
    # transformers 5 writes num_local_experts for both (Qwen3-MoE's num_experts is an alias of it); 4 wrote
    # Qwen3-MoE's as num_experts.
    key = "num_experts" if hf.get("num_local_experts") is None and hf.get("num_experts") is not None else \
        "num_local_experts"
    num_experts = positive_int(hf, key, defaults["num_local_experts"])
    top_k = positive_int(hf, "num_experts_per_tok", defaults["num_experts_per_tok"])
    if top_k > num_experts:
        raise ValueError(f"field 'num_experts_per_tok' = {top_k} exceeds the {num_experts} experts ({key!r})")
    if model_type == "mixtral":
        return MoEConfig(num_experts, top_k, positive_int(hf, "intermediate_size"), router="topk_softmax")
    step = positive_int(hf, "decoder_sparse_step", 1)
    if step != 1:
        raise ValueError(f"field 'decoder_sparse_step' = {step} is not supported (only 1: every layer sparse)")
    dense_layers = hf.get("mlp_only_layers") or []
    if not isinstance(dense_layers, list) or any(not is_int(i) or not 0 <= i < num_layers for i in dense_layers):
        raise ValueError(f"field 'mlp_only_layers': expected a list of layer indices, got {dense_layers!r}")
    if dense_layers:
        raise ValueError(f"field 'mlp_only_layers' = {dense_layers} is not supported (dense MLP layers between "
                         "sparse ones)")
    return MoEConfig(num_experts, top_k, positive_int(hf, "moe_intermediate_size", defaults["moe_intermediate_size"]),
                     router="softmax_topk", norm_topk_prob=flag(hf, "norm_topk_prob", defaults["norm_topk_prob"]))


def _check_unsupported(hf: dict, model_type: str) -> None:
    """ValueError naming the first field whose value pagedjax cannot compute exactly for this family."""
    if model_type in _GEMMA:
        # transformers' Gemma reads hidden_activation (older configs also carry a hidden_act it ignores).
        act = hf.get("hidden_activation") or _GEMMA_ACTIVATION
        if act != _GEMMA_ACTIVATION:
            raise ValueError(f"field 'hidden_activation' = {act!r} is not supported for {model_type} "
                             f"(only {_GEMMA_ACTIVATION})")
        if flag(hf, "use_bidirectional_attention", False):
            raise ValueError("field 'use_bidirectional_attention' = true is not supported (attention is causal)")
    else:
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"field 'hidden_act' = {act!r} is not supported (only silu)")
    if model_type == "gemma3_text" and hf.get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 never applies it: computing it would disagree with transformers, ignoring it
        # with the checkpoint's intent.
        raise ValueError(f"field 'attn_logit_softcapping' = {hf['attn_logit_softcapping']!r} is not supported for "
                         "gemma3_text (transformers does not apply it)")
    if flag(hf, "mlp_bias", False):
        raise ValueError("field 'mlp_bias' = true is not supported (MLP projections have no bias)")
    if model_type in _O_PROJ_BIAS and flag(hf, "attention_bias", False):
        raise ValueError(f"field 'attention_bias' = true is not supported for {model_type} "
                         "(it also biases o_proj)")


# Vision-language models, served as models of the public contract (`pagedjax.model.loading.hf_vision`): LLaVA and
# Gemma 3 with images.
VISION_MODEL_TYPES = ("llava", "gemma3")

# DeepSeek V2 / V3 / V3.2 and GLM-5 (`pagedjax.config.deepseek.DeepSeekConfig`, served by `pagedjax.model.deepseek`).
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa")
# Hybrids of recurrent-state layers and attention (`pagedjax.model.families.qwen3_next`, `.nemotron_h`), models of
# the contract.
HYBRID_MODEL_TYPES = qwen3_next.MODEL_TYPES + nemotron_h.MODEL_TYPES  # gated DeltaNet / Mamba-2 state + attention
# What `from_pretrained` and `--model` load, by the route `pagedjax.model.loading.loader` dispatches a Hugging Face
# folder on (after a factory registered for its model_type): the families a ModelConfig describes, then the
# built-in models of the public contract. The refusal of any other model_type lists them from here.
LOADABLE_MODEL_TYPES: dict[str, tuple[str, ...]] = {
    "": SUPPORTED_MODEL_TYPES, "DeepSeek ": DEEPSEEK_MODEL_TYPES, "with images ": VISION_MODEL_TYPES,
    "hybrid recurrent ": HYBRID_MODEL_TYPES}


def load_qwen3_next_config(path: str | os.PathLike, dtype: str | None = None):
    """Map a Qwen3-Next or Qwen3.5 Hugging Face folder's `config.json` (and `generation_config.json`'s stop tokens) to a
    `pagedjax.model.families.qwen3_next.Qwen3NextConfig` (`qwen3_next.config_from_hf`: what it maps and refuses);
    `dtype` as `load_hf_config`'s. ModelLoadError naming the file and field."""
    return load_folder_config(path, lambda hf, bos, eos: qwen3_next.config_from_hf(hf, dtype, bos, eos))


def load_nemotron_h_config(path: str | os.PathLike, dtype: str | None = None):
    """Map a Nemotron-H Hugging Face folder's `config.json` (and `generation_config.json`'s stop tokens) to a
    `pagedjax.model.families.nemotron_h.NemotronHConfig` (`nemotron_h.config_from_hf`: what it maps and refuses);
    `dtype` as `load_hf_config`'s. ModelLoadError naming the file and field."""
    return load_folder_config(path, lambda hf, bos, eos: nemotron_h.config_from_hf(hf, dtype, bos, eos))


def loadable_model_types() -> str:
    """'from_pretrained and --model load llama, ...; DeepSeek deepseek_v2, ...; with images llava, gemma3' (and
    the model_types registered in `pagedjax.ModelRegistry` in this process), from `LOADABLE_MODEL_TYPES`."""
    from pagedjax.model.registry import ModelRegistry

    groups = [f"{label}{', '.join(types)}" for label, types in LOADABLE_MODEL_TYPES.items()]
    registered = ModelRegistry.model_types()
    if registered:
        groups.append(f"registered {', '.join(registered)}")
    return f"from_pretrained and --model load {'; '.join(groups)}"


# transformers' defaults for the fields a DeepSeek config.json may leave out.
_DEEPSEEK_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                    "tie_word_embeddings": False, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
                    "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2,
                    "moe_intermediate_size": 1407, "first_k_dense_replace": 0, "routed_scaling_factor": 1.0,
                    "topk_method": "greedy", "norm_topk_prob": False},
    "deepseek_v3": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                    "tie_word_embeddings": False, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
                    "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
                    "moe_intermediate_size": 2048, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5,
                    "topk_method": "noaux_tc", "norm_topk_prob": True, "n_group": 8, "topk_group": 4,
                    "num_experts_per_tok": 8, "rope_interleave": True},
    "deepseek_v32": {"max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                     "tie_word_embeddings": False, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
                     "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
                     "moe_intermediate_size": 2048, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5,
                     "topk_method": "noaux_tc", "norm_topk_prob": True, "n_group": 8, "topk_group": 4,
                     "num_experts_per_tok": 8, "rope_interleave": True, "index_n_heads": 64, "index_head_dim": 128,
                     "index_topk": 2048},
    "glm_moe_dsa": {"max_position_embeddings": 202752, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                    "tie_word_embeddings": False, "kv_lora_rank": 512, "q_lora_rank": 2048, "qk_rope_head_dim": 64,
                    "qk_nope_head_dim": 192, "v_head_dim": 256, "n_routed_experts": 256, "n_shared_experts": 1,
                    "moe_intermediate_size": 2048, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5,
                    "topk_method": "noaux_tc", "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
                    "num_experts_per_tok": 8, "rope_interleave": True, "index_n_heads": 32, "index_head_dim": 128,
                    "index_topk": 2048},
}
# The sparse-attention types (an indexer, `DeepSeekConfig.indexer`): V3.2's, and GLM-5's (its indexer rotates
# interleaved pairs, and its "shared" layers read the previous indexed layer's selection).
_DSA_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
# What each family's transformers model computes whatever config.json says, and what a checkpoint declaring
# otherwise would mean instead (so refused): V2 softmax-scores its experts, V3 takes sigmoid scores with the
# correction bias ("noaux_tc").
_DEEPSEEK_ROUTING = {"deepseek_v2": ("softmax", ("greedy", "group_limited_greedy")),
                     "deepseek_v3": ("sigmoid", ("noaux_tc",)), "deepseek_v32": ("sigmoid", ("noaux_tc",)),
                     "glm_moe_dsa": ("sigmoid", ("noaux_tc",))}
_ROPE_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def load_deepseek_config(path: str | os.PathLike, dtype: str | None = None):
    """Map a DeepSeek V2 / V3 / V3.2 Hugging Face folder's `config.json` (`model_type` "deepseek_v2" /
    "deepseek_v3" / "deepseek_v32", and `generation_config.json`'s stop tokens) to a
    `pagedjax.config.deepseek.DeepSeekConfig`, as transformers' `DeepseekV2ForCausalLM` / `DeepseekV3ForCausalLM`
    / `DeepseekV32ForCausalLM` compute it; `dtype` as `load_hf_config`'s. V3.2's `index_n_heads`,
    `index_head_dim` and `index_topk` are its `indexer`; V3.2 always has a query latent (`q_lora_rank`), rotates
    MLA's pairs interleaved (`rope_interleave` false refused) and takes its MoE layers from `mlp_layer_types`
    (which must be dense layers then sparse ones); its `layer_types` must all be "indexed_attention". GLM-5
    ("glm_moe_dsa", transformers' `GlmMoeDsaForCausalLM`) is V3.2's definition but for its indexer, which rotates
    interleaved pairs, and its `indexer_types` (or the `index_topk_pattern` / `index_topk_freq` /
    `index_skip_topk_offset` they derive from, as transformers derives them): a "shared" layer has no indexer and
    reads the previous "full" layer's selection (`DeepSeekIndexerConfig.shared_layers`; layer 0 must be "full").

    Refused with a ModelLoadError naming the file and field: anything those classes do not compute as the
    checkpoint declares it (a V2 config asking for `norm_topk_prob`, `moe_layer_freq` != 1, a V3 `topk_method`
    other than "noaux_tc", a V2 `rope_interleave` false, `scoring_func` other than the family's), `hidden_act`
    other than silu, `attention_bias`, `mlp_bias`, RoPE scaling other than YaRN, partial rotary, pre-quantized
    weights other than block-scaled FP8 (`pagedjax.model.loading.hf_fp8`: dequantized at load).
    `num_key_value_heads` is not read (MLA has no KV heads; transformers' attention does not read it either);
    `num_nextn_predict_layers` neither (the multi-token-prediction layers are not served)."""
    return load_folder_config(path, lambda hf, bos, eos: _deepseek_from_hf(hf, dtype, bos, eos))


def _deepseek_from_hf(hf: dict, dtype: str | None, gen_bos: int | None, gen_eos: tuple[int, ...]):
    from pagedjax.config.deepseek import DeepSeekConfig

    model_type = hf.get("model_type")
    if model_type not in DEEPSEEK_MODEL_TYPES:
        raise ValueError(f"field 'model_type' = {model_type!r} is not a DeepSeek one "
                         f"({', '.join(DEEPSEEK_MODEL_TYPES)})")
    defaults = _DEEPSEEK_DEFAULTS[model_type]
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"field 'hidden_act' = {act!r} is not supported (only silu)")
    for key in ("attention_bias", "mlp_bias"):
        if flag(hf, key, False):
            raise ValueError(f"field {key!r} = true is not supported (the projections have no bias)")
    if hf.get("quantization_config") is not None:  # block-scaled FP8 weights, dequantized at load (`hf_fp8`)
        from pagedjax.model.loading.hf_fp8 import block_size

        try:
            block_size(hf["quantization_config"])
        except ValueError as e:
            raise ValueError(f"field 'quantization_config': {e}") from None
    interleave = flag(hf, "rope_interleave", True)
    if model_type in ("deepseek_v2", *_DSA_MODEL_TYPES) and not interleave:
        raise ValueError(f"field 'rope_interleave' = false is not supported for {model_type} (transformers' "
                         "model always rotates MLA's interleaved pairs)")
    num_layers = positive_int(hf, "num_hidden_layers")
    max_pos = positive_int(hf, "max_position_embeddings", defaults["max_position_embeddings"])
    rope_dim = positive_int(hf, "qk_rope_head_dim", defaults["qk_rope_head_dim"])
    theta, yarn = _deepseek_rope(hf, defaults["rope_theta"], max_pos)
    q_lora = hf.get("q_lora_rank", defaults["q_lora_rank"])
    if model_type in _DSA_MODEL_TYPES and q_lora is None:
        raise ValueError(f"field 'q_lora_rank' = null is not supported for {model_type} (transformers' model always "
                         "projects the query through its latent, which the indexer reads)")
    bos = gen_bos if gen_bos is not None else optional_id(hf.get("bos_token_id"), "bos_token_id")
    eos = gen_eos or id_list(hf.get("eos_token_id"), "eos_token_id")
    nope = hf.get("qk_nope_head_dim", defaults["qk_nope_head_dim"])
    if not is_int(nope) or nope < 0:
        raise ValueError(f"field 'qk_nope_head_dim': expected an int >= 0, got {nope!r}")
    return DeepSeekConfig(
        vocab_size=positive_int(hf, "vocab_size"),
        hidden_size=positive_int(hf, "hidden_size"),
        num_layers=num_layers,
        num_heads=positive_int(hf, "num_attention_heads"),
        intermediate_size=positive_int(hf, "intermediate_size"),
        kv_lora_rank=positive_int(hf, "kv_lora_rank", defaults["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=positive_int(hf, "v_head_dim", defaults["v_head_dim"]),
        q_lora_rank=None if q_lora is None else positive_int(hf, "q_lora_rank", defaults["q_lora_rank"]),
        rope_theta=theta,
        rope_scaling=yarn,
        rope_interleave=interleave,
        rms_norm_eps=number(hf, "rms_norm_eps", defaults["rms_norm_eps"]),
        tie_word_embeddings=flag(hf, "tie_word_embeddings", defaults["tie_word_embeddings"]),
        max_position_embeddings=max_pos,
        dtype=checkpoint_dtype(hf, dtype),
        bos_token_id=bos,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        moe=_deepseek_moe(hf, model_type, num_layers),
        indexer=_deepseek_indexer(hf, num_layers, model_type) if model_type in _DSA_MODEL_TYPES else None,
    )


def _deepseek_indexer(hf: dict, num_layers: int, model_type: str):
    """DeepSeekConfig.indexer of a "deepseek_v32" config (every layer's lightning indexer) or a "glm_moe_dsa"
    one (interleaved rotation; "shared" layers by `indexer_types`)."""
    from pagedjax.config.deepseek import DeepSeekIndexerConfig

    defaults = _DEEPSEEK_DEFAULTS[model_type]
    kinds = hf.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list) or kinds != ["indexed_attention"] * num_layers):
        raise ValueError(f"field 'layer_types' = {kinds!r} is not supported (every one of the {num_layers} layers "
                         "must be 'indexed_attention': sparse attention)")
    glm = model_type == "glm_moe_dsa"
    shared = _glm_shared_layers(hf, num_layers) if glm else ()
    return DeepSeekIndexerConfig(num_heads=positive_int(hf, "index_n_heads", defaults["index_n_heads"]),
                                 head_dim=positive_int(hf, "index_head_dim", defaults["index_head_dim"]),
                                 topk=positive_int(hf, "index_topk", defaults["index_topk"]),
                                 rope_interleave=glm, shared_layers=shared)


def _glm_shared_layers(hf: dict, num_layers: int) -> tuple[int, ...]:
    """GLM-5's "shared" layers: from `indexer_types`, else as transformers' `GlmMoeDsaConfig` derives them (an
    `index_topk_pattern` of "F" / "S", else layer i is "full" when max(i - index_skip_topk_offset + 1, 0) is a
    multiple of index_topk_freq: every layer with the defaults 1 and 2)."""
    kinds, field = hf.get("indexer_types"), "indexer_types"
    if kinds is None and hf.get("index_topk_pattern") is not None:
        pattern, field = hf["index_topk_pattern"], "index_topk_pattern"
        if isinstance(pattern, str):
            if set(pattern) - {"F", "S"}:
                raise ValueError(f"field 'index_topk_pattern' = {pattern!r}: expected letters F (full) and S (shared)")
            kinds = [{"F": "full", "S": "shared"}[c] for c in pattern]
        else:
            kinds = pattern
    if kinds is None:
        freq, offset = hf.get("index_topk_freq", 1), hf.get("index_skip_topk_offset", 2)
        for name, value in (("index_topk_freq", freq), ("index_skip_topk_offset", offset)):
            if not is_int(value):
                raise ValueError(f"field {name!r}: expected an int, got {value!r}")
        kinds = ["full" if max(i - offset + 1, 0) % max(freq, 1) == 0 else "shared" for i in range(num_layers)]
    if not isinstance(kinds, list) or len(kinds) != num_layers or set(kinds) - {"full", "shared"}:
        raise ValueError(f"field {field!r} = {kinds!r}: expected 'full' or 'shared' for each of the {num_layers} "
                         "layers")
    if kinds[0] != "full":
        raise ValueError(f"field {field!r}: layer 0 is 'shared', but a shared layer reads the selection of a 'full' "
                         "layer before it")
    return tuple(i for i, kind in enumerate(kinds) if kind == "shared")


def _deepseek_rope(hf: dict, default_theta: float, max_pos: int) -> tuple[float, tuple | None]:
    """(rope_theta, DeepSeekConfig.rope_scaling): none, or YaRN's parameters as transformers completes them
    (`factor` null: max_position_embeddings / original_max_position_embeddings; the original length from the
    top-level field when there is one, else max_position_embeddings)."""
    from pagedjax.config.deepseek import ROPE_YARN_PARAMS

    params, field = rope_source(hf)
    theta = number(params, "rope_theta", number(hf, "rope_theta", default_theta))
    partial = number(params if params.get("partial_rotary_factor") is not None else hf, "partial_rotary_factor",
                      1.0)
    if partial != 1.0:
        raise ValueError(f"field 'partial_rotary_factor' = {partial!r}: only full rotary embeddings are supported")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ValueError(f"field {field!r}: rope type {kind!r} is not supported for DeepSeek (supported: default, "
                         "yarn)")
    unknown = sorted(set(params) - set(_ROPE_KEYS) - set(ROPE_YARN_PARAMS))
    if unknown:
        raise ValueError(f"field {field!r}: YaRN parameters {unknown} are not supported")
    yarn = {k: v for k, v in params.items() if k in ROPE_YARN_PARAMS and v is not None}
    if hf.get("original_max_position_embeddings") is not None:  # transformers prefers the top-level one
        yarn["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    yarn.setdefault("original_max_position_embeddings", max_pos)
    original = number(yarn, "original_max_position_embeddings")
    yarn.setdefault("factor", max_pos / original)
    for key in yarn:  # each value's type, the field named, before the config checks the ranges
        if key == "truncate":
            flag(yarn, key, True)
        else:
            number(yarn, key)
    return theta, tuple(sorted(yarn.items()))


def _deepseek_moe(hf: dict, model_type: str, num_layers: int):
    """DeepSeekConfig.moe: the routed and shared experts of the layers from `first_k_dense_replace` on."""
    from pagedjax.config.deepseek import DeepSeekMoEConfig

    defaults = _DEEPSEEK_DEFAULTS[model_type]
    scoring, methods = _DEEPSEEK_ROUTING[model_type]
    if hf.get("scoring_func", scoring) != scoring:
        raise ValueError(f"field 'scoring_func' = {hf['scoring_func']!r} is not supported for {model_type} "
                         f"(transformers scores its experts by {scoring})")
    method = hf.get("topk_method") or defaults["topk_method"]
    if method not in methods:
        raise ValueError(f"field 'topk_method' = {method!r} is not supported for {model_type} (supported: "
                         f"{', '.join(methods)})")
    freq = hf.get("moe_layer_freq", 1)
    if freq != 1:
        raise ValueError(f"field 'moe_layer_freq' = {freq!r} is not supported (only 1: transformers makes every "
                         "layer from first_k_dense_replace on a mixture of experts)")
    norm = flag(hf, "norm_topk_prob", defaults["norm_topk_prob"])
    if model_type == "deepseek_v2" and norm:
        raise ValueError("field 'norm_topk_prob' = true is not supported for deepseek_v2 (transformers' DeepSeek V2 "
                         "router does not renormalize)")
    first_dense = hf.get("first_k_dense_replace", defaults["first_k_dense_replace"])
    if not is_int(first_dense) or not 0 <= first_dense <= num_layers:
        raise ValueError(f"field 'first_k_dense_replace': expected an int in [0, num_hidden_layers], got "
                         f"{first_dense!r}")
    kinds = hf.get("mlp_layer_types") if model_type in _DSA_MODEL_TYPES else None
    if kinds is not None:  # what transformers' V3.2 reads (first_k_dense_replace only derives its default)
        dense = kinds.count("dense") if isinstance(kinds, list) else -1
        if dense < 0 or kinds != ["dense"] * dense + ["sparse"] * (num_layers - dense):
            raise ValueError(f"field 'mlp_layer_types' = {kinds!r} is not supported (only 'dense' layers then "
                             f"'sparse' ones, {num_layers} in all)")
        first_dense = dense
    num_experts = positive_int(hf, "n_routed_experts", defaults["n_routed_experts"])
    top_k = positive_int(hf, "num_experts_per_tok", defaults.get("num_experts_per_tok"))
    if top_k > num_experts:
        raise ValueError(f"field 'num_experts_per_tok' = {top_k} exceeds the {num_experts} experts "
                         "('n_routed_experts')")
    groups = (1, 1) if method == "greedy" else (positive_int(hf, "n_group", defaults.get("n_group")),
                                                positive_int(hf, "topk_group", defaults.get("topk_group")))
    return DeepSeekMoEConfig(
        num_experts=num_experts, num_experts_per_tok=top_k,
        intermediate_size=positive_int(hf, "moe_intermediate_size", defaults["moe_intermediate_size"]),
        num_shared_experts=positive_int(hf, "n_shared_experts", defaults["n_shared_experts"]),
        first_k_dense_replace=first_dense, router=method, num_groups=groups[0], topk_groups=groups[1],
        norm_topk_prob=norm, routed_scaling_factor=number(hf, "routed_scaling_factor",
                                                           defaults["routed_scaling_factor"]))
