"""Qwen3-Next (`model_type` "qwen3_next", transformers' `Qwen3NextForCausalLM`) and Qwen3.5 (its successor:
"qwen3_5_text" / "qwen3_5_moe_text", `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM`, and the text of "qwen3_5" /
"qwen3_5_moe", `Qwen3_5(Moe)ForConditionalGeneration`): a hybrid decoder of gated DeltaNet (linear attention) layers
and gated full-attention layers, each followed by a dense SwiGLU MLP or a sparse mixture of experts with a gated
shared expert. A model of the public contract (`pagedjax.model.api`): the linear layers keep their recurrent state
and conv window as `RecurrentState` snapshots in the paged cache (a pool of their own, snapshots valid at block
boundaries: prefix hits, chunked prefill, preemption and forks stay exact), the full layers K/V pages as any
`FullAttention` layer. What is here: the config (`Qwen3NextConfig`, mapped from config.json by `config_from_hf`), the
model (`Qwen3Next`) and its checkpoint names (`tensor_names`, `TEXT_PREFIX`); the weights are read by
`load`. Qwen3.5 is a variant of this module, not a module of its own:
transformers builds it from Qwen3-Next's classes (`Qwen3_5TextConfig(Qwen3NextConfig)`, `Qwen3_5GatedDeltaNet(
Qwen3NextGatedDeltaNet)`, Qwen3-Next's attention, MLP, MoE block and norms) and what differs is a few switches of the
config (below), so each concept keeps one home.

The model, as transformers computes it (transformers 5.x, `models/qwen3_next/modeling_qwen3_next.py`):
  - every norm is a zero-centred RMSNorm, `(1 + w) * normed` in float32, rounded once (`RMSNorm(offset=True)`);
    blocks are pre-norm: x += mixer(input_layernorm(x)); x += mlp(post_attention_layernorm(x));
  - "full_attention" layers (`layer_types`): `q_proj` gives per head a query and an output gate (`[heads, 2 *
    head_dim]`, query first), q / k RMSNorm per head, RoPE on the first `partial_rotary_factor * head_dim` dims
    (rotate-half, base `rope_theta`), GQA, then `o_proj(attn * sigmoid(gate))`;
  - "linear_attention" layers, the gated DeltaNet: `in_proj_qkvz` gives per key head q, k `[Dk]` and its
    Hv / Hk value heads' v, z `[Dv]`; `in_proj_ba` per key head its value heads' b, a; the concatenation [q | k | v]
    (key heads, then value heads, flattened) passes a causal depthwise conv1d of `linear_conv_kernel_dim` taps and
    SiLU (`pagedjax.device.recurrent.causal_conv1d`); beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias);
    the gated delta rule with L2-normalised q / k (`pagedjax.device.recurrent.gated_delta_rule`); per value head a
    gated RMSNorm `w * normed * silu(z)` (w around 1, not zero-centred); `out_proj`;
  - the MLP of layer i is a sparse MoE unless i is in `mlp_only_layers`, `num_experts` is 0 or (i + 1) is not a
    multiple of `decoder_sparse_step` (then a SwiGLU of `intermediate_size`). The MoE: router `mlp.gate` (no bias),
    softmax over all experts, top `num_experts_per_tok`, renormalised when `norm_topk_prob`; experts SwiGLUs of
    `moe_intermediate_size` (`pagedjax.model.layers.moe.Experts`, through `combine_experts`); plus
    `sigmoid(shared_expert_gate(x)) * shared_expert(x)`, a SwiGLU of `shared_expert_intermediate_size`.

Qwen3.5, as transformers computes it (`models/qwen3_5/modular_qwen3_5.py`, `models/qwen3_5_moe/`), differs in:
  - the gated DeltaNet's input projections: four separate ones (`in_proj_qkv` giving [q | k | v] already in the
    conv's channel order: all key heads' q, then k, then the value heads' v; `in_proj_z` per value head; `in_proj_b`
    and `in_proj_a` one per value head) instead of Qwen3-Next's per-key-head interleaved `in_proj_qkvz` and
    `in_proj_ba` (`Qwen3NextConfig.fused_projections` False); the conv, the rule and the gated norm are Qwen3-Next's;
  - the rotary embedding: interleaved multimodal RoPE (`mrope_section` splits the frequencies among temporal,
    height and width positions). A text-only sequence gives all three the same position (`Qwen3_5TextModel`'s
    position ids, and `get_rope_index` without images), so each frequency sees the token's position and the result
    is Qwen3-Next's rotate-half RoPE on the first `partial_rotary_factor * head_dim` dims, frequencies in the usual
    order (`mrope_section` / `mrope_interleaved` are accepted and change nothing for text);
  - the MLP: "qwen3_5_text" has a dense SwiGLU in every layer (no MoE fields); "qwen3_5_moe_text" the sparse MoE with
    the shared expert in every layer, its router always renormalising the top k (`Qwen3VLMoeTextTopKRouter`);
  - the checkpoint: a CausalLM's tensors under `model.`; a ForConditionalGeneration's (`model_type` "qwen3_5" /
    "qwen3_5_moe") under `model.language_model.` beside the vision tower's `model.visual.*` (not read: pagedjax
    serves its text only, and a prompt with images is refused by the engine: this model takes no images), its
    `text_config` the decoder's config, and its top-level `tie_word_embeddings` the one transformers ties by.

Refused with a ValueError naming the field: `hidden_act` other than silu, `attention_bias`, `attn_output_gate` false,
rope types other than "default", an odd rotary width, `quantization_config`, layer types other than the two, a model
without a full-attention layer (the engine sizes its pools by a KV pool of token pages), value heads not a
multiple of key heads, `mlp_only_layers` out of range, top-k past the experts, fields of the wrong type; for Qwen3.5
also MoE fields in the dense "qwen3_5_text" (`num_experts`), in "qwen3_5_moe_text" a dense layer (`mlp_only_layers`,
`decoder_sparse_step`), `norm_topk_prob` false or no experts, and a conditional-generation folder's `text_config`
missing or of another model_type.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from pagedjax.config import ModelSpec
from pagedjax.config.kv_spec import FullAttention, RecurrentState, StatePages
from pagedjax.config.parallel import TP
from pagedjax.device.recurrent import causal_conv1d, gated_delta_rule
from pagedjax.model.api import PagedAttention, PagedKVCache, forward_on_fresh_pages
from pagedjax.model.errors import read_json
from pagedjax.model.families import model_types_of
from pagedjax.model.layers.conv import Conv1d
from pagedjax.model.layers.linear import apply_linear
from pagedjax.model.layers.moe import Experts, combine_experts, per_expert_params, route
from pagedjax.model.layers.rope import RoPE
from pagedjax.model.llama import Linear, RMSNorm
from pagedjax.model.loading.hf_fields import (
    checkpoint_dtype,
    flag,
    id_list,
    load_folder_config,
    number,
    optional_id,
    positive_int,
    rope_source,
)
from pagedjax.model.loading.hf_loader import IGNORED_SUFFIXES, fill_state, folder_tokenizer, hf_names
from pagedjax.parallel.recurrent import over_heads

# Qwen3.5's text decoders (CausalLM checkpoints) -> whether every layer's MLP is the sparse MoE.
QWEN3_5_TEXT_TYPES = {"qwen3_5_text": False, "qwen3_5_moe_text": True}
# Qwen3.5's conditional-generation checkpoints (vision tower + text decoder) -> their text_config's model_type.
QWEN3_5_MULTIMODAL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
MODEL_TYPES = model_types_of(__name__)  # "qwen3_next", QWEN3_5_TEXT_TYPES, QWEN3_5_MULTIMODAL_TYPES
LAYER_TYPES = ("linear_attention", "full_attention")
# Where a checkpoint keeps the decoder's tensors (`model.embed_tokens.weight`, ...; `lm_head.weight` is top-level).
TEXT_PREFIX = {**dict.fromkeys(("qwen3_next", *QWEN3_5_TEXT_TYPES), "model."),
               **dict.fromkeys(QWEN3_5_MULTIMODAL_TYPES, "model.language_model.")}
# Qwen3NextConfig's defaults of the fields a config.json may leave out.
_DEFAULTS = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48, num_attention_heads=16,
    num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
    head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=32, decoder_sparse_step=1, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, num_experts_per_tok=10, num_experts=512, norm_topk_prob=True,
    rope_theta=10000.0, partial_rotary_factor=0.25, full_attention_interval=4)
# Qwen3_5TextConfig's and Qwen3_5MoeTextConfig's (Qwen3NextConfig's where they do not override them).
_DEFAULTS_OF = {
    "qwen3_next": _DEFAULTS,
    "qwen3_5_text": {**_DEFAULTS, "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
                     "num_hidden_layers": 32, "num_key_value_heads": 4},
    "qwen3_5_moe_text": {**_DEFAULTS, "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
                         "num_experts_per_tok": 8, "num_experts": 256}}


@dataclass(frozen=True)
class Qwen3NextConfig:
    """A Qwen3-Next or Qwen3.5 decoder (module docstring). `layer_types[i]`: "linear_attention" or
    "full_attention"; `moe_layers[i]`: whether layer i's MLP is the sparse MoE; `fused_projections`: the gated
    DeltaNet's input projections are Qwen3-Next's interleaved `in_proj_qkvz` / `in_proj_ba` (True) or Qwen3.5's
    `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a` (False)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    linear_conv_kernel: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    intermediate_size: int
    moe_layers: tuple[bool, ...]
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    fused_projections: bool = True

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: [q | k | v] of every head."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def state_spec(self) -> RecurrentState:
        """A linear layer's snapshot: the delta rule's state `[Hv, Dk, Dv]` and the conv window `[conv_dim, K - 1]`."""
        return RecurrentState((self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim),
                              (self.conv_dim, self.linear_conv_kernel - 1))

    @property
    def spec(self) -> ModelSpec:
        attention = FullAttention(self.num_kv_heads, self.head_dim)
        layers = tuple(attention if t == "full_attention" else self.state_spec for t in self.layer_types)
        return ModelSpec(vocab_size=self.vocab_size, num_layers=self.num_layers, num_q_heads=self.num_heads,
                         kv_layers=layers, dtype=self.dtype, max_position_embeddings=self.max_position_embeddings,
                         eos_token_ids=self.eos_token_ids, bos_token_id=self.bos_token_id,
                         hidden_size=self.hidden_size)

    def replace(self, **changes) -> Qwen3NextConfig:
        return dataclasses.replace(self, **changes)


