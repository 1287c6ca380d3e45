"""The DeepSeek V2 / V3 / V3.2 decoder in Flax NNX (`pagedjax.config.deepseek.DeepSeekConfig`): multi-head
latent attention (MLA), YaRN RoPE over the rotary dims, dense SwiGLU MLPs in the first layers and mixtures of
shared and routed experts after them; in V3.2 (`DeepSeekConfig.indexer`) each layer's MLA is sparse, over the
positions its lightning indexer selects (DeepSeek Sparse Attention). A model of the public contract
(`pagedjax.model.api`).

MLA per layer and token: the query's heads come from `hidden` directly or through a normalized low-rank latent
(`q_lora_rank`); keys and values come from one compressed latent c_kv (`kv_lora_rank`, normalized) and one rotary
key k_rope (`qk_rope_head_dim`) shared by every head; `kv_b_proj` (W_UK | W_UV per head) lifts c_kv to each head's
key part (`qk_nope_head_dim`) and value (`v_head_dim`). Two forwards share the weights:
  `__call__`       the serving path, absorbed: the cache holds only [c_kv | k_rope] per token (the model's spec
                   declares `LatentAttention` layers). Each head's query part for c_kv is folded through W_UK into
                   latent space, q_latent[h] = q_nope[h] @ W_UK[h]^T, attention runs over the latent pages as
                   stored (`PagedLatentAttention`: score = scale * (q_latent . c_kv + q_rope . k_rope)) and returns
                   sum_t p_t c_kv[t] per head, which W_UV lifts to the head's value. q_nope . (W_UK c) equals
                   (W_UK^T q_nope) . c, so this is the same function as:
  `forward_dense`  the ground truth: whole sequences, K and V expanded per head as transformers does, causal
                   softmax, no cache; mixture-of-experts layers by their reference computation.

DeepSeek Sparse Attention (V3.2, `LightningIndexer`): per token an indexer key k_I (one `index_head_dim` vector,
cached beside the latent entry: `IndexedSparse` layers); per query indexer queries q_I from the query latent and
per-head weights w; query s scores each earlier token t as sum_h w[s, h] relu(q_I[s, h] . k_I[t] / sqrt(
index_head_dim)) and attends to its `index_topk` best only (all of t <= s while s < index_topk). `forward_dense`
computes every score, takes the top k and masks dense MLA to them (`MLAttention.dense_index_scores` gives the
scores, for checking that a test's data has no ties at the k-th); `__call__` hands the indexer's q_I, w and k_I
to `PagedSparseAttention`, which scores the paged keys, selects and attends over the selection.

Parameter names mirror transformers' `DeepseekV2ForCausalLM` / `DeepseekV3ForCausalLM` /
`DeepseekV32ForCausalLM` (minus `model.`); linear kernels are `[in, out]` (HF's weights transposed). The router
(`mlp.gate`) and the indexer's `weights_proj` are float32 whatever the model's dtype, as in transformers (it keeps
`gate.weight`, `e_score_correction_bias` and `indexer.weights_proj` in float32). `kv_b_proj` and the router
are not `nnx.Linear`s: `quantize_model` leaves them float (the absorbed path reads `kv_b_proj`'s kernel by head).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from pagedjax.config import ModelSpec
from pagedjax.config.deepseek import INDEXER_NORM_EPS, LATENT_NORM_EPS, DeepSeekConfig
from pagedjax.config.fields import is_int
from pagedjax.model.api import (
    TP,
    PagedKVCache,
    PagedLatentAttention,
    PagedSharedSparseAttention,
    PagedSparseAttention,
)
from pagedjax.model.errors import ModelLoadError, read_json
from pagedjax.model.families import model_types_of
from pagedjax.model.layers.linear import apply_linear
from pagedjax.model.layers.moe import Experts, combine_experts, per_expert_params, route
from pagedjax.model.layers.norm import LayerNorm
from pagedjax.model.layers.rope import RoPE
from pagedjax.model.llama import Linear, RMSNorm
from pagedjax.model.loading import hf_fp8
from pagedjax.model.loading.hf_fields import (
    checkpoint_dtype,
    flag,
    id_list,
    load_folder_config,
    number,
    optional_id,
    positive_int,
    rope_source,
    rope_theta_and_type,
)
from pagedjax.model.loading.hf_loader import IGNORED_SUFFIXES, fill_state, folder_tokenizer, hf_names


def _linear(n_in: int, n_out: int, dtype, rngs: nnx.Rngs) -> Linear:
    # 16-bit layers accumulate in float32 and round once (`pagedjax.model.llama.Linear`).
    acc = jnp.float32 if jnp.dtype(dtype).itemsize == 2 else None
    return Linear(n_in, n_out, use_bias=False, dtype=dtype, param_dtype=dtype, preferred_element_type=acc, rngs=rngs)


def _matmul(subscripts: str, a: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """An einsum accumulated in float32, rounded once to `dtype`."""
    return jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32).astype(dtype)


class LatentUpProjection(nnx.Module):
    """`kv_b_proj`: c_kv `[..., kv_lora_rank]` -> every head's key part and value, kernel `[kv_lora_rank,
    heads * (qk_nope_head_dim + v_head_dim)]` (per head: W_UK's columns, then W_UV's, as transformers lays them
    out). The absorbed path reads it by head (`key_weights`, `value_weights`)."""

    def __init__(self, rank: int, heads: int, nope_dim: int, v_dim: int, dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (rank, heads * (nope_dim + v_dim)),
                                                                dtype))
        self.heads, self.nope_dim, self.v_dim = heads, nope_dim, v_dim

    def _per_head(self) -> jax.Array:
        return self.kernel[...].reshape(self.kernel.shape[0], self.heads, self.nope_dim + self.v_dim)

    def key_weights(self) -> jax.Array:
        """W_UK `[rank, heads, qk_nope_head_dim]`."""
        return self._per_head()[..., :self.nope_dim]

    def value_weights(self) -> jax.Array:
        """W_UV `[rank, heads, v_head_dim]`."""
        return self._per_head()[..., self.nope_dim:]

    def __call__(self, c: jax.Array) -> tuple[jax.Array, jax.Array]:
        """c `[..., rank]` -> (keys' latent part `[..., heads, qk_nope_head_dim]`, values `[..., heads,
        v_head_dim]`), in c's dtype."""
        kernel = self.kernel[...]
        kv = apply_linear(lambda x: jnp.matmul(x, kernel, preferred_element_type=jnp.float32), c)
        kv = kv.reshape(*c.shape[:-1], self.heads, self.nope_dim + self.v_dim)
        return kv[..., :self.nope_dim], kv[..., self.nope_dim:]


class LightningIndexer(nnx.Module):
    """`self_attn.indexer`: DeepSeek V3.2's lightning indexer (`DeepSeekIndexerConfig`). Projects a layer's input
    to what scoring needs; `index_scores` is the dense definition of the scores."""

    def __init__(self, cfg: DeepSeekConfig, dtype, rngs: nnx.Rngs):
        ix = cfg.indexer
        self.heads, self.head_dim, self.rope_dim = ix.num_heads, ix.head_dim, cfg.qk_rope_head_dim
        self.topk, self.scale, self.weight_scale = ix.topk, ix.scale, ix.weight_scale
        self.wq_b = _linear(cfg.q_lora_rank, ix.num_heads * ix.head_dim, dtype, rngs)
        self.wk = _linear(cfg.hidden_size, ix.head_dim, dtype, rngs)
        self.k_norm = LayerNorm(ix.head_dim, INDEXER_NORM_EPS, dtype)
        self.weights_proj = _linear(cfg.hidden_size, ix.num_heads, jnp.float32, rngs)  # float32, as transformers
        scaling = None if cfg.rope_scaling is None else (("rope_type", "yarn"), *cfg.rope_scaling)
        # The model's rotation, in the halves layout whatever MLA's `rope_interleave` (transformers' V3.2 indexer)
        # or in interleaved pairs (GLM-5's): the indexer's own `rope_interleave`.
        self.rope = RoPE(cfg.qk_rope_head_dim, cfg.rope_theta, scaling, interleaved=ix.rope_interleave)

    def __call__(self, x: jax.Array, q_resid: jax.Array, positions: jax.Array):
        """x `[..., hidden]` (the layer's normalized input), q_resid `[..., q_lora_rank]` (MLA's normalized query
        latent) -> (queries `[..., heads, head_dim]`, head weights float32 `[..., heads]` (already times
        heads ** -0.5), key `[..., head_dim]`), queries and key rotated over their first qk_rope_head_dim dims."""
        dr = self.rope_dim
        q = self.wq_b(q_resid).reshape(*q_resid.shape[:-1], self.heads, self.head_dim)
        q = jnp.concatenate([self.rope(q[..., :dr], positions), q[..., dr:]], axis=-1)
        k = self.k_norm(self.wk(x))
        k = jnp.concatenate([self.rope(k[..., None, :dr], positions)[..., 0, :], k[..., dr:]], axis=-1)
        weights = self.weights_proj(x.astype(jnp.float32)) * self.weight_scale
        return q, weights, k

    def index_scores(self, q: jax.Array, weights: jax.Array, k: jax.Array) -> jax.Array:
        """The dense scores: q `[B, S, heads, head_dim]`, weights `[B, S, heads]`, k `[B, S, head_dim]` -> float32
        `[B, S, S]`, sum_h weights[s, h] relu(scale * q[s, h] . k[t]), -inf where t > s."""
        hi = jax.lax.Precision.HIGHEST  # the selection is discrete: no reduced-precision passes
        dots = jnp.einsum("bshd,btd->bsht", q.astype(jnp.float32), k.astype(jnp.float32), precision=hi)
        scores = jnp.einsum("bsh,bsht->bst", weights, jax.nn.relu(dots * self.scale), precision=hi)
        s = q.shape[1]
        return jnp.where(np.arange(s)[None, :] <= np.arange(s)[:, None], scores, -jnp.inf)


def top_k_mask(scores: jax.Array, k: int) -> jax.Array:
    """Causally masked scores `[..., S, S]` (-inf where t > s) -> bool `[..., S, S]`: each query's k best
    positions among t <= s (all of them while s < k). Ties at the k-th are broken towards the lower position
    (`jax.lax.top_k`); transformers' torch.topk leaves them unspecified, so parity needs tie-free scores."""
    s = scores.shape[-1]
    _, chosen = jax.lax.top_k(scores, min(k, s))
    selected = jnp.any(chosen[..., None] == jnp.arange(s), axis=-2)
    return selected & (np.arange(s)[None, :] <= np.arange(s)[:, None])


class MLAttention(nnx.Module):
    """One layer's multi-head latent attention (module docstring)."""

    def __init__(self, cfg: DeepSeekConfig, layer_index: int, dtype, rngs: nnx.Rngs):
        h, heads = cfg.hidden_size, cfg.num_heads
        self.heads, self.nope_dim, self.rope_dim = heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.rank, self.v_dim = cfg.kv_lora_rank, cfg.v_head_dim
        q_out = heads * cfg.qk_head_dim
        self.q_lora = cfg.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = _linear(h, cfg.q_lora_rank, dtype, rngs)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = _linear(cfg.q_lora_rank, q_out, dtype, rngs)
        else:
            self.q_proj = _linear(h, q_out, dtype, rngs)
        self.kv_a_proj_with_mqa = _linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype, rngs)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = LatentUpProjection(cfg.kv_lora_rank, heads, cfg.qk_nope_head_dim, cfg.v_head_dim, dtype,
                                            rngs)
        self.o_proj = _linear(heads * cfg.v_head_dim, h, dtype, rngs)
        scaling = None if cfg.rope_scaling is None else (("rope_type", "yarn"), *cfg.rope_scaling)
        self.rope = RoPE(cfg.qk_rope_head_dim, cfg.rope_theta, scaling, interleaved=cfg.rope_interleave)
        self.scale = cfg.softmax_scale
        # GLM-5's shared layers (`DeepSeekIndexerConfig.shared_layers`) attend over the previous indexed layer's
        # selection, with no indexer of their own.
        self.shared = cfg.indexer is not None and cfg.indexer.is_shared(layer_index)
        self.indexer = None if cfg.indexer is None or self.shared else LightningIndexer(cfg, dtype, rngs)
        latent = dict(num_heads=heads, kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim, scale=self.scale)
        if cfg.indexer is None:
            self.paged = PagedLatentAttention(layer_index, **latent)
        elif self.shared:
            self.paged = PagedSharedSparseAttention(layer_index, **latent)
        else:
            ix = cfg.indexer
            self.paged = PagedSparseAttention(layer_index, **latent, index_n_heads=ix.num_heads,
                                              index_head_dim=ix.head_dim, index_topk=ix.topk, index_scale=ix.scale)

    def _project(self, x: jax.Array, positions: jax.Array):
        """x `[..., hidden]` -> (q_nope `[..., H, nope]`, q_rope `[..., H, rope]` rotated, c_kv `[..., rank]`
        normalized, k_rope `[..., rope]` rotated, the normalized query latent `[..., q_lora_rank]` or None)."""
        q_resid = self.q_a_layernorm(self.q_a_proj(x)) if self.q_lora else None
        q = self.q_b_proj(q_resid) if self.q_lora else self.q_proj(x)
        q = q.reshape(*x.shape[:-1], self.heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q[..., :self.nope_dim], q[..., self.nope_dim:]
        ckv = self.kv_a_proj_with_mqa(x)
        c_kv, k_rope = self.kv_a_layernorm(ckv[..., :self.rank]), ckv[..., self.rank:]
        q_rope = self.rope(q_rope, positions)
        k_rope = self.rope(k_rope[..., None, :], positions)[..., 0, :]
        return q_nope, q_rope, c_kv, k_rope, q_resid

    def __call__(self, x: jax.Array, positions: jax.Array, cache: PagedKVCache,
                 selected: jax.Array | None = None) -> tuple[jax.Array, PagedKVCache, jax.Array | None]:
        """x `[T, hidden]` -> (`[T, hidden]`, the cache with this layer's latent entries (and indexer keys)
        written, the selection the next layers share): absorbed MLA, over the indexer's selection when there is
        one, or over `selected` (the previous indexed layer's, int32 `[T, index_topk]`) in a shared layer."""
        q_nope, q_rope, c_kv, k_rope, q_resid = self._project(x, positions)
        q_latent = _matmul("thd,rhd->thr", q_nope, self.kv_b_proj.key_weights(), x.dtype)
        if self.shared:
            o_latent, cache = self.paged(q_latent, q_rope, c_kv, k_rope, selected, cache)
        elif self.indexer is None:
            o_latent, cache = self.paged(q_latent, q_rope, c_kv, k_rope, cache)
        else:  # the indexer's queries, head weights and key; the layer scores, selects and attends
            o_latent, cache, selected = self.paged(q_latent, q_rope, c_kv, k_rope, *self.indexer(x, q_resid, positions),
                                                   cache, return_selection=True)
        o = _matmul("thr,rhv->thv", o_latent, self.kv_b_proj.value_weights(), x.dtype)
        return self.o_proj(o.reshape(x.shape[0], -1)), cache, selected

    def dense_index_scores(self, x: jax.Array) -> jax.Array:
        """The indexer's dense scores of x `[B, S, hidden]` (the layer's normalized input): float32 `[B, S, S]`,
        -inf where t > s (`LightningIndexer.index_scores`). Only for a layer with an indexer."""
        b, s, _ = x.shape
        positions = jnp.broadcast_to(jnp.arange(s), (b, s))
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        return self.indexer.index_scores(*self.indexer(x, q_resid, positions))

    def dense(self, x: jax.Array, visible: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
        """Causal attention over whole sequences with K / V expanded per head, no cache; with an indexer, each
        query attends to its top `index_topk` positions only (a shared layer: to the previous indexed layer's,
        `visible` bool `[B, 1, S, S]`). x `[B, S, hidden]` -> (`[B, S, hidden]`, the mask the next layers share)."""
        b, s, _ = x.shape
        positions = jnp.broadcast_to(jnp.arange(s), (b, s))
        q_nope, q_rope, c_kv, k_rope, _ = self._project(x, positions)
        k_nope, v = self.kv_b_proj(c_kv)
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
        scores = (jnp.einsum("bqhd,bkhd->bhqk", f32(q_nope), f32(k_nope))
                  + jnp.einsum("bqhd,bkd->bhqk", f32(q_rope), f32(k_rope))) * self.scale
        if self.indexer is not None:
            visible = top_k_mask(self.dense_index_scores(x), self.indexer.topk)[:, None]  # [B, 1, S, S]
        mask = visible if self.indexer is not None or self.shared else np.arange(s)[None, :] <= np.arange(s)[:, None]
        probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        o = jnp.einsum("bhqk,bkhv->bqhv", probs, f32(v)).astype(x.dtype)
        return self.o_proj(o.reshape(b, s, -1)), visible


class SwiGLU(nnx.Module):
    """A dense MLP: down_proj(silu(gate_proj(x)) * up_proj(x)) (the first layers' MLP, and the shared experts)."""

    def __init__(self, hidden: int, width: int, dtype, rngs: nnx.Rngs):
        self.gate_proj = _linear(hidden, width, dtype, rngs)
        self.up_proj = _linear(hidden, width, dtype, rngs)
        self.down_proj = _linear(width, hidden, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nnx.Module):
    """`mlp.gate`: router logits `[N, E]` = x @ kernel in float32 (the kernel float32 whatever the model's dtype:
    transformers computes them so), and for "noaux_tc" the float32 `e_score_correction_bias` `[E]` added to the
    scores when choosing experts (not when weighting them)."""

    def __init__(self, hidden: int, num_experts: int, correction_bias: bool, rngs: nnx.Rngs):
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (hidden, num_experts), jnp.float32))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((num_experts,), jnp.float32)) if correction_bias else None

    def __call__(self, rows: jax.Array) -> jax.Array:
        return jnp.matmul(rows.astype(jnp.float32), self.kernel[...], precision=jax.lax.Precision.HIGHEST)

    def bias(self) -> jax.Array | None:
        return None if self.e_score_correction_bias is None else self.e_score_correction_bias[...]


class DeepSeekMoE(nnx.Module):
    """A mixture-of-experts MLP (`DeepSeekConfig.moe`): routed experts (`Experts`, through the shared
    computations of `pagedjax.model.layers.moe.combine_experts`) plus the shared experts every token takes."""

    def __init__(self, cfg: DeepSeekConfig, dtype, rngs: nnx.Rngs):
        moe = cfg.moe
        self.moe = moe
        self.gate = Router(cfg.hidden_size, moe.num_experts, moe.router == "noaux_tc", rngs)
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, dtype, rngs)
        self.shared_experts = (SwiGLU(cfg.hidden_size, moe.intermediate_size * moe.num_shared_experts, dtype, rngs)
                               if moe.num_shared_experts else None)

    def routing(self, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Rows `[N, hidden]` -> (weights float32 `[N, k]`, experts int32 `[N, k]`)."""
        m = self.moe
        return route(self.gate(rows), m.num_experts_per_tok, m.router, m.norm_topk_prob, num_groups=m.num_groups,
                     topk_groups=m.topk_groups, correction_bias=self.gate.bias(),
                     scaling_factor=m.routed_scaling_factor)

    def __call__(self, x: jax.Array, method: str | None = None) -> jax.Array:
        """x `[..., hidden]` -> `[..., hidden]`; `method`: `combine_experts`' (None: the backend's; "every": the
        reference)."""
        weights, experts = self.routing(x.reshape(-1, x.shape[-1]))
        y = combine_experts(self.experts, x, weights, experts, method)
        return y if self.shared_experts is None else y + self.shared_experts(x)

    def dense(self, x: jax.Array) -> jax.Array:
        return self(x, "every")


class DecoderLayer(nnx.Module):
    """x += attn(input_layernorm(x)); x += mlp(post_attention_layernorm(x))."""

    def __init__(self, cfg: DeepSeekConfig, layer_index: int, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = MLAttention(cfg, layer_index, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.moe = cfg.moe is not None and cfg.moe.is_moe_layer(layer_index)
        self.mlp = DeepSeekMoE(cfg, dtype, rngs) if self.moe else SwiGLU(cfg.hidden_size, cfg.intermediate_size,
                                                                         dtype, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, cache: PagedKVCache, selected: jax.Array | None = None
                 ) -> tuple[jax.Array, PagedKVCache, jax.Array | None]:
        """(x, cache, the sparse selection the next layers share: `MLAttention.__call__`)."""
        h, cache, selected = self.self_attn(self.input_layernorm(x), positions, cache, selected)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache, selected

    def dense(self, x: jax.Array, visible: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
        h, visible = self.self_attn.dense(self.input_layernorm(x), visible)
        x = x + h
        h = self.post_attention_layernorm(x)
        return x + (self.mlp.dense(h) if self.moe else self.mlp(h)), visible


class DeepSeek(nnx.Module):
    """DeepSeek V2 / V3 / V3.2 (module docstring): `spec` declares one `LatentAttention` KV layer per decoder
    layer, or with an indexer one `IndexedSparse` layer."""

    def __init__(self, cfg: DeepSeekConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.config = cfg
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, dtype, rngs)

    @property
    def spec(self) -> ModelSpec:
        return self.config.spec

    def param_partition(self, names: tuple, tp: int) -> P | None:
        """Tensor parallelism over heads: the query projection (`q_proj` / `q_b_proj`) and `kv_b_proj` split by
        their output columns, whole heads each ([.., heads * per_head] is head-major), `o_proj` by its input rows,
        so a device computes its heads' queries, latent up-projections and output share (all-reduced by XLA);
        the latent projections (`kv_a_proj_with_mqa`, `q_a_proj`) stay whole, as the latent pages do (every head
        reads them), and so does V3.2's indexer (the default rule replicates its `wq_b` / `wk` / `weights_proj`:
        every device scores every position alike and selects the same ones). 8-bit leaves of these modules stay
        replicated; the MLPs and experts take the default rule."""
        module, leaf = str(names[-2]), str(names[-1])
        if module in ("q_proj", "q_b_proj", "kv_b_proj", "o_proj"):
            if leaf != "kernel" or self.config.num_heads % tp:
                return P()
            return P(TP, None) if module == "o_proj" else P(None, TP)
        return None

    def single_device_params(self, state: nnx.State) -> nnx.State:
        """On one CPU device, every routed expert as its own array (`per_expert_params`: why); else `state`."""
        if self.config.moe is None or jax.default_backend() != "cpu":
            return state
        return per_expert_params(state)

    def __call__(self, token_ids: jax.Array, positions: jax.Array,
                 cache: PagedKVCache) -> tuple[jax.Array, PagedKVCache]:
        """Serving forward. token_ids, positions int32 `[T]` -> (final hidden states `[T, hidden]`, cache)."""
        x, selected = self.embed_tokens(token_ids), None
        for layer in self.layers:
            x, cache, selected = layer(x, positions, cache, selected)
        return self.norm(x), cache

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """`[..., hidden]` -> float32 logits `[..., vocab]`."""
        if self.lm_head is None:
            return apply_linear(self.embed_tokens.attend, hidden).astype(jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)

    def forward_dense(self, token_ids: jax.Array) -> jax.Array:
        """Ground truth: token_ids `[B, S]` -> float32 logits `[B, S, vocab]`, causal, no cache, K / V expanded per
        head (with an indexer: every score computed, attention masked to each query's top k), mixture-of-experts
        layers by every expert on every token."""
        x, visible = self.embed_tokens(token_ids), None
        for layer in self.layers:
            x, visible = layer.dense(x, visible)
        return self.compute_logits(self.norm(x))


def init_deepseek(cfg: DeepSeekConfig, seed: int = 0) -> DeepSeek:
    """A randomly initialised model (deterministic in `seed`)."""
    return DeepSeek(cfg, rngs=nnx.Rngs(seed))


def abstract_deepseek(cfg: DeepSeekConfig) -> DeepSeek:
    """The model's structure with `jax.ShapeDtypeStruct` leaves: nothing is allocated."""
    return nnx.eval_shape(lambda: init_deepseek(cfg))


def deepseek_from_state(cfg: DeepSeekConfig, state: nnx.State) -> DeepSeek:
    """A `DeepSeek` holding `state` (e.g. loaded weights) without first initialising random weights."""
    graphdef, _ = nnx.split(abstract_deepseek(cfg))
    return nnx.merge(graphdef, state)



# The Hugging Face config mapping: `config.json` -> DeepSeekConfig.

MODEL_TYPES = model_types_of(__name__)

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


def load_config(path: str | os.PathLike, dtype: str | None = None):
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
    if model_type not in MODEL_TYPES:
        raise ValueError(f"field 'model_type' = {model_type!r} is not a DeepSeek one "
                         f"({', '.join(MODEL_TYPES)})")
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
    theta, kind = rope_theta_and_type(hf, params, field, number(hf, "rope_theta", default_theta))
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


# The weights.

def _deepseek_names(path: tuple, shape: tuple) -> list[tuple[str, bool, int | None]]:
    """A `DeepSeek` parameter -> its checkpoint tensors: the Llama family's names
    (`hf_names`: transformers' module paths, kernels transposed, experts one tensor each), and the router's
    `e_score_correction_bias` as it is."""
    *mods, leaf = (str(p) for p in path)
    if leaf == "e_score_correction_bias":
        return [("model." + ".".join(mods + [leaf]), False, None)]
    return hf_names(path, shape)


def load_params(path: str | os.PathLike, cfg, *, mtp_layers: int = 0,
                         fp8_block: tuple[int, int] | None = None) -> nnx.State:
    """Weights of a DeepSeek V2 / V3 / V3.2 Hugging Face folder as the parameters of `DeepSeek(cfg)` (a
    `pagedjax.config.deepseek.DeepSeekConfig`), streamed as `fill_state` does (`fp8_block`: the block size of
    an FP8 checkpoint's scales, `hf_fp8`). The `mtp_layers` multi-token-prediction layers after the last decoder
    layer (`num_nextn_predict_layers`: tensors `model.layers.{L + i}.*`) are not read. ModelLoadError naming
    missing, unexpected or mis-shaped tensors."""
    mtp = tuple(f"model.layers.{cfg.num_layers + i}." for i in range(mtp_layers))

    def skip(name: str) -> bool:
        return name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings) or (
            bool(mtp) and name.startswith(mtp))

    return fill_state(path, lambda: nnx.split(abstract_deepseek(cfg))[1], _deepseek_names, skip=skip,
                      fp8_block=fp8_block)


def load(path: str | os.PathLike, dtype: str | None = None):
    """(`DeepSeek` holding the folder's weights, tokenizer or None) of a DeepSeek V2 / V3 /
    V3.2 Hugging Face folder (float, or the official block-scaled FP8 weights dequantized to the model's dtype: the
    checkpoint's `torch_dtype`, or `dtype`): the built-in factory of `model_type` "deepseek_v2" / "deepseek_v3" /
    "deepseek_v32"
    (`pagedjax.model.loading.loader.load_registered`; the `ModelRegistry` factory contract)."""
    cfg = load_config(path, dtype)  # the quantization_config checked too
    config_path = Path(path) / "config.json"
    hf = read_json(config_path)
    mtp = hf.get("num_nextn_predict_layers") or 0
    if not (isinstance(mtp, int) and not isinstance(mtp, bool) and mtp >= 0):
        raise ModelLoadError(config_path, f"field 'num_nextn_predict_layers': expected an int >= 0, got {mtp!r}")
    qc = hf.get("quantization_config")
    state = load_params(path, cfg, mtp_layers=mtp, fp8_block=None if qc is None else hf_fp8.block_size(qc))
    return deepseek_from_state(cfg, state), folder_tokenizer(path, cfg.eos_token_ids, cfg.bos_token_id)


__all__ = ["DeepSeek", "abstract_deepseek", "deepseek_from_state", "init_deepseek", "load", "load_config",
           "load_params"]
