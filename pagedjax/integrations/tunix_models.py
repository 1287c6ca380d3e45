"""Tunix's own model classes as pagedjax models, and a Tunix actor's LoRA as a pagedjax adapter: a Tunix actor
(`tunix.models.llama3.model.Llama3`, dense `tunix.models.qwen3.model.Qwen3`) read as the pagedjax `ModelConfig` and
parameters of the same network, so `PagedJaxRollout` serves a model Tunix trains with its own forward.

The arrays are the actor's: embeddings, norms and MLP kernels as they are, the attention projections reshaped
from Tunix's per-head einsum layout (`q_proj.w` [hidden, heads, head_dim], `o_proj.w` [heads, head_dim, hidden])
to pagedjax's matrices (a device op each time the trainer's arrays change: no host copy). Both are the Hugging
Face networks (rotate-half RoPE without scaling, RMSNorm times its weight, SwiGLU, scale head_dim ** -0.5;
Qwen3's per-head q / k norms) but for one thing: Tunix 0.1.7's attention calls its `apply_rope` without the
config's `rope_theta`, so RoPE runs at that function's default, 1e6, whatever the config says (Llama 3's 500000
included). The rollout must sample from the network the trainer computes, so `tunix_model_config` runs the actor
once on a probe of 8 tokens and takes the theta (the config's or 1e6) whose pagedjax forward matches it, with a
warning when that is not the config's. `tests/integrations/test_tunix.py` checks each family against Tunix's
forward. Nothing here imports Tunix: a model is recognised by its class's module and read by attribute names.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.config import ModelConfig
from pagedjax.model.llama import abstract_model, model_from_state

logger = logging.getLogger(__name__)
TUNIX_ROPE_DEFAULT = 1e6  # Tunix's apply_rope default, which its attention used whatever the config said (0.1.7)

FAMILIES = {"tunix.models.llama3.model": "llama", "tunix.models.qwen3.model": "qwen3"}
TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


def tunix_family(actor) -> str | None:
    """"llama" or "qwen3" for a Tunix model this module reads (qwix's LoRA subclasses it: its bases count), None
    for anything else."""
    return next((FAMILIES[c.__module__] for c in type(actor).__mro__ if c.__module__ in FAMILIES), None)


def lora_weights(actor) -> dict[tuple[int, str], tuple[jax.Array, jax.Array]]:
    """The actor's LoRA parameters (qwix's `<param>_lora_a` / `_lora_b`, `nnx.LoRAParam`) by (layer, target), as
    `LoRAAdapter.weights` takes them: A `[in, r]`, B `[r, out]` (Tunix's per-head shapes reshaped on the device);
    empty without LoRA. ValueError for a LoRA outside the decoder layers' seven linears (pagedjax's targets)."""
    pure = nnx.to_pure_dict(nnx.state(actor, nnx.LoRAParam))
    if not pure:
        return {}
    body = pure.get("model", pure)  # a TunixPolicy holds its pagedjax model under "model"
    outside = sorted(set(body) - {"layers"})
    if outside:
        raise ValueError(f"LoRA on {outside}: pagedjax serves LoRA on the decoder layers' q/k/v/o and MLP linears")
    out = {}
    for i, layer in body["layers"].items():
        for block in layer.values():
            for module, params in block.items():
                if module not in TARGETS:
                    raise ValueError(f"LoRA on layer {i} {module}: pagedjax's targets are {sorted(TARGETS)}")
                a = next(v for k, v in params.items() if k.endswith("_lora_a"))
                b = next(v for k, v in params.items() if k.endswith("_lora_b"))
                out[int(i), module] = (a.reshape(-1, a.shape[-1]), b.reshape(b.shape[0], -1))
    return out


def tunix_model_config(actor) -> ModelConfig:
    """The pagedjax `ModelConfig` of a Tunix Llama3 / Qwen3 actor. ValueError for a family or a variant (a
    mixture of experts) it does not read."""
    family = tunix_family(actor)
    if family is None:
        raise ValueError(f"{type(actor).__module__}.{type(actor).__name__} is not a Tunix model pagedjax reads "
                         f"(those of {sorted(FAMILIES)}); wrap a pagedjax model in TunixPolicy instead")
    c = actor.config
    if getattr(c, "num_experts", None):
        raise ValueError(f"a Tunix Qwen3 mixture of experts ({c.num_experts} experts) is not read; dense Qwen3 is")
    tied = c.weight_tying if family == "llama" else c.use_tied_embedding
    dtype = jnp.dtype(jax.tree.leaves(nnx.state(actor.embedder, nnx.Param))[0].dtype).name
    cfg = ModelConfig(architecture="llama", vocab_size=c.vocab_size,  # Qwen3: a Llama with per-head q / k norms
                      hidden_size=c.embed_dim, intermediate_size=c.hidden_dim, num_layers=c.num_layers,
                      num_q_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                      rope_theta=float(c.rope_theta), rms_norm_eps=float(c.norm_eps), tie_word_embeddings=tied,
                      qk_norm="head" if family == "qwen3" else None, dtype=dtype)
    return cfg if cfg.rope_theta == TUNIX_ROPE_DEFAULT else _rope_theta_it_computes(actor, cfg)


def _rope_theta_it_computes(actor, cfg: ModelConfig) -> ModelConfig:
    """`cfg` with the RoPE theta (its own or Tunix's default) whose pagedjax forward is the actor's on a probe of
    8 tokens (the other differs from the first position on; a LoRA actor's adapter, left out of the pagedjax
    forward here, adds about the same difference to both); a warning when it is not the config's."""
    tokens = jnp.arange(8, dtype=jnp.int32)[None] % cfg.vocab_size
    causal = jnp.tril(jnp.ones((8, 8), bool))[None]
    theirs = np.asarray(actor(tokens, jnp.arange(8)[None], None, causal)[0], np.float32)
    errors = {}
    for theta in (cfg.rope_theta, TUNIX_ROPE_DEFAULT):
        candidate = dataclasses.replace(cfg, rope_theta=theta)
        ours = model_from_state(candidate, tunix_model_params(actor, candidate)).forward_dense(tokens)
        errors[theta] = float(np.max(np.abs(np.asarray(ours) - theirs)))
    theta = min(errors, key=errors.get)
    if theta != cfg.rope_theta:
        logger.warning("the Tunix model's attention applies RoPE with theta %g, not its config's %g (Tunix's "
                       "apply_rope default; logits differ by %.1e with the config's): serving what it computes",
                       theta, cfg.rope_theta, errors[cfg.rope_theta])
    return dataclasses.replace(cfg, rope_theta=theta)


def tunix_model_params(actor, cfg: ModelConfig) -> nnx.State:
    """The actor's parameters as the pagedjax model of `cfg` (`tunix_model_config(actor)`) takes them."""
    src = nnx.to_pure_dict(nnx.state(actor, nnx.Param))  # LoRA parameters too, which the names below skip
    h, d = cfg.hidden_size, cfg.head_dim

    def layer(t: dict) -> dict:
        attn = t["attn"]
        out = {
            "input_layernorm": {"weight": t["input_layernorm"]["w"]},
            "post_attention_layernorm": {"weight": t["post_attention_layernorm"]["w"]},
            "self_attn": {
                "q_proj": {"kernel": attn["q_proj"]["w"].reshape(h, cfg.num_q_heads * d)},
                "k_proj": {"kernel": attn["k_proj"]["w"].reshape(h, cfg.num_kv_heads * d)},
                "v_proj": {"kernel": attn["v_proj"]["w"].reshape(h, cfg.num_kv_heads * d)},
                "o_proj": {"kernel": attn["o_proj"]["w"].reshape(cfg.num_q_heads * d, h)},
            },
            "mlp": {name: {"kernel": t["mlp"][name]["kernel"]} for name in ("gate_proj", "up_proj", "down_proj")},
        }
        if cfg.qk_norm == "head":
            out["self_attn"]["q_norm"] = {"weight": attn["q_norm"]["w"]}
            out["self_attn"]["k_norm"] = {"weight": attn["k_norm"]["w"]}
        return out

    pure = {"embed_tokens": {"embedding": src["embedder"]["input_embedding"]},
            "layers": {i: layer(t) for i, t in src["layers"].items()},
            "norm": {"weight": src["final_norm"]["w"]}}
    if not cfg.tie_word_embeddings:
        pure["lm_head"] = {"kernel": src["lm_head"]["w"]}
    state = nnx.state(abstract_model(cfg))
    nnx.replace_by_pure_dict(state, pure)
    return state