# ------------------------------------------------------------------------------------------------ config.json
def config_from_hf(hf: dict, dtype: str | None, gen_bos: int | None, gen_eos: tuple[int, ...]) -> Qwen3NextConfig:
    """The `Qwen3NextConfig` of a parsed qwen3_next / qwen3_5_text / qwen3_5_moe_text `config.json`, or of a qwen3_5
    / qwen3_5_moe one's `text_config` (the module docstring says what it maps and refuses); `dtype` overrides the
    checkpoint's, `gen_bos` / `gen_eos` (generation_config.json's) its stop tokens. ValueError naming the field."""
    model_type = hf.get("model_type", "qwen3_next")
    if model_type in QWEN3_5_MULTIMODAL_TYPES:
        hf, model_type = text_config(hf), QWEN3_5_MULTIMODAL_TYPES[model_type]
    if model_type not in _DEFAULTS_OF:
        raise ValueError(f"field 'model_type' = {model_type!r}: not a Qwen3-Next or Qwen3.5 model (supported: "
                         f"{', '.join(MODEL_TYPES)})")
    d = _DEFAULTS_OF[model_type]
    if hf.get("quantization_config") is not None:
        raise ValueError(f"field 'quantization_config': pre-quantized {model_type} checkpoints are not supported "
                         "(load a float one; quantization= quantizes it)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"field 'hidden_act' = {act!r}: only 'silu' is supported for {model_type}")
    if flag(hf, "attention_bias", False):
        raise ValueError(f"field 'attention_bias' = true is not supported for {model_type}")
    if not flag(hf, "attn_output_gate", True):  # transformers' attention always gates (q_proj: query and gate)
        raise ValueError(f"field 'attn_output_gate' = false is not supported for {model_type} (its attention "
                         "always has the output gate)")
    num_layers = positive_int(hf, "num_hidden_layers", d["num_hidden_layers"])
    kinds = _layer_types(hf, num_layers, d)
    num_heads = positive_int(hf, "num_attention_heads", d["num_attention_heads"])
    num_kv = positive_int(hf, "num_key_value_heads", d["num_key_value_heads"])
    if num_heads % num_kv:
        raise ValueError(f"'num_attention_heads' ({num_heads}) is not a multiple of 'num_key_value_heads' ({num_kv})")
    head_dim = positive_int(hf, "head_dim", d["head_dim"])
    theta, rotary_dim = _rope(hf, head_dim, model_type, d)
    hk = positive_int(hf, "linear_num_key_heads", d["linear_num_key_heads"])
    hv = positive_int(hf, "linear_num_value_heads", d["linear_num_value_heads"])
    if hv % hk:
        raise ValueError(f"field 'linear_num_value_heads' ({hv}) is not a multiple of 'linear_num_key_heads' ({hk})")
    kernel = positive_int(hf, "linear_conv_kernel_dim", d["linear_conv_kernel_dim"])
    if kernel < 2:
        raise ValueError(f"field 'linear_conv_kernel_dim' = {kernel}: a conv of one tap keeps no state (>= 2)")
    if model_type == "qwen3_next":
        moe = _moe(hf, num_layers, d)
    else:
        moe = _qwen3_5_mlp(hf, num_layers, model_type, d)
    intermediate = 0  # no dense layer: Qwen3.5-MoE has no intermediate_size
    if model_type == "qwen3_next" or not all(moe["moe_layers"]):
        intermediate = positive_int(hf, "intermediate_size", d["intermediate_size"])
    bos = gen_bos if gen_bos is not None else optional_id(hf.get("bos_token_id"), "bos_token_id")
    eos = gen_eos or id_list(hf.get("eos_token_id"), "eos_token_id")
    return Qwen3NextConfig(
        vocab_size=positive_int(hf, "vocab_size", d["vocab_size"]),
        hidden_size=positive_int(hf, "hidden_size", d["hidden_size"]), num_layers=num_layers, layer_types=kinds,
        num_heads=num_heads, num_kv_heads=num_kv, head_dim=head_dim, rotary_dim=rotary_dim, rope_theta=theta,
        linear_conv_kernel=kernel, linear_num_key_heads=hk, linear_num_value_heads=hv,
        linear_key_head_dim=positive_int(hf, "linear_key_head_dim", d["linear_key_head_dim"]),
        linear_value_head_dim=positive_int(hf, "linear_value_head_dim", d["linear_value_head_dim"]),
        intermediate_size=intermediate, **moe,
        rms_norm_eps=number(hf, "rms_norm_eps", d["rms_norm_eps"]),
        max_position_embeddings=positive_int(hf, "max_position_embeddings", d["max_position_embeddings"]),
        tie_word_embeddings=flag(hf, "tie_word_embeddings", d["tie_word_embeddings"]),
        dtype=checkpoint_dtype(hf, dtype), bos_token_id=bos, eos_token_ids=tuple(dict.fromkeys(eos)),
        fused_projections=model_type == "qwen3_next")


def text_config(hf: dict) -> dict:
    """The decoder's config of a Qwen3.5 conditional-generation `config.json` (`model_type` "qwen3_5" /
    "qwen3_5_moe"): its `text_config`, with the top level's `tie_word_embeddings` (the flag transformers ties the
    ForConditionalGeneration's lm_head by; False when absent, `Qwen3_5Config`'s default) and, where the text config
    has none, the top level's dtype and `quantization_config`. ValueError naming `text_config`."""
    model_type = hf["model_type"]
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"field 'text_config': a {model_type} folder needs its text decoder's config (an object), "
                         f"got {text!r}")
    want = QWEN3_5_MULTIMODAL_TYPES[model_type]
    inner = text.get("model_type", want)
    if inner != want:
        raise ValueError(f"field 'text_config': model_type {inner!r} in a {model_type} folder (expected {want!r})")
    text = {**text, "model_type": want, "tie_word_embeddings": flag(hf, "tie_word_embeddings", False)}
    for key in ("torch_dtype", "dtype", "quantization_config"):
        if text.get(key) is None and hf.get(key) is not None:
            text[key] = hf[key]
    return text


