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
`sliding_window_pattern`-th: Gemma 2 alternates, Gemma 3 defaults to 6). A gemma3_text config with
`use_bidirectional_attention` (EmbeddingGemma) is `ModelConfig.bidirectional`, its window w becoming w // 2 + 1
both ways, as transformers computes it.

Anything pagedjax cannot compute exactly (unknown `model_type`, `hidden_act` other than silu (Gemma:
`hidden_activation` other than gelu_pytorch_tanh), `mlp_bias`, `attention_bias` where it also biases o_proj,
rope scaling other than `pagedjax.config.ROPE_TYPES` (YaRN: gpt_oss only), partial rotary, quantized weights,
bidirectional attention but EmbeddingGemma's, Gemma 3's `attn_logit_softcapping` (which transformers does not
apply), ...) and any field of the wrong type (`"hidden_size": "256"`, `2.0`) or invalid JSON raises a
`ModelLoadError` (a ValueError) naming the file and field: never silently wrong output. Phi-3's LongRoPE
("longrope", "su") is computed exactly within `original_max_position_embeddings`, to which the context is capped
(with a warning): its long factors are not implemented.

The families served as models of the public contract (DeepSeek V2 / V3 / V3.2 and GLM-5, Qwen3-Next and Qwen3.5,
Nemotron-H, LLaVA and Gemma 3 with images: `pagedjax.model.families.FAMILIES`) map in their own modules
(`<module>.load_config`); `load_hf_config` refuses them, naming it (the vision models' text decoders map with
`config_from_dict`). An unknown `model_type` is refused with the list of every one `from_pretrained` loads
(`loadable_model_types`: these, the families, and the types registered in `pagedjax.ModelRegistry`).

The weights are read by `pagedjax.model.loading.hf_loader`.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from pagedjax.config import ModelConfig
from pagedjax.config.fields import is_int
from pagedjax.config.model import ROPE_SCALING_PARAMS, ROPE_TYPES
from pagedjax.config.moe import MoEConfig
from pagedjax.model import families
from pagedjax.model.classifier import is_classifier
from pagedjax.model.families import family_of, gpt_oss
from pagedjax.model.loading.hf_fields import (
    checkpoint_dtype,
    flag,
    id_list,
    layer_types,
    load_folder_config,
    number,
    optional_id,
    positive_int,
    rope_source,
    rope_theta_and_type,
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
    theta, kind = rope_theta_and_type(hf, params, field, top_theta)
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
    family = family_of(model_type)
    if family is not None:
        raise ValueError(f"field 'model_type' = {model_type!r}: a {family.label} model, not a ModelConfig one; "
                         f"LLMEngine.from_pretrained and --model serve it ({family.module}), and "
                         f"{family.module}.load_config maps its config")
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
    # EmbeddingGemma: attention both ways, a local layer's query at p seeing keys j with |p - j| < w // 2 + 1
    # (transformers halves the window: `Gemma3TextConfig.__post_init__`, `_bidirectional_window_overlay`).
    bidirectional = model_type == "gemma3_text" and flag(hf, "use_bidirectional_attention", False)
    if bidirectional and sliding_windows is not None:
        sliding_windows = tuple(None if w is None else w // 2 + 1 for w in sliding_windows)
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
        # A sequence classifier has no LM head: the embedding matrix stands in (`pagedjax.model.classifier`)
        tie_word_embeddings=flag(hf, "tie_word_embeddings", defaults["tie_word_embeddings"]) or is_classifier(hf),
        dtype=dtype,
        bos_token_id=bos,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        sliding_windows=sliding_windows,
        bidirectional=bidirectional,
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
        if model_type != "gemma3_text" and flag(hf, "use_bidirectional_attention", False):
            raise ValueError(f"field 'use_bidirectional_attention' = true is not supported for {model_type} "
                             "(only gemma3_text: EmbeddingGemma)")
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


def loadable_model_types() -> str:
    """'from_pretrained and --model load llama, ...; DeepSeek deepseek_v2, ...; with images llava, gemma3' (and
    the model_types registered in `pagedjax.ModelRegistry` in this process): what `pagedjax.model.loading.loader`
    dispatches a Hugging Face folder to (after a factory registered for its model_type), the families a ModelConfig
    describes, then the built-in models of the contract by `pagedjax.model.families.FAMILIES`' labels."""
    from pagedjax.model.registry import ModelRegistry

    labels: dict[str, list[str]] = {}
    for family in families.FAMILIES:  # read when called: the registry as it is then
        labels.setdefault(family.label, []).extend(family.model_types)
    groups = [", ".join(SUPPORTED_MODEL_TYPES), *(f"{label} {', '.join(types)}" for label, types in labels.items())]
    registered = ModelRegistry.model_types()
    if registered:
        groups.append(f"registered {', '.join(registered)}")
    return f"from_pretrained and --model load {'; '.join(groups)}"