def _layer_types(hf: dict, num_layers: int, d: dict) -> tuple[str, ...]:
    """`layer_types`, or as transformers fills it: every `full_attention_interval`-th layer (default 4) full."""
    kinds = hf.get("layer_types")
    if kinds is None:
        every = positive_int(hf, "full_attention_interval", d["full_attention_interval"])
        kinds = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]
    if not isinstance(kinds, list) or not all(isinstance(t, str) for t in kinds):
        raise ValueError(f"field 'layer_types': expected a list of strings, got {kinds!r}")
    unknown = sorted(set(kinds) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"field 'layer_types': unsupported layer types {unknown} (supported: "
                         f"{', '.join(LAYER_TYPES)})")
    if len(kinds) != num_layers:
        raise ValueError(f"field 'layer_types': {len(kinds)} entries for {num_layers} layers")
    if "full_attention" not in kinds:
        raise ValueError("field 'layer_types': no 'full_attention' layer; pagedjax's Qwen3-Next / Qwen3.5 needs at "
                         "least one")
    return tuple(kinds)


def _rope(hf: dict, head_dim: int, model_type: str, d: dict) -> tuple[float, int]:
    """(rope_theta, rotary dims): default RoPE only, `partial_rotary_factor` of head_dim rotated (0.25 when absent,
    the configs' default). Qwen3.5's `mrope_section` / `mrope_interleaved` are accepted: for text the sections share
    the position (module docstring)."""
    params, field = rope_source(hf)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"field {field!r}: rope type {kind!r} is not supported for {model_type} (supported: "
                         "default)")
    known = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    if model_type != "qwen3_next":
        known |= {"mrope_section", "mrope_interleaved"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"field {field!r}: parameters {unknown} are not supported")
    theta = number(params, "rope_theta", number(hf, "rope_theta", d["rope_theta"]))
    source = params if params.get("partial_rotary_factor") is not None else hf
    factor = number(source, "partial_rotary_factor", d["partial_rotary_factor"])
    rotary = int(head_dim * factor)
    if not 0 < factor <= 1 or rotary < 2 or rotary % 2:
        raise ValueError(f"field 'partial_rotary_factor' = {factor!r}: rotates {rotary} of head_dim {head_dim} dims "
                         "(must be an even number >= 2)")
    return theta, rotary


def _moe(hf: dict, num_layers: int, d: dict) -> dict:
    """The MoE fields of a qwen3_next `Qwen3NextConfig`: which layers are sparse and their experts' shapes."""
    num_experts = hf.get("num_experts", d["num_experts"])
    if num_experts is None:
        num_experts = d["num_experts"]
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 0:
        raise ValueError(f"field 'num_experts': expected an int >= 0, got {num_experts!r}")
    step = positive_int(hf, "decoder_sparse_step", d["decoder_sparse_step"])
    only = hf.get("mlp_only_layers")
    only = [] if only is None else only
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ValueError(f"field 'mlp_only_layers': expected a list of layer indices, got {only!r}")
    if any(not 0 <= i < num_layers for i in only):
        raise ValueError(f"field 'mlp_only_layers': indices must be in [0, {num_layers}), got {only}")
    layers = tuple(i not in only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    if not any(layers):
        return dict(moe_layers=layers)
    return _experts(hf, layers, num_experts, flag(hf, "norm_topk_prob", d["norm_topk_prob"]), d)


def _qwen3_5_mlp(hf: dict, num_layers: int, model_type: str, d: dict) -> dict:
    """The MoE fields of a Qwen3.5 `Qwen3NextConfig`: no MoE in "qwen3_5_text"; in "qwen3_5_moe_text" every layer's,
    its top k renormalised (transformers' Qwen3.5 ignores `mlp_only_layers`, `decoder_sparse_step` and
    `norm_topk_prob`: a config asking otherwise is refused rather than served as something else)."""
    if not QWEN3_5_TEXT_TYPES[model_type]:
        if hf.get("num_experts"):
            raise ValueError(f"field 'num_experts' = {hf['num_experts']!r}: qwen3_5_text is the dense Qwen3.5 (its "
                             "MoE is model_type qwen3_5_moe_text)")
        return dict(moe_layers=(False,) * num_layers)
    if hf.get("mlp_only_layers"):
        raise ValueError(f"field 'mlp_only_layers' = {hf['mlp_only_layers']!r}: every layer of qwen3_5_moe_text is "
                         "sparse (transformers' Qwen3.5-MoE has no dense layers)")
    if positive_int(hf, "decoder_sparse_step", 1) != 1:
        raise ValueError(f"field 'decoder_sparse_step' = {hf['decoder_sparse_step']!r}: every layer of "
                         "qwen3_5_moe_text is sparse (transformers' Qwen3.5-MoE has no dense layers)")
    if not flag(hf, "norm_topk_prob", True):
        raise ValueError("field 'norm_topk_prob' = false: transformers' Qwen3.5-MoE router always renormalises the "
                         "top k")
    num_experts = positive_int(hf, "num_experts", d["num_experts"])
    return _experts(hf, (True,) * num_layers, num_experts, True, d)


def _experts(hf: dict, layers: tuple[bool, ...], num_experts: int, norm_topk_prob: bool, d: dict) -> dict:
    top_k = positive_int(hf, "num_experts_per_tok", d["num_experts_per_tok"])
    if top_k > num_experts:
        raise ValueError(f"field 'num_experts_per_tok' = {top_k} exceeds the {num_experts} experts ('num_experts')")
    return dict(moe_layers=layers, num_experts=num_experts, num_experts_per_tok=top_k,
                moe_intermediate_size=positive_int(hf, "moe_intermediate_size", d["moe_intermediate_size"]),
                shared_expert_intermediate_size=positive_int(hf, "shared_expert_intermediate_size",
                                                             d["shared_expert_intermediate_size"]),
                norm_topk_prob=norm_topk_prob)


# ------------------------------------------------------------------------------------------------------ model
def _linear(n_in: int, n_out: int, dtype, rngs: nnx.Rngs) -> Linear:
    acc = jnp.float32 if jnp.dtype(dtype).itemsize == 2 else None  # 16-bit: accumulate in float32, round once
    return Linear(n_in, n_out, use_bias=False, dtype=dtype, param_dtype=dtype, preferred_element_type=acc, rngs=rngs)


class GatedRMSNorm(nnx.Module):
    """transformers' `Qwen3NextRMSNormGated`: `w * normed` (normed rounded to x's dtype first) times silu(gate) in
    float32, rounded to x's dtype. w is the weight itself (initialised to ones), not an offset."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        y = (self.weight[...] * y).astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
        return y.astype(x.dtype)


class GatedDeltaNet(nnx.Module):
    """A "linear_attention" layer (module docstring), its state in the layer's `RecurrentState` snapshots."""

    def __init__(self, cfg: Qwen3NextConfig, layer_index: int, dtype, rngs: nnx.Rngs):
        self.layer_index = layer_index
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        key_dim, value_dim = self.hk * self.dk, cfg.value_dim
        self.fused = cfg.fused_projections
        if self.fused:  # Qwen3-Next
            self.in_proj_qkvz = _linear(cfg.hidden_size, 2 * key_dim + 2 * value_dim, dtype, rngs)
            self.in_proj_ba = _linear(cfg.hidden_size, 2 * self.hv, dtype, rngs)
        else:  # Qwen3.5
            self.in_proj_qkv = _linear(cfg.hidden_size, 2 * key_dim + value_dim, dtype, rngs)
            self.in_proj_z = _linear(cfg.hidden_size, value_dim, dtype, rngs)
            self.in_proj_b = _linear(cfg.hidden_size, self.hv, dtype, rngs)
            self.in_proj_a = _linear(cfg.hidden_size, self.hv, dtype, rngs)
        self.conv1d = Conv1d(cfg.conv_dim, cfg.linear_conv_kernel, dtype, rngs)
        self.dt_bias = nnx.Param(jnp.ones((self.hv,), dtype))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (self.hv,), jnp.float32, 0.01, 16))
                               .astype(dtype))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps, dtype)
        self.out_proj = _linear(value_dim, cfg.hidden_size, dtype, rngs)

    def _project(self, x: jax.Array) -> tuple[jax.Array, ...]:
        """x `[T, hidden]` -> (q, k `[T, Hk, Dk]`, v, z `[T, Hv, Dv]`, b, a `[T, Hv]`)."""
        t = x.shape[0]
        if not self.fused:  # Qwen3.5: [q | k | v] already in the conv's channel order, one projection each
            key_dim = self.hk * self.dk
            qkv = self.in_proj_qkv(x)
            q = qkv[:, :key_dim].reshape(t, self.hk, self.dk)
            k = qkv[:, key_dim:2 * key_dim].reshape(t, self.hk, self.dk)
            v = qkv[:, 2 * key_dim:].reshape(t, self.hv, self.dv)
            z = self.in_proj_z(x).reshape(t, self.hv, self.dv)
            return q, k, v, z, self.in_proj_b(x), self.in_proj_a(x)
        r = self.hv // self.hk  # value heads per key head
        qkvz = self.in_proj_qkvz(x).reshape(t, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = jnp.split(qkvz, np.cumsum([self.dk, self.dk, r * self.dv]), axis=-1)
        ba = self.in_proj_ba(x).reshape(t, self.hk, 2 * r)
        b, a = ba[..., :r].reshape(t, self.hv), ba[..., r:].reshape(t, self.hv)
        return q, k, v.reshape(t, self.hv, self.dv), z.reshape(t, self.hv, self.dv), b, a

    def _conv_weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The conv's taps `[conv_dim, K]` as the channels of each head: q's and k's `[Hk, Dk, K]`, v's
        `[Hv, Dv, K]`."""
        w, key_dim = self.conv1d.weight[...][:, 0, :], self.hk * self.dk
        return (w[:key_dim].reshape(self.hk, self.dk, -1), w[key_dim:2 * key_dim].reshape(self.hk, self.dk, -1),
                w[2 * key_dim:].reshape(self.hv, self.dv, -1))

    def __call__(self, x: jax.Array, cache: PagedKVCache) -> tuple[jax.Array, PagedKVCache]:
        """x `[T, hidden]` -> (`[T, hidden]`, the cache with this layer's snapshots written). Under tensor
        parallelism the conv, the rule and the snapshots run per device over its heads (`over_heads`), the
        projections split by heads (`Qwen3Next.param_partition`) and out_proj's partial products summed."""
        t, i = x.shape[0], self.layer_index
        q, k, v, z, b, a = self._project(x)
        core = functools.partial(_delta_net_core, block_size=cache.block_size_of(i), backend=cache.backend,
                                 decode_only=cache.decode_only)
        split = (q, k, v, b, a, *self._conv_weights(), self.A_log[...], self.dt_bias[...])
        if cache.mesh is None:
            o, pages = core(*split, cache.layer(i), cache.meta_of(i))
        else:
            o, pages = over_heads(core, cache.mesh, split, (1, 1, 1, 1, 1, 0, 0, 0, 0, 0), (), cache.layer(i),
                                  cache.meta_of(i))
        o = self.norm(o.astype(x.dtype), z)
        return self.out_proj(o.reshape(t, -1)), cache.with_layer(i, pages)


def _delta_net_core(q, k, v, b, a, w_q, w_k, w_v, A_log, dt_bias, pages: StatePages, meta, *, block_size: int,
                    backend: str, decode_only: bool) -> tuple[jax.Array, StatePages]:
    """The gated DeltaNet of the heads given (all, or one device's): the causal conv over their [q | k | v]
    channels with SiLU, beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), the gated delta rule; -> (o
    `[T, Hv, Dv]`, the pages with this step's snapshots written)."""
    t, hk, dk = q.shape
    mixed = jnp.concatenate([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], axis=-1)
    kernel = w_q.shape[-1]
    weight = jnp.concatenate([w.reshape(-1, kernel) for w in (w_q, w_k, w_v)])
    mixed, conv_pages = causal_conv1d(mixed, weight, pages.conv, meta, block_size=block_size, backend=backend,
                                      decode_only=decode_only, activation="silu")
    key_dim = hk * dk
    q = mixed[:, :key_dim].reshape(t, hk, dk)
    k = mixed[:, key_dim:2 * key_dim].reshape(t, hk, dk)
    v = mixed[:, 2 * key_dim:].reshape(v.shape)
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(A_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    o, state = gated_delta_rule(q, k, v, g, beta, pages.recurrent, meta, block_size=block_size, backend=backend,
                                decode_only=decode_only)
    return o, StatePages(state, conv_pages)


class GatedAttention(nnx.Module):
    """A "full_attention" layer (module docstring): q / k norms, partial RoPE, a sigmoid output gate per head."""

    def __init__(self, cfg: Qwen3NextConfig, layer_index: int, dtype, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = _linear(h, 2 * cfg.num_heads * d, dtype, rngs)
        self.k_proj = _linear(h, cfg.num_kv_heads * d, dtype, rngs)
        self.v_proj = _linear(h, cfg.num_kv_heads * d, dtype, rngs)
        self.o_proj = _linear(cfg.num_heads * d, h, dtype, rngs)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, offset=True)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, offset=True)
        self.rope = RoPE(cfg.rotary_dim, cfg.rope_theta)
        self.paged = PagedAttention(layer_index, num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                    head_dim=d)

    def _rotate(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        rot = self.rope.head_dim
        return jnp.concatenate([self.rope(x[..., :rot], positions), x[..., rot:]], axis=-1)

    def __call__(self, x: jax.Array, positions: jax.Array, cache: PagedKVCache) -> tuple[jax.Array, PagedKVCache]:
        t, d = x.shape[0], self.head_dim
        qg = self.q_proj(x).reshape(t, self.num_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(t, -1)
        q = self._rotate(self.q_norm(q), positions)
        k = self._rotate(self.k_norm(self.k_proj(x).reshape(t, self.num_kv_heads, d)), positions)
        v = self.v_proj(x).reshape(t, self.num_kv_heads, d)
        o, cache = self.paged(q, k, v, cache)
        return self.o_proj(o.reshape(t, -1) * jax.nn.sigmoid(gate)), cache


class SwiGLU(nnx.Module):
    def __init__(self, hidden: int, width: int, dtype, rngs: nnx.Rngs):
        self.gate_proj = _linear(hidden, width, dtype, rngs)
        self.up_proj = _linear(hidden, width, dtype, rngs)
        self.down_proj = _linear(width, hidden, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nnx.Module):
    """`Qwen3NextSparseMoeBlock`: routed experts plus the shared expert, gated by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg: Qwen3NextConfig, dtype, rngs: nnx.Rngs):
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = _linear(cfg.hidden_size, cfg.num_experts, dtype, rngs)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype, rngs)
        self.shared_expert = SwiGLU(cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype, rngs)
        self.shared_expert_gate = _linear(cfg.hidden_size, 1, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        # Router logits in the model's dtype, then a softmax in float32 over every expert (transformers').
        logits = self.gate(x).astype(jnp.float32)
        weights, experts = route(logits, self.top_k, "softmax_topk", self.norm_topk_prob)
        routed = combine_experts(self.experts, x, weights.astype(x.dtype).astype(jnp.float32), experts)
        return routed + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen3NextConfig, layer_index: int, dtype, rngs: nnx.Rngs):
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, offset=True)  # noqa: E731
        self.linear = cfg.layer_types[layer_index] == "linear_attention"
        self.input_layernorm = norm()
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, layer_index, dtype, rngs)
        else:
            self.self_attn = GatedAttention(cfg, layer_index, dtype, rngs)
        self.post_attention_layernorm = norm()
        self.mlp = (SparseMoE(cfg, dtype, rngs) if cfg.moe_layers[layer_index]
                    else SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype, rngs))

    def __call__(self, x, positions, cache: PagedKVCache) -> tuple[jax.Array, PagedKVCache]:
        h = self.input_layernorm(x)
        if self.linear:
            h, cache = self.linear_attn(h, cache)
        else:
            h, cache = self.self_attn(h, positions, cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class Qwen3Next(nnx.Module):
    """Qwen3-Next or Qwen3.5 (module docstring). Parameter names mirror transformers' `Qwen3NextForCausalLM` /
    `Qwen3_5(Moe)ForCausalLM` (minus `model.`); linear kernels are `[in, out]`."""

    def __init__(self, cfg: Qwen3NextConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.config = cfg
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, offset=True)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, dtype, rngs)

    @property
    def spec(self) -> ModelSpec:
        return self.config.spec

    def param_partition(self, names: tuple, tp: int) -> P | None:
        """Tensor parallelism over the linear layers' heads (`pagedjax.parallel.recurrent`): their input
        projections split by output columns (Qwen3-Next's interleaved `in_proj_qkvz` / `in_proj_ba` by key heads,
        Qwen3.5's by columns, the value heads' `in_proj_z` / `_b` / `_a` by value heads), `out_proj` by input rows,
        `A_log` / `dt_bias` by value heads; the conv's taps (`[conv_dim, 1, K]`, a few KiB, in [q | k | v] order:
        each device takes its heads' channels) and the gated norm's weight (one per value-head channel, shared by the
        heads) whole on every device. Everything else by the default rule (attention, MLPs, experts, vocabulary).
        ValueError unless tp divides the key heads (and so the value heads)."""
        if tp == 1 or "linear_attn" not in names:
            return None
        if self.config.linear_num_key_heads % tp:
            raise ValueError(f"tensor_parallel_size {tp} must divide 'linear_num_key_heads' "
                             f"({self.config.linear_num_key_heads}): the linear layers are split by key heads, each "
                             "with its value heads")
        module, leaf = str(names[-2]), str(names[-1])
        if module in ("in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
            return P(None, TP)
        if module == "out_proj":
            return P(TP, None)
        if leaf in ("A_log", "dt_bias"):
            return P(TP)
        return P()

    def single_device_params(self, state: nnx.State) -> nnx.State:
        """On one CPU device, every routed expert as its own array (`per_expert_params`: why); else `state`."""
        if not any(self.config.moe_layers) or jax.default_backend() != "cpu":
            return state
        return per_expert_params(state)

    def __call__(self, token_ids: jax.Array, positions: jax.Array,
                 cache: PagedKVCache) -> tuple[jax.Array, PagedKVCache]:
        """Serving forward: token_ids, positions int32 `[T]` -> (final hidden states `[T, hidden]`, cache)."""
        x = self.embed_tokens(token_ids)
        for layer in self.layers:
            x, cache = layer(x, positions, cache)
        return self.norm(x), cache

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        if self.lm_head is None:
            return apply_linear(self.embed_tokens.attend, hidden).astype(jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)

    def forward_dense(self, token_ids: jax.Array, block_size: int = 8) -> jax.Array:
        """Whole sequences token_ids `[B, S]` -> float32 logits `[B, S, vocab]` (`api.forward_on_fresh_pages`)."""
        return forward_on_fresh_pages(self, token_ids, block_size)


def init_qwen3_next(cfg: Qwen3NextConfig, seed: int = 0) -> Qwen3Next:
    return Qwen3Next(cfg, rngs=nnx.Rngs(seed))


def abstract_qwen3_next(cfg: Qwen3NextConfig) -> Qwen3Next:
    """The model's structure with `jax.ShapeDtypeStruct` leaves: nothing is allocated."""
    return nnx.eval_shape(lambda: init_qwen3_next(cfg))


def qwen3_next_from_state(cfg: Qwen3NextConfig, state: nnx.State) -> Qwen3Next:
    graphdef, _ = nnx.split(abstract_qwen3_next(cfg))
    return nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------------------------------- weights
def tensor_names(path: tuple, prefix: str = "model.") -> list[tuple[str, bool, None]] | None:
    """A parameter's checkpoint tensor where Qwen3-Next / Qwen3.5 name it other than the Llama family's rule
    (`hf_loader.hf_names`): `linear_attn.A_log` and `.dt_bias` as stored, under the decoder's `prefix`
    (`TEXT_PREFIX`); None for every other parameter."""
    *mods, leaf = (str(p) for p in path)
    if leaf in ("A_log", "dt_bias"):
        return [(prefix + ".".join(mods + [leaf]), False, None)]
    return None


def load_config(path: str | os.PathLike, dtype: str | None = None) -> Qwen3NextConfig:
    """Map a Qwen3-Next or Qwen3.5 Hugging Face folder's `config.json` (and `generation_config.json`'s stop tokens)
    to a `Qwen3NextConfig` (`config_from_hf`: what it maps and refuses); `dtype` overrides the checkpoint's.
    ModelLoadError naming the file and field."""
    return load_folder_config(path, lambda hf, bos, eos: config_from_hf(hf, dtype, bos, eos))


def load(path: str | os.PathLike, dtype: str | None = None):
    """(`Qwen3Next` holding the folder's weights, tokenizer or None) of a
    Qwen3-Next or Qwen3.5 Hugging Face folder (float weights, in the checkpoint's dtype or `dtype`): the built-in
    factory of `model_type` "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5" and "qwen3_5_moe"
    (`pagedjax.model.loading.loader.load_registered`). Tensors are named as transformers' `save_pretrained` writes
    them: the Llama family's rule (`hf_names`: kernels transposed, each expert's `mlp.experts.{e}.gate_proj.weight`
    ... into the stacked experts) and `tensor_names` (`A_log`, `dt_bias`), the decoder's under
    `TEXT_PREFIX` of the folder's model_type (`model.language_model.` in a Qwen3.5 conditional-generation
    checkpoint, whose vision tower `model.visual.*` is not read: text only); the multi-token-prediction tensors
    (`mtp.*`) are not read."""
    cfg = load_config(path, dtype)
    prefix = TEXT_PREFIX[read_json(Path(path) / "config.json").get("model_type", "qwen3_next")]

    def skip(name: str) -> bool:
        return name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings) or (
            name.startswith("mtp.")) or (prefix != "model." and name.startswith("model.visual."))

    def names(p, shape):
        found = tensor_names(p, prefix)
        if found is not None:
            return found
        return [(prefix + name.removeprefix("model.") if name.startswith("model.") else name, transpose, expert)
                for name, transpose, expert in hf_names(p, shape)]

    state = fill_state(path, lambda: nnx.split(abstract_qwen3_next(cfg))[1], names, skip=skip)
    return qwen3_next_from_state(cfg, state), folder_tokenizer(path, cfg.eos_token_ids, cfg.bos_token_id)
